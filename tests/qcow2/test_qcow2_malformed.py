"""The qcow2 engine against malformed images (host only, no ublk).

Valid images are made with qemu-img/qemu-io, then corrupted by patching bytes
(header layout: QEMU docs/interop/qcow2.rst); the cases follow QEMU's own
corruption tests (iotests 060, 080) and go further. Expected reactions:

* at open: ``Qcow2Error`` with a one-line message naming the problem, and the
  file left untouched;
* at I/O time: ``OSError`` with errno EIO from the failing call;
* never another exception type, never a hang (opens run on a guarded thread,
  I/O under ``asyncio.wait_for``), and never a write over the image's own
  metadata (a detected overlap may set the corrupt bit, as QEMU does; nothing
  else in the metadata may change);
* one outcome per case: where an image leaves a choice (open or refuse, serve
  or fail a request), qemu-io on a copy of the same image is the oracle, and a
  test that differs from QEMU on purpose says why.

Sections: header fields refused at open (magic, version, feature bits,
cluster_bits, refcount_order, header_length, truncation, encryption, L1 /
refcount table / snapshot table / backing name geometry); dirty and corrupt
bits; bad L1/L2/refcount-table entries at I/O time (reads, partial and whole
writes, zeroing, discard, concurrency, read-only images); entries and tables
pointing at other metadata; compressed clusters (past EOF, garbage, truncated,
wrong length, zlib and zstd); backing chains (missing, loops, odd names, depth);
and a few odd-but-valid images that must keep working.
"""

from __future__ import annotations

import asyncio
import errno
import random
import shutil
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aioublk.qcow2 import Qcow2Error, Qcow2Image
from aioublk.ring import Ring
from tests.support.qcow2_util import missing_tool

OPEN_TIMEOUT = 10.0
IO_TIMEOUT = 10.0

CS = 65536                      # cluster size of every template (qemu-img default)
COPIED = 1 << 63                # L1/L2 entry: refcount is exactly one
COMPRESSED = 1 << 62            # L2 entry: compressed cluster descriptor
OFFSET_MASK = 0x00FF_FFFF_FFFF_FE00
FAR = 1 << 40                   # a cluster-aligned host offset far past any template's EOF

# header fields (docs/interop/qcow2.rst), big endian
MAGIC, VERSION, BACKING_OFFSET, BACKING_SIZE, CLUSTER_BITS, SIZE = 0, 4, 8, 16, 20, 24
CRYPT_METHOD, L1_SIZE, L1_OFFSET, RT_OFFSET, RT_CLUSTERS = 32, 36, 40, 48, 56
NB_SNAPSHOTS, SNAPSHOTS_OFFSET, INCOMPAT, COMPAT, AUTOCLEAR = 60, 64, 72, 80, 88
REFCOUNT_ORDER, HEADER_LENGTH, COMPRESSION_TYPE = 96, 100, 104

DIRTY, CORRUPT, EXTERNAL_DATA, COMPRESSION_BIT, EXTENDED_L2 = 1, 2, 4, 8, 16

PATTERN = 0x5A                  # guest cluster 0 of the plain templates
GUEST = 0xEE                    # what the tests write as guest data
SNAP_NEW = 0x6B                 # written to the snapshot template after its snapshot


# ---------------------------------------------------------------- file surgery


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, f"{cmd}: {p.stdout}{p.stderr}"
    return p.stdout


def poke(path: Path, offset: int, fmt: str, *values: Any) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(">" + fmt, *values))


def peek(path: Path, offset: int, fmt: str) -> Any:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(struct.calcsize(">" + fmt))
    return struct.unpack(">" + fmt, data)[0]


