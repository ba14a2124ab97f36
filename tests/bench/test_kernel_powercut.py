"""ext4 and XFS on an aioublk loop device under dm-log-writes, the log replayed
to flush points: each replayed state fsck-clean, every fsynced file intact
(the quick run of ``python -m bench.suites powercut``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from aioublk.targets import LoopTarget
from bench.suites import powercut
from tests.support.kernel import served

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]


@contextlib.contextmanager
def serve(kind: str, image: Path) -> Iterator[str]:
    """A device served by this process: no CLI start-up in the emulated guest."""
    assert kind == "loop", kind
    with served(LoopTarget(str(image))) as dev:
        yield dev.path


def test_fsynced_data_survives_a_power_cut_at_each_flush(tmp_path: Path) -> None:
    cases = powercut.quick(serve, tmp_path)  # no dm-log-writes: an error, not a skip
    assert [c["fs"] for c in cases] == ["ext4", "xfs"]
    for c in cases:
        where = f"{c['kind']} {c['fs']}"
        assert c["error"] is None, f"{where}: {c['error']}"
        assert c["logging"] == "on", where
        assert c["durable_files"] == powercut.QUICK_FILES, where
        checks = c["checks"]
        assert len(checks) == min(powercut.QUICK_POINTS, c["durable_points"]) > 1, where
        for check in checks:
            at = f"{where} entry {check['entry']}"
            assert check["error"] is None, f"{at}: {check['error']}"
            assert check["fsck"] == "clean", f"{at}: {check['fsck']}"
            assert check["bad"] == [], at
            assert check["verified"] == check["expected"], at
        # the last point follows umount's flush: every file made durable is checked there
        assert checks[-1]["expected"] == powercut.QUICK_FILES, where
        assert c["identical"] is True, f"{where}: {c['identical']}"
        assert c["failures"] == [] and c["result"] == "pass", where
