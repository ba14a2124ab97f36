"""Unprivileged devices against the real driver, with the udev rule we ship.

udevd (Debian's, unpacked under the cache by scripts/setup) runs with our
rule only for this module; users 1000 and 1001 are plain uids, made with
setpriv. What a user's commands record and read (its run directory,
chosen at import from its uid and environment) needs a fresh interpreter
started as that user; a refusal that comes first forks from pytest and
drops to the user (kernel.cli's as_uid), since each interpreter costs
10-15 s in the emulated guest.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aioublk.frontend import udev
from aioublk.kernel import uapi
from aioublk.testing.sid import cache_dir
from tests.support import kernel

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

USER, OTHER = 1000, 1001
RULES = Path("/run/udev/rules.d/99-aioublk.rules")
UDEVD_LOG = Path("/tmp/udevd.log")


def _udevadm(*args: str) -> None:
    tree = cache_dir() / "udev"
    env = dict(os.environ, LD_LIBRARY_PATH=str(tree / "usr/lib/x86_64-linux-gnu/systemd"))
    subprocess.run([str(tree / "bin/udevadm"), *args], check=True, timeout=120, env=env,
                   stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def udevd() -> Iterator[None]:
    """udevd with the rule `aioublk udev rules` prints, /dev/ublk-control
    re-triggered so that the rule opens it to everyone; undone afterwards.
    The rule's text without the check of who may change the interpreter: a
    checkout under /tmp (as CI's may be) is refused there, and that check has
    tests of its own (tests/security/test_root_trust.py)."""
    tree = cache_dir() / "udev"
    udevadm = tree / "bin/udevadm"
    assert udevadm.exists(), f"{udevadm} is missing: run scripts/setup"
    RULES.parent.mkdir(parents=True, exist_ok=True)
    RULES.write_text(udev.rule_text(sys.executable))
    env = dict(os.environ, LD_LIBRARY_PATH=str(tree / "usr/lib/x86_64-linux-gnu/systemd"))
    log = UDEVD_LOG.open("w")  # noqa: SIM115 - closed below
    # udevadm is udevd when its argv[0] says so
    proc = subprocess.Popen(["systemd-udevd", "--debug"], executable=str(udevadm), env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not _listening("/run/udev/control"):
            assert proc.poll() is None, _why("udevd exited before it listened", proc)
            assert time.monotonic() < deadline, "udevd did not start in 60 s"
            time.sleep(0.1)
        # --settle waits for this event's own reply from udevd; a bare settle
        # may return before udevd has read the event, or at once if udevd died
        try:
            _udevadm("trigger", "--settle", "--action=add", "--sysname-match=ublk-control")
        except subprocess.SubprocessError as e:
            pytest.fail(_why(f"udevadm trigger: {e}", proc))
        mode = stat.S_IMODE(os.stat("/dev/ublk-control").st_mode)
        assert mode == 0o666, _why(f"the rule left /dev/ublk-control {mode:o}", proc)
        yield
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        RULES.unlink()
        os.chmod("/dev/ublk-control", 0o600)


def _why(what: str, udevd: subprocess.Popen[bytes]) -> str:
    """``what``, with what the guest can tell about udevd's state."""
    free = {line.split(":")[0]: line.split()[1] for line in
            Path("/proc/meminfo").read_text().splitlines()[:3]}
    space = {d: os.statvfs(d) for d in ("/run", "/tmp")}
    return "\n".join([
        what, f"udevd exit status: {udevd.poll()}, memory (kB): {free}",
        *(f"{d}: {s.f_bavail * s.f_frsize >> 20} MiB free" for d, s in space.items()),
        "udevd's log:", UDEVD_LOG.read_text()[-4000:]])


def _listening(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _traversable(path: str) -> bool:
    p = Path(path).absolute()
    return all(os.stat(d).st_mode & 0o001 for d in [p.parent, *p.parent.parents])


def as_user(uid: int, *cmd: str, cwd: Path | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``cmd`` as a plain user: no capabilities, no groups. If the checkout
    is not reachable by other users (a clone under /root), the user may read
    it anyway (CAP_DAC_READ_SEARCH): that grants no write and is not
    CAP_SYS_ADMIN, which is all ublk_drv looks at."""
    pre = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    if not _traversable(sys.executable):
        pre += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd or "/"), "LANG": "C.UTF-8",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return subprocess.run([*pre, *cmd], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env, stdin=subprocess.DEVNULL)


def _one_line_error(p: subprocess.CompletedProcess[str], *words: str) -> str:
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aioublk: "), p.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_a_user_creates_uses_and_deletes_a_device_of_its_own(udevd: None) -> None:
    work = Path(tempfile.mkdtemp(prefix="aioublk-user-"))
    os.chown(work, USER, USER)
    backing = kernel.make_file(work / "disk.img", 64 << 20)
    os.chown(backing, USER, USER)

    p = as_user(USER, *kernel.CLI, "add", "-t", "loop", "--unprivileged", "-q", "2",
                "--log-file", str(work / "server.log"), str(backing), cwd=work)
    assert p.returncode == 0, (p.stderr, (work / "server.log").read_text())
    (dev,) = kernel.parse_list(p.stdout)
    assert dev.state == "LIVE" and dev.flags & uapi.Feature.UNPRIVILEGED_DEV, p.stdout
    n = dev.dev_id
    # the rule handed both nodes to their creator, for it alone, before add
    # said the device was ready
    for node in (f"/dev/ublkc{n}", f"/dev/ublkb{n}"):
        st = os.stat(node)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (USER, USER, 0o600), node

    fio = as_user(USER, "fio", "--name=v", f"--filename=/dev/ublkb{n}", "--ioengine=io_uring",
                  "--direct=1", "--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=16M",
                  "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", cwd=work)
    assert fio.returncode == 0, fio.stdout + fio.stderr
    listed = as_user(USER, *kernel.CLI, "list", "-n", str(n), cwd=work)
    assert listed.returncode == 0, listed.stderr
    (mine,) = kernel.parse_list(listed.stdout)
    assert (mine.state, mine.target) == ("LIVE", f"loop file {backing}"), listed.stdout

    # another user can neither delete it nor read it
    _one_line_error(kernel.cli("del", "-n", str(n), cwd=work, as_uid=OTHER, check=False),
                    f"device {n}", "not yours")
    dd = as_user(OTHER, "dd", f"if=/dev/ublkb{n}", "of=/dev/null", "bs=4k", "count=1")
    assert dd.returncode != 0, dd.stderr

    # its owner deletes it; the server exits
    gone = as_user(USER, *kernel.CLI, "del", "-n", str(n), cwd=work)
    assert gone.returncode == 0, gone.stderr
    kernel.wait_gone(dev.pid)
    assert all(d.dev_id != n for d in kernel.listing())


def test_the_kernels_request_timeout_kills_a_server_that_never_answers(udevd: None) -> None:
    """A request of an unprivileged device that is never answered (the
    error filter's ``hang``): at the queue's io_timeout ublk_drv's timeout
    handler kills the server (it does so for unprivileged devices only), so
    the reader gets an I/O error instead of waiting forever. The range
    spares the blocks the kernel's partition scan reads."""
    work = Path(tempfile.mkdtemp(prefix="aioublk-user-"))
    os.chown(work, USER, USER)
    p = as_user(USER, *kernel.CLI, "add", "-t", "null", "--unprivileged", "-q", "1",
                "--filter", "error:ops=read,offset=1M,length=1M,hang=true",
                "--log-file", str(work / "server.log"), cwd=work)
    assert p.returncode == 0, (p.stderr, (work / "server.log").read_text())
    (dev,) = kernel.parse_list(p.stdout)
    n = dev.dev_id
    Path(f"/sys/block/ublkb{n}/queue/io_timeout").write_text("2000")  # ms
    t0 = time.monotonic()
    dd = as_user(USER, "dd", f"if=/dev/ublkb{n}", "of=/dev/null", "bs=4k", "count=1",
                 "skip=256", "iflag=direct", timeout=120)
    assert dd.returncode != 0 and "Input/output error" in dd.stderr, dd.stderr
    assert time.monotonic() - t0 >= 2.0  # held until the timeout, not refused
    kernel.wait_gone(dev.pid, 60)
    listed = as_user(USER, *kernel.CLI, "list", "-n", str(n), cwd=work)
    (after,) = kernel.parse_list(listed.stdout)
    assert after.state == "DEAD", listed.stdout
    gone = as_user(USER, *kernel.CLI, "del", "-n", str(n), cwd=work)
    assert gone.returncode == 0, gone.stderr


def test_what_needs_root_is_refused_in_one_line(udevd: None) -> None:
    work = Path(tempfile.mkdtemp(prefix="aioublk-user-"))
    os.chown(work, USER, USER)
    _one_line_error(as_user(USER, *kernel.CLI, "add", "-t", "null", cwd=work),
                    "needs root", "--unprivileged")
    for refused in (["-z"], ["-r", "1"]):
        _one_line_error(kernel.cli("add", "-t", "null", "--unprivileged", *refused, cwd=work,
                                   as_uid=USER, check=False), "needs root")
    # root asking for an unprivileged device would silently get a privileged one
    p = kernel.cli("add", "-t", "null", "--unprivileged", check=False)
    _one_line_error(p, "--unprivileged", "CAP_SYS_ADMIN")
    # and the helper the rule runs leaves root's devices alone
    dev = kernel.add("-t", "null", "-q", "1")
    try:
        owner = kernel.cli("udev", "owner", f"ublkb{dev.dev_id}", check=False)
        assert (owner.returncode, owner.stdout) == (1, ""), owner
    finally:
        kernel.delete(dev.dev_id)
