"""The nbd target: the device's bytes live on an NBD server (qemu-nbd,
qemu-storage-daemon, nbdkit and its plugins), reached through libnbd.

libnbd connects: it is the NBD project's maintained client (handshake,
structured replies, block-size constraints, TLS through gnutls), and its
asynchronous API fits a queue's loop as it is: one socket fd, a readiness
direction, and commands pipelined on it with no thread.

Reads and writes go in C: the target's map is the nbd extension's plug-in
(``csrc/nbd.c``, ``dataplane.External``). Once a queue's data plane has
taken it and Python has connected, the handle is plugged in, and the data
plane hands the plug-in every READ and non-FUA WRITE. Without TLS the
plug-in then owns the socket (the transmission phase in C): each pass's
requests go in one SENDMSG on the queue's ring, from the tag buffers, and a
READV kept in flight on the ring brings the replies (simple or structured),
which C parses into the tag buffers; libnbd would make a syscall per send
and read each reply in pieces (four reads for a structured one). Over TLS,
libnbd keeps sending and parsing on the worker's thread, its socket watched
by polls on the ring. Either way each completion commits its request, all
without Python. Python keeps the rest on the same connection (flush, trim,
zeroes, FUA writes, and every request C hands back: one answered with an
error, or lost with its connection), sent through the plug-in while it
owns the socket, and everything while no handle is plugged (connecting,
reconnecting, other copy modes): there each request is a coroutine awaiting
a future (or the task-free ``start_read``), the fd is watched with
``add_reader`` (always) and ``add_writer`` (while libnbd has bytes to
send), and after each ``nbd_aio_notify_*`` the completions the C side
recorded are reaped in bulk and resolve their futures. When C sees the
connection die (or a reply break the protocol) it lets go of it at once and
tells Python (``EV_EXT``), which reconnects as below and plugs the new
handle in.

Connections: one per queue loop when the server advertises multi-conn (its
connections then share one consistent cache, so a flush on one covers
writes made on another); otherwise one connection, and the device serves
all its queues from one loop (``one_loop``), as the kernel's own client must.

A server that goes away: a loop's requests in flight and new ones are held,
not failed, while it reconnects with exponential backoff (0.1 s doubling up
to 5 s) for ``reconnect_timeout`` seconds; then they fail with EIO. Held
requests are sent again on the new connection: NBD commands are idempotent
(a write sent twice stores the same bytes). A request after giving up starts
a new round. Each state change is one log line.

Connecting is bounded: a server that takes the connection and never
answers costs ``CONNECT_TIMEOUT`` seconds, then one line. The first
connection (the probe the device is made from) is driven by polling
libnbd's state machine against that deadline, never its blocking connect;
a queue's connection is awaited on its loop with the same timeout.

A reconnection must find the export as the device was made from it: the
same size, flags (read-only, flush, FUA, trim, zero, multi-conn) and block
sizes; a server that came back otherwise is refused (and retried until
``reconnect_timeout``). A server that lost multi-conn, served again on
every queue's connection, would let a FLUSH on one connection leave writes
acknowledged on another uncovered.

TLS: libnbd checks the server's certificate against the URI's host name,
and over a unix socket (no host) checks nothing; so ``nbds+unix://`` is
refused unless ``tls_hostname`` names the host the certificate must hold
and libnbd can use it (``nbd_set_tls_hostname``, libnbd 1.22).

Fast zero is never sent: a kernel write-zeroes request cannot say "only if
fast" (REQ_NOUNMAP becomes NBD's NO_HOLE), as in the kernel's own client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import importlib
import itertools
import os
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from aioublk import logs
from aioublk.dataplane.maps import External
from aioublk.errors import Error
from aioublk.ring import Ring, current_ring
from aioublk.target import Done, Geometry, QueueContext, Target, current_queue
from aioublk.targets.spec import INT, PATH, STR, Option, TargetSpec

log = logs.get_logger("aioublk.nbd")

#: a command's errno when its connection went away, not the server's answer
_LOST = frozenset({errno.ENOTCONN, errno.ESHUTDOWN, errno.ECONNRESET, errno.EPIPE})
_FIRST_DELAY, _MAX_DELAY = 0.1, 5.0
#: seconds a connection (TCP or unix, TLS, NBD handshake) may take
CONNECT_TIMEOUT = 10.0
_REAP = 64


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What a server advertises for the export, which the device is made of."""

    size: int
    read_only: bool
    flush: bool
    fua: bool
    trim: bool
    zero: bool
    multi_conn: bool
    block_sizes: tuple[int, int, int]  # minimum, preferred, maximum (0: none)


