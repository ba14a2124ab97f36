"""The ``serve`` configuration file: TOML, read and checked in full before any
device exists, so that a mistake costs one line on stderr and nothing else.

Every problem is one line, ``FILE: PATH: what is wrong: what to do``, where
PATH is the dotted key path with 0-based list indices
(``devices[1].options.file``). Loading is pure: it reads the file, looks at
backing files' existence and imports custom target classes, and touches no
device. As root (or with CAP_SYS_ADMIN), a file that others can change is
refused before it is read (it names code serve runs privileged). Relative
backing-file paths are relative to the config file's directory (a daemon's
working directory is rarely the user's).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import tomllib
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from aioublk.errors import Error, UblkError
from aioublk.frontend import registry
from aioublk.io import locking
from aioublk.kernel import control
from aioublk.queue.options import (
    BOOL,
    DEVICE_OPTIONS,
    ID,
    INT,
    PATH,
    TRISTATE,
    DeviceConfig,
    DeviceOption,
    IntegrityError,
    OptionError,
    device_config,
)
from aioublk.target import GeometryError, Target
from aioublk.targets import spec as decl

BUILTIN_TARGETS = tuple(registry.TARGETS)
LEVELS = ("warning", "info", "debug")
FORMATS = ("console", "json")
ON_STOP = ("delete", "quiesce")
BLOCK_SIZES = (512, 1024, 2048, 4096)

#: the keys of each target's ``[devices.options]`` (custom targets: their
#: constructor's keyword arguments)
TARGET_OPTIONS = {name: spec.keys() for name, spec in registry.TARGETS.items()}
#: the ``[[devices]]`` keys that are no device option (``DEVICE_OPTIONS``):
#: what to serve, and how serve stops it and presents the disk
SPEC_KEYS = ("target", "on_stop", "logical_block_size", "physical_block_size", "read_only",
             "force_share", "filters", "options")
DEVICE_KEYS = SPEC_KEYS[:1] + tuple(o.key for o in DEVICE_OPTIONS if o.key) + SPEC_KEYS[1:]
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*(\d+)\s*(?:([KMGT])(?:I?B)?|B)?\s*", re.IGNORECASE)
#: how a size may be written, for error messages
SIZE_FORMS = "bytes, or a number with K, M, G or T (powers of 1024; KB, KiB... too), e.g. \"64M\""


class ConfigError(Error):
    """A configuration problem, in one line: ``FILE: PATH: problem: remedy``."""


class _Invalid(Exception):
    """A problem at ``where`` (a key path); ``load`` adds the file name."""

    def __init__(self, where: str, msg: str) -> None:
        super().__init__(f"{where}: {msg}" if where else msg)


@dataclass(frozen=True)
class LogSettings:
    level: str = "warning"
    format: str = "console"
    stats_interval: float = 0  # seconds between per-queue stats lines; 0 = none
    file: str | None = None    # append the lines here instead of stderr (absolute)


@dataclass(frozen=True)
class MetricsSettings:
    listen: tuple[str, int] | None = None  # (host, port) of the Prometheus endpoint


@dataclass
class DeviceSpec:
    """One ``[[devices]]`` table, checked: everything needed to serve it."""

    where: str                     # "devices[N]", for messages
    target: str                    # a builtin name or "pkg.module:Class"
    options: dict[str, Any]        # normalized: sizes in bytes, paths absolute
    config: DeviceConfig
    recovery: str = "none"
    on_stop: str = "delete"
    read_only: bool = False
    force_share: bool = False      # read-only: let QEMU or others write meanwhile
    logical_block_size: int | None = None
    physical_block_size: int | None = None
    #: (name, checked options) of each filter, outermost first
    filters: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def backing_files(self) -> list[tuple[str, str]]:
        """(key path, real path) of each file the target opens."""
        at = f"{self.where}.options"
        return [(f"{at}.{k}", self.options[k]) for k in ("file", "image") if k in self.options] \
            + [(f"{at}.files[{i}]", f) for i, f in enumerate(self.options.get("files", ()))]

    def build_target(self) -> Target:
        """The target, with this device's read-only flag and block sizes."""
        target = with_filters(build_target(self.target, self.options, read_only=self.read_only,
                                           force_share=self.force_share), self.filters)
        geo = target.geometry
        lbs = self.logical_block_size or geo.logical_block_size
        pbs = self.physical_block_size or geo.physical_block_size
        if pbs < lbs:
            target.close()
            raise UblkError(f"physical block size {pbs} is smaller than the logical block "
                            f"size {lbs}: raise physical_block_size")
        try:
            target.geometry = replace(geo, logical_block_size=lbs, physical_block_size=pbs,
                                      size=geo.size & ~(lbs - 1),
                                      read_only=geo.read_only or self.read_only)
        except GeometryError:
            target.close()
            raise
        return target


