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

The values are checked by ``values``, a device's target and filters as
``registry`` declares and builds them; this module reads the tables.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from aioublk.errors import Error, UblkError
from aioublk.frontend import registry
from aioublk.frontend.registry import (
    build_target,
    check_options,
    parse_filters,
    target_kind,
    with_filters,
)
from aioublk.frontend.values import (
    Invalid,
    check_bool,
    check_choice,
    check_int,
    check_known,
    check_path,
    check_size,
    check_str,
    check_table,
    kind_of,
    one_line,
    show,
)
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


class ConfigError(Error):
    """A configuration problem, in one line: ``FILE: PATH: problem: remedy``."""


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
        raise ConfigError(f"{path}: invalid TOML: {one_line(str(e).split(';')[0])}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: arrays or tables nested too deeply: "
                          "flatten them") from None
    try:
        return parse(data, path, base=os.path.dirname(os.path.abspath(path)))
    except Invalid as e:
        raise ConfigError(f"{path}: {one_line(str(e))}") from None


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
    """Check parsed TOML; raises Invalid. ``base`` resolves relative paths."""
    check_known(data, "", ("logging", "devices", "metrics"))
    logging = _logging(data.get("logging", {}), base)
    metrics = _metrics(data.get("metrics", {}))
    raw = data.get("devices")
    if raw is None or raw == []:
        raise Invalid("devices", "no devices: add a [[devices]] table")
    if not isinstance(raw, list) or not all(isinstance(d, dict) for d in raw):
        raise Invalid("devices", f"{show(raw)} is {kind_of(raw)}: write each device as a "
                      "[[devices]] table")
    devices = [_device(d, f"devices[{i}]", base) for i, d in enumerate(raw)]
    _no_sharing(devices)
    return ServeConfig(path, logging, devices, metrics)


# ------------------------------------------------------------------ tables --

def _logging(raw: Any, base: str) -> LogSettings:
    at = "logging"
    check_table(raw, at)
    check_known(raw, at, ("level", "format", "stats_interval", "file"))
    file = None
    if "file" in raw:
        file = check_str(raw["file"], f"{at}.file")
        if not file.strip():
            raise Invalid(f"{at}.file", "empty: name a file, or drop the key to log on stderr")
        file = os.path.normpath(os.path.join(base, os.path.expanduser(file)))
    interval = raw.get("stats_interval", 0)
    if isinstance(interval, bool) or not isinstance(interval, int | float):
        raise Invalid(f"{at}.stats_interval", f"{show(interval)} is {kind_of(interval)}: use "
                      "a number of seconds (0 = no stats)")
    if not math.isfinite(interval) or interval < 0:
        what = "negative" if interval < 0 else "not a finite number"
        raise Invalid(f"{at}.stats_interval", f"{interval} is {what}: use 0 (no stats) or "
                      "a number of seconds")
    return LogSettings(level=check_choice(raw.get("level", "warning"), f"{at}.level", LEVELS),
                       format=check_choice(raw.get("format", "console"), f"{at}.format", FORMATS),
                       stats_interval=interval, file=file)


def _metrics(raw: Any) -> MetricsSettings:
    at = "metrics"
    check_table(raw, at)
    check_known(raw, at, ("listen",))
    if "listen" not in raw:
        return MetricsSettings()
    listen = parse_listen(check_str(raw["listen"], f"{at}.listen"), f"{at}.listen")
    if importlib.util.find_spec("prometheus_client") is None:
        raise Invalid(f"{at}.listen", "needs the prometheus-client package: pip install "
                      "'aioublk[metrics]', or drop [metrics]")
    return MetricsSettings(listen)


