"""The built-in targets, each declared once: its class (imported only when a
device is built), its options (type, default, help, command-line flags,
config key, bounds) and which option the command line's FILE arguments fill.

``add``'s target flags and help, the config file's ``[devices.options]``
checks and ``build_target`` are all made from ``TARGETS``, so a new option is
one entry here. Documentation lists ``TARGETS[name].options``. This module
is declarations only: the checks themselves live in ``config``, the flags in
``addargs``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aioublk.target import Target

#: the option types: how a value is checked and how the command line reads it
SIZE, INT, BOOL, PATH, PATHS, CHOICE, STR = "size", "int", "bool", "path", "paths", "choice", "str"
#: filters' too: seconds (from "50ms", "2s", "100us" or a number of seconds), a fraction
DURATION, FLOAT, RANGES = "duration", "float", "ranges"


@dataclass(frozen=True)
class Option:
    """One option of a built-in target."""

    key: str                      # the config key (also ``--opt KEY=VALUE``)
    type: str                     # SIZE, INT, BOOL, PATH, PATHS, CHOICE or STR
    help: str
    default: Any = None           # what the target does without it (None: see help)
    default_help: str = ""        # the default as --help says it, if it says it
    flags: tuple[str, ...] = ()   # command-line spellings; none: config and --opt only
    arg: str = ""                 # the constructor's keyword ("": key; "*": positional)
    negate: bool = False          # the constructor's keyword means the opposite
    lo: int | None = None         # bounds: of the value, or of a PATHS list's length
    hi: int | None = None
    choices: tuple[str, ...] = ()
    power_of_two: bool = False
    sectors: bool = False         # a SIZE in whole 512-byte sectors
    distinct: bool = False        # PATHS: no path twice
    required: bool = False
    what: str = ""                # PATH/PATHS: what the file is ("backing file", "image")
    zero_one: bool = False        # a BOOL flag written "--flag 0|1" (kublk), not "--flag"

    @property
    def flag(self) -> str:
        """The spelling messages name: the first flag, else ``--opt KEY``."""
        return self.flags[0] if self.flags else f"--opt {self.key}"


@dataclass(frozen=True)
class TargetSpec:
    """A built-in target: ``cls`` is "module:Class", imported when built."""

    name: str
    cls: str
    options: tuple[Option, ...]
    files: str = ""               # the option FILE arguments fill ("": none)
    second_file: str = ""         # the option a second FILE fills (loop: integrity metadata)
    read_only: bool = False       # the constructor takes read_only=

    def option(self, key: str) -> Option | None:
        return next((o for o in self.options if o.key == key), None)

    def keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.options)

    def target_class(self) -> type[Target]:
        module, _, name = self.cls.partition(":")
        cls: type[Target] = getattr(importlib.import_module(module), name)
        return cls

    def build(self, options: dict[str, Any], read_only: bool = False) -> Target:
        """The target from checked ``options`` (those absent: the class's defaults)."""
        args: list[Any] = []
        kwargs: dict[str, Any] = {"read_only": read_only} if self.read_only else {}
        for o in self.options:
            if o.key not in options:
                continue
            value = options[o.key]
            value = not value if o.negate else list(value) if o.type == PATHS else value
            if o.arg == "*":
                args.append(value)
            else:
                kwargs[o.arg or o.key] = value
        return self.target_class()(*args, **kwargs)


_DEVICE_SIZE = Option("size", SIZE, "bytes the device serves", default=250 << 30,
                      default_help="250G", flags=("-s", "--size"), lo=512, sectors=True)
_BUFFERED = Option("buffered", BOOL, "do not use O_DIRECT on the backing files", default=False,
                   flags=("--buffered",), arg="direct", negate=True)

TARGETS: dict[str, TargetSpec] = {t.name: t for t in (
    TargetSpec("null", "aioublk.targets.null:NullTarget", (_DEVICE_SIZE,)),
    TargetSpec("loop", "aioublk.targets.loop:LoopTarget", (
        Option("file", PATH, "the backing file or block device", arg="*",
               required=True, what="backing file"),
        _BUFFERED,
        Option("metadata_file", PATH, "with --metadata_size: the file keeping the integrity "
               "metadata, metadata_size bytes per 512-byte sector (the second FILE, as "
               "kublk's)", what="metadata file"),
    ), files="file", second_file="metadata_file", read_only=True),
    TargetSpec("stripe", "aioublk.targets.stripe:StripeTarget", (
        Option("files", PATHS, "the backing files, striped in this order", arg="*", lo=2, hi=4,
               distinct=True, required=True, what="backing file"),
        Option("chunk_size", SIZE, "bytes per chunk, a power of two", default=65536,
               default_help="64K", flags=("--chunk_size",), lo=4096, hi=512 << 10,
               power_of_two=True),
    ), files="files", read_only=True),
    TargetSpec("qcow2", "aioublk.targets.qcow2:Qcow2Target", (
        Option("image", PATH, "the qcow2 image", arg="*", required=True, what="image"),
        Option("l2_cache", SIZE, "L2 cache size", default_help="map the whole disk, up to 32M",
               flags=("--l2-cache",), arg="cache_bytes", lo=1),
        _BUFFERED,
        Option("allow_backing", PATHS, "backing files may also be under this directory, or be "
               "this file or block device (repeatable; by default only files in the image's "
               "own directory)", default=(), flags=("--allow-backing",)),
        Option("backing_format", CHOICE, "the format of backing files whose image records "
               "none (never guessed)", flags=("--backing-format",), choices=("raw", "qcow2")),
        Option("compress", BOOL, "write whole, aligned clusters compressed, with the image's "
               "compression type (as qemu-img convert -c); C then serves reads only",
               default=False, flags=("--compress",)),
    ), files="image", read_only=True),
    TargetSpec("nvme", "aioublk.targets.nvme:NvmeTarget", (
        Option("device", PATH, "the NVMe namespace's generic char device (/dev/ngXnY)",
               arg="*", required=True, what="NVMe generic char device"),
    ), files="device", read_only=True),
    TargetSpec("nbd", "aioublk.targets.nbd:NbdTarget", (
        Option("uri", STR, "the NBD export: nbd://HOST[:PORT]/EXPORT, "
               "nbd+unix:///EXPORT?socket=PATH, or nbds://... for TLS", arg="*",
               required=True, what="NBD URI"),
        Option("tls_certificates", PATH, "directory of the TLS CA, client certificate and "
               "key (ca-cert.pem, client-cert.pem, client-key.pem) for nbds:// URIs",
               flags=("--tls-certificates",), what="certificate directory"),
        Option("tls_hostname", STR, "the host name the server's TLS certificate must hold: "
               "needed for nbds+unix:// URIs (a unix socket has none to check; libnbd "
               ">= 1.22), and checked instead of the host of an nbds:// URI",
               flags=("--tls-hostname",), what="TLS host name"),
        Option("reconnect_timeout", INT, "seconds a lost server's requests are held while "
               "reconnecting, before they fail with EIO", default=30, default_help="30",
               flags=("--reconnect-timeout",), lo=0),
    ), files="uri", read_only=True),
    TargetSpec("rbd", "aioublk.targets.rbd:RbdTarget", (
        Option("image", STR, "the RBD image: POOL/IMAGE, or POOL/IMAGE@SNAPSHOT (read-only)",
               arg="*", required=True, what="RBD image"),
        Option("conf", PATH, "the Ceph cluster's config file", default="/etc/ceph/ceph.conf",
               default_help="/etc/ceph/ceph.conf", flags=("--rbd-conf",),
               what="Ceph config file"),
        Option("id", STR, "the Ceph client id (client.ID's keyring)", default="admin",
               default_help="admin", flags=("--rbd-id",), arg="client_id"),
    ), files="image", read_only=True),
    TargetSpec("zoned", "aioublk.targets.zoned:ZonedTarget", (
        Option("file", PATH, "the backing file (created if missing; zone states go to "
               "FILE.zones); none: zones in memory", what="backing file"),
        Option("size", SIZE, "bytes the device serves (whole zones)", default=1 << 30,
               default_help="1G", flags=("-s", "--size"), lo=4096, sectors=True),
        Option("zone_size", SIZE, "bytes per zone, a power of two", default=64 << 20,
               default_help="64M", flags=("--zone_size",), lo=4096, power_of_two=True),
        Option("conv_zones", INT, "how many zones, from the first, are conventional",
               default=0, flags=("--conv_zones",), lo=0),
        Option("max_open_zones", INT, "the most zones open at once (0: no limit)", default=0,
               flags=("--max_open_zones",), lo=0),
        Option("max_active_zones", INT, "the most zones open or closed at once (0: no limit)",
               default=0, flags=("--max_active_zones",), lo=0),
        _BUFFERED,
    ), files="file"),
    TargetSpec("fault_inject", "aioublk.targets.fault_inject:FaultInjectTarget", (
        _DEVICE_SIZE,
        Option("delay_us", INT, "hold each request this many microseconds", default=0,
               flags=("--delay_us",), lo=0),
        Option("die_during_fetch", BOOL, "1 = SIGKILL the server while it arms its tags",
               default=False, flags=("--die_during_fetch",), zero_one=True),
    )),
)}


@dataclass(frozen=True)
class FilterSpec:
    """A built-in filter: ``cls`` is "module:Class", built over the next layer."""

    name: str
    cls: str
    help: str
    options: tuple[Option, ...] = ()

    def option(self, key: str) -> Option | None:
        return next((o for o in self.options if o.key == key), None)

    def keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.options)

    def build(self, inner: Target, options: dict[str, Any]) -> Target:
        """This filter over ``inner``, from checked ``options``."""
        module, _, name = self.cls.partition(":")
        cls = getattr(importlib.import_module(module), name)
        layer: Target = cls(inner, **{o.arg or o.key: options[o.key] for o in self.options
                                      if o.key in options})
        return layer


