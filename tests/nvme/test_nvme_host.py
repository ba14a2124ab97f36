"""The nvme target on the host, no NVMe device: the passthrough commands it
builds (byte for byte, as linux/nvme_ioctl.h lays them out) and issues (on a
recording ring), the geometry it reads from a fake sysfs, and its one-line
refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aioublk import Error, FixedBuf
from aioublk._uring import lib
from aioublk.dataplane.maps import Passthrough
from aioublk.dataplane.plane import DataPlane
from aioublk.frontend import maketarget, registry, verb
from aioublk.ring import Ring, buffer_address
from aioublk.targets import nvme
from aioublk.targets.nvme import CMD, NvmeError, NvmeTarget

#: field names of ``struct nvme_uring_cmd``, in order
FIELDS = ("opcode", "flags", "rsvd1", "nsid", "cdw2", "cdw3", "metadata", "addr",
          "metadata_len", "data_len", "cdw10", "cdw11", "cdw12", "cdw13", "cdw14", "cdw15",
          "timeout_ms", "rsvd2")


def fields(cmd: bytes) -> dict[str, int]:
    assert len(cmd) == 72  # fits the 80-byte command area of a 128-byte SQE
    return dict(zip(FIELDS, CMD.unpack(cmd), strict=True))


def test_the_ioctl_numbers_are_the_kernels() -> None:
    assert CMD.size == 72
    assert nvme.NVME_URING_CMD_IO == 0xC0484E80  # _IOWR('N', 0x80, struct nvme_uring_cmd)
    assert nvme.NVME_IOCTL_ID == 0x4E40


def test_read_and_write_name_slba_and_nlb_minus_one() -> None:
    lba = (7 << 32) | 0x1234
    r = fields(nvme.rw_command(nvme.OP_READ, 1, lba, 8, 0xDEAD000, 4096))
    assert r == dict.fromkeys(FIELDS, 0) | {
        "opcode": 0x02, "nsid": 1, "addr": 0xDEAD000, "data_len": 4096,
        "cdw10": 0x1234, "cdw11": 7, "cdw12": 7}
    w = fields(nvme.rw_command(nvme.OP_WRITE, 3, 0, 1, 0x1000, 512, fua=True))
    assert (w["opcode"], w["nsid"], w["cdw12"]) == (0x01, 3, 1 << 30)
    assert fields(nvme.rw_command(nvme.OP_WRITE, 1, 0, 65536, 0, 1 << 25))["cdw12"] == 0xFFFF
    with pytest.raises(ValueError, match="1 to 65536 blocks"):
        nvme.rw_command(nvme.OP_READ, 1, 0, 65537, 0, 0)
    with pytest.raises(ValueError):
        nvme.rw_command(nvme.OP_READ, 1, 0, 0, 0, 0)


def test_flush_write_zeroes_and_deallocate() -> None:
    assert fields(nvme.command(nvme.OP_FLUSH, 2)) == dict.fromkeys(FIELDS, 0) | {"nsid": 2}
    wz = fields(nvme.write_zeroes_command(1, 100, 16, unmap=True))
    assert (wz["opcode"], wz["cdw10"], wz["cdw11"], wz["cdw12"], wz["addr"]) == \
        (0x08, 100, 0, 15 | (1 << 25), 0)
    assert fields(nvme.write_zeroes_command(1, 100, 16, unmap=False))["cdw12"] == 15
    ranges = nvme.dsm_ranges(1 << 33, 10)
    assert ranges == nvme.DSM_RANGE.pack(0, 10, 1 << 33)
    dsm = fields(nvme.dsm_command(1, 0xABC000, len(ranges)))
    assert (dsm["opcode"], dsm["addr"], dsm["data_len"], dsm["cdw10"], dsm["cdw11"]) == \
        (0x09, 0xABC000, 16, 0, 1 << 2)


def test_a_long_deallocate_is_several_ranges() -> None:
    ranges = nvme.dsm_ranges(0, nvme.DSM_MAX_NLB + 5)
    assert list(nvme.DSM_RANGE.iter_unpack(ranges)) == [(0, nvme.DSM_MAX_NLB, 0),
                                                        (0, 5, nvme.DSM_MAX_NLB)]
    assert fields(nvme.dsm_command(1, 0, len(ranges)))["cdw10"] == 1


def fake_block(root: Path, name: str = "nvme0n1", **queue: object) -> Path:
    block = root / "block" / name
    (block / "queue").mkdir(parents=True)
    (block / "size").write_text("1048576\n")  # 512 MiB
    (block / "ro").write_text("0\n")
    values = {"logical_block_size": 4096, "physical_block_size": 4096,
              "max_hw_sectors_kb": 2048, "max_segments": 127, "minimum_io_size": 4096,
              "optimal_io_size": 0, "write_cache": "write back", "fua": 0,
              "discard_max_hw_bytes": 2199023255040, "discard_granularity": 4096,
              "write_zeroes_max_bytes": 1048576} | queue
    for key, value in values.items():
        (block / "queue" / key).write_text(f"{value}\n")
    return block


def test_geometry_from_sysfs(tmp_path: Path) -> None:
    geo = nvme.geometry_from_sysfs(fake_block(tmp_path))
    assert (geo.size, geo.logical_block_size, geo.physical_block_size, geo.io_min,
            geo.io_opt) == (512 << 20, 4096, 4096, 4096, 4096)
    assert geo.max_io_size == 127 * 4096  # a user buffer: one segment per page
    assert (geo.volatile_cache, geo.fua, geo.discard, geo.write_zeroes, geo.read_only) == \
        (True, False, True, True, False)


def test_geometry_of_a_plain_namespace(tmp_path: Path) -> None:
    block = fake_block(tmp_path, logical_block_size=512, max_hw_sectors_kb=128,
                       write_cache="write through", discard_max_hw_bytes=0,
                       write_zeroes_max_bytes=0)
    geo = nvme.geometry_from_sysfs(block, read_only=True)
    assert (geo.logical_block_size, geo.max_io_size, geo.volatile_cache, geo.discard,
            geo.write_zeroes, geo.read_only) == (512, 128 << 10, False, False, False, True)


def fake_sysfs(root: Path, rdev: int, device_name: str) -> Path:
    """``/sys/dev/char/MAJ:MIN`` of ``rdev`` pointing at a device named so."""
    target = root / "devices" / "pci0000:00" / "nvme" / "nvme0" / device_name
    target.mkdir(parents=True)
    link = root / "dev" / "char" / f"{os.major(rdev)}:{os.minor(rdev)}"
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    return root


def test_the_char_device_leads_to_its_block_device(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, os.stat("/dev/null").st_rdev, "ng0n1")
    block = fake_block(root)
    assert nvme.namespace_block("/dev/null", root) == block


@pytest.mark.parametrize(("path", "name", "message"), [
    ("/nonexistent/ng0n1", "ng0n1", "NVMe device /nonexistent/ng0n1: No such file or directory"),
    (__file__, "ng0n1", f"{__file__} is not a character device: pass the namespace's generic "
     "char device, e.g. /dev/ng0n1"),
    ("/dev/null", "null", "/dev/null is not an NVMe generic char device: pass the namespace's "
     "generic char device, e.g. /dev/ng0n1"),
    ("/dev/null", "ng0n2", "/dev/null: no block device nvme0n2 in sysfs to read its geometry "
     "from: is the namespace attached?"),
])
def test_paths_that_are_not_a_namespace_are_refused_in_one_line(
        tmp_path: Path, path: str, name: str, message: str) -> None:
    root = fake_sysfs(tmp_path, os.stat("/dev/null").st_rdev, name)
    fake_block(root)
    with pytest.raises(NvmeError) as e:
        nvme.namespace_block(path, root)
    assert str(e.value) == message


def test_a_char_device_that_is_not_nvme_fails_the_id_ioctl(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, os.stat("/dev/null").st_rdev, "ng0n1")
    fake_block(root)
    with pytest.raises(NvmeError, match=r"^/dev/null does not answer NVME_IOCTL_ID \(.*\): "
                       "pass an NVMe namespace's generic char device, e.g. /dev/ng0n1$"):
        NvmeTarget("/dev/null", sys_root=root)


def test_registered_as_add_t_nvme() -> None:
    spec = registry.TARGETS["nvme"]
    assert (spec.files, spec.keys(), spec.read_only) == ("device", ("device",), True)
    assert spec.target_class() is NvmeTarget
    with pytest.raises(NvmeError, match="^NVMe device /nonexistent/ng0n1: No such file"):
        spec.build({"device": "/nonexistent/ng0n1"})


class FakeRing:
    """Records the passthrough commands a target issues; each succeeds."""

    def __init__(self) -> None:
        self.cmds: list[tuple[int, dict[str, int]]] = []

    async def uring_cmd(self, fd: int, cmd_op: int, cmd: bytes, *, keep: object = None,
                        addr: int = 0, cmd_flags: int = 0, buf_index: int = 0) -> int:
        assert cmd_op == nvme.NVME_URING_CMD_IO
        self.cmds.append((cmd_flags, fields(cmd) | {"buf_index": buf_index}))
        return 0


def served_by(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[NvmeTarget, FakeRing]:
    target = NvmeTarget.__new__(NvmeTarget)
    target.geometry = nvme.geometry_from_sysfs(fake_block(tmp_path))
    target.ns = nvme.Namespace("/dev/ng0n1", -1, 1, 4096)
    ring = FakeRing()
    monkeypatch.setattr(nvme, "current_ring", lambda: ring)
    return target, ring


@pytest.mark.asyncio
async def test_zero_copy_commands_name_the_registered_buffer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-z/--auto_zc: the data is buffer `index` of the ring's table, `addr`
    the offset inside it."""
    target, ring = served_by(tmp_path, monkeypatch)
    await target.read(8192, FixedBuf(5, 4096, 16384))
    await target.write(0, FixedBuf(6, 0, 4096))
    fixed = lib.IORING_URING_CMD_FIXED
    assert [(f, c["opcode"], c["buf_index"], c["addr"], c["data_len"], c["cdw10"], c["cdw12"])
            for f, c in ring.cmds] == [(fixed, 0x02, 5, 4096, 16384, 2, 3),
                                       (fixed, 0x01, 6, 0, 4096, 0, 0)]


