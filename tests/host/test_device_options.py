"""Device options are declared once, in ``options.DEVICE_OPTIONS``: the
command line's flags, a config file's ``[[devices]]`` keys, their defaults
and their checks all come from it, so none can be added, or drift, apart."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from aioublk.errors import UblkError
from aioublk.frontend import cli, config, registry
from aioublk.queue.options import DEVICE_OPTIONS, OptionError, option

#: ``add``'s flags that are no device option: what to serve and how this
#: command runs and logs (the targets' flags are the registry's)
NOT_DEVICE = {"help", "target", "files", "opt", "foreground", "quiet", "debug_mask", "verbose",
              "log_format", "log_file", "read_only", "force_share", "filter", "json", "run"}
TARGET_FLAGS = {o.key for spec in registry.TARGETS.values() for o in spec.options if o.flags}


def _add() -> argparse.ArgumentParser:
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
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
    defaults = cli._create_defaults()
    for o in DEVICE_OPTIONS:
        if o.flags:
            assert defaults[o.name] is o.default, o.name
        if o.key:
            assert config._device_option(o, {}, o.key, str(tmp_path)) is o.default, o.key
    (tmp_path / "c.toml").write_text('[[devices]]\ntarget = "null"\n')
    from_file = config.load(str(tmp_path / "c.toml")).devices[0].config
    from_flags = cli.device_config(cli._parser().parse_args(["add", "-t", "null"]))
    assert from_file == from_flags
    assert from_file.queues == option("queues").default == 2  # kublk's


@pytest.mark.parametrize("flags,keys", [
    (["--per_io_tasks", "-b"], "per_io_tasks = true\nbatch = true"),
    (["-g", "-u"], 'get_data = true\ncopy = "user_copy"'),
    (["--htlb", "{htlb}"], 'htlb = "{htlb}"'),
])
def test_a_conflict_is_one_check_for_both(flags: list[str], keys: str, tmp_path: Path) -> None:
    htlb = tmp_path / "buf"
    htlb.touch()
    with pytest.raises(OptionError) as flag_error:
        cli.device_config(cli._parser().parse_args(
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
