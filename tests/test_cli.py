"""The command line's parser, on the host (no kernel needed)."""

from __future__ import annotations

import argparse

import pytest

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


@pytest.mark.parametrize("args,dest,size", [
    (["add", "-t", "stripe", "--chunk_size", "64K", "a", "b"], "chunk_size", 64 << 10),
    (["add", "-t", "stripe", "--chunk_size", "131072", "a", "b"], "chunk_size", 128 << 10),
    (["recover", "-t", "qcow2", "-n", "0", "--l2-cache", "4MiB", "a"], "l2_cache", 4 << 20),
    (["add", "-t", "qcow2", "--l2-cache", "1mb", "a"], "l2_cache", 1 << 20),
    (["update_size", "-n", "0", "-s", "2G"], "size", 2 << 30),
    (["update_size", "-n", "0", "-s", "1T"], "size", 1 << 40),
])
def test_sizes_take_suffixes(args: list[str], dest: str, size: int) -> None:
    assert getattr(cli._parser().parse_args(args), dest) == size


@pytest.mark.parametrize("args,option", [
    (["add", "-t", "stripe", "--chunk_size", "64X", "a", "b"], "--chunk_size"),
    (["add", "-t", "qcow2", "--l2-cache", "1.5M", "a"], "--l2-cache"),
    (["update_size", "-n", "0", "-s", "-1"], "-s/--size"),
])
def test_bad_size_is_one_line_naming_the_option(args: list[str], option: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"aioublk: argument {option}: ") and "is not a size: use bytes, or a " \
        "number with K, M, G or T" in err, err
