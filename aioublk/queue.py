"""The names this module held before the queue layer was split, for code
that imports them from here (nothing in aioublk does): the copy modes and
``layout`` are in ``options``, the driver core in ``driver``, the drivers in
``perio`` and ``batch``, the workers in ``worker``, ``queue_ring_flags`` in
``ring``."""

from aioublk.batch import BatchDriver
from aioublk.driver import Driver, IoPath, QueueMem, QueueStats, WorkerSpec, serve_request
from aioublk.options import CopyMode, layout
from aioublk.perio import PerIoDriver
from aioublk.ring import queue_ring_flags
from aioublk.worker import Worker

__all__ = ["BatchDriver", "CopyMode", "Driver", "IoPath", "PerIoDriver", "QueueMem",
           "QueueStats", "Worker", "WorkerSpec", "layout", "queue_ring_flags", "serve_request"]
