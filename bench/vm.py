"""qcow2 overlays on a base image, as VMs use them: aioublk beside qemu-nbd + nbd.ko.

aioublk's qcow2 target and qemu-nbd, in one guest run, in rounds:

    python -m bench.vm [--runtime 5] [--rounds 3] [--base-size 1G] [--quick] [--cpus 4]

A VM's disk is rarely a lone image: it is an overlay over a base (a cloud image,
a template), most of its reads fall through to that base, and its first writes
copy the rest of their cluster from it. bench.qcow2 measures whole images; this
bench measures that chain. In guest RAM (tmpfs), made once per run:

- a RAW base of data that compresses to about half, as cloud images do (fio
  ``--buffer_compress_percentage=50``, the compressible part a text pattern);
- a COMPRESSED qcow2 base of the same data (``qemu-img convert -c``, 64 KiB
  clusters): every read through it inflates a cluster.

Every device gets a fresh overlay (``qemu-img create -f qcow2 -b BASE -F
raw|qcow2``; for the copy-on-write rows also ``-o extended_l2=on`` over the raw
base), so no row sees what an earlier one wrote. The servers are bench.qcow2's,
in its order (``qemu-nbd io_uring, aioublk, qemu-nbd native``, reversed every
other round), each row paired against qemu-nbd's better AIO setting. fio
(io_uring, O_DIRECT) per base: 4k randread qd1 and qd64 and 1 MiB sequential
read qd16 before any write; 4k COW randwrite qd1 and qd64, allocating as in
bench.qcow2 (the round's first server runs ``--runtime`` seconds, later ones
repeat its write count in the same random sequence); two queues with two fio
jobs, 4k randread qd64. Then a file-level workload: an ext4 file system holding
a tree of Python's library files, as a compressed qcow2 base; per server a fresh
overlay mounted, a boot-like read of the tree after dropping caches and a
package-install-like untar then ``sync``, timed.

After each device ``qemu-img check`` runs on its overlay and, where nothing was
written, ``qemu-img compare`` against its base. ``--quick`` is a smoke test of
this script (64 MiB bases, a few rows, one round), not a measurement.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from bench.common import command as default_command
from bench.common import (
    errors_section,
    fmt,
    load,
    median,
    paired_ratios,
    parser,
    publish,
    ratio_bars,
    run,
    run_guest,
    table,
)
from bench.qcow2 import (
    _R,
    _W,
    AIOUBLK,
    COUNT_CAP,
    GUEST_MEMORY,
    MIN_FILL_RATE,
    NBD_AIO,
    RAMP,
    RANDREAD,
    AioublkServer,
    Guest,
    Key,
    NbdServer,
    Server,
    Step,
    _dev_ios,
    _image_folder,
    _tasks_cpu,
    cpu_fields,
    dp_fields,
    round_order,
    rows,
)

FORMAT = 1
MiB = 1 << 20
BASE_SIZE = 1 << 30
QUICK_BASE_SIZE = 64 * MiB
FS_SIZE = 512 * MiB
QUICK_FS_SIZE = 64 * MiB
CLUSTER = ["-o", "cluster_size=65536"]
PATTERN = '"cloud image data "'  # fio's buffer_pattern: the compressible half of each 4k
# overlay kind -> (its base, more qemu-img create options)
KINDS: dict[str, tuple[str, list[str]]] = {
    "raw": ("raw", []),
    "compressed": ("compressed", []),
    "extl2": ("raw", ["-o", "extended_l2=on"]),
}
LABELS = {"raw": "raw base", "compressed": "compressed qcow2 base",
          "extl2": "raw base, extended_l2 overlay"}
FILES = "files"  # the file-level workload's base
COW, SEQREAD = "4k COW randwrite", "1M read"
READS = [Step(RANDREAD, 1, _R, "time"), Step(RANDREAD, 64, _R, "time"),
         Step(SEQREAD, 16, ("--rw=read", "--bs=1M"), "time")]
COW1, COW64 = Step(COW, 1, _W, "count"), Step(COW, 64, _W, "count")
READ_2Q = Step(RANDREAD, 64, _R, "time", queues=2)
# Slowest rate (MiB/s) the timeouts allow for qemu-img convert -c and compare (TCG: about
# 2.5 MiB/s for convert -c, the compare's inflate faster).
COMPRESS_RATE, COMPARE_RATE = 1, 5
FILE_TIMEOUT = 1800  # seconds for one file-level phase
PHASES = {"read": "boot-like read", "write": "install-like write"}
TREE, INSTALL = "tree", "install"  # folders in the file system


class Spec(NamedTuple):
    """One device: an overlay of `kind` and the rows run on it, in order."""

    kind: str
    steps: list[Step]

    @property
    def read_only(self) -> bool:
        return all(s.how == "time" and s.workload in (RANDREAD, SEQREAD) for s in self.steps)


def plan(quick: bool) -> list[Spec]:
    """The devices of a round, in order: a fresh overlay wherever an earlier row
    would change what the next measures (a COW row's writes, another queue count)."""
    if quick:
        return [Spec("raw", READS[1:]), Spec("raw", [COW64]), Spec("compressed", [READS[1]]),
                Spec("extl2", [COW64]), Spec("raw", [READ_2Q])]
    return [spec for kind in ("raw", "compressed") for spec in (
        Spec(kind, READS), Spec(kind, [COW1]), Spec(kind, [COW64]), Spec(kind, [READ_2Q]))] \
        + [Spec("extl2", [COW1]), Spec("extl2", [COW64])]


# -- guest side ---------------------------------------------------------------------


def _bases(folder: str, size: int) -> dict[str, Any]:
    """The raw base (compressible data: neither random nor zeros) and the same data
    as a compressed qcow2 base."""
    raw, compressed = os.path.join(folder, "base.raw"), os.path.join(folder, "base.qcow2")
    t0 = time.monotonic()
    _, err = run(["fio", "--name=base", f"--filename={raw}", "--rw=write", "--bs=1M",
                  f"--size={size}", "--ioengine=psync", "--buffer_compress_percentage=50",
                  "--buffer_compress_chunk=4k", "--refill_buffers",
                  f"--buffer_pattern={PATTERN}", "--output-format=terse"],
                 timeout=size / MiB / MIN_FILL_RATE + 300)
    if err:
        raise SystemExit(f"raw base: fio {err}")
    t1 = time.monotonic()
    _convert(raw, compressed, size)
    return {"raw": raw, "compressed": compressed, "raw_s": t1 - t0,
            "compressed_s": time.monotonic() - t1,
            "compressed_bytes": os.path.getsize(compressed)}


def _convert(raw: str, compressed: str, size: int) -> None:
    _, err = run(["qemu-img", "convert", "-c", "-f", "raw", "-O", "qcow2", *CLUSTER, raw,
                  compressed], timeout=size / MiB / COMPRESS_RATE + 300)
    if err:
        raise SystemExit(f"compressed base: qemu-img convert {err}")


def _trees(quick: bool) -> tuple[list[str], list[str]]:
    """(the folders the file system's tree copies, those the install archive holds):
    Python's own library, there in every guest."""
    stdlib = sysconfig.get_paths()["stdlib"]
    if quick:
        return ([os.path.join(stdlib, d) for d in ("asyncio", "email", "json")],
                [os.path.join(stdlib, d) for d in ("xml", "unittest")])
    dist = "/usr/lib/python3/dist-packages"
    return [stdlib, *([dist] if os.path.isdir(dist) else [])], [stdlib]


def _file_count(folder: str) -> tuple[int, int]:
    """(files, bytes) below `folder`."""
    files = size = 0
    for top, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(top, name)
            if os.path.isfile(path) and not os.path.islink(path):
                files, size = files + 1, size + os.path.getsize(path)
    return files, size


def _fs_base(folder: str, size: int, quick: bool) -> dict[str, Any]:
    """An ext4 file system holding TREE as a compressed qcow2 base, and the install
    archive beside it. Inode tables and journal are written by mke2fs, so no lazy
    init writes to the device during a timed phase."""
    t0 = time.monotonic()
    tree_from, install_from = _trees(quick)
    stage = os.path.join(folder, "fs.stage")
    os.makedirs(os.path.join(stage, TREE))
    for src in tree_from:
        _, err = run(["cp", "-a", src, os.path.join(stage, TREE)], timeout=1800)
        if err:
            raise SystemExit(f"file system tree: cp {err}")
    files, tree_bytes = _file_count(stage)
    raw = os.path.join(folder, "fs.raw")
    _, err = run(["mke2fs", "-q", "-F", "-t", "ext4", "-E",
                  "lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0", "-d", stage, raw,
                  f"{size // MiB}M"], timeout=1800)
    shutil.rmtree(stage, ignore_errors=True)
    if err:
        raise SystemExit(f"file system: mke2fs {err}")
    base = os.path.join(folder, "fs.qcow2")
    _convert(raw, base, size)
    os.unlink(raw)
    archive = os.path.join(folder, "install.tar")
    _, err = run(["tar", "-cf", archive, *(a for src in install_from for a in
                                           ("-C", os.path.dirname(src), os.path.basename(src)))],
                 timeout=1800)
    if err:
        raise SystemExit(f"install archive: tar {err}")
    archive_files = sum(_file_count(src)[0] for src in install_from)
    return {"base": base, "archive": archive, "size": size, "tree": tree_from,
            "tree_files": files, "tree_bytes": tree_bytes, "install": install_from,
            "archive_files": archive_files, "archive_bytes": os.path.getsize(archive),
            "base_bytes": os.path.getsize(base), "seconds": time.monotonic() - t0}


class VmGuest(Guest):
    """bench.qcow2's guest run on overlays: a fresh one per device, checked and,
    where nothing was written, compared with its base after."""

    def __init__(self, data: dict[str, Any], out: Path, runtime: int, size: int,
                 folder: str) -> None:
        super().__init__(data, out, runtime, size)
        self.folder = folder

    def overlay(self, base: str, fmt: str, options: Sequence[str] = ()) -> tuple[str, str | None]:
        path = os.path.join(self.folder, "overlay.qcow2")
        if os.path.exists(path):
            os.unlink(path)
        _, err = run(["qemu-img", "create", "-q", "-f", "qcow2", *CLUSTER, *options, "-b",
                      base, "-F", fmt, path], timeout=120)
        return path, (f"qemu-img create {err}" if err else None)

    def finish(self, image: str, base: str | None, fmt: str) -> None:
        """The last device entry's check_ok, and its compare against `base` (None: it
        was written to); the overlay removed."""
        entry = self.data["devices"][-1]
        if "check" in entry:
            entry["check_ok"] = isinstance(entry["check"], list)
        if base is not None and os.path.exists(image):
            t0 = time.monotonic()
            out, err = run(["qemu-img", "compare", "-f", "qcow2", "-F", fmt, image, base],
                           timeout=self.size / MiB / COMPARE_RATE + 300)
            entry["compare_ok"], entry["compare"] = err is None, err or out.strip()
            entry["compare_s"] = time.monotonic() - t0
        if os.path.exists(image):
            os.unlink(image)
        self.save()

    def overlay_device(self, server: Server, rnd: int, spec: Spec,
                       counts: dict[str, int]) -> None:
        """`spec`'s rows on a fresh overlay on `server` (``Guest.serve``)."""
        base_kind, options = KINDS[spec.kind]
        base, fmt = self.data["bases"][base_kind], "raw" if base_kind == "raw" else "qcow2"
        image, err = self.overlay(base, fmt, options)
        self.serve(server, rnd, spec.kind, spec.steps, counts, image, err)
        self.data["devices"][-1]["rows"] = ", ".join(s.key for s in spec.steps)
        self.finish(image, base if spec.read_only else None, fmt)

    def files(self, server: Server, rnd: int) -> None:
        """The file-level device: a fresh overlay on the file system base, mounted;
        the timed read of TREE after dropping caches, then the timed untar + sync."""
        fs = self.data["fs"]
        image, err = self.overlay(fs["base"], "qcow2")
        t0 = time.monotonic()
        dev = None
        if err is None:
            dev, err = server.attach(image, 1)
        entry: dict[str, Any] = {"round": rnd, "kind": FILES, "server": server.name,
                                 "queues": 1, "connections": server.connections,
                                 "attach_s": time.monotonic() - t0, "error": err,
                                 "rows": " then ".join(PHASES.values())}
        self.data["devices"].append(entry)
        mnt = tempfile.mkdtemp(prefix="vmbench.mnt.")
        if dev is not None:
            _, mount_err = run(["mount", "-t", "ext4", "-o", "noinit_itable", dev, mnt], 120)
            err = mount_err and f"mount {mount_err}"
        last = server.counters(time.time()) if dev is not None and err is None else {}
        commands = {
            "read": ["bash", "-o", "pipefail", "-c", 'tar -cf - -C "$0" "$1" | wc -c', mnt,
                     TREE],
            "write": ["sh", "-c", 'tar -xf "$0" -C "$1" && sync', fs["archive"],
                      os.path.join(mnt, INSTALL)]}
        for phase, cmd in commands.items():
            if dev is not None and err is None:
                if phase == "read":
                    os.sync()
                    Path("/proc/sys/vm/drop_caches").write_text("3\n")
                else:
                    os.makedirs(os.path.join(mnt, INSTALL), exist_ok=True)
                r = self.timed(server, dev, cmd, last)
            else:
                r = {"error": err}
            self.data["files"].append({"round": rnd, "server": server.name, "phase": phase,
                                       "seconds": None, **r})
            shown = f"{r['seconds']:.1f} s" if r.get("seconds") is not None \
                else f"ERROR {r.get('error')}"
            print(f"[{time.monotonic() - self.start:4.0f} s] round {rnd}: files    "
                  f"{PHASES[phase]:25} {server.name:17} {shown}", flush=True)
            self.save()
        if dev is not None:
            if os.path.ismount(mnt):
                _, umount_err = run(["umount", mnt], timeout=600)
                entry["umount_error"] = umount_err
            t1 = time.monotonic()
            entry["detach_error"] = server.detach()
            entry["detach_s"] = time.monotonic() - t1
        if not os.path.ismount(mnt):
            os.rmdir(mnt)
        if os.path.exists(image):
            check, check_err = run(["qemu-img", "check", "-f", "qcow2", image], timeout=600)
            entry["check"] = check_err or [ln for ln in check.splitlines() if ln.strip()]
        self.finish(image, None, "qcow2")

    def timed(self, server: Server, dev: str, cmd: list[str],
              last: dict[str, float]) -> dict[str, Any]:
        """One file-level phase: its seconds, output and the server's diagnostics
        (`last`: its counters now, replaced by those after)."""
        cpu0, ios0 = _tasks_cpu(server.pid), _dev_ios(dev)
        t0 = time.monotonic()
        out, err = run(cmd, timeout=FILE_TIMEOUT)
        seconds = time.monotonic() - t0
        cpu1, ios1 = _tasks_cpu(server.pid), _dev_ios(dev)
        ios = ios1 - ios0 if ios0 is not None and ios1 is not None else None
        r: dict[str, Any] = {"seconds": None if err else seconds, "error": err,
                             "dev_ios": ios, **cpu_fields(cpu0, cpu1, ios)}
        if out.strip().isdigit():
            r["bytes"] = int(out)
        if isinstance(server, AioublkServer):
            after = server.counters(time.time())
            if last and after:
                r |= dp_fields(last, after)
            last.clear()
            last.update(after)
        return r


def inner(runtime: int, rounds: int, quick: bool, size: int, out: Path) -> None:
    """Runs in the guest."""
    fs_size = QUICK_FS_SIZE if quick else FS_SIZE
    release, _ = run(["uname", "-r"], timeout=10)
    nbd_version, _ = run(["qemu-nbd", "--version"], timeout=30)
    fio_version, _ = run(["fio", "--version"], timeout=30)
    storage = _image_folder(3 * size + 2 * fs_size)
    folder = str(storage["path"])
    data: dict[str, Any] = {
        "format": FORMAT, "kernel": release.strip(), "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "rounds": rounds, "quick": quick, "base_size": size, "storage": storage,
        "qemu_nbd": nbd_version.splitlines()[0] if nbd_version else None,
        "fio": fio_version.strip(), "complete": False, "runs": [], "devices": [],
        "files": [],
    }
    print(f"bases in {folder}", flush=True)
    guest = VmGuest(data, out, runtime, size, folder)
    data["bases"] = _bases(folder, size)
    data["fs"] = _fs_base(folder, fs_size, quick)
    guest.save()
    print(f"[{time.monotonic() - guest.start:4.0f} s] bases made", flush=True)
    servers: list[Server] = [NbdServer(NBD_AIO[0]), AioublkServer(), NbdServer(NBD_AIO[1])]
    for r in range(1, rounds + 1):
        for spec in plan(quick):
            counts: dict[str, int] = {}  # step -> the round's first server's I/O count
            for server in round_order(servers, r):
                guest.overlay_device(server, r, spec, counts)
        for server in round_order(servers, r):
            guest.files(server, r)
    data["complete"] = True
    data["elapsed_s"] = time.monotonic() - guest.start
    guest.save()
    shutil.rmtree(folder, ignore_errors=True)


# -- host side ----------------------------------------------------------------------


# row -> the goal for aioublk / qemu-nbd's better setting, paired per round
TARGETS: dict[Key, float] = {
    **{key: target for kind in ("raw", "compressed") for key, target in (
        ((kind, RANDREAD, 64, 1), 2.0), ((kind, RANDREAD, 1, 1), 1.5),
        ((kind, COW, 64, 1), 1.5), ((kind, COW, 1, 1), 1.0), ((kind, SEQREAD, 16, 1), 1.2))},
    ("extl2", COW, 64, 1): 2.0,
}
FILE_TARGET = 1.0  # both phases: qemu-nbd time / aioublk time, strictly above


class FileRow(NamedTuple):
    phase: str
    nbd: dict[str, float | None]  # qemu-nbd setting -> median seconds
    best: str | None  # the setting with the lower median
    aioublk: float | None  # median seconds
    ratios: list[float]  # each round's best qemu-nbd seconds / aioublk seconds
    paired: float | None  # their median
    diag: dict[str, float | None]


def _nbd_names(records: Sequence[Mapping[str, Any]]) -> list[str]:
    return list(dict.fromkeys(str(x["server"]) for x in records
                              if str(x["server"]).startswith("qemu-nbd")))


def file_rows(data: Mapping[str, Any]) -> list[FileRow]:
    """Each file-level phase, paired by round against the qemu-nbd setting with the
    lower median time."""
    files = data.get("files") or []
    names = _nbd_names(files)
    out = []
    for phase in dict.fromkeys(str(x["phase"]) for x in files):
        nbd = {n: median(files, "seconds", server=n, phase=phase) for n in names}
        have = [n for n in names if nbd[n] is not None]
        best = min(have, key=lambda n: nbd[n] or 0) if have else None
        ratios = paired_ratios(files, {"server": best, "phase": phase},
                               {"server": AIOUBLK, "phase": phase}, "seconds") if best else []
        diag = {d: median(files, d, server=AIOUBLK, phase=phase)
                for d in ("c_share", "cpu_us_per_io", "iou_wrk_us_per_io")}
        diag |= {f"nbd {d}": median(files, d, server=best, phase=phase)
                 for d in ("cpu_us_per_io", "iou_wrk_us_per_io")} if best else {}
        out.append(FileRow(phase, nbd, best, median(files, "seconds", server=AIOUBLK,
                                                     phase=phase),
                           ratios, statistics.median(ratios) if ratios else None, diag))
    return out


class Goal(NamedTuple):
    label: str
    value: float | None
    ratios: list[float]
    target: float
    strict: bool = False  # met only above the target

    @property
    def met(self) -> str:
        if self.value is None:
            return "—"
        return "yes" if (self.value > self.target if self.strict
                         else self.value >= self.target) else "no"


def _workload(key: Key) -> str:
    _, workload, qd, queues = key
    return f"{workload} qd{qd}" + (f" {queues}q" if queues > 1 else "")


def label(key: Key) -> str:
    return f"{LABELS.get(key[0], key[0])}: {_workload(key)}"


def _bytes(n: float) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / MiB:.0f} MiB"


