"""What metrics cost: ``aioublk serve`` with ``[metrics]`` off and on, in one guest run.

    python -m bench.metrics_cost [--runtime 5] [--rounds 3] [--quick] [--cpus 1]
                                 [--scrape-every 1]

Metrics (issue #25) are the Prometheus endpoint and the latency histograms:
with ``[metrics] listen`` configured, serve starts the endpoint's thread and
the data plane times every request (two clock reads, one bucket). The
per-request counters (requests, bytes, errors, who served) are kept whatever
the configuration, for ``list --stats``; serve publishes them once a second
in both runs. This bench runs one serve config of three devices, 1 queue,
depth 128 each:

- **null** and **loop** (a 1 GiB file in guest RAM, as ``bench.modes``'s),
  served by C from fetch to commit;
- **python**: ``examples/ramdisk.py``'s RAM disk, a coroutine target
  without a map (every request a coroutine, as ``bench.nomap``'s).

and fio io_uring O_DIRECT 4k randread at iodepth 1 and 64 on each, under
three settings:

- **off**: serve without ``[metrics]``;
- **timing**: serve with ``[metrics]``, nobody scraping it;
- **scraped**: the same serve, scraped every ``--scrape-every`` seconds
  (default 1, much more often than Prometheus's usual 15 s or more) while
  fio runs.

off is one serve process and timing/scraped another; per round both run,
the first one swapping every round (and timing/scraped within the second).
The cost is judged on each round's own ratio (paired, so drift between
rounds cancels out): the goal is scraped / off >= 0.97, metrics costing at
most 3%. The server's CPU time per I/O (``/proc/PID/task/*/schedstat``,
io_uring's ``iou-wrk`` workers apart) is given beside the IOPS.

The guest only writes JSON; the host turns it into
``bench/results/metrics_cost.md``, ``.json`` and ``.png``. ``--quick`` (one
round, 2 s runs, qd64 only) is a smoke test of this script.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from bench.common import (
    ROOT,
    Data,
    errors_section,
    fmt,
    grouped_bars,
    median,
    met,
    notes,
    paired_ratios,
    parser,
    record,
    serve_main,
    setup_line,
    swapped,
    table,
)
from bench.modes import RAMP, _backing_file, _fio
from bench.qcow2 import _dev_ios, _tasks_cpu, cpu_fields

NAME = "metrics_cost"
TARGET = 0.97  # with metrics / without, at least: a cost of at most 3%
PORT = 9341
DEV_BASE = 40  # the devices' fixed ids: DEV_BASE + their index in DEVICES
DEVICES = ("null", "loop", "python")
WORKLOADS = ("4k randread qd1", "4k randread qd64")
QUICK_WORKLOADS = ("4k randread qd64",)
#: serve processes, the second with [metrics]; each setting, the process it runs in
PROCESSES = ("off", "on")
SETTINGS = {"off": "off", "timing": "on", "scraped": "on"}
RAMDISK_SIZE = 256 << 20
#: the python device: examples/ramdisk.py's RAM disk (a coroutine per request, no map)
PYTHON_TARGET = "examples.ramdisk:RamDisk"


# -- the guest side -----------------------------------------------------------------------


def config(metrics: bool, backing: str, port: int = PORT) -> str:
    """The serve config: the three devices (ids DEV_BASE...), [metrics] when `metrics`."""
    lines = [f'[metrics]\nlisten = "127.0.0.1:{port}"\n'] if metrics else []
    options = {"null": "", "loop": f'file = "{backing}"\n',
               "python": f"size = {RAMDISK_SIZE}\n"}
    for i, name in enumerate(DEVICES):
        target = PYTHON_TARGET if name == "python" else name
        lines.append(f'[[devices]]\ntarget = "{target}"\nid = {DEV_BASE + i}\nqueues = 1\n'
                     f"depth = 128\n[devices.options]\n{options[name]}")
    return "\n".join(lines)


def order(round_index: int) -> list[tuple[str, list[str]]]:
    """(process, its settings in order) for one round: off and on swap every round,
    and so do timing and scraped within on."""
    inside = {"off": ["off"], "on": list(swapped(("timing", "scraped"), round_index))}
    return [(p, inside[p]) for p in swapped(PROCESSES, round_index)]


_COUNT = re.compile(r"^aioublk_latency_seconds_count\{[^}]*\}\s+(\S+)$", re.M)


def timed(exposition: str) -> int:
    """Requests the latency histograms counted, over every device, queue and op."""
    return sum(int(float(n)) for n in _COUNT.findall(exposition))


class Server:
    """One ``aioublk serve`` of `cfg` (`devices` of them, `env` added to its
    environment), until stop()."""

    def __init__(self, cfg: str, folder: str, devices: int = len(DEVICES),
                 env: Mapping[str, str] | None = None, name: str = "serve") -> None:
        path = Path(folder) / f"{name}.toml"
        path.write_text(cfg)
        self.p = subprocess.Popen([sys.executable, "-m", "aioublk", "serve", str(path)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  cwd=ROOT, env={**os.environ, **(env or {})})
        assert self.p.stdout is not None
        seen: list[str] = []
        ids: set[int] = set()
        while len(ids) < devices:
            line = self.p.stdout.readline()
            if not line:
                self.p.wait()
                raise RuntimeError(f"serve exited {self.p.returncode}: "
                                   + " | ".join(seen[-5:]))
            seen.append(line.strip())
            if line.startswith("dev id "):
                ids.add(int(line.split()[2].rstrip(":")))
        threading.Thread(target=self.p.stdout.read, daemon=True).start()  # never a full pipe
        for i in ids:
            for _ in range(100):  # devtmpfs makes the node shortly after START_DEV
                if os.path.exists(f"/dev/ublkb{i}"):
                    break
                time.sleep(0.1)

    def stop(self) -> None:
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=180)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def scrape(port: int = PORT) -> str:
    """GET /metrics: the body. A bare socket, not urllib: the guest's one CPU
    should spend on the scrape what the endpoint costs, not a client."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status = head.split(b"\r\n")[0]
    if not status.startswith(b"HTTP/1.1 200"):
        raise OSError(f"the endpoint answered {status!r}")
    return body.decode()


