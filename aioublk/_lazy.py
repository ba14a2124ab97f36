"""A package's names, imported when first used (PEP 562).

``import aioublk.frontend.cli`` runs ``aioublk/__init__.py`` first; importing every
target and the qcow2 engine there cost each command seconds of start-up
in an emulated guest, and a user's ``aioublk del`` needs none of it."""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # (typing's would import typing: see aioublk/__init__.py)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any


def _module(name: str) -> Any:
    __import__(name)
    return sys.modules[name]


def exports(package: str, where: Mapping[str, str]) -> tuple[Callable[[str], Any],
                                                            Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for `package`, whose name N lives in
    module ``where[N]``; a name once found is kept in the package."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        try:
            module = where[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
