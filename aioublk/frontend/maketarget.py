"""The target a command line asks for: ``-t NAME`` built from its FILEs, its
flags and ``--opt KEY=VALUE``s, behind the ``--filter``s; and ``add -t NAME
--help``, what NAME takes.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
import sys
from dataclasses import replace
from typing import Any

from aioublk.errors import UblkError
from aioublk.frontend import registry
from aioublk.frontend.addargs import create_defaults
from aioublk.frontend.registry import (
    build_target,
    filter_stack,
    packaged_target,
    packaged_targets,
    target_class_of,
    target_options,
    with_filters,
)
from aioublk.frontend.runner import ONE_LINE_ERRORS
from aioublk.frontend.values import toml_value
from aioublk.target import Target
from aioublk.targets import spec as decl


def make_target(args: argparse.Namespace) -> Target:
    """Build the target named by ``-t`` from the command line's files, flags
    and ``--opt`` (raises UblkError/BackingError/Qcow2Error)."""
    name, files = args.target, args.files
    opts = _opt_values(args.opt)
    spec = registry.TARGETS.get(name)
    if spec is None and ":" not in name:
        packaged = packaged_target(name)
        if packaged is None:
            raise _unknown_target(name)
        name = packaged  # a package's target: built as the module:Class it names
    _no_foreign_options(name, spec, args)
    if spec is None:
        if files:
            raise UblkError(f"{name} takes no FILE: give its arguments as --opt KEY=VALUE")
        return _built(name, target_options(name, opts, at="--opt", base=os.getcwd()), args)
    options = {o.key: getattr(args, o.key) for o in spec.options
               if o.flags and getattr(args, o.key) is not None}
    for o in spec.options:
        if o.type == decl.INT and o.flags and o.lo == 0 and options[o.key] < 0:
            raise UblkError(f"{o.flag} {options[o.key]} is negative")
    fed = spec.option(spec.files)
    if fed is None and files:
        raise UblkError(f"the {name} target takes no backing file")
    if fed is not None and fed.key in opts:
        if files:
            raise UblkError(f"the {name} target's {fed.what} is given twice: as FILE and as "
                            f"--opt {fed.key}; drop one")
    elif fed is not None and fed.type in (decl.PATH, decl.STR):
        second = spec.option(spec.second_file) if spec.second_file else None
        if second is not None and len(files) == 2:  # (kublk's loop: the metadata file)
            if not getattr(args, "metadata_size", 0):
                raise UblkError(f"the {name} target's second FILE is its {second.what}: add "
                                "-u --metadata_size N, or drop it")
            options[second.key] = files[1]
            files = files[:1]
        if len(files) > 1 or (fed.required and not files):
            what = "image file" if fed.what == "image" else fed.what
            need = "exactly one" if fed.required else "at most one"
            raise UblkError(f"the {name} target needs {need} {what}, got {len(files)}")
        if files:
            options[fed.key] = files[0]
    elif fed is not None:
        options[fed.key] = files
    options |= target_options(name, opts, at="--opt", base=os.getcwd())
    return _built(name, options, args)


def _unknown_target(name: str) -> UblkError:
    known = [*registry.TARGETS, *packaged_targets()]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return UblkError(f"unknown target type '{name}'{hint}: use one of {', '.join(known)}, or "
                     "pkg.module:Class with --opt")


def _no_foreign_options(name: str, spec: decl.TargetSpec | None,
                        args: argparse.Namespace) -> None:
    """A target flag given to a target that does not take it is refused, not
    ignored (``--zone_size`` with ``-t null``)."""
    mine = set(spec.keys()) if spec is not None else set()
    defaults = create_defaults()
    for other in registry.TARGETS.values():
        for o in other.options:
            if (o.flags and o.key not in mine and hasattr(args, o.key)
                    and getattr(args, o.key) != defaults.get(o.key)):
                owners = [t.name for t in registry.TARGETS.values() if t.option(o.key)]
                raise UblkError(f"{o.flags[0]} is an option of the {'/'.join(owners)} "
                                f"target, not {name}: drop it")


def _built(name: str, options: dict[str, Any], args: argparse.Namespace) -> Target:
    """The target, read-only if asked whatever it is (as serve's read_only):
    the kernel makes the disk read-only, and a target that opens files
    opens them so."""
    filters = filter_stack(args.filter)
    target = with_filters(build_target(name, options, read_only=args.read_only,
                                       force_share=args.force_share), filters)
    if args.read_only:
        target.geometry = replace(target.geometry, read_only=True)
    return target


def _opt_values(opts: list[str]) -> dict[str, Any]:
    """``--opt KEY=VALUE``s: a VALUE that parses as TOML is that value (64,
    true, "s", [1, 2]), any other the string it is."""
    out: dict[str, Any] = {}
    for opt in opts:
        key, eq, text = opt.partition("=")
        if not eq or not key.strip():
            raise UblkError(f"--opt {opt!r} is not KEY=VALUE: write e.g. --opt size=64M")
        out[key.strip()] = toml_value(text)
    return out


def answer_target_help(argv: list[str]) -> int | None:
    """``add|recover -t NAME --help`` (``argv``, the verb's name first):
    print what NAME takes, and the exit status; None for any other command."""
    if not {"-h", "--help"} & set(argv):
        return None
    name = None
    for i, a in enumerate(argv[:-1]):
        if a in ("-t", "--type"):
            name = argv[i + 1]
            break
        if a.startswith("--type="):
            name = a.split("=", 1)[1]
            break
    if name is None:
        return None
    try:
        sys.stdout.write(target_help(name))
    except ONE_LINE_ERRORS as e:
        sys.stderr.write(f"aioublk: {e}\n")
        return 1
    return 0


def target_help(name: str) -> str:
    """What ``add -t NAME`` takes beyond the device options: the built-in
    target's flags (and config keys), or a class's keyword arguments."""
    spec = registry.TARGETS.get(name)
    if spec is not None:
        lines = [f"aioublk add -t {name}: the {name} target's options (each also --opt KEY=VALUE "
                 "and a serve config's options.KEY)", ""]
        for o in spec.options:
            how = " ".join(o.flags) if o.flags and o.arg != "*" else \
                "FILE" if o.key == spec.files else f"--opt {o.key}=VALUE"
            default = f" (default: {o.default_help})" if o.default_help else ""
            lines.append(f"  {how:28} {o.key}: {o.help}{default}")
        lines += ["", "Device options (queues, depth, copy mode...): aioublk add --help."]
        return "\n".join(lines) + "\n"
    kind = name if ":" in name else packaged_target(name)
    if kind is None:
        raise _unknown_target(name)
    cls = target_class_of(kind)
    params = [p for p in inspect.signature(cls).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    lines = [f"aioublk add -t {name}: {kind}, its keyword arguments as --opt KEY=VALUE "
             "(and a serve config's options.KEY)", ""]
    lines += [f"  --opt {p.name}=VALUE" + ("" if p.default is p.empty
                                          else f" (default: {p.default!r})")
              for p in params]
    doc = inspect.getdoc(cls)
    if doc:
        lines += ["", doc.splitlines()[0]]
    return "\n".join(lines) + "\n"
