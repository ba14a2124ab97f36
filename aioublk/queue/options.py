"""What a device is asked to be, checked without I/O: the data-copy modes
(``CopyMode``, the one place that knows them), the device options
(``DEVICE_OPTIONS`` and ``CONFLICTS``, declared once: the command line,
config files and docs are made from them), ``DeviceConfig`` (kublk's add
options and how they resolve against the kernel's features) and ``layout``
(which worker serves which queues and tags).

This module sits below the queue drivers and the device in the import order
(uapi -> ring -> target -> options -> driver -> perio/batch -> worker ->
device); it imports none of them.
"""

from __future__ import annotations

import enum
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

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
        """The kernel feature the mode's flag (-z, --auto_zc, -u) declares."""
        return next((o.feature for o in DEVICE_OPTIONS
                     if o.attr == "copy" and o.value == self.value), 0)

    @property
    def own_buffers(self) -> bool:
        """The server has a buffer per tag (copy and user copy); zero copy
        works on the request's own pages."""
        return self in (CopyMode.COPY, CopyMode.USER_COPY)

    @property
    def fixed(self) -> bool:
        """The backend does fixed-buffer I/O on the request's registered pages
        (zero copy, auto zero copy)."""
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



class OptionError(UblkError):
    """A device option refused; ``key`` is the one at fault, for a config
    file to name it, and ``config`` the config file's own wording, if it
    has one (the message speaks of flags)."""

    def __init__(self, key: str, msg: str, config: str = "") -> None:
        super().__init__(msg)
        self.key = key
        self.config = config


class IntegrityError(OptionError):
    """An integrity option refused (metadata_size, pi_offset, csum_type,
    tag_size or integrity_reftag); its message already names the key."""


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
        o = option(key)
        if not o.within(value):
            raise IntegrityError(key, f"{opt(key)} {value} out of range: use {o.lo}..{o.hi}")
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


#: how a device option is read: INT, BOOL (a flag, true/false), FLAG01 (kublk's
#: "-r 0|1" on the command line, a bool in a config), CHOICE, PATH, ID (-n:
#: an int the command line bounds by the kernel's id space) and TRISTATE
#: (batch: a flag and its negation, "auto"/true/false in a config)
INT, BOOL, FLAG01, CHOICE, PATH, ID, TRISTATE = (
    "int", "bool", "0|1", "choice", "path", "id", "auto|true|false")


@dataclass(frozen=True)
class DeviceOption:
    """One device option, for the command line (``flags``), a config file
    (``key``), ``DeviceConfig`` (``field``) and the docs (``help``)."""

    name: str                     # argparse's dest (records keep options by it)
    help: str
    flags: tuple[str, ...] = ()   # command-line spellings; none: config only
    key: str = ""                 # the ``[[devices]]`` key; "": command line only
    type: str = BOOL
    default: Any = False
    lo: int | None = None         # bounds, both surfaces
    hi: int | None = None
    choices: tuple[str, ...] = ()
    feature: int = 0              # the UBLK_F_* flag it is about
    sets_feature: bool = False    # ``resolve`` adds ``feature`` when the field is set
    field: str | None = None      # the DeviceConfig field it fills (None: ``name``; "": none)
    value: str = ""               # a flag choosing this value of ``field`` (-z: zero_copy)
    metavar: str | None = None
    #: ``validate``'s message for a value out of lo..hi (format: value, o);
    #: a config file says it its own way, at the key
    range_error: str = ""
    off_flags: tuple[str, ...] = ()  # TRISTATE: the flag that says false
    off_help: str = ""
    #: a config-only key the command line spells with other options' flags
    spelled_by: tuple[str, ...] = ()

    @property
    def attr(self) -> str:
        """The DeviceConfig field it fills ("": none)."""
        return self.name if self.field is None else self.field

    def within(self, value: int) -> bool:
        return (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)


_F = uapi.Feature

