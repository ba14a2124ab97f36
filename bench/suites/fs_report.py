"""bench.suites.fs's report and chart, from a run's JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import Data, errors_section, fmt, grouped_bars, setup_line, table

SERVERS = ("aioublk", "kublk")


def _steps(data: Data, device: str, fs: str, server: str) -> tuple[int, int] | None:
    """(steps passed, steps) of one device run: its workloads, fsck, qemu-img check."""
    runs = [r for r in data["runs"] if (r["device"], r["fs"], r["server"]) == (device, fs, server)]
    checks = [c for c in data["checks"]
              if (c["device"], c["fs"], c["server"]) == (device, fs, server)]
    if not checks:
        return None
    c = checks[0]
    passed = sum(r["result"] == "pass" for r in runs) + (c["fsck"] == "clean") + (
        c["check"] is None or not c["check"].startswith("corrupt")) + (not c["error"])
    return passed, len(runs) + 3


def _kills(r: Mapping[str, Any]) -> str:
    if r["kill_during"] is None:
        return ""
    return f"{r['kills']} ({'during' if r['kill_during'] else 'after'})"


def _check(c: Mapping[str, Any]) -> str:
    if c["check"] is None:
        return "— (raw)"
    return str(c["check"]).split(":")[0]


def groups(data: Data) -> list[tuple[str, str]]:
    seen: dict[tuple[str, str], None] = {}
    for c in [*data["runs"], *data["checks"]]:  # (an incomplete run's last has no check)
        seen[(c["device"], c["fs"])] = None
    return list(seen)


def report(data: Data, command: str) -> str:
    lines = [
        "# File systems under Debian's workloads, aioublk beside kublk", "",
        f"{setup_line(data)}, {data['cpus']} CPUs, Linux {data['kernel']}. Each device "
        f"({data['size'] >> 20} MiB, images in guest RAM) added with user recovery "
        "(`-r 1 -i 1`); ext4 and XFS made by their own mkfs, mounted; each timed "
        f"workload runs {data['seconds']} s. During "
        f"{', '.join(data['killed'])} the server gets `kill -9` and `recover` "
        "(**kills**: cycles, during the workload or, when it had ended, after it). "
        "After the workloads: umount, `e2fsck -fn` / `xfs_repair -n`, the device "
        "deleted, `qemu-img check` of its images (**leaks**: clusters allocated and "
        "never referenced, which a kill may leave; not corruption).", "",
        "Tools: " + ", ".join(f"{v}" for v in data["versions"].values()) + ".",
    ]
    if data.get("quick"):
        lines += ["", "**Smoke run (`--quick`)**: ext4 and XFS on loop and qcow2, stress-ng "
                      "hdd with one kill and recover; not the full suite."]
    if not data.get("complete"):
        lines += ["", "**Incomplete**: the guest run stopped early; below is what it finished."]
    lines += ["", "## Summary", "",
              *table(["device", "fs", "server", "workloads passed", "kill/recover cycles",
                      "fsck", "qemu-img check", "error"], "lllrrlll",
                     ([c["device"], c["fs"], c["server"],
                       "{}/{}".format(*_passed(data, c)), c["kills"], c["fsck"] or "—",
                       _check(c), "yes" if c["error"] else ""] for c in data["checks"]))]
    for device, fs in groups(data):
        runs = [r for r in data["runs"] if (r["device"], r["fs"]) == (device, fs)]
        lines += ["", f"## {device}, {fs}", "",
                  *table(["workload", "server", "result", "ops", "unit", "bytes verified",
                          "kills", "seconds"], "lllrlrrr",
                         ([r["workload"], r["server"], r["result"],
                           fmt(r["ops"], ",.1f" if r["unit"] in ("MB/s", "files/s") else ",.0f"),
                           r["unit"], fmt(r["bytes_verified"]), _kills(r), fmt(r["seconds"], ".0f")]
                          for r in runs))]
    errors: dict[str, str] = {}
    for r in data["runs"]:
        if r["error"]:
            errors.setdefault(f"{r['server']} {r['device']} {r['fs']} {r['workload']}",
                              r["error"])
    for c in data["checks"]:
        for what in ("error", "fsck", "check"):
            v = c[what]
            if v and v not in ("clean",) and not (what == "check" and v.startswith("leaks")):
                errors.setdefault(f"{c['server']} {c['device']} {c['fs']} {what}", v)
    lines += errors_section(errors, "step")
    lines += ["", f"Chart: `fs.png`. Reproduce: `{command}` from the repository root "
              "(boots the guest; fetches liburing's source package from Debian sid and "
              "builds kublk from sid's linux-source).", ""]
    return "\n".join(lines)


def _passed(data: Data, c: Mapping[str, Any]) -> tuple[int, int]:
    runs = [r for r in data["runs"]
            if (r["device"], r["fs"], r["server"]) == (c["device"], c["fs"], c["server"])]
    return sum(r["result"] == "pass" for r in runs), len(runs)


def plot(data: Data, path: Path) -> None:
    """Per device kind and file system, each server's share of steps that passed
    (workloads, fsck, check, the run itself)."""
    gs = groups(data)
    names = [f"{d}\n{f}" for d, f in gs]
    servers: Sequence[str] = [s for s in SERVERS if any(c["server"] == s for c in data["checks"])]
    values: dict[tuple[str, str], float | None] = {}
    for name, (d, f) in zip(names, gs, strict=True):
        for s in servers:
            got = _steps(data, d, f, s)
            values[(name, s)] = got[0] / got[1] if got else None
    grouped_bars(path, names, servers, values, "share of steps passed (line: all)",
                 f"ext4 and XFS under stress-ng, fs_mark, dbench, fio verify, a C build\n"
                 f"with kill -9 and recover; Linux {data['kernel']}")
