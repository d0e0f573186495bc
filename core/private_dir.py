"""A run directory other users cannot control (`check_private`): neither it nor a folder or symbolic link
on the way to it may be written or owned by another user, unless `[output] shared = true` says the
directory is shared on purpose. A run, and every command that writes into the directory (cli/main.py
`_config_to_write`), checks it before anything is written or sent; another user could otherwise move its
records away or reset its spend ledger.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path

from draftgen.core.errors import DraftgenError
from draftgen.core.quoting import sh_path


def _own_group(gid: int) -> bool:
    """`gid` is the user's own group (a user private group, as umask 002 systems make): the user's primary
    group, with no other member and no other user's primary group."""
    uid = os.geteuid()
    if gid != os.getegid():
        return False
    try:
        me = pwd.getpwuid(uid).pw_name
        if any(name != me for name in grp.getgrgid(gid).gr_mem):
            return False
        return not any(p.pw_gid == gid and p.pw_uid != uid for p in pwd.getpwall())
    except KeyError:  # no name for the uid or gid: nothing says the group is the user's alone
        return False


def others_write(st: os.stat_result) -> str:
    """Who besides the user can write a folder with this stat ("" for no one): "every user", or the users of
    its group (unless it is the user's own group, `_own_group`)."""
    if st.st_mode & stat.S_IWOTH:
        return "every user"
    if st.st_mode & stat.S_IWGRP and not _own_group(st.st_gid):
        try:
            name = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            name = str(st.st_gid)
        return f"the users of group {name}"
    return ""


def _user(uid: int) -> str:
    """`uid` with its name where it has one ("uid 65534 (nobody)")."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _path_walk(path: Path) -> Iterator[tuple[Path, os.stat_result, bool]]:
    """The folders and symbolic links the system passes through to reach `path` (absolute), in order, each
    with its lstat and whether it is a link: links are followed as the system follows them (a target's own
    links too, `..` after a link from the link's target), so a folder a link leads through is among them. Ends
    at the first name that does not exist yet (draftgen makes it) or cannot be looked at, or after 40 links
    (a loop: opening the path fails anyway)."""
    cur = Path(path.anchor)
    yield cur, os.lstat(cur), False
    todo = list(path.parts[1:])
    links = 0
    while todo:
        name = todo.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            cur = cur.parent
            continue
        nxt = cur / name
        try:
            st = os.lstat(nxt)
        except OSError:
            return
        if not stat.S_ISLNK(st.st_mode):
            cur = nxt
            yield cur, st, False
            continue
        yield nxt, st, True
        links += 1
        try:
            target = Path(os.readlink(nxt))
        except OSError:
            return
        if links > 40:
            return
        if target.is_absolute():
            cur = Path(target.anchor)
            todo[:0] = target.parts[1:]
        else:
            todo[:0] = target.parts


def check_private(root: Path, config_path: Path | str, *, shared: bool) -> None:
    """Refuse a run directory other users can control (DraftgenError naming the folder or link and who):
    the directory itself if they can write it or own it; a folder on the way to it that another user (not
    root) owns, or that they can write without a sticky bit (they could move the directory away and put
    another in its place); a symbolic link on the way that another user (not root) owns (they could point
    it elsewhere). Every folder and link the system passes through is checked, those a link leads through
    too (`_path_walk`). Folders not made yet are not checked (draftgen makes them 0700). `shared`: `[output]
    shared = true`, the directory is shared on purpose: nothing is refused."""
    if shared:
        return
    path = Path(os.path.abspath(root))
    with contextlib.suppress(OSError):
        path = path.resolve()
    fix = f"or set [output] shared = true in {config_path} if it is shared on purpose"
    me = os.geteuid()
    walk = list(_path_walk(Path(os.getcwd(), root)))  # unnormalized: `..` after a link goes where the system goes
    for folder, st, link in walk:
        mode = f"mode {stat.S_IMODE(st.st_mode):04o}"
        if link:
            if st.st_uid not in (me, 0):
                raise DraftgenError(f"{folder}, a symbolic link on the way to the run directory {path}, is owned by "
                                    f"{_user(st.st_uid)}, not by you or root: they could point it at another "
                                    f"directory; use a path without it, {fix}")
            continue
        if folder == path:
            if st.st_uid != me:
                raise DraftgenError(f"{folder}: the run directory is owned by uid {st.st_uid}, not by you (uid "
                                    f"{me}): its owner could replace or remove its records and reset its spend "
                                    f"ledger; use a directory of your own, {fix}")
            who = others_write(st)
            if who:
                raise DraftgenError(f"{folder}: the run directory can be written by {who} ({mode}): they could "
                                    f"replace or remove its records and reset its spend ledger; `chmod go-w "
                                    f"{sh_path(folder)}`, {fix}")
            continue
        if st.st_uid not in (me, 0):
            raise DraftgenError(f"{folder}, a folder on the way to the run directory {path}, is owned by "
                                f"{_user(st.st_uid)}, not by you or root ({mode}): they could move the run "
                                f"directory away and put another in its place; move output.dir elsewhere, {fix}")
        who = others_write(st)
        if who and not st.st_mode & stat.S_ISVTX:
            raise DraftgenError(f"{folder}, a folder on the way to the run directory {path}, can be written by "
                                f"{who} without the sticky bit ({mode}): they could move the run directory away "
                                f"and put another in its place; `chmod go-w {sh_path(folder)}` (or +t), move "
                                f"output.dir elsewhere, {fix}")