@pytest.mark.asyncio
async def test_copy_mode_commands_point_at_the_buffer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, ring = served_by(tmp_path, monkeypatch)
    buf = memoryview(bytearray(8192))
    await target.write(4096, buf, fua=True)  # write back without FUA: write, then flush
    await target.discard(0, 1 << 20)
    await target.write_zeroes(0, 2 * nvme.MAX_NLB * 4096)
    assert [(f, c["opcode"]) for f, c in ring.cmds] == [(0, 0x01), (0, 0x00), (0, 0x09),
                                                        (0, 0x08), (0, 0x08)]
    write = ring.cmds[0][1]
    assert (write["addr"], write["data_len"], write["cdw10"], write["cdw12"]) == \
        (buffer_address(buf), 8192, 1, 1)


@pytest.mark.parametrize(("argv", "message"), [
    ([], "the nvme target needs exactly one NVMe generic char device, got 0"),
    (["/dev/ng0n1", "/dev/ng0n2"],
     "the nvme target needs exactly one NVMe generic char device, got 2"),
    (["/nonexistent/ng0n1"], "NVMe device /nonexistent/ng0n1: No such file or directory"),
])
def test_add_t_nvme_refuses_in_one_line(argv: list[str], message: str) -> None:
    args = verb.parser().parse_args(["add", "-t", "nvme", *argv])
    with pytest.raises(Error) as e:
        maketarget.make_target(args)
    assert str(e.value) == message


