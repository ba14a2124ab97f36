"""Serving statistics, for ``list --stats`` and ``serve``'s stats log; and
the records of how ``add`` created each device, for ``recover -n ID`` and
``list``.

A server writes each device's per-queue counters (``Device.stats``) to
``/run/aioublk/ID.json`` once a second, with its pid so that a file left by
a dead server is never shown as current; ``list --stats`` prints them under
kublk's lines. With ``stats_interval`` (serve) the rates are also logged.

A server started by ``add`` also writes ``ID.add.json`` once the device is
live (its target, files and options, as rublk records them): ``recover -n
ID`` alone takes them again, ``list`` shows the target. It stays while the
device waits QUIESCED for a new server, and goes when the device is deleted.
A server asked to commit a device's cow overlay (``commit -n ID``, a
SIGUSR1) writes what it did to ``ID.commit.json``.

Servers run as root, so the directory is a place where a planted symlink
would make root write a file of someone else's choosing. It is used only if
it is a real directory, ours, and writable by nobody else (made 0755 whatever
the umask); everything in it is reached through the directory's descriptor,
a file is written under a temporary name opened with ``O_EXCL|O_NOFOLLOW``
and renamed into place (a rename replaces a symlink, never follows it), and
is read with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aioublk.errors import Error

if TYPE_CHECKING:
    from aioublk.device import Device


def _log() -> Any:
    """The module's logger, imported when first needed: ``list`` and ``del``
    read and remove records without structlog."""
    from aioublk import logs

    return logs.get_logger("aioublk.stats")

def _default_run_dir() -> str:
    """/run/aioublk for root; a user (serving unprivileged devices) cannot
    write there, so theirs is under their runtime directory, or /tmp."""
    uid = os.geteuid()
    if uid == 0:
        return "/run/aioublk"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return f"{runtime}/aioublk" if runtime else f"/tmp/aioublk-{uid}"


#: (a str, not a Path: ``list`` and ``del`` read it without importing pathlib)
RUN_DIR = os.environ.get("AIOUBLK_RUN_DIR") or _default_run_dir()


DIR_MODE = 0o755
FILE_MODE = 0o644


class RunDirError(Error, OSError):
    """``RUN_DIR`` is not safe to write in, in one line saying what to do."""


def _name(dev_id: int) -> str:
    return f"{dev_id}.json"


def _commit_name(dev_id: int) -> str:
    return f"{dev_id}.commit.json"


def _record_name(dev_id: int) -> str:
    return f"{dev_id}.add.json"


def open_run_dir(*, create: bool) -> int:
    """A descriptor of ``RUN_DIR``, made 0755 if it is missing (and
    ``create``); raises RunDirError if it is a symlink, not a directory, not
    ours, or writable by others."""
    d = RUN_DIR
    if create:
        os.makedirs(os.path.dirname(os.path.abspath(d)), exist_ok=True)
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            pass
    if os.path.islink(d):
        raise RunDirError(f"{d} is a symlink: remove it (rm {d})")
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            raise RunDirError(f"{d} is not a directory: remove it (rm {d})") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise RunDirError(f"{d} is owned by uid {st.st_uid}, not by us "
                              f"(uid {os.geteuid()}): remove it (rm -r {d})")
        if st.st_mode & 0o022:
            raise RunDirError(f"{d} is writable by others (mode "
                              f"{stat.S_IMODE(st.st_mode):o}): chmod go-w {d}")
        if create and stat.S_IMODE(st.st_mode) != DIR_MODE:
            os.fchmod(fd, DIR_MODE)  # made under a restrictive umask
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write(dfd: int, name: str, content: dict[str, Any]) -> None:
    """Replace ``name`` with ``content`` and this server's pid (whose file it is)."""
    import json

    data = json.dumps({"pid": os.getpid(), "time": time.time(), **content}).encode()
    tmp = f".{name}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, FILE_MODE, dir_fd=dfd)
    except FileExistsError:  # left by a dead server that had our pid
        os.unlink(tmp, dir_fd=dfd)
        fd = os.open(tmp, flags, FILE_MODE, dir_fd=dfd)
    try:
        try:
            os.fchmod(fd, FILE_MODE)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        # readers never see half a file
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise


def _read(name: str) -> dict[str, Any] | None:
    """The file ``name``'s content, or None if there is none (or no safe directory)."""
    try:
        dfd = open_run_dir(create=False)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
        import json  # (here: a ``list`` of devices no aioublk server recorded needs none)

        data = json.loads(raw)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read(dev_id: int, pid: int) -> list[dict[str, int]] | None:
    """The queues' counters published by server ``pid``, or None."""
    got = read_at(dev_id, pid)
    return None if got is None else got[1]


