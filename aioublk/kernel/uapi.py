"""The ublk kernel ABI (``include/uapi/linux/ublk_cmd.h``) as plain data.

No I/O here: opcodes, feature bits and struct layouts, each encoded and
decoded with ``struct`` so they can be tested against the real header on any
machine (``tests/kernel/test_uapi.py`` compiles the sizes and values out of it).
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

# ---------------------------------------------------------------- opcodes --

_IOC_WRITE, _IOC_READ = 1, 2


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ord("u") << 8) | nr


CTRL_CMD_SIZE = 32
IO_CMD_SIZE = 16
BATCH_IO_SIZE = 16


def _ior(nr: int, size: int = CTRL_CMD_SIZE) -> int:
    return _ioc(_IOC_READ, nr, size)


def _iowr(nr: int, size: int = CTRL_CMD_SIZE) -> int:
    return _ioc(_IOC_READ | _IOC_WRITE, nr, size)


class Cmd(enum.IntEnum):
    """Control commands on /dev/ublk-control (ioctl-encoded)."""

    GET_QUEUE_AFFINITY = _ior(0x01)
    GET_DEV_INFO = _ior(0x02)
    ADD_DEV = _iowr(0x04)
    DEL_DEV = _iowr(0x05)
    START_DEV = _iowr(0x06)
    STOP_DEV = _iowr(0x07)
    SET_PARAMS = _iowr(0x08)
    GET_PARAMS = _ior(0x09)
    START_USER_RECOVERY = _iowr(0x10)
    END_USER_RECOVERY = _iowr(0x11)
    GET_DEV_INFO2 = _ior(0x12)
    GET_FEATURES = _ior(0x13)
    DEL_DEV_ASYNC = _ior(0x14)
    UPDATE_SIZE = _iowr(0x15)
    QUIESCE_DEV = _iowr(0x16)
    TRY_STOP_DEV = _iowr(0x17)
    #: UBLK_F_SHMEM_ZC: pin a shared mapping (``SHMEM_BUF_REG`` at addr); the
    #: result is the buffer's index
    REG_BUF = _iowr(0x18)
    UNREG_BUF = _iowr(0x19)  # data[0]: the index


class IoCmd(enum.IntEnum):
    """I/O commands on /dev/ublkcN."""

    FETCH_REQ = _iowr(0x20, IO_CMD_SIZE)
    COMMIT_AND_FETCH_REQ = _iowr(0x21, IO_CMD_SIZE)
    NEED_GET_DATA = _iowr(0x22, IO_CMD_SIZE)
    REGISTER_IO_BUF = _iowr(0x23, IO_CMD_SIZE)
    UNREGISTER_IO_BUF = _iowr(0x24, IO_CMD_SIZE)
    PREP_IO_CMDS = _iowr(0x25, BATCH_IO_SIZE)
    COMMIT_IO_CMDS = _iowr(0x26, BATCH_IO_SIZE)
    FETCH_IO_CMDS = _iowr(0x27, BATCH_IO_SIZE)


# ---------------------------------------------------------------- features --


class Feature(enum.IntFlag):
    """``UBLK_F_*``: driver features and per-device flags."""

    SUPPORT_ZERO_COPY = 1 << 0
    URING_CMD_COMP_IN_TASK = 1 << 1
    NEED_GET_DATA = 1 << 2
    USER_RECOVERY = 1 << 3
    USER_RECOVERY_REISSUE = 1 << 4
    UNPRIVILEGED_DEV = 1 << 5
    CMD_IOCTL_ENCODE = 1 << 6
    USER_COPY = 1 << 7
    ZONED = 1 << 8
    USER_RECOVERY_FAIL_IO = 1 << 9
    UPDATE_SIZE = 1 << 10
    AUTO_BUF_REG = 1 << 11
    QUIESCE = 1 << 12
    PER_IO_DAEMON = 1 << 13
    BUF_REG_OFF_DAEMON = 1 << 14
    BATCH_IO = 1 << 15
    INTEGRITY = 1 << 16
    SAFE_STOP_DEV = 1 << 17
    NO_AUTO_PART_SCAN = 1 << 18
    SHMEM_ZC = 1 << 19


def feature_names(bits: int) -> list[tuple[int, str]]:
    """(bit value, ``UBLK_F_NAME``) for each set bit, in order; unknown bits
    are named ``unknown`` as kublk does."""
    out = []
    for i in range(64):
        bit = 1 << i
        if bits & bit:
            known = Feature._value2member_map_.get(bit)
            out.append((bit, f"UBLK_F_{known.name}" if known is not None else "unknown"))
    return out


def flag_list(bits: int) -> str:
    """``UBLK_F_A, UBLK_F_B`` for messages."""
    return ", ".join(name for _bit, name in feature_names(bits))


class BatchFlag(enum.IntFlag):
    """``UBLK_BATCH_F_*``: what a PREP/COMMIT_IO_CMDS element carries after its
    header (C encodes them: ``aur_dp_prep_io_cmds``; tests read them back)."""

    HAS_ZONE_LBA = 1 << 0
    HAS_BUF_ADDR = 1 << 1
    AUTO_BUF_REG_FALLBACK = 1 << 2


class State(enum.IntEnum):
    DEAD = 0
    LIVE = 1
    QUIESCED = 2
    FAIL_IO = 3


class Op(enum.IntEnum):
    """``UBLK_IO_OP_*``: the low 8 bits of ``ublksrv_io_desc.op_flags``."""

    READ = 0
    WRITE = 1
    FLUSH = 2
    DISCARD = 3
    WRITE_SAME = 4
    WRITE_ZEROES = 5
    ZONE_OPEN = 10
    ZONE_CLOSE = 11
    ZONE_FINISH = 12
    ZONE_APPEND = 13
    ZONE_RESET_ALL = 14
    ZONE_RESET = 15
    #: ``nr_sectors`` holds the number of zones; the data is ``struct blk_zone``s
    REPORT_ZONES = 18


def op_name(op_flags: int) -> str:
    """``READ``, ``WRITE``... for a descriptor's ``op_flags`` (for logs)."""
    try:
        return Op(op_flags & 0xFF).name
    except ValueError:
        return f"op{op_flags & 0xFF}"


