"""-t nbd beside the kernel's own NBD client, against the same server, in one guest run
(issue #14).

    python -m bench.nbd [--runtime 5] [--rounds 2] [--quick]

qemu-storage-daemon exports a 1 GiB raw file in the guest's RAM (tmpfs, filled
with data first so reads do not hit holes), over a unix socket and over TCP
127.0.0.1, a fresh daemon for each client (neither inherits the other's state).
Two clients, each with one connection and depth 128 (nbd.ko's own), the I/O
scheduler set to ``none`` on both devices:

1. ``aioublk add -t nbd URI -q 1 -d 128``: ublk, then the queue's data plane, which
   speaks NBD's transmission phase itself once libnbd has connected;
2. the kernel's nbd.ko: through ``nbd-client`` where the guest has it (it hands
   nbd.ko a socket connected to the daemon), else ``qemu-nbd -c /dev/nbdN URI``,
   where qemu-nbd is itself an NBD client of the daemon and serves nbd.ko over a
   socket pair: one hop more than aioublk's, which the report says.

fio io_uring O_DIRECT: 4k randread and randwrite at iodepth 64, 128k sequential
read and write at iodepth 16. Who goes first swaps every round; the goal is
aioublk / kernel ≥ 1 on the paired ratio (each round's own ratio, then the
median), as in ``bench.dataplane``.

The guest only writes JSON; the host turns it into ``bench/results/nbd.md``,
``.json`` and ``nbd.png`` (matplotlib: ``pip install -e .[bench]``). Absolute
numbers under software emulation mean little; the ratios are the result.
``--quick`` (unix socket only, 4k randread, 2 s runs) is a smoke test.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple, Protocol

from bench.common import (
    fmt,
    footer,
    guest_main,
    median,
    met,
    notes,
    paired,
    ratio,
    ratio_bars,
    record,
    run,
    setup_line,
    swapped,
    table,
)
from bench.modes import BACKING_SIZE, RAMP, _fio
from bench.qcow2 import AioublkServer, NbdServer, _free_nbd, _image_folder

CLIENTS = ("kernel", "aioublk")
TRANSPORTS = ("unix", "tcp")
PORT = 10809
WORKLOADS = ["4k randread qd64", "4k randwrite qd64", "128k read qd16", "128k write qd16"]
QUICK = {"transports": ["unix"], "workloads": ["4k randread qd64"]}
TARGET = 1.0  # aioublk / kernel at least


class Export(NamedTuple):
    """One transport's daemon: how each client names it."""

    uri: str                 # libnbd's and qemu-nbd's
    nbd_client: list[str]    # nbd-client's HOST [PORT] (before the device)
    address: str | tuple[str, int]  # the daemon is up once this accepts a connection
    family: socket.AddressFamily


def _export(transport: str, folder: str) -> Export:
    if transport == "unix":
        sock = os.path.join(folder, "qsd.sock")
        return Export(f"nbd+unix:///disk?socket={sock}", ["-unix", sock], sock,
                      socket.AF_UNIX)
    return Export(f"nbd://127.0.0.1:{PORT}/disk", ["127.0.0.1", str(PORT)],
                  ("127.0.0.1", PORT), socket.AF_INET)


def _start_daemon(transport: str, exp: Export, disk: str) -> tuple[subprocess.Popen[bytes] | None,
                                                                   str | None]:
    """qemu-storage-daemon exporting `disk` writable as "disk"; (process, None) once it
    accepts connections, else (None, error)."""
    addr = (f"addr.type=unix,addr.path={exp.address}" if transport == "unix"
            else f"addr.type=inet,addr.host=127.0.0.1,addr.port={PORT}")
    return start_listening(
        ["qemu-storage-daemon", "--blockdev", f"driver=file,node-name=disk,filename={disk}",
         "--nbd-server", addr, "--export", "type=nbd,id=exp,node-name=disk,name=disk,writable=on"],
        exp, Path(disk).with_suffix(".log"))


def start_listening(argv: list[str], exp: Export,
                    log: Path) -> tuple[subprocess.Popen[bytes] | None, str | None]:
    """Start the NBD server ``argv`` (its stderr to ``log``); (process, None) once
    ``exp``'s address accepts connections, else (None, error). bench.nbdkit's too."""
    name = os.path.basename(argv[0])
    with open(log, "wb") as err_file:  # (a pipe nobody reads could fill and stall it)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err_file)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = log.read_text(errors="replace").strip()[-300:]
            return None, f"{name} exit {proc.returncode}: {err}"
        with socket.socket(exp.family) as s:
            try:
                s.connect(exp.address)
                return proc, None
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.1)
    proc.kill()
    proc.wait()
    return None, f"{name}: not listening after 60 s"


def stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class KernelClient(NbdServer):
    """nbd.ko on the export: nbd-client where installed, else qemu-nbd -c (one more hop).
    Detached as bench.qcow2's (``qemu-nbd -d`` disconnects any /dev/nbdN)."""

    def __init__(self) -> None:
        super().__init__("")
        self.tool = "nbd-client" if shutil.which("nbd-client") else "qemu-nbd -c"
        self.name = "kernel"

    def attach_export(self, exp: Export) -> tuple[str | None, str | None]:
        dev = _free_nbd()
        if dev is None:
            return None, "no free /dev/nbdN (is nbd.ko loaded?)"
        if self.tool == "nbd-client":
            cmd = ["nbd-client", *exp.nbd_client, dev, "-N", "disk"]
        else:
            cmd = ["qemu-nbd", "-f", "raw", "-c", dev, exp.uri]
        _, err = run(cmd, timeout=120)
        if err:
            return None, f"{self.tool} {err}"
        self.dev = dev
        return dev, None

    def detach(self) -> str | None:
        if self.tool != "nbd-client":
            return super().detach()
        assert self.dev is not None
        _, err = run(["nbd-client", "-d", self.dev], timeout=120)
        self.dev = None
        return err


def _no_scheduler(dev: str) -> None:
    """Both devices without an I/O scheduler: nbd.ko and ublk may differ in their default."""
    path = Path(f"/sys/block/{os.path.basename(dev)}/queue/scheduler")
    try:
        path.write_text("none")
    except OSError as e:
        print(f"  {dev}: scheduler left as {path.read_text().strip()} ({e.strerror})",
              flush=True)


def attach_client(kernel: bool, exp: Export) -> tuple[KernelClient | AioublkServer,
                                                       tuple[str | None, str | None]]:
    """nbd.ko (``kernel``) or ``aioublk add -t nbd -d 128`` on the export: the side,
    and (its device, None) or (None, error). bench.nbd_instructions's too."""
    side: KernelClient | AioublkServer
    if kernel:
        side = KernelClient()
        return side, side.attach_export(exp)
    side = AioublkServer("nbd", ["-d", "128"])
    return side, side.attach(exp.uri)


def _client_runs(client: str, exp: Export, workloads: list[str],
                 runtime: int) -> list[tuple[str, float | None, str | None]]:
    """Attach one client to the export, run each workload on it, detach."""
    side, attached = attach_client(client == "kernel", exp)
    return workload_runs(client, side, attached, workloads, runtime)


class Detachable(Protocol):
    def detach(self) -> str | None: ...


def workload_runs(client: str, side: Detachable, attached: tuple[str | None, str | None],
                  workloads: list[str],
                  runtime: int) -> list[tuple[str, float | None, str | None]]:
    """Each workload on the device ``attached`` gave as (device, error), then ``side``
    detached (bench.rbd's clients too)."""
    dev, err = attached
    if dev is None:
        return [(w, None, err) for w in workloads]
    runs = []
    try:
        _no_scheduler(dev)
        for w in workloads:
            iops, err = _fio(dev, w, runtime, [])
            runs.append((w, iops, err))
    finally:
        err = side.detach()
        if err:
            print(f"  detaching {client} from {dev} failed: {err}", flush=True)
    return runs


def _fill(disk: str) -> str | None:
    """Data in every block of the export's file, so reads are not of holes."""
    _, err = run(["fio", "--name=fill", f"--filename={disk}", "--rw=write", "--bs=1M",
                   f"--size={BACKING_SIZE}", "--ioengine=psync", "--refill_buffers"],
                  timeout=1800)
    return err