#: every device option, once: the command line's flags (``frontend.addargs``),
#: a config's ``[[devices]]`` keys (``config``), the checks
#: (``DeviceConfig.validate``) and both references (``docs/hooks.py``) are
#: made from it. Order: ``--help``'s. An option for a new setting is an entry
#: here and the typed field it fills in ``DeviceConfig`` (its default taken
#: from here), which ``DeviceOptions`` repeats for type checkers (tests hold
#: the three alike).
DEVICE_OPTIONS: tuple[DeviceOption, ...] = (
    DeviceOption("dev_id", "device id: -1 = auto allocation (the first free one)",
                 flags=("-n", "--number"), key="id", type=ID, default=-1, lo=-1,
                 metavar="DEV_ID"),
    DeviceOption("queues", "number of hardware queues", flags=("-q", "--queues"), key="queues",
                 type=INT, default=2, lo=1, hi=32, metavar="NR_QUEUES",
                 range_error="{value} queues out of range: use {o.lo}..{o.hi}"),
    DeviceOption("depth", "queue depth: requests in flight per queue", flags=("-d", "--depth"),
                 key="depth", type=INT, default=128, lo=1, hi=uapi.MAX_QUEUE_DEPTH,
                 range_error="queue depth {value} out of range: use {o.lo}..{o.hi}"),
    DeviceOption("unprivileged", "as a user without root: a device of your own (needs the "
                 "udev rule: aioublk udev rules)", flags=("--unprivileged",), key="unprivileged",
                 feature=_F.UNPRIVILEGED_DEV, sets_feature=True),
    DeviceOption("no_auto_part_scan", "do not scan the new disk for partitions",
                 flags=("--no_auto_part_scan",), feature=_F.NO_AUTO_PART_SCAN, field="flags"),
    DeviceOption("batch", "batch I/O: -b (true) requires it, --no-batch (false) uses the "
                 "per-I/O FETCH/COMMIT path; by default (\"auto\") it is used when the kernel "
                 "has it",
                 flags=("-b", "--batch"), key="batch", type=TRISTATE, default=None,
                 feature=_F.BATCH_IO, off_flags=("--no-batch",),
                 off_help="use the per-I/O FETCH/COMMIT path"),
    DeviceOption("copy", "how request data moves: copy (the kernel copies it to and from the "
                 "server's buffers), zero_copy, auto_zc or user_copy", key="copy", type=CHOICE,
                 default=CopyMode.COPY.value, choices=tuple(m.value for m in CopyMode),
                 spelled_by=("zero_copy", "auto_zc", "user_copy")),
    DeviceOption("zero_copy", "zero copy", flags=("-z", "--zero_copy"), field="copy",
                 value=CopyMode.ZERO_COPY.value, feature=_F.SUPPORT_ZERO_COPY),
    DeviceOption("auto_zc", "zero copy, the kernel registering the buffers",
                 flags=("--auto_zc",), field="copy", value=CopyMode.AUTO_ZC.value,
                 feature=_F.AUTO_BUF_REG),
    DeviceOption("auto_zc_fallback", "with auto_zc: register buffers by hand when the kernel "
                 "cannot", flags=("--auto_zc_fallback",), key="auto_zc_fallback",
                 feature=_F.SUPPORT_ZERO_COPY, sets_feature=True),
    DeviceOption("user_copy", "user copy", flags=("-u", "--user_copy"), field="copy",
                 value=CopyMode.USER_COPY.value, feature=_F.USER_COPY),
    DeviceOption("get_data", "a write's data is fetched (UBLK_IO_NEED_GET_DATA) only when the "
                 "server asks, before the target runs (per-I/O path, default copy mode)",
                 flags=("-g", "--get_data"), key="get_data", feature=_F.NEED_GET_DATA,
                 sets_feature=True),
    DeviceOption("metadata_size", "integrity: N bytes of metadata per 512-byte sector, 0 = "
                 "none (needs user copy; loop keeps it in its metadata_file)",
                 flags=("--metadata_size",), key="metadata_size", type=INT, default=0, lo=0,
                 hi=255, metavar="N", feature=_F.INTEGRITY, sets_feature=True,
                 field="integrity"),
    DeviceOption("pi_offset", "integrity: where the PI tuple starts in the metadata",
                 flags=("--pi_offset",), key="pi_offset", type=INT, default=0, lo=0, hi=255,
                 metavar="N", field="integrity"),
    DeviceOption("csum_type", "integrity: the PI tuple's checksum (none: metadata without PI)",
                 flags=("--csum_type",), key="csum_type", type=CHOICE, default="none",
                 choices=tuple(c for c in uapi.PI_CSUM if c != "none"), field="integrity"),
    DeviceOption("tag_size", "integrity: bytes of application tag", flags=("--tag_size",),
                 key="tag_size", type=INT, default=0, lo=0, hi=255, metavar="N",
                 field="integrity"),
    DeviceOption("integrity_capable", "integrity: the device checks PI itself "
                 "(device_is_integrity_capable)", flags=("--integrity_capable",),
                 key="integrity_capable", field="integrity"),
    DeviceOption("integrity_reftag", "integrity: the PI carries a reference tag (T10 type 1)",
                 flags=("--integrity_reftag",), key="integrity_reftag", field="integrity"),
    DeviceOption("shmem_zc", "shared-memory zero copy: a request whose pages lie in a "
                 "registered shared buffer (htlb) is served in it, uncopied",
                 flags=("--shmem_zc",), key="shmem_zc", feature=_F.SHMEM_ZC, sets_feature=True),
    DeviceOption("htlb", "with shmem_zc: map FILE (on hugetlbfs; clients map it too) and "
                 "register it as the shared buffer", flags=("--htlb",), key="htlb", type=PATH,
                 default=None, metavar="FILE"),
    DeviceOption("rdonly_shmem_buf", "with htlb: map and register it read-only (only writes "
                 "match)", flags=("--rdonly_shmem_buf",), key="rdonly_shmem_buf"),
    DeviceOption("no_ublk_fixed_fd", "accepted for kublk's scripts: aioublk never registers "
                 "/dev/ublkcN as a fixed file, so its commands always go on the plain fd",
                 flags=("--no_ublk_fixed_fd",), field=""),
    DeviceOption("nthreads", "number of worker threads, 0 = one per queue",
                 flags=("--nthreads",), key="nthreads", type=INT, default=0, lo=0, hi=64,
                 range_error="--nthreads {value} out of range: use 1..{o.hi}"),
    DeviceOption("per_io_tasks", "spread each queue's tags over the threads (per-I/O path)",
                 flags=("--per_io_tasks",), key="per_io_tasks", feature=_F.PER_IO_DAEMON),
    DeviceOption("recovery_mode", "what the kernel does with I/O while no server is attached: "
                 "none (the device goes with its server), requeue, reissue or fail_io (on the "
                 "command line -r 1, -i 1 or -e 1)",
                 key="recovery", type=CHOICE, default="none", field="recovery",
                 choices=("none", "requeue", "reissue", "fail_io"), feature=_F.USER_RECOVERY,
                 spelled_by=("recovery", "recovery_reissue", "recovery_fail_io")),
    DeviceOption("recovery", "1: the device outlives its server, QUIESCED until `recover`",
                 flags=("-r", "--recovery"), type=FLAG01, feature=_F.USER_RECOVERY),
    DeviceOption("recovery_fail_io", "1: recovery, and I/O fails while no server is attached",
                 flags=("-e", "--recovery_fail_io"), type=FLAG01,
                 feature=_F.USER_RECOVERY_FAIL_IO),
    DeviceOption("recovery_reissue", "1: recovery, and requests the dead server held are "
                 "reissued", flags=("-i", "--recovery_reissue"), type=FLAG01,
                 feature=_F.USER_RECOVERY_REISSUE),
)


