"""``aioublk img``: qemu-img's commands on qcow2 images that nothing serves,
spelled as qemu-img spells them so that people's habits (and scripts) work.

    aioublk img check [-q] [-f qcow2] [--output human|json] [-r leaks|all] [-U] FILE
    aioublk img info [-f qcow2] [--output human|json] [-U] FILE
    aioublk img snapshot -l [-U] FILE
    aioublk img map [-f qcow2] [--output human|json] [-U] FILE
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from aioublk.errors import Error
from aioublk.io import locking
from aioublk.qcow2 import blockmap, info
from aioublk.qcow2 import check as chk
from aioublk.qcow2 import format as fmt
from aioublk.qcow2.base import MAX_CHAIN


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    img = sub.add_parser("img", help="qemu-img's commands on a qcow2 image nothing serves "
                         "(check, info, map, snapshot -l)")
    cmds = img.add_subparsers(dest="img_cmd", required=True, parser_class=type(img))

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
    s = command("snapshot", "list the image's internal snapshots (-l), as qemu-img "
                "snapshot -l does", output=False)
    s.add_argument("-l", dest="list", action="store_true", required=True,
                   help="list the snapshots")
    command("map", "where each range of the disk lives, through the backing chain, as "
            "qemu-img map prints it", share="read images another process has open")


def main(args: argparse.Namespace) -> int:
    return {"check": cmd_check, "info": cmd_info, "snapshot": cmd_snapshot,
            "map": cmd_map}[args.img_cmd](args)


def _reading(args: argparse.Namespace) -> tuple[int, chk.Read]:
    fd = _open(args.filename, False, args.force_share)
    return fd, _read_of(fd)


def cmd_info(args: argparse.Namespace) -> int:
    fd, read = _reading(args)
    try:
        try:
            found = info.image_info(read, args.filename, os.fstat(fd))
        except fmt.Qcow2Error as e:
            raise Error(f"{args.filename}: {e}") from None
        if args.output == "json":
            print(json.dumps(found, indent=4))
        else:
            print("\n".join(info.human_info(found, read)))
        return 0
    finally:
        os.close(fd)


def cmd_map(args: argparse.Namespace) -> int:
    fds: list[int] = []
    try:
        chain: list[blockmap.Layer] = []
        name, kind = args.filename, "qcow2"
        while True:
            if len(chain) >= MAX_CHAIN:
                raise Error(f"{args.filename}: backing chain deeper than {MAX_CHAIN} images")
            fd = _open(name, False, args.force_share)
            fds.append(fd)
            read, size = _read_of(fd), os.fstat(fd).st_size
            if kind != "raw" and read(0, 4) != fmt.MAGIC:
                kind = "raw"  # (a backing file with no format named: probed, as qemu-img)
            if kind == "raw":
                chain.append(blockmap.Layer(name, read, size))
                break
            try:
                h = fmt.parse_header(read(0, 1 << 21), size)
            except fmt.Qcow2Error as e:
                raise Error(f"{name}: {e}") from None
            chain.append(blockmap.Layer(name, read, h.size, h))
            if h.backing_file is None:
                break
            name = info.full_backing(name, h.backing_file)
            kind = h.backing_format or "probe"
        entries = blockmap.block_map(chain)
        if args.output == "json":
            sys.stdout.write(blockmap.json_lines(entries))
            return 0
        lines, stopped = blockmap.human_lines(entries)
        print("\n".join(lines), flush=True)
        if stopped:
            raise Error(stopped)
        return 0
    finally:
        for fd in fds:
            os.close(fd)


def cmd_snapshot(args: argparse.Namespace) -> int:
    fd, read = _reading(args)
    try:
        try:
            h = fmt.parse_header(read(0, 1 << 21), os.fstat(fd).st_size)
            snaps = info.snapshots(read, h)
        except fmt.Qcow2Error as e:
            raise Error(f"{args.filename}: {e}") from None
        if snaps:
            print("\n".join(info.snapshot_lines(snaps)))
        return 0
    finally:
        os.close(fd)


def _open(path: str, write: bool, share: bool) -> int:
    try:
        fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError as e:
        raise Error(f"cannot open {path}: {e.strerror}") from None
    try:
        with locking.force_share(share):
            locking.lock(fd, path, write=write)
    except locking.InUse:
        os.close(fd)
        hint = "" if write or share else ", or check it anyway with -U"
        raise Error(f"{path} is in use by another process (QEMU or aioublk): stop it "
                    f"first{hint}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write(fd: int, offset: int, data: bytes) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _read_of(fd: int) -> chk.Read:
    return lambda off, n: os.pread(fd, n, off)


def cmd_check(args: argparse.Namespace) -> int:
    if args.repair and args.force_share:
        raise Error("-U cannot be used with -r: a repair needs the image to itself")
    path = args.filename
    fd = _open(path, bool(args.repair), args.force_share)
    try:
        return _check(fd, args)
    finally:
        os.close(fd)


def _check(fd: int, args: argparse.Namespace) -> int:
    read = _read_of(fd)

    def say(lines: list[str], stream: TextIO = sys.stdout) -> None:
        if not args.quiet:
            for line in lines:
                print(line, file=stream)

    try:
        h, res = chk.scan(read, os.fstat(fd).st_size)
    except fmt.Qcow2Error as e:
        raise Error(f"{args.filename}: {e}") from None
    repair = None
    if args.repair and (res.leaks or res.corruptions):
        try:
            repair = chk.plan_repair(read, os.fstat(fd).st_size, h, res, args.repair)
        except fmt.Qcow2Error as e:
            say(chk.finding_lines(res), sys.stderr)
            raise Error(f"{args.filename}: {e}") from None
        chk.apply(repair, lambda off, data: _write(fd, off, data), lambda: os.fsync(fd))
        say(repair.lines, sys.stderr)
        if args.output == "human":
            say(["The following inconsistencies were found and repaired:", "",
                 f"    {repair.leaks_fixed} leaked clusters",
                 f"    {repair.corruptions_fixed} corruptions", "",
                 "Double checking the fixed image now..."])
        h, res = chk.scan(read, os.fstat(fd).st_size)
    else:
        say(chk.finding_lines(res), sys.stderr)
    if args.repair and not res.corruptions and not res.check_errors and \
            h.incompatible != chk.clean_bits(h):
        os.pwrite(fd, fmt.pack_u64(chk.clean_bits(h)), fmt.OFF_INCOMPAT)
        os.fsync(fd)
    if args.output == "json":
        say([json.dumps(chk.json_report(res, args.filename, repair), indent=4)])
    else:
        say(chk.human_report(res))
    return res.exit_code()