def read_at(dev_id: int, pid: int) -> tuple[float, list[dict[str, int]]] | None:
    """When server ``pid`` published its queues' counters (``time.time()``),
    and the counters; None if it did not."""
    data = _read(_name(dev_id))
    if data is None or data.get("pid") != pid:
        return None
    queues: list[dict[str, int]] = data["queues"]
    return float(data.get("time", 0)), queues


def write_record(dev_id: int, record: dict[str, Any]) -> None:
    """Record how device ``dev_id`` was added (by this server: its pid is
    kept); a failure is logged, the device served all the same."""
    _save(dev_id, _record_name(dev_id), record, "cannot record the device's options")


def write_commit(dev_id: int, result: dict[str, Any]) -> None:
    """What a commit of device ``dev_id``'s overlay did (``blocks``, or
    ``error``), for the ``commit`` command that asked (it knows our pid)."""
    _save(dev_id, _commit_name(dev_id), result, "cannot tell the commit's result")


def read_commit(dev_id: int, pid: int) -> dict[str, Any] | None:
    """The last commit result server ``pid`` wrote for ``dev_id``, with its
    ``time``; None if it wrote none."""
    data = _read(_commit_name(dev_id))
    return data if data is not None and data.get("pid") == pid else None


def _save(dev_id: int, name: str, content: dict[str, Any], failed: str) -> None:
    try:
        dfd = open_run_dir(create=True)
        try:
            _write(dfd, name, content)
        finally:
            os.close(dfd)
    except OSError as e:
        _log().warning(failed, dev=dev_id, dir=str(RUN_DIR), error=str(e))


def read_record(dev_id: int) -> dict[str, Any] | None:
    """How device ``dev_id`` was added, with the pid of the server that
    wrote it; None if no aioublk server recorded it."""
    record = _read(_record_name(dev_id))
    if record is None or not isinstance(record.get("options"), dict):
        return None
    return record


def remove_record(dev_id: int) -> str | None:
    """Forget device ``dev_id`` (deleted: its id may be given to another);
    why it could not be, for the caller to tell (None if it was, or there
    was none)."""
    try:
        dfd = open_run_dir(create=False)
    except OSError:
        return None
    try:
        for name in (_record_name(dev_id), _commit_name(dev_id)):
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
    except OSError as e:
        return f"cannot remove device {dev_id}'s record in {RUN_DIR}: {e.strerror}"
    finally:
        os.close(dfd)
    return None


def c_share(row: dict[str, int]) -> float | None:
    """The share of a queue's requests the C data plane served, fetch to
    commit (None before any request, or from a server that did not count)."""
    done = row.get("c_served", 0) + row.get("py_handed", 0)
    return row.get("c_served", 0) / done if done else None


def lines(rows: list[dict[str, int]]) -> list[str]:
    """``list --stats``: one line per queue, after kublk's queue lines; the
    data plane's counters at its end when the server published them."""
    out = []
    for r in rows:
        line = (f"\tqueue {r['queue']} stats: ios {r['ios']} bytes {r['bytes']} "
                f"errors {r['errors']} inflight {r['inflight']}")
        if "wakes" in r:
            share = c_share(r)
            line += (f" c_share {'-' if share is None else f'{share:.3f}'} "
                     f"wakes {r['wakes']} poll_timeouts {r['poll_timeouts']}")
        out.append(line)
    return out


def json_rows(rows: list[dict[str, int]]) -> list[dict[str, Any]]:
    """``list --stats --json``: the published counters and each queue's ``c_share``."""
    return [r | {"c_share": c_share(r)} if "c_served" in r else dict(r) for r in rows]


async def publish(devices: Callable[[], list[Device]], log_every: float = 0,
                  period: float = 1.0) -> None:
    """Until cancelled: publish every second; log rates every ``log_every``
    seconds (0: never). Removes the files when cancelled."""
    import asyncio

    log = _log()
    try:
        dfd = open_run_dir(create=True)
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
                    os.unlink(_name(gone), dir_fd=dfd)
            for dev in current:
                if dev.info is None:
                    continue
                taken = time.time()  # before the counters: a reader's "after" holds
                rows = dev.stats()
                try:
                    _write(dfd, _name(dev.id), {"time": taken, "queues": rows})
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
                os.unlink(_name(dev_id), dir_fd=dfd)
        os.close(dfd)


def _log_rates(dev_id: int, rows: list[dict[str, int]],
               before: tuple[float, list[dict[str, int]]] | None, now: float) -> None:
    then, old = before if before is not None else (now, [])
    prev = {r["queue"]: r for r in old}
    span = max(now - then, 1e-9)
    for r in rows:
        p = prev.get(r["queue"], dict.fromkeys(r, 0))
        _log().info("stats", dev=dev_id, queue=r["queue"],
                 iops=round((r["ios"] - p["ios"]) / span) if before else 0,
                 mib_s=round((r["bytes"] - p["bytes"]) / span / (1 << 20), 1) if before else 0,
                 inflight=r["inflight"], errors=r["errors"], ios=r["ios"])
