"""The C of ``aioublk/csrc`` as plain C: each file compiles alone, warning-free, so
none leans on what another happens to include before it (the builder used to
paste them into one source), and the builder's cdef takes only declarations."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from aioublk import _uring_build

CSRC = Path(_uring_build.__file__).parent / "csrc"
CFLAGS = ["-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-I", str(CSRC)]


def _cc(src: Path) -> None:
    p = subprocess.run(["cc", *CFLAGS, str(src)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("name", sorted(p.name for p in CSRC.glob("*.c")))
def test_each_c_file_compiles_alone(name: str) -> None:
    _cc(CSRC / name)


@pytest.mark.parametrize("name", sorted(p.name for p in CSRC.glob("*.h")))
def test_each_header_compiles_alone(name: str, tmp_path: Path) -> None:
    src = tmp_path / "only.c"
    src.write_text(f'#include "{name}"\n')
    _cc(src)


def test_every_part_is_here_and_the_kernel_abi_is_the_vendored_one() -> None:
    """The build host's <linux/ublk_cmd.h> may be older than the guest kernel's:
    only csrc/ublk_cmd.h may define the ABI."""
    assert {p.stem for p in CSRC.glob("*.c")} == set(_uring_build.PARTS)
    for path in CSRC.glob("*.[ch]"):
        assert "<linux/ublk_cmd.h>" not in path.read_text(), path.name


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
