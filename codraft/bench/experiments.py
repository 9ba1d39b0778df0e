"""`codraft bench drift|parity|rollout-dtype`: series of `codraft train` runs that compare draft modes
and kinds, or rollout weight dtypes.

drift   same seed, same initial (offline-trained) draft: a frozen draft vs a co-trained one,
        per draft kind, while the policy changes. Reports τ at the start and the end.
parity  reward, validation accuracy and mismatch KL with speculative rollouts (each kind)
        vs draft.mode=none, over several seeds; also the end-to-end numbers (rollout
        speedup, step speedup, rollout share of step time and Amdahl's bound).
rollout-dtype  reward and mismatch KL with bf16 rollout weights (``rollout.dtype=bfloat16``) vs the
        trainer's fp32 weights, over several seeds: does the reward curve track (last-10-step means
        within the seed spread), how large is the train/rollout gap, what does it buy in rollout time.
Each run is an ordinary `codraft train` run folder under ``out`` (``config``: the preset or YAML file
the runs start from, default tiny); the summary is a
markdown table + JSON, and overlay plots.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from codraft.config import load_config
from codraft.rl.plots import plot_compare, summarize
from codraft.rl.trainer import train
from codraft.train.checkpoint import latest_checkpoint


def _run(out: Path, name: str, overrides: list[str], progress: bool, config: str | None = None) -> Path:
    run_dir = out / name
    if (run_dir / "metrics.jsonl").is_file() and (run_dir / "done").is_file():
        return run_dir  # finished earlier: experiments are resumable run by run, and within a run
    cfg = load_config(config, overrides + [f"run_dir={run_dir}"])
    resume = None
    if run_dir.exists():  # an interrupted run of this experiment (no "done")
        if latest_checkpoint(run_dir) is not None:  # it continues as `codraft train --resume` would
            print(f"== {name}: continuing the unfinished run in {run_dir} from its last checkpoint", flush=True)
            resume = str(run_dir)
        else:
            print(f"== {name}: removing the unfinished run in {run_dir} (no checkpoint)", flush=True)
            shutil.rmtree(run_dir)
    print(f"== {name}: {' '.join(overrides)}", flush=True)
    train(cfg, resume=resume, progress=progress)
    (run_dir / "done").write_text("")
    return run_dir


def _fmt(v, nd=3):
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def drift(out: str | Path, *, kinds=("dflash", "dspark", "eagle3"), steps: int = 50, seeds=(0,),
          extra: list[str] = (), progress: bool = True, config: str | None = None) -> dict:
    out = Path(out)
    rows, dirs = {}, []
    for kind in kinds:
        for seed in seeds:
            for mode in ("frozen", "cotrain"):
                # the co-trained run also runs a frozen copy of the initial draft on its own prompts every
                # step: both drafts against the same policy, which the two runs' policies are not (their
                # rollouts differ, so their updates do)
                d = _run(out, f"drift-{kind}-{mode}-seed{seed}",
                         [f"steps={steps}", f"seed={seed}", f"draft.kind={kind}", f"draft.mode={mode}",
                          "log.speedup_every=0", "log.checkpoint_every=0", "log.frozen_probe_every=1", *extra],
                         progress, config)
                rows[f"{kind}/{seed}/{mode}"] = summarize(d)
                dirs.append(d)
    plot_compare(dirs, out / "drift-plots")
    lines = ["| kind | seed | run | τ first 5 steps | τ last 5 steps | reward first → last |",
             "|---|---|---|---|---|---|"]
    for key, s in rows.items():
        kind, seed, mode = key.split("/")
        lines.append(f"| {kind} | {seed} | {mode} | {_fmt(s['tau_first'], 2)} | {_fmt(s['tau_last'], 2)} | "
                     f"{_fmt(s['reward_first'], 2)} → {_fmt(s['reward_last'], 2)} |")
        if s["frozen_tau_last"] is not None:
            lines.append(f"| {kind} | {seed} | {mode}: frozen copy, same policy | {_fmt(s['frozen_tau_first'], 2)} | "
                         f"{_fmt(s['frozen_tau_last'], 2)} | |")

    def ratios(frozen_key, frozen_mode):
        per = {k: [rows[f"{k}/{s}/cotrain"]["tau_last"] / rows[f"{k}/{s}/{frozen_mode}"][frozen_key] for s in seeds
                   if rows[f"{k}/{s}/{frozen_mode}"][frozen_key]] for k in kinds}
        return ", ".join(f"{k} {sum(v) / len(v):.2f}× (" + " ".join(f"{x:.2f}" for x in v) + ")" for k, v in per.items() if v)

    lines += ["", "co-trained / frozen τ at the end, mean (per seed), separate runs: " + ratios("tau_last", "frozen"),
              "co-trained / frozen copy τ at the end, same run (same policy): " + ratios("frozen_tau_last", "cotrain")]
    return _write(out, "drift", rows, lines)


def parity(out: str | Path, *, kinds=("none", "dflash", "dspark", "eagle3"), seeds=(0, 1, 2), steps: int = 30,
           extra: list[str] = (), progress: bool = True, config: str | None = None) -> dict:
    out = Path(out)
    rows, dirs = {}, []
    for kind in kinds:
        for seed in seeds:
            mode = ["draft.mode=none"] if kind == "none" else [f"draft.kind={kind}", "draft.mode=cotrain"]
            d = _run(out, f"parity-{kind}-seed{seed}", [f"steps={steps}", f"seed={seed}", *mode,
                                                         "log.speedup_every=5", "log.checkpoint_every=0", *extra],
                     progress, config)
            rows[f"{kind}/{seed}"] = summarize(d)
            dirs.append(d)
    plot_compare(dirs, out / "parity-plots")

    def spread(kind, key):
        vals = [rows[f"{kind}/{s}"][key] for s in seeds if rows[f"{kind}/{s}"][key] is not None]
        if not vals:
            return "-"
        m = sum(vals) / len(vals)
        return f"{m:.3f} ± {(max(vals) - min(vals)) / 2:.3f}"

    lines = ["| kind | reward (last 5) | val acc (end) | mismatch KL | τ | rollout speedup | step time s | rollout share |",
             "|---|---|---|---|---|---|---|---|"]
    for kind in kinds:
        lines.append(f"| {kind} | {spread(kind, 'reward_last')} | {spread(kind, 'val_last')} | "
                     f"{spread(kind, 'mismatch_kl')} | {spread(kind, 'tau_last')} | {spread(kind, 'rollout_speedup')} | "
                     f"{spread(kind, 'time_step')} | {spread(kind, 'rollout_share')} |")
    if "none" in kinds:
        base = [rows[f"none/{s}"] for s in seeds]
        t_none = sum(r["time_step"] for r in base) / len(base)
        f = sum(r["rollout_share"] for r in base) / len(base)
        lines += ["", "End to end vs draft.mode=none (mean over seeds): "]
        for kind in kinds[1:]:
            rs = [rows[f"{kind}/{s}"] for s in seeds]
            t = sum(r["time_step"] for r in rs) / len(rs)
            s_roll = sum(r["rollout_speedup"] or 0 for r in rs) / len(rs)
            bound = 1 / ((1 - f) + f / s_roll) if s_roll else None
            lines.append(f"- {kind}: step speedup {t_none / t:.2f}× (rollout speedup {s_roll:.2f}×, "
                         f"Amdahl bound with f={f:.2f}: {_fmt(bound, 2)}×)")
    return _write(out, "parity", rows, lines)


def rollout_dtype(out: str | Path, *, dtypes=("float32", "bfloat16"), seeds=(0, 1, 2), steps: int = 100,
                  extra: list[str] = (), progress: bool = True, config: str | None = None) -> dict:
    out = Path(out)
    rows, dirs = {}, []
    for dtype in dtypes:
        for seed in seeds:
            d = _run(out, f"dtype-{dtype}-seed{seed}", [f"steps={steps}", f"seed={seed}", f"rollout.dtype={dtype}",
                                                         "log.checkpoint_every=0", *extra], progress, config)
            rows[f"{dtype}/{seed}"] = summarize(d, last=10)
            dirs.append(d)
    plot_compare(dirs, out / "rollout-dtype-plots")

    def stats(dtype, key):
        vals = [rows[f"{dtype}/{s}"][key] for s in seeds if rows[f"{dtype}/{s}"][key] is not None]
        return (sum(vals) / len(vals), (max(vals) - min(vals)) / 2) if vals else (None, None)

    lines = ["| rollout weights | reward (last 10, mean ± half-range over seeds) | val acc (end) | mismatch KL | "
             "rollout s/step | τ |", "|---|---|---|---|---|---|"]
    for dtype in dtypes:
        cells = [stats(dtype, k) for k in ("reward_last", "val_last", "mismatch_kl", "time_rollout", "tau_last")]
        lines.append(f"| {dtype} | " + " | ".join("-" if m is None else f"{m:.4g} ± {h:.2g}" for m, h in cells) + " |")
    (m0, h0), (m1, h1) = stats(dtypes[0], "reward_last"), stats(dtypes[-1], "reward_last")
    if len(seeds) < 2:
        lines += ["", "One seed: no seed spread to judge the reward difference against."]
    elif len(dtypes) > 1 and m0 is not None and m1 is not None:
        verdict = "within" if abs(m1 - m0) <= max(h0, h1) else "OUTSIDE"
        lines += ["", f"Last-10-step reward: {dtypes[-1]} {m1:.3f} vs {dtypes[0]} {m0:.3f}, difference "
                      f"{m1 - m0:+.3f}, {verdict} the seed spread (±{max(h0, h1):.3f})."]
    return _write(out, "rollout-dtype", rows, lines)


def _write(out: Path, name: str, rows: dict, lines: list[str]) -> dict:
    (out / f"{name}.json").write_text(json.dumps(rows, indent=2))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows
