"""The rbd target against the real driver, through the CLI, in front of a
throwaway one-node Ceph cluster on 127.0.0.1 in the guest (started once
for the module: about ten times the host's 7 s under emulation)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.nbd.test_kernel_nbd import _write_error
from tests.support.kernel import add, cli, delete, fio, listing, run, write_synced
from tools.ceph import Cluster

pytestmark = [
    pytest.mark.guest, pytest.mark.usefixtures("no_devices_left"),
    pytest.mark.skipif(shutil.which("ceph-osd") is None,
                       reason="needs ceph-mon and ceph-osd (scripts/setup installs them)"),
]

MiB = 1 << 20
RBD_IMAGE_SIZE = 128 * MiB


def _add(ceph: Cluster, spec: str, *args: str) -> tuple[int, str]:
    dev = add("-t", "rbd", spec, "--rbd-conf", ceph.conf, "-q", "2", *args)
    return dev.dev_id, f"/dev/ublkb{dev.dev_id}"


def _exported(ceph: Cluster, spec: str, tmp_path: Path, offset: int, length: int) -> bytes:
    """The image's bytes as another librbd client reads them."""
    out = tmp_path / "export.raw"
    out.unlink(missing_ok=True)
    ceph.rbd("export", "--no-progress", spec, str(out))
    with open(out, "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_fio_verify_and_data_in_the_image(ceph: Cluster, rbd_image: str,
                                          tmp_path: Path) -> None:
    dev_id, path = _add(ceph, rbd_image)
    assert run("blockdev", "--getss", path).strip() == "512"
    job = fio(path, tmp_path, "--rw=randwrite", "--bs=8k", "--iodepth=32", "--size=16M",
              "--verify=crc32c", "--verify_fatal=1", "--do_verify=1")
    assert job["write"]["io_bytes"] == 16 * MiB  # type: ignore[index]
    data = os.urandom(MiB)
    write_synced(path, data, 100 * MiB)
    delete(dev_id)
    assert _exported(ceph, rbd_image, tmp_path, 100 * MiB, MiB) == data


def test_a_snapshot_is_read_only(ceph: Cluster, rbd_image: str, tmp_path: Path) -> None:
    old = os.urandom(MiB)
    dev_id, path = _add(ceph, rbd_image)
    write_synced(path, old, 0)
    ceph.rbd("snap", "create", f"{rbd_image}@before")
    write_synced(path, os.urandom(MiB), 0)
    delete(dev_id)
    dev_id, path = _add(ceph, f"{rbd_image}@before")
    try:
        assert run("blockdev", "--getro", path).strip() == "1"
        with open(path, "rb") as f:
            assert f.read(MiB) == old
        assert _write_error(path) != 0
    finally:
        delete(dev_id)


def _used(ceph: Cluster, spec: str) -> int:
    images = json.loads(ceph.rbd("du", "--format", "json", spec))["images"]
    return int(images[0]["used_size"])


def test_discard_frees_the_image_objects(ceph: Cluster, rbd_image: str,
                                         tmp_path: Path) -> None:
    dev_id, path = _add(ceph, rbd_image)
    try:
        fio(path, tmp_path, "--rw=write", "--bs=1M", "--iodepth=8", "--size=32M")
        run("sync")
        before = _used(ceph, rbd_image)
        assert before >= 32 * MiB
        run("blkdiscard", "-o", "0", "-l", str(32 * MiB), path)
        assert _used(ceph, rbd_image) < before
    finally:
        delete(dev_id)


@pytest.mark.parametrize("spec,says", [
    ("rbd/nope", "RBD image rbd/nope: no such image"),
    ("nopool/img", "Ceph pool 'nopool': no such pool"),
    ("rbd/{image}@nosnap", "has no snapshot 'nosnap'"),
])
def test_bad_input_is_one_line_and_leaves_no_device(ceph: Cluster, rbd_image: str, spec: str,
                                                    says: str) -> None:
    p = cli("add", "-t", "rbd", spec.format(image=rbd_image.split("/")[1]), "--rbd-conf",
            ceph.conf, check=False)
    assert p.returncode == 1 and says in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert not listing()


def test_a_missing_config_or_cluster_is_one_line(tmp_path: Path) -> None:
    p = cli("add", "-t", "rbd", "rbd/img", "--rbd-conf", str(tmp_path / "none.conf"),
            check=False)
    assert p.returncode == 1 and "no such file" in p.stderr and p.stderr.count("\n") == 1
    conf = tmp_path / "ceph.conf"
    conf.write_text("[global]\nmon host = 127.0.0.1:1\nauth client required = none\n")
    p = cli("add", "-t", "rbd", "rbd/img", "--rbd-conf", str(conf), check=False, timeout=120)
    assert p.returncode == 1 and "is it up and reachable" in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1
    assert not listing()
