"""The kernel's ublk selftests with aioublk as their server, beside kublk.

    python -m bench.suites selftests [--only GLOB] [--servers aioublk,kublk] [--timeout S]
                                     [--update]

Every ``test_*.sh`` of ``tools/testing/selftests/ublk`` in the guest kernel's own
linux-source (fetched into the cache by ``python -m tools.kublk``) runs in one
guest boot, once per server, through the same runner: each from a copy of the
folder whose ``kublk`` (the scripts' ``UBLK_PROG``) is either the real kublk,
built from that folder, or a shim that runs this installation's ``aioublk``
with the same arguments. A script's exit status is its outcome, as in the
kernel's kselftest runner: 0 pass, 4 skip, anything else fail.

``UNPASSABLE`` is the list of scripts aioublk cannot pass, each with its reason;
``QUICK`` those short enough for the test command, where
``tests/cli/test_kernel_selftests.py`` runs them with aioublk."""

from __future__ import annotations

import fnmatch
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import Data, load, parser, publish, run_guest, table
from bench.suites import OUTCOMES, counts, side_by_side

NAME = "selftests"
SERVERS = ("aioublk", "kublk")
SKIP, SCRIPT_TIMEOUT = 4, 600
CPUS, MEMORY = 4, "6G"
WHERE = f"One guest run: QEMU TCG software emulation (no KVM), {CPUS} vCPUs, {MEMORY[:-1]} GiB RAM"

#: the scripts aioublk cannot pass, and why: each is run all the same, and
#: its reason shown beside its outcome
UNPASSABLE: dict[str, str] = {
    "test_batch_01.sh": "adds a stripe device over the backing file of a loop device "
                        "still serving: aioublk refuses a file another device writes "
                        "(two writers corrupt it), as QEMU does",
    "test_generic_02.sh": "its bpftrace script needs a newer bpftrace than Debian 12's "
                          "0.17, which fails to attach and the script skips (either server)",
    "test_generic_06.sh": "times three `list` calls and a 1 s sleep against a 5 s limit: "
                          "each `aioublk list` is a Python start, about 1 s under TCG "
                          "emulation and 2 s on a busy host, where kublk's C starts in a "
                          "fraction of that, so it passes or fails with the host's speed",
    "test_generic_08.sh": "the same: a stripe device over a live loop device's file",
    "test_generic_12.sh": "its bpftrace script does not parse with Debian 12's bpftrace "
                          "0.17 (either server fails)",
    "test_integrity_02.sh": "needs fio 3.42 or later (Debian 12 and sid have 3.41); "
                            "skips with either server",
}

#: the test command's: scripts that take well under a minute in the emulated guest,
#: one or two of each kind (the null, loop and partition targets, the copy modes,
#: batch I/O, recovery's teardown, zero copy's fallback)
QUICK = ("test_null_01.sh", "test_null_02.sh", "test_null_03.sh", "test_loop_02.sh",
         "test_loop_04.sh", "test_loop_07.sh", "test_generic_03.sh", "test_generic_09.sh",
         "test_generic_13.sh", "test_generic_17.sh", "test_batch_02.sh", "test_part_01.sh",
         "test_part_02.sh")


def selftest_dir() -> Path:
    from aioublk.testing.sid import cache_dir

    return cache_dir() / "kublk" / "src"


def scripts(src: Path, only: str = "*") -> list[str]:
    return sorted(p.name for p in src.glob("test_*_*.sh") if fnmatch.fnmatch(p.name, only))


def prepare(dest: Path, server: str, kublk: Path | None = None) -> Path:
    """A copy of the selftest folder whose ``kublk`` is `server`: the real one
    (`kublk`, default the cached build) or a shim for this installation's
    aioublk; ``metadata_size`` beside it and a ``bin/`` to put first on PATH."""
    from aioublk.testing.sid import cache_dir

    src = selftest_dir()
    if not (src / "test_common.sh").is_file():
        raise SystemExit(f"no ublk selftests in {src}: run scripts/setup "
                         "(python -m tools.kublk fetches them from Debian sid's linux-source)")
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.c", "*.h", "*.o", "Makefile"))
    built = src.parent
    shutil.copy2(built / "metadata_size", dest / "metadata_size")
    prog = dest / "kublk"
    if server == "kublk":
        shutil.copy2(kublk or built / "kublk", prog)
    else:
        aioublk = Path(sys.executable).with_name("aioublk")
        prog.write_text(f'#!/bin/sh\nexec {aioublk} "$@"\n')
        prog.chmod(0o755)
    # udevadm, which the scripts call to settle, unpacked by scripts/setup (never installed)
    udev = cache_dir() / "udev"
    bin_dir = dest / "bin"
    bin_dir.mkdir()
    (bin_dir / "udevadm").write_text(
        f"#!/bin/sh\nLD_LIBRARY_PATH={udev}/usr/lib/x86_64-linux-gnu/systemd "
        f'exec {udev}/bin/udevadm "$@"\n')
    (bin_dir / "udevadm").chmod(0o755)
    return dest


