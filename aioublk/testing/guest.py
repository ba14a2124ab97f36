"""Run a command under a real ublk kernel: Debian sid's, booted by virtme-ng in QEMU.

Why and how (every point was seen on a Debian 12 build machine):

- The host kernel has io_uring but no ublk driver, so tests that need
  `/dev/ublk-control` run in a guest. `/dev/kvm` exists but cannot run an
  ordinary guest (QEMU aborts with "failed to set MSR 0x10a"), so whether KVM
  works is probed, once per process: QEMU starts a stopped `-cpu host` machine
  (the CPU vng asks for with KVM) and quits at once, about 0.05 s; the MSRs
  are set at the machine's first reset, before that quit. If the probe fails
  the guest runs under `--disable-kvm`: TCG software emulation, 11-14x slower
  for Python code. Another host's /dev/kvm passes that probe and then stops
  the real boot with "KVM internal error" (an instruction it cannot emulate,
  early in the kernel): that boot is cut short when the log says so, booted
  again under TCG, and `auto` keeps to TCG for the rest of the process.
- Any bzImage boots instead of sid's (`kernel_from`): its release is read
  from the image's setup header, and its modules come from the folder given,
  else the image's own folder when it is a `/lib/modules/$REL` tree (as sid's
  is in the cache), else the host's `/lib/modules/$REL`; with none, only
  built-in drivers exist in the guest.
- The kernel is Debian sid's generic amd64 flavour (`cloud-amd64` lacks 9p and
  does not boot under vng). Its release changes over time, so it is resolved
  from `linux-image-amd64`'s dependency, never hard-coded, and only when the
  cache has no kernel (or on `--refresh`): a cached lookup costs no network.
  `linux-modules-*` ships no `modules.dep`, so `depmod -b` runs after
  unpacking, or modprobe finds nothing. vng loads modules from
  `/lib/modules/$REL`: a symlink to the cache is enough (needs root).
- vng shares the host's root file system read-only over 9p, with writable
  overlays on /tmp, /etc, /usr, /var... that live in guest RAM (`--memory`)
  and never reach the host. The project checkout is read-only in the guest;
  `--rwdir DIR` is the way back: the generated script, the command's output
  and its exit status live in such a folder.
- vng does not return the guest command's output or status here ("cannot
  find script I/O ports"): it exits 255 whatever happens. We read the status
  file instead; no status file means the guest never got that far.
- vng 1.42 crashes at start when stdin is closed (`'NoneType' object has no
  attribute 'isatty'`), as it may be in CI: stdin is always /dev/null.
- virtme's initramfs mounts that root without a cache, so each stat and
  open crosses to QEMU: our virtme-run (`aioublk.testing.virtme_run`, first
  on vng's PATH) mounts it `cache=loose`, which takes a third off every
  Python start in the guest.
- vng first tries virtiofsd for the root file system; here it fails ("fuse:
  invalid argument") and vng falls back to 9p after about 6 s of retries.
  `--force-9p` skips that: a boot to a shell command takes 6.5-7.5 s of wall
  time instead of 13 s.
- Under TCG the guest kernel boots with `tsc=reliable`. Without it the
  clocksource watchdog, fooled by the emulation's uneven pace, now and then
  finds the TSC "skewed" against the HPET (seen after 6 and after 19 minutes
  of tests) and turns off the `sched_clock` static key. That patches live
  kernel text through an int3, and under TCG a vCPU sometimes runs the
  half-patched instruction: "Oops: int3" in `sched_clock_cpu`, a panic, and
  the rest of that boot's tests lost. `reliable` takes the TSC off the
  watchdog. `tsc=unstable` would also stop the key's first flip (on, at
  about 2 s: the same oops, caught as a failed boot and booted again), but
  it moves timekeeping to the HPET: clock reads 2.2x slower, fio 10% slower.
- vng rejects a space-separated option value that starts with a dash: every
  option is passed in its `--opt=value` form.
- Every boot has an emulated NVMe controller (QEMU's `-device nvme`) with one
  namespace, /dev/nvme0n1 and its generic char device /dev/ng0n1, for the
  nvme target's tests: a sparse file of NVME_BYTES in the run's scratch
  folder backs it, gone with the folder. vng hands `--qemu-opts` to QEMU
  through a shell, so the drive's path is quoted for one.
- The guest's `python3` on PATH is Debian's: the host interpreter's folder
  (a venv's `bin` works) is put first on the guest's PATH, and callers pass
  `sys.executable` explicitly anyway.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, NamedTuple

from aioublk.testing.sid import (
    SetupError,
    SidApt,
    cache_dir,
    extract,
    locked,
    progress,
    run,
    scratch_dir,
)

DEFAULT_TIMEOUT = 40 * 60.0
# Host variables worth seeing in the guest; the guest does not inherit the host env.
FORWARDED_ENV = ("PYTHONPATH", "PYTHONWARNINGS", "CI", "LANG", "LC_ALL", "TERM", "COLUMNS")
STATUS_TIMEOUT = 124  # like timeout(1)
STATUS_NO_RESULT = 125  # the guest never wrote a status: boot failure, crash, vng error
NVME_BYTES = 512 << 20  # the emulated NVMe namespace (a sparse file on the host)
#: the guest kernel's extra arguments under TCG: the TSC off the watchdog (see above)
TCG_KERNEL_ARGS = "tsc=reliable"
#: boots of one run before giving up when the guest kernel dies or hangs before our
#: script starts
BOOTS = 3
#: seconds a boot may take to reach our script (7-20 s idle; seen: a TCG boot hung for
#: good after bringing up its CPUs)
BOOT_TIMEOUT = float(os.environ.get("AIOUBLK_GUEST_BOOT_TIMEOUT", "240"))


ACCELS = ("auto", "kvm", "tcg")
#: what QEMU's log says when KVM cannot run an instruction of the guest (seen
#: on a host whose /dev/kvm passes the probe: a BMI2 instruction early in the
#: kernel's boot, "emulation failure"); the VM then sits stopped
KVM_FAILED = "KVM internal error"
#: set when a KVM boot failed that way: `auto` uses TCG from then on
_kvm_broken = threading.Event()


class Kernel(NamedTuple):
    release: str
    vmlinuz: Path
    modules: Path | None = None  # linked at /lib/modules/$REL for the guest; None: leave it


def default_memory() -> str:
    return os.environ.get("AIOUBLK_GUEST_MEMORY", "4G")


def default_accel() -> str:
    return os.environ.get("AIOUBLK_GUEST_ACCEL", "auto")


def _kernels() -> Path:
    return cache_dir() / "kernel"


def _modules_dir(release: str) -> Path:
    return _kernels() / release / "usr" / "lib" / "modules" / release


def _cached_kernel() -> Kernel | None:
    """The kernel named by `kernel/current`, if it is completely unpacked."""
    try:
        release = (_kernels() / "current").read_text().strip()
    except FileNotFoundError:
        return None
    modules = _modules_dir(release)
    if not (modules / "vmlinuz").is_file() or not (modules / "modules.dep").is_file():
        return None
    return Kernel(release, modules / "vmlinuz", modules)


def _link_modules(release: str, target: Path) -> None:
    """Make `/lib/modules/$REL` point at `target`, where vng looks for modules."""
    link = Path("/lib/modules") / release
    if link.is_symlink() and link.readlink() == target:
        return
    if link.exists() and not link.is_symlink():
        return  # a real install of the very same release: its modules will do
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f".{release}.aioublk")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        tmp.replace(link)
    except PermissionError:
        raise SetupError(f"cannot create {link} -> {target}: run once as root") from None


def _depmod() -> str:
    found = shutil.which("depmod") or next(
        (p for p in ("/usr/sbin/depmod", "/sbin/depmod") if os.access(p, os.X_OK)), None
    )
    if found is None:
        raise SetupError("depmod not found: install kmod (scripts/setup does)")
    return found


def resolve_release(apt: SidApt) -> str:
    """sid's current generic amd64 release, e.g. 7.2.13+deb14-amd64 (fetches the index)."""
    apt.update()
    for line in apt.cache_query("depends", "linux-image-amd64").splitlines():
        dep = line.strip().removeprefix("Depends: ")
        if dep != line.strip() and dep.startswith("linux-image-"):
            return dep.removeprefix("linux-image-")
    raise SetupError(
        "cannot resolve sid's kernel: linux-image-amd64 has no linux-image-* dependency"
    )


