"""Every public name, and every public method and property of the public
classes, says what it is for: the API reference is made from these."""

from __future__ import annotations

import inspect

import aioublk


def _undocumented() -> list[str]:
    missing = []
    for name in aioublk.__all__:
        obj = getattr(aioublk, name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not obj.__doc__:
            missing.append(name)
        if not inspect.isclass(obj):
            continue
        ours = {k for c in obj.__mro__ if c.__module__.startswith("aioublk") for k in vars(c)}
        for member in sorted(ours):
            if member.startswith("_"):
                continue
            raw = inspect.getattr_static(obj, member)
            if isinstance(raw, property):
                doc = raw.__doc__
            elif callable(raw) or isinstance(raw, (classmethod, staticmethod)):
                doc = inspect.getdoc(getattr(obj, member))  # (a base's, if it overrides)
            else:
                continue
            if not (doc or "").strip():
                missing.append(f"{name}.{member}")
    return missing


def test_every_public_name_and_method_has_a_docstring() -> None:
    assert _undocumented() == []


def test_the_check_sees_a_missing_one() -> None:
    def bare(self: object) -> None:
        pass
    aioublk.Ring.bare_for_test = bare  # type: ignore[attr-defined]
    try:
        assert _undocumented() == ["Ring.bare_for_test"]
    finally:
        del aioublk.Ring.bare_for_test  # type: ignore[attr-defined]
