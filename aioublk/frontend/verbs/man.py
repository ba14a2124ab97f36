"""``man``: the man page aioublk(1) in roff, generated from the parser."""

from __future__ import annotations

import argparse
import sys

from aioublk.frontend.verb import Verb
from aioublk.frontend.verbs.completion import generated


def _no_arguments(p: argparse.ArgumentParser) -> None:
    pass


def _run(args: argparse.Namespace) -> int:
    sys.stdout.write(generated("man"))
    return 0


VERB = Verb("man", "print the man page aioublk(1) in roff (man -l - shows it)", _no_arguments,
            _run, place=15)
