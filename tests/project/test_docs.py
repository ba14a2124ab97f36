"""The documentation site builds without a warning, and its generated references
name every command-line option and every config key the code has."""

from __future__ import annotations

import argparse
import dataclasses
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import aioublk
from aioublk.frontend import config, registry, verb
from aioublk.kernel import uapi
from aioublk.queue import options

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-d", str(out)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed (scripts/setup installs " \
                                 f"the docs extra):\n{proc.stderr}"
    return out


def _page(site: Path, name: str) -> str:
    return html.unescape((site / name / "index.html").read_text())


def _subcommands(parser: argparse.ArgumentParser, prefix: str = ""
                 ) -> dict[str, argparse.ArgumentParser]:
    """Every subcommand, nested ones by their full name ("udev rules")."""
    found: dict[str, argparse.ArgumentParser] = {}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                found[prefix + name] = sub
                found |= _subcommands(sub, f"{prefix}{name} ")
    return found


def test_cli_reference_has_every_option_of_every_subcommand(site: Path) -> None:
    page = _page(site, "cli")
    text = " ".join(re.sub(r"<[^>]+>", "", page).split())  # help text, Markdown rendered
    parser = verb.parser()
    subs = _subcommands(parser)
    assert {"add", "recover", "del", "list", "serve", "udev rules", "udev owner"} <= set(subs)
    assert {"--opt", "--unprivileged", "--log-file"} <= {
        o for a in subs["recover"]._actions for o in a.option_strings}
    missing = []
    for name, sub in [("aioublk", parser), *subs.items()]:
        if name != "aioublk" and f"<code>{name}</code>" not in page:
            missing.append(name)
        for action in sub._actions:
            for opt in action.option_strings:
                if f"<code>{opt}</code>" not in page:
                    missing.append(f"{name} {opt}")
            if action.help and action.help != argparse.SUPPRESS:
                expanded = sub._get_formatter()._expand_help(action).replace("`", "")
                if " ".join(expanded.split()) not in text:
                    missing.append(f"{name} {action.dest}: its help")
    assert missing == []


def test_config_reference_has_every_key(site: Path) -> None:
    page = _page(site, "config")
    keys = {f.name for f in dataclasses.fields(config.LogSettings)} | set(config.DEVICE_KEYS)
    keys |= {f.name for f in dataclasses.fields(config.MetricsSettings)}
    keys |= {k for options in config.TARGET_OPTIONS.values() for k in options}
    assert {"listen", "unprivileged"} <= keys
    assert [k for k in sorted(keys) if f"<code>{k}</code>" not in page] == []
    assert [t for t in config.TARGET_OPTIONS if f'target = "{t}"' not in page] == []


def _sections(page: str) -> dict[str, str]:
    """Each h2's text -> the HTML up to the next h2."""
    parts = re.split(r"<h2 [^>]*>(.*?)</h2>", page)
    return {re.sub(r"<[^>]+>", "", head).strip(" ¶"): body
            for head, body in zip(parts[1::2], parts[2::2], strict=True)}


def _rows(section: str) -> dict[str, str]:
    """A table's rows by the key in their first cell."""
    rows = re.findall(r"<tr>\s*<td><code>([^<]+)</code></td>(.*?)</tr>", section, re.S)
    return {key: rest for key, rest in rows}


def test_config_reference_lists_each_target_option_with_its_flag(site: Path) -> None:
    sections = _sections(_page(site, "config"))
    missing = []
    for name, spec in registry.TARGETS.items():
        rows = _rows(sections.get(f'[devices.options] for target = "{name}"', ""))
        for o in spec.options:
            row = rows.get(o.key)
            if row is None or f"<code>{o.flag}" not in row or o.help not in row:
                missing.append(f"{name}.{o.key}")
    assert missing == []
    assert "listen" in _rows(sections["[metrics]"])
    assert "UBLK_F_UNPRIVILEGED_DEV" in _rows(sections["[[devices]]"])["unprivileged"]


def test_config_reference_lists_each_device_option_with_its_flag(site: Path) -> None:
    """The device options' rows are ``DEVICE_OPTIONS``': help, flags, kernel feature."""
    rows = _rows(_sections(_page(site, "config"))["[[devices]]"])
    missing = [o.key for o in options.DEVICE_OPTIONS if o.key and (
        o.key not in rows or html.unescape(o.help) not in rows[o.key]
        or (o.flags and f"<code>{o.flags[0]}</code>" not in rows[o.key])
        or (o.feature and uapi.flag_list(o.feature) not in rows[o.key]))]
    assert missing == []
    # a key the command line spells with other flags names exactly those
    assert "<code>-i</code>" in rows["recovery"] and "<code>-e</code>" in rows["recovery"]
    assert "<code>-z</code>" in rows["copy"] and "<code>--csum_type</code>" in rows["csum_type"]
    assert "<code>--pi_offset</code>" not in rows["csum_type"]


def test_api_reference_documents_every_public_name(site: Path) -> None:
    page = _page(site, "api")
    assert [n for n in aioublk.__all__ if f'id="aioublk.{n}"' not in page] == []


def test_benchmark_results_and_charts_are_on_the_site(site: Path) -> None:
    results = ROOT / "bench" / "results"
    for md in results.glob("*.md"):
        assert (site / "benchmarks" / md.stem / "index.html").exists(), md.name
    for png in results.glob("*.png"):
        assert (site / "benchmarks" / png.name).read_bytes() == png.read_bytes()
        assert f'src="../{png.name}"' in _page(site, f"benchmarks/{png.stem}"), png.name


def test_operating_page_names_every_metric_and_op(site: Path) -> None:
    pytest.importorskip("prometheus_client")
    from aioublk.frontend import metrics

    page = _page(site, "operating")
    names = [f.name + "_total" * (f.type == "counter")
             for f in metrics.Collector(lambda: []).collect()]
    assert len(names) == 5
    assert [n for n in names if f"<code>{n}</code>" not in page] == []
    assert [op for op in metrics.OPS if op not in page] == []
