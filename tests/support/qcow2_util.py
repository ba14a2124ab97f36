"""Helpers for the qcow2 engine's host tests (no ublk, no kernel).

QEMU's own tools are the reference: images are made with ``qemu-img`` and
filled with ``qemu-io``; what the engine reads is compared with
``qemu-img convert -O raw``; what the engine writes is checked with
``qemu-img check``, ``qemu-img compare`` and ``qemu-img map``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import random
import shlex
import subprocess
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from aioublk.dataplane.extents import ZSTD, Zipped
from aioublk.qcow2.compress import decompress
from aioublk.qcow2.format import COMPRESSION_ZLIB, COMPRESSION_ZSTD

K = 1024
M = 1024 * K
SECTOR = 512

#: Chunk sizes a whole-image read cycles through: a page, 1 MiB, a multiple of
#: 512 that is not a power of two (21 sectors), one cluster-ish size plus a
#: sector, a single sector. Cycling makes chunk starts land everywhere.
CHUNKS_A: tuple[int, ...] = (4 * K, 1 * M, 21 * SECTOR, 64 * K + SECTOR, SECTOR)
#: Another cycle, for a second pass that must not share chunk boundaries.
CHUNKS_B: tuple[int, ...] = (1 * M, 71 * SECTOR, 4 * K, 3 * M // 2 + SECTOR, 3 * SECTOR)

#: What a read buffer holds before the engine fills it: a read that leaves a
#: range untouched (instead of zeroing it) shows up as this byte.
SENTINEL = 0xA5


@dataclass(frozen=True)
class Spec:
    """An image to create: cluster size, refcount width, compat level, size."""

    cluster: int
    refcount_bits: int
    compat: str
    size: int


# -- running QEMU's tools -------------------------------------------------------


def missing_tool(what: str) -> NoReturn:
    """A tool (or a feature of one) the test needs is missing: a skip on a
    developer's machine, a failure under CI (``CI=true``), whose machines
    are set up to have everything."""
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"{what}: CI must have it (see scripts/setup)", pytrace=False)
    pytest.skip(what)



def run(*cmd: object, ok: Iterable[int] = (0,), timeout: float = 300,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command; fail the test with the command line, exit code, stdout and
    stderr (tails) if its exit code is not in ``ok``."""
    args = [str(c) for c in cmd]
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if p.returncode not in tuple(ok):
        raise AssertionError(
            f"command failed (exit {p.returncode}): {shlex.join(args)}\n"
            f"--- stdout ---\n{_tail(p.stdout)}\n--- stderr ---\n{_tail(p.stderr)}")
    return p


def _tail(text: str, lines: int = 40) -> str:
    parts = text.rstrip("\n").splitlines()
    if len(parts) > lines:
        parts = [f"[... {len(parts) - lines} lines left out ...]"] + parts[-lines:]
    return "\n".join(parts)


def qemu_img(*args: object, ok: Iterable[int] = (0,)) -> subprocess.CompletedProcess[str]:
    return run("qemu-img", *args, ok=ok)


def qemu_io(path: Path, *commands: str, fmt: str = "qcow2") -> str:
    """Run qemu-io commands (one ``-c`` each) on an image. qemu-io exits 1 when a
    command failed; a "failed" line in its output also fails the test."""
    args: list[object] = ["qemu-io", "-f", fmt]
    for c in commands:
        args += ["-c", c]
    args.append(path)
    p = run(*args)
    bad = [line for line in p.stdout.splitlines() if "failed" in line.lower()]
    if bad:
        raise AssertionError(f"qemu-io reported a failure on {path}:\n" + "\n".join(bad)
                             + f"\ncommands: {list(commands)}")
    return p.stdout


def create(path: Path, size: int | None, *, cluster_size: int = 64 * K,
           refcount_bits: int = 16, compat: str = "1.1", backing: Path | str | None = None,
           backing_fmt: str = "qcow2", compression_type: str | None = None,
           lazy_refcounts: bool = False, extended_l2: bool = False) -> Path:
    """``qemu-img create -f qcow2``. ``backing`` is stored as given (a relative
    name is relative to the image's directory, as QEMU resolves it). ``size``
    None takes the backing file's size."""
    opts = [f"cluster_size={cluster_size}", f"refcount_bits={refcount_bits}",
            f"compat={compat}"]
    if compression_type is not None:
        opts.append(f"compression_type={compression_type}")
    if lazy_refcounts:
        opts.append("lazy_refcounts=on")
    if extended_l2:
        opts.append("extended_l2=on")
    args: list[object] = ["create", "-q", "-f", "qcow2", "-o", ",".join(opts)]
    if backing is not None:
        args += ["-b", backing, "-F", backing_fmt]
    args.append(path)
    if size is not None:
        args.append(size)
    # relative backing names are resolved from the image's directory
    run("qemu-img", *args, cwd=path.parent)
    return path


