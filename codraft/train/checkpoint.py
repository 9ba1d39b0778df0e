"""Run checkpoints: `step_N/` with everything needed to continue bit-for-bit.

Contents: the policy in HF format (`policy/`, loadable by transformers), the draft's state,
both optimisers and schedulers, RNG states, the data-loader position and the config.
Written to a temporary folder and renamed (``codraft.atomic.atomic_dir``: a crash never leaves
a half checkpoint that looks complete); only the newest ``keep_last`` are kept. Everything is
read back with ``torch.load(weights_only=True)``: a run folder cannot run code on resume.
"""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import torch
import yaml

from codraft.atomic import atomic_dir
from codraft.models import load_pretrained, save_pretrained

_STEP = re.compile(r"^step_(\d+)$")


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    run_dir = Path(run_dir)
    found = [(int(m.group(1)), p) for p in run_dir.glob("step_*") if (m := _STEP.match(p.name))
             and (p / "state.json").is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete step_N folder, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: str | Path, step: int, *, policy, draft, optimizers: dict, state: dict,
                    config: dict, keep_last: int, extra_files: dict[str, str] | None = None) -> Path:
    final = Path(run_dir) / f"step_{step}"
    with atomic_dir(final) as tmp:
        save_pretrained(policy, tmp / "policy", extra_files=extra_files)
        if draft is not None and isinstance(draft, torch.nn.Module):
            torch.save(draft.state_dict(), tmp / "draft.pt")
        torch.save({k: o.state_dict() for k, o in optimizers.items() if o is not None}, tmp / "optim.pt")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}))  # written last: marks complete
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_policy_from(path: str | Path, dtype: torch.dtype = torch.float32):
    return load_pretrained(Path(path) / "policy", dtype=dtype)


def restore(path: str | Path, *, draft, optimizers: dict) -> dict:
    """Restore draft, optimisers (built over the restored policy) and RNG in place; returns the state."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    if draft is not None and (path / "draft.pt").is_file():
        draft.load_state_dict(torch.load(path / "draft.pt", weights_only=True))
    saved = torch.load(path / "optim.pt", weights_only=True)  # never unpickle code from a run folder
    for k, o in optimizers.items():
        if o is not None and k in saved:
            o.load_state_dict(saved[k])
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return state
