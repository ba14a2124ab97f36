"""Command line compatible with the kernel's reference server ``kublk``.

Same subcommands, flags, defaults and output lines, so scripts written for
kublk keep working::

    python -m aioublk add -t null|loop|stripe|qcow2|fault_inject [-n ID] [-q N]
                         [-d DEPTH] [-r 0|1] [-e 0|1] [-i 0|1] [--foreground] [FILE...]
    python -m aioublk add -t pkg.module:Class [--opt KEY=VALUE...] (a custom target)
    python -m aioublk recover -n ID [options that differ from add's]
    python -m aioublk del -n ID | -a
    python -m aioublk stop -n ID [--safe]
    python -m aioublk quiesce -n ID
    python -m aioublk update_size -n ID -s BYTES
    python -m aioublk snapshot -n ID create|list|delete [NAME] (a qcow2 device's image)
    python -m aioublk list [-n ID | -a] [--stats] [--json]
    python -m aioublk features
    python -m aioublk serve config.toml

``add`` and ``recover`` daemonize like kublk: the command returns once the
device is LIVE (printing the same lines as ``list``) or has failed (one line
on stderr, non-zero exit, no device left behind by ``add``). A daemon's logs
go to ``--log-file`` (its stderr too) or else to syslog, or to a file in the
run directory on a host without one; a line on stderr says where (the
error line, when the server fails).
"""

from __future__ import annotations

import argparse
import difflib
import errno
import functools
import inspect
import json
import logging
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from aioublk import logs
from aioublk._version import __version__
from aioublk.device import Device
from aioublk.errors import UblkError
from aioublk.frontend import ctl, img, registry, stats
from aioublk.frontend.config import (
    SIZE_FORMS,
    build_target,
    filter_stack,
    packaged_target,
    packaged_targets,
    parse_size,
    target_options,
    toml_value,
    with_filters,
)
from aioublk.frontend.kublk_lines import print_device
from aioublk.frontend.runner import ONE_LINE_ERRORS, run_device, run_loop
from aioublk.io import locking
from aioublk.kernel import uapi
from aioublk.kernel.control import Control
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
from aioublk.target import Target

log = logs.get_logger("aioublk.cli")


