"""What aioublk ships to a library user: the PEP 561 marker, its names at the
top level, one exception base, one version number."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import aioublk

ROOT = Path(__file__).resolve().parent.parent
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