@dataclass
class ServeConfig:
    path: str
    logging: LogSettings = field(default_factory=LogSettings)
    devices: list[DeviceSpec] = field(default_factory=list)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)


def parse_size(value: int | str) -> int:
    """Bytes from an integer or a string like "64M", "64MB" or "64MiB"
    (K/M/G/T are powers of 1024, any case; a bare "B" is bytes). The
    command line and config files both parse sizes here. Raises ValueError
    with the reason."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{_show(value)} is {_kind(value)}: use {SIZE_FORMS}")
    if isinstance(value, int):
        return value
    m = _SIZE.fullmatch(value)
    if m is None:
        raise ValueError(f"{_show(value)} is not a size: use {SIZE_FORMS}")
    return int(m[1]) * _UNITS[(m[2] or "").upper()]


def build_target(kind: str, options: dict[str, Any], *, read_only: bool = False,
                 force_share: bool = False) -> Target:
    """The target ``kind`` ("loop", ..., or "pkg.module:Class") made from
    checked ``options`` (sizes in bytes), its files locked as QEMU locks
    them (``force_share``: read-only, sharing with writers). Raises the
    target's own errors (BackingError, Qcow2Error, UblkError, OSError...)."""
    if force_share and not read_only:
        raise UblkError("force_share needs read_only: a writer never shares its files")
    with locking.force_share(force_share):
        return _build_target(kind, options, read_only)


def _build_target(kind: str, options: dict[str, Any], read_only: bool) -> Target:
    spec = registry.TARGETS.get(kind)
    if spec is not None:
        return spec.build(options, read_only)
    if ":" in kind:
        try:
            return _custom_class(kind)(**options)
        except (TypeError, ValueError) as e:  # the target's own checks, in one line
            shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
            raise UblkError(f"{kind}({shown}) failed: {type(e).__name__}: {e}: check its "
                            "options") from None
    raise UblkError(f"unknown target type '{kind}': use one of {', '.join(BUILTIN_TARGETS)} "
                    "or pkg.module:Class")


def load(path: str) -> ServeConfig:
    """Read and check the whole file; raises ConfigError (one line)."""
    try:
        with open(path, "rb") as f:
            _trusted(path, os.fstat(f.fileno()))
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:  # tomllib decodes the whole file first
        line = e.object[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}: line {line}: invalid TOML: byte {e.object[e.start]:#04x} "
                          "is not UTF-8: save the file as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {_toml_error(str(e))}") from None
    except ValueError as e:  # int()'s limit (4300 digits), which tomllib lets through
        # (its advice, after the ";", is to the programmer)
        raise ConfigError(f"{path}: invalid TOML: {_one_line(str(e).split(';')[0])}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: arrays or tables nested too deeply: "
                          "flatten them") from None
    try:
        return parse(data, path, base=os.path.dirname(os.path.abspath(path)))
    except _Invalid as e:
        raise ConfigError(f"{path}: {_one_line(str(e))}") from None


def privileged(*, euid: int | None = None, cap_sys_admin: bool | None = None) -> bool:
    """Whether serve runs with root's power: as uid 0, or as another user
    holding CAP_SYS_ADMIN (a service's AmbientCapabilities=, a file
    capability), which adds any device and opens any disk all the same.
    ``euid`` and ``cap_sys_admin`` default to this process's."""
    if euid is None:
        euid = os.geteuid()
    if cap_sys_admin is None:
        cap_sys_admin = control.has_cap_sys_admin()
    return euid == 0 or cap_sys_admin


