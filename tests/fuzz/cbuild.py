"""The C fuzz targets (``tests/fuzz/c``): libFuzzer harnesses over the
project's C, built with clang under ASan and UBSan into the cache
(``$AIOUBLK_CACHE/fuzz``), one binary per target and hash of everything
that goes into it, so an unchanged target is built once.

- ``nbd_wire``: the nbd target's own transmission (``targets/csrc/nbd.c``)
  against a hostile server and any order of the ring's completions;
- ``extents``: the extent table (``dataplane/csrc/extents.c``) against a model;
- ``batch``: the data plane's COMMIT_IO_CMDS encoding and its partial
  commits, and the multishot FETCH_IO_CMDS's completions over its
  provided buffers (``dataplane/csrc``'s C, included by the harness).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from aioublk.testing.sid import cache_dir

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
CSRC = ROOT / "aioublk" / "csrc"
DPSRC = ROOT / "aioublk" / "dataplane" / "csrc"
NBDSRC = ROOT / "aioublk" / "targets" / "csrc"
CLANG = "clang-14"
FLAGS = ["-fsanitize=fuzzer,address,undefined", "-g", "-O1", "-Wall", "-Wextra"]

#: each target: its harness, the project's C it links (or includes), the
#: headers it reads, the include folders and libraries
TARGETS: dict[str, dict[str, list[Path] | list[str]]] = {
    "nbd_wire": {"sources": [HERE / "c" / "fuzz_nbd.c", NBDSRC / "nbd.c"],
                 "headers": [NBDSRC / "nbd.h", DPSRC / "dp_ext.h"],
                 "include": [DPSRC, NBDSRC], "libs": []},
    "extents": {"sources": [HERE / "c" / "fuzz_extents.c", DPSRC / "extents.c"],
                "headers": [DPSRC / "extents.h"], "include": [DPSRC], "libs": ["-lpthread"]},
    "batch": {"sources": [HERE / "c" / "fuzz_batch.c", DPSRC / "extents.c"],
              # (the data plane's .c files, which the harness includes, are headers here)
              "headers": [*sorted(p for p in DPSRC.glob("*.[ch]") if p.name != "extents.c"),
                          CSRC / "ring.h", CSRC / "ublk_cmd.h"],
              "include": [CSRC, DPSRC], "libs": ["-luring", "-lz", "-lzstd", "-lpthread"]},
}


class BuildError(Exception):
    """A C target could not be built (one line: what to do)."""


def _paths(target: str, key: str) -> list[Path]:
    return [Path(p) for p in TARGETS[target][key]]


def _key(target: str, clang: str) -> str:
    """A hash of what the binary is made of: sources, headers, flags, compiler."""
    h = hashlib.sha256()
    version = subprocess.run([clang, "--version"], capture_output=True, text=True).stdout
    h.update("\0".join([version, *FLAGS, *map(str, TARGETS[target]["libs"])]).encode())
    for p in [*_paths(target, "sources"), *_paths(target, "headers"), HERE / "c" / "input.h"]:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def build(target: str) -> Path:
    """The target's binary, built now unless the cache has this version of it."""
    clang = shutil.which(CLANG)
    if clang is None:
        raise BuildError(f"{CLANG} (with libFuzzer) is missing: run scripts/setup")
    out = cache_dir() / "fuzz" / f"{target}-{_key(target, clang)}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    cmd = [clang, *FLAGS, *(f"-I{d}" for d in [*_paths(target, "include"), HERE / "c"]),
           *map(str, _paths(target, "sources")), *map(str, TARGETS[target]["libs"]),
           "-o", str(tmp)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise BuildError(f"cannot build the {target} fuzz target: {p.stderr.strip()[-3000:]}")
    tmp.replace(out)  # (whole or not at all: a parallel build may race us)
    return out


#: sanitizer options: a UBSan report is a finding too, and stops the run
ENV = {"ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
