"""Command line compatible with the kernel's reference server ``kublk``.

Same subcommands, flags, defaults and output lines, so scripts written for
kublk keep working::

    python -m aioublk add -t null|loop|stripe|qcow2|fault_inject [-n ID] [-q N]
                         [-d DEPTH] [-r 0|1] [-e 0|1] [-i 0|1] [--foreground] [FILE...]
    python -m aioublk add -t pkg.module:Class [--opt KEY=VALUE...] (a custom target)
    python -m aioublk recover -n ID [options that differ from add's]
    python -m aioublk del -n ID | -a
    python -m aioublk stop -n ID [--safe]
    python -m aioublk quiesce -n ID
    python -m aioublk update_size -n ID -s BYTES
    python -m aioublk snapshot -n ID create|list|delete [NAME] (a qcow2 device's image)
    python -m aioublk list [-n ID | -a] [--stats] [--json]
    python -m aioublk features
    python -m aioublk serve config.toml

``add`` and ``recover`` daemonize like kublk: the command returns once the
device is LIVE (printing the same lines as ``list``) or has failed (one line
on stderr, non-zero exit, no device left behind by ``add``). A daemon's logs
go to ``--log-file`` (its stderr too) or else to syslog, or to a file in the
run directory on a host without one; a line on stderr says where (the
error line, when the server fails).

Each verb is a module of ``aioublk/frontend/verbs/`` (``aioublk.frontend.verb``);
this one parses the command line and runs the verb it names.
"""

from __future__ import annotations

import sys

from aioublk.frontend import verb


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    parser = verb.parser()
    if not given:  # a bare aioublk: what it can do
        sys.stdout.write(parser.format_help())
        return 2
    asked = verb.find(given[0])
    if asked is not None and asked.before_parse is not None:
        answered = asked.before_parse(given)
        if answered is not None:
            return answered
    args = parser.parse_args(given)
    found = verb.find(args.cmd)
    assert found is not None  # (the parser knows no other)
    return verb.run(found, args)
