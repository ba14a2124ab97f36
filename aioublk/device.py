"""A Device: one ublk device and the queues that serve it, driven through
the control commands of ``kernel/control.py``.

Facts that shape this module:

- ``START_DEV`` waits until every queue has armed every tag, so it must never
  run on a queue's own loop: queues arm on their threads first, then the
  control loop starts the device.
- ``STOP_DEV`` deletes the disk (waiting for in-flight I/O, which the queues
  keep serving) and then aborts the armed commands (CQE -ENODEV): that is
  how a queue learns it is finished. ``DEL_DEV`` waits until /dev/ublkcN is
  closed.
- /dev/ublkcN appears (devtmpfs) shortly after ADD_DEV and opens exclusively;
  udev may hold it for a moment, so opening retries briefly.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import mmap
import os
from dataclasses import replace
from typing import Unpack

from aioublk import logs
from aioublk.batch import BatchDriver
from aioublk.errors import UblkError
from aioublk.kernel import uapi
from aioublk.kernel.control import Control, char_path, command_failed, settled_info, state_name
from aioublk.queue.driver import QueueMem, WorkerSpec
from aioublk.queue.options import CopyMode, DeviceConfig, DeviceOptions, layout, placement
from aioublk.queue.perio import PerIoDriver
from aioublk.queue.worker import Worker
from aioublk.ring import buffer_address
from aioublk.target import QueueSetupError, Target

log = logs.get_logger("aioublk.device")

STAT_FIELDS = ("queue", "ios", "bytes", "errors", "inflight")
#: the data plane's counters, summed as they are (``QueueStats``)
DP_FIELDS = ("c_served", "py_handed", "wakes", "poll_timeouts", "c_alloc")

#: seconds an unprivileged device's server waits for udev to hand it its node
_UDEV_WAIT = 30.0

def target_files(target: Target) -> list[str]:
    """The files a target serves, as its ``describe`` names them."""
    d = target.describe()
    files = d.get("files") or ([d["file"]] if d.get("file") else [])
    return [str(f) for f in files] if isinstance(files, list) else []


def target_fingerprint(target: Target) -> int:
    """64 bits naming the target's type and its files (device and inode, in
    order), which ADD_DEV stores in the device's ``ublksrv_flags`` (the
    kernel keeps that field for the server and never reads it), so that
    ``recover`` can tell another file from the one the device was added
    with. Bit 63 is always set: 0 is a device added without one."""
    ids: list[object] = [target.name]
    for path in target_files(target):
        try:
            st = os.stat(path)
            ids.append((st.st_dev, st.st_ino))
        except OSError:
            ids.append(path)
    digest = hashlib.blake2b(repr(ids).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1 << 63


async def _open_char(path: str, unprivileged: bool = False) -> int:
    """The device's char node, once udev has made it (and, for an
    unprivileged device, has handed it to us: that runs a program, slow on
    a loaded machine)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (_UDEV_WAIT if unprivileged else 3.0)
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except (FileNotFoundError, PermissionError, OSError) as e:
            if isinstance(e, OSError) and e.errno not in (errno.ENOENT, errno.EBUSY,
                                                          errno.EACCES):
                raise
            if loop.time() > deadline:
                hint = " (is the udev rule installed? see aioublk udev rules)" \
                    if unprivileged and e.errno == errno.EACCES else ""
                raise UblkError(f"cannot open {path}: {e.strerror}{hint}") from None
            await asyncio.sleep(0.05)


async def _queue_cpus(ctrl: Control, info: uapi.DevInfo) -> list[list[int]]:
    """Each queue's CPUs as the kernel maps them (for ``placement``); none
    where the driver will not say, and the workers go unpinned."""
    try:
        return [await ctrl.queue_affinity(info.dev_id, q) for q in range(info.nr_hw_queues)]
    except UblkError as e:
        log.debug("no queue affinity: workers not pinned", error=str(e))
        return []


