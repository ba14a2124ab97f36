"""``list``/``del -a`` seeing every device id (host, no kernel)."""

from __future__ import annotations

from pathlib import Path

from aioublk.kublk_lines import device_ids


def test_device_ids_from_sysfs_else_dev(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys/class/ublk-char"
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("ublkc3", "ublkb3", "ublk-control", "ublkc12"):
        (dev / name).touch()
    assert device_ids(tmp_path) == [3, 12]  # no sysfs: /dev
    sysfs.mkdir(parents=True)
    for name in ("ublkc10", "ublkc2", "ublkc1000", "ublkcx", "other"):
        (sysfs / name).touch()
    assert device_ids(tmp_path) == [2, 10, 1000]  # numeric order, sysfs first
    assert device_ids(tmp_path / "nothing") == []
