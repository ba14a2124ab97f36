"""The ``serve`` config file (host, no kernel): every target accepted, every
mistake refused in one line ``FILE: PATH: problem`` by ``serve.main``
before anything touches /dev/ublk-control."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from aioublk.frontend import addargs, registry, serve, verb
from aioublk.frontend.config import ConfigError, load
from aioublk.frontend.registry import build_target
from aioublk.frontend.values import parse_size
from aioublk.qcow2 import Qcow2Error
from aioublk.queue.options import CopyMode
from aioublk.targets import LoopTarget, NullTarget, StripeTarget
from aioublk.targets import spec as decl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MiB = 1 << 20


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``config.toml`` in the working directory, next to a few backing files."""
    monkeypatch.chdir(tmp_path)
    for name in ("a.img", "b.img", "c.img", "d.img"):
        (tmp_path / name).write_bytes(b"")
        with open(tmp_path / name, "r+b") as f:
            f.truncate(4 * MiB)
    return tmp_path / "config.toml"


def error(cfg: Path, text: str) -> str:
    cfg.write_text(text)
    with pytest.raises(ConfigError) as e:
        load("config.toml")
    return str(e.value)


# ------------------------------------------------------------------ valid --

def test_every_builtin_target(cfg: Path) -> None:
    cfg.write_text("""
[logging]
level = "debug"
format = "json"
stats_interval = 2.5

[[devices]]
target = "null"
options = { size = "64M" }

[[devices]]
target = "loop"
id = 4
queues = 2
depth = 64
batch = false
copy = "zero_copy"
nthreads = 0
recovery = "reissue"
on_stop = "quiesce"
logical_block_size = 4096
physical_block_size = 4096
[devices.options]
file = "a.img"
buffered = true

[[devices]]
target = "stripe"
batch = true
copy = "auto_zc"
auto_zc_fallback = true
recovery = "fail_io"
options = { files = ["b.img", "c.img"], chunk_size = "16K" }

[[devices]]
target = "qcow2"
read_only = true
recovery = "requeue"
options = { image = "./d.img", l2_cache = "1M", buffered = false }

[[devices]]
target = "fault_inject"
per_io_tasks = true
nthreads = 2
options = { size = 1073741824, delay_us = 0 }
""")
    c = load("config.toml")
    assert c.path == "config.toml"
    assert (c.logging.level, c.logging.format, c.logging.stats_interval) == ("debug", "json", 2.5)
    null, loop, stripe, qcow2, fault = c.devices
    assert null.options == {"size": 64 * MiB} and null.config.dev_id == -1
    assert null.config.batch is None and not null.config.recovery
    a, b, c_ = (str(cfg.parent / n) for n in ("a.img", "b.img", "c.img"))
    assert loop.options == {"file": a, "buffered": True}
    lc = loop.config
    assert (lc.dev_id, lc.queues, lc.depth, lc.batch, lc.copy) == (4, 2, 64, False,
                                                                  CopyMode.ZERO_COPY)
    assert (lc.recovery, lc.recovery_reissue, lc.recovery_fail_io) == (True, True, False)
    assert loop.on_stop == "quiesce" and loop.logical_block_size == 4096
    assert stripe.options == {"files": [b, c_], "chunk_size": 16384}
    sc = stripe.config
    assert (sc.batch, sc.copy, sc.auto_zc_fallback) == (True, CopyMode.AUTO_ZC, True)
    assert (sc.recovery, sc.recovery_reissue, sc.recovery_fail_io) == (True, False, True)
    assert qcow2.options == {"image": str(cfg.parent / "d.img"), "l2_cache": MiB,
                             "buffered": False}
    assert qcow2.read_only and qcow2.config.recovery and not qcow2.config.recovery_reissue
    assert fault.options == {"size": 1 << 30, "delay_us": 0}
    assert fault.config.per_io_tasks and fault.config.nthreads == 2


