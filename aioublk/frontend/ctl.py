"""The commands that only talk to /dev/ublk-control (and to a server by
signal): ``list``, ``del``, ``features``, ``udev`` and ``commit``.

Scripts written for kublk poll ``list``, and udev runs ``udev owner`` for
every ublk node, so these start as fast as Python can: a blocking
``Control`` (no event loop), no asyncio, uvloop or structlog, and a parser
of their own that ``__main__`` builds without the full command line (whose
``add`` needs every target's options). The full parser declares them with
the same functions, so ``aioublk --help`` and completion show them alike.
"""

from __future__ import annotations

import argparse
import errno
import os
import select
import signal
import sys
import time
from typing import Any, NoReturn

from aioublk.errors import Error, UblkError
from aioublk.frontend import stats
from aioublk.frontend.kublk_lines import device_ids, dump, target_line
from aioublk.kernel import uapi
from aioublk.kernel.control import Control, run_now, state_name

#: the subcommands this module serves
COMMANDS = ("list", "del", "features", "udev", "commit")


def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` finds it ($COLUMNS,
    then stdout's terminal, else 80), without importing shutil (and the
    compressors it brings)."""
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        return 80


class _Formatter(argparse.HelpFormatter):
    """argparse's help, sized by ``_columns`` (argparse makes a formatter at
    every ``add_argument``, and its own imports shutil to size it)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position,
                         _columns() - 2 if width is None else width)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 1 like kublk;
    help sized without shutil."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kw)

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"aioublk: {message}\n")
        raise SystemExit(1)


def dev_id_arg(value: str) -> int:
    """``-n``: an id ublk_drv accepts (it sends ids as u32s, so a larger
    one would name another device), or -1 (none given; any, for add)."""
    try:
        dev_id = int(value)
    except ValueError:
        dev_id = -2
    if not -1 <= dev_id < uapi.MAX_DEV_ID:
        raise argparse.ArgumentTypeError(f"device id {value} is out of range: use "
                                         f"0..{uapi.MAX_DEV_ID - 1}")
    return dev_id


def add_dev_id(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("-n", "--number", dest="dev_id", type=dev_id_arg, default=-1,
                        metavar="DEV_ID", help=help)


def add_del(sub: Any) -> None:
    d = sub.add_parser("del", help="delete devices")
    add_dev_id(d, "device to delete")
    d.add_argument("-a", "--all", action="store_true", help="delete all devices")


def add_list(sub: Any) -> None:
    ls = sub.add_parser("list", help="show devices")
    add_dev_id(ls, "device to show (default: all)")
    ls.add_argument("-a", "--all", action="store_true", help="show all devices (the default)")
    ls.add_argument("--stats", action="store_true",
                    help="also each queue's requests, bytes, errors and in-flight count, "
                    "and the share the C data plane served")
    ls.add_argument("--json", action="store_true",
                    help="one JSON list of the devices instead of kublk's lines")


def add_features(sub: Any) -> None:
    sub.add_parser("features", help="show the driver's features")


def add_udev(sub: Any) -> None:
    from aioublk.frontend import udev

    ud = sub.add_parser("udev", help="the udev rule that gives users their unprivileged "
                        "devices")
    uds = ud.add_subparsers(dest="udev_cmd", required=True, parser_class=Parser)
    uds.add_parser("rules", help=f"print the rule file (install it as {udev.RULES_FILE})")
    uo = uds.add_parser("owner", help="run by the rule: print an unprivileged device's "
                        "owner as UID GID (exit 1 for a privileged device)")
    uo.add_argument("name", help="the node's kernel name: ublkcN, ublkbN or ublkbNpM")


def add_commit(sub: Any) -> None:
    c = sub.add_parser("commit", help="write a served device's cow overlay to the device "
                       "under it, and flush it (the server goes on serving)")
    add_dev_id(c, "device whose overlay to commit")
    c.add_argument("--timeout", type=float, default=COMMIT_TIMEOUT, metavar="SECONDS",
                   help=f"how long to wait for the server (default {COMMIT_TIMEOUT:g})")


# ------------------------------------------------------------------ output --

async def describe(ctrl: Control, dev_id: int, with_stats: bool) -> dict[str, Any]:
    """``list --json``: one device as kublk's lines describe it, its recorded
    target, and (``with_stats``) its server's published counters (None if
    there are none)."""
    info = await ctrl.get_info(dev_id)
    params = await ctrl.get_params(dev_id)
    pid = info.ublksrv_pid
    record = stats.read_record(dev_id)
    mine = record is not None and record.get("pid") == pid
    out: dict[str, Any] = {
        "dev_id": info.dev_id, "nr_hw_queues": info.nr_hw_queues,
        "queue_depth": info.queue_depth, "block_size": 1 << params.logical_bs_shift,
        "dev_capacity": params.dev_sectors, "max_io_buf_bytes": info.max_io_buf_bytes,
        "pid": pid, "flags": info.flags, "state": state_name(info.state),
        "target": record.get("target") if mine and record else None,
        "files": [str(f) for f in record.get("files", [])] if mine and record else [],
        "filters": list(record.get("options", {}).get("filter") or []) if mine and record
        else [],
    }
    if with_stats:
        got = stats.read_at(dev_id, pid)
        out["stats"] = None if got is None else stats.json_rows(got[1])
        out["stats_time"] = None if got is None else got[0]  # published then (time.time())
    return out


def _lines(ctrl: Control, dev_id: int, with_stats: bool) -> list[str]:
    """kublk's lines for one device, then aioublk's target line (for a
    device an aioublk ``add`` recorded) and ``--stats``' lines."""
    out = run_now(dump(ctrl, dev_id))
    pid = run_now(ctrl.get_info(dev_id)).ublksrv_pid
    record = stats.read_record(dev_id)
    # (a record left by a server of another device of this id is not its)
    if record is not None and record.get("pid") == pid:
        out.append(target_line(record))
    if with_stats:
        rows = stats.read(dev_id, pid)
        out += stats.lines(rows) if rows is not None else [
            f"\tstats: none published by server pid {pid} (not an aioublk server, "
            "or not running)"]
    return out


def cmd_list(ctrl: Control, args: argparse.Namespace) -> int:
    found: list[dict[str, Any]] = []
    for dev_id in [args.dev_id] if args.dev_id >= 0 else device_ids():
        try:
            if args.json:
                found.append(run_now(describe(ctrl, dev_id, args.stats)))
            else:
                print("\n".join(_lines(ctrl, dev_id, args.stats)))
        except UblkError:
            if args.dev_id >= 0:
                raise
            # (deleted since it was listed)
    if args.json:
        import json

        print(json.dumps(found))
    return 0


def cmd_features(ctrl: Control, args: argparse.Namespace) -> int:
    feats = run_now(ctrl.features())
    print(f"ublk_drv features: 0x{feats:x}")
    for bit, name in uapi.feature_names(feats):
        print(f"0x{bit:<16x}: {name}")
    return 0


def wait_exit(pid: int, timeout: float) -> None:
    """Wait at most ``timeout`` seconds for process ``pid`` to exit (a
    zombie has), by its pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        poll.poll(int(timeout * 1000))
    finally:
        os.close(fd)


def delete(ctrl: Control, dev_id: int, timeout: float = 10.0) -> None:
    """Stop the device, wait for its server to exit, delete it."""
    info = run_now(ctrl.get_info(dev_id))
    res = run_now(ctrl.stop_dev(dev_id))
    if res < 0 and res != -errno.ENODEV:
        raise UblkError(f"cannot stop device {dev_id}: {os.strerror(-res)}")
    pid = info.ublksrv_pid
    if pid > 0 and pid != os.getpid():
        wait_exit(pid, timeout)
    res = run_now(ctrl.del_dev(dev_id))
    if res < 0 and res != -errno.ENODEV:
        raise UblkError(f"cannot delete device {dev_id}: {os.strerror(-res)}")
    failed = stats.remove_record(dev_id)
    if failed:
        sys.stderr.write(f"aioublk: warning: {failed}\n")


def cmd_del(ctrl: Control, args: argparse.Namespace) -> int:
    if args.dev_id >= 0:
        delete(ctrl, args.dev_id)
        return 0
    if not args.all:
        raise UblkError("del needs -n ID or -a")
    for dev_id in device_ids():
        try:
            delete(ctrl, dev_id)
        except UblkError as e:
            if "does not exist" not in str(e):
                raise
    return 0


#: seconds ``commit`` waits for the server by default (it writes every
#: block the overlay holds that the device under it lacks)
COMMIT_TIMEOUT = 600.0


def cmd_commit(ctrl: Control, args: argparse.Namespace) -> int:
    """Ask device ``-n``'s server (SIGUSR1) to commit its cow overlay, and
    wait for its answer in the run directory."""
    if args.dev_id < 0:
        raise UblkError("commit needs a device id (-n ID)")
    dev_id = args.dev_id
    info = run_now(ctrl.get_info(dev_id))
    pid = info.ublksrv_pid
    if info.state != uapi.State.LIVE or pid <= 0:
        raise UblkError(f"device {dev_id} is {state_name(info.state)}: only a live device's "
                        "server holds an overlay")
    if stats.read_at(dev_id, pid) is None:  # (SIGUSR1 would kill kublk's)
        raise UblkError(f"device {dev_id}'s server (pid {pid}) publishes no aioublk stats: "
                        "it is not an aioublk server, or not one that may be signalled")
    asked = time.time()
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + args.timeout
    while (got := stats.read_commit(dev_id, pid)) is None or got.get("time", 0) < asked:
        if time.monotonic() > deadline:
            raise UblkError(f"device {dev_id}: no answer from server pid {pid} in "
                            f"{args.timeout:g} s (is it still committing? see its log)")
        if not os.path.exists(f"/proc/{pid}"):
            raise UblkError(f"device {dev_id}: server pid {pid} exited before it answered")
        time.sleep(0.02)
    if "error" in got:
        raise UblkError(str(got["error"]))
    n = got["blocks"]
    print(f"device {dev_id}: {n} block{'' if n == 1 else 's'} of {got['block']} bytes committed")
    return 0


def delete_device(dev_id: int) -> None:
    """``delete`` on a Control of its own."""
    ctrl = Control(blocking=True)
    try:
        delete(ctrl, dev_id)
    finally:
        ctrl.close()


# -------------------------------------------------------------------- main --

def run(args: argparse.Namespace) -> int:
    """One of ``COMMANDS``, parsed (by this module's parser or the full one)."""
    try:
        if args.cmd == "udev":
            from aioublk.frontend import udev  # (only here: list and del need none of it)

            if args.udev_cmd == "rules":
                sys.stdout.write(udev.rules())
                return 0
            return udev.main_owner(args.name)
        handler = {"list": cmd_list, "del": cmd_del, "features": cmd_features,
                   "commit": cmd_commit}[args.cmd]
        ctrl = Control(blocking=True)
        try:
            return handler(ctrl, args)
        finally:
            ctrl.close()
    except (Error, OSError) as e:  # as the full command line reports them
        sys.stderr.write(f"aioublk: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: list[str]) -> int:
    """``aioublk list|del|features|udev ...`` without the full command line."""
    p = Parser(prog="aioublk")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    declare = {"list": add_list, "del": add_del, "features": add_features, "udev": add_udev,
               "commit": add_commit}
    # (the one asked for: udev's declaration imports its module)
    for name in [argv[0]] if argv and argv[0] in declare else COMMANDS:
        declare[name](sub)
    return run(p.parse_args(argv))