def _both_spellings(parser: argparse.ArgumentParser) -> None:
    """Every multi-word long flag of ``parser`` and its subcommands also in the
    other spelling (``--no_batch`` for ``--no-batch``, ``--chunk-size`` for
    ``--chunk_size``): taken when parsing, while help, usage and errors keep
    the one declared."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                _both_spellings(sub)
            continue
        for name in action.option_strings:
            if not name.startswith("--"):
                continue
            for alt in ("--" + name[2:].replace("_", "-"), "--" + name[2:].replace("-", "_")):
                parser._option_string_actions.setdefault(alt, action)


def _flag01(value: str) -> bool:
    if value not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"'{value}' is not 0 or 1")
    return value == "1"


def _size(value: str) -> int:
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


def _add_create_options(add: argparse.ArgumentParser) -> None:
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
            add.add_argument(*o.flags, type=_flag01, default=o.default, metavar="0|1", **kw)
        elif o.type == CHOICE:
            add.add_argument(*o.flags, choices=o.choices, default=o.default, **kw)
        else:
            kind: Callable[[str], Any] = ctl.dev_id_arg if o.type == ID else int if o.type == INT \
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
            if o.type == registry.BOOL:
                kw |= ({"type": _flag01, "default": False, "metavar": "0|1"} if o.zero_one
                       else {"action": "store_true"})
            elif o.type == registry.PATHS:
                kw |= {"action": "append", "default": [], "metavar": "PATH"}
            elif o.type == registry.CHOICE:
                kw |= {"choices": o.choices}
            else:
                kw |= {"type": {registry.SIZE: _size, registry.INT: int}.get(o.type, str),
                       "default": o.default if shared_default else None}
                if o.type == registry.SIZE:
                    kw["metavar"] = "SIZE"
            if users not in groups:
                groups[users] = add.add_argument_group("-t " + users.replace("/", ", "))
            groups[users].add_argument(*o.flags, **kw)
    fed = [(t.name, f) for t in specs if (f := t.option(t.files)) is not None]
    one = [name + ("" if f.required else " (or none)") for name, f in fed
           if f.type == registry.PATH]
    many = [f"{name} {f.lo} to {f.hi}" for name, f in fed if f.type == registry.PATHS]
    named = [f"; {name} its {f.what}" for name, f in fed if f.type == registry.STR]
    add.add_argument("files", nargs="*", metavar="FILE",
                     help=f"backing files: {' and '.join(one)} take one, {', '.join(many)}"
                     f"{''.join(named)}")
    add.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                     help="a target option by its config key (repeatable): the only way to "
                     "give a pkg.module:Class target its keyword arguments; VALUE is read as "
                     "TOML (64, true, \"s\", [\"a\", \"b\"]) when it parses, else as a string")


def _filter_help(spec: registry.FilterSpec) -> str:
    keys = ",".join(f"{o.key}={o.type.upper()}" if o.required else f"[{o.key}={o.type.upper()}]"
                    for o in spec.options)
    return f"{spec.name}" + (f":{keys}" if keys else "") + f" = {spec.help}"


def _parser() -> argparse.ArgumentParser:
    p = ctl.Parser(prog="aioublk", description="ublk block-device server (kublk-compatible)")
    p.add_argument("--version", action="version", version=f"aioublk {__version__}",
                   help="show the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=ctl.Parser)

    add = sub.add_parser("add", help="create a device and serve it")
    _add_create_options(add)
    add.add_argument("--json", action="store_true",
                     help="print the new device as list --json does (a list of one object, "
                     "its id under dev_id) instead of kublk's lines")
    add.add_argument("--run", metavar="CMD",
                     help="captive mode (nbdkit's --run): run the shell command CMD with "
                     "$ublk set to /dev/ublkbN and $ublk_id to N, then delete the device; "
                     "exits with CMD's status")
    recover = sub.add_parser("recover", help="serve a QUIESCED device again (with the options "
                             "it was added with, or those given)")
    _add_create_options(recover)
    _given_only(recover)

    ctl.add_del(sub)

    st = sub.add_parser("stop", help="stop a device (its server exits; del removes it)")
    ctl.add_dev_id(st, "device to stop")
    st.add_argument("--safe", action="store_true", help="only if nothing has the disk open")

    qu = sub.add_parser("quiesce", help="detach the server, leaving the device QUIESCED")
    ctl.add_dev_id(qu, "device to quiesce")

    sn = sub.add_parser("snapshot", help="internal snapshots of the qcow2 image a live device "
                        "serves (added with -r 1 -i 1): the server steps aside while one is taken")
    ctl.add_dev_id(sn, "device whose image to snapshot")
    sn.add_argument("action", choices=["create", "list", "delete"],
                    help="create a snapshot, list them, or delete one")
    sn.add_argument("name", nargs="?", help="the snapshot's name (create, delete)")

    us = sub.add_parser("update_size", help="change the device's size")
    ctl.add_dev_id(us, "device to resize")
    us.add_argument("-s", "--size", type=_size, required=True,
                    help=f"new size: {SIZE_FORMS}")

    ctl.add_list(sub)
    ctl.add_features(sub)
    ctl.add_udev(sub)
    ctl.add_commit(sub)

    sv = sub.add_parser("serve", help="serve the devices of a TOML config file (foreground)")
    sv.add_argument("config", help="the TOML config file (see README)")
    img.add_parser(sub)

    co = sub.add_parser("completion", help="print a shell completion script, generated from "
                        "this parser (bash: source it, or install it as /usr/share/"
                        "bash-completion/completions/aioublk)")
    co.add_argument("shell", choices=["bash", "zsh", "fish"], help="the shell to complete for")
    sub.add_parser("man", help="print the man page aioublk(1) in roff (man -l - shows it)")
    _both_spellings(p)
    return p


def generated(what: str, shell: str = "") -> str:
    """``completion``'s script for ``shell``, or the man page (``man``)."""
    from aioublk.frontend import shellgen

    targets = (*registry.TARGETS, *packaged_targets())
    cmds = shellgen.commands(_parser(), {"-t": targets, "--filter": tuple(registry.FILTERS)})
    if what == "man":
        return shellgen.man(cmds, __version__)
    return {"bash": shellgen.bash, "zsh": shellgen.zsh, "fish": shellgen.fish}[shell](cmds)


