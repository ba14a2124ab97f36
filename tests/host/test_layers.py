"""aioublk's modules import in one direction: every import (at the top, under
``TYPE_CHECKING`` or inside a function) goes to a module of an earlier
layer, or, inside a subpackage, to a sibling; and the import graph has no
cycle at all. The queue layer's order is the issue's: uapi -> ring -> target
-> options -> driver core -> per-I/O / batch drivers -> worker -> device."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import aioublk

PACKAGE = Path(aioublk.__file__).parent

#: the package root: the modules the design names (the ring, the device, the
#: batch driver, the target base class) and what everything shares; the rest
#: lives in a folder per layer
ROOT_MODULES = {"aioublk", "aioublk.__main__", "aioublk._lazy", "aioublk._uring",
                "aioublk._uring_build", "aioublk._version", "aioublk.batch", "aioublk.device",
                "aioublk.errors", "aioublk.logs", "aioublk.ring", "aioublk.target"}

#: the folders, lowest first: a module in one may import from an earlier
#: folder (or the root), never from a later one
FOLDERS = ["aioublk.testing", "aioublk.kernel", "aioublk.dataplane", "aioublk.io",
           "aioublk.queue", "aioublk.qcow2", "aioublk.targets", "aioublk.frontend"]

#: each module (or subpackage, with everything in it) in its layer; a module
#: may import only from earlier layers (and its own subpackage)
LAYERS: list[list[str]] = [
    ["aioublk._uring", "aioublk._uring_build"],
    ["aioublk.errors", "aioublk._version", "aioublk._lazy",
     "aioublk.dataplane", "aioublk.queue", "aioublk.frontend"],  # (docstrings only)
    ["aioublk.logs"],  # (its LogFileError is an aioublk.Error)
    ["aioublk.testing"],
    ["aioublk.kernel", "aioublk.kernel.uapi"],
    # below every queue module: its owner hands it the data plane (Ring.attach)
    ["aioublk.ring"],
    # how threads call into a worker's loop (and wake it in C): under the qcow2 engine
    ["aioublk.dataplane.crossloop"],
    ["aioublk.io"],
    ["aioublk.dataplane.extents"],
    # how C finds the worker's uvloop loop to own its wait: the data plane's
    ["aioublk.dataplane.cwait"],
    ["aioublk.dataplane.maps"],
    ["aioublk.dataplane.plane"],
    ["aioublk.kernel.control"],
    ["aioublk.target"],
    # the one host-file module: the ring's I/O on a target's buffers
    ["aioublk.io.hostfile"],
    ["aioublk.qcow2"],
    ["aioublk.targets"],
    ["aioublk.queue.options", "aioublk.queue.lifecycle"],
    ["aioublk.queue.driver"],
    ["aioublk.queue.perio", "aioublk.batch"],
    ["aioublk.queue.worker"],
    ["aioublk.device"],
    # how values read and are checked; then the built-in targets found, and built
    ["aioublk.frontend.values", "aioublk.frontend.notify"],
    ["aioublk.frontend.registry"],
    ["aioublk.frontend.stats", "aioublk.frontend.config", "aioublk.frontend.udev",
     "aioublk.frontend.metrics", "aioublk.frontend.img"],
    # what cli and serve share
    ["aioublk.frontend.kublk_lines", "aioublk.frontend.runner", "aioublk.frontend.livesnap"],
    # the verb table, and what the verbs on /dev/ublk-control share (the light
    # ones, list, del..., run from here)
    ["aioublk.frontend.verb"],
    ["aioublk.frontend.ctl"],
    # what add and recover share: their options, the target they ask for, the daemon
    ["aioublk.frontend.addargs"],
    ["aioublk.frontend.maketarget"],
    ["aioublk.frontend.daemon", "aioublk.frontend.serve"],
    # the verbs, a module each
    ["aioublk.frontend.verbs"],
    ["aioublk.frontend.cli"],
    ["aioublk.__main__", "aioublk"],
]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the entry that placed it: a module or a subpackage)."""
    for i, layer in enumerate(LAYERS):
        if module in layer:
            return i, module
    # (the innermost subpackage that holds it: frontend.verbs, not frontend)
    holders = [(len(entry), i, entry) for i, layer in enumerate(LAYERS) for entry in layer
               if module == entry or (entry != "aioublk" and module.startswith(entry + "."))]
    if holders:
        _length, i, entry = max(holders)
        return i, entry
    raise AssertionError(f"{module} has no place in LAYERS: add it")


