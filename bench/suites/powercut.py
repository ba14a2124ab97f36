"""File systems replayed to every flush of a dm-log-writes log, fsck at each.

    python -m bench.suites powercut [--quick] [--points N]

For each device kind (an aioublk loop device on a raw file, an aioublk qcow2
device, and kublk's loop device as the reference) and each file system (ext4,
XFS): the kernel's dm-log-writes target goes between the file system and the
device, logging every write in the order it reached stable storage onto a loop
device of its own. mkfs, a mark, then a workload that makes flushes: files
written, fsynced, renamed into place and their folder fsynced (each such file's
checksum kept and a mark logged once its fsync returned), around unsynced churn
(and stress-ng's hdd and sync-file stressors beside it, but in ``--quick``).

The log is then replayed onto a zeroed file, the device's starting state, up to
FLUSH and FUA points after mkfs (every one, or evenly spread ones and the last
when there are more than ``--points``). At each: a copy is mounted, which
recovers the journal as a restart after a power cut would (xfstests' generic/482
does the same), every file whose mark precedes the point must read back with
its checksum, and after umount ``e2fsck -fn`` or ``xfs_repair -n`` must find
nothing: what the file system was told durable is durable. Last, the whole log
replayed must equal what the device holds (``qemu-img compare``): every write
landed where it was sent.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from bench.common import Data, load, notes, parser, publish, pyplot, run, run_guest, table
from bench.modes import _add
from bench.suites import counts
from bench.suites.logwrites import LogError, Replayer, pick, read_log

MiB = 1 << 20
FILESYSTEMS = ("ext4", "xfs")
#: (server, device kind) in the order a full run goes
CASES = (("aioublk", "loop"), ("aioublk", "qcow2"), ("kublk", "loop"))
#: XFS refuses less than 300 MB
SIZES = {"ext4": 128 * MiB, "xfs": 320 * MiB}
MKFS = {"ext4": ["mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0"],
        "xfs": ["mkfs.xfs", "-q", "-f", "-K"]}
FSCK = {"ext4": ["e2fsck", "-fn"], "xfs": ["xfs_repair", "-n"]}
POINTS, QUICK_POINTS = 20, 8
FILES, QUICK_FILES = 30, 8
STRESS_SECONDS = 15
DM_NAME = "powercut"
#: serve(kind, image) -> a context holding the device node that serves `image`
Serve = Callable[[str, Path], AbstractContextManager[str]]


# -- devices --------------------------------------------------------------------------------


def cli_serve(cmd: Sequence[str]) -> Serve:
    """Devices that ``CMD add -t KIND -q 1 IMAGE`` adds and ``CMD del -n ID`` removes."""

    @contextlib.contextmanager
    def serve(kind: str, image: Path) -> Iterator[str]:
        dev_id, err = _add(list(cmd), ["-t", kind, "-q", "1", str(image)])
        if dev_id is None:
            raise RuntimeError(f"{os.path.basename(cmd[-1])} {err}")
        try:
            yield f"/dev/ublkb{dev_id}"
        finally:
            _, err = run([*cmd, "del", "-n", dev_id], timeout=180)
            if err:
                print(f"  del -n {dev_id}: {err}", flush=True)

    return serve


def _must(*cmd: str, timeout: float = 300) -> str:
    out, err = run(list(cmd), timeout)
    if err:
        raise RuntimeError(f"{cmd[0]} {err}")
    return out


@contextlib.contextmanager
def _loop_device(path: Path) -> Iterator[str]:
    dev = _must("losetup", "-f", "--show", str(path)).strip()
    try:
        yield dev
    finally:
        run(["losetup", "-d", dev], timeout=60)


@contextlib.contextmanager
def _log_writes(data: str, log: str) -> Iterator[str]:
    """The node of dm-log-writes over `data`, its log on `log`."""
    sectors = _must("blockdev", "--getsz", data).strip()
    _must("dmsetup", "create", DM_NAME, "--table", f"0 {sectors} log-writes {data} {log}")
    try:
        # /dev/dm-N, which devtmpfs makes: /dev/mapper/ needs udev
        name = _must("dmsetup", "info", "-c", "--noheadings", "-o", "blkdevname", DM_NAME)
        node = f"/dev/{name.strip()}"
        deadline = time.monotonic() + 30
        while not os.path.exists(node):
            if time.monotonic() > deadline:
                raise RuntimeError(f"dmsetup create: no {node} after 30 s")
            time.sleep(0.1)
        yield node
    finally:
        _, err = run(["dmsetup", "remove", "--retry", DM_NAME], timeout=120)
        if err:
            print(f"  dmsetup remove: {err}", flush=True)


def mark(name: str) -> None:
    _must("dmsetup", "message", DM_NAME, "0", "mark", name)


@contextlib.contextmanager
def _mounted(dev: str, mnt: Path, *opts: str) -> Iterator[Path]:
    _must("mount", *opts, dev, str(mnt))
    try:
        yield mnt
    finally:
        _must("umount", str(mnt))


# -- the workload ---------------------------------------------------------------------------


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def workload(root: Path, files: int, seed: int, stress: int) -> list[dict[str, Any]]:
    """Files made durable the safe way (write a temporary, fsync it, rename it into
    place, fsync the folder) among unsynced churn; a mark after each. Returns the
    durable files: name, checksum, mark."""
    rnd = random.Random(seed)
    done, churn = root / "durable", root / "churn"
    done.mkdir()
    churn.mkdir()
    _fsync_path(root)
    helper = None
    if stress:
        (root / "stress").mkdir()
        helper = subprocess.Popen(
            ["stress-ng", "--hdd", "1", "--hdd-bytes", "8m", "--hdd-opts", "wr-rnd,fsync",
             "--sync-file", "1", "--sync-file-bytes", "8m", "--timeout", f"{stress}s",
             "--temp-path", str(root / "stress"), "--quiet"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    made = []
    try:
        for i in range(files):
            for j in range(rnd.randrange(1, 6)):  # churn nobody asked to keep
                path = churn / f"c{i}-{j}"
                path.write_bytes(rnd.randbytes(rnd.randrange(1, 64 << 10)))
                if rnd.random() < 0.3:
                    path.rename(churn / f"r{i}-{j}")
            for old in rnd.sample(sorted(churn.iterdir()), k=min(2, i)):
                old.unlink()
            body = rnd.randbytes(rnd.choice([512, 4096, 3 * 4096 + 100, 200 << 10]))
            tmp = done / f".f{i}.tmp"
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            tmp.rename(done / f"f{i}")
            _fsync_path(done)
            name = f"f{i}"
            mark(name)
            made.append({"name": name, "sha256": hashlib.sha256(body).hexdigest(),
                         "size": len(body), "mark": name})
    finally:
        if helper is not None:
            _, err = helper.communicate(timeout=stress + 300)
            if helper.returncode:
                raise RuntimeError(f"stress-ng exit {helper.returncode}: {err.strip()[-300:]}")
    return made


# -- replay and check -----------------------------------------------------------------------


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy only `src`'s data, its holes stay holes: copies stay cheap."""
    with open(src, "rb") as s, open(dst, "wb") as d:
        size = os.fstat(s.fileno()).st_size
        d.truncate(size)
        pos = 0
        while pos < size:
            try:
                start = os.lseek(s.fileno(), pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole is left
                    break
                raise
            end = os.lseek(s.fileno(), start, os.SEEK_HOLE)
            while start < end:
                n = os.copy_file_range(s.fileno(), d.fileno(), end - start, start, start)
                if n <= 0:
                    raise OSError(f"copy_file_range copied nothing at byte {start} of {src}")
                start += n
            pos = end


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check_point(fs: str, image: Path, mnt: Path, keep: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mount a copy replayed to one point (recovering its journal), read back the
    files made durable before it, umount, fsck."""
    got: dict[str, Any] = {"verified": 0, "bad": [], "fsck": None, "error": None}
    try:
        with _loop_device(image) as dev:
            with _mounted(dev, mnt):
                for f in keep:
                    path = mnt / "durable" / f["name"]
                    if not path.exists():
                        got["bad"].append(f"{f['name']} missing")
                    elif (digest := _sha256(path)) != f["sha256"]:
                        got["bad"].append(f"{f['name']} differs ({path.stat().st_size} bytes, "
                                          f"{f['size']} written; sha256 {digest[:12]})")
                    else:
                        got["verified"] += 1
            _, err = run([*FSCK[fs], dev], timeout=600)
            got["fsck"] = "clean" if err is None else err
    except RuntimeError as e:
        got["error"] = str(e)
    return got


def replay_and_check(fs: str, log_path: Path, size: int, work: Path, made: list[dict[str, Any]],
                     most: int, say: Callable[[str], None]) -> tuple[dict[str, Any], Path]:
    """Replay the log onto a zeroed file point by point, check each; returns the
    figures and the file with the whole log replayed."""
    replayed, scratch, mnt = work / "replay.img", work / "scratch.img", work / "check"
    mnt.mkdir(exist_ok=True)
    with open(replayed, "wb") as f:
        f.truncate(size)
    with open(log_path, "rb") as src, open(replayed, "r+b") as dst:
        log = read_log(src)
        marks = log.marks()
        after = log.mark("mkfs")
        points = log.durable_points(after)
        chosen = pick(points, most)
        r = Replayer(log, src, dst, size)
        checks = []
        for n, point in enumerate(chosen):
            t0 = time.monotonic()
            r.to(point)
            sparse_copy(replayed, scratch)
            keep = [f for f in made if marks.get(f["mark"], len(log.entries)) < point]
            got = check_point(fs, scratch, mnt, keep)
            got |= {"entry": point, "expected": len(keep),
                    "seconds": round(time.monotonic() - t0, 1)}
            checks.append(got)
            say(f"point {n + 1}/{len(chosen)} entry {point}: fsck {got['fsck']}, "
                f"{got['verified']}/{len(keep)} files"
                + (f", {got['error']}" if got["error"] else "")
                + (f", BAD {got['bad']}" if got["bad"] else ""))
        if log.entries:
            r.to(len(log.entries) - 1)
        scratch.unlink(missing_ok=True)
        figures = {"entries": len(log.entries), "sectorsize": log.sectorsize,
                   "mkfs_entry": after, "durable_points": len(points),
                   "marks": len(marks), "replayed_bytes": r.written, "checks": checks}
    return figures, replayed


def _failures(case: dict[str, Any]) -> list[str]:
    out = [] if case.get("error") is None else [str(case["error"])]
    for c in case.get("checks", []):
        where = f"entry {c['entry']}"
        if c["error"]:
            out.append(f"{where}: {c['error']}")
        elif c["fsck"] != "clean":
            out.append(f"{where}: fsck {c['fsck']}")
        out += [f"{where}: {b}" for b in c["bad"]]
    if case.get("checks") == []:
        out.append("no flush point after mkfs to check")
    if case.get("identical") not in (None, True):
        out.append(f"whole log replayed differs from the device: {case['identical']}")
    if case.get("logging") not in (None, "on"):
        out.append(f"dm-log-writes stopped logging: {case['logging']}")
    return out


def one_case(server: str, kind: str, fs: str, serve: Serve, work: Path, *, files: int,
             points: int, stress: int, seed: int = 52) -> dict[str, Any]:
    """mkfs, workload and umount on dm-log-writes over a new device, then the
    replay; a record with the figures and ``result`` pass or fail."""
    t0 = time.monotonic()
    case: dict[str, Any] = {"test": f"{kind} {fs}", "server": server, "kind": kind, "fs": fs,
                            "size": SIZES[fs], "error": None}

    def say(what: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {server} {kind} {fs}: {what}", flush=True)

    work.mkdir(parents=True, exist_ok=True)
    image, log_file, mnt = work / f"disk.{kind}", work / "log.img", work / "mnt"
    mnt.mkdir(exist_ok=True)
    try:
        if kind == "qcow2":
            _must("qemu-img", "create", "-q", "-f", "qcow2", str(image), str(SIZES[fs]))
        else:
            with open(image, "wb") as f:
                f.truncate(SIZES[fs])
        with open(log_file, "wb") as f:
            f.truncate(4 * SIZES[fs])  # sparse: it takes only what is logged
        with _loop_device(log_file) as log_dev, serve(kind, image) as dev:
            with _log_writes(dev, log_dev) as dm:
                _must(*MKFS[fs], dm)
                mark("mkfs")
                say("mkfs done")
                with _mounted(dm, mnt):
                    made = workload(mnt, files, seed, stress)
                status = _must("dmsetup", "status", DM_NAME).split()
                case["logging"] = "logging_disabled" if "logging_disabled" in status else "on"
            say(f"workload done: {len(made)} durable files")
        case["durable_files"] = len(made)
        case["log_bytes"] = os.stat(log_file).st_blocks * 512
        figures, replayed = replay_and_check(fs, log_file, SIZES[fs], work, made, points, say)
        case |= figures
        fmt = "qcow2" if kind == "qcow2" else "raw"
        _, err = run(["qemu-img", "compare", "-q", "-f", "raw", "-F", fmt, str(replayed),
                      str(image)], timeout=600)
        case["identical"] = True if err is None else err
    except (RuntimeError, LogError, OSError, subprocess.SubprocessError) as e:
        case["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    case["failures"] = _failures(case)
    case["result"] = "fail" if case["failures"] else "pass"
    case["seconds"] = round(time.monotonic() - t0, 1)
    say(f"{case['result']} in {case['seconds']} s" +
        "".join(f"\n  {f}" for f in case["failures"]))
    return case


def load_modules() -> None:
    """dm-log-writes, and loop for the log and the replayed copies."""
    for module in ("dm-log-writes", "loop"):
        _must("modprobe", module, timeout=60)


def quick(serve: Serve, work: Path, kind: str = "loop") -> list[dict[str, Any]]:
    """One device kind, ext4 and XFS, a small workload, a few points each."""
    load_modules()
    return [one_case("aioublk", kind, fs, serve, work / fs, files=QUICK_FILES,
                     points=QUICK_POINTS, stress=0) for fs in FILESYSTEMS]


# -- the command ----------------------------------------------------------------------------


def inner(kublk: str, out: Path, quick_run: bool, most: int) -> None:
    """Runs in the guest; rewrites `out` after every case."""
    import json

    release, _ = run(["uname", "-r"], timeout=10)
    data: Data = {"kernel": release.strip(), "cpus": os.cpu_count(),
                  "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "quick": quick_run,
                  "points": most, "complete": False, "cases": []}
    try:
        load_modules()
    except RuntimeError as e:
        data["error"] = str(e)
        out.write_text(json.dumps(data))
        return
    servers = {"aioublk": cli_serve([sys.executable, "-m", "aioublk"]),
               "kublk": cli_serve([kublk])}
    cases = [("aioublk", "loop")] if quick_run else CASES
    work = Path(tempfile.mkdtemp(prefix="powercut-"))
    for server, kind in cases:
        for fs in FILESYSTEMS:
            data["cases"].append(one_case(
                server, kind, fs, servers[server], work / f"{server}-{kind}-{fs}",
                files=QUICK_FILES if quick_run else FILES, points=most,
                stress=0 if quick_run else STRESS_SECONDS))
            out.write_text(json.dumps(data))
    data["complete"] = True
    out.write_text(json.dumps(data))


def _sum(case: dict[str, Any], key: str) -> int:
    return sum(int(c[key]) for c in case.get("checks", []))


def _clean(case: dict[str, Any]) -> int:
    """The points where fsck found nothing and every file read back intact."""
    return sum(c["fsck"] == "clean" and not c["error"] and not c["bad"]
               for c in case.get("checks", []))


def report(data: Data, command: str) -> str:
    cases = data["cases"]
    lines = [
        "# File systems after power cuts: dm-log-writes replayed to each flush", "",
        ("One guest run: QEMU TCG software emulation (no KVM), 4 GiB RAM" if data["guest"]
         else "One run on the host") + f", {data['cpus']} CPUs, Linux {data['kernel']}.",
        "",
        "dm-log-writes between the file system and the device logs each write in the "
        "order it reached stable storage. After mkfs and a workload (files written, "
        "fsynced, renamed into place and their folder fsynced, a mark logged after "
        "each, among unsynced churn" + ("" if data["quick"] else ", with stress-ng's hdd "
                                        "and sync-file stressors beside it") + "), the "
        "log is replayed onto a zeroed file up to FLUSH and FUA points after mkfs "
        f"(all of them, or {data['points']} evenly spread ones ending with the last). "
        "At each point a copy is mounted (recovering the journal), every file whose "
        "mark precedes the point must read back with its checksum, then `e2fsck -fn` "
        "or `xfs_repair -n` must find nothing. **replay = device**: the whole log "
        "replayed equals what the device holds (`qemu-img compare`). kublk's loop "
        "target is the reference.",
    ]
    if data.get("error"):
        lines += ["", f"**Not run**: {data['error']}"]
    lines += notes(data, "aioublk's loop device only, a small workload, a few points")
    rows = [[c["server"], c["kind"], c["fs"], f"{c['size'] // MiB} MiB",
             c.get("entries", "—"), f"{c['log_bytes'] / MiB:.1f}" if "log_bytes" in c else "—",
             c.get("durable_points", "—"), len(c.get("checks", [])),
             f"{_clean(c)}/{len(c.get('checks', []))}",
             f"{_sum(c, 'verified')}/{_sum(c, 'expected')}", c.get("durable_files", "—"),
             {True: "yes", None: "—"}.get(c.get("identical"), "no"), c["result"]]
            for c in cases]
    lines += ["", *table(["server", "device", "fs", "size", "log entries", "log MiB",
                          "flush/FUA points", "checked", "fsck clean", "files verified",
                          "durable files", "replay = device", "result"],
                         "llllrrrrrrrlr", rows)]
    lines += ["", "**files verified**: over all checked points, the files made durable "
                  "before the point that read back intact, of those expected."]
    for server in dict.fromkeys(c["server"] for c in cases):
        got = counts(cases, server)
        lines += ["", f"{server}: " + ", ".join(f"{n} {k}" for k, n in got.items())]
    failed = [(c, f) for c in cases for f in c["failures"]]
    if failed:
        lines += ["", "## Failures", ""]
        lines += [f"- {c['server']} {c['kind']} {c['fs']}: `{f}`" for c, f in failed]
    lines += ["", f"Chart: `powercut.png`. Reproduce: `{command}` from the repository "
                  "root (boots the guest when the host has no ublk_drv; builds kublk "
                  "from Debian sid's linux-source).", ""]
    return "\n".join(lines)


def plot(data: Data, path: Path) -> None:
    """Per case, the points checked: clean and not."""
    plt = pyplot()
    cases = data["cases"]
    names = [f"{c['server']}\n{c['kind']} {c['fs']}" for c in cases]
    clean = [_clean(c) for c in cases]
    bad = [len(c.get("checks", [])) - k for c, k in zip(cases, clean, strict=True)]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(cases) + 2), 4.5))
    ax.bar(range(len(cases)), clean, 0.6, color="tab:green", label="fsck clean, files intact")
    ax.bar(range(len(cases)), bad, 0.6, bottom=clean, color="tab:red", label="failed")
    for i, c in enumerate(cases):
        ax.annotate(f"of {c.get('durable_points', 0)} points", (i, clean[i] + bad[i]),
                    xytext=(0, 2), textcoords="offset points", ha="center", fontsize=8)
    ax.set_ylim(0, max([k + b for k, b in zip(clean, bad, strict=True)] + [1]) * 1.15)
    ax.set_xticks(range(len(cases)), names, fontsize=8)
    ax.set_ylabel("flush/FUA points checked")
    ax.set_title(f"dm-log-writes replay, fsck at each point (Linux {data['kernel']})",
                 fontsize=10)
    ax.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, rounds=False,
                quick=f"aioublk's loop device, ext4 and XFS, {QUICK_FILES} durable files, "
                      f"{QUICK_POINTS} points each")
    ap.add_argument("--points", type=int, default=None,
                    help=f"most flush points checked per case (default {POINTS}, "
                         f"{QUICK_POINTS} with --quick)")
    ns = ap.parse_args(argv)
    most = ns.points or (QUICK_POINTS if ns.quick else POINTS)
    if ns.report:
        saved = load(ns.report)
        shown = str(saved.get("command") or ".venv/bin/python -m bench.suites powercut")
        return publish("powercut", saved, report(saved, shown), plot, out=ns.out)
    if ns.inner:
        inner(ns.inner[0], Path(ns.inner[1]), ns.quick, most)
        return 0
    options = [f"--points={most}", *(["--quick"] if ns.quick else [])]
    cases = 2 if ns.quick else len(CASES) * len(FILESYSTEMS)
    code, data = run_guest("bench.suites.powercut", options,
                           timeout=900 + cases * (300 + 30 * most))
    if data is None:
        return 1
    data["command"] = " ".join([".venv/bin/python", "-m", "bench.suites", "powercut", *options])
    ok = data["complete"] and all(c["result"] == "pass" for c in data["cases"])
    return publish("powercut", data, report(data, data["command"]), plot, code, ns.out, ok)


if __name__ == "__main__":
    sys.exit(main())