class NbdError(Error):
    """The NBD server or export cannot be used, in one line."""


#: libnbd's URI schemes: (TLS, transport)
_SCHEMES = {f"nbd{s}{t and '+' + t}": (s == "s", t or "tcp")
            for s in ("", "s") for t in ("", "unix", "vsock", "ssh")}
_FORMS = "nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH (nbds for TLS)"


@dataclasses.dataclass(frozen=True)
class NbdUri:
    """What the target decides from a URI before libnbd connects to it."""

    tls: bool
    transport: str  # tcp, unix, vsock or ssh
    psk: bool = False  # TLS with a pre-shared key (tls-psk-file=): no certificate to check


def parse_uri(uri: str) -> NbdUri:
    """The URI's scheme and transport, or a one-line NbdError: a URI is
    checked here, where its errors can be said plainly, before libnbd parses
    it again to connect (and before it is ever put in a message: a control
    character would split the line)."""
    if not uri.isprintable() or not uri.isascii():
        raise NbdError(f"NBD URI {uri!r}: only printable ASCII belongs in a URI "
                       "(percent-encode the rest)")
    scheme, sep, _ = uri.partition("://")
    if not sep or scheme not in _SCHEMES:  # (libnbd's schemes are lower case only)
        raise NbdError(f"NBD URI {uri}: not an NBD URI: use {_FORMS}")
    tls, transport = _SCHEMES[scheme]
    try:
        parts = urllib.parse.urlsplit(uri)
        if transport != "vsock":  # (a vsock port has 32 bits)
            parts.port  # noqa: B018 - read to refuse a bad one now (libnbd takes 99999)
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    except ValueError as e:
        raise NbdError(f"NBD URI {uri}: {e}") from None
    if transport == "unix" and not query.get("socket", [""])[0]:
        raise NbdError(f"NBD URI {uri}: a unix socket URI names its socket: "
                       f"{scheme}:///EXPORT?socket=PATH")
    return NbdUri(tls, transport, psk="tls-psk-file" in query)


def _lib() -> tuple[Any, Any]:
    """(ffi, lib) of the libnbd binding, built only where libnbd-dev was."""
    try:
        mod: Any = importlib.import_module("aioublk.targets._nbd")
    except ImportError:
        raise NbdError("the nbd target needs libnbd: install libnbd-dev (Debian) and "
                       "reinstall aioublk (scripts/setup)") from None
    return mod.ffi, mod.lib


def _why(ffi: Any, lib: Any) -> str:
    """libnbd's last error on this thread."""
    msg = lib.nbd_get_error()
    return ffi.string(msg).decode(errors="replace") if msg != ffi.NULL else "unknown error"


