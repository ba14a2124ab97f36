"""mkdocs hooks: the references generated from the code, and the benchmark results.

The CLI and config references are written at build time from the objects the
program itself uses (``aioublk.frontend.verb.parser()``, ``aioublk.frontend.config``), so they
cannot drift from it: a page holds a marker (``<!-- cli-reference -->``,
``<!-- config-reference -->``) that ``on_page_markdown`` replaces. The
targets' options come from ``aioublk.frontend.registry.TARGETS``, each
target's ``SPEC`` (type, default, bounds, flags, help); the other tables'
keys from ``config_sections`` and their meanings from the comments of
``examples/serve.toml``, the one place those are written down.

``bench/results`` stays where the benchmarks write it; ``on_files`` adds its
pages and charts to the site under ``benchmarks/`` instead of copying them
into ``docs/``."""

from __future__ import annotations

import argparse
import dataclasses
import html
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

import aioublk
from aioublk.frontend import config, registry, verb
from aioublk.kernel import uapi
from aioublk.queue import options
from aioublk.targets import spec as decl

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SERVE_EXAMPLE = ROOT / "examples" / "serve.toml"


def on_files(files: Files, config: Any) -> Files:
    """Serve bench/results/*.md and *.png as benchmarks/NAME."""
    for path in sorted(RESULTS.glob("*.md")) + sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    for marker, generate in GENERATED.items():
        if f"<!-- {marker} -->" in markdown:
            markdown = markdown.replace(f"<!-- {marker} -->", generate())
    src = page.file.src_uri
    if src.startswith("benchmarks/") and (RESULTS / Path(src).with_suffix(".png").name).exists():
        chart = Path(src).with_suffix(".png").name
        markdown += f"\n\n![{Path(src).stem} chart]({chart})\n"
    return markdown


# -- the CLI reference --------------------------------------------------------------------


def cli_reference() -> str:
    """Every subcommand of the parser, each option with its help, default and metavar."""
    parser = verb.parser()
    out = [_options_table(parser)]
    for name, sub, help_ in _subcommands(parser):
        out.append(f"## `{name}`\n\n{_text(help_ or sub.description or '')}\n\n"
                   f"```\n{sub.format_usage().strip()}\n```\n\n{_options_table(sub)}")
    return "\n\n".join(out)


def _subcommands(parser: argparse.ArgumentParser, prefix: str = ""
                 ) -> list[tuple[str, argparse.ArgumentParser, str | None]]:
    """Each subcommand, then its own ("udev rules"), depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((f"{prefix}{name}", sub, helps.get(name)))
                found += _subcommands(sub, f"{prefix}{name} ")
    return found


def _options_table(parser: argparse.ArgumentParser) -> str:
    rows = ["| option | value | default | meaning |", "| --- | --- | --- | --- |"]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
        help_ = formatter._expand_help(action) if action.help else ""
        if action.required and action.option_strings:
            help_ += " (required)"
        rows.append(f"| {names} | {_value(action)} | {_default(action)} | {_text(help_)} |")
    return "\n".join(rows)


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None and not isinstance(action.choices, dict):
        return " \\| ".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    shown = " ".join(metavar) if isinstance(metavar, tuple) else metavar
    suffix = {"*": " ...", "+": " ...", "?": " (optional)"}.get(str(action.nargs), "")
    return f"`{shown}`{suffix}"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, [], ""):
        return ""
    return f"`{action.default}`"


# -- the config reference -----------------------------------------------------------------


def config_sections() -> list[tuple[str, str, list[str]]]:
    """(table, what it is, its keys) for each table of a serve config whose keys'
    meanings are the comments of examples/serve.toml; the device options among
    ``[[devices]]``' keys are ``_device_rows``', from ``DEVICE_OPTIONS``, and the
    targets' options ``_target_section``'s, from the registry."""
    return [
        ("[logging]", "optional; how the server logs",
         [f.name for f in dataclasses.fields(config.LogSettings)]),
        ("[metrics]", "optional; a Prometheus endpoint (needs `pip install "
         "'aioublk[metrics]'`; see [Operating](operating.md#prometheus-metrics))",
         [f.name for f in dataclasses.fields(config.MetricsSettings)]),
        ("[[devices]]", "one per device", list(config.SPEC_KEYS)),
    ]


def config_reference() -> str:
    """A table per config section: the general tables' keys with their comment in
    examples/serve.toml, then each built-in target's options as the registry
    declares them."""
    comments = _serve_example_comments()
    out = []
    for table, what, keys in config_sections():
        rows = [f"## `{table}`", "", f"{what[0].upper()}{what[1:]}.", "",
                "| key | meaning |", "| --- | --- |"]
        for key in keys:
            meaning = _meaning(comments, table, key)
            if not meaning:
                raise ValueError(f"config key {table} {key} has no meaning: add a comment "
                                 f"to it in {SERVE_EXAMPLE.relative_to(ROOT)}")
            rows.append(f"| `{key}` | {_text(meaning)} |")
        if table == "[[devices]]":
            rows += _device_rows()
        out.append("\n".join(rows))
    out += [_target_section(spec) for spec in registry.TARGETS.values()]
    return "\n\n".join(out)


def _device_rows() -> list[str]:
    """The device options' rows of ``[[devices]]``: each key's type, default,
    bounds, command-line spelling and help, from ``DEVICE_OPTIONS``."""
    rows = ["", "Device options: the same as `add`'s flags (those a config file does not "
            "spell alike are given in the command line column).", "",
            "| key | type | default | bounds | command line | kernel feature | meaning |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for o in options.DEVICE_OPTIONS:
        if not o.key:
            continue
        flags = [f for d in options.DEVICE_OPTIONS if d.name == o.name or d.name in o.spelled_by
                 for f in d.flags + d.off_flags]
        bounds = " \\| ".join(f"`{c}`" for c in o.choices) if o.choices else \
            f"{o.lo}..{o.hi}" if o.hi is not None else f"≥ {o.lo}" if o.lo is not None else ""
        feature = uapi.flag_list(o.feature) if o.feature else ""
        rows.append(f"| `{o.key}` | {_text(o.type)} | {_device_default(o)} | {bounds} | "
                    f"{', '.join(f'`{f}`' for f in flags)} | {feature} | {_text(o.help)} |")
    return rows


def _device_default(o: options.DeviceOption) -> str:
    if o.type == options.TRISTATE:
        return '`"auto"`'
    if o.default is None:
        return ""
    if isinstance(o.default, bool):
        return f"`{str(o.default).lower()}`"
    return f'`"{o.default}"`' if isinstance(o.default, str) else f"`{o.default}`"


def _target_section(spec: decl.TargetSpec) -> str:
    """The target's options: type, default, bounds, command-line spelling, help."""
    rows = [f"## `[devices.options]` for `target = \"{spec.name}\"`", "",
            f"The {spec.name} target's options. On the command line "
            f"(`add -t {spec.name}`) each is its flag or `--opt KEY=VALUE`.", "",
            "| key | type | default | bounds | command line | meaning |",
            "| --- | --- | --- | --- | --- | --- |"]
    for o in spec.options:
        spellings = [f"`FILE{' ...' if o.type == decl.PATHS else ''}`"] \
            if o.key == spec.files else []
        spellings += [f"`{f}{' 0|1' if o.zero_one else ''}`" for f in o.flags] \
            or [f"`--opt {o.key}`"]
        rows.append(f"| `{o.key}` | {o.type} | {_option_default(o)} | {_bounds(o)} | "
                    f"{', '.join(spellings)} | {_text(o.help)} |")
    return "\n".join(rows)


