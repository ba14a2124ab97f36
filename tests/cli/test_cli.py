"""The command line's parser, on the host (no kernel needed)."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from aioublk.errors import UblkError
from aioublk.frontend import addargs, cli, ctl, daemon, maketarget, verb
from aioublk.kernel import uapi


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subs.update(action.choices)
    return subs


def test_every_option_of_every_subcommand_has_help() -> None:
    """So that no option can be added without saying what it does."""
    parser = verb.parser()
    subs = _subparsers(parser)
    assert {"add", "recover", "del", "stop", "quiesce", "update_size", "list", "features",
            "serve"} <= set(subs)
    missing = []
    for name, sub in [("", parser), *subs.items()]:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"subcommand {c.dest}" for c in action._choices_actions
                            if not c.help]
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                flag = "/".join(action.option_strings) or action.dest
                missing.append(f"{name or 'aioublk'} {flag}")
    assert not missing, missing


@pytest.mark.parametrize("args,dest,size", [
    (["add", "-t", "stripe", "--chunk_size", "64K", "a", "b"], "chunk_size", 64 << 10),
    (["add", "-t", "stripe", "--chunk_size", "131072", "a", "b"], "chunk_size", 128 << 10),
    (["recover", "-t", "qcow2", "-n", "0", "--l2-cache", "4MiB", "a"], "l2_cache", 4 << 20),
    (["add", "-t", "qcow2", "--l2-cache", "1mb", "a"], "l2_cache", 1 << 20),
    (["update_size", "-n", "0", "-s", "2G"], "size", 2 << 30),
    (["update_size", "-n", "0", "-s", "1T"], "size", 1 << 40),
])
def test_sizes_take_suffixes(args: list[str], dest: str, size: int) -> None:
    assert getattr(verb.parser().parse_args(args), dest) == size


@pytest.mark.parametrize("args,option", [
    (["add", "-t", "stripe", "--chunk_size", "64X", "a", "b"], "--chunk_size"),
    (["add", "-t", "qcow2", "--l2-cache", "1.5M", "a"], "--l2-cache"),
    (["update_size", "-n", "0", "-s", "-1"], "-s/--size"),
])
def test_bad_size_is_one_line_naming_the_option(args: list[str], option: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"aioublk: argument {option}: ") and "is not a size: use bytes, or a " \
        "number with K, M, G or T" in err, err


#: ``add --foreground`` with a server that logs one line at each level and
#: says whether per-request logs are on (no kernel: run_device is replaced)
_LOGGING_SERVER = """
import sys
from aioublk.frontend import cli, daemon
from aioublk import logs
async def run_device(target, cfg, on_live=None, recover=False):
    log = logs.get_logger("aioublk.device")
    log.debug("debug line")
    log.warning("warning line")
    log.error("error line")
    print("per_request", logs.per_request())
    return 0
daemon.run_device = run_device
sys.exit(cli.main(["add", "-t", "null", "--foreground", "--log-format", "json", *sys.argv[1:]]))
"""


def _logged(*args: str) -> tuple[list[str], bool]:
    """The levels ``add ARGS`` logged, and whether it logs every request."""
    p = subprocess.run([sys.executable, "-c", _LOGGING_SERVER, *args], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    return [json.loads(line)["level"] for line in p.stderr.splitlines()], \
        p.stdout.split() == ["per_request", "True"]


@pytest.mark.parametrize("args,levels,per_request", [
    ([], ["warning", "error"], False),
    (["--quiet"], ["error"], False),
    (["--debug_mask", "0"], ["error"], False),
    (["--debug_mask", "0x20"], ["warning", "error"], False),
    (["--debug_mask", "8"], ["debug", "warning", "error"], True),
    (["--debug_mask", "0x3f", "-v"], ["debug", "warning", "error"], True),
    (["-v"], ["debug", "warning", "error"], True),
])
def test_quiet_and_debug_mask_set_the_logs(args: list[str], levels: list[str],
                                           per_request: bool) -> None:
    """kublk's --quiet (errors only) and --debug_mask (hex: 0 quiet, 0x20
    its usual lines, debug bits 0x1f) map onto aioublk's log levels."""
    assert _logged(*args) == (levels, per_request)


