"""The completion scripts and the man page, loaded into the real shells and
groff: what they offer is what the parser takes."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from aioublk.frontend import registry
from aioublk.frontend.verb import parser


def _aioublk(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "aioublk", *args], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


# (words typed, the last one being completed; what must be offered; what must not)
CASES = [
    (["a"], {"add"}, {"del"}),
    (["add", "--que"], {"--queues"}, set()),
    (["add", "-t", ""], set(registry.TARGETS), {"add"}),
    (["add", "-t", "loop", "--filter", "c"], {"cache", "cow"}, set()),
    (["img", ""], {"check", "create", "info", "map", "snapshot"}, {"add"}),
    (["img", "check", "-f", ""], {"qcow2"}, set()),
    (["snapshot", ""], {"create", "list", "delete"}, {"add"}),
    (["completion", ""], {"bash", "zsh", "fish"}, set()),
    (["udev", "o"], {"owner"}, set()),
]


def test_bash_completes_commands_flags_and_values(tmp_path: Path) -> None:
    script = tmp_path / "aioublk.bash"
    script.write_text(_aioublk("completion", "bash"))
    lines = [f"source {script}",
             'comp() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _aioublk; '
             'echo "${COMPREPLY[*]}"; }']
    lines += ["comp aioublk " + " ".join(shlex.quote(w) for w in words)
              for words, _, _ in CASES]
    out = subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    assert len(out) == len(CASES)
    for (words, offered, not_offered), line in zip(CASES, out, strict=True):
        got = set(line.split())
        assert offered <= got, (words, line)
        assert not (not_offered & got), (words, line)


def test_fish_completes_commands_flags_and_values(tmp_path: Path) -> None:
    script = tmp_path / "aioublk.fish"
    script.write_text(_aioublk("completion", "fish"))
    for words, offered, not_offered in CASES:
        line = "aioublk " + " ".join(words)
        p = subprocess.run(["fish", "--no-config", "-c",
                            f"source {script}; complete -C {shlex.quote(line)}"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and not p.stderr, p.stderr
        got = {row.split("\t")[0] for row in p.stdout.splitlines()}
        assert offered <= got, (words, p.stdout)
        assert not (not_offered & got), (words, p.stdout)


@pytest.mark.parametrize(("typed", "completed"), [
    ("aioublk add --que", "aioublk add --queues"),
    ("aioublk img ch", "aioublk img check"),
    ("aioublk add -t qc", "aioublk add -t qcow2"),
    ("aioublk completion fi", "aioublk completion fish"),
])
def test_zsh_completes_in_an_interactive_shell(tmp_path: Path, typed: str,
                                               completed: str) -> None:
    """A real interactive zsh (on a pty, through zsh/zpty) with compinit and
    the function on $fpath: TAB turns ``typed`` into ``completed``."""
    (tmp_path / "_aioublk").write_text(_aioublk("completion", "zsh"))
    driver = f"""
zmodload zsh/zpty
zpty z zsh -f -i
zpty -w z "PS1='>' ; fpath=({tmp_path} \\$fpath); autoload -U compinit; compinit -u -D; print READY"
zpty -r z out '*READY*'
zpty -w -n z {shlex.quote(typed)}$'\\t'
zpty -r z out {shlex.quote('*' + completed + '*')}
print FOUND
zpty -d z
"""
    p = subprocess.run(["zsh", "-f", "-c", driver], capture_output=True, text=True,
                       timeout=30)
    assert "FOUND" in p.stdout, p.stdout[-500:] + p.stderr


def test_the_man_page_renders_cleanly_and_lists_every_command_and_flag() -> None:
    page = _aioublk("man")
    p = subprocess.run(["groff", "-man", "-Tascii", "-ww"], input=page, capture_output=True,
                       text=True, timeout=60, check=True)
    assert not p.stderr, p.stderr  # no warnings
    text = " ".join(re.sub(".\b", "", p.stdout).split())  # (no overstrikes)
    add = next(c for c in parser()._subparsers._group_actions[0].choices.values()
               if c.prog.endswith(" add"))
    for action in add._actions:
        for flag in action.option_strings:
            assert flag in text or flag in ("-h", "--help"), flag
    for command in ("aioublk add", "aioublk del", "aioublk img check", "aioublk serve",
                    "aioublk udev owner", "aioublk completion"):
        assert command in text, command

