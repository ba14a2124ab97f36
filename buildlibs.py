"""Build time: where a C library is, as its packager says (pkg-config and
its ``.pc`` file), so one under a prefix or /opt is found and linked as
installed; for a library without a ``.pc`` (librbd), the C compiler's own
search decides whether its header is there.

setup.py and the cffi builders load this file by path before aioublk is
installed, so it imports nothing of aioublk; it sits beside setup.py, not in
the package, because nothing installed ever needs it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from typing import Any

__all__ = ["available", "cffi_modules", "header_found", "source_args"]


def _pkg_config(*args: str) -> str | None:
    """pkg-config's answer, or None (no pkg-config, or no such package)."""
    try:
        p = subprocess.run([os.environ.get("PKG_CONFIG", "pkg-config"), *args],
                           capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return p.stdout if p.returncode == 0 else None


def source_args(package: str, libraries: list[str], **extra: list[str]) -> dict[str, Any]:
    """``cffi.FFI.set_source`` keywords for ``package`` from its pkg-config
    flags, plus ``extra`` (e.g. include_dirs); just ``libraries`` on the
    compiler's default paths when pkg-config does not know it."""
    out: dict[str, list[str]] = {k: list(v) for k, v in extra.items()}

    def put(key: str, value: str) -> None:
        out.setdefault(key, [])
        if value not in out[key]:
            out[key].append(value)

    cflags, libs = _pkg_config("--cflags", package), _pkg_config("--libs", package)
    if cflags is None or libs is None:
        for lib in libraries:
            put("libraries", lib)
        return out
    for flag in shlex.split(cflags):
        if flag.startswith("-I"):
            put("include_dirs", flag[2:])
        else:
            put("extra_compile_args", flag)
    for flag in shlex.split(libs):
        if flag.startswith("-L"):
            put("library_dirs", flag[2:])
        elif flag.startswith("-l"):
            put("libraries", flag[2:])
        else:
            put("extra_link_args", flag)
    return out


def header_found(header: str, include_dirs: list[str] | None = None) -> bool:
    """Whether the C compiler (``$CC``, else cc) finds ``<header>``."""
    cc = shlex.split(os.environ.get("CC", "cc"))
    dirs = [f"-I{d}" for d in include_dirs or []]
    try:
        p = subprocess.run([*cc, *dirs, "-E", "-x", "c", "-", "-o", os.devnull],
                           input=f"#include <{header}>\n", capture_output=True, text=True,
                           timeout=60)
    except OSError:
        return False
    return p.returncode == 0


def available(package: str, header: str) -> bool:
    """Whether the library can be built against: its header found with its
    pkg-config flags (or the compiler's own paths when it has no ``.pc``)."""
    args = source_args(package, [])
    return header_found(header, args.get("include_dirs"))


def cffi_modules() -> list[str]:
    """The cffi builders (``path:ffibuilder``) to run here: the nbd and rbd
    targets' only where their library is."""
    modules = ["aioublk/_uring_build.py:ffibuilder", "aioublk/qcow2/_zstd_build.py:ffibuilder"]
    if available("libnbd", "libnbd.h"):
        modules.append("aioublk/targets/_nbd_build.py:ffibuilder")
    if available("librbd", "rbd/librbd.h"):
        modules.append("aioublk/targets/_rbd_build.py:ffibuilder")
    return modules
