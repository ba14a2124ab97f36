"""The command line's parser, on the host (no kernel needed)."""

from __future__ import annotations

import argparse

from aioublk import cli


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subs.update(action.choices)
    return subs


def test_every_option_of_every_subcommand_has_help() -> None:
    """So that no option can be added without saying what it does."""
    parser = cli._parser()
    subs = _subparsers(parser)
    assert {"add", "recover", "del", "stop", "quiesce", "update_size", "list", "features",
            "serve"} <= set(subs)
    missing = []
    for name, sub in [("", parser), *subs.items()]:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"subcommand {c.dest}" for c in action._choices_actions
                            if not c.help]
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                flag = "/".join(action.option_strings) or action.dest
                missing.append(f"{name or 'aioublk'} {flag}")
    assert not missing, missing
