"""The update's machinery at a layout, behind one interface (``TrainStep``), chosen once by
``codraft.parallel.parallelize``: the forward and backward of the step's objective (the caller's, ``Objective``:
the co-training loss) over this rank's part of the step, the sums of the gradients over the ranks that share
them, the clipping by the global norms, and after the optimiser step what every rank must see of it. Nothing
here knows the loss or the RL config: the objective packs the parts this cuts and computes their losses.

* ``OneBatch`` (one process, tp, cp): one packed forward and backward. Under cp each rank runs its zigzag rows
  of the batch (``codraft.parallel.context.ShardedRow`` installs the ring attention per batch: the split follows
  the batch's sequences) and the gradient shares are summed over cp.
* ``DataParallel`` (dp without stages, FSDP2 or replicate): the step's groups as dp × ``parallel.microbatches``
  micro-batches, this DP rank's in turn, each normalised by the step's totals (``codraft.rl.microbatch``), so
  the gradients FSDP sums over the ranks after the last one are the one-batch step's.
* ``Pipelined`` (``parallel.pp``, or micro-batches without FSDP): this rank's stage over the micro-batches
  (1F1B, ``codraft.parallel.pipelined``), the stages' gradient sums and clipping, and after the optimiser step
  every stage's update broadcast to every rank (its engine decodes the whole policy).

Each returns the step's loss and metrics (the same on every rank) and both gradient norms before clipping.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from codraft.parallel.data_parallel import named_collectives
from codraft.parallel.gradients import clip_grad_norm, clip_stage_gradients, reduce_stage_gradients, sync_gradients, \
    sync_stage_weights
from codraft.parallel.mesh import Mesh
from codraft.parallel.pipeline import stage_parameters
from codraft.parallel.pipelined import StageObjective, run_stage
from codraft.parallel.stages import open_channel, split_pipeline


class Objective(StageObjective, Protocol):
    """What a step trains, given by the caller each step (``codraft.rl.objective.CoTraining``): the step's
    rollouts, the models and the loss. The machinery decides how the step is cut and which part a rank runs;
    the objective packs the parts and computes their losses (under pipeline stages: ``StageObjective``'s)."""

    def whole(self):
        """The step as one packed batch."""

    def microbatches(self, n: int) -> list:
        """The step as ``n`` packed micro-batches of whole groups, each normalised by the step's totals."""

    def loss(self, mb, cp) -> tuple[torch.Tensor, dict]:
        """One (micro-)batch's policy forward and co-training loss (under cp: on this rank's rows of it)."""

    def merge(self, parts: list[dict], mbs: list) -> dict:
        """The micro-batches' metrics -> the step's."""


@dataclass
class Grads:
    """What a step's forward and backward leave: the loss and metrics, and the norms before clipping."""
    loss: torch.Tensor
    metrics: dict
    policy_norm: torch.Tensor
    draft_norm: torch.Tensor | None  # None when the draft is not trained


class TrainStep:
    """The update's body at one layout (see the module doc): ``forward_backward``, then the caller's optimiser
    steps, then ``after_optimizer``; ``owned`` are the parameters this rank's optimisers step."""

    def __init__(self, policy, draft, mesh: Mesh | None, *, trains_draft: bool, grad_clip: float, draft_clip: float):
        self.policy, self.draft, self.mesh = policy, draft, mesh
        self.trains_draft = trains_draft
        self.grad_clip, self.draft_clip = grad_clip, draft_clip

    @property
    def cp(self):
        return None if self.mesh is None else self.mesh.cp_group

    def owned(self) -> tuple[list, list]:
        """The policy and draft parameters this rank trains (all of them but under pipeline stages)."""
        return list(self.policy.parameters()), list(self.draft.trainable_parameters()) if self.trains_draft else []

    def zero_grad(self) -> None:
        for p in (p for ps in self.owned() for p in ps):
            p.grad = None

    def forward_backward(self, objective: Objective, step: int, timer) -> Grads:
        """The step's forward and backward at this layout, the gradients summed and clipped; ``timer(name)``
        times its phases."""
        raise NotImplementedError

    def after_optimizer(self, timer) -> None:
        """After the optimiser steps: nothing, but under pipeline stages."""

    def close(self) -> None:
        """At the end of a run every rank reached: nothing, but the pipeline's tap channel."""

    def _clip(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        policy, drafts = self.owned()
        return clip_grad_norm(policy, self.grad_clip), clip_grad_norm(drafts, self.draft_clip) \
            if self.trains_draft else None

    def _microbatches(self, objective: Objective, n: int) -> tuple[list, list]:
        """The step's groups as dp × ``n`` micro-batches, and this DP rank's (or replica's) ``n`` of them."""
        dp = 1 if self.mesh is None else self.mesh.dp
        mbs = objective.microbatches(dp * n)
        return mbs, mbs[self.mesh.dp_rank * n:(self.mesh.dp_rank + 1) * n] if dp > 1 else mbs

    def _over_replicas(self, loss: torch.Tensor, parts: list[dict]) -> tuple[torch.Tensor, list[dict]]:
        """This DP rank's loss and per-micro-batch metrics -> the step's: the losses summed and every rank's
        metrics in the step's order (one gather); unchanged without data parallelism."""
        if self.mesh is None or self.mesh.dp == 1:
            return loss, parts
        shared = self.mesh.dp_group.all_gather_object((float(loss), parts),
                                                      "the data-parallel ranks' losses and metrics")
        return torch.tensor(sum(x for x, _ in shared)), [p for _, share in shared for p in share]


class OneBatch(TrainStep):
    def forward_backward(self, objective: Objective, step: int, timer) -> Grads:
        split = self.mesh is not None and self.mesh.tp > 1  # the products' collectives: a peer that hangs is named
        with timer("loss_forward"), self._named("the policy's forward (tensor-parallel all-reduces)", split):
            loss, metrics = objective.loss(objective.whole(), self.cp)
        self.zero_grad()
        with timer("backward"), self._named("the backward (tensor-parallel all-reduces)", split):
            loss.backward()
            if self.cp is not None:  # each rank holds its share of the gradient: the sum is the gradient
                sync_gradients(self.policy.parameters(), self.cp, "policy")
                if self.trains_draft:
                    sync_gradients(self.draft.trainable_parameters(), self.cp, "draft")
            return Grads(loss, metrics, *self._clip())

    def _named(self, what: str, on: bool):
        return named_collectives(self.mesh, what, "tensor-parallel") if on else contextlib.nullcontext()


class DataParallel(TrainStep):
    def __init__(self, *args, microbatches: int, **kw):
        super().__init__(*args, **kw)
        self.microbatches = microbatches

    def forward_backward(self, objective: Objective, step: int, timer) -> Grads:
        mbs, mine = self._microbatches(objective, self.microbatches)
        wrapped = [self.policy, *([self.draft] if self.trains_draft else [])]
        self.zero_grad()
        losses, metrics = [], []
        for i, mb in enumerate(mine):
            for module in wrapped:  # accumulate locally; sum over the ranks after the last micro-batch only
                module.set_requires_gradient_sync(i == len(mine) - 1)
            with timer("loss_forward"), named_collectives(self.mesh, "the policy's forward (FSDP all-gathers)"):
                loss, m = objective.loss(mb, self.cp)
            with timer("backward"), named_collectives(self.mesh, "the backward (FSDP gradient sums)"):
                loss.backward()
            losses.append(loss.detach())
            metrics.append(m)
        with timer("backward"):
            norms = self._clip()
        loss, parts = self._over_replicas(torch.stack(losses).sum(), metrics)
        return Grads(loss, objective.merge(parts, mbs), *norms)


class Pipelined(TrainStep):
    def __init__(self, *args, par, rollout, **kw):
        """``par``, ``rollout``: the run config's sections (the tap transport and budget, the step's size)."""
        super().__init__(*args, **kw)
        self.par, self.rollout = par, rollout
        self.pipe = split_pipeline(self.policy, self.draft if self.trains_draft else None, self.mesh,
                                   transport=par.taps, timeout=par.timeout)
        self._opened = False

    def owned(self) -> tuple[list, list]:
        policy, drafts = super().owned()
        if self.mesh is None or self.mesh.pp == 1:
            return policy, drafts
        return stage_parameters(self.policy, self.mesh.stage, self.mesh.pp), drafts if self.mesh.last else []

    def forward_backward(self, objective: Objective, step: int, timer) -> Grads:
        self.zero_grad()
        mbs, mine = self._microbatches(objective, self.par.microbatches)
        if not self._opened:  # collective (the tap channels): on the first update, sized from its batch
            open_channel(self.pipe, self.policy, self.par.tap_tokens or self._tap_tokens(mine))
            self._opened = True
        fsdp = named_collectives(self.mesh, "the stage's forward and backward (FSDP's all-gathers and gradient "
                                            "sums)") if self.pipe.sharded else contextlib.nullcontext()
        with timer("forward_backward"), fsdp:  # (the schedule's own sends name their peers)
            loss, parts = run_stage(self.pipe, self.policy, self.draft if self.trains_draft else None, objective,
                                    mine, step)
        loss, parts = self._over_replicas(loss, parts)
        with timer("backward"):  # here: the gradient sums and the clipping
            own, drafts = reduce_stage_gradients(self.pipe, self.policy, self.owned()[1])
            norms = clip_stage_gradients(self.pipe, self.policy, own, drafts, self.grad_clip,
                                         self.draft_clip if self.trains_draft else None)
        return Grads(loss, objective.merge(parts, mbs), *norms)

    def after_optimizer(self, timer) -> None:
        """Every rank's rollout engine decodes with every stage's update."""
        with timer("weight_sync"):
            sync_stage_weights(self.pipe, self.policy,
                               list(self.draft.trainable_parameters()) if self.trains_draft else [])

    def close(self) -> None:
        if self.pipe.channel is not None:
            self.pipe.channel.close()

    def _tap_tokens(self, mbs: list) -> int:
        """TapChannel slots (tokens of one micro-batch at one rank) for the longest micro-batch the run can
        produce: the largest group count per micro-batch, each with twice this step's longest prompt and
        every completion at rollout.max_new_tokens; under CP a rank's share plus the zigzag padding."""
        r, par = self.rollout, self.par
        groups = -(-r.prompts_per_step // (par.microbatches * par.dp))  # (a DP replica's micro-batches)
        longest = max(int(mb.batch.cu_seqlens.diff().max()) for mb in mbs)  # a prompt and its completion
        tokens = groups * (2 * longest + r.group_size * r.max_new_tokens)
        return tokens if par.cp == 1 else -(-tokens // par.cp) + 2 * par.cp * groups * (r.group_size + 1)
