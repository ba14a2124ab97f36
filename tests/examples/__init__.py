"""The examples, and aioublk embedded in an asyncio application."""
