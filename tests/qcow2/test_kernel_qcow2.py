"""The qcow2 target against the real driver, through the CLI, checked by
QEMU's own tools: fio verify (empty image and over a compressed backing
file), the exact bytes written reaching the image (`qemu-img compare`
against a raw file built by the test), ext4, read-only serving of a backing
chain, kill -9 of the server in the middle of writes (`qemu-img check`
finds leaks at worst, never corruption, and flushed data survives), and the
C data plane serving clusters while discards, write-zeroes and rewrites
change the mappings of the same clusters and L2 table."""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import random
import shutil
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aioublk.errors import UblkError
from aioublk.io import locking
from tests.support import kernel
from tests.support.kernel import add, delete, run, start_server, tail

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

KiB = 1 << 10
MiB = 1 << 20
BLKZEROOUT = 0x127F  # _IO(0x12, 127)
BLKDISCARD = 0x1277  # _IO(0x12, 119)


# ------------------------------------------------------------------ images --

def qemu_img(*args: str, check: bool = True,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["qemu-img", *args], capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    if check and p.returncode != 0:
        raise AssertionError(f"qemu-img {' '.join(args)} failed ({p.returncode}): "
                             f"{(p.stdout + p.stderr).strip()}")
    return p


def create(path: Path, size: int | None = None, *, backing: Path | None = None,
           backing_fmt: str = "qcow2", cluster_size: int | None = None,
           extended_l2: bool = False) -> Path:
    """``qemu-img create -f qcow2``, optionally over a backing file."""
    args = ["create", "-q", "-f", "qcow2"]
    if cluster_size:
        args += ["-o", f"cluster_size={cluster_size}"]
    if extended_l2:
        args += ["-o", "extended_l2=on"]
    if backing is not None:
        args += ["-b", str(backing.absolute()), "-F", backing_fmt]
    args.append(str(path))
    if size is not None:
        args.append(str(size))
    qemu_img(*args)
    return path


def raw_file(path: Path, size: int, extents: Iterable[tuple[int, bytes]]) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, body in extents:
            f.seek(off)
            f.write(body)
    return path


def data(seed: int, n: int) -> bytes:
    """``n`` deterministic pseudo-random bytes: every block is distinct, so
    data at a wrong offset never passes for the right data."""
    return random.Random(seed).randbytes(n)


def compressible(seed: int, n: int) -> bytes:
    """Like ``data`` but one random byte in 16: ``qemu-img convert -c``
    stores compressed clusters only where compression gains space."""
    out = bytearray(n)
    out[::16] = data(seed, len(range(0, n, 16)))
    return bytes(out)


def check_image(img: Path) -> tuple[int, dict[str, Any], str]:
    """``qemu-img check``: exit status (0 clean, 1 check failed, 2 corrupt,
    3 leaks only), its JSON report (without the zero counts qemu leaves out),
    and its text for messages. Waits for a killed server's last I/O first
    (its image lock goes with it)."""
    locking.wait_released(str(img))
    p = qemu_img("check", "--output=json", str(img), check=False)
    try:
        report = json.loads(p.stdout)
    except json.JSONDecodeError:
        report = {}
    return p.returncode, report, (p.stdout + p.stderr).strip()


def assert_clean(img: Path) -> None:
    rc, _, text = check_image(img)
    assert rc == 0, f"qemu-img check {img.name} exited {rc}:\n{text}"


def assert_same(img: Path, raw: Path) -> None:
    """QEMU reads from the image exactly the bytes of the raw file."""
    p = qemu_img("compare", "-f", "qcow2", "-F", "raw", str(img), str(raw), check=False)
    assert p.returncode == 0, (f"qemu-img compare {img.name} {raw.name} exited "
                               f"{p.returncode}: {(p.stdout + p.stderr).strip()}")


def first_difference(got: bytes | bytearray, want: bytes | bytearray) -> int | None:
    if got == want:
        return None
    n = min(len(got), len(want))
    step = MiB
    for start in range(0, n, step):
        if got[start:start + step] != want[start:start + step]:
            for i in range(start, min(start + step, n), 512):
                if got[i:i + 512] != want[i:i + 512]:
                    return i + next(j for j in range(512) if got[i + j] != want[i + j])
    return n


def assert_bytes(got: bytes | bytearray, want: bytes | bytearray, what: str,
                 base: int = 0) -> None:
    diff = first_difference(got, want)
    if diff is not None:
        raise AssertionError(
            f"{what}: {len(got)} bytes read, {len(want)} expected, first difference at "
            f"offset {base + diff} (0x{base + diff:x}): got {bytes(got[diff:diff + 16]).hex()} "
            f"want {bytes(want[diff:diff + 16]).hex()}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------- O_DIRECT block I/O --

def pwrite_direct(fd: int, body: bytes, offset: int) -> None:
    buf = mmap.mmap(-1, len(body))  # page aligned, as O_DIRECT wants
    try:
        buf[:] = body
        assert os.pwrite(fd, buf, offset) == len(body)
    finally:
        buf.close()


def pread_direct(fd: int, offset: int, length: int) -> bytes:
    buf = mmap.mmap(-1, MiB)
    parts = []
    try:
        done = 0
        while done < length:
            n = min(MiB, length - done)
            view = memoryview(buf)[:n]
            got = os.preadv(fd, [view], offset + done)
            view.release()
            assert got == n, f"short read at {offset + done}: {got} of {n}"
            parts.append(buf[:n])
            done += n
    finally:
        buf.close()
    return b"".join(parts)


def read_device(blk: str, offset: int, length: int) -> bytes:
    fd = os.open(blk, os.O_RDONLY | os.O_DIRECT)
    try:
        return pread_direct(fd, offset, length)
    finally:
        os.close(fd)


def write_device(blk: str, extents: Iterable[tuple[int, bytes]]) -> None:
    """O_DIRECT writes, then fsync: the block layer sends a flush."""
    fd = os.open(blk, os.O_WRONLY | os.O_DIRECT)
    try:
        for off, body in extents:
            pwrite_direct(fd, body, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def fio_jobs(blk: str, cwd: Path, *args: str, timeout: float = 300) -> list[dict[str, object]]:
    """fio with every job's report checked (kernel.fio looks at the first only)."""
    cmd = ["fio", "--name=q", f"--filename={blk}", "--ioengine=io_uring", "--direct=1",
           "--output-format=json", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"fio failed ({p.returncode}): {p.stderr.strip()}\n{p.stdout}"
    jobs: list[dict[str, object]] = json.loads(p.stdout[p.stdout.index("{"):])["jobs"]
    for job in jobs:
        assert job["error"] == 0, job
    return jobs


def queue_cpus(dev: kernel.DevListing) -> list[str]:
    """One CPU per queue (``list`` shows each queue's first CPU): fio jobs
    pinned to them submit through different queues, so different server
    threads allocate clusters in the same L2 table at once."""
    return [a.split()[0] for a in dev.affinity if a.split()]


def cross_queue_args(dev: kernel.DevListing) -> list[str]:
    cpus = queue_cpus(dev)
    if len(set(cpus)) < 2:
        return []
    return [f"--cpus_allowed={','.join(cpus)}", "--cpus_allowed_policy=split"]


# ------------------------------------------------------------------- tests --

FIO_SIZE, FIO_SPAN = 256 * MiB, 48 * MiB  # the disk, and what is checked around fio's range


@pytest.fixture(scope="module")
def zstd_base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """A zstd-compressed qcow2 holding data in its first FIO_SPAN bytes,
    shared (read-only) by the tests that put an overlay on it."""
    d = tmp_path_factory.mktemp("zstd-base")
    body = compressible(3, FIO_SPAN)
    raw = raw_file(d / "base.raw", FIO_SIZE, [(0, body)])
    base = d / "base.qcow2"
    qemu_img("convert", "-c", "-f", "raw", "-O", "qcow2", "-o", "compression_type=zstd",
             str(raw), str(base))
    raw.unlink()
    assert check_image(base)[1].get("compressed-clusters", 0) > 0
    return base, body


# every queue count on both queue paths, each copy mode (qcow2 takes copy
# and -u) on every count: each queue has its own worker, sharing one engine
FIO_SHAPES = [
    ("empty", ["-b", "-q", "1"]), ("empty", ["--no-batch", "-q", "1", "-u"]),
    ("empty", ["-b", "-q", "2", "-u"]), ("empty", ["--no-batch", "-q", "2"]),
    ("empty", ["-b", "-q", "4"]), ("empty", ["--no-batch", "-q", "4", "-u"]),
    ("zstd-backing", ["-b", "-q", "2"]), ("zstd-backing", ["--no-batch", "-q", "2"]),
    # subclusters: C serves whole clusters, Python the partly allocated ones
    ("extl2-backing", ["-b", "-q", "2"]),
]


@pytest.mark.parametrize(("image", "args"), FIO_SHAPES,
                         ids=[f"{i} {' '.join(a)}" for i, a in FIO_SHAPES])
def test_fio_verify(image: str, args: list[str], tmp_path: Path,
                    request: pytest.FixtureRequest) -> None:
    """Two fio jobs, pinned to different queues where there are several,
    write and verify 16 MiB each: their ranges start and meet mid-cluster,
    and over a backing file every first write to a cluster is partial
    (copy-on-write from compressed clusters; with extended L2 the image
    starts with clusters whose subclusters differ). The bytes around them
    must still be the backing file's."""
    size, span = FIO_SIZE, FIO_SPAN
    around = bytes(span)
    allow: list[str] = []
    if image == "empty":
        img = create(tmp_path / "disk.qcow2", size)
    else:
        base, around = request.getfixturevalue("zstd_base")
        img = tmp_path / "top.qcow2"
        if image == "extl2-backing":
            qemu_img("create", "-q", "-f", "qcow2", "-o", "extended_l2=on", "-b", str(base),
                     "-F", "qcow2", str(img))
            # partly allocated clusters inside fio's range, which it overwrites
            run("qemu-io", "-f", "qcow2", "-c", "write -P 5 9M 2k", "-c", "write -z 10M 4k",
                "-c", "write -P 6 20M 3k", str(img))
        else:
            create(img, backing=base)
        allow = ["--allow-backing", str(base)]  # the shared base is in another directory
    dev = add("-t", "qcow2", str(img), *args, *allow)
    assert dev.queues == int(args[args.index("-q") + 1]) and dev.sectors * 512 == size
    blk = f"/dev/ublkb{dev.dev_id}"
    off, per_job = 8 * MiB + 20 * KiB, 16 * MiB
    end = off + 2 * per_job
    jobs = fio_jobs(blk, tmp_path, "--rw=randwrite", "--bsrange=4k-64k", "--iodepth=16",
                    "--numjobs=2", f"--offset={off}", f"--size={per_job}",
                    f"--offset_increment={per_job}", *cross_queue_args(dev),
                    "--verify=crc32c", "--verify_fatal=1", "--do_verify=1")
    assert sum(j["write"]["io_bytes"] for j in jobs) == 2 * per_job  # type: ignore[index]
    got = read_device(blk, 0, span)
    assert_bytes(got[:off], around[:off], "before fio's range")
    assert_bytes(got[end:], around[end:], "after fio's range", base=end)
    delete(dev.dev_id)
    assert_clean(img)


@pytest.mark.parametrize("kind", ["zlib", "zstd"])
def test_compress_stores_compressed_clusters_fio_verifies(kind: str, tmp_path: Path) -> None:
    """``--compress``: fio writes compressible data in whole and partial
    clusters over 2 queues and verifies it; the image holds compressed
    clusters, QEMU finds it clean and reads the same bytes."""
    img = tmp_path / "c.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-o", f"compression_type={kind}", str(img),
             str(64 * MiB))
    dev = add("-t", "qcow2", str(img), "--compress", "-q", "2")
    blk = f"/dev/ublkb{dev.dev_id}"
    fio_jobs(blk, tmp_path, "--rw=randwrite", "--bsrange=16k-256k", "--iodepth=8",
             "--numjobs=2", "--size=16M", "--offset_increment=24M", "--offset=4k",
             "--buffer_compress_percentage=70", "--refill_buffers",
             "--verify=crc32c", "--verify_fatal=1", "--do_verify=1", *cross_queue_args(dev))
    got = read_device(blk, 0, 64 * MiB)
    delete(dev.dev_id)
    assert_clean(img)
    assert check_image(img)[1].get("compressed-clusters", 0) > 100
    raw = raw_file(tmp_path / "c.raw", 64 * MiB, [(0, got)])
    assert_same(img, raw)


def _ops(size: int, cluster: int) -> list[tuple[str, int, int]]:
    """Writes ("w") and write-zeroes ("z"), in order, as (op, offset, length)."""
    return [
        ("w", 512, 512),                        # one sector inside the first cluster
        ("w", 3 * 4096 + 512, 1536),            # unaligned sectors, same cluster
        ("w", 5 * cluster - 4096, 8192),        # across a cluster boundary
        ("w", MiB + 512, 3 * MiB),              # many clusters, unaligned, several requests
        ("w", 2 * MiB + 4096, 64 * KiB),        # overwrite inside the previous write
        ("z", 3 * MiB - 8192, 256 * KiB),       # zeroes over written data and past it
        ("w", 3 * MiB, 4096),                   # data again inside the zeroed range
        ("w", 20 * MiB + 7 * 512, 20 * KiB),    # a lone write far away
        ("w", 30 * MiB + 512, 6 * MiB),         # 4 KiB clusters: a 2nd refcount block
        ("z", 34 * MiB, 128 * KiB),             # zeroes over allocated clusters
        ("w", size - 4096 - 512, 4096 + 512),   # the last sectors of the disk
    ]


@pytest.mark.parametrize("image", ["empty-4k-clusters", "raw-backing"])
def test_written_bytes_reach_the_image(image: str, tmp_path: Path) -> None:
    """Known bytes written with O_DIRECT (and zeroed with BLKZEROOUT) read
    back through the device, and after the device is gone QEMU reads exactly
    them from the image: `qemu-img compare` against a raw file the test
    builds itself, `qemu-img check` clean."""
    size = 64 * MiB
    expected = bytearray(size)
    if image == "raw-backing":
        cluster = 64 * KiB
        base_data = data(1, 24 * MiB)
        expected[:len(base_data)] = base_data
        base = raw_file(tmp_path / "base.raw", size, [(0, base_data)])
        img = create(tmp_path / "top.qcow2", backing=base, backing_fmt="raw")
    else:
        cluster = 4 * KiB
        img = create(tmp_path / "disk.qcow2", size, cluster_size=cluster)
    dev = add("-t", "qcow2", str(img), "-q", "1")
    blk = f"/dev/ublkb{dev.dev_id}"
    fd = os.open(blk, os.O_RDWR | os.O_DIRECT)
    try:
        for n, (op, off, length) in enumerate(_ops(size, cluster)):
            if op == "w":
                body = data(100 + n, length)
                pwrite_direct(fd, body, off)
                expected[off:off + length] = body
            else:
                fcntl.ioctl(fd, BLKZEROOUT, struct.pack("QQ", off, length))
                expected[off:off + length] = bytes(length)
        os.fsync(fd)
        got = pread_direct(fd, 0, size)
    finally:
        os.close(fd)
    assert_bytes(got, expected, "read back through the device")
    delete(dev.dev_id)
    raw = raw_file(tmp_path / "expected.raw", size, [(0, bytes(expected))])
    assert_clean(img)
    assert_same(img, raw)


def test_ext4_then_the_image_holds_what_the_device_showed(tmp_path: Path) -> None:
    """mkfs (with its discard), files, remount; then QEMU reads from the
    image exactly what the device served, and e2fsck finds that clean."""
    img = create(tmp_path / "disk.qcow2", 64 * MiB)
    dev = add("-t", "qcow2", str(img))
    blk = f"/dev/ublkb{dev.dev_id}"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run("mkfs.ext4", "-q", "-F", blk)
    run("mount", blk, str(mnt))
    files = {f"f{i}": data(200 + i, 37 * KiB * i + 512 * i + 1) for i in range(12)}
    files["big"] = data(250, 3 * MiB + 3)
    for name, body in files.items():
        (mnt / name).write_bytes(body)
    run("umount", str(mnt))
    run("mount", blk, str(mnt))
    try:
        assert {n: (mnt / n).read_bytes() for n in files} == files
    finally:
        run("umount", str(mnt))
    dump = tmp_path / "device.raw"
    run("dd", f"if={blk}", f"of={dump}", "bs=1M", "iflag=direct", "status=none")
    delete(dev.dev_id)
    assert dump.stat().st_size == 64 * MiB
    assert_clean(img)
    assert_same(img, dump)
    run("e2fsck", "-fn", str(dump))


def _try_write(blk: str) -> int | None:
    """The errno that refused a write to ``blk``, None if the write went through."""
    try:
        fd = os.open(blk, os.O_WRONLY | os.O_DIRECT)
    except OSError as e:
        return e.errno
    try:
        pwrite_direct(fd, b"\xee" * 4096, 0)
        os.fsync(fd)
    except (OSError, AssertionError) as e:
        return getattr(e, "errno", None) or -1
    finally:
        os.close(fd)
    return None


def test_read_only_serves_the_chain_and_refuses_writes(tmp_path: Path) -> None:
    """An overlay (qemu-io writes, zero clusters over backing data) over a
    zlib-compressed qcow2 base, served with --read-only: the device is
    read-only, writes fail, reads equal `qemu-img convert -O raw`, and
    neither file changes by a byte."""
    size = 32 * MiB
    raw = raw_file(tmp_path / "base.raw", size, [(0, compressible(7, 8 * MiB))])
    base = tmp_path / "base.qcow2"
    qemu_img("convert", "-c", "-f", "raw", "-O", "qcow2", str(raw), str(base))
    raw.unlink()
    assert check_image(base)[1].get("compressed-clusters", 0) > 0
    top = create(tmp_path / "top.qcow2", backing=base)
    subprocess.run(["qemu-io", "-f", "qcow2",
                    "-c", "write -P 0x5a 1M 68k",      # partial clusters over compressed ones
                    "-c", "write -z 4M 128k",          # zero clusters hiding backing data
                    "-c", "write -P 0x3c 7M 2M",       # across the end of the base's data
                    "-c", "write -P 0xa5 20M 4k",      # beyond it
                    str(top)], check=True, capture_output=True, timeout=60)
    expected = tmp_path / "expected.raw"
    qemu_img("convert", "-f", "qcow2", "-O", "raw", str(top), str(expected))
    sums = {p.name: sha256(p) for p in (top, base)}
    dev = add("-t", "qcow2", "--read-only", str(top), "-q", "1")
    blk = f"/dev/ublkb{dev.dev_id}"
    assert dev.sectors * 512 == size
    assert Path(f"/sys/block/ublkb{dev.dev_id}/ro").read_text().strip() == "1"
    refused = _try_write(blk)
    got = read_device(blk, 0, size)
    delete(dev.dev_id)
    assert refused is not None, "a write to the --read-only device went through"
    assert_bytes(got, expected.read_bytes(), "read-only device vs qemu-img convert -O raw")
    assert {p.name: sha256(p) for p in (top, base)} == sums, "--read-only changed the image"
    assert_clean(top)


# ------------------------------------------------- the data plane under churn --

CHURN_SIZE, CHURN_CS = 64 * MiB, 64 * KiB
CHURN_B = (40 * MiB, 56 * MiB)  # the churn threads' clusters
STAMP = struct.Struct("<QQQ")  # magic, device offset, generation: the head of each 4 KiB
STAMP_MAGIC = 0x51C0_2D47_A7A0_0001


def stamped(offset: int, gen: int) -> bytes:
    """A 4 KiB block that says where it belongs and which write made it."""
    head = STAMP.pack(STAMP_MAGIC, offset, gen)
    return head + random.Random(offset * 1_000_003 + gen).randbytes(4096 - len(head))


def foreign_blocks(buf: bytes, base: int) -> list[int]:
    """Offsets of the 4 KiB blocks in ``buf`` whose head says they belong
    elsewhere: a stamp for another offset, or anything but a stamp or zeros
    (fio's blocks). A read racing a write may see a block half old, half
    new: each field is only checked to be zero or what this offset's stamp
    holds."""
    bad = []
    for pos in range(0, len(buf), 4096):
        magic, off, _gen = STAMP.unpack_from(buf, pos)
        if magic not in (0, STAMP_MAGIC) or off not in (0, base + pos):
            bad.append(base + pos)
    return bad


class Churn:
    """Threads that keep changing the mappings of their own clusters of
    CHURN_B (whole and partial writes, discards, write-zeroes), each reading
    back what its model says after every step, and a racer reading any of
    them meanwhile: a block from elsewhere (a stale or reused mapping) fails."""

    def __init__(self, blk: str, threads: int = 3) -> None:
        self.blk = blk
        self.stop = threading.Event()
        first, end = (c // CHURN_CS for c in CHURN_B)
        self.owned = [list(range(first + k, end, threads)) for k in range(threads)]
        #: each cluster's expected bytes (the thread that owns it writes it)
        self.model = {c: bytes(CHURN_CS) for own in self.owned for c in own}
        self.errors: list[str] = []
        self.steps = 0
        self.workers = [threading.Thread(target=self._guard, args=(self._work, k))
                        for k in range(threads)]
        self.workers.append(threading.Thread(target=self._guard, args=(self._race, 0)))

    def __enter__(self) -> Churn:
        for t in self.workers:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.workers:
            t.join(120)

    def _guard(self, fn: Any, k: int) -> None:
        try:
            fn(k)
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            self.errors.append(f"{fn.__name__}[{k}]: {e!r}")
            self.stop.set()

    def _work(self, k: int) -> None:
        rng = random.Random(900 + k)
        fd = os.open(self.blk, os.O_RDWR | os.O_DIRECT)
        gen = 0
        try:
            while not self.stop.is_set():
                c = rng.choice(self.owned[k])
                base = c * CHURN_CS
                body = bytearray(self.model[c])
                act = rng.choice(("full", "part", "part", "discard", "zero", "zero-part"))
                gen += 1
                if act == "full":
                    body[:] = b"".join(stamped(base + i, gen) for i in range(0, CHURN_CS, 4096))
                    pwrite_direct(fd, bytes(body), base)
                elif act == "part":
                    at = rng.randrange(0, CHURN_CS, 4096)
                    n = 4096 * rng.randint(1, (CHURN_CS - at) // 4096)
                    part = b"".join(stamped(base + at + i, gen) for i in range(0, n, 4096))
                    pwrite_direct(fd, part, base + at)
                    body[at:at + n] = part
                elif act == "discard":
                    fcntl.ioctl(fd, BLKDISCARD, struct.pack("QQ", base, CHURN_CS))
                    body[:] = bytes(CHURN_CS)
                else:
                    at, n = (0, CHURN_CS) if act == "zero" else (8192, 16384)
                    fcntl.ioctl(fd, BLKZEROOUT, struct.pack("QQ", base + at, n))
                    body[at:at + n] = bytes(n)
                self.model[c] = bytes(body)
                for _ in range(2):  # the second read is the data plane's if the first published
                    got = pread_direct(fd, base, CHURN_CS)
                    where = first_difference(got, body)
                    if where is not None:
                        raise AssertionError(f"after {act} of cluster {c} (gen {gen}) the "
                                             f"byte at {base + where:#x} differs")
                self.steps += 1
        finally:
            os.close(fd)

    def _race(self, _k: int) -> None:
        rng = random.Random(77)
        fd = os.open(self.blk, os.O_RDONLY | os.O_DIRECT)
        try:
            while not self.stop.is_set():
                base = rng.randrange(*CHURN_B, CHURN_CS)
                bad = foreign_blocks(pread_direct(fd, base, CHURN_CS), base)
                if bad:
                    raise AssertionError(f"blocks from elsewhere at {[hex(b) for b in bad]}")
        finally:
            os.close(fd)


@pytest.mark.parametrize("args", [["-b", "-q", "2"], ["--no-batch", "-q", "4"],
                                  ["-b", "-u", "-q", "4"], ["--no-batch", "-u", "-q", "2"]],
                         ids=" ".join)
def test_data_plane_under_mapping_churn(args: list[str], tmp_path: Path) -> None:
    """The data plane serves reads and in-place writes of the clusters the
    image published while their mappings change under them, in one L2 table
    (64 KiB clusters: one table maps the whole disk):

    - fio writes and verifies [0, 24M) at random (4-64 KiB, in place after
      the first write: the data plane's writes);
    - fio ``randtrimwrite`` over [24M, 40M) in whole clusters: every block is
      discarded, written again and verified, so each cluster is freed and
      allocated anew while it is being served;
    - threads discard, zero and rewrite their own clusters of [40M, 56M),
      each reading back exactly what it wrote, while a racer reads any of
      them and finds no block from elsewhere.

    Then the whole device is read: the churned clusters hold what the model
    says, and QEMU reads exactly the device's bytes from the image
    (``qemu-img compare``), which ``qemu-img check`` finds clean. With
    ``-u`` C moves the data through /dev/ublkcN itself."""
    img = create(tmp_path / "disk.qcow2", CHURN_SIZE, cluster_size=CHURN_CS)
    dev = add("-t", "qcow2", str(img), *args)
    blk = f"/dev/ublkb{dev.dev_id}"
    fio = ["fio", "--output-format=json", f"--filename={blk}", "--ioengine=io_uring",
           "--direct=1", "--verify=crc32c", "--verify_fatal=1", "--do_verify=1",
           "--name=inplace", "--rw=randwrite", "--bsrange=4k-64k", "--iodepth=16",
           "--offset=0", f"--size={24 * MiB}", "--loops=2",
           "--name=trimwrite", "--rw=randtrimwrite", "--bs=64k", "--iodepth=8",
           f"--offset={24 * MiB}", f"--size={16 * MiB}", "--loops=3"]
    try:
        with Churn(blk) as churn:
            p = subprocess.run(fio, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                               stdin=subprocess.DEVNULL)
            while churn.steps < 200 and not churn.stop.is_set():
                time.sleep(0.5)  # a slow guest: churn some more after fio
        assert not churn.errors, churn.errors
        assert p.returncode == 0, f"fio failed ({p.returncode}): {p.stderr.strip()}"
        jobs = json.loads(p.stdout[p.stdout.index("{"):])["jobs"]
        for job in jobs:
            assert job["error"] == 0, job
        assert jobs[1]["trim"]["io_bytes"] > 0, "fio trimmed nothing"
        write_device(blk, [])  # fsync: a flush
        got = read_device(blk, 0, CHURN_SIZE)
    finally:
        delete(dev.dev_id)
    for c, body in churn.model.items():
        assert_bytes(got[c * CHURN_CS:(c + 1) * CHURN_CS], body, f"churned cluster {c}",
                     base=c * CHURN_CS)
    dump = raw_file(tmp_path / "device.raw", CHURN_SIZE, [(0, got)])
    assert_clean(img)
    assert_same(img, dump)


def served(dev_id: int, since: float) -> dict[str, int]:
    """The device's counters summed over its queues, from a publication made
    after ``since`` (the server publishes every second): what C served,
    what it handed to Python, what it allocated."""
    deadline = time.monotonic() + 60
    while True:
        p = kernel.cli("list", "-n", str(dev_id), "--stats", "--json")
        dev = json.loads(p.stdout)[0]
        if dev["stats"] and dev["stats_time"] > since:
            return {k: sum(int(r.get(k, 0)) for r in dev["stats"])
                    for k in ("c_served", "py_handed", "c_alloc")}
        assert time.monotonic() < deadline, "no stats published after the run"
        time.sleep(0.2)  # (polls the condition: the next publication)


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


# every queue count, both paths, both copy modes (kept few: the CI budget)
SHARE_SHAPES = [["-b", "-q", "1"], ["--no-batch", "-q", "2", "-u"], ["-b", "-q", "4"],
                ["--no-batch", "-q", "4", "-u"]]


@pytest.mark.parametrize("args", SHARE_SHAPES, ids=" ".join)
def test_c_serves_all_but_the_first_touch(args: list[str], tmp_path: Path) -> None:
    """On an empty image, once its one L2 table is cached (a first write):
    allocating writes, reads and in-place writes are served by C, and at
    most 1% of requests reach Python, on every queue count and path. With
    C switched off (or C allocation), the first phase alone would send
    every first write of a cluster to Python."""
    img = create(tmp_path / "disk.qcow2", 256 * MiB)
    dev = add("-t", "qcow2", str(img), *args)
    blk = f"/dev/ublkb{dev.dev_id}"
    cross = cross_queue_args(dev)
    jobs = ["--numjobs=2", f"--size={32 * MiB}", f"--offset_increment={32 * MiB}", *cross]
    try:
        # the first touch: a write makes the (one) L2 table, published whole;
        # fio's first writes would otherwise all be Python's until it exists
        write_device(blk, [(0, bytes(range(256)) * 16)])
        s0 = served(dev.dev_id, time.time())
        # every 4 KiB block once: 1024 clusters allocated, 16 writes each
        fio_jobs(blk, tmp_path, "--rw=randwrite", "--bs=4k", "--iodepth=16", *jobs)
        s1 = served(dev.dev_id, time.time())
        fio_jobs(blk, tmp_path, "--rw=randrw", "--bs=4k", "--iodepth=16",
                 "--number_ios=4000", *jobs)
        s2 = served(dev.dev_id, time.time())
    finally:
        delete(dev.dev_id)
    alloc, rest = delta(s0, s1), delta(s1, s2)
    for what, d in (("allocating writes", alloc), ("reads and in-place writes", rest)):
        total = d["c_served"] + d["py_handed"]
        assert total >= 4000, f"{what}: only {total} requests counted: {d}"
        assert d["py_handed"] <= total // 100, f"{what}: Python served {d} (over 1%)"
    # nearly every cluster fio wrote first: Python allocates only when a
    # queue's pool runs dry before the owner refills it, and each of those is
    # one of the requests Python served (the 1% above); cluster 0 was the
    # first touch's
    limit = 1023 - alloc["py_handed"]
    assert alloc["c_alloc"] >= limit, f"C allocated only {alloc['c_alloc']} clusters: {alloc}"
    assert_clean(img)


def chain_of(depth: int, d: Path, size: int, compressed: bool = False,
             extended_l2: bool = False) -> tuple[Path, Path]:
    """A chain ``depth`` images deep over a raw base of distinct data, each
    overlay writing a little of its own, and the top's content as raw:
    1: top -> base.raw; 2: top -> base.qcow2 (a copy of the raw base,
    ``compressed`` or not); 3: top -> mid.qcow2 -> base.raw. The top has
    subclusters with ``extended_l2``."""
    body = compressible(5, size) if compressed else data(5, size)
    raw = raw_file(d / "base.raw", size, [(0, body)])
    if depth == 2:
        base = d / "base.qcow2"
        qemu_img("convert", *(["-c"] if compressed else []), "-f", "raw", "-O", "qcow2",
                 str(raw), str(base))
        raw.unlink()
        below, fmt = base, "qcow2"
    else:
        below, fmt = raw, "raw"
    if depth == 3:
        mid = create(d / "mid.qcow2", backing=raw, backing_fmt="raw")
        subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -P 0x4d {8 * MiB} 1M",
                        "-c", f"write -z {12 * MiB} 256k", str(mid)],
                       check=True, capture_output=True, timeout=60)
        below, fmt = mid, "qcow2"
    top = create(d / "top.qcow2", backing=below, backing_fmt=fmt, extended_l2=extended_l2)
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -P 0x7c {16 * MiB} 64k",
                    str(top)], check=True, capture_output=True, timeout=60)
    want = d / "want.raw"
    qemu_img("convert", "-f", "qcow2", "-O", "raw", str(top), str(want))
    return top, want


@pytest.mark.parametrize("depth,compressed,args", [
    (1, False, ["-b", "-q", "1"]),
    (2, False, ["--no-batch", "-q", "2", "-u"]),
    (2, True, ["-b", "-q", "2"]),
    (3, False, ["-b", "-q", "2", "-u"]),
    (3, False, ["--no-batch", "-q", "1"]),
], ids=["depth1-batch", "depth2-per_io-u", "depth2-compressed-batch", "depth3-batch-u",
        "depth3-per_io"])
def test_c_serves_reads_through_the_chain(depth: int, compressed: bool, args: list[str],
                                          tmp_path: Path) -> None:
    """An overlay over a chain ``depth`` deep: once a read went through the
    backing chain in each L2 span (the first touch), C serves reads of what
    the overlay does not hold from the backing files (a compressed base's
    clusters inflated by C), and at most 1% of requests reach Python, on
    every path and copy mode; the device reads what ``qemu-img convert``
    reads, and a write copies up."""
    size = 64 * MiB
    top, want = chain_of(depth, tmp_path, size, compressed)
    sums = {p.name: sha256(p) for p in tmp_path.iterdir() if p.name not in (top.name, want.name)}
    dev = add("-t", "qcow2", str(top), *args)
    blk = f"/dev/ublkb{dev.dev_id}"
    try:
        read_device(blk, 0, 4096)  # the first touch
        s0 = served(dev.dev_id, time.time())
        fio_jobs(blk, tmp_path, "--rw=randread", "--bs=4k", "--iodepth=16",
                 "--number_ios=4000", "--numjobs=2", *cross_queue_args(dev))
        s1 = served(dev.dev_id, time.time())
        got = read_device(blk, 0, size)
        write_device(blk, [(4 * MiB + 512, b"w" * 1024)])
        after = read_device(blk, 4 * MiB, 64 * KiB)
    finally:
        delete(dev.dev_id)
    d = delta(s0, s1)
    total = d["c_served"] + d["py_handed"]
    assert total >= 7900, f"only {total} of fio's 8000 requests counted: {d}"
    assert d["py_handed"] <= total // 100, f"Python served {d} (over 1%)"
    expected = want.read_bytes()
    assert_bytes(got, expected, f"the device over a chain {depth} deep vs qemu-img convert")
    assert_bytes(after, expected[4 * MiB:4 * MiB + 512] + b"w" * 1024
                 + expected[4 * MiB + 1536:4 * MiB + 64 * KiB], "a copied-up cluster")
    assert {p.name: sha256(p) for p in tmp_path.iterdir() if p.name in sums} == sums, \
        "a backing file changed"
    assert_clean(top)


@pytest.mark.parametrize("depth,compressed,extended,args", [
    (1, False, False, ["-b", "-q", "1"]),
    (2, False, False, ["--no-batch", "-q", "2", "-u"]),
    (2, True, False, ["-b", "-q", "2", "-u"]),
    (3, False, False, ["--no-batch", "-q", "1"]),
    (1, False, True, ["-b", "-q", "2"]),
], ids=["depth1-batch", "depth2-per_io-u", "depth2-compressed-batch-u", "depth3-per_io",
        "depth1-subclusters-batch"])
def test_c_copies_on_write_over_the_chain(depth: int, compressed: bool, extended: bool,
                                          args: list[str], tmp_path: Path) -> None:
    """First writes of part of a cluster whose data is in the backing chain:
    once the overlay's L2 table is private (the first touch: a write), C
    takes a cluster from its queue's pool, copies the
    rest of the cluster (of the subclusters it touches, ``extended``) from
    the backing file (a compressed base's cluster inflated) around the
    write, and records it (``extended``: a second write to each cluster,
    elsewhere in it, copies the rest of its own subclusters into the cluster
    C took): at most 1% of the writes reach Python, the device and then
    QEMU read the base's bytes around every write, and the image checks
    clean."""
    size = 64 * MiB
    top, want = chain_of(depth, tmp_path, size, compressed, extended)
    expected = bytearray(want.read_bytes())
    rng = random.Random(f"cow-{depth}-{compressed}")
    # one write in each of 600 distinct clusters past the first, at a random
    # 4 KiB-aligned place inside it, 4-12 KiB long (within the cluster), none
    # in the cluster the top holds already (at 16 MiB: its writes go in place)
    writes = []
    own = 16 * MiB // (64 * KiB)
    for c in rng.sample([c for c in range(1, size // (64 * KiB)) if c != own], 600):
        n = rng.choice((4, 8, 12)) * KiB
        off = c * 64 * KiB + rng.randrange(0, (64 * KiB - n) // (4 * KiB) + 1) * 4 * KiB
        writes.append((off, data(c, n)))
    if extended:  # the same clusters again, in their other half
        for off, body in list(writes):
            c, n = off // (64 * KiB), 4 * KiB
            at = off + len(body) if off % (64 * KiB) < 32 * KiB else off - 2 * n
            writes.append((max(at, c * 64 * KiB), data(c + size, n)))
    dev = add("-t", "qcow2", str(top), *args)
    blk = f"/dev/ublkb{dev.dev_id}"
    try:
        # the first touch: a write makes the overlay's L2 table (private), and
        # the rest of its span is published COW from there (a compressed
        # base's clusters as their compressed bytes, which C inflates): a
        # guest that only writes needs no read first
        write_device(blk, [(0, b"f" * 4096)])
        s0 = served(dev.dev_id, time.time())
        write_device(blk, writes)
        s1 = served(dev.dev_id, time.time())
        got = read_device(blk, 0, size)
    finally:
        delete(dev.dev_id)
    d = delta(s0, s1)
    total = d["c_served"] + d["py_handed"]
    assert total >= len(writes), f"only {total} requests counted: {d}"
    assert d["py_handed"] <= total // 100, f"Python served {d} (over 1%)"
    assert d["c_alloc"] >= len(writes) - d["py_handed"], f"C copied few clusters: {d}"
    expected[:4096] = b"f" * 4096
    for off, body in writes:
        expected[off:off + len(body)] = body
    assert_bytes(got, expected, f"the device after copy-on-writes over a chain {depth} deep")
    assert_clean(top)
    assert_same(top, raw_file(tmp_path / "expected.raw", size, [(0, bytes(expected))]))


@pytest.mark.parametrize("args", [["-b", "-q", "2"], ["--no-batch", "-q", "1", "-u"]],
                         ids=["batch-2q", "per_io-u"])
def test_user_recovery_writes_are_c_served_and_survive_kill9(args: list[str],
                                                              tmp_path: Path) -> None:
    """With user recovery (``-r 1``) every write answered has its metadata in
    the image file. C still serves the writes, allocating ones included (at
    most 1% reach Python), their answers held until a write-back makes their
    metadata durable. Killed with -9 right after, with no flush ever sent,
    the image checks clean but for leaks and QEMU reads every write from it."""
    size = 64 * MiB
    img = create(tmp_path / "disk.qcow2", size)
    rng = random.Random("user-recovery")
    writes = [(c * 64 * KiB + rng.randrange(16) * 4 * KiB, data(c, 4 * KiB))
              for c in rng.sample(range(1, size // (64 * KiB)), 400)]
    writes += [(off + 512, data(off, 1024)) for off, _ in writes[:100]]  # (in place)
    expected = bytearray(size)
    expected[:4096] = b"f" * 4096
    for off, body in writes:
        expected[off:off + len(body)] = body
    dev = start_server(["-t", "qcow2", str(img), "-r", "1", *args], tmp_path / "server.log")
    blk = f"/dev/ublkb{dev.dev_id}"
    fd = -1
    try:
        write_device(blk, [(0, b"f" * 4096)])  # (the L2 table, Python's)
        s0 = served(dev.dev_id, time.time())
        fd = os.open(blk, os.O_WRONLY | os.O_DIRECT)
        for off, body in writes:  # (no fsync: nothing asks for a flush)
            pwrite_direct(fd, body, off)
        s1 = served(dev.dev_id, time.time())
    finally:
        os.kill(dev.pid, signal.SIGKILL)
        os.waitpid(dev.pid, 0)
        if fd >= 0:
            os.close(fd)
        delete(dev.dev_id)
    d = delta(s0, s1)
    total = d["c_served"] + d["py_handed"]
    assert total >= len(writes), f"only {total} requests counted: {d}"
    assert d["py_handed"] <= total // 100, f"Python served {d} (over 1%)"
    assert d["c_alloc"] >= 400 - d["py_handed"], f"C allocated few clusters: {d}"
    rc, _, text = check_image(img)
    assert rc in (0, 3), text
    spans = [(off, len(body)) for off, body in writes]
    for (off, n), got in zip(spans, read_image(img, spans, tmp_path), strict=True):
        assert_bytes(got, bytes(expected[off:off + n]), "a write answered before kill -9",
                     base=off)


# ------------------------------------------------------------- kill -9 test --

KILL_RUNS = 20
KILL_SIZE = 64 * MiB
# written and flushed before fio starts: must survive the kill; the last one
# shares a 64 KiB cluster (or, with 4 KiB clusters, an L2 table) with fio's range
FLUSHED = [(0, MiB + 512), (2 * MiB + 3 * 64 * KiB + 4 * KiB, 12 * KiB),
           (4 * MiB - 512, 1024)]
# fio's two jobs write [FIO_OFF, FIO_OFF + 2 * FIO_JOB) at random while the server is killed
FIO_OFF, FIO_JOB = 4 * MiB + 4 * KiB, 28 * MiB
FIO_MAGIC = 0xACCA  # fio's verify header: magic, type, len, seed, offset (little endian)
SCAN_EVERY = 5  # runs whose whole fio range is read back and scanned (costs a convert)


def misplaced_blocks(region: bytes, base: int) -> list[int]:
    """Offsets of the 4 KiB blocks of fio's range that are neither still
    zero nor a block fio wrote at that very offset (fio writes a verify
    header into every 4 KiB): data that landed at the wrong place, or that
    is not data at all."""
    zero = bytes(4096)
    bad = []
    for i in range(0, len(region), 4096):
        block = region[i:i + 4096]
        if block == zero:
            continue
        magic, _, length, _, offset = struct.unpack_from("<HHIQQ", block)
        if magic != FIO_MAGIC or length != 4096 or offset != base + i:
            bad.append(base + i)
    return bad


@dataclass
class KillRun:
    n: int
    delay: float
    cluster: int
    path: str
    queues: int
    check_rc: int | None = None
    c_alloc: int = 0  # clusters C had allocated by the last stats before the kill
    leaks: int = 0
    corruptions: int = 0
    writes_before_kill: int = 0
    scanned: bool = False  # fio's range checked block by block
    misplaced: str = ""  # blocks of fio's range holding what fio never wrote there
    lost: str = ""       # flushed data that did not survive
    error: str = ""      # the run itself went wrong (hang, failed start, ...)
    check_text: str = ""

    def line(self) -> str:
        return (f"run {self.n:2}: kill at {self.delay:.2f}s cluster {self.cluster // KiB}K "
                f"{self.path:10} -q {self.queues} writes {self.writes_before_kill:5} "
                f"c_alloc {self.c_alloc:4} check rc {self.check_rc} "
                f"leaks {self.leaks} corruptions {self.corruptions}"
                f"{' fio range scanned' if self.scanned else ''}"
                f"{' MISPLACED ' + self.misplaced if self.misplaced else ''}"
                f"{' LOST ' + self.lost if self.lost else ''}"
                f"{' ERROR ' + self.error if self.error else ''}")


def _writes_done(dev_id: int) -> int:
    return int(Path(f"/sys/block/ublkb{dev_id}/stat").read_text().split()[4])


def read_image(img: Path, extents: list[tuple[int, int]], d: Path) -> list[bytes]:
    """What QEMU reads from ``img`` at each (offset, length): extents less
    than 8 MiB apart share one ``qemu-img convert`` of their window."""
    windows: list[list[int]] = []
    for off, length in sorted(extents):
        if windows and off - windows[-1][1] < 8 * MiB:
            windows[-1][1] = max(windows[-1][1], off + length)
        else:
            windows.append([off, off + length])
    got = {}
    for start, end in windows:
        out = d / "window.raw"
        qemu_img("convert", "--image-opts",
                 f"driver=raw,offset={start},size={end - start},file.driver=qcow2,"
                 f"file.file.filename={img}", "-O", "raw", str(out))
        with open(out, "rb") as f:
            for off, length in extents:
                if start <= off < end:
                    f.seek(off - start)
                    got[off] = f.read(length)
        out.unlink()
    return [got[off] for off, _ in extents]


def _keep_for_debugging(img: Path, name: str) -> str:
    """Copy a bad image to the guest harness's results folder (it reaches the host)."""
    reports = os.environ.get("AIOUBLK_GUEST_REPORTS")
    if not reports:
        return ""
    dest = Path(reports).parent / name
    try:
        shutil.copyfile(img, dest)
    except OSError:
        return ""
    return f" (image kept in {dest})"


def _kill_run(n: int, delay: float, d: Path,
              templates: dict[int, Path]) -> tuple[KillRun, Path | None]:
    d.mkdir()
    # over the runs: every (path, queue count) pair, each cluster size on both
    r = KillRun(n, delay, cluster=64 * KiB if n % 2 == 0 else 4 * KiB,
                path="-b" if n % 4 < 2 else "--no-batch", queues=(1, 2, 4)[n % 3])
    img = d / "disk.qcow2"
    shutil.copyfile(templates[r.cluster], img)  # one qemu-img start less per run
    flushed = [(off, data(1000 + 10 * n + k, length))
               for k, (off, length) in enumerate(FLUSHED)]
    log = d / "server.log"
    try:
        dev = start_server(["-t", "qcow2", str(img), r.path, "-q", str(r.queues)], log)
    except AssertionError as e:
        r.error = f"start failed: {e}"
        return r, None
    blk = f"/dev/ublkb{dev.dev_id}"
    proc = None
    try:
        write_device(blk, flushed)
        before = _writes_done(dev.dev_id)
        proc = subprocess.Popen(
            ["fio", "--name=k", f"--filename={blk}", "--ioengine=io_uring", "--direct=1",
             "--rw=randwrite", "--bsrange=4k-64k", "--iodepth=16", "--numjobs=2",
             f"--offset={FIO_OFF}", f"--size={FIO_JOB}", f"--offset_increment={FIO_JOB}",
             *cross_queue_args(dev), "--fsync=16", "--verify=crc32c", "--verify_interval=4096",
             "--do_verify=0", "--time_based", "--runtime=60"],
            cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while _writes_done(dev.dev_id) - before < 8:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError("fio never got writes going")
            time.sleep(0.02)
        time.sleep(delay)
        r.writes_before_kill = _writes_done(dev.dev_id) - before
        r.c_alloc = served(dev.dev_id, 0)["c_alloc"]  # (the last published)
    except (AssertionError, OSError) as e:
        r.error = f"{type(e).__name__}: {e}; server log: {tail(log)}"
    os.kill(dev.pid, signal.SIGKILL)
    try:
        if proc is not None:
            proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        r.error += "fio still running 60 s after kill -9 of the server"
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        os.waitpid(dev.pid, 0)
    try:
        delete(dev.dev_id)
    except UblkError:
        pass
    if any(x.dev_id == dev.dev_id for x in kernel.listing()):
        r.error += f" device {dev.dev_id} could not be deleted"
    r.check_rc, report, r.check_text = check_image(img)
    r.leaks = int(report.get("leaks", 0))
    r.corruptions = int(report.get("corruptions", 0))
    r.scanned = n % SCAN_EVERY == 0
    fio_range = [(FIO_OFF, 2 * FIO_JOB)] if r.scanned else []
    try:
        back = read_image(img, FLUSHED + fio_range, d)
    except AssertionError as e:
        r.lost = f"QEMU cannot read the image: {e}"
    else:
        for (off, body), got in zip(flushed, back[:len(flushed)], strict=True):
            if (diff := first_difference(got, body)) is not None:
                r.lost += f"[{off}+{len(body)}: differs at {off + diff}] "
        if r.scanned and (bad := misplaced_blocks(back[-1], FIO_OFF)):
            r.misplaced = f"{len(bad)} blocks, first at {bad[:4]}"
    if r.check_rc not in (0, 3) or r.lost or r.misplaced:
        r.error += _keep_for_debugging(img, f"qcow2-kill-run{n}.qcow2")
    return r, img


def test_kill9_mid_write_leaks_at_worst(tmp_path: Path) -> None:
    """20 times: a fresh image (64 KiB or 4 KiB clusters, batch or per-I/O,
    1, 2 or 4 queues; C allocating the clusters fio writes first),
    known data written and flushed, then two fio jobs (on two queues where there are) write
    at random elsewhere, with a flush every 16 writes (a kill may land while
    a flush writes metadata back), and the server is killed 0.5-3 s into
    that. Then `qemu-img check` may find leaked clusters (exit 3) but never
    corruption (exit 2), QEMU reads the flushed data intact, and (every
    SCAN_EVERY-th run) each 4 KiB of fio's range is zero or what fio wrote
    at that offset. Finally the image of a run with leaks is served again:
    it still reads and takes writes."""
    delays = [0.5 + 2.5 * i / (KILL_RUNS - 1) for i in range(KILL_RUNS)]
    random.Random(9).shuffle(delays)
    templates = {c: create(tmp_path / f"fresh-{c}.qcow2", KILL_SIZE, cluster_size=c)
                 for c in (4 * KiB, 64 * KiB)}
    runs: list[KillRun] = []
    reopen: tuple[KillRun, Path] | None = None
    for n, delay in enumerate(delays):
        r, img = _kill_run(n, delay, tmp_path / f"run{n}", templates)
        runs.append(r)
        print(r.line(), flush=True)
        if img is None or r.error or r.check_rc not in (0, 3):
            continue
        keep = reopen is None or (r.leaks > 0 and reopen[0].leaks == 0)
        if keep:
            if reopen is not None:
                reopen[1].unlink()
            reopen = (r, img)
        else:
            img.unlink()
    leaky = sum(1 for r in runs if r.check_rc == 3 or r.leaks)
    corrupt = sum(1 for r in runs if r.check_rc == 2 or r.corruptions)
    broken = sum(1 for r in runs if r.error)
    print(f"kill test: {len(runs)} runs, {leaky} with leaks, {corrupt} corruptions"
          + (f", {broken} runs went wrong (see above)" if broken else ""), flush=True)
    bad = [r for r in runs
           if r.check_rc not in (0, 3) or r.corruptions or r.lost or r.misplaced or r.error]
    assert not bad, "\n".join(f"{r.line()}\n{r.check_text}" for r in bad)
    assert sum(r.c_alloc > 0 for r in runs) >= len(runs) // 2, \
        "C allocated in fewer than half of the runs: the kill test did not cover it"

    # a crashed image is served again: flushed data intact, new writes land
    assert reopen is not None
    r, img = reopen
    log = tmp_path / "reopen.log"
    dev = start_server(["-t", "qcow2", str(img), "-q", "1"], log)
    try:
        blk = f"/dev/ublkb{dev.dev_id}"
        for k, (off, length) in enumerate(FLUSHED):
            assert_bytes(read_device(blk, off, length), data(1000 + 10 * r.n + k, length),
                         f"flushed extent {k} of run {r.n} served again", base=off)
        fresh = data(77, 256 * KiB)
        write_device(blk, [(FIO_OFF, fresh)])
        assert_bytes(read_device(blk, FIO_OFF, len(fresh)), fresh, "written after the crash")
    finally:
        delete(dev.dev_id)
        os.waitpid(dev.pid, 0)
    rc, _, text = check_image(img)
    assert rc in (0, 3), f"qemu-img check after serving run {r.n}'s image again: {rc}\n{text}"


# -------------------------------------------------------- untrusted images --

def test_untrusted_image_cannot_choose_a_host_file(tmp_path: Path) -> None:
    """`add -t qcow2 evil.qcow2`, an image whose raw backing file is a secret
    host file outside its directory: refused in one line, non-zero exit, no
    device left behind. With --allow-backing for the secret's directory (the
    user's decision) the same image serves the file's bytes."""
    images, etc = tmp_path / "images", tmp_path / "etc"
    images.mkdir()
    etc.mkdir()
    secret = etc / "shadow"
    secret.write_bytes(data(31, 64 * KiB))
    evil = images / "evil.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-u", "-b", str(secret), "-F", "raw", str(evil),
             "1M")
    p = kernel.cli("add", "-t", "qcow2", str(evil), "-q", "1", check=False)
    if p.returncode == 0:
        (dev,) = kernel.parse_list(p.stdout)
        leaked = read_device(f"/dev/ublkb{dev.dev_id}", 0, 64 * KiB) == secret.read_bytes()
        delete(dev.dev_id)
        pytest.fail(f"evil.qcow2 was served as /dev/ublkb{dev.dev_id}"
                    + (", which reads the secret file" if leaked else ""))
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert str(secret) in lines[0] and f"--allow-backing {secret} " in lines[0], lines[0]
    assert kernel.listing() == [], "a refused add left a device"

    dev = add("-t", "qcow2", str(evil), "-q", "1", "--allow-backing", str(etc))
    try:
        got = read_device(f"/dev/ublkb{dev.dev_id}", 0, 64 * KiB)
    finally:
        delete(dev.dev_id)
    assert_bytes(got, secret.read_bytes(), "the allowed backing file through the device")