def _install(apt: SidApt, release: str) -> None:
    """Download, unpack and depmod a release; atomic: an interrupted run leaves no half kernel."""
    debs = apt.download([f"linux-binary-{release}", f"linux-modules-{release}"])
    final, tmp = _kernels() / release, _kernels() / f".{release}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    progress(f"unpacking kernel {release}")
    for deb in debs:
        extract(deb, tmp)
    run([_depmod(), "-b", tmp / "usr", release])
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for deb in debs:  # 125 MB we can fetch again if ever needed
        deb.unlink()


def _prune(keep: str) -> None:
    """Drop kernels other than `keep`, with their /lib/modules links into our cache."""
    for old in _kernels().iterdir():
        if old.is_dir() and old.name != keep and not old.name.startswith("."):
            link = Path("/lib/modules") / old.name
            if link.is_symlink() and link.readlink().is_relative_to(_kernels()):
                link.unlink()
            shutil.rmtree(old)


def ensure_kernel(refresh: bool = False) -> Kernel:
    """The guest kernel, downloaded on first use; cached calls do no network at all."""
    kernel = _cached_kernel()
    if kernel is None or refresh:
        with locked("kernel"):
            kernel = _cached_kernel()  # another process may have just filled the cache
            if kernel is None or refresh:
                apt = SidApt()
                release = resolve_release(apt)
                if kernel is None or kernel.release != release:
                    _install(apt, release)
                (_kernels() / "current").write_text(release + "\n")
                _prune(keep=release)
                kernel = _cached_kernel()
                if kernel is None:
                    raise SetupError(f"kernel {release} unpacked without vmlinuz or modules.dep")
    _link_modules(kernel.release, _modules_dir(kernel.release))
    return kernel


