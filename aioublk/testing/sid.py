"""Debian sid packages fetched into a private cache, without touching the host.

Facts this module relies on (checked on a Debian 12 build machine):

- The guest kernel, its uapi headers and a recent liburing come from Debian
  *sid*, while the host runs Debian 12. A private apt state directory (its own
  sources.list, lists and archive cache, passed with `-o Dir::...` options)
  lets the ordinary `apt-get`/`apt-cache` clients read sid's index and
  download `.deb` files without changing the host's apt setup. Nothing is
  installed: packages are unpacked with `dpkg-deb -x`.
- The mirror is the machine's own (from `/etc/apt/sources.list.d/*.sources`
  or `/etc/apt/sources.list`), so sid comes from the same registry as every
  other Debian package. `Debug::NoLocking` avoids the host's apt lock;
  `APT::Sandbox::User=root` because the `_apt` user cannot enter `/root`.
- sid moves: a package version in our lists may vanish from the mirror.
  A download that fails is retried once after `apt-get update`.
- The cache must be visible inside the virtme-ng guest: a cache under
  `/var/cache` is not (something mounts over it there), `$HOME/.cache`,
  `/tmp` and the project tree are. `$AIOUBLK_CACHE` overrides the default
  `~/.cache/aioublk`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

DEFAULT_MIRROR = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


class SetupError(RuntimeError):
    """A missing tool, package or download: shown as one line, never a traceback."""


def progress(message: str) -> None:
    """One short line on stderr for the slow steps, so a first run is not silent."""
    print(f"aioublk: {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """The cache root; created on demand. Refuses places the guest cannot see."""
    env = os.environ.get("AIOUBLK_CACHE")
    path = Path(env) if env else Path.home() / ".cache" / "aioublk"
    path = path.absolute()
    if path == Path("/var/cache") or Path("/var/cache") in path.parents:
        raise SetupError(f"cache {path} is under /var/cache, which the guest cannot see")
    path.mkdir(parents=True, exist_ok=True)
    return path


def scratch_dir(kind: str, keep: int = 20) -> Path:
    """A new folder under `$CACHE/kind`, dropping the oldest beyond `keep`: logs of
    failed guest runs and guest JUnit files stay around for a while, not forever."""
    root = cache_dir() / kind
    root.mkdir(exist_ok=True)
    old = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for p in old[: max(0, len(old) - keep + 1)]:
        shutil.rmtree(p, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=root))


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """Serialise slow cache fills between concurrent processes (e.g. two pytest runs)."""
    with open(cache_dir() / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def host_mirror() -> str:
    """The Debian mirror the host's own apt configuration uses."""
    for sources in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        m = re.search(r"^URIs:\s*(\S+)", sources.read_text(), re.MULTILINE)
        if m and "security" not in m.group(1):
            return m.group(1)
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        m = re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)", legacy.read_text(), re.MULTILINE)
        if m and "security" not in m.group(1):
            return m.group(1)
    return DEFAULT_MIRROR


def run(argv: Sequence[str | Path], cwd: Path | None = None, stdin: IO[bytes] | None = None) -> str:
    """Run a tool and return its stdout; a failure becomes a SetupError with its stderr."""
    try:
        proc = subprocess.run(
            [str(a) for a in argv],
            check=False,
            cwd=cwd,
            stdin=subprocess.DEVNULL if stdin is None else stdin,
            capture_output=True,
            text=True,
        )
    except FileNotFoundError as e:
        raise SetupError(f"{argv[0]} not found ({e.strerror}); run scripts/setup first") from None
    if proc.returncode != 0:
        raise SetupError(
            f"`{' '.join(map(str, argv[:3]))} ...` failed ({proc.returncode}):\n"
            + proc.stderr.strip()
        )
    return proc.stdout


class SidApt:
    """The private apt state under `$CACHE/apt` and the `.deb` store `$CACHE/debs`."""

    def __init__(self, cache: Path | None = None) -> None:
        self.cache = cache or cache_dir()
        self.root = self.cache / "apt"
        self.debs = self.cache / "debs"

    def _options(self) -> list[str]:
        opts = {
            "Dir::Etc::SourceList": self.root / "sources.list",
            "Dir::Etc::SourceParts": "/dev/null",
            "Dir::State::Lists": self.root / "lists",
            "Dir::Cache": self.root,
            "Debug::NoLocking": 1,
            "APT::Sandbox::User": "root",
        }
        return [arg for k, v in opts.items() for arg in ("-o", f"{k}={v}")]

    def _has_lists(self) -> bool:
        return any((self.root / "lists").glob("*_Packages*"))

    def update(self) -> None:
        """Write sources.list (only if it changed, so lists stay valid) and fetch sid's index."""
        for sub in ("lists/partial", "archives/partial"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        line = f"deb [signed-by={KEYRING}] {host_mirror()} sid main\n"
        sources = self.root / "sources.list"
        if not sources.exists() or sources.read_text() != line:
            sources.write_text(line)
        progress("updating the private Debian sid package index")
        run(["apt-get", *self._options(), "update", "-qq"])

    def cache_query(self, *args: str) -> str:
        """`apt-cache` against sid's index (fetched first if we have none yet)."""
        if not self._has_lists():
            self.update()
        return run(["apt-cache", *self._options(), *args])

    def field(self, package: str, name: str) -> str:
        """One control field of the candidate version, e.g. Version or Filename."""
        text = self.cache_query("show", "--no-all-versions", package)
        m = re.search(rf"^{name}:\s*(.+)$", text, re.MULTILINE)
        if not m:
            raise SetupError(f"no {name} for {package} in Debian sid")
        return m.group(1).strip()

    def download(self, packages: Sequence[str]) -> list[Path]:
        """The `.deb` files of the candidate versions, named as in the pool; present ones are
        reused. Each download lands in a temporary folder first, so a partial file never
        passes for a complete one."""
        self.debs.mkdir(parents=True, exist_ok=True)
        for attempt in (1, 2):
            want = {p: self.debs / Path(self.field(p, "Filename")).name for p in packages}
            missing = [p for p, f in want.items() if not f.exists()]
            if not missing:
                return list(want.values())
            progress(f"downloading {' '.join(missing)} from Debian sid")
            with tempfile.TemporaryDirectory(dir=self.debs) as tmp:
                proc = subprocess.run(
                    ["apt-get", *self._options(), "download", *missing],
                    check=False,
                    cwd=tmp,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                )
                if proc.returncode == 0:
                    for p in missing:  # apt names files with the epoch (%3a), the pool does not
                        next(Path(tmp).glob(f"{p}_*.deb")).rename(want[p])
                    return list(want.values())
            if attempt == 2:
                raise SetupError(f"apt-get download {' '.join(missing)} failed:\n{proc.stderr}")
            self.update()  # sid moved on: the index may name versions the mirror dropped
        raise AssertionError("unreachable")


def extract(deb: Path, dest: Path) -> None:
    """Unpack a `.deb` without installing it."""
    dest.mkdir(parents=True, exist_ok=True)
    run(["dpkg-deb", "-x", deb, dest])
