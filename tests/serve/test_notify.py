"""``aioublk.frontend.notify`` against a socket the test binds, as systemd's would be
(a path and an abstract ``@`` address), and what ``serve`` tells it when no
device can start. The sequence with LIVE devices is in
test_kernel_serve.py: it needs the kernel."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aioublk.frontend import notify
from aioublk.frontend.config import load
from aioublk.frontend.serve import serve


class Manager:
    """The systemd end: a bound datagram socket and what it received."""

    def __init__(self, address: str) -> None:
        self.name = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.setblocking(False)

    def messages(self) -> list[list[str]]:
        out = []
        while True:
            try:
                out.append(self.sock.recv(4096).decode().split("\n"))
            except BlockingIOError:
                return out


@pytest.fixture(params=["path", "abstract"])
def manager(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Manager]:
    name = str(tmp_path / "notify") if request.param == "path" else \
        f"@aioublk-test-{os.getpid()}-{id(request)}"
    m = Manager(name)
    yield m
    m.sock.close()


def test_messages_reach_the_socket(manager: Manager) -> None:
    n = notify.Notifier({"NOTIFY_SOCKET": manager.name})
    assert n.enabled
    n.send("READY=1", "STATUS=serving: ublkb0")
    n.status("two\nlines")  # STATUS is one line
    n.close()
    assert manager.messages() == [["READY=1", "STATUS=serving: ublkb0"], ["STATUS=two lines"]]


class Recorder:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.warnings.append((event, kw))


def test_no_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = notify.Notifier()
    assert not n.enabled
    n.send("READY=1")
    assert n._sock is None  # not even a socket was made


def test_an_error_sending_is_logged_once_and_never_raised(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rec = Recorder()
    monkeypatch.setattr(notify, "log", rec)
    n = notify.Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    for _ in range(3):
        n.send("WATCHDOG=1")
    n.close()
    assert len(rec.warnings) == 1, rec.warnings
    assert "No such file" in rec.warnings[0][1]["error"]


def test_an_address_it_does_not_speak_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    monkeypatch.setattr(notify, "log", rec)
    assert not notify.Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    assert len(rec.warnings) == 1


@pytest.mark.parametrize(("env", "interval"), [
    ({}, None),
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "42"}, 0.1),
    ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "43"}, None),  # another process's
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "me"}, None),
])
def test_watchdog_interval(env: dict[str, str], interval: float | None) -> None:
    assert notify.watchdog_interval(env, pid=42) == interval


def test_watchdog_interval_defaults_to_this_process() -> None:
    env = {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    assert notify.watchdog_interval(env) == 0.5


def test_service_sequence_and_watchdog(manager: Manager) -> None:
    # a ping every 30 ms: few enough that the socket's queue (10) never fills
    env = {"NOTIFY_SOCKET": manager.name, "WATCHDOG_USEC": "60000"}

    async def go() -> None:
        with notify.Service(env) as sd:
            sd.starting(2)
            sd.serving(["ublkb0", "ublkb1"])
            await asyncio.sleep(0.12)
            sd.stopping()
            await asyncio.sleep(0.03)  # the pings go on through the drain
        await asyncio.sleep(0.05)  # and end with the service

    asyncio.run(go())
    got = manager.messages()
    assert got[:2] == [["STATUS=starting 2 devices"],
                       ["READY=1", "STATUS=serving: ublkb0 ublkb1"]]
    stopping = got.index(["STOPPING=1", "STATUS=stopping"])
    assert set(map(tuple, got[2:stopping])) == {("WATCHDOG=1",)}
    assert stopping - 2 >= 2, got  # repeated, not once
    assert set(map(tuple, got[stopping + 1:])) <= {("WATCHDOG=1",)}
    assert len(got) - stopping - 1 <= 2, got  # stopped with the service


def test_no_watchdog_pings_without_a_watchdog(manager: Manager) -> None:
    async def go() -> None:
        with notify.Service({"NOTIFY_SOCKET": manager.name}, pid=1) as sd:
            sd.starting(1)
            sd.serving(["ublkb3"])
            await asyncio.sleep(0.05)

    asyncio.run(go())
    assert manager.messages() == [["STATUS=starting 1 device"],
                                  ["READY=1", "STATUS=serving: ublkb3"]]


@pytest.mark.skipif(os.path.exists("/dev/ublk-control"), reason="needs a host without ublk")
def test_serve_is_never_ready_when_a_device_cannot_start(
        manager: Manager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Here no device can start (there is no ublk driver): systemd hears
    that serve is starting, and no READY=1."""
    monkeypatch.setenv("NOTIFY_SOCKET", manager.name)
    monkeypatch.setenv("WATCHDOG_USEC", "20000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    (tmp_path / "cfg.toml").write_text('[[devices]]\ntarget = "null"\n')
    assert asyncio.run(serve(load(str(tmp_path / "cfg.toml")))) == 1
    assert manager.messages() == [["STATUS=starting 1 device"]]
    assert capsys.readouterr().err.startswith("aioublk: ")


UNIT = Path(__file__).resolve().parents[2] / "examples" / "aioublk-serve@.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_example_unit_verifies(tmp_path: Path) -> None:
    """systemd-analyze reports unknown keys and bad values as warnings on
    stderr: the example has none."""
    unit = tmp_path / "aioublk-serve@mydisks.service"
    unit.write_text(UNIT.read_text())
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True, timeout=60)
    assert (p.returncode, p.stderr) == (0, ""), p.stderr
    assert "Type=notify\n" in UNIT.read_text()
