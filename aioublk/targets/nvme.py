"""The nvme target: an NVMe namespace served through its generic char device
(``/dev/ngXnY``) with io_uring passthrough, bypassing the block layer.

Each request is one ``IORING_OP_URING_CMD`` carrying a ``struct
nvme_uring_cmd`` (``NVME_URING_CMD_IO``) on the queue's ring, which is why
the target asks for rings of 128-byte SQEs and 32-byte CQEs
(``big_ring_entries``). Its CQE's result is 0, a negative errno (the kernel
refused), or a positive NVMe status (the controller did): both fail the
request, the status as EIO.

The geometry comes from the namespace's block device in sysfs
(``/sys/block/nvmeXnY``): its LBA size, size, transfer and segment limits,
write cache and whether it deallocates (discard) and writes zeroes. A
request is never split: the device's largest I/O is one command's.

Copy modes: the default and ``-u`` hand the target the request in memory,
which the command's ``addr`` points at. Zero copy (``-z``, ``--auto_zc``)
hands it a ``FixedBuf``, the ublk request's pages in the ring's buffer
table: the command then carries ``IORING_URING_CMD_FIXED`` with that index,
and its ``addr`` is the offset inside that buffer (a kernel-registered
buffer starts at address 0), so the controller moves the data straight to
or from the request's pages. The C data plane serves reads, writes (FUA
ones too where the namespace takes the bit, or has no volatile cache),
flushes, discards and write zeroes (``map`` is ``Passthrough``): it builds
the same command in C, with the fixed-buffer flag and the tag's slot in the
zero-copy modes, and counts a result of 0 as the whole transfer. Anything
else (a write zeroes over 2^16 blocks, a FUA write the namespace needs a
flush for) and anything C hands back is a coroutine or a
``start_read``/``start_write`` fast-path CQE handler.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from aioublk._uring import lib
from aioublk.dataplane.maps import Passthrough
from aioublk.errors import Error
from aioublk.ring import Handler, buffer_address, current_ring
from aioublk.target import Buffer, Done, FixedBuf, Geometry, Target
from aioublk.targets.spec import PATH, Option, TargetSpec


def _iowr(type_: str, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord(type_) << 8) | nr


#: ``struct nvme_uring_cmd`` (linux/nvme_ioctl.h): opcode, flags, rsvd1, nsid,
#: cdw2, cdw3, metadata, addr, metadata_len, data_len, cdw10..cdw15,
#: timeout_ms, rsvd2
CMD = struct.Struct("=BBHIIIQQII6III")
NVME_URING_CMD_IO = _iowr("N", 0x80, CMD.size)
NVME_IOCTL_ID = 0x4E40  # _IO('N', 0x40): the namespace id of the fd

OP_FLUSH, OP_WRITE, OP_READ, OP_WRITE_ZEROES, OP_DSM = 0x00, 0x01, 0x02, 0x08, 0x09
FUA = 1 << 30          # cdw12 of read/write: force unit access
DEAC = 1 << 25         # cdw12 of write zeroes: deallocate the blocks too
DSM_AD = 1 << 2        # cdw11 of dataset management: deallocate the ranges
MAX_NLB = 1 << 16      # blocks one read/write/write zeroes can name (NLB is 16 bits)
DSM_RANGE = struct.Struct("=IIQ")  # context attributes, blocks, starting LBA
DSM_MAX_RANGES = 256
DSM_MAX_NLB = 0xFFFF_FFFF
PAGE = 4096  # a segment of a user buffer the driver maps


class NvmeError(Error):
    """An NVMe namespace that cannot be served, explained in one line."""


def command(opcode: int, nsid: int, *, addr: int = 0, data_len: int = 0,
            cdw: tuple[int, ...] = ()) -> bytes:
    """A ``struct nvme_uring_cmd``; ``cdw`` fills cdw10 onwards."""
    words = (*cdw, *(0,) * (6 - len(cdw)))
    return CMD.pack(opcode, 0, 0, nsid, 0, 0, 0, addr, 0, data_len, *words, 0, 0)


def rw_command(opcode: int, nsid: int, lba: int, nblocks: int, addr: int, data_len: int,
               fua: bool = False) -> bytes:
    """A read or write of ``nblocks`` blocks at ``lba`` to or from ``addr``."""
    if not 0 < nblocks <= MAX_NLB:
        raise ValueError(f"an NVMe read or write moves 1 to {MAX_NLB} blocks, not {nblocks}")
    cdw12 = (nblocks - 1) | (FUA if fua else 0)
    return command(opcode, nsid, addr=addr, data_len=data_len,
                   cdw=(lba & 0xFFFF_FFFF, lba >> 32, cdw12))


def write_zeroes_command(nsid: int, lba: int, nblocks: int, unmap: bool) -> bytes:
    if not 0 < nblocks <= MAX_NLB:
        raise ValueError(f"an NVMe write zeroes covers 1 to {MAX_NLB} blocks, not {nblocks}")
    cdw12 = (nblocks - 1) | (DEAC if unmap else 0)
    return command(OP_WRITE_ZEROES, nsid, cdw=(lba & 0xFFFF_FFFF, lba >> 32, cdw12))


def dsm_ranges(lba: int, nblocks: int) -> bytes:
    """The range buffer of a deallocate covering ``nblocks`` blocks at ``lba``."""
    out = bytearray()
    while nblocks:
        n = min(nblocks, DSM_MAX_NLB)
        out += DSM_RANGE.pack(0, n, lba)
        lba, nblocks = lba + n, nblocks - n
    if len(out) > DSM_MAX_RANGES * DSM_RANGE.size:
        raise ValueError("a discard this long needs more than 256 NVMe ranges")
    return bytes(out)


def dsm_command(nsid: int, addr: int, ranges_len: int) -> bytes:
    """Deallocate the ranges (``dsm_ranges``) at ``addr``."""
    nr = ranges_len // DSM_RANGE.size
    return command(OP_DSM, nsid, addr=addr, data_len=ranges_len, cdw=(nr - 1, DSM_AD))


def _int(path: Path, default: int = 0) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def geometry_from_sysfs(block: Path, read_only: bool = False) -> Geometry:
    """The device's geometry from the namespace's block device folder in
    sysfs (``/sys/block/nvmeXnY``)."""
    q = block / "queue"
    lbs = _int(q / "logical_block_size", 512)
    segments = _int(q / "max_segments", 0)
    max_io = _int(q / "max_hw_sectors_kb", 128) << 10
    if segments:  # a user buffer's pages are mapped one segment each
        max_io = min(max_io, segments * PAGE)
    max_io = min(max_io, MAX_NLB * lbs) // lbs * lbs
    write_back = (q / "write_cache").exists() and \
        (q / "write_cache").read_text().strip() == "write back"
    return Geometry(
        size=_int(block / "size") * 512 // lbs * lbs,
        logical_block_size=lbs,
        physical_block_size=max(lbs, _int(q / "physical_block_size", lbs)),
        io_min=max(lbs, _int(q / "minimum_io_size", lbs)),
        io_opt=max(lbs, _int(q / "optimal_io_size", lbs)),
        max_io_size=max(max_io, lbs),
        volatile_cache=write_back,
        fua=write_back and _int(q / "fua") == 1,
        read_only=read_only or _int(block / "ro") == 1,
        discard=_int(q / "discard_max_hw_bytes") > 0,
        discard_granularity=max(lbs, _int(q / "discard_granularity", lbs)),
        write_zeroes=_int(q / "write_zeroes_max_bytes") > 0,
        dma_alignment=3,  # the driver maps dword-aligned user memory without a bounce
    )


_GENERIC = re.compile(r"ng(\d+)n(\d+)")


def namespace_block(path: str, sys_root: Path = Path("/sys")) -> Path:
    """The sysfs folder of the block device behind generic char device
    ``path`` (ngXnY -> nvmeXnY), or NvmeError."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise NvmeError(f"NVMe device {path}: {e.strerror}") from None
    hint = "pass the namespace's generic char device, e.g. /dev/ng0n1"
    if not stat.S_ISCHR(st.st_mode):
        raise NvmeError(f"{path} is not a character device: {hint}")
    name = (sys_root / "dev/char" / f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
            ).resolve().name
    m = _GENERIC.fullmatch(name)
    if m is None:
        raise NvmeError(f"{path} is not an NVMe generic char device: {hint}")
    block = sys_root / "block" / f"nvme{m[1]}n{m[2]}"
    if not (block / "size").exists():
        raise NvmeError(f"{path}: no block device nvme{m[1]}n{m[2]} in sysfs to read its "
                        "geometry from: is the namespace attached?")
    return block


