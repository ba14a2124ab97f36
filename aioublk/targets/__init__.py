"""Built-in targets, by the names the CLI and config files use.

Each is a module here holding its class and, beside it, its ``SPEC`` (an
``aioublk.targets.spec.TargetSpec``); the filters are in ``filters/``. A
target module added here is found by name: ``aioublk.targets.ItsClass``
imports it, as the command line and config files find its ``SPEC``.
"""

from typing import TYPE_CHECKING, Any

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

_listed, __dir__ = exports(__name__, _WHERE)


def __getattr__(name: str) -> Any:
    """A name of ``_WHERE``, or the class of a target found by its ``SPEC``."""
    if name in _WHERE or not name[:1].isupper():  # (modules: the import system's)
        return _listed(name)
    from aioublk.targets.spec import TargetSpec, discover

    for spec in discover(__name__, TargetSpec).values():
        if spec.cls.__name__ == name:
            globals()[name] = spec.cls
            return spec.cls
    return _listed(name)  # (raises AttributeError)


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
