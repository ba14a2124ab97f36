"""Fuzz target: ``aioublk.targets.nbd.parse_uri``, what the nbd target
checks in a URI (from ``-t nbd URI`` or a config's ``uri``) before libnbd
sees it. The input's bytes are the URI (undecodable bytes are replaced, as
a command line's would be surrogates). Only a result or a one-line NbdError
may come out, and what is accepted is printable ASCII with a known scheme."""

from __future__ import annotations

from aioublk.targets.nbd import NbdError, parse_uri
from tests.fuzz.common import check_error


def one_input(data: bytes) -> None:
    uri = data.decode("utf-8", "surrogateescape")
    try:
        parsed = parse_uri(uri)
    except NbdError as e:
        check_error(e)
        return
    assert uri.isascii() and uri.isprintable(), uri
    assert uri.startswith("nbd"), uri
    assert parsed.transport in ("tcp", "unix", "vsock", "ssh"), parsed
