"""Structured logging: quiet by default (warnings and errors), ``-v`` for
debug, human-readable on a TTY, JSON on request."""

from __future__ import annotations

import logging
import sys

import structlog

_per_request = False


def per_request() -> bool:
    """Whether ``-v``/debug asked for a log line per request. Set only by
    ``configure``: an application that embeds devices without configuring
    aioublk's logs keeps the fast path and a quiet stdout."""
    return _per_request


class _Stderr:
    """``sys.stderr`` as it is when a line is written, not when logs were
    configured: an application (or pytest's capture) may swap and close it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(*, verbose: bool = False, json: bool = False, level: str | None = None) -> None:
    """``level`` ("warning", "info", "debug") overrides ``verbose``."""
    global _per_request
    lvl = logging.DEBUG if verbose else logging.WARNING
    if level is not None:
        lvl = logging.getLevelNamesMapping()[level.upper()]
    _per_request = lvl <= logging.DEBUG
    renderer: structlog.types.Processor
    if json:
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
