"""Helpers for tests that drive the real ublk driver through the CLI.

They run where /dev/ublk-control exists (the guest); every call has a
timeout so that a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from aioublk.device import Device
from aioublk.errors import UblkError
from aioublk.frontend import cli as cli_mod
from aioublk.frontend import ctl
from aioublk.frontend.kublk_lines import device_ids, dump
from aioublk.kernel.control import Control, run_now
from aioublk.queue.options import DeviceConfig
from aioublk.target import Target

T = TypeVar("T")

CLI = [sys.executable, "-m", "aioublk"]

_DEV_LINE = re.compile(
    r"^dev id (\d+): nr_hw_queues (\d+) queue_depth (\d+) block size (\d+) dev_capacity (\d+)$")
_INFO_LINE = re.compile(
    r"^\tmax rq size (\d+) daemon pid (-?\d+) flags 0x([0-9a-f]+) state (\w+)$")
_QUEUE_LINE = re.compile(r"^\tqueue (\d+): affinity\(((?:\d+ )*)\)$")
_TARGET_LINE = re.compile(r"^\ttarget: (.+)$")  # aioublk's own, after kublk's


@dataclass
class DevListing:
    dev_id: int
    queues: int
    depth: int
    block_size: int
    sectors: int
    max_rq: int
    pid: int
    flags: int
    state: str
    affinity: list[str]
    target: str = ""


def parse_list(out: str) -> list[DevListing]:
    """Parse kublk's ``list`` format strictly, and aioublk's target line:
    any other line is an error."""
    devs: list[DevListing] = []
    for line in out.splitlines():
        if not line:
            continue
        if m := _DEV_LINE.match(line):
            a = [int(x) for x in m.groups()]
            devs.append(DevListing(a[0], a[1], a[2], a[3], a[4], 0, 0, 0, "", []))
        elif m := _INFO_LINE.match(line):
            d = devs[-1]
            d.max_rq, d.pid, d.flags, d.state = (int(m[1]), int(m[2]), int(m[3], 16), m[4])
        elif m := _QUEUE_LINE.match(line):
            devs[-1].affinity.append(m[2])
        elif m := _TARGET_LINE.match(line):
            devs[-1].target = m[1]
        else:
            raise AssertionError(f"unexpected list line: {line!r}")
    return devs


def fork_cli(argv: list[str], stdout: int, stderr: int, cwd: Path | str | None = None,
             as_uid: int | None = None, close: tuple[int, ...] = ()) -> int:
    """``aioublk ARGV`` in a child forked from this process, its stdout and
    stderr on the given descriptors: the CLI's own code (parsing, daemonizing,
    serving, its lines and its exit status) without starting an interpreter,
    which costs 10-15 s per command in the emulated guest. `as_uid` drops to
    that uid (group the same, no others) first, as setpriv would; what was
    decided at import (stats.RUN_DIR) stays root's. The child closes the
    descriptors `close`. Returns the child's pid; the caller reaps it.
    ``python -m aioublk`` itself is run by the tests that are about the
    process."""
    gc.freeze()  # (a daemon's collector then leaves pytest's heap shared, not copied)
    try:
        pid = os.fork()
    except BaseException:
        gc.unfreeze()
        raise
    if pid != 0:
        gc.unfreeze()
        return pid
    code = 1  # the child: never returns into pytest, whatever happens
    try:
        for fd in close:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        for src, dst in ((null, 0), (stdout, 1), (stderr, 2)):
            os.dup2(src, dst)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        # what the interpreter would report, not pytest's capture of it
        sys.excepthook, sys.unraisablehook = sys.__excepthook__, sys.__unraisablehook__
        threading.excepthook = threading.__excepthook__
        logging.root.handlers.clear()
        if cwd is not None:  # (as root, as subprocess's cwd= would)
            os.chdir(cwd)
        if as_uid is not None:
            os.setgroups([])
            os.setgid(as_uid)
            os.setuid(as_uid)
        code = cli_mod.main(argv)
    except SystemExit as e:  # argparse's errors and --help, as the interpreter reports them
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a traceback, as the interpreter prints it
        traceback.print_exc()
    finally:
        try:
            for f in (sys.stdout, sys.stderr):
                f.flush()
        finally:
            os._exit(code)


def wait_exit(pid: int, timeout: float) -> int:
    """The exit status of child `pid`; killed and reaped past `timeout` or
    if the wait itself fails (never a child left running or a zombie)."""
    try:
        fd = os.pidfd_open(pid)
        try:
            if not _ready(fd, timeout):
                raise subprocess.TimeoutExpired(["aioublk"], timeout)
        finally:
            os.close(fd)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _ready(fd: int, timeout: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def cli(*args: str, timeout: float = 60, check: bool = True, cwd: Path | str | None = None,
        as_uid: int | None = None) -> subprocess.CompletedProcess[str]:
    """``aioublk ARGS`` as `fork_cli` runs it, with its output and status."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        code = wait_exit(fork_cli(list(args), out.fileno(), err.fileno(), cwd, as_uid), timeout)
        out.seek(0)
        err.seek(0)
        p = subprocess.CompletedProcess([*CLI, *args], code, out.read().decode(),
                                        err.read().decode())
    if check and p.returncode != 0:
        raise AssertionError(f"aioublk {' '.join(args)} failed ({p.returncode}): "
                             f"{p.stderr.strip()}")
    return p


