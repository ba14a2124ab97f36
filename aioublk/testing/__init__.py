"""Test tooling for aioublk and for servers built on it.

`guest` boots a real ublk kernel under QEMU (virtme-ng) on machines without
`/dev/ublk-control`, `pytest_plugin` (which pytest loads through aioublk's
entry point) runs `@pytest.mark.guest` tests there, and `kublk` builds the
kernel's C reference server as a benchmark peer.
"""
