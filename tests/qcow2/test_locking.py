"""Image locking against the real QEMU tools: aioublk takes QEMU's OFD lock
bytes, so an image served by aioublk and one opened by ``qemu-io`` or
``qemu-img`` exclude each other, and two aioublk servers of one file too."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from aioublk.errors import UblkError
from aioublk.frontend.config import ConfigError, load
from aioublk.frontend.registry import build_target
from aioublk.io import locking
from aioublk.qcow2 import Qcow2Error
from aioublk.target import Target
from aioublk.targets import BackingError, LoopTarget, StripeTarget
from aioublk.targets.qcow2 import Qcow2Target

IN_USE = re.escape("is in use by another process (QEMU or aioublk)")


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal is retried for a moment (a server that just died); not here."""
    monkeypatch.setattr(locking, "GRACE", 0.0)


def qcow2(path: Path, *extra: str) -> str:
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", *extra, str(path), "4M"],
                   check=True)
    return str(path)


@contextmanager
def qemu_io(path: str, *opts: str) -> Iterator[subprocess.Popen[str]]:
    """``qemu-io`` holding ``path`` open (interactive, commands on a pipe):
    returns once it has opened the image and read from it."""
    p = subprocess.Popen(["qemu-io", *opts, path], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdin is not None and p.stdout is not None
    try:
        p.stdin.write("read 0 512\n")
        p.stdin.flush()
        seen = []
        for line in p.stdout:
            seen.append(line)
            if "read 512/512" in line:
                break
        else:
            raise AssertionError(f"qemu-io did not open {path}: {''.join(seen)}")
        yield p
    finally:
        p.stdin.close()
        p.wait(timeout=30)


def tool(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)


@contextmanager
def held(target: Target) -> Iterator[Target]:
    try:
        yield target
    finally:
        target.close()


def test_two_servers_of_one_image(tmp_path: Path) -> None:
    img = qcow2(tmp_path / "x.qcow2")
    with held(Qcow2Target(img)), pytest.raises(Qcow2Error, match=IN_USE):
        Qcow2Target(img)
    with held(Qcow2Target(img)):  # released with the first
        pass


def test_readers_coexist_but_not_with_a_writer(tmp_path: Path) -> None:
    img = qcow2(tmp_path / "x.qcow2")
    with (held(Qcow2Target(img, read_only=True)), held(Qcow2Target(img, read_only=True)),
          pytest.raises(Qcow2Error, match=IN_USE)):
        Qcow2Target(img)
    with held(Qcow2Target(img)), pytest.raises(Qcow2Error, match="--read-only --force-share"):
        Qcow2Target(img, read_only=True)


def test_qemu_io_writer_refuses_aioublk(tmp_path: Path) -> None:
    img = qcow2(tmp_path / "x.qcow2")
    with qemu_io(img):
        with pytest.raises(Qcow2Error) as e:
            Qcow2Target(img)
        assert str(e.value) == (f"{img} is in use by another process (QEMU or aioublk): "
                                "stop it first, or use --read-only --force-share")
        with pytest.raises(Qcow2Error, match=IN_USE):
            Qcow2Target(img, read_only=True)
        # QEMU's -U: a reader that shares everything may look
        with locking.force_share(), held(Qcow2Target(img, read_only=True)) as t:
            assert t.geometry.size == 4 << 20


def test_qemu_io_reader_refuses_an_aioublk_writer_only(tmp_path: Path) -> None:
    img = qcow2(tmp_path / "x.qcow2")
    with qemu_io(img, "-r"):
        with pytest.raises(Qcow2Error, match=IN_USE):
            Qcow2Target(img)
        with held(Qcow2Target(img, read_only=True)):
            pass


def test_aioublk_writer_refuses_qemu_tools(tmp_path: Path) -> None:
    img = qcow2(tmp_path / "x.qcow2")
    with held(Qcow2Target(img)):
        w = tool("qemu-io", "-c", "write 0 4k", img)
        assert 'Failed to get "write" lock' in w.stdout + w.stderr, w
        s = tool("qemu-img", "snapshot", "-c", "s1", img)
        assert s.returncode != 0 and "lock" in s.stderr, s
        i = tool("qemu-img", "info", img)  # a reader, not sharing write
        assert i.returncode != 0 and 'Failed to get shared "write" lock' in i.stderr, i
        assert tool("qemu-img", "info", "-U", img).returncode == 0
    assert tool("qemu-io", "-c", "write 0 4k", img).returncode == 0


def test_aioublk_reader_lets_qemu_readers_in(tmp_path: Path) -> None:
    img = qcow2(tmp_path / "x.qcow2")
    with held(Qcow2Target(img, read_only=True)):
        assert tool("qemu-img", "info", img).returncode == 0
        w = tool("qemu-io", "-c", "write 0 4k", img)
        assert 'Failed to get "write" lock' in w.stdout + w.stderr, w


def test_backing_file_is_locked_for_reading(tmp_path: Path) -> None:
    base = qcow2(tmp_path / "base.qcow2")
    top = qcow2(tmp_path / "top.qcow2", "-b", base, "-F", "qcow2")
    with held(Qcow2Target(top)):
        w = tool("qemu-io", "-c", "write 0 4k", base)
        assert 'Failed to get "write" lock' in w.stdout + w.stderr, w
        assert tool("qemu-img", "info", base).returncode == 0  # readers share it
    with qemu_io(base), pytest.raises(Qcow2Error, match=IN_USE):
        Qcow2Target(top)


def test_loop_file_locks(tmp_path: Path) -> None:
    raw = tmp_path / "disk.img"
    raw.write_bytes(bytes(1 << 20))
    with held(LoopTarget(str(raw))):
        with pytest.raises(BackingError, match=IN_USE):
            LoopTarget(str(raw), read_only=True)
        w = tool("qemu-io", "-f", "raw", "-c", "write 0 4k", str(raw))
        assert 'Failed to get "write" lock' in w.stdout + w.stderr, w
    with qemu_io(str(raw), "-f", "raw"):
        with pytest.raises(BackingError, match=IN_USE):
            LoopTarget(str(raw))
        with locking.force_share(), held(LoopTarget(str(raw), read_only=True)):
            pass


def test_stripe_files_locked(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for p in (a, b):
        p.write_bytes(bytes(256 << 10))
    with held(LoopTarget(str(b))), pytest.raises(BackingError, match=IN_USE):
        StripeTarget([str(a), str(b)])
    with held(StripeTarget([str(a), str(b)])):  # the refused one released a
        pass


def test_force_share_is_for_readers(tmp_path: Path) -> None:
    img = qcow2(tmp_path / "x.qcow2")
    with pytest.raises(UblkError, match="force_share needs read_only"):
        build_target("qcow2", {"image": img}, force_share=True)
    with qemu_io(img), held(build_target("qcow2", {"image": img}, read_only=True,
                                          force_share=True)):
        pass


def test_cli_refusal_is_one_line(tmp_path: Path) -> None:
    img = qcow2(tmp_path / "x.qcow2")
    with qemu_io(img):
        p = subprocess.run([sys.executable, "-m", "aioublk", "add", "-t", "qcow2",
                            "--foreground", img], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    assert p.returncode != 0
    assert p.stderr == (f"aioublk: {img} is in use by another process (QEMU or aioublk): "
                        "stop it first, or use --read-only --force-share\n")


def test_config_force_share_key(tmp_path: Path) -> None:
    img = qcow2(tmp_path / "x.qcow2")
    cfg = tmp_path / "c.toml"
    body = '[[devices]]\ntarget = "qcow2"\nforce_share = true\noptions = { image = "x.qcow2" }\n'
    cfg.write_text(body)
    with pytest.raises(ConfigError, match=r"devices\[0\]\.force_share: needs read_only = true"):
        load(str(cfg))
    cfg.write_text(body + "read_only = true\n")
    spec = load(str(cfg)).devices[0]
    with qemu_io(img), held(spec.build_target()):
        assert spec.force_share


def test_qemu_nbd_server_refuses_aioublk(tmp_path: Path) -> None:
    img = qcow2(tmp_path / "x.qcow2")
    sock = tmp_path / "nbd.sock"
    nbd = subprocess.Popen(["qemu-nbd", "-f", "qcow2", "-k", str(sock), img],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():  # qemu-nbd opens the image before it listens
            assert nbd.poll() is None and time.monotonic() < deadline, nbd.stderr
            time.sleep(0.05)
        with pytest.raises(Qcow2Error, match=IN_USE):
            Qcow2Target(img)
    finally:
        nbd.terminate()
        nbd.wait(timeout=30)
    with held(Qcow2Target(img)):
        pass