def _range(ratios: Sequence[float]) -> str:
    return f"{min(ratios):.2f} – {max(ratios):.2f}" if ratios else "—"


def goals(data: Mapping[str, Any]) -> list[Goal]:
    """Every goal, from values paired within the round."""
    by_key = {r.key: r for r in rows(data)}
    out = [Goal(label(key), by_key[key].paired if key in by_key else None,
                by_key[key].ratios if key in by_key else [], target)
           for key, target in TARGETS.items()]
    by_phase = {f.phase: f for f in file_rows(data)}
    out += [Goal(f"file level: {name} (qemu-nbd time / aioublk time)",
                 by_phase[p].paired if p in by_phase else None,
                 by_phase[p].ratios if p in by_phase else [], FILE_TARGET, strict=True)
            for p, name in PHASES.items()]
    return out


def _order(key: Key) -> tuple[int, int]:
    kind, workload, qd, queues = key
    steps = [*READS, COW1, COW64, READ_2Q]
    i = next((i for i, s in enumerate(steps) if (s.workload, s.qd, s.queues) ==
              (workload, qd, queues)), len(steps))
    return (list(KINDS).index(kind) if kind in KINDS else len(KINDS), i)


def _integrity(d: Mapping[str, Any], what: str) -> str:
    """A device's qemu-img check or compare as a table cell: pass, FAIL and why, or —."""
    ok = d.get(f"{what}_ok")
    if ok is None:
        return "—"
    if ok:
        return "pass"
    detail = d.get(what)
    if isinstance(detail, list):
        detail = "; ".join(ln for ln in detail if not ln.startswith("Image end offset"))
    return f"**FAIL**: {detail}"