class Scraper:
    """Scrapes the endpoint every `every` seconds in a thread while it is entered."""

    def __init__(self, every: float) -> None:
        self.every, self.done, self.count, self.error = every, threading.Event(), 0, ""
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(self.every):
            try:
                scrape()
                self.count += 1
            except OSError as e:
                self.error = str(e)

    def __enter__(self) -> Scraper:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.thread.join()


def _measure(pid: int, dev: str, workload: str, runtime: int,
             scrape_every: float | None) -> dict[str, Any]:
    """One fio run: IOPS, the server's CPU per I/O, the scrapes made meanwhile."""
    cpu, ios = _tasks_cpu(pid), _dev_ios(dev)
    if scrape_every is None:
        iops, err = _fio(dev, workload, runtime, [])
        scrapes = None
    else:
        with Scraper(scrape_every) as s:
            iops, err = _fio(dev, workload, runtime, [])
        scrapes = s.count
        err = err or (f"scrape: {s.error}" if s.error else None)
    done = _dev_ios(dev)
    return {"iops": iops, "error": err, "scrapes": scrapes,
            **cpu_fields(cpu, _tasks_cpu(pid), None if ios is None or done is None
                         else done - ios)}


def _clocksource() -> str:
    try:
        return Path("/sys/devices/system/clocksource/clocksource0/current_clocksource") \
            .read_text().strip()
    except OSError:
        return "unknown"


