"""User recovery, quiesce, stop --safe, update_size and the fault_inject
target against the real driver.

Servers are ``aioublk add|recover ... --foreground`` forked from this
process (``kernel.start_server``): the CLI's code without a fresh
interpreter per start, which the emulated guest makes cost seconds.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from aioublk.frontend import cli as cli_mod
from aioublk.frontend import stats
from aioublk.io import locking
from tests.support import kernel
from tests.support.kernel import delete, start_server

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]


def state(dev_id: int) -> str:
    return next(d.state for d in kernel.listing() if d.dev_id == dev_id)


def wait_state(dev_id: int, want: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (got := state(dev_id)) != want:
        assert time.monotonic() < deadline, f"device {dev_id} is {got}, not {want}"
        time.sleep(0.1)


def reap(pid: int, timeout: float = 30) -> int:
    """The exit status of a forked server (negative: killed by that signal)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        assert time.monotonic() < deadline, f"server {pid} did not exit"
        time.sleep(0.05)


def reads_done(dev_id: int) -> int:
    return int(Path(f"/sys/block/ublkb{dev_id}/stat").read_text().split()[0])


def writes_done(dev_id: int) -> int:
    return int(Path(f"/sys/block/ublkb{dev_id}/stat").read_text().split()[4])


def start_fio(dev_id: int, cwd: Path, runtime: int, *extra: str) -> subprocess.Popen[str]:
    """Random reads for ``runtime`` seconds, every error fatal unless
    ``extra`` says otherwise; returns once they are flowing."""
    before = reads_done(dev_id)
    p = subprocess.Popen(
        ["fio", "--name=r", f"--filename=/dev/ublkb{dev_id}", "--ioengine=io_uring",
         "--direct=1", "--rw=randread", "--bs=4k", "--iodepth=32", "--size=1G",
         "--time_based", f"--runtime={runtime}", "--output-format=json", *extra],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while reads_done(dev_id) < before + 1000:
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "fio did not start"
        time.sleep(0.1)
    return p


def fio_result(p: subprocess.Popen[str], timeout: float = 120,
               errors_ok: bool = False) -> dict[str, object]:
    out, err = p.communicate(timeout=timeout)
    assert errors_ok or p.returncode == 0, f"fio failed ({p.returncode}): {err.strip()}\n{out}"
    job: dict[str, object] = json.loads(out[out.index("{"):])["jobs"][0]
    assert errors_ok or job["error"] == 0, job
    return job


def start_fio_verify(dev_id: int, cwd: Path, size: int) -> subprocess.Popen[str]:
    """Random 4k writes over the first ``size`` bytes, each block carrying
    fio's crc32c verify header, at most 1500 a second; then fio reads every
    block back and checks it. Returns once a quarter of the writes are done."""
    before = writes_done(dev_id)
    p = subprocess.Popen(
        ["fio", "--name=v", f"--filename=/dev/ublkb{dev_id}", "--ioengine=io_uring",
         "--direct=1", "--rw=randwrite", "--bs=4k", "--iodepth=16", f"--size={size}",
         "--rate_iops=,1500", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1",
         "--output-format=json"],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60  # (an emulated guest on a busy host is slow)
    while (done := writes_done(dev_id) - before) < size // 4096 // 4:
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, f"fio wrote only {done} blocks in 60 s"
        time.sleep(0.05)
    return p


def in_process(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """A CLI command run by this process (same code as ``python -m aioublk``)."""
    code = cli_mod.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("how,args", [
    ("kill", ["-b", "-r", "1", "-i", "1"]),
    ("kill", ["--no-batch", "-r", "1", "-i", "1"]),
    ("sigterm", ["-b", "-r", "1", "-i", "1"]),
    ("quiesce", ["--no-batch", "-r", "1"]),
    # each queue's tags spread over 4 workers: some see no abort at all
    ("quiesce", ["--no-batch", "--nthreads", "4", "--per_io_tasks", "-r", "1"]),
], ids=["kill-batch-reissue", "kill-per_io-reissue", "sigterm-batch-reissue",
        "quiesce-per_io", "quiesce-per_io_tasks"])
def test_recover_under_fio(how: str, args: list[str], tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """The server goes away under random reads (killed, SIGTERM, or the
    ``quiesce`` command); the device waits QUIESCED; ``recover`` serves it
    again and fio finishes without a single error. (``quiesce`` on a batch
    device makes the kernel fail new I/O until recovery: see
    Device.quiesce.)"""
    add_args = ["-t", "null", "-q", "2", "-d", "32", *args]
    dev = start_server(add_args, tmp_path / "first.log")
    dev_id = dev.dev_id
    # long enough that the server is gone while fio still runs: a slow
    # guest spends seconds in the quiesce command alone
    fio = start_fio(dev_id, tmp_path, runtime=12)
    if how == "kill":
        os.kill(dev.pid, signal.SIGKILL)
        assert reap(dev.pid) == -signal.SIGKILL
    elif how == "sigterm":
        # a server with recovery hands its device over on SIGTERM (batch:
        # by detaching, see Device.quiesce)
        os.kill(dev.pid, signal.SIGTERM)
        assert reap(dev.pid) == 0, kernel.tail(tmp_path / "first.log")
    else:
        code, out, err = in_process("quiesce", "-n", str(dev_id), capsys=capsys)
        assert (code, out, err) == (0, "", "")
        # the server saw its commands cancelled, finished what it held, and left
        assert reap(dev.pid) == 0, kernel.tail(tmp_path / "first.log")
    wait_state(dev_id, "QUIESCED")
    stalled = reads_done(dev_id)
    time.sleep(0.5)
    assert reads_done(dev_id) == stalled, "I/O completed while no server was attached"
    assert fio.poll() is None, "fio ended before the server left: nothing waits for recovery"

    new = start_server(["-n", str(dev_id), *add_args], tmp_path / "second.log", cmd="recover")
    assert (new.dev_id, new.state) == (dev_id, "LIVE") and new.pid != dev.pid
    job = fio_result(fio)
    assert job["read"]["io_bytes"] > 0  # type: ignore[index]
    assert reads_done(dev_id) > stalled
    delete(dev_id)
    assert reap(new.pid) == 0


@pytest.mark.parametrize("target,how,path", [
    ("loop", "kill", "-b"),
    ("qcow2", "kill", "-b"),
    ("qcow2", "kill", "--no-batch"),
    ("loop", "sigterm", "-b"),
    ("qcow2", "sigterm", "-b"),
    ("qcow2", "sigterm", "--no-batch"),
])
def test_recovery_keeps_acknowledged_writes(target: str, how: str, path: str,
                                            tmp_path: Path) -> None:
    """fio writes 16 MiB at random with verify headers while the server is
    killed (-9) or hands the device over (SIGTERM: a batch device detaches,
    a per-I/O one quiesces); ``recover`` serves it again from the same file,
    fio finishes, then reads back and checks every block it wrote, those
    acknowledged before the kill included. qcow2 keeps its metadata in
    memory until a FLUSH (none comes from fio here): with user recovery it
    must write it through before a write completes."""
    size = 64 << 20
    if target == "qcow2":
        image = tmp_path / "disk.qcow2"
        kernel.run("qemu-img", "create", "-q", "-f", "qcow2", str(image), str(size))
    else:
        image = kernel.make_file(tmp_path / "disk.img", size)
    add_args = ["-t", target, "-q", "2", "-d", "32", path, "-r", "1", "-i", "1", str(image)]
    dev = start_server(add_args, tmp_path / "first.log")
    dev_id = dev.dev_id
    fio = start_fio_verify(dev_id, tmp_path, 16 << 20)
    if how == "kill":
        os.kill(dev.pid, signal.SIGKILL)
        assert reap(dev.pid) == -signal.SIGKILL
    else:
        os.kill(dev.pid, signal.SIGTERM)
        assert reap(dev.pid) == 0, kernel.tail(tmp_path / "first.log")
    wait_state(dev_id, "QUIESCED")
    new = start_server(["-n", str(dev_id), *add_args], tmp_path / "second.log", cmd="recover")
    job = fio_result(fio)
    assert job["write"]["io_bytes"] == 16 << 20, job["write"]  # type: ignore[index]
    assert job["read"]["io_bytes"] == 16 << 20, job["read"]  # type: ignore[index]
    delete(dev_id)
    assert reap(new.pid) == 0, kernel.tail(tmp_path / "second.log")
    if target == "qcow2":
        # clean, or (killed) clusters allocated and never referenced: leaks, never corruption
        p = subprocess.run(["qemu-img", "check", str(image)], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode in ((0, 3) if how == "kill" else (0,)), p.stdout + p.stderr


def test_recover_refuses_another_size_or_file(tmp_path: Path) -> None:
    """``recover`` with a backing file of another size, or another file of
    the same size: one line, and the device still waits for its own file.
    (A forked server: one that wrongly serves is killed, not waited for.)"""
    first = kernel.make_file(tmp_path / "a.img", 32 << 20)
    same_size = kernel.make_file(tmp_path / "b.img", 32 << 20)
    smaller = kernel.make_file(tmp_path / "c.img", 16 << 20)
    add_args = ["-t", "loop", "-q", "1", "-r", "1"]
    dev = start_server([*add_args, str(first)], tmp_path / "first.log")
    os.kill(dev.pid, signal.SIGKILL)
    assert reap(dev.pid) == -signal.SIGKILL
    wait_state(dev.dev_id, "QUIESCED")
    for other, message in (
            (smaller, f"device {dev.dev_id} has 33554432 bytes, the target 16777216"),
            (same_size, f"device {dev.dev_id} was added with another target type or backing "
                        f"file than loop {same_size}")):
        log = tmp_path / f"{other.name}.log"
        with pytest.raises(AssertionError, match="failed"):
            start_server(["-n", str(dev.dev_id), *add_args, str(other)], log, cmd="recover")
        # recover says first that the file given replaces the recorded one
        notice, *lines = log.read_text().splitlines()
        assert notice == f"aioublk: recover: {other} overrides the recorded {first}", notice
        assert len(lines) == 1 and lines[0].startswith("aioublk: ") and message in lines[0], lines
        assert state(dev.dev_id) == "QUIESCED"
    new = start_server(["-n", str(dev.dev_id), *add_args, str(first)], tmp_path / "second.log",
                       cmd="recover")
    assert new.state == "LIVE"
    delete(dev.dev_id)
    assert reap(new.pid) == 0


def test_without_reissue_held_requests_fail_and_batch_quiesce(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Batch I/O with ``-r 1`` alone. kill -9 under fio: only the requests
    the dead server held fail (EIO, at most a queue depth's worth per
    queue); the rest wait for ``recover``. Then the ``quiesce`` command on
    the batch device: the server finishes and exits, recover works again."""
    add_args = ["-t", "null", "-q", "2", "-d", "32", "-b", "-r", "1"]
    dev = start_server(add_args, tmp_path / "first.log")
    dev_id = dev.dev_id
    fio = start_fio(dev_id, tmp_path, 6, "--continue_on_error=io")
    os.kill(dev.pid, signal.SIGKILL)
    assert reap(dev.pid) == -signal.SIGKILL
    wait_state(dev_id, "QUIESCED")
    second = start_server(["-n", str(dev_id), *add_args], tmp_path / "second.log",
                          cmd="recover")
    job = fio_result(fio, errors_ok=True)
    assert job["read"]["io_bytes"] > 0  # type: ignore[index]
    failed = int(job["total_err"])  # type: ignore[call-overload]
    assert failed <= 2 * 32, job["total_err"]
    assert job["first_error"] in (0, 5), job["first_error"]  # none, or EIO

    # under load: the kernel leaves the fetch it is dispatching on armed
    fio = start_fio(dev_id, tmp_path, 6, "--continue_on_error=io")
    code, _out, err = in_process("quiesce", "-n", str(dev_id), capsys=capsys)
    assert code == 0 and "uses batch I/O" in err, err  # the warning, one line
    assert reap(second.pid) == 0, kernel.tail(tmp_path / "second.log")
    wait_state(dev_id, "QUIESCED")
    third = start_server(["-n", str(dev_id), *add_args], tmp_path / "third.log",
                         cmd="recover")
    fio_result(fio, errors_ok=True)
    kernel.run("dd", f"if=/dev/ublkb{dev_id}", "of=/dev/null", "bs=4k", "count=16",
               "iflag=direct")
    delete(dev_id)
    assert reap(third.pid) == 0


def test_fail_io_mode_fails_fast_then_recovers(tmp_path: Path) -> None:
    """``-e 1``: with the server dead the device is FAIL_IO and reads fail at
    once; ``recover`` makes it LIVE and reads work again."""
    add_args = ["-t", "null", "-q", "1", "-e", "1", "-v"]  # -v: a log line per request
    dev = start_server(add_args, tmp_path / "first.log")
    os.kill(dev.pid, signal.SIGKILL)
    assert reap(dev.pid) == -signal.SIGKILL
    wait_state(dev.dev_id, "FAIL_IO")
    path = f"/dev/ublkb{dev.dev_id}"
    p = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4k", "count=1",
                        "iflag=direct"], capture_output=True, text=True, timeout=30)
    # (the kernel fails them with BLK_STS_TARGET: EREMOTEIO)
    assert p.returncode != 0 and "error reading" in p.stderr, p.stderr
    new = start_server(["-n", str(dev.dev_id), *add_args], tmp_path / "second.log",
                       cmd="recover")
    assert new.state == "LIVE"
    kernel.run("dd", f"if={path}", "of=/dev/null", "bs=4k", "count=16", "iflag=direct")
    delete(dev.dev_id)
    assert reap(new.pid) == 0
    logged = (tmp_path / "second.log").read_text()
    assert "device recovered" in logged
    assert logged.count("request") >= 16 and "op=READ" in logged, logged[-2000:]


def test_recover_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One line each: a device without recovery, and a LIVE device."""
    dev = start_server(["-t", "null", "-q", "1"], tmp_path / "plain.log")
    code, _out, err = in_process("recover", "-n", str(dev.dev_id), "-t", "null", "-q", "1",
                                 "--foreground", capsys=capsys)
    assert code == 1 and err.count("\n") == 1
    assert "was added without user recovery (-r 1)" in err, err
    code, _out, err = in_process("quiesce", "-n", str(dev.dev_id), capsys=capsys)
    assert code == 1 and "cannot be quiesced" in err and err.count("\n") == 1, err
    delete(dev.dev_id)
    assert reap(dev.pid) == 0

    dev = start_server(["-t", "null", "-q", "1", "-r", "1"], tmp_path / "rec.log")
    code, _out, err = in_process("recover", "-n", str(dev.dev_id), "-t", "null", "-q", "1",
                                 "-r", "1", "--foreground", capsys=capsys)
    assert code == 1 and f"device {dev.dev_id} is LIVE" in err and err.count("\n") == 1, err
    assert state(dev.dev_id) == "LIVE"  # untouched
    delete(dev.dev_id)
    assert reap(dev.pid) == 0


def test_server_dying_while_arming_leaves_a_deletable_device(tmp_path: Path) -> None:
    """kublk's fault_inject test: a recovery whose server is SIGKILLed after
    arming some but not all tags; the device can still be deleted."""
    # per-I/O: tags are armed one FETCH_REQ each (batch arms a queue in one command)
    dev = start_server(["-t", "fault_inject", "-q", "1", "-r", "1", "--no-batch"],
                       tmp_path / "first.log")
    os.kill(dev.pid, signal.SIGKILL)
    assert reap(dev.pid) == -signal.SIGKILL
    wait_state(dev.dev_id, "QUIESCED")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = cli_mod.main(["recover", "-n", str(dev.dev_id), "-t", "fault_inject",
                                 "-q", "1", "-r", "1", "--no-batch",
                                 "--die_during_fetch", "1", "--foreground"])
        finally:
            os._exit(code)
    assert reap(pid) == -signal.SIGKILL
    delete(dev.dev_id)  # bounded: hangs here would fail the test
    assert not Path(f"/dev/ublkb{dev.dev_id}").exists()


def test_requests_held_by_a_killed_server_fail_fast(tmp_path: Path) -> None:
    """fault_inject --delay_us: a write the server holds for 30 s fails soon
    after the server is killed, not after an I/O timeout."""
    # (no partition scan: its reads would be held 30 s each too)
    dev = start_server(["-t", "fault_inject", "-q", "2", "-d", "1", "--delay_us", "30000000",
                        "--no_auto_part_scan"], tmp_path / "s.log")
    dd = subprocess.Popen(["dd", "if=/dev/zero", f"of=/dev/ublkb{dev.dev_id}", "bs=4k",
                           "count=1", "oflag=direct"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while sum(map(int, Path(f"/sys/block/ublkb{dev.dev_id}/inflight").read_text().split())) == 0:
        assert time.monotonic() < deadline, "the write never reached the device"
        time.sleep(0.05)
    killed = time.monotonic()
    os.kill(dev.pid, signal.SIGKILL)
    assert reap(dev.pid) == -signal.SIGKILL
    _out, err = dd.communicate(timeout=60)
    assert dd.returncode != 0, "the held write succeeded"
    assert time.monotonic() - killed < 20, "the held write waited for a timeout"
    delete(dev.dev_id)


def test_list_stats_update_size_and_safe_stop(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    dev = start_server(["-t", "null", "-q", "1"], tmp_path / "s.log")
    path = f"/dev/ublkb{dev.dev_id}"
    reads = reads_done(dev.dev_id)  # (the partition scan's)
    kernel.run("dd", f"if={path}", "of=/dev/null", "bs=4k", "count=300", "iflag=direct")
    deadline = time.monotonic() + 10
    while True:  # published once a second
        code, out, err = in_process("list", "-n", str(dev.dev_id), "--stats", capsys=capsys)
        assert code == 0, err
        stat = out.splitlines()[-1]
        ios = int(stat.split(" ios ")[1].split()[0])
        if ios >= reads + 300:
            break
        assert time.monotonic() < deadline, out
        time.sleep(0.3)
    assert stat.startswith("\tqueue 0 stats: ios ") and " errors 0 inflight 0 " in stat
    assert 0 <= float(stat.split(" c_share ")[1].split()[0]) <= 1, stat
    assert int(stat.split(" bytes ")[1].split()[0]) >= 300 * 4096
    # kublk's lines first, then the recorded target's
    kublk, target = out.splitlines()[:-2], out.splitlines()[-2]
    assert len(kernel.parse_list("\n".join(kublk))) == 1 and target == "\ttarget: null", out
    code, out, err = in_process("list", "-n", str(dev.dev_id), "--stats", "--json",
                                capsys=capsys)
    assert code == 0, err
    [listed] = json.loads(out)
    assert (listed["dev_id"], listed["pid"], listed["target"]) == (dev.dev_id, dev.pid, "null")
    [row] = listed["stats"]
    assert row["ios"] >= reads + 300 and row["c_served"] + row["py_handed"] >= reads + 300, row

    full = int(kernel.run("lsblk", "-bdno", "SIZE", path))
    assert full == 250 << 30
    code, out, err = in_process("update_size", "-n", str(dev.dev_id), "-s", str(full // 2),
                                capsys=capsys)
    assert (code, out, err) == (0, "", "")
    assert int(kernel.run("lsblk", "-bdno", "SIZE", path)) == full // 2
    code, _out, err = in_process("update_size", "-n", str(dev.dev_id), "-s", "1000",
                                 capsys=capsys)
    assert code == 1 and "logical block size (512)" in err, err

    # dd keeps the disk open while it reads (the null device is 125 GiB now)
    before = reads_done(dev.dev_id)
    dd = subprocess.Popen(["dd", f"if={path}", "of=/dev/null", "bs=64k", "iflag=direct"],
                          stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while reads_done(dev.dev_id) <= before:  # dd has the disk open
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code, out, err = in_process("stop", "-n", str(dev.dev_id), "--safe", capsys=capsys)
        assert code == 1 and err.count("\n") == 1, err
        assert f"device {dev.dev_id} is open" in err, err
        assert state(dev.dev_id) == "LIVE"
    finally:
        dd.terminate()
        dd.wait(30)
    code, out, err = in_process("stop", "-n", str(dev.dev_id), "--safe", capsys=capsys)
    assert (code, out, err) == (0, "", "")
    assert reap(dev.pid) == 0  # the server saw the stop and exited
    assert not Path(path).exists()
    assert state(dev.dev_id) == "DEAD"
    delete(dev.dev_id)


def listed(out: str) -> tuple[list[kernel.DevListing], list[str]]:
    """``list``'s output: kublk's lines parsed, and aioublk's target lines."""
    lines = out.splitlines()
    targets = [line for line in lines if line.startswith("\ttarget: ")]
    return kernel.parse_list("\n".join(line for line in lines if line not in targets)), targets


def test_recover_by_id_alone_uses_what_add_recorded(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A daemonized ``add`` records its target and options; after kill -9
    ``recover -n ID`` alone serves the device again with them (-q 1 -d 64,
    not the defaults), ``list`` shows its target, and what was written
    before the kill reads back intact. ``del`` removes the record."""
    image = kernel.make_file(tmp_path / "disk.img", 64 << 20)
    dev = kernel.add("-t", "loop", "-q", "1", "-d", "64", "-r", "1", str(image))
    dev_id = dev.dev_id
    verify = ["--rw=write", "--bs=4k", "--size=16M", "--verify=crc32c", "--iodepth=16"]
    kernel.fio(f"/dev/ublkb{dev_id}", tmp_path, *verify, "--do_verify=0")
    code, out, err = in_process("list", "-n", str(dev_id), capsys=capsys)
    assert code == 0, err
    (before,), targets = listed(out)
    assert targets == [f"\ttarget: loop file {image}"], out
    os.kill(before.pid, signal.SIGKILL)  # the daemon: not our child
    kernel.wait_gone(before.pid)
    wait_state(dev_id, "QUIESCED")

    p = kernel.cli("recover", "-n", str(dev_id))
    assert p.stderr.startswith("aioublk: logs: "), p.stderr  # no override notice
    code, out, err = in_process("list", "-n", str(dev_id), capsys=capsys)
    assert code == 0, err
    (after,), targets = listed(out)
    assert (after.state, after.queues, after.depth) == ("LIVE", 1, 64), out
    assert after.pid != before.pid
    assert targets == [f"\ttarget: loop file {image}"], out
    kernel.fio(f"/dev/ublkb{dev_id}", tmp_path, *verify, "--verify_only")
    delete(dev_id)
    assert stats.read_record(dev_id) is None


def test_list_and_del_all_see_ids_past_254(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Ids are not kublk's 0..254: ``list`` shows device 1000 (after any
    lower one) and ``del -a`` removes it with the rest."""
    low = start_server(["-t", "null", "-q", "1"], tmp_path / "low.log")
    high = start_server(["-t", "null", "-q", "1", "-n", "1000"], tmp_path / "high.log")
    assert high.dev_id == 1000
    code, out, err = in_process("list", capsys=capsys)
    assert code == 0, err
    devs, targets = listed(out)
    assert [d.dev_id for d in devs] == [low.dev_id, 1000], out
    assert targets == ["\ttarget: null"] * 2, out
    code, out, err = in_process("del", "-a", capsys=capsys)
    assert (code, out, err) == (0, "", "")
    assert reap(low.pid) == 0 and reap(high.pid) == 0
    assert not Path("/sys/class/ublk-char/ublkc1000").exists()
    assert stats.read_record(1000) is None


def _span(blk: str, offset: int, body: bytes | None) -> bytes:
    """Write ``body`` (O_DIRECT, synced) at ``offset``, or read as much back."""
    fd = os.open(blk, os.O_RDWR | os.O_DIRECT)
    buf = mmap.mmap(-1, 8 << 20)
    try:
        if body is not None:
            buf[:len(body)] = body
            assert os.pwrite(fd, memoryview(buf)[:len(body)], offset) == len(body)
            os.fsync(fd)
            return body
        assert os.preadv(fd, [buf], offset) == len(buf)
        return bytes(buf)
    finally:
        buf.close()
        os.close(fd)


@pytest.mark.guest(timeout=1500)  # (each step serves the device anew: a minute under TCG)
def test_live_snapshot_under_fio_verify(tmp_path: Path) -> None:
    """``snapshot -n ID create|list|delete`` on a served qcow2 device while
    fio writes and verifies: the server steps aside (its requests held by
    the kernel), the snapshot is taken, the device is recovered, and fio
    finishes without an error. Each snapshot holds exactly what the disk
    held when it was taken (qemu-img convert -l), and the image is clean."""
    image = tmp_path / "disk.qcow2"
    kernel.run("qemu-img", "create", "-q", "-f", "qcow2", str(image), str(64 << 20))
    dev = start_server(["-t", "qcow2", "-q", "2", "-d", "32", "-r", "1", "-i", "1",
                        str(image)], tmp_path / "first.log")
    dev_id, blk = dev.dev_id, f"/dev/ublkb{dev.dev_id}"
    first = _span(blk, 32 << 20, random.Random(1).randbytes(8 << 20))
    fio = start_fio_verify(dev_id, tmp_path, 16 << 20)
    p = kernel.cli("snapshot", "-n", str(dev_id), "create", "one", timeout=600)
    assert (p.stdout, p.stderr) == ("", "")
    assert reap(dev.pid) == 0, kernel.tail(tmp_path / "first.log")
    job = fio_result(fio, timeout=600)
    assert job["write"]["io_bytes"] == 16 << 20, job["write"]  # type: ignore[index]
    assert state(dev_id) == "LIVE"
    second = _span(blk, 32 << 20, random.Random(2).randbytes(8 << 20))
    kernel.cli("snapshot", "-n", str(dev_id), "create", "two", timeout=600)
    listed = kernel.cli("snapshot", "-n", str(dev_id), "list").stdout
    assert [line.split()[1] for line in listed.splitlines()[2:]] == ["one", "two"], listed
    assert _span(blk, 32 << 20, None) == second
    kernel.cli("snapshot", "-n", str(dev_id), "delete", "two", timeout=600)
    p = kernel.cli("snapshot", "-n", str(dev_id), "delete", "nope", timeout=600, check=False)
    assert p.returncode == 1 and "snapshot not found" in p.stderr, p.stderr
    assert state(dev_id) == "LIVE"  # (found missing before the server stepped aside)
    delete(dev_id)
    assert locking.wait_released(str(image), 30)
    kernel.run("qemu-img", "check", str(image))
    out = tmp_path / "one.raw"
    kernel.run("qemu-img", "convert", "-l", "snapshot.name=one", "-O", "raw", str(image),
               str(out))
    with open(out, "rb") as f:
        f.seek(32 << 20)
        assert f.read(8 << 20) == first
    names = json.loads(kernel.run("qemu-img", "info", "--output", "json", str(image)))
    assert [s["name"] for s in names["snapshots"]] == ["one"]


def test_live_snapshot_refused_in_one_line(tmp_path: Path) -> None:
    """Without user recovery the server cannot step aside: refused, and the
    device goes on serving."""
    image = tmp_path / "disk.qcow2"
    kernel.run("qemu-img", "create", "-q", "-f", "qcow2", str(image), str(16 << 20))
    dev = kernel.add("-t", "qcow2", "-q", "1", "-r", "1", str(image))  # (no -i 1)
    p = kernel.cli("snapshot", "-n", str(dev.dev_id), "create", "s", check=False)
    assert p.returncode == 1 and "-r 1 -i 1" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert state(dev.dev_id) == "LIVE"
    null = kernel.add("-t", "null", "-q", "1")
    p = kernel.cli("snapshot", "-n", str(null.dev_id), "list", check=False)
    assert p.returncode == 1 and "no qcow2 image" in p.stderr, p.stderr
    delete(dev.dev_id)
    delete(null.dev_id)
