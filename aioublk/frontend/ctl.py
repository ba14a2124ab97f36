"""What the commands on /dev/ublk-control share, and the light verbs' own
way in (``main``).

Scripts written for kublk poll ``list``, and udev runs ``udev owner`` for
every ublk node, so the light verbs (``Verb.light``: ``list``, ``del``,
``features``, ``udev``, ``commit``) start as fast as Python can: a blocking
``Control`` (no event loop), no asyncio, uvloop or structlog, and a parser
of their own that ``__main__`` builds from the verb's module alone (the
full command line's ``add`` needs every target's options).
"""

from __future__ import annotations

import argparse
import errno
import os
import select
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aioublk.errors import UblkError
from aioublk.frontend import stats, verb
from aioublk.kernel.control import Control, run_now, state_name


def light(argv: list[str]) -> verb.Verb | None:
    """The light verb ``argv`` asks for, else None."""
    asked = verb.find(argv[0]) if argv else None
    return asked if asked is not None and asked.light else None


def main(argv: list[str]) -> int:
    """``aioublk list|del|features|udev|commit ...``, without the full
    command line: the verb's parser alone."""
    asked = light(argv)
    if asked is None:
        raise ValueError(f"{argv[:1]} names no light verb")
    return verb.run(asked, verb.parser([asked]).parse_args(argv))


def blocking(handler: Callable[[Control, argparse.Namespace], int]
             ) -> Callable[[argparse.Namespace], int]:
    """A verb's handler run on a blocking Control (no event loop)."""
    def run(args: argparse.Namespace) -> int:
        ctrl = Control(blocking=True)
        try:
            return handler(ctrl, args)
        finally:
            ctrl.close()
    return run


def on_loop(handler: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
            ) -> Callable[[argparse.Namespace], int]:
    """A verb's async handler run on an event loop of its own, with the
    default logs (the event loop and the logs load only then)."""
    def run(args: argparse.Namespace) -> int:
        from aioublk import logs
        from aioublk.frontend.runner import run_loop

        logs.configure()
        return run_loop(handler(args))
    return run


async def with_control(fn: Callable[[Control], Awaitable[int]]) -> int:
    """``fn`` on a Control of its own (on the running event loop)."""
    ctrl = Control()
    try:
        return await fn(ctrl)
    finally:
        ctrl.close()


def need_id(args: argparse.Namespace) -> int:
    if args.dev_id < 0:
        raise UblkError(f"{args.cmd} needs a device id (-n ID)")
    return int(args.dev_id)


async def on_device(args: argparse.Namespace,
                    fn: Callable[[Control, int], Awaitable[None]]) -> int:
    """A command on the device ``-n ID``: exit status 0 unless ``fn`` raises."""
    dev_id = need_id(args)

    async def run(ctrl: Control) -> int:
        await fn(ctrl, dev_id)
        return 0
    return await with_control(run)


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


def delete_device(dev_id: int) -> None:
    """``delete`` on a Control of its own."""
    ctrl = Control(blocking=True)
    try:
        delete(ctrl, dev_id)
    finally:
        ctrl.close()


