"""An untrusted qcow2 image must not choose which host files the server reads.

Images are made with ``qemu-img create -u`` (the backing name is stored as
given, nothing is opened) and name a secret host file, a symlink out, a
FIFO, a device, or a raw file without a recorded format. Each is refused at
open with one line naming the backing file and the option that allows it;
with that option (where one exists) the same image opens and serves the
backing file's bytes. The policy itself (``aioublk.qcow2.backing_policy``)
is tested without I/O at the end.
"""

from __future__ import annotations

import asyncio
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aioublk.qcow2 import Qcow2Error
from aioublk.qcow2.backing_policy import BackingPolicy
from aioublk.ring import Ring
from tests.qcow2.test_qcow2_malformed import open_in_thread
from tests.support.qcow2_util import qemu_img, qemu_io

SECRET = b"root:$6$not-a-real-hash:19000:0:99999:7:::\n" * 100
EXT_BACKING_FORMAT = struct.pack(">I", 0xE2792ACA)


@dataclass
class Place:
    home: Path     # the directory the image is in
    secret: Path   # a host file outside it (absolute path)


@pytest.fixture
def place(tmp_path: Path) -> Place:
    home, outside = tmp_path / "images", tmp_path / "etc"
    home.mkdir()
    outside.mkdir()
    secret = outside / "shadow"
    secret.write_bytes(SECRET)
    return Place(home, secret)


def image(home: Path, backing: str, fmt: str | None = "raw", name: str = "evil.qcow2") -> Path:
    """A 1 MiB qcow2 image in ``home`` naming ``backing`` (stored as given);
    ``fmt`` None: no backing format extension (as images made before
    qemu-img required -F)."""
    path = home / name
    qemu_img("create", "-q", "-f", "qcow2", "-u", "-b", backing, "-F", fmt or "raw", path, "1M")
    if fmt is None:
        raw = bytearray(path.read_bytes())
        at = raw.index(EXT_BACKING_FORMAT, 0, 4096)
        raw[at:at + 4] = struct.pack(">I", 0x0BAD0BAD)  # an unknown extension: ignored
        path.write_bytes(raw)
    return path


def refused(path: Path, *words: str, **kw: Any) -> str:
    """Open must fail, in one line naming each of ``words``, without a hang."""
    img, exc = open_in_thread(path, read_only=True, **kw)
    if img is not None:
        img.release()
        pytest.fail(f"{path.name} opened with {kw}: its backing file was used")
    assert isinstance(exc, Qcow2Error), f"{path.name}: {exc!r}"
    msg = str(exc)
    assert len(msg.splitlines()) == 1, msg
    for w in words:
        assert w in msg, f"{path.name}: {msg!r} does not name {w!r}"
    return msg


async def served(path: Path, length: int, **kw: Any) -> bytes:
    """Open with ``kw`` and read the first ``length`` bytes of the disk."""
    img, exc = open_in_thread(path, read_only=True, **kw)
    if exc is not None:
        raise exc
    try:
        buf = bytearray(length)
        await asyncio.wait_for(img.read(0, buf), 10)
        return bytes(buf)
    finally:
        await asyncio.wait_for(img.close(), 10)


# ---------------------------------------------------------------- outside the image's directory


@pytest.mark.asyncio
async def test_absolute_name_outside_is_refused(ring: Ring, place: Place) -> None:
    evil = image(place.home, str(place.secret))
    refused(evil, str(place.secret), f"--allow-backing {place.secret} ")
    assert await served(evil, len(SECRET), allow_backing=[str(place.secret.parent)]) == SECRET
    assert await served(evil, len(SECRET), allow_backing=[str(place.secret)]) == SECRET


@pytest.mark.asyncio
async def test_dotdot_name_outside_is_refused(ring: Ring, place: Place) -> None:
    evil = image(place.home, "../etc/shadow")
    refused(evil, "../etc/shadow", str(place.secret), "--allow-backing")
    assert await served(evil, len(SECRET), allow_backing=[str(place.secret.parent)]) == SECRET


@pytest.mark.asyncio
async def test_symlink_out_is_refused(ring: Ring, place: Place) -> None:
    (place.home / "base.raw").symlink_to(place.secret)
    evil = image(place.home, "base.raw")
    refused(evil, "base.raw", str(place.secret), "--allow-backing")
    assert await served(evil, len(SECRET), allow_backing=[str(place.secret.parent)]) == SECRET


