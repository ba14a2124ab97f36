"""Built-in targets, by the names the CLI and config files use."""

from typing import TYPE_CHECKING

from aioublk._lazy import exports

#: imported on first use: `-t null` need not load librbd (see aioublk._lazy)
_WHERE = {
    "BackingError": "aioublk.io.hostfile",
    "LoopTarget": "aioublk.targets.loop",
    "NbdError": "aioublk.targets.nbd",
    "NbdTarget": "aioublk.targets.nbd",
    "NullTarget": "aioublk.targets.null",
    "RbdError": "aioublk.targets.rbd",
    "RbdTarget": "aioublk.targets.rbd",
    "StripeTarget": "aioublk.targets.stripe",
}

__getattr__, __dir__ = exports(__name__, _WHERE)

if TYPE_CHECKING:
    from aioublk.io.hostfile import BackingError as BackingError
    from aioublk.targets.loop import LoopTarget as LoopTarget
    from aioublk.targets.nbd import NbdError as NbdError
    from aioublk.targets.nbd import NbdTarget as NbdTarget
    from aioublk.targets.null import NullTarget as NullTarget
    from aioublk.targets.rbd import RbdError as RbdError
    from aioublk.targets.rbd import RbdTarget as RbdTarget
    from aioublk.targets.stripe import StripeTarget as StripeTarget

__all__ = sorted(_WHERE)  # (every lazy name, and only those)
