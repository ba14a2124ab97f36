"""A throwaway one-node Ceph cluster for the rbd target's tests, on the host
and in the guest: one monitor and one memstore OSD on 127.0.0.1, no
authentication, everything (config, keyrings, data, sockets, logs) under one
temporary directory that ``stop`` removes.

No manager: pool creation, ``rbd create``, I/O, snapshots and ``rbd du``
(which walks the image's objects itself) need only the monitor and the OSD.

    with Cluster() as c, c.image("img", 64 << 20) as spec:   # c.conf: its ceph.conf
        ...
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: bytes of the OSD's in-memory store
MEMSTORE_BYTES = 1 << 30
POOL = "rbd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Cluster:
    """Start with ``start()`` (or ``with``); ``stop()`` kills it and removes its files."""

    def __init__(self, memstore_bytes: int = MEMSTORE_BYTES) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="aioublk-ceph-"))
        self.conf = str(self.dir / "ceph.conf")
        self.ports = (_free_port(), _free_port())  # msgr2, msgr1
        self.fsid = str(uuid.uuid4())
        self.memstore_bytes = memstore_bytes
        self.procs: list[subprocess.Popen[bytes]] = []
        self.startup_seconds = 0.0

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def mon_addrs(self) -> str:
        v2, v1 = self.ports
        return f"[v2:127.0.0.1:{v2},v1:127.0.0.1:{v1}]"

    def _write_conf(self) -> None:
        d = self.dir
        (d / "mon").mkdir()
        (d / "osd").mkdir()
        (d / "run").mkdir()
        (d / "log").mkdir()
        (d / "ceph.conf").write_text(f"""[global]
fsid = {self.fsid}
mon host = {self.mon_addrs}
ms bind ipv4 = true
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
run dir = {d}/run
admin socket = {d}/run/$name.asok
log file = {d}/log/$name.log
keyring = {d}/keyring
pid file = {d}/run/$name.pid
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
client mount timeout = 15
rados osd op timeout = 15

[mon]
mon data = {d}/mon
mon cluster log file = {d}/log/cluster.log

[osd]
public addr = 127.0.0.1
osd data = {d}/osd
osd objectstore = memstore
memstore device bytes = {self.memstore_bytes}
osd max object name len = 256
osd max object namespace len = 64
""")
        (d / "keyring").write_text("")

    def _spawn(self, *argv: str) -> None:
        self.procs.append(subprocess.Popen(
            [*argv, "-c", self.conf, "-f"], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))

    def ceph(self, *args: str, timeout: float = 60) -> str:
        """``ceph ARGS`` against this cluster; its output."""
        return self._run("ceph", "--connect-timeout", "30", *args, timeout=timeout)

    def rbd(self, *args: str, timeout: float = 60) -> str:
        """``rbd ARGS`` against this cluster; its output."""
        return self._run("rbd", *args, timeout=timeout)

    def _run(self, *argv: str, timeout: float) -> str:
        out = subprocess.run([*argv, "-c", self.conf], capture_output=True, timeout=timeout,
                             text=True, stdin=subprocess.DEVNULL)
        if out.returncode:
            raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or out.returncode}")
        return out.stdout

    @contextmanager
    def image(self, name: str, size: int) -> Iterator[str]:
        """A new image ``rbd/NAME`` of ``size`` bytes (whole MiB) as its spec;
        removed after, with its snapshots."""
        spec = f"{POOL}/{name}"
        self.rbd("create", "--size", f"{size >> 20}M", spec)
        try:
            yield spec
        finally:
            self.rbd("snap", "purge", "--no-progress", spec)
            self.rbd("rm", "--no-progress", spec)

    def start(self, timeout: float = 300) -> None:
        """Make and start the monitor and the OSD, then the ``rbd`` pool."""
        began = time.monotonic()
        self._write_conf()
        monmap = str(self.dir / "monmap")
        subprocess.run(["monmaptool", "--create", "--fsid", self.fsid, "--addv", "a",
                        self.mon_addrs, monmap], check=True, capture_output=True, timeout=timeout)
        subprocess.run(["ceph-mon", "-c", self.conf, "--mkfs", "-i", "a", "--monmap", monmap],
                       check=True, capture_output=True, timeout=timeout)
        self._spawn("ceph-mon", "-i", "a")
        osd_id = self.ceph("osd", "create", timeout=timeout).strip()
        subprocess.run(["ceph-osd", "-c", self.conf, "--mkfs", "-i", osd_id], check=True,
                       capture_output=True, timeout=timeout)
        self._spawn("ceph-osd", "-i", osd_id)
        deadline = time.monotonic() + timeout
        while '"num_up_osds":1' not in self.ceph("osd", "stat", "-f", "json").replace(" ", ""):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"ceph-osd did not come up: see {self.dir}/log")
            time.sleep(0.2)
        self.ceph("osd", "pool", "create", POOL, "8", timeout=timeout)
        self.rbd("pool", "init", POOL, timeout=timeout)
        self.startup_seconds = time.monotonic() - began

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
