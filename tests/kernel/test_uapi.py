"""The Python encoding of the ublk ABI checked against the kernel's own header.

Twice: against the copy the C data plane is built with
(``aioublk/csrc/ublk_cmd.h``, no download), and against Debian sid's
``linux-libc-dev`` (the one matching the guest kernel, with the BATCH_IO
structs), which also has the block layer's headers. Each time a small C
program compiled against the header prints every size, offset and value we
rely on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from aioublk.kernel import uapi
from aioublk.testing.sid import SidApt, cache_dir, extract, locked

CSRC = Path(uapi.__file__).parent.parent / "csrc"

PROBE = r"""
#include <stdio.h>
#include <stddef.h>
#include <sys/ioctl.h>
%INCLUDES%
#define S(t) printf("\"sizeof %s\": %zu,\n", #t, sizeof(struct t))
#define O(t, f) printf("\"offsetof %s.%s\": %zu,\n", #t, #f, offsetof(struct t, f))
#define V(x) printf("\"%s\": %llu,\n", #x, (unsigned long long)(x))
int main(void) {
    printf("{\n");
%CALLS%
    printf("\"end\": 0}\n");
    return 0;
}
"""


def probe(includes: list[str], calls: str, flags: list[str], build: Path) -> dict[str, int]:
    """What a program built in ``build`` with ``flags`` prints for ``calls`` (of
    S(struct), O(struct, field), V(expression)) after ``#include`` of ``includes``."""
    src = build / "probe.c"
    src.write_text(PROBE.replace("%INCLUDES%", "".join(f"#include {i}\n" for i in includes))
                   .replace("%CALLS%", calls))
    exe = build / "probe"
    subprocess.run(["cc", *flags, "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    values: dict[str, int] = json.loads(out)
    return values


def python_abi() -> dict[str, int]:
    """Each value of ``uapi`` that ublk_cmd.h defines too, by the probe's key for it
    (``sizeof <struct>`` or the header's name)."""
    want: dict[str, int] = {f"UBLK_U_CMD_{c.name}": c for c in uapi.Cmd}
    want |= {f"UBLK_U_IO_{c.name}": c for c in uapi.IoCmd}
    want |= {f"UBLK_F_{f.name}": f for f in uapi.Feature}
    want |= {f"UBLK_BATCH_F_{f.name}": f for f in uapi.BatchFlag}
    want |= {f"UBLK_IO_OP_{op.name}": op for op in uapi.Op}
    want |= {f"UBLK_S_DEV_{s.name}": s for s in uapi.State}
    for name in ("FUA", "NOUNMAP", "NEED_REG_BUF", "INTEGRITY", "SHMEM_ZC"):
        want[f"UBLK_IO_F_{name}"] = getattr(uapi, f"IO_F_{name}")
    for name in ("BASIC", "DISCARD", "DEVT", "ZONED", "DMA_ALIGN", "SEGMENT", "INTEGRITY"):
        want[f"UBLK_PARAM_TYPE_{name}"] = getattr(uapi, f"PARAM_TYPE_{name}")
    for name in ("READ_ONLY", "ROTATIONAL", "VOLATILE_CACHE", "FUA"):
        want[f"UBLK_ATTR_{name}"] = getattr(uapi, f"ATTR_{name}")
    want |= {
        "UBLK_IO_RES_OK": uapi.IO_RES_OK,
        "UBLK_IO_RES_NEED_GET_DATA": uapi.IO_RES_NEED_GET_DATA,
        "UBLK_MAX_QUEUE_DEPTH": uapi.MAX_QUEUE_DEPTH,
        "UBLK_MAX_NR_QUEUES": uapi.MAX_NR_QUEUES,
        "UBLKSRV_IO_BUF_OFFSET": uapi.IO_BUF_OFFSET,
        "UBLK_IO_BUF_BITS": uapi.IO_BUF_BITS,
        "UBLK_TAG_OFF": uapi.TAG_OFF,
        "UBLK_QID_OFF": uapi.QID_OFF,
        "UBLKSRV_IO_INTEGRITY_FLAG": uapi.IO_INTEGRITY_FLAG,
        "UBLK_SHMEM_BUF_READ_ONLY": uapi.SHMEM_BUF_READ_ONLY,
        "sizeof ublksrv_ctrl_cmd": uapi.CTRL_CMD.size,
        "sizeof ublksrv_ctrl_dev_info": uapi.DEV_INFO_SIZE,
        "sizeof ublksrv_io_desc": uapi.IO_DESC.size,
        "sizeof ublksrv_io_cmd": uapi.IO_CMD.size,
        "sizeof ublk_params": uapi.PARAMS_SIZE,
        "sizeof ublk_batch_io": uapi.BATCH_IO.size,
        "sizeof ublk_elem_header": uapi.ELEM_HEADER.size,
        "sizeof ublk_shmem_buf_reg": uapi.SHMEM_BUF_REG.size,
    }
    return {k: int(v) for k, v in want.items()}


def probe_calls(keys: list[str]) -> str:
    """The calls that print ``keys`` (python_abi's)."""
    return "".join(f"    S({k.split()[1]});\n" if k.startswith("sizeof ") else f"    V({k});\n"
                   for k in keys)


@pytest.fixture(scope="module")
def vendored_abi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """The values of python_abi's names in csrc/ublk_cmd.h, by the system compiler."""
    return probe(['"ublk_cmd.h"'], probe_calls(list(python_abi())), ["-I", str(CSRC)],
                 tmp_path_factory.mktemp("vendored-uapi"))


@pytest.fixture(scope="module")
def kernel_abi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """The same and more (the block layer's values, layouts) in the guest kernel's
    headers."""
    root = cache_dir() / "uapi"
    header = root / "usr" / "include" / "linux" / "ublk_cmd.h"
    with locked("uapi"):
        if not header.exists():
            (deb,) = SidApt().download(["linux-libc-dev"])
            shutil.rmtree(root, ignore_errors=True)
            extract(deb, root)
    calls = """
    S(ublk_param_zoned); S(blk_zone);
    O(blk_zone, wp); O(blk_zone, type); O(blk_zone, cond); O(blk_zone, capacity);
    O(ublk_params, basic); O(ublk_params, discard); O(ublk_params, devt);
    O(ublk_params, zoned); O(ublk_params, dma); O(ublk_params, seg);
    O(ublk_params, integrity); S(ublk_param_integrity);
    O(ublk_param_integrity, max_integrity_segments); O(ublk_param_integrity, interval_exp);
    O(ublk_param_integrity, metadata_size); O(ublk_param_integrity, pi_offset);
    O(ublk_param_integrity, csum_type); O(ublk_param_integrity, tag_size);
    O(ublksrv_ctrl_dev_info, flags); O(ublksrv_ctrl_dev_info, ublksrv_pid);
    O(ublksrv_ctrl_cmd, data); O(ublksrv_ctrl_cmd, addr);
    O(ublk_shmem_buf_reg, len); O(ublk_shmem_buf_reg, flags);
    V(ublk_shmem_zc_addr(0xbeef, 0xdeadbeefu));
    V(BLK_ZONE_TYPE_SEQWRITE_REQ); V(BLK_ZONE_COND_CLOSED); V(BLK_ZONE_COND_FULL);
    V(LBMD_PI_CAP_INTEGRITY); V(LBMD_PI_CAP_REFTAG); V(LBMD_PI_CSUM_NONE); V(LBMD_PI_CSUM_IP);
    V(LBMD_PI_CSUM_CRC16_T10DIF); V(LBMD_PI_CSUM_CRC64_NVME);
"""
    include = header.parents[1]
    return probe(["<linux/ublk_cmd.h>", "<linux/blkzoned.h>", "<linux/fs.h>"],
                 calls + probe_calls(list(python_abi())),
                 ["-I", str(include), "-I", str(include / "x86_64-linux-gnu")],
                 tmp_path_factory.mktemp("guest-uapi"))


def test_python_abi_matches_the_vendored_header(vendored_abi: dict[str, int]) -> None:
    want = python_abi()
    assert {k: vendored_abi[k] for k in want} == want


def test_vendored_header_is_the_guest_kernels(kernel_abi: dict[str, int],
                                              vendored_abi: dict[str, int]) -> None:
    """csrc/ublk_cmd.h is a copy of the guest kernel's (copy it again when that one
    changes); with the test above, the Python values are the guest kernel's too."""
    assert {k: kernel_abi[k] for k in vendored_abi} == vendored_abi


def test_opcodes_encode_the_struct_sizes() -> None:
    """(python_abi holds the structs' sizes against the headers)"""
    assert uapi.CTRL_CMD.size == uapi.CTRL_CMD_SIZE
    assert uapi.IO_CMD.size == uapi.IO_CMD_SIZE
    assert uapi.BATCH_IO.size == uapi.BATCH_IO_SIZE


def test_params_layout(kernel_abi: dict[str, int]) -> None:
    p = uapi.Params(dev_sectors=12345, dma_alignment=511, segment=(4095, 65536, 7),
                    discard=(0, 4096, 2048, 2048, 1), attrs=uapi.ATTR_VOLATILE_CACHE)
    raw = p.pack()
    assert len(raw) == kernel_abi["sizeof ublk_params"]
    basic = kernel_abi["offsetof ublk_params.basic"]
    assert int.from_bytes(raw[basic + 16:basic + 24], "little") == 12345  # dev_sectors
    dma = kernel_abi["offsetof ublk_params.dma"]
    assert int.from_bytes(raw[dma:dma + 4], "little") == 511
    seg = kernel_abi["offsetof ublk_params.seg"]
    assert int.from_bytes(raw[seg:seg + 8], "little") == 4095
    assert int.from_bytes(raw[seg + 12:seg + 14], "little") == 7
    disc = kernel_abi["offsetof ublk_params.discard"]
    assert int.from_bytes(raw[disc + 4:disc + 8], "little") == 4096
    assert uapi.Params.unpack(raw).segment == (4095, 65536, 7)


def test_zoned_layout(kernel_abi: dict[str, int]) -> None:
    assert kernel_abi["sizeof blk_zone"] == uapi.BLK_ZONE.size
    assert [kernel_abi[f"offsetof blk_zone.{f}"] for f in ("wp", "type", "cond", "capacity")] \
        == [16, 24, 25, 32]
    assert kernel_abi["BLK_ZONE_TYPE_SEQWRITE_REQ"] == uapi.ZONE_TYPE_SEQWRITE_REQ
    assert kernel_abi["BLK_ZONE_COND_CLOSED"] == uapi.ZONE_COND_CLOSED
    assert kernel_abi["BLK_ZONE_COND_FULL"] == uapi.ZONE_COND_FULL
    raw = uapi.Params(dev_sectors=1 << 20, chunk_sectors=2048, zoned=(4, 6, 256)).pack()
    off = kernel_abi["offsetof ublk_params.zoned"]
    assert [int.from_bytes(raw[off + i:off + i + 4], "little") for i in (0, 4, 8)] == [4, 6, 256]
    assert kernel_abi["sizeof ublk_param_zoned"] == 32


def test_integrity_layout(kernel_abi: dict[str, int]) -> None:
    assert kernel_abi["sizeof ublk_param_integrity"] == 16
    assert [kernel_abi[f"offsetof ublk_param_integrity.{f}"] for f in (
        "max_integrity_segments", "interval_exp", "metadata_size", "pi_offset", "csum_type",
        "tag_size")] == [4, 6, 7, 8, 9, 10]
    assert kernel_abi["LBMD_PI_CAP_INTEGRITY"] == uapi.PI_CAP_INTEGRITY
    assert kernel_abi["LBMD_PI_CAP_REFTAG"] == uapi.PI_CAP_REFTAG
    for name, csum in (("NONE", "none"), ("IP", "ip"), ("CRC16_T10DIF", "t10dif"),
                       ("CRC64_NVME", "nvme")):
        assert kernel_abi[f"LBMD_PI_CSUM_{name}"] == uapi.PI_CSUM[csum]
    integrity = uapi.Integrity(64, 9, 56, uapi.PI_CSUM["t10dif"], 2,
                               uapi.PI_CAP_INTEGRITY | uapi.PI_CAP_REFTAG)
    raw = uapi.Params(dev_sectors=8, integrity=integrity).pack()
    assert int.from_bytes(raw[4:8], "little") & uapi.PARAM_TYPE_INTEGRITY
    off = kernel_abi["offsetof ublk_params.integrity"]
    assert int.from_bytes(raw[off:off + 4], "little") == 3
    assert raw[off + 6:off + 11] == bytes([9, 64, 56, 2, 2])
    assert uapi.Params.unpack(raw).integrity == integrity
    assert uapi.Params.unpack(uapi.Params(dev_sectors=8).pack()).integrity is None


def test_dev_info_layout(kernel_abi: dict[str, int]) -> None:
    info = uapi.DevInfo(nr_hw_queues=3, queue_depth=64, dev_id=9, ublksrv_pid=4242,
                        flags=0x8040)
    raw = info.pack()
    off = kernel_abi["offsetof ublksrv_ctrl_dev_info.flags"]
    assert int.from_bytes(raw[off:off + 8], "little") == 0x8040
    off = kernel_abi["offsetof ublksrv_ctrl_dev_info.ublksrv_pid"]
    assert int.from_bytes(raw[off:off + 4], "little") == 4242
    assert uapi.DevInfo.unpack(raw) == info


def test_ctrl_cmd_layout(kernel_abi: dict[str, int]) -> None:
    raw = uapi.ctrl_cmd(7, length=8, addr=0xABCDEF, data=99)
    off = kernel_abi["offsetof ublksrv_ctrl_cmd.addr"]
    assert int.from_bytes(raw[off:off + 8], "little") == 0xABCDEF
    off = kernel_abi["offsetof ublksrv_ctrl_cmd.data"]
    assert int.from_bytes(raw[off:off + 8], "little") == 99


def test_shmem_buf_reg_layout(kernel_abi: dict[str, int]) -> None:
    assert uapi.SHMEM_BUF_REG.size == 24
    raw = uapi.SHMEM_BUF_REG.pack(0x7F00_0000_0000, 4 << 20, uapi.SHMEM_BUF_READ_ONLY, 0)
    off = kernel_abi["offsetof ublk_shmem_buf_reg.len"]
    assert int.from_bytes(raw[off:off + 8], "little") == 4 << 20
    off = kernel_abi["offsetof ublk_shmem_buf_reg.flags"]
    assert int.from_bytes(raw[off:off + 4], "little") == uapi.SHMEM_BUF_READ_ONLY


def test_shmem_zc_place(kernel_abi: dict[str, int]) -> None:
    addr = kernel_abi["ublk_shmem_zc_addr(0xbeef, 0xdeadbeefu)"]
    assert uapi.shmem_zc_place(addr) == (0xBEEF, 0xDEADBEEF)
    # bits 48-63 are reserved: they never leak into the index
    assert uapi.shmem_zc_place(0xFFFF_0001_0000_1000) == (1, 0x1000)


def test_feature_names_cover_every_known_bit() -> None:
    names = dict(uapi.feature_names((1 << 20) - 1))
    assert len(names) == 20
    assert "unknown" not in names.values()
    assert names[1 << 19] == "UBLK_F_SHMEM_ZC"
    assert uapi.feature_names(1 << 40) == [(1 << 40, "unknown")]


def test_desc_mmap_offsets() -> None:
    # each queue's descriptors sit at a stride sized for the maximum depth
    assert uapi.desc_area_size(128) == 4096
    assert uapi.desc_mmap_offset(1) == 4096 * 24
    assert uapi.user_copy_offset(1, 2) == 0x8000_0000 | (1 << 41) | (2 << 25)
    assert uapi.user_copy_offset(1, 2, integrity=True) == uapi.user_copy_offset(1, 2) | 1 << 62


def test_integrity_meta_bytes() -> None:
    # one metadata_size chunk per protection interval, as kublk's ublk_integrity_len
    assert uapi.Integrity(64).meta_bytes(1 << 20) == 128 << 10
    assert uapi.Integrity(8, interval_exp=12).meta_bytes(8192) == 16


