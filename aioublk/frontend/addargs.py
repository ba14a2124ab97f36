"""The options ``add`` takes and ``recover`` takes again: their declaration
(kublk's device flags from ``DEVICE_OPTIONS``, the server's, each built-in
target's from the registry), their defaults, the record a device keeps of
them, and the DeviceConfig and log level they ask for.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from typing import Any

from aioublk.errors import UblkError
from aioublk.frontend import registry
from aioublk.frontend.values import SIZE_FORMS, parse_size
from aioublk.frontend.verb import dev_id_arg, flag01
from aioublk.kernel import uapi
from aioublk.queue import options
from aioublk.queue.options import (
    BOOL,
    CHOICE,
    DEVICE_OPTIONS,
    FLAG01,
    ID,
    INT,
    PATH,
    TRISTATE,
    DeviceConfig,
)
from aioublk.targets import spec as decl


def size(value: str) -> int:
    """A size option: bytes, or "4M" and the like, parsed as config files are."""
    try:
        return parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _debug_mask(value: str) -> int:
    """kublk's --debug_mask: hexadecimal, with or without 0x (kublk reads it so)."""
    try:
        mask = int(value, 16)
    except ValueError:
        mask = -1
    if mask < 0:
        raise argparse.ArgumentTypeError(f"'{value}' is not a hexadecimal mask: use e.g. 0, "
                                         "0x20 or 0x1f")
    return mask


def add_create_options(add: argparse.ArgumentParser) -> None:
    """The options of ``add``, which ``recover`` takes again."""
    add.epilog = f"SIZE is {SIZE_FORMS}."
    add.add_argument("-t", "--type", dest="target", required=True,
                     help="target: " + "|".join(registry.TARGETS) + ", or pkg.module:Class "
                     "with --opt")
    _add_device_options(add.add_argument_group(
        "the device (kublk's flags)", "how the kernel's device is made: queues, copy mode, "
        "features, recovery"))
    _add_server_options(add.add_argument_group("the server", "how this process serves it"))
    _add_target_options(add)


def _add_server_options(add: argparse._ActionsContainer) -> None:
    add.add_argument("--foreground", action="store_true",
                     help="serve in this process instead of daemonizing")
    add.add_argument("--quiet", action="store_true",
                     help="log errors only (the device's lines are still printed)")
    add.add_argument("--debug_mask", type=_debug_mask, default=None, metavar="MASK",
                     help="kublk's hex mask: 0 = as --quiet, 0x20 (UBLK_LOG) = the default "
                     "logs, any of 0x1f = debug logs, as -v")
    add.add_argument("--read-only", "--read_only", dest="read_only", action="store_true",
                     help="a read-only disk, whatever the target (the files of those "
                     "that open some are opened read-only)")
    add.add_argument("--force-share", "-U", dest="force_share", action="store_true",
                     help="with --read-only: serve files QEMU or others may be writing")
    add.add_argument("-v", "--verbose", action="store_true", help="log every request")
    add.add_argument("--filter", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                     help="put a filter in front of the target (repeatable, outermost "
                     "first): " + "; ".join(_filter_help(f) for f in registry.FILTERS.values()))
    add.add_argument("--log-format", choices=("console", "json"), default="console",
                     help="log lines as text (default) or JSON")
    add.add_argument("--log-file", metavar="PATH",
                     help="append the server's log lines (and a daemon's stderr) to PATH "
                     "(default: stderr with --foreground, else syslog)")


def _add_device_options(add: argparse._ActionsContainer) -> None:
    """The device's flags, as ``options.DEVICE_OPTIONS`` declares them."""
    for o in DEVICE_OPTIONS:
        if not o.flags:
            continue
        help_ = o.help + (f" ({uapi.flag_list(o.feature)})" if o.feature else "")
        if o.type in (INT, ID):
            bounds = f", {o.lo}..{o.hi}" if o.hi is not None else ""
            help_ += f" (default: {o.default}{bounds})"
        kw: dict[str, Any] = {"dest": o.name, "help": help_}
        if o.metavar:
            kw["metavar"] = o.metavar
        if o.type == TRISTATE:
            group = add.add_mutually_exclusive_group()
            group.add_argument(*o.flags, action="store_true", default=o.default, **kw)
            group.add_argument(*o.off_flags, dest=o.name, action="store_false",
                               help=o.off_help)
        elif o.type == BOOL:
            add.add_argument(*o.flags, action="store_true", **kw)
        elif o.type == FLAG01:
            add.add_argument(*o.flags, type=flag01, default=o.default, metavar="0|1", **kw)
        elif o.type == CHOICE:
            add.add_argument(*o.flags, choices=o.choices, default=o.default, **kw)
        else:
            kind: Callable[[str], Any] = dev_id_arg if o.type == ID else int if o.type == INT \
                else str
            add.add_argument(*o.flags, type=kind, default=o.default, **kw)


