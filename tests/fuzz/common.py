"""What every fuzz target checks: an error is one of the allowed types and
says what is wrong in one line."""

from __future__ import annotations

import errno

from aioublk.errors import Error


class NotOneLine(AssertionError):
    """An allowed error type whose message is empty or spans lines."""


def check_error(exc: BaseException) -> None:
    """``exc``, one of the errors a target may raise: its message is one
    non-empty line (anything else is a finding)."""
    msg = str(exc)
    if not msg.strip() or len(msg.splitlines()) != 1:
        raise NotOneLine(f"{type(exc).__name__} message is not one line: {msg!r}") from exc


def is_eio(exc: OSError) -> bool:
    """An I/O-time failure of a malformed image: errno EIO, one line."""
    if exc.errno != errno.EIO:
        return False
    check_error(exc)
    return True


__all__ = ["Error", "NotOneLine", "check_error", "is_eio"]
