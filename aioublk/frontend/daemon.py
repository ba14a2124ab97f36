"""Serving one device as ``add`` and ``recover`` do: in the foreground, or
daemonized like kublk's server (a new session, stdio on /dev/null, logs to
``--log-file``, syslog or a file in the run directory), the command
returning once the device is LIVE (its lines printed) or has failed (one
line). The device's record (how it was added, for ``recover`` and ``list``)
is written once it is live and removed when it is gone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aioublk import logs
from aioublk.device import Device
from aioublk.errors import UblkError
from aioublk.frontend import addargs, ctl, stats
from aioublk.frontend.kublk_lines import print_device
from aioublk.frontend.maketarget import make_target
from aioublk.frontend.runner import ONE_LINE_ERRORS, run_device, run_loop
from aioublk.kernel.control import Control
from aioublk.queue.options import DeviceConfig
from aioublk.target import Target

log = logs.get_logger("aioublk.cli")


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


def start(args: argparse.Namespace, *, recover: bool = False) -> int:
    """``add`` and ``recover`` (its options filled in from the record):
    serve in the foreground, or daemonize and report how the start went."""
    captive = getattr(args, "run", None)
    as_json = getattr(args, "json", False)
    if captive is not None and args.foreground:
        raise UblkError("--run serves the device in the background while CMD runs: drop "
                        "--foreground")
    json, level = args.log_format == "json", addargs.log_level(args)
    logs.configure(json=json, level=level)
    cfg = addargs.config_from_flags(args)
    target = make_target(args)
    record = addargs.record(args)

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

    rfd, pid = daemonize(serve, stderr=log_fd)
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
        return bool(await ctl.with_control(run))
    except UblkError as e:
        return "does not exist" not in str(e)


def daemonize(serve: Callable[[int], int], stderr: int | None = None) -> tuple[int, int]:
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
    return await ctl.with_control(run)


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
