"""aioublk's version, from the installed package's metadata. Its one source
is ``project.version`` in pyproject.toml; installing (``scripts/setup``
reinstalls when pyproject.toml changes) writes it into the metadata."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("aioublk")
except metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"
