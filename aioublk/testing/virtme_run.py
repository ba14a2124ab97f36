"""virtme-run, as vng runs it for our guest, with the guest's root file system cached.

virtme's initramfs mounts the host's root over 9p without a cache, so every
stat and open in the guest crosses to QEMU's 9p server: under emulation a
bare ``python -c pass`` took 0.62-0.69 s and ``aioublk list`` 1.8-2.0 s.
With ``cache=loose`` they took 0.38-0.52 s and 0.94-1.45 s (kublk's ``list``
0.18-0.29 s and 0.11-0.17 s). The root is read-only in the guest and the
host does not change it while a guest runs; the folders passed with
``--rwdir`` (everything the host and guest exchange) keep their own uncached
mounts. `aioublk.testing.guest` puts this first on vng's PATH.
"""

from __future__ import annotations

import sys

#: the 9p mount of the root in virtme's initramfs script, and what it becomes
UNCACHED = "msize=524288 /dev/root /newroot/"
CACHED = "msize=524288,cache=loose /dev/root /newroot/"


def cache_root_mount(script: str) -> str | None:
    """`script` (virtme's root-mounting shell) with the 9p root cached, or
    None when virtme's script no longer has the line we know."""
    if script.count(UNCACHED) != 1:
        return None
    return script.replace(UNCACHED, CACHED)


def main() -> int:
    sys.argv[0] = "virtme-run"  # its usage line, built when its module loads
    import virtme.mkinitramfs as initramfs
    from virtme.commands.run import main as virtme_run

    cached = cache_root_mount(initramfs._MOUNT_ROOT_HOST)
    if cached is None:
        print("aioublk guest: virtme's root mount is not the one we know: the guest's "
              "root stays uncached (slower)", file=sys.stderr)
    else:
        initramfs._MOUNT_ROOT_HOST = cached
    return int(virtme_run() or 0)


if __name__ == "__main__":
    sys.exit(main())
