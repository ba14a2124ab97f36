"""--shmem_zc on the host: the options and their refusals. The device itself
is tested in the guest (tests/test_kernel_shmem.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioublk import cli, uapi
from aioublk.config import load
from aioublk.options import CopyMode, DeviceConfig, UblkError


def _config(*args: str) -> DeviceConfig:
    return cli.device_config(cli._parser().parse_args(["add", "-t", "null", *args]))


def test_options_ask_the_kernel_for_shmem_zc(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _config("--shmem_zc", "--htlb", "buf", "--rdonly_shmem_buf")
    assert cfg.htlb == str(tmp_path / "buf")  # absolute: a daemon runs in /
    assert cfg.rdonly_shmem_buf
    _batch, flags = cfg.resolve(uapi.Feature.SHMEM_ZC)
    assert flags == uapi.Feature.SHMEM_ZC
    # alone, --shmem_zc only asks for the feature (no buffer to match yet)
    assert _config("--shmem_zc", "-u").resolve(~0 & ((1 << 64) - 1))[1] & uapi.Feature.SHMEM_ZC


@pytest.mark.parametrize("args,message", [
    (["--htlb", "/dev/hugepages/buf"], "--htlb needs --shmem_zc"),
    (["--shmem_zc", "--rdonly_shmem_buf"], "--rdonly_shmem_buf needs --htlb FILE"),
])
def test_refusals_are_one_line(args: list[str], message: str) -> None:
    with pytest.raises(UblkError) as e:
        _config(*args)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_kernel_without_shmem_zc_is_one_line() -> None:
    with pytest.raises(UblkError, match="does not support UBLK_F_SHMEM_ZC: drop the option"):
        _config("--shmem_zc").resolve(uapi.Feature.CMD_IOCTL_ENCODE)


def test_zoned_and_shmem_zc_conflict() -> None:
    with pytest.raises(UblkError, match="a zoned device and --shmem_zc conflict"):
        DeviceConfig(zoned=True, copy=CopyMode.USER_COPY, shmem_zc=True).validate()


def test_config_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "buf").write_bytes(bytes(4096))
    (tmp_path / "config.toml").write_text(
        '[[devices]]\ntarget = "null"\nshmem_zc = true\nhtlb = "buf"\n'
        "rdonly_shmem_buf = true\n")
    (dev,) = load("config.toml").devices
    assert dev.config.shmem_zc and dev.config.rdonly_shmem_buf
    assert dev.config.htlb == str(tmp_path / "buf")
