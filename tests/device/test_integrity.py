"""Integrity (UBLK_F_INTEGRITY) without a kernel: kublk's options, their
refusals, the flags and params they ask for."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioublk.errors import UblkError
from aioublk.frontend import addargs, maketarget, verb
from aioublk.kernel import uapi
from aioublk.queue.options import DeviceConfig


def _config(*args: str) -> DeviceConfig:
    return addargs.config_from_flags(verb.parser().parse_args(["add", "-t", "null", *args]))


@pytest.mark.parametrize("args,want", [
    # test_integrity_01.sh's four devices
    (["--metadata_size", "8"], uapi.Integrity(8)),
    (["--integrity_capable", "--metadata_size", "64", "--pi_offset", "56", "--csum_type", "ip"],
     uapi.Integrity(64, 9, 56, uapi.PI_CSUM["ip"], 0, uapi.PI_CAP_INTEGRITY)),
    (["--integrity_reftag", "--metadata_size", "8", "--csum_type", "t10dif"],
     uapi.Integrity(8, 9, 0, uapi.PI_CSUM["t10dif"], 0, uapi.PI_CAP_REFTAG)),
    (["--metadata_size", "16", "--csum_type", "nvme", "--tag_size", "8"],
     uapi.Integrity(16, 9, 0, uapi.PI_CSUM["nvme"], 8, 0)),
])
def test_kublk_options_become_integrity_params(args: list[str], want: uapi.Integrity) -> None:
    cfg = _config("-u", *args)
    assert cfg.integrity == want
    _batch, flags = cfg.resolve(uapi.Feature.INTEGRITY | uapi.Feature.USER_COPY)
    assert flags & uapi.Feature.INTEGRITY and flags & uapi.Feature.USER_COPY


def test_without_metadata_size_no_integrity() -> None:
    cfg = _config("-u")
    assert cfg.integrity is None
    assert not cfg.resolve(uapi.Feature.USER_COPY)[1] & uapi.Feature.INTEGRITY


@pytest.mark.parametrize("args,message", [
    (["-u", "--csum_type", "t10dif"], "integrity options need --metadata_size N"),
    (["-u", "--integrity_capable"], "integrity options need --metadata_size N"),
    (["-u", "--metadata_size", "64", "--pi_offset", "60", "--csum_type", "t10dif"],
     "a 8-byte t10dif PI tuple at --pi_offset 60 does not fit in --metadata_size 64: "
     "raise --metadata_size to 68 or more"),
    (["-u", "--metadata_size", "8", "--csum_type", "nvme"],
     "a 16-byte nvme PI tuple at --pi_offset 0 does not fit in --metadata_size 8"),
    (["-u", "--metadata_size", "8", "--pi_offset", "9"],
     "--pi_offset 9 does not fit in --metadata_size 8: raise --metadata_size to 9 or more"),
    (["-u", "--metadata_size", "8", "--integrity_reftag"],
     "--integrity_reftag needs a PI tuple: add --csum_type t10dif"),
    (["-u", "--metadata_size", "256"], "--metadata_size 256 out of range: use 0..255"),
    (["--metadata_size", "8"], "--metadata_size and copy mode copy conflict: the kernel "
     "moves integrity data only by user copy: add -u"),
    (["-z", "--metadata_size", "8"], "--metadata_size and copy mode zero_copy conflict"),
])
def test_refusals_are_one_line(args: list[str], message: str) -> None:
    with pytest.raises(UblkError) as e:
        _config(*args)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_unknown_csum_type_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        _config("-u", "--metadata_size", "8", "--csum_type", "crc32")


def test_a_kernel_without_integrity_is_one_line() -> None:
    cfg = _config("-u", "--metadata_size", "8")
    with pytest.raises(UblkError, match="does not support UBLK_F_INTEGRITY: drop the option"):
        cfg.resolve(uapi.Feature.USER_COPY)


def test_recover_takes_the_integrity_options_again() -> None:
    args = ["--metadata_size", "64", "--pi_offset", "56", "--csum_type", "t10dif",
            "--integrity_reftag"]
    recovered = vars(verb.parser().parse_args(["recover", "-n", "0", *args]))
    assert (recovered["metadata_size"], recovered["pi_offset"], recovered["csum_type"],
            recovered["integrity_reftag"]) == (64, 56, "t10dif", True)


def test_loop_takes_the_metadata_file_as_second_file(tmp_path: Path) -> None:
    from aioublk.targets.loop import LoopTarget

    data, meta = tmp_path / "data", tmp_path / "meta"
    data.write_bytes(bytes(1 << 20))
    meta.write_bytes(bytes(8 * 1024))  # 8 bytes per sector: metadata for 512K of data
    args = verb.parser().parse_args(["add", "-t", "loop", "--buffered", "-u",
                                     "--metadata_size", "8", str(data), str(meta)])
    target = maketarget.make_target(args)
    try:
        assert isinstance(target, LoopTarget)
        assert target.meta is not None and target.meta.path == str(meta)
        integrity = uapi.Integrity(8, csum_type=uapi.PI_CSUM["t10dif"])
        target.use_integrity(integrity, fresh=True)
        # as big as both files allow, and advertised with the metadata format
        assert target.geometry.size == 512 << 10
        assert target.geometry.params(1 << 20).integrity == integrity
        # a new device's metadata is 0xFF: the block layer does not check it
        assert meta.read_bytes() == b"\xff" * (8 * 1024)
    finally:
        target.close()


def test_recovering_keeps_the_metadata(tmp_path: Path) -> None:
    from aioublk.targets.loop import LoopTarget

    (tmp_path / "data").write_bytes(bytes(1 << 20))
    (tmp_path / "meta").write_bytes(b"\x12" * 4096)
    target = LoopTarget(str(tmp_path / "data"), direct=False,
                        metadata_file=str(tmp_path / "meta"))
    try:
        target.use_integrity(uapi.Integrity(8), fresh=False)
        assert (tmp_path / "meta").read_bytes() == b"\x12" * 4096
    finally:
        target.close()


def test_loop_without_metadata_file_is_one_line(tmp_path: Path) -> None:
    from aioublk.io.hostfile import BackingError
    from aioublk.targets.loop import LoopTarget

    (tmp_path / "data").write_bytes(bytes(1 << 20))
    target = LoopTarget(str(tmp_path / "data"), direct=False)
    try:
        with pytest.raises(BackingError, match="needs a second FILE, the metadata file"):
            target.use_integrity(uapi.Integrity(8), fresh=True)
    finally:
        target.close()


def test_a_target_without_metadata_is_refused() -> None:
    from aioublk.device import Device
    from aioublk.target import Geometry, Target

    class Plain(Target):
        name = "plain"
        geometry = Geometry(size=1 << 20)

    with pytest.raises(UblkError, match="target plain keeps no integrity metadata: drop "):
        Device(Plain(), _config("-u", "--metadata_size", "8"))


@pytest.mark.asyncio
async def test_null_reads_metadata_the_block_layer_skips() -> None:
    from aioublk.targets.null import NullTarget

    meta = memoryview(bytearray(16))
    await NullTarget(1 << 20).read(0, memoryview(bytearray(1024)), meta=meta)
    assert bytes(meta) == b"\xff" * 16


def test_a_metadata_file_without_metadata_size_is_one_line(tmp_path: Path) -> None:
    for f in ("data", "meta"):
        (tmp_path / f).write_bytes(bytes(4096))
    args = verb.parser().parse_args(["add", "-t", "loop", str(tmp_path / "data"),
                                     str(tmp_path / "meta")])
    with pytest.raises(UblkError, match="loop target's second FILE is its metadata file: add "
                       "-u --metadata_size N, or drop it"):
        maketarget.make_target(args)
