"""``add``'s records in the run directory, ``recover -n ID`` alone, and
``list``/``del -a`` seeing every device id (host, no kernel)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aioublk.frontend import addargs, cli, ctl, daemon, stats, verb
from aioublk.frontend.kublk_lines import device_ids, target_line
from aioublk.frontend.verbs import list as list_verb
from aioublk.queue.options import DeviceConfig
from aioublk.target import Target
from tests.filters.test_filters import Memory


@pytest.fixture(autouse=True)
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "run" / "aioublk"
    monkeypatch.setattr(stats, "RUN_DIR", d)
    return d


def recorded_add(argv: list[str], dev_id: int = 3) -> dict[str, Any]:
    """Record ``add ARGV`` as its server would, for device ``dev_id``."""
    record = addargs.record(verb.parser().parse_args(["add", *argv]))
    stats.write_record(dev_id, record)
    return record


def test_record_round_trip(run_dir: Path, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    recorded_add(["-t", "loop", "-q", "1", "-d", "64", "-r", "1", "--log-file", "s.log",
                  "disk.img"])
    record = stats.read_record(3)
    assert record is not None
    assert record["pid"] == os.getpid()
    assert (record["target"], record["files"]) == ("loop", [str(tmp_path / "disk.img")])
    options = record["options"]
    assert (options["queues"], options["depth"], options["recovery"]) == (1, 64, True)
    assert options["log_file"] == str(tmp_path / "s.log")  # a daemon runs in /
    # every option add parsed, but not how this command ran
    assert set(options) == set(addargs.create_defaults()) - {"target", "files", "dev_id",
                                                           "foreground"}
    assert (run_dir / "3.add.json").stat().st_mode & 0o777 == stats.FILE_MODE
    stats.remove_record(3)
    assert stats.read_record(3) is None
    stats.remove_record(3)  # (gone already: nothing to say)


def test_an_nbd_uri_is_recorded_as_given(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A URI is no path: made absolute it would be ``CWD/nbd+unix:/disk?...``
    and ``recover -n ID`` alone could not reach the server."""
    monkeypatch.chdir(tmp_path)
    uri = "nbd+unix:///disk?socket=/run/qsd.sock"
    record = recorded_add(["-t", "nbd", "-r", "1", uri])
    assert record["files"] == [uri]
    assert addargs.absolute_files("nbd", [uri]) == [uri]
    assert addargs.absolute_files("loop", ["d.img"]) == [str(tmp_path / "d.img")]


def test_record_is_not_read_through_a_symlink(run_dir: Path, tmp_path: Path) -> None:
    recorded_add(["-t", "null"])
    planted = tmp_path / "planted.json"
    os.rename(run_dir / "3.add.json", planted)
    (run_dir / "3.add.json").symlink_to(planted)
    assert stats.read_record(3) is None


def recover(argv: list[str], monkeypatch: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str]) -> tuple[int, str, dict[str, Any]]:
    """``recover ARGV --foreground`` with the server replaced: its exit
    code, stderr, and the target and device config it would have served."""
    served: dict[str, Any] = {}

    async def run_device(target: Target, cfg: DeviceConfig, on_live: Any = None,
                         recover: bool = False) -> int:
        served.update(target=target, cfg=cfg, recover=recover)
        target.close()
        return 0
    monkeypatch.setattr(daemon, "run_device", run_device)
    code = cli.main(["recover", *argv, "--foreground"])
    return code, capsys.readouterr().err, served


def test_recover_alone_takes_the_recorded_options(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(1 << 20))
    recorded_add(["-t", "loop", "-q", "1", "-d", "64", "-r", "1", "--buffered", str(disk)])
    code, err, served = recover(["-n", "3"], monkeypatch, capsys)
    assert (code, err) == (0, "")
    cfg = served["cfg"]
    assert (cfg.dev_id, cfg.queues, cfg.depth, cfg.recovery) == (3, 1, 64, True)
    assert served["recover"] and type(served["target"]).__name__ == "LoopTarget"


def test_given_options_override_the_record_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    recorded_add(["-t", "null", "-q", "2", "-r", "1"])
    code, err, served = recover(["-n", "3", "-q", "4", "-d", "128", "-r", "1"], monkeypatch,
                                capsys)
    assert code == 0
    # -d 128 and -r 1 are what was recorded: nothing to say
    assert err == "aioublk: recover: -q 4 overrides the recorded -q 2\n"
    assert (served["cfg"].queues, served["cfg"].recovery) == (4, True)

    code, err, served = recover(["-n", "3", "-q", "2", "-r", "0"], monkeypatch, capsys)
    assert err == "aioublk: recover: -r 0 overrides the recorded -r 1\n"


def test_another_target_than_recorded_wins_with_a_notice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    recorded_add(["-t", "loop", "-q", "1", "-r", "1", str(tmp_path / "gone.img")])
    code, err, served = recover(["-n", "3", "-t", "null"], monkeypatch, capsys)
    assert code == 0
    assert err == "aioublk: recover: -t null overrides the recorded -t loop\n"
    # the recorded file was the loop target's, not null's
    assert type(served["target"]).__name__ == "NullTarget" and served["cfg"].queues == 1


