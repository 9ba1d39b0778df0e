"""Run checkpoints: `step_N/` with everything needed to continue bit-for-bit.

Contents: the policy in HF format (`policy/`, loadable by transformers), the draft's state
(`draft.pt`), both optimisers and schedulers (`optim.pt`), RNG states (`rng.pt`), the config
(`config.yaml`) and `state.json`, the completion marker: the data-loader position and the
size and sha256 of every other file of the checkpoint. A run of several ranks also writes `sharded/`:
every rank's part (its shards, its stage's tensors) of the policy, the co-trained draft and their
optimisers (torch.distributed.checkpoint), which its `optim.pt` then leaves out; `policy/` and `draft.pt`
still hold the whole weights (gathered by rank 0).

Crash safety, end to end (``kill -9`` at any moment leaves a run that resumes):
- writing: the checkpoint is built in a temporary sibling, the marker written last, and
  renamed into place (``codraft.atomic.atomic_dir``);
- pruning (only the newest ``keep_last`` are kept): a folder is first renamed to
  ``.step_N.trash-*`` (one atomic step: it stops being a checkpoint), then deleted;
- ``clean_stale`` removes what interrupted writes and prunes leave (``.step_N.tmp-*``,
  ``.step_N.old-*``, ``.step_N.trash-*``, temporaries of atomic file writes) at the start of a run;
- ``list_checkpoints`` lists a folder only when its marker reads and every file it names is
  there with its recorded size; ``load_latest`` also checks the sha256 of the newest, reads it
  whole into memory and, if anything is wrong, warns with the reason and falls back to the
  newest older checkpoint that verifies (none: ``CheckpointError``).
Everything is read back with ``torch.load(weights_only=True)``, and `sharded/` with
``codraft.models.shard_files`` (DCP's metadata and items, nothing else admitted): a run folder cannot
run code on resume (a pickle that is more than tensors and plain containers fails to load, and the
checkpoint is skipped like a corrupt one).
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from codraft.atomic import atomic_dir
from codraft.errors import CodraftError
from codraft.models import load_pretrained, save_pretrained
from codraft.models.shard_files import check_shards
from codraft.models.tensor_files import load_pickle

MARKER = "state.json"
SHARDS = "sharded"  # a run of several ranks: their parts of policy, draft and optimisers (torch.distributed.checkpoint)
REQUIRED = ("policy/config.json", "optim.pt", "rng.pt", "config.yaml")  # in every checkpoint
_STEP = re.compile(r"^step_(\d+)$")
_STALE = re.compile(r"^\..+\.(tmp|old|trash)-")


class CheckpointError(CodraftError, ValueError):
    """No usable checkpoint (the message says why)."""


@dataclass
class Checkpoint:
    """A verified checkpoint, read whole into memory (nothing restored yet)."""
    path: Path
    step: int
    state: dict                 # the marker: prompts_used, step, files (+ acceptance under draft_length=auto)
    config: dict                # the run config it was written under
    policy: torch.nn.Module
    draft: dict | None          # the draft's state dict
    optim: dict                 # optimiser and scheduler state dicts by name
    rng: dict
    skipped: list[str] = field(default_factory=list)  # newer checkpoints that failed, with the reason


def _step_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in run_dir.iterdir() if (m := _STEP.match(p.name)) and p.is_dir())


def _marker(path: Path) -> dict | None:
    try:
        m = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("step"), int) else None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def _complete(path: Path) -> bool:
    """The marker reads and every file it names is there with its size (no hashing)."""
    return verify(path, hashes=False) is None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete step_N folders, oldest first."""
    return [p for _, p in _step_dirs(run_dir) if _complete(p)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete step_N folder, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _manifest(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER}


def shards_folder(run_dir: str | Path, step: int) -> Path:
    """Where every rank of a sharded run writes its shards of step ``step`` before rank 0 moves them into
    the checkpoint (``SHARDS``); a name that ``clean_stale`` removes if the write never completes."""
    return Path(run_dir) / f".step_{step}.tmp-shards"


def save_checkpoint(run_dir: str | Path, step: int, *, policy, draft, optimizers: dict, state: dict,
                    config: dict, keep_last: int, extra_files: dict[str, str] | None = None,
                    shards: Path | None = None) -> Path:
    final = Path(run_dir) / f"step_{step}"
    with atomic_dir(final) as tmp:
        if shards is not None:  # the ranks' shards (written before): part of the checkpoint, hashed with it
            shards.rename(tmp / SHARDS)
        save_pretrained(policy, tmp / "policy", extra_files=extra_files)
        if isinstance(draft, (torch.nn.Module, dict)):  # (a dict: the state dict, gathered from shards)
            torch.save(draft if isinstance(draft, dict) else draft.state_dict(), tmp / "draft.pt")
        torch.save({k: o.state_dict() for k, o in optimizers.items() if o is not None}, tmp / "optim.pt")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        marker = {**state, "step": step, "files": _manifest(tmp)}
        (tmp / MARKER).write_text(json.dumps(marker))  # written last: marks complete
    prune(run_dir, keep_last)
    return final


def discard(path: Path):
    """Delete a checkpoint folder; renamed to a trash name first, so it is never seen half deleted."""
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.trash-", dir=path.parent))
    trash.rmdir()
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune(run_dir: str | Path, keep_last: int):
    """Keep the newest ``keep_last`` complete checkpoints (0: keep all)."""
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        discard(old)


def clean_stale(run_dir: str | Path, *, resumed_step: int | None = None) -> list[str]:
    """Remove what interrupted writes and prunes left behind; on a resume from ``resumed_step``
    also step_N folders that cannot be resumed from: incomplete ones and newer ones (a later
    history that the resumed run replaces). Returns the names removed."""
    run_dir = Path(run_dir)
    removed = []
    for p in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        if not _STALE.match(p.name):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p.name)
    for step, p in _step_dirs(run_dir) if resumed_step is not None else []:
        if step > resumed_step or not _complete(p):
            discard(p)
            removed.append(p.name)
    return removed


