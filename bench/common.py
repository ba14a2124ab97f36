"""What every benchmark shares, written once: its command line, the guest run, rounds
in swapped order, medians and paired ratios, markdown tables, charts, and the
results files (``bench/results/NAME.json``, ``.md``, ``.png``).

Every bench re-renders its report from a run's JSON (``--report JSON``, ``--out
DIR``) without running anything: tests/bench/test_bench.py does so for each one."""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
T = TypeVar("T")
Data = dict[str, Any]


# -- the command line -------------------------------------------------------------------


def parser(doc: str | None, *, runtime: int | None = None, rounds: int | None = None,
           rounds_help: str | None = None, quick: str | None = None,
           inner: Sequence[str] | None = ("KUBLK", "OUT")) -> argparse.ArgumentParser:
    """The options every bench has: ``--rounds``, ``--quick`` (``quick``: what it runs),
    ``--runtime`` (fio benches: ``runtime`` is the default it shows), ``--report JSON``
    and ``--out DIR``; ``inner``: the hidden guest-side ``--inner`` metavars. ``rounds``
    False: a bench without rounds."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    if runtime is not None:
        ap.add_argument("--runtime", type=int, default=None,
                        help=f"seconds per fio run (default {runtime})")
    if rounds is not False:
        ap.add_argument("--rounds", type=int, default=rounds,
                        help=rounds_help or (f"default {rounds}" if rounds else None))
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=f"smoke test: {quick}")
    ap.add_argument("--report", metavar="JSON",
                    help="only write the report (and chart) again from a run's JSON")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="folder for NAME.json, .md and .png (default bench/results)")
    if inner:
        ap.add_argument("--inner", nargs=len(inner), metavar=tuple(inner),
                        help=argparse.SUPPRESS)
    return ap


def load(path: str | Path) -> Data:
    data: Data = json.loads(Path(path).read_text())
    return data


# -- running ------------------------------------------------------------------------------


def run(cmd: list[str], timeout: float) -> tuple[str, str | None]:
    """(stdout, None) or (stdout, error): one failed step must not end the whole run."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "", f"timed out after {timeout:.0f} s"
    if p.returncode != 0:
        msg = (p.stderr.strip() or p.stdout.strip()).splitlines()
        return p.stdout, f"exit {p.returncode}: {' | '.join(msg[-5:])}"
    return p.stdout, None


def swapped(items: Sequence[T], round_index: int) -> Sequence[T]:
    """Who goes first swaps every round: drift over the run (the host's load, the
    guest's page cache) then favours neither side."""
    return items if round_index % 2 == 0 else items[::-1]


def run_guest(module: str, args: list[str], timeout: float, cpus: int = 2,
              kublk: bool = True, memory: str = "4G", inner: Sequence[str] = (),
              here: bool = True, shared: Sequence[Path] = (), accel: str | None = None,
              qemu_opts: Sequence[str] = ()) -> tuple[int, Data | None]:
    """Run ``python -m MODULE ARGS --inner [KUBLK] [INNER...] OUT`` in the guest (or here
    when this host has ublk_drv and `here`), building kublk first if `kublk`: (exit
    status, the JSON it left in OUT or None). ``AIOUBLK_GUEST_ACCEL`` picks the
    accelerator unless `accel` does, as for the tests (tcg where a KVM probe passes
    but guests fail); `shared` folders are writable in the guest too, and
    `qemu_opts` go to QEMU."""
    from aioublk.testing.guest import default_accel, run_in_guest

    peer: list[str] = []
    if kublk:
        from tools.kublk import ensure_kublk

        peer = [str(ensure_kublk())]
    with tempfile.TemporaryDirectory(dir=Path.home() / ".cache") as rw:
        out = Path(rw) / "result.json"
        argv = [sys.executable, "-m", module, *args, "--inner", *peer, *inner, str(out)]
        if here and Path("/dev/ublk-control").exists():
            code = subprocess.run(argv, cwd=ROOT).returncode
        else:
            code = run_in_guest(argv, [rw, *shared], memory=memory, cpus=cpus,
                                timeout=timeout, cwd=ROOT, accel=accel or default_accel(),
                                qemu_opts=qemu_opts)
        if not out.exists():
            print(f"benchmark failed (exit {code}), no results", file=sys.stderr)
            return code, None
        return code, load(out)


# -- numbers ------------------------------------------------------------------------------


