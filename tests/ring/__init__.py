"""The io_uring shim and its typed stub."""
