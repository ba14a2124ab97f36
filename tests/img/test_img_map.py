"""``aioublk img map`` against ``qemu-img map`` on the same images (host
only): the same JSON byte for byte, the same table, through backing chains
of qcow2 and raw files."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.img.test_img_check import IMAGES
from tests.support.qcow2_util import M, create, qemu_img, qemu_io


def ours(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aioublk", "img", "map", *map(str, args)],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def img_zeros(d: Path) -> Path:
    """Zero clusters, plain and allocated (a write of zeros kept allocated)."""
    p = create(d / "zeros.qcow2", 32 * M)
    qemu_io(p, "write -P 1 0 2M", "write -z 64k 128k", "write -z -u 1M 64k",
            "write -z 8M 1M", "write -P 2 20M 4k")
    return p


def img_three_deep(d: Path) -> Path:
    raw = d / "base.raw"
    raw.write_bytes(b"\x11" * (3 * M))  # shorter than the disk above it
    mid = create(d / "mid.qcow2", 16 * M, backing=raw.name, backing_fmt="raw")
    qemu_io(mid, "write -P 2 1M 512k", "write -z 2M 64k")
    top = create(d / "top.qcow2", 16 * M, backing=mid.name)
    qemu_io(top, "write -P 3 1100k 64k", "write -P 4 10M 64k")
    return top


def img_preallocated(d: Path) -> Path:
    """Metadata preallocated: clusters allocated over holes of the file."""
    p = d / "prealloc.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-o", "preallocation=metadata", p, "8M")
    qemu_io(p, "write -P 1 64k 64k", "write -P 2 5M 4k")
    return p


def img_sparse_raw(d: Path) -> Path:
    raw = d / "sparse.raw"
    with open(raw, "wb") as f:
        f.truncate(8 * M)
        f.seek(2 * M)
        f.write(b"\x33" * (512 * 1024))
    top = create(d / "over-sparse.qcow2", 8 * M, backing=raw.name, backing_fmt="raw")
    qemu_io(top, "write -P 4 0 64k")
    return top


MORE: dict[str, Callable[[Path], Path]] = {"zeros": img_zeros, "three-deep": img_three_deep,
                                           "preallocated": img_preallocated,
                                           "sparse-raw": img_sparse_raw}


@pytest.mark.parametrize("name", [*IMAGES, *MORE])
def test_map_matches_qemu_img(name: str, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = {**IMAGES, **MORE}[name](tmp_path)
    for shown in (path, path.name):
        if shown == path.name:
            monkeypatch.chdir(tmp_path)
        a, q = ours("--output", "json", shown), qemu_img("map", "--output", "json", shown)
        assert (a.returncode, a.stdout) == (0, q.stdout), a.stderr
        a = ours(shown)
        q = subprocess.run(["qemu-img", "map", str(shown)], capture_output=True, text=True)
        assert a.returncode == q.returncode and a.stdout == q.stdout, (a.stderr, q.stderr)
        if q.returncode:  # compressed clusters have no offset to show: one line, as theirs
            assert a.stderr.count("\n") == 1 and "compressed" in a.stderr
