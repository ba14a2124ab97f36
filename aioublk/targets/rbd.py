"""The rbd target: the device's bytes are a Ceph RADOS block device image
(``pool/image``, or ``pool/image@snap`` read-only), reached through librbd.

Why librbd: it is Ceph's own client (object striping, exclusive lock,
snapshots, caches), and its asynchronous API needs no thread of ours: each
request is submitted with a completion that carries its id, librbd signals
an eventfd when completions finish, and the queue's loop reads it and reaps
them in bulk (``rbd_poll_io_events``).

One image handle per device, shared by all its queues, so the device serves
them from one loop (``one_loop``): two handles on one image in one process
would pass its exclusive lock back and forth on every write.

A read that librbd answers short (the image was shrunk by another client
since the device was made, and the read crosses its new end) has the rest
of its buffer zeroed, as the loop target reads past a file's end: the
buffer would otherwise still hold an earlier request's bytes.

FUA is a write then a flush. Connecting, the pool, the image and the
snapshot are checked when the target is made, each failure one line; that
probe's connection is shut at once, and the image is opened again by the
first queue, in the process that serves it: librados's threads do not
survive the fork of ``add``'s daemon.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import itertools
import os
from collections.abc import Callable
from typing import Any

from aioublk import logs
from aioublk.errors import Error
from aioublk.target import Done, Geometry, QueueContext, Target
from aioublk.targets.spec import PATH, STR, Option, TargetSpec

log = logs.get_logger("aioublk.rbd")

DEFAULT_CONF = "/etc/ceph/ceph.conf"
_REAP = 128


class RbdError(Error):
    """The Ceph cluster, pool, image or snapshot cannot be used, in one line."""


def _lib() -> tuple[Any, Any]:
    """(ffi, lib) of the librbd binding, built only where librbd-dev was."""
    try:
        mod: Any = importlib.import_module("aioublk.targets._rbd")
    except ImportError:
        raise RbdError("the rbd target needs librbd: install librbd-dev (Debian) and "
                       "reinstall aioublk (scripts/setup)") from None
    return mod.ffi, mod.lib


def parse_spec(spec: str) -> tuple[str, str, str | None]:
    """``pool/image[@snap]`` as (pool, image, snap or None)."""
    pool, slash, rest = spec.partition("/")
    image, at, snap = rest.partition("@")
    if not slash or not pool or not image or "/" in image or (at and not snap):
        raise RbdError(f"RBD image {spec!r}: write it POOL/IMAGE or POOL/IMAGE@SNAPSHOT")
    return pool, image, snap if at else None


class RbdTarget(Target):
    """A device in front of the RBD image ``spec`` (``pool/image[@snap]``)."""

    name = "rbd"
    one_loop = True

    def __init__(self, spec: str, *, conf: str = DEFAULT_CONF, client_id: str = "admin",
                 read_only: bool = False, timeout: int = 10) -> None:
        self.ffi, self.lib = _lib()
        self.spec, self.conf, self.id = spec, conf, client_id
        self.pool, self.image_name, self.snap = parse_spec(spec)
        self.read_only = read_only or self.snap is not None
        self.cluster: Any = None
        self.ioctx: Any = None
        self.image: Any = None
        self.efd = -1
        self.timeout = timeout
        try:  # a probe: the image is opened again where it is served
            self._open(timeout)
            info = self.ffi.new("rbd_image_info_t *")
            self._check(self.lib.rbd_stat(self.image, info, self.ffi.sizeof(info[0])), "stat")
            self.size, self.object_size = int(info.size), int(info.obj_size)
        finally:
            self._shut()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queues = 0
        self.ids = itertools.count(1)
        self.pending: dict[int, Callable[[int], None]] = {}
        self.done = self.ffi.new("struct arbd_done[]", _REAP)
        io_opt = min(max(self.object_size, 4096), 64 << 20)
        self.geometry = Geometry(
            size=self.size - self.size % 512, logical_block_size=512, physical_block_size=4096,
            io_min=512, io_opt=io_opt, max_io_size=min(io_opt, 4 << 20), volatile_cache=True,
            fua=True, read_only=self.read_only, discard=not self.read_only,
            discard_granularity=4096, max_discard_size=1 << 30,  # whole objects freed
            write_zeroes=not self.read_only)

    # ------------------------------------------------------- opening ----

    def _open(self, timeout: int) -> None:
        ffi, lib = self.ffi, self.lib
        if not os.path.isfile(self.conf):
            raise RbdError(f"Ceph config {self.conf}: no such file: give the cluster's "
                           "ceph.conf (--rbd-conf)")
        cluster = ffi.new("rados_t *")
        self._check(lib.rados_create(cluster, self.id.encode()), "client")
        self.cluster = cluster[0]
        self._check(lib.rados_conf_read_file(self.cluster, self.conf.encode()),
                    f"config {self.conf}")
        # the monitors' answers only: an OSD op timeout would also fail I/O
        # while OSDs recover, which a disk should wait through
        for key in ("client_mount_timeout", "rados_mon_op_timeout"):
            lib.rados_conf_set(self.cluster, key.encode(), str(timeout).encode())
        r = lib.rados_connect(self.cluster)
        if r < 0:
            raise RbdError(f"Ceph cluster of {self.conf} (client.{self.id}): "
                           f"{os.strerror(-r)}: is it up and reachable, and the id allowed?")
        ioctx = ffi.new("rados_ioctx_t *")
        r = lib.rados_ioctx_create(self.cluster, self.pool.encode(), ioctx)
        if r == -errno.ENOENT:
            raise RbdError(f"Ceph pool {self.pool!r}: no such pool: create it, or name "
                           "another (POOL/IMAGE)")
        self._check(r, f"pool {self.pool!r}")
        self.ioctx = ioctx[0]
        image = ffi.new("rbd_image_t *")
        snap = self.snap.encode() if self.snap is not None else ffi.NULL
        open_ = lib.rbd_open_read_only if self.read_only else lib.rbd_open
        r = open_(self.ioctx, self.image_name.encode(), image, snap)
        if r == -errno.ENOENT and self.snap is not None and self._image_exists():
            raise RbdError(f"RBD image {self.pool}/{self.image_name} has no snapshot "
                           f"{self.snap!r}: see rbd snap ls {self.pool}/{self.image_name}")
        if r == -errno.ENOENT:
            raise RbdError(f"RBD image {self.pool}/{self.image_name}: no such image: see "
                           f"rbd ls {self.pool}")
        self._check(r, "open")
        self.image = image[0]

    def _image_exists(self) -> bool:
        image = self.ffi.new("rbd_image_t *")
        if self.lib.rbd_open_read_only(self.ioctx, self.image_name.encode(), image,
                                       self.ffi.NULL) < 0:
            return False
        self.lib.rbd_close(image[0])
        return True

    def _check(self, r: int, what: str) -> None:
        if r < 0:
            raise RbdError(f"RBD image {self.spec}: {what}: {os.strerror(-r)}")

    def _shut(self) -> None:
        if self.image is not None:
            self.lib.rbd_close(self.image)
            self.image = None
        if self.ioctx is not None:
            self.lib.rados_ioctx_destroy(self.ioctx)
            self.ioctx = None
        if self.cluster is not None:
            self.lib.rados_shutdown(self.cluster)
            self.cluster = None

    def close(self) -> None:
        self._shut()
        if self.efd >= 0:
            os.close(self.efd)
            self.efd = -1

    # ------------------------------------------------------- the loop ---

    async def queue_setup(self, q: QueueContext) -> None:
        """All queues share one loop (``one_loop``): the first watches the
        image's eventfd, the last to go stops."""
        self.queues += 1
        if self.loop is not None:
            return
        self.loop = q.loop
        try:
            await q.loop.run_in_executor(None, self._open, self.timeout)
        except BaseException:
            self.loop = None
            self.queues -= 1
            self._shut()
            raise
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        r = self.lib.rbd_set_image_notification(self.image, efd, self.lib.EVENT_TYPE_EVENTFD)
        if r < 0:
            os.close(efd)
            self.queues -= 1
            self.loop = None
            self._shut()
            self._check(r, "completion notification")
        self.efd = efd
        q.loop.add_reader(efd, self._reap)
        log.info("RBD image open", image=self.spec, size=self.size, read_only=self.read_only)

    async def queue_teardown(self, q: QueueContext) -> None:
        self.queues -= 1
        if self.queues or self.loop is None:
            return
        self.loop.remove_reader(self.efd)
        self.loop = None
        self._shut()  # (librbd writes the eventfd until the image is closed: close it after)
        os.close(self.efd)
        self.efd = -1

    def _reap(self) -> None:
        try:
            os.eventfd_read(self.efd)
        except BlockingIOError:
            pass
        lib, done = self.lib, self.done
        while (n := lib.arbd_reap(self.image, done, _REAP)) > 0:
            for i in range(n):
                finish = self.pending.pop(done[i].id, None)
                if finish is not None:
                    finish(done[i].result)
            if n < _REAP:
                break

    def _submit(self, issue: Callable[[int], int], finish: Callable[[int], None]) -> None:
        """Start one librbd call (``issue(id)``, 0 or -errno); ``finish`` gets its result."""
        rid = next(self.ids)
        self.pending[rid] = finish
        r = issue(rid)
        if r < 0:
            del self.pending[rid]
            finish(r)

    async def _run(self, issue: Callable[[int], int], buf: Any = None,
                   into: memoryview | None = None) -> None:
        """One librbd call awaited; ``into``: a read's buffer, zeroed past a short answer."""
        fut = asyncio.get_running_loop().create_future()

        def finish(res: int) -> None:
            if into is not None:
                _zero_past(into, res)
            if buf is not None:
                self.ffi.release(buf)
            if fut.done():
                return
            if res < 0:
                fut.set_exception(OSError(-res, f"RBD image {self.spec}: {os.strerror(-res)}"))
            else:
                fut.set_result(None)

        self._submit(issue, finish)
        await fut

    def _start(self, issue: Callable[[int], int], buf: Any, n: int, done: Done,
               into: memoryview | None = None) -> None:
        def finish(res: int) -> None:
            if into is not None:
                _zero_past(into, res)
            self.ffi.release(buf)
            done(n if res >= 0 else res)

        self._submit(issue, finish)

    # ------------------------------------------------------- requests ---

    def _refuse_write(self) -> None:
        if self.read_only:
            raise OSError(errno.EROFS, f"RBD image {self.spec} is read-only")

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        b, n, lib, img = self.ffi.from_buffer(buf), len(buf), self.lib, self.image
        self._start(lambda i: lib.arbd_read(img, b, n, offset, i), b, n, done, buf)
        return True

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        if self.read_only:
            return False
        b, n, lib, img = self.ffi.from_buffer(buf), len(buf), self.lib, self.image
        self._start(lambda i: lib.arbd_write(img, b, n, offset, i), b, n, done)
        return True

    async def read(self, offset: int, buf: memoryview) -> None:
        b, n, lib, img = self.ffi.from_buffer(buf), len(buf), self.lib, self.image
        await self._run(lambda i: lib.arbd_read(img, b, n, offset, i), b, buf)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        self._refuse_write()
        b, n, lib, img = self.ffi.from_buffer(buf), len(buf), self.lib, self.image
        await self._run(lambda i: lib.arbd_write(img, b, n, offset, i), b)
        if fua:
            await self.flush()

    async def flush(self) -> None:
        lib, img = self.lib, self.image
        await self._run(lambda i: lib.arbd_flush(img, i))

    async def discard(self, offset: int, length: int) -> None:
        self._refuse_write()
        lib, img = self.lib, self.image
        await self._run(lambda i: lib.arbd_discard(img, offset, length, i))

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        self._refuse_write()
        lib, img = self.lib, self.image
        await self._run(lambda i: lib.arbd_write_zeroes(img, offset, length, i))

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "image": self.spec, "conf": self.conf, "id": self.id}


def _zero_past(buf: memoryview, res: int) -> None:
    """A read answered with ``res`` bytes (librbd clips a read at the image's
    end): zeros after them, never what the buffer held before."""
    if 0 <= res < len(buf):
        buf[res:] = bytes(len(buf) - res)


#: ``-t rbd``: its options, as the command line and config files take them
SPEC = TargetSpec("rbd", RbdTarget, (
    Option("image", STR, "the RBD image: POOL/IMAGE, or POOL/IMAGE@SNAPSHOT (read-only)",
           arg="*", required=True, what="RBD image"),
    Option("conf", PATH, "the Ceph cluster's config file", default="/etc/ceph/ceph.conf",
           default_help="/etc/ceph/ceph.conf", flags=("--rbd-conf",),
           what="Ceph config file"),
    Option("id", STR, "the Ceph client id (client.ID's keyring)", default="admin",
           default_help="admin", flags=("--rbd-id",), arg="client_id"),
), files="image", read_only=True, rank=7)