IO_F_FUA = 1 << 13
IO_F_NOUNMAP = 1 << 15
IO_F_NEED_REG_BUF = 1 << 17
#: the request carries an integrity (metadata) buffer (``UBLK_F_INTEGRITY``)
IO_F_INTEGRITY = 1 << 18
#: the request's data is in a registered shared buffer: ``addr`` holds its
#: index and offset (``shmem_zc_place``), and the kernel copies nothing
IO_F_SHMEM_ZC = 1 << 19

IO_RES_OK = 0
IO_RES_NEED_GET_DATA = 1

MAX_QUEUE_DEPTH = 4096
MAX_NR_QUEUES = 4096
CTRL_QUEUE_NONE = 0xFFFF
DEV_ID_ANY = 0xFFFF_FFFF
MAX_DEV_ID = 1 << 20  # ublk_drv's UBLK_MAX_UBLKS: ids are 0..MAX_DEV_ID-1

# /dev/ublkcN offsets for mmap (descriptors) and pread/pwrite (USER_COPY)
IO_BUF_OFFSET = 0x8000_0000
IO_BUF_BITS = 25
TAG_OFF = IO_BUF_BITS
QID_OFF = IO_BUF_BITS + 16

IO_DESC = struct.Struct("=IIQQ")  # op_flags, nr_sectors, start_sector, addr


def desc_area_size(depth: int, page_size: int = 4096) -> int:
    """Bytes of one queue's mmapped descriptor array."""
    size = depth * IO_DESC.size
    return (size + page_size - 1) // page_size * page_size


def desc_mmap_offset(q_id: int, page_size: int = 4096) -> int:
    """Each queue's descriptors sit at a stride sized for the maximum depth."""
    return q_id * desc_area_size(MAX_QUEUE_DEPTH, page_size)


#: ORed into a user-copy offset: the request's integrity buffer, not its data
IO_INTEGRITY_FLAG = 1 << 62


