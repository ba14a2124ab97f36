"""Soak: fio verify through servers that are killed and handed over, for as long as asked.

    python -m bench.soak [--minutes 60]

In one guest boot (here, when this host has ublk_drv), round after round until
the time is up, over every (target, queue path) in turn: loop, qcow2 and
stripe, each with batch I/O (``-b``) and per-I/O commands (``--no-batch``),
two queues, user recovery with reissue (``-r 1 -i 1``). Each round:

1. ``add`` the device over a fresh file (qcow2: an empty ``qemu-img create``
   image), and start fio: 4k random writes over 32 MiB with crc32c verify
   headers, then a read-back of every block (``--verify_fatal``);
2. once a quarter is written, ``kill -9`` the server, wait for QUIESCED and
   ``recover`` it;
3. then a second hand-over: ``quiesce`` (per-I/O) or SIGTERM (batch: the
   server detaches; ``quiesce`` on a batch device fails new I/O until
   recovery, which fio would see), and ``recover`` again;
4. fio finishes: every block written must read back as written, with no
   error; ``del``; for qcow2 ``qemu-img check`` may find leaked clusters after
   a kill, never corruption.

Reported (``bench/results/soak.md`` and ``.json``): time, rounds, hand-overs,
bytes verified and every error verbatim. Not part of the test command: an
hour of it is a soak, not a test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import grouped_bars, load, parser, publish, run_guest, table

SIZE = 32 << 20
CASES = [(t, p) for t in ("loop", "qcow2", "stripe") for p in ("-b", "--no-batch")]


def _round(target: str, path: str, work: Path) -> dict[str, object]:
    """One round; raises AssertionError (from the test helpers) on any failure."""
    from aioublk.frontend import cli as cli_mod
    from tests.device.test_kernel_lifecycle import (
        fio_result,
        reap,
        start_fio_verify,
        wait_state,
    )
    from tests.support import kernel

    files: list[str]
    if target == "qcow2":
        image = work / "disk.qcow2"
        kernel.run("qemu-img", "create", "-q", "-f", "qcow2", str(image), str(SIZE))
        files = [str(image)]
    elif target == "stripe":
        files = [str(kernel.make_file(work / f"s{i}.img", SIZE // 2)) for i in range(2)]
    else:
        files = [str(kernel.make_file(work / "disk.img", SIZE))]
    args = ["-t", target, "-q", "2", "-d", "32", path, "-r", "1", "-i", "1", *files]
    dev = kernel.start_server(args, work / "server-0.log")
    fio = start_fio_verify(dev.dev_id, work, SIZE)
    handovers = []
    for n, how in enumerate(["kill", "quiesce" if path == "--no-batch" else "sigterm"], 1):
        if how == "kill":
            os.kill(dev.pid, signal.SIGKILL)
            assert reap(dev.pid) == -signal.SIGKILL
        elif how == "sigterm":
            os.kill(dev.pid, signal.SIGTERM)
            assert reap(dev.pid) == 0, kernel.tail(work / f"server-{n - 1}.log")
        else:
            assert cli_mod.main(["quiesce", "-n", str(dev.dev_id)]) == 0
            assert reap(dev.pid) == 0, kernel.tail(work / f"server-{n - 1}.log")
        wait_state(dev.dev_id, "QUIESCED")
        dev = kernel.start_server(["-n", str(dev.dev_id), *args], work / f"server-{n}.log",
                                  cmd="recover")
        handovers.append(how)
    job = fio_result(fio, timeout=600)
    verified = job["read"]["io_bytes"]  # type: ignore[index]
    assert verified == SIZE, job["read"]
    kernel.delete(dev.dev_id)
    assert reap(dev.pid) == 0, kernel.tail(work / f"server-{len(handovers)}.log")
    check = ""
    if target == "qcow2":
        p = subprocess.run(["qemu-img", "check", files[0]], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode in (0, 3), p.stdout + p.stderr  # 3: leaks only
        check = "clean" if p.returncode == 0 else "leaks only"
    return {"target": target, "path": path, "handovers": handovers, "verified": verified,
            "check": check}


def inner(minutes: float, out: Path) -> int:
    """In the guest: rounds until the time is up; the JSON after every round."""
    start = time.monotonic()
    data: dict[str, object] = {"minutes": minutes, "rounds": [], "errors": []}
    rounds, errors = data["rounds"], data["errors"]
    assert isinstance(rounds, list) and isinstance(errors, list)
    n = 0
    while time.monotonic() - start < minutes * 60:
        target, path = CASES[n % len(CASES)]
        n += 1
        with tempfile.TemporaryDirectory(prefix="soak-") as work:
            t0 = time.monotonic()
            try:
                result = _round(target, path, Path(work))
            except Exception as e:  # noqa: BLE001 - every failure is a finding to report
                from tests.support import kernel
                errors.append({"round": n, "target": target, "path": path,
                               "error": f"{type(e).__name__}: {e}"[:2000],
                               "trace": traceback.format_exc()[-3000:]})
                kernel.delete_all()
                result = {"target": target, "path": path, "failed": True}
            result["seconds"] = round(time.monotonic() - t0, 1)
            rounds.append(result)
        data["elapsed"] = round(time.monotonic() - start, 1)
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"soak: round {n} {target} {path}: "
              f"{'FAILED' if result.get('failed') else 'ok'} in {result['seconds']} s",
              flush=True)
    return 1 if errors else 0


def report(data: dict[str, object]) -> str:
    rounds, errors = data["rounds"], data["errors"]
    assert isinstance(rounds, list) and isinstance(errors, list)
    ok = [r for r in rounds if not r.get("failed")]
    handovers = sum(len(r["handovers"]) for r in ok)
    verified = sum(int(r["verified"]) for r in ok)
    lines = ["# Soak: fio verify across kill -9, quiesce and SIGTERM hand-overs", "",
             f"One guest run (QEMU TCG), {float(str(data.get('elapsed', 0))) / 3600:.2f} h of "
             f"the {float(str(data['minutes'])) / 60:.2f} h asked: {len(rounds)} rounds, "
             f"{handovers} hand-overs (each a recover), {verified / (1 << 20):.0f} MiB written "
             f"and read back verified, **{len(errors)} errors**.", "",
             ]
    cells = []
    for target, path in CASES:
        mine = [r for r in ok if (r["target"], r["path"]) == (target, path)]
        checks = sorted({str(r["check"]) for r in mine if r["check"]}) or ["-"]
        cells.append([target, f"`{path}`", len(mine), sum(len(r["handovers"]) for r in mine),
                      f"{sum(int(r['verified']) for r in mine) / (1 << 20):.0f}",
                      ", ".join(checks)])
    lines += table(["target", "queue path", "rounds", "hand-overs", "MiB verified",
                    "qemu-img check"], "llrrrl", cells)
    for e in errors:
        lines += ["", f"- round {e['round']} ({e['target']} `{e['path']}`): `{e['error']}`"]
    return "\n".join(lines + ["", "Reproduce: `python -m bench.soak --minutes 60`.", ""])


def plot(data: dict[str, object], path: Path) -> None:
    """Per target and queue path: rounds, hand-overs and GiB verified."""
    rounds = data["rounds"]
    assert isinstance(rounds, list)
    ok = [r for r in rounds if not r.get("failed")]
    groups = [f"{t} {p}" for t, p in CASES]
    values: dict[tuple[str, str], float | None] = {}
    for (target, qpath), group in zip(CASES, groups, strict=True):
        mine = [r for r in ok if (r["target"], r["path"]) == (target, qpath)]
        values[(group, "rounds")] = len(mine)
        values[(group, "hand-overs")] = sum(len(r["handovers"]) for r in mine)
        values[(group, "GiB verified")] = sum(int(r["verified"]) for r in mine) / (1 << 30)
    grouped_bars(path, groups, ["rounds", "hand-overs", "GiB verified"], values, "count",
                 "Soak: verified rounds across hand-overs, no errors expected", lines=())


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, rounds=False, inner=("OUT",))
    ap.prog = "python -m bench.soak"
    ap.add_argument("--minutes", type=float, default=60.0)
    ns = ap.parse_args(argv)
    if ns.report:
        saved = load(ns.report)
        return publish("soak", saved, report(saved), plot, out=ns.out)
    if ns.inner:
        return inner(ns.minutes, Path(ns.inner[0]))
    # a round that hangs is bounded by the test helpers' own timeouts
    code, data = run_guest("bench.soak", ["--minutes", str(ns.minutes)],
                           timeout=ns.minutes * 60 + 1800, kublk=False)
    if data is None:
        return 1
    return publish("soak", data, report(data), plot, code=code, out=ns.out)


if __name__ == "__main__":
    sys.exit(main())
