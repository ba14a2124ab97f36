"""The project's C under AddressSanitizer and UndefinedBehaviorSanitizer:
``python -m tools.sanitize [pytest arguments]`` runs pytest with every C
extension (the data plane, the extent table, the NBD transmission, zstd,
rbd) built with ``-fsanitize=address,undefined``, and fails on the first
finding, printing the sanitizer's report.

The sanitized extensions are built from the same cffi builders as the
normal ones, by gcc directly, into ``build/sanitize/<hash>/`` (the hash of
the C, the builders and the flags: a second run with the same sources does
not build). The in-tree extensions are never touched: the run imports the
sanitized ones in their place (a finder ahead of the normal import), in its
own Python, which starts with gcc's ASan runtime preloaded (it must come
before any other library). Python itself leaks by design, so leak checking
is off. Processes the tests start get neither the runtime nor the
sanitized extensions.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import os
import re
import runpy
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: the flags the C is built with here (-O1: a usable speed, stacks still exact)
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
            "-fno-sanitize-recover=undefined", "-g", "-O1"]
#: set in the sanitized run's environment: the overlay's folder
ACTIVE = "AIOUBLK_SANITIZED"
#: this module's own test: never run under itself
SELF_TEST = ROOT / "tests/csrc/test_sanitizers.py"
#: the host tests that run the C, as paths from the repository's root
C_TESTS = ("tests/ring/test_ring.py", "tests/queue/test_batch.py",
           "tests/dataplane/test_crossloop.py", "tests/dataplane/test_cwait.py",
           "tests/dataplane/test_hostile_kernel.py", "tests/dataplane/test_inline_io.py",
           "tests/dataplane/test_fast_path.py", "tests/queue/test_shmem.py",
           "tests/dataplane/test_extents.py", "tests/dataplane/test_inflate.py",
           "tests/dataplane/test_cow.py", "tests/qcow2/test_qcow2_extents.py",
           "tests/qcow2/test_qcow2_chain.py",
           "tests/qcow2/test_qcow2_queues.py", "tests/qcow2/test_qcow2_writes.py",
           "tests/qcow2/test_qcow2_compress.py", "tests/targets/test_fua_durable.py",
           "tests/filters/test_filters.py", "tests/targets/test_targets_host.py",
           "tests/kernel/test_control_guards.py", "tests/rbd/test_rbd_host.py")
#: and every nbd target test of the host: what a run without arguments and
#: the test command's sanitizer test run
NBD_TESTS = "tests/nbd/test_nbd_*.py"
#: the file where the run notes the test it runs
_CURRENT = "AIOUBLK_SANITIZE_CURRENT"
#: how the run says which sanitized extensions the tests loaded
_LOADED = "sanitized extensions loaded: "
#: the first lines of a report shown (the error, its stacks, the summary)
REPORT_LINES = 60


class SanitizeError(Exception):
    """The sanitized build cannot be made (no compiler, no runtime, a
    compile error): one line that says what."""


def c_tests() -> list[str]:
    """The paths of the host tests that run the C."""
    paths = {*(ROOT / t for t in C_TESTS), *ROOT.glob(NBD_TESTS)}
    return [str(p) for p in sorted(paths)]


def _buildlibs() -> dict[str, Any]:
    return runpy.run_path(str(ROOT / "buildlibs.py"))


def builders() -> list[Path]:
    """The cffi builders setup.py would run here (the optional ones only
    where their library is)."""
    return [ROOT / m.split(":")[0] for m in _buildlibs()["cffi_modules"]()]


def _gcc() -> str:
    gcc = os.environ.get("AIOUBLK_SANITIZE_CC", "gcc")
    if shutil.which(gcc) is None:
        raise SanitizeError(f"no {gcc}: the sanitized build needs gcc (apt install gcc)")
    return gcc


def _runtime(name: str, package: str) -> str:
    out = subprocess.run([_gcc(), f"-print-file-name={name}"], capture_output=True,
                         text=True, check=True).stdout.strip()
    if not os.path.isabs(out) or not os.path.exists(out):
        raise SanitizeError(f"gcc has no {name}: install it (apt install {package})")
    return os.path.realpath(out)


def preload() -> str:
    """What the run preloads: gcc's ASan runtime (first, as it must be),
    and libstdc++, whose exceptions (librbd's) ASan intercepts only when
    it is there from the start."""
    return " ".join([_runtime("libasan.so", "libasan8 libubsan1"),
                     _runtime("libstdc++.so.6", "libstdc++6")])


def _key(paths: Sequence[Path]) -> str:
    """The hash the cache is kept under: what the build reads, and how."""
    h = hashlib.sha256()
    csrc = [p for d in sorted((ROOT / "aioublk").glob("**/csrc"))
            for p in sorted(d.iterdir()) if p.is_file()]
    for p in [*paths, *csrc, ROOT / "buildlibs.py", Path(__file__)]:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    version = subprocess.run([_gcc(), "--version"], capture_output=True, text=True).stdout
    h.update(" ".join(SANITIZE).encode() + version.encode() + sys.version.encode())
    return h.hexdigest()[:16]


@dataclass
class _Ext:
    """One extension to build: its module, C files and cffi's link arguments."""

    module: str
    c_files: list[Path]
    kw: dict[str, list[str]]


def _extension(builder: Path, generated: Path) -> _Ext:
    """Run ``builder`` (from the root: its sources are relative to it) and
    write the C cffi generates into ``generated``."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        ffi = runpy.run_path(str(builder))["ffibuilder"]
    finally:
        os.chdir(cwd)
    # (what set_source was given: cffi keeps it there for setuptools' hook too)
    module, _source, _ext, kw = ffi._assigned_source
    wrapper = generated / f"{module}.c"
    with contextlib.redirect_stdout(io.StringIO()):  # ("generating ...")
        ffi.emit_c_code(str(wrapper))
    sources = [ROOT / s for s in kw.get("sources", [])]
    return _Ext(module, [wrapper, *sources], kw)


def _run(cmd: list[str]) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SanitizeError(f"{' '.join(cmd)} failed:\n{p.stdout}{p.stderr}")


def build(cache: Path | None = None) -> Path:
    """The sanitized extensions' folder (a package tree of the .so files
    alone), built unless the cache has it."""
    todo = builders()
    cache = cache or ROOT / "build" / "sanitize"
    key = _key(todo)
    out = cache / key
    if out.is_dir():
        return out
    gcc = _gcc()
    preload()
    # (cffi's C stays beside the build: a report names its lines)
    generated = cache / f"{key}-c"
    generated.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
    try:
        exts = [_extension(b, generated) for b in todo]
        include = [sysconfig.get_paths()["include"], sysconfig.get_paths()["platinclude"]]
        jobs: list[list[str]] = []
        objects: dict[str, list[str]] = {}
        for ext in exts:
            incs = [f"-I{d}" for d in [*ext.kw.get("include_dirs", []), *include]]
            objects[ext.module] = []
            for i, c in enumerate(ext.c_files):
                obj = str(work / f"{ext.module}.{i}.o")
                objects[ext.module].append(obj)
                jobs.append([gcc, "-fPIC", "-pthread", *SANITIZE, *incs,
                             *ext.kw.get("extra_compile_args", []), "-c", str(c), "-o", obj])
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(_run, jobs))
        tree = work / "tree"
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        for ext in exts:
            so = tree.joinpath(*ext.module.split(".")).with_name(
                ext.module.rsplit(".", 1)[1] + suffix)
            so.parent.mkdir(parents=True, exist_ok=True)
            _run([gcc, "-shared", "-pthread", *SANITIZE, *objects[ext.module],
                  *(f"-L{d}" for d in ext.kw.get("library_dirs", [])),
                  *(f"-l{lib}" for lib in ext.kw.get("libraries", [])),
                  *ext.kw.get("extra_link_args", []), "-o", str(so)])
        tree.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for old in cache.iterdir():  # (builds of older sources)
        if not old.name.startswith((key, ".")):
            shutil.rmtree(old, ignore_errors=True)
    return out


def modules(tree: Path) -> dict[str, Path]:
    """The sanitized extensions in ``tree``, by module name."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # (the one build gives)
    return {".".join([*so.relative_to(tree).parts[:-1], so.name[: -len(suffix)]]): so
            for so in tree.rglob("*" + suffix)}


