"""The C of ``aioublk._uring`` (``aioublk/csrc``, ``aioublk/dataplane/csrc``) as
plain C: each file compiles alone, warning-free, so none leans on what another
happens to include before it (the builder used to paste them into one source),
and the builder's cdef takes only declarations."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from aioublk import _uring_build

PACKAGE = Path(_uring_build.__file__).parent
CSRC = PACKAGE / "csrc"
DIRS = [Path(d) for d in _uring_build.include_dirs()]
CFLAGS = ["-fsyntax-only", "-Wall", "-Wextra", "-Werror", *(f"-I{d}" for d in DIRS)]
FILES = {str(p.relative_to(PACKAGE)): p for d in DIRS for p in d.iterdir()}


def _cc(src: Path) -> None:
    p = subprocess.run(["cc", *CFLAGS, str(src)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("name", sorted(n for n in FILES if n.endswith(".c")))
def test_each_c_file_compiles_alone(name: str) -> None:
    _cc(FILES[name])


@pytest.mark.parametrize("name", sorted(n for n in FILES if n.endswith(".h")))
def test_each_header_compiles_alone(name: str, tmp_path: Path) -> None:
    src = tmp_path / "only.c"
    src.write_text(f'#include "{FILES[name].name}"\n')
    _cc(src)


def test_every_part_is_here_and_the_kernel_abi_is_the_vendored_one() -> None:
    """Every .c file of the folders is built (none left out), and the build host's
    <linux/ublk_cmd.h> may be older than the guest kernel's: only csrc/ublk_cmd.h
    may define the ABI."""
    built = {f"{folder}/{c}" for folder, _h, cs in _uring_build.PARTS for c in cs}
    assert {n for n in FILES if n.endswith(".c")} == built
    assert (CSRC / "ublk_cmd.h").is_file()
    for name, path in FILES.items():
        assert "<linux/ublk_cmd.h>" not in path.read_text(), name


@pytest.mark.parametrize("line", ["#include <stdint.h>", "#ifdef X", "#define F(x) (x)",
                                  "#define X (1U << 2)"])
def test_a_cdef_region_takes_only_declarations(line: str, tmp_path: Path) -> None:
    header = tmp_path / "x.h"
    header.write_text(f"/* cdef: begin */\n#define OK 0x10\nint f(void);\n{line}\n"
                      "/* cdef: end */\n")
    with pytest.raises(SystemExit, match="only plain declarations"):
        _uring_build._cdef_of(header)
    header.write_text("/* cdef: begin */\n#define OK 0x10 /* why */\nint f(void);\n"
                      "/* cdef: end */\n")
    assert "int f(void);" in _uring_build._cdef_of(header)
