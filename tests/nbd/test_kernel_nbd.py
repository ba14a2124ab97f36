"""The nbd target against the real driver, through the CLI, in front of
qemu-nbd, qemu-storage-daemon and nbdkit on unix sockets in the guest."""

from __future__ import annotations

import errno
import mmap
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.device.test_kernel_lifecycle import reap, wait_state, writes_done
from tests.qcow2.test_kernel_qcow2 import delta, served
from tests.support.kernel import add, delete, fio, make_file, run, start_server, tail, write_synced

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20
SIZE = 256 * MiB


class Server:
    """An NBD server on a unix socket, killable and restartable."""

    def __init__(self, argv: list[str], sock: Path, export: str) -> None:
        self.argv, self.sock, self.export = argv, sock, export
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        self.sock.unlink(missing_ok=True)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:  # its socket file exists before it listens
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.connect(str(self.sock))
                    return self
                except (FileNotFoundError, ConnectionRefusedError):
                    pass
            assert self.proc.poll() is None, f"{self.argv[0]} exited"
            assert time.monotonic() < deadline, f"{self.argv[0]}: no socket"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    @property
    def uri(self) -> str:
        return f"nbd+unix:///{self.export}?socket={self.sock}"


def _server(kind: str, tmp_path: Path, read_only: bool = False) -> tuple[Server, Path | None]:
    sock = tmp_path / f"{kind}.sock"
    ro = ["-r"] if read_only else []
    if kind == "nbdkit":
        return Server(["nbdkit", "-f", *ro, "-U", str(sock), "memory", f"size={SIZE}"], sock,
                      ""), None
    disk = make_file(tmp_path / "disk.raw", SIZE)
    if kind == "qemu-nbd":
        return Server(["qemu-nbd", *ro, "-f", "raw", "-x", "disk", "-t", "-k", str(sock),
                       str(disk)], sock, "disk"), disk
    return Server(["qemu-storage-daemon",
                   "--blockdev", f"driver=file,node-name=disk,filename={disk}",
                   "--nbd-server", f"addr.type=unix,addr.path={sock}",
                   "--export", "type=nbd,id=exp,node-name=disk,name=disk,"
                   f"writable={'off' if read_only else 'on'}"],
                  sock, "disk"), disk


@pytest.fixture(params=["qemu-nbd", "qemu-storage-daemon", "nbdkit"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Server, Path | None]]:
    s, disk = _server(request.param, tmp_path)
    yield s.start(), disk
    s.kill()


def _export(s: Server, tmp_path: Path, offset: int, length: int) -> bytes:
    """The export's bytes as another NBD client reads them."""
    out = tmp_path / "export.raw"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "raw", s.uri, str(out)],
                   check=True, capture_output=True)
    with open(out, "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_fio_verify_and_data_in_the_export(server: tuple[Server, Path | None],
                                           tmp_path: Path) -> None:
    s, disk = server
    dev = add("-t", "nbd", s.uri, "-q", "1")
    path = f"/dev/ublkb{dev.dev_id}"
    job = fio(path, tmp_path, "--rw=randwrite", "--bs=8k", "--iodepth=32", "--size=24M",
              "--verify=crc32c", "--verify_fatal=1", "--do_verify=1")
    assert job["write"]["io_bytes"] == 24 * MiB  # type: ignore[index]
    data = os.urandom(MiB)
    write_synced(path, data, 100 * MiB)
    delete(dev.dev_id)
    if disk is not None:
        with open(disk, "rb") as f:
            f.seek(100 * MiB)
            assert f.read(MiB) == data
    assert _export(s, tmp_path, 100 * MiB, MiB) == data


def test_two_queues_with_multi_conn(tmp_path: Path) -> None:
    s, _disk = _server("qemu-storage-daemon", tmp_path)
    s.start()
    try:
        dev = add("-t", "nbd", s.uri, "-q", "2")
        assert dev.queues == 2
        job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randwrite", "--bs=4k",
                  "--iodepth=32", "--size=12M", "--offset_increment=12M", "--numjobs=2",
                  "--verify=crc32c",
                  "--verify_fatal=1", "--do_verify=1", "--group_reporting")
        assert job["error"] == 0
        delete(dev.dev_id)
    finally:
        s.kill()


