"""Only here because cffi's extension hook (cffi_modules) has no pyproject key."""

from setuptools import setup

setup(cffi_modules=["aioublk/_uring_build.py:ffibuilder",
                    "aioublk/qcow2/_zstd_build.py:ffibuilder"])
