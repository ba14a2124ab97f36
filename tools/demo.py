"""The main job, shown end to end: a loop device over a file, a file system
on it, data written, the file system remounted, the data read back.

``scripts/demo`` runs it (``python -m tools.demo``) in the guest on a host without ublk_drv.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def sh(*cmd: str) -> str:
    print("$", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL).stdout
    if out.strip():
        print(out.rstrip(), flush=True)
    return out


def main() -> int:
    cli = [sys.executable, "-m", "aioublk"]
    work = Path(tempfile.mkdtemp(prefix="aioublk-demo-"))
    img = work / "disk.img"
    with open(img, "wb") as f:
        f.truncate(256 << 20)
    out = sh(*cli, "add", "-t", "loop", "-q", "2", str(img))
    dev_id = out.split()[2].rstrip(":")
    dev = f"/dev/ublkb{dev_id}"
    mnt = work / "mnt"
    mnt.mkdir()
    try:
        sh("mkfs.ext4", "-q", "-F", dev)
        sh("mount", dev, str(mnt))
        payload = os.urandom(8 << 20)
        (mnt / "hello.bin").write_bytes(payload)
        digest = hashlib.sha256(payload).hexdigest()
        print(f"wrote 8 MiB, sha256 {digest[:16]}...", flush=True)
        sh("umount", str(mnt))
        sh("mount", dev, str(mnt))
        back = hashlib.sha256((mnt / "hello.bin").read_bytes()).hexdigest()
        print(f"read back,  sha256 {back[:16]}... {'OK' if back == digest else 'MISMATCH'}",
              flush=True)
        sh("umount", str(mnt))
        sh(*cli, "list", "-n", dev_id)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        sh(*cli, "del", "-n", dev_id)
    return 0 if back == digest else 1


if __name__ == "__main__":
    sys.exit(main())
