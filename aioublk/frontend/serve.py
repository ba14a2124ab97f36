"""``serve config.toml``: the devices of a config file, served in the
foreground by one process until SIGTERM or SIGINT.

- The whole file is checked first (``aioublk.frontend.config``); a bad file costs one
  line and creates nothing.
- Start-up is all or nothing: if a device cannot start, the ones started
  before it are undone (deleted, or handed back QUIESCED if they were
  reattached), one line goes to stderr and the exit status is 1.
- A device with a fixed id and recovery that exists QUIESCED or FAIL_IO is
  reattached (its previous server was quiesced or died) instead of added.
- On SIGTERM/SIGINT each device is deleted (in-flight requests finish, the
  target flushes) or, with ``on_stop = "quiesce"``, left QUIESCED for the
  next server. A device deleted or quiesced from outside is released and
  the others keep serving; when none is left, serve exits 0.
- Under systemd (``$NOTIFY_SOCKET``, ``aioublk.frontend.notify``): STATUS= lines as
  it goes, READY=1 only once every device is LIVE (never after a failed
  start), STOPPING=1 when the stop begins, watchdog pings until it ends.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass

from aioublk import logs
from aioublk.device import Device
from aioublk.errors import UblkError
from aioublk.frontend import metrics, notify, stats
from aioublk.frontend.config import ConfigError, DeviceSpec, ServeConfig, load
from aioublk.frontend.kublk_lines import print_device
from aioublk.frontend.runner import ONE_LINE_ERRORS, run_loop, until_signal
from aioublk.kernel import uapi
from aioublk.kernel.control import Control, settled_info, state_name
from aioublk.target import Target

log = logs.get_logger("aioublk.serve")

_RECOVERABLE = (uapi.State.QUIESCED, uapi.State.FAIL_IO)


@dataclass
class _Served:
    spec: DeviceSpec
    dev: Device
    target: Target
    reattached: bool


def main(path: str, *, verbose: bool = False) -> int:
    """The CLI's ``serve``: exit status 0 after a clean stop, 1 on a bad config
    or a device that could not start (one line on stderr either way), or when
    a target's final write-back failed (logged)."""
    try:
        cfg = load(path)
    except ConfigError as e:
        _report(str(e))
        return 1
    level = "debug" if verbose else cfg.logging.level
    if cfg.logging.stats_interval and level == "warning":
        level = "info"  # the stats lines are info: asking for them shows them
    try:
        to = logs.open_log_file(cfg.logging.file) if cfg.logging.file else None
    except logs.LogFileError as e:
        _report(f"{cfg.path}: logging.file: {e}")
        return 1
    logs.configure(json=cfg.logging.format == "json", level=level, to=to)
    if cfg.logging.file:
        _report(f"logs: {cfg.logging.file}")
    try:
        return run_loop(serve(cfg))
    except KeyboardInterrupt:  # before the signal handlers were installed
        return 130


async def serve(cfg: ServeConfig) -> int:
    """Serve every device of ``cfg`` on the running loop until SIGTERM/SIGINT
    or until all have ended; returns the exit status."""
    held: list[_Served] = []
    with until_signal(lambda: [s.dev for s in held]) as stop, notify.Service() as systemd:
        systemd.starting(len(cfg.devices))
        try:
            ctrl = Control()
        except UblkError as e:
            _report(str(e))
            return 1
        try:
            # before the devices: it turns on the timing their queues read at start
            stop_metrics = _start_metrics(cfg, lambda: [s.dev for s in held])
        except metrics.MetricsError as e:
            ctrl.close()
            _report(f"{cfg.path}: metrics.listen: {e}")
            return 1
        try:
            try:
                served = await _start_all(cfg, ctrl)
            finally:
                ctrl.close()
            if served is None:
                return 1
            held.extend(served)
            return await _run(served, stop, systemd, cfg.logging.stats_interval)
        finally:
            stop_metrics()


def _start_metrics(cfg: ServeConfig, devices: Callable[[], list[Device]]) -> Callable[[], None]:
    """The ``[metrics]`` endpoint, if configured; returns what stops it."""
    if cfg.metrics.listen is None:
        return lambda: None
    host, port = cfg.metrics.listen
    return metrics.start(host, port, devices)


