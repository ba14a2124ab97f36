"""aioublk: Linux ublk block-device servers written as asyncio coroutines.

Every name an application needs is here: the device and its options, the
target base class and its buffers, the data-plane maps, the ring, the
built-in targets, the qcow2 engine, and ``Error`` with its subclasses."""

from aioublk._version import __version__ as __version__
from aioublk.config import ConfigError
from aioublk.dataplane import Extents, Linear, Map, Null, Striped
from aioublk.device import Control, Device
from aioublk.errors import Error
from aioublk.extents import ExtentConflict, ExtentTable
from aioublk.locking import InUse, LockFailed
from aioublk.logs import LogFileError
from aioublk.metrics import MetricsError
from aioublk.options import CopyMode, DeviceConfig, IntegrityError, UblkError
from aioublk.qcow2 import Qcow2Error, Qcow2Image
from aioublk.ring import Ring, current_ring
from aioublk.stats import RunDirError
from aioublk.target import (
    Buffer,
    Done,
    FixedBuf,
    Geometry,
    QueueContext,
    QueueSetupError,
    Target,
    current_queue,
)
from aioublk.targets import (
    BackingError,
    LoopTarget,
    NbdError,
    NullTarget,
    RbdError,
    StripeTarget,
)
from aioublk.targets.nvme import NvmeError
from aioublk.targets.qcow2 import Qcow2Target
from aioublk.targets.zoned import ZonedError, ZonedTarget

__all__ = [
    # devices
    "Control", "CopyMode", "Device", "DeviceConfig",
    # targets
    "Buffer", "Done", "FixedBuf", "Geometry", "QueueContext", "Target", "current_queue",
    "LoopTarget", "NullTarget", "Qcow2Target", "StripeTarget", "ZonedTarget",
    # the data plane
    "ExtentTable", "Extents", "Linear", "Map", "Null", "Striped",
    # I/O
    "Ring", "current_ring",
    # qcow2 without ublk
    "Qcow2Image",
    # errors
    "BackingError", "ConfigError", "Error", "ExtentConflict", "InUse", "IntegrityError",
    "LockFailed", "LogFileError", "MetricsError", "NbdError", "NvmeError", "Qcow2Error",
    "QueueSetupError", "RbdError", "RunDirError", "UblkError", "ZonedError",
]
