"""cffi (API mode) builder for ``aioublk.targets._rbd``, librados and librbd
for the rbd target (``rbd.py``).

A separate extension, as ``_nbd_build.py`` is for libnbd: ``setup.py``
builds it only where ``rbd/librbd.h`` is, and without it the rbd target
alone says what to install.

Completions need no callback: the image is told to notify an eventfd
(``rbd_set_image_notification``), librbd queues each finished completion
for ``rbd_poll_io_events``, and ``arbd_reap`` turns a batch of them into
(request id, result) records and releases them, so Python is entered once
per wakeup, not once per request. A completion's argument is our request
id, not a pointer.

Supported: Ceph >= 16.2 (pacific, Debian 12).
"""

from __future__ import annotations

import runpy
from pathlib import Path

import cffi

CDEF = """
typedef void *rados_t;
typedef void *rados_ioctx_t;
typedef void *rbd_image_t;
typedef void *rbd_completion_t;
typedef struct {
  uint64_t size;
  uint64_t obj_size;
  uint64_t num_objs;
  int order;
  ...;
} rbd_image_info_t;
struct arbd_done { uint64_t id; int64_t result; };

int rados_create(rados_t *cluster, const char *id);
int rados_conf_read_file(rados_t cluster, const char *path);
int rados_conf_set(rados_t cluster, const char *option, const char *value);
int rados_connect(rados_t cluster);
void rados_shutdown(rados_t cluster);
int rados_ioctx_create(rados_t cluster, const char *pool_name, rados_ioctx_t *ioctx);
void rados_ioctx_destroy(rados_ioctx_t io);

int rbd_open(rados_ioctx_t io, const char *name, rbd_image_t *image, const char *snap_name);
int rbd_open_read_only(rados_ioctx_t io, const char *name, rbd_image_t *image,
                       const char *snap_name);
int rbd_close(rbd_image_t image);
int rbd_stat(rbd_image_t image, rbd_image_info_t *info, size_t infosize);
int rbd_set_image_notification(rbd_image_t image, int fd, int type);

int arbd_read(rbd_image_t image, void *buf, size_t len, uint64_t off, uint64_t id);
int arbd_write(rbd_image_t image, const void *buf, size_t len, uint64_t off, uint64_t id);
int arbd_discard(rbd_image_t image, uint64_t off, uint64_t len, uint64_t id);
int arbd_write_zeroes(rbd_image_t image, uint64_t off, uint64_t len, uint64_t id);
int arbd_flush(rbd_image_t image, uint64_t id);
int arbd_reap(rbd_image_t image, struct arbd_done *out, int max);

#define EVENT_TYPE_EVENTFD ...
"""

SOURCE = r"""
#include <stdint.h>
#include <rados/librados.h>
#include <rbd/librbd.h>

struct arbd_done { uint64_t id; int64_t result; };

/* each call: a completion without callback carrying the request id; on a
   refused submission it is released here and the error returned */
#define ARBD_CALL(call) do { \
        rbd_completion_t c; \
        int r = rbd_aio_create_completion((void *)(uintptr_t)id, NULL, &c); \
        if (r < 0) \
            return r; \
        r = call; \
        if (r < 0) \
            rbd_aio_release(c); \
        return r < 0 ? r : 0; \
    } while (0)

int arbd_read(rbd_image_t image, void *buf, size_t len, uint64_t off, uint64_t id)
{
    ARBD_CALL(rbd_aio_read(image, off, len, buf, c));
}

int arbd_write(rbd_image_t image, const void *buf, size_t len, uint64_t off, uint64_t id)
{
    ARBD_CALL(rbd_aio_write(image, off, len, buf, c));
}

int arbd_discard(rbd_image_t image, uint64_t off, uint64_t len, uint64_t id)
{
    ARBD_CALL(rbd_aio_discard(image, off, len, c));
}

int arbd_write_zeroes(rbd_image_t image, uint64_t off, uint64_t len, uint64_t id)
{
    ARBD_CALL(rbd_aio_write_zeroes(image, off, len, c, 0, 0));
}

int arbd_flush(rbd_image_t image, uint64_t id)
{
    ARBD_CALL(rbd_aio_flush(image, c));
}

/* up to max finished completions as records; each is released */
int arbd_reap(rbd_image_t image, struct arbd_done *out, int max)
{
    rbd_completion_t comps[64];
    int total = 0;

    while (total < max) {
        int want = max - total < 64 ? max - total : 64;
        int n = rbd_poll_io_events(image, comps, want);

        if (n <= 0)
            return total ? total : n;
        for (int i = 0; i < n; i++) {
            out[total + i].id = (uint64_t)(uintptr_t)rbd_aio_get_arg(comps[i]);
            out[total + i].result = rbd_aio_get_return_value(comps[i]);
            rbd_aio_release(comps[i]);
        }
        total += n;
        if (n < want)
            break;
    }
    return total;
}
"""

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
# (librbd ships no .pc file: then the compiler's default paths)
_LINK = runpy.run_path(str(Path(__file__).parents[2] / "buildlibs.py"))["source_args"](
    "librbd", ["rbd", "rados"])
ffibuilder.set_source("aioublk.targets._rbd", SOURCE, **_LINK)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