def clean_up() -> None:
    """Whatever a failed or killed script left: its devices, by either server."""
    for prog in (Path(sys.executable).with_name("aioublk"), selftest_dir().parent / "kublk"):
        subprocess.run([str(prog), "del", "-a"], capture_output=True, timeout=120,
                       stdin=subprocess.DEVNULL, check=False)


def run_script(folder: Path, script: str, timeout: float = SCRIPT_TIMEOUT) -> dict[str, Any]:
    """Run one script from a prepared `folder`: its outcome, seconds and output's tail."""
    tmp = folder / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), PATH=f"{folder / 'bin'}:{os.environ['PATH']}")
    start = time.monotonic()
    with subprocess.Popen(["bash", str(folder / script)], cwd=folder, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, start_new_session=True) as p:
        try:
            out, _ = p.communicate(timeout=timeout)
            code = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the script and all it started: fio, servers
            out, _ = p.communicate()
            code, out = -1, out + f"\ntimed out after {timeout:.0f} s"
    seconds = time.monotonic() - start
    shutil.rmtree(tmp, ignore_errors=True)  # what a failed script left: the next one's space
    result = "pass" if code == 0 else "skip" if code == SKIP else "fail"
    lines = [ln for ln in out.splitlines() if ln.strip() and "selftest:" not in ln]
    return {"test": script.removesuffix(".sh").removeprefix("test_"), "script": script,
            "result": result, "code": code, "seconds": round(seconds, 1),
            "tail": lines[-6:]}


def inner(out: Path, only: str, servers: Sequence[str], timeout: float,
          kublk: Path | None) -> None:
    import json

    records: list[dict[str, Any]] = []
    data: Data = {"guest": os.environ.get("AIOUBLK_IN_GUEST") == "1",
                  "kernel": os.uname().release, "servers": list(servers),
                  "records": records, "complete": False}
    base = Path(os.environ.get("TMPDIR", "/tmp")) / "ublk-selftests"
    folders = {s: prepare(base / s, s, kublk if s == "kublk" else None) for s in servers}
    names = scripts(selftest_dir(), only)
    start = time.monotonic()
    for script in names:
        for server in servers:
            rec = run_script(folders[server], script, timeout)
            rec["server"] = server
            records.append(rec)
            clean_up()
            print(f"[{time.monotonic() - start:5.0f} s] {server:7} {script:22} "
                  f"{rec['result']:4} {rec['seconds']:6.1f} s", flush=True)
            out.write_text(json.dumps(data))
    data["complete"] = True
    out.write_text(json.dumps(data))


def merged(old: Data, new: Data) -> Data:
    """`old` with the records of the scripts and servers `new` ran replaced by
    `new`'s, in `old`'s order; the commands of both kept."""
    ran = {(r["script"], r["server"]) for r in new["records"]}
    fresh = {(r["script"], r["server"]): r for r in new["records"]}
    records = [fresh.pop((r["script"], r["server"]), r) if (r["script"], r["server"]) in ran
               else r for r in old["records"]]
    commands = [*old.get("commands", [old["command"]]), new["command"]]
    return {**old, "records": [*records, *fresh.values()], "command": old["command"],
            "commands": commands, "complete": old["complete"] and new["complete"]}


# -- the report ---------------------------------------------------------------------------


def _cell(rec: Mapping[str, Any] | None) -> str:
    return "—" if rec is None else f"{rec['result']} ({rec['seconds']:.0f} s)"


