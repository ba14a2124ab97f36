"""aioublk: Linux ublk block-device servers written as asyncio coroutines."""

from aioublk.dataplane import Extents, Linear, Map, Null, Striped
from aioublk.device import Control, Device
from aioublk.errors import Error
from aioublk.extents import ExtentTable
from aioublk.options import DeviceConfig, UblkError
from aioublk.ring import Ring, current_ring
from aioublk.target import Geometry, Target

__all__ = ["Control", "Device", "DeviceConfig", "Error", "ExtentTable", "Extents", "Geometry",
           "Linear", "Map", "Null", "Ring", "Striped", "Target", "UblkError", "current_ring"]
__version__ = "0.1.0"
