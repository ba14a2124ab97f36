"""``python -m aioublk`` (and the ``aioublk`` script): the kublk-compatible
command line. ``--version`` answers before the command line's modules load,
so a script asking it pays for the interpreter alone; ``list``, ``del``,
``features``, ``udev`` and ``commit`` (polled by scripts, run by udev for
every node: light verbs) load only theirs (``frontend.ctl``)."""

import sys


def entry() -> int:
    if sys.argv[1:] == ["--version"]:
        from aioublk._version import __version__

        print(f"aioublk {__version__}")
        return 0
    from aioublk.frontend import ctl

    if ctl.light(sys.argv[1:]) is not None:
        return ctl.main(sys.argv[1:])
    from aioublk.frontend.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(entry())
