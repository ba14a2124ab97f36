"""Filters: a layer in front of a target (or another filter), as nbdkit stacks
filters in front of a plugin.

A filter is a ``Target`` that wraps ``inner`` and passes every operation on
unchanged unless it overrides it. What it overrides decides how the C data
plane may serve it:

- a **placement** filter (an offset, a smaller size, read-only) changes only
  where and whether the bytes go; it overrides ``place`` to transform the
  inner map, so C still serves the requests it resolves;
- a filter that touches data or timing (a delay, an error, a log) keeps the
  base ``place``, which removes the map: every request comes to its
  coroutines, which then call the inner layer's.

A minimal filter, failing every write past 1 GiB::

    class Fence(Filter):
        name = "fence"

        async def write(self, offset, buf, fua=False):
            if offset + len(buf) > 1 << 30:
                raise OSError(errno.EPERM, "past the fence")
            await self.inner.write(offset, buf, fua)

``Device(Fence(LoopTarget("disk.img")))`` serves it; the command line stacks
built-in filters with ``--filter NAME[:KEY=VALUE,...]``.

The built-in filters, by the names ``--filter`` and a config's ``filters``
use: placement filters keep the C data plane: ``offset`` (a window of the inner
device), ``partition`` (the window one MBR or GPT partition holds),
``truncate`` (a shorter device), ``readonly`` and ``protect`` (ranges whose
writes are refused). Timing, fault and accounting filters take every request
through Python: ``delay``, ``error``, ``rate`` (token buckets) and ``log`` (a
JSON line per request); so do ``cache``, a read (and write-back) cache in
RAM, ``cow``, an overlay that keeps the inner device unwritten, and
``encrypt``, dm-crypt's plain AES-XTS.

Each is a module here, its class beside its ``SPEC`` (a ``FilterSpec``: its
name, help and options), which ``--filter`` and the config's checks read;
``base`` holds ``Filter``. A module with a ``SPEC`` added here is a
built-in filter: nothing else lists them.
"""