def test_get_data_is_a_device_setting_on_the_per_io_path(cfg: Path) -> None:
    """kublk's -g as a config key: UBLK_F_NEED_GET_DATA asked of the kernel,
    and "auto" batch settles on the per-I/O path (batch has no get-data)."""
    from aioublk.kernel import uapi

    cfg.write_text(NULL + "get_data = true\n")
    (null,) = load("config.toml").devices
    assert null.config.get_data and null.config.batch is None
    everything = ~0 & ((1 << 64) - 1)
    batch, flags = null.config.resolve(everything)
    assert not batch and flags & uapi.Feature.NEED_GET_DATA


def test_targets_are_built_with_the_device_settings(cfg: Path) -> None:
    cfg.write_text("""
[[devices]]
target = "null"
read_only = true
logical_block_size = 4096
options = { size = "64M" }

[[devices]]
target = "loop"
read_only = true
physical_block_size = 512
options = { file = "a.img", buffered = true }

[[devices]]
target = "stripe"
options = { files = ["b.img", "c.img"] }

[[devices]]
target = "fault_inject"
options = { size = "1M", delay_us = 5 }
""")
    targets = [d.build_target() for d in load("config.toml").devices]
    try:
        null, loop, stripe, fault = targets
        assert isinstance(null, NullTarget) and null.geometry.read_only
        assert (null.geometry.logical_block_size, null.geometry.size) == (4096, 64 * MiB)
        assert isinstance(loop, LoopTarget) and loop.geometry.read_only
        assert not loop.backing.direct and loop.geometry.physical_block_size == 512
        assert isinstance(stripe, StripeTarget) and stripe.chunk == 65536
        assert stripe.geometry.size == 8 * MiB and not stripe.geometry.read_only
        assert fault.name == "fault_inject" and fault.geometry.size == MiB
    finally:
        for t in targets:
            t.close()


@pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")
def test_qcow2_target_is_built(cfg: Path) -> None:
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "vm.qcow2", "64M"], check=True,
                   cwd=cfg.parent)
    cfg.write_text('[[devices]]\ntarget = "qcow2"\nread_only = true\n'
                   'options = { image = "vm.qcow2" }\n')
    t = load("config.toml").devices[0].build_target()
    try:
        assert t.name == "qcow2" and t.geometry.size == 64 * MiB and t.geometry.read_only
    finally:
        t.close()


def test_qcow2_backing_options(cfg: Path) -> None:
    """allow_backing (paths relative to the config file, resolved) and
    backing_format reach the image: its backing file outside the image's
    directory is refused without them and used with them."""
    (cfg.parent / "base").mkdir()
    (cfg.parent / "images").mkdir()
    base = cfg.parent / "base" / "base.raw"
    base.write_bytes(bytes(MiB))
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", "../base/base.raw",
                    "-F", "raw", "images/vm.qcow2", "1M"], check=True, cwd=cfg.parent)
    device = '[[devices]]\ntarget = "qcow2"\nread_only = true\n'
    cfg.write_text(device + 'options = { image = "images/vm.qcow2" }\n')
    with pytest.raises(Qcow2Error, match="allow it with --allow-backing .*base.raw "
                                         r"\(allow_backing in a serve config\)"):
        load("config.toml").devices[0].build_target()
    cfg.write_text(device + 'options = { image = "images/vm.qcow2", allow_backing = ["base"], '
                   'backing_format = "raw" }\n')
    (d,) = load("config.toml").devices
    assert d.options["allow_backing"] == [str(cfg.parent / "base")]
    assert d.options["backing_format"] == "raw"
    d.build_target().close()


def test_custom_target(cfg: Path) -> None:
    cfg.write_text('[[devices]]\ntarget = "aioublk.targets.null:NullTarget"\n'
                   'options = { size = 1048576 }\n')
    (d,) = load("config.toml").devices
    t = d.build_target()
    assert isinstance(t, NullTarget) and t.geometry.size == MiB
    assert isinstance(build_target("null", {}), NullTarget)


