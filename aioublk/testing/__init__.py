"""Test tooling for aioublk and for servers built on it.

`guest` boots a real ublk kernel under QEMU (virtme-ng) on machines without
`/dev/ublk-control`, `pytest_plugin` (which pytest loads through aioublk's
entry point) runs `@pytest.mark.guest` tests there, and `sid` fetches the
kernel it boots by default. The project's own tooling (kublk, Ceph, the demo)
lives in the repository's `tools/`, outside the wheel.
"""
