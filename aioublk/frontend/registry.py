"""The built-in targets and filters, by the names the command line and
config files use: each declared once, beside its class (a module-level
``SPEC`` in ``aioublk.targets`` or ``aioublk.targets.filters``, see
``aioublk.targets.spec``), and found here by scanning those packages.

``add``'s target flags and help (made in ``addargs``), ``--filter``, the config
file's ``[devices.options]`` and ``filters`` checks and the documentation are all
made from ``TARGETS`` and ``FILTERS``.
"""

from __future__ import annotations

from aioublk.targets.spec import FilterSpec, TargetSpec, discover

TARGETS: dict[str, TargetSpec] = discover("aioublk.targets", TargetSpec)
FILTERS: dict[str, FilterSpec] = discover("aioublk.targets.filters", FilterSpec)