@pytest.mark.parametrize("args,message", [
    (["--debug_mask", "zz"], "aioublk: argument --debug_mask: 'zz' is not a hexadecimal mask"),
    (["--quiet", "-v"], "aioublk: -v and --quiet ask for different logs: pick one"),
    (["--quiet", "--debug_mask", "1"],
     "aioublk: --quiet and --debug_mask 0x1 ask for different logs: pick one"),
])
def test_contradictory_log_options_are_refused(args: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = cli.main(["add", "-t", "null", "--foreground", *args])
    except SystemExit as e:
        code = e.code  # type: ignore[assignment]
    assert code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message), err


# ---------------------------------------------------------- where logs go --

#: ``add ARGS`` with a server that logs at each level, writes to its stderr
#: and fails with a traceback (no kernel: run_device is replaced); the
#: syslog address may be pointed at the test's socket
_FAILING_SERVER = """
import os, sys
from aioublk.frontend import cli, daemon
from aioublk import logs
logs.SYSLOG_ADDRESS = os.environ.get("TEST_SYSLOG", logs.SYSLOG_ADDRESS)
async def run_device(target, cfg, on_live=None, recover=False):
    log = logs.get_logger("aioublk.device")
    log.debug("debug line")
    log.warning("warning line")
    log.error("error line")
    os.write(2, b"raw stderr line\\n")
    raise RuntimeError("boom")
daemon.run_device = run_device
sys.exit(cli.main(["add", "-t", "null", *sys.argv[1:]]))
"""


def _add(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _FAILING_SERVER, *args], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={**os.environ, **env})


def test_daemon_logs_and_stderr_go_to_the_log_file(tmp_path: Path) -> None:
    """Nothing of a failure is lost to /dev/null: the log lines, the raw
    stderr and the traceback are appended to --log-file."""
    path = tmp_path / "server.log"
    path.write_text("earlier line\n")
    p = _add("--log-file", str(path))
    assert p.returncode == 1
    # one line: the failure, and where its details are
    assert p.stderr == f"aioublk: server failed: RuntimeError('boom') (logs: {path})\n"
    text = path.read_text()
    assert text.startswith("earlier line\n"), text
    for line in ("warning line", "error line", "raw stderr line", "server failed",
                 "Traceback (most recent call last)", "RuntimeError: boom"):
        assert line in text, text
    assert "debug line" not in text and "\x1b" not in text, text


def test_log_file_takes_the_json_format(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    _add("--log-file", str(path), "--log-format", "json")
    records = [json.loads(line) for line in path.read_text().splitlines() if line[0] == "{"]
    assert [r["event"] for r in records] == ["warning line", "error line", "server failed"]
    assert "RuntimeError: boom" in records[-1]["exception"]


@pytest.mark.parametrize("foreground", [[], ["--foreground"]])
def test_unwritable_log_file_is_one_line(tmp_path: Path, foreground: list[str]) -> None:
    path = tmp_path / "missing" / "server.log"
    p = _add(*foreground, "--log-file", str(path))
    assert p.returncode == 1
    assert p.stderr == f"aioublk: cannot open log file {path}: No such file or directory: " \
                       "fix the path or its permissions, or pick another\n"


def test_foreground_log_file(tmp_path: Path) -> None:
    """--foreground logs on stderr unless --log-file is given."""
    path = tmp_path / "server.log"
    p = _add("--foreground", "--log-file", str(path))
    assert p.stderr.startswith(f"aioublk: logs: {path}\n"), p.stderr
    assert "warning line" not in p.stderr, p.stderr
    text = path.read_text()
    assert "warning line" in text and "error line" in text, text
    p = _add("--foreground")
    assert "warning line" in p.stderr and "raw stderr line" in p.stderr, p.stderr


def test_daemon_without_log_file_logs_to_syslog(tmp_path: Path) -> None:
    address = tmp_path / "log"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(address))
        s.settimeout(10)
        p = _add(TEST_SYSLOG=str(address))
        assert p.returncode == 1
        assert p.stderr == "aioublk: server failed: RuntimeError('boom') " \
                           "(logs: syslog (aioublk))\n"
        messages = [s.recv(65536).decode() for _ in range(3)]
    # facility daemon (3): <28> is a warning, <27> an error
    assert re.match(r"<28>aioublk\[\d+\]: .*warning line", messages[0]), messages
    assert re.match(r"<27>aioublk\[\d+\]: .*error line", messages[1]), messages
    assert re.match(r"<27>aioublk\[\d+\]: .*server failed", messages[2]), messages
    assert "RuntimeError: boom" in messages[2], messages