def test_refusal_says_nothing_about_existence(place: Place) -> None:
    """Outside the allowed places a missing file is refused like an existing
    one: the refusal is no oracle for the host's files."""
    a = refused(image(place.home, str(place.secret), name="a.qcow2"), "outside")
    b = refused(image(place.home, str(place.secret) + "-nope", name="b.qcow2"), "outside")
    assert a.replace(str(place.home / "a.qcow2"), "") == \
        b.replace(str(place.home / "b.qcow2"), "").replace("shadow-nope", "shadow")


@pytest.mark.asyncio
@pytest.mark.parametrize("spelling", ["absolute", "dotdot", "symlink_inside"])
async def test_names_landing_in_the_image_directory_are_used(ring: Ring, place: Place,
                                                             spelling: str) -> None:
    """Where the name resolves decides, not how it is spelled."""
    base = place.home / "base.raw"
    base.write_bytes(b"base" * 1024)
    if spelling == "symlink_inside":
        (place.home / "link.raw").symlink_to("base.raw")
    name = {"absolute": str(base), "dotdot": "../images/base.raw",
            "symlink_inside": "link.raw"}[spelling]
    assert await served(image(place.home, name), 4096) == b"base" * 1024


def test_subdirectory_is_not_the_image_directory(place: Place) -> None:
    (place.home / "sub").mkdir()
    (place.home / "sub" / "base.raw").write_bytes(bytes(4096))
    refused(image(place.home, "sub/base.raw"), "sub/base.raw", "--allow-backing")


# ---------------------------------------------------------------- not a regular file


@pytest.fixture
def fifo(place: Place) -> Iterator[Path]:
    path = place.home / "base.fifo"
    os.mkfifo(path)
    yield path
    try:  # a reader stuck in open(): a writer lets it go
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader


@pytest.mark.parametrize("fmt", ["raw", None], ids=["raw", "no_format"])
def test_fifo_is_refused_without_hanging(place: Place, fifo: Path, fmt: str | None) -> None:
    evil = image(place.home, fifo.name, fmt)
    refused(evil, fifo.name, "FIFO")
    refused(evil, fifo.name, "FIFO", allow_backing=[str(fifo)], backing_format="raw")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_character_device_is_refused(place: Place, device: str) -> None:
    evil = image(place.home, device)
    refused(evil, device, f"--allow-backing {device} ")
    refused(evil, device, "character device", allow_backing=[device])
    refused(evil, device, "character device", allow_backing=["/dev"])


@pytest.mark.asyncio
async def test_block_device_only_when_named(ring: Ring, place: Place) -> None:
    """A block device (an unattached loop device node: size 0) is used only
    when the user allowed that very path, not its directory."""
    node = place.home / "disk"
    os.mknod(node, stat.S_IFBLK | 0o600, os.makedev(7, 7))
    evil = image(place.home, node.name)
    refused(evil, str(node), "block device", f"--allow-backing {node}")
    refused(evil, str(node), "block device", allow_backing=[str(place.home)])
    assert await served(evil, 4096, allow_backing=[str(node)]) == bytes(4096)


def test_directory_is_refused(place: Place) -> None:
    (place.home / "dir").mkdir()
    refused(image(place.home, "dir"), "dir", "directory")


# ---------------------------------------------------------------- the format is never guessed


@pytest.mark.asyncio
async def test_raw_backing_without_format_needs_the_user(ring: Ring, place: Place) -> None:
    (place.home / "base.raw").write_bytes(b"RAW!" * 1024)
    evil = image(place.home, "base.raw", fmt=None)
    refused(evil, "base.raw", "--backing-format")
    assert await served(evil, 4096, backing_format="raw") == b"RAW!" * 1024


@pytest.mark.asyncio
async def test_qcow2_backing_without_format_needs_the_user(ring: Ring, place: Place) -> None:
    base = place.home / "base.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", base, "1M")
    qemu_io(base, "write -q -P 0x42 0 4096")
    evil = image(place.home, "base.qcow2", fmt=None)
    refused(evil, "base.qcow2", "--backing-format")
    assert await served(evil, 4096, backing_format="qcow2") == b"\x42" * 4096