def inner(runtime: int, rounds: int, quick: bool, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every client so a crash keeps what was done."""
    transports = QUICK["transports"] if quick else list(TRANSPORTS)
    workloads = QUICK["workloads"] if quick else WORKLOADS
    start = time.monotonic()
    release, _ = run(["uname", "-r"], timeout=10)
    qsd, _ = run(["qemu-storage-daemon", "--version"], timeout=30)
    run(["modprobe", "nbd"], timeout=60)  # the harness loads it already
    folder = _image_folder(BACKING_SIZE)
    disk = os.path.join(str(folder["path"]), "disk.raw")
    runs: list[dict[str, object]] = []
    data: dict[str, object] = {
        "kernel": release.strip(), "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "rounds": rounds, "quick": quick, "storage": folder,
        "qemu_storage_daemon": qsd.splitlines()[0] if qsd else None,
        "kernel_client": KernelClient().tool, "complete": False, "runs": runs,
    }
    data["fill_error"] = fill_err = _fill(disk)
    print(f"export file {disk} ({folder['fs']}) filled: {fill_err or 'ok'}", flush=True)
    for r in range(rounds):
        for transport in transports:
            exp = _export(transport, str(folder["path"]))
            for client in swapped(CLIENTS, r):
                proc, err = _start_daemon(transport, exp, disk)
                done = (_client_runs(client, exp, workloads, runtime) if proc is not None
                        else [(w, None, err) for w in workloads])
                if proc is not None:
                    stop_daemon(proc)
                for w, iops, e in done:
                    record(runs, start, r + 1, f"{transport:4} {w:17} {client:7}", iops, e,
                           device=transport, workload=w, server=client)
                out.write_text(json.dumps(data))
    data["complete"] = True
    out.write_text(json.dumps(data))


class Row(NamedTuple):
    transport: str
    workload: str
    kernel: float | None  # median IOPS
    aioublk: float | None
    ratio: float | None  # of the medians
    paired: float | None  # the median of each round's aioublk / kernel


def rows(data: dict[str, object], transports: tuple[str, ...] = TRANSPORTS,
         clients: tuple[str, str] = CLIENTS) -> list[Row]:
    """Each transport and workload the run measured; ``clients``: (the peer, aioublk)."""
    runs = data["runs"]
    assert isinstance(runs, list)
    out = []
    for t in transports:
        for w in WORKLOADS:
            if any(x["device"] == t and x["workload"] == w for x in runs):
                k, a = (median(runs, server=c, device=t, workload=w) for c in clients)
                key = {"device": t, "workload": w}
                out.append(Row(t, w, k, a, ratio(a, k),
                               paired(runs, {"server": clients[1], **key},
                                      {"server": clients[0], **key})))
    return out


def ratio_table(table_rows: list[Row], first: str, peer: str) -> list[str]:
    """The ratio table's lines: ``first`` heads the rows' transport column, ``peer``
    names the other client (bench.rbd's too)."""
    return table([first, "workload", f"{peer} IOPS", "aioublk IOPS", f"aioublk / {peer}",
                  "paired", "goal", "met"], "llrrrrrl",
                 ([r.transport, r.workload, fmt(r.kernel), fmt(r.aioublk), fmt(r.ratio, ".2f"),
                   fmt(r.paired, ".2f"), f"≥ {TARGET}", met(r.paired, TARGET)]
                  for r in table_rows))


def report(data: dict[str, object], command: str) -> str:
    runs = data["runs"]
    assert isinstance(runs, list)
    tool = data.get("kernel_client")
    hop = ("`nbd-client` hands nbd.ko a socket connected to the daemon" if tool == "nbd-client"
           else "no `nbd-client` in the guest, so `qemu-nbd -f raw -c /dev/nbdN URI`: qemu-nbd "
           "is an NBD client of the daemon and serves nbd.ko over a socket pair, **one hop "
           "more** than aioublk's")
    storage = data.get("storage")
    where = (f"`{storage['path']}` ({storage['fs']})" if isinstance(storage, dict)
             else "guest RAM")
    lines = [
        "# -t nbd vs the kernel's NBD client, same server (issue #14)", "",
        f"{setup_line(data)}, {data['cpus']} CPUs, Linux {data['kernel']}. "
        f"{data.get('qemu_storage_daemon') or 'qemu-storage-daemon'} exports a 1 GiB raw "
        f"file in {where}, filled with data, over a unix socket and over TCP 127.0.0.1. "
        "Clients: `aioublk add -t nbd URI -q 1 -d 128`, and nbd.ko (depth 128, one "
        f"connection): {hop}. Scheduler `none` on both devices. fio with io_uring, "
        f"O_DIRECT, {data['runtime']} s per workload after {data['ramp']} s ramp; median of "
        f"{data['rounds']} round(s), the kernel first in odd rounds and aioublk first in "
        "even ones. Under emulation the absolute IOPS mean little: **the ratios are the "
        "result**.",
    ]
    lines += notes(data, "unix socket, 4k randread, one round")
    lines += ["", "IOPS are medians over the rounds. **aioublk / kernel** divides those "
              "medians; **paired** is the median over the rounds of each round's own ratio "
              "(the two ran back to back): the goal is judged on it.",
              "", *ratio_table(rows(data), "transport", "kernel")]
    errors: dict[str, str] = {}
    for x in runs:
        if x["error"]:
            errors.setdefault(f"{x['server']} `{x['device']}`", str(x["error"]))
    return "\n".join(lines + footer(errors, "client/transport", "nbd.png", command))


def plot(data: dict[str, object], path: Path) -> None:
    """One bar per transport and workload, the goal drawn across: green met, red not."""
    plot_ratios(rows(data), path, "aioublk / kernel IOPS, paired by round (line: goal)",
                f"-t nbd vs nbd.ko ({data.get('kernel_client')}), qemu-storage-daemon\n"
                f"Linux {data['kernel']}, median of {data['rounds']} round(s)")


def plot_ratios(table: list[Row], path: Path, ylabel: str, title: str) -> None:
    """The paired ratio of each row as a bar, TARGET drawn across (bench.rbd's too)."""
    ratio_bars(path, [(f"{r.transport}\n{r.workload}", r.paired, TARGET) for r in table],
               ylabel, title)


def main(argv: list[str] | None = None) -> int:
    def timeout(rounds: int, quick: bool, runtime: int) -> float:
        attaches = rounds * len(CLIENTS) * (1 if quick else len(TRANSPORTS))
        fio_runs = attaches * (1 if quick else len(WORKLOADS))
        return 1800 + attaches * 180 + fio_runs * (runtime + RAMP + 30)

    return guest_main("nbd", __doc__, argv, rounds=2, quick="unix socket, 4k randread, 2 s runs",
                      inner=inner, report=report, plot=plot, timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
