"""A device's options and lifecycle: recovery, quiesce, integrity, kublk's flags."""
