"""What a built-in target or filter declares beside its class: its name, its
options (type, default, help, command-line flags, config key, bounds) and,
for a target, which option the command line's FILE arguments fill.

A module of ``aioublk.targets`` holding a module-level ``SPEC =
TargetSpec(...)`` is a built-in target; one of ``aioublk.targets.filters``
holding ``SPEC = FilterSpec(...)`` is a built-in filter. ``discover`` finds
them, and ``add``'s flags and help, ``--filter``, the config file's checks,
``aioublk.targets``' names and the documentation are all made from what it
finds: a new target or filter is one file. Discovering imports each module,
so a module keeps heavy libraries (librbd, libnbd) to the functions that
need them.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from aioublk.target import Target

#: the option types: how a value is checked and how the command line reads it
SIZE, INT, BOOL, PATH, PATHS, CHOICE, STR = "size", "int", "bool", "path", "paths", "choice", "str"
#: filters' too: seconds (from "50ms", "2s", "100us" or a number of seconds), a fraction
DURATION, FLOAT, RANGES = "duration", "float", "ranges"


@dataclass(frozen=True)
class Option:
    """One option of a built-in target or filter."""

    key: str                      # the config key (also ``--opt KEY=VALUE``)
    type: str                     # SIZE, INT, BOOL, PATH, PATHS, CHOICE or STR
    help: str
    default: Any = None           # what the target does without it (None: see help)
    default_help: str = ""        # the default as --help says it, if it says it
    flags: tuple[str, ...] = ()   # command-line spellings; none: config and --opt only
    arg: str = ""                 # the constructor's keyword ("": key; "*": positional)
    negate: bool = False          # the constructor's keyword means the opposite
    lo: int | None = None         # bounds: of the value, or of a PATHS list's length
    hi: int | None = None
    choices: tuple[str, ...] = ()
    power_of_two: bool = False
    sectors: bool = False         # a SIZE in whole 512-byte sectors
    distinct: bool = False        # PATHS: no path twice
    required: bool = False
    what: str = ""                # PATH/PATHS: what the file is ("backing file", "image")
    zero_one: bool = False        # a BOOL flag written "--flag 0|1" (kublk), not "--flag"

    @property
    def flag(self) -> str:
        """The spelling messages name: the first flag, else ``--opt KEY``."""
        return self.flags[0] if self.flags else f"--opt {self.key}"


#: options several targets share: a device size, and buffered backing files
DEVICE_SIZE = Option("size", SIZE, "bytes the device serves", default=250 << 30,
                     default_help="250G", flags=("-s", "--size"), lo=512, sectors=True)
BUFFERED = Option("buffered", BOOL, "do not use O_DIRECT on the backing files", default=False,
                  flags=("--buffered",), arg="direct", negate=True)


@dataclass(frozen=True)
class TargetSpec:
    """A built-in target: its name (``-t NAME``, a config's ``target``), its
    class and options. ``rank`` orders the listings (help, docs, messages):
    lower first, equal ranks by name."""

    name: str
    cls: type[Target]
    options: tuple[Option, ...]
    files: str = ""               # the option FILE arguments fill ("": none)
    second_file: str = ""         # the option a second FILE fills (loop: integrity metadata)
    read_only: bool = False       # the constructor takes read_only=
    rank: int = 100

    def option(self, key: str) -> Option | None:
        return next((o for o in self.options if o.key == key), None)

    def keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.options)

    def target_class(self) -> type[Target]:
        return self.cls

    def build(self, options: dict[str, Any], read_only: bool = False) -> Target:
        """The target from checked ``options`` (those absent: the class's defaults)."""
        args: list[Any] = []
        kwargs: dict[str, Any] = {"read_only": read_only} if self.read_only else {}
        for o in self.options:
            if o.key not in options:
                continue
            value = options[o.key]
            value = not value if o.negate else list(value) if o.type == PATHS else value
            if o.arg == "*":
                args.append(value)
            else:
                kwargs[o.arg or o.key] = value
        return self.cls(*args, **kwargs)


@dataclass(frozen=True)
class FilterSpec:
    """A built-in filter (``--filter NAME``, a config's ``filters``): its
    class, built over the next layer, its help and options; ``rank`` as a
    target's."""

    name: str
    cls: type[Target]
    help: str
    options: tuple[Option, ...] = ()
    rank: int = 100

    def option(self, key: str) -> Option | None:
        return next((o for o in self.options if o.key == key), None)

    def keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.options)

    def build(self, inner: Target, options: dict[str, Any]) -> Target:
        """This filter over ``inner``, from checked ``options``."""
        cls: Any = self.cls
        layer: Target = cls(inner, **{o.arg or o.key: options[o.key] for o in self.options
                                      if o.key in options})
        return layer


Spec = TypeVar("Spec", TargetSpec, FilterSpec)


def discover(package: str, kind: type[Spec]) -> dict[str, Spec]:
    """The ``SPEC`` of each module of ``package`` that declares one of
    ``kind``, by name, in listing order; modules named ``_...`` and
    subpackages are passed over."""
    found: dict[str, Spec] = {}
    for m in pkgutil.iter_modules(importlib.import_module(package).__path__, f"{package}."):
        if m.ispkg or m.name.rpartition(".")[2].startswith("_"):
            continue
        spec = getattr(importlib.import_module(m.name), "SPEC", None)
        if not isinstance(spec, kind):
            continue
        if spec.name in found:
            raise ImportError(f"{m.name} declares the {spec.name!r} that "
                              f"{found[spec.name].cls.__module__} declares: rename one")
        found[spec.name] = spec
    return dict(sorted(found.items(), key=lambda item: (item[1].rank, item[0])))