def absolute(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    """The module a ``from ... import`` in ``module`` imports from."""
    base = node.module or ""
    if node.level:
        pkg = module.split(".") if is_pkg else module.split(".")[:-1]
        pkg = pkg[:len(pkg) - node.level + 1]
        base = ".".join(pkg + ([base] if base else []))
    return base


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Every aioublk module ``module`` imports, wherever the import is."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "aioublk"}
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, module, is_pkg)
            if base.split(".")[0] != "aioublk":
                continue
            for a in node.names:  # ``from pkg import mod`` imports pkg.mod
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return out - {module}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods) | {"aioublk._uring"}
    return {m: imports(m, p, known) for m, p in mods.items()}


@pytest.mark.parametrize("module", sorted(modules()))
def test_every_module_imports(module: str) -> None:
    if module == "aioublk.__main__":
        return  # runs the CLI
    importlib.import_module(module)


def test_every_import_goes_to_an_earlier_layer() -> None:
    bad = []
    for mod, deps in graph().items():
        mine, entry = layer_of(mod)
        for dep in deps:
            theirs, dep_entry = layer_of(dep)
            # a subpackage is one layer: its modules may import each other
            same_package = entry == dep_entry and entry != "aioublk" and (
                PACKAGE.parent / entry.replace(".", "/")).is_dir()
            if theirs > mine or (theirs == mine and not same_package):
                bad.append(f"{mod} imports {dep}")
    assert not bad, bad


def test_no_import_cycles() -> None:
    g = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError(" -> ".join([*path[path.index(d):], d]))
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])


def folder_of(module: str) -> str | None:
    return next((f for f in FOLDERS if module.startswith(f + ".") or module == f), None)


def test_the_root_holds_at_most_a_dozen_modules() -> None:
    root = {m for m in [*modules(), "aioublk._uring"] if m.count(".") <= 1
            and folder_of(m) is None}
    assert root == ROOT_MODULES and len(root) <= 12


def test_every_other_module_lives_in_a_layer_folder() -> None:
    homeless = [m for m in modules() if m not in ROOT_MODULES and folder_of(m) is None]
    assert not homeless, f"{homeless}: put each in one of {FOLDERS}"


def test_folders_import_only_earlier_folders() -> None:
    bad = []
    for mod, deps in graph().items():
        mine = folder_of(mod)
        for dep in deps:
            theirs = folder_of(dep)
            if mine and theirs and FOLDERS.index(theirs) > FOLDERS.index(mine):
                bad.append(f"{mod} imports {dep}")
    assert not bad, bad


def test_the_queue_layer_order() -> None:
    order = ["aioublk.kernel.uapi", "aioublk.ring", "aioublk.target", "aioublk.queue.options",
             "aioublk.queue.driver", "aioublk.queue.perio", "aioublk.queue.worker",
             "aioublk.device"]
    assert [layer_of(m)[0] for m in order] == sorted({layer_of(m)[0] for m in order})
    assert layer_of("aioublk.batch")[0] == layer_of("aioublk.queue.perio")[0]


def test_the_ring_imports_nothing_of_the_queue() -> None:
    """The data plane is handed to the ring by its owner, not imported by it."""
    assert not {d for d in graph()["aioublk.ring"] if d.startswith("aioublk.queue")}
    queue = [layer_of(m)[0] for m in modules() if m.startswith("aioublk.queue.")]
    assert layer_of("aioublk.ring")[0] < min(queue)


#: ``serve`` is a verb of the CLI: its verb may call its ``main`` and nothing
#: else of it; what serve and add's daemon both use (the run-until-signal
#: loop, kublk's device lines) lives in modules below both, so that neither
#: grows into the other
FRONT_ENDS = {("aioublk.frontend.verbs.serve", "aioublk.frontend.serve"): {"main"},
              ("aioublk.frontend.daemon", "aioublk.frontend.serve"): set(),
              ("aioublk.frontend.serve", "aioublk.frontend.daemon"): set()}


def names_imported(module: str, source: str) -> set[str]:
    """The names ``module`` imports from the module ``source`` (wherever the
    import is); ``*`` for the module itself."""
    path = modules()[module]
    pkg, _, leaf = source.rpartition(".")
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {"*" for a in node.names if a.name == source}
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, module, path.name == "__init__.py")
            if base == source:
                out |= {a.name for a in node.names}
            elif base == pkg:
                out |= {"*" for a in node.names if a.name == leaf}
    return out


@pytest.mark.parametrize(("importer", "source"), sorted(FRONT_ENDS))
def test_the_front_ends_share_through_modules_of_their_own(importer: str, source: str) -> None:
    extra = names_imported(importer, source) - FRONT_ENDS[importer, source]
    assert not extra, (f"{importer} imports {sorted(extra)} from {source}: move what both "
                       "use to a module below both")