def image_release(vmlinuz: Path) -> str:
    """The release a bzImage names in its setup header (x86 boot protocol >= 2.00)."""
    try:
        with open(vmlinuz, "rb") as f:
            head = f.read(0x10000)
    except OSError as e:
        raise SetupError(f"cannot read kernel {vmlinuz}: {e.strerror}") from None
    if head[0x202:0x206] != b"HdrS":
        raise SetupError(f"{vmlinuz} is not a bzImage: pass an x86 kernel image (vmlinuz)")
    at = 0x200 + int.from_bytes(head[0x20E:0x210], "little")
    name = head[at:head.find(b"\0", at)].decode(errors="replace").split(" ")[0]
    if not name:
        raise SetupError(f"{vmlinuz} names no release in its header: pass another kernel image")
    return name


def kernel_from(vmlinuz: Path | str, modules: Path | str | None = None) -> Kernel:
    """A kernel of the user's own: the image, and its modules tree if one is found."""
    image = Path(vmlinuz).absolute()
    release = image_release(image)
    if modules is not None:
        tree = Path(modules).absolute()
        if not (tree / "modules.dep").is_file():
            raise SetupError(f"{tree} has no modules.dep: pass a /lib/modules/{release} tree "
                             f"(run `depmod -b ROOT {release}` on an unpacked one)")
        return Kernel(release, image, tree)
    if (image.parent / "modules.dep").is_file() and image.parent.name == release:
        return Kernel(release, image, image.parent)
    return Kernel(release, image)  # the host's /lib/modules/$REL, if any, or built-ins only


def guest_kernel(vmlinuz: Path | str | None = None, modules: Path | str | None = None) -> Kernel:
    """The kernel to boot: the one given (or `$AIOUBLK_GUEST_KERNEL`), else sid's, cached."""
    vmlinuz = vmlinuz or os.environ.get("AIOUBLK_GUEST_KERNEL") or None
    modules = modules or os.environ.get("AIOUBLK_GUEST_MODULES") or None
    if vmlinuz is None:
        if modules is not None:
            raise SetupError("a modules folder needs its kernel: pass --guest-kernel too")
        return ensure_kernel()
    return kernel_from(vmlinuz, modules)


