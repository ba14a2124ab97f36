"""kill -9 of a process writing through the engine, at random moments: the
image may leak clusters (qemu-img check exit 3) but is never corrupt
(exit 2), and what was flushed before the kill reads back intact."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aioublk.io import locking
from tests.support.qcow2_crasher import pattern, write_through_ops

MiB = 1 << 20
RUNS = 20


@pytest.mark.parametrize("opts", ["cluster_size=65536", "cluster_size=4096,refcount_bits=1",
                                  "cluster_size=512,refcount_bits=64"])
def test_kill_during_random_writes(tmp_path: Path, opts: str) -> None:
    rnd = random.Random(opts)
    leaks = 0
    for run in range(RUNS):
        img = tmp_path / f"crash{run}.qcow2"
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", opts, str(img),
                        "64M"], check=True)
        flushed = 2 * MiB
        child = subprocess.Popen([sys.executable, "-m", "tests.support.qcow2_crasher", str(img),
                                  str(run), str(flushed)], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line == "FLUSHED\n", f"run {run}: crasher said {line!r}"
        time.sleep(rnd.uniform(0.05, 0.6))
        child.kill()
        child.wait()
        locking.wait_released(str(img))  # the dead ring's last I/O is done
        check = subprocess.run(["qemu-img", "check", str(img)], capture_output=True, text=True)
        assert check.returncode in (0, 3), \
            f"run {run}: qemu-img check exit {check.returncode}:\n{check.stdout}{check.stderr}"
        leaks += check.returncode == 3
        raw = tmp_path / "flushed.raw"
        subprocess.run(["qemu-img", "convert", "-O", "raw", str(img), str(raw)], check=True)
        with open(raw, "rb") as f:
            got = f.read(flushed)
        assert got == pattern(flushed, run), f"run {run}: flushed data changed"
        img.unlink()
    print(f"\nkill test ({opts}): {RUNS} runs, {leaks} with leaks, 0 corruptions")


@pytest.mark.parametrize("opts", ["cluster_size=65536", "cluster_size=4096,refcount_bits=1"])
def test_kill_after_completed_writes_with_metadata_write_through(tmp_path: Path,
                                                                 opts: str) -> None:
    """With ``metadata_write_through`` (what ublk user recovery needs) a
    completed allocating write, write_zeroes or discard is in the image file
    when it returns: after kill -9, without any flush, a new process sees
    it (the page cache outlives the process) and the image is clean."""
    for seed in (1, 2):
        img = tmp_path / f"wt{seed}.qcow2"
        base = tmp_path / f"base{seed}.raw"
        with open(base, "wb") as f:
            f.write(pattern(16 * MiB, seed + 100))
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", opts, "-b",
                        str(base), "-F", "raw", str(img), "16M"], check=True)
        child = subprocess.Popen([sys.executable, "-m", "tests.support.qcow2_crasher",
                                  "--write-through", str(img), str(seed)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        line = child.stdout.readline()
        child.kill()
        child.wait()
        assert line == "DONE\n", f"seed {seed}: crasher said {line!r}"
        locking.wait_released(str(img))  # the dead ring's last I/O is done
        check = subprocess.run(["qemu-img", "check", str(img)], capture_output=True, text=True)
        assert check.returncode == 0, \
            f"seed {seed}: qemu-img check exit {check.returncode}:\n{check.stdout}{check.stderr}"
        want = bytearray(pattern(16 * MiB, seed + 100))
        for _kind, off, data in write_through_ops(16 * MiB, seed):
            want[off:off + len(data)] = data
        raw = tmp_path / "got.raw"
        subprocess.run(["qemu-img", "convert", "-O", "raw", str(img), str(raw)], check=True)
        got = raw.read_bytes()
        bad = [off for _k, off, data in write_through_ops(16 * MiB, seed)
               if got[off:off + len(data)] != data]
        assert not bad, f"seed {seed}: {len(bad)} completed requests lost after kill -9, " \
            f"first at {bad[0]:#x}"
        assert got == want, f"seed {seed}: image differs from what was written"
