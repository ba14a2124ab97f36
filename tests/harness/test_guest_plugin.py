"""The guest harness's rule (host, no kernel): a `guest` test that skips
fails, because a skipped kernel test hides a broken harness or driver.

Each case runs pytest on a tiny test file in a subprocess, with our plugin:
with `/dev/ublk-control` made to look present (the tests run in place, as
they do inside the guest), and through the host's guest proxies with a fake
"guest" that runs the same pytest on the host. The plugin reaches a
project through its pytest11 entry point alone; the kernel and accelerator
options are followed as far as vng's command line, never to a boot."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from xml.etree import ElementTree

import pytest

from aioublk.testing import guest
from aioublk.testing.sid import SetupError

CONFTEST = """
from pathlib import Path
from xml.etree import ElementTree

import pytest
from aioublk.testing import pytest_plugin
pytest_plugin.UBLK_CONTROL = Path("/")  # "the driver is here": run guest tests in place
"""

TESTS = '''
import pytest

guest = pytest.mark.guest


@pytest.fixture
def needs_something():
    pytest.skip("no fio")


@guest
def test_skip_in_call():
    pytest.skip("no zstd")


@guest
@pytest.mark.skipif(True, reason="kernel too old")
def test_skipif_marker():
    pass


@guest
def test_skip_in_fixture(needs_something):
    pass


@guest
def test_importorskip():
    pytest.importorskip("no_such_module_here")


@guest
def test_passes():
    pass


@guest
@pytest.mark.xfail(reason="known bug", strict=True)
def test_xfail():
    assert False


def test_host_skip_stays_a_skip():
    pytest.skip("not a guest test")
'''


FAKE_GUEST = """
import os
import subprocess
from pathlib import Path
from aioublk.testing import guest, pytest_plugin

if os.environ.get("FAKE_GUEST_INSIDE"):
    pytest_plugin.UBLK_CONTROL = Path("/")  # "the driver is here": run guest tests in place
else:
    pytest_plugin.UBLK_CONTROL = Path("/nonexistent/ublk-control")

    class Kernel:
        release = "fake"

    def run_in_guest(argv, rwdirs, *, env, on_output, cwd, **kw):
        p = subprocess.run(argv, env={**os.environ, **env, "FAKE_GUEST_INSIDE": "1"},
                           cwd=cwd, capture_output=True, stdin=subprocess.DEVNULL)
        on_output(p.stdout + p.stderr)
        return p.returncode

    guest.ensure_kernel = lambda: Kernel()
    guest.run_in_guest = run_in_guest
