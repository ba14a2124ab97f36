"""Device options are declared once, in ``options.DEVICE_OPTIONS``: the
command line's flags, a config file's ``[[devices]]`` keys, their defaults
and their checks all come from it, so none can be added, or drift, apart."""

from __future__ import annotations

import argparse
import subprocess
import sys
import typing
from dataclasses import replace
from pathlib import Path

import pytest

from aioublk.errors import UblkError
from aioublk.frontend import addargs, config, registry, verb
from aioublk.queue import options
from aioublk.queue.options import DEVICE_OPTIONS, CopyMode, DeviceConfig, OptionError, option

#: ``add``'s flags that are no device option: what to serve and how this
#: command runs and logs (the targets' flags are the registry's)
NOT_DEVICE = {"help", "target", "files", "opt", "foreground", "quiet", "debug_mask", "verbose",
              "log_format", "log_file", "read_only", "force_share", "filter", "json", "run"}
TARGET_FLAGS = {o.key for spec in registry.TARGETS.values() for o in spec.options if o.flags}


def _add() -> argparse.ArgumentParser:
    sub = next(a for a in verb.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["add"]


def test_every_device_flag_is_in_the_table_and_every_table_flag_is_a_flag() -> None:
    add = _add()
    dests = {a.dest for a in add._actions}
    table = {o.name for o in DEVICE_OPTIONS if o.flags}
    assert dests - table - TARGET_FLAGS - NOT_DEVICE == set()
    assert table <= dests
    for o in DEVICE_OPTIONS:
        for flag in o.flags + o.off_flags:
            assert add._option_string_actions[flag].dest == o.name, flag


def test_every_device_key_is_in_the_table_and_every_table_key_is_a_key() -> None:
    keys = [o.key for o in DEVICE_OPTIONS if o.key]
    assert len(keys) == len(set(keys))
    assert not set(keys) & set(config.SPEC_KEYS)
    assert set(config.DEVICE_KEYS) == set(keys) | set(config.SPEC_KEYS)


def test_the_command_line_and_config_defaults_are_the_tables(tmp_path: Path) -> None:
    defaults = addargs.create_defaults()
    for o in DEVICE_OPTIONS:
        if o.flags:
            assert defaults[o.name] is o.default, o.name
        if o.key:
            assert config._device_option(o, {}, o.key, str(tmp_path)) is o.default, o.key
    (tmp_path / "c.toml").write_text('[[devices]]\ntarget = "null"\n')
    from_file = config.load(str(tmp_path / "c.toml")).devices[0].config
    from_flags = addargs.config_from_flags(verb.parser().parse_args(["add", "-t", "null"]))
    assert from_file == from_flags
    assert from_file.queues == option("queues").default == 2  # kublk's
    # a program's device too: one default everywhere
    assert DeviceConfig() == replace(from_flags, flags=0, batch=DeviceConfig().batch)


@pytest.mark.parametrize(("geometry", "message"), [
    ({"logical_block_size": 1000}, "logical block size 1000 is not a power of two"),
    ({"logical_block_size": 8192}, "logical block size 8192 is not a power of two from 512"),
    ({"physical_block_size": 256}, "physical block size 256 is not a power of two of at least"),
    ({"size": 1000}, "device size 1000 is not a positive multiple of the logical block size"),
    ({"size": 0}, "device size 0 is not a positive multiple"),
])
def test_a_geometry_the_kernel_would_change_fails_where_it_is_made(
        geometry: dict[str, int], message: str) -> None:
    from aioublk import Error, Geometry, GeometryError
    with pytest.raises(GeometryError, match=message) as e:
        Geometry(**{"size": 1 << 20, **geometry})
    assert isinstance(e.value, ValueError) and isinstance(e.value, Error)
    with pytest.raises(GeometryError):  # replace() checks too
        replace(Geometry(size=1 << 20), **geometry)


def test_a_loop_file_smaller_than_a_block_is_refused_in_one_line(tmp_path: Path) -> None:
    from aioublk.io.hostfile import BackingError
    tiny = tmp_path / "tiny.img"
    tiny.write_bytes(b"x" * 100)
    with pytest.raises(BackingError) as e:  # (an aioublk.Error: the CLI prints one line)
        registry.build_target("loop", {"file": str(tiny)}, read_only=False)
    assert str(e.value) == f"{tiny} (100 bytes) is smaller than one 512-byte block: give a " \
        "larger file"


@pytest.mark.parametrize("flags,keys", [
    (["--per_io_tasks", "-b"], "per_io_tasks = true\nbatch = true"),
    (["-g", "-u"], 'get_data = true\ncopy = "user_copy"'),
    (["--htlb", "{htlb}"], 'htlb = "{htlb}"'),
])
def test_a_conflict_is_one_check_for_both(flags: list[str], keys: str, tmp_path: Path) -> None:
    htlb = tmp_path / "buf"
    htlb.touch()
    with pytest.raises(OptionError) as flag_error:
        addargs.config_from_flags(verb.parser().parse_args(
            ["add", "-t", "null", *(f.format(htlb=htlb) for f in flags)]))
    (tmp_path / "c.toml").write_text('[[devices]]\ntarget = "null"\n'
                                     + keys.format(htlb=htlb) + "\n")
    with pytest.raises(config.ConfigError) as key_error:
        config.load(str(tmp_path / "c.toml"))
    e = flag_error.value  # the config's own wording at its key, or the same words
    said = f"devices[0].{e.key}: {e.config}" if e.config else f"devices[0]: {e}"
    assert str(key_error.value).endswith(said)


def test_a_one_thread_target_on_an_older_kernel_is_told_both_spellings(tmp_path: Path) -> None:
    """A config without ``queues`` now asks for kublk's 2; a target that serves
    every queue from one thread cannot have 2 on a kernel with neither batch
    I/O nor per-I/O daemons (6.4 to 6.16), and the error names the key too."""
    from dataclasses import replace

    from aioublk.kernel import uapi

    (tmp_path / "c.toml").write_text('[[devices]]\ntarget = "null"\n')
    cfg = replace(config.load(str(tmp_path / "c.toml")).devices[0].config, one_loop=True)
    with pytest.raises(UblkError, match=r"use -q 1 \(queues = 1 in a config\)"):
        cfg.resolve(uapi.Feature.USER_COPY)


def test_device_keywords_are_typed_as_device_config_fields() -> None:
    """Device(target, **kw)'s TypedDict names exactly DeviceConfig's fields."""
    import dataclasses

    from aioublk.queue.options import DeviceOptions
    assert list(DeviceOptions.__annotations__) == [
        f.name for f in dataclasses.fields(DeviceConfig)]


def test_device_keywords_have_the_device_config_fields_types() -> None:
    """DeviceOptions is DeviceConfig's fields, typed alike (a TypedDict cannot
    be made from a dataclass for a type checker, so this keeps them one):
    only ``copy`` also takes the mode's name."""
    from aioublk.queue.options import DeviceOptions

    fields = typing.get_type_hints(DeviceConfig)
    keywords = typing.get_type_hints(DeviceOptions)
    assert keywords == {**fields, "copy": CopyMode | str}


#: the DeviceConfig type of each kind of table option that fills a field of its name
_FIELD_TYPES: dict[str, object] = {
    options.INT: int, options.ID: int, options.BOOL: bool, options.FLAG01: bool,
    options.PATH: str | None, options.TRISTATE: bool | None}


def test_an_options_field_has_the_tables_type() -> None:
    """The table says how an option is read, the field what it holds: the two
    agree (a choice's field is the enum of its choices)."""
    fields = typing.get_type_hints(DeviceConfig)
    for o in DEVICE_OPTIONS:
        if o.attr != o.name:  # (one of several flags or keys of a field: -z, -r, integrity)
            continue
        if o.type == options.CHOICE:
            assert {m.value for m in fields[o.attr]} == set(o.choices), o.name
        else:
            assert fields[o.attr] == _FIELD_TYPES[o.type], o.name
        assert o.default == getattr(DeviceConfig(), o.attr) or o.type == options.CHOICE, o.name


#: a device option DeviceConfig has a field for but the table does not list,
#: declared once as a new entry before the command line and the config
#: loader are imported: the flag, the key, the bounds and the field follow
_NEW_OPTION = """
import sys
from aioublk.queue import options

options.DEVICE_OPTIONS += (options.DeviceOption(
    "fetch_buf_entries", "batch I/O: provided fetch buffers per queue and worker, 0 = 8",
    flags=("--fetch_buf_entries",), key="fetch_buf_entries", type=options.INT, default=0, lo=0,
    hi=4096, metavar="N", range_error="--fetch_buf_entries {value} out of range: use 0..4096"),)

from aioublk.frontend import addargs, config, verb

parser = verb.parser()
add = parser._subparsers._group_actions[0].choices["add"]
assert "--fetch_buf_entries N" in add.format_help()
args = parser.parse_args(["add", "-t", "null", "--fetch_buf_entries", "16"])
assert addargs.config_from_flags(args).fetch_buf_entries == 16
assert addargs.record(args)["options"]["fetch_buf_entries"] == 16  # (recover's)
assert "fetch_buf_entries" in config.DEVICE_KEYS
spec = config.parse({"devices": [{"target": "null", "fetch_buf_entries": 16}]}, "c.toml",
                    base=".").devices[0]
assert spec.config.fetch_buf_entries == 16
try:
    config.parse({"devices": [{"target": "null", "fetch_buf_entries": 8192}]}, "c.toml",
                 base=".")
except Exception as e:  # (parse's; load makes it a ConfigError naming the file)
    assert str(e) == "devices[0].fetch_buf_entries: 8192 is out of range: use 0..4096", e
else:
    raise AssertionError("8192 entries taken from a config")
args = parser.parse_args(["add", "-t", "null", "--fetch_buf_entries", "8192"])
try:
    addargs.config_from_flags(args)
except options.UblkError as e:
    assert str(e) == "--fetch_buf_entries 8192 out of range: use 0..4096", e
else:
    raise AssertionError("8192 entries taken from a flag")
print("ok")
"""


def test_a_device_option_declared_once_is_a_flag_a_key_and_a_field(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-c", _NEW_OPTION], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert (p.returncode, p.stdout) == (0, "ok\n"), p.stderr


def test_copy_takes_the_mode_by_name() -> None:
    assert DeviceConfig(copy="zero_copy").copy is CopyMode.ZERO_COPY  # type: ignore[arg-type]
    with pytest.raises(UblkError) as e:
        DeviceConfig(copy="zerocopy")  # type: ignore[arg-type]
    assert "copy 'zerocopy' is no copy mode: use one of copy, zero_copy" in str(e.value)


def test_mypy_catches_a_misspelt_device_keyword(tmp_path: Path) -> None:
    script = tmp_path / "typo.py"
    script.write_text("from aioublk import Device, NullTarget\n"
                      "Device(NullTarget(1 << 20), queus=2)\n"
                      "Device(NullTarget(1 << 20), queues=2, copy=\"zero_copy\")\n")
    p = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary",
                        "--cache-dir", str(tmp_path / "cache"), str(script)],
                       capture_output=True, text=True, timeout=600)
    assert p.stdout.count("error:") == 1, p.stdout
    assert 'Unexpected keyword argument "queus" for "Device"' in p.stdout


def test_a_qcow2_disk_of_no_sectors_is_refused_in_one_line(tmp_path: Path) -> None:
    from aioublk.qcow2.format import Qcow2Error
    image = tmp_path / "zero.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "0"], check=True)
    with pytest.raises(Qcow2Error) as e:
        registry.build_target("qcow2", {"image": str(image)}, read_only=False)
    assert str(e.value) == f"{image}: its disk has 0 bytes, less than one 512-byte sector: " \
        "resize it (qemu-img resize)"
    with pytest.raises(Qcow2Error, match="its disk has 0 bytes"):  # not "locked": let go
        registry.build_target("qcow2", {"image": str(image)}, read_only=False)
