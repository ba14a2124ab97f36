"""How the command line and config files read values: sizes ("64M"),
durations, byte ranges, TOML scalars, and the checks each typed key passes
(an integer in bounds, an existing path, a choice with a did-you-mean...).

A check returns the value, normalized (sizes in bytes, paths absolute), or
raises ``Invalid`` with the key path and one line of what is wrong and what
to do. A built-in target's or filter's option is checked as its declaration
(``aioublk.targets.spec.Option``) says, by ``check_option``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import tomllib
from collections.abc import Iterable
from typing import Any

from aioublk.targets import spec as decl

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*(\d+)\s*(?:([KMGT])(?:I?B)?|B)?\s*", re.IGNORECASE)


#: how a size may be written, for error messages
SIZE_FORMS = "bytes, or a number with K, M, G or T (powers of 1024; KB, KiB... too), e.g. \"64M\""


class Invalid(Exception):
    """A problem at ``where`` (a key path): a config's ``load`` adds the file
    name, the command line makes it a one-line UblkError."""

    def __init__(self, where: str, msg: str) -> None:
        super().__init__(f"{where}: {msg}" if where else msg)


def parse_size(value: int | str) -> int:
    """Bytes from an integer or a string like "64M", "64MB" or "64MiB"
    (K/M/G/T are powers of 1024, any case; a bare "B" is bytes). The
    command line and config files both parse sizes here. Raises ValueError
    with the reason."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{show(value)} is {kind_of(value)}: use {SIZE_FORMS}")
    if isinstance(value, int):
        return value
    m = _SIZE.fullmatch(value)
    if m is None:
        raise ValueError(f"{show(value)} is not a size: use {SIZE_FORMS}")
    return int(m[1]) * _UNITS[(m[2] or "").upper()]


