"""systemd's notify protocol (sd_notify(3)) without libsystemd, for
``serve`` under a ``Type=notify`` unit.

- A message is one datagram of ``KEY=value`` lines on an AF_UNIX
  SOCK_DGRAM socket to ``$NOTIFY_SOCKET``; a leading ``@`` there names the
  abstract namespace. Without ``$NOTIFY_SOCKET`` every call does nothing.
- Telling systemd is never worth failing the service for: the first error
  sending is logged (a warning), later ones are not, and none is raised.
  The socket is non-blocking, so a manager that does not read never stalls
  the event loop: if the socket's queue is full (net.unix.max_dgram_qlen
  datagrams) the message is lost instead, which a manager reading as
  messages come never lets happen.
- The watchdog is ours when ``$WATCHDOG_USEC`` is a positive number and
  ``$WATCHDOG_PID`` is unset or our pid (sd_watchdog_enabled(3)); systemd
  documents pinging at half that interval.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping

from aioublk import logs

log = logs.get_logger("aioublk.notify")


class Notifier:
    """Sends sd_notify messages to the socket ``env`` names (os.environ by
    default); a no-op when it names none."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.socket_name = env.get("NOTIFY_SOCKET", "")
        self.address = _address(self.socket_name)
        self._sock: socket.socket | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> None:
        """One datagram of ``fields`` (``"READY=1"``, ``"STATUS=..."``)."""
        if self.address is None or not fields:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX,
                                           socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("cannot notify systemd; carrying on without it",
                            socket=self.socket_name, error=str(e))

    def status(self, text: str) -> None:
        self.send(f"STATUS={' '.join(text.split())}")  # one line: STATUS ends at a newline

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _address(value: str) -> str | bytes | None:
    """The socket address ``$NOTIFY_SOCKET`` names; None for none, or for
    a kind this module does not speak (vsock:, relative paths)."""
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    if value:
        log.warning("NOTIFY_SOCKET is neither an absolute path nor @abstract; not notifying",
                    socket=value)
    return None


def watchdog_interval(env: Mapping[str, str] | None = None,
                      pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``$WATCHDOG_USEC``), or
    None when no watchdog is set for this process (``pid``, ours by default)."""
    env = os.environ if env is None else env
    pid = os.getpid() if pid is None else pid
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
        owner = int(env.get("WATCHDOG_PID") or pid)
    except ValueError:
        return None
    if usec <= 0 or owner != pid:
        return None
    return usec / 2e6


async def keep_alive(notifier: Notifier, interval: float) -> None:
    """Ping the watchdog every ``interval`` seconds until cancelled: the
    pings stop when the event loop stops turning, which is the point."""
    while True:
        notifier.send("WATCHDOG=1")
        await asyncio.sleep(interval)


class Service:
    """What ``serve`` tells systemd, in its order: ``starting`` (STATUS),
    ``serving`` once every device is LIVE (READY=1, then the watchdog pings
    until ``close``), ``stopping`` when a stop signal arrives (STOPPING=1,
    before the drain; the pings go on through it, which may be long)."""

    def __init__(self, env: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        self.notifier = Notifier(env)
        self.interval = watchdog_interval(env, pid) if self.notifier.enabled else None
        self._pings: asyncio.Task[None] | None = None

    def starting(self, devices: int) -> None:
        self.notifier.status(f"starting {devices} device{'s' if devices != 1 else ''}")

    def serving(self, names: list[str]) -> None:
        """READY=1; call it on the event loop the pings are to come from."""
        self.notifier.send("READY=1", f"STATUS=serving: {' '.join(names)}")
        if self.interval is not None and self._pings is None:
            self._pings = asyncio.ensure_future(keep_alive(self.notifier, self.interval))

    def stopping(self) -> None:
        self.notifier.send("STOPPING=1", "STATUS=stopping")

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pings is not None:
            self._pings.cancel()
            self._pings = None
        self.notifier.close()
