"""Unprivileged devices' nodes for their owners: the udev rule and its helper.

A user without CAP_SYS_ADMIN may add a device with UBLK_F_UNPRIVILEGED_DEV
through a world-writable ``/dev/ublk-control``; the kernel records the user as
the device's owner and, for every later command, checks the caller's access
to ``/dev/ublkcN`` instead of its capabilities. So the nodes devtmpfs makes
(root's, mode 0600) must become the owner's, which is udev's job: for each
new ``ublkcN``/``ublkbN[pM]`` the rule runs ``aioublk udev owner NAME`` (as
root), which asks the kernel for the device's owner with GET_DEV_INFO2 and
prints ``UID GID``; udev applies them as it creates the node, so there is no
moment where the node has the wrong owner once the server can see it. A
privileged device makes the helper exit 1: the rule does not match, and
its nodes stay root's. The kernel itself lets only the owner open an
unprivileged disk, whatever the node's mode says.

The rule names the interpreter aioublk is installed for (udev runs programs
with a bare environment), hence ``aioublk udev rules`` prints it for this
installation; ``examples/99-aioublk.rules`` is its output for a system-wide
install. Root runs that interpreter whenever any user makes a ublk node
(``/dev/ublk-control`` is 0666), so a rule is printed only if nobody but
root can change what it runs (``check_trusted``): the interpreter, every
directory and symlink on the way to it, the package, and the site
directories whose ``.pth`` files run at startup. A user's venv gets one
line saying why not, instead of a rule. The rule runs Python isolated
(``-I``: no environment variables, no user site, no current directory).
"""

from __future__ import annotations

import os
import re
import stat
import sys

from aioublk.errors import UblkError
from aioublk.kernel import uapi
from aioublk.kernel.control import Control, run_now

RULES_FILE = "/etc/udev/rules.d/99-aioublk.rules"
_NODE = re.compile(r"ublk[bc](\d+)(?:p\d+)?")


#: a symlink chain longer than this is refused, as the kernel does (ELOOP)
MAX_HOPS = 40


def rules(python: str | None = None) -> str:
    """The rule file for this aioublk run by ``python`` (this interpreter by
    default), if nobody but root can change what it runs; UblkError (one
    line) otherwise."""
    python = python or sys.executable
    check_trusted(python, os.path.dirname(os.path.abspath(__file__)))
    return rule_text(python)


def check_trusted(python: str, package: str) -> None:
    """UblkError unless root alone can change ``python`` (and the path to
    it), the ``package`` directory (all of it) and this interpreter's site
    directories (and what is in them: ``.pth`` files run at startup)."""
    # the deepest first: a refusal names the place nearest to what root runs
    places = [*_walked(_path(python, must_exist=True)), *_tree(package)]
    places += _walked(_path(package, must_exist=True))
    import sysconfig  # (here: ``udev owner``, run for every ublk node, needs none of it)

    paths = sysconfig.get_paths()
    for site in dict.fromkeys(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")):
        places += _walked(_path(site))
        if os.path.isdir(site):
            places += ((e.path, e.stat(follow_symlinks=False), False)
                       for e in os.scandir(site))
    for where, st, passed in places:
        why = _others_may_change(where, st, passed)
        if why is not None:
            raise UblkError(f"no udev rule for {python}: {why}, and root would run it for "
                            "every ublk node any user creates: install aioublk where only "
                            "root can write (pip as root, outside a user's venv) and print "
                            "the rule with that python")


def _walked(path: list[tuple[str, os.stat_result]]) -> list[tuple[str, os.stat_result, bool]]:
    """A path's places, the deepest first, each marked whether the walk only passed
    through it (every one but the last)."""
    return [(p, st, i < len(path) - 1) for i, (p, st) in reversed(list(enumerate(path)))]


def _others_may_change(path: str, st: os.stat_result, passed: bool = False) -> str | None:
    """Why others may change what root runs through ``path``, or None. A sticky
    directory the walk only passes through (``/tmp``) is safe: others may add names
    there, never replace the root-owned one the walk goes on to (itself checked)."""
    if stat.S_ISLNK(st.st_mode):
        return None  # (a symlink cannot be changed, only replaced in its directory)
    if st.st_uid != 0:
        return f"{path} is owned by uid {st.st_uid}"
    if passed and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
        return None
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != 0):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _path(path: str, must_exist: bool = False) -> list[tuple[str, os.stat_result]]:
    """What the kernel goes through to reach ``path``, from ``/`` down: each
    directory, and the directories symlinks lead to, hop by hop."""
    seen = [("/", os.lstat("/"))]
    todo = os.path.abspath(path).split("/")[::-1]
    cur, hops = "/", 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, part)
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            if must_exist:
                raise UblkError(f"no udev rule for {path}: {nxt} does not exist") from None
            break  # (only who may write its directory can make it)
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_HOPS:
                raise UblkError(f"no udev rule for {path}: too many symlinks")
            target = os.readlink(nxt)
            cur = "/" if target.startswith("/") else cur
            todo += target.split("/")[::-1]
            continue
        seen.append((nxt, st))
        cur = nxt
    return seen


def _tree(top: str) -> list[tuple[str, os.stat_result, bool]]:
    """Everything under the directory ``top`` (not following symlinks)."""
    found = []
    for d, dirs, files in os.walk(top):
        found += [(os.path.join(d, n), os.lstat(os.path.join(d, n)), False)
                  for n in dirs + files]
    return found


def rule_text(python: str) -> str:
    """The rule file running aioublk's helper with ``python``, unchecked."""
    return f"""\
# aioublk: users may create ublk devices of their own (add --unprivileged).
# Install as {RULES_FILE}, then: udevadm control --reload
# Anyone may send ADD_DEV; ublk_drv caps unprivileged devices (module
# parameter ublks_max, 64 by default) and checks every other command
# against the caller's access to the device's /dev/ublkcN.
KERNEL=="ublk-control", MODE="0666", OPTIONS+="static_node=ublk-control"
# An unprivileged device's nodes belong to the user who created it.
ACTION=="add", KERNEL=="ublk[bc][0-9]*", PROGRAM="{python} -I -m aioublk udev owner %k", \\
    OWNER="%c{{1}}", GROUP="%c{{2}}", MODE="0600"
"""


def dev_id_of(name: str) -> int:
    """The device id in a node's kernel name: ublkc3, ublkb3, ublkb3p1."""
    m = _NODE.fullmatch(name)
    if m is None:
        raise UblkError(f"{name!r} is not a ublk node name (ublkcN, ublkbN or ublkbNpM)")
    return int(m.group(1))


def owner(dev_id: int) -> tuple[int, int] | None:
    """(uid, gid) of an unprivileged device's owner; None for a privileged
    one. Blocking, and light: udev runs it for every ublk node."""
    ctrl = Control(blocking=True)
    try:
        info = run_now(ctrl.get_info2(dev_id))
    finally:
        ctrl.close()
    if not info.flags & uapi.Feature.UNPRIVILEGED_DEV:
        return None
    return info.owner_uid, info.owner_gid


def main_owner(name: str) -> int:
    """``aioublk udev owner NAME``: print ``UID GID``, or exit 1 (no match)."""
    found = owner(dev_id_of(name))
    if found is None:
        return 1
    print(*found)
    return 0
