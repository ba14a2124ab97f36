"""``aioublk serve config.toml`` against the real driver: several targets in
one process (one of them deleted from outside while the others serve),
config and start-up failures that leave nothing behind, and a device
quiesced by SIGTERM then reattached by the next serve.

Only the first test starts ``python -m aioublk serve``; the others fork
this process and call ``aioublk.frontend.serve.main`` (the same code, without the
6-20 s an interpreter start costs in the emulated guest)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from aioublk.frontend import stats
from aioublk.kernel.control import Control
from aioublk.targets.null import NullTarget
from tests.support import kernel
from tests.support.kernel import DevListing, fio, listing, make_file, parse_list, run
from tests.support.qcow2_util import check_clean

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20
WRITE_VERIFY = ("--rw=randwrite", "--bs=4k", "--size=8M", "--verify=crc32c", "--iodepth=16")


class Server:
    """A serve process started in ``cfg``'s directory as ``serve cfg.toml``:
    its stdout (kublk's lines per device) read here, its stderr in a file."""

    def __init__(self, cfg: Path, *, interpreter: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.log = cfg.with_suffix(".log")
        self.out = b""
        self.rc: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        if interpreter:
            with open(self.log, "wb") as err:
                self.proc = subprocess.Popen([*kernel.CLI, "serve", cfg.name], cwd=cfg.parent,
                                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                             stderr=err, env={**os.environ, **(env or {})})
            assert self.proc.stdout is not None
            self.pid, self.fd = self.proc.pid, self.proc.stdout.fileno()
            return
        assert env is None, "env is for the interpreter's serve"
        rfd, wfd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.chdir(cfg.parent)
                log = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                for src, dst in ((os.open(os.devnull, os.O_RDONLY), 0), (wfd, 1), (log, 2)):
                    os.dup2(src, dst)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                from aioublk.frontend.serve import main

                code = main(cfg.name)
            except BaseException:  # noqa: BLE001 - reported through the log
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(wfd)
        self.fd = rfd

    def devices(self, n: int, timeout: float = 120) -> list[DevListing]:
        """The first ``n`` devices' lines, once all are printed."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.out.decode(errors="replace")
            devs = parse_list(text[:text.rfind("\n") + 1])
            if len(devs) == n and len(devs[-1].affinity) == devs[-1].queues:
                return devs
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"serve printed {text!r} in {timeout} s: {self.stderr()}")
            if select.select([self.fd], [], [], left)[0]:
                chunk = os.read(self.fd, 4096)
                if not chunk:
                    raise AssertionError(f"serve exited ({self.wait()}): {self.stderr()}")
                self.out += chunk

    def stderr(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while self.rc is None:
            if self.proc is not None:
                self.rc = self.proc.poll()
            else:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.rc = os.waitstatus_to_exitcode(status)
            if self.rc is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"serve still running after {timeout} s: "
                                         f"{self.stderr()}")
                time.sleep(0.05)
        return self.rc

    def terminate(self) -> int:
        os.kill(self.pid, signal.SIGTERM)
        return self.wait()

    def close(self) -> None:
        """Kill it if it still runs, reap it, close its stdout."""
        if self.rc is None:
            os.kill(self.pid, signal.SIGKILL)
            self.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        else:
            os.close(self.fd)


def _stop_and_delete(dev_id: int) -> None:
    """What ``aioublk del`` does, from outside the server, without waiting
    for the server to exit (it keeps serving its other devices)."""
    async def go() -> None:
        ctrl = Control()
        try:
            assert await ctrl.stop_dev(dev_id) == 0
            assert await ctrl.del_dev(dev_id) == 0
        finally:
            ctrl.close()
    asyncio.run(go())


THREE = """
[[devices]]
target = "null"
options = { size = "64M" }

[[devices]]
target = "loop"
options = { file = "loop.img" }

[[devices]]
target = "qcow2"
options = { image = "vm.qcow2" }
"""


def test_serve_three_targets_until_sigterm(tmp_path: Path) -> None:
    make_file(tmp_path / "loop.img", 64 * MiB)
    run("qemu-img", "create", "-q", "-f", "qcow2", str(tmp_path / "vm.qcow2"), "64M")
    # JSON logs with per-queue stats every second
    (tmp_path / "cfg.toml").write_text(
        '[logging]\nformat = "json"\nstats_interval = 1\n' + THREE)
    srv = Server(tmp_path / "cfg.toml", interpreter=True)
    try:
        null, loop, qcow2 = srv.devices(3)
        assert all(d.state == "LIVE" and d.pid == srv.pid for d in (null, loop, qcow2))
        assert null.sectors == 64 * MiB >> 9
        assert sorted((d.dev_id, d.state) for d in listing()) == \
            sorted((d.dev_id, "LIVE") for d in (null, loop, qcow2))
        fio(f"/dev/ublkb{null.dev_id}", tmp_path, "--rw=randwrite", "--bs=4k", "--size=8M")
        for d in (loop, qcow2):
            job = fio(f"/dev/ublkb{d.dev_id}", tmp_path, *WRITE_VERIFY)
            assert job["write"]["io_bytes"] == 8 * MiB  # type: ignore[index]
        _assert_stats(srv, loop.dev_id, 8 * MiB)
        # deleted from outside: released, and the other two keep serving
        _stop_and_delete(null.dev_id)
        assert "device ended from outside" in srv.stderr()
        assert sorted(d.dev_id for d in listing()) == sorted([loop.dev_id, qcow2.dev_id])
        fio(f"/dev/ublkb{loop.dev_id}", tmp_path, "--rw=randread", "--bs=4k", "--size=8M")
        assert srv.terminate() == 0, srv.stderr()
    finally:
        srv.close()
    assert listing() == []
    check_clean(tmp_path / "vm.qcow2")


def _assert_stats(srv: Server, dev_id: int, written: int) -> None:
    """The published counters (``list --stats``) and the JSON stats log
    account for what fio wrote."""
    deadline = time.monotonic() + 30
    while True:
        rows = stats.read(dev_id, srv.pid) or []
        logged = [e for e in map(json.loads, srv.stderr().splitlines())
                  if e["event"] == "stats" and e["dev"] == dev_id]
        if sum(r["bytes"] for r in rows) >= written and \
                sum(e["ios"] for e in logged[-len(rows):]) >= written // 4096:
            break
        assert time.monotonic() < deadline, (rows, logged[-2:])
        time.sleep(0.5)
    assert all(r["errors"] == 0 and r["inflight"] == 0 for r in rows), rows


def test_bad_config_or_start_leaves_nothing(tmp_path: Path) -> None:
    make_file(tmp_path / "loop.img", 64 * MiB)
    run("qemu-img", "create", "-q", "-f", "qcow2", str(tmp_path / "vm.qcow2"), "64M")
    (tmp_path / "dir.img").mkdir()
    cases = {
        THREE.replace('target = "loop"', 'target = "loop"\nqeues = 2'):
            'aioublk: cfg.toml: devices[1].qeues: unknown key (did you mean "queues"?)',
        THREE.replace('"vm.qcow2"', '"missing.qcow2"'):
            f"aioublk: cfg.toml: devices[2].options.image: {tmp_path}/missing.qcow2 does not "
            "exist",
        THREE.replace('target = "loop"', 'target = "loop"\ndepth = 5000'):
            "aioublk: cfg.toml: devices[1].depth: 5000 is out of range: use 1..4096",
        # valid, but the second device cannot start: the first is deleted again
        THREE.replace('"loop.img"', '"dir.img"'):
            f"aioublk: cfg.toml: devices[1]: backing file {tmp_path}/dir.img is neither",
    }
    for text, line in cases.items():
        (tmp_path / "cfg.toml").write_text(text)
        srv = Server(tmp_path / "cfg.toml")
        try:
            assert srv.wait() == 1
        finally:
            srv.close()
        err = srv.stderr()
        assert err.count("\n") == 1 and err.startswith(line), err
        assert listing() == []


RECOVERABLE = """
[[devices]]
target = "loop"
id = 9
recovery = "requeue"
on_stop = "quiesce"
options = { file = "disk.img" }
"""


def test_quiesce_on_sigterm_then_reattach(tmp_path: Path) -> None:
    make_file(tmp_path / "disk.img", 64 * MiB)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(RECOVERABLE)
    first = Server(cfg)
    try:
        (dev,) = first.devices(1)
        assert (dev.dev_id, dev.state, dev.pid) == (9, "LIVE", first.pid)
        fio("/dev/ublkb9", tmp_path, *WRITE_VERIFY)
        assert first.terminate() == 0, first.stderr()
    finally:
        first.close()
    assert [(d.dev_id, d.state) for d in listing()] == [(9, "QUIESCED")]

    cfg.write_text(RECOVERABLE.replace('"quiesce"', '"delete"'))
    second = Server(cfg)
    try:
        (dev,) = second.devices(1)
        assert (dev.dev_id, dev.state, dev.pid) == (9, "LIVE", second.pid)
        fio("/dev/ublkb9", tmp_path, *WRITE_VERIFY, "--verify_only=1")  # the data is kept
        fio("/dev/ublkb9", tmp_path, *WRITE_VERIFY)
        assert second.terminate() == 0, second.stderr()
    finally:
        second.close()
    assert listing() == []


class DrainFails(NullTarget):
    """A target whose final write-back fails, as a cached target's does when
    its storage has gone bad: the data it held is lost."""

    async def drain(self) -> None:
        raise OSError(errno.EIO, "the storage went away")


def test_failed_final_write_back_reaches_the_exit_status(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[[devices]]\ntarget = "{__name__}:DrainFails"\nid = 4\n')
    srv = Server(cfg)
    try:
        srv.devices(1)
        assert srv.terminate() == 1, srv.stderr()
    finally:
        srv.close()
    err = srv.stderr()
    assert "final write-back failed" in err and "the storage went away" in err, err
    assert "dev=4" in err, err
    assert listing() == []


class Systemd:
    """systemd's end of $NOTIFY_SOCKET: a thread keeps the socket drained
    (its queue holds 10 datagrams, and the pings never stop) and records
    each message's fields with the pid the kernel says sent it."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[int, list[str]]] = []
        self.closed = False
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        while not self.closed:
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                continue
            pid = next((struct.unpack("3i", d)[0] for level, kind, d in anc
                        if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)), 0)
            self.messages.append((pid, data.decode().split("\n")))

    def fields(self) -> list[str]:
        return [f for _, fields in list(self.messages) for f in fields]

    def wait_for(self, field: str, count: int = 1, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.fields().count(field) < count:
            assert time.monotonic() < deadline, f"no {field} x{count}: {self.messages}"
            time.sleep(0.01)

    def close(self) -> None:
        self.closed = True
        self.thread.join()
        self.sock.close()


TWO_NULL = """
[[devices]]
target = "null"
id = 5

[[devices]]
target = "null"
id = 6
"""


def test_serve_tells_systemd_ready_watchdog_stopping(tmp_path: Path) -> None:
    """As under a Type=notify unit with WatchdogSec=0.2: READY=1 only once
    every device is LIVE, WATCHDOG=1 every 0.1 s, STOPPING=1 on SIGTERM;
    every message from serve's own pid (NotifyAccess=main)."""
    (tmp_path / "cfg.toml").write_text(TWO_NULL)
    systemd = Systemd(tmp_path / "notify")
    srv = Server(tmp_path / "cfg.toml", interpreter=True,
                 env={"NOTIFY_SOCKET": systemd.path, "WATCHDOG_USEC": "200000"})
    try:
        systemd.wait_for("READY=1")
        # checked at once: READY=1 is sent after the last device is LIVE
        assert all(os.path.exists(f"/dev/ublkb{n}") for n in (5, 6))
        assert sorted((d.dev_id, d.state) for d in listing()) == [(5, "LIVE"), (6, "LIVE")]
        assert [d.state for d in srv.devices(2)] == ["LIVE", "LIVE"]
        systemd.wait_for("WATCHDOG=1", count=5, timeout=30)
        os.kill(srv.pid, signal.SIGTERM)
        systemd.wait_for("STOPPING=1", timeout=60)
        assert srv.wait() == 0, srv.stderr()
    finally:
        srv.close()
        systemd.close()
    assert listing() == []
    fields = systemd.fields()
    assert [f for f in fields if f.startswith("STATUS=")] == \
        ["STATUS=starting 2 devices", "STATUS=serving: ublkb5 ublkb6", "STATUS=stopping"]
    assert fields.count("READY=1") == 1 and fields.count("STOPPING=1") == 1
    ready, stopping = fields.index("READY=1"), fields.index("STOPPING=1")
    assert not [f for f in fields[:ready] if f == "WATCHDOG=1"]  # the pings begin once ready
    assert fields[ready:stopping].count("WATCHDOG=1") >= 5
    assert {pid for pid, _ in systemd.messages} == {srv.pid}
    assert "cannot notify systemd" not in srv.stderr()
