"""Root conftest: pytester, and the event loops tests run on."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio
import uvloop

from aioublk.ring import Ring

if TYPE_CHECKING:
    from tools.ceph import Cluster

pytest_plugins = ["pytester"]  # aioublk.testing comes through its pytest11 entry point


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under CI (`CI` set, as .ci/run does) a skipped test fails: a host test that
    skips for a missing qemu-nbd, nbdkit, Ceph or certtool would pass a run that
    tested nothing of it. Guest tests fail on a skip anywhere (the aioublk plugin);
    an expected failure stays one."""
    report: pytest.TestReport = yield
    if report.skipped and os.environ.get("CI") and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI, which must run every test (scripts/setup "
                           f"installs every tool the tests use): {reason}")
    return report


@pytest.fixture(autouse=True)
def _structlog_as_it_was() -> Iterator[None]:
    """Each test gets structlog's configuration back as it found it. structlog's
    own ``capture_logs`` leaves structlog *configured* (with its defaults,
    printing to stdout) when it restores, and aioublk's loggers then stop
    reaching logging: a later test's ``caplog`` saw nothing, depending on
    which tests ran before it."""
    import structlog

    was = structlog.get_config() if structlog.is_configured() else None
    yield
    if was is None:
        structlog.reset_defaults()
    else:
        structlog.configure(**was)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Host tests run under the default loop and under uvloop; kernel tests
    (slow under emulation) under uvloop, the loop aioublk itself uses."""
    if item.get_closest_marker("guest"):
        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest_asyncio.fixture
async def ring() -> AsyncIterator[Ring]:
    """A Ring bound to this thread and the test's loop: what the engine and
    the targets submit their I/O to (``aioublk.current_ring``)."""
    r = Ring(256, bind_thread=True)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def no_devices_left() -> Iterator[None]:
    """Kernel tests start with no device and fail if they leave one behind."""
    from tests.support import kernel

    kernel.delete_all()
    yield
    left = kernel.listing()
    kernel.delete_all()
    assert not left, f"devices left behind: {left}"


@pytest.fixture(scope="module")
def ceph() -> Iterator[Cluster]:
    """A throwaway one-node Ceph cluster, started once per test module using it."""
    from tools.ceph import Cluster

    with Cluster() as c:
        yield c


@pytest.fixture
def rbd_image(ceph: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A new image named after the test, of the module's ``RBD_IMAGE_SIZE`` bytes."""
    with ceph.image(re.sub(r"[^A-Za-z0-9_]+", "-", request.node.name).strip("-"),
                    request.module.RBD_IMAGE_SIZE) as spec:
        yield spec
