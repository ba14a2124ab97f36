"""pytest side of the guest harness: `@pytest.mark.guest` tests run under a real ublk kernel.

Registered by aioublk's `pytest11` entry point, so a project that installs
aioublk gets the `guest` marker and options without a conftest line (naming
it in `pytest_plugins` or `-p aioublk.testing.pytest_plugin` as well is a
double registration, which pytest refuses). How it works, and the pytest
facts it leans on:

- Three situations. With `/dev/ublk-control` present (a host with ublk_drv,
  or inside our guest) guest tests simply run. Inside the guest
  (`AIOUBLK_IN_GUEST=1`) without it, each guest test fails with a clear
  message: a skipped kernel test would hide a broken harness. On a host
  without it, the selected guest tests run in ONE guest boot (a boot costs
  about 7 s, starting pytest in the emulated guest 5-10 s more, and Python
  runs 11-14x slower there) and the host replays their results.
- Selection first: `-k`, `-m` and node ids deselect in a normal
  `pytest_collection_modifyitems`; ours is `trylast`, so it sees the final
  list, and it swaps each guest item for a `GuestProxy`, a plain `pytest.Item`
  with the same node id and location but no fixtures at all: nothing of the
  test (no `tmp_path`, no ublk fixture, no autouse fixture) runs on the host.
  The proxies keep their place in the list, so host fixtures scoped to a
  module or class are set up and torn down as pytest's SetupState expects.
- The guest pytest runs lazily, before the first proxy's protocol (outside the
  per-phase output capture), with `-p no:cacheprovider` (the checkout is
  read-only there), `--junitxml` into a `--rwdir` folder, and our plugin
  writing every report, serialised with `pytest_report_to_serializable` (as
  pytest-xdist does), one JSON line each, as it happens: a guest that dies at
  test 40 still gives the results of tests 1-39. Its output is streamed live.
- `pytest_runtest_makereport` is `firstresult`: for a proxy we return the
  guest's own report for that phase (outcome, longrepr, captured output,
  duration), so the host summary counts guest tests like any other test. A
  phase the guest never reported fails, saying why.
- A guest test that skips (`pytest.skip`, a `skipif` mark, a skipping
  fixture, `importorskip`) fails instead, wherever it runs: a wrapper of
  `pytest_runtest_makereport` turns the skipped report into a failed one (a
  skip in setup shows as an error). Expected failures (`xfail`) stay so.
- A slow or hung test fails alone. Each guest test has a limit
  (`--guest-test-timeout`, or `@pytest.mark.guest(timeout=S)`); in the guest a
  watchdog thread, armed as the test starts, writes that test's failed report
  with every thread's stack and ends the guest pytest (a hung test may sit
  in the kernel, where no exception reaches it; a fresh boot is cleaner than
  whatever it left behind). The host then boots again for the tests that have
  no report yet. The guest also writes a line as each test starts, so when the
  guest dies some other way (a kernel hang, a crash, or the host's own
  watchdog: no line for longer than the largest limit plus a boot's grace)
  the test that was running takes the failure and the rest run in a new
  boot. A boot that reports nothing new is the last. A boot's limit is the sum
  of its tests' limits plus a boot's grace; `--guest-timeout` caps the whole run.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aioublk.testing import guest
from aioublk.testing.sid import SetupError, scratch_dir

UBLK_CONTROL = Path("/dev/ublk-control")
REPORTS_ENV = "AIOUBLK_GUEST_REPORTS"  # set for the guest pytest: where to write reports
#: the guest pytest's exit status when a test outlived its limit (the watchdog's)
STATUS_TEST_TIMEOUT = 86
STOPPED = {
    guest.STATUS_TIMEOUT: "the guest run timed out (--guest-timeout, or no test progressed)",
    guest.STATUS_NO_RESULT: "the guest stopped early: panic, crash or failed boot (see above)",
    STATUS_TEST_TIMEOUT: "a test outlived its limit (--guest-test-timeout) and the guest "
                         "pytest was ended",
}
DEFAULT_TEST_TIMEOUT = 600.0
#: the host's allowance for a boot, the guest pytest's start and its collection (seen:
#: over 300 s under TCG on a machine busy with other guests)
BOOT_GRACE = 600.0


PYTEST_EXIT = {2: "interrupted", 3: "internal error", 4: "usage error", 5: "no tests collected"}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aioublk", "aioublk kernel tests")
    group.addoption(
        "--no-guest",
        action="store_true",
        help="deselect @pytest.mark.guest tests (they need ublk_drv, maybe a QEMU guest)",
    )
    group.addoption(
        "--guest-timeout",
        type=float,
        default=float(os.environ["AIOUBLK_GUEST_TIMEOUT"])
        if os.environ.get("AIOUBLK_GUEST_TIMEOUT") else None,
        help="seconds for the whole guest run (env AIOUBLK_GUEST_TIMEOUT; default: none, "
             "each boot has the sum of its tests' limits)",
    )
    group.addoption(
        "--guest-test-timeout",
        type=float,
        default=float(os.environ.get("AIOUBLK_GUEST_TEST_TIMEOUT", DEFAULT_TEST_TIMEOUT)),
        help="seconds one guest test may take before it fails alone (env "
             "AIOUBLK_GUEST_TEST_TIMEOUT, default 600; a test's own: "
             "@pytest.mark.guest(timeout=S))",
    )
    group.addoption(
        "--guest-accel",
        choices=guest.ACCELS,
        default=guest.default_accel(),
        help="kvm, tcg, or auto: KVM if a quick probe runs it (env AIOUBLK_GUEST_ACCEL)",
    )
    group.addoption(
        "--guest-kernel",
        metavar="PATH",
        help="bzImage the guest boots (env AIOUBLK_GUEST_KERNEL; default Debian sid's, cached)",
    )
    group.addoption(
        "--guest-modules",
        metavar="DIR",
        help="that kernel's /lib/modules/RELEASE tree (env AIOUBLK_GUEST_MODULES)",
    )


def test_limit(item: pytest.Item) -> float:
    """Seconds this guest test may run: its marker's `timeout`, else the option's."""
    marker = item.get_closest_marker("guest")
    own = marker.kwargs.get("timeout") if marker is not None else None
    return float(own if own is not None else item.config.getoption("guest_test_timeout"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "guest(timeout=None): needs the real ublk_drv kernel driver; timeout: "
                   "seconds before it fails alone (default --guest-test-timeout)")
    if os.environ.get(REPORTS_ENV) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_ReportWriter(config, Path(os.environ[REPORTS_ENV])))


class _ReportWriter:
    """Guest side: every test and failed collection report as a JSON line, flushed
    at once; a line as each test starts; and the watchdog that ends a test's overtime."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.config = config
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the session
        self.lock = threading.Lock()  # the watchdog thread writes too

    def _line(self, data: dict[str, Any]) -> None:
        with self.lock:
            self.file.write(json.dumps(data) + "\n")
            self.file.flush()

    def _write(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        self._line(self.config.hook.pytest_report_to_serializable(config=self.config,
                                                                   report=report))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        if item.get_closest_marker("guest") is None:
            return (yield)
        limit = test_limit(item)
        self._line({STARTED: item.nodeid})
        timer = threading.Timer(limit, self._overtime, (item, limit))
        timer.daemon = True
        timer.start()
        try:
            return (yield)
        finally:
            timer.cancel()

    def _overtime(self, item: pytest.Item, limit: float) -> None:
        """The test is still running at its limit: fail it with every thread's stack (in
        the report: the test's output capture would swallow a dump to stderr), and end
        this pytest (the host boots again for the tests after it)."""
        me = threading.get_ident()
        stacks = "".join(
            f"\n--- thread {ident} ---\n" + "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items() if ident != me)
        self._write(overtime_report(item.nodeid, item.location, limit,
                                    f"the test outlived its limit of {limit:.0f} s "
                                    "(--guest-test-timeout or @pytest.mark.guest(timeout=S)); "
                                    f"its threads:{stacks}"))
        os._exit(STATUS_TEST_TIMEOUT)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._write(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._write(report)

    def pytest_unconfigure(self) -> None:
        self.file.close()


STARTED = "aioublk_started"  # the key of a reports line that says a test began


def overtime_report(nodeid: str, location: tuple[str, int | None, str], took: float,
                    why: str) -> pytest.TestReport:
    """A failed call report for a test that never finished."""
    return pytest.TestReport(nodeid=nodeid, location=location, keywords={}, outcome="failed",
                             longrepr=why, when="call", sections=[], duration=took)


class GuestProxy(pytest.Item):
    """Stands in on the host for a guest test: no fixtures, its results come from `run`."""

    def __init__(self, *, original: pytest.Item, run: GuestRun, **kw: Any) -> None:
        super().__init__(**kw)
        self.original = original
        self.run = run

    def reportinfo(self) -> tuple[os.PathLike[str] | str, int | None, str]:
        return self.original.reportinfo()

    def runtest(self) -> None:
        if self.run.report(self.nodeid, "call") is None:
            pytest.fail(self.run.missing("for this test"), pytrace=False)

    def teardown(self) -> None:
        call = self.run.report(self.nodeid, "call")
        # a test that failed by never finishing has no teardown to report
        if call is not None and call.passed and self.run.report(self.nodeid, "teardown") is None:
            pytest.fail(self.run.missing("for this test's teardown"), pytrace=False)


class GuestRun:
    """The selected guest tests, in as few boots as their hangs allow; results keyed by
    (node id, phase)."""

    def __init__(self, config: pytest.Config, items: list[pytest.Item], *,
                 unavailable: str = "") -> None:
        self.config = config
        self.nodeids = [i.nodeid for i in items]
        self.limits = {i.nodeid: test_limit(i) for i in items}
        self.locations = {i.nodeid: i.location for i in items}
        self.reports: dict[tuple[str, str], pytest.TestReport] = {}
        self.begun: list[str] = []  # node ids in the order the guest started them
        self.collect_errors: list[str] = []
        self.started = False
        self.status: int | None = None
        self.unavailable = unavailable  # set: no guest at all, every guest test fails with it
        self.problem = ""  # why results may be missing
        self.results: Path | None = None
        self.summary = ""

    def report(self, nodeid: str, when: str) -> pytest.TestReport | None:
        return self.reports.get((nodeid, when))

    def missing(self, what: str) -> str:
        if self.unavailable:
            return self.unavailable
        if self.problem:
            why = self.problem
        elif self.status is None:
            why = "the guest did not run"
        else:
            why = f"the guest pytest exited with status {self.status}"
            why += f" ({PYTEST_EXIT[self.status]})" if self.status in PYTEST_EXIT else ""
        errors = "".join(f"\n{e}" for e in self.collect_errors)
        return f"the guest reported nothing {what}: {why}{errors}"

    def ensure_ran(self) -> None:
        if self.started or self.unavailable:
            return
        self.started = True
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            self._run(tr)

    def _run(self, tr: pytest.TerminalReporter | None) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def emit(chunk: bytes) -> None:
            text = decoder.decode(chunk)
            if tr is not None:
                tr.write(text, flush=True)
            else:
                sys.stdout.write(text)

        start = time.monotonic()
        cap = self.config.getoption("guest_timeout")  # None: each boot's own budget alone
        boots = 0
        try:
            kernel = guest.guest_kernel(
                self.config.getoption("guest_kernel"), self.config.getoption("guest_modules")
            )
            self.results = scratch_dir("results")
            todo = list(self.nodeids)
            while todo:
                left = BOOT_GRACE + sum(self.limits[t] for t in todo)
                if cap is not None:
                    left = min(left, start + cap - time.monotonic())
                    if left <= 0:
                        break
                boots += 1
                n = len(todo)
                again = f" (boot {boots}: the tests left)" if boots > 1 else ""
                _sep(tr, f"{n} guest test{'s' * (n != 1)}, one boot of Linux "
                         f"{kernel.release}{again}")
                self.status = self._boot(kernel, todo, left, tr, emit)
                self._load(self.results)
                self._blame(self.status)
                rest = [t for t in todo if not self._reported(t)]
                if self.status not in STOPPED or len(rest) == len(todo):
                    break
                todo = rest
        except (SetupError, OSError) as e:
            self.problem = f"the guest could not run: {e}"
        if self.status in STOPPED:
            self.problem = STOPPED[self.status]
        took = time.monotonic() - start
        done = sum(1 for _, when in self.reports if when == "call")
        self.summary = (f"{done} of {len(self.nodeids)} guest tests reported in {took:.0f} s, "
                        f"{boots} boot{'s' * (boots != 1)}")
        if self.results and (self.results / "junit-1.xml").exists():
            self.summary += f"; guest JUnit XML: {self.results}/junit-*.xml"
        _sep(tr, f"guest done: {self.problem or f'pytest exit status {self.status}'}")

    def _boot(self, kernel: guest.Kernel, todo: list[str], timeout: float,
              tr: pytest.TerminalReporter | None, emit: Callable[[bytes], None]) -> int:
        """One guest pytest over `todo`: its exit status, or why the guest stopped."""
        assert self.results is not None
        argv, env = self._command(self.results, todo, tr)
        reports = self.results / "reports.jsonl"
        stall = BOOT_GRACE + max(self.limits[t] for t in todo)
        seen = [reports.stat().st_size if reports.exists() else 0, time.monotonic()]

        def watchdog() -> str | None:
            """The guest's own watchdog could not end a test (or the guest hangs)."""
            size = reports.stat().st_size if reports.exists() else 0
            if size != seen[0]:
                seen[:] = [size, time.monotonic()]
            elif time.monotonic() - seen[1] > stall:
                return f"no guest test started or finished for {stall:.0f} s"
            return None

        return guest.run_in_guest(
            argv,
            [self.results],
            memory=guest.default_memory(),
            # ublk caps a device's queues at the CPU count: 4 vCPUs let the
            # 4-queue tests have 4 queues (TCG runs them on our 2 cores)
            cpus=int(os.environ.get("AIOUBLK_GUEST_CPUS", "4")),
            env=env,
            timeout=timeout,
            cwd=self.config.rootpath,
            on_output=emit,
            kernel=kernel,
            accel=self.config.getoption("guest_accel"),
            watchdog=watchdog,
        )

    def _reported(self, nodeid: str) -> bool:
        return any((nodeid, when) in self.reports for when in ("setup", "call", "teardown"))

    def _blame(self, status: int | None) -> None:
        """A guest that died mid-test: the test that was running fails, with why."""
        if status not in STOPPED or not self.begun:
            return
        last = self.begun[-1]
        if (last, "call") in self.reports or (last, "teardown") in self.reports:
            return
        self.reports[(last, "call")] = overtime_report(
            last, self.locations[last], 0.0,
            f"the guest stopped while this test ran: {STOPPED[status]}")

    def _command(
        self, results: Path, todo: list[str], tr: pytest.TerminalReporter | None
    ) -> tuple[list[str], dict[str, str]]:
        """The guest pytest: our selection, the host's reporting options, our rootdir and ini."""
        opt = self.config.option
        argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA"]
        junit = results / f"junit-{len(list(results.glob('junit-*.xml'))) + 1}.xml"
        argv += [f"--junitxml={junit}", f"--rootdir={self.config.rootpath}"]
        argv += [f"--guest-test-timeout={opt.guest_test_timeout}"]
        if self.config.inipath:
            argv += ["-c", str(self.config.inipath)]
        if opt.verbose:
            argv.append("-" + ("v" * opt.verbose if opt.verbose > 0 else "q" * -opt.verbose))
        argv += [f"--tb={opt.tbstyle}", f"--capture={opt.capture}"]
        argv += [f"--maxfail={opt.maxfail}"] if opt.maxfail else []
        argv += ["-l"] if opt.showlocals else []
        argv += [a for o in opt.override_ini or () for a in ("-o", o)]
        argv += [a for w in opt.pythonwarnings or () for a in ("-W", w)]
        argv += [a for p in _plugin_args(self.config.invocation_params.args) for a in ("-p", p)]
        env = {REPORTS_ENV: str(results / "reports.jsonl")}
        if tr is not None:
            tw = self.config.get_terminal_writer()
            argv += ["--color=yes"] if tw.hasmarkup else []
            env["COLUMNS"] = str(tw.fullwidth)
        return argv + todo, env

    def _load(self, results: Path | None) -> None:
        path = results / "reports.jsonl" if results else None
        if path is None or not path.exists():
            return
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a dying guest
            if STARTED in data:
                if data[STARTED] not in self.begun:
                    self.begun.append(data[STARTED])
                continue
            rep = self.config.hook.pytest_report_from_serializable(config=self.config, data=data)
            if isinstance(rep, pytest.TestReport):
                # a skip's (path, line, reason) tuple came back from JSON as a list
                if isinstance(rep.longrepr, list):
                    rep.longrepr = tuple(rep.longrepr)
                self.reports[(rep.nodeid, rep.when)] = rep
            elif isinstance(rep, pytest.CollectReport):
                self.collect_errors.append(
                    f"guest collection error in {rep.nodeid}:\n{rep.longreprtext}"
                )


def _plugin_args(args: tuple[str, ...]) -> Iterator[str]:
    """The host's `-p NAME` options: the guest needs the same plugins for the same markers."""
    it = iter(args)
    for a in it:
        if a == "-p":
            yield next(it, "")
        elif a.startswith("-p") and len(a) > 2:
            yield a[2:].removeprefix("=")


def _sep(tr: pytest.TerminalReporter | None, title: str) -> None:
    if tr is not None:
        tr.ensure_newline()
        tr.write_sep("-", title)
    else:
        print(f"--- {title} ---", flush=True)


_run_key = pytest.StashKey[GuestRun]()
_deselected_key = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    guests = [i for i in items if i.get_closest_marker("guest") is not None]
    if not guests or config.option.collectonly:
        return
    if config.getoption("no_guest"):
        items[:] = [i for i in items if i.get_closest_marker("guest") is None]
        config.hook.pytest_deselected(items=guests)
        config.stash[_deselected_key] = len(guests)
        return
    if UBLK_CONTROL.exists():
        return
    unavailable = ""
    if os.environ.get("AIOUBLK_IN_GUEST") == "1":
        unavailable = f"{UBLK_CONTROL} is missing inside the guest: did `modprobe ublk_drv` fail?"
    run = GuestRun(config, guests, unavailable=unavailable)
    config.stash[_run_key] = run
    for n, item in enumerate(items):
        if item.get_closest_marker("guest") is not None:
            assert item.parent is not None, "a test item always has a parent"
            items[n] = GuestProxy.from_parent(
                item.parent, name=item.name, nodeid=item.nodeid, original=item, run=run
            )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """Inside the guest, a guest test's ``tmp_path`` goes once its fixtures
    are torn down: the guest's /tmp lives in its RAM, and pytest keeps every
    tmp_path until the session ends, so a whole run's backing files would
    fill it and a late test fail with ENOSPC."""
    try:
        return (yield)
    finally:
        tmp = getattr(item, "funcargs", {}).get("tmp_path")
        if os.environ.get("AIOUBLK_IN_GUEST") == "1" and isinstance(tmp, Path) \
                and item.get_closest_marker("guest") is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> None:
    if isinstance(item, GuestProxy):
        item.run.ensure_ran()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> pytest.TestReport | None:
    if isinstance(item, GuestProxy):
        return item.run.report(item.nodeid, call.when)
    return None


@pytest.hookimpl(wrapper=True, specname="pytest_runtest_makereport")
def pytest_runtest_makereport_guest_skip_fails(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[None]:
    """A `guest` test that skips fails (an expected failure stays one)."""
    report: pytest.TestReport | None = yield
    guest_test = isinstance(item, GuestProxy) or item.get_closest_marker("guest") is not None
    if report is not None and guest_test and report.skipped and not hasattr(report, "wasxfail"):
        where = reason = str(report.longrepr)
        if isinstance(report.longrepr, tuple):
            path, line, reason = report.longrepr
            where = f"{path}:{line}"
            reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = (f"{where}: a guest test must not skip (a skipped kernel test hides "
                           f"a broken harness or a missing tool): {reason}")
    return report  # type: ignore[return-value]


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    deselected = config.stash.get(_deselected_key, 0)
    if deselected:
        terminalreporter.write_line(f"aioublk: {deselected} guest tests deselected (--no-guest)")
    run = config.stash.get(_run_key, None)
    if run is not None and run.summary:
        terminalreporter.write_line(f"aioublk: {run.summary}")
