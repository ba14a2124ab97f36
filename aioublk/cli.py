"""Command line compatible with the kernel's reference server ``kublk``.

Same subcommands, flags, defaults and output lines, so scripts written for
kublk keep working::

    python -m aioublk add -t null|loop|stripe [-n ID] [-q N] [-d DEPTH]
                         [--foreground] [--chunk_size N] [FILE...]
    python -m aioublk del -n ID | -a
    python -m aioublk list [-n ID | -a]
    python -m aioublk features

``add`` daemonizes like kublk: the command returns once the device is LIVE
(printing the same lines as ``list``) or has failed (one line on stderr,
non-zero exit, no device left behind).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NoReturn

from aioublk import logs, uapi
from aioublk.device import Control, Device, DeviceConfig, UblkError
from aioublk.qcow2 import Qcow2Error
from aioublk.queue import CopyMode
from aioublk.target import Target
from aioublk.targets import BackingError, LoopTarget, NullTarget, StripeTarget

TARGETS = ("null", "loop", "stripe", "qcow2")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 1 like kublk."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"aioublk: {message}\n")
        raise SystemExit(1)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="aioublk", description="ublk block-device server (kublk-compatible)")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    add = sub.add_parser("add", help="create a device and serve it")
    add.add_argument("-t", "--type", dest="target", required=True,
                     help="target: " + "|".join(TARGETS))
    add.add_argument("-n", "--number", dest="dev_id", type=int, default=-1)
    add.add_argument("-q", "--queues", type=int, default=2)
    add.add_argument("-d", "--depth", type=int, default=128)
    add.add_argument("--foreground", action="store_true")
    add.add_argument("--quiet", action="store_true")
    add.add_argument("--debug_mask", default=None)
    add.add_argument("--no_auto_part_scan", action="store_true")
    add.add_argument("--chunk_size", type=int, default=65536)
    batch = add.add_mutually_exclusive_group()
    batch.add_argument("-b", "--batch", action="store_true", default=None,
                       help="require UBLK_F_BATCH_IO (default: use it when the kernel has it)")
    batch.add_argument("--no-batch", dest="batch", action="store_false",
                       help="use the per-I/O FETCH/COMMIT path")
    add.add_argument("-z", dest="zero_copy", action="store_true",
                     help="zero copy (UBLK_F_SUPPORT_ZERO_COPY)")
    add.add_argument("--auto_zc", action="store_true", help="UBLK_F_AUTO_BUF_REG")
    add.add_argument("--auto_zc_fallback", action="store_true",
                     help="with --auto_zc: register by hand when the kernel cannot")
    add.add_argument("-u", dest="user_copy", action="store_true",
                     help="user copy (UBLK_F_USER_COPY)")
    add.add_argument("--nthreads", type=int, default=0)
    add.add_argument("--per_io_tasks", action="store_true")
    add.add_argument("--buffered", action="store_true",
                     help="loop/stripe/qcow2: do not use O_DIRECT on the backing files")
    add.add_argument("--read-only", "--read_only", dest="read_only", action="store_true",
                     help="qcow2: serve the image read-only")
    add.add_argument("--l2-cache", dest="l2_cache", type=int, default=None,
                     help="qcow2: L2 cache bytes (default: map the whole disk, up to 32 MiB)")
    add.add_argument("-v", "--verbose", action="store_true")
    add.add_argument("--log-format", choices=("console", "json"), default="console")
    add.add_argument("files", nargs="*")

    d = sub.add_parser("del", help="delete devices")
    d.add_argument("-n", "--number", dest="dev_id", type=int, default=-1)
    d.add_argument("-a", "--all", action="store_true")

    ls = sub.add_parser("list", help="show devices")
    ls.add_argument("-n", "--number", dest="dev_id", type=int, default=-1)
    ls.add_argument("-a", "--all", action="store_true")

    sub.add_parser("features", help="show the driver's features")
    return p


# ------------------------------------------------------------------ output --

def _state_name(state: int) -> str:
    try:
        return uapi.State(state).name
    except ValueError:
        return "UNKNOWN"


async def dump(ctrl: Control, dev_id: int) -> list[str]:
    """kublk's three-part description of one device."""
    info = await ctrl.get_info(dev_id)
    params = await ctrl.get_params(dev_id)
    lines = [
        f"dev id {info.dev_id}: nr_hw_queues {info.nr_hw_queues} "
        f"queue_depth {info.queue_depth} block size {1 << params.logical_bs_shift} "
        f"dev_capacity {params.dev_sectors}",
        f"\tmax rq size {info.max_io_buf_bytes} daemon pid {info.ublksrv_pid} "
        f"flags 0x{info.flags:x} state {_state_name(info.state)}",
    ]
    for q in range(info.nr_hw_queues):
        cpus = await ctrl.queue_affinity(dev_id, q)
        # kublk keeps only the first CPU of each queue's set
        lines.append(f"\tqueue {q}: affinity({''.join(f'{c} ' for c in cpus[:1])})")
    return lines