def test_a_unix_socket_device_leaves_its_workers_to_the_scheduler(tmp_path: Path) -> None:
    """The server behind a unix socket runs here: no worker is pinned to one
    CPU, where a null device's would be (test_kernel_dataplane). One queue:
    its worker serves exactly that queue, the case that is pinned otherwise."""
    s, _disk = _server("qemu-storage-daemon", tmp_path)
    s.start()
    try:
        dev = add("-t", "nbd", s.uri, "-q", "1")
        try:
            allowed = os.sched_getaffinity(dev.pid)
            assert len(allowed) > 1, "the guest needs 2 CPUs for this test"
            tasks = list(Path(f"/proc/{dev.pid}/task").iterdir())
            assert len(tasks) >= 2  # (the main thread and the queue's worker at least)
            assert {t.name: os.sched_getaffinity(int(t.name)) for t in tasks} == \
                {t.name: allowed for t in tasks}
        finally:
            delete(dev.dev_id)
    finally:
        s.kill()


def test_server_killed_and_restarted_under_fio(tmp_path: Path) -> None:
    s, _disk = _server("qemu-storage-daemon", tmp_path)
    s.start()
    try:
        dev = add("-t", "nbd", s.uri, "-q", "1", "--reconnect-timeout", "30")
        cmd = ["fio", "--name=t", f"--filename=/dev/ublkb{dev.dev_id}", "--ioengine=io_uring",
               "--direct=1", "--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=16M",
               "--verify=crc32c", "--verify_fatal=1", "--do_verify=1", "--loops=2"]
        fio_proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, cwd=tmp_path)
        time.sleep(2)
        s.kill()
        time.sleep(2)
        s.start()
        out, err = fio_proc.communicate(timeout=180)
        assert fio_proc.returncode == 0, f"fio failed: {err}\n{out}"
        delete(dev.dev_id)
    finally:
        s.kill()


def test_recovery_survives_a_restart_of_both_servers(tmp_path: Path) -> None:
    """-r 1 + restart of aioublk too: fio writes with verify headers, then
    the aioublk server is killed (-9) AND the NBD server restarted; ``recover
    -n ID`` alone (add's record holds the target and URI) serves the device
    again and fio reads every block back intact."""
    s, _disk = _server("qemu-storage-daemon", tmp_path)
    s.start()
    try:
        dev = start_server(["-t", "nbd", s.uri, "-q", "1", "-r", "1"], tmp_path / "first.log")
        path = f"/dev/ublkb{dev.dev_id}"
        job_args = ["--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=12M",
                    "--verify=crc32c", "--verify_fatal=1"]
        job = fio(path, tmp_path, *job_args, "--do_verify=0")
        assert job["write"]["io_bytes"] == 12 * MiB  # type: ignore[index]
        os.kill(dev.pid, signal.SIGKILL)
        assert reap(dev.pid) == -signal.SIGKILL
        wait_state(dev.dev_id, "QUIESCED")
        s.kill()
        s.start()
        new = start_server(["-n", str(dev.dev_id)], tmp_path / "second.log", cmd="recover")
        assert (new.dev_id, new.state) == (dev.dev_id, "LIVE") and new.pid != dev.pid
        # the same job with the same seed: fio regenerates what it wrote and compares
        job = fio(path, tmp_path, *job_args, "--verify_only")
        assert job["read"]["io_bytes"] == 12 * MiB  # type: ignore[index]
        delete(dev.dev_id)
        assert reap(new.pid) == 0, tail(tmp_path / "second.log")
    finally:
        s.kill()


