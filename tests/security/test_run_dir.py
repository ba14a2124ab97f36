"""``/run/aioublk`` and the daemon (host, no kernel): the stats directory is
ours and 0755 whatever the umask, a planted symlink is never followed, and
``add``'s daemon runs in ``/`` with umask 022."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from aioublk.frontend import stats

ROWS = [{"queue": 0, "ios": 1, "bytes": 512, "errors": 0, "inflight": 0}]


class FakeDevice:
    """What ``stats.publish`` reads of a Device."""

    def __init__(self, dev_id: int) -> None:
        self.id = dev_id
        self.info = object()

    def stats(self) -> list[dict[str, int]]:
        return ROWS


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "run" / "aioublk"
    monkeypatch.setattr(stats, "RUN_DIR", d)
    return d


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def publish_once(dev_id: int = 0) -> tuple[list[Any], dict[str, Any] | None]:
    """Run the publisher for one round; return its log lines and what
    ``list --stats`` would have read while it ran."""
    seen: dict[str, Any] | None = None

    async def main() -> None:
        nonlocal seen
        task = asyncio.ensure_future(stats.publish(
            lambda: [FakeDevice(dev_id)], period=0.01))  # type: ignore[list-item]
        await asyncio.sleep(0.05)
        rows = stats.read(dev_id, os.getpid())
        seen = {"queues": rows} if rows is not None else None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with capture_logs() as logs:
        asyncio.run(main())
    return logs, seen


@pytest.mark.parametrize("mask", [0o000, 0o077, 0o022])
def test_modes_whatever_the_umask(run_dir: Path, mask: int, tmp_path: Path) -> None:
    written: dict[str, int] = {}
    real_rename = os.rename

    def spy(src: Any, dst: Any, **kw: Any) -> None:  # the file, as it is renamed into place
        written[str(dst)] = os.stat(src, dir_fd=kw.get("src_dir_fd")).st_mode
        real_rename(src, dst, **kw)

    with umask(mask), pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "rename", spy)
        mp.setattr(os, "replace", spy)
        logs, seen = publish_once()
    assert seen == {"queues": ROWS}, logs
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o755
    assert written, "no stats file was written"
    assert {stat.S_IMODE(m) for m in written.values()} == {0o644}


def test_symlink_at_the_stats_file_is_not_followed(run_dir: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("precious")
    run_dir.mkdir(parents=True, mode=0o755)
    # every name a server of this pid might write through
    for name in ("0.json", "0.tmp", f".0.{os.getpid()}.tmp", f"0.json.{os.getpid()}.tmp",
                 f".0.json.{os.getpid()}.tmp"):
        (run_dir / name).symlink_to(secret)
    logs, seen = publish_once()
    assert secret.read_text() == "precious"
    assert seen == {"queues": ROWS}, logs


def test_symlinked_directory_is_refused(run_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    run_dir.parent.mkdir()
    run_dir.symlink_to(elsewhere)
    logs, seen = publish_once()
    assert list(elsewhere.iterdir()) == []
    assert seen is None
    assert [e["event"] for e in logs] == ["cannot publish stats"]
    assert "symlink" in logs[0]["error"], logs


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_directory_writable_by_others_is_refused(run_dir: Path, mode: int) -> None:
    run_dir.mkdir(parents=True)
    run_dir.chmod(mode)
    logs, seen = publish_once()
    assert list(run_dir.iterdir()) == []
    assert seen is None
    assert [e["event"] for e in logs] == ["cannot publish stats"]
    assert "writable by others" in logs[0]["error"] and "chmod" in logs[0]["error"], logs


def test_directory_owned_by_another_user_is_refused(run_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir.mkdir(parents=True, mode=0o755)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(run_dir).st_uid + 1)
    logs, seen = publish_once()
    assert list(run_dir.iterdir()) == []
    assert [e["event"] for e in logs] == ["cannot publish stats"]
    assert "owned by uid" in logs[0]["error"], logs


def test_read_does_not_follow_a_symlink(run_dir: Path, tmp_path: Path) -> None:
    fake = tmp_path / "fake.json"
    fake.write_text(json.dumps({"pid": 1234, "queues": ROWS}))
    run_dir.mkdir(parents=True, mode=0o755)
    (run_dir / "0.json").symlink_to(fake)
    assert stats.read(0, 1234) is None


def test_list_stats_adds_the_c_share_after_the_counters_it_always_showed() -> None:
    """A server that counts who served prints the C share, wakes and poll
    timeouts after the line's usual fields; an older server's line is as it was."""
    old = ROWS[0]
    new = old | {"c_served": 3, "py_handed": 1, "wakes": 2, "poll_timeouts": 1}
    idle = new | {"c_served": 0, "py_handed": 0}
    assert stats.lines([old]) == ["\tqueue 0 stats: ios 1 bytes 512 errors 0 inflight 0"]
    assert stats.lines([new, idle]) == [
        "\tqueue 0 stats: ios 1 bytes 512 errors 0 inflight 0 c_share 0.750 wakes 2 "
        "poll_timeouts 1",
        "\tqueue 0 stats: ios 1 bytes 512 errors 0 inflight 0 c_share - wakes 2 "
        "poll_timeouts 1"]
    assert stats.json_rows([old, new, idle]) == [
        old, new | {"c_share": 0.75}, idle | {"c_share": None}]


def test_read_at_says_when_the_counters_were_published(run_dir: Path) -> None:
    """``list --json`` shows how fresh the counters are (a bench waits for a
    publish after its run before it takes their deltas)."""
    before = time.time()
    dfd = stats.open_run_dir(create=True)
    try:
        stats._write(dfd, "0.json", {"queues": ROWS})
    finally:
        os.close(dfd)
    got = stats.read_at(0, os.getpid())
    assert got is not None and before <= got[0] <= time.time() and got[1] == ROWS
    assert stats.read_at(0, os.getpid() + 1) is None  # another server's



def test_the_publication_time_is_taken_before_the_counters(run_dir: Path) -> None:
    """A reader that waits for a publication stamped after its run ended
    must see every request of the run: a stamp taken after reading the
    counters (a slow write under emulation) let one request go missing."""
    read_at: list[float] = []

    class Slow(FakeDevice):
        def stats(self) -> list[dict[str, int]]:
            read_at.append(time.time())
            time.sleep(0.02)  # (the time the publisher takes between the two)
            return ROWS

    got: tuple[float, list[dict[str, int]]] | None = None

    async def main() -> None:
        nonlocal got
        task = asyncio.ensure_future(stats.publish(
            lambda: [Slow(0)], period=0.01))  # type: ignore[list-item]
        while got is None:
            await asyncio.sleep(0.005)  # (polls the condition: a publication)
            got = stats.read_at(0, os.getpid())
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert got is not None
    # stamped before its counters were read, not 20 ms after
    assert any(0 <= r - got[0] < 0.015 for r in read_at), (got[0], read_at)


DAEMON = """
import os, sys
from aioublk.frontend import daemon
os.umask(0o077)
os.chdir(sys.argv[1])
def serve(wfd: int) -> int:
    os.write(wfd, f"{os.getcwd()} {os.umask(0):o} {os.getsid(0) == os.getpid()}\\n".encode())
    return 0
rfd, pid = daemon.daemonize(serve)
os.waitpid(pid, 0)
with os.fdopen(rfd, "rb") as r:
    print(r.readline().decode().strip())
"""


def test_daemon_runs_in_root_with_umask_022(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-c", DAEMON, str(tmp_path)], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["/", "22", "False"], p.stdout