def inner(runtime: int, rounds: int, quick: bool, scrape_every: float, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every serve process."""
    workloads = QUICK_WORKLOADS if quick else WORKLOADS
    start = time.monotonic()
    runs: list[dict[str, Any]] = []
    backing = _backing_file()
    data: Data = {
        "kernel": os.uname().release, "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "rounds": rounds, "quick": quick, "scrape_every": scrape_every,
        "clocksource": _clocksource(), "backing": backing, "timed": [], "complete": False,
        "runs": runs,
    }
    with tempfile.TemporaryDirectory() as folder:
        for r in range(rounds):
            for process, settings in order(r):
                t0 = time.monotonic()
                try:
                    server = Server(config(process == "on", str(backing["path"])), folder)
                except RuntimeError as e:
                    for name in DEVICES:
                        for w in workloads:
                            for s in settings:
                                record(runs, start, r + 1, f"{name:6} {w:16} {s:7}", None,
                                       str(e), device=name, workload=w, setting=s)
                    continue
                print(f"  serve ({process}) started in {time.monotonic() - t0:.0f} s",
                      flush=True)
                try:
                    for i, name in enumerate(DEVICES):
                        for w in workloads:
                            for s in settings:
                                got = _measure(server.p.pid, f"/dev/ublkb{DEV_BASE + i}", w,
                                               runtime,
                                               scrape_every if s == "scraped" else None)
                                iops, err = got.pop("iops"), got.pop("error")
                                record(runs, start, r + 1, f"{name:6} {w:16} {s:7}", iops,
                                       err, device=name, workload=w, setting=s, **got)
                    if process == "on":  # the histograms counted: timing was on
                        data["timed"].append(timed(scrape()))
                except OSError as e:
                    data["timed"].append(f"scrape failed: {e}")
                finally:
                    server.stop()
                out.write_text(json.dumps(data))
    data["complete"] = True
    out.write_text(json.dumps(data))


# -- the report ---------------------------------------------------------------------------


class Row(NamedTuple):
    device: str
    workload: str
    iops: dict[str, float | None]  # setting -> median IOPS
    cpu: dict[str, float | None]   # setting -> median CPU µs per I/O
    ratios: dict[str, list[float]]  # "timing", "scraped": each round's setting / off

    def paired(self, setting: str) -> float | None:
        values = self.ratios[setting]
        return statistics.median(values) if values else None


def rows(data: Mapping[str, Any]) -> list[Row]:
    out = []
    runs = data["runs"]
    for device in DEVICES:
        for w in WORKLOADS:
            key = {"device": device, "workload": w}
            if not any(all(x.get(k) == v for k, v in key.items()) for x in runs):
                continue
            out.append(Row(
                device, w,
                {s: median(runs, setting=s, **key) for s in SETTINGS},
                {s: median(runs, "cpu_us_per_io", setting=s, **key) for s in SETTINGS},
                {s: paired_ratios(runs, {"setting": s, **key}, {"setting": "off", **key})
                 for s in ("timing", "scraped")}))
    return out


def _spread(values: Sequence[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if values else "—"


def _cpu_ratio(r: Row) -> float | None:
    on, off = r.cpu["scraped"], r.cpu["off"]
    return on / off if on is not None and off else None


def report(data: Mapping[str, Any], command: str) -> str:
    every = data["scrape_every"]
    lines = [
        "# What metrics cost: serve with `[metrics]` off and on (issue #25)",
        "",
        f"{setup_line(data)}, {data['cpus']} CPUs, Linux {data['kernel']}, clock source "
        f"`{data['clocksource']}`. One `aioublk serve` config of three devices (1 queue, "
        "depth 128): **null** and **loop** (served by C from fetch to commit) and "
        "**python** (a coroutine target without a map: every request crosses Python). fio "
        f"io_uring O_DIRECT 4k randread, {data['runtime']} s per run after {data['ramp']} s "
        f"ramp, {data['rounds']} round(s). **off**: no `[metrics]`; **timing**: `[metrics]` "
        "configured (the endpoint's thread, every request timed in C), nobody scraping; "
        f"**scraped**: the same, `/metrics` fetched every {every} s during the run. The "
        "per-request counters (`list --stats`) are kept in every setting and published "
        "once a second: they cannot be switched off, so they are in every column.",
    ]
    lines += notes(data, "one round, 2 s runs, qd64 only")
    counted = [f"{n:,}" if isinstance(n, int) else str(n) for n in data.get("timed") or []]
    if counted:
        lines += ["", "Requests the latency histograms counted by the end of each metrics-on "
                  f"serve (timing was on): {', '.join(counted)}."]
    lines += ["", "IOPS and CPU are medians over the rounds. A ratio is the median over the "
              "rounds of each round's own setting / off (min–max beside it); the goal, "
              f"scraped / off ≥ {TARGET} (metrics cost at most 3%), is judged on it. CPU µs "
              "per I/O: the serve process's threads (`/proc/PID/task/*/schedstat`, io_uring's "
              "`iou-wrk` apart, ramp included) per request the device completed.", "",
              *table(["device", "workload", "off IOPS", "timing IOPS", "scraped IOPS",
                      "timing / off", "scraped / off", "rounds", "CPU µs/I/O off",
                      "scraped", "CPU scraped / off", "met"], "llrrrrrlrrrl",
                     ([r.device, r.workload, fmt(r.iops["off"]), fmt(r.iops["timing"]),
                       fmt(r.iops["scraped"]), fmt(r.paired("timing"), ".3f"),
                       fmt(r.paired("scraped"), ".3f"), _spread(r.ratios["scraped"]),
                       fmt(r.cpu["off"], ".1f"), fmt(r.cpu["scraped"], ".1f"),
                       fmt(_cpu_ratio(r), ".3f"), met(r.paired("scraped"), TARGET)]
                      for r in rows(data)))]
    errors: dict[str, str] = {}
    for x in data["runs"]:
        if x["error"]:
            errors.setdefault(f"{x['device']} {x['setting']}", str(x["error"]))
    return "\n".join(lines + errors_section(errors, "device/setting") + [
        "", f"Chart: `{NAME}.png`. Reproduce: `{command}` from the repository root (boots "
        "the guest when the host has no ublk_drv).", ""])


def plot(data: Mapping[str, Any], path: Path) -> None:
    """Per row, timing / off and scraped / off (paired by round), the goal drawn across."""
    got = rows(data)
    groups = [f"{r.device}\n{r.workload.removeprefix('4k randread ')}" for r in got]
    values = {(g, f"{s} / off"): r.paired(s) for g, r in zip(groups, got, strict=True)
              for s in ("timing", "scraped")}
    where = "QEMU TCG" if data["guest"] else "host"
    grouped_bars(path, groups, ["timing / off", "scraped / off"], values,
                 "IOPS with metrics / without (paired by round)",
                 f"What metrics cost, 4k randread: {where}, {data['cpus']} CPUs, "
                 f"{data['rounds']} round(s); red dashes: the goal {TARGET}",
                 lines=((1.0, "black", "-"), (TARGET, "red", "--")))


def _guest_timeout(rounds: int, quick: bool, runtime: int) -> float:
    """Generous (TCG on a busy host is slow), but bounded: 300 s per serve process,
    each fio run with 40 s of slack."""
    fio_runs = len(DEVICES) * len(QUICK_WORKLOADS if quick else WORKLOADS) * len(SETTINGS)
    return 900 + rounds * (len(PROCESSES) * 300 + fio_runs * (runtime + RAMP + 40))


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, runtime=5, rounds=3, quick="one round, 2 s runs, qd64 only",
                inner=("OUT",))
    ap.add_argument("--cpus", type=int, default=1,
                    help="guest vCPUs (default 1: fio and serve share it, as do the settings; "
                         "with more, where the scheduler puts them moves IOPS more than "
                         "metrics do)")
    ap.add_argument("--scrape-every", type=float, default=1.0,
                    help="seconds between scrapes in the scraped setting (default 1)")
    ns = ap.parse_args(argv)
    return serve_main(NAME, ns, 1, [f"--scrape-every={ns.scrape_every}"],
                      lambda runtime, rounds: inner(runtime, rounds, ns.quick, ns.scrape_every,
                                                    Path(ns.inner[0])),
                      report, plot, lambda rounds, runtime: _guest_timeout(rounds, ns.quick,
                                                                           runtime))


if __name__ == "__main__":
    sys.exit(main())