def _failed(res: int) -> OSError:
    if res < 0:
        return OSError(-res, f"NVMe passthrough: {os.strerror(-res)}")
    return OSError(errno.EIO, f"NVMe passthrough: the controller answered status {res:#x}")


def _answer(n: int, done: Done) -> Handler:
    """A fast-path CQE handler: 0 is the whole transfer, anything else an error."""
    def on_cqe(res: int, flags: int) -> None:
        done(n if res == 0 else res if res < 0 else -errno.EIO)
    return on_cqe


@dataclass(frozen=True)
class Namespace:
    """An open namespace: its char device's fd, id and block size."""

    path: str
    fd: int
    nsid: int
    lbs: int

    def lba(self, offset: int) -> int:
        return offset // self.lbs


class NvmeTarget(Target):
    name = "nvme"
    big_ring_entries = True
    fixed_buffers = True

    def __init__(self, path: str, *, read_only: bool = False,
                 sys_root: Path = Path("/sys")) -> None:
        block = namespace_block(path, sys_root)
        try:
            fd = os.open(path, (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC)
        except OSError as e:
            raise NvmeError(f"NVMe device {path}: {e.strerror}") from None
        try:
            nsid = fcntl.ioctl(fd, NVME_IOCTL_ID)
        except OSError as e:
            os.close(fd)
            raise NvmeError(f"{path} does not answer NVME_IOCTL_ID ({e.strerror}): pass an "
                            "NVMe namespace's generic char device, e.g. /dev/ng0n1") from None
        self.geometry = geometry_from_sysfs(block, read_only)
        self.ns = Namespace(path, fd, nsid, self.geometry.logical_block_size)

    def map(self) -> Passthrough:
        g = self.geometry
        return Passthrough(self.ns.fd, self.ns.nsid, self.ns.lbs, g.volatile_cache, g.fua)

    async def _cmd(self, cmd: bytes, keep: object = None, fixed: FixedBuf | None = None) -> None:
        res = await current_ring().uring_cmd(
            self.ns.fd, NVME_URING_CMD_IO, cmd, keep=keep,
            cmd_flags=lib.IORING_URING_CMD_FIXED if fixed is not None else 0,
            buf_index=fixed.index if fixed is not None else 0)
        if res:
            raise _failed(res)

    def _rw(self, opcode: int, offset: int, buf: Buffer, fua: bool = False) -> bytes:
        ns = self.ns
        if (offset | len(buf)) % ns.lbs:  # a config's smaller logical_block_size
            raise OSError(errno.EINVAL, f"I/O not in whole {ns.lbs}-byte NVMe blocks")
        addr = buf.offset if isinstance(buf, FixedBuf) else buffer_address(buf)
        return rw_command(opcode, ns.nsid, ns.lba(offset), len(buf) // ns.lbs, addr, len(buf),
                          fua)

    async def _transfer(self, opcode: int, offset: int, buf: Buffer, fua: bool = False) -> None:
        fixed = buf if isinstance(buf, FixedBuf) else None
        await self._cmd(self._rw(opcode, offset, buf, fua), None if fixed else buf, fixed)

    async def read(self, offset: int, buf: Buffer) -> None:
        await self._transfer(OP_READ, offset, buf)

    async def write(self, offset: int, buf: Buffer, fua: bool = False) -> None:
        fua = fua and self.geometry.volatile_cache
        await self._transfer(OP_WRITE, offset, buf, fua and self.geometry.fua)
        if fua and not self.geometry.fua:
            await self.flush()

    def _start(self, opcode: int, offset: int, buf: memoryview, done: Done) -> bool:
        if (offset | len(buf)) % self.ns.lbs:
            return False  # the coroutine fails it
        current_ring().prep_cmd(self.ns.fd, NVME_URING_CMD_IO, self._rw(opcode, offset, buf),
                                handler=_answer(len(buf), done), keep=buf)
        return True

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        return self._start(OP_READ, offset, buf, done)

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        return self._start(OP_WRITE, offset, buf, done)

    async def flush(self) -> None:
        if self.geometry.volatile_cache:
            await self._cmd(command(OP_FLUSH, self.ns.nsid))

    async def discard(self, offset: int, length: int) -> None:
        ranges = bytearray(dsm_ranges(self.ns.lba(offset), length // self.ns.lbs))
        await self._cmd(dsm_command(self.ns.nsid, buffer_address(ranges), len(ranges)), ranges)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        lba, left = self.ns.lba(offset), length // self.ns.lbs
        while left:
            n = min(left, MAX_NLB)
            await self._cmd(write_zeroes_command(self.ns.nsid, lba, n, unmap))
            lba, left = lba + n, left - n

    async def drain(self) -> None:
        await self.flush()

    def close(self) -> None:
        os.close(self.ns.fd)

    def describe(self) -> dict[str, object]:
        return {"target": self.name, "size": self.geometry.size, "device": self.ns.path,
                "nsid": self.ns.nsid}


#: ``-t nvme``: its options, as the command line and config files take them
SPEC = TargetSpec("nvme", NvmeTarget, (
    Option("device", PATH, "the NVMe namespace's generic char device (/dev/ngXnY)",
           arg="*", required=True, what="NVMe generic char device"),
), files="device", read_only=True, rank=5)