def _trusted(path: str, st: os.stat_result) -> None:
    """Privileged, a config others can change is refused: it names code that
    serve imports and runs privileged (a custom target) and the files it
    opens. Root or the serving user may own it."""
    if not privileged():
        return
    euid = os.geteuid()
    runs = "as root" if euid == 0 else f"as uid {euid} with CAP_SYS_ADMIN"
    why = f"and serve runs {runs}, importing the code it names"
    if st.st_mode & 0o022:
        raise ConfigError(f"{path}: writable by others (mode {st.st_mode & 0o7777:o}) {why}: "
                          f"chmod go-w {path}")
    if st.st_uid not in (0, euid):
        raise ConfigError(f"{path}: owned by uid {st.st_uid} {why}: chown root {path}")


def parse(data: dict[str, Any], path: str, *, base: str) -> ServeConfig:
    """Check parsed TOML; raises _Invalid. ``base`` resolves relative paths."""
    _known(data, "", ("logging", "devices", "metrics"))
    logging = _logging(data.get("logging", {}), base)
    metrics = _metrics(data.get("metrics", {}))
    raw = data.get("devices")
    if raw is None or raw == []:
        raise _Invalid("devices", "no devices: add a [[devices]] table")
    if not isinstance(raw, list) or not all(isinstance(d, dict) for d in raw):
        raise _Invalid("devices", f"{_show(raw)} is {_kind(raw)}: write each device as a "
                       "[[devices]] table")
    devices = [_device(d, f"devices[{i}]", base) for i, d in enumerate(raw)]
    _no_sharing(devices)
    return ServeConfig(path, logging, devices, metrics)


# ------------------------------------------------------------------ tables --

def _logging(raw: Any, base: str) -> LogSettings:
    at = "logging"
    _table(raw, at)
    _known(raw, at, ("level", "format", "stats_interval", "file"))
    file = None
    if "file" in raw:
        file = _str(raw["file"], f"{at}.file")
        if not file.strip():
            raise _Invalid(f"{at}.file", "empty: name a file, or drop the key to log on stderr")
        file = os.path.normpath(os.path.join(base, os.path.expanduser(file)))
    interval = raw.get("stats_interval", 0)
    if isinstance(interval, bool) or not isinstance(interval, int | float):
        raise _Invalid(f"{at}.stats_interval", f"{_show(interval)} is {_kind(interval)}: use "
                       "a number of seconds (0 = no stats)")
    if not math.isfinite(interval) or interval < 0:
        what = "negative" if interval < 0 else "not a finite number"
        raise _Invalid(f"{at}.stats_interval", f"{interval} is {what}: use 0 (no stats) or "
                       "a number of seconds")
    return LogSettings(level=_choice(raw.get("level", "warning"), f"{at}.level", LEVELS),
                       format=_choice(raw.get("format", "console"), f"{at}.format", FORMATS),
                       stats_interval=interval, file=file)


def _metrics(raw: Any) -> MetricsSettings:
    at = "metrics"
    _table(raw, at)
    _known(raw, at, ("listen",))
    if "listen" not in raw:
        return MetricsSettings()
    listen = parse_listen(_str(raw["listen"], f"{at}.listen"), f"{at}.listen")
    if importlib.util.find_spec("prometheus_client") is None:
        raise _Invalid(f"{at}.listen", "needs the prometheus-client package: pip install "
                       "'aioublk[metrics]', or drop [metrics]")
    return MetricsSettings(listen)