def test_relative_paths_are_relative_to_the_config_file(cfg: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cfg.write_text('[[devices]]\ntarget = "loop"\noptions = { file = "a.img" }\n')
    monkeypatch.chdir("/")
    (d,) = load(str(cfg)).devices
    assert d.options["file"] == str(cfg.parent / "a.img")


def test_log_file_is_relative_to_the_config_file(cfg: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg.write_text('[logging]\nfile = "logs/serve.log"\n' + NULL)
    monkeypatch.chdir("/")
    assert load(str(cfg)).logging.file == str(cfg.parent / "logs" / "serve.log")
    cfg.write_text(NULL)
    assert load(str(cfg)).logging.file is None


def test_sizes_take_suffixes(cfg: Path) -> None:
    """Every size in a config file may be written "4M", "4MB" or "4MiB"."""
    cfg.write_text('[[devices]]\ntarget = "null"\nlogical_block_size = "4K"\n'
                   'physical_block_size = "4KiB"\noptions = { size = "64MiB" }\n'
                   '[[devices]]\ntarget = "stripe"\n'
                   'options = { files = ["b.img", "c.img"], chunk_size = "128kB" }\n'
                   '[[devices]]\ntarget = "qcow2"\n'
                   'options = { image = "a.img", l2_cache = "1M" }\n')
    null, stripe, qcow2 = load("config.toml").devices
    assert null.options == {"size": 64 * MiB}
    assert (null.logical_block_size, null.physical_block_size) == (4096, 4096)
    assert stripe.options["chunk_size"] == 128 << 10
    assert qcow2.options["l2_cache"] == MiB


def test_two_read_only_devices_may_share_a_file(cfg: Path) -> None:
    cfg.write_text('[[devices]]\ntarget = "loop"\nread_only = true\noptions = { file = "a.img" }\n'
                   '[[devices]]\ntarget = "qcow2"\nread_only = true\n'
                   'options = { image = "a.img" }\n')
    assert len(load("config.toml").devices) == 2


@pytest.mark.parametrize("text,size", [(4096, 4096), ("4096", 4096), ("64K", 64 << 10),
                                       ("64M", 64 * MiB), ("1g", 1 << 30), ("250G", 250 << 30),
                                       ("2T", 2 << 40), (" 8 M ", 8 * MiB), ("64MB", 64 * MiB),
                                       ("64MiB", 64 * MiB), ("4kib", 4096), ("512B", 512),
                                       ("1 GiB", 1 << 30)])
def test_parse_size(text: int | str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "M", "MB", "1.5G", "-1", "64X", "4iB", "4BB", "4MiBB"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)
    with pytest.raises(ValueError, match="is a boolean"):
        parse_size(True)


@pytest.mark.parametrize("flags,keys", [
    # test_integrity_01.sh's four devices
    (["--metadata_size", "8"], "metadata_size = 8"),
    (["--integrity_capable", "--metadata_size", "64", "--pi_offset", "56", "--csum_type", "ip"],
     'integrity_capable = true\nmetadata_size = 64\npi_offset = 56\ncsum_type = "ip"'),
    (["--integrity_reftag", "--metadata_size", "8", "--csum_type", "t10dif"],
     'integrity_reftag = true\nmetadata_size = 8\ncsum_type = "t10dif"'),
    (["--metadata_size", "16", "--csum_type", "nvme", "--tag_size", "8"],
     'metadata_size = 16\ncsum_type = "nvme"\ntag_size = 8'),
])
def test_integrity_keys_ask_what_the_flags_ask(flags: list[str], keys: str, cfg: Path) -> None:
    cfg.write_text(f'[[devices]]\ntarget = "null"\ncopy = "user_copy"\n{keys}\n')
    want = addargs.config_from_flags(verb.parser().parse_args(["add", "-t", "null", "-u", *flags]))
    assert want.integrity is not None
    assert load("config.toml").devices[0].config.integrity == want.integrity


def test_loop_keeps_integrity_metadata_in_its_metadata_file(cfg: Path) -> None:
    cfg.write_text('[[devices]]\ntarget = "loop"\ncopy = "user_copy"\nmetadata_size = 8\n'
                   'csum_type = "t10dif"\noptions = { file = "a.img", metadata_file = "b.img" }\n')
    d = load("config.toml").devices[0]
    assert d.config.integrity is not None and d.config.integrity.metadata_size == 8
    target = d.build_target()
    try:
        assert isinstance(target, LoopTarget) and target.meta is not None
        assert target.meta.path == str(cfg.parent / "b.img")
    finally:
        target.close()


@pytest.mark.parametrize("name", ["null", "loop", "stripe", "qcow2", "serve", "serve-nbd",
                                  "serve-rbd"])
def test_examples_load(name: str, tmp_path: Path) -> None:
    """Every example is valid once the files it names exist."""
    example = shutil.copy(EXAMPLES / f"{name}.toml", tmp_path)
    with open(example, "rb") as f:
        devices = tomllib.load(f)["devices"]
    for d in devices:
        o = d.get("options", {})
        paths = [o[x.key] for x in registry.TARGETS[d["target"]].options
                 if x.key in o and x.type == decl.PATH]
        for p in paths + o.get("files", []):
            (tmp_path / p).write_bytes(b"\0" * MiB)
    c = load(str(example))
    assert [d.target for d in c.devices] == [d["target"] for d in devices]


# --------------------------------------------------------------- mistakes --

LOOP = '[[devices]]\ntarget = "loop"\noptions = { file = "a.img" }\n'
NULL = '[[devices]]\ntarget = "null"\n'

MISTAKES = [
    # where logs go
    ('[logging]\nfile = 3\n' + NULL, "config.toml: logging.file: 3 is an integer: use a string"),
    ('[logging]\nfile = " "\n' + NULL,
     "config.toml: logging.file: empty: name a file, or drop the key to log on stderr"),
    # syntax, structure, unknown keys
    ("[[devices]]\ntarget = \n", "config.toml: line 2, column 10: invalid TOML: invalid value"),
    ('[[device]]\ntarget = "null"\n', 'config.toml: device: unknown key (did you mean "devices"?)'),
    (NULL + "qeues = 2\n", 'config.toml: devices[0].qeues: unknown key (did you mean "queues"?)'),
    (NULL + "colour = 2\n", "config.toml: devices[0].colour: unknown key (known keys: target,"),
    ('[logging]\nlevl = "info"\n' + NULL,
     'config.toml: logging.levl: unknown key (did you mean "level"?)'),
    ('[[devices]]\ntarget = "loop"\noptions = { fiel = "a.img" }\n',
     'config.toml: devices[0].options.fiel: unknown key (did you mean "file"?)'),
    ('[logging]\nlevel = "info"\n', "config.toml: devices: no devices: add a [[devices]] table"),
    ('[devices]\ntarget = "null"\n', "config.toml: devices: {...} is a table: write each device"),
    ('[logging]\n' + NULL + 'options = "big"\n', 'config.toml: devices[0].options: "big" is a '
     "string: use a table"),
    # types and ranges
    (NULL + NULL + "depth = 5000\n",
     "config.toml: devices[1].depth: 5000 is out of range: use 1..4096"),
    (NULL + "queues = 0\n", "config.toml: devices[0].queues: 0 is out of range: use 1..32"),
    (NULL + "nthreads = 65\n", "config.toml: devices[0].nthreads: 65 is out of range: use 0..64"),
    (NULL + "id = -2\n", "config.toml: devices[0].id: -2 is out of range: use -1 or more"),
    (NULL + "queues = true\n", "config.toml: devices[0].queues: true is a boolean: use an integer"),
    (NULL + 'depth = "128"\n', 'config.toml: devices[0].depth: "128" is a string: use an integer'),
    (NULL + "depth = 1.5\n", "config.toml: devices[0].depth: 1.5 is a number: use an integer"),
    (NULL + "read_only = 1\n",
     "config.toml: devices[0].read_only: 1 is an integer: use true or false"),
    (NULL + "per_io_tasks = \"yes\"\n", 'config.toml: devices[0].per_io_tasks: "yes" is a string'),
    (NULL + 'batch = "yes"\n', 'config.toml: devices[0].batch: "yes" is not a batch setting'),
    (NULL + "batch = 1\n", "config.toml: devices[0].batch: 1 is not a batch setting"),
    (NULL + 'copy = "zerocopy"\n', 'config.toml: devices[0].copy: "zerocopy" is not a valid '
     'choice (did you mean "zero_copy"?): use "copy", "zero_copy", "auto_zc" or "user_copy"'),
    (NULL + 'recovery = "yes"\n', 'config.toml: devices[0].recovery: "yes" is not a valid choice'),
    (NULL + 'on_stop = "stop"\n', 'config.toml: devices[0].on_stop: "stop" is not a valid choice'),
    ('[logging]\nlevel = "warn"\n' + NULL,
     'config.toml: logging.level: "warn" is not a valid choice (did you mean "warning"?)'),
    ('[logging]\nformat = "text"\n' + NULL, 'config.toml: logging.format: "text" is not a valid'),
    ("[logging]\nstats_interval = -1\n" + NULL,
     "config.toml: logging.stats_interval: -1 is negative"),
    ("[logging]\nstats_interval = true\n" + NULL,
     "config.toml: logging.stats_interval: true is a boolean"),
    (NULL + "logical_block_size = 1000\n",
     "config.toml: devices[0].logical_block_size: 1000 is not a power of two"),
    (NULL + "physical_block_size = 8192\n",
     "config.toml: devices[0].physical_block_size: 8192 is out of range: use 512..4096"),
    (NULL + "logical_block_size = 4096\nphysical_block_size = 512\n",
     "config.toml: devices[0].physical_block_size: 512 is smaller than logical_block_size 4096"),
    (NULL + 'logical_block_size = "4X"\n',
     'config.toml: devices[0].logical_block_size: "4X" is not a size: use bytes, or a number '
     'with K, M, G or T'),
    (NULL + 'options = { size = "64X" }\n',
     'config.toml: devices[0].options.size: "64X" is not a size'),
    (NULL + "options = { size = 1000 }\n",
     "config.toml: devices[0].options.size: 1000 is not a multiple of 512"),
    (NULL + "options = { size = 0 }\n",
     "config.toml: devices[0].options.size: 0 is out of range: use 512 or more"),
    ('[[devices]]\ntarget = "fault_inject"\noptions = { delay_us = -1 }\n',
     "config.toml: devices[0].options.delay_us: -1 is out of range: use 0 or more"),
    ('[[devices]]\ntarget = "stripe"\noptions = { files = ["a.img", "b.img"], '
     "chunk_size = 12288 }\n",
     "config.toml: devices[0].options.chunk_size: 12288 is not a power of two"),
    ('[[devices]]\ntarget = "stripe"\noptions = { files = ["a.img", "b.img"], '
     'chunk_size = "1M" }\n',
     "config.toml: devices[0].options.chunk_size: 1048576 is out of range: use 4096..524288"),
    ('[[devices]]\ntarget = "qcow2"\noptions = { image = "a.img", l2_cache = false }\n',
     "config.toml: devices[0].options.l2_cache: false is a boolean"),
    ('[[devices]]\ntarget = "qcow2"\noptions = { image = "a.img", allow_backing = "b.img" }\n',
     'config.toml: devices[0].options.allow_backing: "b.img" is a string: use a list of paths'),
    ('[[devices]]\ntarget = "qcow2"\noptions = { image = "a.img", allow_backing = ["nope"] }\n',
     "config.toml: devices[0].options.allow_backing[0]: TMP/nope does not exist"),
    ('[[devices]]\ntarget = "qcow2"\noptions = { image = "a.img", backing_format = "vmdk" }\n',
     'config.toml: devices[0].options.backing_format: "vmdk" is not a valid choice: use '
     '"raw" or "qcow2"'),
    ('[[devices]]\ntarget = "qcow2"\noptions = { image = "a.img", allow_backings = [] }\n',
     'config.toml: devices[0].options.allow_backings: unknown key (did you mean '
     '"allow_backing"?)'),
    # required options, files
    ("[[devices]]\nqueues = 1\n", "config.toml: devices[0].target: missing: set it to one of "
     'null, loop, stripe, qcow2, nvme, nbd, rbd, zoned, fault_inject or "pkg.module:Class"'),
    ('[[devices]]\ntarget = "loop"\n', "config.toml: devices[0].options.file: missing: the loop "
     "target needs the path of its backing file"),
    ('[[devices]]\ntarget = "qcow2"\n', "config.toml: devices[0].options.image: missing"),
    ('[[devices]]\ntarget = "stripe"\n', "config.toml: devices[0].options.files: missing"),
    ('[[devices]]\ntarget = "stripe"\noptions = { files = ["a.img"] }\n',
     "config.toml: devices[0].options.files: 1 file given: the stripe target needs 2 to 4"),
    ('[[devices]]\ntarget = "stripe"\noptions = { files = "a.img" }\n',
     'config.toml: devices[0].options.files: "a.img" is a string: use a list'),
    ('[[devices]]\ntarget = "stripe"\noptions = { files = ["a.img", "./a.img"] }\n',
     "config.toml: devices[0].options.files[1]: TMP/a.img is also files[0]"),
    ('[[devices]]\ntarget = "loop"\noptions = { file = 7 }\n',
     "config.toml: devices[0].options.file: 7 is an integer: use a string"),
    (NULL + NULL + LOOP.replace("a.img", "nope.img"),
     "config.toml: devices[2].options.file: TMP/nope.img does not exist"),
    ('[[devices]]\ntarget = "stripe"\noptions = { files = ["a.img", "nope.img"] }\n',
     "config.toml: devices[0].options.files[1]: TMP/nope.img does not exist"),
    # targets
    ('[[devices]]\ntarget = "nul"\n', 'config.toml: devices[0].target: unknown target "nul" '
     '(did you mean "null"?): use null, loop, stripe, qcow2, nvme, nbd, rbd, zoned, '
     'fault_inject or "pkg.module:Class"'),
    ("[[devices]]\ntarget = 1\n", "config.toml: devices[0].target: 1 is an integer"),
    ('[[devices]]\ntarget = "no_such_module_xyz:Disk"\n', "config.toml: devices[0].target: "
     "cannot import 'no_such_module_xyz' (ModuleNotFoundError: No module named"),
    ('[[devices]]\ntarget = "aioublk.targets:Nope"\n', "config.toml: devices[0].target: module "
     "'aioublk.targets' has no 'Nope'"),
    ('[[devices]]\ntarget = "collections:OrderedDict"\n', "config.toml: devices[0].target: "
     "collections:OrderedDict is not a subclass of aioublk.Target"),
    ('[[devices]]\ntarget = "aioublk.targets.loop:LoopTarget"\n',
     "config.toml: devices[0].options.path: missing: aioublk.targets.loop:LoopTarget needs it"),
    ('[[devices]]\ntarget = "aioublk.targets.null:NullTarget"\noptions = { sise = 1 }\n',
     'config.toml: devices[0].options.sise: unknown key (did you mean "size"?)'),
    # conflicts
    (NULL + 'on_stop = "quiesce"\nid = 1\n', 'config.toml: devices[0].on_stop: "quiesce" needs '
     'recovery: set recovery = "requeue", "reissue" or "fail_io", or on_stop = "delete"'),
    (NULL + 'on_stop = "quiesce"\nrecovery = "requeue"\n',
     'config.toml: devices[0].on_stop: "quiesce" needs a fixed id'),
    (NULL + "auto_zc_fallback = true\n",
     'config.toml: devices[0].auto_zc_fallback: needs copy = "auto_zc"'),
    (NULL + "per_io_tasks = true\nbatch = true\n",
     "config.toml: devices[0].per_io_tasks: conflicts with batch = true"),
    (NULL + 'get_data = true\ncopy = "user_copy"\n',
     'config.toml: devices[0].get_data: conflicts with copy = "user_copy"'),
    (NULL + "get_data = true\nbatch = true\n",
     "config.toml: devices[0].get_data: conflicts with batch = true (batch I/O has no "
     "NEED_GET_DATA command)"),
    (NULL + 'get_data = "yes"\n', 'config.toml: devices[0].get_data: "yes" is a string'),
    # integrity: options.integrity's refusals, naming the key
    (NULL + 'copy = "user_copy"\ncsum_type = "t10dif"\n', "config.toml: devices[0].csum_type: "
     "integrity options need metadata_size N: give the bytes of metadata per 512-byte sector"),
    (NULL + 'copy = "user_copy"\nintegrity_capable = true\n',
     "config.toml: devices[0].integrity_capable: integrity options need metadata_size N"),
    (NULL + 'copy = "user_copy"\nmetadata_size = 8\ncsum_type = "crc32"\n',
     "config.toml: devices[0].csum_type: csum_type crc32 is unknown: use ip, t10dif or nvme"),
    (NULL + 'copy = "user_copy"\nmetadata_size = 64\npi_offset = 60\ncsum_type = "t10dif"\n',
     "config.toml: devices[0].pi_offset: a 8-byte t10dif PI tuple at pi_offset 60 does not fit "
     "in metadata_size 64: raise metadata_size to 68 or more"),
    (NULL + 'copy = "user_copy"\nmetadata_size = 8\npi_offset = 9\n',
     "config.toml: devices[0].pi_offset: pi_offset 9 does not fit in metadata_size 8"),
    (NULL + 'copy = "user_copy"\nmetadata_size = 8\nintegrity_reftag = true\n',
     "config.toml: devices[0].integrity_reftag: integrity_reftag needs a PI tuple: add "
     "csum_type t10dif"),
    (NULL + 'copy = "user_copy"\nmetadata_size = 256\n',
     "config.toml: devices[0].metadata_size: metadata_size 256 out of range: use 0..255"),
    (NULL + 'copy = "user_copy"\nmetadata_size = 8\ntag_size = -1\n',
     "config.toml: devices[0].tag_size: tag_size -1 out of range: use 0..255"),
    (NULL + "metadata_size = 8\n", 'config.toml: devices[0].metadata_size: needs copy = '
     '"user_copy" (the kernel moves integrity data only by user copy)'),
    (NULL + 'copy = "user_copy"\nmetadata_size = "8"\n',
     'config.toml: devices[0].metadata_size: "8" is a string: use an integer'),
    (NULL + 'copy = "user_copy"\nmetadata_size = 8\ncsum_type = 1\n',
     "config.toml: devices[0].csum_type: 1 is an integer: use a string"),
    (NULL + 'copy = "user_copy"\nmetadata_size = 8\nintegrity_reftag = 1\n',
     "config.toml: devices[0].integrity_reftag: 1 is an integer: use true or false"),
    ('[[devices]]\ntarget = "loop"\noptions = { file = "a.img", metadata_file = "b.img" }\n',
     "config.toml: devices[0].options.metadata_file: needs metadata_size"),
    (LOOP + 'copy = "user_copy"\nmetadata_size = 8\n', "config.toml: devices[0].metadata_size: "
     "the loop target keeps the metadata in its metadata file: set options.metadata_file"),
    (NULL + "id = 3\n" + NULL + "id = 3\n",
     "config.toml: devices[1].id: 3 is also the id of devices[0]: pick another id"),
    (LOOP + NULL + '[[devices]]\ntarget = "qcow2"\noptions = { image = "a.img" }\n',
     "config.toml: devices[2].options.image: TMP/a.img is also a backing file of devices[0]"),
    (LOOP + '[[devices]]\ntarget = "stripe"\nread_only = true\n'
     'options = { files = ["b.img", "a.img"] }\n',
     "config.toml: devices[1].options.files[1]: TMP/a.img is also a backing file of devices[0]"),
]


@pytest.mark.parametrize("text,message", MISTAKES)
def test_mistake_is_one_line_and_nothing_starts(text: str, message: str, cfg: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def no_control() -> None:
        raise AssertionError("serve touched /dev/ublk-control on a bad config")

    monkeypatch.setattr(serve, "Control", no_control)
    message = message.replace("TMP", str(cfg.parent))
    assert error(cfg, text).startswith(message)
    assert serve.main("config.toml") == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"aioublk: {message}"), err


def test_unwritable_log_file_is_one_line(cfg: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading opens nothing: serve opens the log file, before any device."""
    def no_control() -> None:
        raise AssertionError("serve touched /dev/ublk-control without its log file")

    monkeypatch.setattr(serve, "Control", no_control)
    cfg.write_text('[logging]\nfile = "no-dir/serve.log"\n' + NULL)
    assert serve.main("config.toml") == 1
    assert capsys.readouterr().err == (
        f"aioublk: config.toml: logging.file: cannot open log file {cfg.parent}/no-dir/"
        "serve.log: No such file or directory: fix the path or its permissions, or pick "
        "another\n")


def test_unreadable_config(cfg: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert serve.main("missing.toml") == 1
    assert capsys.readouterr().err == "aioublk: missing.toml: cannot read: No such file or " \
                                      "directory\n"


def test_bad_config_is_reported_before_the_driver(cfg: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """No /dev/ublk-control on the host: the config's error wins."""
    cfg.write_text(NULL + "depth = 0\n")
    assert serve.main("config.toml") == 1
    err = capsys.readouterr().err
    assert err == "aioublk: config.toml: devices[0].depth: 0 is out of range: use 1..4096\n"
    assert "ublk-control" not in err


# ------------------------------------------------------------ permissions --
# A config names the code serve runs as root (a custom target is imported from
# it) and the files it opens: as root, a file others can change is refused.

@pytest.fixture
def as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 0)


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646, 0o620, 0o602])
def test_config_writable_by_others_is_refused_as_root(
        cfg: Path, mode: int, as_root: None, capsys: pytest.CaptureFixture[str]) -> None:
    cfg.write_text(NULL)
    cfg.chmod(mode)
    with pytest.raises(ConfigError) as e:
        load("config.toml")
    assert str(e.value) == (f"config.toml: writable by others (mode {mode:o}) and serve runs "
                            "as root, importing the code it names: chmod go-w config.toml")
    assert serve.main("config.toml") == 1
    assert capsys.readouterr().err == f"aioublk: {e.value}\n"


