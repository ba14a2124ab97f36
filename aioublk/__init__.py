"""aioublk: Linux ublk block-device servers written as asyncio coroutines.

Every name an application needs is here: the device and its options, the
target base class and its buffers, the data-plane maps, the ring, the
built-in targets, the qcow2 engine, and ``Error`` with its subclasses."""

from aioublk._lazy import exports
from aioublk._version import __version__ as __version__

#: where each exported name lives; imported on first use (see aioublk._lazy)
_WHERE = {
    "ConfigError": "aioublk.frontend.config",
    "Extents": "aioublk.dataplane.maps",
    "Linear": "aioublk.dataplane.maps",
    "Map": "aioublk.dataplane.maps",
    "Null": "aioublk.dataplane.maps",
    "Striped": "aioublk.dataplane.maps",
    "Control": "aioublk.kernel.control",
    "Device": "aioublk.device",
    "Error": "aioublk.errors",
    "ExtentConflict": "aioublk.dataplane.extents",
    "ExtentTable": "aioublk.dataplane.extents",
    "InUse": "aioublk.io.locking",
    "LockFailed": "aioublk.io.locking",
    "LogFileError": "aioublk.logs",
    "MetricsError": "aioublk.frontend.metrics",
    "CopyMode": "aioublk.queue.options",
    "DeviceConfig": "aioublk.queue.options",
    "DeviceOptions": "aioublk.queue.options",
    "IntegrityError": "aioublk.queue.options",
    "OptionError": "aioublk.queue.options",
    "UblkError": "aioublk.errors",
    "Qcow2Error": "aioublk.qcow2.format",
    "Qcow2Image": "aioublk.qcow2.image",
    "Ring": "aioublk.ring",
    "current_ring": "aioublk.ring",
    "RunDirError": "aioublk.frontend.stats",
    "Buffer": "aioublk.target",
    "Done": "aioublk.target",
    "FixedBuf": "aioublk.target",
    "Geometry": "aioublk.target",
    "GeometryError": "aioublk.target",
    "QueueContext": "aioublk.target",
    "QueueSetupError": "aioublk.target",
    "Target": "aioublk.target",
    "current_queue": "aioublk.target",
    "BackingError": "aioublk.io.hostfile",
    "Filter": "aioublk.targets.filters.base",
    "LoopTarget": "aioublk.targets.loop",
    "NbdError": "aioublk.targets.nbd",
    "NullTarget": "aioublk.targets.null",
    "RbdError": "aioublk.targets.rbd",
    "StripeTarget": "aioublk.targets.stripe",
    "NvmeError": "aioublk.targets.nvme",
    "Qcow2Target": "aioublk.targets.qcow2",
    "ZonedError": "aioublk.targets.zoned",
    "ZonedTarget": "aioublk.targets.zoned",
}

__getattr__, __dir__ = exports(__name__, _WHERE)

# (not typing's: importing typing brings re, collections and functools into
# every command, ``--version`` included; mypy reads any TYPE_CHECKING as true)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from aioublk.dataplane.extents import ExtentConflict as ExtentConflict
    from aioublk.dataplane.extents import ExtentTable as ExtentTable
    from aioublk.dataplane.maps import Extents as Extents
    from aioublk.dataplane.maps import Linear as Linear
    from aioublk.dataplane.maps import Map as Map
    from aioublk.dataplane.maps import Null as Null
    from aioublk.dataplane.maps import Striped as Striped
    from aioublk.device import Device as Device
    from aioublk.errors import Error as Error
    from aioublk.errors import UblkError as UblkError
    from aioublk.frontend.config import ConfigError as ConfigError
    from aioublk.frontend.metrics import MetricsError as MetricsError
    from aioublk.frontend.stats import RunDirError as RunDirError
    from aioublk.io.hostfile import BackingError as BackingError
    from aioublk.io.locking import InUse as InUse
    from aioublk.io.locking import LockFailed as LockFailed
    from aioublk.kernel.control import Control as Control
    from aioublk.logs import LogFileError as LogFileError
    from aioublk.qcow2.format import Qcow2Error as Qcow2Error
    from aioublk.qcow2.image import Qcow2Image as Qcow2Image
    from aioublk.queue.options import CopyMode as CopyMode
    from aioublk.queue.options import DeviceConfig as DeviceConfig
    from aioublk.queue.options import DeviceOptions as DeviceOptions
    from aioublk.queue.options import IntegrityError as IntegrityError
    from aioublk.queue.options import OptionError as OptionError
    from aioublk.ring import Ring as Ring
    from aioublk.ring import current_ring as current_ring
    from aioublk.target import Buffer as Buffer
    from aioublk.target import Done as Done
    from aioublk.target import FixedBuf as FixedBuf
    from aioublk.target import Geometry as Geometry
    from aioublk.target import GeometryError as GeometryError
    from aioublk.target import QueueContext as QueueContext
    from aioublk.target import QueueSetupError as QueueSetupError
    from aioublk.target import Target as Target
    from aioublk.target import current_queue as current_queue
    from aioublk.targets.filters.base import Filter as Filter
    from aioublk.targets.loop import LoopTarget as LoopTarget
    from aioublk.targets.nbd import NbdError as NbdError
    from aioublk.targets.null import NullTarget as NullTarget
    from aioublk.targets.nvme import NvmeError as NvmeError
    from aioublk.targets.qcow2 import Qcow2Target as Qcow2Target
    from aioublk.targets.rbd import RbdError as RbdError
    from aioublk.targets.stripe import StripeTarget as StripeTarget
    from aioublk.targets.zoned import ZonedError as ZonedError
    from aioublk.targets.zoned import ZonedTarget as ZonedTarget

__all__ = sorted(_WHERE)  # (every lazy name, and only those)
