"""What aioublk ships to a library user: the PEP 561 marker, its names at the
top level, one exception base, one version number."""

from __future__ import annotations

import ast
import errno
import fnmatch
import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

import pytest

import aioublk

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(aioublk.__file__).parent


def pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_py_typed_is_in_the_package_and_its_package_data() -> None:
    """Without the marker mypy ignores aioublk's annotations in a user's code;
    without the package-data entry the wheel would leave it (and the C
    extension's stub) behind."""
    data = pyproject()["tool"]["setuptools"]["package-data"]["aioublk"]  # type: ignore[index]
    for name in ("py.typed", "_uring.pyi"):
        assert (PACKAGE / name).is_file(), name
        assert any(fnmatch.fnmatch(name, pattern) for pattern in data), (name, data)


def _raise_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[
        tuple[type[BaseException], Callable[[], object]]]:
    """(class, a call into aioublk that raises it) for each of the library's errors."""
    from aioublk.dataplane.extents import ExtentConflict, ExtentTable
    from aioublk.errors import UblkError
    from aioublk.frontend import config, stats
    from aioublk.io import locking
    from aioublk.io.hostfile import Backing, BackingError
    from aioublk.qcow2.format import Qcow2Error, parse_header
    from aioublk.queue.options import DeviceConfig

    yield UblkError, lambda: DeviceConfig(queues=0).validate()
    bad = tmp_path / "bad.toml"
    bad.write_text("[[devices]]\nqeues = 1\n")
    yield config.ConfigError, lambda: config.load(str(bad))
    yield Qcow2Error, lambda: parse_header(b"not an image", 12)
    yield BackingError, lambda: Backing(str(tmp_path / "missing.img"))

    image = tmp_path / "held.img"
    image.write_bytes(bytes(4096))
    monkeypatch.setattr(locking, "GRACE", 0.0)
    holder = os.open(image, os.O_RDWR)
    other = os.open(image, os.O_RDWR)
    try:
        locking.lock(holder, str(image), write=True)
        yield locking.InUse, lambda: locking.lock(other, str(image), write=True)
    finally:
        os.close(other)
        os.close(holder)

    def lock_failed() -> None:
        raise locking.LockFailed(str(image), OSError(errno.EIO, "Input/output error"))
    yield locking.LockFailed, lock_failed

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setattr(stats, "RUN_DIR", tmp_path / "run")
    yield stats.RunDirError, lambda: stats.open_run_dir(create=False)

    table = ExtentTable(4096)
    table.insert(0, 4096, 3, 0, writable=True)
    yield ExtentConflict, lambda: table.insert(0, 4096, 4, 8192, writable=True)


def test_except_aioublk_error_catches_what_the_library_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    for cls, call in _raise_each(tmp_path, monkeypatch):
        assert issubclass(cls, aioublk.Error), cls
        try:
            call()
        except aioublk.Error as e:
            assert type(e) is cls, (cls, e)
            seen.append(cls.__name__)
        else:
            raise AssertionError(f"{cls.__name__}: nothing raised")
    assert seen == ["UblkError", "ConfigError", "Qcow2Error", "BackingError", "InUse",
                    "LockFailed", "RunDirError", "ExtentConflict"]


def test_error_subclasses_keep_their_other_bases() -> None:
    """An ``except OSError`` (or ValueError) written before aioublk.Error
    existed still catches them."""
    from aioublk.dataplane.extents import ExtentConflict
    from aioublk.frontend.stats import RunDirError
    from aioublk.io.locking import LockFailed

    assert issubclass(LockFailed, OSError) and issubclass(RunDirError, OSError)
    assert issubclass(ExtentConflict, ValueError)
    e = LockFailed("/x", OSError(errno.EIO, "Input/output error"))
    assert e.errno == errno.EIO and str(e) == "cannot lock /x: Input/output error"


def test_star_import_gives_every_name_in_all() -> None:
    names: dict[str, object] = {}
    exec("from aioublk import *", names)
    assert len(set(aioublk.__all__)) == len(aioublk.__all__)
    assert set(aioublk.__all__) <= names.keys()


def _documented_imports() -> set[str]:
    """Names that examples/*.py and README.md's Python blocks take from
    ``aioublk`` itself (``from aioublk import X`` or ``aioublk.X``)."""
    sources = [p.read_text() for p in sorted((ROOT / "examples").glob("*.py"))]
    readme = (ROOT / "README.md").read_text()
    sources += [block.split("```")[0] for block in readme.split("```python\n")[1:]]
    names = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module == "aioublk":
                names |= {a.name for a in node.names}
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "aioublk"):
                names.add(node.attr)
    return names


def test_what_the_examples_and_readme_import_is_exported() -> None:
    names = _documented_imports()
    assert {"Device", "Target", "Geometry", "UblkError"} <= names  # the parse found them
    assert names - {"__version__"} <= set(aioublk.__all__)


