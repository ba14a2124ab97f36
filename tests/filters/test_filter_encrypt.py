"""The encrypt filter on the host: the cipher against its own reads, and
the key file it accepts (its size, who may read it) through the command
line and a serve config (no kernel)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aioublk.errors import UblkError
from aioublk.frontend import config, maketarget, registry, verb
from tests.filters.test_filters import Memory, stacked


def key_file(tmp_path: Path, mode: int = 0o600, size: int = 64) -> Path:
    """A random key of ``size`` bytes, readable as ``mode`` says."""
    key = tmp_path / "key"
    key.write_bytes(os.urandom(size))
    key.chmod(mode)
    return key


def test_encrypt_round_trips_and_tweaks_each_sector(tmp_path: Path) -> None:
    key = key_file(tmp_path)
    inner = Memory()
    top = stacked([f"encrypt:keyfile={key}"], inner)
    plain = b"same" * 256  # 1 KiB: two sectors of the same plaintext
    asyncio.run(top.write(4096, memoryview(plain)))
    stored = bytes(inner.data[4096:5120])
    assert plain not in stored and stored[:512] != stored[512:]  # each sector its own tweak
    buf = bytearray(1024)
    asyncio.run(top.read(4096, memoryview(buf)))
    assert buf == plain
    buf = bytearray(512)
    asyncio.run(top.read(4608, memoryview(buf)))  # a sector read alone decrypts alike
    assert buf == plain[512:]
    assert not top.geometry.discard and not top.geometry.write_zeroes


def test_encrypt_needs_a_64_byte_key(tmp_path: Path) -> None:
    key = key_file(tmp_path, size=32)
    with pytest.raises(UblkError) as e:
        stacked([f"encrypt:keyfile={key}"])
    assert "holds 32 bytes: an AES-XTS key for --key-size 512 is 64" in str(e.value)
    key.write_bytes(bytes(64))
    with pytest.raises(UblkError) as e:
        stacked([f"encrypt:keyfile={key}"])
    assert "key file" in str(e.value)
    with pytest.raises(UblkError) as e:
        registry.filter_stack([f"encrypt:keyfile={tmp_path / 'none'}"])
    assert "does not exist" in str(e.value)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o620, 0o602])
def test_a_key_others_may_read_or_write_is_refused_in_one_line(tmp_path: Path,
                                                               mode: int) -> None:
    """As cryptsetup warns of such a key file: the line names the file, its
    mode and both ways out."""
    key = key_file(tmp_path, mode)
    proc = subprocess.run([sys.executable, "-m", "aioublk", "add", "-t", "null", "--filter",
                           f"encrypt:keyfile={key}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    for part in (str(key), f"mode {mode:04o}", f"chmod 600 {key}", "allow_insecure_key=true"):
        assert part in proc.stderr, f"{part!r} not in {proc.stderr!r}"


def test_a_serve_config_refuses_it_alike(tmp_path: Path) -> None:
    key = key_file(tmp_path, 0o644)
    conf = tmp_path / "serve.toml"
    conf.write_text(f'[[devices]]\ntarget = "null"\nfilters = ["encrypt:keyfile={key}"]\n')
    conf.chmod(0o600)
    [dev] = config.load(str(conf)).devices
    with pytest.raises(UblkError) as e:
        dev.build_target()
    assert "\n" not in str(e.value) and "mode 0644" in str(e.value)
    conf.write_text(f'[[devices]]\ntarget = "null"\n'
                    f'filters = ["encrypt:keyfile={key},allow_insecure_key=true"]\n')
    [dev] = config.load(str(conf)).devices
    dev.build_target().close()


@pytest.mark.parametrize(("mode", "override"), [(0o600, ""), (0o400, ""), (0o700, ""),
                                                (0o644, ",allow_insecure_key=true")])
def test_a_private_key_or_the_override_is_accepted(tmp_path: Path, mode: int,
                                                   override: str) -> None:
    key = key_file(tmp_path, mode)
    args = verb.parser().parse_args(["add", "-t", "null", "--filter",
                                     f"encrypt:keyfile={key}{override}"])
    target = maketarget.make_target(args)
    try:
        assert target.describe()["filters"][0]["keyfile"] == str(key)  # type: ignore[index]
    finally:
        target.close()