class _Cmd:
    """One NBD command (``kind``: the C side's ANBD_*), sent again after a
    reconnection until it is answered: a coroutine's (``fut``) or a
    fast-path request's (``done`` gets ``n`` or -errno, once). ``buf`` (the
    request's buffer as cffi holds it) is released when it is answered: a
    cffi buffer view left to the garbage collector in a cycle with what it
    views can be freed after it, and crashes the interpreter."""

    __slots__ = ("kind", "buf", "count", "offset", "flags", "fut", "done", "n")

    def __init__(self, kind: int, buf: Any, count: int, offset: int, flags: int = 0, *,
                 fut: asyncio.Future[None] | None = None, done: Done | None = None,
                 n: int = 0) -> None:
        self.kind, self.buf, self.count, self.offset, self.flags = kind, buf, count, offset, flags
        self.fut, self.done, self.n = fut, done, n

    @property
    def abandoned(self) -> bool:
        """Its coroutine was cancelled: nobody waits for the answer."""
        return self.fut is not None and self.fut.done()

    def finish(self, ffi: Any, error: OSError | None = None) -> None:
        if self.buf is not None:
            ffi.release(self.buf)
            self.buf = None
        if self.done is not None:
            done, self.done = self.done, None
            done(self.n if error is None else -(error.errno or errno.EIO))
        elif self.fut is not None and not self.fut.done():
            if error is None:
                self.fut.set_result(None)
            else:
                self.fut.set_exception(error)


