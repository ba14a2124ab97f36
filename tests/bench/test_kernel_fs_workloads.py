"""ext4 and XFS on aioublk's loop and qcow2 devices under stress-ng's verifying
hdd stressor, the server killed (-9) and recovered in the middle: the short
pass of ``python -m bench.suites fs --quick``, run here directly.

Every workload passes its own verification, fsck finds the file system clean
after umount, and ``qemu-img check`` finds no corruption (leaked clusters, which
a kill may leave, are not corruption)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.suites import fs

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]


def test_file_systems_survive_kill_and_recover(tmp_path: Path) -> None:
    data = fs.suite(None, None, quick=True, seconds=fs.QUICK_SECONDS,
                    devices=list(fs.QUICK_DEVICES), filesystems=list(fs.FILESYSTEMS),
                    out=tmp_path / "fs.json")
    assert data["complete"]
    runs, checks = data["runs"], data["checks"]
    assert {(c["device"], c["fs"]) for c in checks} == {
        (d, f) for d in fs.QUICK_DEVICES for f in fs.FILESYSTEMS}
    failed = [r for r in runs if r["result"] != "pass"]
    assert not failed, failed
    assert len(runs) == len(checks) * len(fs.QUICK_WORKLOADS)
    for c in checks:
        assert c["error"] is None, c
        assert c["kills"] >= 1, c
        assert c["fsck"] == "clean", c
        if c["device"] == "qcow2":
            assert c["check"] is not None and not c["check"].startswith("corrupt"), c
    assert all(r["kills"] == 1 and r["kill_during"] for r in runs), runs
