"""What ublk_drv speaks: the uapi encoding and /dev/ublk-control's guards."""