def option(name: str) -> DeviceOption:
    """The option a flag's dest or a config key names (the first, if both)."""
    return next(o for o in DEVICE_OPTIONS if name in (o.name, o.key))


class DeviceOptions(TypedDict, total=False):
    """``DeviceConfig``'s fields as ``Device(target, **options)`` takes them, so
    that a type checker catches a misspelt one. A type checker cannot make a
    TypedDict from a dataclass: a test keeps the names and types the fields'."""

    dev_id: int
    queues: int
    depth: int
    flags: int
    max_io_size: int
    batch: bool | None
    copy: CopyMode | str
    auto_zc_fallback: bool
    get_data: bool
    nthreads: int
    per_io_tasks: bool
    one_loop: bool
    fetch_buf_bytes: int
    fetch_buf_entries: int
    recovery: bool
    recovery_reissue: bool
    recovery_fail_io: bool
    unprivileged: bool
    zoned: bool
    integrity: uapi.Integrity | None
    shmem_zc: bool
    htlb: str | None
    rdonly_shmem_buf: bool


@dataclass
class DeviceConfig:
    """What a device is created with (kublk's add options). Defaults are
    ``DEVICE_OPTIONS``', the command line's and a config's: kublk's 2 queues
    of 128 requests."""

    dev_id: int = option("dev_id").default
    queues: int = option("queues").default
    depth: int = option("depth").default
    flags: int = 0               # extra UBLK_F_* flags (e.g. NO_AUTO_PART_SCAN)
    max_io_size: int = 1 << 20
    #: batch I/O: None = when the kernel has it, True = required (-b), False = never
    batch: bool | None = option("batch").default
    copy: CopyMode = CopyMode(option("copy").default)
    #: with AUTO_ZC: register by hand when the kernel cannot
    auto_zc_fallback: bool = option("auto_zc_fallback").default
    #: UBLK_F_NEED_GET_DATA (kublk -g): a write's data is copied into the tag's
    #: buffer only once the server asks (UBLK_IO_NEED_GET_DATA), not at fetch
    get_data: bool = option("get_data").default
    nthreads: int = option("nthreads").default  # worker threads; 0 = one per queue
    #: per-I/O path: spread each queue's tags over the workers
    per_io_tasks: bool = option("per_io_tasks").default
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
    unprivileged: bool = option("unprivileged").default
    #: UBLK_F_ZONED: the target is zoned (set from it, like one_loop); needs user copy
    zoned: bool = False
    #: UBLK_F_INTEGRITY (kublk --metadata_size...; see ``integrity``): each
    #: request's metadata goes to the target with its data; needs user copy
    integrity: uapi.Integrity | None = None
    #: UBLK_F_SHMEM_ZC (kublk --shmem_zc): a request whose pages lie in a
    #: registered shared buffer arrives by reference (index, offset) and is
    #: served in the server's own mapping of it; the others as the copy mode says
    shmem_zc: bool = option("shmem_zc").default
    #: (--htlb FILE) the shared buffer: a hugetlbfs file the clients map too
    htlb: str | None = option("htlb").default
    #: (--rdonly_shmem_buf) map and register it read-only: only writes match
    rdonly_shmem_buf: bool = option("rdonly_shmem_buf").default

    #: device flags a caller may pass in ``flags``; the rest come from the options
    SUPPORTED_FLAGS = uapi.Feature.NO_AUTO_PART_SCAN

    def __post_init__(self) -> None:
        if isinstance(self.copy, str):  # copy="zero_copy", as a config writes it
            try:
                self.copy = CopyMode(self.copy)
            except ValueError:
                raise UblkError(f"copy {self.copy!r} is no copy mode: use one of "
                                f"{', '.join(m.value for m in CopyMode)}") from None

    def validate(self) -> None:
        """Bounds and conflicts as ``DEVICE_OPTIONS`` and ``CONFLICTS``
        declare them: the one check the command line and config files share."""
        unsupported = self.flags & ~self.SUPPORTED_FLAGS
        if unsupported:
            raise UblkError(f"aioublk does not serve {uapi.flag_list(unsupported)}: "
                            "leave it out")
        if not mmap.PAGESIZE <= self.max_io_size <= MAX_IO_SIZE:
            raise UblkError(f"max_io_size {self.max_io_size} out of range: use "
                            f"{mmap.PAGESIZE}..{MAX_IO_SIZE} bytes")
        for o in DEVICE_OPTIONS:
            if o.range_error and not o.within(value := getattr(self, o.attr)):
                raise UblkError(o.range_error.format(value=value, o=o))
        if not -1 <= self.dev_id < uapi.MAX_DEV_ID:
            raise UblkError(f"device id {self.dev_id} is invalid: use -1 (any) or "
                            f"0..{uapi.MAX_DEV_ID - 1}")
        for c in CONFLICTS:
            if c.test(self):
                raise OptionError(c.key, c.message.format(c=self), c.config.format(c=self))
        if (self.fetch_buf_bytes and (self.fetch_buf_bytes % 2
                                      or not 2 <= self.fetch_buf_bytes <= 4096)) \
                or self.fetch_buf_entries & (self.fetch_buf_entries - 1) \
                or self.fetch_buf_entries > 4096:
            raise UblkError("fetch buffers: bytes must be even (2..4096) and entries a power "
                            "of two (1..4096)")

    @property
    def recovery_flags(self) -> int:
        """The ``UBLK_F_USER_RECOVERY*`` flags ``recovery``, ``recovery_reissue``
        and ``recovery_fail_io`` ask for."""
        flags = 0
        if self.recovery or self.recovery_reissue or self.recovery_fail_io:
            flags |= uapi.Feature.USER_RECOVERY
        if self.recovery_reissue:
            flags |= uapi.Feature.USER_RECOVERY_REISSUE
        if self.recovery_fail_io:
            flags |= uapi.Feature.USER_RECOVERY_FAIL_IO
        return flags

    def threads(self) -> int:
        """How many worker threads (one loop each) serve the queues."""
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
        for o in DEVICE_OPTIONS:  # (the options that are a kernel feature when set)
            if o.sets_feature and getattr(self, o.attr) not in (None, False):
                flags |= o.feature
        if self.zoned:
            flags |= uapi.Feature.ZONED
        if flags & uapi.Feature.USER_RECOVERY and features & uapi.Feature.QUIESCE:
            flags |= uapi.Feature.QUIESCE  # as kublk: lets ``quiesce`` hand over the device
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
                                "6.17+): use -q 1 (queues = 1 in a config)")
            missing |= uapi.Feature.PER_IO_DAEMON
        if missing:
            raise UblkError("this kernel's ublk_drv does not support "
                            f"{uapi.flag_list(missing)}: drop the option that asks for it")
        return batch, flags


