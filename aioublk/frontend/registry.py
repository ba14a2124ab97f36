"""The built-in targets and filters, by the names the command line and
config files use, and how a target and its filter stack are built from
checked options.

Each built-in is declared once, beside its class (a module-level ``SPEC``
in ``aioublk.targets`` or ``aioublk.targets.filters``, see
``aioublk.targets.spec``), and found here by scanning those packages.
``add``'s target flags and help (made in ``addargs``), ``--filter``, the config file's
``[devices.options]`` and ``filters`` checks and the documentation are all
made from ``TARGETS`` and ``FILTERS``. A target outside them is a
``pkg.module:Class``, or a name an installed package offers through the
``aioublk.targets`` entry-point group; its options are checked against its
constructor.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from typing import Any

from aioublk.errors import UblkError
from aioublk.frontend.values import (
    Invalid,
    check_known,
    check_option,
    check_size,
    check_str,
    check_table,
    did_you_mean,
    kind_of,
    one_line,
    show,
    toml_value,
)
from aioublk.io import locking
from aioublk.target import Target
from aioublk.targets import spec as decl
from aioublk.targets.spec import FilterSpec, TargetSpec, discover

TARGETS: dict[str, TargetSpec] = discover("aioublk.targets", TargetSpec)
FILTERS: dict[str, FilterSpec] = discover("aioublk.targets.filters", FilterSpec)


def build_target(kind: str, options: dict[str, Any], *, read_only: bool = False,
                 force_share: bool = False) -> Target:
    """The target ``kind`` ("loop", ..., or "pkg.module:Class") made from
    checked ``options`` (sizes in bytes), its files locked as QEMU locks
    them (``force_share``: read-only, sharing with writers). Raises the
    target's own errors (BackingError, Qcow2Error, UblkError, OSError...)."""
    if force_share and not read_only:
        raise UblkError("force_share needs read_only: a writer never shares its files")
    with locking.force_share(force_share):
        return _build_target(kind, options, read_only)


def _build_target(kind: str, options: dict[str, Any], read_only: bool) -> Target:
    spec = TARGETS.get(kind)
    if spec is not None:
        return spec.build(options, read_only)
    if ":" in kind:
        try:
            return _custom_class(kind)(**options)
        except (TypeError, ValueError) as e:  # the target's own checks, in one line
            shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
            raise UblkError(f"{kind}({shown}) failed: {type(e).__name__}: {e}: check its "
                            "options") from None
    raise UblkError(f"unknown target type '{kind}': use one of {', '.join(TARGETS)} "
                    "or pkg.module:Class")


def target_options(kind: str, raw: dict[str, Any], *, at: str, base: str) -> dict[str, Any]:
    """``raw`` options of the target ``kind`` checked as a config's are, for
    the command line (``at`` is "--opt"): a built-in target's FILE may
    come as an argument instead, so none of its options is required.
    Raises UblkError, the command line's one-line error: "--opt KEY: problem: remedy"."""
    try:
        return check_options(kind, raw, at, base, partial=True)
    except Invalid as e:
        raise UblkError(one_line(str(e)).replace(f"{at}.", f"{at} ", 1)) from None


def check_options(kind: str, raw: Any, at: str, base: str, partial: bool = False) -> dict[str, Any]:
    """A target's options checked as its declaration (a custom class: its
    constructor) says; ``partial``: none required. Raises Invalid."""
    check_table(raw, at)
    if ":" in kind:
        return _custom_options(kind, raw, at)
    spec = TARGETS[kind]
    check_known(raw, at, spec.keys())
    out: dict[str, Any] = {}
    for o in spec.options:
        if o.key in raw:
            out[o.key] = check_option(o, raw[o.key], f"{at}.{o.key}", base, kind)
        elif o.required and not partial:
            need = (f"a list of {o.lo} to {o.hi} {o.what}s" if o.type == decl.PATHS
                    else f"the path of its {o.what}" if o.type == decl.PATH
                    else f"its {o.what}")
            raise Invalid(f"{at}.{o.key}", f"missing: the {kind} target needs {need}")
    return out