async def _with_control(fn: Callable[[Control], Awaitable[int]]) -> int:
    ctrl = Control()
    try:
        return await fn(ctrl)
    finally:
        ctrl.close()


async def cmd_list(args: argparse.Namespace) -> int:
    async def run(ctrl: Control) -> int:
        if args.dev_id >= 0:
            print("\n".join(await dump(ctrl, args.dev_id)))
            return 0
        for dev_id in range(255):
            try:
                print("\n".join(await dump(ctrl, dev_id)))
            except UblkError:
                continue
        return 0
    return await _with_control(run)


async def cmd_features(args: argparse.Namespace) -> int:
    async def run(ctrl: Control) -> int:
        feats = await ctrl.features()
        print(f"ublk_drv features: 0x{feats:x}")
        for bit, name in uapi.feature_names(feats):
            print(f"0x{bit:<16x}: {name}")
        return 0
    return await _with_control(run)


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def delete(ctrl: Control, dev_id: int, timeout: float = 10.0) -> None:
    """Stop the device, wait for its server to exit, delete it."""
    info = await ctrl.get_info(dev_id)
    res = await ctrl.stop_dev(dev_id)
    if res < 0 and res != -errno.ENODEV:
        raise UblkError(f"cannot stop device {dev_id}: {os.strerror(-res)}")
    pid = info.ublksrv_pid
    if pid > 0 and pid != os.getpid():
        deadline = time.monotonic() + timeout
        while not _pid_gone(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    res = await ctrl.del_dev(dev_id)
    if res < 0 and res != -errno.ENODEV:
        raise UblkError(f"cannot delete device {dev_id}: {os.strerror(-res)}")


async def cmd_del(args: argparse.Namespace) -> int:
    async def run(ctrl: Control) -> int:
        if args.dev_id >= 0:
            await delete(ctrl, args.dev_id)
            return 0
        if not args.all:
            raise UblkError("del needs -n ID or -a")
        for dev_id in range(255):
            try:
                await delete(ctrl, dev_id)
            except UblkError as e:
                if "does not exist" not in str(e):
                    raise
        return 0
    return await _with_control(run)


# --------------------------------------------------------------------- add --

def make_target(args: argparse.Namespace) -> Target:
    """Build the target named by ``-t`` (raises UblkError/BackingError/Qcow2Error)."""
    name = args.target
    files = args.files
    if name == "null":
        if files:
            raise UblkError("the null target takes no backing file")
        return NullTarget()
    if name == "loop":
        if len(files) != 1:
            raise UblkError(f"the loop target needs exactly one backing file, got {len(files)}")
        return LoopTarget(files[0], direct=not args.buffered)
    if name == "stripe":
        return StripeTarget(files, chunk_size=args.chunk_size)
    if name == "qcow2":
        if len(files) != 1:
            raise UblkError(f"the qcow2 target needs exactly one image file, got {len(files)}")
        from aioublk.targets.qcow2 import Qcow2Target

        return Qcow2Target(files[0], read_only=args.read_only, cache_bytes=args.l2_cache,
                           direct=not args.buffered)
    raise UblkError(f"unknown target type '{name}': use one of {', '.join(TARGETS)}")


def device_config(args: argparse.Namespace) -> DeviceConfig:
    flags = 0
    if args.no_auto_part_scan:
        flags |= uapi.Feature.NO_AUTO_PART_SCAN
    # kublk spells the fallback mode "-z --auto_zc --auto_zc_fallback"
    modes = [m for on, m in ((args.zero_copy and not args.auto_zc_fallback, CopyMode.ZERO_COPY),
                             (args.auto_zc or args.auto_zc_fallback, CopyMode.AUTO_ZC),
                             (args.user_copy, CopyMode.USER_COPY)) if on]
    if len(modes) > 1:
        names = {CopyMode.ZERO_COPY: "-z", CopyMode.AUTO_ZC: "--auto_zc",
                 CopyMode.USER_COPY: "-u"}
        raise UblkError(f"{' and '.join(names[m] for m in modes)} are different data-copy "
                        "modes: pick one")
    cfg = DeviceConfig(dev_id=args.dev_id, queues=args.queues, depth=args.depth, flags=flags,
                       batch=args.batch, copy=modes[0] if modes else CopyMode.COPY,
                       auto_zc_fallback=args.auto_zc_fallback, nthreads=args.nthreads,
                       per_io_tasks=args.per_io_tasks)
    cfg.validate()
    return cfg


async def serve(target: Target, cfg: DeviceConfig,
                on_live: Callable[[Device], Awaitable[None]] | None = None) -> int:
    """Run one device until SIGTERM/SIGINT (then delete it) or until it is
    stopped from outside (``del``)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    dev = Device(target, cfg)
    try:
        await dev.start()
        if on_live is not None:
            await on_live(dev)
        ended = asyncio.ensure_future(dev.wait())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ended, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if stop.is_set():
            await dev.stop()
        else:
            await dev.stop(delete=False)
        return 0
    finally:
        target.close()


def _run(coro: Coroutine[Any, Any, int]) -> int:
    import uvloop

    result: int = uvloop.run(coro)
    return result


def cmd_add(args: argparse.Namespace) -> int:
    logs.configure(verbose=args.verbose, json=args.log_format == "json")
    cfg = device_config(args)
    target = make_target(args)

    if args.foreground:
        async def announce(dev: Device) -> None:
            print("\n".join(await dump(dev._ctrl, dev.id)), flush=True)  # type: ignore[arg-type]
        return _run(serve(target, cfg, announce))

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: detach, then the grandchild serves
        os.close(rfd)
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        _detach_stdio()
        code = 1
        try:
            async def report(dev: Device) -> None:
                os.write(wfd, f"OK {dev.id}\n".encode())
                os.close(wfd)
            code = _run(serve(target, cfg, report))
        except (UblkError, BackingError, Qcow2Error, OSError) as e:
            _report_error(wfd, str(e))
        except BaseException as e:  # noqa: BLE001 - the parent must hear about it
            _report_error(wfd, f"server failed: {e!r}")
        os._exit(code)

    os.close(wfd)
    target.close()
    os.waitpid(pid, 0)
    with os.fdopen(rfd, "rb") as r:
        line = r.readline().decode().strip()
    if line.startswith("OK "):
        dev_id = int(line.split()[1])
        lines = _run(_with_control_lines(dev_id))
        return lines
    raise UblkError(line.removeprefix("ERR ") if line else
                    "the server exited before the device became live")


async def _with_control_lines(dev_id: int) -> int:
    async def run(ctrl: Control) -> int:
        print("\n".join(await dump(ctrl, dev_id)), flush=True)
        return 0
    return await _with_control(run)


def _report_error(wfd: int, msg: str) -> None:
    try:
        os.write(wfd, f"ERR {msg}\n".encode())
    except OSError:
        pass


def _detach_stdio() -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


# -------------------------------------------------------------------- main --

def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "add":
            return cmd_add(args)
        logs.configure()
        handler = {"list": cmd_list, "del": cmd_del, "features": cmd_features}[args.cmd]
        return _run(handler(args))
    except (UblkError, BackingError, Qcow2Error) as e:
        sys.stderr.write(f"aioublk: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130