def test_daemon_without_syslog_logs_to_the_run_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no-log-socket"
    p = _add(TEST_SYSLOG=str(missing), AIOUBLK_RUN_DIR=str(tmp_path / "run"))
    path = tmp_path / "run" / "aioublk.log"
    assert p.stderr == "aioublk: server failed: RuntimeError('boom') " \
                       f"(logs: {path} (no syslog at {missing}: it does not exist))\n", p.stderr
    text = path.read_text()
    assert "error line" in text and "RuntimeError: boom" in text, text


def test_serve_logs_to_the_configured_file(tmp_path: Path) -> None:
    """``[logging] file`` (relative to the config file): serve's lines go there."""
    (tmp_path / "config.toml").write_text('[logging]\nfile = "serve.log"\n'
                                          '[[devices]]\ntarget = "null"\n')
    script = """
import sys
from aioublk.frontend import serve
async def fake_serve(cfg):
    serve.log.warning("serving line")
    return 0
serve.serve = fake_serve
sys.exit(serve.main(sys.argv[1]))
"""
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path / "config.toml")],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    assert p.stderr == f"aioublk: logs: {tmp_path / 'serve.log'}\n"
    assert "serving line" in (tmp_path / "serve.log").read_text()


# -- kublk's add/recover options (issue #15: flag parity) ------------------------

@pytest.mark.parametrize("args,expect", [
    (["-t", "null", "-g"], {"get_data": True}),
    (["-t", "null", "--get_data"], {"get_data": True}),
    (["-t", "null", "-s", "1G"], {"size": 1 << 30}),
    (["-t", "fault_inject", "--size", "1073741824"], {"size": 1 << 30}),
    (["-t", "null", "--zero_copy"], {"zero_copy": True}),
    (["-t", "null", "--user_copy"], {"user_copy": True}),
    (["-t", "null", "--no_ublk_fixed_fd"], {"no_ublk_fixed_fd": True}),
    # (-s: targets differ in their default size, so each class applies its own)
    (["-t", "null"], {"get_data": False, "size": None, "no_ublk_fixed_fd": False}),
])
def test_kublk_spellings_parse(args: list[str], expect: dict[str, object]) -> None:
    """kublk's long and short spellings, for add and for recover alike
    (recover parses only what is given)."""
    added = vars(verb.parser().parse_args(["add", *args]))
    assert {k: added[k] for k in expect} == expect
    recovered = vars(verb.parser().parse_args(["recover", "-n", "0", *args]))
    assert {k: recovered[k] for k in expect if k in recovered} == \
        {k: v for k, v in expect.items() if k in recovered}


def test_get_data_asks_for_need_get_data_on_the_per_io_path() -> None:
    from aioublk.kernel import uapi

    cfg = addargs.config_from_flags(verb.parser().parse_args(["add", "-t", "null", "-g"]))
    assert cfg.get_data
    batch, flags = cfg.resolve(uapi.Feature.BATCH_IO | uapi.Feature.NEED_GET_DATA)
    assert not batch and flags == uapi.Feature.NEED_GET_DATA


@pytest.mark.parametrize("args,message", [
    (["-g", "-u"], "-g/--get_data and copy mode user_copy conflict"),
    (["-g", "--zero_copy"], "-g/--get_data and copy mode zero_copy conflict"),
    (["-g", "--auto_zc"], "-g/--get_data and copy mode auto_zc conflict"),
    (["-g", "-b"], "-g/--get_data needs the per-I/O path (batch I/O has no NEED_GET_DATA "
     "command): drop -b/--batch"),
])
def test_get_data_refusals_are_one_line(args: list[str], message: str) -> None:
    from aioublk.errors import UblkError

    with pytest.raises(UblkError) as e:
        addargs.config_from_flags(verb.parser().parse_args(["add", "-t", "null", *args]))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_get_data_on_a_kernel_without_it_is_one_line() -> None:
    from aioublk.errors import UblkError

    cfg = addargs.config_from_flags(verb.parser().parse_args(["add", "-t", "null", "-g"]))
    with pytest.raises(UblkError, match="does not support UBLK_F_NEED_GET_DATA"):
        cfg.resolve(0)