@functools.cache
def kvm_works() -> bool:
    """Can QEMU run a KVM guest here? Probed once per process (see the module notes)."""
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None or not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    try:
        proc = subprocess.run(
            [qemu, "-accel", "kvm", "-machine", "pc", "-cpu", "host", "-m", "64",
             "-nodefaults", "-display", "none", "-S", "-monitor", "stdio"],
            input=b"quit\n", capture_output=True, timeout=20, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def use_kvm(accel: str, probe: Callable[[], bool] | None = None) -> bool:
    """`kvm` and `tcg` are obeyed; `auto` asks the probe (``kvm_works`` as it
    is at the call) and says so when KVM is out."""
    if accel not in ACCELS:
        raise SetupError(f"unknown guest accelerator {accel!r}: use one of {', '.join(ACCELS)}")
    if accel != "auto":
        return accel == "kvm"
    if (probe or kvm_works)() and not _kvm_broken.is_set():
        return True
    progress("KVM cannot run a guest here: using TCG emulation (slower); "
             "AIOUBLK_GUEST_ACCEL=kvm forces KVM")
    return False


def _vng() -> str:
    """vng next to the running interpreter first: a venv need not be on PATH."""
    beside = Path(sys.executable).with_name("vng")
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("vng")
    if found is None:
        raise SetupError("vng not found: pip install virtme-ng (scripts/setup does)")
    return found


def _host_env(vng: str, helpers: Path) -> dict[str, str]:
    """vng runs its helpers (virtme-run) through the shell: their folder must
    be on PATH even when the venv is not activated, after `helpers`, where
    ours stand in for them."""
    path = os.environ.get("PATH", "/usr/bin:/bin").split(":")
    first = [str(helpers), str(Path(vng).parent)]
    return os.environ | {"PATH": ":".join(dict.fromkeys([*first, *path]))}


def _helpers(folder: Path) -> Path:
    """`folder` with our virtme-run in it (`aioublk.testing.virtme_run`: the
    guest's root file system cached), run by this interpreter."""
    folder.mkdir(exist_ok=True)
    top = Path(__file__).resolve().parents[2]
    wrapper = folder / "virtme-run"
    wrapper.write_text("#!/bin/sh\n"
                       f"export PYTHONPATH={shlex.quote(str(top))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
                       f'exec {shlex.quote(sys.executable)} -m aioublk.testing.virtme_run "$@"\n')
    wrapper.chmod(0o755)
    return folder


def _guest_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in FORWARDED_ENV or k.startswith("AIOUBLK_")}
    env |= {
        "AIOUBLK_IN_GUEST": "1",
        "PYTHONUNBUFFERED": "1",  # the output file is streamed live
        "PYTHONDONTWRITEBYTECODE": "1",  # the checkout is read-only in the guest
    }
    path = os.environ.get("PATH", "/usr/bin:/bin").split(":")
    env["PATH"] = ":".join(dict.fromkeys([str(Path(sys.executable).parent), *path]))
    return env | dict(extra or {})


def _compile_package() -> None:
    """Write aioublk's bytecode on the host before a boot. The guest cannot
    write it (the checkout is read-only there), so without it every process
    the guest starts compiles each aioublk module it imports from source:
    under emulation that is a tenth of a second more for each ``aioublk``
    command a test or script runs."""
    import compileall

    compileall.compile_dir(Path(__file__).resolve().parents[1], quiet=1)


def _script(argv: Sequence[str], env: Mapping[str, str], cwd: Path, ctl: Path) -> str:
    """The guest side: load drivers, run argv, leave its output and status in `ctl`."""
    q = shlex.quote
    exports = "".join(f"export {k}={q(v)}\n" for k, v in env.items())
    return f"""\
exec >{q(str(ctl / "output"))} 2>&1 </dev/null
: >{q(str(ctl / "booted"))}
modprobe ublk_drv || echo "aioublk guest: modprobe ublk_drv failed"
modprobe nbd 2>/dev/null
modprobe nvme 2>/dev/null  # the emulated controller; no udev here loads it
{exports}cd {q(str(cwd))} && {shlex.join(argv)}
echo $? >{q(str(ctl / "status.tmp"))}
mv {q(str(ctl / "status.tmp"))} {q(str(ctl / "status"))}
sync
"""


