"""Step 3 of an RL step (``Trainer.update``): the co-training update and its commit point.

The step's rollouts and advantages go to the layout's step machinery (``Learner.step``, a
``codraft.parallel.step.TrainStep`` chosen once by ``codraft.parallel.parallelize``): the packed policy
forward -> L_RL(θ) + λ·L_draft(φ; x, sg(H_θ(x))) and one backward over this rank's part of the step (its rows
under cp, its groups under dp, its stage under pp), the gradients summed over the ranks that share them and
clipped. Then the policy and draft optimisers step (draft.mode=cotrain) and the engine's copy is refreshed
(``time_refit``; ``refit_peak_bytes`` where it gathers shards). Its phases are timed (``PhaseTimer``:
time_loss_forward, time_draft_loss, time_backward, time_optimizer in the metrics, within time_train).

Faults: a step whose loss or grad norm is NaN/inf is skipped (no optimiser step, `skipped_update`; the
trainer stops the run after `grpo.max_nonfinite_steps` of those in a row). The commit point
(``commit``) holds Ctrl-C and SIGTERM until every optimiser and scheduler has stepped, so a step's update is
all-or-nothing; with ``rollout.dtype=bfloat16`` it also refreshes the rollout weights' bf16 copy, and with
``rollout.backend=vllm`` it pushes the weights into vLLM (``time_refit``) and checks them (``time_refit_check``,
``codraft.vllm.refit``).
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from codraft.config import RunConfig
from codraft.parallel.step import TrainStep
from codraft.rl.interrupt import hold_signals
from codraft.rl.memory import PeakMemory
from codraft.rl.objective import CoTraining
from codraft.rl.rollout_phase import Rollout
from codraft.rl.scoring import Scored
from codraft.rollout.weights import RolloutWeights
from codraft.train.seeding import step_seed
from codraft.vllm.backend import VllmBackend


def adamw(params, **kw) -> torch.optim.AdamW:
    """AdamW, with the fused kernel on CPU/CUDA: several times faster than foreach on CPU
    (docs/bench-e2e.md has the figures). Parameters of several kinds (tensor parallelism: plain norms beside
    DTensor products, or DTensors of two meshes), which one fused call refuses: one parameter at a time."""
    params = list(params)
    if len({p.device_mesh if isinstance(p, DTensor) else None for p in params}) > 1:
        return torch.optim.AdamW(params, foreach=False, **kw)
    return torch.optim.AdamW(params, fused=all(p.device.type in ("cpu", "cuda") for p in params) or None, **kw)


class PhaseTimer:
    """Wall time of named phases of one step: ``with timer("backward"): ...`` adds to ``seconds["backward"]``.

    ``cotrain_loss`` takes one as its ``phase`` hook and times the draft loss with it, so the
    caller reads the breakdown of the update (``Update.timings``) without wrapping any function.
    """

    def __init__(self, *names: str):
        self.seconds: dict[str, float] = dict.fromkeys(names, 0.0)

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class Optimisers:
    """The policy's and the co-trained draft's AdamW and schedules (the draft's None when it is not trained)."""
    policy: torch.optim.Optimizer
    policy_sched: torch.optim.lr_scheduler.LRScheduler
    draft: torch.optim.Optimizer | None = None
    draft_sched: torch.optim.lr_scheduler.LRScheduler | None = None

    def step(self) -> None:
        self.policy.step()  # (under pp: this stage's parameters)
        if self.draft is not None:
            self.draft.step()

    def schedule(self) -> None:
        self.policy_sched.step()
        if self.draft_sched is not None:
            self.draft_sched.step()

    def as_dict(self) -> dict:
        """By the names checkpoints keep them under."""
        return {"policy": self.policy, "policy_sched": self.policy_sched, "draft": self.draft,
                "draft_sched": self.draft_sched}


@dataclass
class Learner:
    """What an update reads and changes: the trained models, the layout's step machinery
    (``codraft.parallel.parallelize``), the optimisers, and what decodes the next rollout (refreshed at the
    commit point)."""
    policy: torch.nn.Module
    draft: torch.nn.Module | None
    trains_draft: bool
    step: TrainStep
    optimisers: Optimisers
    rollout_weights: RolloutWeights
    vllm: VllmBackend | None = None      # rollout.backend=vllm
    reference: torch.nn.Module | None = None  # grpo.kl_coef > 0: the initial policy
    policy_dtype: torch.dtype = torch.float32  # the products of the losses (grpo.precision, draft.precision)
    draft_dtype: torch.dtype = torch.float32
    device: str = "cpu"


@dataclass
class Update:
    """Step 3: the co-training update, committed (or skipped when non-finite)."""
    loss: torch.Tensor          # detached total loss
    metrics: dict               # cotrain_loss's policy/* and draft/* metrics
    policy_grad_norm: torch.Tensor
    draft_grad_norm: torch.Tensor | None  # None when the draft is not trained
    finite: bool                # False: update skipped
    nonfinite_streak: int       # skipped updates in a row, this one included
    timings: dict               # seconds: train (the whole update), loss_forward (draft_loss included),
    #                             draft_loss (when the draft trains), backward (with clipping), optimizer
    refit_peak: int | None = None  # bytes the refit added at its peak, where it gathers shards


def update(cfg: RunConfig, learner: Learner, step: int, rollout: Rollout, scored: Scored, *, streak: int,
           committed: Callable[[int], None]) -> Update:
    """3. The layout's forward and backward of L_RL + λ·L_draft over this rank's part of the step, with the
    gradient sums and the clipping (``learner.step``), then the commit (``commit``); a non-finite loss or grad
    norm drops the gradients instead (the schedulers still step). ``streak``: the skipped updates before this
    one; ``committed(streak)`` is called at the commit point (see ``commit``)."""
    g = cfg.grpo
    t_train = time.perf_counter()
    timer = PhaseTimer("train", "loss_forward", "backward", "optimizer")
    learner.policy.train()
    loss_kw = dict(temperature=cfg.rollout.temperature, lam=cfg.draft.lam, eps_low=g.eps_low, eps_high=g.eps_high,
                   norm=g.norm, kl_coef=g.kl_coef, reference=learner.reference, tis_cap=g.tis_cap or None,
                   train_draft=learner.trains_draft, policy_dtype=learner.policy_dtype,
                   draft_dtype=learner.draft_dtype, draft_seed=step_seed(cfg.seed, step),  # anchors: any layout
                   phase=timer, **({"router_aux_coef": g.router_aux_coef} if g.router_aux_coef else {}))
    out = rollout.out
    objective = CoTraining(learner.policy, learner.draft, loss_kw, rollout.prompts, [o.tokens for o in out],
                           [o.logprobs for o in out], [o.mask for o in out],
                           [o.routes for o in out] if g.routing_replay else None, scored.advantages,
                           cfg.rollout.group_size, cfg.device)
    grads = learner.step.forward_backward(objective, step, timer)
    loss, policy_norm, draft_norm = grads.loss.detach(), grads.policy_norm, grads.draft_norm
    finite = all(math.isfinite(float(x)) for x in (loss, policy_norm, 0.0 if draft_norm is None else draft_norm))
    streak = 0 if finite else streak + 1
    if not finite:  # one bad batch must not corrupt θ, φ or the Adam moments: drop its gradients
        learner.step.zero_grad()
        warnings.warn(f"step {step}: non-finite loss or grad norm (loss={float(loss):.4g}, policy grad norm="
                      f"{float(policy_norm):.4g}); update skipped ({streak} in a row)",
                      stacklevel=4)  # at Trainer.step()'s caller
    peak = commit(learner, step, finite, timer, lambda: committed(streak))
    timer.seconds["train"] = time.perf_counter() - t_train
    return Update(loss, grads.metrics, policy_norm, draft_norm, finite, streak, timer.seconds, peak)


def commit(learner: Learner, step: int, finite: bool, timer: PhaseTimer, committed: Callable[[], None]) -> int | None:
    """Commit point: a Ctrl-C or SIGTERM here waits until every optimiser and scheduler has stepped, so the
    step's update is all-or-nothing; ``committed`` (the caller's record that the step is complete) runs inside
    it too. (Schedulers step on skipped updates too: the LR stays a function of the step index.) Returns the
    bytes the refit added at its peak where it gathers the trainer's shards, else None."""
    peak = None
    with hold_signals():
        if finite:
            with timer("optimizer"):
                learner.optimisers.step()
            learner.step.after_optimizer(timer)  # (pipeline stages: every stage's update to every rank)
            weights = learner.rollout_weights
            if weights.copies:  # the refit: the engine's copy gathered / cast from the trainer's
                gauge = PeakMemory(learner.device) if weights.gather else contextlib.nullcontext()
                with timer("refit"), gauge as gauged:
                    weights.refresh()
                peak = None if gauged is None else gauged.bytes  # (the gathered tensors, transient)
            if learner.vllm is not None:  # rollout.backend=vllm: the weights pushed into vLLM in place, then checked
                with timer("refit"):
                    learner.vllm.refit(learner.draft if learner.trains_draft else None)
                with timer("refit_check"):
                    learner.vllm.check(f"step {step}")
        learner.optimisers.schedule()
        committed()
    return peak
