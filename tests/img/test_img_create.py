"""``aioublk img create`` beside ``qemu-img create`` (host only): the same
``Formatting`` line, the same ``qemu-img info``, the same length of file,
``qemu-img check`` clean and ``qemu-img compare`` equal, for every option
it takes; bad options are one line each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.qcow2_util import held_by_qemu_io, qemu_img, qemu_io

CASES: dict[str, tuple[list[str], str]] = {
    "plain": ([], "64M"),
    "decimal-size": ([], "1.5G"),
    "small-clusters-lazy-zstd": (["-o", "cluster_size=4096,lazy_refcounts=on,"
                                  "compression_type=zstd"], "16M"),
    "v2": (["-o", "compat=0.10"], "1G"),
    "metadata": (["-o", "preallocation=metadata", "-o", "cluster_size=4096"], "16M"),
    "falloc": (["-o", "preallocation=falloc"], "8M"),
    "refcount-1": (["-o", "refcount_bits=1,cluster_size=512"], "64M"),
    "refcount-64-big": (["-o", "refcount_bits=64,cluster_size=512,preallocation=metadata"],
                        "4M"),
    "empty": ([], "0"),
    "extended-l2": (["-o", "extended_l2=on"], "1G"),
    "extended-l2-metadata": (["-o", "extended_l2=on,cluster_size=32k,preallocation=metadata"],
                             "64M"),
}


def ours(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aioublk", "img", "create", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          stdin=subprocess.DEVNULL)


def info(path: Path) -> dict[str, object]:
    out: dict[str, object] = json.loads(qemu_img("info", "--output", "json", path).stdout)
    out.pop("filename")
    out.pop("actual-size")
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_create_matches_qemu_img(name: str, tmp_path: Path) -> None:
    opts, size = CASES[name]
    a = ours(*opts, "a.qcow2", size, cwd=tmp_path)
    q = subprocess.run(["qemu-img", "create", "-f", "qcow2", *opts, "q.qcow2", size],
                       capture_output=True, text=True, cwd=tmp_path)
    assert a.returncode == 0, a.stderr
    assert a.stdout.replace("a.qcow2", "X") == q.stdout.replace("q.qcow2", "X")
    mine, theirs = tmp_path / "a.qcow2", tmp_path / "q.qcow2"
    assert info(mine) == info(theirs)
    if name == "refcount-64-big":  # QEMU grows its refcounts as it preallocates:
        assert mine.stat().st_size <= theirs.stat().st_size  # ours are laid out first
    else:
        assert mine.stat().st_size == theirs.stat().st_size
    qemu_img("check", mine)
    qemu_img("compare", mine, theirs)
    if name in ("plain", "metadata", "v2"):  # and it takes writes
        qemu_io(mine, "write -P 7 0 64k")
        qemu_img("check", mine)


def test_create_over_a_backing_file(tmp_path: Path) -> None:
    qemu_img("create", "-q", "-f", "qcow2", tmp_path / "base.qcow2", "32M")
    qemu_io(tmp_path / "base.qcow2", "write -P 5 0 1M")
    (tmp_path / "base.raw").write_bytes(b"\x09" * (3 << 20))
    for base, kind in (("base.qcow2", "qcow2"), ("base.raw", "raw")):
        a = ours("-b", base, "-F", kind, "top.qcow2", cwd=tmp_path)
        q = subprocess.run(["qemu-img", "create", "-f", "qcow2", "-b", base, "-F", kind,
                            "q.qcow2"], capture_output=True, text=True, cwd=tmp_path)
        assert a.returncode == 0, a.stderr
        assert a.stdout.replace("top.qcow2", "X") == q.stdout.replace("q.qcow2", "X")
        assert info(tmp_path / "top.qcow2") == info(tmp_path / "q.qcow2")
        qemu_img("compare", tmp_path / "top.qcow2", tmp_path / base)


@pytest.mark.parametrize(("args", "words"), [
    (["-b", "base.qcow2", "x.qcow2", "1M"], "-F qcow2|raw"),
    (["-o", "colour=blue", "x.qcow2", "1M"], "unknown option 'colour'"),
    (["-o", "cluster_size=3000", "x.qcow2", "1M"], "cluster_size 3000"),
    (["-o", "extended_l2=on,cluster_size=4k", "x.qcow2", "1M"], "at least 16384 bytes"),
    (["-o", "extended_l2=on,compat=0.10", "x.qcow2", "1M"], "compatibility level 1.1"),
    (["-o", "compat=0.10,lazy_refcounts=on", "x.qcow2", "1M"], "compat=1.1"),
    (["-o", "preallocation=full", "x.qcow2", "1M"], "preallocation 'full'"),
    (["x.qcow2", "12Q"], "invalid image size"),
    (["x.qcow2"], "SIZE"),
])
def test_bad_options_are_one_line(args: list[str], words: str, tmp_path: Path) -> None:
    got = ours(*args, cwd=tmp_path)
    assert got.returncode != 0 and got.stderr.count("\n") == 1, got.stderr
    assert words in got.stderr and "Traceback" not in got.stderr
    assert not (tmp_path / "x.qcow2").exists()


def test_an_image_in_use_is_not_overwritten(tmp_path: Path) -> None:
    p = tmp_path / "busy.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", p, "16M")
    qemu_io(p, "write -P 3 0 4k")
    before = p.read_bytes()
    with held_by_qemu_io(p):
        got = ours("-q", p, "8M", cwd=tmp_path)
        assert got.returncode == 1 and "in use" in got.stderr, got.stderr
        assert p.read_bytes() == before