def parse_listen(v: str, at: str) -> tuple[str, int]:
    """(host, port) from "host:port" or "[v6 address]:port"."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\[\]]+):(\d+)", v.strip())
    if m is None:
        raise _Invalid(at, f"{_show(v)} is not host:port: use e.g. \"127.0.0.1:9341\" or "
                       "\"[::1]:9341\"")
    host, port = (m[1], int(m[2])) if m[1] else (m[3], int(m[4]))
    if not 1 <= port <= 65535:
        raise _Invalid(at, f"port {port} is out of range: use 1..65535")
    return host, port


def _device(raw: dict[str, Any], at: str, base: str) -> DeviceSpec:
    _known(raw, at, DEVICE_KEYS)
    if "target" not in raw:
        raise _Invalid(f"{at}.target", "missing: set it to one of "
                       f"{', '.join(BUILTIN_TARGETS)} or \"pkg.module:Class\"")
    kind = _target_kind(raw["target"], f"{at}.target")
    key = _keyer(at)
    values = {o.name: _device_option(o, raw, key(o.key), base) for o in DEVICE_OPTIONS if o.key}
    recovery = values["recovery_mode"]
    on_stop = _choice(raw.get("on_stop", "delete"), key("on_stop"), ON_STOP)
    dev_id = values["dev_id"]
    try:
        cfg = device_config(values, prefix="")
    except OptionError as e:  # at its key if the message is the config's own
        raise _Invalid(key(e.key) if e.config or isinstance(e, IntegrityError) else at,
                       e.config or str(e)) from None
    except UblkError as e:
        raise _Invalid(at, str(e)) from None
    if on_stop == "quiesce" and recovery == "none":
        raise _Invalid(key("on_stop"), "\"quiesce\" needs recovery: set recovery = "
                       "\"requeue\", \"reissue\" or \"fail_io\", or on_stop = \"delete\"")
    if on_stop == "quiesce" and dev_id < 0:
        raise _Invalid(key("on_stop"), "\"quiesce\" needs a fixed id (the next serve finds "
                       "the device by it): set id = N")
    lbs = _block_size(raw.get("logical_block_size"), key("logical_block_size"))
    pbs = _block_size(raw.get("physical_block_size"), key("physical_block_size"))
    if lbs and pbs and pbs < lbs:
        raise _Invalid(key("physical_block_size"), f"{pbs} is smaller than "
                       f"logical_block_size {lbs}: use {lbs} or more")
    options = _options(kind, raw.get("options", {}), key("options"), base)
    _metadata_file(kind, options, cfg, key)
    read_only = _bool(raw.get("read_only", False), key("read_only"))
    force_share = _bool(raw.get("force_share", False), key("force_share"))
    if force_share and not read_only:
        raise _Invalid(key("force_share"), "needs read_only = true (a writer never shares "
                       "its files)")
    return DeviceSpec(at, kind, options, cfg, recovery=recovery, on_stop=on_stop,
                      read_only=read_only, force_share=force_share,
                      logical_block_size=lbs, physical_block_size=pbs,
                      filters=parse_filters(raw.get("filters", []), key("filters"), base))


def _device_option(o: DeviceOption, raw: dict[str, Any], at: str, base: str) -> Any:
    """A device option's value (its default if absent), checked as the table
    declares it; the integrity options' bounds and checksum names are
    ``options.integrity``'s to refuse, as the command line's are."""
    if o.key not in raw:
        return o.default
    v = raw[o.key]
    if o.type in (INT, ID):
        return _int(v, at, -(1 << 63)) if o.attr == "integrity" else _int(v, at, o.lo or 0, o.hi)
    if o.type == BOOL:
        return _bool(v, at)
    if o.type == PATH:
        return _existing(v, at, base)
    if o.type == TRISTATE:
        if v == "auto":
            return None
        if not isinstance(v, bool):
            raise _Invalid(at, f"{_show(v)} is not a batch setting: use \"auto\", true or false")
        return v
    if o.attr == "integrity":
        return _str(v, at)
    return _choice(v, at, o.choices)


def _metadata_file(kind: str, options: dict[str, Any], cfg: DeviceConfig,
                   key: Callable[[str], str]) -> None:
    """A target keeping integrity metadata in a file (loop's metadata_file,
    its second FILE on the command line) has one exactly when metadata_size asks."""
    spec = registry.TARGETS.get(kind)
    second = spec.option(spec.second_file) if spec and spec.second_file else None
    if second is None:
        return
    if second.key in options and cfg.integrity is None:
        raise _Invalid(f"{key('options')}.{second.key}", "needs metadata_size (and copy = "
                       "\"user_copy\"): set it, or drop the file")
    if second.key not in options and cfg.integrity is not None:
        raise _Invalid(key("metadata_size"), f"the {kind} target keeps the metadata in its "
                       f"{second.what}: set options.{second.key}")


#: the entry-point group through which an installed package offers targets by name
ENTRY_POINTS = "aioublk.targets"


def packaged_target(name: str) -> str | None:
    """"module:Class" of the target an installed package offers as ``name``
    (its ``aioublk.targets`` entry point), or None."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS, name=name):
        return str(ep.value)
    return None


