"""``features``: the driver's feature bits, as kublk prints them."""

from __future__ import annotations

import argparse

from aioublk.frontend import ctl
from aioublk.frontend.verb import Verb
from aioublk.kernel import uapi
from aioublk.kernel.control import Control, run_now


def _features(ctrl: Control, args: argparse.Namespace) -> int:
    feats = run_now(ctrl.features())
    print(f"ublk_drv features: 0x{feats:x}")
    for bit, name in uapi.feature_names(feats):
        print(f"0x{bit:<16x}: {name}")
    return 0


def _no_arguments(p: argparse.ArgumentParser) -> None:
    pass


VERB = Verb("features", "show the driver's features", _no_arguments, ctl.blocking(_features),
            light=True, place=9)
