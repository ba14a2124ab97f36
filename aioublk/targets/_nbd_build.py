"""cffi (API mode) builder for ``aioublk.targets._nbd``, libnbd for the nbd
target (``nbd.py``).

A separate extension from ``aioublk._uring`` so that aioublk builds and runs
on a machine without libnbd: ``setup.py`` builds this one only when
``libnbd.h`` is there, and the nbd target alone says what to install.

libnbd's functions are bound as they are, except its completion callbacks:
a command's completion is recorded in C (``anbd_done``: our request id and
its errno) and reaped in bulk after each ``nbd_aio_notify_*``, as the ring's
CQEs are, rather than calling into Python once per completion.

The data plane's plug-in (``anbd_ext``, ``csrc/nbd.c``) sends the reads and
writes the worker's data plane hands it, on the connection Python made,
with no Python per request (itself, or through libnbd over TLS); its table
reaches ``aioublk._uring`` as an address, once (``dataplane.External``).
Its C is ``csrc/nbd.c``.

Supported: libnbd >= 1.14 (Debian 12).
"""

from __future__ import annotations

import importlib.util
import os
import runpy
from pathlib import Path

import cffi

#: libnbd's part: its functions as they are, and its constants
LIBNBD_CDEF = """
struct nbd_handle;
struct nbd_handle *nbd_create(void);
void nbd_close(struct nbd_handle *h);
const char *nbd_get_error(void);
int nbd_get_errno(void);

int nbd_set_request_structured_replies(struct nbd_handle *h, bool request);
int nbd_set_request_block_size(struct nbd_handle *h, bool request);
int nbd_set_uri_allow_transports(struct nbd_handle *h, uint32_t mask);
int nbd_set_uri_allow_tls(struct nbd_handle *h, int tls);
int nbd_set_tls_certificates(struct nbd_handle *h, const char *dir);
int nbd_aio_connect_uri(struct nbd_handle *h, const char *uri);
int nbd_poll(struct nbd_handle *h, int timeout);
int nbd_shutdown(struct nbd_handle *h, uint32_t flags);

int nbd_aio_get_fd(struct nbd_handle *h);
unsigned nbd_aio_get_direction(struct nbd_handle *h);
int nbd_aio_notify_read(struct nbd_handle *h);
int nbd_aio_notify_write(struct nbd_handle *h);
int nbd_aio_is_ready(struct nbd_handle *h);
int nbd_aio_is_connecting(struct nbd_handle *h);
int nbd_aio_is_processing(struct nbd_handle *h);
int nbd_aio_is_dead(struct nbd_handle *h);
int nbd_aio_is_closed(struct nbd_handle *h);

int64_t nbd_get_size(struct nbd_handle *h);
int64_t nbd_get_block_size(struct nbd_handle *h, int size_type);
int nbd_is_read_only(struct nbd_handle *h);
int nbd_can_flush(struct nbd_handle *h);
int nbd_can_fua(struct nbd_handle *h);
int nbd_can_trim(struct nbd_handle *h);
int nbd_can_zero(struct nbd_handle *h);
int nbd_can_fast_zero(struct nbd_handle *h);
int nbd_can_multi_conn(struct nbd_handle *h);
int nbd_get_structured_replies_negotiated(struct nbd_handle *h);

#define LIBNBD_SIZE_MINIMUM ...
#define LIBNBD_SIZE_PREFERRED ...
#define LIBNBD_SIZE_MAXIMUM ...
#define LIBNBD_CMD_FLAG_FUA ...
#define LIBNBD_CMD_FLAG_NO_HOLE ...
#define LIBNBD_AIO_DIRECTION_READ ...
#define LIBNBD_AIO_DIRECTION_WRITE ...
#define LIBNBD_ALLOW_TRANSPORT_TCP ...
#define LIBNBD_ALLOW_TRANSPORT_UNIX ...
#define LIBNBD_TLS_ALLOW ...
#define LIBNBD_SHUTDOWN_ABANDON_PENDING ...
"""

#: the C is in csrc/nbd.c, declared in csrc/nbd.h; the plug-in's table is
#: the data plane's (aioublk/dataplane/csrc/dp_ext.h)
_CSRC = Path(__file__).parent / "csrc"
_DP = Path(__file__).parent.parent / "dataplane" / "csrc"


def _cdef_of(header: Path) -> str:
    """The header's cdef region, read as ``aioublk/_uring_build.py`` reads
    the data plane's (loaded by path: a build script is not imported)."""
    spec = importlib.util.spec_from_file_location(
        "_aioublk_uring_build", Path(__file__).parent.parent / "_uring_build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return str(build._cdef_of(header))


CDEF = LIBNBD_CDEF + _cdef_of(_CSRC / "nbd.h")

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
_LINK = runpy.run_path(str(Path(__file__).parents[2] / "buildlibs.py"))["source_args"](
    "libnbd", ["nbd"], include_dirs=[str(_CSRC), str(_DP)])
ffibuilder.set_source("aioublk.targets._nbd", '#include "nbd.h"\n',
                      sources=[os.path.relpath(_CSRC / "nbd.c")], **_LINK)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
