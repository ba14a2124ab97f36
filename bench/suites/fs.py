"""ext4 and XFS on aioublk devices under Debian's own workload tools, with the
server killed (-9) and recovered in the middle, and fsck and ``qemu-img check``
after every run.

Devices, each added with user recovery (``-r 1 -i 1``, held requests reissued):
``loop`` on a raw file, ``qcow2`` (``qemu-img create``), ``overlay`` (a qcow2
image over a qcow2 base holding data already), ``stripe`` over two files, and
``nbd`` (``-t nbd`` on ``qemu-nbd`` serving a qcow2 image over a unix socket);
kublk's ``loop`` and ``stripe`` are the reference. On each, ``mkfs.ext4`` and ``mkfs.xfs``,
mounted, then: stress-ng's file and I/O stressors with ``--verify`` (hdd with
random writes and reads, iomix, aio, io-uring, fallocate, sync-file), fs_mark,
dbench, fio writing with crc32c verification and reading it all back once more,
and the build of liburing from Debian sid's source package. During the workloads
that ``KILLED`` names the server gets ``kill -9`` and ``recover``, and the
workload goes on. Then umount, ``e2fsck -fn`` or ``xfs_repair -n``, the device
deleted, ``qemu-img check`` of its images.

The guest writes JSON; the host renders ``bench/results/fs.md``, ``fs.json`` and
``fs.png``. ``--quick`` (ext4 and XFS on loop and qcow2, 10 s of stress-ng hdd
with one kill and recover) is what the guest test runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import Data, load, parser, publish, run, run_guest

DEVICES = ("loop", "qcow2", "overlay", "stripe", "nbd")
KUBLK_DEVICES = ("loop", "stripe")  # kublk's own targets the suite runs as the reference
FILESYSTEMS = ("ext4", "xfs")
SIZE = 512 << 20  # XFS wants 300 MiB at least
BASE_DATA = 64 << 20  # written into the overlay's base before the overlay is made
RECOVERY = ["-r", "1", "-i", "1"]
SECONDS = 4  # each timed workload, in the full run
BUILD_ON = (("loop", "xfs"),)  # (device, fs): the C build takes minutes under emulation
QUICK_DEVICES = ("loop", "qcow2")
QUICK_WORKLOADS = ("stress-ng hdd",)
QUICK_SECONDS = 10
BUILD = "build liburing"
KILLED = ("stress-ng hdd", "fio verify", BUILD)
DBENCH_LOAD = "/usr/share/dbench/client.txt"
SOURCE_PACKAGE = "liburing"
MKFS = {"ext4": ["mkfs.ext4", "-q", "-F"], "xfs": ["mkfs.xfs", "-q", "-f"]}
FSCK = {"ext4": ["e2fsck", "-fn"], "xfs": ["xfs_repair", "-n"]}


# -- one device and its server --------------------------------------------------------


@dataclass
class Server:
    """One ublk device and the server behind it: add, kill -9 and recover, delete."""

    name: str  # aioublk or kublk
    cmd: list[str]
    args: list[str]  # add's arguments, given again to recover
    dev_id: str | None = None
    kills: int = 0
    log: list[str] = field(default_factory=list)

    @property
    def dev(self) -> str:
        return f"/dev/ublkb{self.dev_id}"

    def add(self) -> str | None:
        out, err = run([*self.cmd, "add", *self.args], timeout=180)
        if err:
            return f"add {err}"
        m = re.search(r"dev id (\d+)", out)
        if not m:
            return f"add printed no device id: {out.strip()[:200]!r}"
        self.dev_id = m.group(1)
        return wait_for(lambda: os.path.exists(self.dev), 30, f"{self.dev} never appeared")

    def listing(self) -> str:
        out, _ = run([*self.cmd, "list", "-n", str(self.dev_id)], timeout=120)
        return out

    def pid(self) -> int | None:
        m = re.search(r"daemon pid (\d+)", self.listing())
        return int(m.group(1)) if m and int(m.group(1)) > 0 else None

    def kill_recover(self) -> str | None:
        """kill -9 the server, wait for the device to be QUIESCED, recover it."""
        pid = self.pid()
        if pid is None:
            return f"no server pid in: {self.listing().strip()[:200]!r}"
        os.kill(pid, signal.SIGKILL)
        err = wait_for(lambda: gone(pid), 60, f"server {pid} alive 60 s after kill -9")
        err = err or wait_for(lambda: "QUIESCED" in self.listing(), 60,
                              "device not QUIESCED 60 s after the kill")
        if err:
            return err
        _, err = run([*self.cmd, "recover", "-n", str(self.dev_id), *self.args], timeout=180)
        if err:
            return f"recover {err}"
        self.kills += 1  # (recover returns once the device is LIVE again)
        return None

    def delete(self) -> str | None:
        if self.dev_id is None:
            return None
        _, err = run([*self.cmd, "del", "-n", self.dev_id], timeout=180)
        return f"del {err}" if err else None


def wait_for(ok: Callable[[], bool], seconds: float, what: str) -> str | None:
    deadline = time.monotonic() + seconds
    while not ok():
        if time.monotonic() > deadline:
            return what
        time.sleep(0.2)
    return None


def gone(pid: int) -> bool:
    """The process is gone or a zombie (a daemon is not our child to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# -- the device kinds -------------------------------------------------------------------


@dataclass
class Backing:
    """What a device kind serves: add's arguments, the images to check, and any
    daemon (qemu-nbd) to stop after."""

    args: list[str]
    qcow2: list[str]
    daemon: subprocess.Popen[bytes] | None = None

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.terminate()
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()


def qemu_img(*args: str) -> str | None:
    _, err = run(["qemu-img", *args], timeout=300)
    return f"qemu-img {args[0]} {err}" if err else None


def raw_file(path: str, size: int) -> str | None:
    """A sparse file: the folder is guest RAM, only what is written takes room."""
    try:
        with open(path, "wb") as f:
            f.truncate(size)
    except OSError as e:
        return f"{path}: {e.strerror}"
    return None


def backing(kind: str, folder: str) -> tuple[Backing | None, str | None]:
    """Make the images of one device kind in `folder`."""
    size = str(SIZE)
    img = os.path.join(folder, "disk.qcow2")
    if kind == "loop":
        path = os.path.join(folder, "disk.raw")
        return Backing(["-t", "loop", path], []), raw_file(path, SIZE)
    if kind == "stripe":
        paths = [os.path.join(folder, f"stripe{i}.raw") for i in (0, 1)]
        err = raw_file(paths[0], SIZE // 2) or raw_file(paths[1], SIZE // 2)
        return Backing(["-t", "stripe", *paths], []), err
    if kind == "qcow2":
        return Backing(["-t", "qcow2", img], [img]), qemu_img("create", "-q", "-f", "qcow2",
                                                              img, size)
    if kind == "overlay":
        base = os.path.join(folder, "base.qcow2")
        err = (qemu_img("create", "-q", "-f", "qcow2", base, size)
               or run(["qemu-io", "-f", "qcow2", "-c", f"write -P 0x5a 0 {BASE_DATA}", base],
                      timeout=300)[1]
               or qemu_img("create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", img, size))
        return Backing(["-t", "qcow2", img], [img, base]), err
    if kind == "nbd":
        err = qemu_img("create", "-q", "-f", "qcow2", img, size)
        if err:
            return None, err
        sock = os.path.join(folder, "nbd.sock")
        log = open(os.path.join(folder, "qemu-nbd.log"), "wb")  # noqa: SIM115 (closed below)
        with log:
            proc = subprocess.Popen(
                ["qemu-nbd", "--persistent", "--shared=8", "--cache=none", "-f", "qcow2",
                 "-x", "disk", "-k", sock, img],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        b = Backing(["-t", "nbd", f"nbd+unix:///disk?socket={sock}"], [img], proc)
        err = wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, 60,
                       "qemu-nbd: no socket after 60 s")
        if proc.poll() is not None:
            err = f"qemu-nbd exit {proc.returncode}"
        return b, err
    raise ValueError(kind)


# -- the workloads --------------------------------------------------------------------


@dataclass
class Workload:
    """A shell script run in WORK (a folder on the file system) with its output in
    OUT (outside it); `parse(OUT, stdout)` gives (operations, bytes verified)."""

    name: str
    script: str
    unit: str
    parse: Callable[[Path, str], tuple[float | None, int | None]]
    timeout: float
    kill_at: float  # seconds after its start, where KILLED names it


def _yaml_bogo_ops(out: Path, _stdout: str) -> tuple[float | None, int | None]:
    m = re.search(r"bogo-ops:\s*(\d+)", (out / "stress.yaml").read_text())
    return (float(m.group(1)) if m else None), None


def _fs_mark(_out: Path, stdout: str) -> tuple[float | None, int | None]:
    rows = re.findall(r"^\s*\d+\s+\d+\s+\d+\s+([\d.]+)\s+\d+\s*$", stdout, re.MULTILINE)
    return (float(rows[-1]) if rows else None), None


def _dbench(_out: Path, stdout: str) -> tuple[float | None, int | None]:
    m = re.search(r"Throughput ([\d.]+) MB/sec", stdout)
    return (float(m.group(1)) if m else None), None


def _fio(out: Path, _stdout: str) -> tuple[float | None, int | None]:
    verified = 0
    for name in ("write.json", "verify.json"):
        text = (out / name).read_text()
        job = json.loads(text[text.index("{"):])["jobs"][0]
        verified += int(job["read"]["io_bytes"])
    return float(verified), verified


def _build(out: Path, _stdout: str) -> tuple[float | None, int | None]:
    objects = (out / "objects").read_text().split()
    return float(len(objects)), None


def stress(name: str, opts: str, seconds: int) -> Workload:
    return Workload(
        f"stress-ng {name}",
        f"stress-ng {opts} --temp-path . --timeout {seconds}s --metrics-brief --verify "
        "--yaml $OUT/stress.yaml", "bogo ops", _yaml_bogo_ops, seconds * 6 + 120, seconds / 2)


def workloads(seconds: int, source: str | None) -> list[Workload]:
    fio = ("fio --name=verify --filename=fio.dat --size=24M --bs=4k --rw=randwrite "
           "--ioengine=io_uring --direct=1 --iodepth=16 --verify=crc32c --verify_fatal=1 "
           "--verify_backlog=512 --randrepeat=1 --output-format=json")
    got = [
        stress("hdd", "--hdd 1 --hdd-opts wr-rnd,rd-rnd --hdd-bytes 32M", seconds),
        stress("iomix", "--iomix 1 --iomix-bytes 32M", seconds),
        stress("aio", "--aio 1 --aio-requests 16", seconds),
        stress("io-uring", "--io-uring 1", seconds),
        stress("fallocate", "--fallocate 1 --fallocate-bytes 32M", seconds),
        stress("sync-file", "--sync-file 1 --sync-file-bytes 32M", seconds),
        Workload("fs_mark", "fs_mark -d fsmark -n 200 -s 16384 -L 1 -t 1 -S 1", "files/s",
                 _fs_mark, 600, 5),
        Workload("dbench", f"dbench -D . -t {seconds} -c {DBENCH_LOAD} 2", "MB/s",
                 _dbench, seconds * 6 + 180, seconds / 2),
        Workload("fio verify", f"{fio} --output=$OUT/write.json && "
                 f"{fio} --verify_only --output=$OUT/verify.json", "bytes verified", _fio, 300, 4),
    ]
    if source:
        orig, debian = sorted(Path(source).glob("*.orig.tar.*")), sorted(
            Path(source).glob("*.debian.tar.*"))
        got.append(Workload(
            BUILD,
            f"tar xf {shlex.quote(str(orig[0]))} && cd liburing-* && "
            f"tar xf {shlex.quote(str(debian[0]))} && ./configure >$OUT/configure.log && "
            "make -C src -j2 >$OUT/make.log 2>&1 && test -s src/liburing.a && "
            "ar t src/liburing.a >$OUT/objects", "objects", _build, 1800, 20))
    return got


def run_workload(w: Workload, work: Path, out: Path, server: Server, kill_at: float | None,
                 ) -> dict[str, Any]:
    """Run `w`; `kill_at` s after it started (or once it ended, if sooner) the server is
    killed and recovered while the workload goes on."""
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    got: dict[str, Any] = {"workload": w.name, "unit": w.unit, "ops": None,
                           "bytes_verified": None, "kills": 0, "kill_during": None,
                           "error": None}
    start = time.monotonic()
    p = subprocess.Popen(["sh", "-c", w.script], cwd=work, env={**os.environ, "OUT": str(out)},
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    kill_err = None
    try:
        if kill_at is not None:
            try:
                p.wait(timeout=kill_at)
                got["kill_during"] = False
            except subprocess.TimeoutExpired:
                got["kill_during"] = True
            before = server.kills
            kill_err = server.kill_recover()
            got["kills"] = server.kills - before
        stdout, _ = p.communicate(timeout=max(1.0, w.timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, _ = p.communicate()
        got["error"] = f"timed out after {w.timeout:.0f} s"
    got["seconds"] = round(time.monotonic() - start, 1)
    (out / "output.log").write_text(stdout)
    if got["error"] is None and p.returncode != 0:
        tail = " | ".join(stdout.strip().splitlines()[-4:])
        got["error"] = f"exit {p.returncode}: {tail}"
    if got["error"] is None:
        try:
            got["ops"], got["bytes_verified"] = w.parse(out, stdout)
        except (OSError, ValueError, KeyError, IndexError) as e:
            got["error"] = f"no result: {e}"
        if got["ops"] is None and got["error"] is None:
            got["error"] = "no result in its output"
    if kill_err:
        got["error"] = f"kill/recover: {kill_err}" + (f"; {got['error']}" if got["error"] else "")
    got["result"] = "fail" if got["error"] else "pass"
    return got


# -- one device kind, one file system, one server ----------------------------------------


def check_images(images: Sequence[str]) -> str | None:
    """``qemu-img check`` of each image: "clean", "leaks: ..." (clusters allocated and
    never referenced, as a kill may leave) or "corrupt: ..."; None with no images."""
    if not images:
        return None
    said = []
    for img in images:
        try:
            p = subprocess.run(["qemu-img", "check", "-f", "qcow2", img], capture_output=True,
                               text=True, timeout=300, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"corrupt: {os.path.basename(img)}: qemu-img check timed out"
        last = " | ".join((p.stdout + p.stderr).strip().splitlines()[-3:])
        if p.returncode == 3:
            count = re.search(r"^\d+ leaked clusters? (?:was|were) found.*$", p.stdout,
                              re.MULTILINE)
            said.append(f"leaks: {os.path.basename(img)}: {count.group(0) if count else last}")
        elif p.returncode != 0:
            return f"corrupt: {os.path.basename(img)}: exit {p.returncode}: {last}"
    return "; ".join(said) or "clean"


def fsck(fs: str, dev: str) -> str:
    out, err = run([*FSCK[fs], dev], timeout=600)
    return "clean" if err is None else f"errors: {err}"


def device_run(server: str, cmd: list[str], kind: str, fs: str, loads: Sequence[Workload],
               killed: Sequence[str], scratch: str, save: Callable[[dict[str, Any]], None],
               ) -> dict[str, Any]:
    """mkfs, mount, every workload (the server killed and recovered during those
    `killed` names), umount, fsck, delete, check the images. Each workload's record
    goes to `save` as it ends; the run's own record (fsck, check, kills) is returned."""
    folder = tempfile.mkdtemp(dir=scratch, prefix=f"{kind}-{fs}-{server}.")
    rec: dict[str, Any] = {"device": kind, "fs": fs, "server": server, "kills": 0,
                           "fsck": None, "check": None, "error": None}
    b, err = backing(kind, folder)
    srv = Server(server, cmd, ["-q", "1", *RECOVERY, *(b.args if b else [])])
    mnt = Path(folder) / "mnt"
    mounted = False
    try:
        err = err or srv.add()
        if not err:
            _, e = run([*MKFS[fs], srv.dev], timeout=600)
            err = e and f"mkfs.{fs} {e}"
        if not err:
            mnt.mkdir()
            _, e = run(["mount", srv.dev, str(mnt)], timeout=120)
            err, mounted = e and f"mount {e}", e is None
        if err:
            rec["error"] = err
            return rec
        for w in loads:
            slug = w.name.replace(" ", "-")
            got = run_workload(w, mnt / slug, Path(folder) / "out" / slug, srv,
                               w.kill_at if w.name in killed else None)
            save({"device": kind, "fs": fs, "server": server, **got})
        _, e = run(["umount", str(mnt)], timeout=300)
        if e:
            rec["error"] = f"umount {e}"
            run(["umount", "-l", str(mnt)], timeout=60)
        mounted = False
        rec["fsck"] = fsck(fs, srv.dev)
    except Exception as e:  # one failed step must not end the whole run
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if mounted:
            run(["umount", "-l", str(mnt)], timeout=60)
        rec["kills"] = srv.kills
        gone_err = srv.delete()
        if gone_err:
            rec["error"] = rec["error"] or gone_err
        if b is not None:
            b.close()
            rec["check"] = check_images(b.qcow2) if srv.dev_id else None  # (served ones)
        shutil.rmtree(folder, ignore_errors=True)
    return rec


def versions() -> dict[str, str]:
    got = {}
    for tool, argv in {"stress-ng": ["stress-ng", "--version"], "fio": ["fio", "--version"],
                       "dbench": ["sh", "-c", "dbench --help 2>&1 | head -1"],
                       "qemu-img": ["qemu-img", "--version"],
                       "e2fsprogs": ["sh", "-c", "e2fsck -V 2>&1 | head -1"],
                       "xfsprogs": ["xfs_repair", "-V"]}.items():
        out, _ = run(argv, timeout=60)
        got[tool] = out.strip().splitlines()[0] if out.strip() else "?"
    return got


def suite(kublk: str | None, source: str | None, quick: bool, seconds: int,
          devices: Sequence[str], filesystems: Sequence[str], out: Path | None) -> Data:
    """Runs in the guest: every device kind x file system x server. Rewrites `out`
    after every step, so a crash keeps what was done."""
    from bench.qcow2 import _image_folder

    loads = workloads(seconds, None if quick else source)
    if quick:
        loads = [w for w in loads if w.name in QUICK_WORKLOADS]
    release, _ = run(["uname", "-r"], timeout=10)
    runs: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    data: Data = {
        "kernel": release.strip(), "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "quick": quick,
        "seconds": seconds, "size": SIZE, "killed": list(KILLED), "source": source,
        "build_on": [list(x) for x in BUILD_ON],
        "versions": versions(), "complete": False, "runs": runs, "checks": checks,
    }
    scratch = str(_image_folder(SIZE)["path"])
    start = time.monotonic()

    def save(rec: dict[str, Any] | None = None) -> None:
        if rec is not None:
            runs.append(rec)
            shown = f"{rec['ops']:,.0f} {rec['unit']}" if rec["ops"] is not None else ""
            print(f"[{time.monotonic() - start:5.0f} s] {rec['device']:7} {rec['fs']:4} "
                  f"{rec['server']:7} {rec['workload']:20} {rec['result']} {shown} "
                  f"kills {rec['kills']} {rec['error'] or ''}", flush=True)
        if out is not None:
            out.write_text(json.dumps(data))

    servers = [("aioublk", [sys.executable, "-m", "aioublk"])]
    for kind in devices:
        for fs in filesystems:
            for server, cmd in servers + ([("kublk", [kublk])] if kublk and not quick
                                         and kind in KUBLK_DEVICES else []):
                these = [w for w in loads if w.name != BUILD or (kind, fs) in BUILD_ON]
                rec = device_run(server, cmd, kind, fs, these, KILLED, scratch, save)
                checks.append(rec)
                print(f"[{time.monotonic() - start:5.0f} s] {kind:7} {fs:4} {server:7} "
                      f"kills {rec['kills']} fsck {rec['fsck']} check {rec['check']} "
                      f"{rec['error'] or ''}", flush=True)
                save()
    data["complete"] = True
    save()
    return data


# -- the source package, fetched on the host --------------------------------------------


def fetch_source(package: str = SOURCE_PACKAGE) -> Path:
    """Debian sid's source package of `package` (its .orig and .debian tarballs),
    checked against the .dsc's SHA-256 sums, cached under the aioublk cache (which
    the guest sees)."""
    from aioublk.testing.sid import SidApt, cache_dir, host_mirror, locked, progress

    version = SidApt().field(f"{package}-dev", "Version").split(":")[-1]
    dest = cache_dir() / "src" / f"{package}_{version}"
    with locked("src"):
        if (dest / "complete").exists():
            return dest
        dest.mkdir(parents=True, exist_ok=True)
        pool = (f"{host_mirror()}/pool/main/"
                f"{package[:4] if package.startswith('lib') else package[0]}/{package}")
        progress(f"downloading the {package} {version} source package from Debian sid")
        with urllib.request.urlopen(f"{pool}/{package}_{version}.dsc", timeout=120) as r:
            dsc = r.read().decode()
        sums = dsc.split("Checksums-Sha256:")[1]
        for sha, name in re.findall(r"^ ([0-9a-f]{64}) \d+ (\S+)$", sums, re.MULTILINE):
            if name.endswith(".asc"):
                continue
            with urllib.request.urlopen(f"{pool}/{name}", timeout=300) as r:
                blob = r.read()
            if hashlib.sha256(blob).hexdigest() != sha:
                raise SystemExit(f"{name}: SHA-256 differs from the .dsc's; try again")
            (dest / name).write_bytes(blob)
        (dest / f"{package}_{version}.dsc").write_text(dsc)
        (dest / "complete").touch()
    return dest


def merge(data: Data, other: Data) -> None:
    """`other`'s device kinds replace `data`'s rows of them (a kind run again), in
    DEVICES order; the command names both runs."""
    kinds = {c["device"] for c in other["checks"]}
    for key in ("runs", "checks"):
        rows = [r for r in data[key] if r["device"] not in kinds] + other[key]
        data[key] = sorted(rows, key=lambda r: DEVICES.index(r["device"]))
    data["command"] = f"{data.get('command')}` then `{other.get('command')}"
    data["complete"] = data["complete"] and other["complete"]


# -- the command -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from bench.suites import fs_report

    ap = parser(__doc__, rounds=False, quick="ext4 and XFS on loop and qcow2, 10 s of "
                "stress-ng hdd with one kill -9 and recover", inner=("KUBLK", "SOURCE", "OUT"))
    ap.add_argument("--seconds", type=int, default=None,
                    help=f"seconds per timed workload (default {SECONDS}, --quick 10)")
    ap.add_argument("--devices", default=",".join(DEVICES),
                    help=f"device kinds, comma-separated (default {','.join(DEVICES)})")
    ap.add_argument("--filesystems", default=",".join(FILESYSTEMS),
                    help="file systems, comma-separated (default ext4,xfs)")
    ap.add_argument("--no-build", action="store_true",
                    help="leave out the build of liburing (no download from Debian)")
    ap.add_argument("--merge", metavar="JSON", help="with --report: the device kinds "
                    "this other run covered replace the first run's rows")
    ns = ap.parse_args(argv)
    quick = bool(ns.quick)
    devices = list(QUICK_DEVICES) if quick else ns.devices.split(",")
    filesystems = ns.filesystems.split(",")
    for bad in [d for d in devices if d not in DEVICES] + [
            f for f in filesystems if f not in FILESYSTEMS]:
        ap.error(f"unknown device kind or file system {bad!r}: pick from "
                 f"{', '.join(DEVICES + FILESYSTEMS)}")
    seconds = ns.seconds or (QUICK_SECONDS if quick else SECONDS)
    if ns.report:
        saved = load(ns.report)
        if ns.merge:
            merge(saved, load(ns.merge))
        shown = saved.get("command") or ".venv/bin/python -m bench.suites fs"
        return publish("fs", saved, fs_report.report(saved, shown), fs_report.plot, out=ns.out)
    if ns.inner:
        kublk, source, out = ns.inner
        suite(kublk, None if source == "-" else source, quick, seconds, devices, filesystems,
              Path(out))
        return 0
    source = "-"
    if not (quick or ns.no_build):
        source = str(fetch_source())
    options = [f"--seconds={seconds}", f"--devices={','.join(devices)}",
               f"--filesystems={','.join(filesystems)}", *(["--quick"] if quick else [])]
    runs = len(devices) * len(filesystems) * (1 if quick else 2)
    code, data = run_guest("bench.suites.fs", options, timeout=900 + runs * (seconds * 40 + 400),
                           inner=[source])
    if data is None:
        return 1
    data["command"] = " ".join([".venv/bin/python", "-m", "bench.suites", "fs", *options,
                                *(["--no-build"] if ns.no_build else [])])
    ok = data["complete"] and all(r["result"] == "pass" for r in data["runs"]) and all(
        c["error"] is None and c["fsck"] == "clean" for c in data["checks"])
    return publish("fs", data, fs_report.report(data, data["command"]), fs_report.plot, code,
                   ns.out, ok=ok)


if __name__ == "__main__":
    sys.exit(main())