# ------------------------------------------------------------ device ids --

@pytest.mark.parametrize("dev_id", ["4294967296", "4294967295", "1048576", "-2"])
@pytest.mark.parametrize("cmd", [
    ["del"], ["stop"], ["stop", "--safe"], ["quiesce"], ["update_size", "-s", "1M"], ["list"],
    ["recover", "-t", "null"], ["add", "-t", "null", "--foreground"],
])
def test_device_id_out_of_the_kernels_range_is_refused_before_the_kernel(
        cmd: list[str], dev_id: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ublk_drv's ids are 0..UBLK_MAX_UBLKS-1 (1 << MINORBITS); the id goes
    to the kernel as a u32, so 4294967296 would be device 0. Every command
    refuses such an id in one line without sending anything."""
    def no_kernel(*a: object, **kw: object) -> None:
        raise AssertionError("the kernel was reached")
    monkeypatch.setattr(ctl, "Control", no_kernel)
    monkeypatch.setattr(daemon, "run_device", no_kernel)
    try:
        code = cli.main([*cmd[:1], "-n", dev_id, *cmd[1:]])
    except SystemExit as e:
        code = e.code  # type: ignore[assignment]
    assert code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"device id {dev_id} is out of range: use 0..1048575" in err, err


@pytest.mark.parametrize("args", [
    ["-t", "null"], ["-t", "fault_inject"], ["-t", "zoned", "-s", "64M", "--zone_size", "4M"],
    ["-t", "stripe", "{a}", "{b}"], ["-t", "loop", "{a}"],
    ["-t", "examples.ramdisk:RamDisk", "--opt", "size=1048576"],
])
def test_add_read_only_is_in_every_targets_geometry(args: list[str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``add --read-only`` tells the kernel whatever the target (serve's
    read_only does); stripe, like loop, opens its files read-only too."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    files = {}
    for k in ("a", "b"):
        (tmp_path / k).write_bytes(b"\0" * (1 << 20))
        files[k] = str(tmp_path / k)
    target = maketarget.make_target(verb.parser().parse_args(
        ["add", *[a.format(**files) for a in args], "--read-only"]))
    try:
        assert target.geometry.read_only
        assert target.geometry.params(1 << 20).attrs & uapi.ATTR_READ_ONLY
        for f in [*getattr(target, "files", []), getattr(target, "backing", None)]:
            if f is not None:
                assert _access_mode(f.fd) == os.O_RDONLY, f.path
    finally:
        target.close()


def _access_mode(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE


# ----------------------------------------------------------- update_size --

class _ResizeControl:
    """A device served by pid 4242, with 512-byte blocks; records resizes."""

    resized: list[int] = []

    def __init__(self) -> None:
        pass

    async def get_info(self, dev_id: int) -> object:
        return uapi.DevInfo(dev_id=dev_id, ublksrv_pid=4242, state=uapi.State.LIVE)

    async def get_params(self, dev_id: int) -> object:
        return uapi.Params(dev_sectors=(64 << 20) >> 9)

    async def update_size(self, dev_id: int, sectors: int) -> int:
        self.resized.append(sectors << 9)
        return 0

    def close(self) -> None:
        pass


def _qcow2_header(size: int) -> bytes:
    """A version-3 header's first 72 bytes (all an image's size needs)."""
    return b"QFI\xfb" + (3).to_bytes(4, "big") + bytes(16) + size.to_bytes(8, "big") + bytes(40)


@pytest.mark.parametrize("target,files,options,limit", [
    ("loop", {"a": 64 << 20}, {}, 64 << 20),
    ("stripe", {"a": 64 << 20, "b": (64 << 20) + 4096}, {"chunk_size": 65536}, 128 << 20),
    ("qcow2", {"a": _qcow2_header(96 << 20)}, {}, 96 << 20),
])
def test_update_size_refuses_to_grow_past_the_backing_files(
        target: str, files: dict[str, int | bytes], options: dict[str, object], limit: int,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A loop device over a 64 MiB file must not become 1 GiB: past its
    files a target has nothing to serve (and a write there grows the file).
    The files are those ``add`` recorded; up to them the resize is sent."""
    from aioublk.frontend import stats

    paths = []
    for name, content in files.items():
        path = tmp_path / name
        if isinstance(content, int):
            path.write_bytes(b"")
            os.truncate(path, content)
        else:
            path.write_bytes(content)
        paths.append(str(path))
    record = {"pid": 4242, "target": target, "files": paths, "options": options}
    monkeypatch.setattr(stats, "read_record", lambda dev_id: record)
    monkeypatch.setattr(ctl, "Control", _ResizeControl)
    _ResizeControl.resized = []
    assert cli.main(["update_size", "-n", "0", "-s", "1G"]) == 1
    err = capsys.readouterr().err
    assert err == (f"aioublk: size {1 << 30} is more than device 0's {target} target can "
                   f"serve: its backing files hold {limit} bytes (grow them first)\n"), err
    assert _ResizeControl.resized == []
    assert cli.main(["update_size", "-n", "0", "-s", str(limit)]) == 0
    assert _ResizeControl.resized == [limit]