def toml_value(text: str) -> Any:
    """A value as TOML reads it (64, 0.1, true), any other the string it is."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def check_option(o: decl.Option, v: Any, at: str, base: str, kind: str) -> Any:
    """One built-in target's or filter's option value, checked as its
    declaration says."""
    if o.type == decl.SIZE:
        n = check_device_size(v, at) if o.sectors else check_size(v, at, o.lo or 0, o.hi)
        if o.power_of_two and n & (n - 1):
            raise Invalid(at, f"{n} is not a power of two: use {o.lo}, {2 * (o.lo or 1)}, ... "
                          f"{o.hi}")
        return n
    if o.type == decl.INT:
        return check_int(v, at, o.lo if o.lo is not None else -(1 << 63), o.hi)
    if o.type == decl.BOOL:
        return check_bool(v, at)
    if o.type == decl.PATH:
        return check_path(v, at, base)
    if o.type == decl.PATHS:
        return check_paths(v, at, base, kind, o)
    if o.type == decl.CHOICE:
        return check_choice(v, at, o.choices)
    if o.type == decl.DURATION:
        return check_duration(v, at)
    if o.type == decl.FLOAT:
        return check_float(v, at, o.lo, o.hi)
    if o.type == decl.RANGES:
        return check_ranges(v, at)
    return check_str(v, at)


def check_ranges(v: Any, at: str) -> list[tuple[int, int]]:
    """(start, end) byte ranges from "START-END+START-END" (sizes as anywhere)."""
    out = []
    for part in filter(None, (p.strip() for p in check_str(v, at).split("+"))):
        first, dash, last = part.partition("-")
        try:
            start, end = parse_size(first), parse_size(last)
        except ValueError:
            start = end = -1
        if not dash or start < 0 or end <= start:
            raise Invalid(at, f"{part!r} is not START-END with START < END: write e.g. 0-1M")
        out.append((start, end))
    if not out:
        raise Invalid(at, "no range: write e.g. 0-1M, or 0-1M+4G-5G")
    return out


_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(us|ms|s)?\s*")
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}


def check_duration(v: Any, at: str) -> float:
    """Seconds, from a number of seconds or "50ms", "2s", "100us" (nbdkit's)."""
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
        return float(v)
    m = _DURATION.fullmatch(v) if isinstance(v, str) else None
    if m is None:
        raise Invalid(at, f"{show(v)} is not a duration: use seconds, or e.g. \"50ms\", "
                      "\"100us\", \"2s\"")
    return float(m[1]) * _TIME_UNITS[m[2]]


def check_float(v: Any, at: str, lo: int | None, hi: int | None) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise Invalid(at, f"{show(v)} is {kind_of(v)}: use a number")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise Invalid(at, f"{v} is out of range: use {lo}..{hi}")
    return float(v)


def check_paths(v: Any, at: str, base: str, kind: str, o: decl.Option) -> list[str]:
    """A list of existing paths: stripe's files (``o.lo``..``o.hi`` of them,
    distinct), qcow2's allow_backing (directories or files)."""
    lo, hi = o.lo, o.hi
    if not isinstance(v, list):
        want = f"a list of {lo} to {hi} paths" if lo is not None else "a list of paths"
        raise Invalid(at, f"{show(v)} is {kind_of(v)}: use {want}")
    if lo is not None and hi is not None and not lo <= len(v) <= hi:
        raise Invalid(at, f"{len(v)} file{'s' * (len(v) != 1)} given: the {kind} target "
                      f"needs {lo} to {hi}")
    files = [check_path(p, f"{at}[{i}]", base) for i, p in enumerate(v)]
    for i, p in enumerate(files if o.distinct else ()):
        if p in files[:i]:
            raise Invalid(f"{at}[{i}]", f"{p} is also {o.key}[{files.index(p)}]: use distinct "
                          "files")
    return files


def check_table(v: Any, at: str) -> None:
    if not isinstance(v, dict):
        raise Invalid(at, f"{show(v)} is {kind_of(v)}: use a table")


def check_known(table: dict[str, Any], at: str, keys: Iterable[str]) -> None:
    keys = tuple(keys)
    for k in table:
        if k not in keys:
            name = k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)
            where = f"{at}.{name}" if at else name
            hint = did_you_mean(k, keys) or (f" (known keys: {', '.join(keys)})" if keys
                                             else " (this table takes none)")
            raise Invalid(where, f"unknown key{hint}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean \"{close[0]}\"?)" if close else ""


def check_int(v: Any, at: str, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise Invalid(at, f"{show(v)} is {kind_of(v)}: use an integer")
    if v < lo or (hi is not None and v > hi):
        want = f"{lo}..{hi}" if hi is not None else f"{lo} or more"
        raise Invalid(at, f"{v} is out of range: use {want}")
    return v


def check_bool(v: Any, at: str) -> bool:
    if not isinstance(v, bool):
        raise Invalid(at, f"{show(v)} is {kind_of(v)}: use true or false")
    return v


def check_str(v: Any, at: str) -> str:
    if not isinstance(v, str):
        raise Invalid(at, f"{show(v)} is {kind_of(v)}: use a string")
    return v


def check_choice(v: Any, at: str, choices: tuple[str, ...]) -> str:
    if isinstance(v, str) and v in choices:
        return v
    hint = did_you_mean(v, choices) if isinstance(v, str) else ""
    listed = ", ".join(json.dumps(c) for c in choices[:-1]) + f" or {json.dumps(choices[-1])}"
    raise Invalid(at, f"{show(v)} is not a valid choice{hint}: use {listed}")


def check_size(v: Any, at: str, lo: int, hi: int | None = None) -> int:
    try:
        n = parse_size(v)
    except ValueError as e:
        raise Invalid(at, str(e)) from None
    if n < lo or (hi is not None and n > hi):
        want = f"{lo}..{hi}" if hi is not None else f"{lo} or more"
        raise Invalid(at, f"{n} is out of range: use {want} (bytes)")
    return n


def check_device_size(v: Any, at: str) -> int:
    n = check_size(v, at, 512)
    if n % 512:
        raise Invalid(at, f"{n} is not a multiple of 512: use whole sectors, e.g. \"64M\"")
    return n


def check_path(v: Any, at: str, base: str) -> str:
    path = os.path.normpath(os.path.join(base, os.path.expanduser(check_str(v, at))))
    if not os.path.exists(path):
        raise Invalid(at, f"{path} does not exist: create it or fix the path")
    return os.path.realpath(path)


def kind_of(v: Any) -> str:
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
                    (str, "a string"), (list, "a list"), (dict, "a table")):
        if isinstance(v, t):
            return name
    return "a date/time"


def show(v: Any) -> str:
    """A value as it looks in TOML, cut short."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        s = json.dumps(v)
    elif isinstance(v, dict):
        s = "{...}"
    else:
        s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def one_line(s: str) -> str:
    return " ".join(s.split())
