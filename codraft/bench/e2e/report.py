"""The summary of `codraft bench e2e`: per-side medians, TRL/codraft ratios, the printed tables, the JSON."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from codraft.bench import format_table, median

# the step-time ratio TRL/codraft that counts as the goal: codraft's full step at least 2x faster than TRL's
TARGET_RATIO = 2.0
# and a side with a draft against codraft/none: speculation's goal for the whole step (#14)
TARGET_VS_NONE = 1.3

_KEYS = ("rollout_s", "train_s", "step_s", "train_forward_s", "train_backward_s", "optimizer_s", "generate_s",
         "draft_forward_s", "other_s", "completion_len", "completion_max", "decode_rounds", "tokens_per_s",
         "acceptance_length", "others_cores", "rollout_speedup", "reward_mean")


def medians(records: list[dict], warmup: int) -> dict:
    """The median of each figure over the steps after the first ``warmup`` (figures a side lacks are left out)."""
    timed = records[warmup:]
    out = {}
    for k in _KEYS:
        vals = [r[k] for r in timed if r.get(k) is not None]
        if vals:
            out[k] = median(vals)
    return out


def add_ratios(result: dict):
    """TRL's median time over each codraft side's (step, rollout, train), and whether the step ratio
    reaches ``TARGET_RATIO``; nothing when TRL did not run."""
    trl_m = result["sides"].get("trl", {}).get("median")
    if not trl_m:
        return
    result["ratios"] = {name: {"step": trl_m["step_s"] / s["median"]["step_s"],
                               "rollout": trl_m["rollout_s"] / s["median"]["rollout_s"],
                               "train": trl_m["train_s"] / s["median"]["train_s"]}
                        for name, s in result["sides"].items() if name != "trl"}
    result["target"] = {"ratio": TARGET_RATIO, "met": {n: r["step"] >= TARGET_RATIO
                                                       for n, r in result["ratios"].items()}}


def add_vs_none(result: dict):
    """Each draft side against ``codraft/none`` in the same run: none's time over the side's for the
    step, rollout and train parts, and what bounds the step's ratio (Amdahl): ``free_rollout``, the
    ratio had the side's rollout taken no time at all (its train part, draft loss included, stays);
    ``rollout_needed``, how much faster than none's its rollout would have to be for
    ``TARGET_VS_NONE`` (None where even a free rollout falls short). Nothing without a none side."""
    none = result["sides"].get("codraft/none", {}).get("median")
    if not none:
        return
    out = {}
    for name, side in result["sides"].items():
        m = side.get("median")
        if name in ("codraft/none", "trl") or not m:
            continue
        rest = m["step_s"] - m["rollout_s"]  # train, reward and the rest: what speculation cannot shorten
        room = none["step_s"] / TARGET_VS_NONE - rest
        out[name] = {"step": none["step_s"] / m["step_s"], "rollout": none["rollout_s"] / m["rollout_s"],
                     "train": none["train_s"] / m["train_s"], "rollout_share": none["rollout_s"] / none["step_s"],
                     "free_rollout": none["step_s"] / rest,
                     "rollout_needed": none["rollout_s"] / room if room > 0 else None}
    if out:
        result["vs_none"] = {"target": TARGET_VS_NONE, "sides": out}


def table(result: dict) -> str:
    sides = result["sides"]
    trl = sides.get("trl", {}).get("median")

    def ratio(m, key):
        return trl[key] / m[key] if trl and m.get(key) else None
    rows = []
    for name, s in sides.items():
        m = s.get("median") or {}
        rows.append([name, m.get("rollout_s"), m.get("train_s"), m.get("step_s"), m.get("acceptance_length"),
                     m.get("completion_len"), m.get("completion_max"), ratio(m, "rollout_s"), ratio(m, "train_s"),
                     ratio(m, "step_s")])
    head = ["side", "rollout s", "train s", "step s", "tau", "mean len", "max len", "TRL/x rollout",
            "TRL/x train", "TRL/x step"]
    keys2 = ("train_forward_s", "train_backward_s", "optimizer_s", "generate_s", "tokens_per_s", "others_cores")
    rows2 = [[name, *((s.get("median") or {}).get(k) for k in keys2)] for name, s in sides.items()]
    head2 = ["side", "train fwd s", "train bwd+clip s", "optim s", "generate s", "rollout tok/s", "others cores"]
    return format_table(rows, head) + "\n\n" + format_table(rows2, head2)


def print_report(result: dict, log: Callable[[str], None]):
    s = result["settings"]
    log("")
    log(f"e2e: {s['prompts']} prompts x {s['group']} completions x <= {s['max_new_tokens']} tokens, {s['policy']} "
        f"fp32, threads={s['threads']}, median of {s['steps']} steps after {s['warmup']} warm-up")
    log(table(result))
    for name, r in result.get("vs_none", {}).get("sides", {}).items():
        needed = f"{r['rollout_needed']:.2f}x" if r["rollout_needed"] else "unreachable: the rest alone is too slow"
        log(f"{name} vs codraft/none: step {r['step']:.2f}x (target >= {TARGET_VS_NONE}), rollout {r['rollout']:.2f}x, "
            f"train {r['train']:.2f}x; the rollout is {r['rollout_share']:.0%} of none's step, so a free rollout "
            f"would give {r['free_rollout']:.2f}x and the target needs a rollout faster than none's by {needed}")
    if "target" in result:
        log(f"target TRL/codraft step >= {TARGET_RATIO}: " +
            ", ".join(f"{n}: {'met' if ok else 'NOT met'}" for n, ok in result["target"]["met"].items()))


def write_json(result: dict, path, log: Callable[[str], None]):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, default=_json_default))
    log(f"wrote {path}")


def _json_default(x):
    if isinstance(x, torch.Tensor):
        return x.tolist() if x.numel() > 1 else x.item()
    if isinstance(x, Path):
        return str(x)
    return repr(x)