async def _until_ours(path: str) -> None:
    """An unprivileged device is live once START_DEV returns, but its disk
    is root's until udev hands it over: wait for that, so that whoever was
    told the device is ready can open it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _UDEV_WAIT
    while not os.access(path, os.R_OK | os.W_OK):
        if loop.time() > deadline:
            log.warning("udev has not given the disk to us: is the rule installed? "
                        "(aioublk udev rules)", path=path)
            return
        await asyncio.sleep(0.05)


class Device:
    """A ublk block device served by this process.

    ``async with Device(target) as dev:`` creates and starts it on the
    caller's loop (queues run on their own threads); leaving the block
    stops and deletes it.
    """

    def __init__(self, target: Target, config: DeviceConfig | None = None,
                 **kw: Unpack[DeviceOptions]) -> None:
        self.target = target
        self.config = config or DeviceConfig(**kw)  # type: ignore[arg-type]  # (copy: a str too)
        if target.one_loop and not self.config.one_loop:
            if self.config.nthreads > 1:
                raise UblkError(f"target {target.name} serves all queues from one thread: "
                                "drop --nthreads")
            self.config = replace(self.config, one_loop=True)
        if target.geometry.zone_size and not self.config.zoned:
            # the kernel returns a zone append's sector only with -u or -z; the
            # default copy mode becomes -u, the others are refused in validate
            copy = CopyMode.USER_COPY if self.config.copy is CopyMode.COPY else self.config.copy
            self.config = replace(self.config, zoned=True, copy=copy)
        self.config.validate()
        if self.config.integrity is not None and not target.metadata:
            raise UblkError(f"target {target.name} keeps no integrity metadata: drop "
                            "--metadata_size and the other integrity options")
        if self.config.copy.fixed and not target.fixed_buffers:
            raise UblkError(f"target {target.name} cannot serve zero-copy modes (-z, "
                            "--auto_zc): it needs the data in memory; use the default copy "
                            "mode or -u")
        self.info: uapi.DevInfo | None = None
        self.batch = False
        self.mems: list[QueueMem] = []
        self.workers: list[Worker] = []
        self._ctrl: Control | None = None
        self._char_fd = -1
        self._stopped = False
        #: --shmem_zc: our mappings of the registered shared buffers, by index
        #: (every QueueMem holds the dict, to find an IO_F_SHMEM_ZC request's data)
        self._shared: dict[int, memoryview] = {}
        self._shared_maps: list[mmap.mmap] = []

    @property
    def id(self) -> int:
        """The kernel's device id (N of /dev/ublkbN); RuntimeError before ``start``."""
        if self.info is None:
            raise RuntimeError("device not added yet")
        return self.info.dev_id

    @property
    def path(self) -> str:
        """The block device: ``/dev/ublkbN``."""
        return f"/dev/ublkb{self.id}"

    @property
    def char_path(self) -> str:
        """The server's character device: ``/dev/ublkcN``."""
        return char_path(self.id)

    async def start(self, recover: bool = False) -> None:
        """Create the device and serve it. With ``recover``, attach instead
        to device ``config.dev_id``, left QUIESCED (or FAIL_IO) by a server
        that died or was quiesced: re-arm every tag, then END_USER_RECOVERY."""
        cfg = self.config
        ctrl = self._ctrl = Control()
        try:
            features = await ctrl.features()
            if not features & uapi.Feature.CMD_IOCTL_ENCODE:
                raise UblkError("this ublk_drv lacks UBLK_F_CMD_IOCTL_ENCODE: "
                                "aioublk needs kernel 6.4 or later")
            if cfg.unprivileged and ctrl.privileged:
                raise UblkError("--unprivileged is for users without CAP_SYS_ADMIN: as root "
                                "the kernel makes a privileged device anyway (leave it out)")
            if recover:
                if cfg.integrity is not None:
                    self.target.use_integrity(cfg.integrity, fresh=False)
                self.info = await self._begin_recovery(ctrl, features)
            else:
                self.batch, flags = cfg.resolve(features)
                if cfg.integrity is not None:  # (the target sizes itself: before ADD_DEV)
                    self.target.use_integrity(cfg.integrity, fresh=True)
                want = uapi.DevInfo(
                    nr_hw_queues=cfg.queues, queue_depth=cfg.depth,
                    max_io_buf_bytes=cfg.max_io_size,
                    dev_id=uapi.DEV_ID_ANY if cfg.dev_id < 0 else cfg.dev_id, flags=flags,
                    ublksrv_flags=target_fingerprint(self.target))
                self.info = await ctrl.add_dev(want)
        except BaseException:
            ctrl.close()
            self._ctrl = None
            raise
        info = self.info
        self.log = log.bind(dev=info.dev_id)
        try:
            self._char_fd = await _open_char(self.char_path, unprivileged=bool(
                info.flags & uapi.Feature.UNPRIVILEGED_DEV))
            if not recover:
                params = self.target.geometry.params(info.max_io_buf_bytes)
                await ctrl.set_params(info.dev_id, params)
            self.target.configure(info.flags)
            self._start_workers(info, await _queue_cpus(ctrl, info))
            loop = asyncio.get_running_loop()
            for w in self.workers:
                await loop.run_in_executor(None, w.ready.wait)
                if isinstance(w.error, QueueSetupError):
                    raise w.error  # already names the target, the worker and the cause
                if w.error is not None:
                    raise UblkError(f"queue worker {w.spec.index} failed to start: {w.error}")
            if recover:
                res = await ctrl.end_user_recovery(info.dev_id, os.getpid())
                if res < 0:
                    raise command_failed(f"END_USER_RECOVERY of device {info.dev_id}", res)
            else:
                await ctrl.start_dev(info.dev_id, os.getpid())
                if info.flags & uapi.Feature.UNPRIVILEGED_DEV:
                    await _until_ours(self.path)
            if self.config.htlb:
                await self._register_shared(ctrl, info.dev_id, self.config.htlb)
            self.info = await ctrl.get_info(info.dev_id)
        except BaseException:
            # a failed recovery leaves the device QUIESCED for another try
            await self._teardown(stop=not recover, delete=not recover)
            raise
        self.log.info("device recovered" if recover else "device started", path=self.path,
                      queues=info.nr_hw_queues, depth=info.queue_depth, batch=self.batch,
                      copy=self.config.copy.value, workers=len(self.workers),
                      **self.target.describe())

    async def _begin_recovery(self, ctrl: Control, features: int) -> uapi.DevInfo:
        """Check the device can be recovered with this config, then
        START_USER_RECOVERY. The device's own flags and sizes decide how it
        is served; the copy mode given must match the one it was added with."""
        cfg = self.config
        if cfg.dev_id < 0:
            raise UblkError("recover needs the id of the device to recover (-n ID)")
        dev_id = cfg.dev_id
        info = await settled_info(ctrl, dev_id)
        # the kernel records the creator's real uid. Root too refuses: it would
        # serve its files to a disk another user controls (a user's device has
        # no recovery today only because the kernel drops the flag)
        if info.owner_uid != os.getuid():
            raise UblkError(f"device {dev_id} belongs to uid {info.owner_uid}, not to this "
                            f"server's uid {os.getuid()}: only the user who added a device "
                            "may recover it")
        if not info.flags & uapi.Feature.USER_RECOVERY:
            raise UblkError(f"device {dev_id} was added without user recovery (-r 1), so it "
                            "cannot be recovered: delete it and add it again")
        if info.state not in (uapi.State.QUIESCED, uapi.State.FAIL_IO):
            raise UblkError(f"device {dev_id} is {state_name(info.state)} (server pid "
                            f"{info.ublksrv_pid}): only a QUIESCED or FAIL_IO device can be "
                            "recovered")
        self.batch = bool(info.flags & uapi.Feature.BATCH_IO)
        self.config = cfg = replace(cfg, batch=self.batch, queues=info.nr_hw_queues,
                                    depth=info.queue_depth)
        _batch, flags = cfg.resolve(features)
        modes = uapi.Feature.SUPPORT_ZERO_COPY | uapi.Feature.AUTO_BUF_REG | uapi.Feature.USER_COPY
        if flags & modes != info.flags & modes:
            was = uapi.flag_list(info.flags & modes) or "the default copy mode"
            raise UblkError(f"device {dev_id} was added with {was}: recover it with the "
                            "options it was added with")
        # the next server must serve the same data: same size, same files
        had = (await ctrl.get_params(dev_id)).dev_sectors << 9
        size = self.target.geometry.size
        if had != size:
            raise UblkError(f"device {dev_id} has {had} bytes, the target {size}: recover it "
                            "with the file it was added with")
        if info.ublksrv_flags >> 63 and info.ublksrv_flags != target_fingerprint(self.target):
            files = " ".join(target_files(self.target)) or "(no file)"
            raise UblkError(f"device {dev_id} was added with another target type or backing "
                            f"file than {self.target.name} {files}: recover it with the ones "
                            "it was added with")
        res = await ctrl.start_user_recovery(dev_id)
        if res == -errno.EBUSY:
            raise UblkError(f"device {dev_id} is still held by its previous server (pid "
                            f"{info.ublksrv_pid}): wait for it to exit, then recover")
        if res < 0:
            raise command_failed(f"START_USER_RECOVERY of device {dev_id}", res)
        return info

    async def _register_shared(self, ctrl: Control, dev_id: int, path: str) -> None:
        """--htlb: map the file the clients map too and register it, after
        START_DEV as kublk does (the kernel freezes the queue to add it).
        Requests match it from then on; until then they take the copy mode."""
        read_only = self.config.rdonly_shmem_buf
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise UblkError(f"--htlb {path}: {e.strerror}: give an existing file (on "
                            "hugetlbfs) that the clients map too") from None
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                raise UblkError(f"--htlb {path} is empty: size it first, e.g. fallocate -l "
                                f"4M {path}")
            prot = mmap.PROT_READ | (0 if read_only else mmap.PROT_WRITE)
            m = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, prot)
        except OSError as e:
            raise UblkError(f"--htlb {path}: mapping it failed: {e.strerror} (are there "
                            "enough huge pages? see /proc/sys/vm/nr_hugepages)") from None
        finally:
            os.close(fd)
        flags = uapi.SHMEM_BUF_READ_ONLY if read_only else 0
        res = await ctrl.reg_buf(dev_id, buffer_address(m), size, flags)
        if res < 0:
            m.close()
            raise UblkError(f"registering --htlb {path} ({size} bytes) with the kernel failed: "
                            f"{os.strerror(-res)} (errno {-res}); its size must be a multiple "
                            "of the page size, at most 4 GiB")
        self._shared_maps.append(m)
        self._shared[res] = memoryview(m)
        self.log.info("shared buffer registered", path=path, index=res, bytes=size,
                      read_only=read_only)

    def _unmap_shared(self) -> None:
        """Drop our mappings once the queues have ended. The registrations
        stay, as kublk leaves them: DEL_DEV frees them, and unregistering
        freezes the queue, which a quiesced device's held requests may
        never let happen."""
        self._shared.clear()
        for m in self._shared_maps:
            try:
                m.close()
            except BufferError:
                pass  # a straggling view; the mapping goes with the process
        self._shared_maps = []

    def _start_workers(self, info: uapi.DevInfo, queue_cpus: list[list[int]]) -> None:
        cfg = self.config
        # what the kernel granted (queues are capped at the CPU count)
        wcfg = replace(cfg, dev_id=info.dev_id, queues=info.nr_hw_queues,
                       depth=info.queue_depth, max_io_size=info.max_io_buf_bytes)
        spread = wcfg.spread(self.batch)
        nthreads = wcfg.threads() if self.batch or spread else info.nr_hw_queues
        self.mems = [QueueMem(self._char_fd, q, info.queue_depth, info.max_io_buf_bytes,
                              cfg.copy) for q in range(info.nr_hw_queues)]
        for m in self.mems:
            m.shared = self._shared
        plan = layout(info.nr_hw_queues, info.queue_depth, nthreads, batch=self.batch,
                      per_io_tasks=spread)
        cpus = placement(plan, queue_cpus, os.sched_getaffinity(0), info.dev_id,
                         pin=self.target.pin_workers)
        prepared: set[int] = set()
        for i, work in enumerate(plan):
            prep = {q for q, _tags in work} - prepared
            prepared |= prep
            spec = WorkerSpec(i, [(self.mems[q], tags) for q, tags in work], prep)
            self.workers.append(Worker(wcfg, spec, self._char_fd, self.target,
                                       BatchDriver if self.batch else PerIoDriver,
                                       cpu=cpus[i]))
        for w in self.workers:
            w.siblings = self.workers
            w.start()

    def stats(self) -> list[dict[str, int]]:
        """Per queue, summed over the workers serving it: requests answered
        (``ios``), bytes read or written, errors, requests in flight, and
        the data plane's ``DP_FIELDS`` (who served them; its wake-ups; clusters
        it allocated)."""
        rows: dict[int, dict[str, int]] = {}
        for w in self.workers:
            driver = w.driver
            if driver is None:
                continue
            for q, st in list(driver.stats.items()):
                row = rows.setdefault(q, dict.fromkeys(STAT_FIELDS + DP_FIELDS, 0)
                                      | {"queue": q})
                started, ios = st.started, st.ios
                row["ios"] += ios
                row["bytes"] += st.bytes
                row["errors"] += st.errors
                row["inflight"] += max(started - ios, 0)
                for name in DP_FIELDS:
                    row[name] += getattr(st, name)
        return [rows[q] for q in sorted(rows)]

    def latency(self) -> dict[int, list[tuple[list[int], int]]]:
        """Per queue, summed over its workers, per op: the latency buckets
        and sum (ns) the data planes keep while timing is on (all zero
        otherwise; see ``aioublk.frontend.metrics``)."""
        out: dict[int, list[tuple[list[int], int]]] = {}
        for w in self.workers:
            driver = w.driver
            if driver is None:
                continue
            for q, st in list(driver.stats.items()):
                mine = st.latency()
                have = out.setdefault(q, [([0] * len(b), 0) for b, _ in mine])
                out[q] = [([x + y for x, y in zip(hb, b, strict=True)], hs + s)
                          for (hb, hs), (b, s) in zip(have, mine, strict=True)]
        return dict(sorted(out.items()))

    @property
    def write_back_error(self) -> Exception | None:
        """Why the target's final write-back failed (data it acknowledged may
        be lost), once the queues have ended; None if it did not."""
        return next((w.drain_error for w in self.workers if w.drain_error is not None), None)

    async def wait(self) -> None:
        """Until every queue has ended (the device was stopped or deleted)."""
        loop = asyncio.get_running_loop()
        for w in self.workers:
            await loop.run_in_executor(None, w.join)

    async def stop(self, delete: bool = True) -> None:
        """Stop serving (in-flight requests finish first) and delete the device."""
        if self._stopped:
            return
        await self._teardown(stop=True, delete=delete)

    async def quiesce(self) -> None:
        """Hand the device over to a future server: the queues finish the
        requests they hold and end, and the device waits QUIESCED for
        ``start(recover=True)`` (it needs user recovery).

        Per-I/O devices use QUIESCE_DEV: the kernel cancels the idle
        commands and queues new requests for the next server. Batch devices
        detach instead (finish, then close): on them QUIESCE_DEV sets the
        queues' ``force_abort``, so the kernel fails every request that
        arrives until a server recovers the device (ublk_batch_cancel_queue,
        Linux 7.2). On detach, tags the kernel had queued but we had not
        fetched are reissued with ``-i 1``, failed otherwise."""
        if self._stopped or self._ctrl is None or self.info is None:
            return
        dev_id, flags = self.info.dev_id, self.info.flags
        if not flags & uapi.Feature.USER_RECOVERY:
            raise UblkError(f"device {dev_id} cannot be quiesced: it was added without user "
                            "recovery (-r 1)")
        self.target.stopping()
        if not self.batch and flags & uapi.Feature.QUIESCE:
            res = await self._ctrl.quiesce_dev(dev_id)
            if res < 0:  # e.g. EBUSY: a request held past the timeout; detach
                self.log.warning("QUIESCE_DEV failed: detaching instead", res=res)
        await self._teardown(stop=False, delete=False)

    async def release(self) -> None:
        """Free what serving held, sending no command: for a device stopped,
        deleted or quiesced from outside (``wait`` has returned)."""
        if not self._stopped:
            await self._teardown(stop=False, delete=False)

    async def _teardown(self, stop: bool, delete: bool) -> None:
        self._stopped = True
        ctrl = self._ctrl
        if ctrl is None or self.info is None:
            return
        dev_id = self.info.dev_id
        self.target.stopping()
        if stop:
            res = await ctrl.stop_dev(dev_id)
            if res < 0 and res != -errno.ENODEV:
                log.warning("STOP_DEV failed", dev=dev_id, res=res)
        for w in self.workers:
            # STOP_DEV ends the workers once their requests are done (a
            # worker whose tags were never armed has nothing to abort);
            # without it, each finishes what it holds and detaches
            if not stop or not w.ready.is_set():
                w.request_finish()
        await self.wait()
        self._unmap_shared()
        for m in self.mems:
            m.close()
        self.mems = []
        if self._char_fd >= 0:
            os.close(self._char_fd)
            self._char_fd = -1
        if delete:
            res = await ctrl.del_dev(dev_id)
            if res < 0 and res != -errno.ENODEV:
                log.warning("DEL_DEV failed", dev=dev_id, res=res)
        ctrl.close()
        self._ctrl = None
        self.log.info("device released", stopped=stop, deleted=delete)

    async def __aenter__(self) -> Device:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        err = self.write_back_error
        if err is not None and exc[0] is None:
            raise UblkError(f"device {self.id}: the target's final write-back failed ({err}): "
                            "data it acknowledged may be lost") from err
