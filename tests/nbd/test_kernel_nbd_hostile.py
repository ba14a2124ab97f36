"""fio with verification over the nbd target in front of a server that
misbehaves on purpose (tests/support/hostile_nbd.py), through the real
driver. Each misbehaviour may cost a dropped connection (the target
reconnects and sends again what was in flight); none may cost wrong data,
a crash or a hang: fio's verify passes, the device is deleted cleanly and
its server exits 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.kernel import add, delete, fio, wait_gone

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

ROOT = Path(__file__).resolve().parents[2]
SIZE = 8 << 20
#: mode, every how many commands, at most how often (a dropped connection
#: costs a reconnection: a few each keep the run short), its extra options
#: (simple replies: a stale one names no offset that gives it away)
MATRIX = [
    ("early", 40, 3, ()),
    ("unknown", 40, 3, ()),
    ("overlap", 40, 3, ()),
    ("duplicate", 40, 3, ()),
    ("stale", 40, 3, ()),
    ("stale", 40, 3, ("--simple",)),
    ("split", 1, 300, ()),
    ("stall", 100, 3, ()),
]


def _start(sock: Path, mode: str, every: int, limit: int, extra: tuple[str, ...],
           out: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.hostile_nbd", "--socket", str(sock),
         "--size", str(SIZE), "--mode", mode, "--every", str(every), "--limit", str(limit),
         *extra],
        cwd=ROOT, stdout=out.open("w"), stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while True:  # (its socket file exists before it listens)
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(sock))
                return proc
            except (FileNotFoundError, ConnectionRefusedError):
                pass
        assert proc.poll() is None, f"the hostile server exited: {out.read_text()}"
        assert time.monotonic() < deadline, "the hostile server never listened"
        time.sleep(0.05)


@pytest.mark.parametrize(("mode", "every", "limit", "extra"), MATRIX,
                         ids=[m[0] + "".join(m[3]).replace("--", "-") for m in MATRIX])
def test_fio_verify_over_a_hostile_server(tmp_path: Path, mode: str, every: int, limit: int,
                                          extra: tuple[str, ...],
                                          record_property: Callable[[str, object], None]
                                          ) -> None:
    sock, out = tmp_path / "hostile.sock", tmp_path / "hostile.out"
    server = _start(sock, mode, every, limit, extra, out)
    try:
        dev = add("-t", "nbd", f"nbd+unix:///?socket={sock}", "-q", "1",
                  "--reconnect-timeout", "60")
        job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randwrite", "--bsrange=4k-64k",
                  "--iodepth=16", f"--size={SIZE}", "--verify=crc32c", "--verify_fatal=1",
                  "--do_verify=1", "--randseed=7", timeout=300)
        assert job["write"]["io_bytes"] == SIZE  # type: ignore[index]
        delete(dev.dev_id)
        wait_gone(dev.pid, timeout=60)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    counts = dict(kv.split("=") for kv in out.read_text().split()[-2:])
    for key, value in counts.items():  # (the matrix's figures, in the JUnit XML)
        record_property(key, int(value))
    assert int(counts["misbehaved"]) >= 1, f"the server never misbehaved: {out.read_text()}"
