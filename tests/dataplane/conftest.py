from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from aioublk._uring import lib
from tests.support.files import Where


@pytest.fixture(params=["disk", "tmpfs"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Where]:
    """A test's files on disk (the ring moves them), or on tmpfs (C does)."""
    if request.param == "disk":
        yield Where(tmp_path, {})
        return
    d = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        yield Where(d, {"inline_io": lib.AUR_DP_INLINE_RAM})
    finally:
        shutil.rmtree(d)