def _option_default(o: decl.Option) -> str:
    if o.required:
        return "required"
    if o.default_help:
        return _text(o.default_help) if " " in o.default_help else f"`{o.default_help}`"
    if o.default is None:
        return ""
    if isinstance(o.default, bool):
        return f"`{str(o.default).lower()}`"
    return f"`{list(o.default)}`" if isinstance(o.default, tuple) else f"`{o.default}`"


def _bounds(o: decl.Option) -> str:
    """Bounds and choices as the config checks them (``values.check_option``)."""
    if o.choices:
        return " \\| ".join(f"`{c}`" for c in o.choices)
    show = _size_text if o.type == decl.SIZE else str
    if o.type == decl.PATHS:
        parts = [f"{o.lo} to {o.hi} paths" if o.lo is not None else ""]
    elif o.lo is not None and o.hi is not None:
        parts = [f"{show(o.lo)}..{show(o.hi)}"]
    else:
        parts = [f"≥ {show(o.lo)}" if o.lo is not None else ""]
    parts += ["a power of two"] * o.power_of_two + ["whole 512-byte sectors"] * o.sectors
    parts += ["no path twice"] * o.distinct + ["must exist"] * (o.type in (decl.PATH,
                                                                          decl.PATHS))
    return _text(", ".join(p for p in parts if p))


def _size_text(n: int) -> str:
    """``n`` bytes in the largest unit that divides it (65536: 64K)."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _meaning(comments: dict[tuple[str, str], list[str]], table: str, key: str) -> str:
    found = comments.get((table.strip("[]"), key), [])
    return found[0] if found else ""


def _serve_example_comments() -> dict[tuple[str, str], list[str]]:
    """(TOML table, key) -> the comments the key has, each with its continuation lines."""
    found: dict[tuple[str, str], list[list[str]]] = {}
    section: str = ""
    current: list[str] | None = None
    for line in SERVE_EXAMPLE.read_text().splitlines():
        # "[table]", "[[table]]", or commented out, "# [metrics]": an optional table
        head = re.match(r"\s*(?:#\s*)?\[\[?([\w.]+)\]\]?\s*(?:#\s?(.*))?$", line)
        key = re.match(r"\s*(?:#\s*)?(\w+)\s*=.*?#\s?(.*)$", line)  # "# key = ..." too
        more = re.match(r"\s+#\s?(.*)$", line)
        if head:
            section, current = head.group(1), None
            parent, _, name = section.rpartition(".")
            if parent and head.group(2):  # "[devices.options]  # ...": the key "options"
                found.setdefault((parent, name), []).append([head.group(2).strip()])
        elif key:
            current = [key.group(2).strip()]
            found.setdefault((section, key.group(1)), []).append(current)
        elif more and current is not None:
            current.append(more.group(1).strip())
        else:
            current = None
    return {k: [" ".join(parts) for parts in v] for k, v in found.items()}


def _text(s: str) -> str:
    """Plain text for a Markdown table cell."""
    return html.escape(" ".join(s.split()), quote=False).replace("|", "\\|")


# -- the API reference and the kernel's flags ---------------------------------------------


def api_reference() -> str:
    """A mkdocstrings block for each public name."""
    return "\n\n".join(f"::: aioublk.{name}" for name in aioublk.__all__
                        if name != "__version__")


def feature_flags() -> str:
    rows = ["| flag | bit |", "| --- | --- |"]
    rows += [f"| `UBLK_F_{f.name}` | `1 << {f.value.bit_length() - 1}` |" for f in uapi.Feature]
    return "\n".join(rows)


GENERATED = {
    "cli-reference": cli_reference,
    "config-reference": config_reference,
    "api-reference": api_reference,
    "feature-flags": feature_flags,
}
