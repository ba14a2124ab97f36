"""aioublk's qcow2 target beside qemu-nbd + nbd.ko, in one guest run.

    python -m bench.qcow2 [--runtime 10] [--quick] [--nbd-aio both|io_uring|native]

Each server exports a fresh 2 GiB qcow2 image (64 KiB clusters) kept in guest
RAM (tmpfs), once EMPTY (``qemu-img create -f qcow2``) and once PREALLOCATED
(``-o preallocation=metadata``: every L2 entry and refcount in place, the data
area a hole of the file). The servers:

- ``qemu-nbd --cache=none --aio=io_uring --discard=unmap -f qcow2 -c /dev/nbdN``
  (nbd.ko, one connection), and the same with ``--aio=native``: the table uses
  whichever of the two is faster overall (geometric mean of all rows), the
  other is listed beside it;
- ``python -m aioublk add -t qcow2 -q 1 IMAGE`` (its defaults otherwise).

On each device fio (io_uring, O_DIRECT) runs, in this order:

1. 4k randwrite at iodepth 1, then 64. On the empty image these are
   *allocating* writes: so that both servers allocate the same clusters,
   the first server runs them for ``--runtime`` seconds and every later
   server does exactly as many writes (``fio --io_size``, same random
   sequence: ``randrepeat``), however long that takes (capped).
2. A sequential 1 MiB write over the whole device at iodepth 16 (reported,
   too): the fill that makes the reads below read data, not holes/zeros.
3. 4k randread, 4k randrw (50/50), 512k rw (sequential 50/50 mix), each at
   iodepth 1 and 64, ``--runtime`` seconds after a 1 s ramp.

After each device ``qemu-img check`` runs on its image. The guest only
writes JSON; the host turns it into ``bench/results/qcow2.md``, ``.json`` and
``qcow2.png`` (matplotlib: ``pip install -e .[bench]``). Absolute numbers
under software emulation mean little; the aioublk/qemu-nbd ratio is the
result. ``--quick`` is a smoke test of this script (256 MiB image, 3 s runs),
not a measurement.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import fmt as _fmt
from bench.common import grouped_bars, load, parser, publish, run_guest
from bench.common import run as _run
from bench.modes import _add

IMAGE_SIZE = 2 << 30
QUICK_IMAGE_SIZE = 256 << 20
KINDS: dict[str, list[str]] = {  # image kind -> extra qemu-img create arguments
    "empty": [],
    "prealloc": ["-o", "preallocation=metadata"],
}
NBD_AIO = ("io_uring", "native")
RAMP = 1
MiB = 1 << 20


class Step:
    """One fio run on a device: a workload at one iodepth.

    how: "count" (pre-fill writes: later servers repeat the first server's
    I/O count), "fill" (one sequential pass over the device), "time"
    (time based, after a ramp).
    """

    def __init__(self, workload: str, qd: int, args: list[str], how: str) -> None:
        self.workload, self.qd, self.args, self.how = workload, qd, args, how

    @property
    def bs(self) -> int:
        """Block size in bytes, from the --bs=4k / 512k / 1M argument."""
        value = next(a for a in self.args if a.startswith("--bs="))[5:]
        return int(value[:-1]) << {"k": 10, "M": 20}[value[-1]]

    @property
    def key(self) -> str:
        return f"{self.workload} qd{self.qd}"


STEPS = [
    Step("4k randwrite", 1, ["--rw=randwrite", "--bs=4k"], "count"),
    Step("4k randwrite", 64, ["--rw=randwrite", "--bs=4k"], "count"),
    Step("1M write (fill)", 16, ["--rw=write", "--bs=1M"], "fill"),
    Step("4k randread", 1, ["--rw=randread", "--bs=4k"], "time"),
    Step("4k randread", 64, ["--rw=randread", "--bs=4k"], "time"),
    Step("4k randwrite in place", 64, ["--rw=randwrite", "--bs=4k"], "time"),
    Step("4k randrw", 1, ["--rw=randrw", "--bs=4k"], "time"),
    Step("4k randrw", 64, ["--rw=randrw", "--bs=4k"], "time"),
    Step("512k rw", 1, ["--rw=rw", "--bs=512k"], "time"),
    Step("512k rw", 64, ["--rw=rw", "--bs=512k"], "time"),
]
# A "count" run of a later server may take this many times --runtime before fio stops it.
COUNT_CAP = 12
# Slowest fill rate the timeouts allow for (MiB/s): TCG is slow, a Python server slower.
MIN_FILL_RATE = 5
GUEST_MEMORY = "6G"  # the 2 GiB image lives in guest RAM


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
        fstype, _ = _run(["stat", "-f", "-c", "%T", path], timeout=10)
        return {"path": path, "fs": fstype.strip(), "free_mib": free >> 20}
    raise SystemExit("no guest-RAM folder for the image: " + "; ".join(tried))


def _fio(dev: str, step: Step, runtime: int, io_count: int | None,
         size: int) -> dict[str, object]:
    """Run one step; a dict with iops, mib_s, ios, seconds, or error."""
    cmd = ["fio", "--name=w", f"--filename={dev}", "--ioengine=io_uring", "--direct=1",
           "--randrepeat=1", *step.args, f"--iodepth={step.qd}", "--output-format=json"]
    if step.how == "fill":
        timeout = size / MiB / MIN_FILL_RATE + 120
    elif step.how == "count" and io_count is not None:
        cmd += [f"--io_size={io_count * step.bs}", f"--runtime={runtime * COUNT_CAP}"]
        timeout = runtime * COUNT_CAP + 120
    elif step.how == "count":  # the first server: time based, no ramp (allocation starts at once)
        cmd += ["--time_based", f"--runtime={runtime}"]
        timeout = runtime + 120
    else:
        cmd += ["--time_based", f"--runtime={runtime}", f"--ramp_time={RAMP}"]
        timeout = runtime + RAMP + 120
    out, err = _run(cmd, timeout=timeout)
    if err:
        return {"error": f"fio {err}"}
    try:
        job = json.loads(out[out.index("{"):])["jobs"][0]
        sides = [job["read"], job["write"]]
        return {
            "iops": sum(float(s["iops"]) for s in sides),
            "mib_s": sum(float(s["bw_bytes"]) for s in sides) / MiB,
            "ios": sum(int(s["total_ios"]) for s in sides),
            "seconds": float(job["job_runtime"]) / 1000,
        }
    except (ValueError, KeyError, IndexError) as e:
        return {"error": f"fio output unreadable: {e!r}"}


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
    """qemu-nbd connected to nbd.ko through the ioctl interface (one connection)."""

    def __init__(self, aio: str) -> None:
        self.aio = aio
        self.name = f"qemu-nbd {aio}"
        self.dev: str | None = None

    def attach(self, image: str) -> tuple[str | None, str | None]:
        _run(["modprobe", "nbd"], timeout=60)  # the harness loads it already
        dev = _free_nbd()
        if dev is None:
            return None, "no free /dev/nbdN (is nbd.ko loaded?)"
        _, err = _run(["qemu-nbd", "--cache=none", f"--aio={self.aio}", "--discard=unmap",
                       "-f", "qcow2", "-c", dev, image], timeout=120)
        if err:
            return None, f"qemu-nbd {err}"
        self.dev = dev
        return dev, None

    def detach(self) -> str | None:
        assert self.dev is not None
        pid_file = Path(f"/sys/block/{os.path.basename(self.dev)}/pid")
        pid = int(pid_file.read_text()) if pid_file.exists() else None
        _, err = _run(["qemu-nbd", "-d", self.dev], timeout=120)
        if pid:
            _wait_gone(pid)  # the image is closed (and flushed) once qemu-nbd is gone
        self.dev = None
        return err


class AioublkServer:
    name = "aioublk"

    def __init__(self, add_args: tuple[str, ...] = ("-t", "qcow2", "-q", "1")) -> None:
        self.cmd = [sys.executable, "-m", "aioublk"]
        self.add_args = add_args  # before the image (bench.nbd: -t nbd, the URI after)
        self.dev_id: str | None = None

    def attach(self, image: str) -> tuple[str | None, str | None]:
        dev_id, err = _add(self.cmd, [*self.add_args, image])
        if dev_id is None:
            return None, err
        self.dev_id = dev_id
        return f"/dev/ublkb{dev_id}", None

    def detach(self) -> str | None:
        assert self.dev_id is not None
        _, err = _run([*self.cmd, "del", "-n", self.dev_id], timeout=120)
        self.dev_id = None
        return err


def _new_image(folder: str, kind: str, size: int) -> tuple[str, str | None]:
    path = os.path.join(folder, f"{kind}.qcow2")
    if os.path.exists(path):
        os.unlink(path)
    _, err = _run(["qemu-img", "create", "-q", "-f", "qcow2", *KINDS[kind], path, str(size)],
                  timeout=120)
    return path, (f"qemu-img create {err}" if err else None)


def inner(runtime: int, quick: bool, nbd_aio: list[str], out: Path) -> None:
    """Runs in the guest; rewrites `out` after every step so a crash keeps what was done."""
    size = QUICK_IMAGE_SIZE if quick else IMAGE_SIZE
    start = time.monotonic()
    release, _ = _run(["uname", "-r"], timeout=10)
    nbd_version, _ = _run(["qemu-nbd", "--version"], timeout=30)
    fio_version, _ = _run(["fio", "--version"], timeout=30)
    folder = _image_folder(size)
    data: dict[str, object] = {
        "kernel": release.strip(), "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "quick": quick, "image_size": size, "storage": folder,
        "qemu_nbd": nbd_version.splitlines()[0] if nbd_version else None,
        "fio": fio_version.strip(), "complete": False, "runs": [], "devices": [],
    }
    print(f"images in {folder}", flush=True)
    runs, devices = data["runs"], data["devices"]
    assert isinstance(runs, list) and isinstance(devices, list)
    servers: list[NbdServer | AioublkServer] = [NbdServer(nbd_aio[0]), AioublkServer(),
                                                *(NbdServer(a) for a in nbd_aio[1:])]

    def save() -> None:
        out.write_text(json.dumps(data))

    def log(what: str, r: dict[str, object]) -> None:
        if r.get("error"):
            shown = f"ERROR {r['error']}"
        else:
            shown = (f"{r['iops']:,.0f} IOPS {r['mib_s']:,.1f} MiB/s "
                     f"({r['ios']} I/Os in {r['seconds']:.1f} s)")
        print(f"[{time.monotonic() - start:5.0f} s] {what} {shown}", flush=True)

    for kind in KINDS:
        counts: dict[str, int] = {}  # step -> I/O count of the first server that did it
        for server in servers:
            image, err = _new_image(str(folder["path"]), kind, size)
            dev = None
            t0 = time.monotonic()
            if err is None:
                dev, err = server.attach(image)
            t1 = time.monotonic()
            device: dict[str, object] = {"kind": kind, "server": server.name,
                                         "attach_s": t1 - t0, "error": err}
            devices.append(device)
            for step in STEPS:
                if dev is None:
                    r: dict[str, object] = {"error": err}
                else:
                    r = _fio(dev, step, runtime, counts.get(step.key), size)
                    if step.how == "count" and step.key not in counts and "ios" in r:
                        counts[step.key] = int(r["ios"])
                        r["leader"] = True
                runs.append({"kind": kind, "server": server.name, "workload": step.workload,
                             "qd": step.qd, "how": step.how, **r})
                log(f"{kind:8} {step.key:22} {server.name:17}", r)
                save()
            if dev is not None:
                t2 = time.monotonic()
                device["detach_error"] = server.detach()
                device["detach_s"] = time.monotonic() - t2
                check, check_err = _run(["qemu-img", "check", "-f", "qcow2", image],
                                        timeout=600)
                device["check"] = check_err or [ln for ln in check.splitlines() if ln.strip()]
                print(f"  {server.name} {kind}: attach {t1 - t0:.1f} s, fio {t2 - t1:.1f} s, "
                      f"detach {device['detach_s']:.1f} s; qemu-img check: "
                      f"{device['check']}", flush=True)
            if os.path.exists(image):
                os.unlink(image)
            save()
    data["ceiling"] = _ceiling(runtime, size)
    data["complete"] = True
    data["elapsed_s"] = time.monotonic() - start
    save()


def _ceiling(runtime: int, size: int) -> dict[str, float | None]:
    """IOPS of aioublk's null target (no backend at all) on the goal rows'
    workloads: what no ublk server reaches in this guest, so the bound of the
    ratios a qcow2 target can show here."""
    dev_id, _err = _add([sys.executable, "-m", "aioublk"], ["-t", "null", "-q", "1"])
    got: dict[str, float | None] = {}
    if dev_id is None:
        return got
    try:
        for workload, qd in GOAL_ROWS:
            rw = "randread" if "read" in workload else "randwrite"
            step = Step(workload, qd, [f"--rw={rw}", "--bs=4k"], "time")
            r = _fio(f"/dev/ublkb{dev_id}", step, runtime, None, size)
            got[step.key] = r.get("iops")  # type: ignore[assignment]
            print(f"  null ceiling {step.key}: {r}", flush=True)
    finally:
        _run([sys.executable, "-m", "aioublk", "del", "-n", dev_id], timeout=120)
    return got


# -- host side ----------------------------------------------------------------------


def _value(runs: list[dict[str, object]], server: str, kind: str, workload: str, qd: int,
           field: str = "iops") -> float | None:
    for x in runs:
        if (x["server"], x["kind"], x["workload"], x["qd"]) == (server, kind, workload, qd):
            v = x.get(field)
            return None if v is None else float(v)  # type: ignore[arg-type]
    return None


def nbd_choice(data: dict[str, object]) -> tuple[str, dict[str, float]]:
    """The qemu-nbd setting with the best geometric mean over the rows all settings ran."""
    runs = data["runs"]
    assert isinstance(runs, list)
    names = list(dict.fromkeys(str(x["server"]) for x in runs if x["server"] != "aioublk"))
    rows = {(x["kind"], x["workload"], x["qd"]) for x in runs}
    common = [r for r in rows if all(_value(runs, n, *r) for n in names)]  # type: ignore[arg-type]
    score = {n: math.exp(statistics.fmean(math.log(_value(runs, n, *r))  # type: ignore[arg-type]
                                          for r in common)) if common else 0.0 for n in names}
    best = max(names, key=lambda n: score[n]) if names else "qemu-nbd"
    return best, score


def rows(data: dict[str, object]) -> list[dict[str, object]]:
    runs = data["runs"]
    assert isinstance(runs, list)
    nbd, _ = nbd_choice(data)
    table = []
    for kind, workload, qd in dict.fromkeys((x["kind"], x["workload"], x["qd"]) for x in runs):
        q = _value(runs, nbd, kind, workload, qd)
        a = _value(runs, "aioublk", kind, workload, qd)
        table.append({
            "kind": kind, "workload": workload, "qd": qd,
            "nbd_iops": q, "nbd_mib_s": _value(runs, nbd, kind, workload, qd, "mib_s"),
            "aioublk_iops": a, "aioublk_mib_s": _value(runs, "aioublk", kind, workload, qd,
                                                       "mib_s"),
            "ratio": a / q if a is not None and q else None,
        })
    return table


#: issue #12's qcow2 number: on the empty image at qd64, the allocating
#: randwrite, then randread and in-place randwrite after the fill
GOAL_ROWS = [("4k randwrite", 64), ("4k randread", 64), ("4k randwrite in place", 64)]
GOAL = 3.0


def _geomean(values: list[float | None]) -> float | None:
    if not all(isinstance(v, float) and v > 0 for v in values):
        return None
    return math.exp(statistics.fmean(math.log(float(v)) for v in values))  # type: ignore[arg-type]


def _goal(data: dict[str, object]) -> list[str]:
    """The geometric mean of aioublk/qemu-nbd over GOAL_ROWS, as a section,
    beside the null target's bound on it."""
    table = rows(data)
    by_key = {(r["workload"], r["qd"]): r for r in table if r["kind"] == "empty"}
    ceiling = data.get("ceiling") or {}
    assert isinstance(ceiling, dict)
    got: list[float | None] = []
    bound: list[float | None] = []
    lines = ["", "## The data plane's goal", "",
             "Empty image, qd64: the allocating 4k randwrite, then (after the fill) 4k "
             "randread and 4k in-place randwrite. **null / qemu-nbd** is aioublk's null "
             "target (no backend at all) on the same fio workload in the same guest: the "
             "most any ublk server shows here, so the bound of the qcow2 ratio.", "",
             "| row | aioublk / qemu-nbd | null IOPS | null / qemu-nbd | qcow2 / null |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for w, qd in GOAL_ROWS:
        r = by_key.get((w, qd), {})
        ratio, nbd, a = r.get("ratio"), r.get("nbd_iops"), r.get("aioublk_iops")
        n = ceiling.get(f"{w} qd{qd}")
        b = n / nbd if isinstance(n, float) and isinstance(nbd, float) and nbd else None
        share = a / n if isinstance(a, float) and isinstance(n, float) and n else None
        got.append(ratio if isinstance(ratio, float) else None)
        bound.append(b)
        lines.append(f"| {w} qd{qd} | {_fmt(ratio, '.2f')} | {_fmt(n)} | {_fmt(b, '.2f')} "
                     f"| {_fmt(share, '.2f')} |")
    mean, top = _geomean(got), _geomean(bound)
    if mean is not None:
        lines.append(f"| **geometric mean** | **{mean:.2f}** (goal >= {GOAL:g}: "
                     f"{'met' if mean >= GOAL else 'not met'}) | | "
                     f"{_fmt(top, '.2f')} | |")
    return lines


def report(data: dict[str, object], command: str) -> str:
    runs, devices = data["runs"], data["devices"]
    assert isinstance(runs, list) and isinstance(devices, list)
    storage = data["storage"]
    assert isinstance(storage, dict)
    nbd, score = nbd_choice(data)
    size_gib = int(data["image_size"]) / (1 << 30)  # type: ignore[call-overload]
    setup = (f"One guest run: QEMU TCG software emulation (no KVM), {GUEST_MEMORY[:-1]} GiB RAM"
             if data["guest"]
             else "One run on the host")
    lines = [
        "# qcow2: aioublk vs qemu-nbd + nbd.ko",
        "",
        f"{setup}, {data['cpus']} CPUs, Linux {data['kernel']}, {data['qemu_nbd']}, "
        f"{data['fio']}. Each server gets a fresh {size_gib:g} GiB qcow2 image (64 KiB "
        f"clusters) in guest RAM (`{storage['path']}`, {storage['fs']}) per image kind: "
        "**empty** (`qemu-img create -f qcow2`) or **prealloc** (`-o preallocation=metadata`: "
        "L2 tables and refcounts in place, data area a hole).",
        "",
        f"- qemu-nbd: `qemu-nbd --cache=none --aio=AIO --discard=unmap -f qcow2 -c /dev/nbdN` "
        f"(nbd.ko, one connection). The table uses **{nbd}**, the faster setting (geometric "
        "mean of IOPS over all rows: "
        + ", ".join(f"{n} {s:,.0f}" for n, s in score.items()) + ").",
        "- aioublk: `python -m aioublk add -t qcow2 -q 1 IMAGE` (its defaults otherwise: "
        "depth 128).",
        f"- fio, io_uring, O_DIRECT, in this order on each device: 4k randwrite qd1 and qd64 "
        f"(the first server runs {data['runtime']} s, every later one does exactly as many "
        "writes, same random sequence, so all allocate the same clusters on the empty image); "
        "a sequential 1 MiB write over the whole device at qd16 (the fill: reads after it "
        "read data, not zeros); then 4k randread at qd1 and qd64, 4k randwrite in place at "
        "qd64, 4k randrw (50/50) and 512k rw (sequential "
        f"50/50 mix) at qd1 and qd64, {data['runtime']} s each after {data['ramp']} s ramp. "
        "IOPS and MiB/s are reads + writes.",
        "",
        "Under emulation the absolute numbers mean little: **the aioublk/qemu-nbd ratios "
        "are the result**.",
    ]
    if data.get("quick"):
        lines += ["", "**Smoke run (`--quick`)**: small image, short runs; not a measurement."]
    if not data.get("complete"):
        lines += ["", "**Incomplete**: the guest run stopped early; rows below are what it "
                      "finished."]
    lines += ["", f"| workload | qd | image | {nbd} IOPS | MiB/s | aioublk IOPS | MiB/s "
                  "| aioublk / qemu-nbd |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows(data), key=lambda r: (_step_index(r), r["kind"] != "empty")):
        lines.append(f"| {r['workload']} | {r['qd']} | {r['kind']} | {_fmt(r['nbd_iops'])} "
                     f"| {_fmt(r['nbd_mib_s'], ',.1f')} | {_fmt(r['aioublk_iops'])} "
                     f"| {_fmt(r['aioublk_mib_s'], ',.1f')} | {_fmt(r['ratio'], '.2f')} |")
    lines += _goal(data)
    names = list(dict.fromkeys(str(x["server"]) for x in runs if x["server"] != "aioublk"))
    if len(names) > 1:
        lines += ["", "## qemu-nbd AIO settings", "", "| workload | qd | image | "
                  + " | ".join(f"{n} IOPS" for n in names) + " |",
                  "| --- | ---: | --- |" + " ---: |" * len(names)]
        for kind, workload, qd in dict.fromkeys((x["kind"], x["workload"], x["qd"])
                                                for x in runs):
            lines.append(f"| {workload} | {qd} | {kind} | "
                         + " | ".join(_fmt(_value(runs, n, kind, workload, qd)) for n in names)
                         + " |")
    lines += ["", "## Devices", "", "| image | server | attach s | qemu-img check after |",
              "| --- | --- | ---: | --- |"]
    for d in devices:
        check = d.get("check")  # qemu-img check's lines, or its error
        shown = ("; ".join(ln for ln in check if not ln.startswith("Image end offset"))
                 if isinstance(check, list) else str(check or "—"))
        lines.append(f"| {d['kind']} | {d['server']} | {d['attach_s']:.1f} | {shown} |")
    errors: dict[tuple[object, ...], str] = {}
    for x in runs:
        if x.get("error"):
            errors.setdefault((x["server"], x["kind"]), str(x["error"]))
    for d in devices:
        if d.get("detach_error"):
            errors.setdefault((d["server"], d["kind"], "detach"), str(d["detach_error"]))
    if errors:
        lines += ["", "## Errors", "", "— in a table means no number; the first error of each "
                  "server/image kind, verbatim:", ""]
        lines += [f"- {' '.join(map(str, k))}: `{e}`" for k, e in errors.items()]
    if data.get("elapsed_s"):
        lines += ["", f"The guest part took {float(data['elapsed_s']) / 60:.0f} min."]  # type: ignore[arg-type]
    lines += ["", f"Chart: `qcow2.png`. Reproduce: `{command}` from the repository root "
                  "(boots the guest when the host has no ublk_drv).", ""]
    return "\n".join(lines)


def _step_index(r: dict[str, object]) -> int:
    for i, s in enumerate(STEPS):
        if (s.workload, s.qd) == (r["workload"], r["qd"]):
            return i
    return len(STEPS)


def plot(data: dict[str, object], path: Path) -> None:
    """Grouped bars of the aioublk/qemu-nbd ratio: one group per workload, one bar per kind."""
    table = sorted(rows(data), key=_step_index)
    nbd, _ = nbd_choice(data)
    where = "QEMU TCG" if data["guest"] else "host"
    grouped_bars(
        path, list(dict.fromkeys(f"{r['workload']}\nqd{r['qd']}" for r in table)),
        [f"{k} image" for k in dict.fromkeys(str(r["kind"]) for r in table)],
        {(f"{r['workload']}\nqd{r['qd']}", f"{r['kind']} image"): r["ratio"]  # type: ignore[misc]
         for r in table},
        f"aioublk IOPS / {nbd} IOPS",
        f"qcow2: aioublk / {nbd} (nbd.ko)\n{where}, {data['cpus']} CPUs, "
        f"Linux {data['kernel']}" + (", --quick" if data.get("quick") else ""))


def _guest_timeout(runtime: int, quick: bool, servers: int) -> float:
    """Generous (a slow server may need long for the fill), but finite."""
    size = QUICK_IMAGE_SIZE if quick else IMAGE_SIZE
    per_device = (300 + size / MiB / MIN_FILL_RATE + 2 * (runtime * COUNT_CAP + 30)
                  + 6 * (runtime + RAMP + 30))
    return 600 + len(KINDS) * servers * per_device


def command(data: dict[str, object]) -> str:
    """The command a report names: the run's own, else the one its settings give."""
    return str(data.get("command") or ".venv/bin/python -m bench.qcow2"
               + (" --quick" if data.get("quick") else "") + f" --runtime {data['runtime']}")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, runtime=10, quick="256 MiB images, 3 s runs", inner=("OUT",))
    ap.add_argument("--nbd-aio", choices=("both", *NBD_AIO), default="both",
                    help="qemu-nbd --aio settings to run (default both; the table uses the "
                         "faster)")
    ns = ap.parse_args(argv)
    if ns.report:
        data = load(ns.report)
        return publish("qcow2", data, report(data, command(data)), plot, out=ns.out)
    runtime = ns.runtime or (3 if ns.quick else 10)
    nbd_aio = list(NBD_AIO) if ns.nbd_aio == "both" else [ns.nbd_aio]
    if ns.inner:
        inner(runtime, ns.quick, nbd_aio, Path(ns.inner[0]))
        return 0
    code, data = run_guest("bench.qcow2", ["--runtime", str(runtime), "--nbd-aio", ns.nbd_aio,
                                           *(["--quick"] if ns.quick else [])],
                           _guest_timeout(runtime, ns.quick, len(nbd_aio) + 1), kublk=False,
                           memory=GUEST_MEMORY)
    if data is None:
        return 1
    data["command"] = (".venv/bin/python -m bench.qcow2" + (" --quick" if ns.quick else "")
                       + (f" --runtime {runtime}" if ns.runtime else "")
                       + (f" --nbd-aio {ns.nbd_aio}" if ns.nbd_aio != "both" else ""))
    return publish("qcow2", data, report(data, command(data)), plot, code, ns.out,
                   ok=bool(data.get("complete")))


if __name__ == "__main__":
    sys.exit(main())
