"""Guest tests (``@pytest.mark.guest``): they need ublk_drv, so on a host
without it aioublk's pytest plugin runs them in one QEMU guest boot."""
