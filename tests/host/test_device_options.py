"""Device options are declared once, in ``options.DEVICE_OPTIONS``: the
command line's flags, a config file's ``[[devices]]`` keys, their defaults
and their checks all come from it, so none can be added, or drift, apart."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from aioublk.errors import UblkError
from aioublk.frontend import addargs, config, registry, verb
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
        config.build_target("loop", {"file": str(tiny)}, read_only=False)
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
        config.build_target("qcow2", {"image": str(image)}, read_only=False)
    assert str(e.value) == f"{image}: its disk has 0 bytes, less than one 512-byte sector: " \
        "resize it (qemu-img resize)"
    with pytest.raises(Qcow2Error, match="its disk has 0 bytes"):  # not "locked": let go
        config.build_target("qcow2", {"image": str(image)}, read_only=False)