"""


def run_pytest(tmp_path: Path, conftest: str = CONFTEST,
               tests: str = TESTS) -> tuple[dict[str, str], str]:
    """Outcome of each test (node name -> passed/failed/error/skipped/xfailed)."""
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_tiny.py").write_text(tests)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.xml"
    p = subprocess.run(
        [sys.executable, "-m", "pytest",
         "-p", "no:cacheprovider", "--strict-markers", "-rA", f"--junitxml={report}",
         str(tmp_path / "test_tiny.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        env={**os.environ, "AIOUBLK_CACHE": str(tmp_path / "cache")})
    assert p.returncode in (0, 1), p.stdout + p.stderr
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        kinds = [c for c in case if c.tag in ("failure", "error", "skipped")]
        kind = kinds[0].tag if kinds else "passed"
        if kind == "skipped" and kinds[0].get("type") == "pytest.xfail":
            kind = "xfailed"
        outcomes[case.get("name", "")] = kind
    return outcomes, p.stdout


@pytest.mark.parametrize("where", ["in_place", "through_the_proxies"])
def test_a_guest_test_that_skips_fails(tmp_path: Path, where: str) -> None:
    out, stdout = run_pytest(tmp_path, CONFTEST if where == "in_place" else FAKE_GUEST)
    assert out == {
        "test_skip_in_call": "failure",
        "test_skipif_marker": "error",
        "test_skip_in_fixture": "error",
        "test_importorskip": "failure",
        "test_passes": "passed",
        "test_xfail": "xfailed",
        "test_host_skip_stays_a_skip": "skipped",
    }, stdout
    assert "a guest test must not skip" in stdout and "no zstd" in stdout, stdout


HANG_TESTS = '''
import os
import threading

import pytest


@pytest.mark.guest
def test_before():
    pass


@pytest.mark.guest(timeout=1)
def test_hangs_where_no_exception_reaches():
    threading.Event().wait()  # as a request stuck in the kernel would


@pytest.mark.guest
def test_after():
    assert os.environ.get("FAKE_GUEST_INSIDE")
'''


def test_a_hung_guest_test_fails_alone_and_the_rest_run_in_a_new_boot(tmp_path: Path) -> None:
    """The guest's watchdog ends the overtime test (report, stacks, exit) and the host
    boots again for the tests it had not reached."""
    out, stdout = run_pytest(tmp_path, FAKE_GUEST, HANG_TESTS)
    assert out == {"test_before": "passed", "test_hangs_where_no_exception_reaches": "failure",
                   "test_after": "passed"}, stdout
    assert "outlived its limit of 1 s" in stdout, stdout
    assert "threading.Event().wait()" in stdout or "in wait" in stdout, stdout  # its stack
    assert "(boot 2: the tests left)" in stdout, stdout
    assert "3 of 3 guest tests reported" in stdout and "2 boots" in stdout, stdout


def test_a_guest_that_dies_blames_the_running_test(tmp_path: Path) -> None:
    """A guest that dies with no report for the running test (a kernel hang, a crash):
    that test fails, saying so, and the tests after it still run."""
    tests = HANG_TESTS.replace("@pytest.mark.guest(timeout=1)", "@pytest.mark.guest") \
        .replace("threading.Event().wait()  # as a request stuck in the kernel would",
                 "os._exit(125)  # as a guest that crashes")
    out, stdout = run_pytest(tmp_path, FAKE_GUEST, tests)
    assert out == {"test_before": "passed", "test_hangs_where_no_exception_reaches": "failure",
                   "test_after": "passed"}, stdout
    assert "the guest stopped while this test ran" in stdout, stdout


TMP_TESTS = '''
import os
from pathlib import Path

import pytest

seen = {}


@pytest.mark.guest
def test_a_guest_test_writes(tmp_path):
    (tmp_path / "backing.img").write_bytes(bytes(4096))
    seen["guest"] = tmp_path


def test_a_host_test_writes(tmp_path):
    (tmp_path / "x").write_bytes(b"x")
    seen["host"] = tmp_path


@pytest.mark.guest
def test_only_the_guest_tests_tmp_path_is_gone():
    assert not seen["guest"].exists()
    assert seen["host"].exists()
'''


def test_in_the_guest_a_guest_tests_tmp_path_goes_when_it_ends(tmp_path: Path) -> None:
    """The guest's /tmp lives in its RAM and pytest keeps every tmp_path
    until the session ends: a whole run's backing files would fill it (a
    late test then fails with ENOSPC), so each guest test's goes at once."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_tmp.py").write_text(TMP_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    p = subprocess.run(
        [sys.executable, "-m", "pytest",
         "-p", "no:cacheprovider", "--strict-markers", "-q", str(tmp_path / "test_tmp.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        env={**os.environ, "AIOUBLK_IN_GUEST": "1", "AIOUBLK_CACHE": str(tmp_path / "cache")})
    assert p.returncode == 0 and "3 passed" in p.stdout, p.stdout + p.stderr


def test_a_project_without_conftest_gets_the_plugin(pytester: pytest.Pytester) -> None:
    """Installing aioublk is enough: the pytest11 entry point brings the
    marker (accepted under --strict-markers) and the options."""
    pytester.makepyfile('''
        import pytest

        @pytest.mark.guest
        def test_on_the_driver():
            pass

        def test_on_the_host():
            pass
    ''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers",
                                           "--no-guest")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["aioublk: 1 guest tests deselected (--no-guest)"])
    helped = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--help")
    for option in ("--no-guest", "--guest-timeout", "--guest-accel", "--guest-kernel",
                   "--guest-modules"):
        helped.stdout.fnmatch_lines([f"*{option}*"])
    marked = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--markers")
    marked.stdout.fnmatch_lines(["@pytest.mark.guest(timeout=None): *ublk_drv*"])


def test_the_accelerator_choice(capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guest, "_kvm_broken", threading.Event())  # not this run's guest's

    def unasked() -> bool:
        raise AssertionError("a forced choice runs no probe")

    assert guest.use_kvm("kvm", unasked) and not guest.use_kvm("tcg", unasked)
    assert guest.use_kvm("auto", lambda: True)
    assert capsys.readouterr().err == ""
    assert not guest.use_kvm("auto", lambda: False)
    assert "using TCG" in capsys.readouterr().err  # one line saying so
    with pytest.raises(SetupError, match="unknown guest accelerator 'hvf'"):
        guest.use_kvm("hvf", unasked)


def fake_bzimage(path: Path, release: str) -> Path:
    """Just the setup header fields `image_release` reads (x86 boot protocol)."""
    image = bytearray(0x1000)
    image[0x202:0x206] = b"HdrS"
    image[0x20E:0x210] = (0x600 - 0x200).to_bytes(2, "little")
    name = f"{release} (builder@host) #1 SMP".encode()
    image[0x600:0x600 + len(name)] = name
    path.write_bytes(bytes(image))
    return path


def test_a_kernel_of_ones_own_and_its_modules(tmp_path: Path) -> None:
    image = fake_bzimage(tmp_path / "bzImage", "6.20.0-mine")
    assert guest.kernel_from(image) == guest.Kernel("6.20.0-mine", image)
    with pytest.raises(SetupError, match="has no modules.dep"):
        guest.kernel_from(image, tmp_path)
    tree = tmp_path / "lib" / "modules" / "6.20.0-mine"
    tree.mkdir(parents=True)
    (tree / "modules.dep").touch()
    assert guest.kernel_from(image, tree).modules == tree
    # an image inside its own modules tree (sid's cache, a /lib/modules install) brings them
    inside = fake_bzimage(tree / "vmlinuz", "6.20.0-mine")
    assert guest.kernel_from(inside).modules == tree
    (tmp_path / "not-a-kernel").write_bytes(b"\0" * 4096)
    with pytest.raises(SetupError, match="is not a bzImage"):
        guest.kernel_from(tmp_path / "not-a-kernel")


def test_the_vng_command(tmp_path: Path) -> None:
    kernel = guest.Kernel("6.20.0-mine", tmp_path / "bzImage")
    script = tmp_path / "run sh"
    argv = guest.vng_command("vng", kernel, script, [tmp_path], memory="2G", cpus=4, kvm=False)
    # under TCG the TSC is off the clocksource watchdog: its verdict flips a
    # static key, and a text patch under TCG now and then oopses the guest
    assert argv == ["vng", f"--run={tmp_path / 'bzImage'}", "--disable-kvm",
                    "--append=tsc=reliable", "--verbose", "--force-9p", "--memory=2G",
                    "--cpus=4", f"--rwdir={tmp_path}", f"--exec=sh '{script}'"]
    kvm = guest.vng_command("vng", kernel, script, [tmp_path], memory="2G", cpus=4, kvm=True)
    assert kvm == [a for a in argv if a not in ("--disable-kvm", "--append=tsc=reliable")]


def test_the_vng_command_adds_an_nvme_controller(tmp_path: Path) -> None:
    kernel = guest.Kernel("6.20.0-mine", tmp_path / "bzImage")
    script = tmp_path / "run.sh"
    plain = guest.vng_command("vng", kernel, script, [], memory="2G", cpus=4, kvm=True)
    argv = guest.vng_command("vng", kernel, script, [], memory="2G", cpus=4, kvm=True,
                             nvme=tmp_path / "nvme.img")
    # vng takes QEMU's options last, and runs them through a shell
    assert argv == [*plain, f"--qemu-opts=-drive file={tmp_path / 'nvme.img'},if=none,id=nvm,"
                    "format=raw -device nvme,serial=aioublk0,drive=nvm"]
    spaced = guest.vng_command("vng", kernel, script, [], memory="2G", cpus=4, kvm=True,
                               nvme=tmp_path / "a b.img")
    assert spaced[-1] == (f"--qemu-opts=-drive 'file={tmp_path / 'a b.img'},if=none,id=nvm,"
                          "format=raw' -device nvme,serial=aioublk0,drive=nvm")


def test_the_vng_command_passes_more_qemu_options_last(tmp_path: Path) -> None:
    kernel = guest.Kernel("6.20.0-mine", tmp_path / "bzImage")
    script = tmp_path / "run.sh"
    plain = guest.vng_command("vng", kernel, script, [], memory="2G", cpus=4, kvm=False)
    argv = guest.vng_command("vng", kernel, script, [], memory="2G", cpus=4, kvm=False,
                             qemu_opts=["-plugin", "/x/count.so,dir=/y"])
    assert argv == [*plain, "--qemu-opts=-plugin /x/count.so,dir=/y"]


def test_our_virtme_run_caches_the_guests_root_with_the_installed_virtme() -> None:
    from virtme import mkinitramfs

    from aioublk.testing import virtme_run

    cached = virtme_run.cache_root_mount(mkinitramfs._MOUNT_ROOT_HOST)
    assert cached is not None, "virtme's 9p root mount changed: update aioublk.testing.virtme_run"
    mounts = [ln for ln in cached.splitlines() if "-t 9p" in ln]
    assert len(mounts) == 1 and "cache=loose" in mounts[0]
    # only that line changed
    assert cached.replace(",cache=loose", "") == mkinitramfs._MOUNT_ROOT_HOST
    assert virtme_run.cache_root_mount("mount -t 9p /dev/root /newroot/") is None


def test_vng_finds_our_virtme_run_first(tmp_path: Path) -> None:
    helpers = guest._helpers(tmp_path / "bin")
    env = guest._host_env("/opt/venv/bin/vng", helpers)
    assert env["PATH"].split(":")[:2] == [str(helpers), "/opt/venv/bin"]
    # run from elsewhere, as vng does, it is virtme-run with the root cached
    p = subprocess.run(["virtme-run", "--help"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "usage: virtme-run" in p.stdout
    assert "not the one we know" not in p.stderr


FAKE_VNG = """
from pathlib import Path
from aioublk.testing import guest, pytest_plugin

pytest_plugin.UBLK_CONTROL = Path("/nonexistent/ublk-control")
guest._vng = lambda: str(Path(__file__).with_name("vng"))
"""


def test_guest_kernel_and_accel_options_reach_vng(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the whole host side, to a stand-in vng that records its argv
    (and writes no status, so the guest test fails as a dead guest's would)."""
    image = fake_bzimage(pytester.path / "bzImage", "6.20.0-mine")
    pytester.makeconftest(FAKE_VNG)
    vng = pytester.path / "vng"
    vng.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {pytester.path / "argv"}\n')
    vng.chmod(0o755)
    pytester.makepyfile("import pytest\n\n@pytest.mark.guest\ndef test_k():\n    pass\n")
    monkeypatch.setenv("AIOUBLK_CACHE", str(pytester.path / "cache"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--guest-kernel={image}",
                                           "--guest-accel=tcg")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*one boot of Linux 6.20.0-mine*", "*guest stopped early*"])
    argv = (pytester.path / "argv").read_text().splitlines()
    assert argv[:2] == [f"--run={image}", "--disable-kvm"], argv
    drive = argv[-1].removeprefix("--qemu-opts=-drive file=").partition(",")[0]
    assert argv[-1].endswith("-device nvme,serial=aioublk0,drive=nvm"), argv
    backing = os.stat(drive)  # kept with the run's folder: the guest left no status
    assert (backing.st_size, backing.st_blocks) == (guest.NVME_BYTES, 0)  # sparse
    pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--guest-kernel={image}",
                                  "--guest-accel=kvm")
    assert "--disable-kvm" not in (pytester.path / "argv").read_text().splitlines()


def run_with_stand_in(vng: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      accel: str) -> None:
    """run_in_guest through the stand-in script ``vng`` (which runs the
    command on the host when it lets a boot go on): the command must run."""
    vng.chmod(0o755)
    monkeypatch.setenv("AIOUBLK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(guest, "_vng", lambda: str(vng))
    out = tmp_path / "out"
    out.mkdir()
    code = guest.run_in_guest(["sh", "-c", f"echo ran > {out / 'ran'}"], [out], timeout=60,
                              kernel=guest.Kernel("fake", tmp_path / "bzImage"), accel=accel,
                              on_output=lambda _b: None)
    assert code == 0 and (out / "ran").read_text() == "ran\n"


def test_a_boot_finds_aioublk_compiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guest cannot write bytecode: each module it imports must have a
    current one from the host, or every command there compiles it again."""
    import importlib.util

    import aioublk.kernel.uapi as module

    pyc = Path(importlib.util.cache_from_source(module.__file__))
    pyc.unlink(missing_ok=True)
    vng = tmp_path / "vng"
    vng.write_text('#!/bin/sh\nfor a; do case "$a" in --exec=*) eval "${a#--exec=}";; esac; done\n')
    run_with_stand_in(vng, tmp_path, monkeypatch, "tcg")
    assert pyc.stat().st_mtime >= Path(module.__file__).stat().st_mtime


def test_a_boot_that_hangs_before_the_script_is_booted_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A TCG boot can hang for good before our script runs: that boot is stopped after
    BOOT_TIMEOUT and the guest booted again, instead of the whole run's limit passing.
    The stand-in vng hangs the first time and runs the script (here, on the host) after."""
    count = tmp_path / "boots"
    vng = tmp_path / "vng"
    vng.write_text(f'#!/bin/sh\necho x >> {count}\n'
                   f'[ "$(wc -l < {count})" -ge 2 ] || exec sleep 600\n'
                   'for a; do case "$a" in --exec=*) eval "${a#--exec=}";; esac; done\n')
    monkeypatch.setattr(guest, "BOOT_TIMEOUT", 2.0)
    run_with_stand_in(vng, tmp_path, monkeypatch, "tcg")
    assert count.read_text().count("x") == 2
    assert "did not reach our script in 2 s" in capsys.readouterr().err


def test_a_kvm_that_cannot_run_the_guest_gives_way_to_tcg(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A host whose /dev/kvm passes the probe may still stop the guest with a
    KVM internal error (the VM then sits stopped): the boot is cut short as
    soon as the log says so, booted again under TCG, and `auto` keeps to TCG.
    The stand-in vng fails that way unless told --disable-kvm."""
    boots = tmp_path / "boots"
    vng = tmp_path / "vng"
    vng.write_text(f'#!/bin/sh\necho "$*" >> {boots}\n'
                   'case " $* " in *" --disable-kvm "*) ;; *)\n'
                   '  echo "KVM internal error. Suberror: 1"\n'
                   f'  [ "$(wc -l < {boots})" -ge 2 ] && exit 1; exec sleep 600;; esac\n'
                   'for a; do case "$a" in --exec=*) eval "${a#--exec=}";; esac; done\n')
    monkeypatch.setattr(guest, "kvm_works", lambda: True)
    monkeypatch.setattr(guest, "_kvm_broken", threading.Event())
    run_with_stand_in(vng, tmp_path, monkeypatch, "auto")
    first, second = boots.read_text().splitlines()
    assert "--disable-kvm" not in first.split() and "--disable-kvm" in second.split()
    assert "booting again under TCG" in capsys.readouterr().err
    assert not guest.use_kvm("auto", lambda: True)  # (and no probe's word brings KVM back)


def test_a_kvm_boot_that_fails_by_itself_late_gives_way_to_tcg_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """QEMU may give up by itself, and only after the boots a hang would
    count: the switch to TCG still comes, and is not one of those boots."""
    boots = tmp_path / "boots"
    vng = tmp_path / "vng"
    vng.write_text(f'#!/bin/sh\necho "$*" >> {boots}\n'
                   'case " $* " in *" --disable-kvm "*) ;; *)\n'
                   f'  if [ "$(wc -l < {boots})" -ge {guest.BOOTS} ]; then\n'
                   '    echo "KVM internal error. Suberror: 1"; fi; exit 1;; esac\n'
                   'for a; do case "$a" in --exec=*) eval "${a#--exec=}";; esac; done\n')
    monkeypatch.setattr(guest, "kvm_works", lambda: True)
    monkeypatch.setattr(guest, "_kvm_broken", threading.Event())
    run_with_stand_in(vng, tmp_path, monkeypatch, "auto")
    runs = boots.read_text().splitlines()
    assert len(runs) == guest.BOOTS + 1 and "--disable-kvm" in runs[-1].split()


FOLDER_TESTS = '''
import os

import pytest


def test_{0}_on_the_host():
    assert "FAKE_GUEST_INSIDE" not in os.environ


@pytest.mark.guest
def test_{0}_in_the_guest():
    assert os.environ.get("FAKE_GUEST_INSIDE") == "1"
'''


def test_the_guest_runs_the_marked_tests_of_every_folder(tmp_path: Path) -> None:
    """A feature's folder holds its host and its guest tests: the guest's
    pytest is given the marked tests' node ids, whatever folder they are in,
    and the host keeps the rest."""
    (tmp_path / "conftest.py").write_text(FAKE_GUEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    for feature in ("queue", "nbd"):
        (tmp_path / "tests" / feature).mkdir(parents=True)
        (tmp_path / "tests" / feature / f"test_{feature}.py").write_text(
            FOLDER_TESTS.format(feature))
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--strict-markers", "-rA"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        env={**os.environ, "AIOUBLK_CACHE": str(tmp_path / "cache")})
    assert p.returncode == 0 and "4 passed" in p.stdout, p.stdout + p.stderr
    assert "2 guest tests, one boot" in p.stdout, p.stdout
