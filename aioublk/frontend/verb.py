"""The command line's verbs, each declared once as a ``Verb`` in a module of
its own under ``aioublk/frontend/verbs/`` (named as the verb): its parser
and its handler. The full parser is made from every module found there, a
light verb's (``list``, ``del``...) from its module alone, so that those
start without the rest; help, completion and the man page come from the
same declarations.

This module is light: argparse, and no asyncio, structlog or target.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, NoReturn

from aioublk._version import __version__
from aioublk.errors import Error
from aioublk.kernel import uapi

#: the package whose modules are the verbs
VERBS_PACKAGE = "aioublk.frontend.verbs"


class Verb(NamedTuple):
    """One subcommand: ``aioublk NAME ...``."""

    name: str
    help: str
    #: declares the verb's arguments on its subparser
    add_arguments: Callable[[argparse.ArgumentParser], None]
    #: runs the parsed command: its exit status (an ``aioublk.Error`` or an
    #: OSError becomes one line on stderr and status 1)
    run: Callable[[argparse.Namespace], int]
    #: runs from a parser of its own, without loading the other verbs: its
    #: module imports no event loop, logging or target (scripts poll ``list``)
    light: bool = False
    #: where ``--help`` lists it, lowest first (a new verb: after the built-ins)
    place: int = 100
    #: looks at the raw arguments before parsing; an exit status ends the
    #: command there (``add -t NAME --help`` answers what NAME takes)
    before_parse: Callable[[list[str]], int | None] | None = None


def find(name: str) -> Verb | None:
    """The verb ``name``, loading its module alone; None if there is none."""
    if not name.isidentifier() or name.startswith("_"):
        return None
    module = f"{VERBS_PACKAGE}.{name}"
    try:
        __import__(module)  # (importlib itself is one module more for light verbs)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return None
    verb: Verb | None = getattr(sys.modules[module], "VERB", None)
    if verb is not None and verb.name != name:  # (found by its file's name)
        raise ImportError(f"{module} declares the verb {verb.name!r}: name its file so")
    return verb


def every() -> list[Verb]:
    """Every verb of the verbs package, in ``--help``'s order."""
    __import__(VERBS_PACKAGE)
    names = sorted({f.removesuffix(".py") for folder in sys.modules[VERBS_PACKAGE].__path__
                    for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("_")})
    found = [v for v in map(find, names) if v is not None]
    return sorted(found, key=lambda v: v.place)


def parser(verbs: Iterable[Verb] | None = None) -> Parser:
    """The command line of ``verbs`` (default: every verb)."""
    p = Parser(prog="aioublk", description="ublk block-device server (kublk-compatible)")
    p.add_argument("--version", action="version", version=f"aioublk {__version__}",
                   help="show the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    for v in every() if verbs is None else verbs:
        v.add_arguments(sub.add_parser(v.name, help=v.help))
    both_spellings(p)
    return p


def run(verb: Verb, args: argparse.Namespace) -> int:
    """``verb``'s handler; an error that explains itself is one line on
    stderr and status 1, Ctrl-C status 130."""
    try:
        return verb.run(args)
    except (Error, OSError) as e:
        sys.stderr.write(f"aioublk: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130


# ------------------------------------------------------- the parser's parts --

def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` finds it ($COLUMNS,
    then stdout's terminal, else 80), without importing shutil (and the
    compressors it brings)."""
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        return 80


class _Formatter(argparse.HelpFormatter):
    """argparse's help, sized by ``_columns`` (argparse makes a formatter at
    every ``add_argument``, and its own imports shutil to size it)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position,
                         _columns() - 2 if width is None else width)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 1 like kublk;
    help sized without shutil."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kw)

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"aioublk: {message}\n")
        raise SystemExit(1)


def both_spellings(parser: argparse.ArgumentParser) -> None:
    """Every multi-word long flag of ``parser`` and its subcommands also in the
    other spelling (``--no_batch`` for ``--no-batch``, ``--chunk-size`` for
    ``--chunk_size``): taken when parsing, while help, usage and errors keep
    the one declared."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                both_spellings(sub)
            continue
        for name in action.option_strings:
            if not name.startswith("--"):
                continue
            for alt in ("--" + name[2:].replace("_", "-"), "--" + name[2:].replace("-", "_")):
                parser._option_string_actions.setdefault(alt, action)


def dev_id_arg(value: str) -> int:
    """``-n``: an id ublk_drv accepts (it sends ids as u32s, so a larger
    one would name another device), or -1 (none given; any, for add)."""
    try:
        dev_id = int(value)
    except ValueError:
        dev_id = -2
    if not -1 <= dev_id < uapi.MAX_DEV_ID:
        raise argparse.ArgumentTypeError(f"device id {value} is out of range: use "
                                         f"0..{uapi.MAX_DEV_ID - 1}")
    return dev_id


def add_dev_id(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("-n", "--number", dest="dev_id", type=dev_id_arg, default=-1,
                        metavar="DEV_ID", help=help)


def flag01(value: str) -> bool:
    """kublk's ``-r 0|1`` and the like."""
    if value not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"'{value}' is not 0 or 1")
    return value == "1"