@dataclass(frozen=True)
class Conflict:
    """Options that do not go together, checked once for both surfaces.
    ``key`` is the option a config file names; messages are formatted with
    ``c``, the DeviceConfig."""

    key: str
    test: Callable[[DeviceConfig], bool]
    message: str
    config: str = ""  # a config file's wording, if its own (at ``key``)


CONFLICTS: tuple[Conflict, ...] = (
    Conflict("per_io_tasks", lambda c: c.per_io_tasks and c.batch is True,
             "--per_io_tasks and -b/--batch conflict: per-I/O tasks are a per-I/O path "
             "feature (use --nthreads alone with batch)",
             "conflicts with batch = true (per-I/O tasks are a per-I/O path feature): set "
             "batch = false or \"auto\""),
    Conflict("auto_zc_fallback", lambda c: c.auto_zc_fallback and c.copy is not CopyMode.AUTO_ZC,
             "--auto_zc_fallback needs --auto_zc",
             "needs copy = \"auto_zc\": set it, or drop auto_zc_fallback"),
    Conflict("get_data", lambda c: c.get_data and c.copy is not CopyMode.COPY,
             "-g/--get_data and copy mode {c.copy.value} conflict (the kernel drops "
             "UBLK_F_NEED_GET_DATA with -z, --auto_zc and -u): pick one",
             "conflicts with copy = \"{c.copy.value}\" (the kernel fetches a write's data only "
             "into the server's own buffer): set copy = \"copy\", or drop get_data"),
    Conflict("get_data", lambda c: c.get_data and c.batch is True,
             "-g/--get_data needs the per-I/O path (batch I/O has no NEED_GET_DATA command): "
             "drop -b/--batch",
             "conflicts with batch = true (batch I/O has no NEED_GET_DATA command): set batch "
             "= false or \"auto\""),
    Conflict("recovery", lambda c: c.recovery_reissue and c.recovery_fail_io,
             "-i 1 (reissue) and -e 1 (fail I/O) are different recovery modes: pick one"),
    Conflict("unprivileged", lambda c: c.unprivileged and c.copy is not CopyMode.COPY,
             "copy mode {c.copy.value} needs root: the kernel refuses zero copy, auto buffer "
             "registration and user copy (-z, --auto_zc, -u) for unprivileged devices (drop "
             "it, or drop --unprivileged and run as root)"),
    Conflict("copy", lambda c: c.zoned and c.copy is not CopyMode.USER_COPY,
             "a zoned device and copy mode {c.copy.value} conflict: aioublk serves zoned "
             "devices with user copy only (-u)"),
    Conflict("metadata_size", lambda c: c.integrity is not None
             and c.copy is not CopyMode.USER_COPY,
             "--metadata_size and copy mode {c.copy.value} conflict: the kernel moves "
             "integrity data only by user copy: add -u",
             "needs copy = \"user_copy\" (the kernel moves integrity data only by user copy): "
             "set it, or drop the integrity keys"),
    Conflict("unprivileged", lambda c: c.unprivileged and bool(c.recovery_flags),
             "user recovery (-r/-e/-i) needs root: the kernel drops it for unprivileged "
             "devices (drop it, or drop --unprivileged and run as root)"),
    Conflict("htlb", lambda c: bool(c.htlb) and not c.shmem_zc,
             "--htlb needs --shmem_zc (the kernel registers shared buffers only on a device "
             "added with UBLK_F_SHMEM_ZC): add it"),
    Conflict("rdonly_shmem_buf", lambda c: c.rdonly_shmem_buf and not c.htlb,
             "--rdonly_shmem_buf needs --htlb FILE: it says how that buffer is registered"),
    # (seen: REG_BUF from the recovering server answers EEXIST, and the dead
    # server's registration still matches clients' pages)
    Conflict("htlb", lambda c: bool(c.htlb) and bool(c.recovery_flags),
             "user recovery (-r/-i/-e) and --htlb conflict: the kernel keeps the dead "
             "server's shared-buffer registration and refuses the new server's (EEXIST), so "
             "its requests could not be served: drop one"),
    Conflict("shmem_zc", lambda c: c.shmem_zc and c.zoned,
             "a zoned device and --shmem_zc conflict: aioublk serves zoned devices with user "
             "copy only (drop --shmem_zc)"),
)


