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
JSON on request. A server's lines may go to a log file instead (opened by
the command, before a daemon detaches, so that a bad path is an error at
the prompt) or, for a daemon given none, to syslog: nothing it logs is
lost with its stderr on /dev/null."""

from __future__ import annotations

import errno
import logging
import logging.handlers
import os
import sys
import threading
from typing import Any

import structlog

from aioublk.errors import Error

_per_request = False

#: where a daemon without a log file sends its lines (journald reads it too);
#: a module attribute so that tests can point it at a socket of their own
SYSLOG_ADDRESS = "/dev/log"
SYSLOG_IDENT = "aioublk"

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


class LogFileError(Error, OSError):
    """A log destination that cannot be opened, in one line saying what to do."""


def open_log_file(path: str) -> int:
    """A descriptor appending to ``path`` (created 0640), or LogFileError.
    A symlink at ``path`` is refused (O_NOFOLLOW): a server runs as root,
    and a link planted under the name (in /tmp, say) would have it append
    to whatever file the link names."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NOCTTY
    try:
        return os.open(path, flags, 0o640)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LogFileError(f"cannot open log file {path}: it is a symlink: name the file "
                               "itself") from None
        raise LogFileError(f"cannot open log file {path}: {e.strerror}: fix the path or its "
                           "permissions, or pick another") from None


def syslog_handler() -> logging.handlers.SysLogHandler:
    """A connection to syslog at ``SYSLOG_ADDRESS`` (LogFileError if nothing
    listens there; once connected, the handler reconnects by itself)."""
    handler = logging.handlers.SysLogHandler(
        SYSLOG_ADDRESS, logging.handlers.SysLogHandler.LOG_DAEMON)
    if handler.socktype is None:  # (nothing listens: it gives up without a word)
        handler.close()
        why = "nothing listens there" if os.path.exists(SYSLOG_ADDRESS) else "it does not exist"
        raise LogFileError(f"no syslog at {SYSLOG_ADDRESS}: {why}")
    handler.append_nul = False
    return handler


class _HandlerLogger:
    """structlog's last stop when lines go to a ``logging.Handler`` (syslog):
    each rendered line is one record at the level it was logged at."""

    _LEVELS = {"exception": logging.ERROR,  # (and warn, fatal: logging knows them)
               **{name.lower(): n for name, n in logging.getLevelNamesMapping().items()}}

    def __init__(self, handler: logging.Handler) -> None:
        self._handler = handler

    def __getattr__(self, method: str) -> Any:  # debug, info, warning, error, msg...
        level = self._LEVELS.get(method, logging.INFO)

        def send(message: str) -> None:
            # the ident names the pid that logs: a daemon's, not the command's
            self._handler.ident = f"{SYSLOG_IDENT}[{os.getpid()}]: "  # type: ignore[attr-defined]
            self._handler.handle(logging.LogRecord(SYSLOG_IDENT, level, "", 0, message,
                                                   None, None))
        return send


def log_uncaught_in_threads() -> None:
    """An exception that ends a thread is logged (with its traceback) instead
    of printed on a stderr that may be /dev/null."""
    log = get_logger("aioublk")

    def hook(a: threading.ExceptHookArgs) -> None:
        if a.exc_type is not SystemExit:
            log.error("thread ended by an exception",
                      thread=a.thread.name if a.thread else "?",
                      exc_info=(a.exc_type, a.exc_value, a.exc_traceback))
    threading.excepthook = hook


def configure(*, verbose: bool = False, json: bool = False, level: str | None = None,
              to: int | logging.Handler | None = None) -> None:
    """The command line's logs: structlog, configured for every structlog
    user in the process. ``level`` ("warning", "info", "debug") overrides
    ``verbose``. Lines go to stderr, or to ``to``: a descriptor (a log
    file, appended to) or a handler (syslog)."""
    global _per_request
    lvl = logging.DEBUG if verbose else logging.WARNING
    if level is not None:
        lvl = logging.getLevelNamesMapping()[level.upper()]
    _per_request = lvl <= logging.DEBUG
    renderer: structlog.types.Processor
    if json:
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=to is None and sys.stderr.isatty())
    factory: Any
    if isinstance(to, logging.Handler):
        handler = to
        factory = lambda *_: _HandlerLogger(handler)  # noqa: E731
    elif to is not None:
        factory = structlog.PrintLoggerFactory(
            file=os.fdopen(to, "a", buffering=1, encoding="utf-8", closefd=False))
    else:
        factory = structlog.PrintLoggerFactory(file=_Stderr())  # type: ignore[arg-type]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
