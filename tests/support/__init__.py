"""What the host and guest tests share: the kernel-test helpers
(``kernel``), qcow2 image helpers (``qcow2_util``) and the crash
child process (``qcow2_crasher``). Fixtures live in tests/conftest.py."""
