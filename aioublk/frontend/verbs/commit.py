"""``commit``: a served device's cow overlay written to the device under it,
by its server (asked by SIGUSR1, answering in the run directory)."""

from __future__ import annotations

import argparse
import os
import signal
import time

from aioublk.errors import UblkError
from aioublk.frontend import ctl, stats
from aioublk.frontend.verb import Verb, add_dev_id
from aioublk.kernel import uapi
from aioublk.kernel.control import Control, run_now, state_name

#: seconds ``commit`` waits for the server by default (it writes every
#: block the overlay holds that the device under it lacks)
COMMIT_TIMEOUT = 600.0


def _arguments(c: argparse.ArgumentParser) -> None:
    add_dev_id(c, "device whose overlay to commit")
    c.add_argument("--timeout", type=float, default=COMMIT_TIMEOUT, metavar="SECONDS",
                   help=f"how long to wait for the server (default {COMMIT_TIMEOUT:g})")


def _commit(ctrl: Control, args: argparse.Namespace) -> int:
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


VERB = Verb("commit", "write a served device's cow overlay to the device under it, and flush "
            "it (the server goes on serving)", _arguments, ctl.blocking(_commit), light=True,
            place=11)