def add(*args: str) -> DevListing:
    """``aioublk add ...``; returns the new device as ``list`` describes it."""
    p = cli("add", *args)
    devs = parse_list(p.stdout)
    assert len(devs) == 1, p.stdout
    d = devs[0]
    assert d.state == "LIVE", p.stdout
    assert Path(f"/dev/ublkb{d.dev_id}").exists()
    return d


# In-process versions of list/del: each CLI call starts Python in the
# emulated guest (seconds over 9p), so only the command under test is run
# as a process.

def listing() -> list[DevListing]:
    ctrl = Control(blocking=True)
    try:
        lines: list[str] = []
        for dev_id in device_ids():  # (every id: a test may add -n 1000)
            try:
                lines += run_now(dump(ctrl, dev_id))
            except UblkError:
                pass
    finally:
        ctrl.close()
    return parse_list("\n".join(lines))


def delete(dev_id: int) -> None:
    ctl.delete_device(dev_id)


def delete_all() -> None:
    for d in listing():
        delete(d.dev_id)


def wait_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"server pid {pid} still running after {timeout}s")


def fio(dev: str, cwd: Path, *args: str, timeout: float = 120) -> dict[str, object]:
    """Run fio against ``dev`` and return its JSON report's first job."""
    cmd = ["fio", "--name=t", f"--filename={dev}", "--ioengine=io_uring", "--direct=1",
           "--output-format=json", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise AssertionError(f"fio failed ({p.returncode}): {p.stderr.strip()}\n{p.stdout}")
    report = json.loads(p.stdout[p.stdout.index("{"):])
    job: dict[str, object] = report["jobs"][0]
    assert job["error"] == 0, job
    return job


def run(*cmd: str, timeout: float = 120) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


def write_synced(path: str, data: bytes, offset: int) -> None:
    """``data`` written at ``offset`` of the device at ``path``, and fsynced."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def make_file(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@contextmanager
def served(target: Target, **config: Any) -> Iterator[Device]:
    """A device served by this process (its control loop on a thread of its
    own) while the test drives it with fio, mkfs, mount: no CLI start-up.
    One queue unless ``queues`` says (a worker thread less in the emulated
    guest)."""
    config.setdefault("queues", 1)
    import uvloop

    box: list[Device] = []
    failed: list[BaseException] = []
    started = threading.Event()
    stop: list[Callable[[], object]] = []

    async def main() -> None:
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        stop.append(lambda: loop.call_soon_threadsafe(done.set))
        async with Device(target, DeviceConfig(**config)) as dev:
            box.append(dev)
            started.set()
            await done.wait()

    def thread() -> None:
        try:
            uvloop.run(main())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            failed.append(e)
        finally:
            started.set()

    t = threading.Thread(target=thread, daemon=True)
    t.start()
    started.wait(120)
    if failed:
        raise failed[0]
    try:
        yield box[0]
    finally:
        if stop:
            stop[0]()
        t.join(120)
        target.close()
    if failed:
        raise failed[0]


def start_server(args: list[str], log: Path, timeout: float = 120,
                 cmd: str = "add") -> DevListing:
    """``aioublk CMD ARGS --foreground`` (add or recover) as `fork_cli` runs
    it, once it serves. Its stderr goes to ``log``; the caller reaps it
    (os.waitpid)."""
    rfd, wfd = os.pipe()
    err = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pid = fork_cli([cmd, *args, "--foreground"], wfd, err, close=(rfd,))
    finally:
        os.close(err)
    os.close(wfd)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            lines = out.decode(errors="replace").splitlines(keepends=True)
            if lines and lines[-1].endswith("\n"):
                devs = parse_list("".join(lines))
                if devs and len(devs[0].affinity) == devs[0].queues:
                    assert devs[0].state == "LIVE" and devs[0].pid == pid, lines
                    return devs[0]
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"server not live after {timeout} s: {tail(log)}")
            if select.select([rfd], [], [], left)[0]:
                chunk = os.read(rfd, 4096)
                if not chunk:  # the server exited
                    os.waitpid(pid, 0)
                    raise AssertionError(f"aioublk {cmd} {' '.join(args)} failed: {tail(log)}")
                out += chunk
    finally:
        os.close(rfd)


def tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no server log)"
