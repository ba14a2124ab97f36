"""The truncate filter: the inner device's first bytes only."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aioublk.dataplane.maps import Map
from aioublk.target import Target
from aioublk.targets.filters.base import Filter, aligned
from aioublk.targets.spec import SIZE, FilterSpec, Option


class TruncateFilter(Filter):
    """Serve the first ``size`` bytes of the inner device."""

    name = "truncate"
    placement = True

    def __init__(self, inner: Target, size: int) -> None:
        g = inner.geometry
        aligned("size", size, g)
        if not 0 < size <= g.size:
            raise ValueError(f"size {size} is larger than the {g.size}-byte inner device: "
                             f"give at most {g.size}")
        self.size = size
        super().__init__(inner)

    def shape(self, geometry: Any) -> Any:
        return replace(geometry, size=self.size)

    def place(self, inner: Map | None) -> Map | None:
        return inner  # the kernel sends nothing past the size

    def settings(self) -> dict[str, object]:
        return {"size": self.size}


SPEC = FilterSpec("truncate", TruncateFilter, "the device's first SIZE bytes", (
    Option("size", SIZE, "bytes to serve", required=True, lo=1),), rank=3)