def _given_only(recover: argparse.ArgumentParser) -> None:
    """``recover`` parses only what is given (-t too is optional): what is
    not comes from ``add``'s record, else from ``add``'s defaults."""
    for action in recover._actions:
        action.default = argparse.SUPPRESS
        action.required = False


@functools.cache
def _create_actions() -> tuple[argparse.Action, ...]:
    """The options ``add`` and ``recover`` take, with ``add``'s defaults."""
    p = argparse.ArgumentParser(add_help=False)
    _add_create_options(p)
    return tuple(p._actions)


def _create_defaults() -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for action in _create_actions():  # (-b and --no-batch: the first's default)
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


def _record(args: argparse.Namespace) -> dict[str, Any]:
    """What ``recover -n ID`` alone needs, and ``list`` shows: the target,
    its files (absolute) and every other option ``add`` parsed."""
    options = {dest: getattr(args, dest) for dest in _create_defaults()
               if dest not in _NOT_RECORDED}
    for dest in _PATH_OPTIONS:
        value = options.get(dest)
        if isinstance(value, str):
            options[dest] = os.path.abspath(value)
        elif isinstance(value, list):
            options[dest] = [os.path.abspath(v) for v in value]
    return {"target": args.target, "files": _absolute_files(args.target, args.files),
            "options": options}


def _absolute_files(target: str | None, files: list[str]) -> list[str]:
    """FILE arguments as a daemon (which runs in /) opens them: paths made
    absolute, but not what is no path (nbd's URI, which abspath would mangle)."""
    spec = registry.TARGETS.get(target or "")
    option = spec.option(spec.files) if spec is not None and spec.files else None
    if option is not None and option.type not in (registry.PATH, registry.PATHS):
        return list(files)
    return [os.path.abspath(f) for f in files]


def _spelled(dest: str, value: Any) -> str:
    """An option as it would be given: ``-q 4``, ``--buffered``, ``-r 1``."""
    actions = [a for a in _create_actions() if a.dest == dest]
    flag = actions[0].option_strings[0] if actions[0].option_strings else ""
    for a in actions:
        if a.nargs == 0 and a.const == value:
            return a.option_strings[0]
    if actions[0].nargs == 0:
        return f"no {flag}"
    values = value if isinstance(value, list) else [value]
    if not flag:  # the files
        return " ".join(map(str, values)) or "no file"
    shown = [str(int(v)) if isinstance(v, bool) else str(v) for v in values]
    return " ".join(f"{flag} {v}" for v in shown) or f"no {flag}"


def _as_recorded(args: argparse.Namespace) -> None:
    """``recover``: fill in what was not given from ``add``'s record of the
    device (else ``add``'s defaults); say in one line which given options
    differ from the record."""
    args.dev_id = getattr(args, "dev_id", -1)
    dev_id = _need_id(args)
    given = {k: v for k, v in vars(args).items() if k not in ("cmd", "dev_id")}
    record = stats.read_record(dev_id)
    if record is None:
        if "target" not in given:
            raise UblkError(f"device {dev_id} has no record of how it was added (not by an "
                            f"aioublk add, or one before records): give its options, e.g. "
                            f"recover -n {dev_id} -t TYPE [FILE...] as given to add")
        recorded: dict[str, Any] = {}
    else:
        recorded = {**record["options"], "target": record.get("target"),
                    "files": record.get("files", [])}
        if given.get("target", recorded["target"]) != recorded["target"]:
            del recorded["files"]  # the other target's
    if "files" in given:
        given["files"] = _absolute_files(given.get("target", recorded.get("target")),
                                         given["files"])
    overrides = [f"{_spelled(dest, value)} overrides the recorded "
                 f"{_spelled(dest, recorded[dest])}"
                 for dest, value in given.items()
                 if dest in recorded and value != recorded[dest]]
    if overrides:
        sys.stderr.write(f"aioublk: recover: {', '.join(overrides)}\n")
    for dest, default in _create_defaults().items():
        if dest not in given and dest != "dev_id":
            setattr(args, dest, recorded.get(dest, default))