class _Link:
    """One loop's connection to the server, kept up: while it is down its
    requests wait in ``held``."""

    def __init__(self, target: NbdTarget, loop: asyncio.AbstractEventLoop, worker: int) -> None:
        self.t, self.loop, self.worker = target, loop, worker
        self.ffi, self.lib = target.ffi, target.lib
        self.h: Any = None           # the libnbd handle, None while down
        self.up = False              # h is connected and takes commands
        self.nbd_fd = -1             # libnbd's socket, which it closes when the link dies
        self.fd = -1                 # the loop watches a dup of it: never closed behind its back
        self.writing = False
        self.q = self.lib.anbd_q_new()
        self.done = self.ffi.new("struct anbd_done[]", _REAP)
        self.ids = itertools.count(1)
        self.pending: dict[int, _Cmd] = {}
        self.held: list[_Cmd] = []
        self.ready: asyncio.Future[None] | None = None
        self.reconnecting: asyncio.Task[None] | None = None
        self.why = ""
        #: the data plane's plug-in (``external``): once a data plane took it,
        #: a connected handle is plugged in and C sends reads and writes on
        #: it and watches its socket on the queue's ring, not the loop
        self.ext: Any = None
        self.plugged = False
        self.ring: Ring | None = None

    def external(self) -> External:
        """The data plane's map: this connection's plug-in (``csrc/nbd.c``)."""
        ffi, lib = self.ffi, self.lib
        ext = lib.anbd_ext_new(int(self.t.read_only), self.q)
        if ext == ffi.NULL:
            raise MemoryError("the NBD data plane plug-in")
        self.ext = ffi.gc(ext, lib.anbd_ext_free)  # freed after the data plane that holds it
        self.ring = current_ring()
        return External(int(ffi.cast("uintptr_t", lib.anbd_ext_ops())),
                        int(ffi.cast("uintptr_t", ext)), self.wake, self.ext)

    def wake(self) -> None:
        """The plug-in asks for Python: it was bound, its handle died, or
        commands of ours on it completed."""
        if self.h is not None:
            self._progress()

    def _kicked(self, ret: int) -> None:
        """After C was told something: its ring has work to submit."""
        if ret and self.ring is not None:
            self.ring.request_flush()

    # ------------------------------------------------------- connecting --

    async def connect(self) -> None:
        """A new handle, connected; raises NbdError naming the server's refusal."""
        lib = self.lib
        h = self.t.new_handle()
        self.why = ""
        if lib.nbd_aio_connect_uri(h, self.t.uri.encode()) == -1:
            why = _why(self.ffi, lib)
            lib.nbd_close(h)
            raise NbdError(f"NBD server {self.t.uri}: {why}")
        self.h, self.ready = h, self.loop.create_future()
        try:
            self._progress()
            await self.ready
            self.t.check_same(h)
        except BaseException:
            self._drop()
            raise
        self.up = True
        if self.ext is not None:  # (plugged into C if a data plane took it)
            self._progress()

    def _progress(self) -> None:
        """After libnbd did something: reap completions, follow its fd and
        direction, notice a connection made or lost."""
        lib, h = self.lib, self.h
        if self.plugged:  # (C lets go of a dead handle here)
            self._kicked(lib.anbd_ext_kick(self.ext))
        dead = bool(lib.nbd_aio_is_dead(h) or lib.nbd_aio_is_closed(h)
                    or (self.plugged and lib.anbd_ext_handle(self.ext) == self.ffi.NULL))
        self._reap(dead)
        if dead:
            if self.plugged and not self.why:
                self.why = self.ffi.string(lib.anbd_ext_why(self.ext)).decode(errors="replace")
            if self.ready is not None and not self.ready.done():
                self.ready.set_exception(NbdError(
                    f"NBD server {self.t.uri}: {self.why or 'connection closed'}"))
            elif self.up:
                self._lost()
            return
        if self.ready is not None and not self.ready.done() and lib.nbd_aio_is_ready(h):
            self.ready.set_result(None)
        if self.plugged:
            return
        if self.up and self.ext is not None and lib.anbd_ext_bound(self.ext):
            self._unwatch()  # the ring watches it from now on
            self.plugged, self.why = True, ""  # (C says why, if it lets go of it)
            self._kicked(lib.anbd_ext_plug(self.ext, h))
            return
        fd = lib.nbd_aio_get_fd(h)
        if fd != self.nbd_fd:  # connecting to the next address of a host makes a new socket
            self._unwatch()
            if fd >= 0:
                self.nbd_fd, self.fd = fd, os.dup(fd)
                self.loop.add_reader(self.fd, self._notify, lib.nbd_aio_notify_read)
        writing = fd >= 0 and bool(lib.nbd_aio_get_direction(h) & lib.LIBNBD_AIO_DIRECTION_WRITE)
        if writing != self.writing:
            self.writing = writing
            if writing:
                self.loop.add_writer(self.fd, self._notify, lib.nbd_aio_notify_write)
            else:
                self.loop.remove_writer(self.fd)

    def _notify(self, notify: Callable[[Any], int]) -> None:
        if self.h is None:
            return
        if notify(self.h) == -1:
            self.why = _why(self.ffi, self.lib)
        self._progress()

    def _unwatch(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            if self.writing:
                self.loop.remove_writer(self.fd)
            os.close(self.fd)
        self.fd, self.nbd_fd, self.writing = -1, -1, False

    def _drop(self) -> None:
        """Close the handle; its commands still in flight are held (C's
        come back to Python as retries)."""
        self._unplug()
        self._unwatch()
        h, self.h, self.up = self.h, None, False
        if h is not None:
            self.lib.nbd_close(h)  # runs the callbacks of what was in flight
            if self.ext is not None:  # C's answers wait for its next pass
                self._kicked(self.lib.anbd_ext_kick(self.ext))
            self._reap(True)

    def _unplug(self) -> None:
        if self.plugged:
            self.plugged = False
            self._kicked(self.lib.anbd_ext_plug(self.ext, self.ffi.NULL))

    def _reap(self, lost: bool) -> None:
        lib = self.lib
        while n := lib.anbd_reap(self.q, self.done, _REAP):
            for i in range(n):
                d = self.done[i]
                cmd = self.pending.pop(d.id, None)
                if cmd is None:
                    continue
                if not d.error:
                    cmd.finish(self.ffi)
                elif (lost or d.error in _LOST) and not cmd.abandoned:
                    self.held.append(cmd)
                else:
                    cmd.finish(self.ffi, OSError(d.error, f"NBD server: "
                                                 f"{os.strerror(d.error)}"))

    # --------------------------------------------------- losing it ------

    def _lost(self) -> None:
        log.warning("NBD connection lost", uri=self.t.uri, worker=self.worker,
                    error=self.why or "connection closed", held=len(self.pending))
        self._drop()
        self._reconnect_soon()

    def _reconnect_soon(self) -> None:
        if self.reconnecting is None or self.reconnecting.done():
            self.reconnecting = self.loop.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        start = self.loop.time()
        deadline = start + self.t.reconnect_timeout
        delay = _FIRST_DELAY
        for attempt in itertools.count(1):
            log.info("NBD reconnecting", uri=self.t.uri, worker=self.worker, attempt=attempt)
            try:
                await asyncio.wait_for(self.connect(), max(0.1, deadline - self.loop.time()))
                break
            except (NbdError, TimeoutError) as e:
                error = str(e) or "timed out"
            if self.loop.time() + delay >= deadline:
                log.error("NBD server gave no connection: requests fail", uri=self.t.uri,
                          worker=self.worker, attempts=attempt, error=error,
                          seconds=self.t.reconnect_timeout)
                self._fail_held(f"NBD server {self.t.uri} lost")
                return
            await asyncio.sleep(delay)
            delay = min(2 * delay, _MAX_DELAY)
        log.info("NBD reconnected", uri=self.t.uri, worker=self.worker, attempts=attempt,
                 seconds=round(self.loop.time() - start, 3), resent=len(self.held))
        held, self.held = self.held, []
        for cmd in held:
            if cmd.abandoned:  # its request was cancelled meanwhile
                cmd.finish(self.ffi)
            else:
                self._submit(cmd)

    def _fail_held(self, why: str) -> None:
        held, self.held = self.held, []
        for cmd in held:
            cmd.finish(self.ffi, OSError(errno.EIO, why))

    # --------------------------------------------------- requests -------

    async def run(self, kind: int, buf: Any = None, count: int = 0, offset: int = 0,
                  flags: int = 0) -> None:
        """Send one command and wait for its answer (holding it while down)."""
        fut = self.loop.create_future()
        self._submit(_Cmd(kind, buf, count, offset, flags, fut=fut))
        await fut

    def start(self, kind: int, buf: Any, offset: int, done: Done) -> None:
        """Send a read or write of the fast path: ``done(len)`` when answered."""
        n = len(buf)
        self._submit(_Cmd(kind, buf, n, offset, done=done, n=n))

    def _submit(self, cmd: _Cmd) -> None:
        if not self.up:
            self.held.append(cmd)
            self._reconnect_soon()
            return
        rid = next(self.ids)
        self.pending[rid] = cmd
        ext = self.ext if self.plugged else self.ffi.NULL  # (C's own transmission, if any)
        buf = cmd.buf if cmd.buf is not None else self.ffi.NULL
        if self.lib.anbd_cmd(self.h, self.q, ext, cmd.kind, buf, cmd.count, cmd.offset, rid,
                             cmd.flags) == -1:
            self.pending.pop(rid, None)
            err = self.lib.nbd_get_errno() or errno.EIO
            if self.lib.nbd_aio_is_ready(self.h) or self.lib.nbd_aio_is_processing(self.h):
                cmd.finish(self.ffi, OSError(err, _why(self.ffi, self.lib)))
            else:
                self.held.append(cmd)
        self._progress()

    async def close(self) -> None:
        if self.reconnecting is not None:
            self.reconnecting.cancel()
            await asyncio.wait([self.reconnecting])
        self._unplug()  # (before the goodbye: nothing but libnbd reads the socket)
        if self.h is not None and self.up:
            self.lib.nbd_shutdown(self.h, 0)
        self._drop()
        self._fail_held("the NBD target is closing")
        self.lib.anbd_q_free(self.q)


class NbdTarget(Target):
    """A device in front of the NBD export at ``uri`` (nbd://host:port/export,
    nbd+unix:///export?socket=PATH, nbds://... with ``tls_certificates``)."""

    name = "nbd"

    def __init__(self, uri: str, *, tls_certificates: str | None = None,
                 tls_hostname: str | None = None, reconnect_timeout: int = 30,
                 read_only: bool = False) -> None:
        self.ffi, self.lib = _lib()
        if tls_certificates is not None and not os.path.isfile(
                os.path.join(tls_certificates, "ca-cert.pem")):
            # libnbd would go on without verifying the server: refuse a mistyped directory
            raise NbdError(f"TLS certificates {tls_certificates}: no ca-cert.pem there: give "
                           "the directory holding ca-cert.pem, client-cert.pem and "
                           "client-key.pem")
        self.uri, self.tls_certificates = uri, tls_certificates
        self.tls_hostname = tls_hostname
        self._check_tls()
        self.reconnect_timeout = reconnect_timeout
        lib = self.lib
        h = self.new_handle()
        try:
            self._connect_now(h)
            self.shape = self._shape(h)
            lib.nbd_shutdown(h, 0)  # a clean goodbye: servers log a dropped connection
        finally:
            lib.nbd_close(h)
        shape = self.shape
        self.size, self.multi_conn = shape.size, shape.multi_conn
        self.can_flush, self.can_fua = shape.flush, shape.fua
        self.can_trim, self.can_zero = shape.trim, shape.zero
        self.read_only = read_only or shape.read_only
        self.one_loop = not self.multi_conn
        # The server at the other end of a unix socket runs on this machine. A
        # worker pinned to one CPU then competes with it there, while the
        # scheduler could have used the other: measured in the guest against
        # qemu-storage-daemon (4 rounds, paired), unpinned / pinned 1.15 for
        # 4k randread qd64, 1.05 randwrite qd64, 1.03 randread qd1.
        self.pin_workers = parse_uri(uri).transport != "unix"
        self.geometry = _geometry(self.size, *shape.block_sizes,
                                  read_only=self.read_only, flush=self.can_flush,
                                  fua=self.can_fua, trim=self.can_trim and not self.read_only,
                                  zero=self.can_zero and not self.read_only)

    def _check_tls(self) -> None:
        """Refuse TLS that would check nothing: over a unix socket libnbd has
        no host name to hold the certificate to, and takes any."""
        uri = parse_uri(self.uri)
        if self.tls_hostname is not None:
            if not uri.tls:
                raise NbdError(f"NBD server {self.uri}: --tls-hostname is for TLS: use an "
                               "nbds:// or nbds+unix:// URI, or drop it")
            if not self.lib.anbd_can_tls_hostname():
                raise NbdError(f"NBD server {self.uri}: --tls-hostname needs libnbd 1.22 or "
                               "later (nbd_set_tls_hostname); with this one use TLS over TCP "
                               "(nbds://HOST:PORT/EXPORT), where the URI's host is checked")
        elif uri.tls and uri.transport in ("unix", "vsock") and not uri.psk:
            raise NbdError(f"NBD server {self.uri}: TLS over a {uri.transport} socket checks "
                           "no host name, so any certificate would pass: give the name the "
                           "server's certificate holds (--tls-hostname)")

    def _connect_now(self, h: Any) -> None:
        """Connect ``h`` within CONNECT_TIMEOUT: libnbd's state machine polled
        against a deadline (its blocking connect waits forever for a server
        that accepts and never answers)."""
        lib = self.lib
        deadline = time.monotonic() + CONNECT_TIMEOUT
        if lib.nbd_aio_connect_uri(h, self.uri.encode()) == -1:
            raise NbdError(f"NBD server {self.uri}: {_why(self.ffi, lib)}")
        while not lib.nbd_aio_is_ready(h):
            if lib.nbd_aio_is_dead(h) or lib.nbd_aio_is_closed(h):
                raise NbdError(f"NBD server {self.uri}: {_why(self.ffi, lib)}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise NbdError(self._timed_out())
            if lib.nbd_poll(h, max(1, min(int(left * 1000), 1000))) == -1:
                raise NbdError(f"NBD server {self.uri}: {_why(self.ffi, lib)}")

    def _timed_out(self) -> str:
        return (f"NBD server {self.uri}: no answer in {CONNECT_TIMEOUT:g} s (timed out): is "
                "it an NBD server, and is it serving?")

    def new_handle(self) -> Any:
        """A libnbd handle set up as every connection of this target is."""
        lib = self.lib
        h = lib.nbd_create()
        if h == self.ffi.NULL:
            raise NbdError(f"libnbd: {_why(self.ffi, lib)}")
        lib.nbd_set_request_structured_replies(h, True)
        lib.nbd_set_request_block_size(h, True)
        lib.nbd_set_uri_allow_transports(h, lib.LIBNBD_ALLOW_TRANSPORT_TCP
                                         | lib.LIBNBD_ALLOW_TRANSPORT_UNIX)
        lib.nbd_set_uri_allow_tls(h, lib.LIBNBD_TLS_ALLOW)
        if self.tls_certificates is not None and lib.nbd_set_tls_certificates(
                h, self.tls_certificates.encode()) == -1:
            why = _why(self.ffi, lib)
            lib.nbd_close(h)
            raise NbdError(f"TLS certificates {self.tls_certificates}: {why}")
        if self.tls_hostname is not None and lib.anbd_set_tls_hostname(
                h, self.tls_hostname.encode()) == -1:
            why = _why(self.ffi, lib)
            lib.nbd_close(h)
            raise NbdError(f"TLS host name {self.tls_hostname!r}: {why}")
        return h

    def _flag(self, h: Any, get: Callable[[Any], int]) -> int:
        value = get(h)
        if value == -1:
            raise NbdError(f"NBD server {self.uri}: {_why(self.ffi, self.lib)}")
        return value

    def _block_size(self, kind: int) -> Callable[[Any], int]:
        return lambda h: int(self.lib.nbd_get_block_size(h, kind))

    def _shape(self, h: Any) -> _Shape:
        """What the device is made from, as the server of ``h`` advertises it."""
        lib = self.lib
        flag = functools.partial(self._flag, h)
        return _Shape(
            size=flag(lib.nbd_get_size), read_only=bool(flag(lib.nbd_is_read_only)),
            flush=bool(flag(lib.nbd_can_flush)), fua=bool(flag(lib.nbd_can_fua)),
            trim=bool(flag(lib.nbd_can_trim)), zero=bool(flag(lib.nbd_can_zero)),
            multi_conn=bool(flag(lib.nbd_can_multi_conn)),
            block_sizes=(flag(self._block_size(lib.LIBNBD_SIZE_MINIMUM)),
                         flag(self._block_size(lib.LIBNBD_SIZE_PREFERRED)),
                         flag(self._block_size(lib.LIBNBD_SIZE_MAXIMUM))))

    def check_same(self, h: Any) -> None:
        """A reconnection must find the export as the device was made from it:
        same size, flags and block sizes (a server without multi-conn now
        would leave one connection's FLUSH not covering another's writes)."""
        was, now = dataclasses.asdict(self.shape), dataclasses.asdict(self._shape(h))
        changed = [f"{k} {was[k]} -> {now[k]}" for k in was if now[k] != was[k]]
        if changed:
            raise NbdError(f"NBD export {self.uri} changed since the device was made "
                           f"({', '.join(changed)}): refused")

    # ------------------------------------------------------- per loop ---

    async def queue_setup(self, q: QueueContext) -> None:
        link = _Link(self, q.loop, q.worker)
        try:
            try:
                await asyncio.wait_for(link.connect(), CONNECT_TIMEOUT)
            except TimeoutError:
                raise NbdError(self._timed_out()) from None
        except BaseException:
            await link.close()
            raise
        q.state["nbd"] = link
        log.info("NBD connected", uri=self.uri, worker=q.worker, multi_conn=self.multi_conn)

    async def queue_teardown(self, q: QueueContext) -> None:
        link: _Link | None = q.state.pop("nbd", None)
        if link is not None:
            await link.close()

    def _link(self) -> _Link:
        link: _Link = current_queue().state["nbd"]
        return link

    def map(self) -> External:
        """The data plane sends this loop's reads and writes itself, on the
        connection Python made (``csrc/nbd.c``); the rest (flush, trim,
        zeroes, FUA, what C hands back) comes to the coroutines."""
        return self._link().external()

    # ------------------------------------------------------- requests ---

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        self._link().start(self.lib.ANBD_READ, self.ffi.from_buffer(buf), offset, done)
        return True

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        if self.read_only:
            return False  # the coroutine refuses it
        self._link().start(self.lib.ANBD_WRITE, self.ffi.from_buffer(buf), offset, done)
        return True

    async def read(self, offset: int, buf: memoryview) -> None:
        await self._link().run(self.lib.ANBD_READ, self.ffi.from_buffer(buf), len(buf), offset)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        if self.read_only:
            raise OSError(errno.EROFS, f"NBD export {self.uri} is read-only")
        lib = self.lib
        flags = lib.LIBNBD_CMD_FLAG_FUA if fua and self.can_fua else 0
        await self._link().run(lib.ANBD_WRITE, self.ffi.from_buffer(buf), len(buf), offset,
                               flags)
        if fua and not self.can_fua:
            await self.flush()

    async def flush(self) -> None:
        if self.can_flush:
            await self._link().run(self.lib.ANBD_FLUSH)

    async def discard(self, offset: int, length: int) -> None:
        if not self.can_trim or self.read_only:
            raise OSError(errno.EOPNOTSUPP, f"NBD export {self.uri} cannot trim")
        await self._link().run(self.lib.ANBD_TRIM, None, length, offset)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        if not self.can_zero or self.read_only:
            raise OSError(errno.EOPNOTSUPP, f"NBD export {self.uri} cannot write zeroes")
        lib = self.lib
        flags = 0 if unmap else lib.LIBNBD_CMD_FLAG_NO_HOLE
        await self._link().run(lib.ANBD_ZERO, None, length, offset, flags)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "uri": self.uri, "multi_conn": self.multi_conn}


def _geometry(size: int, minimum: int, preferred: int, maximum: int, *, read_only: bool,
              flush: bool, fua: bool, trim: bool, zero: bool) -> Geometry:
    """The server's block-size constraints (0: not advertised) as the
    kernel's: its minimum is the logical block (512 to 4096), its preferred
    size the physical block and optimal I/O, its maximum the largest request."""
    lbs = min(max(512, minimum), 4096)
    pbs = min(max(lbs, preferred or 4096), 64 << 10)
    return Geometry(size=size - size % lbs, logical_block_size=lbs, physical_block_size=pbs,
                    io_min=lbs, io_opt=pbs, max_io_size=min(maximum or 32 << 20, 32 << 20),
                    volatile_cache=flush, fua=fua, read_only=read_only, discard=trim,
                    discard_granularity=pbs, write_zeroes=zero)


#: ``-t nbd``: its options, as the command line and config files take them
SPEC = TargetSpec("nbd", NbdTarget, (
    Option("uri", STR, "the NBD export: nbd://HOST[:PORT]/EXPORT, "
           "nbd+unix:///EXPORT?socket=PATH, or nbds://... for TLS", arg="*",
           required=True, what="NBD URI"),
    Option("tls_certificates", PATH, "directory of the TLS CA, client certificate and "
           "key (ca-cert.pem, client-cert.pem, client-key.pem) for nbds:// URIs",
           flags=("--tls-certificates",), what="certificate directory"),
    Option("tls_hostname", STR, "the host name the server's TLS certificate must hold: "
           "needed for nbds+unix:// URIs (a unix socket has none to check; libnbd "
           ">= 1.22), and checked instead of the host of an nbds:// URI",
           flags=("--tls-hostname",), what="TLS host name"),
    Option("reconnect_timeout", INT, "seconds a lost server's requests are held while "
           "reconnecting, before they fail with EIO", default=30, default_help="30",
           flags=("--reconnect-timeout",), lo=0),
), files="uri", read_only=True, rank=6)
