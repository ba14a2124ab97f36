"""``python -m aioublk``: the kublk-compatible command line."""

import sys

from aioublk.frontend.cli import main

sys.exit(main())
