"""aioublk: Linux ublk block-device servers written as asyncio coroutines."""

from aioublk.device import Control, Device, DeviceConfig, UblkError
from aioublk.ring import Ring, current_ring
from aioublk.target import Geometry, Target

__all__ = ["Control", "Device", "DeviceConfig", "Geometry", "Ring", "Target", "UblkError",
           "current_ring"]
__version__ = "0.1.0"
