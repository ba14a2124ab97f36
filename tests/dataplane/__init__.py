"""The C data plane: host tests play the kernel, guest tests use the driver."""
