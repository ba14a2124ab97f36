"""Suites we did not write, run against aioublk beside kublk: the kernel's ublk
selftests (``selftests``), file systems under Debian's workload tools (``fs``) and
file-system durability under power cuts (``powercut``).

Each is one command, ``python -m bench.suites NAME``, that boots the guest, runs
there and writes ``bench/results/NAME.json``, ``.md`` and ``.png`` beside the other
benchmarks' results. A suite's record per test says which server ran it, its
outcome (``pass``, ``fail`` or ``skip``) and why."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: the outcomes a record may have, in the order tables show them
OUTCOMES = ("pass", "fail", "skip")


def counts(records: Iterable[Mapping[str, Any]], server: str) -> dict[str, int]:
    """How many of `server`'s records ended each way."""
    got = dict.fromkeys(OUTCOMES, 0)
    for r in records:
        if r["server"] == server:
            got[r["result"]] += 1
    return got


def side_by_side(records: Sequence[Mapping[str, Any]], servers: Sequence[str],
                 key: str = "test") -> list[tuple[str, dict[str, Mapping[str, Any]]]]:
    """Rows of (test, {server: its record}) in the order tests first appear."""
    rows: dict[str, dict[str, Mapping[str, Any]]] = {}
    for r in records:
        if r["server"] in servers:
            rows.setdefault(r[key], {})[r["server"]] = r
    return list(rows.items())
