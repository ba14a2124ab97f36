"""Make the seed corpus of the qcow2 fuzz targets with QEMU's own tools:
``python -m tests.fuzz.seeds`` (needs qemu-img and qemu-io) writes
``corpus/image/seed-*.qcow2``, ``corpus/header/seed-*`` (their first
cluster), ``corpus/snapshots/seed-*`` (their snapshot tables) and
``data/base.qcow2`` (the backing file the image target provides). The
config target's seeds are copies of ``examples/*.toml``, the nbd_uri target's
the URIs in ``NBD_URIS``.

Small images (512-byte clusters where QEMU allows it) keep each fuzz input
small and fast; the seeds stay in git, so this runs only to remake them.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
CORPUS = HERE / "corpus"
EXAMPLES = HERE.parent.parent / "examples"

#: name -> (qemu-img create options, size, qemu-io commands, snapshot names)
IMAGES: dict[str, tuple[list[str], str, list[str], list[str]]] = {
    "plain": (["-o", "cluster_size=512"], "1M", [], []),
    "data": (["-o", "cluster_size=512"], "1M",
             ["write -P 0x5a 0 1k", "write -P 0x6b 300k 512", "write -z 600k 1k"], []),
    "v2": (["-o", "cluster_size=512,compat=0.10"], "1M", ["write -P 0x5a 0 512"], []),
    "refcount1": (["-o", "cluster_size=512,refcount_bits=1"], "256k",
                  ["write -P 0x5a 0 512"], []),
    "refcount64": (["-o", "cluster_size=512,refcount_bits=64"], "256k",
                   ["write -P 0x5a 0 512"], []),
    "zlib": (["-o", "cluster_size=512"], "256k", ["write -c -P 0x5a 0 512"], []),
    "zstd": (["-o", "cluster_size=512,compression_type=zstd"], "256k",
             ["write -c -P 0x5a 0 512", "write -P 0x11 1k 512"], []),
    "extl2": (["-o", "cluster_size=16384,extended_l2=on"], "1M",
              ["write -P 0x5a 0 1k", "write -z 8k 1k"], []),
    "backed-raw": (["-o", "cluster_size=512", "-b", "base.raw", "-F", "raw"], "64k",
                   ["write -P 0x5a 512 512"], []),
    "backed-qcow2": (["-o", "cluster_size=512", "-b", "base.qcow2", "-F", "qcow2"], "64k",
                     ["write -P 0x5a 0 512"], []),
    "backed-noformat": (["-o", "cluster_size=512", "-b", "base.raw", "-F", "raw"], "64k",
                        [], []),
    "snapshot": (["-o", "cluster_size=512"], "64k", ["write -P 0x5a 0 1k"], ["s1"]),
    "snapshots": (["-o", "cluster_size=512"], "64k", ["write -P 0x5a 0 512"], ["one", "two"]),
}


def run(*cmd: str, cwd: Path) -> None:
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, timeout=60)


def make(tmp: Path) -> dict[str, bytes]:
    run("qemu-img", "create", "-q", "-f", "raw", "base.raw", "64k", cwd=tmp)
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", "base.qcow2",
        "64k", cwd=tmp)
    run("qemu-io", "-c", "write -P 0x33 0 1k", "base.qcow2", cwd=tmp)
    out = {}
    for name, (opts, size, writes, snaps) in IMAGES.items():
        path = f"{name}.qcow2"
        run("qemu-img", "create", "-q", "-f", "qcow2", *opts, path, size, cwd=tmp)
        for cmd in writes:
            run("qemu-io", "-c", cmd, path, cwd=tmp)
        for snap in snaps:
            run("qemu-img", "snapshot", "-c", snap, path, cwd=tmp)
            run("qemu-io", "-c", "write -P 0x7c 0 512", path, cwd=tmp)
        out[name] = (tmp / path).read_bytes()
    if b"base.raw" in out["backed-noformat"]:  # drop the backing format extension
        data = bytearray(out["backed-noformat"])
        i = data.find(struct.pack(">I", 0xE2792ACA))
        data[i:i + 4] = b"\0\0\0\0"  # becomes the end-of-extensions marker
        out["backed-noformat"] = bytes(data)
    out["base.qcow2"] = (tmp / "base.qcow2").read_bytes()
    return out


#: the nbd_uri target's seeds: each scheme and the URIs libnbd's manual shows
NBD_URIS = ["nbd://example.com", "nbds://example.com:10809/export",
            "nbd+unix:///foo?socket=/tmp/nbd.sock",
            "nbds+unix://alice@/?socket=/tmp/nbd.sock&tls-certificates=certs",
            "nbd+vsock:///", "nbds+vsock://2:10809/exp", "nbd+ssh://user@host/disk",
            "nbd://[::1]:10809/e%20x", "nbd:///", "nbd://h:99999/"]


def write(name: str, files: dict[str, bytes]) -> None:
    d = CORPUS / name
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("seed-*"):
        old.unlink()
    for fname, data in files.items():
        (d / f"seed-{fname}").write_bytes(data)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        images = make(Path(tmp))
    base = images.pop("base.qcow2")
    (HERE / "data").mkdir(exist_ok=True)
    (HERE / "data" / "base.qcow2").write_bytes(base)
    write("image", {f"{n}.qcow2": d for n, d in images.items()})
    headers = {}
    snapshots = {}
    for name, data in images.items():
        cluster_bits = struct.unpack_from(">I", data, 20)[0]
        headers[name] = data[:1 << cluster_bits]
        count, offset = struct.unpack_from(">IQ", data, 60)
        if count:
            # the snapshot target's input: a 2-byte count, then the table
            snapshots[name] = struct.pack(">H", count) + data[offset:offset + 4096]
    write("header", headers)
    write("snapshots", snapshots)
    write("config", {p.name: p.read_bytes() for p in sorted(EXAMPLES.glob("*.toml"))})
    write("nbd_uri", {f"{i}.uri": u.encode() for i, u in enumerate(NBD_URIS)})
    shutil.rmtree(CORPUS / "__pycache__", ignore_errors=True)


if __name__ == "__main__":
    main()