def report(data: Mapping[str, Any], command: str) -> str:
    runs, devices, storage = data["runs"], data["devices"], data["storage"]
    names = _nbd_names(runs)
    bases, fs = data.get("bases") or {}, data.get("fs") or {}
    setup = (f"One guest run: QEMU TCG software emulation (no KVM), {GUEST_MEMORY[:-1]} GiB RAM"
             if data["guest"] else "One run on the host")
    size = int(data["base_size"])
    compressed = f", {_bytes(bases['compressed_bytes'])}" if bases else ""
    table_rows = sorted(rows(data), key=lambda r: _order(r.key))
    lines = [
        "# vm: qcow2 overlays on a base, aioublk vs qemu-nbd + nbd.ko",
        "",
        f"{setup}, {data['cpus']} CPUs, Linux {data['kernel']}, {data['qemu_nbd']}, "
        f"{data['fio']}. Two bases in guest RAM (`{storage['path']}`, {storage['fs']}), made "
        f"once per run: a **raw** one of {_bytes(size)} of data that compresses to about half, "
        "as cloud images do (fio `--buffer_compress_percentage=50`, the compressible part a "
        "text pattern), and a **compressed qcow2** one holding the same data (`qemu-img "
        f"convert -c`, 64 KiB clusters{compressed}). Every device gets a fresh overlay "
        "(`qemu-img create -f qcow2 -b BASE -F raw|qcow2`, 64 KiB clusters); "
        "**extended_l2** overlays (`-o extended_l2=on`, over the raw base) have 32 "
        "subclusters of 2 KiB, so a 4k write copies no part of its cluster from the base.",
        "",
        "- qemu-nbd: `qemu-nbd --cache=none --aio=AIO --discard=unmap -f qcow2 -c /dev/nbdN` "
        "(nbd.ko, one connection; with two queues, two connections through nbd-client when "
        "the export allows multi-conn: **conns** says how many ran). Each row uses the AIO "
        "setting with the higher median over the rounds (**best**).",
        "- aioublk: `python -m aioublk add -t qcow2 -q 1 OVERLAY` (`-q 2` for the 2q row; its "
        "defaults otherwise: depth 128).",
        "- fio, io_uring, O_DIRECT, a device per group: 4k randread qd1 and qd64, then 1 MiB "
        "sequential read qd16, on one overlay before any write (every read falls through to "
        "the base); 4k COW randwrite qd1 and qd64 each on its own overlay (first writes to "
        f"clusters whose rest comes from the base: the round's first server runs "
        f"{data['runtime']} s, every later one does exactly as many writes in the same "
        "random sequence, so all allocate the same clusters); 2q: 4k randread qd64 by two "
        "fio jobs, each on its own half of the device. Time-based rows run "
        f"{data['runtime']} s after {data['ramp']} s ramp. IOPS are reads + writes.",
        f"- {data['rounds']} round(s), the servers' order reversed every other round. "
        "**paired** is the median over the rounds of each round's aioublk / best qemu-nbd "
        "(min and max beside it).",
        "",
        "Under emulation the absolute numbers mean little: **the paired ratios are the "
        "result**.",
    ]
    if data.get("quick"):
        lines += ["", "**Smoke run (`--quick`)**: small bases, a few rows, one round; not a "
                      "measurement."]
    if not data.get("complete"):
        lines += ["", "**Incomplete**: the guest run stopped early; rows below are what it "
                      "finished."]
    lines += ["", *table(
        ["base", "workload", *(f"{n} IOPS" for n in names), "best", "conns", "aioublk IOPS",
         "paired", "min – max"], "ll" + "r" * len(names) + "lrrrr",
        ([LABELS.get(r.key[0], r.key[0]), _workload(r.key),
          *(fmt(r.nbd[n]) for n in names), (r.best or "—").removeprefix("qemu-nbd "),
          fmt(r.connections, "d"), fmt(r.aioublk), fmt(r.paired, ".2f"), _range(r.ratios)]
         for r in table_rows))]
    lines += _files_section(data, fs)
    lines += ["", "## Goals", "",
              "aioublk / qemu-nbd's better setting, the median of the per-round paired ratios "
              "(file level: qemu-nbd's time / aioublk's, above 1 when aioublk is faster).", "",
              *table(["goal", "value", "min – max", "target", "met"], "lrrrl",
                     ([g.label, fmt(g.value, ".2f"), _range(g.ratios),
                       f"{'>' if g.strict else '≥'} {g.target}", g.met]
                      for g in goals(data)))]
    lines += _diagnostics(table_rows, file_rows(data))
    lines += _devices_section(devices)
    errors: dict[str, str] = {}
    for x in [*runs, *(data.get("files") or [])]:
        if x.get("error"):
            errors.setdefault(f"{x['server']} {x.get('kind', FILES)}", str(x["error"]))
    for d in devices:
        for what in ("detach_error", "umount_error"):
            if d.get(what):
                errors.setdefault(f"{d['server']} {d['kind']} {what.split('_')[0]}",
                                  str(d[what]))
    lines += errors_section(errors, "server/base")
    if data.get("elapsed_s"):
        lines += ["", f"The guest part took {float(data['elapsed_s']) / 60:.0f} min."]
    lines += ["", f"Chart: `vm.png`. Reproduce: `{command}` from the repository root "
                  "(boots the guest when the host has no ublk_drv).", ""]
    return "\n".join(lines)