class _Overlay(importlib.abc.MetaPathFinder):
    """Finds the sanitized build of each extension it has, ahead of the
    in-tree one."""

    def __init__(self, tree: Path) -> None:
        self.found = modules(tree)

    def find_spec(self, name: str, path: Any = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        so = self.found.get(name)
        return importlib.util.spec_from_file_location(name, so) if so else None


def _child(args: list[str]) -> int:
    """The sanitized run's own side: import the sanitized extensions, run
    pytest, say which of them the tests loaded."""
    import pytest

    class Track:
        """Notes each test as it starts: an abort leaves the last one."""

        def pytest_runtest_logstart(self, nodeid: str) -> None:
            Path(os.environ[_CURRENT]).write_text(nodeid)

    overlay = _Overlay(Path(os.environ[ACTIVE]))
    sys.meta_path.insert(0, overlay)
    # (the tests' own processes get neither the runtime nor the overlay)
    os.environ.pop("LD_PRELOAD", None)
    code = int(pytest.main(args, plugins=[Track()]))
    loaded = sorted(m for m in overlay.found if m in sys.modules
                    and sys.modules[m].__file__ == str(overlay.found[m]))
    print(f"{_LOADED}{', '.join(loaded) or 'none'}", file=sys.stderr)
    return code


#: the first line of a sanitizer's report
_REPORT = re.compile(r"^==\d+==|[\w/][\w./+-]*:\d+:\d+: runtime error: |Sanitizer: CHECK failed",
                     re.M)

#: a report's stack frame in the interpreter or its FFI: left out of what
#: is shown, where they would fill the first lines
_INTERPRETER = re.escape(os.path.realpath(sys.executable))
_PYTHON_FRAME = re.compile(
    rf"\s+#\d+ 0x[0-9a-f]+ +(in \S+ +)?\(({_INTERPRETER}|\S*/(libffi|_ctypes|_cffi_backend))")


@dataclass
class Outcome:
    """What a sanitized run gave: pytest's exit status (negative: killed by
    that signal, as a sanitizer's abort is), its output and the last test
    it started."""

    returncode: int
    output: str = field(repr=False)
    test: str = ""

    @property
    def report(self) -> str | None:
        """The sanitizer's first report, if any: the error and its stacks
        (frames of our C, libc's and the libraries', not the interpreter's),
        up to its summary, at most REPORT_LINES lines."""
        found = _REPORT.search(self.output)
        if found is None:
            return None
        text = self.output[found.start():]
        for end in ("Shadow bytes around", "Fatal Python error"):  # (shown apart)
            text = text.split(end, 1)[0]
        lines = [line for line in text.splitlines() if not _PYTHON_FRAME.match(line)]
        if len(lines) > REPORT_LINES:
            lines[REPORT_LINES:] = [f"[... {len(lines) - REPORT_LINES} more lines]"]
        return "\n".join(lines)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.report is None

    def loaded(self) -> list[str]:
        """The sanitized extensions the tests loaded."""
        for line in self.output.splitlines():
            if line.startswith(_LOADED):
                return [m for m in line[len(_LOADED):].split(", ") if m != "none"]
        return []

    def describe(self) -> str:
        """Why the run failed: the sanitizer's report, where Python was
        (the innermost frames), how the run ended and pytest's last lines."""
        parts = []
        if self.report is not None:
            parts.append(f"a sanitizer found an error:\n{self.report}")
        where = self.output.split("\nCurrent thread ", 1)
        if len(where) == 2:
            frames = where[1].splitlines()[:12]
            parts.append("in Python (innermost first):\n" + "\n".join(frames[1:]))
        if self.returncode < 0:
            during = f" during {self.test}" if self.test else ""
            parts.append(f"the run was killed by {signal.Signals(-self.returncode).name}{during}")
        else:
            if self.returncode:
                parts.append(f"pytest exited with status {self.returncode}")
            parts.append("its last lines:\n" + "\n".join(self.output.splitlines()[-25:]))
        return "\n\n".join(parts)


def run(pytest_args: Sequence[str], *, capture: bool = True, timeout: float | None = None,
        cache: Path | None = None) -> Outcome:
    """Run pytest with ``pytest_args`` on the sanitized extensions (built
    first if needed). ``capture``: keep the output (else it streams)."""
    if os.environ.get(ACTIVE):
        raise SanitizeError("already a sanitized run: it does not start another")
    tree = build(cache)
    common = "abort_on_error=1:halt_on_error=1:print_stacktrace=1"
    env = {
        **os.environ,
        ACTIVE: str(tree),
        "LD_PRELOAD": preload(),
        "ASAN_OPTIONS": f"detect_leaks=0:{common}",
        "UBSAN_OPTIONS": common,
    }
    # --capture=sys: a report goes to the file descriptor 2 the run started
    # with, never into a test's captured output that its abort loses
    cmd = [sys.executable, "-m", "tools.sanitize", "--inside", "--", "--capture=sys",
           f"--ignore={SELF_TEST}", *pytest_args]
    with tempfile.TemporaryDirectory(prefix="aioublk-sanitize-") as tmp, \
            open(Path(tmp, "output"), "w+") as out:
        current = Path(tmp, "test")
        env[_CURRENT] = str(current)
        # its own process group: what an aborted test leaves running (its
        # servers, which also hold the output open) goes with it
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, process_group=0, text=True,
                             stdout=out if capture else None,
                             stderr=subprocess.STDOUT if capture else None)
        try:
            ended = _wait(p.pid, timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        out.seek(0)
        output = out.read() + ("" if ended else f"\n(timed out after {timeout} s)")
        test = current.read_text() if current.exists() else ""
    return Outcome(p.returncode if ended else -signal.SIGKILL, output, test)


def _wait(pid: int, timeout: float | None) -> bool:
    """Wait up to ``timeout`` for child ``pid`` to end, without reaping it:
    while it is not, its pid (its group's id) cannot be another's."""
    fd = os.pidfd_open(pid)
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.sanitize",
        description="Run pytest with the C extensions built under ASan and UBSan.")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="arguments for pytest (default: the host tests that run "
                             "the C, as the test command runs them)")
    args = parser.parse_args(argv)
    rest = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    if args.inside:
        return _child(rest)
    try:
        outcome = run(rest or c_tests(), capture=False)
    except SanitizeError as e:
        print(f"tools.sanitize: {e}", file=sys.stderr)
        return 2
    if outcome.returncode < 0:
        print(f"tools.sanitize: the run was killed by {signal.Signals(-outcome.returncode).name}"
              " (a sanitizer's report is above it)", file=sys.stderr)
        return 128 - outcome.returncode
    return outcome.returncode


if __name__ == "__main__":
    sys.exit(main())
