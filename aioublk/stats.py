"""Serving statistics, for ``list --stats`` and ``serve``'s stats log.

A server writes each device's per-queue counters (``Device.stats``) to
``/run/aioublk/ID.json`` once a second, with its pid so that a file left by
a dead server is never shown as current; ``list --stats`` prints them under
kublk's lines. With ``stats_interval`` (serve) the rates are also logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from aioublk.device import Device

log = structlog.get_logger("aioublk.stats")

RUN_DIR = Path(os.environ.get("AIOUBLK_RUN_DIR", "/run/aioublk"))


def stats_path(dev_id: int) -> Path:
    return RUN_DIR / f"{dev_id}.json"


def _write(dev_id: int, rows: list[dict[str, int]]) -> None:
    path = stats_path(dev_id)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "time": time.time(), "queues": rows}))
    tmp.replace(path)  # readers never see half a file


def read(dev_id: int, pid: int) -> list[dict[str, int]] | None:
    """The queues' counters published by server ``pid``, or None."""
    try:
        data: dict[str, Any] = json.loads(stats_path(dev_id).read_text())
    except (OSError, ValueError):
        return None
    if data.get("pid") != pid:
        return None
    queues: list[dict[str, int]] = data["queues"]
    return queues


def lines(rows: list[dict[str, int]]) -> list[str]:
    """``list --stats``: one line per queue, after kublk's queue lines."""
    return [f"\tqueue {r['queue']} stats: ios {r['ios']} bytes {r['bytes']} "
            f"errors {r['errors']} inflight {r['inflight']}" for r in rows]


async def publish(devices: Callable[[], list[Device]], log_every: float = 0,
                  period: float = 1.0) -> None:
    """Until cancelled: publish every second; log rates every ``log_every``
    seconds (0: never). Removes the files when cancelled."""
    try:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("cannot publish stats", dir=str(RUN_DIR), error=str(e))
        return
    loop = asyncio.get_running_loop()
    published: set[int] = set()
    last: dict[int, tuple[float, list[dict[str, int]]]] = {}
    next_log = loop.time() + log_every
    try:
        while True:
            now = loop.time()
            due = log_every > 0 and now >= next_log
            current = devices()
            for gone in published - {d.id for d in current if d.info is not None}:
                published.discard(gone)  # released: its counters are history
                with contextlib.suppress(OSError):
                    stats_path(gone).unlink()
            for dev in current:
                if dev.info is None:
                    continue
                rows = dev.stats()
                try:
                    _write(dev.id, rows)
                    published.add(dev.id)
                except OSError as e:
                    log.warning("cannot publish stats", dev=dev.id, error=str(e))
                if due:
                    _log_rates(dev.id, rows, last.get(dev.id), now)
                    last[dev.id] = (now, rows)
            if due:
                next_log = now + log_every
            await asyncio.sleep(period)
    finally:
        for dev_id in published:
            with contextlib.suppress(OSError):
                stats_path(dev_id).unlink()


def _log_rates(dev_id: int, rows: list[dict[str, int]],
               before: tuple[float, list[dict[str, int]]] | None, now: float) -> None:
    then, old = before if before is not None else (now, [])
    prev = {r["queue"]: r for r in old}
    span = max(now - then, 1e-9)
    for r in rows:
        p = prev.get(r["queue"], dict.fromkeys(r, 0))
        log.info("stats", dev=dev_id, queue=r["queue"],
                 iops=round((r["ios"] - p["ios"]) / span) if before else 0,
                 mib_s=round((r["bytes"] - p["bytes"]) / span / (1 << 20), 1) if before else 0,
                 inflight=r["inflight"], errors=r["errors"], ios=r["ios"])
