"""``udev rules|owner``: the rule that hands users their unprivileged
devices, and what the rule runs for every ublk node."""

from __future__ import annotations

import argparse
import sys

from aioublk.frontend import udev
from aioublk.frontend.verb import Parser, Verb


def _arguments(ud: argparse.ArgumentParser) -> None:
    uds = ud.add_subparsers(dest="udev_cmd", required=True, parser_class=Parser)
    uds.add_parser("rules", help=f"print the rule file (install it as {udev.RULES_FILE})")
    uo = uds.add_parser("owner", help="run by the rule: print an unprivileged device's "
                        "owner as UID GID (exit 1 for a privileged device)")
    uo.add_argument("name", help="the node's kernel name: ublkcN, ublkbN or ublkbNpM")


def _udev(args: argparse.Namespace) -> int:
    if args.udev_cmd == "rules":
        sys.stdout.write(udev.rules())
        return 0
    return udev.main_owner(args.name)


VERB = Verb("udev", "the udev rule that gives users their unprivileged devices", _arguments,
            _udev, light=True, place=10)
