"""Only here because cffi's extension hook (cffi_modules) has no pyproject key.

The nbd and rbd targets' extensions are built only where libnbd's and
librbd's headers are (found with pkg-config's flags, else on the compiler's
own paths: buildlibs.py): without them aioublk still installs, and
``-t nbd`` or ``-t rbd`` says what to install."""

import runpy
from pathlib import Path

from setuptools import setup

cffi_modules = runpy.run_path(str(Path(__file__).parent / "buildlibs.py"))["cffi_modules"]
setup(cffi_modules=cffi_modules())
