"""`codraft bench draft-length`: how far the adaptive draft length's cost model is from the rounds it prices.

``gamma="auto"`` (``codraft.rollout.draft_length``) picks each round's g from a ``CostModel`` calibrated
once per machine: T_target(rows, g+1) for the verify (or plain step) and T_draft(rows, g) for the draft's
propose + commit. Here rollouts of held-out prompts (the model's default task, val split) run with
``gamma="auto"``, B at a time, sampling at ``temperature`` (1: as RL rollouts do) with EOS on; every
round is timed through the rollout's own stats and filed under (live rows, chosen g), next to what the
cost model predicts for it:

  target   the round's ``verify_s`` (target forward + the accept rule, or a plain step + sampling)
  draft    the round's ``draft_s + bookkeeping_s`` (propose + commit, and the round's host work)

The rule compares rates across g at one row count, so what matters is whether measured / predicted
differs between the g's of one row count (the summary's spread), more than how far it is from 1.
"""
from __future__ import annotations

import json
from collections import defaultdict

import torch

from codraft.bench import format_table, machine_info
from codraft.bench.spec import MODELS, _prompts
from codraft.policy import load_policy
from codraft.rollout import Engine, load_or_calibrate
from codraft.rollout.weights import RolloutWeights
from codraft.train.offline_draft import draft_for_command


def measure(engine: Engine, prompts: list[list[int]], *, batch: int, repeats: int, max_new_tokens: int,
            temperature: float, eos_id: list[int]) -> tuple[list[dict], dict]:
    """Rollouts of ``prompts`` by ``engine`` (gamma="auto"), ``batch`` at a time, ``repeats`` times (other
    seeds each time). Returns the cells, one per (live rows, g) seen, sorted: rounds and summed measured
    and predicted seconds of each part; and the totals the rollouts' own stats report (rounds, verify_s,
    the draft and bookkeeping seconds of their steps, rounds by g)."""
    cost = engine.cost_model
    cells = defaultdict(lambda: {"rounds": 0, "target_s": 0.0, "target_pred_s": 0.0, "draft_s": 0.0,
                                 "draft_pred_s": 0.0})
    totals = {"rounds": 0, "verify_s": 0.0, "step_draft_s": 0.0, "gamma_chosen": [0] * (engine.gamma + 1)}
    for rep in range(repeats):
        for i in range(0, len(prompts), batch):
            run = engine.start(prompts[i:i + batch], max_new_tokens, temperature=temperature, eos_id=eos_id,
                               seed=1 + i + len(prompts) * rep)
            s = run.stats  # (the rollout's; the engine's are only set when generate() ends)
            start = s.draft_s + s.bookkeeping_s  # the prefill's part (the draft's begin)
            while not run.finished:
                rows = run.rows.numel()
                g = run.draft_length(rows)  # what step() is about to choose: the rule reads no clock
                before = s.verify_s, s.draft_s + s.bookkeeping_s, s.rounds
                run.step()
                if s.rounds == before[2]:
                    continue  # (no round: the rollout had already finished)
                c = cells[rows, g]
                c["rounds"] += 1
                c["target_s"] += s.verify_s - before[0]
                c["draft_s"] += s.draft_s + s.bookkeeping_s - before[1]
                c["target_pred_s"] += cost.target(rows, g + 1)
                c["draft_pred_s"] += cost.draft(rows, g)
            totals["rounds"] += s.rounds
            totals["verify_s"] += s.verify_s
            totals["step_draft_s"] += s.draft_s + s.bookkeeping_s - start
            totals["gamma_chosen"] = [a + b for a, b in zip(totals["gamma_chosen"], s.gamma_chosen)]
    out = []
    for (rows, g), c in sorted(cells.items()):
        n = c["rounds"]
        out.append({"rows": rows, "g": g, **c,
                    "target_ms": 1e3 * c["target_s"] / n, "target_pred_ms": 1e3 * c["target_pred_s"] / n,
                    "draft_ms": 1e3 * c["draft_s"] / n, "draft_pred_ms": 1e3 * c["draft_pred_s"] / n,
                    "target_ratio": _ratio(c["target_s"], c["target_pred_s"]),
                    "draft_ratio": _ratio(c["draft_s"], c["draft_pred_s"])})
    return out, totals