def report(data: Data, command: str) -> str:
    recs = data["records"]
    servers = data["servers"]
    lines = ["# The kernel's ublk selftests: aioublk beside kublk", "",
             f"{WHERE if data['guest'] else 'One run on the host'}, kernel "
             f"{data['kernel']}: every "
             "`test_*.sh` of the kernel's `tools/testing/selftests/ublk`, from that "
             "kernel's linux-source, run by the same runner with each server as "
             "`UBLK_PROG`. Exit 0 is a pass, 4 a skip, anything else a failure.", ""]
    lines += table(["server", *OUTCOMES], "lrrr",
                   [[s, *counts(recs, s).values()] for s in servers])
    lines += ["", "## Per script", ""]
    rows = []
    for test, by in side_by_side(recs, servers):
        script = next(iter(by.values()))["script"]
        why = UNPASSABLE.get(script, "")
        ours = by.get("aioublk")
        if not why and ours is not None and ours["result"] != "pass" and ours["tail"]:
            why = ours["tail"][-1].replace("|", "\\|")
        rows.append([test, *(_cell(by.get(s)) for s in servers), why])
    lines += table(["test", *servers, "reason (aioublk's, when not a pass)"],
                   "l" + "l" * len(servers) + "l", rows)
    if UNPASSABLE:
        lines += ["", "## Scripts aioublk cannot pass", "",
                  *(f"- `{s}`: {why}" for s, why in UNPASSABLE.items())]
    if not data.get("complete"):
        lines += ["", "**Incomplete**: the guest run stopped early; rows above are what "
                      "it finished."]
    reruns = data.get("commands", [])[1:]
    if reruns:
        lines += ["", "Scripts run again after the whole run, their records replacing the "
                      "first: " + "; ".join(f"`{c}`" for c in reruns) + "."]
    lines += ["", f"Chart: `{NAME}.png`. Reproduce: `{command}` from the repository root.",
              ""]
    return "\n".join(lines)


def plot(data: Data, path: Path) -> None:
    from bench.common import pyplot

    plt = pyplot()
    servers = data["servers"]
    fig, ax = plt.subplots(figsize=(7, 3))
    colors = {"pass": "tab:green", "fail": "tab:red", "skip": "tab:grey"}
    for i, server in enumerate(servers):
        left = 0
        for outcome, n in counts(data["records"], server).items():
            ax.barh(i, n, left=left, color=colors[outcome],
                    label=outcome if i == 0 else None)
            if n:
                ax.text(left + n / 2, i, str(n), ha="center", va="center", color="white")
            left += n
    ax.set_yticks(range(len(servers)), servers)
    ax.set_xlabel("selftest scripts")
    ax.set_title(f"ublk selftests ({data['kernel']})", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, rounds=False, inner=("KUBLK", "OUT"))
    ap.add_argument("--only", default="*", help="scripts matching this glob (default all)")
    ap.add_argument("--servers", default=",".join(SERVERS),
                    help="comma-separated, of aioublk and kublk (default both)")
    ap.add_argument("--timeout", type=float, default=SCRIPT_TIMEOUT,
                    help=f"seconds per script (default {SCRIPT_TIMEOUT})")
    ap.add_argument("--update", action="store_true",
                    help=f"keep OUT/{NAME}.json's other records: only those of the "
                         "scripts run now are replaced")
    ns = ap.parse_args(argv)
    servers = [s for s in ns.servers.split(",") if s]
    if ns.report:
        saved = load(ns.report)
        return publish(NAME, saved, report(saved, saved["command"]), plot, out=ns.out)
    if ns.inner:
        inner(Path(ns.inner[1]), ns.only, servers, ns.timeout, Path(ns.inner[0]))
        return 0
    options = [f"--only={ns.only}", f"--servers={','.join(servers)}",
               f"--timeout={ns.timeout:g}"]
    n = len(scripts(selftest_dir(), ns.only)) * len(servers)
    code, data = run_guest(f"bench.suites.{NAME}", options, timeout=n * ns.timeout + 600,
                           cpus=CPUS, memory=MEMORY)
    if data is None:
        return 1
    data["command"] = " ".join([".venv/bin/python", "-m", "bench.suites", NAME, *options])
    if ns.update and (ns.out / f"{NAME}.json").exists():
        data = merged(load(ns.out / f"{NAME}.json"), data)
    return publish(NAME, data, report(data, data["command"]), plot, code, ns.out)


if __name__ == "__main__":
    sys.exit(main())
