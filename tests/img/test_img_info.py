"""``aioublk img info`` and ``img snapshot -l`` against qemu-img's on the
same images (host only): the very same human lines, and the same JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.img.test_img_check import IMAGES
from tests.support.qcow2_util import M, create, held_by_qemu_io, qemu_img, qemu_io


def ours(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aioublk", "img", *map(str, args)],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def img_lazy_zstd(d: Path) -> Path:
    p = create(d / "lz.qcow2", 1 << 30, cluster_size=4096, compression_type="zstd",
               lazy_refcounts=True)
    qemu_io(p, "write -P 1 0 64k")
    return p


def img_long_names(d: Path) -> Path:
    """Snapshot names longer than their column."""
    p = create(d / "names.qcow2", 16 * M)
    qemu_io(p, "write -P 1 0 1M")
    for name in ("first", "a-much-longer-snapshot-name"):
        qemu_img("snapshot", "-c", name, p)
    return p


MORE: dict[str, Callable[[Path], Path]] = {"lazy-zstd": img_lazy_zstd,
                                           "long-names": img_long_names}


@pytest.mark.parametrize("name", [*IMAGES, *MORE])
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_info_matches_qemu_img(name: str, where: str, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = {**IMAGES, **MORE}[name](tmp_path)
    shown: Path | str = path
    if where == "relative":
        monkeypatch.chdir(tmp_path)
        shown = path.name
    for args in ([], ["--output", "json"]):
        a, q = ours("info", *args, shown), qemu_img("info", *args, shown)
        assert a.returncode == 0, a.stderr
        if args:
            assert json.loads(a.stdout) == json.loads(q.stdout)
        else:
            assert a.stdout == q.stdout
    a, q = ours("snapshot", "-l", shown), qemu_img("snapshot", "-l", shown)
    assert (a.returncode, a.stdout) == (0, q.stdout)


def test_info_of_an_image_in_use_needs_u(tmp_path: Path) -> None:
    p = IMAGES["data"](tmp_path)
    with held_by_qemu_io(p):
        got = ours("info", p)
        assert got.returncode == 1 and got.stderr.count("\n") == 1, got.stderr
        assert ours("info", "-U", p).returncode == 0