def test_config_owned_by_another_user_is_refused_as_root(cfg: Path, as_root: None) -> None:
    cfg.write_text(NULL)
    cfg.chmod(0o644)
    if os.getuid() == 0:
        os.chown(cfg, 12345, -1)
    uid = os.stat(cfg).st_uid
    with pytest.raises(ConfigError) as e:
        load("config.toml")
    assert str(e.value) == (f"config.toml: owned by uid {uid} and serve runs as root, "
                            "importing the code it names: chown root config.toml")


@pytest.mark.parametrize("mode", [0o644, 0o600, 0o444])
def test_config_only_root_can_change_is_accepted_as_root(cfg: Path, mode: int,
                                                         as_root: None) -> None:
    cfg.write_text(NULL)
    cfg.chmod(mode)
    if os.getuid() != 0:
        pytest.skip("needs root to own a file as root")
    assert len(load("config.toml").devices) == 1


def test_config_writable_by_others_is_accepted_when_not_root(
        cfg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user serving their own config as themselves gains nothing from it."""
    monkeypatch.setattr("os.geteuid", lambda: 12345)
    monkeypatch.setattr("aioublk.kernel.control.has_cap_sys_admin", lambda: False)
    cfg.write_text(NULL)
    cfg.chmod(0o666)
    assert len(load("config.toml").devices) == 1