def _delay(op: str) -> Option:
    return Option(op, DURATION, f"hold each {op.replace('_', '-')} this long", default=0)


FILTERS: dict[str, FilterSpec] = {f.name: f for f in (
    FilterSpec("offset", "aioublk.targets.filters:OffsetFilter",
               "a window of the device: from OFFSET on, SIZE bytes (C still serves a loop's)", (
                   Option("offset", SIZE, "the window's first byte", required=True, lo=0),
                   Option("size", SIZE, "the window's length (default: to the end)", lo=1))),
    FilterSpec("partition", "aioublk.targets.filters:PartitionFilter",
               "one partition of the device's MBR or GPT (C still serves a loop's)", (
                   Option("partition", INT, "its number, from 1 (an MBR's logical ones from 5, "
                          "as Linux numbers them)", required=True, lo=1),)),
    FilterSpec("truncate", "aioublk.targets.filters:TruncateFilter",
               "the device's first SIZE bytes", (
                   Option("size", SIZE, "bytes to serve", required=True, lo=1),)),
    FilterSpec("readonly", "aioublk.targets.filters:ReadonlyFilter", "refuse every write"),
    FilterSpec("delay", "aioublk.targets.filters:DelayFilter",
               "a slow disk: each operation held for its delay (Python serves every request)",
               tuple(_delay(op) for op in ("read", "write", "flush", "discard",
                                            "write_zeroes"))),
    FilterSpec("error", "aioublk.targets.filters:ErrorFilter",
               "fail requests with an errno (Python serves every request)", (
                   Option("rate", FLOAT, "the chance a matching request fails", default=1.0,
                          lo=0, hi=1),
                   Option("ops", STR, "the operations that fail, joined by +",
                          default="read+write+flush+discard+write_zeroes"),
                   Option("errno", STR, "the error returned", default="EIO"),
                   Option("offset", SIZE, "fail requests touching bytes from here", default=0,
                          lo=0),
                   Option("length", SIZE, "... this many (default: to the end)", lo=1),
                   Option("seed", INT, "the random sequence's seed (default: random)"),
                   Option("hang", BOOL, "never answer a matching request instead (an "
                          "unprivileged device's io_timeout then kills the server; a "
                          "privileged one's waits until the server stops, which fails it)",
                          default=False))),
    FilterSpec("rate", "aioublk.targets.filters:RateFilter",
               "limit requests and bytes a second, token buckets with a second's burst "
               "(Python serves every request)", (
                   Option("iops", INT, "requests a second (0: no limit)", default=0, lo=0),
                   Option("bandwidth", SIZE, "bytes a second read and written (0: no limit)",
                          default=0, lo=0))),
    FilterSpec("cache", "aioublk.targets.filters:CacheFilter",
               "a cache in RAM, write-through or write-back (FLUSH and FUA honoured; "
               "write-through under -r 1); Python serves every request", (
                   Option("size", SIZE, "the cache's bytes", default=64 << 20, lo=4096),
                   Option("block", SIZE, "its block size, a power of two", default=65536,
                          lo=512, power_of_two=True),
                   Option("mode", CHOICE, "writethrough or writeback",
                          default="writethrough", choices=("writethrough", "writeback")))),
    FilterSpec("cow", "aioublk.targets.filters:CowFilter",
               "copy on write: the device under it is never written (as qemu-nbd -s); "
               "Python serves every request", (
                   Option("file", STR, "the overlay file, made anew (default: in memory)"),
                   Option("block", SIZE, "the overlay's block size, a power of two",
                          default=4096, lo=512, power_of_two=True),
                   Option("commit", BOOL, "write the overlay to the device when it stops",
                          default=False))),
    FilterSpec("protect", "aioublk.targets.filters:ProtectFilter",
               "refuse writes to byte ranges with EPERM (Python serves every request)", (
                   Option("ranges", RANGES, "START-END byte ranges (END exclusive), joined "
                          "by +, e.g. 0-1M+4G-5G", required=True),)),
    FilterSpec("encrypt", "aioublk.targets.filters:EncryptFilter",
               "AES-XTS, the bytes dm-crypt's plain mode writes (cryptsetup open --type plain "
               "--cipher aes-xts-plain64 --key-size 512 --key-file KEYFILE); Python serves "
               "every request", (
                   Option("keyfile", PATH, "the 64-byte key file, that only its owner may "
                          "read or write", required=True, what="key file"),
                   Option("allow_insecure_key", BOOL, "use a key file that group or others "
                          "may read or write (refused otherwise)", default=False))),
    FilterSpec("log", "aioublk.targets.filters:LogFilter",
               "a JSON line per request to FILE (Python serves every request)", (
                   Option("file", STR, "the log file (appended to)", required=True),
                   Option("max_size", SIZE, "rotate past this many bytes (0: never)", default=0,
                          lo=0),
                   Option("keep", INT, "old files kept when rotating", default=3, lo=1))),
)}