# ------------------------------------------------------------------ output --

async def _with_control(fn: Callable[[Control], Awaitable[int]]) -> int:
    ctrl = Control()
    try:
        return await fn(ctrl)
    finally:
        ctrl.close()


def _need_id(args: argparse.Namespace) -> int:
    if args.dev_id < 0:
        raise UblkError(f"{args.cmd} needs a device id (-n ID)")
    return int(args.dev_id)


async def _on_device(args: argparse.Namespace,
                     fn: Callable[[Control, int], Awaitable[None]]) -> int:
    """A command on the device ``-n ID``: exit status 0 unless ``fn`` raises."""
    dev_id = _need_id(args)

    async def run(ctrl: Control) -> int:
        await fn(ctrl, dev_id)
        return 0
    return await _with_control(run)


async def cmd_stop(args: argparse.Namespace) -> int:
    async def run(ctrl: Control, dev_id: int) -> None:
        await ctrl.get_info(dev_id)  # "does not exist" in one line
        if args.safe:
            res = await ctrl.try_stop_dev(dev_id)
            if res == -errno.EBUSY:
                raise UblkError(f"device {dev_id} is open (mounted, or held by a program): "
                                "close it first, or stop without --safe")
        else:
            res = await ctrl.stop_dev(dev_id)
        if res < 0:
            raise UblkError(f"cannot stop device {dev_id}: {os.strerror(-res)}")
    return await _on_device(args, run)


async def cmd_quiesce(args: argparse.Namespace) -> int:
    async def run(ctrl: Control, dev_id: int) -> None:
        info = await ctrl.get_info(dev_id)
        if info.flags & uapi.Feature.QUIESCE and info.flags & uapi.Feature.BATCH_IO:
            sys.stderr.write(f"aioublk: warning: device {dev_id} uses batch I/O: until it is "
                             "recovered the kernel fails its new requests (SIGTERM an aioublk "
                             "server instead: it finishes its requests and detaches)\n")
        res = await ctrl.quiesce_dev(dev_id)
        if res == -errno.EOPNOTSUPP:
            raise UblkError(f"device {dev_id} cannot be quiesced: it was added without user "
                            "recovery (-r 1), or this kernel lacks UBLK_F_QUIESCE (6.15+)")
        if res < 0:
            raise UblkError(f"cannot quiesce device {dev_id}: {os.strerror(-res)}")
    return await _on_device(args, run)


async def cmd_snapshot(args: argparse.Namespace) -> int:
    from aioublk.frontend import livesnap

    async def run(ctrl: Control, dev_id: int) -> None:
        await ctrl.get_info(dev_id)  # "does not exist" in one line
        image = livesnap.image_of(dev_id)
        if args.action == "list":
            lines = img.snapshot_lines(image, True)
            if lines:
                print("\n".join(lines))
            return
        if not args.name:
            raise UblkError(f"give the snapshot's name: snapshot -n {dev_id} {args.action} NAME")
        if args.action == "delete" and all(s.name != args.name
                                           for s in img.snapshots_of(image, True)):
            # (found before the server steps aside for nothing)
            raise UblkError(f"{image}: could not delete snapshot '{args.name}': "
                            "snapshot not found")
        await livesnap.detach(ctrl, dev_id)
        try:
            if not locking.wait_released(image, livesnap.STEP_TIMEOUT):
                raise UblkError(f"{image} is still in use after its server exited")
            img.change_snapshots(image, args.action, args.name)
        finally:
            livesnap.recover(dev_id)
    return await _on_device(args, run)