def device_config(values: dict[str, Any], *, prefix: str = "--") -> DeviceConfig:
    """A checked DeviceConfig from option values by option name, as a
    surface parsed them (the command line's dests, a config's keys, each
    defaulting to the table's); ``prefix`` as ``integrity``'s."""
    kwargs: dict[str, Any] = {}
    chosen: dict[str, list[DeviceOption]] = {}
    ints: dict[str, Any] = {}
    for o in DEVICE_OPTIONS:
        if o.name not in values or not o.attr:
            continue
        v = values[o.name]
        if o.value:
            if v:
                chosen.setdefault(o.attr, []).append(o)
        elif o.attr == "integrity":
            ints[o.name] = v
        elif o.attr == "flags":
            kwargs["flags"] = kwargs.get("flags", 0) | (o.feature if v else 0)
        elif o.attr == "copy":
            kwargs["copy"] = CopyMode(v)
        elif o.type == CHOICE and o.attr == "recovery":  # a config's one key for -r/-i/-e
            kwargs |= {"recovery": v != "none", "recovery_reissue": v == "reissue",
                       "recovery_fail_io": v == "fail_io"}
        else:
            kwargs[o.attr] = v
    modes = chosen.get("copy", [])
    if kwargs.get("auto_zc_fallback") and "auto_zc" in values:
        # the command line's flags: kublk spells it "-z --auto_zc --auto_zc_fallback"
        modes = [option("auto_zc")] + [o for o in modes if o.name not in ("zero_copy", "auto_zc")]
    if len(modes) > 1:
        raise OptionError("copy", f"{' and '.join(o.flags[0] for o in modes)} are different "
                          "data-copy modes: pick one")
    if modes:
        kwargs["copy"] = CopyMode(modes[0].value)
    if ints:
        def arg(name: str) -> Any:
            return ints.get(name, option(name).default)

        kwargs["integrity"] = integrity(
            arg("metadata_size"), pi_offset=arg("pi_offset"), csum_type=arg("csum_type"),
            capable=arg("integrity_capable"), reftag=arg("integrity_reftag"),
            tag_size=arg("tag_size"), prefix=prefix)
    cfg = DeviceConfig(**kwargs)
    cfg.validate()
    return cfg


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


