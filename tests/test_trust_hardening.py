"""What root trusts: backing files opened as checked, the udev rule's
interpreter, the serve config's owner, the log file's name.

The tests run as root: files of another user are made with ``os.chown``
(uid 1000), a shared directory with mode 1777. A race is made by a hook
that changes the file system between the policy's check and the open.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aioublk.qcow2.backing_policy import BackingPolicy
from aioublk.ring import Ring
from tests.test_qcow2_untrusted import image, refused, served

USER = 1000
BASE = b"BASE" * 1024
OTHER = b"USER" * 1024


def write(path: Path, data: bytes, uid: int = 0) -> Path:
    path.write_bytes(data)
    os.chown(path, uid, uid)
    return path


# ---------------------------------------------------------------- 6: the check and the open


@pytest.fixture
def after_check(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Callable[[], None]]]:
    """Hooks run once, right after the policy passed a backing file's kind
    (its lstat) and before the file is opened."""
    hooks: list[Callable[[], None]] = []
    checked = BackingPolicy.check_kind

    def check_kind(self: BackingPolicy, name: str, real: str, mode: int) -> None:
        checked(self, name, real, mode)
        while hooks:
            hooks.pop()()
    monkeypatch.setattr(BackingPolicy, "check_kind", check_kind)
    yield hooks


@pytest.mark.asyncio
async def test_file_swapped_after_the_check_is_refused(ring: Ring, tmp_path: Path,
                                                       after_check: list[Any]) -> None:
    """The opened file must be the inode that was checked."""
    write(tmp_path / "base.raw", BASE)
    write(tmp_path / "other.raw", OTHER)
    evil = image(tmp_path, "base.raw")
    after_check.append(lambda: os.replace(tmp_path / "other.raw", tmp_path / "base.raw"))
    refused(evil, "base.raw", "changed")
    assert await served(evil, 4096) == OTHER  # (nothing stays refused without a race)


@pytest.mark.asyncio
async def test_directory_swapped_for_a_symlink_after_the_check_is_refused(
        ring: Ring, tmp_path: Path, after_check: list[Any]) -> None:
    """O_NOFOLLOW covers the last component only: a directory of the path
    made a symlink after the check must not lead the open elsewhere."""
    home, allowed, outside = tmp_path / "img", tmp_path / "allowed", tmp_path / "outside"
    for d in (home, allowed / "sub", outside):
        d.mkdir(parents=True)
    write(allowed / "sub" / "base.raw", BASE)
    write(outside / "base.raw", OTHER)
    evil = image(home, str(allowed / "sub" / "base.raw"))

    def swap() -> None:
        os.rename(allowed / "sub", tmp_path / "was-sub")
        (allowed / "sub").symlink_to(outside)
    after_check.append(swap)
    refused(evil, "base.raw", allow_backing=[str(allowed)])