async def cmd_update_size(args: argparse.Namespace) -> int:
    async def run(ctrl: Control, dev_id: int) -> None:
        params = await ctrl.get_params(dev_id)
        block = 1 << params.logical_bs_shift
        if not 0 < args.size < 1 << 63 or args.size % block:
            raise UblkError(f"size {args.size} is not a positive multiple of the device's "
                            f"logical block size ({block})")
        pid = (await ctrl.get_info(dev_id)).ublksrv_pid
        record = stats.read_record(dev_id)
        # (a record left by a server of another device of this id is not its)
        limit = _backing_bytes(record) if record and record.get("pid") == pid else None
        if record is not None and limit is not None and args.size > limit:
            raise UblkError(f"size {args.size} is more than device {dev_id}'s "
                            f"{record['target']} target can serve: its backing files "
                            f"hold {limit} bytes (grow them first)")
        res = await ctrl.update_size(dev_id, args.size >> 9)
        if res < 0:
            raise UblkError(f"cannot resize device {dev_id}: {os.strerror(-res)}")
    return await _on_device(args, run)


def _backing_bytes(record: dict[str, Any]) -> int | None:
    """The bytes a recorded device's files hold now, which its target can
    serve and no more (past them a loop target would grow its file); None
    when no file bounds the target, or the files cannot be read."""
    spec = registry.TARGETS.get(str(record.get("target")))
    files = record.get("files") or []
    if spec is None or not isinstance(files, list) or not files:
        return None
    try:
        return spec.target_class().capacity([str(f) for f in files],
                                            dict(record.get("options") or {}))
    except (OSError, TypeError, ValueError, AttributeError):
        return None


# --------------------------------------------------------------------- add --

def make_target(args: argparse.Namespace) -> Target:
    """Build the target named by ``-t`` from the command line's files, flags
    and ``--opt`` (raises UblkError/BackingError/Qcow2Error)."""
    name, files = args.target, args.files
    opts = _opt_values(args.opt)
    spec = registry.TARGETS.get(name)
    if spec is None and ":" not in name:
        packaged = packaged_target(name)
        if packaged is None:
            raise _unknown_target(name)
        name = packaged  # a package's target: built as the module:Class it names
    _no_foreign_options(name, spec, args)
    if spec is None:
        if files:
            raise UblkError(f"{name} takes no FILE: give its arguments as --opt KEY=VALUE")
        return _built(name, target_options(name, opts, at="--opt", base=os.getcwd()), args)
    options = {o.key: getattr(args, o.key) for o in spec.options
               if o.flags and getattr(args, o.key) is not None}
    for o in spec.options:
        if o.type == registry.INT and o.flags and o.lo == 0 and options[o.key] < 0:
            raise UblkError(f"{o.flag} {options[o.key]} is negative")
    fed = spec.option(spec.files)
    if fed is None and files:
        raise UblkError(f"the {name} target takes no backing file")
    if fed is not None and fed.key in opts:
        if files:
            raise UblkError(f"the {name} target's {fed.what} is given twice: as FILE and as "
                            f"--opt {fed.key}; drop one")
    elif fed is not None and fed.type in (registry.PATH, registry.STR):
        second = spec.option(spec.second_file) if spec.second_file else None
        if second is not None and len(files) == 2:  # (kublk's loop: the metadata file)
            if not getattr(args, "metadata_size", 0):
                raise UblkError(f"the {name} target's second FILE is its {second.what}: add "
                                "-u --metadata_size N, or drop it")
            options[second.key] = files[1]
            files = files[:1]
        if len(files) > 1 or (fed.required and not files):
            what = "image file" if fed.what == "image" else fed.what
            need = "exactly one" if fed.required else "at most one"
            raise UblkError(f"the {name} target needs {need} {what}, got {len(files)}")
        if files:
            options[fed.key] = files[0]
    elif fed is not None:
        options[fed.key] = files
    options |= target_options(name, opts, at="--opt", base=os.getcwd())
    return _built(name, options, args)


