"""aioublk's modules import in one direction: the package is a stack of floors,
each a folder or a module of the package root, and every import (at the top,
under ``TYPE_CHECKING`` or inside a function) goes down to a lower floor or
stays inside its own folder; a few folders keep an order inside them too, and
the import graph has no cycle at all."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import aioublk

PACKAGE = Path(aioublk.__file__).parent

#: the floors, lowest first: a folder (every module in it) or a module of the
#: package root. A module imports from lower floors only, and from its own
#: folder (in the order INSIDE gives, where it gives one)
FLOORS = [
    # what everything shares
    "aioublk._uring_build", "aioublk._uring", "aioublk.errors", "aioublk._version",
    "aioublk._lazy", "aioublk.logs",
    # the pytest plugin and the guest's runner: nothing of the rest
    "aioublk.testing",
    # io_uring on the loop; its owner hands it the data plane (Ring.attach)
    "aioublk.ring",
    # what ublk_drv speaks
    "aioublk.kernel",
    # what C needs to serve a request without Python
    "aioublk.dataplane",
    # what a target is
    "aioublk.target",
    # host files: the ring's I/O on a target's buffers
    "aioublk.io",
    "aioublk.qcow2",
    "aioublk.targets",
    # serving a queue, then the batch driver (perio.py's peer, at the root), then
    # the device that picks one for its workers
    "aioublk.queue",
    "aioublk.batch",
    "aioublk.device",
    "aioublk.frontend",
    "aioublk.__main__",
    "aioublk",
]

#: the floors that are folders
FOLDERS = [f for f in FLOORS if (PACKAGE.parent / f.replace(".", "/")).is_dir() and f != "aioublk"]

#: the folders whose modules keep an order among themselves, lowest first:
#: each may import only the modules before it (every module of the folder listed)
INSIDE = {
    # the queue's order: options -> driver core -> per-I/O driver -> worker
    "aioublk.queue": ["options", "lifecycle", "driver", "perio", "worker"],
    # the plane is built on the maps, the maps on the extent table
    "aioublk.dataplane": ["crossloop", "extents", "cwait", "maps", "plane"],
    "aioublk.kernel": ["uapi", "control"],
    # one host-file module on the others
    "aioublk.io": ["directio", "locking", "hostfile"],
}

#: rooms on different floors that import each other in neither direction: the
#: queue serves any target through target.py alone, and what ublk_drv speaks
#: and the data plane know nothing of each other
APART = [("aioublk.queue", "aioublk.targets"), ("aioublk.queue", "aioublk.qcow2"),
         ("aioublk.kernel", "aioublk.dataplane")]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


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


def folder_of(module: str) -> str | None:
    return next((f for f in FOLDERS if module.startswith(f + ".") or module == f), None)


def floor_of(module: str) -> int:
    """The floor of ``module``: its own (a root module) or its folder's."""
    room = folder_of(module) or module
    assert room in FLOORS, f"{module} has no place in FLOORS: add it"
    return FLOORS.index(room)


@pytest.mark.parametrize("module", sorted(modules()))
def test_every_module_imports(module: str) -> None:
    if module == "aioublk.__main__":
        return  # runs the CLI
    importlib.import_module(module)


def test_every_module_has_a_floor() -> None:
    for module in [*modules(), "aioublk._uring"]:
        floor_of(module)


def test_every_import_goes_down_or_stays_in_its_folder() -> None:
    bad = []
    for mod, deps in graph().items():
        for dep in deps:
            mine, theirs = floor_of(mod), floor_of(dep)
            if theirs > mine or (theirs == mine and folder_of(mod) is None):
                bad.append(f"{mod} imports {dep}")
    assert not bad, bad


@pytest.mark.parametrize("folder", sorted(INSIDE))
def test_the_order_inside_a_folder(folder: str) -> None:
    order = [f"{folder}.{name}" for name in INSIDE[folder]]
    assert set(order) == {m for m in modules() if folder_of(m) == folder and m != folder}
    g = graph()
    bad = [f"{mod} imports {dep}" for i, mod in enumerate(order) for dep in g[mod]
           if dep in order and order.index(dep) > i]
    assert not bad, bad


@pytest.mark.parametrize(("one", "other"), APART)
def test_rooms_kept_apart(one: str, other: str) -> None:
    g = graph()
    bad = [f"{mod} imports {dep}" for mod, deps in g.items() for dep in deps
           if {folder_of(mod) or mod, folder_of(dep) or dep} == {one, other}]
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


#: the package root: the modules the design names (the ring, the device, the
#: batch driver, the target base class) and what everything shares; the rest
#: lives in a folder per layer
ROOT_MODULES = {"aioublk", "aioublk.__main__", "aioublk._lazy", "aioublk._uring",
                "aioublk._uring_build", "aioublk._version", "aioublk.batch", "aioublk.device",
                "aioublk.errors", "aioublk.logs", "aioublk.ring", "aioublk.target"}


def test_the_root_holds_at_most_a_dozen_modules() -> None:
    root = {m for m in [*modules(), "aioublk._uring"] if m.count(".") <= 1
            and folder_of(m) is None}
    assert root == ROOT_MODULES and len(root) <= 12
    assert root == set(FLOORS) - set(FOLDERS)


def test_every_other_module_lives_in_a_layer_folder() -> None:
    homeless = [m for m in modules() if m not in ROOT_MODULES and folder_of(m) is None]
    assert not homeless, f"{homeless}: put each in one of {FOLDERS}"


def test_the_batch_driver_sits_right_above_the_queue_and_below_the_device() -> None:
    """batch.py is perio.py's peer: on the queue's folder, under the device."""
    assert FLOORS.index("aioublk.batch") == FLOORS.index("aioublk.queue") + 1
    assert FLOORS.index("aioublk.device") == FLOORS.index("aioublk.batch") + 1


def test_the_ring_imports_nothing_of_the_queue() -> None:
    """The data plane is handed to the ring by its owner, not imported by it."""
    assert not {d for d in graph()["aioublk.ring"] if d.startswith("aioublk.queue")}
    assert floor_of("aioublk.ring") < floor_of("aioublk.queue")


#: ``serve`` is a subcommand of the CLI: cli may call its ``main`` and nothing
#: else of it; what both use (the run-until-signal loop, kublk's device lines)
#: lives in modules below both, so that neither grows into the other
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