def _files_section(data: Mapping[str, Any], fs: Mapping[str, Any]) -> list[str]:
    frows = file_rows(data)
    if not frows:
        return []
    names = _nbd_names(data.get("files") or [])
    tree = ", ".join(f"`{t}`" for t in fs.get("tree", [])) or "—"
    install = ", ".join(f"`{t}`" for t in fs.get("install", [])) or "—"
    return [
        "", "## File level", "",
        f"An ext4 file system of {_bytes(fs.get('size', 0))} (`mke2fs -d`, inode "
        f"tables and journal written at mkfs) holding {fs.get('tree_files', 0):,} files, "
        f"{_bytes(fs.get('tree_bytes', 0))}, copied from {tree}, as a compressed "
        f"qcow2 base ({_bytes(fs.get('base_bytes', 0))}); per server a fresh "
        "overlay attached (one queue) and mounted. **boot-like read**: `tar -cf - tree | "
        "wc -c` after `echo 3 > /proc/sys/vm/drop_caches` (through a pipe: GNU tar reads no "
        "file whose archive is /dev/null); **install-like write**: `tar -xf` of an archive "
        f"of {fs.get('archive_files', 0):,} files "
        f"({_bytes(fs.get('archive_bytes', 0))}, {install}) into the file system, "
        "then `sync`. Seconds are medians over the rounds; **ratio**: each round's time of "
        "qemu-nbd's better setting (**best**, the lower median) / aioublk's time, median "
        "and min – max (above 1: aioublk is faster).", "",
        *table(["phase", *(f"{n} s" for n in names), "best", "aioublk s", "ratio",
                "min – max"], "l" + "r" * len(names) + "lrrr",
               ([PHASES.get(f.phase, f.phase), *(fmt(f.nbd[n], ",.1f") for n in names),
                 (f.best or "—").removeprefix("qemu-nbd "), fmt(f.aioublk, ",.1f"),
                 fmt(f.paired, ".2f"), _range(f.ratios)]
                for f in frows))]


