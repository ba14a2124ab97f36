"""The built-in targets' registry: every option it declares reaches both the
command line and the config file, ``add --opt`` types and checks values as
a config file's are, and a target or a filter added as one module is known
everywhere (on the host, no kernel)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from aioublk import Geometry, Target, UblkError
from aioublk.frontend import cli, config, maketarget, registry, verb
from aioublk.targets import spec as decl


def _add_parser() -> argparse.ArgumentParser:
    for action in verb.parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["add"]  # type: ignore[no-any-return]
    raise AssertionError("no add subcommand")


def _flags() -> dict[str, argparse.Action]:
    return {flag: a for a in _add_parser()._actions for flag in a.option_strings}


@pytest.mark.parametrize("name", sorted(registry.TARGETS))
def test_every_option_reaches_the_command_line_and_the_config(name: str) -> None:
    spec = registry.TARGETS[name]
    assert config.TARGET_OPTIONS[name] == spec.keys()
    flags = _flags()
    for o in spec.options:
        for flag in o.flags:
            assert flags[flag].dest == o.key, flag
            assert name in (flags[flag].help or "").split(":")[0].split("/"), flag
    assert spec.files in ("", *spec.keys())
    assert issubclass(spec.target_class(), Target) and spec.target_class() is spec.cls
    assert spec.cls.__module__ == f"aioublk.targets.{name}"


def test_every_option_says_what_docs_need() -> None:
    for spec in registry.TARGETS.values():
        for o in spec.options:
            assert o.help and o.type in (decl.SIZE, decl.INT, decl.BOOL,
                                         decl.PATH, decl.PATHS, decl.CHOICE,
                                         decl.STR), o
            assert o.flag == (o.flags[0] if o.flags else f"--opt {o.key}")


def test_the_flags_kublk_users_know_keep_their_defaults() -> None:
    args = verb.parser().parse_args(["add", "-t", "stripe", "a", "b"])
    assert (args.chunk_size, args.buffered, args.l2_cache, args.allow_backing,
            args.backing_format, args.delay_us, args.die_during_fetch) == \
        (65536, False, None, [], None, 0, False)


class Custom(Target):
    """A target for --opt: one argument of each kind a TOML value gives."""

    def __init__(self, size: int, *, label: str = "", on: bool = False,
                 parts: list[int] | None = None, human: str = "") -> None:
        self.size, self.label, self.on, self.parts, self.human = size, label, on, parts, human
        self.geometry = Geometry(size=size)


def _make(*argv: str) -> Target:
    return maketarget.make_target(verb.parser().parse_args(["add", *argv]))


def test_custom_target_takes_typed_opt_values() -> None:
    t = _make("-t", f"{__name__}:Custom", "--opt", "size=1048576", "--opt", 'label="a b"',
              "--opt", "on=true", "--opt", "parts=[1, 2]", "--opt", "human=64M")
    assert isinstance(t, Custom)
    assert (t.size, t.label, t.on, t.parts, t.human) == (1 << 20, "a b", True, [1, 2], "64M")


def test_a_size_string_for_an_int_argument_is_a_size() -> None:
    t = _make("-t", f"{__name__}:Custom", "--opt", "size=64M")
    assert isinstance(t, Custom) and t.size == 64 << 20


class Picky(Target):
    def __init__(self, size: int) -> None:
        if size % 4096:
            raise ValueError(f"size {size} is not a multiple of 4096")
        self.geometry = Geometry(size=size)


def test_a_custom_constructor_refusing_its_options_is_one_line() -> None:
    with pytest.raises(UblkError) as e:
        _make("-t", f"{__name__}:Picky", "--opt", "size=1000")
    assert str(e.value) == (f"{__name__}:Picky(size=1000) failed: ValueError: size 1000 is "
                            "not a multiple of 4096: check its options")


def test_builtin_options_by_config_key(tmp_path: Path) -> None:
    t = _make("-t", "null", "--opt", "size=64M")
    assert t.geometry.size == 64 << 20
    t = _make("-t", "fault_inject", "--opt", "delay_us=5", "--opt", "die_during_fetch=true")
    assert t.delay == 5e-6 and t.die_during_fetch  # type: ignore[attr-defined]
    img = tmp_path / "a.img"
    img.write_bytes(bytes(1 << 20))
    t = _make("-t", "loop", "--opt", "buffered=true", str(img))
    t.close()
    t = _make("-t", "loop", "--opt", f'file="{img}"')
    t.close()


@pytest.mark.parametrize("argv,message", [
    (["-t", f"{__name__}:Custom", "--opt", "sise=1"],
     '--opt sise: unknown key (did you mean "size"?)'),
    (["-t", f"{__name__}:Custom"], f"--opt size: missing: {__name__}:Custom needs it"),
    (["-t", f"{__name__}:Custom", "--opt", "size=1", "FILE"],
     f"{__name__}:Custom takes no FILE: give its arguments as --opt KEY=VALUE"),
    (["-t", f"{__name__}:Nope"], f"module '{__name__}' has no 'Nope': check the class name"),
    (["-t", "loop", "--opt", "bufferd=true", "x"],
     '--opt bufferd: unknown key (did you mean "buffered"?)'),
    (["-t", "loop", "--opt", "buffered=yes", "x"],
     '--opt buffered: "yes" is a string: use true or false'),
    (["-t", "stripe", "--opt", "chunk_size=12288", "a", "b"],
     "--opt chunk_size: 12288 is not a power of two: use 4096, 8192, ... 524288"),
    (["-t", "null", "--opt", "size"], "--opt 'size' is not KEY=VALUE: write e.g. --opt size=64M"),
    (["-t", f"{__name__}:Custom", "--opt", "size=lots"],
     '--opt size: "lots" is not a size: use bytes, or a number with K, M, G or T (powers of '
     '1024; KB, KiB... too), e.g. "64M"'),
    (["-t", "loop", "--opt", "file=x", "y"],
     "the loop target's backing file is given twice: as FILE and as --opt file; drop one"),
    (["-t", "fault_inject", "--delay_us", "-1"], "--delay_us -1 is negative"),
    (["-t", "null", "x"], "the null target takes no backing file"),
])
def test_bad_opt_is_refused_in_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(UblkError) as e:
        _make(*argv)
    assert str(e.value) == message


def test_bad_opt_through_main_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["add", "-t", "null", "--opt", "sizes=1M"]) == 1
    err = capsys.readouterr().err
    assert err == 'aioublk: --opt sizes: unknown key (did you mean "size"?)\n'


#: a target and a filter as a contributor adds them: one module each, its
#: class beside its SPEC, dropped into the package and edited nowhere else
TINY_TARGET = '''"""A disk that stores nothing, as a new target's whole module."""

