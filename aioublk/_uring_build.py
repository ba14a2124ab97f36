"""cffi (API mode) builder for ``aioublk._uring``: the C in ``csrc/`` (the io_uring
shim under ``ring.py``) and in ``dataplane/csrc/`` (the data plane, the extent
table) as one extension.

Each .c file is its own translation unit. What Python sees is what the parts'
headers declare between ``/* cdef: begin */`` and ``/* cdef: end */``: plain
declarations and ``#define NAME value`` only, so that cffi can read them as they
are and each declaration is written once. This file holds only what cffi alone
needs (``CDEF``): a struct Python allocates but never looks into, a kernel type,
and liburing's constants by name (the compiler gives their values).
"""

from __future__ import annotations

import os
import re
import runpy
from pathlib import Path

import cffi

#: the C parts in cdef order (a header's cdef may name a type an earlier one
#: declares): each its folder (from the package), its header, and its .c files
PARTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("csrc", "ring.h", ("ring.c",)),
    ("dataplane/csrc", "extents.h", ("extents.c",)),
    ("dataplane/csrc", "dataplane.h",
     ("setup.c", "commands.c", "serve.c", "inflate.c", "plugin.c", "reap.c", "uvhook.c")),
)
_HERE = Path(__file__).parent

#: liburing's constants Python uses
LIBURING_CONSTANTS = (
    "IORING_SETUP_SQE128", "IORING_SETUP_CQE32", "IORING_SETUP_COOP_TASKRUN",
    "IORING_SETUP_SINGLE_ISSUER", "IORING_SETUP_DEFER_TASKRUN", "IORING_SETUP_SUBMIT_ALL",
    "IORING_OP_NOP", "IORING_OP_READV", "IORING_OP_WRITEV", "IORING_OP_FSYNC",
    "IORING_OP_READ_FIXED", "IORING_OP_WRITE_FIXED", "IORING_OP_FALLOCATE", "IORING_OP_READ",
    "IORING_OP_WRITE", "IORING_OP_ASYNC_CANCEL", "IORING_OP_TIMEOUT", "IORING_OP_URING_CMD",
    "IORING_OP_POLL_ADD", "IORING_POLL_ADD_MULTI",
    "IORING_FSYNC_DATASYNC", "IORING_ASYNC_CANCEL_ALL", "IORING_ASYNC_CANCEL_ANY",
    "IORING_CQE_F_BUFFER", "IORING_CQE_F_MORE", "IORING_URING_CMD_FIXED",
    "IORING_URING_CMD_MULTISHOT",
    "IOSQE_FIXED_FILE", "IOSQE_IO_LINK", "IOSQE_IO_HARDLINK", "IOSQE_ASYNC",
    "IOSQE_BUFFER_SELECT", "IOSQE_CQE_SKIP_SUCCESS",
)

#: what cffi alone needs: ring.py allocates a struct aur (cffi learns its size from
#: the compiler), an IORING_OP_TIMEOUT takes a kernel timespec (cffi checks the
#: fields named), and liburing's constants
CDEF = ("struct aur { ...; };\n"
        "struct __kernel_timespec { int64_t tv_sec; long long tv_nsec; ...; };\n"
        + "".join(f"#define {n} ...\n" for n in LIBURING_CONSTANTS))

_REGION = re.compile(r"/\* cdef: begin\b.*?\*/\n(.*?)/\* cdef: end \*/", re.S)
#: the one directive a region may hold: an integer constant, as cffi parses it
_DEFINE = re.compile(r"\s*#\s*define\s+\w+\s+-?0?x?[0-9a-f]+[lu]*\s*", re.I)


def _cdef_of(header: Path) -> str:
    """The cdef region of ``header``; anything but plain declarations and integer
    ``#define``s there stops the build (cffi would misread or refuse it)."""
    regions = _REGION.findall(header.read_text())
    if len(regions) != 1:
        raise SystemExit(f"aioublk build: {header} needs one /* cdef: begin */ ... "
                         "/* cdef: end */ region")
    for line in re.sub(r"/\*.*?\*/", "", regions[0], flags=re.S).splitlines():
        if line.lstrip().startswith("#") and not _DEFINE.fullmatch(line):
            raise SystemExit(f"aioublk build: {header.name}: only plain declarations and "
                             f"`#define NAME value` may sit in its cdef region, not {line!r}")
    return str(regions[0])


def _parts() -> tuple[str, list[str]]:
    """(cdef, sources) of the C parts. A missing file is an error, never a smaller
    extension: one built without a part imports, then fails at its first use."""
    cdef, sources = "", []
    for folder, header, cfiles in PARTS:
        h, cs = _HERE / folder / header, [_HERE / folder / c for c in cfiles]
        missing = [str(p) for p in (h, *cs) if not p.is_file()]
        if missing:
            raise SystemExit(f"aioublk build: missing C source {', '.join(missing)}: "
                             "the source tree or sdist is incomplete")
        cdef += _cdef_of(h)
        # relative: setuptools takes an extension's sources from the setup.py folder
        sources += [os.path.relpath(c) for c in cs]
    return cdef, sources


def include_dirs() -> list[str]:
    """The parts' folders: a header includes another part's by its bare name."""
    return list(dict.fromkeys(str(_HERE / folder) for folder, _h, _c in PARTS))


_PART_CDEF, _SOURCES = _parts()
ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF + _PART_CDEF)
_SOURCE_ARGS = runpy.run_path(str(Path(__file__).parent.parent / "buildlibs.py"))["source_args"]
#: liburing, and the two inflaters the data plane calls for a compressed
#: qcow2 cluster (zlib's raw deflate, zstd)
_LINK = _SOURCE_ARGS("liburing", ["uring"], include_dirs=include_dirs())
for _pkg, _lib in (("zlib", "z"), ("libzstd", "zstd")):
    for _key, _values in _SOURCE_ARGS(_pkg, [_lib]).items():
        _LINK.setdefault(_key, [])
        _LINK[_key] += [v for v in _values if v not in _LINK[_key]]
ffibuilder.set_source("aioublk._uring", "".join(f'#include "{h}"\n' for _f, h, _c in PARTS),
                      sources=_SOURCES, **_LINK)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