def user_copy_offset(q_id: int, tag: int, integrity: bool = False) -> int:
    """pread/pwrite offset on /dev/ublkcN for a request's data (USER_COPY),
    or with ``integrity`` its metadata (offsets in metadata bytes)."""
    pos = IO_BUF_OFFSET + ((q_id << QID_OFF) | (tag << TAG_OFF))
    return pos | IO_INTEGRITY_FLAG if integrity else pos


# ---------------------------------------------------------------- structs --

CTRL_CMD = struct.Struct("=IHHQQHHI")  # dev_id queue_id len addr data0 path_len pad rsvd
IO_CMD = struct.Struct("=HHiQ")  # q_id tag result addr
BATCH_IO = struct.Struct("=HHHBBQ")  # q_id flags nr_elem elem_bytes rsvd rsvd2
ELEM_HEADER = struct.Struct("=HHi")  # tag buf_index result


#: ``struct ublk_shmem_buf_reg``: addr len flags reserved (REG_BUF's payload)
SHMEM_BUF_REG = struct.Struct("=QQII")
#: pin without write access: only writes can then match the buffer
SHMEM_BUF_READ_ONLY = 1 << 0


def shmem_zc_place(addr: int) -> tuple[int, int]:
    """(buffer index, byte offset) of an ``IO_F_SHMEM_ZC`` request's ``addr``."""
    return (addr >> 32) & 0xFFFF, addr & 0xFFFF_FFFF


def ctrl_cmd(dev_id: int, *, queue_id: int = CTRL_QUEUE_NONE, length: int = 0,
             addr: int = 0, data: int = 0, dev_path_len: int = 0) -> bytes:
    """``dev_path_len``: the buffer at ``addr`` starts with that many bytes of
    the device's char path (unprivileged devices; ``length`` counts them)."""
    return CTRL_CMD.pack(dev_id, queue_id, length, addr, data, dev_path_len, 0, 0)


def io_cmd(q_id: int, tag: int, result: int = 0, addr: int = 0) -> bytes:
    return IO_CMD.pack(q_id, tag, result, addr)


_DEV_INFO = struct.Struct("=HHHHIIiIQQIIQQ")
DEV_INFO_SIZE = _DEV_INFO.size


