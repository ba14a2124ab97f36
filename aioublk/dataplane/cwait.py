"""C owns the worker's wait (``aur_dp_own_wait``, see csrc/uvhook.c).

The data plane hooks the worker's uvloop loop through libuv itself: a
prepare handle, run just before the loop would sleep, in which C sleeps in
its ring instead, for exactly as long as the loop would have. This module
finds what C needs: uvloop's ``uv_loop_t`` and the libuv functions its
extension exports. Neither is public API, so each step is checked, and a
loop that does not match (another event loop, another uvloop layout) keeps
the older way: C polls for a slice inside each reap.

``AIOUBLK_OWN_WAIT=0`` in a server's environment keeps the older way on
every loop, to compare the two (``bench.mixed``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from typing import Any

from aioublk import logs
from aioublk._uring import ffi, lib

log = logs.get_logger("aioublk.dataplane.cwait")

#: where uvloop's Loop keeps its ``uv_loop_t *``: after the object header and
#: the Cython vtable pointer (uvloop/loop.pxd: ``uvloop`` is its first field)
_UV_LOOP_OFFSET = 24
#: the libuv functions C calls (struct aur_uv's fields, each ``uv_`` + name)
_FUNCS = ("handle_size", "prepare_init", "prepare_start", "prepare_stop", "close",
          "backend_fd", "backend_timeout", "update_time")


@functools.cache
def _libuv() -> ctypes.CDLL | None:
    """uvloop's extension, whose libuv symbols C calls (already loaded: this
    only finds them)."""
    try:
        import uvloop.loop
        return ctypes.CDLL(uvloop.loop.__file__)
    except (ImportError, OSError):
        return None


def _peek(addr: int) -> int | None:
    """The pointer at ``addr``, read through /proc/self/mem: an address that
    is not mapped answers None instead of crashing the process."""
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.pread(fd, 8, addr)
    except OSError:
        return None
    finally:
        os.close(fd)
    return struct.unpack("=Q", raw)[0] if len(raw) == 8 else None


def uv_loop_of(loop: Any) -> int | None:
    """The address of ``loop``'s ``uv_loop_t`` if it is a uvloop loop laid out
    as expected: its ``data`` field points back at the loop."""
    try:
        import uvloop
    except ImportError:
        return None
    if not isinstance(loop, uvloop.Loop):
        return None
    ptr = ctypes.c_void_p.from_address(id(loop) + _UV_LOOP_OFFSET).value
    if not ptr or _peek(ptr) != id(loop):
        return None
    return ptr


def hand_wait_to_c(dp: Any, loop: Any) -> bool:
    """Let data plane ``dp`` own the wait of ``loop``'s thread; False (and the
    older way) when the loop is not one C can hook."""
    if os.environ.get("AIOUBLK_OWN_WAIT") == "0":
        log.debug("C does not own the loop's wait: AIOUBLK_OWN_WAIT=0")
        return False
    so = _libuv()
    uv_loop = uv_loop_of(loop)
    if so is None or uv_loop is None:
        log.debug("C cannot own this loop's wait: not a uvloop loop it can read")
        return False
    uv = ffi.new("struct aur_uv *")
    uv.loop = ffi.cast("void *", uv_loop)
    for field in _FUNCS:
        fn = getattr(so, "uv_" + field, None)
        if fn is None:
            return False
        setattr(uv, field, ffi.cast("void *", ctypes.cast(fn, ctypes.c_void_p).value))
    ret = lib.aur_dp_own_wait(dp, uv)
    if ret < 0:
        log.debug("C cannot own this loop's wait", error=os.strerror(-ret))
        return False
    return True