from aioublk.targets.null import NullTarget
from aioublk.targets.spec import SIZE, Option, TargetSpec


class TinyTarget(NullTarget):
    name = "tiny"


SPEC = TargetSpec("tiny", TinyTarget, (
    Option("bytes", SIZE, "bytes the tiny disk serves", default=1 << 20, default_help="1M",
           flags=("--tiny-bytes",), arg="size", lo=512, sectors=True),))
'''

CUT_FILTER = '''"""A filter hiding the device's last bytes, as a new filter's whole module."""

from dataclasses import replace
from typing import Any

from aioublk.target import Target
from aioublk.targets.filters.base import Filter
from aioublk.targets.spec import SIZE, FilterSpec, Option


class CutFilter(Filter):
    name = "cut"
    placement = True

    def __init__(self, inner: Target, tail: int = 4096) -> None:
        self.tail = tail
        super().__init__(inner)

    def shape(self, geometry: Any) -> Any:
        return replace(geometry, size=geometry.size - self.tail)


SPEC = FilterSpec("cut", CutFilter, "hide the device's last TAIL bytes", (
    Option("tail", SIZE, "bytes hidden", default=4096, lo=512),))
'''

#: run in a copy of the package holding the two new modules: what the command
#: line, the config loader, ``aioublk.targets`` and the docs make of them
PROBE = '''
import contextlib, io, os, sys
import aioublk, aioublk.targets
from aioublk.frontend import cli, config, maketarget, registry, verb

