"""``add``: create a device and serve it, daemonized like kublk's server
(``aioublk.frontend.daemon``) or in the foreground."""

from __future__ import annotations

import argparse

from aioublk.frontend import daemon
from aioublk.frontend.addargs import add_create_options
from aioublk.frontend.maketarget import answer_target_help
from aioublk.frontend.verb import Verb


def _arguments(add: argparse.ArgumentParser) -> None:
    add_create_options(add)
    add.add_argument("--json", action="store_true",
                     help="print the new device as list --json does (a list of one object, "
                     "its id under dev_id) instead of kublk's lines")
    add.add_argument("--run", metavar="CMD",
                     help="captive mode (nbdkit's --run): run the shell command CMD with "
                     "$ublk set to /dev/ublkbN and $ublk_id to N, then delete the device; "
                     "exits with CMD's status")


VERB = Verb("add", "create a device and serve it", _arguments, daemon.start, place=1,
            before_parse=answer_target_help)
