"""A QEMU-compatible qcow2 engine on coroutines: usable on its own (open an
image, read/write/discard/flush at byte offsets on a Ring) and as the ublk
``qcow2`` target (``aioublk.targets.qcow2``)."""

from aioublk.qcow2.format import Qcow2Error
from aioublk.qcow2.image import Qcow2Image

__all__ = ["Qcow2Error", "Qcow2Image"]
