"""Build the kernel's own C ublk server, `kublk`, as a side-by-side peer for benchmarks.

Facts this relies on (checked on a Debian 12 build machine):

- kublk lives in the kernel tree under `tools/testing/selftests/ublk/`. Its
  Makefile links every `*.c` there except the standalone `metadata_size.c`:
  for Linux 7.2 that is kublk.c null.c file_backed.c common.c stripe.c
  fault_inject.c batch.c. We take the sources from Debian sid's
  `linux-source-$MAJOR.$MINOR` matching the guest kernel, and extract only
  that folder from the 160 MB tarball inside the package.
- It needs uapi headers as new as the kernel (`linux/ublk_cmd.h` with the
  BATCH_IO structs; Debian 12's are too old) and a recent liburing (Debian
  12 has 2.3). Both come from sid (`linux-libc-dev`, `liburing-dev` 2.15),
  unpacked with `dpkg-deb -x` into a private sysroot that goes first on the
  include path; `liburing.a` is linked statically, so the binary needs
  nothing from sid at run time and runs unchanged in the guest, which sees
  the cache through the host's root file system. `-D_GNU_SOURCE` because
  the sources use GNU extensions without defining it themselves.
- Nothing is installed on the host and nothing of the kernel source goes
  into the repository: it is all fetched from the Debian registry at run
  time into `$CACHE/kublk/`.

`python -m tools.kublk` prints the binary's path (building it first
if needed, and the selftests' `metadata_size` helper beside it). Run it in the guest, e.g.
`python -m aioublk.testing.guest run -- $(python -m tools.kublk) features`.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from aioublk.testing.guest import ensure_kernel
from aioublk.testing.sid import SetupError, SidApt, cache_dir, extract, locked, progress, run

SELFTEST = "tools/testing/selftests/ublk"
STANDALONE = {"metadata_size.c"}  # STANDALONE_UTILS in the selftest Makefile
MULTIARCH = "x86_64-linux-gnu"


def source_version(release: str) -> str:
    """`7.2.13+deb14-amd64` -> `7.2`: linux-source packages are named by major.minor."""
    m = re.match(r"(\d+\.\d+)", release)
    if not m:
        raise SetupError(f"cannot read a kernel version from {release!r}")
    return m.group(1)


def _extract_selftest(deb: Path, version: str, dest: Path) -> Path:
    """Only the ublk selftest folder: deb -> data tar -> linux-source tar.xz -> folder."""
    member = f"./usr/src/linux-source-{version}.tar.xz"
    inner = f"linux-source-{version}/{SELFTEST}"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    progress(f"extracting {SELFTEST} from linux-source-{version}")
    with (
        subprocess.Popen(["dpkg-deb", "--fsys-tarfile", deb], stdout=subprocess.PIPE) as deb_tar,
        subprocess.Popen(
            ["tar", "-xO", member], stdin=deb_tar.stdout, stdout=subprocess.PIPE
        ) as src_tar,
    ):
        assert deb_tar.stdout is not None  # for mypy: PIPE was asked for
        deb_tar.stdout.close()  # tar owns it now; lets dpkg-deb see a closed pipe
        run(["tar", "-xJ", "-C", dest, "--strip-components=5", inner], stdin=src_tar.stdout)
    if src_tar.returncode or deb_tar.returncode:
        raise SetupError(f"cannot extract {member} from {deb.name}")
    return dest


def _compile(src: Path, sysroot: Path, out: Path) -> None:
    sources = sorted(p.name for p in src.glob("*.c") if p.name not in STANDALONE)
    include = sysroot / "usr" / "include"
    liburing = sysroot / "usr" / "lib" / MULTIARCH / "liburing.a"
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise SetupError("no C compiler: apt-get install gcc libc6-dev")
    progress(f"compiling kublk from {' '.join(sources)}")
    tmp = out.with_suffix(".tmp")
    run(
        [
            gcc, "-O3", "-Wall", "-D_GNU_SOURCE",
            "-I", include, "-I", include / MULTIARCH,
            "-o", tmp, *sources, liburing, "-lpthread", "-lm",
        ],
        cwd=src,
    )  # fmt: skip
    tmp.replace(out)


def ensure_kublk(rebuild: bool = False) -> Path:
    """The kublk binary for the guest kernel's major.minor; built once, then cached."""
    version = source_version(ensure_kernel().release)
    home = cache_dir() / "kublk"
    out, stamp = home / "kublk", home / "stamp"
    wanted = f"linux-source-{version}\n"

    def cached() -> bool:
        return out.is_file() and stamp.is_file() and stamp.read_text() == wanted

    if cached() and not rebuild:
        return out
    with locked("kublk"):
        if cached() and not rebuild:
            return out
        home.mkdir(exist_ok=True)
        stamp.unlink(missing_ok=True)
        apt = SidApt()
        source, *dev = apt.download([f"linux-source-{version}", "linux-libc-dev", "liburing-dev"])
        sysroot = home / "sysroot"
        shutil.rmtree(sysroot, ignore_errors=True)
        for deb in dev:
            extract(deb, sysroot)
        src = _extract_selftest(source, version, home / "src")
        _compile(src, sysroot, out)
        stamp.write_text(wanted)
        source.unlink()  # 160 MB, needed again only for another kernel version
    return out


def ensure_metadata_size() -> Path:
    """The selftests' `metadata_size` helper (integrity scripts run it beside kublk),
    built from the same folder and headers as kublk."""
    kublk = ensure_kublk()
    home = kublk.parent
    out = home / "metadata_size"
    if out.is_file() and out.stat().st_mtime >= kublk.stat().st_mtime:
        return out
    with locked("kublk"):
        include = home / "sysroot" / "usr" / "include"
        tmp = out.with_suffix(".tmp")
        run(["gcc", "-O2", "-Wall", "-I", include, "-I", include / MULTIARCH, "-o", tmp,
             home / "src" / "metadata_size.c"])
        tmp.replace(out)
    return out


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.kublk", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rebuild", action="store_true", help="build again even if cached")
    ns = parser.parse_args(args)
    try:
        print(ensure_kublk(rebuild=ns.rebuild))
        ensure_metadata_size()
    except SetupError as e:
        print(f"aioublk: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
