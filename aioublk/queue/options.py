"""What a device is asked to be, checked without I/O: the data-copy modes
(``CopyMode``, the one place that knows them), ``DeviceConfig`` (kublk's add
options and how they resolve against the kernel's features) and ``layout``
(which worker serves which queues and tags).

This module sits below the queue drivers and the device in the import order
(uapi -> ring -> target -> options -> driver -> perio/batch -> worker ->
device); it imports none of them.
"""

from __future__ import annotations

import enum
import mmap
from dataclasses import dataclass

from aioublk._uring import lib
from aioublk.errors import UblkError
from aioublk.kernel import uapi

#: the largest max_io_size: the data plane carries a request's sectors in 16
#: bits of user_data, and ublk_drv rounds the size down to whole pages (its
#: own limit, user copy's 25-bit buffer offset, is 32 MiB: above this one)
MAX_IO_SIZE = (lib.AUR_DP_MAX_SECTORS << 9) // mmap.PAGESIZE * mmap.PAGESIZE


class CopyMode(enum.Enum):
    """How request data moves between the kernel and the target (kublk's flags)."""

    COPY = "copy"             # default: the kernel copies to/from our buffer
    ZERO_COPY = "zero_copy"   # -z: register the request's pages, fixed-buffer I/O
    AUTO_ZC = "auto_zc"       # --auto_zc: the kernel registers them for us
    USER_COPY = "user_copy"   # -u: pread/pwrite on /dev/ublkcN

    @property
    def flags(self) -> int:
        return {
            CopyMode.COPY: 0,
            CopyMode.ZERO_COPY: uapi.Feature.SUPPORT_ZERO_COPY,
            CopyMode.AUTO_ZC: uapi.Feature.AUTO_BUF_REG,
            CopyMode.USER_COPY: uapi.Feature.USER_COPY,
        }[self]

    @property
    def own_buffers(self) -> bool:
        return self in (CopyMode.COPY, CopyMode.USER_COPY)

    @property
    def fixed(self) -> bool:
        return self in (CopyMode.ZERO_COPY, CopyMode.AUTO_ZC)

    @property
    def data_plane(self) -> int:
        """How the C data plane serves in this mode (``AUR_DP_*``): in the tag's
        buffer (filled and emptied by the kernel, or by C through /dev/ublkcN
        with -u), or with fixed-buffer I/O on the kernel's registration or on
        its own (-z)."""
        return int({CopyMode.COPY: lib.AUR_DP_COPY, CopyMode.AUTO_ZC: lib.AUR_DP_AUTO_ZC,
                    CopyMode.ZERO_COPY: lib.AUR_DP_ZERO_COPY,
                    CopyMode.USER_COPY: lib.AUR_DP_USER_COPY}[self])



class IntegrityError(UblkError):
    """An integrity option refused; ``key`` is the one at fault
    (metadata_size, pi_offset, csum_type, tag_size or integrity_reftag), for
    a config file to name it."""

    def __init__(self, key: str, msg: str) -> None:
        super().__init__(msg)
        self.key = key


def integrity(metadata_size: int = 0, *, pi_offset: int = 0, csum_type: str = "none",
              capable: bool = False, reftag: bool = False, tag_size: int = 0,
              prefix: str = "--") -> uapi.Integrity | None:
    """kublk's integrity options as ``ublk_param_integrity`` (None without
    ``--metadata_size``), refused in one line where ublk_drv would refuse
    them with a bare EINVAL (IntegrityError). One interval per 512-byte
    sector, as kublk. The refusals write each option as ``prefix`` + its
    name: "--" for the command line, "" for a config file's keys."""
    def opt(key: str) -> str:
        return prefix + key

    if not metadata_size:
        given = [k for k, on in (("integrity_capable", capable), ("integrity_reftag", reftag),
                                 ("pi_offset", pi_offset), ("csum_type", csum_type != "none"),
                                 ("tag_size", tag_size)) if on]
        if given:
            raise IntegrityError(given[0], f"integrity options need {opt('metadata_size')} N: "
                                 "give the bytes of metadata per 512-byte sector")
        return None
    for key, value in (("metadata_size", metadata_size), ("pi_offset", pi_offset),
                       ("tag_size", tag_size)):
        if not 0 <= value <= 255:
            raise IntegrityError(key, f"{opt(key)} {value} out of range: use 0..255")
    csum = uapi.PI_CSUM.get(csum_type)
    if csum is None:
        raise IntegrityError("csum_type", f"{opt('csum_type')} {csum_type} is unknown: use ip, "
                             "t10dif or nvme")
    tuple_size = uapi.PI_TUPLE_SIZE[csum]
    if pi_offset + tuple_size > metadata_size:
        at = f"{opt('pi_offset')} {pi_offset}"
        what = f"a {tuple_size}-byte {csum_type} PI tuple at {at}" if tuple_size else at
        raise IntegrityError("pi_offset", f"{what} does not fit in {opt('metadata_size')} "
                             f"{metadata_size}: raise {opt('metadata_size')} to "
                             f"{pi_offset + tuple_size} or more")
    if reftag and not csum:
        raise IntegrityError("integrity_reftag", f"{opt('integrity_reftag')} needs a PI tuple: "
                             f"add {opt('csum_type')} t10dif (or ip, nvme)")
    flags = (uapi.PI_CAP_INTEGRITY if capable else 0) | (uapi.PI_CAP_REFTAG if reftag else 0)
    return uapi.Integrity(metadata_size, 9, pi_offset, csum, tag_size, flags)