@pytest.mark.asyncio
async def test_io_not_in_whole_namespace_blocks_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config may give the device a smaller logical_block_size than the
    namespace's: such a request fails rather than reach the wrong LBA."""
    target, ring = served_by(tmp_path, monkeypatch)
    with pytest.raises(OSError, match="whole 4096-byte NVMe blocks"):
        await target.read(512, memoryview(bytearray(4096)))
    with pytest.raises(OSError, match="whole 4096-byte NVMe blocks"):
        await target.write(0, memoryview(bytearray(512)))
    assert ring.cmds == []


def test_reads_and_writes_are_the_data_planes(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With the namespace's write cache: a flush is a command, a FUA write
    Python's (the fake namespace takes no FUA bit)."""
    target, _ = served_by(tmp_path, monkeypatch)
    assert target.map() == Passthrough(-1, 1, 4096, volatile_cache=True, fua=False)


@pytest.mark.parametrize("sqe128", [False, True], ids=["64-byte", "128-byte"])
@pytest.mark.asyncio
async def test_the_data_plane_takes_passthrough_only_on_a_ring_of_big_sqes(sqe128: bool) -> None:
    """An NVMe command does not fit a 64-byte SQE: C refuses the map there
    rather than writing past it."""
    ring = Ring(8, sqe128=sqe128, cqe32=sqe128)
    try:
        dp = DataPlane(ring, {"char_fd": -1, "nr_queues": 1, "depth": 1, "max_io": 4096}, 1,
                       lambda ud, res, flags: None)
        if sqe128:
            dp.set_map(Passthrough(-1, 1, 4096))
            assert dp.map == Passthrough(-1, 1, 4096)
        else:
            with pytest.raises(OSError, match="refused Passthrough"):
                dp.set_map(Passthrough(-1, 1, 4096))
    finally:
        ring.close()
