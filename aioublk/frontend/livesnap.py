"""``aioublk snapshot -n ID create|list|delete [NAME]``: internal snapshots
of the qcow2 image a live device serves.

The device must have user recovery with reissue (``-r 1 -i 1``: the
requests the server holds when it goes are handed to the next one, not
failed). Its server is asked to detach (SIGTERM: it finishes the requests
it holds, writes everything back and closes the image), the kernel holds
new requests while the device is QUIESCED, the snapshot is taken on the
image as ``img snapshot`` takes it, and ``recover`` serves the device
again with the options it was added with. Applications see a pause, never
an error; nothing acknowledged is lost, since the image is closed
(flushed) before it is touched.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from aioublk.errors import UblkError
from aioublk.frontend import stats
from aioublk.kernel import uapi
from aioublk.kernel.control import Control

#: how long a step may take (a server writes back its caches; under
#: emulation a recover takes a minute)
STEP_TIMEOUT = 300.0
#: how often the device's state is read while waiting for QUIESCED
QUIESCE_POLL = 0.05


def image_of(dev_id: int) -> str:
    """The qcow2 image device ``dev_id`` serves, from ``add``'s record."""
    record = stats.read_record(dev_id)
    if record is None:
        raise UblkError(f"device {dev_id} has no record of how it was added (not by an "
                        "aioublk add): take the snapshot offline with aioublk img snapshot")
    if record.get("target") != "qcow2" or not record.get("files"):
        raise UblkError(f"device {dev_id} serves no qcow2 image (target "
                        f"{record.get('target')}): only qcow2 has internal snapshots")
    return str(record["files"][0])


async def _exited(pidfd: int, timeout: float) -> bool:
    """Wait for the process behind ``pidfd`` to end (it becomes readable),
    the loop running meanwhile; whether it did."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ended.done():
            ended.set_result(None)
    loop.add_reader(pidfd, readable)
    try:
        await asyncio.wait_for(ended, timeout)
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)
    return True


async def _quiesced(ctrl: Control, dev_id: int, timeout: float) -> bool:
    """Wait for the device to be QUIESCED (the kernel's monitor moves it
    there once the server's descriptors are closed; it tells nobody, so
    its state is read again every ``QUIESCE_POLL`` seconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (await ctrl.get_info(dev_id)).state != uapi.State.QUIESCED:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(QUIESCE_POLL)
    return True


async def _stop_server(ctrl: Control, dev_id: int, pid: int) -> None:
    """SIGTERM the server ``pid`` and wait for it to end. Its pidfd is opened
    first and the signal goes through it, so the process signalled is the
    one waited for; and it is the server only if the device, read again
    once the pidfd is held, is still LIVE with it (a server gone before
    leaves its pid to any new process)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    try:
        again = await ctrl.get_info(dev_id)
        if again.state != uapi.State.LIVE or again.ublksrv_pid != pid:
            return  # gone before the pidfd was opened: whatever has its pid now is not it
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        except ProcessLookupError:
            return  # it ended meanwhile
        if not await _exited(pidfd, STEP_TIMEOUT):
            raise UblkError(f"the server of device {dev_id} (pid {pid}) did not exit within "
                            f"{STEP_TIMEOUT:.0f} s of SIGTERM")
    finally:
        os.close(pidfd)


async def detach(ctrl: Control, dev_id: int) -> None:
    """Ask the device's server to finish and detach; return once it is gone,
    its image closed and the device QUIESCED."""
    info = await ctrl.get_info(dev_id)
    need = uapi.Feature.USER_RECOVERY | uapi.Feature.USER_RECOVERY_REISSUE
    if info.flags & need != need or info.flags & uapi.Feature.USER_RECOVERY_FAIL_IO:
        raise UblkError(f"device {dev_id} was added without user recovery with reissue: a "
                        "live snapshot holds its requests (and hands those in flight to the "
                        "next server) while the server steps aside; add it with -r 1 -i 1")
    if info.state != uapi.State.LIVE or info.ublksrv_pid <= 0:
        raise UblkError(f"device {dev_id} is not served now (state "
                        f"{uapi.State(info.state).name}): recover it first")
    await _stop_server(ctrl, dev_id, info.ublksrv_pid)
    if not await _quiesced(ctrl, dev_id, STEP_TIMEOUT):
        raise UblkError(f"device {dev_id} did not become QUIESCED after its server exited: "
                        f"serve it again with aioublk recover -n {dev_id}")


def recover(dev_id: int) -> None:
    """Serve the device again as it was added (``recover -n ID`` daemonizes
    and returns once the device is live)."""
    p = subprocess.run([sys.executable, "-m", "aioublk", "recover", "-n", str(dev_id)],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=STEP_TIMEOUT)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise UblkError(f"device {dev_id} is QUIESCED and its recovery failed: {last}; "
                        f"retry with aioublk recover -n {dev_id}")
