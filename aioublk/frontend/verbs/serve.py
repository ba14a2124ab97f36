"""``serve config.toml``: the devices of a config file, in the foreground
(``aioublk.frontend.serve``)."""

from __future__ import annotations

import argparse

from aioublk.frontend.serve import main as serve_config
from aioublk.frontend.verb import Verb


def _arguments(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("config", help="the TOML config file (see README)")


def _run(args: argparse.Namespace) -> int:
    return serve_config(args.config)


VERB = Verb("serve", "serve the devices of a TOML config file (foreground)", _arguments, _run,
            place=12)
