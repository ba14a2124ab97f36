"""Built-in targets, by the names the CLI and config files use."""

from aioublk.targets.backing import BackingError
from aioublk.targets.loop import LoopTarget
from aioublk.targets.nbd import NbdError, NbdTarget
from aioublk.targets.null import NullTarget
from aioublk.targets.rbd import RbdError, RbdTarget
from aioublk.targets.stripe import StripeTarget

__all__ = ["BackingError", "LoopTarget", "NbdError", "NbdTarget", "NullTarget", "RbdError",
           "RbdTarget", "StripeTarget"]
