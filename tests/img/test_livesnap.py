"""The live snapshot's detach on the host: a real server process is asked
to go and waited for; only the ublk control device is played (no kernel)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from aioublk.frontend import livesnap
from aioublk.kernel import uapi

pytestmark = pytest.mark.asyncio

#: a server that says when SIGTERM came, then waits for a line to exit
SERVER = """
import signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
print("ready", flush=True)
signal.sigwait({signal.SIGTERM})
print("term", flush=True)
sys.stdin.readline()
"""

#: a process that took a gone server's pid: it notes a SIGTERM and lives on
OTHER = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: print("term", flush=True))
print("ready", flush=True)
sys.stdin.readline()
"""


class Control:
    """The device's info as the kernel gives it: LIVE (with recovery and
    reissue) and served by ``pid`` for the first ``live`` reads (None:
    until ``quiesced``), then QUIESCED."""

    def __init__(self, pid: int, live: int | None = None) -> None:
        self.pid, self.live, self.quiesced, self.reads = pid, live, False, 0

    async def get_info(self, dev_id: int) -> uapi.DevInfo:
        self.reads += 1
        gone = self.quiesced if self.live is None else self.reads > self.live
        return uapi.DevInfo(state=uapi.State.QUIESCED if gone else uapi.State.LIVE,
                            dev_id=dev_id, ublksrv_pid=self.pid,
                            flags=uapi.Feature.USER_RECOVERY | uapi.Feature.USER_RECOVERY_REISSUE)


async def spawn(script: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script,
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"ready\n"
    return proc


async def test_the_loop_runs_while_detach_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another task sees the SIGTERM, lets the server go and then the kernel
    quiesce the device, all while ``detach`` waits: it waits without
    blocking the loop, for the exit and then for the state."""
    monkeypatch.setattr(livesnap, "STEP_TIMEOUT", 5.0)
    server = await spawn(SERVER)
    ctrl = Control(server.pid)

    async def kernel_and_server() -> None:
        assert server.stdout is not None and server.stdin is not None
        assert await server.stdout.readline() == b"term\n"
        server.stdin.write(b"go\n")
        assert await server.wait() == 0
        ctrl.quiesced = True

    other = asyncio.create_task(kernel_and_server())
    try:
        await asyncio.wait_for(livesnap.detach(ctrl, 7), 10)  # type: ignore[arg-type]
        assert other.done() and other.exception() is None
    finally:
        other.cancel()
        if server.returncode is None:
            server.kill()
            await server.wait()


async def test_a_pid_the_server_left_is_neither_signalled_nor_waited_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The info read first names a server that has gone since (the kernel
    quiesced the device) and whose pid another process took: that process
    gets no SIGTERM, and detach does not wait its whole timeout for it."""
    monkeypatch.setattr(livesnap, "STEP_TIMEOUT", 3.0)
    other = await spawn(OTHER)
    loop = asyncio.get_running_loop()
    try:
        start = loop.time()
        await asyncio.wait_for(livesnap.detach(Control(other.pid, live=1), 7),  # type: ignore[arg-type]
                               10)
        took = loop.time() - start
    finally:
        assert other.stdin is not None and other.stdout is not None
        other.stdin.write(b"go\n")
        said = await asyncio.wait_for(other.stdout.read(), 30)
        await other.wait()
    assert b"term" not in said, "a process that is not the server got SIGTERM"
    assert took < livesnap.STEP_TIMEOUT, f"waited {took:.1f} s for a process that is not " \
        "the server"