def packaged_targets() -> list[str]:
    """The names installed packages offer targets under."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=ENTRY_POINTS)})


def _target_kind(v: Any, at: str) -> str:
    kind = _str(v, at)
    if kind in BUILTIN_TARGETS:
        return kind
    if ":" not in kind and (value := packaged_target(kind)) is not None:
        kind = value  # (checked as the module:Class it names)
    if ":" in kind:
        try:
            _custom_class(kind)
        except UblkError as e:
            raise _Invalid(at, str(e)) from None
        return kind
    known = [*BUILTIN_TARGETS, *packaged_targets()]
    raise _Invalid(at, f"unknown target {_show(kind)}{_did_you_mean(kind, known)}: "
                   f"use {', '.join(known)} or \"pkg.module:Class\"")


def target_class_of(spec: str) -> type[Target]:
    """The Target subclass "pkg.module:Class" names (UblkError if none)."""
    return _custom_class(spec)


def _custom_class(spec: str) -> type[Target]:
    """The Target subclass named "pkg.module:Class" (UblkError if it is not one)."""
    mod_name, _, cls_name = spec.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - whatever the import raised, in one line
        raise UblkError(f"cannot import {mod_name!r} ({type(e).__name__}: {e}): check the "
                        "module name and sys.path") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise UblkError(f"module {mod_name!r} has no {cls_name!r}: check the class name")
    if not (isinstance(cls, type) and issubclass(cls, Target)):
        raise UblkError(f"{spec} is not a subclass of aioublk.Target: point at a Target class")
    return cls


def target_options(kind: str, raw: dict[str, Any], *, at: str, base: str) -> dict[str, Any]:
    """``raw`` options of the target ``kind`` checked as a config's are, for
    the command line (``at`` is "--opt"): a built-in target's FILE may
    come as an argument instead, so none of its options is required.
    Raises UblkError, the command line's one-line error: "--opt KEY: problem: remedy"."""
    try:
        return _options(kind, raw, at, base, partial=True)
    except _Invalid as e:
        raise UblkError(_one_line(str(e)).replace(f"{at}.", f"{at} ", 1)) from None


def _options(kind: str, raw: Any, at: str, base: str, partial: bool = False) -> dict[str, Any]:
    _table(raw, at)
    if ":" in kind:
        return _custom_options(kind, raw, at)
    spec = registry.TARGETS[kind]
    _known(raw, at, spec.keys())
    out: dict[str, Any] = {}
    for o in spec.options:
        if o.key in raw:
            out[o.key] = _option(o, raw[o.key], f"{at}.{o.key}", base, kind)
        elif o.required and not partial:
            need = (f"a list of {o.lo} to {o.hi} {o.what}s" if o.type == decl.PATHS
                    else f"the path of its {o.what}" if o.type == decl.PATH
                    else f"its {o.what}")
            raise _Invalid(f"{at}.{o.key}", f"missing: the {kind} target needs {need}")
    return out