def parse_listen(v: str, at: str) -> tuple[str, int]:
    """(host, port) from "host:port" or "[v6 address]:port"."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\[\]]+):(\d+)", v.strip())
    if m is None:
        raise Invalid(at, f"{show(v)} is not host:port: use e.g. \"127.0.0.1:9341\" or "
                      "\"[::1]:9341\"")
    host, port = (m[1], int(m[2])) if m[1] else (m[3], int(m[4]))
    if not 1 <= port <= 65535:
        raise Invalid(at, f"port {port} is out of range: use 1..65535")
    return host, port


def _device(raw: dict[str, Any], at: str, base: str) -> DeviceSpec:
    check_known(raw, at, DEVICE_KEYS)
    if "target" not in raw:
        raise Invalid(f"{at}.target", "missing: set it to one of "
                      f"{', '.join(registry.TARGETS)} or \"pkg.module:Class\"")
    kind = target_kind(raw["target"], f"{at}.target")
    key = _keyer(at)
    values = {o.name: _device_option(o, raw, key(o.key), base) for o in DEVICE_OPTIONS if o.key}
    recovery = values["recovery_mode"]
    on_stop = check_choice(raw.get("on_stop", "delete"), key("on_stop"), ON_STOP)
    dev_id = values["dev_id"]
    try:
        cfg = device_config(values, prefix="")
    except OptionError as e:  # at its key if the message is the config's own
        raise Invalid(key(e.key) if e.config or isinstance(e, IntegrityError) else at,
                      e.config or str(e)) from None
    except UblkError as e:
        raise Invalid(at, str(e)) from None
    if on_stop == "quiesce" and recovery == "none":
        raise Invalid(key("on_stop"), "\"quiesce\" needs recovery: set recovery = "
                      "\"requeue\", \"reissue\" or \"fail_io\", or on_stop = \"delete\"")
    if on_stop == "quiesce" and dev_id < 0:
        raise Invalid(key("on_stop"), "\"quiesce\" needs a fixed id (the next serve finds "
                      "the device by it): set id = N")
    lbs = _block_size(raw.get("logical_block_size"), key("logical_block_size"))
    pbs = _block_size(raw.get("physical_block_size"), key("physical_block_size"))
    if lbs and pbs and pbs < lbs:
        raise Invalid(key("physical_block_size"), f"{pbs} is smaller than "
                      f"logical_block_size {lbs}: use {lbs} or more")
    options = check_options(kind, raw.get("options", {}), key("options"), base)
    _metadata_file(kind, options, cfg, key)
    read_only = check_bool(raw.get("read_only", False), key("read_only"))
    force_share = check_bool(raw.get("force_share", False), key("force_share"))
    if force_share and not read_only:
        raise Invalid(key("force_share"), "needs read_only = true (a writer never shares "
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
        if o.attr == "integrity":
            return check_int(v, at, -(1 << 63))
        return check_int(v, at, o.lo or 0, o.hi)
    if o.type == BOOL:
        return check_bool(v, at)
    if o.type == PATH:
        return check_path(v, at, base)
    if o.type == TRISTATE:
        if v == "auto":
            return None
        if not isinstance(v, bool):
            raise Invalid(at, f"{show(v)} is not a batch setting: use \"auto\", true or false")
        return v
    if o.attr == "integrity":
        return check_str(v, at)
    return check_choice(v, at, o.choices)


def _metadata_file(kind: str, options: dict[str, Any], cfg: DeviceConfig,
                   key: Callable[[str], str]) -> None:
    """A target keeping integrity metadata in a file (loop's metadata_file,
    its second FILE on the command line) has one exactly when metadata_size asks."""
    spec = registry.TARGETS.get(kind)
    second = spec.option(spec.second_file) if spec and spec.second_file else None
    if second is None:
        return
    if second.key in options and cfg.integrity is None:
        raise Invalid(f"{key('options')}.{second.key}", "needs metadata_size (and copy = "
                      "\"user_copy\"): set it, or drop the file")
    if second.key not in options and cfg.integrity is not None:
        raise Invalid(key("metadata_size"), f"the {kind} target keeps the metadata in its "
                      f"{second.what}: set options.{second.key}")


def _no_sharing(devices: list[DeviceSpec]) -> None:
    """No two devices with one explicit id, none writing a file another uses."""
    ids: dict[int, str] = {}
    for d in devices:
        if d.config.dev_id >= 0:
            if d.config.dev_id in ids:
                raise Invalid(f"{d.where}.id", f"{d.config.dev_id} is also the id of "
                              f"{ids[d.config.dev_id]}: pick another id (or -1 for any)")
            ids[d.config.dev_id] = d.where
    users: dict[str, DeviceSpec] = {}
    for d in devices:
        for at, f in d.backing_files():
            other = users.get(f)
            if other is not None and other is not d and not (other.read_only and d.read_only):
                raise Invalid(at, f"{f} is also a backing file of {other.where}: two devices "
                              "must not write one file (use another file, or read_only = "
                              "true on both)")
            users[f] = d


# ------------------------------------------------------------------ values --

def _keyer(at: str) -> Callable[[str], str]:
    return lambda name: f"{at}.{name}"


def _block_size(v: Any, at: str) -> int | None:
    if v is None:
        return None
    n = check_size(v, at, 512, 4096)
    if n not in BLOCK_SIZES:
        raise Invalid(at, f"{n} is not a power of two: use 512, 1024, 2048 or 4096")
    return n


def _toml_error(msg: str) -> str:
    """tomllib's "Problem (at line 3, column 5)" as "line 3, column 5: invalid TOML: problem"."""
    m = re.fullmatch(r"(.*) \(at (line \d+, column \d+|end of document)\)", msg, re.DOTALL)
    if m is None:
        return f"invalid TOML: {one_line(msg)}"
    return f"{m[2]}: invalid TOML: {one_line(m[1][:1].lower() + m[1][1:])}"


