"""The nbd target: against real and hostile NBD servers, and the driver."""
