"""``aioublk/_uring.pyi`` against the cdef it describes and the compiled
module: the same names, and each function's arity and types (C integers as
``int``, pointers as ``Any``, ``void`` as ``None``), so mypy's view of the C
boundary cannot drift from the C declarations."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from aioublk import _uring_build
from aioublk._uring import lib

STUB = Path(_uring_build.__file__).with_name("_uring.pyi")


def _py_type(c_type: str, *, ret: bool = False) -> str:
    if "*" in c_type:
        return "Any"
    if ret and c_type == "void":
        return "None"
    return "int"


def cdef_names() -> tuple[set[str], dict[str, tuple[str, list[tuple[str, str]]]]]:
    """(constants, {function: (return type, [(parameter, type)])}) of the
    builder's cdef, in the stub's Python types."""
    text = _uring_build.CDEF + _uring_build._parts()[0]
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    constants = set(re.findall(r"^#define\s+(\w+)", text, flags=re.M))
    functions = {}
    for decl in re.sub(r"^#.*$", "", text, flags=re.M).split(";"):
        m = re.fullmatch(r"(.*?[\s*])(\w+)\s*\((.*)\)", " ".join(decl.split()))
        if m is None:
            continue  # a struct
        params = []
        for p in m.group(3).split(","):
            pm = re.fullmatch(r"(.*?[\s*])(\w+)", p.strip())
            assert pm is not None, p
            params.append((pm.group(2), _py_type(pm.group(1).strip())))
        functions[m.group(2)] = (_py_type(m.group(1).strip(), ret=True), params)
    return constants, functions


def stub_names() -> tuple[set[str], dict[str, tuple[str, list[tuple[str, str]]]]]:
    tree = ast.parse(STUB.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Lib")
    constants = {n.target.id for n in cls.body
                 if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    functions = {}
    for n in cls.body:
        if isinstance(n, ast.FunctionDef):
            args = n.args
            assert not args.args and not args.kwonlyargs, f"{n.name}: positional-only"
            params = [(a.arg, ast.unparse(a.annotation) if a.annotation else "")
                      for a in args.posonlyargs[1:]]  # (self)
            functions[n.name] = (ast.unparse(n.returns) if n.returns else "", params)
    return constants, functions


def test_stub_matches_cdef() -> None:
    consts, funcs = cdef_names()
    s_consts, s_funcs = stub_names()
    assert s_consts == consts
    assert set(s_funcs) == set(funcs)
    for name, sig in funcs.items():
        assert s_funcs[name] == sig, name


def test_stub_matches_compiled_module() -> None:
    consts, funcs = stub_names()
    assert set(dir(lib)) == consts | set(funcs)
    for name in consts:
        assert isinstance(getattr(lib, name), int), name
    for name in funcs:
        assert callable(getattr(lib, name)), name
