"""aioublk's qcow2 target beside qemu-nbd + nbd.ko, in one guest run, in rounds.

    python -m bench.qcow2 [--runtime 5] [--rounds 3] [--rows goals|all] [--quick]
                          [--nbd-aio both|io_uring|native] [--cpus 4]

Each server exports a fresh 2 GiB qcow2 image (64 KiB clusters) kept in guest
RAM (tmpfs), once EMPTY (``qemu-img create -f qcow2``) and once PREALLOCATED
(``-o preallocation=metadata``: every L2 entry and refcount in place, the data
area a hole of the file); for the allocating rows alone, twice more over a raw
backing file of random data (BACKED: ``-b base.raw -F raw``), once plain and once
with ``-o extended_l2=on``, where a 4k write copies nothing from the backing file
(the **Subclusters** table: what that gains each server). The servers, in the
order ``qemu-nbd io_uring, aioublk, qemu-nbd native`` in odd rounds and the
reverse in even ones:

- ``qemu-nbd --cache=none --aio=io_uring --discard=unmap -f qcow2 -c /dev/nbdN``
  (nbd.ko, one connection), and the same with ``--aio=native``: each row uses
  whichever of the two has the higher median over the rounds (the other is
  listed beside it);
- ``python -m aioublk add -t qcow2 -q 1 IMAGE`` (its defaults otherwise).

On each device fio (io_uring, O_DIRECT) runs, in this order:

1. 4k randwrite at iodepth 1, then 64. On the empty image these are
   *allocating* writes: so that every server allocates the same clusters, the
   round's first server runs them for ``--runtime`` seconds and every later
   server does exactly as many writes (``fio --io_size``, same random
   sequence: ``randrepeat``), however long that takes (capped).
2. A sequential 1 MiB write over the whole device at iodepth 16 (reported,
   too): the fill that makes the reads below read data, not holes/zeros.
3. 4k randread and 4k randwrite in place at iodepth 1 and 64 (and with
   ``--rows all`` 4k randrw 50/50 and 512k rw, sequential 50/50, at 1 and
   64), ``--runtime`` seconds each after a 1 s ramp.
4. Two queues: the filled image attached again, aioublk with ``-q 2``,
   qemu-nbd with two connections (``--fork --shared=2 --persistent`` and
   ``nbd-client -C 2``) when the guest has nbd-client and ``nbdinfo --can
   multi-conn`` says the export allows it, else one (``connections`` in the
   JSON); 4k randread and randwrite in place at iodepth 64 by two fio jobs,
   each on its own half of the device (on the empty image; both kinds with
   ``--rows all``).

Every round also measures aioublk's null target (no backend at all) on the
goal and QD1 workloads: the ceiling of what a ublk server shows here. Around
every run the guest takes each server's CPU time from
``/proc/PID/task/*/schedstat`` (io_uring's ``iou-wrk-*`` workers apart) and
the device's I/O count from sysfs, and for aioublk ``list --stats --json``
(the share of requests its C data plane served, and its wakes). After each
device ``qemu-img check`` runs on its image. The guest only writes JSON; the
host turns it into ``bench/results/qcow2.md``, ``.json`` and ``qcow2.png``
(matplotlib: ``pip install -e .[bench]``). Absolute numbers under software
emulation mean little; the aioublk/qemu-nbd ratios, paired within each
round, are the result. ``--quick`` is a smoke test of this script (64 MiB
empty image, a few rows), not a measurement.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from bench.common import (
    errors_section,
    fmt,
    grouped_bars,
    load,
    median,
    met,
    paired_ratios,
    parser,
    publish,
    record,
    run,
    run_guest,
    spread,
    swapped,
    table,
)
from bench.modes import _add

T = TypeVar("T")
FORMAT = 2  # data["format"]; results without one came from the one-round script
IMAGE_SIZE = 2 << 30
QUICK_IMAGE_SIZE = 64 << 20
KINDS: dict[str, list[str]] = {  # image kind -> extra qemu-img create arguments
    "empty": [],
    "prealloc": ["-o", "preallocation=metadata"],
    "backing": [],
    "extl2": ["-o", "extended_l2=on"],
}
# Kinds made over a raw backing file full of data (BASE), so that an allocating 4k write
# must copy the rest of its cluster, or with extended_l2 only of its 2 KiB subcluster.
BACKED = ("backing", "extl2")
BASE = "base.raw"
NBD_AIO = ("io_uring", "native")
AIOUBLK = "aioublk"
#: aioublk with user recovery: the engine writes its metadata through
WRITE_THROUGH = "aioublk -r 1"
NULL = "null"
RAMP = 1
MiB = 1 << 20
# A "count" run of a later server may take this many times --runtime before fio stops it.
COUNT_CAP = 12
# Slowest fill rate the timeouts allow for (MiB/s): TCG is slow, a Python server slower.
MIN_FILL_RATE = 5
GUEST_MEMORY = "6G"  # the 2 GiB image lives in guest RAM
STATS_WAIT = 15.0  # seconds for aioublk to publish its counters after a run


class Step(NamedTuple):
    """One fio run on a device: a workload at one iodepth, by ``queues`` jobs.

    how: "count" (allocating writes: later servers repeat the round's first
    server's I/O count), "fill" (one sequential pass over the device), "time"
    (time based, after a ramp). rows: the ``--rows`` set it belongs to.
    """

    workload: str
    qd: int
    args: tuple[str, ...]
    how: str
    queues: int = 1
    rows: str = "goals"

    @property
    def bs(self) -> int:
        """Block size in bytes, from the --bs=4k / 512k / 1M argument."""
        value = next(a for a in self.args if a.startswith("--bs="))[5:]
        return int(value[:-1]) << {"k": 10, "M": 20}[value[-1]]

    @property
    def key(self) -> str:
        return f"{self.workload} qd{self.qd}" + (f" {self.queues}q" if self.queues > 1 else "")


RANDWRITE, RANDREAD, IN_PLACE = "4k randwrite", "4k randread", "4k randwrite in place"
_W, _R = ("--rw=randwrite", "--bs=4k"), ("--rw=randread", "--bs=4k")
STEPS = [  # one queue, in this order
    Step(RANDWRITE, 1, _W, "count"),
    Step(RANDWRITE, 64, _W, "count"),
    Step("1M write (fill)", 16, ("--rw=write", "--bs=1M"), "fill"),
    Step(RANDREAD, 1, _R, "time"),
    Step(RANDREAD, 64, _R, "time"),
    Step(IN_PLACE, 1, _W, "time"),
    Step(IN_PLACE, 64, _W, "time"),
    Step("4k randrw", 1, ("--rw=randrw", "--bs=4k"), "time", rows="all"),
    Step("4k randrw", 64, ("--rw=randrw", "--bs=4k"), "time", rows="all"),
    Step("512k rw", 1, ("--rw=rw", "--bs=512k"), "time", rows="all"),
    Step("512k rw", 64, ("--rw=rw", "--bs=512k"), "time", rows="all"),
]
STEPS_2Q = [Step(RANDREAD, 64, _R, "time", queues=2), Step(IN_PLACE, 64, _W, "time", queues=2)]
QUICK_STEPS = [STEPS[0], STEPS[2], STEPS[4], STEPS_2Q[0]]
# the null target, every round: the goal and QD1 workloads (in place is randwrite there)
NULL_STEPS = [Step(RANDWRITE, 64, _W, "time"), Step(RANDREAD, 64, _R, "time"),
              Step(RANDWRITE, 1, _W, "time"), Step(RANDREAD, 1, _R, "time")]


def plan(rows: str, quick: bool) -> dict[str, list[Step]]:
    """image kind -> its steps: one queue's, then two queues' (the empty image's
    only, unless ``rows`` is "all")."""
    if quick:
        return {"empty": QUICK_STEPS}
    one = [s for s in STEPS if rows == "all" or s.rows == "goals"]
    return {kind: [s for s in STEPS if s.how == "count"] if kind in BACKED
            else one + (STEPS_2Q if kind == "empty" or rows == "all" else [])
            for kind in KINDS}


# -- guest side ---------------------------------------------------------------------


def _image_folder(size: int) -> dict[str, object]:
    """A guest-RAM folder (tmpfs) that takes O_DIRECT and has room for the image.

    /dev/shm is plain tmpfs; the guest's /tmp is an overlay whose upper layer
    is tmpfs: both live in guest RAM, /dev/shm has one layer fewer.
    """
    tried = []
    for folder in ("/dev/shm", "/tmp"):
        if not os.access(folder, os.W_OK):
            tried.append(f"{folder}: not writable")
            continue
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
        if free < size + (256 << 20):
            tried.append(f"{folder}: {free >> 20} MiB free")
            continue
        path = tempfile.mkdtemp(dir=folder, prefix="qcow2bench.")
        probe = os.path.join(path, "probe")
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            os.close(fd)
        except OSError as e:
            tried.append(f"{folder}: O_DIRECT refused ({e.strerror})")
            if os.path.exists(probe):
                os.unlink(probe)
            os.rmdir(path)
            continue
        os.unlink(probe)
        fstype, _ = run(["stat", "-f", "-c", "%T", path], timeout=10)
        return {"path": path, "fs": fstype.strip(), "free_mib": free >> 20}
    raise SystemExit("no guest-RAM folder for the image: " + "; ".join(tried))


def _fio(dev: str, step: Step, runtime: int, io_count: int | None,
         size: int) -> dict[str, Any]:
    """Run one step; a dict with iops, mib_s, ios, seconds, or error."""
    cmd = ["fio", "--name=w", f"--filename={dev}", "--ioengine=io_uring", "--direct=1",
           "--randrepeat=1", *step.args, f"--iodepth={step.qd}", "--output-format=json"]
    if step.queues > 1:  # a job per queue, each on its own half: no shared random sequence
        part = size // step.queues
        cmd += [f"--numjobs={step.queues}", "--group_reporting",
                f"--offset_increment={part}", f"--size={part}"]
    if step.how == "fill":
        timeout = size / MiB / MIN_FILL_RATE + 120
    elif step.how == "count" and io_count is not None:
        cmd += [f"--io_size={io_count * step.bs}", f"--runtime={runtime * COUNT_CAP}"]
        timeout = runtime * COUNT_CAP + 120
    elif step.how == "count":  # the leader: time based, no ramp (allocation starts at once)
        cmd += ["--time_based", f"--runtime={runtime}"]
        timeout = runtime + 120
    else:
        cmd += ["--time_based", f"--runtime={runtime}", f"--ramp_time={RAMP}"]
        timeout = runtime + RAMP + 120
    out, err = run(cmd, timeout=timeout)
    if err:
        return {"error": f"fio {err}"}
    try:
        job = json.loads(out[out.index("{"):])["jobs"][0]
        sides = [job["read"], job["write"]]
        return {
            "iops": sum(float(s["iops"]) for s in sides),
            "mib_s": sum(float(s["bw_bytes"]) for s in sides) / MiB,
            "ios": sum(int(s["total_ios"]) for s in sides),
            "seconds": float(job["job_runtime"]) / 1000 / step.queues,
        }
    except (ValueError, KeyError, IndexError) as e:
        return {"error": f"fio output unreadable: {e!r}"}


def _tasks_cpu(pid: int | None) -> dict[int, tuple[str, int]]:
    """tid -> (comm, ns on CPU) of every thread of `pid` (schedstat's first field)."""
    got: dict[int, tuple[str, int]] = {}
    if pid is None:
        return got
    base = Path(f"/proc/{pid}/task")
    try:
        tids = [int(t) for t in os.listdir(base)]
    except OSError:
        return got
    for tid in tids:
        try:
            comm = (base / str(tid) / "comm").read_text().strip()
            got[tid] = (comm, int((base / str(tid) / "schedstat").read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            continue
    return got


def _dev_ios(dev: str) -> int | None:
    """Reads + writes the block device completed (sysfs stat), ramp included."""
    try:
        f = Path(f"/sys/block/{os.path.basename(dev)}/stat").read_text().split()
        return int(f[0]) + int(f[4])
    except (OSError, ValueError, IndexError):
        return None


def cpu_fields(before: Mapping[int, tuple[str, int]], after: Mapping[int, tuple[str, int]],
               ios: int | None) -> dict[str, Any]:
    """CPU µs per I/O of a server between two ``_tasks_cpu`` samples, io_uring's
    ``iou-wrk-*`` workers apart (a thread that left before `after` is not counted)."""
    own = wrk = 0
    workers = 0
    for tid, (comm, ns) in after.items():
        spent = ns - before.get(tid, (comm, 0))[1]
        if comm.startswith("iou-wrk"):
            wrk += spent
            workers += 1
        else:
            own += spent
    if not ios or not after:
        return {}
    return {"cpu_us_per_io": own / 1000 / ios, "iou_wrk_us_per_io": wrk / 1000 / ios,
            "iou_wrk_threads": workers}


def dp_fields(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """aioublk's C share and wakes per C-served request between two samples of its
    summed ``list --stats --json`` counters."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("c_served", "py_handed", "wakes")}
    done = d["c_served"] + d["py_handed"]
    return {"c_share": d["c_served"] / done if done else None,
            "wakes_per_c": d["wakes"] / d["c_served"] if d["c_served"] else None,
            "c_served": d["c_served"], "py_handed": d["py_handed"], "wakes": d["wakes"]}


def _free_nbd() -> str | None:
    for n in range(16):
        size = Path(f"/sys/block/nbd{n}/size")
        if size.exists() and size.read_text().strip() == "0":
            return f"/dev/nbd{n}"
    return None


def _wait_gone(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.1)


class NbdServer:
    """qemu-nbd and nbd.ko: one connection through the ioctl interface (``-c``),
    or ``queues`` connections through nbd-client when the export allows it."""

    def __init__(self, aio: str) -> None:
        self.aio = aio
        self.name = f"qemu-nbd {aio}"
        self.dev: str | None = None
        self.pid: int | None = None
        self.connections = 0
        self._forked: str | None = None  # the socket folder of a --fork server

    def _args(self, image: str) -> list[str]:
        return ["--cache=none", f"--aio={self.aio}", "--discard=unmap", "-f", "qcow2", image]

    def attach(self, image: str, queues: int = 1) -> tuple[str | None, str | None]:
        run(["modprobe", "nbd"], timeout=60)  # the harness loads it already
        dev = _free_nbd()
        if dev is None:
            return None, "no free /dev/nbdN (is nbd.ko loaded?)"
        if queues > 1 and shutil.which("nbd-client") and shutil.which("nbdinfo") and \
                self._attach_many(image, dev, queues) is None:
            return dev, None
        _, err = run(["qemu-nbd", *self._args(image), "-c", dev], timeout=120)
        if err:
            return None, f"qemu-nbd {err}"
        self.dev, self.connections = dev, 1
        pid_file = Path(f"/sys/block/{os.path.basename(dev)}/pid")
        self.pid = int(pid_file.read_text()) if pid_file.exists() else None
        return dev, None

    def _attach_many(self, image: str, dev: str, queues: int) -> str | None:
        """A --fork server and nbd-client -C `queues`; an error (self.dev None)
        means: fall back to one connection."""
        folder = tempfile.mkdtemp(prefix="qemu-nbd.")
        sock, pid_file = f"{folder}/sock", f"{folder}/pid"
        _, err = run(["qemu-nbd", "--fork", f"--shared={queues}", "--persistent",
                      f"--pid-file={pid_file}", "-k", sock, *self._args(image)], timeout=120)
        if err:
            shutil.rmtree(folder, ignore_errors=True)
            return f"qemu-nbd --fork {err}"
        self._forked, self.pid = folder, int(Path(pid_file).read_text())
        _, no = run(["nbdinfo", "--can", "multi-conn", f"nbd+unix:///?socket={sock}"], 60)
        if no is None:
            _, err = run(["nbd-client", "-unix", sock, dev, "-N", "", "-C", str(queues)], 120)
            if err is None:
                self.dev, self.connections = dev, queues
                return None
        self._stop_forked()
        return "no multi-conn"

    def _stop_forked(self) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            _wait_gone(self.pid)
        if self._forked:
            shutil.rmtree(self._forked, ignore_errors=True)
        self._forked = self.pid = None

    def detach(self) -> str | None:
        assert self.dev is not None
        if self._forked:
            _, err = run(["nbd-client", "-d", self.dev], timeout=120)
            self._stop_forked()
        else:
            _, err = run(["qemu-nbd", "-d", self.dev], timeout=120)
            if self.pid:
                _wait_gone(self.pid)  # the image is closed (and flushed) once it is gone
        self.dev = self.pid = None
        return err

    def counters(self, since: float) -> dict[str, float]:
        return {}


class AioublkServer:
    def __init__(self, target: str = "qcow2", extra: Sequence[str] = (),
                 name: str | None = None) -> None:
        self.cmd = [sys.executable, "-m", "aioublk"]
        self.target = target
        self.extra = list(extra)  # more add flags (-d, a target's options)
        self.name = name or (AIOUBLK if target == "qcow2" else target)
        self.dev_id: str | None = None
        self.pid: int | None = None
        self.connections = 0

    def attach(self, image: str | None, queues: int = 1) -> tuple[str | None, str | None]:
        dev_id, err = _add(self.cmd, ["-t", self.target, "-q", str(queues), *self.extra,
                                      *([image] if image else [])])
        if dev_id is None:
            return None, err
        self.dev_id, self.connections = dev_id, queues
        out, _ = run([*self.cmd, "list", "-n", dev_id, "--json"], timeout=120)
        try:
            self.pid = int(json.loads(out)[0]["pid"])
        except (ValueError, KeyError, IndexError):
            self.pid = None
        return f"/dev/ublkb{dev_id}", None

    def counters(self, since: float) -> dict[str, float]:
        """The data plane's counters summed over the queues, from a publish made
        after `since` (``time.time()``); empty if none came."""
        deadline = time.monotonic() + STATS_WAIT
        while self.dev_id is not None and time.monotonic() < deadline:
            out, err = run([*self.cmd, "list", "-n", self.dev_id, "--stats", "--json"], 120)
            try:
                dev = json.loads(out)[0]
                if not err and dev["stats"] and dev["stats_time"] > since:
                    return {k: float(sum(r.get(k, 0) for r in dev["stats"]))
                            for k in ("ios", "c_served", "py_handed", "wakes", "poll_timeouts")}
            except (ValueError, KeyError, IndexError, TypeError):
                pass
            time.sleep(0.3)
        return {}

    def detach(self) -> str | None:
        assert self.dev_id is not None
        _, err = run([*self.cmd, "del", "-n", self.dev_id], timeout=120)
        self.dev_id = self.pid = None
        return err


Server = NbdServer | AioublkServer


def _new_image(folder: str, kind: str, size: int) -> tuple[str, str | None]:
    path = os.path.join(folder, f"{kind}.qcow2")
    if os.path.exists(path):
        os.unlink(path)
    backing = ["-b", _base(folder, size), "-F", "raw"] if kind in BACKED else []
    _, err = run(["qemu-img", "create", "-q", "-f", "qcow2", *KINDS[kind], *backing, path,
                  str(size)], timeout=120)
    return path, (f"qemu-img create {err}" if err else None)


def _base(folder: str, size: int) -> str:
    """BASE in `folder`, written once: no zeros nor holes, so every copy on write reads
    data."""
    path = os.path.join(folder, BASE)
    if not os.path.exists(path):
        block = os.urandom(MiB)
        with open(path + ".part", "wb") as f:
            for i in range(size // MiB):
                f.write(i.to_bytes(8, "little") + block[8:])
        os.rename(path + ".part", path)
    return path


class Guest:
    """One guest run: the data, saved after every step so a crash keeps what was done."""

    def __init__(self, data: dict[str, Any], out: Path, runtime: int, size: int) -> None:
        self.data, self.out, self.runtime, self.size = data, out, runtime, size
        self.start = time.monotonic()

    def save(self) -> None:
        self.out.write_text(json.dumps(self.data))

    def measure(self, server: Server, dev: str, step: Step, count: int | None,
                fields: dict[str, Any], last: dict[str, float]) -> dict[str, Any]:
        """One fio run with its diagnostics; `last`: the server's counters now
        (replaced by those after the run)."""
        cpu0, ios0 = _tasks_cpu(server.pid), _dev_ios(dev)
        r = _fio(dev, step, self.runtime, count, self.size)
        cpu1, ios1 = _tasks_cpu(server.pid), _dev_ios(dev)
        ended = time.time()
        ios = ios1 - ios0 if ios0 is not None and ios1 is not None else None
        r |= cpu_fields(cpu0, cpu1, ios) | {"dev_ios": ios}
        if isinstance(server, AioublkServer):
            after = server.counters(ended)
            if last and after:
                r |= dp_fields(last, after)
            last.clear()
            last.update(after)
        record(self.data["runs"], self.start, fields["round"],
               f"{fields['kind']:8} {step.key:25} {server.name:17}", r.get("iops"),
               r.get("error"), **{k: v for k, v in fields.items() if k != "round"},
               workload=step.workload, qd=step.qd, queues=step.queues, how=step.how,
               connections=server.connections,
               **{k: v for k, v in r.items() if k not in ("iops", "error")})
        self.save()
        return r

    def device(self, server: Server, rnd: int, kind: str, steps: list[Step],
               counts: dict[str, int], folder: str) -> None:
        """A fresh image of `kind` on `server` (``serve``), removed after."""
        image, err = _new_image(folder, kind, self.size)
        self.serve(server, rnd, kind, steps, counts, image, err)
        if os.path.exists(image):
            os.unlink(image)
        self.save()

    def serve(self, server: Server, rnd: int, kind: str, steps: list[Step],
              counts: dict[str, int], image: str, err: str | None) -> None:
        """`image` on `server` (`err`: why it could not be made): the one-queue steps,
        then the image attached again with two queues for the others; qemu-img check
        (in the last device entry). Another bench brings images of its own here."""
        for queues in sorted({s.queues for s in steps}):
            t0 = time.monotonic()
            dev = None
            if err is None:
                dev, err = server.attach(image, queues)
            entry: dict[str, Any] = {"round": rnd, "kind": kind, "server": server.name,
                                     "queues": queues, "connections": server.connections,
                                     "attach_s": time.monotonic() - t0, "error": err}
            self.data["devices"].append(entry)
            last = server.counters(time.time()) if dev is not None else {}
            for step in (s for s in steps if s.queues == queues):
                fields = {"round": rnd, "kind": kind, "server": server.name}
                if dev is None:
                    record(self.data["runs"], self.start, rnd, f"{kind} {step.key}", None, err,
                           kind=kind, server=server.name, workload=step.workload, qd=step.qd,
                           queues=step.queues, how=step.how)
                    continue
                r = self.measure(server, dev, step, counts.get(step.key), fields, last)
                if step.how == "count" and step.key not in counts and "ios" in r:
                    counts[step.key] = int(r["ios"])
                    self.data["runs"][-1]["leader"] = True
            if dev is not None:
                t1 = time.monotonic()
                entry["detach_error"] = server.detach()
                entry["detach_s"] = time.monotonic() - t1
                err = entry["detach_error"] and f"detach {entry['detach_error']}"
        if os.path.exists(image):
            check, check_err = run(["qemu-img", "check", "-f", "qcow2", image], timeout=600)
            self.data["devices"][-1]["check"] = \
                check_err or [ln for ln in check.splitlines() if ln.strip()]

    def ceiling(self, rnd: int) -> None:
        """aioublk's null target on NULL_STEPS: no backend at all."""
        server = AioublkServer("null")
        dev, err = server.attach(None)
        last = server.counters(time.time()) if dev is not None else {}
        for step in NULL_STEPS:
            fields = {"round": rnd, "kind": NULL, "server": NULL}
            if dev is None:
                record(self.data["runs"], self.start, rnd, f"null {step.key}", None, err,
                       kind=NULL, server=NULL, workload=step.workload, qd=step.qd, queues=1,
                       how=step.how)
                continue
            self.measure(server, dev, step, None, fields, last)
        if dev is not None:
            server.detach()


def round_order(servers: list[T], rnd: int) -> list[T]:
    """Round `rnd` (from 1): the servers as given in odd rounds, reversed in even
    ones; the first one leads the allocating rows' I/O count."""
    return list(swapped(servers, rnd - 1))


def inner(runtime: int, rounds: int, rows_set: str, quick: bool, nbd_aio: list[str],
          out: Path) -> None:
    """Runs in the guest."""
    size = QUICK_IMAGE_SIZE if quick else IMAGE_SIZE
    release, _ = run(["uname", "-r"], timeout=10)
    nbd_version, _ = run(["qemu-nbd", "--version"], timeout=30)
    fio_version, _ = run(["fio", "--version"], timeout=30)
    folder = _image_folder(size)
    data: dict[str, Any] = {
        "format": FORMAT, "kernel": release.strip(), "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "rounds": rounds, "rows": rows_set, "quick": quick, "image_size": size, "storage": folder,
        "qemu_nbd": nbd_version.splitlines()[0] if nbd_version else None,
        "fio": fio_version.strip(), "nbd_client": bool(shutil.which("nbd-client")),
        "nbdinfo": bool(shutil.which("nbdinfo")), "complete": False, "runs": [],
        "devices": [],
    }
    print(f"images in {folder}", flush=True)
    guest = Guest(data, out, runtime, size)
    servers: list[Server] = [NbdServer(nbd_aio[0]), AioublkServer(),
                             *(NbdServer(a) for a in nbd_aio[1:])]
    write_through = AioublkServer(extra=["-r", "1"], name=WRITE_THROUGH)
    for r in range(1, rounds + 1):
        empty: dict[str, int] = {}
        for kind, steps in plan(rows_set, quick).items():
            counts: dict[str, int] = {}  # step -> the round's first server's I/O count
            for server in round_order(servers, r):
                guest.device(server, r, kind, steps, counts, str(folder["path"]))
            if kind == "empty":
                empty = counts
        # the allocating rows again with metadata write-through, as many writes
        guest.device(write_through, r, "empty", [s for s in STEPS if s.how == "count"],
                     empty, str(folder["path"]))
        base = os.path.join(str(folder["path"]), BASE)
        if os.path.exists(base):  # RAM for the next round's full images
            os.unlink(base)
        guest.ceiling(r)
    data["complete"] = True
    data["elapsed_s"] = time.monotonic() - guest.start
    guest.save()


# -- host side ----------------------------------------------------------------------


Key = tuple[str, str, int, int]  # image kind, workload, qd, queues


def normalized(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` in this format: results of the one-round script (no ``format``) get
    round 1, one queue, and their null ceiling as runs."""
    if data.get("format") == FORMAT:
        return dict(data)
    runs = [{"round": 1, "queues": 1, **x} for x in data["runs"]]
    for key, iops in (data.get("ceiling") or {}).items():
        workload, qd = key.rsplit(" qd", 1)
        runs.append({"round": 1, "kind": NULL, "server": NULL, "queues": 1,
                     "workload": workload, "qd": int(qd), "iops": iops, "error": None})
    return {**data, "rounds": 1, "runs": runs,
            "devices": [{"round": 1, "queues": 1, **d} for d in data["devices"]]}


def _match(key: Key) -> dict[str, object]:
    kind, workload, qd, queues = key
    return {"kind": kind, "workload": workload, "qd": qd, "queues": queues}


class Row(NamedTuple):
    key: Key
    nbd: dict[str, float | None]  # qemu-nbd setting -> median IOPS
    best: str | None  # the setting with the higher median
    connections: int | None  # the best setting's
    aioublk: float | None  # median IOPS
    ratios: list[float]  # each round's aioublk / best
    paired: float | None  # their median
    diag: dict[str, float | None]  # medians over the rounds


DIAG = ("c_share", "wakes_per_c", "cpu_us_per_io", "iou_wrk_us_per_io")


def rows(data: Mapping[str, Any]) -> list[Row]:
    """Each (image kind, workload, qd, queues) the run measured, paired by round
    against the qemu-nbd setting with the higher median over the rounds."""
    runs = data["runs"]
    names = list(dict.fromkeys(str(x["server"]) for x in runs
                               if str(x["server"]).startswith("qemu-nbd")))
    keys: list[Key] = list(dict.fromkeys((x["kind"], x["workload"], x["qd"], x["queues"])
                                         for x in runs if x["server"] != NULL))
    out = []
    for key in keys:
        m = _match(key)
        nbd = {n: median(runs, server=n, **m) for n in names}
        have = [n for n in names if nbd[n] is not None]
        best = max(have, key=lambda n: nbd[n] or 0) if have else None
        ratios = paired_ratios(runs, {"server": AIOUBLK, **m}, {"server": best, **m}) \
            if best else []
        diag = {f"aioublk {d}": median(runs, d, server=AIOUBLK, **m) for d in DIAG}
        diag |= {f"nbd {d}": median(runs, d, server=best, **m) for d in DIAG[2:]} if best \
            else {}
        conns = [int(x["connections"]) for x in runs if x["server"] == best
                 and x.get("connections") and all(x.get(k) == v for k, v in m.items())]
        out.append(Row(key, nbd, best, max(conns) if conns else None,
                       median(runs, server=AIOUBLK, **m), ratios,
                       statistics.median(ratios) if ratios else None, diag))
    return out


def _geomean(values: list[float | None]) -> float | None:
    if not values or not all(v is not None and v > 0 for v in values):
        return None
    return math.exp(statistics.fmean(math.log(v) for v in values if v is not None))


class Goal(NamedTuple):
    label: str
    value: float | None
    target: float


EMPTY_QD64 = [("empty", RANDWRITE, 64, 1), ("empty", RANDREAD, 64, 1),
              ("empty", IN_PLACE, 64, 1)]
QD1 = [(kind, w, 1, 1) for kind in ("empty", "prealloc") for w in (RANDREAD, RANDWRITE)]


def goals(data: Mapping[str, Any]) -> list[Goal]:
    """Issue #24's numbers, each from values paired within the round."""
    runs = data["runs"]
    paired = {r.key: r.paired for r in rows(data)}

    def within(num: dict[str, object], den: dict[str, object]) -> float | None:
        ratios = paired_ratios(runs, num, den)
        return statistics.median(ratios) if ratios else None

    out = [Goal("geomean: empty image, qd64: allocating randwrite, randread and in-place "
                "randwrite after the fill", _geomean([paired.get(k) for k in EMPTY_QD64]), 3.0)]
    out += [Goal(f"prealloc image, {w} qd64", paired.get(("prealloc", w, 64, 1)), 3.0)
            for w in (RANDREAD, RANDWRITE)]
    out += [Goal(f"{kind} image, {w} qd1", paired.get((kind, w, qd, q)), 1.0)
            for kind, w, qd, q in QD1]
    out += [Goal(f"aioublk 2 queues / 1 queue, empty image, {w} qd64",
                 within({"server": AIOUBLK, **_match(("empty", w, 64, 2))},
                        {"server": AIOUBLK, **_match(("empty", w, 64, 1))}), 1.5)
            for w in (RANDREAD, IN_PLACE)]
    out.append(Goal("aioublk allocating randwrite qd64 (empty image) / null target",
                    within({"server": AIOUBLK, **_match(EMPTY_QD64[0])},
                           {"server": NULL, "workload": RANDWRITE, "qd": 64}), 0.4))
    return out


def _label(key: Key) -> str:
    kind, workload, qd, queues = key
    return f"{workload} qd{qd}" + (f" {queues}q" if queues > 1 else "")


def _order(key: Key) -> tuple[int, int, bool]:
    kind, workload, qd, queues = key
    steps = STEPS + STEPS_2Q
    i = next((i for i, s in enumerate(steps) if (s.workload, s.qd, s.queues) ==
              (workload, qd, queues)), len(steps))
    return (i, 0, kind != "empty")


def report(data_in: Mapping[str, Any], command: str) -> str:
    data = normalized(data_in)
    runs, devices, storage = data["runs"], data["devices"], data["storage"]
    names = list(dict.fromkeys(str(x["server"]) for x in runs
                               if str(x["server"]).startswith("qemu-nbd")))
    size_gib = int(data["image_size"]) / (1 << 30)
    setup = (f"One guest run: QEMU TCG software emulation (no KVM), {GUEST_MEMORY[:-1]} GiB RAM"
             if data["guest"] else "One run on the host")
    table_rows = sorted(rows(data), key=lambda r: _order(r.key))
    lines = [
        "# qcow2: aioublk vs qemu-nbd + nbd.ko",
        "",
        f"{setup}, {data['cpus']} CPUs, Linux {data['kernel']}, {data['qemu_nbd']}, "
        f"{data['fio']}. Each server gets a fresh {size_gib:g} GiB qcow2 image (64 KiB "
        f"clusters) in guest RAM (`{storage['path']}`, {storage['fs']}) per image kind: "
        "**empty** (`qemu-img create -f qcow2`) or **prealloc** (`-o preallocation=metadata`: "
        "L2 tables and refcounts in place, data area a hole)"
        + (f", and for the allocating rows **backing** and **extl2** (`-b {BASE} -F raw`, "
           "a raw file of random data as large as the image, without and with "
           "`-o extended_l2=on`: 32 subclusters of 2 KiB, so a 4k write copies no part of "
           "its cluster from the backing file)" if any(x["kind"] in BACKED for x in runs)
           else "") + ".",
        "",
        "- qemu-nbd: `qemu-nbd --cache=none --aio=AIO --discard=unmap -f qcow2 -c /dev/nbdN` "
        "(nbd.ko, one connection; with two queues, two connections through nbd-client when "
        "the export allows multi-conn: **conns** says how many ran). Each row uses the AIO "
        "setting with the higher median over the rounds (**best**).",
        "- aioublk: `python -m aioublk add -t qcow2 -q 1 IMAGE` (`-q 2` for the 2q rows; its "
        "defaults otherwise: depth 128).",
        f"- fio, io_uring, O_DIRECT, in this order on each device: 4k randwrite qd1 and qd64 "
        f"(the round's first server runs {data['runtime']} s, every later one does exactly "
        "as many writes, same random sequence, so all allocate the same clusters on the "
        "empty image); a sequential 1 MiB write over the whole device at qd16 (the fill: "
        "reads after it read data, not zeros); then the time-based rows, "
        f"{data['runtime']} s each after {data['ramp']} s ramp; 2q rows: two fio jobs, each "
        "on its own half of the device. IOPS and MiB/s are reads + writes.",
        f"- {data['rounds']} round(s), the servers' order reversed every other round. "
        "**paired** is the median over the rounds of each round's aioublk / best qemu-nbd "
        "(min and max beside it): drift between rounds does not move it.",
        "",
        "Under emulation the absolute numbers mean little: **the paired ratios are the "
        "result**.",
    ]
    if data_in.get("format") != FORMAT:
        lines += ["", "**Produced by an older bench/qcow2.py**: one round (each paired "
                      "ratio is one run's), no two-queue, in-place qd1 or diagnostic rows; "
                      "rendered here in the current layout from the same JSON."]
    if data.get("quick"):
        lines += ["", "**Smoke run (`--quick`)**: small image, a few rows; not a measurement."]
    if not data.get("complete"):
        lines += ["", "**Incomplete**: the guest run stopped early; rows below are what it "
                      "finished."]
    lines += ["", *table(
        ["image", "workload", *(f"{n} IOPS" for n in names), "best", "conns",
         "aioublk IOPS", "paired", "min – max"], "ll" + "r" * len(names) + "lrrrr",
        ([r.key[0], _label(r.key), *(fmt(r.nbd[n]) for n in names),
          (r.best or "—").removeprefix("qemu-nbd "), fmt(r.connections, "d"), fmt(r.aioublk),
          fmt(r.paired, ".2f"),
          f"{min(r.ratios):.2f} – {max(r.ratios):.2f}" if r.ratios else "—"]
         for r in table_rows))]
    lines += ["", "## Goals (issue #24)", "", "From the paired values.", "",
              *table(["goal", "value", "target", "met"], "lrrl",
                     ([g.label, fmt(g.value, ".2f"), f"≥ {g.target}", met(g.value, g.target)]
                      for g in goals(data)))]
    lines += _subclusters(data)
    lines += _write_through(data)
    null_keys = list(dict.fromkeys((x["workload"], x["qd"]) for x in runs
                                   if x["server"] == NULL))
    if null_keys:
        lines += ["", "## Null target ceiling", "",
                  "aioublk's null target (no backend at all), measured every round: the most "
                  "any ublk server shows here.", "",
                  *table(["workload", "null IOPS", "empty image aioublk / null, paired"],
                         "lrr",
                         ([f"{w} qd{qd}", fmt(median(runs, server=NULL, workload=w, qd=qd)),
                           fmt(_median(paired_ratios(
                               runs, {"server": AIOUBLK, **_match(("empty", w, qd, 1))},
                               {"server": NULL, "workload": w, "qd": qd})), ".2f")]
                          for w, qd in null_keys))]
    if any(v is not None for r in table_rows for v in r.diag.values()):
        lines += ["", "## Diagnostics", "",
                  "Medians over the rounds. **C share**: aioublk's requests its C data plane "
                  "served fetch to commit (the rest went to Python); **wakes / C**: its "
                  "returns to Python per request C served (`list --stats --json` deltas). "
                  "**CPU µs / I/O**: the server process's threads "
                  "(`/proc/PID/task/*/schedstat`) per I/O the device completed, ramp "
                  "included, io_uring's `iou-wrk` workers apart (nbd.ko's kernel threads are "
                  "not counted).", "",
                  *table(["image", "workload", "C share", "wakes / C", "aioublk CPU µs / I/O",
                          "iou-wrk", "qemu-nbd CPU µs / I/O", "iou-wrk"], "llrrrrrr",
                         ([r.key[0], _label(r.key), fmt(r.diag["aioublk c_share"], ".3f"),
                           fmt(r.diag["aioublk wakes_per_c"], ".3f"),
                           fmt(r.diag["aioublk cpu_us_per_io"], ",.1f"),
                           fmt(r.diag["aioublk iou_wrk_us_per_io"], ",.1f"),
                           fmt(r.diag.get("nbd cpu_us_per_io"), ",.1f"),
                           fmt(r.diag.get("nbd iou_wrk_us_per_io"), ",.1f")]
                          for r in table_rows))]
    lines += ["", "## Devices", "", *table(
        ["round", "image", "server", "queues", "attach s", "qemu-img check after"], "rllrrl",
        ([d["round"], d["kind"], d["server"], d["queues"], f"{d['attach_s']:.1f}",
          _check(d.get("check"))] for d in devices))]
    errors: dict[str, str] = {}
    for x in runs:
        if x.get("error"):
            errors.setdefault(f"{x['server']} {x['kind']}", str(x["error"]))
    for d in devices:
        if d.get("detach_error"):
            errors.setdefault(f"{d['server']} {d['kind']} detach", str(d["detach_error"]))
    lines += errors_section(errors, "server/image kind")
    if data.get("elapsed_s"):
        lines += ["", f"The guest part took {float(data['elapsed_s']) / 60:.0f} min."]
    lines += ["", f"Chart: `qcow2.png`. Reproduce: `{command}` from the repository root "
                  "(boots the guest when the host has no ublk_drv).", ""]
    return "\n".join(lines)


def _subclusters(data: Mapping[str, Any]) -> list[str]:
    """What extended L2 gains each server: extl2 / backing IOPS, paired by round."""
    runs = data["runs"]
    servers = list(dict.fromkeys(str(x["server"]) for x in runs if x["kind"] == "extl2"))
    if not servers:
        return []
    steps = [s for s in STEPS if s.how == "count"]
    return ["", "## Subclusters", "",
            "Allocating 4k writes over the backing file: each server's IOPS on the **extl2** "
            "image / on the **backing** image, paired by round (median, min – max).", "",
            *table(["server", *(s.key for s in steps)], "l" + "r" * len(steps),
                   ([name, *(spread(paired_ratios(
                       runs, {"server": name, **_match(("extl2", s.workload, s.qd, 1))},
                       {"server": name, **_match(("backing", s.workload, s.qd, 1))}))
                     for s in steps)] for name in servers))]


#: aioublk -r 1 / aioublk on the empty image's allocating qd64 row: the goal
WRITE_THROUGH_TARGET = 0.5


def _write_through(data: Mapping[str, Any]) -> list[str]:
    """What metadata write-through costs aioublk: its allocating rows on the
    empty image with ``-r 1`` / without, paired by round."""
    runs = data["runs"]
    if not any(x["server"] == WRITE_THROUGH for x in runs):
        return []
    steps = [s for s in STEPS if s.how == "count"]
    out = []
    for s in steps:
        m = _match(("empty", s.workload, s.qd, 1))
        ratios = paired_ratios(runs, {"server": WRITE_THROUGH, **m}, {"server": AIOUBLK, **m})
        value = _median(ratios)
        out.append([s.key, fmt(median(runs, server=AIOUBLK, **m)),
                    fmt(median(runs, server=WRITE_THROUGH, **m)), spread(ratios),
                    f"≥ {WRITE_THROUGH_TARGET}" if s.qd == 64 else "—",
                    met(value, WRITE_THROUGH_TARGET) if s.qd == 64 else "—"])
    return ["", "## Metadata write-through", "",
            f"`{WRITE_THROUGH}` (`add -r 1`: user recovery, so every write is answered only "
            "once the L2 and refcount changes it made are in the image file) on a fresh "
            "empty image, as many allocating writes as the round's first server did, "
            "against aioublk's default on the same rows: IOPS medians, and the ratio "
            "paired by round (median, min – max).", "",
            *table(["workload", "aioublk IOPS", f"{WRITE_THROUGH} IOPS", "ratio", "target",
                    "met"], "lrrrrl", out)]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _check(check: object) -> str:
    """qemu-img check's lines, or its error."""
    if isinstance(check, list):
        return "; ".join(ln for ln in check if not ln.startswith("Image end offset"))
    return str(check or "—")


def plot(data_in: dict[str, Any], path: Path) -> None:
    """Grouped bars of the paired aioublk/qemu-nbd ratio: one group per row, one bar
    per image kind."""
    data = normalized(data_in)
    table_rows = sorted(rows(data), key=lambda r: _order(r.key))
    where = "QEMU TCG" if data["guest"] else "host"
    grouped_bars(
        path, list(dict.fromkeys(_label(r.key).replace(" qd", "\nqd") for r in table_rows)),
        [f"{k} image" for k in dict.fromkeys(r.key[0] for r in table_rows)],
        {(_label(r.key).replace(" qd", "\nqd"), f"{r.key[0]} image"): r.paired
         for r in table_rows},
        "aioublk IOPS / best qemu-nbd IOPS, paired by round",
        f"qcow2: aioublk / qemu-nbd (nbd.ko), per row the better AIO setting\n{where}, "
        f"{data['cpus']} CPUs, Linux {data['kernel']}, {data['rounds']} round(s)"
        + (", --quick" if data.get("quick") else ""))


def guest_timeout(runtime: int, rounds: int, rows_set: str, quick: bool,
                  servers: int) -> float:
    """From the plan: generous (a slow server may need long for the fill), but finite."""
    size = QUICK_IMAGE_SIZE if quick else IMAGE_SIZE
    per_round = 0.0
    for steps in plan(rows_set, quick).values():
        attaches = len({s.queues for s in steps})
        fio = sum(size / MiB / MIN_FILL_RATE + 120 if s.how == "fill"
                  else runtime * COUNT_CAP + 60 if s.how == "count"
                  else runtime + RAMP + 60 for s in steps)
        per_round += servers * (attaches * 300 + fio)
    per_round += 300 + len(NULL_STEPS) * (runtime + RAMP + 60) + size / MiB / MIN_FILL_RATE
    per_round += 300 + sum(runtime * COUNT_CAP + 60 for s in STEPS if s.how == "count")  # -r 1
    return 600 + rounds * per_round


def command(data: Mapping[str, Any]) -> str:
    """The command a report names: the run's own, else the one its settings give."""
    return str(data.get("command") or ".venv/bin/python -m bench.qcow2"
               + (" --quick" if data.get("quick") else "") + f" --runtime {data['runtime']}")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, runtime=5, rounds=3, quick="a 64 MiB empty image, a few rows",
                inner=("OUT",))
    ap.add_argument("--rows", choices=("goals", "all"), default="goals",
                    help="goals (default): the goal, QD1 and 2-queue rows; all: also randrw "
                         "and 512k rw, and 2 queues on the preallocated image")
    ap.add_argument("--nbd-aio", choices=("both", *NBD_AIO), default="both",
                    help="qemu-nbd --aio settings to run (default both; each row uses the "
                         "better)")
    ap.add_argument("--cpus", type=int, default=4,
                    help="guest vCPUs (default 4: the driver caps queues at the CPU count)")
    ns = ap.parse_args(argv)
    if ns.report:
        saved = load(ns.report)
        return publish("qcow2", saved, report(saved, command(saved)), plot, out=ns.out)
    runtime = ns.runtime or (2 if ns.quick else 5)
    nbd_aio = list(NBD_AIO) if ns.nbd_aio == "both" else [ns.nbd_aio]
    if ns.inner:
        inner(runtime, ns.rounds, ns.rows, ns.quick, nbd_aio, Path(ns.inner[0]))
        return 0
    options = [f"--runtime={runtime}", f"--rounds={ns.rounds}", f"--rows={ns.rows}",
               f"--nbd-aio={ns.nbd_aio}", *(["--quick"] if ns.quick else [])]
    code, data = run_guest(
        "bench.qcow2", options,
        guest_timeout(runtime, ns.rounds, ns.rows, ns.quick, len(nbd_aio) + 1), cpus=ns.cpus,
        kublk=False, memory=GUEST_MEMORY)
    if data is None:
        return 1
    data["command"] = " ".join([".venv/bin/python -m bench.qcow2", *options]
                               + ([f"--cpus={ns.cpus}"] if ns.cpus != 4 else []))
    return publish("qcow2", data, report(data, command(data)), plot, code, ns.out,
                   ok=bool(data.get("complete")))


if __name__ == "__main__":
    sys.exit(main())