def test_every_error_class_of_the_library_is_exported() -> None:
    """A new aioublk.Error subclass is reachable as aioublk.<Name> too."""
    found = set()
    for info in pkgutil.walk_packages(aioublk.__path__, "aioublk."):
        if info.name == "aioublk.__main__" or info.name.startswith("aioublk.testing"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and issubclass(obj, aioublk.Error)
                    and obj.__module__ == info.name and not name.startswith("_")):
                found.add(name)
    assert "UblkError" in found
    assert found <= set(aioublk.__all__), found - set(aioublk.__all__)
    for name in found:
        assert issubclass(getattr(aioublk, name), aioublk.Error)


#: what aioublk.testing ships: the guest harness a user's tests run under, the
#: virtme-run it boots through (the guest's root cached), and the Debian sid
#: kernel fetcher its default (`--guest-kernel` unset) needs at run time
SHIPPED_TESTING = {"__init__", "guest", "pytest_plugin", "sid", "virtme_run"}


def test_the_wheel_carries_no_development_tooling() -> None:
    """The project's own tooling (kublk builder, Ceph cluster, demo) lives in tools/,
    which no listed package names: a wheel holds only aioublk and its subpackages."""
    packages = pyproject()["tool"]["setuptools"]["packages"]  # type: ignore[index]
    assert all(p == "aioublk" or p.startswith("aioublk.") for p in packages), packages
    assert {p.stem for p in (PACKAGE / "testing").glob("*.py")} == SHIPPED_TESTING
    assert (ROOT / "tools" / "kublk.py").is_file()


def test_one_version_written_once_and_read_without_the_metadata() -> None:
    """aioublk/_version.py is the source; pyproject.toml takes it from there,
    the installed metadata agrees (a mismatch: run scripts/setup), and
    nothing imports importlib.metadata to learn it (seconds in a guest)."""
    assert pyproject()["project"]["dynamic"] == ["version"]  # type: ignore[index]
    assert metadata.version("aioublk") == aioublk.__version__
    out = subprocess.run([sys.executable, "-c", "import sys; from aioublk.frontend import "
                          "verb; verb.parser(); print('importlib.metadata' in sys.modules)"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout == "False\n"


def test_cli_version() -> None:
    out = subprocess.run([sys.executable, "-m", "aioublk", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"aioublk {aioublk.__version__}\n", "")


#: what a source tree must never carry into the sdist test's copy: builds of this
#: checkout (an in-tree `_uring*.so` would hide a C part the sdist left out)
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "site", "*.so",
                                     "*.egg-info", "__pycache__", ".*_cache")


def test_sdist_builds_a_wheel_that_imports_and_runs(tmp_path: Path) -> None:
    """The sdist is what pip builds from when no wheel fits: every C source must be in
    it, and the extension built from it must export what the Python side uses. Built
    from a copy of the tree without any compiled file, installed into a fresh venv."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    build = subprocess.run([sys.executable, "-m", "build", "--sdist", "-o", str(tmp_path)],
                           cwd=src, capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (sdist,) = tmp_path.glob("aioublk-*.tar.gz")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                              "--no-cache-dir", str(sdist)],
                             capture_output=True, text=True, timeout=600, check=False)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    # run from elsewhere, so `import aioublk` cannot find this checkout
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import aioublk, aioublk.dataplane.plane, aioublk.ring; "
                            "print(aioublk.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert str(venv) in probe.stdout, probe.stdout
    site = Path(probe.stdout.strip()).parent.parent
    assert not (site / "tools").exists(), "the development tooling was installed"
    assert {p.stem for p in (site / "aioublk" / "testing").glob("*.py")} == SHIPPED_TESTING
    version = subprocess.run([str(venv / "bin" / "aioublk"), "--version"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, check=False)
    assert version.returncode == 0, version.stderr[-2000:]
    assert version.stdout.strip() == f"aioublk {metadata.version('aioublk')}"


def test_a_missing_c_part_fails_the_build(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An extension built without one of its C parts imports, then fails at first use:
    the build must stop instead, naming the file."""
    from aioublk import _uring_build

    for folder, header, cfiles in _uring_build.PARTS:
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        for name in (header, *cfiles):
            shutil.copy(PACKAGE / folder / name, tmp_path / folder)
    monkeypatch.setattr(_uring_build, "_HERE", tmp_path)
    assert _uring_build._parts()[1]
    folder, _header, cfiles = _uring_build.PARTS[-1]
    (tmp_path / folder / cfiles[-1]).unlink()
    with pytest.raises(SystemExit, match=f"missing C source .*{folder}/{cfiles[-1]}"):
        _uring_build._parts()