def _diagnostics(table_rows: Sequence[Any], frows: Sequence[FileRow]) -> list[str]:
    lines = [[label(r.key), fmt(r.diag["aioublk c_share"], ".3f"),
              fmt(r.diag["aioublk cpu_us_per_io"], ",.1f"),
              fmt(r.diag["aioublk iou_wrk_us_per_io"], ",.1f"),
              fmt(r.diag.get("nbd cpu_us_per_io"), ",.1f"),
              fmt(r.diag.get("nbd iou_wrk_us_per_io"), ",.1f")] for r in table_rows]
    lines += [[f"file level: {PHASES.get(f.phase, f.phase)}", fmt(f.diag["c_share"], ".3f"),
               fmt(f.diag["cpu_us_per_io"], ",.1f"), fmt(f.diag["iou_wrk_us_per_io"], ",.1f"),
               fmt(f.diag.get("nbd cpu_us_per_io"), ",.1f"),
               fmt(f.diag.get("nbd iou_wrk_us_per_io"), ",.1f")] for f in frows]
    if all(c == "—" for row in lines for c in row[1:]):
        return []
    return ["", "## Diagnostics", "",
            "Medians over the rounds. **C share**: aioublk's requests its C data plane served "
            "fetch to commit (the rest went to Python; `list --stats --json` deltas). **CPU "
            "µs / I/O**: the server process's threads (`/proc/PID/task/*/schedstat`) per I/O "
            "the device completed, ramp included, io_uring's `iou-wrk` workers apart "
            "(nbd.ko's kernel threads are not counted).", "",
            *table(["row", "C share", "aioublk CPU µs / I/O", "iou-wrk",
                    "qemu-nbd CPU µs / I/O", "iou-wrk"], "lrrrrr", lines)]


