"""The error filter: requests failed with an errno (or never answered),
by chance, operation and byte range, as nbdkit's error filter."""

from __future__ import annotations

import errno
import random
import threading
from collections.abc import Callable, Iterable

from aioublk.dataplane import crossloop
from aioublk.target import Target
from aioublk.targets.filters.base import OPS, Filter
from aioublk.targets.spec import BOOL, FLOAT, INT, SIZE, STR, FilterSpec, Option


class ErrorFilter(Filter):
    """Fail requests with ``errno`` (a name, e.g. "EIO"): those of the operations
    in ``ops`` ("+"-separated, default all of ``OPS``) that touch
    ``[offset, offset + length)`` (default: the whole device), each with
    probability ``rate``, as nbdkit's error filter. Zone operations pass.

    With ``hang`` such a request is never answered, to see what the kernel
    does with one: on an unprivileged device its request timeout kills the
    server (``/sys/block/ublkbN/queue/io_timeout``); on a privileged one the
    request waits until the server stops, which fails it with ``errno``."""

    name = "error"

    def __init__(self, inner: Target, rate: float = 1.0, ops: str = "+".join(OPS),
                 errno: str = "EIO", offset: int = 0, length: int | None = None,
                 seed: int | None = None, hang: bool = False) -> None:
        self.ops = _ops(ops.split("+"))
        if not 0 <= rate <= 1:
            raise ValueError(f"rate {rate} is not between 0 and 1: give e.g. 0.1")
        self.rate, self.errno_name, self.hang = rate, errno, hang
        self.code = _errno(errno)
        self.start = offset
        self.end = offset + length if length is not None else 1 << 64
        self.random = random.Random(seed)
        # wakes of the requests ``hang`` holds, on their queues' loops; None: stopping
        self._held: set[Callable[[], None]] | None = set()
        self._lock = threading.Lock()
        super().__init__(inner)

    def _matches(self, op: str, offset: int = 0, length: int = 1 << 64) -> bool:
        return op in self.ops and offset < self.end and offset + length > self.start and (
            self.rate >= 1 or self.random.random() < self.rate)

    async def _fail(self, op: str) -> None:
        """Fail a matching request, with ``hang`` once the server stops."""
        if self.hang:
            held_until, wake = crossloop.waiter()
            with self._lock:
                held = self._held
                if held is not None:
                    held.add(wake)
            if held is not None:  # (else the server is stopping: fail it now)
                try:
                    await held_until
                finally:
                    with self._lock:
                        held.discard(wake)
        raise OSError(self.code, f"error filter: {op} fails with {self.errno_name}")

    def configure(self, device_flags: int) -> None:
        with self._lock:  # (served again, e.g. recovered: hold again)
            if self._held is None:
                self._held = set()
        super().configure(device_flags)

    def stopping(self) -> None:
        with self._lock:
            held, self._held = list(self._held or ()), None
        for wake in held:
            wake()
        super().stopping()

    async def read(self, offset: int, buf: memoryview) -> None:
        if self._matches("read", offset, len(buf)):
            await self._fail("read")
        await super().read(offset, buf)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        if self._matches("write", offset, len(buf)):
            await self._fail("write")
        await super().write(offset, buf, fua)

    async def flush(self) -> None:
        if self._matches("flush"):
            await self._fail("flush")
        await super().flush()

    async def discard(self, offset: int, length: int) -> None:
        if self._matches("discard", offset, length):
            await self._fail("discard")
        await super().discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        if self._matches("write_zeroes", offset, length):
            await self._fail("write_zeroes")
        await super().write_zeroes(offset, length, unmap)

    def settings(self) -> dict[str, object]:
        return {"rate": self.rate, "ops": "+".join(sorted(self.ops)), "errno": self.errno_name,
                "offset": self.start,
                "length": None if self.end == 1 << 64 else self.end - self.start,
                **({"hang": True} if self.hang else {})}


def _ops(names: Iterable[str]) -> frozenset[str]:
    ops = frozenset(n.strip() for n in names if n.strip())
    unknown = sorted(ops - set(OPS))
    if unknown or not ops:
        raise ValueError(f"ops {'+'.join(unknown) or '(none)'}: use some of "
                         f"{'+'.join(OPS)}")
    return ops


def _errno(name: str) -> int:
    code = getattr(errno, name.upper(), None)
    if not isinstance(code, int) or not name.upper().startswith("E"):
        raise ValueError(f"errno {name!r} is no errno name: give e.g. EIO or ENOSPC")
    return code


SPEC = FilterSpec(
    "error", ErrorFilter, "fail requests with an errno (Python serves every request)", (
        Option("rate", FLOAT, "the chance a matching request fails", default=1.0, lo=0, hi=1),
        Option("ops", STR, "the operations that fail, joined by +",
               default="read+write+flush+discard+write_zeroes"),
        Option("errno", STR, "the error returned", default="EIO"),
        Option("offset", SIZE, "fail requests touching bytes from here", default=0, lo=0),
        Option("length", SIZE, "... this many (default: to the end)", lo=1),
        Option("seed", INT, "the random sequence's seed (default: random)"),
        Option("hang", BOOL, "never answer a matching request instead (an unprivileged "
               "device's io_timeout then kills the server; a privileged one's waits until "
               "the server stops, which fails it)", default=False)), rank=6)