assert aioublk.__file__.startswith(sys.argv[1]), aioublk.__file__
assert list(registry.TARGETS)[-1] == "tiny" and list(registry.FILTERS)[-1] == "cut"
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert cli.main(["add", "-t", "tiny", "--help"]) == 0
assert "--tiny-bytes" in out.getvalue() and "bytes the tiny disk serves" in out.getvalue()
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    cli.main(["add", "--help"])
help = " ".join(out.getvalue().split())
assert "|fault_inject|tiny, or pkg.module:Class" in help, help
assert "; cut:[tail=SIZE] = hide the device's last TAIL bytes" in help, help
args = verb.parser().parse_args(["add", "-t", "tiny", "--tiny-bytes", "64K",
                                 "--filter", "cut:tail=8K"])
t = maketarget.make_target(args)
assert type(t).__name__ == "CutFilter" and type(t.inner).__name__ == "TinyTarget"
assert t.geometry.size == 56 << 10
path = os.path.join(sys.argv[2], "serve.toml")
with open(path, "w") as f:
    f.write('[[devices]]\\ntarget = "tiny"\\nfilters = ["cut:tail=1K"]\\n'
            '[devices.options]\\nbytes = "32K"\\n')
[dev] = config.load(path).devices
assert dev.build_target().geometry.size == 31 << 10
assert aioublk.targets.TinyTarget is registry.TARGETS["tiny"].cls
sys.path.insert(0, sys.argv[3])
import hooks  # the docs' generated references
assert 'target = "tiny"' in hooks.config_reference() and "--tiny-bytes" in hooks.cli_reference()
print("ok")
'''


def test_a_new_target_and_filter_are_one_file_each(tmp_path: Path) -> None:
    """Dropped into aioublk/targets and aioublk/targets/filters (here, of a
    copy of the package), a module is a target ``add -t``, its ``--help``, a
    config file, ``aioublk.targets`` and the docs know; another a filter
    ``--filter`` and a config's ``filters`` stack."""
    root = Path(cli.__file__).resolve().parents[2]
    copy = tmp_path / "copy"
    shutil.copytree(root / "aioublk", copy / "aioublk",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "aioublk" / "targets" / "tiny.py").write_text(TINY_TARGET)
    (copy / "aioublk" / "targets" / "filters" / "cut.py").write_text(CUT_FILTER)
    # -S: no editable install's finder to import the checkout's package instead
    path = os.pathsep.join([str(copy), sysconfig.get_paths()["purelib"],
                            sysconfig.get_paths()["platlib"]])
    p = subprocess.run([sys.executable, "-S", "-c", PROBE, str(copy), str(tmp_path),
                        str(root / "docs")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": path, "COLUMNS": "1000"}, cwd=tmp_path,
                       stdin=subprocess.DEVNULL)
    assert p.stdout == "ok\n", p.stderr


def test_finding_the_targets_loads_no_backend_library() -> None:
    """Discovering imports every target module, never librbd's or libnbd's
    bindings (nor the cipher): ``-t null`` loads none of them."""
    probe = ("import sys\nfrom aioublk.frontend import maketarget, verb\n"
             "maketarget.make_target(verb.parser().parse_args(['add', '-t', 'null']))\n"
             "print(sorted(m for m in sys.modules if m.split('.')[-1] in ('_rbd', '_nbd')\n"
             "             or m.startswith(('rbd', 'rados', 'nbd', 'cryptography'))))")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert p.stdout == "[]\n", p.stderr
