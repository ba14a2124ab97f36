"""Build time: C libraries are found where pkg-config says, not at fixed
paths (a library under a prefix builds as one in /usr does)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

PKG = runpy.run_path(str(Path(__file__).resolve().parents[2] / "buildlibs.py"))


@pytest.fixture
def prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A library "libfake" installed under tmp_path, as a .pc file says."""
    (tmp_path / "include" / "fake").mkdir(parents=True)
    (tmp_path / "include" / "fake" / "fake.h").write_text("int fake(void);\n")
    (tmp_path / "pc").mkdir()
    (tmp_path / "pc" / "libfake.pc").write_text(
        f"prefix={tmp_path}\nName: libfake\nDescription: a test\nVersion: 1.0\n"
        "Cflags: -I${prefix}/include -DFAKE=1\nLibs: -L${prefix}/lib -lfake -pthread\n")
    monkeypatch.setenv("PKG_CONFIG_PATH", str(tmp_path / "pc"))
    return tmp_path


def test_flags_come_from_the_pc_file(prefix: Path) -> None:
    args = PKG["source_args"]("libfake", ["ignored"], include_dirs=["csrc"])
    assert args["include_dirs"] == ["csrc", f"{prefix}/include"]
    assert args["library_dirs"] == [f"{prefix}/lib"]
    assert args["libraries"] == ["fake"]
    assert args["extra_compile_args"] == ["-DFAKE=1"]
    assert args["extra_link_args"] == ["-pthread"]


def test_a_library_without_a_pc_file_takes_the_compilers_paths(prefix: Path) -> None:
    assert PKG["source_args"]("librbd-none", ["rbd", "rados"]) == {"libraries": ["rbd", "rados"]}


def test_a_header_is_found_where_the_pc_file_points(prefix: Path) -> None:
    assert PKG["available"]("libfake", "fake/fake.h")
    assert not PKG["header_found"]("fake/fake.h")  # (not on the compiler's own paths)
    assert not PKG["available"]("libnothing", "fake/fake.h")
    assert PKG["header_found"]("stdio.h")