def _pump(src: BinaryIO, emit: Callable[[bytes], None]) -> None:
    while chunk := src.read(65536):
        emit(chunk)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """vng runs QEMU as a child: signal the whole session we started it in."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _write_stdout(chunk: bytes) -> None:
    sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.flush()


def vng_command(
    vng: str,
    kernel: Kernel,
    script: Path,
    rwdirs: Sequence[Path | str],
    *,
    memory: str,
    cpus: int,
    kvm: bool,
    nvme: Path | None = None,
    qemu_opts: Sequence[str] = (),
) -> list[str]:
    """vng's argv: boot `kernel`, run `script` with `rwdirs` writable, and
    an NVMe controller whose namespace is the file `nvme`; `qemu_opts` go to
    QEMU as they are (vng runs them through a shell: quote them)."""
    drive = shlex.quote(f"file={Path(nvme).absolute()},if=none,id=nvm,format=raw") \
        if nvme is not None else ""
    return [
        vng,
        f"--run={kernel.vmlinuz}",
        *([] if kvm else ["--disable-kvm", f"--append={TCG_KERNEL_ARGS}"]),
        "--verbose",
        "--force-9p",
        f"--memory={memory}",
        f"--cpus={cpus}",
        *(f"--rwdir={Path(d).absolute()}" for d in rwdirs),
        f"--exec=sh {shlex.quote(str(script))}",
        *([f"--qemu-opts=-drive {drive} -device nvme,serial=aioublk0,drive=nvm"]
          if nvme is not None else []),
        *([f"--qemu-opts={' '.join(qemu_opts)}"] if qemu_opts else []),
    ]


def run_in_guest(
    argv: Sequence[str],
    rwdirs: Sequence[Path | str] = (),
    memory: str = "4G",
    cpus: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    cwd: Path | str | None = None,
    on_output: Callable[[bytes], None] = _write_stdout,
    kernel: Kernel | None = None,
    accel: str = "auto",
    watchdog: Callable[[], str | None] | None = None,
    qemu_opts: Sequence[str] = (),
) -> int:
    """Boot the guest, run argv in `cwd` (default: ours), return argv's exit status.

    The output is passed to `on_output` while the VM runs. `rwdirs` are made
    writable in the guest at the same paths. Without a status from the guest
    a one-line reason and the tail of vng's log go to stderr, and the result is
    STATUS_TIMEOUT or STATUS_NO_RESULT. `kernel` defaults to `guest_kernel()`;
    `accel` is auto, kvm or tcg (see `use_kvm`). `watchdog`, asked every poll,
    stops the guest early by returning why (the result is then STATUS_TIMEOUT).
    `qemu_opts` are more of QEMU's options (a TCG plugin, say).
    """
    if not argv:
        raise ValueError("run_in_guest needs a command")
    kernel = kernel or guest_kernel()
    if kernel.modules is not None:
        _link_modules(kernel.release, kernel.modules)
    kvm = use_kvm(accel)
    vng = _vng()
    _compile_package()
    ctl = scratch_dir("runs")
    workdir = Path(cwd or Path.cwd()).absolute()
    script, output, status, log = (ctl / n for n in ("run.sh", "output", "status", "vng.log"))
    script.write_text(_script(argv, _guest_env(env), workdir, ctl))
    output.touch()
    host_env = _host_env(vng, _helpers(ctl / "bin"))
    nvme = ctl / "nvme.img"
    with open(nvme, "wb") as f:
        f.truncate(NVME_BYTES)
    cmd = vng_command(vng, kernel, script, [ctl, *rwdirs], memory=memory, cpus=cpus, kvm=kvm,
                      nvme=nvme, qemu_opts=qemu_opts)
    deadline = time.monotonic() + timeout
    hung = f"the guest kernel did not reach our script in {BOOT_TIMEOUT:.0f} s"
    boot_deadline = 0.0

    kvm_failed = f"KVM could not run the guest ({KVM_FAILED})"

    def stop_why() -> str | None:
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f} s"
        if not (ctl / "booted").exists():
            if kvm and KVM_FAILED in log.read_text(errors="replace"):
                return kvm_failed
            if time.monotonic() > boot_deadline:
                return hung
        return watchdog() if watchdog is not None else None

    boot = 0
    while True:
        boot += 1
        boot_deadline = time.monotonic() + BOOT_TIMEOUT
        timed_out, returncode = _boot(cmd, workdir, host_env, log, output, stop_why, on_output)
        booted = status.exists() or (ctl / "booted").exists()
        if kvm and accel == "auto" and not booted and \
                KVM_FAILED in log.read_text(errors="replace"):
            # the probe passed, a real boot did not (cut short, or QEMU gave up by
            # itself): TCG for this and later runs, not counted as one of the BOOTS
            _kvm_broken.set()
            kvm = False
            boot -= 1
            cmd = vng_command(vng, kernel, script, [ctl, *rwdirs], memory=memory, cpus=cpus,
                              kvm=False, nvme=nvme, qemu_opts=qemu_opts)
            progress("KVM cannot run the guest here: booting again under TCG emulation "
                     "(slower); AIOUBLK_GUEST_ACCEL=tcg skips the attempt")
            continue
        if booted or (timed_out and timed_out not in (hung, kvm_failed)) or boot >= BOOTS:
            break
        # an emulated SMP boot now and then dies or hangs before our script runs
        # (seen: an int3 oops in sched_clock_cpu under TCG; a boot stuck after
        # "smp: Brought up 1 node"): not the tests' fault
        why = next((ln for ln in log.read_text(errors="replace").splitlines()
                    if "Kernel panic" in ln), timed_out or "no sign of life")
        print(f"aioublk guest: the guest kernel did not boot ({why.strip()}): booting again",
              file=sys.stderr)
    if status.exists():
        code = int(status.read_text().strip() or STATUS_NO_RESULT)
        shutil.rmtree(ctl)
        return code
    reason = timed_out or "the guest command never finished"
    tail = log.read_text(errors="replace").splitlines()[-40:]
    print("\n".join(["--- tail of vng's log ---", *tail, "---"]), file=sys.stderr)
    print(f"aioublk guest: {reason} (vng exit {returncode}; kept {ctl})", file=sys.stderr)
    return STATUS_TIMEOUT if timed_out else STATUS_NO_RESULT


def _boot(cmd: list[str], workdir: Path, env: Mapping[str, str], log: Path, output: Path,
          stop_why: Callable[[], str | None],
          on_output: Callable[[bytes], None]) -> tuple[str | None, int | None]:
    """One boot of the guest, its output pumped until it powers off or `stop_why`
    says why it must stop: (that reason or None, vng's exit status)."""
    timed_out = None
    with open(log, "wb") as logf, open(output, "rb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            start_new_session=True,
            env=env,
        )
        try:
            while proc.poll() is None:
                _pump(out, on_output)
                timed_out = stop_why()
                if timed_out:
                    break
                time.sleep(0.2)
        finally:
            _stop(proc)
        _pump(out, on_output)
    return timed_out, proc.returncode


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aioublk.testing.guest", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="action", required=True)
    kern = sub.add_parser(
        "kernel", help="download the guest kernel if needed and print its release"
    )
    kern.add_argument("--refresh", action="store_true", help="re-resolve sid's current kernel")
    runp = sub.add_parser("run", help="run a command in the guest; exits with its status")
    runp.add_argument(
        "--memory", default=default_memory(), help="guest RAM (env AIOUBLK_GUEST_MEMORY)"
    )
    runp.add_argument("--cpus", type=int, default=2)
    runp.add_argument("--kernel", help="bzImage to boot (env AIOUBLK_GUEST_KERNEL; default sid's)")
    runp.add_argument("--modules", help="its /lib/modules/REL tree (env AIOUBLK_GUEST_MODULES)")
    runp.add_argument("--accel", choices=ACCELS, default=default_accel(),
                      help="kvm, tcg, or auto: KVM if a probe boots it (env AIOUBLK_GUEST_ACCEL)")
    runp.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds")
    runp.add_argument(
        "--rwdir", action="append", default=[], help="host folder writable in the guest"
    )
    runp.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    ns = parser.parse_args(args)
    try:
        if ns.action == "kernel":
            print(ensure_kernel(refresh=ns.refresh).release)
            return 0
        command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
        if not command:
            parser.error("run needs a command: run -- CMD ARGS...")
        return run_in_guest(command, ns.rwdir, ns.memory, ns.cpus, timeout=ns.timeout,
                            kernel=guest_kernel(ns.kernel, ns.modules), accel=ns.accel)
    except SetupError as e:
        print(f"aioublk: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
