"""``aioublk serve`` and its config file."""
