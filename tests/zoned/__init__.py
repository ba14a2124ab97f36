"""The zoned target: its zone state machine, and zoned devices."""