def _option(o: decl.Option, v: Any, at: str, base: str, kind: str) -> Any:
    """One built-in target option's value, checked as its declaration says."""
    if o.type == decl.SIZE:
        n = _device_size(v, at) if o.sectors else _size(v, at, o.lo or 0, o.hi)
        if o.power_of_two and n & (n - 1):
            raise _Invalid(at, f"{n} is not a power of two: use {o.lo}, {2 * (o.lo or 1)}, ... "
                           f"{o.hi}")
        return n
    if o.type == decl.INT:
        return _int(v, at, o.lo if o.lo is not None else -(1 << 63), o.hi)
    if o.type == decl.BOOL:
        return _bool(v, at)
    if o.type == decl.PATH:
        return _existing(v, at, base)
    if o.type == decl.PATHS:
        return _paths(v, at, base, kind, o)
    if o.type == decl.CHOICE:
        return _choice(v, at, o.choices)
    if o.type == decl.DURATION:
        return _duration(v, at)
    if o.type == decl.FLOAT:
        return _float(v, at, o.lo, o.hi)
    if o.type == decl.RANGES:
        return _ranges(v, at)
    return _str(v, at)


def _ranges(v: Any, at: str) -> list[tuple[int, int]]:
    """(start, end) byte ranges from "START-END+START-END" (sizes as anywhere)."""
    out = []
    for part in filter(None, (p.strip() for p in _str(v, at).split("+"))):
        first, dash, last = part.partition("-")
        try:
            start, end = parse_size(first), parse_size(last)
        except ValueError:
            start = end = -1
        if not dash or start < 0 or end <= start:
            raise _Invalid(at, f"{part!r} is not START-END with START < END: write e.g. 0-1M")
        out.append((start, end))
    if not out:
        raise _Invalid(at, "no range: write e.g. 0-1M, or 0-1M+4G-5G")
    return out


_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(us|ms|s)?\s*")
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}


def _duration(v: Any, at: str) -> float:
    """Seconds, from a number of seconds or "50ms", "2s", "100us" (nbdkit's)."""
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
        return float(v)
    m = _DURATION.fullmatch(v) if isinstance(v, str) else None
    if m is None:
        raise _Invalid(at, f"{_show(v)} is not a duration: use seconds, or e.g. \"50ms\", "
                       "\"100us\", \"2s\"")
    return float(m[1]) * _TIME_UNITS[m[2]]


def _float(v: Any, at: str, lo: int | None, hi: int | None) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _Invalid(at, f"{_show(v)} is {_kind(v)}: use a number")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _Invalid(at, f"{v} is out of range: use {lo}..{hi}")
    return float(v)


def parse_filters(raw: Any, at: str, base: str = "") -> list[tuple[str, dict[str, Any]]]:
    """A filter stack, outermost first, from "NAME[:KEY=VALUE,...]" strings
    (``--filter``, a config's ``filters``), each option checked as its
    declaration says; raises _Invalid."""
    if not isinstance(raw, list):
        raise _Invalid(at, f"{_show(raw)} is {_kind(raw)}: use a list of \"NAME[:KEY=VALUE,"
                       "...]\" strings, outermost first")
    out = []
    for i, item in enumerate(raw):
        where = f"{at}[{i}]"
        text = _str(item, where)
        name, _, rest = text.partition(":")
        name = name.strip()
        if at == "--filter":  # the command line's: name the flag as given
            where = f"--filter {text}"
        spec = registry.FILTERS.get(name)
        if spec is None:
            raise _Invalid(where, f"unknown filter {name!r}{_did_you_mean(name, registry.FILTERS)}"
                           f": use one of {', '.join(registry.FILTERS)}")
        values: dict[str, Any] = {}
        for pair in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = pair.partition("=")
            if not eq:
                raise _Invalid(where, f"{pair!r} is not KEY=VALUE: write e.g. "
                               f"{name}:{spec.keys()[0] if spec.options else 'KEY'}=VALUE")
            values[key.strip()] = toml_value(value.strip())
        where = f"--filter {name}" if at == "--filter" else f"{where}.{name}"
        _known(values, where, spec.keys())
        checked = {}
        for o in spec.options:
            if o.key in values:
                checked[o.key] = _option(o, values[o.key], f"{where}.{o.key}", base, name)
            elif o.required:
                raise _Invalid(f"{where}.{o.key}", f"missing: the {name} filter needs it "
                               f"({o.help})")
        out.append((name, checked))
    return out


