"""aioublk's loggers, and the command line's structured logs.

Embedded in an application, aioublk prints nothing of its own. Its loggers
(``get_logger``) write to the standard library's ``logging.getLogger(name)``
(``aioublk.device``, ``aioublk.queue``, ...) until someone configures
structlog, so the application's logging configuration decides what is
shown and where; with none, nothing is shown (a ``NullHandler`` on
``aioublk`` keeps logging's last-resort handler off stderr). Once structlog
is configured, by the application or by ``configure``, they are structlog's
loggers, as configured.

The command line calls ``configure``: structlog lines on stderr, quiet by
default (warnings and errors), ``-v`` for debug, human-readable on a TTY,
JSON on request."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_per_request = False

logging.getLogger("aioublk").addHandler(logging.NullHandler())

_fields = structlog.processors.LogfmtRenderer(bool_as_flag=False)


def _to_logging(logger: Any, method_name: str,
                event_dict: structlog.types.EventDict) -> tuple[tuple[str], dict[str, Any]]:
    """The last processor before a ``logging.Logger``: the event, then its
    other keys as ``key=value`` in one message; ``exc_info`` and
    ``stack_info`` go to logging as its own arguments, and ``stacklevel``
    makes the record name aioublk's line that logged, not structlog's."""
    kwargs = {k: event_dict.pop(k) for k in ("exc_info", "stack_info") if k in event_dict}
    # count structlog's frames between here and the caller: at the logging
    # call all but the first (_process_event) are still there, then the caller
    depth, f = 0, sys._getframe(1)
    while f.f_globals.get("__name__", "").startswith("structlog") and f.f_back is not None:
        depth, f = depth + 1, f.f_back
    kwargs["stacklevel"] = depth
    event = str(event_dict.pop("event", ""))
    rest = _fields(logger, method_name, event_dict) if event_dict else ""
    return (f"{event} {rest}" if rest else event,), kwargs


_STDLIB_PROCESSORS: list[structlog.types.Processor] = [
    structlog.stdlib.filter_by_level,
    structlog.contextvars.merge_contextvars,
    _to_logging,
]


class _Logger:
    """One of aioublk's loggers: structlog's once structlog is configured,
    logging's until then. Decided at each call (and at ``bind``, for what
    the bound logger logs), so an application may configure either before
    or after importing aioublk."""

    __slots__ = ("_stdlib", "_structlog")

    def __init__(self, name: str) -> None:
        self._structlog: Any = structlog.get_logger(name)
        self._stdlib = structlog.stdlib.BoundLogger(logging.getLogger(name),
                                                    _STDLIB_PROCESSORS, {})

    def _now(self) -> Any:
        return self._structlog if structlog.is_configured() else self._stdlib

    def __getattr__(self, attr: str) -> Any:  # debug, info, warning, error, exception, bind
        return getattr(self._now(), attr)


def get_logger(name: str) -> Any:
    """The logger aioublk's module ``name`` logs to (see the module's docstring)."""
    return _Logger(name)


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
    """The command line's logs: structlog, configured for every structlog
    user in the process. ``level`` ("warning", "info", "debug") overrides
    ``verbose``."""
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
