"""``completion bash|zsh|fish``: a shell completion script, generated from
the parser (as ``man``'s page is)."""

from __future__ import annotations

import argparse
import sys

from aioublk._version import __version__
from aioublk.frontend import registry, verb
from aioublk.frontend.registry import packaged_targets
from aioublk.frontend.verb import Verb


def generated(what: str, shell: str = "") -> str:
    """``completion``'s script for ``shell``, or the man page (``man``)."""
    from aioublk.frontend import shellgen

    targets = (*registry.TARGETS, *packaged_targets())
    cmds = shellgen.commands(verb.parser(), {"-t": targets, "--filter": tuple(registry.FILTERS)})
    if what == "man":
        return shellgen.man(cmds, __version__)
    return {"bash": shellgen.bash, "zsh": shellgen.zsh, "fish": shellgen.fish}[shell](cmds)


def _arguments(co: argparse.ArgumentParser) -> None:
    co.add_argument("shell", choices=["bash", "zsh", "fish"], help="the shell to complete for")


def _run(args: argparse.Namespace) -> int:
    sys.stdout.write(generated("completion", args.shell))
    return 0


VERB = Verb("completion", "print a shell completion script, generated from this parser (bash: "
            "source it, or install it as /usr/share/bash-completion/completions/aioublk)",
            _arguments, _run, place=14)
