"""``python -m bench.suites selftests|fs|powercut [OPTIONS]``: one suite, in the guest."""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "selftests": "the kernel's ublk selftests, aioublk beside kublk",
    "fs": "ext4 and XFS on aioublk devices under stress-ng, fsmark, dbench, fio and a C build",
    "powercut": "file systems replayed to every flush of a dm-log-writes log, fsck at each",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in SUITES:
        usage = "usage: python -m bench.suites {" + "|".join(SUITES) + "} [OPTIONS]\n"
        print(usage, file=sys.stderr)
        for name, what in SUITES.items():
            print(f"  {name:10} {what}", file=sys.stderr)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    suite = importlib.import_module(f"bench.suites.{args[0]}")
    code: int = suite.main(args[1:])
    return code


if __name__ == "__main__":
    sys.exit(main())
