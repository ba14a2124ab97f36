"""Which backing files an image may use: the user decides, never the image.

A qcow2 header names its backing file, and every cluster the image does not
hold reads from that file. A server running as root that follows the name
lets an image from elsewhere (a download, a guest, another user) serve
``/etc/shadow`` or ``/dev/sda`` through ``/dev/ublkbN`` as a "raw backing
file", and a FIFO named there hangs the open. QEMU's answer for untrusted
images is to take the chain from the user (``-F``, ``backing.*`` options,
libvirt's labels) rather than from the file; here the same rules are the
default, with an option to widen them:

- **where**: a backing file is used only if its real path (every symlink
  followed) is a file in the directory of the image the user named, or lies
  under a path the user allowed (``--allow-backing PATH``, ``allow_backing``
  in a serve config: a directory allows everything under it, a file allows
  that file). How the header spells the name does not matter: an absolute
  name or ``..`` that lands in the image's own directory is as good as a
  plain one, and a plain name that is a symlink out of it is refused. A name
  is relative to the directory of the image that holds it, as QEMU reads it.
  The same places hold for the whole chain.
- **whose**: a backing file belongs to the owner of the image that names it,
  or to root, unless the user allowed that very file: a root-owned image
  downloaded to ``/tmp`` must not serve another user's ``krb5cc_1000``
  from next to it. And a directory anyone may write (``/tmp``, sticky or
  not) is no place of the image's: a file there is used only under a path
  the user allowed.
- **what**: a regular file, or a block device whose own path the user
  allowed. Never a FIFO, socket, character device or directory: none of them
  is a disk, and opening some of them blocks or has side effects.
- **format**: the image's backing-format header extension, else the user's
  ``--backing-format``, never a probe of the file's first bytes: a raw file
  a guest wrote a qcow2 header into would otherwise become an image naming
  backing files of its own.

A place is checked before the file's existence or type, so a refusal tells
nothing about host files outside the allowed places.

The decisions are plain functions of names, real paths and ``st_mode``; the
image resolves the name (``resolve``) and checks what ``lstat`` says of the
real path. Then the file is opened as it was checked (``open_dir``, then
``aioublk.io.hostfile.HostFile``): from ``/`` one directory at a time, each with
``O_NOFOLLOW``, the file itself with ``O_NOFOLLOW|O_NONBLOCK`` in the last,
so that no symlink made since the check is followed anywhere in the path;
and before a byte is read, ``fstat`` on the descriptor must show the
``(st_dev, st_ino)`` that was checked (``Checked.same``), so a name swapped
since the check is refused rather than served.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from aioublk.qcow2.format import Qcow2Error

ALLOW = "--allow-backing"
FORMAT = "--backing-format"
FORMATS = ("qcow2", "raw")
PROTOCOLS = ("json:", "nbd:", "http:", "https:", "ftp:", "ftps:", "ssh:", "iscsi:", "gluster:",
             "rbd:", "nfs:", "vvfat:", "null-co:", "null-aio:", "blkdebug:")


def _allow_hint(path: str) -> str:
    return f"{ALLOW} {path} (allow_backing in a serve config)"


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _shown(name: str, real: str) -> str:
    return name if name == real else f"{name} ({real})"


@dataclass
class Checked:
    """A backing file as its policy passed it: ``real`` path, the
    ``(st_dev, st_ino)`` its check saw, and an ``O_PATH`` descriptor of its
    directory, reached without a symlink (``BackingPolicy.open_dir``), to
    open ``leaf`` in with ``O_NOFOLLOW``."""

    name: str
    real: str
    ident: tuple[int, int]
    dir_fd: int = field(default=-1)

    @property
    def leaf(self) -> str:
        return os.path.basename(self.real)

    def same(self, st: os.stat_result) -> None:
        """Qcow2Error unless ``st`` (fstat of the opened file) is the checked file."""
        if (st.st_dev, st.st_ino) != self.ident:
            raise Qcow2Error(f"backing file {_shown(self.name, self.real)} changed between its "
                             "check and its open: refused (retry if you changed it yourself)")

    def close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


@dataclass(frozen=True)
class BackingPolicy:
    """Where the backing files of one chain may be, and their format where
    an image records none. ``home`` and ``allowed`` are real paths."""

    home: str                       # the directory of the image the user named
    allowed: tuple[str, ...] = ()   # directories (everything under) and files
    fmt: str | None = None          # for images without a backing-format extension

    @classmethod
    def for_image(cls, image: str, allow: Iterable[str] = (),
                  fmt: str | None = None) -> BackingPolicy:
        """The policy for the chain under ``image`` (resolves the paths)."""
        if fmt is not None and fmt not in FORMATS:
            raise Qcow2Error(f"backing format '{fmt}' is not supported: use qcow2 or raw")
        allow = tuple(allow)
        for p in allow:
            if not os.path.exists(p):
                raise Qcow2Error(f"{ALLOW} {p}: no such file or directory")
        return cls(home=os.path.realpath(os.path.dirname(os.path.abspath(image))),
                   allowed=tuple(os.path.realpath(p) for p in allow), fmt=fmt)

    # -- the name -> a path (no I/O but realpath in resolve)
    @staticmethod
    def candidate(image: str, name: str) -> str:
        """The path a header's backing name designates, as QEMU reads it."""
        if name.startswith(PROTOCOLS):
            raise Qcow2Error(f"backing file '{name}' is a protocol, not a file: not supported")
        if "\0" in name:
            raise Qcow2Error(f"backing file '{name}' of {image} does not exist (the name holds "
                             "a NUL byte)")
        return name if os.path.isabs(name) else os.path.join(os.path.dirname(image), name)

    def resolve(self, image: str, name: str) -> str:
        """The real path of ``name`` (backing file of ``image``) if it lies in
        an allowed place; Qcow2Error otherwise."""
        real = os.path.realpath(self.candidate(image, name))
        self.check_place(name, real)
        return real

    def check_place(self, name: str, real: str) -> None:
        if os.path.dirname(real) == self.home or any(_within(real, a) for a in self.allowed):
            return
        shown = _shown(name, real)
        raise Qcow2Error(f"backing file {shown} is outside the image's directory {self.home}: "
                         f"if you trust the image, allow it with "
                         f"{_allow_hint(real)}")

    def check_dir(self, name: str, real: str, dir_mode: int) -> None:
        """A directory anyone may write allows only what the user allowed."""
        if not dir_mode & stat.S_IWOTH or any(_within(real, a) for a in self.allowed):
            return
        raise Qcow2Error(f"backing file {_shown(name, real)} is in {os.path.dirname(real)}, "
                         f"a directory anyone may write (mode {stat.S_IMODE(dir_mode):o}): "
                         f"if you trust it, allow it with {_allow_hint(real)}")

    # -- whose it is (st_uid from lstat of the real path)
    def check_owner(self, name: str, real: str, uid: int, *, image_uid: int) -> None:
        """The image's owner's file, or root's, or one the user allowed by name."""
        if uid in (0, image_uid) or real in self.allowed:
            return
        raise Qcow2Error(f"backing file {_shown(name, real)} is owned by uid {uid}, neither "
                         f"root nor the image's owner (uid {image_uid}): if you trust it, "
                         f"allow it with {_allow_hint(real)}")

    # -- what the path is (st_mode from lstat of the real path, then fstat)
    def check_kind(self, name: str, real: str, mode: int) -> None:
        if stat.S_ISREG(mode):
            return
        shown = _shown(name, real)
        if stat.S_ISBLK(mode):
            if real in self.allowed:
                return
            raise Qcow2Error(f"backing file {shown} is a block device: use it only if you "
                             f"trust the image, with {_allow_hint(real)}")
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a character device" if stat.S_ISCHR(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise Qcow2Error(f"backing file {shown} is {kind}: a backing file must be a regular "
                         f"file (or a block device allowed with {ALLOW})")

    # -- the open, of the file that was checked
    def open_dir(self, name: str, real: str, st: os.stat_result) -> Checked:
        """``real`` (checked, with ``st`` from its lstat) ready to open: its
        directory opened from ``/`` one component at a time, never through a
        symlink (what openat2's RESOLVE_NO_SYMLINKS does, on any kernel: the
        real path has no ``..`` to climb out by), and its mode checked on
        that descriptor (``check_dir``)."""
        checked = Checked(name, real, (st.st_dev, st.st_ino))
        flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        checked.dir_fd = os.open("/", flags)
        try:
            for part in os.path.dirname(real).split("/"):
                if part:
                    fd = os.open(part, flags, dir_fd=checked.dir_fd)
                    os.close(checked.dir_fd)
                    checked.dir_fd = fd
            self.check_dir(name, real, os.fstat(checked.dir_fd).st_mode)
        except Qcow2Error:
            checked.close()
            raise
        except OSError as e:
            checked.close()
            raise Qcow2Error(f"backing file {_shown(name, real)} changed between its check and "
                             f"its open ({e.strerror} in {os.path.dirname(real)}): "
                             "refused") from None
        return checked

    # -- the format
    def format(self, image: str, name: str, recorded: str | None) -> str:
        """The backing file's format: the image's extension, else the user's."""
        fmt = recorded if recorded is not None else self.fmt
        if fmt is None:
            raise Qcow2Error(f"backing file {name} of {image} has no recorded format and "
                             f"formats are never guessed: give it with {FORMAT} raw|qcow2 "
                             "(backing_format in a serve config), or record it with "
                             f"`qemu-img rebase -u -F FMT -b {name} {image}`")
        if fmt not in FORMATS:
            raise Qcow2Error(f"backing file {name} has format '{fmt}': only qcow2 and raw")
        return fmt