def _write_error(path: str) -> int:
    """The errno of a 4k O_DIRECT write at offset 0 (refused at open or by the write)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as e:
        return e.errno or 0
    try:
        with mmap.mmap(-1, 4096) as buf:  # page aligned, as O_DIRECT wants
            os.pwrite(fd, buf, 0)
        return 0
    except OSError as e:
        return e.errno or 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["qemu-nbd", "nbdkit"])
def test_a_read_only_export_refuses_writes(kind: str, tmp_path: Path) -> None:
    """qemu-nbd -r / nbdkit -r: add succeeds, the device is read-only and
    a write through it fails; reads still work."""
    s, _disk = _server(kind, tmp_path, read_only=True)
    s.start()
    try:
        dev = add("-t", "nbd", s.uri, "-q", "1")
        path = f"/dev/ublkb{dev.dev_id}"
        assert run("blockdev", "--getro", path).strip() == "1"
        assert _write_error(path) in (errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)
        job = fio(path, tmp_path, "--rw=randread", "--bs=4k", "--iodepth=8", "--size=8M")
        assert job["read"]["io_bytes"] == 8 * MiB  # type: ignore[index]
        delete(dev.dev_id)
    finally:
        s.kill()


def test_server_not_back_within_the_reconnect_timeout_gives_eio(tmp_path: Path) -> None:
    """The NBD server killed and not restarted: requests are held for
    --reconnect-timeout seconds, then fail; fio stops with EIO and the
    server's log says it gave up."""
    s, _disk = _server("qemu-storage-daemon", tmp_path)
    s.start()
    log = tmp_path / "server.log"
    try:
        dev = start_server(["-t", "nbd", s.uri, "-q", "1", "--reconnect-timeout", "3"], log)
        before = writes_done(dev.dev_id)
        fio_proc = subprocess.Popen(
            ["fio", "--name=t", f"--filename=/dev/ublkb{dev.dev_id}", "--ioengine=io_uring",
             "--direct=1", "--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=32M",
             "--time_based", "--runtime=120"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
            stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while writes_done(dev.dev_id) < before + 500:
            assert fio_proc.poll() is None, fio_proc.communicate()
            assert time.monotonic() < deadline, "fio did not start"
            time.sleep(0.1)
        s.kill()
        out, err = fio_proc.communicate(timeout=90)  # well before its 120 s run ends
        assert fio_proc.returncode != 0, out
        assert "Input/output error" in err + out, f"{err}\n{out}"
        text = log.read_text(errors="replace")
        assert "NBD connection lost" in text, tail(log)
        assert "NBD server gave no connection: requests fail" in text, tail(log)
        delete(dev.dev_id)
        assert reap(dev.pid) == 0, tail(log)
    finally:
        s.kill()


def test_c_serves_4k_reads_and_writes_and_again_after_a_reconnect(tmp_path: Path) -> None:
    """After the first requests, 4k reads and writes are sent and answered
    by the C data plane (at most 1% reach Python) with the data intact; the
    server killed and restarted under fio: the requests C had in flight go
    back to Python, which reconnects and resends them, fio verifies every
    block, and C serves on the new connection."""
    s, disk = _server("qemu-storage-daemon", tmp_path)
    s.start()
    try:
        dev = add("-t", "nbd", s.uri, "-q", "1", "--reconnect-timeout", "30")
        path = f"/dev/ublkb{dev.dev_id}"
        verify = ["--bs=4k", "--iodepth=16", "--size=8M", "--verify=crc32c",
                  "--verify_fatal=1", "--do_verify=1"]
        s0 = served(dev.dev_id, time.time())
        job = fio(path, tmp_path, "--rw=randwrite", *verify)
        assert job["write"]["io_bytes"] == 8 * MiB  # type: ignore[index]
        s1 = served(dev.dev_id, time.time())
        d = delta(s0, s1)
        total = d["c_served"] + d["py_handed"]
        # 2048 writes, their 2048 verifying reads: fewer requests where the
        # block layer merged neighbours submitted together
        assert total >= 2048, d
        assert d["py_handed"] <= total // 100, f"Python served {d} (over 1%)"
        # the server goes away under a verifying writer, and comes back
        before = writes_done(dev.dev_id)
        fio_proc = subprocess.Popen(
            ["fio", "--name=t", f"--filename={path}", "--ioengine=io_uring", "--direct=1",
             "--rw=randwrite", "--offset=16M", *verify, "--loops=4"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
            stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while writes_done(dev.dev_id) < before + 300:
            assert fio_proc.poll() is None, fio_proc.communicate()
            assert time.monotonic() < deadline, "fio did not start"
            time.sleep(0.05)  # (polls the condition)
        s.kill()
        s.start()
        out, err = fio_proc.communicate(timeout=180)
        assert fio_proc.returncode == 0, f"fio failed: {err}\n{out}"
        s2 = served(dev.dev_id, time.time())
        assert delta(s1, s2)["py_handed"] >= 1  # what C had in flight went to Python
        job = fio(path, tmp_path, "--rw=randread", "--bs=4k", "--iodepth=16", "--size=8M")
        assert job["read"]["io_bytes"] == 8 * MiB  # type: ignore[index]
        d = delta(s2, served(dev.dev_id, time.time()))
        assert d["c_served"] >= 1024 and d["py_handed"] == 0, d  # (2048 reads, some merged)
        data = os.urandom(MiB)
        write_synced(path, data, 100 * MiB)
        delete(dev.dev_id)
        assert disk is not None
        with open(disk, "rb") as f:
            f.seek(100 * MiB)
            assert f.read(MiB) == data
    finally:
        s.kill()
