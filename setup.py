"""Only here because cffi's extension hook (cffi_modules) has no pyproject key.

The nbd and rbd targets' extensions are built only where libnbd's and
librbd's headers are: without them aioublk still installs, and ``-t nbd`` or
``-t rbd`` says what to install."""

import os

from setuptools import setup

modules = ["aioublk/_uring_build.py:ffibuilder", "aioublk/qcow2/_zstd_build.py:ffibuilder"]
if os.path.exists("/usr/include/libnbd.h"):
    modules.append("aioublk/targets/_nbd_build.py:ffibuilder")
if os.path.exists("/usr/include/rbd/librbd.h"):
    modules.append("aioublk/targets/_rbd_build.py:ffibuilder")

setup(cffi_modules=modules)
