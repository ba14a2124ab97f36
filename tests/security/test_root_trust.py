"""What root trusts: backing files opened as checked, the udev rule's
interpreter, the serve config's owner, the log file's name.

The tests run as root: files of another user are made with ``os.chown``
(uid 1000), a shared directory with mode 1777. A race is made by a hook
that changes the file system between the policy's check and the open.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aioublk import logs
from aioublk.errors import UblkError
from aioublk.frontend import cli, config, udev
from aioublk.qcow2 import Qcow2Error
from aioublk.qcow2.backing_policy import BackingPolicy
from aioublk.ring import Ring
from tests.qcow2.test_qcow2_untrusted import image, refused, served

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
@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A directory like /tmp: world-writable and sticky."""
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    return d


def test_root_image_may_not_name_a_users_file(tmp_path: Path) -> None:
    """A root-owned image naming a uid-1000 file next to it (krb5cc_1000)."""
    write(tmp_path / "krb5cc_1000", OTHER, uid=USER)
    refused(image(tmp_path, "krb5cc_1000"), "krb5cc_1000", "uid 1000", "--allow-backing")


@pytest.mark.asyncio
async def test_users_image_may_name_its_own_or_roots_file(ring: Ring, tmp_path: Path) -> None:
    write(tmp_path / "mine.raw", OTHER, uid=USER)
    write(tmp_path / "root.raw", BASE)
    top = image(tmp_path, "mine.raw", name="a.qcow2")
    os.chown(top, USER, USER)
    assert await served(top, 4096) == OTHER
    top = image(tmp_path, "root.raw", name="b.qcow2")
    os.chown(top, USER, USER)
    assert await served(top, 4096) == BASE


@pytest.mark.asyncio
async def test_users_file_only_when_named(ring: Ring, tmp_path: Path) -> None:
    """An allowed directory does not lift the owner rule; the file itself does."""
    write(tmp_path / "krb5cc_1000", OTHER, uid=USER)
    evil = image(tmp_path, "krb5cc_1000")
    refused(evil, "uid 1000", allow_backing=[str(tmp_path)])
    assert await served(evil, 4096, allow_backing=[str(tmp_path / "krb5cc_1000")]) == OTHER


def test_shared_directory_allows_another_users_file_never(shared: Path) -> None:
    write(shared / "krb5cc_1000", OTHER, uid=USER)
    refused(image(shared, "krb5cc_1000"), "krb5cc_1000")
    refused(image(shared, "krb5cc_1000"), "krb5cc_1000", allow_backing=[str(shared)])


@pytest.mark.asyncio
async def test_shared_directory_allows_nothing_unless_named(ring: Ring, shared: Path) -> None:
    """Even root's own file in a 1777 directory: anyone may have put it there."""
    write(shared / "base.raw", BASE)
    evil = image(shared, "base.raw")
    refused(evil, "base.raw", "anyone may write", f"--allow-backing {shared / 'base.raw'}")
    assert await served(evil, 4096, allow_backing=[str(shared)]) == BASE
    assert await served(evil, 4096, allow_backing=[str(shared / "base.raw")]) == BASE


def test_policy_owners() -> None:
    policy = BackingPolicy(home="/img", allowed=("/srv/base", "/srv/one.raw"))
    policy.check_owner("x", "/img/a", 0, image_uid=USER)
    policy.check_owner("x", "/img/a", USER, image_uid=USER)
    policy.check_owner("x", "/srv/one.raw", USER, image_uid=0)
    for real in ("/img/a", "/srv/base/a"):
        with pytest.raises(Qcow2Error, match="owned by uid 1000"):
            policy.check_owner("x", real, USER, image_uid=0)


def test_policy_directories() -> None:
    policy = BackingPolicy(home="/tmp", allowed=("/srv/base",))
    policy.check_dir("x", "/tmp/a", stat.S_IFDIR | 0o755)
    policy.check_dir("x", "/srv/base/a", stat.S_IFDIR | 0o1777)
    for mode in (0o1777, 0o777):
        with pytest.raises(Qcow2Error, match="anyone may write"):
            policy.check_dir("x", "/tmp/a", stat.S_IFDIR | mode)


# ---------------------------------------------------------------- 8: the udev rule's interpreter


def fake_python(d: Path, uid: int = 0, mode: int = 0o755) -> Path:
    """A file standing for an interpreter (never run), in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    path = d / "python3"
    path.write_text("#!/bin/sh\n")
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("uid,mode,why", [
    (USER, 0o755, "owned by uid 1000"),
    (0, 0o757, "writable by others"),
    (0, 0o775, "writable by others"),  # (its group is not root's: chown 0:1000 below)
])
def test_udev_rule_refuses_an_interpreter_others_can_change(tmp_path: Path, uid: int,
                                                            mode: int, why: str) -> None:
    python = fake_python(tmp_path / "venv" / "bin", uid, mode)
    if mode & 0o020:
        os.chown(python, 0, USER)
    with pytest.raises(UblkError, match=f"{python} is {why}") as e:
        udev.rules(str(python))
    assert len(str(e.value).splitlines()) == 1


def test_udev_rule_refuses_an_interpreter_in_a_users_directory(tmp_path: Path) -> None:
    python = fake_python(tmp_path / "home" / "bin")
    os.chown(tmp_path / "home", USER, USER)
    with pytest.raises(UblkError, match=f"{tmp_path / 'home'} is owned by uid 1000"):
        udev.rules(str(python))


def test_udev_rule_follows_symlinks_through_users_directories(tmp_path: Path) -> None:
    """A root-owned name that is a symlink into a user's directory."""
    python = fake_python(tmp_path / "home" / "bin")
    os.chown(tmp_path / "home" / "bin", USER, USER)
    (tmp_path / "usr").mkdir()
    (tmp_path / "usr" / "python3").symlink_to(python)
    with pytest.raises(UblkError, match=f"{tmp_path / 'home' / 'bin'} is owned by uid 1000"):
        udev.rules(str(tmp_path / "usr" / "python3"))