@pytest.mark.parametrize("args,message", [
    (["-t", "nul"], "unknown target type 'nul' (did you mean 'null'?)"),
    (["-t", "null", "--zone_size", "1M"], "--zone_size is an option of the zoned target, "
     "not null: drop it"),
    (["-t", "null", "--chunk_size", "128K"], "--chunk_size is an option of the stripe target"),
    (["-t", "null", "--buffered"], "--buffered is an option of the loop/qcow2/zoned target"),
])
def test_target_mistakes_are_named_in_one_line(args: list[str], message: str) -> None:
    with pytest.raises(UblkError) as e:
        maketarget.make_target(verb.parser().parse_args(["add", *args]))
    assert message in str(e.value)


def test_a_bare_aioublk_prints_its_usage() -> None:
    proc = subprocess.run([sys.executable, "-m", "aioublk"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr == ""
    assert proc.stdout.startswith("usage: aioublk") and "{add,recover," in proc.stdout


def test_a_package_offers_a_target_by_name(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/ramdisk-package, installed with pip, is -t ramdisk and target = "ramdisk"."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(site),
                    str(Path(__file__).parents[2] / "examples" / "ramdisk-package")],
                   check=True, capture_output=True, timeout=300)
    monkeypatch.syspath_prepend(str(site))
    target = maketarget.make_target(verb.parser().parse_args(["add", "-t", "ramdisk", "--opt",
                                                       "size=8M"]))
    assert type(target).__name__ == "RamDisk" and target.geometry.size == 8 << 20
    with pytest.raises(UblkError) as e:
        maketarget.make_target(verb.parser().parse_args(["add", "-t", "ramdsk"]))
    assert "(did you mean 'ramdisk'?)" in str(e.value)
    conf = tmp_path / "serve.toml"
    conf.write_text('[[devices]]\ntarget = "ramdisk"\noptions.size = "4M"\n')
    conf.chmod(0o600)
    from aioublk.frontend import config
    [dev] = config.load(str(conf)).devices
    assert dev.target == "aioublk_ramdisk:RamDisk" and dev.options == {"size": 4 << 20}


def test_target_help_lists_that_targets_options() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "aioublk", *args], capture_output=True,
                              text=True, timeout=60)
    p = run("add", "-t", "stripe", "--help")
    assert p.returncode == 0 and p.stdout.startswith("aioublk add -t stripe:")
    assert "--chunk_size" in p.stdout and "--l2-cache" not in p.stdout
    p = run("add", "--help", "-t", "examples.fence:Fence")
    assert p.returncode == 0 and "--opt limit=VALUE" in p.stdout
    p = run("add", "-t", "strip", "-h")
    assert p.returncode == 1 and "(did you mean 'stripe'?)" in p.stderr


