"""The encrypt filter on the host: the cipher against its own reads, and
the key file it accepts (no kernel)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from aioublk.errors import UblkError
from aioublk.frontend import config
from tests.host.test_filters import Memory, stacked


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
        config.filter_stack([f"encrypt:keyfile={tmp_path / 'none'}"])
    assert "does not exist" in str(e.value)