def _add_target_options(add: argparse.ArgumentParser) -> None:
    """The built-in targets' flags, FILE and --opt, as the registry declares them:
    in a group for each set of targets that share them."""
    seen: set[str] = set()
    specs = registry.TARGETS.values()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in specs:
        for o in spec.options:
            if not o.flags or o.key in seen:
                continue
            seen.add(o.key)
            same = [(t.name, t.option(o.key)) for t in specs if t.option(o.key) is not None]
            users = "/".join(name for name, _o in same)
            default = f" (default: {o.default_help})" if o.default_help else ""
            shared_default = len({u.default for _name, u in same if u is not None}) == 1
            if not shared_default:  # each target's own default, applied by its class
                default = " (default: " + ", ".join(
                    f"{name} {u.default_help}" for name, u in same if u is not None) + ")"
            kw: dict[str, Any] = {"dest": o.key, "help": f"{users}: {o.help}{default}"}
            if o.type == decl.BOOL:
                kw |= ({"type": flag01, "default": False, "metavar": "0|1"} if o.zero_one
                       else {"action": "store_true"})
            elif o.type == decl.PATHS:
                kw |= {"action": "append", "default": [], "metavar": "PATH"}
            elif o.type == decl.CHOICE:
                kw |= {"choices": o.choices}
            else:
                kw |= {"type": {decl.SIZE: size, decl.INT: int}.get(o.type, str),
                       "default": o.default if shared_default else None}
                if o.type == decl.SIZE:
                    kw["metavar"] = "SIZE"
            if users not in groups:
                groups[users] = add.add_argument_group("-t " + users.replace("/", ", "))
            groups[users].add_argument(*o.flags, **kw)
    fed = [(t.name, f) for t in specs if (f := t.option(t.files)) is not None]
    one = [name + ("" if f.required else " (or none)") for name, f in fed
           if f.type == decl.PATH]
    many = [f"{name} {f.lo} to {f.hi}" for name, f in fed if f.type == decl.PATHS]
    named = [f"; {name} its {f.what}" for name, f in fed if f.type == decl.STR]
    add.add_argument("files", nargs="*", metavar="FILE",
                     help=f"backing files: {' and '.join(one)} take one, {', '.join(many)}"
                     f"{''.join(named)}")
    add.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                     help="a target option by its config key (repeatable): the only way to "
                     "give a pkg.module:Class target its keyword arguments; VALUE is read as "
                     "TOML (64, true, \"s\", [\"a\", \"b\"]) when it parses, else as a string")


def _filter_help(spec: decl.FilterSpec) -> str:
    keys = ",".join(f"{o.key}={o.type.upper()}" if o.required else f"[{o.key}={o.type.upper()}]"
                    for o in spec.options)
    return f"{spec.name}" + (f":{keys}" if keys else "") + f" = {spec.help}"


def given_only(recover: argparse.ArgumentParser) -> None:
    """``recover`` parses only what is given (-t too is optional): what is
    not comes from ``add``'s record, else from ``add``'s defaults."""
    for action in recover._actions:
        action.default = argparse.SUPPRESS
        action.required = False


@functools.cache
def create_actions() -> tuple[argparse.Action, ...]:
    """The options ``add`` and ``recover`` take, with ``add``'s defaults."""
    p = argparse.ArgumentParser(add_help=False)
    add_create_options(p)
    return tuple(p._actions)


def create_defaults() -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for action in create_actions():  # (-b and --no-batch: the first's default)
        default = action.default
        if default is None and action.nargs == "*":
            default = []  # (as argparse makes it)
        # (a copy: a list default is the parser's own)
        defaults.setdefault(action.dest, list(default) if isinstance(default, list) else default)
    return defaults


#: not among the recorded options: the target and files are recorded apart,
#: the id is the record's name, --foreground is how one command runs
_NOT_RECORDED = ("target", "files", "dev_id", "foreground")


#: options naming files, recorded absolute (a daemon runs in /)
_PATH_OPTIONS = ("log_file", "allow_backing", "htlb")


def record(args: argparse.Namespace) -> dict[str, Any]:
    """What ``recover -n ID`` alone needs, and ``list`` shows: the target,
    its files (absolute) and every other option ``add`` parsed."""
    options = {dest: getattr(args, dest) for dest in create_defaults()
               if dest not in _NOT_RECORDED}
    for dest in _PATH_OPTIONS:
        value = options.get(dest)
        if isinstance(value, str):
            options[dest] = os.path.abspath(value)
        elif isinstance(value, list):
            options[dest] = [os.path.abspath(v) for v in value]
    return {"target": args.target, "files": absolute_files(args.target, args.files),
            "options": options}


def absolute_files(target: str | None, files: list[str]) -> list[str]:
    """FILE arguments as a daemon (which runs in /) opens them: paths made
    absolute, but not what is no path (nbd's URI, which abspath would mangle)."""
    spec = registry.TARGETS.get(target or "")
    option = spec.option(spec.files) if spec is not None and spec.files else None
    if option is not None and option.type not in (decl.PATH, decl.PATHS):
        return list(files)
    return [os.path.abspath(f) for f in files]


def config_from_flags(args: argparse.Namespace) -> DeviceConfig:
    """The device the flags ask for (``options.device_config`` checks it);
    a FILE given is made absolute (a daemon runs in /)."""
    values = {o.name: getattr(args, o.name) for o in DEVICE_OPTIONS if o.flags}
    for o in DEVICE_OPTIONS:
        if o.type == PATH and values.get(o.name):
            values[o.name] = os.path.abspath(values[o.name])
    return options.device_config(values)


#: kublk's debug_mask bits: UBLK_DBG_DEV..UBLK_DBG_CTRL_CMD are its debug
#: output, UBLK_LOG its usual lines (its default mask)
_KUBLK_DEBUG, _KUBLK_LOG = 0x1f, 0x20


def log_level(args: argparse.Namespace) -> str:
    """The log level ``-v``, ``--quiet`` and ``--debug_mask`` ask for
    (refused in one line if they disagree)."""
    asked: dict[str, str] = {}
    if args.verbose:
        asked["-v"] = "debug"
    if args.quiet:
        asked["--quiet"] = "error"
    if args.debug_mask is not None:
        mask = args.debug_mask
        asked[f"--debug_mask {mask:#x}"] = ("debug" if mask & _KUBLK_DEBUG else
                                            "warning" if mask & _KUBLK_LOG else "error")
    levels = set(asked.values())
    if len(levels) > 1:
        raise UblkError(f"{' and '.join(asked)} ask for different logs: pick one")
    return levels.pop() if levels else "warning"
