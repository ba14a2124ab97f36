"""Where aioublk's log lines go: through the standard ``logging`` module in an
application that did not configure structlog (and nowhere if it configured
nothing), through structlog once the application or the CLI configured it.
Each case runs in a fresh interpreter: structlog's configuration is global."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: an application embedding aioublk: SETUP configures (or not) its logging,
#: then library code logs a warning, a bound logger with context logs one,
#: and a target's exception is logged with its traceback
APP = """
import asyncio, logging, os, sys
import structlog
{setup}
import aioublk
from aioublk.io import directio
from aioublk import logs
from aioublk.kernel import uapi
from aioublk.queue.driver import serve_request

fd = os.open({path!r}, os.O_RDWR | os.O_CREAT, 0o600)
directio.make_buffered(fd, {path!r}, "a test")
structlog.contextvars.bind_contextvars(worker=7)
logs.get_logger("aioublk.device").bind(dev=3).info("bound and merged")

class Broken(aioublk.Target):
    async def read(self, offset, buf):
        raise RuntimeError("the target broke")

res = asyncio.run(serve_request(Broken(), int(uapi.Op.READ), 8, 0,
                                memoryview(bytearray(4096)), q=1, tag=2))
assert res == -5, res
"""


def run_app(tmp_path: Path, setup: str) -> subprocess.CompletedProcess[str]:
    code = APP.format(setup=textwrap.dedent(setup), path=str(tmp_path / "file"))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)


def test_nothing_printed_when_the_application_configured_no_logging(tmp_path: Path) -> None:
    out = run_app(tmp_path, "")
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


def test_records_reach_the_applications_logging_config(tmp_path: Path) -> None:
    out = run_app(tmp_path, """
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="LOG %(name)s %(levelname)s %(module)s.%(funcName)s: "
                                   "%(message)s")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    path = tmp_path / "file"
    # the record names aioublk's module and function, not structlog's
    assert lines[0] == ("LOG aioublk.directio WARNING directio.make_buffered: direct I/O "
                        f'refused: buffered I/O from now on path={path} reason="a test"')
    assert lines[1] == "LOG aioublk.device INFO <string>.<module>: bound and merged dev=3 worker=7"
    assert lines[2].startswith("LOG aioublk.queue ERROR driver.serve_request: target raised: "
                               "request failed with EIO q=1 tag=2 op=0 offset=0 length=4096")
    assert lines[3] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: the target broke"


def test_the_logging_level_filters_before_anything_is_formatted(tmp_path: Path) -> None:
    out = run_app(tmp_path, """
        logging.basicConfig(level=logging.ERROR, stream=sys.stderr, format="LOG %(message)s")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    assert out.stderr.startswith("LOG target raised")
    assert "direct I/O refused" not in out.stderr and "bound and merged" not in out.stderr


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_application_that_configured_structlog_gets_the_lines(tmp_path: Path,
                                                                 when: str) -> None:
    """Its structlog config decides, whether made before or after aioublk was
    imported; the stdlib route is not used then."""
    configure = """
        structlog.configure(processors=[structlog.processors.add_log_level,
                                        structlog.processors.JSONRenderer()],
                            logger_factory=structlog.PrintLoggerFactory(sys.stdout))
    """
    setup = """logging.basicConfig(level=logging.DEBUG, format="LOG %(name)s %(message)s")\n"""
    setup += ("" if when == "before" else "import aioublk\n") + textwrap.dedent(configure)
    out = run_app(tmp_path, setup)
    assert out.returncode == 0, out.stderr
    assert "LOG aioublk" not in out.stderr  # (asyncio's own debug lines are there)
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(e["event"], e["level"]) for e in events] == [
        ("direct I/O refused: buffered I/O from now on", "warning"),
        ("bound and merged", "info"),
        ("target raised: request failed with EIO", "error")]
    assert events[1]["dev"] == 3


def test_the_cli_configuration_keeps_its_lines_on_stderr(tmp_path: Path) -> None:
    """``logs.configure`` (what the CLI calls): structlog lines, JSON on
    request, warnings and errors by default, on stderr; never via logging."""
    out = run_app(tmp_path, """
        logging.basicConfig(level=logging.DEBUG, format="LOG %(name)s %(message)s")
        from aioublk import logs
        logs.configure(json=True)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    assert "LOG aioublk" not in out.stderr
    events = [json.loads(line) for line in out.stderr.splitlines() if not line.startswith("LOG ")]
    assert [(e["event"], e["level"]) for e in events] == [
        ("direct I/O refused: buffered I/O from now on", "warning"),
        ("target raised: request failed with EIO", "error")]
    assert "RuntimeError: the target broke" in events[1]["exception"]
