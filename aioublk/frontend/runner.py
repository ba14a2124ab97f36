"""Serving until SIGTERM or SIGINT, as ``add``/``recover`` (one device,
``run_device``) and ``serve`` (a config file's devices) both do.

- Every command runs on one uvloop event loop (``run_loop``).
- The first SIGTERM/SIGINT stops gracefully: the devices finish their
  in-flight requests and are deleted or quiesced. A second one exits at
  once; the kernel then ends the devices as for a killed server.
- A device stopped, deleted or quiesced from outside is released (its
  server lets go of it) rather than ended again.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from aioublk import logs
from aioublk.device import Device
from aioublk.errors import Error
from aioublk.frontend import stats
from aioublk.kernel import uapi
from aioublk.queue.options import DeviceConfig
from aioublk.target import Target
from aioublk.targets.filters.cow import CowFilter

log = logs.get_logger("aioublk.runner")

#: errors that explain themselves in one line (every aioublk.Error, whichever
#: target raised it); anything else gets its type name
ONE_LINE_ERRORS = (Error, OSError)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def run_loop(coro: Coroutine[Any, Any, int]) -> int:
    """Run a command's coroutine on a new uvloop loop; its exit status."""
    import uvloop

    result: int = uvloop.run(coro)
    return result


def stop_or_exit(stop: asyncio.Event) -> None:
    """The first SIGTERM/SIGINT stops gracefully; a second one exits at once
    (the kernel then ends the devices as for a killed server)."""
    if stop.is_set():
        log.warning("second signal: exiting without a clean stop")
        os._exit(1)
    stop.set()


@contextmanager
def until_signal(devices: Callable[[], list[Device]]) -> Iterator[asyncio.Event]:
    """An event the first SIGTERM/SIGINT sets, on the running loop's signal
    handlers while the block runs (see ``stop_or_exit``); SIGUSR1 commits
    the cow overlays of ``devices()`` (``commit -n ID`` sends it)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    commits: set[asyncio.Future[None]] = set()

    def commit() -> None:
        task = asyncio.ensure_future(commit_overlays(devices()))
        commits.add(task)
        task.add_done_callback(commits.discard)
    for sig in SIGNALS:
        loop.add_signal_handler(sig, stop_or_exit, stop)
    loop.add_signal_handler(signal.SIGUSR1, commit)
    try:
        yield stop
    finally:
        for sig in (*SIGNALS, signal.SIGUSR1):
            loop.remove_signal_handler(sig)


async def commit_overlays(devices: list[Device]) -> None:
    """Each served device's outermost cow overlay to the device under it,
    its result (blocks written, or the error in one line) for ``commit``."""
    for dev in devices:
        if dev.info is None:
            continue
        try:
            overlay = cow_overlay(dev.target)
            if overlay is None:
                raise Error(f"device {dev.id} has no cow filter: nothing to commit")
            result: dict[str, object] = {"blocks": await overlay.commit_now(),
                                         "block": overlay.block}
        except ONE_LINE_ERRORS as e:
            result = {"error": str(e)}
        except RuntimeError as e:  # (its queue loop has ended: the device is stopping)
            result = {"error": f"device {dev.id} is stopping: {e}"}
        log.info("commit", dev=dev.id, **result)
        stats.write_commit(dev.id, result)


def cow_overlay(target: Target) -> CowFilter | None:
    """The outermost cow filter of a target's stack, if any."""
    layer: Target | None = target
    while layer is not None:
        if isinstance(layer, CowFilter):
            return layer
        layer = getattr(layer, "inner", None)
    return None


async def run_device(target: Target, cfg: DeviceConfig,
                     on_live: Callable[[Device], Awaitable[None]] | None = None,
                     recover: bool = False) -> int:
    """Serve one device until SIGTERM/SIGINT or until it is stopped, deleted
    or quiesced from outside. On a signal a device with user recovery is
    quiesced (it waits for ``recover``, as a killed kublk's does); any other
    is deleted."""
    dev = Device(target, cfg)
    with until_signal(lambda: [dev]) as stop:
        try:
            await dev.start(recover=recover)
            if on_live is not None:
                await on_live(dev)
            ended = asyncio.ensure_future(dev.wait())
            stopper = asyncio.ensure_future(stop.wait())
            publisher = asyncio.ensure_future(stats.publish(lambda: [dev]))
            await asyncio.wait({ended, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            publisher.cancel()
            if not stop.is_set():
                await dev.release()
            elif dev.info is not None and dev.info.flags & uapi.Feature.USER_RECOVERY:
                await dev.quiesce()  # (falls back to detaching: never raises once started)
            else:
                await dev.stop()
            return 0 if dev.write_back_error is None else 1  # (the worker logged it)
        finally:
            target.close()