def test_recover_without_record_or_target_says_what_to_pass(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, err, served = recover(["-n", "7"], monkeypatch, capsys)
    assert code == 1 and not served
    assert err == "aioublk: device 7 has no record of how it was added (not by an aioublk " \
                  "add, or one before records): give its options, e.g. recover -n 7 -t TYPE " \
                  "[FILE...] as given to add\n"
    code, err, _ = recover([], monkeypatch, capsys)
    assert (code, err) == (1, "aioublk: recover needs a device id (-n ID)\n")
    # without a record, what is given is all there is (add's defaults for the rest)
    code, err, served = recover(["-n", "7", "-t", "null"], monkeypatch, capsys)
    assert (code, err) == (0, "")
    assert (served["cfg"].queues, served["cfg"].depth) == (2, 128)


def test_device_ids_from_sysfs_else_dev(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys/class/ublk-char"
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("ublkc3", "ublkb3", "ublk-control", "ublkc12"):
        (dev / name).touch()
    assert device_ids(tmp_path) == [3, 12]  # no sysfs: /dev
    sysfs.mkdir(parents=True)
    for name in ("ublkc10", "ublkc2", "ublkc1000", "ublkcx", "other"):
        (sysfs / name).touch()
    assert device_ids(tmp_path) == [2, 10, 1000]  # numeric order, sysfs first
    assert device_ids(tmp_path / "nothing") == []


class FakeControl:
    """What ``list`` asks the driver, for devices 0 (kublk's) and 1000 (ours)."""

    def __init__(self, *, blocking: bool = False) -> None:
        self.pids = {0: 4000, 1000: os.getpid()}

    async def get_info(self, dev_id: int) -> SimpleNamespace:
        return SimpleNamespace(dev_id=dev_id, nr_hw_queues=1, queue_depth=64,
                               max_io_buf_bytes=524288, ublksrv_pid=self.pids[dev_id],
                               flags=0x42, state=1)

    async def get_params(self, dev_id: int) -> SimpleNamespace:
        return SimpleNamespace(logical_bs_shift=9, dev_sectors=2048)

    async def queue_affinity(self, dev_id: int, q: int) -> list[int]:
        return [0, 1]

    def close(self) -> None:
        pass


def test_list_adds_the_target_line_for_recorded_devices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    recorded_add(["-t", "loop", str(tmp_path / "disk.img")], dev_id=1000)
    # a record left by a dead server of another device 0: not device 0's
    recorded_add(["-t", "null"], dev_id=0)
    monkeypatch.setattr(ctl, "Control", FakeControl)
    monkeypatch.setattr(list_verb, "device_ids", lambda: [0, 1000])
    assert ctl.main(["list"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "dev id 0: nr_hw_queues 1 queue_depth 64 block size 512 dev_capacity 2048",
        "\tmax rq size 524288 daemon pid 4000 flags 0x42 state LIVE",
        "\tqueue 0: affinity(0 )",
        "dev id 1000: nr_hw_queues 1 queue_depth 64 block size 512 dev_capacity 2048",
        f"\tmax rq size 524288 daemon pid {os.getpid()} flags 0x42 state LIVE",
        "\tqueue 0: affinity(0 )",
        f"\ttarget: loop file {tmp_path / 'disk.img'}",
    ]


def test_target_line_names_every_file() -> None:
    assert target_line({"target": "null", "files": []}) == "\ttarget: null"
    assert target_line({"target": "stripe", "files": ["/a", "/b"]}) == \
        "\ttarget: stripe files /a /b"


class CommitControl(FakeControl):
    """A live device whose server is this process."""

    def __init__(self, *, blocking: bool = False) -> None:
        super().__init__()
        self.pids = {5: os.getpid()}


def test_commit_asks_the_server_and_prints_its_answer(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``commit -n ID`` signals the device's server (here this process,
    whose SIGUSR1 handler commits as the server's does) and prints what
    the server wrote back; a server that publishes no stats (kublk's,
    which SIGUSR1 would kill) is never signalled."""
    import signal

    from aioublk.frontend import runner
    from aioublk.targets.filters.cow import CowFilter

    monkeypatch.setattr(ctl, "Control", CommitControl)
    assert ctl.main(["commit", "-n", "5"]) == 1
    assert "publishes no aioublk stats" in capsys.readouterr().err
    dfd = stats.open_run_dir(create=True)
    stats._write(dfd, stats._name(5), {"queues": []})
    os.close(dfd)
    inner = Memory()
    top = CowFilter(inner, block=4096)
    dev = SimpleNamespace(id=5, info=object(), target=top)
    asyncio.run(top.write(4096, memoryview(b"x" * 8192)))

    def commit_answered(dev: SimpleNamespace) -> int:
        """``commit -n 5``, this process answering SIGUSR1 as a server does."""
        previous = signal.signal(signal.SIGUSR1, lambda *_: asyncio.run(
            runner.commit_overlays([dev])))  # type: ignore[list-item]
        try:
            return ctl.main(["commit", "-n", "5"])
        finally:
            signal.signal(signal.SIGUSR1, previous)
    assert commit_answered(dev) == 0
    assert capsys.readouterr().out == "device 5: 2 blocks of 4096 bytes committed\n"
    assert inner.data[4096:12288] == b"x" * 8192
    dev.target = Memory()  # no cow filter: the server says so, the command fails
    assert commit_answered(dev) == 1
    assert capsys.readouterr().err == "aioublk: device 5 has no cow filter: nothing to commit\n"
    top.close()
