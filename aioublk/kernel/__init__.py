"""What ublk_drv speaks: the uapi (commands, flags, structs) and the control
device. Imports nothing above it; everything else in aioublk may use it."""
