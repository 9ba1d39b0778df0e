"""The two rollout backends as `codraft bench rollout` drives them: per mode (plain, spec) an engine with
codraft's ``Engine.generate`` interface and the refit the trainer runs before that engine decodes again.

  codraft  ``Engine`` over the rollout weights (``RolloutWeights``: the trainer's own at float32, a weight-only
           copy at bfloat16), the draft shared; refit: ``RolloutWeights.refresh`` + ``check``, the same for
           both modes (with no copy both return at once: the engine decodes the trainer's weights)
  vllm     ``VllmBackend``'s speculative and plain engines; refit: spec ``refit.push`` of the policy and the
           draft + the probe check, plain the policy's push + check (``VllmBackend.sync``), as the trainer
           runs them. Built without its start-up lossless self-check (800 sampled continuations: a start-up
           cost of a run, not of a rollout)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from codraft.config import load_config
from codraft.rollout import Engine
from codraft.rollout.weights import RolloutWeights
from codraft.vllm.backend import VllmBackend

MODES = ("plain", "spec")


@dataclass
class Sides:
    """What one backend decodes with: ``engines[mode]`` and ``refits[mode]`` (no arguments, the trainer's
    current weights pushed and checked), and a line saying what the refit is."""
    engines: dict[str, object]
    refits: dict[str, Callable[[], object]]
    refit_what: str


def codraft_sides(policy, draft, *, gamma: int, dtype: str) -> Sides:
    weights = RolloutWeights(policy, getattr(torch, dtype))
    target = weights.policy
    engines = {"plain": Engine(target), "spec": Engine(target, weights.draft_for(draft), gamma)}

    def refit():
        weights.refresh()
        weights.check("bench rollout")

    what = f"RolloutWeights.refresh + check of the {dtype} copy" if weights.copies else \
        "none: the engine decodes the trainer's weights (refresh + check timed, they return at once)"
    return Sides(engines, {"plain": refit, "spec": refit}, what)


def vllm_sides(policy, draft, *, policy_dir: str, gamma: int, taps: list[int], dtype: str, kv_cache_gb: int,
               max_rows: int, probe: list[int]) -> Sides:
    cfg = load_config(None, [f"policy.init={policy_dir}", "rollout.backend=vllm", "draft.kind=eagle3",
                             f"draft.gamma={gamma}", f"draft.taps={','.join(map(str, taps))}",
                             f"rollout.dtype={'policy' if dtype == 'float32' else dtype}",
                             f"rollout.vllm_kv_cache_gb={kv_cache_gb}",
                             "rollout.temperature=0"])  # (only skips the self-check: each call names its own)
    backend = VllmBackend(cfg, policy, draft, probe, max_rows=max_rows, announce=False)

    def refit_spec():
        backend.refit(draft)
        backend.check("bench rollout")

    def refit_plain():  # (after refit_spec: the plain engine is one version behind, as in the trainer)
        backend.sync(backend.plain)

    return Sides({"plain": backend.plain_engine, "spec": backend.engine}, {"spec": refit_spec, "plain": refit_plain},
                 f"refit.push + refit.check ({dtype}): spec the policy and the draft, plain the policy")
