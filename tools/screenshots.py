"""The documentation's screenshots, made from a build of the site, never by hand.

    python -m tools.screenshots [--out docs/screenshots] [--chromium PATH]

Builds the site (``mkdocs build`` of ``mkdocs.yml``, strict) into a temporary
folder and captures each page of ``PAGES`` with headless Chromium (Debian's
``chromium`` package: ``apt-get install chromium``) into OUT/NAME.png, so a
screenshot always shows the CLI, the config keys and the benchmark results
of the code it was made from.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: NAME -> (the page's path in the site, the window's height in pixels)
PAGES = {
    "front": ("index.html", 1000),
    "getting-started": ("getting-started/index.html", 1400),
    "cli-reference": ("cli/index.html", 1400),
    "config-reference": ("config/index.html", 1400),
    "qcow2": ("qcow2/index.html", 1400),
    "alternatives": ("alternatives/index.html", 1400),
    "benchmarks-startup": ("benchmarks/startup/index.html", 1400),
    "api": ("api/index.html", 1400),
}
WIDTH = 1280


def build(site: Path) -> None:
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d",
                    str(site)], cwd=ROOT, check=True, stdin=subprocess.DEVNULL,
                   env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def capture(chromium: str, url: str, out: Path, height: int) -> None:
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", f"--window-size={WIDTH},{height}",
                    f"--screenshot={out}", url], check=True, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    if not out.is_file() or out.stat().st_size == 0:
        raise SystemExit(f"screenshots: chromium made no {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    ns = ap.parse_args(argv)
    if shutil.which(ns.chromium) is None:
        print("screenshots: no chromium: apt-get install chromium (or --chromium PATH)",
              file=sys.stderr)
        return 1
    ns.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="aioublk-site-") as tmp:
        site = Path(tmp) / "site"
        print("screenshots: building the site", flush=True)
        build(site)
        for i, (name, (page, height)) in enumerate(PAGES.items(), 1):
            print(f"screenshots: [{i}/{len(PAGES)}] {name}", flush=True)
            capture(ns.chromium, (site / page).as_uri(), ns.out / f"{name}.png", height)
    return 0


if __name__ == "__main__":
    sys.exit(main())
