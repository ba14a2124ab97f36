"""Only here because cffi's extension hook (cffi_modules) has no pyproject key.

The nbd target's extension is built only where libnbd's header is: without
it aioublk still installs, and ``-t nbd`` says what to install."""

import os

from setuptools import setup

modules = ["aioublk/_uring_build.py:ffibuilder", "aioublk/qcow2/_zstd_build.py:ffibuilder"]
if os.path.exists("/usr/include/libnbd.h"):
    modules.append("aioublk/targets/_nbd_build.py:ffibuilder")

setup(cffi_modules=modules)
