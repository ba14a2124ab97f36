"""The nbd target on the host, against real NBD servers (qemu-nbd,
qemu-storage-daemon, nbdkit) on a unix socket or loopback TCP: its
coroutines driven directly on the test's loop, the export read back from
the server's backing file."""

from __future__ import annotations

import asyncio
import errno
import importlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aioublk.frontend.cli import main as cli_main
from aioublk.target import QueueContext, QueueSetupError, setup_queue, teardown_queue
from aioublk.targets import nbd
from aioublk.targets.nbd import NbdError, NbdTarget

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("aioublk.targets._nbd") is None,
                       reason="libnbd binding not built (needs libnbd-dev)"),
    pytest.mark.skipif(shutil.which("qemu-nbd") is None or shutil.which("nbdkit") is None,
                       reason="needs qemu-nbd and nbdkit (scripts/setup installs them)"),
]

SIZE = 4 << 20


def _wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    """Until the server accepts connections (its socket file comes before its listen)."""
    deadline = time.monotonic() + 10
    while True:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(path))
                return
            except (FileNotFoundError, ConnectionRefusedError):
                pass
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"no socket {path}"
        time.sleep(0.02)


class Server:
    """An NBD server process on a unix socket, restartable."""

    def __init__(self, argv: list[str], sock: Path) -> None:
        self.argv, self.sock = argv, sock
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        self.sock.unlink(missing_ok=True)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL)
        _wait_for(self.sock, self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def uri(self, export: str = "exp") -> str:
        return f"nbd+unix:///{export}?socket={self.sock}"


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    path = tmp_path / "disk.raw"
    path.write_bytes(os.urandom(SIZE))
    return path


@pytest.fixture
def qemu_nbd(tmp_path: Path, disk: Path) -> Iterator[Server]:
    s = Server(["qemu-nbd", "-f", "raw", "-x", "exp", "-t", "-k",
                str(tmp_path / "qemu-nbd.sock"), str(disk)], tmp_path / "qemu-nbd.sock")
    yield s.start()
    s.kill()


async def _attached(t: NbdTarget, worker: int = 0) -> QueueContext:
    q = QueueContext(worker, (worker,), asyncio.get_running_loop())
    await setup_queue(t, q)
    return q


async def _round_trip(t: NbdTarget, disk: Path) -> None:
    """Write, read, flush, trim, zero through the target; compare with the file."""
    data = bytearray(os.urandom(256 << 10))
    await t.write(64 << 10, memoryview(data))
    await t.write(1 << 20, memoryview(data[:4096]), fua=True)
    out = bytearray(len(data))
    await asyncio.gather(t.read(64 << 10, memoryview(out)), t.flush())
    assert out == data
    await t.write_zeroes(128 << 10, 8192, unmap=False)
    await t.write_zeroes(136 << 10, 8192)
    if t.can_trim:
        await t.discard(2 << 20, 64 << 10)
    await t.flush()
    raw = disk.read_bytes()
    assert raw[64 << 10:128 << 10] == data[:64 << 10]
    assert raw[128 << 10:144 << 10] == bytes(16 << 10)
    assert raw[144 << 10:320 << 10] == data[80 << 10:]
    assert raw[1 << 20:(1 << 20) + 4096] == data[:4096]


@pytest.mark.asyncio
async def test_qemu_nbd_unix_round_trip(qemu_nbd: Server, disk: Path) -> None:
    t = NbdTarget(qemu_nbd.uri())
    assert t.geometry.size == SIZE and t.geometry.volatile_cache and t.geometry.write_zeroes
    assert not t.pin_workers  # (its server shares this machine's CPUs)
    q = await _attached(t)
    try:
        await _round_trip(t, disk)
    finally:
        await teardown_queue(t, q)


@pytest.mark.asyncio
async def test_qemu_nbd_tcp_round_trip(disk: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["qemu-nbd", "-f", "raw", "-x", "exp", "-t", "-b", "127.0.0.1",
                             "-p", str(port), str(disk)])
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        t = NbdTarget(f"nbd://127.0.0.1:{port}/exp")
        assert t.pin_workers  # (a TCP server may be anywhere)
        q = await _attached(t)
        try:
            await _round_trip(t, disk)
        finally:
            await teardown_queue(t, q)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.asyncio
async def test_qemu_storage_daemon_round_trip(tmp_path: Path, disk: Path) -> None:
    """qemu-storage-daemon exporting a file; unlike qemu-nbd's (which
    serves one client by default) its export advertises multi-conn."""
    sock = tmp_path / "qsd.sock"
    qsd = Server(["qemu-storage-daemon",
                  "--blockdev", f"driver=file,node-name=file,filename={disk}",
                  "--nbd-server", f"addr.type=unix,addr.path={sock}",
                  "--export", "type=nbd,id=exp,node-name=file,name=exp,writable=on"],
                 sock).start()
    try:
        t = NbdTarget(qsd.uri())
        assert t.multi_conn and not t.one_loop
        q = await _attached(t)
        try:
            await _round_trip(t, disk)
        finally:
            await teardown_queue(t, q)
    finally:
        qsd.kill()


@pytest.mark.asyncio
async def test_multi_conn_connection_per_queue_loop(tmp_path: Path, disk: Path) -> None:
    """nbdkit's file plugin advertises multi-conn: a connection per queue
    loop, each on its own thread, both writes in the file."""
    sock = tmp_path / "kit.sock"
    kit = Server(["nbdkit", "-f", "-U", str(sock), "file", str(disk)], sock).start()
    try:
        t = NbdTarget(kit.uri(""))
        assert t.multi_conn and not t.one_loop
        chunks = [os.urandom(64 << 10) for _ in range(2)]
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            async def run() -> None:
                q = await _attached(t, i)
                try:
                    await t.write(i << 20, memoryview(bytearray(chunks[i])))
                    await t.flush()
                finally:
                    await teardown_queue(t, q)
            try:
                asyncio.run(run())
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        await asyncio.to_thread(lambda: [th.join() for th in threads])
        assert not errors
        raw = disk.read_bytes()
        for i, chunk in enumerate(chunks):
            assert raw[i << 20:(i << 20) + len(chunk)] == chunk
    finally:
        kit.kill()


@pytest.mark.asyncio
async def test_nbdkit_memory(tmp_path: Path) -> None:
    sock = tmp_path / "nbdkit.sock"
    kit = Server(["nbdkit", "-f", "-U", str(sock), "memory", f"size={SIZE}"], sock).start()
    try:
        t = NbdTarget(kit.uri(""))
        assert t.multi_conn and t.can_trim and t.geometry.discard
        q = await _attached(t)
        try:
            data = bytearray(os.urandom(8192))
            await t.write(4096, memoryview(data))
            await t.discard(4096, 4096)
            out = bytearray(8192)
            await t.read(4096, memoryview(out))
            assert out == bytes(4096) + data[4096:]
            # the export as another client sees it
            got = subprocess.run(["qemu-io", "-f", "raw", "-r", "-c", "read -P 0 4096 4096",
                                  f"nbd+unix:///?socket={sock}"], capture_output=True, text=True)
            assert "read 4096/4096" in got.stdout, got
        finally:
            await teardown_queue(t, q)
    finally:
        kit.kill()


def test_multi_conn_detected(qemu_nbd: Server, tmp_path: Path, disk: Path) -> None:
    """qemu-nbd advertises multi-conn only when it serves more than one
    client (-e); without it the device is served from one loop."""
    t = NbdTarget(qemu_nbd.uri())
    assert not t.multi_conn and t.one_loop
    shared = Server(["qemu-nbd", "-f", "raw", "-x", "exp", "-t", "-e", "4", "-k",
                     str(tmp_path / "shared.sock"), str(disk)], tmp_path / "shared.sock")
    try:
        t = NbdTarget(shared.start().uri())
        assert t.multi_conn and not t.one_loop
    finally:
        shared.kill()


@pytest.mark.asyncio
async def test_read_only_export_refuses_writes(tmp_path: Path, disk: Path) -> None:
    sock = tmp_path / "ro.sock"
    ro = Server(["qemu-nbd", "-r", "-f", "raw", "-x", "exp", "-t", "-k", str(sock), str(disk)],
                sock).start()
    try:
        t = NbdTarget(ro.uri())
        assert t.geometry.read_only and not t.geometry.discard
        q = await _attached(t)
        try:
            with pytest.raises(OSError) as e:
                await t.write(0, memoryview(bytearray(4096)))
            assert e.value.errno == errno.EROFS
            out = bytearray(4096)
            await t.read(0, memoryview(out))
            assert out == disk.read_bytes()[:4096]
        finally:
            await teardown_queue(t, q)
    finally:
        ro.kill()


@pytest.mark.asyncio
async def test_server_restarted_requests_complete(qemu_nbd: Server, disk: Path) -> None:
    """Requests pending when the server dies are held, and complete on the
    restarted server."""
    t = NbdTarget(qemu_nbd.uri(), reconnect_timeout=20)
    q = await _attached(t)
    try:
        assert qemu_nbd.proc is not None
        qemu_nbd.proc.send_signal(signal.SIGSTOP)  # requests stay pending
        data = [bytearray(os.urandom(4096)) for _ in range(8)]
        writes = [asyncio.ensure_future(t.write(i * 4096, memoryview(d)))
                  for i, d in enumerate(data)]
        await asyncio.sleep(0.2)
        assert not any(w.done() for w in writes)
        qemu_nbd.kill()
        await asyncio.sleep(0.5)
        assert not any(w.done() for w in writes)
        qemu_nbd.start()
        await asyncio.wait_for(asyncio.gather(*writes), 20)
        out = bytearray(4096)
        await t.read(0, memoryview(out))
        await t.flush()
        assert out == data[0]
        assert disk.read_bytes()[:8 * 4096] == b"".join(data)
    finally:
        await teardown_queue(t, q)


def _fast(start: Callable[[int, memoryview, Callable[[int], None]], bool], offset: int,
          buf: bytearray) -> asyncio.Future[int]:
    """A fast-path request (start_read/start_write) as a future of its result."""
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    assert start(offset, memoryview(buf), fut.set_result)
    return fut


@pytest.mark.asyncio
async def test_fast_path_requests_are_held_across_a_restart(qemu_nbd: Server,
                                                            disk: Path) -> None:
    """start_write/start_read (no coroutine per request) answer with the byte
    count, and are held and resent like the coroutines' when the server
    comes back."""
    t = NbdTarget(qemu_nbd.uri(), reconnect_timeout=20)
    q = await _attached(t)
    try:
        assert qemu_nbd.proc is not None
        qemu_nbd.proc.send_signal(signal.SIGSTOP)
        data = [bytearray(os.urandom(4096)) for _ in range(8)]
        writes = [_fast(t.start_write, i * 4096, d) for i, d in enumerate(data)]
        await asyncio.sleep(0.2)
        qemu_nbd.kill()
        await asyncio.sleep(0.5)
        assert not any(w.done() for w in writes)
        qemu_nbd.start()
        assert await asyncio.wait_for(asyncio.gather(*writes), 20) == [4096] * 8
        out = bytearray(8 * 4096)
        assert await _fast(t.start_read, 0, out) == len(out)
        assert out == b"".join(data)
        await t.flush()
        assert disk.read_bytes()[:8 * 4096] == b"".join(data)
    finally:
        await teardown_queue(t, q)


@pytest.mark.asyncio
async def test_server_not_back_in_time_fails_with_eio(qemu_nbd: Server) -> None:
    t = NbdTarget(qemu_nbd.uri(), reconnect_timeout=1)
    q = await _attached(t)
    try:
        qemu_nbd.kill()
        start = time.monotonic()
        with pytest.raises(OSError) as e:
            await asyncio.wait_for(t.read(0, memoryview(bytearray(4096))), 10)
        assert e.value.errno == errno.EIO
        assert 0.5 < time.monotonic() - start < 5
    finally:
        await teardown_queue(t, q)


@pytest.mark.parametrize("uri,says", [
    ("nbd://127.0.0.1:1/exp", "Connection refused"),
    ("http://example.com/disk", "not an NBD URI: use nbd://HOST[:PORT]/EXPORT"),
    ("NBD://example.com/disk", "not an NBD URI"),  # libnbd's schemes are lower case
    ("nbd+unix:///disk", "names its socket: nbd+unix:///EXPORT?socket=PATH"),
    ("nbd://[::1/disk", "Invalid IPv6 URL"),
    ("nbd://example.com:99999/disk", "Port out of range"),  # libnbd would try it
])
def test_bad_uri_is_one_line(uri: str, says: str) -> None:
    with pytest.raises(NbdError) as e:
        NbdTarget(uri)
    assert says in str(e.value) and uri in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("uri", ["nbd://h/e\nx", "nbd://h/\x1b[2J", "nbd://h/\u00e9"])
def test_a_uri_that_would_split_the_error_line_is_refused_quoted(uri: str) -> None:
    with pytest.raises(NbdError) as e:
        nbd.parse_uri(uri)
    assert str(e.value) == (f"NBD URI {uri!r}: only printable ASCII belongs in a URI "
                            "(percent-encode the rest)")


@pytest.mark.parametrize("uri,tls,transport", [
    ("nbd://", False, "tcp"),  # libnbd's localhost:10809
    ("nbds://example.com:10809/e%20x", True, "tcp"),
    ("nbd+unix:///e?socket=/tmp/s", False, "unix"),
    ("nbds+vsock:///", True, "vsock"),
    ("nbd+vsock://2:100000/", False, "vsock"),  # a vsock port has 32 bits
    ("nbd+ssh://user@host/disk", False, "ssh"),
])
def test_parse_uri(uri: str, tls: bool, transport: str) -> None:
    assert nbd.parse_uri(uri) == nbd.NbdUri(tls, transport)


def test_tls_with_a_pre_shared_key_over_unix_is_not_refused_for_its_host_name() -> None:
    """A PSK authenticates both ends with no certificate: the missing host
    name costs nothing there, so only the connect (no server) fails."""
    uri = "nbds+unix:///e?socket=/nonexistent.sock&tls-psk-file=/nonexistent.psk"
    assert nbd.parse_uri(uri).psk
    with pytest.raises(NbdError) as e:
        NbdTarget(uri)
    assert "--tls-hostname" not in str(e.value), e.value


def test_missing_export_is_one_line(qemu_nbd: Server) -> None:
    with pytest.raises(NbdError) as e:
        NbdTarget(qemu_nbd.uri("nope"))
    msg = str(e.value)
    assert "nope" in msg and "\n" not in msg


def test_cli_add_unreachable_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["add", "-t", "nbd", "nbd://127.0.0.1:1/exp"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aioublk: NBD server nbd://127.0.0.1:1/exp:") and err.count("\n") == 1


def _certificates(where: Path, server: bool) -> Path:
    """A test CA and, signed by it, a client (and a server) certificate, in
    the layout libnbd and nbdkit read."""
    where.mkdir()
    templates = {"ca": "cn = Test CA\nca\ncert_signing_key\n",
                 "server": "cn = localhost\ndns_name = localhost\nip_address = 127.0.0.1\n"
                           "tls_www_server\nencryption_key\nsigning_key\n",
                 "client": "cn = client\ntls_www_client\nencryption_key\nsigning_key\n"}
    for name, text in templates.items():
        (where / f"{name}.info").write_text(text + "expiration_days = 2\n")

    def certtool(*args: str) -> None:
        subprocess.run(["certtool", *args], check=True, capture_output=True, cwd=where)

    certtool("--generate-privkey", "--outfile", "ca-key.pem")
    certtool("--generate-self-signed", "--load-privkey", "ca-key.pem", "--template",
             "ca.info", "--outfile", "ca-cert.pem")
    for who in ("server", "client") if server else ("client",):
        certtool("--generate-privkey", "--outfile", f"{who}-key.pem")
        certtool("--generate-certificate", "--load-ca-certificate", "ca-cert.pem",
                 "--load-ca-privkey", "ca-key.pem", "--load-privkey", f"{who}-key.pem",
                 "--template", f"{who}.info", "--outfile", f"{who}-cert.pem")
    return where


@pytest.mark.skipif(shutil.which("certtool") is None, reason="needs certtool (gnutls-bin)")
@pytest.mark.asyncio
async def test_tls_with_a_test_ca(tmp_path: Path) -> None:
    certs = _certificates(tmp_path / "certs", server=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kit = subprocess.Popen(["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(port), "--tls=require",
                            f"--tls-certificates={certs}", "memory", f"size={SIZE}"],
                           stderr=subprocess.DEVNULL)
    uri = f"nbds://localhost:{port}/"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        t = NbdTarget(uri, tls_certificates=str(certs))
        q = await _attached(t)
        try:
            data = bytearray(os.urandom(8192))
            await t.write(0, memoryview(data), fua=True)
            out = bytearray(8192)
            await t.read(0, memoryview(out))
            assert out == data
        finally:
            await teardown_queue(t, q)
        with pytest.raises(NbdError, match="server requires TLS") as e:
            NbdTarget(uri.replace("nbds:", "nbd:"))
        wrong = _certificates(tmp_path / "wrong", server=False)
        with pytest.raises(NbdError, match="certificate verification") as e:
            NbdTarget(uri, tls_certificates=str(wrong))
        assert "\n" not in str(e.value)
        with pytest.raises(NbdError, match="no ca-cert.pem"):
            NbdTarget(uri, tls_certificates=str(tmp_path))
    finally:
        kit.kill()
        kit.wait()


def _tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tls_nbdkit(certs: Path, sock: Path | None) -> tuple[subprocess.Popen[bytes], str]:
    """nbdkit requiring TLS with ``certs``, on ``sock`` or else loopback TCP; its URI."""
    where = ["-U", str(sock)] if sock else ["-i", "127.0.0.1", "-p", str(port := _tcp_port())]
    kit = subprocess.Popen(["nbdkit", "-f", *where, "--tls=require",
                            f"--tls-certificates={certs}", "memory", f"size={SIZE}"],
                           stderr=subprocess.DEVNULL)
    if sock:
        _wait_for(sock, kit)
        return kit, f"nbds+unix:///?socket={sock}"
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return kit, f"nbds://localhost:{port}/"
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.02)


@pytest.mark.skipif(shutil.which("certtool") is None, reason="needs certtool (gnutls-bin)")
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_tls_wrong_ca_is_refused_on_both_transports(tmp_path: Path, transport: str) -> None:
    """A server whose certificate our CA did not sign is refused, over TCP
    (libnbd checks it against the URI's host) and over a unix socket, where
    libnbd knows no host name to check and would take any certificate: there
    TLS needs the expected name (``tls_hostname``), and a libnbd that can
    use it (nbd_set_tls_hostname, 1.22)."""
    certs = _certificates(tmp_path / "certs", server=True)
    wrong = _certificates(tmp_path / "wrong", server=False)
    kit, uri = _tls_nbdkit(certs, tmp_path / "kit.sock" if transport == "unix" else None)
    try:
        with pytest.raises(NbdError) as e:
            NbdTarget(uri, tls_certificates=str(wrong))
        msg = str(e.value)
        assert uri in msg and "\n" not in msg
        if transport == "tcp":
            assert "certificate verification" in msg
            return
        assert "tls_hostname" in msg or "--tls-hostname" in msg, msg
        can_name = bool(nbd._lib()[1].anbd_can_tls_hostname())
        with pytest.raises(NbdError) as e:
            NbdTarget(uri, tls_certificates=str(wrong), tls_hostname="localhost")
        msg = str(e.value)
        assert ("certificate verification" if can_name else "libnbd 1.22") in msg, msg
        if can_name:  # the right CA and name: served
            NbdTarget(uri, tls_certificates=str(certs), tls_hostname="localhost")
        else:
            with pytest.raises(NbdError, match="libnbd 1.22"):
                NbdTarget(uri, tls_certificates=str(certs), tls_hostname="localhost")
    finally:
        kit.kill()
        kit.wait()


def test_tls_hostname_is_a_target_option() -> None:
    from aioublk.frontend.registry import TARGETS

    o = TARGETS["nbd"].option("tls_hostname")
    assert o is not None and o.flags == ("--tls-hostname",)


def test_cli_tls_hostname_needs_tls(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["add", "-t", "nbd", "--tls-hostname", "localhost",
                     "nbd://127.0.0.1:1/exp"]) == 1
    err = capsys.readouterr().err
    assert "--tls-hostname is for TLS" in err and err.count("\n") == 1


def _silent(tmp_path: Path, transport: str) -> tuple[socket.socket, str]:
    """A listener that takes connections (the kernel's backlog does) and never answers."""
    if transport == "unix":
        lsn = socket.socket(socket.AF_UNIX)
        lsn.bind(str(tmp_path / "silent.sock"))
        uri = f"nbd+unix:///exp?socket={tmp_path / 'silent.sock'}"
    else:
        lsn = socket.socket()
        lsn.bind(("127.0.0.1", 0))
        uri = f"nbd://127.0.0.1:{lsn.getsockname()[1]}/exp"
    lsn.listen(8)
    return lsn, uri


def _within(seconds: float, fn: Callable[[], object], unblock: Callable[[], None]) -> object:
    """``fn()``'s result or exception, failing the test if it takes longer than
    ``seconds`` (then ``unblock()`` lets it end, so no thread is left behind)."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    hung = th.is_alive()
    unblock()
    th.join(10)
    assert not hung, f"still waiting after {seconds} s"
    return box[0]


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_server_that_never_answers_times_out_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    monkeypatch.setattr(nbd, "CONNECT_TIMEOUT", 0.5, raising=False)
    lsn, uri = _silent(tmp_path, transport)
    start = time.monotonic()
    got = _within(5, lambda: NbdTarget(uri), lsn.close)
    assert isinstance(got, NbdError), got
    msg = str(got)
    assert msg.startswith(f"NBD server {uri}: ") and "timed out" in msg and "\n" not in msg
    assert time.monotonic() - start < 3


def test_cli_add_to_a_silent_server_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(nbd, "CONNECT_TIMEOUT", 0.5, raising=False)
    lsn, uri = _silent(tmp_path, "tcp")
    assert _within(5, lambda: cli_main(["add", "-t", "nbd", uri]), lsn.close) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"aioublk: NBD server {uri}: ") and "timed out" in err
    assert err.count("\n") == 1


@pytest.mark.asyncio
async def test_serve_connects_off_its_loop(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """serve builds each target in a thread: while an NBD server stays
    silent the loop still runs (it answers signals and metrics), then the
    connect's one-line error comes out of serve's start."""
    from aioublk.frontend import config, serve
    from aioublk.queue.options import DeviceConfig

    monkeypatch.setattr(nbd, "CONNECT_TIMEOUT", 1.0, raising=False)
    lsn, uri = _silent(tmp_path, "tcp")
    spec = config.DeviceSpec(target="nbd", options={"uri": uri}, where="devices[0]",
                             config=DeviceConfig())
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1
    ticker = asyncio.create_task(tick())
    try:
        with pytest.raises(NbdError, match="timed out"):
            await asyncio.wait_for(serve._start(None, spec), 10)  # type: ignore[arg-type]
    finally:
        ticker.cancel()
        lsn.close()
    assert ticks > 20  # the loop ran through most of the second


@pytest.mark.asyncio
async def test_a_target_built_after_serve_gave_up_is_closed() -> None:
    """SIGTERM (a cancel) while a target is built in its thread: the build
    cannot be stopped, so what it makes is closed when it is done, never
    left holding its files, locks or connections."""
    from aioublk.frontend import serve

    started, release, closed = threading.Event(), threading.Event(), threading.Event()

    class Built:
        def close(self) -> None:
            closed.set()

    class Spec:
        config = type("C", (), {"dev_id": -1})()

        def build_target(self) -> Built:
            started.set()
            release.wait(10)
            return Built()

    start = asyncio.ensure_future(serve._start(None, Spec()))  # type: ignore[arg-type]
    while not started.is_set():
        await asyncio.sleep(0.01)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert not closed.is_set()
    release.set()
    for _ in range(500):  # (the thread's result reaches the loop, then the callback runs)
        if closed.is_set():
            break
        await asyncio.sleep(0.01)
    assert closed.is_set()


@pytest.mark.asyncio
async def test_queue_connect_to_a_silent_server_times_out(
        qemu_nbd: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server answered the probe, then a silent one took its socket: the
    queue's own connection gives up too."""
    monkeypatch.setattr(nbd, "CONNECT_TIMEOUT", 0.5, raising=False)
    t = NbdTarget(qemu_nbd.uri())
    qemu_nbd.kill()
    qemu_nbd.sock.unlink()
    with socket.socket(socket.AF_UNIX) as lsn:
        lsn.bind(str(qemu_nbd.sock))
        lsn.listen(8)
        with pytest.raises(QueueSetupError, match="NbdError: NBD server .*timed out"):
            await asyncio.wait_for(_attached(t), 5)


@pytest.mark.asyncio
@pytest.mark.parametrize("first, then", [
    (["-e", "4"], []),     # multi-conn no more: a flush would not cover the other queues
    ([], ["-r"]),          # read-only now
], ids=["multi-conn-lost", "read-only"])
async def test_reconnect_refuses_a_server_that_changed(tmp_path: Path, disk: Path,
                                                       first: list[str],
                                                       then: list[str]) -> None:
    sock = tmp_path / "s.sock"
    base = ["qemu-nbd", "-f", "raw", "-x", "exp", "-t", "-k", str(sock)]
    s = Server([*base, *first, str(disk)], sock).start()
    try:
        t = NbdTarget(s.uri(), reconnect_timeout=1)
        assert t.multi_conn == bool(first)
        q = await _attached(t)
        try:
            await t.read(0, memoryview(bytearray(4096)))
            s.kill()
            s.argv = [*base, *then, str(disk)]
            s.start()
            with pytest.raises(OSError) as e:
                await asyncio.wait_for(t.read(0, memoryview(bytearray(4096))), 10)
            assert e.value.errno == errno.EIO
        finally:
            await teardown_queue(t, q)
    finally:
        s.kill()


def test_without_libnbd_the_target_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """aioublk installs without libnbd (no _nbd extension); -t nbd then says
    what to install, in one line."""
    real = importlib.import_module

    def no_nbd(name: str, package: str | None = None) -> object:
        if name == "aioublk.targets._nbd":
            raise ModuleNotFoundError(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_nbd)
    with pytest.raises(NbdError, match="install libnbd-dev") as e:
        NbdTarget("nbd://127.0.0.1/exp")
    assert "\n" not in str(e.value)