class DevInfo(NamedTuple):
    """``struct ublksrv_ctrl_dev_info`` (64 bytes)."""

    nr_hw_queues: int = 1
    queue_depth: int = 128
    state: int = 0
    max_io_buf_bytes: int = 1 << 20
    dev_id: int = DEV_ID_ANY
    ublksrv_pid: int = -1
    flags: int = 0
    ublksrv_flags: int = 0
    owner_uid: int = 0
    owner_gid: int = 0

    def pack(self) -> bytes:
        return _DEV_INFO.pack(
            self.nr_hw_queues, self.queue_depth, self.state, 0, self.max_io_buf_bytes,
            self.dev_id, self.ublksrv_pid, 0, self.flags, self.ublksrv_flags,
            self.owner_uid, self.owner_gid, 0, 0,
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> DevInfo:
        (q, d, st, _p0, mx, dev_id, pid, _p1, flags, sflags, uid, gid, _r1, _r2) = (
            _DEV_INFO.unpack_from(data)
        )
        return cls(q, d, st, mx, dev_id, pid, flags, sflags, uid, gid)


PARAM_TYPE_BASIC = 1 << 0
PARAM_TYPE_DISCARD = 1 << 1
PARAM_TYPE_DEVT = 1 << 2
PARAM_TYPE_ZONED = 1 << 3
PARAM_TYPE_DMA_ALIGN = 1 << 4
PARAM_TYPE_SEGMENT = 1 << 5
PARAM_TYPE_INTEGRITY = 1 << 6

#: ``ublk_param_integrity.flags`` (``LBMD_PI_CAP_*``, linux/fs.h)
PI_CAP_INTEGRITY = 1 << 0  # the device itself checks PI (sysfs device_is_integrity_capable)
PI_CAP_REFTAG = 1 << 1     # the PI carries a reference tag (T10 type 1)
#: ``ublk_param_integrity.csum_type`` (``LBMD_PI_CSUM_*``): name -> value
PI_CSUM = {"none": 0, "ip": 1, "t10dif": 2, "nvme": 4}
#: bytes of one PI tuple per checksum type (ublk_drv's pi_tuple_size)
PI_TUPLE_SIZE = {0: 0, 1: 8, 2: 8, 4: 16}

ATTR_READ_ONLY = 1 << 0
ATTR_ROTATIONAL = 1 << 1
ATTR_VOLATILE_CACHE = 1 << 2
ATTR_FUA = 1 << 3

_HDR = struct.Struct("=II")  # len types
_BASIC = struct.Struct("=IBBBBIIQQ")  # 32
_DISCARD = struct.Struct("=IIIIHH")  # 20
_DEVT = struct.Struct("=IIII")  # 16
_ZONED = struct.Struct("=III20x")  # 32
_DMA = struct.Struct("=I4x")  # 8
_SEG_PAD = 4  # ublk_param_segment holds a u64, so it is 8-byte aligned
_SEG = struct.Struct("=QIH2x")  # 16
_INTEGRITY = struct.Struct("=IHBBBBB5x")  # 16
PARAMS_SIZE = (_HDR.size + _BASIC.size + _DISCARD.size + _DEVT.size + _ZONED.size
               + _DMA.size + _SEG_PAD + _SEG.size + _INTEGRITY.size)


class Integrity(NamedTuple):
    """``struct ublk_param_integrity``: ``metadata_size`` bytes per
    ``1 << interval_exp`` bytes of data, a PI tuple of ``csum_type``
    (``PI_CSUM``) at ``pi_offset`` in them, ``tag_size`` bytes of tag."""

    metadata_size: int
    interval_exp: int = 9
    pi_offset: int = 0
    csum_type: int = 0
    tag_size: int = 0
    flags: int = 0               # PI_CAP_*
    max_segments: int = 0        # 0: no limit

    def pack(self) -> bytes:
        return _INTEGRITY.pack(self.flags, self.max_segments, self.interval_exp,
                               self.metadata_size, self.pi_offset, self.csum_type,
                               self.tag_size)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview, offset: int = 0) -> Integrity:
        flags, segs, exp, size, pi_offset, csum, tag = _INTEGRITY.unpack_from(data, offset)
        return cls(size, exp, pi_offset, csum, tag, flags, segs)

    def meta_bytes(self, data_bytes: int) -> int:
        """Bytes of metadata that go with ``data_bytes`` of data."""
        return (data_bytes >> self.interval_exp) * self.metadata_size

    def metadata_bytes_to_data(self, meta_bytes: int) -> int:
        """Bytes of data that ``meta_bytes`` of metadata cover (whole intervals)."""
        return meta_bytes // self.metadata_size << self.interval_exp