def filter_stack(specs: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """``--filter`` values checked (``parse_filters``); raises UblkError (one line)."""
    try:
        return parse_filters(specs, "--filter")
    except _Invalid as e:
        raise UblkError(_one_line(str(e))) from None


def toml_value(text: str) -> Any:
    """A value as TOML reads it (64, 0.1, true), any other the string it is."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def with_filters(target: Target, filters: list[tuple[str, dict[str, Any]]]) -> Target:
    """``target`` under the checked filter stack (outermost first); a filter
    that refuses its options closes the target and raises UblkError (one line)."""
    for name, options in reversed(filters):
        try:
            target = registry.FILTERS[name].build(target, options)
        except ValueError as e:
            target.close()
            raise UblkError(f"filter {name}: {e}") from None
    return target


def _custom_options(kind: str, raw: dict[str, Any], at: str) -> dict[str, Any]:
    """Passed through as keyword arguments; checked against the constructor."""
    cls = _custom_class(kind)
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return dict(raw)  # no signature to check against (a C type, say)
    params = sig.parameters
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        _known(raw, at, named)
    for n in named:
        if params[n].default is params[n].empty and n not in raw:
            raise _Invalid(f"{at}.{n}", f"missing: {kind} needs it")
    try:
        sig.bind(**raw)
    except TypeError as e:
        raise _Invalid(at, f"{e}: match {kind}'s keyword arguments") from None
    return _sized(cls, raw, at)


def _sized(cls: type, raw: dict[str, Any], at: str) -> dict[str, Any]:
    """A string given for an ``int`` argument is a size ("64M"), as sizes
    are everywhere else: the command line's ``--opt`` reads "64M" as a
    string, and a config may quote one."""
    try:
        hints = typing.get_type_hints(cls.__init__)  # type: ignore[misc]
    except Exception:  # noqa: BLE001 - unresolvable annotations: nothing to go by
        return dict(raw)
    out = dict(raw)
    for name, v in raw.items():
        if hints.get(name) is int and isinstance(v, str):
            out[name] = _size(v, f"{at}.{name}", 0)
    return out


def _paths(v: Any, at: str, base: str, kind: str, o: decl.Option) -> list[str]:
    """A list of existing paths: stripe's files (``o.lo``..``o.hi`` of them,
    distinct), qcow2's allow_backing (directories or files)."""
    lo, hi = o.lo, o.hi
    if not isinstance(v, list):
        want = f"a list of {lo} to {hi} paths" if lo is not None else "a list of paths"
        raise _Invalid(at, f"{_show(v)} is {_kind(v)}: use {want}")
    if lo is not None and hi is not None and not lo <= len(v) <= hi:
        raise _Invalid(at, f"{len(v)} file{'s' * (len(v) != 1)} given: the {kind} target "
                       f"needs {lo} to {hi}")
    files = [_existing(p, f"{at}[{i}]", base) for i, p in enumerate(v)]
    for i, p in enumerate(files if o.distinct else ()):
        if p in files[:i]:
            raise _Invalid(f"{at}[{i}]", f"{p} is also {o.key}[{files.index(p)}]: use distinct "
                           "files")
    return files


def _no_sharing(devices: list[DeviceSpec]) -> None:
    """No two devices with one explicit id, none writing a file another uses."""
    ids: dict[int, str] = {}
    for d in devices:
        if d.config.dev_id >= 0:
            if d.config.dev_id in ids:
                raise _Invalid(f"{d.where}.id", f"{d.config.dev_id} is also the id of "
                               f"{ids[d.config.dev_id]}: pick another id (or -1 for any)")
            ids[d.config.dev_id] = d.where
    users: dict[str, DeviceSpec] = {}
    for d in devices:
        for at, f in d.backing_files():
            other = users.get(f)
            if other is not None and other is not d and not (other.read_only and d.read_only):
                raise _Invalid(at, f"{f} is also a backing file of {other.where}: two devices "
                               "must not write one file (use another file, or read_only = "
                               "true on both)")
            users[f] = d


