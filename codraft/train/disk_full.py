"""A disk that fills up while a run writes: one line naming the folder, the bytes needed and what was kept.

The writers report a full disk in several shapes: ``OSError`` ENOSPC (or EDQUOT, a quota) from Python's
own writes, safetensors' ``SafetensorError`` with "No space left on device (os error 28)" in its text, and
torch.distributed.checkpoint's ``CheckpointException`` holding every rank's exception; ``is_disk_full``
reads all of them.
"""
from __future__ import annotations

import errno
import shutil
from pathlib import Path

from codraft.errors import CodraftError

_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


class DiskFullError(CodraftError, OSError):
    """The disk (or quota) holding the run folder is full: the message says where and how much is needed."""


def is_disk_full(e: BaseException | None) -> bool:
    """Is ``e``, or an exception it wraps or was raised from, an out-of-space error?"""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(e) for t in _TEXTS):
            return True
        failures = getattr(e, "failures", None)  # DCP: rank -> (exception, its stack)
        if isinstance(failures, dict) and any(is_disk_full(f[0]) for f in failures.values()
                                              if isinstance(f, tuple) and f):
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(folder: Path) -> int | None:
    """Bytes free for this user on ``folder``'s file system (None when it cannot be read)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def checkpoint_full(folder: Path, step: int, needed: int, previous: Path | None, run_dir: Path) -> DiskFullError:
    """The one-line error for a checkpoint of ``step`` that did not fit in ``folder`` (its temporaries removed)."""
    free = free_bytes(folder)
    kept = f"the previous checkpoint {previous} is kept (continue with --resume {run_dir} once there is room)" \
        if previous is not None else "no earlier checkpoint exists"
    return DiskFullError(f"no space left on device writing the checkpoint of step {step} in {folder}: it needs about "
                         f"{megabytes(needed)}" + (f", {megabytes(free)} are free" if free is not None else "")
                         + f"; its temporary files were removed and {kept}")


def run_full(run_dir: Path, e: BaseException, latest: Path | None) -> DiskFullError:
    """The one-line error for a full disk outside a checkpoint write (the metrics, the plots)."""
    where = getattr(e, "filename", None) or run_dir
    kept = f"the latest checkpoint is {latest} (continue with --resume {run_dir} once there is room)" \
        if latest is not None else "no checkpoint was written"
    return DiskFullError(f"no space left on device writing {where} ({megabytes(free_bytes(Path(run_dir)) or 0)} "
                         f"free); {kept}")