class Params(NamedTuple):
    """``struct ublk_params``: the parts a target sets (basic, discard, DMA
    alignment, segments) plus the read-only device numbers."""

    dev_sectors: int = 0
    logical_bs_shift: int = 9
    physical_bs_shift: int = 12
    io_opt_shift: int = 12
    io_min_shift: int = 9
    max_sectors: int = (1 << 20) >> 9
    attrs: int = 0
    chunk_sectors: int = 0
    virt_boundary_mask: int = 0
    discard: tuple[int, int, int, int, int] | None = None  # align gran max_disc max_wz segs
    dma_alignment: int | None = None
    segment: tuple[int, int, int] | None = None  # boundary_mask max_seg_size max_segs
    devt: tuple[int, int, int, int] = (0, 0, 0, 0)
    #: ``ublk_param_zoned``: max_open_zones max_active_zones max_zone_append_sectors
    zoned: tuple[int, int, int] | None = None
    integrity: Integrity | None = None
    types: int = 0

    def pack(self) -> bytes:
        types = PARAM_TYPE_BASIC
        discard = (0, 0, 0, 0, 0)
        if self.discard is not None:
            types |= PARAM_TYPE_DISCARD
            discard = self.discard
        dma = 0
        if self.dma_alignment is not None:
            types |= PARAM_TYPE_DMA_ALIGN
            dma = self.dma_alignment
        zoned = (0, 0, 0)
        if self.zoned is not None:
            types |= PARAM_TYPE_ZONED
            zoned = self.zoned
        seg = (0, 0, 0)
        if self.segment is not None:
            types |= PARAM_TYPE_SEGMENT
            seg = self.segment
        integrity = b"\0" * _INTEGRITY.size
        if self.integrity is not None:
            types |= PARAM_TYPE_INTEGRITY
            integrity = self.integrity.pack()
        return b"".join((
            _HDR.pack(PARAMS_SIZE, types),
            _BASIC.pack(self.attrs, self.logical_bs_shift, self.physical_bs_shift,
                        self.io_opt_shift, self.io_min_shift, self.max_sectors,
                        self.chunk_sectors, self.dev_sectors, self.virt_boundary_mask),
            _DISCARD.pack(*discard, 0),
            _DEVT.pack(0, 0, 0, 0),
            _ZONED.pack(*zoned),
            _DMA.pack(dma),
            bytes(_SEG_PAD),
            _SEG.pack(*seg),
            integrity,
        ))

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Params:
        _len, types = _HDR.unpack_from(data, 0)
        off = _HDR.size
        (attrs, lbs, pbs, opt, mn, max_sectors, chunk, sectors, vbm) = _BASIC.unpack_from(
            data, off)
        off += _BASIC.size
        disc = _DISCARD.unpack_from(data, off)
        off += _DISCARD.size
        devt = _DEVT.unpack_from(data, off)
        off += _DEVT.size
        zoned = _ZONED.unpack_from(data, off)
        off += _ZONED.size
        (dma,) = _DMA.unpack_from(data, off)
        off += _DMA.size + _SEG_PAD
        seg = _SEG.unpack_from(data, off)
        off += _SEG.size
        integrity = Integrity.unpack(data, off) if types & PARAM_TYPE_INTEGRITY else None
        return cls(
            dev_sectors=sectors, logical_bs_shift=lbs, physical_bs_shift=pbs,
            io_opt_shift=opt, io_min_shift=mn, max_sectors=max_sectors, attrs=attrs,
            chunk_sectors=chunk, virt_boundary_mask=vbm,
            discard=tuple(disc[:5]) if types & PARAM_TYPE_DISCARD else None,
            dma_alignment=dma if types & PARAM_TYPE_DMA_ALIGN else None,
            segment=tuple(seg) if types & PARAM_TYPE_SEGMENT else None,
            devt=devt, zoned=tuple(zoned) if types & PARAM_TYPE_ZONED else None,
            integrity=integrity, types=types,
        )


# ---------------------------------------------------------------- zones --

#: ``struct blk_zone`` (linux/blkzoned.h): start len wp (sectors), type cond
#: non_seq reset, 4 reserved, capacity (sectors), 24 reserved
BLK_ZONE = struct.Struct("=QQQBBBB4xQ24x")  # 64

ZONE_TYPE_CONVENTIONAL = 1
ZONE_TYPE_SEQWRITE_REQ = 2

ZONE_COND_NOT_WP = 0x0
ZONE_COND_EMPTY = 0x1
ZONE_COND_IMP_OPEN = 0x2
ZONE_COND_EXP_OPEN = 0x3
ZONE_COND_CLOSED = 0x4
ZONE_COND_FULL = 0xE


def pack_zones(zones: list[tuple[int, int, int, int, int, int]], buf: memoryview) -> None:
    """Fill ``buf`` with ``struct blk_zone`` entries, one per (start, len,
    wp, type, cond, capacity), all in sectors; zeros after the last one (a
    zero-length zone tells the kernel the report ends there)."""
    size = BLK_ZONE.size
    end = 0
    for i, (start, length, wp, ztype, cond, capacity) in enumerate(zones):
        if (i + 1) * size > len(buf):
            raise ValueError(f"{len(zones)} zones do not fit in {len(buf)} bytes")
        BLK_ZONE.pack_into(buf, i * size, start, length, wp, ztype, cond, 0, 0, capacity)
        end = (i + 1) * size
    buf[end:] = bytes(len(buf) - end)