def test_multi_word_flags_take_both_spellings_and_help_shows_one() -> None:
    args = verb.parser().parse_args(["add", "-t", "stripe", "--chunk-size", "128K",
                                     "--no_batch", "--l2_cache", "1M", "--read_only",
                                     "--no-auto-part-scan", "a", "b"])
    assert (args.chunk_size, args.l2_cache, args.read_only) == (128 << 10, 1 << 20, True)
    text = _subparsers(verb.parser())["add"].format_help()
    assert "--chunk_size SIZE" in text and "--chunk-size" not in text
    assert "--no-batch" in text and "--no_batch" not in text


def test_version_loads_next_to_nothing() -> None:
    """--version answers before the command line's modules load (issue #28)."""
    def imported(*args: str) -> int:
        p = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True,
                           text=True, timeout=60, check=True)
        return p.stderr.count("import time:")
    # as the ``aioublk`` script runs it (``-m`` adds runpy's own 17 modules)
    script = "import sys; sys.argv[1:] = ['--version']; from aioublk.__main__ import entry; entry()"
    assert imported("-c", script) <= imported("-c", "pass") + 8


def test_add_help_groups_the_options_by_target() -> None:
    """Issue 28: 144 lines in one list become the device's, the server's and
    each target's: every target heads a group, and its flags are under it."""
    from aioublk.frontend import registry
    text = verb.parser()._subparsers._group_actions[0].choices["add"].format_help()
    headings = [line for line in text.splitlines() if line and not line[0].isspace()]
    assert "the device (kublk's flags):" in headings and "the server:" in headings
    target_heads = [h for h in headings if h.startswith("-t ")]
    for name, spec in registry.TARGETS.items():
        if not any(o.flags for o in spec.options):
            continue  # (nvme: its FILE only)
        assert any(name in h.removeprefix("-t ").rstrip(":").split(", ")
                   for h in target_heads), name
    after = text[text.index("\n-t stripe:"):]
    assert after.index("--chunk_size") < after.index("\n-t ", 1)  # stripe's, under stripe


# ------------------------------------------------------------ a new verb --

#: a verb as a new file of aioublk/frontend/verbs/ declares it: nothing else
#: names it
_HELLO = '''"""``hello``: a verb of one module."""

import argparse

from aioublk.errors import UblkError
from aioublk.frontend.verb import Verb


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="world", help="whom to greet")


def _hello(args: argparse.Namespace) -> int:
    if args.name == "nobody":
        raise UblkError("nobody to greet")
    print(f"hello {args.name}")
    return 0


VERB = Verb("hello", "greet someone", _arguments, _hello, light=LIGHT)
'''


@pytest.mark.parametrize("light", [False, True], ids=["full", "light"])
def test_a_new_verb_is_one_module_of_the_verbs_package(
        light: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from aioublk.frontend import verbs
    from aioublk.frontend.verbs.completion import generated

    (tmp_path / "hello.py").write_text(_HELLO.replace("LIGHT", str(light)))
    monkeypatch.setattr(verbs, "__path__", [*verbs.__path__, str(tmp_path)])
    try:
        with pytest.raises(SystemExit) as e:
            cli.main(["--help"])
        assert e.value.code == 0
        listed = capsys.readouterr().out
        assert "{add,recover," in listed and ",man,hello}" in listed  # (after the built-ins)
        assert "    hello               greet someone\n" in listed
        assert cli.main(["hello", "--name", "you"]) == 0
        assert capsys.readouterr().out == "hello you\n"
        assert cli.main(["hello", "--name", "nobody"]) == 1  # one line, as every verb's
        assert capsys.readouterr().err == "aioublk: nobody to greet\n"
        assert (ctl.light(["hello"]) is not None) == light
        if light:  # from its own parser, as __main__ runs list and del
            assert ctl.main(["hello"]) == 0
            assert capsys.readouterr().out == "hello world\n"
        assert " hello " in generated("completion", "bash")  # completion too
    finally:
        sys.modules.pop("aioublk.frontend.verbs.hello", None)