def record(runs: list[dict[str, Any]], start: float, rnd: int, what: str,
           iops: float | None, err: str | None, **fields: object) -> None:
    """Keep one fio run's result (``fields`` say which row and server) and
    print its progress line, so a long run shows how far it got."""
    runs.append({"round": rnd, **fields, "iops": iops, "error": err})
    shown = f"{iops:,.0f} IOPS" if iops is not None else f"ERROR {err}"
    print(f"[{time.monotonic() - start:4.0f} s] round {rnd}: {what} {shown}", flush=True)


def command(data: Mapping[str, Any], name: str) -> str:
    """The command a report names: the run's own, else the one its settings
    give (results written before runs kept their command)."""
    return str(data.get("command") or shlex.join(
        [".venv/bin/python", "-m", f"bench.{name}", f"--runtime={data['runtime']}",
         f"--rounds={data['rounds']}", *(["--quick"] if data["quick"] else [])]))


def median(records: Iterable[Mapping[str, Any]], value: str = "iops", /,
           **match: object) -> float | None:
    """The median of `value` over the records whose fields equal `match` (records
    without a number, failed runs, are left out)."""
    values = [float(x[value]) for x in records
              if x.get(value) is not None and all(x.get(k) == v for k, v in match.items())]
    return statistics.median(values) if values else None


def paired_ratios(records: Iterable[Mapping[str, Any]], num: Mapping[str, object],
                  den: Mapping[str, object], value: str = "iops") -> list[float]:
    """Each round's num / den (each a field match), in round order: both ran minutes
    apart there, so drift between rounds cancels out."""
    by_round: dict[Any, dict[str, float]] = {}
    for x in records:
        if x.get(value) is None:
            continue
        for side, match in (("num", num), ("den", den)):
            if all(x.get(k) == v for k, v in match.items()):
                by_round.setdefault(x["round"], {})[side] = float(x[value])
    return [r["num"] / r["den"] for _, r in sorted(by_round.items())
            if r.get("den") and "num" in r]


def paired(records: Iterable[Mapping[str, Any]], num: Mapping[str, object],
           den: Mapping[str, object], value: str = "iops") -> float | None:
    """The median over rounds of num / den within one round (``paired_ratios``)."""
    ratios = paired_ratios(records, num, den, value)
    return statistics.median(ratios) if ratios else None


class AgainstBest(NamedTuple):
    """One row of ours against the peer's best setting in each round."""

    peer: float | None  # the median over rounds of the peer's best
    ours: float | None  # the median of ours (of our best setting, where we have several)
    ratios: list[float]  # each round's ours / the peer's best, in round order
    settings: str  # the peer's settings that were its best, joined by " / ", or "—"
    our_settings: str = "—"  # ours that were our best, the same way


def against_best(records: Iterable[Mapping[str, Any]], ours: str | Mapping[str, str],
                 settings: Mapping[str, str], **match: object) -> AgainstBest:
    """Server ``ours`` against the peer's best setting in each round, on the row
    ``match`` names; ``settings`` maps each of the peer's server names to its label.
    ``ours`` may map several server names to labels too: then each round pairs our
    best with the peer's best, so neither side gains by having more settings."""
    mine_settings = {ours: ours} if isinstance(ours, str) else ours
    best: dict[Any, tuple[float, str]] = {}
    mine: dict[Any, tuple[float, str]] = {}
    for x in records:
        if x.get("iops") is None or any(x.get(k) != v for k, v in match.items()):
            continue
        got, server = float(x["iops"]), str(x.get("server"))
        side, label = ((mine, mine_settings[server]) if server in mine_settings
                       else (best, settings.get(server)))
        if label is not None and (x["round"] not in side or got > side[x["round"]][0]):
            side[x["round"]] = (got, label)
    return AgainstBest(
        statistics.median(v for v, _ in best.values()) if best else None,
        statistics.median(v for v, _ in mine.values()) if mine else None,
        [mine[r][0] / best[r][0] for r in sorted(mine) if r in best and best[r][0]],
        " / ".join(sorted({n for _, n in best.values()})) or "—",
        " / ".join(sorted({n for _, n in mine.values()})) or "—")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def met(value: float | None, target: float) -> str:
    return "—" if value is None else ("yes" if value >= target else "no")


def fmt(v: float | None, spec: str = ",.0f") -> str:
    return "—" if v is None else format(v, spec)


# -- the report ---------------------------------------------------------------------------


