"""``img check|info|map|snapshot|create``: qemu-img's commands on qcow2
images that nothing serves (``aioublk.frontend.img``), spelled as qemu-img
spells them."""

from __future__ import annotations

import argparse
from typing import Any

from aioublk.frontend import img
from aioublk.frontend.verb import Verb


def _arguments(parser: argparse.ArgumentParser) -> None:
    cmds = parser.add_subparsers(dest="img_cmd", required=True, parser_class=type(parser))

    def command(name: str, what: str, *, output: bool = True,
                share: str = "read an image another process has open") -> Any:
        """A subcommand with the options every one of them takes, as qemu-img spells them."""
        p = cmds.add_parser(name, help=what)
        p.add_argument("-f", dest="format", default="qcow2", choices=["qcow2"],
                       help="the image's format (qcow2 only)")
        if output:
            p.add_argument("--output", choices=["human", "json"], default="human")
        p.add_argument("-U", "--force-share", action="store_true", help=share)
        p.add_argument("filename")
        return p

    c = command("check", "find (and with -r repair) leaked clusters, wrong refcounts and "
                "COPIED flags, as qemu-img check does; exit 0 clean, 1 the check could not "
                "finish, 2 corruptions, 3 leaks only",
                share="check an image another process has open (its numbers may be off "
                "while it writes); not with -r")
    c.add_argument("-q", dest="quiet", action="store_true", help="print nothing")
    c.add_argument("-r", "--repair", choices=["leaks", "all"],
                   help="leaks: set leaked clusters' refcounts right; all: every refcount "
                   "and COPIED flag")
    command("info", "the image's size, format options, backing file, snapshots and "
            "bitmaps, as qemu-img info prints them")
    s = command("snapshot", "list (-l), create (-c), apply (-a) or delete (-d) the image's "
                "internal snapshots, as qemu-img snapshot does", output=False,
                share="list the snapshots of an image another process has open (-l only)")
    act = s.add_mutually_exclusive_group(required=True)
    act.add_argument("-l", dest="list", action="store_true", help="list the snapshots")
    act.add_argument("-c", dest="create", metavar="SNAPSHOT",
                     help="take a snapshot of the disk as it is, named SNAPSHOT")
    act.add_argument("-a", dest="apply", metavar="SNAPSHOT",
                     help="revert the disk to SNAPSHOT (an ID, or a name)")
    act.add_argument("-d", dest="delete", metavar="SNAPSHOT",
                     help="delete the first snapshot named SNAPSHOT")
    command("map", "where each range of the disk lives, through the backing chain, as "
            "qemu-img map prints it", share="read images another process has open")
    n = cmds.add_parser("create", help="a new qcow2 image, as qemu-img create makes it")
    n.add_argument("-f", dest="format", default="qcow2", choices=["qcow2"])
    n.add_argument("-q", dest="quiet", action="store_true", help="print nothing")
    n.add_argument("-b", dest="backing", help="the backing file (a name beside the image, or "
                   "a path), stored as given")
    n.add_argument("-F", dest="backing_fmt", choices=["qcow2", "raw"],
                   help="the backing file's format")
    n.add_argument("-o", dest="options", action="append", default=[],
                   help="cluster_size=, compat=1.1|0.10, refcount_bits=, lazy_refcounts=on|"
                   "off, compression_type=zlib|zstd, preallocation=off|metadata|falloc, "
                   "backing_file=, backing_fmt= (comma-separated, repeatable)")
    n.add_argument("filename")
    n.add_argument("size", nargs="?", help="bytes, or with k, M, G, T (default: the backing "
                   "file's)")


def _run(args: argparse.Namespace) -> int:
    return {"check": img.cmd_check, "info": img.cmd_info, "snapshot": img.cmd_snapshot,
            "map": img.cmd_map, "create": img.cmd_create}[args.img_cmd](args)


VERB = Verb("img", "qemu-img's commands on a qcow2 image nothing serves (create, check, info, "
            "map, snapshot)", _arguments, _run, place=13)
