"""mkdocs hooks: the references generated from the code, and the benchmark results.

The CLI and config references are written at build time from the objects the
program itself uses (``aioublk.cli._parser()``, ``aioublk.config``), so they
cannot drift from it: a page holds a marker (``<!-- cli-reference -->``,
``<!-- config-reference -->``) that ``on_page_markdown`` replaces. The config
part is one function, ``config_sections``; point it at another source of keys
and the page follows.

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
from aioublk import cli, config, uapi

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
    parser = cli._parser()
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
    """(table, what it is, its keys) for each table of a serve config: the one place
    the config reference learns which keys exist."""
    sections = [
        ("[logging]", "optional; how the server logs",
         [f.name for f in dataclasses.fields(config.LogSettings)]),
        ("[[devices]]", "one per device", list(config.DEVICE_KEYS)),
    ]
    sections += [(f"[devices.options] for target = \"{kind}\"", f"the {kind} target's options",
                  list(keys)) for kind, keys in config.TARGET_OPTIONS.items()]
    return sections


def config_reference() -> str:
    """A table per config section; each key's meaning is its comment in
    examples/serve.toml, the file that shows every key."""
    comments = _serve_example_comments()
    out = []
    for table, what, keys in config_sections():
        rows = [f"## `{table}`", "", f"{what[0].upper()}{what[1:]}.", "",
                "| key | meaning |", "| --- | --- |"]
        for key in keys:
            rows.append(f"| `{key}` | {_text(_meaning(comments, table, key))} |")
        out.append("\n".join(rows))
    return "\n\n".join(out)


def _meaning(comments: dict[tuple[str, str], list[str]], table: str, key: str) -> str:
    """A key's comment; for a target option, the one that names the target
    ("loop: ...", "null and fault_inject: ...") when several targets share the key."""
    name = table.split()[0].strip("[]")
    found = comments.get((name, key), [])
    kind = re.search(r'target = "(.*)"', table)
    if kind:
        named = [c for c in found if kind.group(1) in c.split(":")[0]]
        found = named or found
    return found[0] if found else ""


def _serve_example_comments() -> dict[tuple[str, str], list[str]]:
    """(TOML table, key) -> the comments the key has, each with its continuation lines."""
    found: dict[tuple[str, str], list[list[str]]] = {}
    section: str = ""
    current: list[str] | None = None
    for line in SERVE_EXAMPLE.read_text().splitlines():
        head = re.match(r"\s*\[\[?([\w.]+)\]\]?\s*(?:#\s?(.*))?$", line)
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