def _unknown_target(name: str) -> UblkError:
    known = [*registry.TARGETS, *packaged_targets()]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return UblkError(f"unknown target type '{name}'{hint}: use one of {', '.join(known)}, or "
                     "pkg.module:Class with --opt")


def _no_foreign_options(name: str, spec: registry.TargetSpec | None,
                        args: argparse.Namespace) -> None:
    """A target flag given to a target that does not take it is refused, not
    ignored (``--zone_size`` with ``-t null``)."""
    mine = set(spec.keys()) if spec is not None else set()
    defaults = _create_defaults()
    for other in registry.TARGETS.values():
        for o in other.options:
            if (o.flags and o.key not in mine and hasattr(args, o.key)
                    and getattr(args, o.key) != defaults.get(o.key)):
                owners = [t.name for t in registry.TARGETS.values() if t.option(o.key)]
                raise UblkError(f"{o.flags[0]} is an option of the {'/'.join(owners)} "
                                f"target, not {name}: drop it")


def _built(name: str, options: dict[str, Any], args: argparse.Namespace) -> Target:
    """The target, read-only if asked whatever it is (as serve's read_only):
    the kernel makes the disk read-only, and a target that opens files
    opens them so."""
    filters = filter_stack(args.filter)
    target = with_filters(build_target(name, options, read_only=args.read_only,
                                       force_share=args.force_share), filters)
    if args.read_only:
        target.geometry = replace(target.geometry, read_only=True)
    return target


def _opt_values(opts: list[str]) -> dict[str, Any]:
    """``--opt KEY=VALUE``s: a VALUE that parses as TOML is that value (64,
    true, "s", [1, 2]), any other the string it is."""
    out: dict[str, Any] = {}
    for opt in opts:
        key, eq, text = opt.partition("=")
        if not eq or not key.strip():
            raise UblkError(f"--opt {opt!r} is not KEY=VALUE: write e.g. --opt size=64M")
        out[key.strip()] = toml_value(text)
    return out


def device_config(args: argparse.Namespace) -> DeviceConfig:
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


#: the file a daemon logs to when there is no syslog to send its lines to
FALLBACK_LOG = "aioublk.log"


