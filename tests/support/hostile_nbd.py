"""An NBD server that misbehaves on purpose, for the nbd target's tests.

It speaks the fixed newstyle handshake as libnbd asks for it (structured
replies if ``structured``, then GO) and serves an export of ``size`` bytes
kept in memory, shared by its connections. Every ``every``-th command of a
connection is answered in the way ``mode`` names (the rest correctly), at
most ``limit`` times in all if given:

- ``early``: before reading that command, a simple reply to the cookie a
  careless client would use next (the last cookie seen, plus one);
- ``unknown``: a reply to a cookie no request ever had, before the real one;
- ``overlap``: a read answered with two data chunks over the same bytes
  (its first half twice, its second half never; structured replies only);
- ``duplicate``: the real reply, then the same reply again;
- ``stale``: before a read's real reply, the previous read's reply again
  (its cookie, its data): a late duplicate for a finished request;
- ``split``: the reply written a byte at a time (its first 64 bytes, so
  every header) and in pieces of one to 512 bytes after; a correct reply,
  merely slow;
- ``stall``: the server stops reading for ``stall`` seconds first (a large
  send from the client stays in flight); correct otherwise.

``first_read`` answers the first read of all with what it returns for the
cookie's bytes on the wire instead (a reply a test makes by hand).

A client may drop the connection over any of these; it must never take
wrong data for a read's answer, crash or hang. Tests also drive it by hand:
``hold()`` / ``release()`` stop and resume reading requests, ``inject()``
writes raw bytes to the newest connection, and ``requests`` records the
(kind, cookie, offset, length) of each request read.

Run it as a process (the guest's tests): ``python -m tests.support.hostile_nbd
--socket PATH --size BYTES --mode MODE --every N [--limit K]``; on SIGTERM
it prints ``misbehaved=N connections=M`` and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

MODES = ("none", "early", "unknown", "overlap", "duplicate", "stale", "split", "stall")

REQUEST = struct.Struct(">IHHQQI")
SIMPLE_MAGIC, STRUCTURED_MAGIC, REQUEST_MAGIC = 0x67446698, 0x668E33EF, 0x25609513
CMD_READ, CMD_WRITE, CMD_DISC, CMD_FLUSH, CMD_TRIM, CMD_ZERO = 0, 1, 2, 3, 4, 6
FLAG_DONE, TYPE_NONE, TYPE_OFFSET_DATA = 1, 0, 1
EINVAL = 22


def simple(cookie: int, error: int = 0, data: bytes = b"") -> bytes:
    return struct.pack(">IIQ", SIMPLE_MAGIC, error, cookie) + data


def chunk(cookie: int, kind: int, payload: bytes, done: bool) -> bytes:
    return struct.pack(">IHHQI", STRUCTURED_MAGIC, FLAG_DONE if done else 0, kind, cookie,
                       len(payload)) + payload


def data_chunk(cookie: int, offset: int, data: bytes, done: bool) -> bytes:
    return chunk(cookie, TYPE_OFFSET_DATA, struct.pack(">Q", offset) + data, done)


class HostileServer:
    """The server on a unix socket, its connections each on a thread."""

    def __init__(self, sock: Path, size: int, *, mode: str = "none", every: int = 0,
                 limit: int = 0, structured: bool = True, stall: float = 1.0,
                 seed: int = 0, first_read: Callable[[bytes], bytes] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
        self.sock, self.size, self.mode, self.every, self.limit = sock, size, mode, every, limit
        self.structured, self.stall, self.first_read = structured, stall, first_read
        self.rng = random.Random(seed)
        self.data = bytearray(size)
        self.lock = threading.Lock()  # the export's bytes
        self.gate = threading.Event()
        self.gate.set()
        self.requests: list[tuple[int, int, int, int]] = []
        self.connections = 0
        self.misbehaved = 0
        self._conn: socket.socket | None = None
        self._send_lock = threading.Lock()
        sock.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(sock))
        self.listener.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def uri(self) -> str:
        return f"nbd+unix:///?socket={self.sock}"

    def hold(self) -> None:
        """Stop reading requests (after the one being read)."""
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def inject(self, data: bytes) -> None:
        """Raw bytes to the newest connection, between two of its replies."""
        assert self._conn is not None
        with self._send_lock:
            self._conn.sendall(data)

    def close(self) -> None:
        self.listener.close()
        self.gate.set()

    # -- serving --

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                self.connections += 1
                self._conn = conn
                threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    @staticmethod
    def _read(conn: socket.socket, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            more = conn.recv(n - len(data))
            if not more:
                raise ConnectionError("client gone")
            data += more
        return bytes(data)

    def _send(self, conn: socket.socket, data: bytes, split: bool = False) -> None:
        with self._send_lock:
            if not split:
                conn.sendall(data)
                return
            i = 0
            while i < len(data):
                n = 1 if i < 64 else self.rng.randint(1, 512)
                conn.sendall(data[i:i + n])
                i += n

    def _handshake(self, conn: socket.socket) -> None:
        rep = 0x3E889045565A9

        def reply(opt: int, kind: int, data: bytes = b"") -> None:
            conn.sendall(struct.pack(">QIII", rep, opt, kind, len(data)) + data)

        conn.sendall(b"NBDMAGIC" + b"IHAVEOPT" + struct.pack(">H", 3))
        self._read(conn, 4)  # the client's flags
        while True:
            _, opt, length = struct.unpack(">QII", self._read(conn, 16))
            self._read(conn, length)
            if opt == 7:  # GO: the export (flags: HAS_FLAGS, SEND_FLUSH), then transmission
                reply(opt, 3, struct.pack(">HQH", 0, self.size, 1 | 4))
                reply(opt, 1)
                return
            ok = opt == 8 and self.structured  # STRUCTURED_REPLY
            reply(opt, 1 if ok else 0x80000001)

    def _session(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, ConnectionError):
            self._handshake(conn)
            n, last_cookie, last_read = 0, 0, b""
            while True:
                self.gate.wait()
                n += 1
                bad = (self.every > 0 and n % self.every == 0 and self.mode != "none"
                       and not (self.limit and self.misbehaved >= self.limit))
                if bad and self.mode == "early":
                    self.misbehaved += 1
                    self._send(conn, simple(last_cookie + 1))
                if bad and self.mode == "stall":
                    self.misbehaved += 1
                    time.sleep(self.stall)
                header = self._read(conn, 28)
                self.gate.wait()  # (held while a request's header was read: not its data)
                magic, _flags, kind, cookie, off, length = REQUEST.unpack(header)
                if magic != REQUEST_MAGIC:
                    return
                last_cookie = cookie
                payload = self._read(conn, length) if kind == CMD_WRITE else b""
                self.requests.append((kind, cookie, off, length))
                if kind == CMD_DISC:
                    return
                reply = self._answer(kind, cookie, off, length, payload)
                if kind == CMD_READ and self.first_read is not None:
                    reply, self.first_read = self.first_read(header[8:16]), None
                if bad and self.mode == "unknown":
                    self.misbehaved += 1
                    self._send(conn, simple(cookie ^ 0x5A5A5A5A00000000))
                if bad and self.mode == "overlap" and kind == CMD_READ and self.structured:
                    self.misbehaved += 1
                    with self.lock:
                        first = bytes(self.data[off:off + length // 2])
                    reply = (data_chunk(cookie, off, first, False)
                             + data_chunk(cookie, off, first, True))
                if bad and self.mode == "stale" and kind == CMD_READ and last_read:
                    self.misbehaved += 1
                    self._send(conn, last_read)
                if bad and self.mode == "split":
                    self.misbehaved += 1
                self._send(conn, reply, split=bad and self.mode == "split")
                if bad and self.mode == "duplicate":
                    self.misbehaved += 1
                    self._send(conn, reply)
                if kind == CMD_READ:
                    last_read = reply

    def _answer(self, kind: int, cookie: int, off: int, length: int, payload: bytes) -> bytes:
        """The correct reply to one request."""
        if kind not in (CMD_READ, CMD_WRITE, CMD_FLUSH, CMD_TRIM, CMD_ZERO) or \
                off + length > self.size:
            return simple(cookie, EINVAL)
        with self.lock:
            if kind == CMD_READ:
                data = bytes(self.data[off:off + length])
            elif kind == CMD_WRITE:
                self.data[off:off + length] = payload
            elif kind in (CMD_TRIM, CMD_ZERO):
                self.data[off:off + length] = bytes(length)
        if kind != CMD_READ:
            return simple(cookie)
        if not self.structured:
            return simple(cookie, 0, data)
        return data_chunk(cookie, off, data, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True, type=Path)
    ap.add_argument("--size", required=True, type=int)
    ap.add_argument("--mode", default="none", choices=MODES)
    ap.add_argument("--every", default=0, type=int)
    ap.add_argument("--limit", default=0, type=int, help="misbehave at most this often")
    ap.add_argument("--simple", action="store_true", help="no structured replies")
    ap.add_argument("--stall", default=1.0, type=float)
    ap.add_argument("--seed", default=0, type=int)
    a = ap.parse_args()
    server = HostileServer(a.socket, a.size, mode=a.mode, every=a.every, limit=a.limit,
                           structured=not a.simple, stall=a.stall, seed=a.seed)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    print(f"misbehaved={server.misbehaved} connections={server.connections}", flush=True)


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    main()