# ------------------------------------------------------------------ values --

def _keyer(at: str) -> Callable[[str], str]:
    return lambda name: f"{at}.{name}"


def _table(v: Any, at: str) -> None:
    if not isinstance(v, dict):
        raise _Invalid(at, f"{_show(v)} is {_kind(v)}: use a table")


def _known(table: dict[str, Any], at: str, keys: Iterable[str]) -> None:
    keys = tuple(keys)
    for k in table:
        if k not in keys:
            name = k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)
            where = f"{at}.{name}" if at else name
            hint = _did_you_mean(k, keys) or (f" (known keys: {', '.join(keys)})" if keys
                                              else " (this table takes none)")
            raise _Invalid(where, f"unknown key{hint}")


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean \"{close[0]}\"?)" if close else ""


def _int(v: Any, at: str, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Invalid(at, f"{_show(v)} is {_kind(v)}: use an integer")
    if v < lo or (hi is not None and v > hi):
        want = f"{lo}..{hi}" if hi is not None else f"{lo} or more"
        raise _Invalid(at, f"{v} is out of range: use {want}")
    return v


def _bool(v: Any, at: str) -> bool:
    if not isinstance(v, bool):
        raise _Invalid(at, f"{_show(v)} is {_kind(v)}: use true or false")
    return v


def _str(v: Any, at: str) -> str:
    if not isinstance(v, str):
        raise _Invalid(at, f"{_show(v)} is {_kind(v)}: use a string")
    return v


def _choice(v: Any, at: str, choices: tuple[str, ...]) -> str:
    if isinstance(v, str) and v in choices:
        return v
    hint = _did_you_mean(v, choices) if isinstance(v, str) else ""
    listed = ", ".join(json.dumps(c) for c in choices[:-1]) + f" or {json.dumps(choices[-1])}"
    raise _Invalid(at, f"{_show(v)} is not a valid choice{hint}: use {listed}")


def _size(v: Any, at: str, lo: int, hi: int | None = None) -> int:
    try:
        n = parse_size(v)
    except ValueError as e:
        raise _Invalid(at, str(e)) from None
    if n < lo or (hi is not None and n > hi):
        want = f"{lo}..{hi}" if hi is not None else f"{lo} or more"
        raise _Invalid(at, f"{n} is out of range: use {want} (bytes)")
    return n


def _device_size(v: Any, at: str) -> int:
    n = _size(v, at, 512)
    if n % 512:
        raise _Invalid(at, f"{n} is not a multiple of 512: use whole sectors, e.g. \"64M\"")
    return n


def _block_size(v: Any, at: str) -> int | None:
    if v is None:
        return None
    n = _size(v, at, 512, 4096)
    if n not in BLOCK_SIZES:
        raise _Invalid(at, f"{n} is not a power of two: use 512, 1024, 2048 or 4096")
    return n


def _existing(v: Any, at: str, base: str) -> str:
    path = os.path.normpath(os.path.join(base, os.path.expanduser(_str(v, at))))
    if not os.path.exists(path):
        raise _Invalid(at, f"{path} does not exist: create it or fix the path")
    return os.path.realpath(path)


def _kind(v: Any) -> str:
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
                    (str, "a string"), (list, "a list"), (dict, "a table")):
        if isinstance(v, t):
            return name
    return "a date/time"


def _show(v: Any) -> str:
    """A value as it looks in TOML, cut short."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        s = json.dumps(v)
    elif isinstance(v, dict):
        s = "{...}"
    else:
        s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _toml_error(msg: str) -> str:
    """tomllib's "Problem (at line 3, column 5)" as "line 3, column 5: invalid TOML: problem"."""
    m = re.fullmatch(r"(.*) \(at (line \d+, column \d+|end of document)\)", msg, re.DOTALL)
    if m is None:
        return f"invalid TOML: {_one_line(msg)}"
    return f"{m[2]}: invalid TOML: {_one_line(m[1][:1].lower() + m[1][1:])}"


def _one_line(s: str) -> str:
    return " ".join(s.split())