def placement(plan: list[list[tuple[int, list[int]]]], queue_cpus: list[list[int]],
              allowed: set[int], dev_id: int, pin: bool = True) -> list[int | None]:
    """The CPU each worker of ``plan`` (``layout``'s) is pinned to, or None.

    kublk pins a thread that serves exactly one queue to one CPU of that
    queue's affinity, and it matters: measured in the guest, an unpinned
    loop worker answered 4k reads at QD1 at 0.55-0.65 of kublk, pinned at
    0.93-1.04 (the scheduler moved it between CPUs at every wake). kublk
    takes the mask's first CPU; here the device id picks among the mask's
    CPUs this process may use (``allowed``), so that several one-queue
    devices are not all pinned to CPU 0. A worker serving several queues,
    or a queue served by several workers, is left to the scheduler, and so
    is every worker of a target that says not to pin them (``pin``:
    ``Target.pin_workers``)."""
    queues = [work[0][0] for work in plan if len(work) == 1]
    if not pin or len(queues) != len(plan) or len(set(queues)) != len(queues):
        return [None] * len(plan)
    cpus = []
    for q in queues:
        usable = [c for c in queue_cpus[q] if c in allowed] if q < len(queue_cpus) else []
        cpus.append(usable[dev_id % len(usable)] if usable else None)
    return cpus