@dataclass
class DeviceConfig:
    """What a device is created with (kublk's add options)."""

    dev_id: int = -1
    queues: int = 1
    depth: int = 128
    flags: int = 0               # extra UBLK_F_* flags (e.g. NO_AUTO_PART_SCAN)
    max_io_size: int = 1 << 20
    #: batch I/O: None = when the kernel has it, True = required (-b), False = never
    batch: bool | None = None
    copy: CopyMode = CopyMode.COPY
    auto_zc_fallback: bool = False  # with AUTO_ZC: register by hand when the kernel cannot
    #: UBLK_F_NEED_GET_DATA (kublk -g): a write's data is copied into the tag's
    #: buffer only once the server asks (UBLK_IO_NEED_GET_DATA), not at fetch
    get_data: bool = False
    nthreads: int = 0            # worker threads; 0 = one per queue
    per_io_tasks: bool = False   # per-I/O path: spread each queue's tags over the workers
    one_loop: bool = False       # every queue on one thread (targets that need it set it)
    fetch_buf_bytes: int = 0     # batch: bytes per provided fetch buffer (0 = depth's tags)
    fetch_buf_entries: int = 0   # batch: provided buffers per queue and worker (0 = 8)
    #: user recovery (kublk -r/-i/-e): after the server dies the device waits,
    #: QUIESCED, for a new server (``Device.start(recover=True)``); with
    #: reissue the requests the old server held are replayed, with fail_io
    #: I/O fails while no server is attached
    recovery: bool = False
    recovery_reissue: bool = False
    recovery_fail_io: bool = False
    #: UBLK_F_UNPRIVILEGED_DEV: made by a user without CAP_SYS_ADMIN, who then
    #: owns it (its nodes are handed over by the udev rule, ``aioublk udev``)
    unprivileged: bool = False
    #: UBLK_F_ZONED: the target is zoned (set from it, like one_loop); needs user copy
    zoned: bool = False
    #: UBLK_F_INTEGRITY (kublk --metadata_size...; see ``integrity``): each
    #: request's metadata goes to the target with its data; needs user copy
    integrity: uapi.Integrity | None = None
    #: UBLK_F_SHMEM_ZC (kublk --shmem_zc): a request whose pages lie in a
    #: registered shared buffer arrives by reference (index, offset) and is
    #: served in the server's own mapping of it; the others as the copy mode says
    shmem_zc: bool = False
    #: (--htlb FILE) the shared buffer: a hugetlbfs file the clients map too
    htlb: str | None = None
    #: (--rdonly_shmem_buf) map and register it read-only: only writes match
    rdonly_shmem_buf: bool = False

    #: device flags a caller may pass in ``flags``; the rest come from the options
    SUPPORTED_FLAGS = uapi.Feature.NO_AUTO_PART_SCAN

    def validate(self) -> None:
        unsupported = self.flags & ~self.SUPPORTED_FLAGS
        if unsupported:
            raise UblkError(f"aioublk does not serve {uapi.flag_list(unsupported)}: "
                            "leave it out")
        if not 1 <= self.depth <= uapi.MAX_QUEUE_DEPTH:
            raise UblkError(f"queue depth {self.depth} out of range: use 1..4096")
        if not mmap.PAGESIZE <= self.max_io_size <= MAX_IO_SIZE:
            raise UblkError(f"max_io_size {self.max_io_size} out of range: use "
                            f"{mmap.PAGESIZE}..{MAX_IO_SIZE} bytes")
        if not 1 <= self.queues <= 32:
            raise UblkError(f"{self.queues} queues out of range: use 1..32")
        if not -1 <= self.dev_id < uapi.MAX_DEV_ID:
            raise UblkError(f"device id {self.dev_id} is invalid: use -1 (any) or "
                            f"0..{uapi.MAX_DEV_ID - 1}")
        if not 0 <= self.nthreads <= 64:
            raise UblkError(f"--nthreads {self.nthreads} out of range: use 1..64")
        if self.per_io_tasks and self.batch:
            raise UblkError("--per_io_tasks and -b/--batch conflict: per-I/O tasks are a "
                            "per-I/O path feature (use --nthreads alone with batch)")
        if self.auto_zc_fallback and self.copy is not CopyMode.AUTO_ZC:
            raise UblkError("--auto_zc_fallback needs --auto_zc")
        if self.get_data and self.copy is not CopyMode.COPY:
            raise UblkError(f"-g/--get_data and copy mode {self.copy.value} conflict (the "
                            "kernel drops UBLK_F_NEED_GET_DATA with -z, --auto_zc and -u): "
                            "pick one")
        if self.get_data and self.batch:
            raise UblkError("-g/--get_data needs the per-I/O path (batch I/O has no "
                            "NEED_GET_DATA command): drop -b/--batch")
        if self.recovery_reissue and self.recovery_fail_io:
            raise UblkError("-i 1 (reissue) and -e 1 (fail I/O) are different recovery modes: "
                            "pick one")
        if self.unprivileged and self.copy is not CopyMode.COPY:
            raise UblkError(f"copy mode {self.copy.value} needs root: the kernel refuses zero "
                            "copy, auto buffer registration and user copy (-z, --auto_zc, -u) "
                            "for unprivileged devices (drop it, or drop --unprivileged and "
                            "run as root)")
        if self.zoned and self.copy is not CopyMode.USER_COPY:
            raise UblkError(f"a zoned device and copy mode {self.copy.value} conflict: aioublk "
                            "serves zoned devices with user copy only (-u)")
        if self.integrity is not None and self.copy is not CopyMode.USER_COPY:
            raise UblkError(f"--metadata_size and copy mode {self.copy.value} conflict: the "
                            "kernel moves integrity data only by user copy: add -u")
        if self.unprivileged and self.recovery_flags:
            raise UblkError("user recovery (-r/-e/-i) needs root: the kernel drops it for "
                            "unprivileged devices (drop it, or drop --unprivileged and run as "
                            "root)")
        if self.htlb and not self.shmem_zc:
            raise UblkError("--htlb needs --shmem_zc (the kernel registers shared buffers only "
                            "on a device added with UBLK_F_SHMEM_ZC): add it")
        if self.rdonly_shmem_buf and not self.htlb:
            raise UblkError("--rdonly_shmem_buf needs --htlb FILE: it says how that buffer is "
                            "registered")
        if self.htlb and self.recovery_flags:
            # (seen: REG_BUF from the recovering server answers EEXIST, and
            # the dead server's registration still matches clients' pages)
            raise UblkError("user recovery (-r/-i/-e) and --htlb conflict: the kernel keeps "
                            "the dead server's shared-buffer registration and refuses the new "
                            "server's (EEXIST), so its requests could not be served: drop one")
        if self.shmem_zc and self.zoned:
            raise UblkError("a zoned device and --shmem_zc conflict: aioublk serves zoned "
                            "devices with user copy only (drop --shmem_zc)")
        if (self.fetch_buf_bytes and (self.fetch_buf_bytes % 2
                                      or not 2 <= self.fetch_buf_bytes <= 4096)) \
                or self.fetch_buf_entries & (self.fetch_buf_entries - 1) \
                or self.fetch_buf_entries > 4096:
            raise UblkError("fetch buffers: bytes must be even (2..4096) and entries a power "
                            "of two (1..4096)")

    @property
    def recovery_flags(self) -> int:
        flags = 0
        if self.recovery or self.recovery_reissue or self.recovery_fail_io:
            flags |= uapi.Feature.USER_RECOVERY
        if self.recovery_reissue:
            flags |= uapi.Feature.USER_RECOVERY_REISSUE
        if self.recovery_fail_io:
            flags |= uapi.Feature.USER_RECOVERY_FAIL_IO
        return flags

    def threads(self) -> int:
        return 1 if self.one_loop else self.nthreads or self.queues

    def spread(self, batch: bool) -> bool:
        """Per-I/O path with each queue's tags dealt over the workers (per-I/O daemons)."""
        return self.per_io_tasks or (self.one_loop and not batch and self.queues > 1)

    def resolve(self, features: int) -> tuple[bool, int]:
        """Against the kernel's features: (use batch I/O, device flags).
        Raises UblkError for what this kernel or combination cannot do."""
        has_batch = bool(features & uapi.Feature.BATCH_IO)
        if self.batch and not has_batch:
            raise UblkError("this kernel's ublk_drv lacks UBLK_F_BATCH_IO (kernel 6.19+): "
                            "drop -b/--batch")
        if self.batch and self.depth < 2:
            raise UblkError("batch I/O needs a queue depth of 2 or more (ublk_drv refuses "
                            "depth 1 with UBLK_F_BATCH_IO): raise -d or drop -b")
        auto = has_batch and not self.per_io_tasks and not self.get_data and self.depth >= 2
        batch = auto if self.batch is None else self.batch
        nthreads = self.threads()
        if not batch and nthreads != self.queues and not self.spread(batch):
            raise UblkError(f"--nthreads {nthreads} differs from -q {self.queues}: add "
                            "--per_io_tasks, or use batch I/O (-b)")
        flags = self.flags | self.copy.flags | self.recovery_flags
        if self.get_data:
            flags |= uapi.Feature.NEED_GET_DATA
        if self.unprivileged:
            flags |= uapi.Feature.UNPRIVILEGED_DEV
        if self.zoned:
            flags |= uapi.Feature.ZONED
        if self.integrity is not None:
            flags |= uapi.Feature.INTEGRITY
        if self.shmem_zc:
            flags |= uapi.Feature.SHMEM_ZC
        if flags & uapi.Feature.USER_RECOVERY and features & uapi.Feature.QUIESCE:
            flags |= uapi.Feature.QUIESCE  # as kublk: lets ``quiesce`` hand over the device
        if self.auto_zc_fallback:
            flags |= uapi.Feature.SUPPORT_ZERO_COPY
        if batch:
            flags |= uapi.Feature.BATCH_IO
            if self.copy is CopyMode.AUTO_ZC and nthreads > self.queues:
                raise UblkError(f"--auto_zc with batch I/O cannot use more threads "
                                f"({nthreads}) than queues ({self.queues}): lower --nthreads")
        missing = flags & ~features
        if self.spread(batch) and not features & uapi.Feature.PER_IO_DAEMON:
            if not self.per_io_tasks:
                raise UblkError(f"this target serves all {self.queues} queues from one thread, "
                                "which needs batch I/O or UBLK_F_PER_IO_DAEMON (kernel "
                                "6.17+): use -q 1")
            missing |= uapi.Feature.PER_IO_DAEMON
        if missing:
            raise UblkError("this kernel's ublk_drv does not support "
                            f"{uapi.flag_list(missing)}: drop the option that asks for it")
        return batch, flags


def layout(queues: int, depth: int, nthreads: int, *, batch: bool,
           per_io_tasks: bool) -> list[list[tuple[int, list[int]]]]:
    """For each worker, the (queue, tags) it serves."""
    work: list[dict[int, list[int]]] = [{} for _ in range(nthreads)]
    if batch:
        # kublk's round-robin N:M map: worker i % N serves queue i % M
        for i in range(max(queues, nthreads)):
            work[i % nthreads].setdefault(i % queues, list(range(depth)))
        return [sorted(w.items()) for w in work]
    if per_io_tasks:
        # the n-th (queue, tag) pair, in queue-major order, goes to worker n % N
        for n in range(queues * depth):
            work[n % nthreads].setdefault(n // depth, []).append(n % depth)
        return [sorted(w.items()) for w in work]
    return [[(q, list(range(depth)))] for q in range(queues)]