def _devices_section(devices: Sequence[Mapping[str, Any]]) -> list[str]:
    checks = [d["check_ok"] for d in devices if d.get("check_ok") is not None]
    compares = [d["compare_ok"] for d in devices if d.get("compare_ok") is not None]
    return ["", "## Devices", "",
            f"`qemu-img check` after every device: {sum(checks)} of {len(checks)} passed. "
            f"`qemu-img compare` of the overlay with its base after every device nothing "
            f"wrote to (must be identical): {sum(compares)} of {len(compares)} passed.", "",
            *table(["round", "base", "rows", "server", "queues", "attach s", "check",
                    "compare"], "rlllrrll",
                   ([d["round"], LABELS.get(d["kind"], d["kind"]), d.get("rows", "—"),
                     d["server"], d["queues"], f"{d['attach_s']:.1f}", _integrity(d, "check"),
                     _integrity(d, "compare")] for d in devices))]


def plot(data: dict[str, Any], path: Path) -> None:
    """A bar per row and file-level phase: the paired ratio, its goal drawn across."""
    bars: list[tuple[str, float | None, float | None]] = [
        (label(r.key).replace(": ", "\n"), r.paired, TARGETS.get(r.key))
        for r in sorted(rows(data), key=lambda r: _order(r.key))]
    split = len(bars)
    bars += [(f"file level\n{PHASES.get(f.phase, f.phase)}", f.paired, FILE_TARGET)
             for f in file_rows(data)]
    where = "QEMU TCG" if data["guest"] else "host"
    ratio_bars(path, bars, "aioublk / best qemu-nbd, paired by round (files: time ratio)",
               f"qcow2 overlays on a base: aioublk / qemu-nbd (nbd.ko), per row the better AIO "
               f"setting\n{where}, {data['cpus']} CPUs, Linux {data['kernel']}, "
               f"{data['rounds']} round(s)" + (", --quick" if data.get("quick") else ""),
               height=6.0, split=split, labels=7)