def test_udev_rule_refuses_a_package_others_can_change(tmp_path: Path) -> None:
    pkg = tmp_path / "site-packages" / "aioublk"
    pkg.mkdir(parents=True)
    write(pkg / "__init__.py", b"", uid=0)
    write(pkg / "udev.py", b"", uid=USER)
    with pytest.raises(UblkError, match=f"{pkg / 'udev.py'} is owned by uid 1000"):
        udev.check_trusted(sys.executable, str(pkg))


def test_udev_rule_is_isolated_for_roots_interpreter() -> None:
    """This interpreter and package are root's here (the tests run as root)."""
    rule = udev.rules(sys.executable)
    assert f'PROGRAM="{sys.executable} -I -m aioublk udev owner %k"' in rule


def test_udev_rules_refusal_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "executable", str(fake_python(tmp_path / "bin", USER)))
    assert cli.main(["udev", "rules"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and "uid 1000" in err and "root" in err, err


# ---------------------------------------------------------------- 14: who counts as root


@pytest.mark.parametrize("euid,cap,privileged", [
    (0, True, True), (0, False, True), (USER, True, True), (USER, False, False),
])
def test_privilege_is_the_capability_not_the_uid(euid: int, cap: bool,
                                                 privileged: bool) -> None:
    assert config.privileged(euid=euid, cap_sys_admin=cap) is privileged


@pytest.fixture
def with_cap_sys_admin_as_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service user with CAP_SYS_ADMIN (AmbientCapabilities=CAP_SYS_ADMIN)."""
    monkeypatch.setattr("os.geteuid", lambda: USER)
    monkeypatch.setattr("aioublk.kernel.control.has_cap_sys_admin", lambda: True)


@pytest.mark.parametrize("mode,uid", [(0o666, USER), (0o644, 4321)])
def test_config_trust_is_checked_with_cap_sys_admin(
        tmp_path: Path, with_cap_sys_admin_as_user: None, mode: int, uid: int) -> None:
    cfg = tmp_path / "serve.toml"
    cfg.write_text('[[devices]]\ntarget = "null"\n')
    os.chown(cfg, uid, uid)
    cfg.chmod(mode)
    with pytest.raises(config.ConfigError, match="CAP_SYS_ADMIN") as e:
        config.load(str(cfg))
    assert len(str(e.value).splitlines()) == 1


def test_config_of_the_capable_user_itself_is_accepted(
        tmp_path: Path, with_cap_sys_admin_as_user: None) -> None:
    cfg = tmp_path / "serve.toml"
    cfg.write_text('[[devices]]\ntarget = "null"\n')
    os.chown(cfg, USER, USER)
    cfg.chmod(0o644)
    assert len(config.load(str(cfg)).devices) == 1


# ---------------------------------------------------------------- 14: the log file's name


def test_log_file_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    """Root appends to --log-file: a symlink planted at that name (in /tmp,
    say) must not make it append to the file the link names."""
    victim = write(tmp_path / "shadow", b"root:x:0:\n")
    (tmp_path / "aioublk.log").symlink_to(victim)
    with pytest.raises(logs.LogFileError, match="symlink") as e:
        logs.open_log_file(str(tmp_path / "aioublk.log"))
    assert len(str(e.value).splitlines()) == 1
    assert victim.read_bytes() == b"root:x:0:\n"


def test_log_file_is_created_and_appended(tmp_path: Path) -> None:
    path = tmp_path / "aioublk.log"
    for line in (b"one\n", b"two\n"):
        fd = logs.open_log_file(str(path))
        os.write(fd, line)
        os.close(fd)
    assert path.read_bytes() == b"one\ntwo\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 & ~_umask()


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_udev_rule_passes_through_a_sticky_directory_only(tmp_path: Path) -> None:
    """A checkout under /tmp: a sticky world-writable directory on the way is safe
    (others cannot replace the root-owned entry the walk goes on to); the same
    directory without the sticky bit is not."""
    from aioublk.frontend import udev

    shared = tmp_path / "shared"
    (shared / "pkg").mkdir(parents=True)
    shared.chmod(0o1777)
    udev.check_trusted(sys.executable, str(shared / "pkg"))
    shared.chmod(0o777)
    with pytest.raises(UblkError, match="shared is writable by others"):
        udev.check_trusted(sys.executable, str(shared / "pkg"))
