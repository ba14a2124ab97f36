"""``aioublk.Error``: the base of every exception aioublk raises for reasons
of its own (a kernel or device failure, a config, image or backing file it
refuses, a file another process holds), so an application catches them all
with one ``except aioublk.Error``.

A subclass that is also an ``OSError`` or ``ValueError`` keeps that base, so
an ``except`` written for it still works. Errors of the system underneath
(an ``OSError`` from a read, say) stay what they are. This module is the
lowest layer: any module may import it.
"""

from __future__ import annotations


class Error(Exception):
    """An error aioublk raised, explained in one line."""


class UblkError(Error):
    """A failure explained in one line for the user."""