def table(head: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines; `align` has an ``l`` or ``r`` per column."""
    rule = {"l": "---", "r": "---:"}
    return ["| " + " | ".join(head) + " |",
            "| " + " | ".join(rule[a] for a in align) + " |",
            *("|" + "|".join(f" {c} " if str(c) else " " for c in row) + "|" for row in rows)]


def setup_line(data: Mapping[str, Any]) -> str:
    """Where a guest bench ran, the first words of its report."""
    return ("One guest run: QEMU TCG software emulation (no KVM), 4 GiB RAM" if data["guest"]
            else "One run on the host")


def notes(data: Mapping[str, Any], quick: str) -> list[str]:
    """A report's paragraphs on the loop file, a --quick run (`quick`: what it ran), an
    early stop."""
    lines = []
    backing = data.get("backing")
    if isinstance(backing, dict):
        o_direct = "accepted" if backing["o_direct"] else "refused"
        lines += ["", f"The loop target's backing file is 1 GiB at `{backing['path']}` "
                      f"({backing['fs']}, O_DIRECT {o_direct}), preallocated, shared by both "
                      "servers."]
    if data.get("quick"):
        lines += ["", f"**Smoke run (`--quick`)**: {quick}; not a measurement."]
    if not data.get("complete"):
        lines += ["", "**Incomplete**: the guest run stopped early; rows below are what it "
                      "finished."]
    return lines


def errors_section(errors: Mapping[str, str], each: str) -> list[str]:
    """The first error of each `each`, verbatim."""
    if not errors:
        return []
    return ["", "## Errors", "", "— in a table means the server produced no number; "
            f"the first error of each {each}, verbatim:", "",
            *(f"- {where}: `{e}`" for where, e in errors.items())]


def spread(ratios: Sequence[float]) -> str:
    """Per-round ratios as a table cell: "median (min – max)", or — for none."""
    if not ratios:
        return "—"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f} – {max(ratios):.2f})"


def footer(errors: Mapping[str, str], each: str, chart: str, command: str) -> list[str]:
    """A guest bench's last lines: its errors, chart, command."""
    return errors_section(errors, each) + [
        "", f"Chart: `{chart}`. Reproduce: `{command}` from the repository root "
        "(boots the guest when the host has no ublk_drv; builds kublk from "
        "Debian sid's linux-source).", ""]


# -- charts (matplotlib: pip install -e '.[bench]') -------------------------------------


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ratio_bars(path: Path, bars: Sequence[tuple[str, float | None, float | None]],
               ylabel: str, title: str, *, height: float = 5.0,
               split: int | None = None, labels: int = 8) -> None:
    """One bar per (label, value, target): the target drawn across its bar, green when
    met (or no target), red when not."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(bars) + 2), height))
    top = 1.2
    for i, (_, value, target) in enumerate(bars):
        ok = target is None or (value is not None and value >= target)
        ax.bar(i, value or 0, 0.6, color="tab:green" if ok else "tab:red", alpha=0.8)
        if target is not None:
            ax.hlines(target, i - 0.4, i + 0.4, color="black", linewidth=2)
        ax.annotate("n/a" if value is None else f"{value:.2f}", (i, value or 0),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8)
        top = max(top, (value or 0) + 0.2)
    if split is not None and 0 < split < len(bars):
        ax.axvline(split - 0.5, color="grey", linewidth=1, linestyle=":")
    ax.set_xticks(range(len(bars)), [label for label, _, _ in bars], rotation=30, ha="right",
                  fontsize=labels)
    ax.set_ylim(0, top)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def grouped_bars(path: Path, groups: Sequence[str], series: Sequence[str],
                 values: Mapping[tuple[str, str], float | None], ylabel: str, title: str, *,
                 lines: Sequence[tuple[float, str, str]] = ((1.0, "black", "-"),),
                 height: float = 5.0, per_group: float = 1.3, fontsize: int = 8,
                 legend: Mapping[str, Any] | None = None) -> None:
    """Grouped bars: one group per `groups`, one bar per `series`, heights
    ``values[(group, series)]``; `lines`: (y, colour, style) drawn across."""
    plt = pyplot()
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(7, per_group * len(groups) + 2), height))
    top = 1.1
    for i, name in enumerate(series):
        xs = [j - 0.4 + width * (i + 0.5) for j in range(len(groups))]
        ys = [values.get((g, name)) for g in groups]
        bars = ax.bar(xs, [y or 0 for y in ys], width, label=name)
        for bar, y in zip(bars, ys, strict=True):
            ax.annotate("n/a" if y is None else f"{y:.2f}",
                        (bar.get_x() + bar.get_width() / 2, y or 0), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7,
                        rotation=90 if len(series) > 4 else 0)
            top = max(top, (y or 0) + 0.25)
    for y, colour, style in lines:
        ax.axhline(y, color=colour, linewidth=1, linestyle=style)
    ax.set_xticks(range(len(groups)), groups, fontsize=fontsize)
    ax.set_ylim(0, top)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(**({"fontsize": 8} | dict(legend or {})))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# -- the results files --------------------------------------------------------------------


def publish(name: str, data: Data, text: str,
            plot: Callable[[Data, Path], None] | None = None, code: int = 0,
            out: Path = RESULTS, ok: bool = True) -> int:
    """Write OUT/NAME.json, .md (`text`, also printed) and .png (`plot`, when matplotlib
    is there); main's exit status: 1 unless `code` is 0 and the run `ok`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{name}.md").write_text(text)
    print(text)
    if plot is not None:
        try:
            plot(data, out / f"{name}.png")
        except ImportError:
            print("no chart: matplotlib missing (pip install -e '.[bench]')", file=sys.stderr)
    if code != 0 or not ok:
        print(f"benchmark incomplete (exit {code})", file=sys.stderr)
        return 1
    return 0


def serve_main(name: str, ns: argparse.Namespace, cpus: int, extra: Sequence[str],
               inner: Callable[[int, int], None], report: Callable[[Data, str], str],
               plot: Callable[[Data, Path], None], timeout: Callable[[int, int], float]) -> int:
    """The rest of main for a bench with its own ``--cpus`` (default `cpus`) and `extra`
    options passed to the guest: render a run's report again (``--report``), run
    inside the guest (``--inner``: ``inner(runtime, rounds)``), or boot the guest
    (no kublk) and publish what it wrote. ``--quick`` means one round of 2 s runs
    unless told; ``timeout(rounds, runtime)`` bounds the guest run."""
    runtime = ns.runtime or (2 if ns.quick else 5)
    rounds = 1 if ns.quick and ns.rounds == 3 else ns.rounds
    if ns.report:
        saved = load(ns.report)
        return publish(name, saved, report(saved, command(saved, name)), plot, out=ns.out)
    if ns.inner:
        inner(runtime, rounds)
        return 0
    options = [f"--runtime={runtime}", f"--rounds={rounds}", *extra,
               *(["--quick"] if ns.quick else [])]
    shown = [*options, *([f"--cpus={ns.cpus}"] if ns.cpus != cpus else [])]
    code, got = run_guest(f"bench.{name}", options, timeout(rounds, runtime), cpus=ns.cpus,
                          kublk=False)
    if got is None:
        return 1
    got["command"] = " ".join([".venv/bin/python", "-m", f"bench.{name}", *shown])
    return publish(name, got, report(got, command(got, name)), plot, code, ns.out)


def guest_main(name: str, doc: str | None, argv: list[str] | None, *, rounds: int,
               quick: str, inner: Callable[[int, int, bool, Path], None],
               report: Callable[[Data, str], str], plot: Callable[[Data, Path], None],
               timeout: Callable[[int, bool, int], float], runtime: int = 5) -> int:
    """A fio bench's whole command: render a run's report again (``--report``),
    run inside the guest (``--inner``: its kublk is unused), or boot the guest
    to run there and publish what it wrote. ``timeout(rounds, quick, runtime)``
    bounds the guest run."""
    ns = parser(doc, runtime=runtime, rounds=rounds, quick=quick).parse_args(argv)
    seconds = ns.runtime or (2 if ns.quick else runtime)
    if ns.report:
        saved = load(ns.report)
        return publish(name, saved, report(saved, command(saved, name)), plot, out=ns.out)
    if ns.inner:
        inner(seconds, ns.rounds, ns.quick, Path(ns.inner[1]))
        return 0
    options = [f"--runtime={seconds}", f"--rounds={ns.rounds}",
               *(["--quick"] if ns.quick else [])]
    code, data = run_guest(f"bench.{name}", options,
                           timeout=timeout(ns.rounds, ns.quick, seconds))
    if data is None:
        return 1
    return publish(name, data, report(data, command(data, name)), plot, code, ns.out)
