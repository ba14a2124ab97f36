"""``aioublk img`` against qemu-img, and snapshots of a served image."""
