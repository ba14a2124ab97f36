"""The test harness itself: the guest plugin, skips under CI."""
