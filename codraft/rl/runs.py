"""Starting and resuming a `codraft train` run in its folder, and the end-of-run report.

A fresh run never writes into a folder that already holds a run (``codraft.train.run_dir``).
A resume continues the run under its own config: the CLI builds it from ``RUN_DIR/config.yaml``
(``resume_config``), not from a preset, and the trainer compares it with the config of the
checkpoint it restores (``check_resume``). Only the keys in ``RESUMABLE`` may differ; any other
difference is refused with the key named. What changed is appended to ``resume_log.jsonl``
with the step it takes effect from, and ``config.yaml`` is rewritten as the effective config.

``steps`` may change (down to the steps the checkpoint completed): the policy's lr cosine is a
function of (step, steps), so from the resumed step on the lr follows the cosine over the new
total (the trainer sets the restored optimiser's lr from it; earlier steps keep the lr they had,
which metrics.jsonl shows). Extending a finished run thus raises the lr from the floor to the
new cosine's value at that step.
"""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

from codraft.atomic import atomic_write_text
from codraft.config import ConfigError, RunConfig, apply, flatten, load_config
from codraft.rl.logger import read_metrics
from codraft.train import checkpoint as ckpt
from codraft.train.run_dir import (
    RunDirError,
    append_resume_log,
    check_fresh,
    check_resumable,
    lock_run,
)

# keys a resume may change: none of them alters what the restored state means
RESUMABLE = (
    "steps",                     # the run's length, >= the steps completed; the lr cosine follows it
    "device",                    # where it runs (exact repetition holds on one device only)
    "memory_check",              # a check before the run, not the run
    "rollout.vllm_kv_cache_gb",  # vLLM's KV cache size: how many rows fit at once, not what they sample
    "parallel.dp", "parallel.dp_shard",  # DCP reshards a checkpoint to any layout (the same math)
    "parallel.cp", "parallel.pp", "parallel.tp", "parallel.sequence_parallel",  # how it is split:
    "parallel.taps", "parallel.tap_tokens", "parallel.timeout",
    #                            the same math, other float rounding
    "parallel.microbatches",     # the RL loss is exact over micro-batches; the draft's anchors are drawn per one
    "grpo.max_nonfinite_steps",  # fault tolerance, not the update
    "env.timeout", "env.workers", "env.isolation",  # where and how long tool calls run, not what they answer
    "log.val_every", "log.speedup_every", "log.frozen_probe_every",  # measurement cadences
    "log.checkpoint_every", "log.keep_last",                         # checkpoint cadence and rotation
    "log.samples_every", "log.no_signal_steps",                      # what the run shows of itself
)


def _refuse(run_dir, key: str, detail: str = "") -> ConfigError:
    return ConfigError(f"--resume {run_dir}: config key {key!r} cannot change on resume{detail}; "
                       f"a resume may change only {', '.join(RESUMABLE)}")


def resume_config(run_dir: str | Path, overrides: list[str] = ()) -> RunConfig:
    """The config to resume ``run_dir`` with: its ``config.yaml`` plus ``key=value`` overrides,
    which may name only RESUMABLE keys. Nothing is created or written."""
    d = check_resumable(run_dir)
    saved = d / "config.yaml"
    if not saved.is_file():
        last = ckpt.latest_checkpoint(d)
        if last is None:
            raise RunDirError(f"--resume {d}: config.yaml is missing and there is no checkpoint to take it from")
        saved = last / "config.yaml"
    overrides = list(overrides)
    cfg = load_config(str(saved), overrides)  # unknown keys and bad values: the usual messages
    for item in overrides:
        key, value = (s.strip() for s in item.split("=", 1))
        if key == "run_dir" and Path(value).resolve() != d.resolve():
            raise ConfigError(f"--resume {d}: run_dir={value} differs; a resumed run stays in its folder")
        if key not in RESUMABLE and key != "run_dir":
            raise _refuse(d, key)
    cfg.run_dir = str(d)  # where the run is now (the folder may have moved)
    return cfg


