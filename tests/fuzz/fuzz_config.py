"""Fuzz target: ``aioublk.frontend.config.load`` over the bytes of a serve config
file. Only the parsed config or a one-line ConfigError may come out.

The files the examples name (disk.img, vm.qcow2...) exist in the target's
directory, so paths get past their existence check. A custom target
("pkg.module:Class") is looked up only among modules already imported:
the fuzzer must not import (and so run) whatever module a mutation names.
"""

from __future__ import annotations

import atexit
import importlib
import shutil
import sys
import tempfile
import types
from pathlib import Path

from aioublk.frontend import config, registry
from tests.fuzz.common import check_error

FILES = ("disk.img", "vm.qcow2", "stripe0.img", "stripe1.img", "meta.img")


def _imported_only(name: str, package: str | None = None) -> types.ModuleType:
    module = sys.modules.get(name)
    if module is None:
        raise ModuleNotFoundError(f"No module named {name!r} (not imported while fuzzing)")
    return module


#: config's view of importlib while fuzzing: import_module sees only imported modules
_IMPORTLIB = types.SimpleNamespace(import_module=_imported_only, util=importlib.util)

_DIR = Path(tempfile.mkdtemp(prefix="fuzz-config-"))
atexit.register(shutil.rmtree, _DIR, True)
for _name in FILES:
    (_DIR / _name).write_bytes(b"\0" * 4096)
_PATH = str(_DIR / "serve.toml")


def one_input(data: bytes) -> None:
    with open(_PATH, "wb") as f:
        f.write(data)
    real, registry.importlib = registry.importlib, _IMPORTLIB  # type: ignore[assignment]
    try:
        cfg = config.load(_PATH)
    except config.ConfigError as e:
        check_error(e)
    else:
        assert isinstance(cfg, config.ServeConfig)
    finally:
        registry.importlib = real
