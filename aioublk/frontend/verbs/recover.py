"""``recover``: serve a QUIESCED device again, with the options ``add``
recorded for it, or those given (which it names when they differ)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from aioublk.errors import UblkError
from aioublk.frontend import ctl, daemon, stats
from aioublk.frontend.addargs import (
    absolute_files,
    add_create_options,
    create_actions,
    create_defaults,
    given_only,
)
from aioublk.frontend.maketarget import answer_target_help
from aioublk.frontend.verb import Verb


def _arguments(recover: argparse.ArgumentParser) -> None:
    add_create_options(recover)
    given_only(recover)


def _spelled(dest: str, value: Any) -> str:
    """An option as it would be given: ``-q 4``, ``--buffered``, ``-r 1``."""
    actions = [a for a in create_actions() if a.dest == dest]
    flag = actions[0].option_strings[0] if actions[0].option_strings else ""
    for a in actions:
        if a.nargs == 0 and a.const == value:
            return a.option_strings[0]
    if actions[0].nargs == 0:
        return f"no {flag}"
    values = value if isinstance(value, list) else [value]
    if not flag:  # the files
        return " ".join(map(str, values)) or "no file"
    shown = [str(int(v)) if isinstance(v, bool) else str(v) for v in values]
    return " ".join(f"{flag} {v}" for v in shown) or f"no {flag}"


def _as_recorded(args: argparse.Namespace) -> None:
    """``recover``: fill in what was not given from ``add``'s record of the
    device (else ``add``'s defaults); say in one line which given options
    differ from the record."""
    args.dev_id = getattr(args, "dev_id", -1)
    dev_id = ctl.need_id(args)
    given = {k: v for k, v in vars(args).items() if k not in ("cmd", "dev_id")}
    record = stats.read_record(dev_id)
    if record is None:
        if "target" not in given:
            raise UblkError(f"device {dev_id} has no record of how it was added (not by an "
                            f"aioublk add, or one before records): give its options, e.g. "
                            f"recover -n {dev_id} -t TYPE [FILE...] as given to add")
        recorded: dict[str, Any] = {}
    else:
        recorded = {**record["options"], "target": record.get("target"),
                    "files": record.get("files", [])}
        if given.get("target", recorded["target"]) != recorded["target"]:
            del recorded["files"]  # the other target's
    if "files" in given:
        given["files"] = absolute_files(given.get("target", recorded.get("target")),
                                         given["files"])
    overrides = [f"{_spelled(dest, value)} overrides the recorded "
                 f"{_spelled(dest, recorded[dest])}"
                 for dest, value in given.items()
                 if dest in recorded and value != recorded[dest]]
    if overrides:
        sys.stderr.write(f"aioublk: recover: {', '.join(overrides)}\n")
    for dest, default in create_defaults().items():
        if dest not in given and dest != "dev_id":
            setattr(args, dest, recorded.get(dest, default))


def _run(args: argparse.Namespace) -> int:
    _as_recorded(args)
    return daemon.start(args, recover=True)


VERB = Verb("recover", "serve a QUIESCED device again (with the options it was added with, "
            "or those given)", _arguments, _run, place=2, before_parse=answer_target_help)
