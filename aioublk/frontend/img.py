"""``aioublk img``: qemu-img's commands on qcow2 images that nothing serves,
spelled as qemu-img spells them so that people's habits (and scripts) work.

    aioublk img check [-q] [-f qcow2] [--output human|json] [-r leaks|all] [-U] FILE
    aioublk img info [-f qcow2] [--output human|json] [-U] FILE
    aioublk img snapshot -l [-U] FILE
    aioublk img snapshot -c|-a|-d SNAPSHOT FILE
    aioublk img map [-f qcow2] [--output human|json] [-U] FILE
    aioublk img create [-q] [-f qcow2] [-b BACKING [-F FMT]] [-o OPTIONS] FILE [SIZE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TextIO

from aioublk.errors import Error
from aioublk.io import locking
from aioublk.qcow2 import blockmap, create, info, snapshot
from aioublk.qcow2 import check as chk
from aioublk.qcow2 import format as fmt
from aioublk.qcow2.base import MAX_CHAIN


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
            holes = _holes_of(fd, size)
            if kind == "raw":
                chain.append(blockmap.Layer(name, read, size, holes=holes))
                break
            try:
                h = fmt.parse_header(read(0, 1 << 21), size)
            except fmt.Qcow2Error as e:
                raise Error(f"{name}: {e}") from None
            chain.append(blockmap.Layer(name, read, h.size, h, holes))
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


def _create_options(args: argparse.Namespace) -> tuple[create.Options, set[str]]:
    """The options from -o, -b and -F, and which of them were given."""
    given: dict[str, str] = {}
    for group in args.options:
        for item in filter(None, group.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise Error(f"-o {item}: give it as KEY=VALUE")
            given[key.strip()] = value.strip()
    if args.backing is not None:
        given["backing_file"] = args.backing
    if args.backing_fmt is not None:
        given["backing_fmt"] = args.backing_fmt
    o = create.Options(size=0)
    flags = {"on": True, "off": False}
    for key, value in given.items():
        try:
            if key == "cluster_size":
                o.cluster_size = create.parse_size(value)
            elif key == "refcount_bits":
                o.refcount_bits = int(value)
            elif key == "lazy_refcounts":
                o.lazy_refcounts = flags[value]
            elif key == "extended_l2":
                o.extended_l2 = flags[value]
            elif key in ("compat", "compression_type", "preallocation", "backing_file",
                         "backing_fmt"):
                setattr(o, key, value)
            else:
                raise Error(f"unknown option {key!r} for qcow2: use cluster_size, compat, "
                            "refcount_bits, lazy_refcounts, compression_type, preallocation, "
                            "extended_l2, backing_file, backing_fmt")
        except (KeyError, ValueError):
            raise Error(f"-o {key}={value}: not a valid value") from None
    return o, set(given)


def _backing_size(image: str, o: create.Options) -> int:
    """The virtual size of the backing file named by ``o``, for a SIZE left out."""
    if o.backing_file is None:
        raise Error("give the image's SIZE (or a backing file to take it from)")
    path = info.full_backing(image, o.backing_file)
    fd = _open(path, False, True)
    try:
        read = _read_of(fd)
        if o.backing_fmt == "raw" or (o.backing_fmt is None and read(0, 4) != fmt.MAGIC):
            return os.fstat(fd).st_size
        return fmt.parse_header(read(0, 1 << 21), os.fstat(fd).st_size).size
    except fmt.Qcow2Error as e:
        raise Error(f"backing file {path}: {e}") from None
    finally:
        os.close(fd)


def cmd_create(args: argparse.Namespace) -> int:
    o, given = _create_options(args)
    try:
        o.size = create.parse_size(args.size) if args.size is not None else \
            _backing_size(args.filename, o)
        if o.backing_file is not None and o.backing_fmt is None:
            raise Error("give the backing file's format with -F qcow2|raw (it is never "
                        "guessed from the file)")
        writes, end = create.build(o)
    except fmt.Qcow2Error as e:
        raise Error(str(e)) from None
    if not args.quiet:
        print(create.formatting_line(args.filename, o, "compat" in given,
                                     "preallocation" in given), flush=True)
    try:
        fd = os.open(args.filename, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise Error(f"cannot create {args.filename}: {e.strerror}") from None
    try:
        try:
            locking.lock(fd, args.filename, write=True)
        except locking.InUse:
            raise Error(f"{args.filename} is in use by another process (QEMU or aioublk): "
                        "stop it first") from None
        os.ftruncate(fd, 0)
        for off, data in writes:
            _write(fd, off, data)
        os.ftruncate(fd, end)
        if o.preallocation == "falloc":
            os.posix_fallocate(fd, 0, end)
        os.fsync(fd)
    except OSError as e:
        raise Error(f"cannot write {args.filename}: {e.strerror}") from None
    finally:
        os.close(fd)
    return 0


def _holes_of(fd: int, size: int) -> blockmap.Holes:
    """The holes of the file at fd (SEEK_HOLE), past its end included."""
    def holes(offset: int, length: int) -> list[tuple[int, int]]:
        out, pos, end = [], offset, offset + length
        while pos < end:
            if pos >= size:
                out.append((pos, end))
                break
            try:
                hole = os.lseek(fd, pos, os.SEEK_HOLE)
            except OSError:
                break  # (no SEEK_HOLE here: no holes known)
            if hole >= end:
                break
            try:
                data = os.lseek(fd, hole, os.SEEK_DATA)
            except OSError:  # ENXIO: a hole to the end of the file
                data = size
            out.append((hole, min(data, end)))
            pos = data
        return out
    return holes


def cmd_snapshot(args: argparse.Namespace) -> int:
    if args.list:
        lines = snapshot_lines(args.filename, args.force_share)
        if lines:
            print("\n".join(lines))
        return 0
    if args.force_share:
        raise Error("-U works with -l only: changing snapshots needs the image to itself")
    verb, name = (("create", args.create) if args.create is not None
                  else ("apply", args.apply) if args.apply is not None
                  else ("delete", args.delete))
    change_snapshots(args.filename, verb, name)
    return 0


def snapshot_lines(path: str, share: bool) -> list[str]:
    """``qemu-img snapshot -l``'s lines (none without snapshots)."""
    snaps = snapshots_of(path, share)
    return info.snapshot_lines(snaps) if snaps else []