def truncate(path: Path, length: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(length)


@dataclass
class Layout:
    """Where qemu-img put things (host offsets)."""
    l1: int
    rt: int
    rb: int
    l2: int
    size: int

    @staticmethod
    def of(path: Path) -> Layout:
        l1 = peek(path, L1_OFFSET, "Q")
        rt = peek(path, RT_OFFSET, "Q")
        return Layout(l1=l1, rt=rt, rb=peek(path, rt, "Q"),
                      l2=peek(path, l1, "Q") & OFFSET_MASK, size=path.stat().st_size)


def compressed_fields(entry: int, cluster_bits: int = 16) -> tuple[int, int]:
    """(host offset, additional sectors) of a compressed cluster descriptor."""
    x = 62 - (cluster_bits - 8)
    return entry & ((1 << x) - 1), (entry >> x) & ((1 << (62 - x)) - 1)


def compressed_entry(offset: int, sectors: int, cluster_bits: int = 16) -> int:
    x = 62 - (cluster_bits - 8)
    return COMPRESSED | (sectors << x) | offset


def metadata_clusters(path: Path) -> dict[str, int]:
    lay = Layout.of(path)
    return {"header": 0, "refcount table": lay.rt, "refcount block": lay.rb, "L1": lay.l1,
            "L2": lay.l2}


def assert_only_corrupt_bit_changed(before: bytes, after: bytes, start: int, end: int,
                                    what: str) -> None:
    """bytes [start, end) of the image are as before, except that the header's
    corrupt bit may have been set."""
    old, new = bytearray(before[start:end]), bytearray(after[start:end])
    if len(old) != len(new):
        pytest.fail(f"{what} at {start:#x} was cut short by a truncation")
    if start == 0:
        old_inc = struct.unpack_from(">Q", old, INCOMPAT)[0]
        new_inc = struct.unpack_from(">Q", new, INCOMPAT)[0]
        assert (old_inc ^ new_inc) & ~CORRUPT == 0, \
            f"incompatible_features changed {old_inc:#x} -> {new_inc:#x}"
        struct.pack_into(">Q", new, INCOMPAT, old_inc)
    if old != new:
        first = next(i for i in range(len(old)) if old[i] != new[i])
        pytest.fail(f"{what} at {start:#x} was modified (first difference at {start + first:#x})")


def assert_no_guest_data_in_metadata(path: Path, where: dict[str, int] | None = None) -> None:
    data = path.read_bytes()
    for name, off in (where or metadata_clusters(path)).items():
        assert bytes([GUEST]) * 512 not in data[off:off + CS], f"guest data written over the {name}"


def qcreate(tmp: Path, name: str, backing: str | None = None, fmt: str = "qcow2") -> Path:
    cmd = ["qemu-img", "create", "-q", "-f", "qcow2"]
    if backing is not None:
        cmd += ["-u", "-b", backing, "-F", fmt]
    run(*cmd, name, "64M", cwd=tmp)
    return tmp / name


# ---------------------------------------------------------------- templates


@dataclass
class Templates:
    dir: Path
    v3: Path            # 64 MiB, guest cluster 0 = PATTERN (L2 and data allocated)
    v2: Path            # same, compat=0.10
    zlib: Path          # 1 MiB, guest cluster 0 compressed (deflate)
    zstd: Path | None   # same with compression_type=zstd (None if qemu-img lacks it)
    compressed_data: bytes = field(repr=False)
    data_file: Path
    snap: Path          # like v3, then snapshot 's1', then 4 KiB of SNAP_NEW at 0


@pytest.fixture(scope="module")
def tpl(tmp_path_factory: pytest.TempPathFactory) -> Templates:
    d = tmp_path_factory.mktemp("qcow2-templates")
    v3, v2 = d / "v3.qcow2", d / "v2.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", v3, "64M")
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat=0.10", v2, "64M")
    for p in (v3, v2):
        run("qemu-io", "-f", "qcow2", "-c", f"write -q -P {PATTERN:#x} 0 {CS}", p)

    # compressed: 16 KiB of noise then text, so the deflate stream spans many sectors
    rnd = random.Random(1234)
    data = bytes(rnd.getrandbits(8) for _ in range(16384))
    data += (b"aioublk qcow2 malformed " * (CS // 24 + 1))[: CS - len(data)]
    raw = d / "src.raw"
    raw.write_bytes(data + bytes((1 << 20) - CS))
    zl = d / "zlib.qcow2"
    run("qemu-img", "convert", "-q", "-c", "-f", "raw", "-O", "qcow2", raw, zl)
    zs: Path | None = d / "zstd.qcow2"
    p = subprocess.run(["qemu-img", "convert", "-q", "-c", "-f", "raw", "-O", "qcow2", "-o",
                        "compression_type=zstd", str(raw), str(zs)], capture_output=True)
    if p.returncode != 0:
        zs = None

    df = d / "data_file.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", f"data_file={d / 'data_file.raw'}",
        df, "1M")
    snap = d / "snap.qcow2"
    shutil.copyfile(v3, snap)
    run("qemu-img", "snapshot", "-c", "s1", snap)
    run("qemu-io", "-f", "qcow2", "-c", f"write -q -P {SNAP_NEW:#x} 0 4096", snap)
    return Templates(dir=d, v3=v3, v2=v2, zlib=zl, zstd=zs, compressed_data=data,
                     data_file=df, snap=snap)


def clone(src: Path, tmp_path: Path, name: str | None = None) -> Path:
    dst = tmp_path / (name or src.name)
    shutil.copyfile(src, dst)
    return dst


# ---------------------------------------------------------------- open helpers


def _close_quietly(img: Any) -> None:
    """Close an image that should never have opened, on a thread of its own
    (with its own loop and Ring: the caller may be inside a running loop)."""
    async def go() -> None:
        r = Ring(8, bind_thread=True)
        try:
            await asyncio.wait_for(img.close(), IO_TIMEOUT)
        finally:
            r.close()

    def target() -> None:
        try:
            asyncio.run(go())
        except Exception:
            pass

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(OPEN_TIMEOUT)


def open_in_thread(path: Path, **kw: Any) -> tuple[Any, BaseException | None]:
    """Qcow2Image.open in a daemon thread, so that a hang fails the test
    instead of the run."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["img"] = Qcow2Image.open(str(path), **kw)
        except BaseException as e:
            box["exc"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(OPEN_TIMEOUT)
    assert not t.is_alive(), f"Qcow2Image.open({path.name}, {kw}) hung for {OPEN_TIMEOUT} s"
    return box.get("img"), box.get("exc")


def open_ok(path: Path, **kw: Any) -> Any:
    """Qcow2Image.open with the hang guard; its exception, if any, is raised."""
    img, exc = open_in_thread(path, **kw)
    if exc is not None:
        raise exc
    return img


def check_message(exc: BaseException, words: tuple[str, ...], what: str) -> str:
    assert isinstance(exc, Qcow2Error), \
        f"{what}: expected Qcow2Error, got {type(exc).__name__}: {exc!r}"
    msg = str(exc)
    assert msg.strip(), f"{what}: empty Qcow2Error message"
    assert len(msg.splitlines()) == 1, f"{what}: message is not one line: {msg!r}"
    assert any(w.lower() in msg.lower() for w in words), \
        f"{what}: message {msg!r} names none of {words}"
    return msg


def expect_open_error(path: Path, words: tuple[str, ...], **kw: Any) -> str:
    before = path.read_bytes()
    img, exc = open_in_thread(path, **kw)
    if img is not None:
        _close_quietly(img)
        pytest.fail(f"Qcow2Image.open({path.name}, {kw}) succeeded; expected Qcow2Error "
                    f"naming one of {words}")
    assert exc is not None
    msg = check_message(exc, words, f"open({path.name}, {kw})")
    assert path.read_bytes() == before, "a refused open modified the image"
    return msg


# ---------------------------------------------------------------- open-time cases

Builder = Callable[[Templates, Path], Path]


def patched(template: str, *pokes: tuple[int, str, int | bytes]) -> Builder:
    def build(t: Templates, tmp: Path) -> Path:
        p = clone(getattr(t, template), tmp)
        for off, fmt, val in pokes:
            poke(p, off, fmt, val)
        return p
    return build


def truncated(template: str, length: int) -> Builder:
    def build(t: Templates, tmp: Path) -> Path:
        p = clone(getattr(t, template), tmp)
        truncate(p, length)
        return p
    return build


def as_is(template: str) -> Builder:
    def build(t: Templates, tmp: Path) -> Path:
        src = getattr(t, template)
        if src is None:
            missing_tool(f"qemu-img could not make the {template} template")
        return clone(src, tmp)
    return build


def huge_extension(t: Templates, tmp: Path) -> Path:
    p = clone(t.v3, tmp)
    hl = peek(p, HEADER_LENGTH, "I")
    poke(p, hl, "II", 0x12345678, 0x7FFF_FFFF)
    return p


def l1_past_eof(t: Templates, tmp: Path) -> Path:
    """An L1 table of 32 MiB (QEMU's limit, so allowed by size) in a 384 KiB
    file."""
    p = clone(t.v3, tmp)
    poke(p, L1_SIZE, "I", (32 << 20) // 8)
    poke(p, SIZE, "Q", ((32 << 20) // 8) * (CS // 8) * CS)
    return p


TRUNC = ("short", "truncat", "small", "header", "eof", "end of file", "empty")
L1 = ("l1",)
RC = ("refcount",)
CRYPT = ("crypt",)          # encrypt, encryption, crypt_method
BK = ("backing",)

OPEN_CASES: list[tuple[str, Builder, tuple[str, ...]]] = [
    ("bad_magic", patched("v3", (MAGIC, "4s", b"QFI\xfa")), ("magic", "not a qcow")),
    ("zero_magic", patched("v3", (MAGIC, "4s", bytes(4))), ("magic", "not a qcow")),
    ("version_0", patched("v3", (VERSION, "I", 0)), ("version",)),
    ("version_1", patched("v3", (VERSION, "I", 1)), ("version",)),
    ("version_4", patched("v3", (VERSION, "I", 4)), ("version",)),
    ("version_huge", patched("v3", (VERSION, "I", 0xFFFF_FFFF)), ("version",)),
    ("incompat_bit5", patched("v3", (INCOMPAT, "Q", 1 << 5)), ("incompatible",)),
    ("incompat_bit63", patched("v3", (INCOMPAT, "Q", 1 << 63)), ("incompatible",)),
    ("external_data_bit", patched("v3", (INCOMPAT, "Q", EXTERNAL_DATA)),
     ("external", "data file", "data_file", "data-file")),
    ("external_data_file", as_is("data_file"), ("external", "data file", "data_file",
                                                 "data-file")),
    # (extended L2 images are served: QEMU makes none with clusters under 16 KiB)
    ("extended_l2_small_clusters",
     patched("v3", (INCOMPAT, "Q", EXTENDED_L2), (CLUSTER_BITS, "I", 12)), ("16 KiB",)),
    ("compression_bit_type_0", patched("v3", (INCOMPAT, "Q", COMPRESSION_BIT)),
     ("compression",)),
    ("compression_type_unknown",
     patched("v3", (INCOMPAT, "Q", COMPRESSION_BIT), (COMPRESSION_TYPE, "B", 7)),
     ("compression",)),
    ("compression_type_without_bit", patched("v3", (COMPRESSION_TYPE, "B", 1)),
     ("compression",)),
    ("cluster_bits_8", patched("v3", (CLUSTER_BITS, "I", 8)), ("cluster",)),
    ("cluster_bits_22", patched("v3", (CLUSTER_BITS, "I", 22)), ("cluster",)),
    ("cluster_bits_64", patched("v3", (CLUSTER_BITS, "I", 64)), ("cluster",)),
    ("cluster_bits_huge", patched("v3", (CLUSTER_BITS, "I", 0xFFFF_FFFF)), ("cluster",)),
    ("v2_cluster_bits_8", patched("v2", (CLUSTER_BITS, "I", 8)), ("cluster",)),
    ("refcount_order_7", patched("v3", (REFCOUNT_ORDER, "I", 7)), RC),
    ("refcount_order_huge", patched("v3", (REFCOUNT_ORDER, "I", 0xFFFF_FFFF)), RC),
    ("header_length_72", patched("v3", (HEADER_LENGTH, "I", 72)), ("header",)),
    ("header_length_100", patched("v3", (HEADER_LENGTH, "I", 100)), ("header",)),
    ("header_length_0", patched("v3", (HEADER_LENGTH, "I", 0)), ("header",)),
    ("header_length_past_cluster", patched("v3", (HEADER_LENGTH, "I", 0x7FFF_FFFF)),
     ("header",)),
    ("header_length_max", patched("v3", (HEADER_LENGTH, "I", 0xFFFF_FFFF)), ("header",)),
    ("huge_header_extension", huge_extension, ("extension", "header")),
    ("empty_file", truncated("v3", 0), TRUNC + ("magic",)),
    ("file_3_bytes", truncated("v3", 3), TRUNC + ("magic",)),
    ("v2_file_60_bytes", truncated("v2", 60), TRUNC),
    ("v3_file_72_bytes", truncated("v3", 72), TRUNC),
    ("v3_file_100_bytes", truncated("v3", 100), TRUNC),
    ("only_header_cluster", truncated("v3", CS), TRUNC + L1 + RC),
    ("crypt_aes", patched("v3", (CRYPT_METHOD, "I", 1)), CRYPT),
    # (a real LUKS image is not made here: qemu-img's PBKDF benchmark takes
    # seconds and fails under load; the engine sees the same crypt_method 2)
    ("crypt_luks_bit", patched("v3", (CRYPT_METHOD, "I", 2)), CRYPT),
    ("crypt_unknown", patched("v3", (CRYPT_METHOD, "I", 3)), CRYPT),
    ("v2_crypt_aes", patched("v2", (CRYPT_METHOD, "I", 1)), CRYPT),
    ("l1_size_max", patched("v3", (L1_SIZE, "I", 0xFFFF_FFFF)), L1),
    ("l1_size_int_max", patched("v3", (L1_SIZE, "I", 0x7FFF_FFFF)), L1),
    ("l1_size_over_32MiB", patched("v3", (L1_SIZE, "I", (32 << 20) // 8 + 1)), L1),
    ("l1_table_past_eof", l1_past_eof, L1),
    ("l1_size_0_for_64MiB", patched("v3", (L1_SIZE, "I", 0)), L1),
    ("virtual_size_too_big_for_l1", patched("v3", (SIZE, "Q", 1 << 60)),
     L1 + ("virtual size",)),
    ("virtual_size_2_64", patched("v3", (SIZE, "Q", (1 << 64) - 512)), L1 + ("size",)),
    ("l1_offset_unaligned", patched("v3", (L1_OFFSET, "Q", 0x30200)), L1),
    ("l1_offset_garbage", patched("v3", (L1_OFFSET, "Q", 0x1234_5678_90AB_CDEF)), L1),
    ("l1_offset_past_eof", patched("v3", (L1_OFFSET, "Q", FAR)), L1),
    ("refcount_table_unaligned", patched("v3", (RT_OFFSET, "Q", 0x10200)), RC),
    ("refcount_table_garbage", patched("v3", (RT_OFFSET, "Q", 0x1234_5678_90AB_CDEF)), RC),
    ("refcount_table_past_eof", patched("v3", (RT_OFFSET, "Q", FAR)), RC),
    ("refcount_table_huge_offset",
     patched("v3", (RT_OFFSET, "Q", 0xFFFF_FFFF_FFFF_0000), (RT_CLUSTERS, "I", 0x7F)), RC),
    ("refcount_table_clusters_max", patched("v3", (RT_CLUSTERS, "I", 0xFFFF_FFFF)), RC),
    ("refcount_table_clusters_131073", patched("v3", (RT_CLUSTERS, "I", 0x0002_0001)), RC),
    ("refcount_table_clusters_0", patched("v3", (RT_CLUSTERS, "I", 0)), RC),
    ("snapshots_count_max", patched("v3", (NB_SNAPSHOTS, "I", 0xFFFF_FFFF)), ("snapshot",)),
    ("snapshots_offset_unaligned",
     patched("v3", (NB_SNAPSHOTS, "I", 1), (SNAPSHOTS_OFFSET, "Q", 0x1234_5678_90AB_CDEF)),
     ("snapshot",)),
    ("snapshots_past_eof",
     patched("v3", (NB_SNAPSHOTS, "I", 0xFFFF), (SNAPSHOTS_OFFSET, "Q", 0xFFFF_FFFF_FFFF_0000)),
     ("snapshot",)),
    ("backing_name_size_max",
     patched("v3", (BACKING_OFFSET, "Q", 0x1000), (BACKING_SIZE, "I", 0xFFFF_FFFF)), BK),
    ("backing_name_past_eof",
     patched("v3", (BACKING_OFFSET, "Q", FAR), (BACKING_SIZE, "I", 16)), BK),
]


@pytest.mark.parametrize("build,words", [c[1:] for c in OPEN_CASES],
                         ids=[c[0] for c in OPEN_CASES])
@pytest.mark.parametrize("read_only", [False, True], ids=["rw", "ro"])
def test_open_refused(tpl: Templates, tmp_path: Path, build: Builder,
                      words: tuple[str, ...], read_only: bool) -> None:
    expect_open_error(build(tpl, tmp_path), words, read_only=read_only)


# ---------------------------------------------------------------- dirty / corrupt bits


def test_corrupt_image_refused_read_write(tpl: Templates, tmp_path: Path) -> None:
    p = clone(tpl.v3, tmp_path)
    poke(p, INCOMPAT, "Q", CORRUPT)
    msg = expect_open_error(p, ("corrupt",), read_only=False)
    assert f"aioublk img check -r all {p}" in msg, f"message does not say how to repair: {msg!r}"
    fixed = subprocess.run([sys.executable, "-m", "aioublk", "img", "check", "-r", "all",
                            str(p)], capture_output=True, text=True, timeout=60)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert peek(p, INCOMPAT, "Q") == 0  # the command the message names did clear it


def test_dirty_image_repaired_when_opened_read_write(tpl: Templates, tmp_path: Path) -> None:
    """As QEMU: a dirty image (lazy refcounts, then a crash) has its
    refcounts rebuilt by a read-write open, and is clean after."""
    p = clone(tpl.v3, tmp_path)
    poke(p, INCOMPAT, "Q", DIRTY)
    img, exc = open_in_thread(p, read_only=False)
    assert exc is None and img is not None, exc
    _close_quietly(img)
    assert peek(p, INCOMPAT, "Q") == 0


# ---------------------------------------------------------------- async I/O-time cases


async def expect_eio(aw: Awaitable[Any], what: str) -> None:
    try:
        await asyncio.wait_for(aw, IO_TIMEOUT)
    except TimeoutError:
        pytest.fail(f"{what}: hung for {IO_TIMEOUT} s")
    except OSError as e:
        assert e.errno == errno.EIO, f"{what}: {type(e).__name__} {e!r}, expected errno EIO"
        return
    except Exception as e:
        pytest.fail(f"{what}: raised {type(e).__name__}: {e!r}; expected OSError(EIO)")
    pytest.fail(f"{what}: succeeded; expected OSError(EIO)")


async def ok_or_eio(aw: Awaitable[Any], what: str) -> bool:
    """True if the call succeeded; False for OSError(EIO); fails on anything else."""
    try:
        await asyncio.wait_for(aw, IO_TIMEOUT)
    except TimeoutError:
        pytest.fail(f"{what}: hung for {IO_TIMEOUT} s")
    except OSError as e:
        assert e.errno == errno.EIO, f"{what}: {type(e).__name__} {e!r}, expected errno EIO"
        return False
    except Exception as e:
        pytest.fail(f"{what}: raised {type(e).__name__}: {e!r}; expected OSError(EIO)")
    return True


async def aclose(img: Any) -> None:
    """close() after a failure: succeeding or OSError(EIO) are both fine."""
    await ok_or_eio(img.close(), "close")


def open_or_refused(path: Path, words: tuple[str, ...], **kw: Any) -> Any:
    """Open an image whose problem may be found at open or at I/O time: returns
    the image, or None when open refused it properly."""
    try:
        return open_ok(path, **kw)
    except Exception as e:
        check_message(e, words, f"open({path.name})")
        return None


# ---------------------------------------------------------------- QEMU as the oracle
# Where a malformed image leaves a choice (refuse at open or at I/O time; fail
# a request or serve it), qemu-io on a copy of the same image decides: each
# request gets one expected outcome, QEMU's, unless the test documents a
# deliberate difference. Outcomes are "ok" or "fails" (QEMU's errno varies:
# EIO, EINVAL, ENOMEDIUM once it has marked the image corrupt and ejected it;
# ours is always EIO, all a block device can report).


@dataclass(frozen=True)
class Op:
    qemu: str                                   # the qemu-io command
    call: Callable[[Any], Awaitable[Any]]       # the same request to our image


def op_read(offset: int, buf: bytearray) -> Op:
    return Op(f"read {offset} {len(buf)}", lambda img: img.read(offset, buf))


def op_write(offset: int, length: int, byte: int = GUEST) -> Op:
    return Op(f"write -P {byte:#x} {offset} {length}",
              lambda img: img.write(offset, bytes([byte]) * length))


def op_zeroes(offset: int, length: int, unmap: bool = False) -> Op:
    return Op(f"write -z {'-u ' if unmap else ''}{offset} {length}",
              lambda img: img.write_zeroes(offset, length, unmap=unmap))


def op_discard(offset: int, length: int) -> Op:
    return Op(f"discard {offset} {length}", lambda img: img.discard(offset, length))


OP_FLUSH = Op("flush", lambda img: img.flush())
_QEMU_DONE = {"read": "read ", "write": "wrote ", "discard": "discard "}


def qemu_outcomes(path: Path, ops: list[Op], *, read_only: bool = False) -> list[str] | None:
    """What qemu-io does with ``ops`` on a copy of ``path``: None if it refuses
    to open the image, else "ok" or "fails" for each op."""
    copy = path.with_name(path.name + ".qemu")
    shutil.copyfile(path, copy)
    cmd = ["qemu-io", "-f", "qcow2", *(["-r"] if read_only else [])]
    for op in ops:
        cmd += ["-c", op.qemu]
    p = subprocess.run([*cmd, str(copy)], capture_output=True, text=True, timeout=60)
    copy.unlink()
    if "can't open" in p.stderr:
        return None
    lines = [ln for ln in p.stdout.splitlines()
             if ln.startswith(tuple(_QEMU_DONE.values())) or " failed: " in ln]
    out = []
    for op in ops:
        verb = op.qemu.split()[0]
        if lines and lines[0].startswith(f"{verb} failed: "):
            out.append("fails")
        elif verb == "flush":
            out.append("ok")
            continue
        else:
            assert lines and lines[0].startswith(_QEMU_DONE[verb]), \
                f"cannot read qemu-io's answer to {op.qemu!r}: {p.stdout}{p.stderr}"
            out.append("ok")
        lines.pop(0)
    return out


def open_like_qemu(path: Path, qemu: list[str] | None, words: tuple[str, ...],
                   **kw: Any) -> Any:
    """Open ``path`` where QEMU opens it (else None, refused in one line
    naming one of ``words``)."""
    img = open_or_refused(path, words, **kw)
    if qemu is None and img is not None:
        _close_quietly(img)
        pytest.fail(f"QEMU refuses to open {path.name}; we open it")
    if qemu is not None and img is None:
        pytest.fail(f"QEMU opens {path.name} (then {qemu}); we refuse it at open")
    return img


def open_as_qemu_does(path: Path, words: tuple[str, ...], **kw: Any) -> Any:
    """Open ``path`` if QEMU opens it (else None: refused in one line)."""
    qemu = qemu_outcomes(path, [], read_only=kw.get("read_only", False))
    return open_like_qemu(path, qemu, words, **kw)


async def our_outcomes(img: Any, ops: list[Op]) -> list[str]:
    """Our engine's outcome of each op, in order ("ok" or "fails": EIO)."""
    return ["ok" if await ok_or_eio(op.call(img), op.qemu) else "fails" for op in ops]


async def like_qemu(path: Path, ops: list[Op], words: tuple[str, ...], *,
                    ours: list[str] | None = None, refuse: bool = False,
                    **kw: Any) -> tuple[Any, list[str] | None]:
    """Open ``path`` and run ``ops`` as QEMU does. A documented deliberate
    difference: ``ours``, our outcomes where they are not QEMU's, or
    ``refuse``, we refuse at open an image QEMU opens. Returns our image (to
    close; None if refused) and the outcomes."""
    qemu = qemu_outcomes(path, ops, read_only=kw.get("read_only", False))
    if refuse:
        assert qemu is not None, "QEMU refuses this image too: drop the documented difference"
        expect_open_error(path, words, **kw)
        return None, None
    img = open_like_qemu(path, qemu, words, **kw)
    if img is None:
        return None, None
    assert qemu is not None
    want = qemu if ours is None else ours
    if ours is not None and ours == qemu:
        await aclose(img)
        pytest.fail(f"QEMU now does {qemu} too: drop the documented difference")
    try:
        ours = await our_outcomes(img, ops)
    except BaseException:
        await aclose(img)
        raise
    if ours != want:
        await aclose(img)
        pytest.fail(f"outcomes of {[op.qemu for op in ops]}: ours {ours}, expected {want} "
                    f"(QEMU: {qemu})")
    return img, ours


@pytest.mark.asyncio
async def test_templates_are_sane(ring: Ring, tpl: Templates, tmp_path: Path) -> None:
    """The uncorrupted templates open and read back what qemu wrote, so the
    failures below come from the corruption."""
    for name, expect in [("v3", bytes([PATTERN]) * CS), ("v2", bytes([PATTERN]) * CS),
                         ("zlib", tpl.compressed_data), ("zstd", tpl.compressed_data)]:
        src = getattr(tpl, name)
        if src is None:
            continue
        img = open_ok(clone(src, tmp_path), read_only=(name != "v3"))
        buf = bytearray(CS)
        await asyncio.wait_for(img.read(0, buf), IO_TIMEOUT)
        assert bytes(buf) == expect, name
        await asyncio.wait_for(img.close(), IO_TIMEOUT)
    if tpl.zstd is None:
        missing_tool("qemu-img cannot make zstd images")


@pytest.mark.parametrize("bit,word", [(DIRTY, "dirty"), (CORRUPT, "corrupt")],
                         ids=["dirty", "corrupt"])
@pytest.mark.asyncio
async def test_flagged_image_opens_read_only(ring: Ring, tpl: Templates, tmp_path: Path,
                                             bit: int, word: str) -> None:
    p = clone(tpl.v3, tmp_path)
    poke(p, INCOMPAT, "Q", bit)
    before = p.read_bytes()
    img = open_ok(p, read_only=True)
    buf = bytearray(CS)
    await asyncio.wait_for(img.read(0, buf), IO_TIMEOUT)
    assert bytes(buf) == bytes([PATTERN]) * CS
    await asyncio.wait_for(img.close(), IO_TIMEOUT)
    assert p.read_bytes() == before, f"read-only use of a {word} image modified it"


BAD_TABLE_ENTRIES = [
    # (id, which table, entry)
    ("l1_entry_past_eof", "l1", COPIED | FAR),
    ("l1_entry_unaligned", "l1", COPIED | 0x40200),
    ("l1_entry_unaligned_not_copied", "l1", 0x40200),
    ("l2_entry_past_eof", "l2", COPIED | FAR),
    ("l2_entry_past_eof_not_copied", "l2", FAR),
    ("l2_entry_unaligned", "l2", COPIED | 0x50200),
    ("l2_entry_unaligned_not_copied", "l2", 0x50200),
]


PARTIAL_OPS = {
    "read": lambda img: img.read(0, bytearray(4096)),
    "read_cluster": lambda img: img.read(0, bytearray(CS)),
    "write": lambda img: img.write(512, bytes([GUEST]) * 4096),
    "zeroes": lambda img: img.write_zeroes(512, 4096),
}


@pytest.mark.parametrize("op", list(PARTIAL_OPS))
@pytest.mark.parametrize("table,entry", [c[1:] for c in BAD_TABLE_ENTRIES],
                         ids=[c[0] for c in BAD_TABLE_ENTRIES])
@pytest.mark.asyncio
async def test_bad_table_entry(ring: Ring, tpl: Templates, tmp_path: Path, table: str,
                               entry: int, op: str) -> None:
    """A read, or a write needing the cluster's old data, through a bad L1/L2
    entry fails with EIO (each op on a fresh image: an engine that marks the
    image corrupt on the first error would otherwise hide the later paths)."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    poke(p, lay.l1 if table == "l1" else lay.l2, "Q", entry)
    img = open_as_qemu_does(p, ("l1", "l2", "offset", "align", "eof"))
    if img is None:
        return
    try:
        await expect_eio(PARTIAL_OPS[op](img), op)
    finally:
        await aclose(img)
    assert p.stat().st_size < 64 << 20, f"the file grew to {p.stat().st_size} bytes"


BOGUS_OPS = {
    "write": op_write(0, CS),
    "discard": op_discard(0, CS),
    "zeroes": op_zeroes(0, CS),
    "zeroes_unmap": op_zeroes(0, CS, unmap=True),
}


@pytest.mark.parametrize("op", list(BOGUS_OPS))
@pytest.mark.parametrize("entry", [FAR, 0x50200, COPIED | FAR, (0x3F << 56) | 0x50000],
                         ids=["past_eof", "unaligned", "past_eof_copied", "reserved_bits"])
@pytest.mark.asyncio
async def test_replace_cluster_with_bogus_entry(ring: Ring, tpl: Templates, tmp_path: Path,
                                                entry: int, op: str) -> None:
    """Overwriting, discarding or zeroing a whole cluster whose L2 entry is
    bogus needs none of the old data: as QEMU does (which drops the entry
    and leaks the old cluster, or fails). Either way the bogus offset must
    not be 'freed' into the refcounts (no refcount table grown to reach it,
    no huge file), and a success reads back."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    poke(p, lay.l2, "Q", entry)
    before = p.read_bytes()
    ours = None
    if entry == COPIED | FAR and op == "write":
        # deliberate: QEMU writes the cluster in place at 1 TiB (the file
        # grows to 1 TiB and qemu-img check then finds errors); we refuse
        ours = ["fails", "ok"]
    img, outcomes = await like_qemu(p, [BOGUS_OPS[op], OP_FLUSH],
                                    ("l2", "offset", "align", "eof"), ours=ours)
    if img is None:
        return
    await aclose(img)
    ok = outcomes == ["ok", "ok"]
    assert p.stat().st_size < 64 << 20, f"the file grew to {p.stat().st_size} bytes"
    after = p.read_bytes()
    assert_only_corrupt_bit_changed(before, after, 0, CS, "the header cluster")
    assert peek(p, RT_CLUSTERS, "I") == peek(tpl.v3, RT_CLUSTERS, "I")
    if ok:
        img = open_ok(p, read_only=True)
        buf = bytearray(CS)
        await asyncio.wait_for(img.read(0, buf), IO_TIMEOUT)
        await asyncio.wait_for(img.close(), IO_TIMEOUT)
        want = bytes([GUEST]) * CS if op == "write" else bytes(CS)
        assert bytes(buf) == want, f"the {op} succeeded but does not read back"


@pytest.mark.parametrize("table,entry", [("l1", COPIED | FAR), ("l1", COPIED | 0x40200),
                                         ("l2", COPIED | 0x50200)],
                         ids=["l1_past_eof", "l1_unaligned", "l2_unaligned"])
@pytest.mark.asyncio
async def test_concurrent_requests_on_bad_entry(ring: Ring, tpl: Templates, tmp_path: Path,
                                                table: str, entry: int) -> None:
    """Many requests at once on a bad table entry: every one fails with EIO,
    none hangs waiting for a load that failed."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    poke(p, lay.l1 if table == "l1" else lay.l2, "Q", entry)
    img = open_as_qemu_does(p, ("l1", "l2", "offset", "align", "eof"))
    if img is None:
        return
    try:
        reqs = [img.read(i * 4096, bytearray(4096)) for i in range(16)]
        reqs += [img.write(i * 4096, bytes([GUEST]) * 4096) for i in range(16)]
        try:
            results = await asyncio.wait_for(asyncio.gather(*reqs, return_exceptions=True),
                                             IO_TIMEOUT)
        except TimeoutError:
            pytest.fail(f"concurrent requests hung for {IO_TIMEOUT} s")
        for i, r in enumerate(results):
            assert isinstance(r, OSError) and r.errno == errno.EIO, \
                f"request {i}: {r!r}, expected OSError(EIO)"
    finally:
        await aclose(img)


# Deliberate differences (the last field: our outcomes of reading guest
# clusters 0 and 1, where QEMU's differ): a table or data cluster wholly past
# the end of the file is EIO (QEMU reads it as zeros: an L2 table past EOF
# makes every cluster it maps read as zeros); so is a read through an L1
# entry that points at other metadata (QEMU checks overlaps on writes only,
# and serves the refcount table's bytes as an L2 table).
READ_ONLY_CORRUPTIONS = [
    ("l1_entry_past_eof", "l1", COPIED | FAR, ["fails", "fails"]),
    ("l1_entry_unaligned", "l1", COPIED | 0x40200, None),
    ("l1_entry_onto_refcount_table", "l1", COPIED | 0x10000, ["fails", "fails"]),
    ("l2_entry_past_eof", "l2", COPIED | FAR, ["fails", "ok"]),
    ("l2_entry_unaligned", "l2", COPIED | 0x50200, None),
]


@pytest.mark.parametrize("table,entry,ours", [c[1:] for c in READ_ONLY_CORRUPTIONS],
                         ids=[c[0] for c in READ_ONLY_CORRUPTIONS])
@pytest.mark.asyncio
async def test_read_only_detection_writes_nothing(ring: Ring, tpl: Templates, tmp_path: Path,
                                                  table: str, entry: int,
                                                  ours: list[str] | None) -> None:
    """Corruption found while the image is open read-only: each read as QEMU
    does, and not a byte of the file changes (no corrupt bit either: the
    image is read-only)."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    poke(p, lay.l1 if table == "l1" else lay.l2, "Q", entry)
    before = p.read_bytes()
    ops = [op_read(0, bytearray(CS)), op_read(CS, bytearray(CS))]
    img, _ = await like_qemu(p, ops, ("l1", "l2", "offset", "align", "eof", "overlap"),
                             ours=ours, read_only=True)
    if img is not None:
        await aclose(img)
    assert p.read_bytes() == before, "a read-only image was modified"


# An L2/L1 entry with offset 0 means "unallocated" (docs/interop/qcow2.rst), so
# the header cluster can only be hit through an unaligned entry.
DATA_OVERLAPS = [
    ("header_unaligned", "header", 0x200),
    ("refcount_table", "refcount table", 0),
    ("refcount_block", "refcount block", 0),
    ("L1", "L1", 0),
    ("L2_itself", "L2", 0),
]


@pytest.mark.parametrize("target,delta", [c[1:] for c in DATA_OVERLAPS],
                         ids=[c[0] for c in DATA_OVERLAPS])
@pytest.mark.asyncio
async def test_data_cluster_overlapping_metadata(ring: Ring, tpl: Templates, tmp_path: Path,
                                                 target: str, delta: int) -> None:
    """An L2 entry (with the COPIED flag, so the write goes in place) points
    into a metadata cluster: the write fails with EIO and the metadata is
    untouched (QEMU iotest 060)."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    poke(p, lay.l2, "Q", COPIED | (metadata_clusters(p)[target] + delta))
    before = p.read_bytes()
    img = open_as_qemu_does(p, ("overlap", "metadata", "align", target.lower()))
    if img is None:
        return
    try:
        await expect_eio(img.write(0, bytes([GUEST]) * 4096), f"write over the {target}")
    finally:
        await aclose(img)
    after = p.read_bytes()
    assert_only_corrupt_bit_changed(before, after, 0, len(before), "the image")
    # what is left can still be opened for reading (e.g. to rescue data)
    img = open_ok(p, read_only=True)
    await asyncio.wait_for(img.close(), IO_TIMEOUT)
    if peek(p, INCOMPAT, "Q") & CORRUPT:
        expect_open_error(p, ("corrupt",), read_only=False)


L2_OVERLAPS = [
    # (id, target, index of the guest cluster whose 'L2 entry' is hit)
    ("refcount_table", "refcount table", 1),
    ("refcount_block", "refcount block", 8),
    ("L1_entry_1", "L1", 1),
    ("L1_onto_itself", "L1", 0),
]


@pytest.mark.parametrize("target,index", [c[1:] for c in L2_OVERLAPS],
                         ids=[c[0] for c in L2_OVERLAPS])
@pytest.mark.asyncio
async def test_l2_table_overlapping_metadata(ring: Ring, tpl: Templates, tmp_path: Path,
                                             target: str, index: int) -> None:
    """An L1 entry (COPIED) points at a metadata cluster, which is thus taken
    for an L2 table; a write to guest cluster `index` must not update that
    cluster (QEMU iotest 060, 'L2 reference into L1')."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    tgt = metadata_clusters(p)[target]
    poke(p, lay.l1, "Q", COPIED | tgt)
    entry = peek(p, tgt + 8 * index, "Q")
    assert entry == 0 or (target == "L1" and index == 0)
    before = p.read_bytes()
    words = ("overlap", "metadata", "l1", "l2", target.lower())
    if entry:       # guest cluster 0 maps onto the L1 table itself, in place
        img = open_as_qemu_does(p, words)
        if img is None:
            return
        try:
            await expect_eio(img.write(0, bytes([GUEST]) * 512), "write over the L1 table")
        finally:
            await aclose(img)
    else:
        img, _ = await like_qemu(p, [op_write(index * CS, 4096), OP_FLUSH], words)
        if img is not None:
            await aclose(img)
    after = p.read_bytes()
    assert_only_corrupt_bit_changed(before, after, 0, CS, "the header cluster")
    assert_only_corrupt_bit_changed(before, after, lay.l1, lay.l1 + CS, "the L1 table")
    assert_only_corrupt_bit_changed(before, after, lay.rt, lay.rt + CS, "the refcount table")
    e = tgt + 8 * index     # the refcount block's other bytes may change legitimately
    assert_only_corrupt_bit_changed(before, after, e, e + 8, f"the {target}")
    assert_no_guest_data_in_metadata(p)


@pytest.mark.parametrize("target", ["refcount table", "refcount block", "L1"])
@pytest.mark.asyncio
async def test_discard_then_allocate_does_not_reuse_metadata(
        ring: Ring, tpl: Templates, tmp_path: Path, target: str) -> None:
    """Guest cluster 0 claims a metadata cluster: discarding it must not make
    that cluster free for the next allocations."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    poke(p, lay.l2, "Q", COPIED | metadata_clusters(p)[target])
    before = p.read_bytes()
    ops = [op_discard(0, CS), *(op_write(i * CS, CS) for i in range(1, 4)), OP_FLUSH]
    # deliberate: QEMU frees the metadata cluster, allocates it again for the
    # next write, catches that with its overlap check, marks the image corrupt
    # and fails every later request; we never free a cluster that is metadata
    img, _ = await like_qemu(p, ops, ("overlap", "metadata", target.lower()),
                             ours=["ok"] * len(ops))
    if img is not None:
        await aclose(img)
    after = p.read_bytes()
    assert_only_corrupt_bit_changed(before, after, 0, CS, "the header cluster")
    assert_only_corrupt_bit_changed(before, after, lay.rt, lay.rt + CS, "the refcount table")
    assert_only_corrupt_bit_changed(before, after, lay.l1, lay.l1 + CS, "the L1 table")
    assert_no_guest_data_in_metadata(p)


@pytest.mark.parametrize("how", ["metadata_refcounts_zero", "refcount_table_entry_zero"])
@pytest.mark.asyncio
async def test_refcounts_claim_metadata_free(ring: Ring, tpl: Templates, tmp_path: Path,
                                             how: str) -> None:
    """Refcounts say the metadata clusters are free: allocations must not land
    on them (QEMU's overlap check catches this and marks the image corrupt)."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    meta = metadata_clusters(p)
    if how == "metadata_refcounts_zero":
        for off in meta.values():
            poke(p, lay.rb + 2 * (off // CS), "H", 0)
    else:
        poke(p, lay.rt, "Q", 0)
    before = p.read_bytes()
    bufs = {i: bytearray(CS) for i in range(1, 7)}
    ops = [*(op_write(i * CS, CS) for i in bufs), OP_FLUSH,
           *(op_read(i * CS, b) for i, b in bufs.items())]
    # deliberate: QEMU allocates the metadata clusters the refcounts call
    # free, its overlap check catches the write, marks the image corrupt and
    # fails every later request; we never allocate a cluster our metadata uses
    img, outcomes = await like_qemu(p, ops, RC, ours=["ok"] * len(ops))
    if img is None:
        return
    await aclose(img)
    assert outcomes is not None
    for (i, buf), wrote, read in zip(bufs.items(), outcomes, outcomes[len(bufs) + 1:],
                                     strict=False):
        if wrote == read == "ok":
            assert bytes(buf) == bytes([GUEST]) * CS, f"cluster {i} reads back wrong"
    after = p.read_bytes()
    assert_only_corrupt_bit_changed(before, after, 0, CS, "the header cluster")
    assert_only_corrupt_bit_changed(before, after, lay.l1, lay.l1 + CS, "the L1 table")
    if how == "metadata_refcounts_zero":
        assert_only_corrupt_bit_changed(before, after, lay.rt, lay.rt + CS,
                                        "the refcount table")
    assert_no_guest_data_in_metadata(p)


@pytest.mark.parametrize("entry", [FAR, 0x20200], ids=["past_eof", "unaligned"])
@pytest.mark.asyncio
async def test_bad_refcount_block_offset(ring: Ring, tpl: Templates, tmp_path: Path,
                                         entry: int) -> None:
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    poke(p, lay.rt, "Q", entry)
    img = open_as_qemu_does(p, RC)
    if img is None:
        return
    try:
        await expect_eio(img.write(8 * CS, bytes([GUEST]) * CS), "allocating write")
    finally:
        await aclose(img)
    assert p.stat().st_size < 64 << 20, f"the file grew to {p.stat().st_size} bytes"


TABLE_OVERLAPS = [
    # (id, header field moved, onto which cluster)
    ("l1_on_header", L1_OFFSET, "header"),
    ("l1_on_refcount_table", L1_OFFSET, "refcount table"),
    ("refcount_table_on_header", RT_OFFSET, "header"),
    ("refcount_table_on_l1", RT_OFFSET, "L1"),
]


@pytest.mark.parametrize("field_at,onto", [c[1:] for c in TABLE_OVERLAPS],
                         ids=[c[0] for c in TABLE_OVERLAPS])
@pytest.mark.asyncio
async def test_tables_overlapping_each_other(ring: Ring, tpl: Templates, tmp_path: Path,
                                             field_at: int, onto: str) -> None:
    """The header moves the L1 or refcount table onto another metadata
    cluster: refused at open (QEMU opens it, then fails the writes that would
    hit the shared cluster and marks the image corrupt)."""
    p = clone(tpl.v3, tmp_path)
    meta = metadata_clusters(p)
    poke(p, field_at, "Q", meta[onto])
    before = p.read_bytes()
    ops = [op_read(0, bytearray(4096)), op_write(CS, CS), op_write(0, 4096), OP_FLUSH]
    # deliberate: we refuse it at open; QEMU opens it and finds the overlap
    # only when a write would hit it
    await like_qemu(p, ops, ("overlap", "l1", "refcount", "header", "metadata"), refuse=True)
    after = p.read_bytes()
    assert_only_corrupt_bit_changed(before, after, 0, CS, "the header cluster")
    at = meta[onto]
    assert_only_corrupt_bit_changed(before, after, at, at + CS, f"the {onto} (shared)")
    assert_no_guest_data_in_metadata(p, meta)


@pytest.mark.asyncio
async def test_file_truncated_inside_data_cluster(ring: Ring, tpl: Templates,
                                                  tmp_path: Path) -> None:
    """The file ends 4 KiB into guest cluster 0's data (an interrupted copy):
    as QEMU does (the bytes that are there followed by zeros)."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    data = peek(p, lay.l2, "Q") & OFFSET_MASK
    truncate(p, data + 4096)
    cut, past = bytearray(CS), bytearray(4096)
    img, outcomes = await like_qemu(p, [op_read(0, cut), op_read(8192, past)], TRUNC,
                                    read_only=True)
    if img is None:
        return
    await aclose(img)
    if outcomes == ["ok", "ok"]:
        assert bytes(cut) == bytes([PATTERN]) * 4096 + bytes(CS - 4096), \
            "a cut cluster must read as its bytes, then zeros"
        assert bytes(past) == bytes(4096)


# snapshot table entry (docs/interop/qcow2.rst): l1 offset, l1 size, id size,
# name size, date, date ns, vm clock, vm state size, extra data size
SN_L1_OFFSET, SN_L1_SIZE, SN_ID_SIZE, SN_NAME_SIZE, SN_EXTRA_SIZE = 0, 8, 12, 14, 36

# The last field: None, as QEMU does (which refuses the last two at open);
# "refuse", deliberately refused at open where QEMU opens (a snapshot L1 that
# is unaligned or larger than the disk needs: QEMU fails only when the
# snapshot is used); or our outcomes where they deliberately differ (a
# 64 KiB name or id makes the table cover guest cluster 0's data: requests on
# a cluster that overlaps metadata are EIO, reads too; QEMU checks overlaps on
# writes only).
SNAP_OVERLAP = ["fails", "fails", "fails", "ok"]
SNAPSHOT_CASES: list[tuple[str, list[tuple[int | None, str, int]], Any]] = [
    # (id, pokes relative to the snapshot table (None: absolute header field), ours)
    ("l1_unaligned", [(SN_L1_OFFSET, "Q", 0x400200)], "refuse"),
    ("l1_size_huge", [(SN_L1_SIZE, "I", 0x1000_0000)], "refuse"),
    ("l1_past_eof", [(SN_L1_OFFSET, "Q", FAR)], None),
    ("l1_onto_active_l1", [(SN_L1_OFFSET, "Q", 0x30000)], None),
    ("name_size_max", [(SN_NAME_SIZE, "H", 0xFFFF)], SNAP_OVERLAP),
    ("id_size_max", [(SN_ID_SIZE, "H", 0xFFFF)], SNAP_OVERLAP),
    ("count_2", [(None, "I", 2)], None),
    ("extra_data_size_max", [(SN_EXTRA_SIZE, "I", 0xFFFF_FFFF)], None),
    ("count_max_at_eof", [(None, "I", 0xFFFF)], None),
]


@pytest.mark.parametrize("pokes,ours", [c[1:] for c in SNAPSHOT_CASES],
                         ids=[c[0] for c in SNAPSHOT_CASES])
@pytest.mark.asyncio
async def test_snapshot_table_malformed(ring: Ring, tpl: Templates, tmp_path: Path,
                                        pokes: list[tuple[int | None, str, int]],
                                        ours: Any) -> None:
    """A bad internal-snapshot table (QEMU iotest 080): refused with a message
    naming the snapshot table, or each request as QEMU does, and nothing the
    snapshot owns is overwritten. A table that runs past the end of the file
    is refused (QEMU too)."""
    p = clone(tpl.snap, tmp_path)
    table = peek(p, SNAPSHOTS_OFFSET, "Q")
    for off, fmt_, val in pokes:
        poke(p, NB_SNAPSHOTS if off is None else table + off, fmt_, val)
    before = p.read_bytes()
    snap_only = [c for c in range(0, len(before), CS)
                 if before[c:c + CS] == bytes([PATTERN]) * CS]
    assert len(snap_only) == 1, "template: the snapshot's copy of cluster 0 not found"
    buf = bytearray(4096)
    ops = [op_read(0, buf), op_write(0, CS), op_write(2 * CS, CS), OP_FLUSH]
    img, outcomes = await like_qemu(p, ops, ("snapshot",), refuse=ours == "refuse",
                                    ours=None if ours == "refuse" else ours)
    if img is None:
        return
    await aclose(img)
    if outcomes and outcomes[0] == "ok":
        assert bytes(buf) == bytes([SNAP_NEW]) * 4096
    after = p.read_bytes()
    assert_only_corrupt_bit_changed(before, after, 0, CS, "the header cluster")
    assert_only_corrupt_bit_changed(before, after, table, table + 512, "the snapshot table")
    c = snap_only[0]
    assert_only_corrupt_bit_changed(before, after, c, c + CS, "the snapshot's data cluster")


ZERO = 1     # L2 entry, standard cluster: reads as zeros (v3)

ZERO_ALLOC_CASES = [
    ("past_eof", FAR),
    ("unaligned", 0x50200),
    ("on_L1", 0x30000),
    ("on_refcount_table", 0x10000),
    ("on_refcount_block", 0x20000),
]


@pytest.mark.parametrize("host", [c[1] for c in ZERO_ALLOC_CASES],
                         ids=[c[0] for c in ZERO_ALLOC_CASES])
@pytest.mark.asyncio
async def test_zero_cluster_with_bogus_preallocation(ring: Ring, tpl: Templates,
                                                     tmp_path: Path, host: int) -> None:
    """A zero-flagged L2 entry (COPIED, so its host cluster counts as
    preallocated and could be written in place) whose offset is bogus: reads
    and a partial write as QEMU does (zeros; the write goes elsewhere, or
    fails); never a write over metadata or a huge file.

    Deliberate, but past EOF: QEMU reads an unaligned preallocation as
    corruption, and writes in place over the metadata one points at (its
    overlap check then marks the image corrupt and fails the rest); we read
    a zero cluster as zeros whatever its offset and give a write to it a
    fresh cluster."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    meta = metadata_clusters(p)
    poke(p, lay.l2, "Q", COPIED | host | ZERO)
    before = p.read_bytes()
    first, back = bytearray(CS), bytearray(CS)
    ops = [op_read(0, first), op_write(512, 4096), OP_FLUSH, op_read(0, back)]
    img, outcomes = await like_qemu(p, ops, ("l2", "offset", "align", "eof", "overlap",
                                             "metadata"),
                                    ours=None if host == FAR else ["ok"] * len(ops))
    if img is None:
        return
    await aclose(img)
    assert outcomes is not None
    if outcomes[0] == "ok":
        assert bytes(first) == bytes(CS), "a zero cluster must read as zeros"
    if outcomes[1] == outcomes[3] == "ok":
        assert bytes(back) == bytes(512) + bytes([GUEST]) * 4096 + bytes(CS - 4608)
    assert p.stat().st_size < 64 << 20, f"the file grew to {p.stat().st_size} bytes"
    after = p.read_bytes()
    assert_only_corrupt_bit_changed(before, after, 0, CS, "the header cluster")
    assert_only_corrupt_bit_changed(before, after, lay.rt, lay.rt + CS, "the refcount table")
    assert_only_corrupt_bit_changed(before, after, lay.l1, lay.l1 + CS, "the L1 table")
    assert_no_guest_data_in_metadata(p, meta)


@pytest.mark.parametrize("target", ["L1", "L2"])
@pytest.mark.asyncio
async def test_refcount_block_overlapping_metadata(ring: Ring, tpl: Templates,
                                                   tmp_path: Path, target: str) -> None:
    """The refcount table's entry 0 points at the L1 or an L2 table, so those
    entries are taken for refcounts: an allocating write cannot record its
    refcount without overwriting them, so it (or the flush) fails with EIO,
    and the table is untouched."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    meta = metadata_clusters(p)
    poke(p, lay.rt, "Q", meta[target])
    before = p.read_bytes()
    # deliberate, for L1: refcount blocks are written back at FLUSH, so we
    # find the overlap there; QEMU writes refcounts with the allocation and
    # fails the write
    img, outcomes = await like_qemu(p, [op_write(4 * CS, CS), OP_FLUSH],
                                    ("refcount", "overlap", "metadata", target.lower()),
                                    ours=["ok", "fails"] if target == "L1" else None)
    if img is None:
        return
    await aclose(img)
    assert outcomes != ["ok", "ok"], \
        "an allocation was recorded in a refcount block that is not one"
    after = p.read_bytes()
    assert_only_corrupt_bit_changed(before, after, 0, CS, "the header cluster")
    at = meta[target]
    assert_only_corrupt_bit_changed(before, after, at, at + CS, f"the {target} table")
    assert_no_guest_data_in_metadata(p, meta)


# ---------------------------------------------------------------- compressed clusters

COMPRESSED_KINDS = ["zlib", "zstd"]


def compressed_image(tpl: Templates, tmp_path: Path, kind: str) -> tuple[Path, int, int]:
    """A copy of a compressed template: (path, L2 entry offset, entry)."""
    src = getattr(tpl, kind)
    if src is None:
        missing_tool(f"qemu-img cannot make {kind} images")
    p = clone(src, tmp_path)
    lay = Layout.of(p)
    entry = peek(p, lay.l2, "Q")
    assert entry & COMPRESSED, "template cluster 0 is not compressed"
    off, sectors = compressed_fields(entry)
    assert sectors >= 8, "template compressed data too small for the test"
    return p, lay.l2, entry


def test_missing_zstd_fails_under_ci(tpl: Templates, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A qemu-img without zstd skips the zstd cases on a developer's machine,
    but CI (CI=true) must have it: there the same gap fails."""
    no_zstd = Templates(**{**tpl.__dict__, "zstd": None})
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="zstd"):
        compressed_image(no_zstd, tmp_path, "zstd")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="zstd"):
        compressed_image(no_zstd, tmp_path, "zstd")


def garbage(kind: str, n: int) -> bytes:
    if kind == "ff":
        return b"\xff" * n              # deflate: reserved block type; zstd: bad magic
    rnd = random.Random(99)
    g = bytes(rnd.getrandbits(8) for _ in range(n))
    try:                                # precondition: not a valid raw deflate stream
        out = zlib.decompressobj(-15).decompress(g, CS)
        assert len(out) < CS
    except zlib.error:
        pass
    return g


@pytest.mark.parametrize("kind", COMPRESSED_KINDS)
@pytest.mark.asyncio
async def test_compressed_past_eof(ring: Ring, tpl: Templates, tmp_path: Path,
                                   kind: str) -> None:
    p, l2e, entry = compressed_image(tpl, tmp_path, kind)
    _, sectors = compressed_fields(entry)
    poke(p, l2e, "Q", compressed_entry(FAR + 1234, sectors))
    img = open_as_qemu_does(p, ("compress",), read_only=True)
    if img is None:
        return
    try:
        await expect_eio(img.read(0, bytearray(CS)), "read of the compressed cluster")
        await expect_eio(img.read(4096, bytearray(512)), "partial read")
    finally:
        await aclose(img)


@pytest.mark.parametrize("junk", ["ff", "random"])
@pytest.mark.parametrize("kind", COMPRESSED_KINDS)
@pytest.mark.asyncio
async def test_compressed_garbage(ring: Ring, tpl: Templates, tmp_path: Path, kind: str,
                                  junk: str) -> None:
    p, l2e, entry = compressed_image(tpl, tmp_path, kind)
    off, sectors = compressed_fields(entry)
    length = (sectors + 1) * 512 - (off & 511)
    poke(p, off, f"{length}s", garbage(junk, length))
    img = open_ok(p)
    try:
        await expect_eio(img.read(0, bytearray(CS)), "read of the compressed cluster")
        await expect_eio(img.read(CS - 512, bytearray(512)), "read of its last sector")
        await expect_eio(img.write(512, bytes([GUEST]) * 512),
                         "partial write (needs the old data)")
    finally:
        await aclose(img)
    assert peek(p, l2e, "Q") == entry, "a failed write changed the L2 entry"


@pytest.mark.parametrize("kind", COMPRESSED_KINDS)
@pytest.mark.asyncio
async def test_compressed_truncated(ring: Ring, tpl: Templates, tmp_path: Path,
                                    kind: str) -> None:
    """The descriptor says the data ends in its first sector; whatever follows
    it in the file is junk."""
    p, l2e, entry = compressed_image(tpl, tmp_path, kind)
    off, sectors = compressed_fields(entry)
    end = (off | 511) + 1
    tail = (sectors + 1) * 512 - (off & 511) - (end - off)
    poke(p, end, f"{tail}s", b"\xff" * tail)
    poke(p, l2e, "Q", compressed_entry(off, 0))
    img = open_ok(p, read_only=True)
    try:
        await expect_eio(img.read(0, bytearray(CS)), "read of the truncated cluster")
    finally:
        await aclose(img)


def deflate(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize("produces", ["short", "long"])
@pytest.mark.asyncio
async def test_compressed_wrong_length(ring: Ring, tpl: Templates, tmp_path: Path,
                                       produces: str) -> None:
    """A valid deflate stream of the wrong size: a stream that ends before a
    full cluster is EIO; a longer one reads as its first cluster (as QEMU
    does)."""
    p, l2e, entry = compressed_image(tpl, tmp_path, "zlib")
    off, _ = compressed_fields(entry)
    plain = tpl.compressed_data[:1000] if produces == "short" else \
        tpl.compressed_data + b"overflow" * 1000
    stream = deflate(plain)
    poke(p, off, f"{len(stream)}s", stream)
    poke(p, l2e, "Q", compressed_entry(off, (len(stream) + (off & 511) - 1) // 512))
    buf = bytearray(CS)
    img, outcomes = await like_qemu(p, [op_read(0, buf)], ("compress",), read_only=True)
    assert img is not None
    await aclose(img)
    assert outcomes == (["fails"] if produces == "short" else ["ok"])
    if produces == "long":
        assert bytes(buf) == tpl.compressed_data


@pytest.mark.asyncio
async def test_compressed_straddling_eof(ring: Ring, tpl: Templates, tmp_path: Path) -> None:
    """The descriptor's sector count runs past EOF but the stream itself is
    complete: EIO (QEMU reads the missing part as zeros, so the data)."""
    p, l2e, entry = compressed_image(tpl, tmp_path, "zlib")
    off, sectors = compressed_fields(entry)
    max_sectors = (1 << (62 - (62 - 8))) - 1
    poke(p, l2e, "Q", compressed_entry(off, max_sectors))
    assert off + (max_sectors + 1) * 512 > p.stat().st_size
    buf = bytearray(CS)
    # deliberate: a descriptor that runs past the end of the file is EIO;
    # QEMU reads the part past EOF as zeros (here the stream is complete)
    img, outcomes = await like_qemu(p, [op_read(0, buf)], ("compress",), ours=["fails"],
                                    read_only=True)
    assert img is not None
    await aclose(img)


@pytest.mark.asyncio
async def test_compressed_garbage_concurrent(ring: Ring, tpl: Templates,
                                            tmp_path: Path) -> None:
    p, l2e, entry = compressed_image(tpl, tmp_path, "zlib")
    off, sectors = compressed_fields(entry)
    length = (sectors + 1) * 512 - (off & 511)
    poke(p, off, f"{length}s", garbage("ff", length))
    img = open_ok(p, read_only=True)
    try:
        reqs = [img.read(i * 4096, bytearray(4096)) for i in range(16)]
        try:
            results = await asyncio.wait_for(asyncio.gather(*reqs, return_exceptions=True),
                                             IO_TIMEOUT)
        except TimeoutError:
            pytest.fail(f"concurrent reads hung for {IO_TIMEOUT} s")
        for i, r in enumerate(results):
            assert isinstance(r, OSError) and r.errno == errno.EIO, \
                f"read {i}: {r!r}, expected OSError(EIO)"
    finally:
        await aclose(img)


# ---------------------------------------------------------------- backing chains


@pytest.mark.parametrize("read_only", [False, True], ids=["rw", "ro"])
def test_backing_missing(tmp_path: Path, read_only: bool) -> None:
    p = qcreate(tmp_path, "top.qcow2", "no-such-base.qcow2")
    expect_open_error(p, ("backing", "no-such-base"), read_only=read_only)


@pytest.mark.parametrize("read_only", [False, True], ids=["rw", "ro"])
def test_backing_loop(tmp_path: Path, read_only: bool) -> None:
    qcreate(tmp_path, "b.qcow2", "a.qcow2")
    a = qcreate(tmp_path, "a.qcow2", "b.qcow2")
    expect_open_error(a, BK + ("loop", "cycle", "chain", "recurs"), read_only=read_only)


def test_backing_self_loop(tmp_path: Path) -> None:
    a = qcreate(tmp_path, "a.qcow2", "x.qcow2")     # qemu-img refuses a.qcow2 itself
    name_at = peek(a, BACKING_OFFSET, "Q")
    assert peek(a, BACKING_SIZE, "I") == 7
    poke(a, name_at, "7s", b"a.qcow2")
    expect_open_error(a, BK + ("loop", "cycle", "chain", "recurs"), read_only=True)


def test_backing_three_loop(tmp_path: Path) -> None:
    qcreate(tmp_path, "c.qcow2", "a.qcow2")
    qcreate(tmp_path, "b.qcow2", "c.qcow2")
    a = qcreate(tmp_path, "a.qcow2", "b.qcow2")
    expect_open_error(a, BK + ("loop", "cycle", "chain", "recurs"), read_only=True)


def test_backing_malformed(tmp_path: Path) -> None:
    """A malformed image further down the chain is reported as a Qcow2Error too."""
    base = qcreate(tmp_path, "base.qcow2")
    poke(base, CLUSTER_BITS, "I", 64)
    top = qcreate(tmp_path, "top.qcow2", "base.qcow2")
    expect_open_error(top, BK + ("cluster",), read_only=True)


def test_backing_loop_through_symlink(tmp_path: Path) -> None:
    a = qcreate(tmp_path, "a.qcow2", "b.qcow2")
    (tmp_path / "b.qcow2").symlink_to("a.qcow2")
    expect_open_error(a, BK + ("loop", "cycle", "chain", "recurs"), read_only=True)


def test_backing_loop_through_other_spelling(tmp_path: Path) -> None:
    a = qcreate(tmp_path, "a.qcow2", "./b.qcow2")
    poke(a, peek(a, BACKING_OFFSET, "Q"), "9s", b"./a.qcow2")
    expect_open_error(a, BK + ("loop", "cycle", "chain", "recurs"), read_only=True)


@pytest.mark.parametrize("fmt", ["raw", "qcow2"])
def test_backing_is_a_directory(tmp_path: Path, fmt: str) -> None:
    (tmp_path / "dir").mkdir()
    top = qcreate(tmp_path, "top.qcow2", "dir", fmt)
    expect_open_error(top, BK + ("dir", "regular file"), read_only=True)


def test_backing_format_unsupported(tmp_path: Path) -> None:
    qcreate(tmp_path, "base.qcow2")
    top = qcreate(tmp_path, "top.qcow2", "base.qcow2", "vmdk")
    expect_open_error(top, BK + ("vmdk", "format"), read_only=True)


DEPTH = 300


@pytest.mark.asyncio
async def test_backing_chain_very_deep(ring: Ring, tmp_path: Path) -> None:
    """A valid chain of 300 images: it opens and reads through (or is refused
    with a Qcow2Error); never a RecursionError or another crash."""
    base = tmp_path / "l000.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", base, "1M")
    run("qemu-io", "-f", "qcow2", "-c", f"write -q -P {PATTERN:#x} 0 512", base)
    level = tmp_path / "level.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", "-u", "-b",
        "l999.qcow2", "-F", "qcow2", level, "1M", cwd=tmp_path)
    raw = bytearray(level.read_bytes())
    name_at = struct.unpack_from(">Q", raw, BACKING_OFFSET)[0]
    for i in range(1, DEPTH + 1):
        raw[name_at:name_at + 10] = f"l{i - 1:03d}.qcow2".encode()
        (tmp_path / f"l{i:03d}.qcow2").write_bytes(raw)
    top = tmp_path / f"l{DEPTH:03d}.qcow2"
    img, exc = open_in_thread(top, read_only=True)
    if exc is not None:
        check_message(exc, BK + ("chain", "deep", "depth"), "open of a deep chain")
        return
    try:
        buf = bytearray(1024)
        await asyncio.wait_for(img.read(0, buf), IO_TIMEOUT)
        assert bytes(buf) == bytes([PATTERN]) * 512 + bytes(512)
    finally:
        await asyncio.wait_for(img.close(), IO_TIMEOUT)


BACKING_NAMES = [
    ("invalid_utf8", b"\xff\xfe\xfd\xfc.qcow2"),
    ("nul_byte", b"xx\x00xxxx.qcow2"),
    ("newline", b"evil\nname.img"),
    ("control_chars", b"\x1b[2J\r\x07.qcow2"),
]


@pytest.mark.parametrize("name", [c[1] for c in BACKING_NAMES], ids=[c[0] for c in BACKING_NAMES])
def test_backing_name_odd_bytes(tmp_path: Path, name: bytes) -> None:
    """The backing file name comes from the image: odd bytes in it give a
    Qcow2Error whose message is still one line (no UnicodeError, no
    ValueError for a NUL, no raw newline in the message)."""
    top = qcreate(tmp_path, "top.qcow2", "x" * len(name))
    poke(top, peek(top, BACKING_OFFSET, "Q"), f"{len(name)}s", name)
    expect_open_error(top, BK + ("not exist", "no such", "not found"), read_only=True)


def test_backing_name_empty(tmp_path: Path) -> None:
    """backing_file_offset set, backing_file_size 0: no backing file (as QEMU
    reads it), or a Qcow2Error; nothing else."""
    top = qcreate(tmp_path, "top.qcow2", "base.qcow2")
    poke(top, BACKING_SIZE, "I", 0)
    img, exc = open_in_thread(top, read_only=True)
    if exc is not None:
        check_message(exc, BK, "open with an empty backing name")
    else:
        _close_quietly(img)


# ---------------------------------------------------------------- what is NOT an error


@pytest.mark.asyncio
async def test_unknown_compatible_and_autoclear_bits(ring: Ring, tpl: Templates,
                                                     tmp_path: Path) -> None:
    """Unknown compatible bits and unknown header extensions are ignored;
    unknown autoclear bits are cleared before the image is written
    (docs/interop/qcow2.rst). Not every odd header is malformed."""
    p = clone(tpl.v3, tmp_path)
    poke(p, COMPAT, "Q", 1 << 40)
    poke(p, AUTOCLEAR, "Q", 1 << 33)
    img = open_ok(p)
    try:
        buf = bytearray(CS)
        await asyncio.wait_for(img.read(0, buf), IO_TIMEOUT)
        assert bytes(buf) == bytes([PATTERN]) * CS
        await asyncio.wait_for(img.write(CS, bytes([GUEST]) * CS), IO_TIMEOUT)
        await asyncio.wait_for(img.flush(), IO_TIMEOUT)
        assert peek(p, AUTOCLEAR, "Q") & (1 << 33) == 0, \
            "an unknown autoclear bit survived a write"
    finally:
        await asyncio.wait_for(img.close(), IO_TIMEOUT)
    assert peek(p, COMPAT, "Q") == 1 << 40
    assert peek(p, AUTOCLEAR, "Q") & (1 << 33) == 0
    run("qemu-img", "check", "-q", p)


@pytest.mark.parametrize("bit", [DIRTY, CORRUPT], ids=["dirty", "corrupt"])
@pytest.mark.asyncio
async def test_flagged_backing_is_only_read(ring: Ring, tmp_path: Path, bit: int) -> None:
    """A dirty or corrupt *backing* file does not stop a read-write top: the
    backing is only ever read (QEMU opens it read-only), and stays untouched."""
    base = qcreate(tmp_path, "base.qcow2")
    run("qemu-io", "-f", "qcow2", "-c", f"write -q -P {PATTERN:#x} 0 {CS}", base)
    poke(base, INCOMPAT, "Q", bit)
    top = qcreate(tmp_path, "top.qcow2", "base.qcow2")
    before = base.read_bytes()
    img = open_ok(top)
    try:
        buf = bytearray(CS)
        await asyncio.wait_for(img.read(0, buf), IO_TIMEOUT)
        assert bytes(buf) == bytes([PATTERN]) * CS
        await asyncio.wait_for(img.write(512, bytes([GUEST]) * 512), IO_TIMEOUT)
        await asyncio.wait_for(img.flush(), IO_TIMEOUT)
    finally:
        await asyncio.wait_for(img.close(), IO_TIMEOUT)
    assert base.read_bytes() == before, "the backing file was modified"


@pytest.mark.parametrize("how", ["shrunk", "patched"])
@pytest.mark.asyncio
async def test_l1_larger_than_needed_is_valid(ring: Ring, tpl: Templates, tmp_path: Path,
                                              how: str) -> None:
    """An L1 table longer than the virtual size needs is not malformed: QEMU
    keeps l1_size on `qemu-img resize --shrink` (and snapshots' VM state lives
    past the disk). Only an L1 table over QEMU's 32 MiB limit, or one that
    does not fit the file, is refused (test_open_refused)."""
    if how == "shrunk":
        p = tmp_path / "shrunk.qcow2"
        run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", p, "128M")
        run("qemu-io", "-f", "qcow2", "-c", f"write -q -P {PATTERN:#x} 0 4096", p)
        run("qemu-img", "resize", "-q", "--shrink", p, "64M")
        assert peek(p, L1_SIZE, "I") > (64 << 20) // (4096 * 512)
    else:
        p = clone(tpl.v3, tmp_path)
        poke(p, L1_SIZE, "I", CS // 8)
    img = open_ok(p)
    try:
        assert img.size == 64 << 20
        buf = bytearray(4096)
        await asyncio.wait_for(img.read(0, buf), IO_TIMEOUT)
        assert bytes(buf) == bytes([PATTERN]) * 4096
        await asyncio.wait_for(img.write(img.size - 4096, bytes([GUEST]) * 4096), IO_TIMEOUT)
        await asyncio.wait_for(img.read(img.size - 4096, buf), IO_TIMEOUT)
        assert bytes(buf) == bytes([GUEST]) * 4096
    finally:
        await asyncio.wait_for(img.close(), IO_TIMEOUT)
    run("qemu-img", "check", "-q", p)


@pytest.mark.asyncio
async def test_allocation_skips_l2_table_past_eof(ring: Ring, tmp_path: Path) -> None:
    """An L1 entry points at the first cluster past the end of the file, which
    the open records as an L2 table: allocating writes elsewhere must never
    put guest data there (an access through that entry would then take it
    for a table). QEMU allocates that cluster (its refcount is 0), its
    overlap check catches the write, marks the image corrupt and fails it;
    we never allocate a cluster a table points to, so the writes succeed."""
    p = tmp_path / "img.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", p, "1G")  # two L1 entries
    run("qemu-io", "-f", "qcow2", "-c", f"write -q -P {PATTERN:#x} 0 {CS}", p)
    lay = Layout.of(p)
    far = -(-lay.size // CS) * CS  # the first cluster past the end of the file
    poke(p, lay.l1 + 8, "Q", COPIED | far)
    img = open_ok(p)
    try:
        bufs = {i: bytes([GUEST - i]) * CS for i in range(1, 4)}
        for i, data in bufs.items():
            await asyncio.wait_for(img.write(i * CS, data), IO_TIMEOUT)
        await asyncio.wait_for(img.flush(), IO_TIMEOUT)
        for i, data in bufs.items():
            buf = bytearray(CS)
            await asyncio.wait_for(img.read(i * CS, buf), IO_TIMEOUT)
            assert bytes(buf) == data, f"cluster {i} reads back wrong"
    finally:
        await aclose(img)
    table = p.read_bytes()[far:far + CS]
    for i in bufs:
        assert bytes([GUEST - i]) * 512 not in table, \
            f"guest cluster {i} was written over the L2 table the L1 table points to"


@pytest.mark.asyncio
async def test_allocating_write_checks_overlap(ring: Ring, tpl: Templates, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Defence in depth: should allocation ever hand out a metadata cluster
    (here it is made to return the L1 table's), the allocating write refuses
    it as the in-place one does: EIO, the image marked corrupt, the table
    untouched."""
    p = clone(tpl.v3, tmp_path)
    lay = Layout.of(p)
    before = p.read_bytes()
    img = open_ok(p)

    async def bad_alloc(n: int, meta: int | None = None) -> tuple[int, bool]:
        return lay.l1 // CS, False
    monkeypatch.setattr(img.refs, "alloc", bad_alloc)
    try:
        await expect_eio(img.write(CS, bytes([GUEST]) * CS), "write")
        assert img.corrupt, "the image was not marked corrupt"
    finally:
        await aclose(img)
    after = p.read_bytes()
    assert_only_corrupt_bit_changed(before, after, lay.l1, lay.l1 + CS, "the L1 table")
    assert_no_guest_data_in_metadata(p)