def guest_timeout(runtime: int, rounds: int, quick: bool, size: int) -> float:
    """From the plan: generous (TCG is slow, a compressed base slower), but finite."""
    servers = len(NBD_AIO) + 1
    per_round = 0.0
    for spec in plan(quick):
        fio = sum(runtime * COUNT_CAP + 60 if s.how == "count" else runtime + RAMP + 60
                  for s in spec.steps)
        compare = size / MiB / COMPARE_RATE if spec.read_only else 0
        per_round += servers * (180 + fio + compare)
    per_round += servers * (300 if quick else 900)
    bases = 2 * size / MiB / COMPRESS_RATE + (300 if quick else 900)
    return 600 + bases + rounds * per_round


def _size(text: str) -> int:
    """A size like 1G, 512M or 1073741824, for ``--base-size``."""
    units = {"K": 10, "M": 20, "G": 30}
    try:
        n = int(text[:-1]) << units[text[-1].upper()] if text[-1:].isalpha() else int(text)
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (say 1G or 512M)") from None
    if n < 16 * MiB or n % MiB:
        raise argparse.ArgumentTypeError(f"{text}: a whole number of MiB, 16M or more")
    return n


def command(data: Mapping[str, Any]) -> str:
    return str(data.get("command") or default_command(data, "vm"))


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, runtime=5, rounds=None, rounds_help="default 3; 1 with --quick",
                quick="64 MiB bases, a few rows, one round", inner=("OUT",))
    ap.add_argument("--base-size", type=_size, default=None,
                    help="size of the bases (default 1G; 64M with --quick)")
    ap.add_argument("--cpus", type=int, default=4,
                    help="guest vCPUs (default 4, as bench.qcow2)")
    ns = ap.parse_args(argv)
    if ns.report:
        saved = load(ns.report)
        return publish("vm", saved, report(saved, command(saved)), plot, out=ns.out)
    runtime = ns.runtime or (2 if ns.quick else 5)
    rounds = ns.rounds or (1 if ns.quick else 3)
    size = ns.base_size or (QUICK_BASE_SIZE if ns.quick else BASE_SIZE)
    if ns.inner:
        inner(runtime, rounds, ns.quick, size, Path(ns.inner[0]))
        return 0
    options = [f"--runtime={runtime}", f"--rounds={rounds}", f"--base-size={size >> 20}M",
               *(["--quick"] if ns.quick else [])]
    code, data = run_guest("bench.vm", options, guest_timeout(runtime, rounds, ns.quick, size),
                           cpus=ns.cpus, kublk=False, memory=GUEST_MEMORY)
    if data is None:
        return 1
    data["command"] = " ".join([".venv/bin/python -m bench.vm", *options]
                               + ([f"--cpus={ns.cpus}"] if ns.cpus != 4 else []))
    return publish("vm", data, report(data, command(data)), plot, code, ns.out,
                   ok=bool(data.get("complete")))


if __name__ == "__main__":
    sys.exit(main())
