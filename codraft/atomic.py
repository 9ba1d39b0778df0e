"""Write folders and files atomically: build in a temporary sibling, rename into place on success.

A crash, ``kill -9`` or Ctrl-C mid-write leaves only a dot-prefixed temporary sibling
(``.NAME.tmp-*``; ``.NAME.old-*`` while a folder is being replaced), never a half-written
file or folder under the final name. Contents are flushed to disk (fsync) before the rename,
so after a power cut the final name holds either the old or the new contents.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path


def fsync_dir(path: str | os.PathLike):
    """Make a rename or a new entry in ``path`` durable (no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(root: Path):
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(folder)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike):
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        old.rmdir()
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_dir(final.parent)


def atomic_write_text(path: str | os.PathLike, text: str):
    """Replace ``path``'s contents with ``text`` in one step (temporary sibling, fsync, rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def build_lock(path: str | os.PathLike, what: str):
    """One process at a time builds ``what`` (a cache entry that takes minutes: a converted model, an
    offline draft): the others wait here, then find it built. An inter-process lock on ``path`` (POSIX
    ``flock``; elsewhere none, and atomic renames still keep the folders whole). The OS drops it when its
    holder dies, so a crashed builder never leaves the others waiting."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"codraft: another process is building {what}; waiting for it", file=sys.stderr, flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)

