"""A custom target tried from the command line: ``add -t pkg.module:Class
--opt KEY=VALUE`` serves examples/ramdisk.py's RamDisk as a block device."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.kernel import CLI, cli, fio, parse_list

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def test_add_a_custom_target_with_opt(tmp_path: Path) -> None:
    """The module imports from the repository (PYTHONPATH, as a user's own
    package would), its size comes typed from --opt, fio verifies every
    block, and ``del`` removes the device."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    p = subprocess.run([*CLI, "add", "-t", "examples.ramdisk:RamDisk", "--opt",
                        f"size={64 * MiB}", "-q", "2"], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr
    (dev,) = parse_list(p.stdout)
    job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randwrite", "--bs=8k",
              "--iodepth=32", "--size=32M", "--verify=crc32c", "--verify_fatal=1",
              "--do_verify=1")
    assert job["write"]["io_bytes"] == 32 * MiB  # type: ignore[index]
    cli("del", "-n", str(dev.dev_id))
    assert not Path(f"/dev/ublkb{dev.dev_id}").exists()