def snapshots_of(path: str, share: bool) -> list[fmt.Snapshot]:
    fd = _open(path, False, share)
    try:
        read = _read_of(fd)
        try:
            h = fmt.parse_header(read(0, 1 << 21), os.fstat(fd).st_size)
            return info.snapshots(read, h)
        except fmt.Qcow2Error as e:
            raise Error(f"{path}: {e}") from None
    finally:
        os.close(fd)


#: ``verb`` -> its planner (the snapshot named by an argument)
_PLANNERS: dict[str, Callable[..., snapshot.Plan]] = {
    "create": snapshot.plan_create, "apply": snapshot.plan_apply,
    "delete": snapshot.plan_delete}


def change_snapshots(path: str, verb: str, name: str) -> None:
    """Create, apply or delete a snapshot of an image nothing has open:
    planned from the image, written in durable steps."""
    fd = _open(path, True, False)
    try:
        read = _read_of(fd)
        try:
            plan = _PLANNERS[verb](read, os.fstat(fd).st_size, name,
                                   progress=terminal_progress())
        except fmt.Qcow2Error as e:
            raise Error(f"{path}: could not {verb} snapshot '{name}': {e}") from None
        try:
            snapshot.apply(plan, lambda off, data: _write(fd, off, data), lambda: os.fsync(fd))
        except OSError as e:
            raise Error(f"{path}: could not {verb} snapshot '{name}': {e.strerror}") from None
    finally:
        os.close(fd)


def terminal_progress(stream: TextIO | None = None) -> chk.Progress | None:
    """qemu-img -p's progress line, on a terminal only (elsewhere there is
    nothing to redraw it on, and scripts want clean output)."""
    out = sys.stderr if stream is None else stream
    if not out.isatty():
        return None
    last = -1.0

    def show(done: float) -> None:
        nonlocal last
        pct = min(100.0, done * 100)
        if pct - last < 1 and pct < 100 or pct == last:
            return
        last = pct
        out.write(f"    ({pct:.2f}/100%)\r" + ("\n" if pct >= 100 else ""))
        out.flush()
    return show


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
        h, res = chk.scan(read, os.fstat(fd).st_size,
                          None if args.quiet else terminal_progress(),
                          fix_errors=args.repair == "all")
    except fmt.Qcow2Error as e:
        raise Error(f"{args.filename}: {e}") from None
    repair = None
    if args.repair and (res.leaks or res.corruptions or res.zeroed):
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
