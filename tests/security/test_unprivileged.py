"""Unprivileged devices without a kernel: the command encoding, the refusals
that need no driver, the udev rule and its helper's name parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioublk.errors import UblkError
from aioublk.frontend import addargs, cli, config, udev, values, verb
from aioublk.kernel import uapi
from aioublk.queue.options import CopyMode, DeviceConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_control_command_carries_the_path_length() -> None:
    cmd = uapi.ctrl_cmd(7, length=11 + 64, addr=0x1000, dev_path_len=11)
    dev_id, _q, length, addr, _data, path_len, _pad, _rsvd = uapi.CTRL_CMD.unpack(cmd)
    assert (dev_id, length, addr, path_len) == (7, 75, 0x1000, 11)
    assert uapi.CTRL_CMD.unpack(uapi.ctrl_cmd(7))[5] == 0


def test_the_device_flag_is_asked_for() -> None:
    cfg = DeviceConfig(unprivileged=True)
    cfg.validate()
    _batch, flags = cfg.resolve(uapi.Feature.CMD_IOCTL_ENCODE | uapi.Feature.UNPRIVILEGED_DEV)
    assert flags & uapi.Feature.UNPRIVILEGED_DEV
    assert not DeviceConfig().resolve(uapi.Feature.CMD_IOCTL_ENCODE)[1] \
        & uapi.Feature.UNPRIVILEGED_DEV


@pytest.mark.parametrize("kw", [{"copy": CopyMode.ZERO_COPY}, {"copy": CopyMode.AUTO_ZC},
                                {"copy": CopyMode.USER_COPY}, {"recovery": True},
                                {"recovery_fail_io": True}])
def test_what_the_kernel_refuses_users_is_refused_first(kw: dict[str, object]) -> None:
    with pytest.raises(UblkError, match="needs root") as e:
        DeviceConfig(unprivileged=True, **kw).validate()  # type: ignore[arg-type]
    assert "\n" not in str(e.value)


def test_cli_and_config_spell_it(tmp_path: Path) -> None:
    args = verb.parser().parse_args(["add", "-t", "null", "--unprivileged"])
    assert addargs.config_from_flags(args).unprivileged
    args = verb.parser().parse_args(["add", "-t", "null"])
    assert not addargs.config_from_flags(args).unprivileged
    spec = config.parse({"devices": [{"target": "null", "unprivileged": True}]},
                        str(tmp_path / "c.toml"), base=str(tmp_path)).devices[0]
    assert spec.config.unprivileged
    with pytest.raises(values.Invalid, match="unprivileged"):
        config.parse({"devices": [{"target": "null", "unprivileged": "yes"}]},
                     str(tmp_path / "c.toml"), base=str(tmp_path))


@pytest.mark.parametrize("name,dev_id", [("ublkc0", 0), ("ublkb12", 12), ("ublkb3p2", 3),
                                         ("ublkc1000", 1000)])
def test_the_helper_reads_node_names(name: str, dev_id: int) -> None:
    assert udev.dev_id_of(name) == dev_id


@pytest.mark.parametrize("name", ["ublk-control", "sda", "ublkb", "ublkx1", "ublkb1p"])
def test_the_helper_refuses_other_names(name: str) -> None:
    with pytest.raises(UblkError, match="not a ublk node name"):
        udev.dev_id_of(name)


def test_the_shipped_rule_is_what_the_command_prints() -> None:
    shipped = (ROOT / "examples/99-aioublk.rules").read_text()
    assert shipped == udev.rule_text("/usr/bin/python3")
    assert 'PROGRAM="/usr/bin/python3 -I -m aioublk udev owner %k"' in shipped
    assert 'KERNEL=="ublk-control", MODE="0666"' in shipped


def test_udev_rules_prints_this_interpreter(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    assert cli.main(["udev", "rules"]) == 0
    assert f"PROGRAM=\"{sys.executable} -I -m aioublk udev owner %k\"" in capsys.readouterr().out
