"""The log filter: a JSON line per request to a file, rotated by size, as
nbdkit's log filter."""

from __future__ import annotations

import errno
import json
import logging
import logging.handlers
import os
import time
from typing import Any

from aioublk.target import Target
from aioublk.targets.filters.base import Filter
from aioublk.targets.spec import INT, SIZE, STR, FilterSpec, Option


class LogFilter(Filter):
    """One JSON line per request to ``file`` (op, offset, length, latency in
    microseconds, result: 0 or -errno), rotated past ``max_size`` bytes with
    ``keep`` old files (FILE.1 ...), as nbdkit's log filter keeps a record."""

    name = "log"

    def __init__(self, inner: Target, file: str, max_size: int = 0, keep: int = 3) -> None:
        self.file = os.path.abspath(file)
        try:  # opened now: a daemon serves from /, and a mistake is the command's error
            self.handler = logging.handlers.RotatingFileHandler(
                self.file, maxBytes=max_size, backupCount=keep if max_size else 0)
        except OSError as e:
            raise ValueError(f"cannot open {self.file}: {e.strerror}: fix the path") from None
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        super().__init__(inner)

    async def _logged(self, op: str, offset: int, length: int, call: Any) -> Any:
        t0 = time.monotonic()
        result = 0
        try:
            return await call
        except OSError as e:
            result = -(e.errno or errno.EIO)
            raise
        except Exception:
            result = -errno.EIO
            raise
        finally:
            line = json.dumps({"time": round(time.time(), 6), "op": op, "offset": offset,
                               "length": length,
                               "latency_us": round((time.monotonic() - t0) * 1e6),
                               "result": result})
            self.handler.emit(logging.makeLogRecord({"msg": line}))

    async def read(self, offset: int, buf: memoryview) -> None:
        await self._logged("read", offset, len(buf), super().read(offset, buf))

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        await self._logged("write_fua" if fua else "write", offset, len(buf),
                           super().write(offset, buf, fua))

    async def flush(self) -> None:
        await self._logged("flush", 0, 0, super().flush())

    async def discard(self, offset: int, length: int) -> None:
        await self._logged("discard", offset, length, super().discard(offset, length))

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._logged("write_zeroes", offset, length,
                           super().write_zeroes(offset, length, unmap))

    def close(self) -> None:
        self.handler.close()
        super().close()

    def settings(self) -> dict[str, object]:
        return {"file": self.file}


SPEC = FilterSpec(
    "log", LogFilter, "a JSON line per request to FILE (Python serves every request)", (
        Option("file", STR, "the log file (appended to)", required=True),
        Option("max_size", SIZE, "rotate past this many bytes (0: never)", default=0, lo=0),
        Option("keep", INT, "old files kept when rotating", default=3, lo=1)), rank=12)
