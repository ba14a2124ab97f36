"""The encrypt filter: AES-XTS, the bytes dm-crypt's plain mode writes;
the cipher is the cryptography package's, imported when the filter is built."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from aioublk.target import Target
from aioublk.targets.filters.base import Filter
from aioublk.targets.spec import BOOL, PATH, FilterSpec, Option

#: dm-crypt's plain mode as ``cryptsetup open --type plain --cipher aes-xts-plain64
#: --key-size 512`` sets it up: 512-byte sectors, each its own XTS tweak
SECTOR = 512
KEY_BYTES = 64


class EncryptFilter(Filter):
    """AES-XTS with the 64-byte key in ``keyfile``, the same bytes on disk as
    dm-crypt's plain mode (``cryptsetup open --type plain --cipher
    aes-xts-plain64 --key-size 512 --key-file KEYFILE``): each 512-byte
    sector encrypted with its number from the start of the inner device,
    little-endian, as the tweak (plain64). The ``cryptography`` package does
    the cipher. A key file group or others may read or write is refused
    (anyone who reads it reads the disk) unless ``allow_insecure_key``."""

    name = "encrypt"

    def __init__(self, inner: Target, keyfile: str, allow_insecure_key: bool = False) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        except ImportError:
            raise ValueError("needs the cryptography package: pip install "
                             "'aioublk[encrypt]'") from None
        with open(keyfile, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode & 0o7777  # (the file read, not its name)
            if mode & 0o066 and not allow_insecure_key:
                raise ValueError(f"key file {keyfile} has mode {mode:04o}, so others may read "
                                 f"or write it: chmod 600 {keyfile}, or add "
                                 "allow_insecure_key=true to the filter to use it anyway")
            key = f.read(KEY_BYTES + 1)
        if len(key) != KEY_BYTES:
            raise ValueError(f"key file {keyfile} holds {len(key)}{'+' * (len(key) > 64)} "
                             f"bytes: an AES-XTS key for --key-size 512 is {KEY_BYTES}: "
                             "make one with head -c 64 /dev/urandom")
        try:
            self._algorithm = algorithms.AES(key)
            Cipher(self._algorithm, modes.XTS(bytes(16))).encryptor()
        except ValueError as e:  # (XTS refuses a key whose two halves are equal)
            raise ValueError(f"key file {keyfile}: {e}") from None
        self._cipher, self._xts = Cipher, modes.XTS
        self.keyfile = os.path.abspath(keyfile)
        super().__init__(inner)

    def _crypt(self, offset: int, data: memoryview, out: memoryview, encrypt: bool) -> None:
        sector = offset // SECTOR
        for at in range(0, len(data), SECTOR):
            tweak = (sector + at // SECTOR).to_bytes(16, "little")
            c = self._cipher(self._algorithm, self._xts(tweak))
            op = c.encryptor() if encrypt else c.decryptor()
            out[at:at + SECTOR] = op.update(data[at:at + SECTOR]) + op.finalize()

    async def read(self, offset: int, buf: memoryview) -> None:
        await super().read(offset, buf)
        self._crypt(offset, buf, buf, encrypt=False)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        sealed = memoryview(bytearray(len(buf)))
        self._crypt(offset, buf, sealed, encrypt=True)
        await super().write(offset, sealed, fua)

    def shape(self, geometry: Any) -> Any:
        # a discarded or zeroed range would read back as the decryption of zeros
        return replace(geometry, discard=False, write_zeroes=False)

    def settings(self) -> dict[str, object]:
        return {"keyfile": self.keyfile, "cipher": "aes-xts-plain64", "key_size": 512}


SPEC = FilterSpec(
    "encrypt", EncryptFilter,
    "AES-XTS, the bytes dm-crypt's plain mode writes (cryptsetup open --type plain "
    "--cipher aes-xts-plain64 --key-size 512 --key-file KEYFILE); Python serves "
    "every request", (
        Option("keyfile", PATH, "the 64-byte key file, that only its owner may read or "
               "write", required=True, what="key file"),
        Option("allow_insecure_key", BOOL, "use a key file that group or others may read "
               "or write (refused otherwise)", default=False)), rank=11)