def _daemon_logs(args: argparse.Namespace) -> tuple[int | None, logging.Handler | None, str]:
    """Where a daemon's logs go, opened now so that a failure is an error at
    the prompt: (a log file's descriptor, or syslog's handler; a description)."""
    if args.log_file:
        return logs.open_log_file(args.log_file), None, os.path.abspath(args.log_file)
    try:
        return None, logs.syslog_handler(), f"syslog ({logs.SYSLOG_IDENT})"
    except logs.LogFileError as e:
        missing = str(e)
    path = os.path.join(stats.RUN_DIR, FALLBACK_LOG)
    try:
        dfd = stats.open_run_dir(create=True)
        try:
            fd = os.open(FALLBACK_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o640, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        raise logs.LogFileError(f"{missing}, and cannot write {path}: {e.strerror or e}: "
                                "pass --log-file PATH") from None
    return fd, None, f"{path} ({missing})"


def cmd_add(args: argparse.Namespace) -> int:
    """``add`` and ``recover``: serve in the foreground, or daemonize and
    report how the start went."""
    recover = args.cmd == "recover"
    if recover:
        _as_recorded(args)
    captive = getattr(args, "run", None)
    as_json = getattr(args, "json", False)
    if captive is not None and args.foreground:
        raise UblkError("--run serves the device in the background while CMD runs: drop "
                        "--foreground")
    json, level = args.log_format == "json", log_level(args)
    logs.configure(json=json, level=level)
    cfg = device_config(args)
    target = make_target(args)
    record = _record(args)

    if args.foreground:
        if args.log_file:
            logs.configure(json=json, level=level, to=logs.open_log_file(args.log_file))
            sys.stderr.write(f"aioublk: logs: {os.path.abspath(args.log_file)}\n")

        async def announce(dev: Device) -> None:
            await _announce(dev._ctrl, dev.id, as_json)  # type: ignore[arg-type]
        return run_loop(_serve_recorded(target, cfg, announce, recover, record))

    try:
        log_fd, syslog, where = _daemon_logs(args)
    except BaseException:
        target.close()
        raise

    def serve(wfd: int) -> int:
        logs.configure(json=json, level=level, to=syslog)  # stderr: the log file, if any
        if syslog is not None:
            logs.log_uncaught_in_threads()

        reported = False

        async def report(dev: Device) -> None:
            nonlocal reported
            os.write(wfd, f"OK {dev.id}\n".encode())
            os.close(wfd)
            reported = True
        try:
            return run_loop(_serve_recorded(target, cfg, report, recover, record))
        except ONE_LINE_ERRORS as e:
            log.error("server failed", error=str(e))
            msg = str(e)
        except BaseException as e:  # noqa: BLE001 - the parent must hear about it
            log.error("server failed", exc_info=True)
            msg = f"server failed: {e!r}"
        if not reported:  # (once reported, wfd is closed and its number may be reused)
            _report_error(wfd, msg)
        return 1

    rfd, pid = _daemonize(serve, stderr=log_fd)
    target.close()
    if log_fd is not None:
        os.close(log_fd)
    if syslog is not None:
        syslog.close()
    os.waitpid(pid, 0)
    with os.fdopen(rfd, "rb") as r:
        line = r.readline().decode().strip()
    if line.startswith("OK "):
        # said once the server runs: a refusal before that stays one line
        sys.stderr.write(f"aioublk: logs: {where}\n")
        sys.stderr.flush()
        dev_id = int(line.split()[1])
        if captive is None:
            return run_loop(_with_control_lines(dev_id, as_json))
        return _run_captive(dev_id, captive)
    why = line.removeprefix("ERR ") if line else "the server exited before the device became live"
    raise UblkError(f"{why} (logs: {where})")


def _run_captive(dev_id: int, command: str) -> int:
    """``add --run``: CMD's exit status (128 + N for a signal, as a shell says
    it), the device deleted however CMD ended."""
    try:
        run_loop(_with_control_lines(dev_id))
        env = {**os.environ, "ublk": f"/dev/ublkb{dev_id}", "ublk_id": str(dev_id)}
        code = subprocess.run(command, shell=True, env=env, check=False).returncode
    finally:
        ctl.delete_device(dev_id)
    return 128 - code if code < 0 else code


async def _serve_recorded(target: Target, cfg: DeviceConfig,
                          on_live: Callable[[Device], Awaitable[None]], recover: bool,
                          record: dict[str, Any]) -> int:
    """``run_device``, recording how the device was added before it is
    announced, and forgetting it if the device is gone when serving ends
    (deleted by this server, or from outside)."""
    served: list[int] = []

    async def recorded(dev: Device) -> None:
        stats.write_record(dev.id, record)
        served.append(dev.id)
        await on_live(dev)
    try:
        return await run_device(target, cfg, recorded, recover)
    finally:
        failed = stats.remove_record(served[0]) if served and not await _exists(served[0]) \
            else None
        if failed:
            log.warning(failed)


async def _exists(dev_id: int) -> bool:
    async def run(ctrl: Control) -> bool:
        await ctrl.get_info(dev_id)
        return True
    try:
        return bool(await _with_control(run))
    except UblkError as e:
        return "does not exist" not in str(e)


def _daemonize(serve: Callable[[int], int], stderr: int | None = None) -> tuple[int, int]:
    """Run ``serve(wfd)`` in a daemon, detached as kublk's is (a new session,
    a second fork, stdio on /dev/null, stderr on the descriptor ``stderr``
    if given), in ``/`` with umask 022 so that it
    holds no directory busy and creates nothing with the caller's umask.
    Returns the read end of ``wfd`` and the pid of the first child (exits
    at once: wait for it)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid != 0:
        os.close(wfd)
        return rfd, pid
    code = 1
    try:  # child: detach, then the grandchild serves
        os.close(rfd)
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        os.umask(0o022)
        os.chdir("/")
        _detach_stdio(stderr)
        code = serve(wfd)
    finally:
        os._exit(code)


async def _with_control_lines(dev_id: int, as_json: bool = False) -> int:
    async def run(ctrl: Control) -> int:
        await _announce(ctrl, dev_id, as_json)
        return 0
    return await _with_control(run)


async def _announce(ctrl: Control, dev_id: int, as_json: bool) -> None:
    """A new device: kublk's lines, or (``add --json``) list --json's list."""
    if as_json:
        print(json.dumps([await ctl.describe(ctrl, dev_id, False)]), flush=True)
    else:
        await print_device(ctrl, dev_id)


def _report_error(wfd: int, msg: str) -> None:
    try:
        os.write(wfd, f"ERR {msg}\n".encode())
    except OSError:
        pass


def _detach_stdio(stderr: int | None) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(stderr if fd == 2 and stderr is not None else null, fd)
    os.close(null)


# -------------------------------------------------------------------- main --

def _asked_target_help(argv: list[str]) -> str | None:
    """The NAME of ``add|recover -t NAME --help``, else None."""
    if not argv or argv[0] not in ("add", "recover") or not {"-h", "--help"} & set(argv):
        return None
    for i, a in enumerate(argv[:-1]):
        if a in ("-t", "--type"):
            return argv[i + 1]
        if a.startswith("--type="):
            return a.split("=", 1)[1]
    return None


def target_help(name: str) -> str:
    """What ``add -t NAME`` takes beyond the device options: the built-in
    target's flags (and config keys), or a class's keyword arguments."""
    spec = registry.TARGETS.get(name)
    if spec is not None:
        lines = [f"aioublk add -t {name}: the {name} target's options (each also --opt KEY=VALUE "
                 "and a serve config's options.KEY)", ""]
        for o in spec.options:
            how = " ".join(o.flags) if o.flags and o.arg != "*" else \
                "FILE" if o.key == spec.files else f"--opt {o.key}=VALUE"
            default = f" (default: {o.default_help})" if o.default_help else ""
            lines.append(f"  {how:28} {o.key}: {o.help}{default}")
        lines += ["", "Device options (queues, depth, copy mode...): aioublk add --help."]
        return "\n".join(lines) + "\n"
    kind = name if ":" in name else packaged_target(name)
    if kind is None:
        raise _unknown_target(name)
    from aioublk.frontend.config import target_class_of

    cls = target_class_of(kind)
    params = [p for p in inspect.signature(cls).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    lines = [f"aioublk add -t {name}: {kind}, its keyword arguments as --opt KEY=VALUE "
             "(and a serve config's options.KEY)", ""]
    lines += [f"  --opt {p.name}=VALUE" + ("" if p.default is p.empty
                                          else f" (default: {p.default!r})")
              for p in params]
    doc = inspect.getdoc(cls)
    if doc:
        lines += ["", doc.splitlines()[0]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    given = sys.argv[1:] if argv is None else argv
    if not given:  # a bare aioublk: what it can do
        sys.stdout.write(parser.format_help())
        return 2
    asked = _asked_target_help(given)
    if asked is not None:
        try:
            sys.stdout.write(target_help(asked))
        except ONE_LINE_ERRORS as e:
            sys.stderr.write(f"aioublk: {e}\n")
            return 1
        return 0
    args = parser.parse_args(argv)
    try:
        if args.cmd in ("add", "recover"):
            return cmd_add(args)
        if args.cmd == "serve":
            from aioublk.frontend.serve import main as serve_main

            return serve_main(args.config)
        if args.cmd == "img":
            return img.main(args)
        if args.cmd in ("completion", "man"):
            sys.stdout.write(generated(args.cmd, getattr(args, "shell", "")))
            return 0
        if args.cmd in ctl.COMMANDS:
            return ctl.run(args)
        logs.configure()
        handler = {"stop": cmd_stop, "quiesce": cmd_quiesce,
                   "update_size": cmd_update_size, "snapshot": cmd_snapshot}[args.cmd]
        return run_loop(handler(args))
    except ONE_LINE_ERRORS as e:  # as serve() reports them
        sys.stderr.write(f"aioublk: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130