def check_resume(cfg: RunConfig, saved: dict, step: int, run_dir) -> dict:
    """The keys ``cfg`` changes against the checkpoint's config ``saved``, as {key: [old, new]};
    ConfigError for a key outside RESUMABLE, or ``steps`` below the completed ``step``."""
    old = flatten(apply(RunConfig(), flatten(saved)).to_dict())
    new = flatten(cfg.to_dict())
    changed = {k: [old.get(k), v] for k, v in new.items() if k != "run_dir" and old.get(k) != v}
    for key, (was, now) in changed.items():
        if key not in RESUMABLE:
            raise _refuse(run_dir, key, f" (the run has {was!r}, asked for {now!r})")
    if cfg.steps < step:
        raise ConfigError(f"--resume {run_dir}: steps={cfg.steps} is below the {step} steps already completed")
    return changed


def open_run(cfg: RunConfig, resume, dtype, lock: bool = True):
    """(config, run folder, restored checkpoint or None, changed keys, the folder's lock) for a fresh run or a
    resume; refuses before anything is loaded when the folder does not fit. With ``lock`` (the rank that
    writes), the folder is locked first (``lock_run``: created if absent, with only its lock file), so two
    runs started at once cannot both pass the checks; a refusal releases it. Writes nothing else
    (``record_start``)."""
    d = Path(cfg.run_dir) if resume is None else check_resumable(resume)  # (a missing resume folder: not created)
    held = lock_run(d) if lock else None
    try:
        if resume is None:
            check_fresh(d)
            return cfg, d, None, {}, held
        found = ckpt.load_latest(d, dtype)  # warns about each newer checkpoint it skips
        changed = check_resume(cfg, found.config, found.step, d)
    except BaseException:
        if held is not None:
            held.release()
        raise
    cfg = copy.deepcopy(cfg)
    cfg.run_dir = str(d)
    return cfg, d, found, changed, held


def record_start(run_dir: Path, cfg: RunConfig, found, changed: dict):
    """Once the run is set up: the folder tidied (temporaries; on a resume, step_N folders newer than the
    restored one or incomplete), config.yaml = the effective config, and on a resume a resume_log.jsonl line."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.clean_stale(run_dir, resumed_step=None if found is None else found.step)
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    if found is not None:
        append_resume_log(run_dir, {"step": found.step, "checkpoint": found.path.name, "changed": changed,
                                    "skipped": found.skipped})


def _first_last(label: str, rows: list, key: str, n: int) -> str:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    if not pts:
        return f"{label}: -"

    def mean(part):
        steps = f"step {part[0][0]}" if len(part) == 1 else f"steps {part[0][0]}-{part[-1][0]}"
        return f"{sum(v for _, v in part) / len(part):.3f} ({steps})"
    k = min(n, len(pts) // 2)  # windows of up to n steps that never overlap (a short run: its halves)
    return f"{label}: {mean(pts)}" if k == 0 else f"{label}: {mean(pts[:k])} -> {mean(pts[-k:])}"


def report(run_dir: str | Path, plots=(), n: int = 10) -> str:
    """Where the run is and how it went: reward and τ over the first/last ``n`` steps, held-out
    accuracy first/last, the plots and the last checkpoint."""
    run_dir = Path(run_dir)
    try:
        rows = read_metrics(run_dir)
    except (OSError, ValueError):
        rows = []
    steps = [r for r in rows if "reward_mean" in r]
    val = [(r["step"], r["val_accuracy"]) for r in rows if isinstance(r.get("val_accuracy"), (int, float))]
    last = ckpt.latest_checkpoint(run_dir)
    lines = [f"run folder: {run_dir}", f"steps completed: {steps[-1]['step'] if steps else 0}",
             _first_last("reward", steps, "reward_mean", n),
             _first_last("tau (acceptance_length)", steps, "acceptance_length", n),
             f"held-out accuracy: {val[0][1]:.3f} (step {val[0][0]}) -> {val[-1][1]:.3f} (step {val[-1][0]})"
             if val else "held-out accuracy: -",
             "plots: " + (", ".join(str(p) for p in plots) or "-"),
             f"last checkpoint: {last or '-'}" + (f" (continue with --resume {run_dir})" if last else "")]
    return "\n".join(lines)