def _ratio(measured: float, predicted: float) -> float | None:
    return measured / predicted if predicted > 0 else None


def spread(cells: list[dict]) -> list[dict]:
    """Per row count with rounds at two or more g's: the lowest and highest measured / predicted of the
    whole round (target + draft) over its g's; equal ratios leave the rule's choice as it would be with
    exact costs, however far from 1 they are."""
    by_rows = defaultdict(list)
    for c in cells:
        pred = c["target_pred_s"] + c["draft_pred_s"]
        if pred > 0:
            by_rows[c["rows"]].append((c["g"], (c["target_s"] + c["draft_s"]) / pred))
    out = []
    for rows, gs in sorted(by_rows.items()):
        if len(gs) > 1:
            lo, hi = min(gs, key=lambda x: x[1]), max(gs, key=lambda x: x[1])
            out.append({"rows": rows, "gs": [g for g, _ in gs], "lowest": {"g": lo[0], "ratio": lo[1]},
                        "highest": {"g": hi[0], "ratio": hi[1]}, "spread": hi[1] / lo[1]})
    return out


def run(model_name: str = "smollm2", draft: str = "dspark", draft_init: str = "offline", dtype: str = "float32",
        batch: int = 8, prompts: int = 16, repeats: int = 2, max_new_tokens: int = 128, temperature: float = 1.0,
        threads: int = 2, json_path: str | None = None) -> dict:
    if batch < 1 or prompts < 1 or repeats < 1:
        raise ValueError(f"--batch, --prompts and --repeats must be >= 1, got {batch}, {prompts}, {repeats}")
    torch.set_num_threads(threads)
    policy, tok, folder = load_policy(MODELS.get(model_name, model_name))
    policy.eval()
    d = draft_for_command(draft, policy, tok, folder, init=draft_init)
    weights = RolloutWeights(policy, getattr(torch, dtype))  # as the trainer's rollout.dtype places them
    target, d = weights.policy, weights.draft_for(d)
    cost = load_or_calibrate(target, d, d.default_gamma, batch)
    engine = Engine(target, d, "auto", cost_model=cost)
    held_out = _prompts(tok, prompts)
    engine.generate(held_out[:batch], 16, temperature=1.0, eos_id=[tok.eos_id], seed=0)  # warm-up
    cells, totals = measure(engine, held_out, batch=batch, repeats=repeats, max_new_tokens=max_new_tokens,
                            temperature=temperature, eos_id=[tok.eos_id])
    spreads = spread(cells)
    print(f"bench draft-length: {model_name} ({dtype}) with {draft} ({draft_init}), gamma=auto up to "
          f"{engine.gamma}, batch {batch}, {prompts} prompts x {repeats}, T={temperature}, {threads} threads")
    print("ms a round, measured and as the cost model predicts (measured / predicted)")
    print(format_table([[c["rows"], c["g"], c["rounds"], c["target_ms"], c["target_pred_ms"], c["target_ratio"],
                         c["draft_ms"], c["draft_pred_ms"], c["draft_ratio"]] for c in cells],
                       ["rows", "g", "rounds", "target", "predicted", "ratio", "draft+bookkeeping", "predicted",
                        "ratio"]))
    for s in spreads:
        print(f"  {s['rows']} rows: whole round measured / predicted {s['lowest']['ratio']:.2f} (g={s['lowest']['g']}) "
              f"to {s['highest']['ratio']:.2f} (g={s['highest']['g']}), spread {s['spread']:.2f}")
    print(f"acceptance estimate at the end: {[round(a, 3) for a in engine.acceptance.values()]}; rounds by g "
          f"{totals['gamma_chosen']}")
    report = {"settings": {"model": model_name, "draft": draft, "draft_init": draft_init, "dtype": dtype,
                           "batch": batch, "prompts": prompts, "repeats": repeats, "max_new_tokens": max_new_tokens,
                           "temperature": temperature, "threads": threads, "max_gamma": engine.gamma},
              "machine": machine_info(),
              "cost_model": {"rows": list(cost.rows), "target_s": [list(r) for r in cost.target_s],
                             "draft_s": [list(r) for r in cost.draft_s]},
              "acceptance": list(engine.acceptance.values()), "cells": cells, "spread": spreads, "totals": totals}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}")
    return report