@pytest.mark.asyncio
async def test_raw_file_that_looks_like_qcow2_stays_raw(ring: Ring, place: Place) -> None:
    """A raw backing file whose bytes are a qcow2 header naming the secret (a
    guest can write that): served as the raw bytes it is, never followed."""
    lure = place.home / "lure.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-u", "-b", str(place.secret), "-F", "raw", lure,
             "1M")
    head = lure.read_bytes()[:4096]
    (place.home / "disk.raw").write_bytes(head)
    lure.unlink()
    assert await served(image(place.home, "disk.raw", fmt="raw"), 4096) == head
    refused(image(place.home, "disk.raw", fmt=None, name="guess.qcow2"), "--backing-format")


def test_unsupported_recorded_format(place: Place) -> None:
    (place.home / "base.vmdk").write_bytes(bytes(4096))
    refused(image(place.home, "base.vmdk", fmt="vmdk"), "base.vmdk", "vmdk")


# ---------------------------------------------------------------- down the chain


@pytest.mark.asyncio
async def test_policy_holds_down_the_chain(ring: Ring, place: Place) -> None:
    """top -> mid.qcow2 (next to it, fine) -> ../etc/shadow (outside)."""
    image(place.home, "../etc/shadow", name="mid.qcow2")
    top = image(place.home, "mid.qcow2", fmt="qcow2", name="top.qcow2")
    refused(top, "../etc/shadow", str(place.secret), "--allow-backing")
    assert await served(top, len(SECRET), allow_backing=[str(place.secret.parent)]) == SECRET


@pytest.mark.asyncio
async def test_allowed_directory_holds_the_rest_of_the_chain(ring: Ring, place: Place) -> None:
    """An image in an allowed directory names its own backing file there."""
    base = place.secret.parent / "base.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-u", "-b", "shadow", "-F", "raw", base, "1M")
    top = image(place.home, str(base), fmt="qcow2")
    refused(top, str(base), "--allow-backing")
    assert await served(top, len(SECRET), allow_backing=[str(place.secret.parent)]) == SECRET


# ---------------------------------------------------------------- the policy, without I/O


POLICY = BackingPolicy(home="/img", allowed=("/srv/base", "/dev/vg/base"), fmt=None)


@pytest.mark.parametrize("real,ok", [
    ("/img/a.raw", True), ("/img/sub/a.raw", False), ("/imgx/a.raw", False),
    ("/srv/base/a.qcow2", True), ("/srv/base/deep/a.qcow2", True), ("/srv/basement", False),
    ("/etc/shadow", False), ("/dev/vg/base", True), ("/dev/vg/other", False),
])
def test_policy_places(real: str, ok: bool) -> None:
    if ok:
        POLICY.check_place("x", real)
    else:
        with pytest.raises(Qcow2Error, match="outside the image's directory /img: .*"
                                             "--allow-backing"):
            POLICY.check_place("x", real)


@pytest.mark.parametrize("mode,real,ok", [
    (stat.S_IFREG, "/img/a", True), (stat.S_IFBLK, "/dev/vg/base", True),
    (stat.S_IFBLK, "/img/sda", False), (stat.S_IFCHR, "/dev/vg/base", False),
    (stat.S_IFIFO, "/img/f", False), (stat.S_IFSOCK, "/img/s", False),
    (stat.S_IFDIR, "/img/d", False), (stat.S_IFLNK, "/img/l", False),
])
def test_policy_kinds(mode: int, real: str, ok: bool) -> None:
    if ok:
        POLICY.check_kind("x", real, mode)
    else:
        with pytest.raises(Qcow2Error, match="backing file"):
            POLICY.check_kind("x", real, mode)


def test_policy_formats() -> None:
    assert POLICY.format("top", "b", "raw") == "raw"
    assert BackingPolicy("/img", fmt="raw").format("top", "b", None) == "raw"
    assert BackingPolicy("/img", fmt="raw").format("top", "b", "qcow2") == "qcow2"
    with pytest.raises(Qcow2Error, match="never guessed: give it with --backing-format"):
        POLICY.format("top", "b", None)
    with pytest.raises(Qcow2Error, match="'vmdk': only qcow2 and raw"):
        POLICY.format("top", "b", "vmdk")
    with pytest.raises(Qcow2Error, match="backing format 'vhd'"):
        BackingPolicy.for_image("/img/top.qcow2", fmt="vhd")


@pytest.mark.parametrize("name", ["nbd:localhost:10809", "json:{}", "https://x/y", "a\0b"])
def test_policy_names_that_are_no_file(name: str) -> None:
    with pytest.raises(Qcow2Error, match="backing file"):
        BackingPolicy.candidate("/img/top.qcow2", name)