def parse_filters(raw: Any, at: str, base: str = "") -> list[tuple[str, dict[str, Any]]]:
    """A filter stack, outermost first, from "NAME[:KEY=VALUE,...]" strings
    (``--filter``, a config's ``filters``), each option checked as its
    declaration says; raises Invalid."""
    if not isinstance(raw, list):
        raise Invalid(at, f"{show(raw)} is {kind_of(raw)}: use a list of \"NAME[:KEY=VALUE,"
                      "...]\" strings, outermost first")
    out = []
    for i, item in enumerate(raw):
        where = f"{at}[{i}]"
        text = check_str(item, where)
        name, _, rest = text.partition(":")
        name = name.strip()
        if at == "--filter":  # the command line's: name the flag as given
            where = f"--filter {text}"
        spec = FILTERS.get(name)
        if spec is None:
            raise Invalid(where, f"unknown filter {name!r}{did_you_mean(name, FILTERS)}"
                          f": use one of {', '.join(FILTERS)}")
        values: dict[str, Any] = {}
        for pair in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = pair.partition("=")
            if not eq:
                raise Invalid(where, f"{pair!r} is not KEY=VALUE: write e.g. "
                              f"{name}:{spec.keys()[0] if spec.options else 'KEY'}=VALUE")
            values[key.strip()] = toml_value(value.strip())
        where = f"--filter {name}" if at == "--filter" else f"{where}.{name}"
        check_known(values, where, spec.keys())
        checked = {}
        for o in spec.options:
            if o.key in values:
                checked[o.key] = check_option(o, values[o.key], f"{where}.{o.key}", base, name)
            elif o.required:
                raise Invalid(f"{where}.{o.key}", f"missing: the {name} filter needs it "
                              f"({o.help})")
        out.append((name, checked))
    return out


def filter_stack(specs: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """``--filter`` values checked (``parse_filters``); raises UblkError (one line)."""
    try:
        return parse_filters(specs, "--filter")
    except Invalid as e:
        raise UblkError(one_line(str(e))) from None


def with_filters(target: Target, filters: list[tuple[str, dict[str, Any]]]) -> Target:
    """``target`` under the checked filter stack (outermost first); a filter
    that refuses its options closes the target and raises UblkError (one line)."""
    for name, options in reversed(filters):
        try:
            target = FILTERS[name].build(target, options)
        except ValueError as e:
            target.close()
            raise UblkError(f"filter {name}: {e}") from None
    return target


def _custom_options(kind: str, raw: dict[str, Any], at: str) -> dict[str, Any]:
    """Passed through as keyword arguments; checked against the constructor."""
    cls = _custom_class(kind)
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return dict(raw)  # no signature to check against (a C type, say)
    params = sig.parameters
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        check_known(raw, at, named)
    for n in named:
        if params[n].default is params[n].empty and n not in raw:
            raise Invalid(f"{at}.{n}", f"missing: {kind} needs it")
    try:
        sig.bind(**raw)
    except TypeError as e:
        raise Invalid(at, f"{e}: match {kind}'s keyword arguments") from None
    return _sized(cls, raw, at)


def _sized(cls: type, raw: dict[str, Any], at: str) -> dict[str, Any]:
    """A string given for an ``int`` argument is a size ("64M"), as sizes
    are everywhere else: the command line's ``--opt`` reads "64M" as a
    string, and a config may quote one."""
    try:
        hints = typing.get_type_hints(cls.__init__)  # type: ignore[misc]
    except Exception:  # noqa: BLE001 - unresolvable annotations: nothing to go by
        return dict(raw)
    out = dict(raw)
    for name, v in raw.items():
        if hints.get(name) is int and isinstance(v, str):
            out[name] = check_size(v, f"{at}.{name}", 0)
    return out


#: the entry-point group through which an installed package offers targets by name
ENTRY_POINTS = "aioublk.targets"


def packaged_target(name: str) -> str | None:
    """"module:Class" of the target an installed package offers as ``name``
    (its ``aioublk.targets`` entry point), or None."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS, name=name):
        return str(ep.value)
    return None


def packaged_targets() -> list[str]:
    """The names installed packages offer targets under."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=ENTRY_POINTS)})


def target_kind(v: Any, at: str) -> str:
    """A config's ``target``: a built-in's name, or the "module:Class" that a
    packaged target's name or the value itself names, imported. Raises Invalid."""
    kind = check_str(v, at)
    if kind in TARGETS:
        return kind
    if ":" not in kind and (value := packaged_target(kind)) is not None:
        kind = value  # (checked as the module:Class it names)
    if ":" in kind:
        try:
            _custom_class(kind)
        except UblkError as e:
            raise Invalid(at, str(e)) from None
        return kind
    known = [*TARGETS, *packaged_targets()]
    raise Invalid(at, f"unknown target {show(kind)}{did_you_mean(kind, known)}: "
                  f"use {', '.join(known)} or \"pkg.module:Class\"")


def target_class_of(spec: str) -> type[Target]:
    """The Target subclass "pkg.module:Class" names (UblkError if none)."""
    return _custom_class(spec)


def _custom_class(spec: str) -> type[Target]:
    """The Target subclass named "pkg.module:Class" (UblkError if it is not one)."""
    mod_name, _, cls_name = spec.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - whatever the import raised, in one line
        raise UblkError(f"cannot import {mod_name!r} ({type(e).__name__}: {e}): check the "
                        "module name and sys.path") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise UblkError(f"module {mod_name!r} has no {cls_name!r}: check the class name")
    if not (isinstance(cls, type) and issubclass(cls, Target)):
        raise UblkError(f"{spec} is not a subclass of aioublk.Target: point at a Target class")
    return cls