async def _start_all(cfg: ServeConfig, ctrl: Control) -> list[_Served] | None:
    """Start the devices in order, printing kublk's ``list`` lines for each;
    on a failure undo the started ones and return None."""
    served: list[_Served] = []
    for spec in cfg.devices:
        try:
            s = await _start(ctrl, spec)
            served.append(s)
            await print_device(ctrl, s.dev.id)
        except Exception as e:  # noqa: BLE001 - one line, then undo
            log.debug("device failed to start", where=spec.where, exc_info=True)
            msg = str(e) if isinstance(e, ONE_LINE_ERRORS) else f"{type(e).__name__}: {e}"
            _report(f"{cfg.path}: {spec.where}: {' '.join(msg.split())}")
            # undo: what we created goes, what we reattached goes back to waiting
            await asyncio.gather(*(_finish(s, quiesce=s.reattached) for s in served))
            return None
    return served


async def _start(ctrl: Control, spec: DeviceSpec) -> _Served:
    reattach = await _reattach(ctrl, spec)
    # off the loop: a target may connect to a server (nbd, rbd) for seconds,
    # and the loop must go on answering signals and metrics meanwhile
    build = asyncio.ensure_future(asyncio.to_thread(spec.build_target))
    try:
        target = await asyncio.shield(build)
    except asyncio.CancelledError:
        build.add_done_callback(_close_late)  # (the thread cannot be stopped)
        raise
    try:
        dev = Device(target, spec.config)
        await dev.start(recover=reattach)
    except BaseException:
        target.close()
        raise
    return _Served(spec, dev, target, reattach)


def _close_late(build: asyncio.Future[Target]) -> None:
    """Close a target whose build finished after its start was cancelled."""
    if not build.cancelled() and build.exception() is None:
        build.result().close()


async def _reattach(ctrl: Control, spec: DeviceSpec) -> bool:
    """Whether the device already exists waiting for a server (then it is
    recovered); UblkError if its id is taken otherwise."""
    dev_id = spec.config.dev_id
    if dev_id < 0:
        return False
    try:
        info = await settled_info(ctrl, dev_id)
    except UblkError:
        return False  # no such device (any other trouble, ADD_DEV will report)
    if info.state in _RECOVERABLE and spec.recovery != "none":
        return True
    hint = "delete it or pick another id"
    if info.state in _RECOVERABLE:
        hint += ", or set recovery to reattach it"
    raise UblkError(f"device {dev_id} already exists ({state_name(info.state)}, served "
                    f"by pid {info.ublksrv_pid}): {hint}")


async def _run(served: list[_Served], stop: asyncio.Event, systemd: notify.Service,
               stats_interval: float = 0) -> int:
    """Until ``stop`` (then end every device as its on_stop says) or until
    every device has ended from outside; systemd hears READY=1 now (every
    device is LIVE) and STOPPING=1 before the drain."""
    systemd.serving([f"ublkb{s.dev.id}" for s in served])
    waits = {asyncio.ensure_future(s.dev.wait()): s for s in served}
    stopper = asyncio.ensure_future(stop.wait())
    live = dict(waits)
    publisher = asyncio.ensure_future(stats.publish(
        lambda: [s.dev for s in live.values()], log_every=stats_interval))
    try:
        while live and not stop.is_set():
            done, _ = await asyncio.wait({stopper, *live}, return_when=asyncio.FIRST_COMPLETED)
            for t in [t for t in live if t in done]:
                s = live.pop(t)
                log.warning("device ended from outside; the others keep serving",
                            dev=s.dev.id)
                await s.dev.release()
                s.target.close()
    finally:
        stopper.cancel()
        publisher.cancel()
    systemd.stopping()
    ok = await asyncio.gather(*(_finish(s, quiesce=s.spec.on_stop == "quiesce")
                                for s in live.values()))
    await asyncio.gather(*waits)
    lost = [s for s in served if s.dev.write_back_error is not None]  # (workers logged it)
    return 0 if all(ok) and not lost else 1


async def _finish(s: _Served, *, quiesce: bool) -> bool:
    """End one device and close its target; False if it could not be
    quiesced (it is deleted instead, so that nothing is left half-served)."""
    ok = True
    if quiesce:
        try:
            await s.dev.quiesce()
        except UblkError as e:
            log.error("cannot quiesce the device: deleting it instead", dev=s.dev.id,
                      error=str(e))
            ok = False
    await s.dev.stop()  # nothing left to do once quiesced
    s.target.close()
    return ok


def _report(line: str) -> None:
    sys.stderr.write(f"aioublk: {line}\n")
    sys.stderr.flush()
