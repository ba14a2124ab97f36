"""Where a test's backing files live, for the data plane's two ways of
moving their bytes: on disk through the ring, or on tmpfs, where C does
the I/O itself (``inline_io``) because the ring would hand it to a worker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Where:
    """A folder for the test's files, and the plane's setup fields for them."""

    dir: Path
    setup: dict[str, int]