def verify(path: str | Path, *, hashes: bool = True) -> str | None:
    """What is wrong with a checkpoint folder (None: every file matches its marker's size and, with
    ``hashes``, its sha256 and the marker lists every required file)."""
    path = Path(path)
    m = _marker(path)
    if m is None:
        return f"{MARKER} is missing or unreadable"
    files = m.get("files")
    if files is None:  # written before checksums: only presence can be checked
        missing = [f for f in REQUIRED if not (path / f).is_file()]
        return f"{missing[0]} is missing" if missing else None
    unlisted = [f for f in REQUIRED if f not in files] if hashes else []
    if unlisted:
        return f"{unlisted[0]} is not in the {MARKER} checksums"
    for rel, entry in files.items():
        size = _size(path / rel)
        if size is None:
            return f"{rel} is missing"
        if size != entry.get("size"):
            return f"{rel} is {size} bytes, expected {entry.get('size')} (truncated?)"
        if hashes and _sha256(path / rel) != entry.get("sha256"):
            return f"{rel} does not match its sha256 (corrupted)"
    return None


def load_file(path: Path):
    """torch.load, tensors and plain containers only: never unpickle code from a run folder."""
    try:
        return load_pickle(path)
    except ValueError as e:  # one line naming the file; a CheckpointError, skipped like a corrupt checkpoint
        raise CheckpointError(str(e)) from e


def check_sharded(folder: Path) -> None:
    """The ranks' part (torch.distributed.checkpoint): its metadata and non-tensor items read with nothing
    but plain data admitted, so a planted pickle there skips the checkpoint like a corrupt file."""
    try:
        check_shards(folder)
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def read(path: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Read a checkpoint whole into memory (``CheckpointError`` naming the file that fails)."""
    path = Path(path)
    state = _marker(path)
    if state is None:
        raise CheckpointError(f"{MARKER} is missing or unreadable")
    try:
        config = yaml.safe_load((path / "config.yaml").read_text())
        policy = load_pretrained(path / "policy", dtype=dtype)
    except Exception as e:
        raise CheckpointError(f"policy/ or config.yaml cannot be loaded ({type(e).__name__}: {e})") from e
    draft = load_file(path / "draft.pt") if (path / "draft.pt").is_file() else None
    optim, rng = load_file(path / "optim.pt"), load_file(path / "rng.pt")
    if (path / SHARDS).is_dir():
        check_sharded(path / SHARDS)
    if not isinstance(config, dict) or not isinstance(optim, dict) or not isinstance(rng, dict) \
            or not isinstance(rng.get("torch"), torch.Tensor) or not isinstance(rng.get("python"), tuple):
        raise CheckpointError("config.yaml, optim.pt or rng.pt does not hold what a checkpoint writes")
    return Checkpoint(path, state["step"], state, config, policy, draft, optim, rng)


def load_latest(run_dir: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """The newest checkpoint that verifies and reads, newer ones that do not being skipped with a
    warning naming what is wrong; ``CheckpointError`` when there is none."""
    dirs = _step_dirs(run_dir)
    if not dirs:
        raise CheckpointError(f"{run_dir} has no step_N checkpoint to resume from "
                              "(the run stopped before its first checkpoint)")
    skipped = []
    for _, path in reversed(dirs):
        problem = verify(path)
        if problem is None:
            try:
                found = read(path, dtype)
            except CheckpointError as e:
                problem = str(e)
        if problem is not None:
            skipped.append(f"{path.name}: {problem}")
            warnings.warn(f"checkpoint {path} is not usable: {problem}; falling back to an earlier one",
                          stacklevel=2)
            continue
        if "files" not in found.state:
            warnings.warn(f"checkpoint {path} has no checksums (written by an older codraft): not verified",
                          stacklevel=2)
        found.skipped = skipped
        return found
    raise CheckpointError(f"no checkpoint in {run_dir} verifies: " + "; ".join(skipped))


def load_policy_from(path: str | Path, dtype: torch.dtype = torch.float32):
    return load_pretrained(Path(path) / "policy", dtype=dtype)


def restore(found: Checkpoint, *, draft, optimizers: dict) -> dict:
    """Restore draft, optimisers (built over the restored policy) and RNG in place; returns the state."""
    if draft is not None and found.draft is not None:
        draft.load_state_dict(found.draft)
    for k, o in optimizers.items():
        if o is not None and k in found.optim:
            o.load_state_dict(found.optim[k])
    torch.set_rng_state(found.rng["torch"])
    random.setstate(found.rng["python"])
    return found.state