def to_raw(image: Path, out: Path, *, snapshot: str | None = None) -> Path:
    """``qemu-img convert -O raw`` of the active layer (or of an internal
    snapshot), backing chain included."""
    args: list[object] = ["convert", "-O", "raw"]
    if snapshot is not None:
        args += ["-l", f"snapshot.name={snapshot}"]
    qemu_img(*args, image, out)
    return out


def info(image: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(qemu_img("info", "-U", "--output=json", image).stdout)
    return out


def check_clean(image: Path) -> dict[str, Any]:
    """``qemu-img check``: exit 0, no leaks, no corruptions, no check errors."""
    p = qemu_img("check", "--output=json", image, ok=(0, 1, 2, 3))
    if p.returncode != 0:
        human = qemu_img("check", image, ok=(0, 1, 2, 3))
        raise AssertionError(f"qemu-img check {image} exited {p.returncode}:\n"
                             f"{_tail(human.stdout, 60)}\n{_tail(human.stderr)}")
    report: dict[str, Any] = json.loads(p.stdout)
    for key in ("leaks", "corruptions", "check-errors", "leaks-fixed", "corruptions-fixed"):
        assert report.get(key, 0) == 0, f"qemu-img check {image}: {key}={report[key]}: {report}"
    return report


def check_consistent(image: Path) -> None:
    """``qemu-img check -U`` of an image still open in the engine after a
    flush: it may leak clusters (as after a crash) but must not be corrupt."""
    p = qemu_img("check", "-U", image, ok=(0, 1, 2, 3))
    assert p.returncode in (0, 3), (
        f"qemu-img check -U {image} after flush exited {p.returncode} (2 = corrupt):\n"
        f"{_tail(p.stdout, 60)}\n{_tail(p.stderr)}")


def compare_identical(image: Path, raw: Path, *, force_share: bool = False) -> None:
    """``qemu-img compare -f qcow2 -F raw``: exit 0, "Images are identical"."""
    args: list[object] = ["compare", "-f", "qcow2", "-F", "raw"]
    if force_share:
        args.append("-U")
    p = qemu_img(*args, image, raw, ok=(0, 1, 2))
    assert p.returncode == 0 and "Images are identical" in p.stdout, (
        f"qemu-img compare {image} {raw} exited {p.returncode}:\n{p.stdout}{p.stderr}")


def qemu_map(image: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = json.loads(
        qemu_img("map", "-U", "--output=json", image).stdout)
    return out


def data_clusters(image: Path, cluster_size: int) -> set[int]:
    """Indexes of the clusters that ``qemu-img map`` reports data in."""
    out: set[int] = set()
    for e in qemu_map(image):
        if e["data"]:
            first = e["start"] // cluster_size
            last = (e["start"] + e["length"] - 1) // cluster_size
            out.update(range(first, last + 1))
    return out


# -- content ----------------------------------------------------------------------


def mixed_content(size: int, seed: int) -> bytes:
    """Bytes with every kind of cluster content: random (incompressible), text-like
    (compressible), runs of one byte, and zeros, in blocks of assorted sizes."""
    rng = random.Random(seed)
    out = bytearray()
    while len(out) < size:
        n = rng.choice((512, 4 * K, 7 * SECTOR, 64 * K, 100 * K, 300 * K))
        kind = rng.randrange(4)
        if kind == 0:
            out += rng.randbytes(n)
        elif kind == 1:
            words = [bytes(rng.choices(b"abcdefghij klmnop", k=rng.randrange(3, 9)))
                     for _ in range(50)]
            text = b" ".join(rng.choice(words) for _ in range(n // 4))
            out += text[:n].ljust(n, b".")
        elif kind == 2:
            out += bytes([rng.randrange(1, 256)]) * n
        else:
            out += bytes(n)
    return bytes(out[:size])


def pattern_file(path: Path, seed: int = 7) -> Path:
    """A file for ``qemu-io write -s`` (repeated when shorter than a write): its
    length is not a power of two, so repeats do not line up with clusters. Half
    random, half text-like, so compressed writes of it really compress a bit."""
    rng = random.Random(seed)
    text = bytes(rng.choices(b"the quick brown fox  ", k=300 * K + 1000))
    path.write_bytes(rng.randbytes(300 * K) + text)
    return path


# -- the engine ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def opened(path: Path, *, read_only: bool = False) -> AsyncIterator[Any]:
    """``Qcow2Image.open`` ... ``await img.close()``."""
    from aioublk.qcow2 import Qcow2Image

    img = Qcow2Image.open(str(path), read_only=read_only)
    try:
        yield img
    finally:
        await img.close()


def spans(start: int, end: int, chunks: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(offset, length) pieces covering [start, end), lengths cycling through
    ``chunks`` (the last one cut short)."""
    pos, i = start, 0
    while pos < end:
        n = min(chunks[i % len(chunks)], end - pos)
        yield pos, n
        pos += n
        i += 1


async def read_all(img: Any, *, chunks: Sequence[int] = CHUNKS_A, concurrency: int = 1,
                   own_buffers: bool = False, start: int = 0,
                   end: int | None = None) -> bytearray:
    """Read [start, end) (default: the whole image) through the engine, chunk by
    chunk, into a buffer pre-filled with SENTINEL. ``concurrency`` > 1 keeps that
    many reads in flight. ``own_buffers`` reads each chunk into its own
    bytearray (else into memoryview slices of one buffer)."""
    end = img.size if end is None else end
    out = bytearray([SENTINEL]) * (end - start)
    view = memoryview(out)

    async def one(off: int, n: int) -> None:
        if own_buffers:
            b = bytearray([SENTINEL]) * n
            await img.read(off, b)
            view[off - start:off - start + n] = b
        else:
            await img.read(off, view[off - start:off - start + n])

    pieces = list(spans(start, end, chunks))
    if concurrency <= 1:
        for off, n in pieces:
            await one(off, n)
    else:
        for i in range(0, len(pieces), concurrency):
            await asyncio.gather(*(one(off, n) for off, n in pieces[i:i + concurrency]))
    return out


def assert_same(got: bytes | bytearray | memoryview, want: bytes | bytearray | memoryview,
                what: str, base: int = 0) -> None:
    """Byte equality with a readable report (mismatching sector ranges, what was
    read vs expected) instead of pytest's diff of megabytes."""
    if len(got) != len(want):
        raise AssertionError(f"{what}: length {len(got)} != expected {len(want)}")
    g, w = memoryview(got).cast("B"), memoryview(want).cast("B")
    if g == w:
        return
    bad: list[tuple[int, int]] = []  # merged (start, end) byte ranges, sector-grained
    step = 1 * M
    for c in range(0, len(g), step):
        if g[c:c + step] == w[c:c + step]:
            continue
        for s in range(c, min(c + step, len(g)), SECTOR):
            if g[s:s + SECTOR] != w[s:s + SECTOR]:
                e = min(s + SECTOR, len(g))
                if bad and bad[-1][1] == s:
                    bad[-1] = (bad[-1][0], e)
                else:
                    bad.append((s, e))
    total = sum(e - s for s, e in bad)
    lines = [f"{what}: {total} bytes in {len(bad)} sector range(s) differ "
             f"(offsets are image offsets):"]
    for s, e in bad[:12]:
        first = next(i for i in range(s, e) if g[i] != w[i])
        lines.append(
            f"  [{base + s:#x}, {base + e:#x}) len {e - s}: first diff at {base + first:#x}: "
            f"got {_sample(g, first)}  expected {_sample(w, first)}")
    if len(bad) > 12:
        lines.append(f"  ... {len(bad) - 12} more ranges")
    raise AssertionError("\n".join(lines))


def _sample(b: memoryview, at: int) -> str:
    chunk = bytes(b[at:at + 16])
    kind = ""
    if chunk == bytes([SENTINEL]) * len(chunk):
        kind = " (untouched read buffer)"
    elif not any(chunk):
        kind = " (zeros)"
    return chunk.hex(" ") + kind


def read_file(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@contextlib.contextmanager
def held_by_qemu_io(image: Path) -> Iterator[None]:
    """``image`` open for writing by a qemu-io that waits for commands (its
    locks taken), until the block ends."""
    holder = subprocess.Popen(["qemu-io", "-f", "qcow2", str(image)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write("read 0 512\n")
        holder.stdin.flush()
        assert "read" in holder.stdout.readline()  # (its answer: the image is open)
        yield
    finally:
        holder.kill()
        holder.wait()


def zipped_bytes(z: Zipped) -> bytes:
    """The bytes a ZIP piece stands for, as the data plane makes them: its
    compressed bytes read (aligned: the file may be open O_DIRECT) and
    inflated, then the part it asks for."""
    lead = z.zoff & 4095
    buf = mmap.mmap(-1, (lead + z.zlen + 4095) & ~4095)
    got = os.preadv(z.fd, [buf], z.zoff - lead)
    kind = COMPRESSION_ZSTD if z.alg == ZSTD else COMPRESSION_ZLIB
    whole = decompress(kind, buf[lead:min(got, lead + z.zlen)], z.skip + z.length)
    return whole[z.skip:z.skip + z.length]
