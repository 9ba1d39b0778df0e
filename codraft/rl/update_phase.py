"""Step 3 of an RL step (``Trainer.update``): the co-training update and its commit point.

One packed policy forward -> L_RL(θ) + λ·L_draft(φ; x, sg(H_θ(x))), one backward, policy and draft
optimisers step (draft.mode=cotrain); its phases are timed (``PhaseTimer``: time_loss_forward,
time_draft_loss, time_backward, time_optimizer in the metrics, within time_train). With
``parallel.pp`` / ``parallel.microbatches`` this stage runs its forward and backward over the
micro-batches (1F1B) instead, and syncs every stage's update into every rank's weights.

Context parallelism: every rank runs the same step on its zigzag rows (``cotrain_loss(..., cp=)``) and
the gradients are summed over the ranks before clipping, so every rank applies the same update.
Data parallelism: each DP rank runs its groups as one micro-batch of the step (``codraft.rl.microbatch``),
FSDP2 sums the policy's and the draft's gradients (over dp × cp with CP); after the optimiser step the
engine's full copy is refreshed from the shards (``time_refit``, ``refit_peak_bytes``).

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
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from codraft.config import RunConfig
from codraft.parallel.data_parallel import named_collectives
from codraft.parallel.gradients import clip_grad_norm, clip_stage_gradients, reduce_stage_gradients, sync_gradients, \
    sync_stage_weights
from codraft.parallel.stages import build_pipeline
from codraft.rl.cotrain import cotrain_loss, replay_routes
from codraft.rl.interrupt import hold_signals
from codraft.rl.memory import PeakMemory
from codraft.rl.microbatch import merge_metrics, split_microbatches, with_draft_normaliser
from codraft.rl.pipelined import pipeline_cotrain
from codraft.rl.rollout_phase import Rollout
from codraft.rl.scoring import Scored
from codraft.train.packing import pack
from codraft.train.seeding import step_seed

if TYPE_CHECKING:
    from codraft.rl.trainer import Trainer


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


def update(tr: Trainer, step: int, rollout: Rollout, scored: Scored) -> Update:
    """3. One packed forward, L_RL + λ·L_draft, one backward, clipping, then the commit (`commit`);
    a non-finite loss or grad norm drops the gradients instead (the schedulers still step)."""
    cfg, g = tr.cfg, tr.cfg.grpo
    t_train = time.perf_counter()
    timer = PhaseTimer("train", "loss_forward", "backward", "optimizer")
    tr.policy.train()
    loss_kw = dict(temperature=cfg.rollout.temperature, lam=cfg.draft.lam, eps_low=g.eps_low, eps_high=g.eps_high,
                   norm=g.norm, kl_coef=g.kl_coef, reference=tr.reference, tis_cap=g.tis_cap or None,
                   train_draft=tr.trains_draft, policy_dtype=tr.policy_dtype,
                   draft_dtype=tr.draft_dtype, draft_seed=step_seed(cfg.seed, step),  # anchors: any layout
                   phase=timer)
    loss, lm, policy_norm, draft_norm = tr.forward_backward(tr, step, rollout, scored, timer, loss_kw)
    loss = loss.detach()
    finite = all(math.isfinite(float(x)) for x in (loss, policy_norm, 0.0 if draft_norm is None else draft_norm))
    tr.nonfinite_streak = 0 if finite else tr.nonfinite_streak + 1
    if not finite:  # one bad batch must not corrupt θ, φ or the Adam moments: drop its gradients
        _zero_grad(tr)
        warnings.warn(f"step {step}: non-finite loss or grad norm (loss={float(loss):.4g}, policy grad norm="
                      f"{float(policy_norm):.4g}); update skipped ({tr.nonfinite_streak} in a row)",
                      stacklevel=4)  # at Trainer.step()'s caller
    commit(tr, step, finite, timer)
    timer.seconds["train"] = time.perf_counter() - t_train
    return Update(loss, lm, policy_norm, draft_norm, finite, tr.nonfinite_streak, timer.seconds)


def step_body(layout):
    """This layout's forward + backward of the update, chosen once (the trainer holds it): the pipeline
    schedule (stages, or micro-batches without FSDP), the FSDP2-sharded step (data parallelism without
    stages), or one packed batch (one process, or CP). Each returns (loss, metrics, policy grad norm,
    draft grad norm) with the gradients summed over the ranks that share them and clipped."""
    if layout.pipelined:
        return _pipelined_backward
    return _data_parallel_backward if layout.sharded else _one_batch_backward


def _one_batch_backward(tr: Trainer, step: int, rollout: Rollout, scored: Scored, timer: PhaseTimer,
                        loss_kw: dict):
    """One packed forward and backward (each CP rank on its rows, the gradients summed), then clipping."""
    cfg, g = tr.cfg, tr.cfg.grpo
    batch = pack(rollout.prompts, [o.tokens for o in rollout.out], [o.logprobs for o in rollout.out],
                 device=cfg.device, masks=[o.mask for o in rollout.out])
    replay = replay_routes(batch, [o.routes for o in rollout.out]) if g.routing_replay else None
    split = tr.layout.tp > 1  # the products' collectives: a peer that hangs is named
    with timer("loss_forward"), _named(tr, "the policy's forward (tensor-parallel all-reduces)", split):
        loss, lm = cotrain_loss(tr.policy, tr.draft, batch, scored.advantages.to(cfg.device), cp=tr.cp,
                                replay=replay, router_aux_coef=g.router_aux_coef, **loss_kw)
    _zero_grad(tr)
    with timer("backward"), _named(tr, "the backward (tensor-parallel all-reduces)", split):
        loss.backward()
        if tr.cp is not None:  # each rank holds its share of the gradient: the sum is the gradient
            sync_gradients(tr.policy.parameters(), tr.cp, "policy")
            if tr.trains_draft:
                sync_gradients(tr.draft.trainable_parameters(), tr.cp, "draft")
        policy_norm = clip_grad_norm(tr.policy.parameters(), g.grad_clip)
        draft_norm = None if tr.draft_opt is None else clip_grad_norm(tr.draft.trainable_parameters(),
                                                                      cfg.draft.grad_clip)
    return loss, lm, policy_norm, draft_norm


def _named(tr: Trainer, what: str, on: bool):
    return named_collectives(tr.mesh, what, "tensor-parallel") if on else contextlib.nullcontext()


def _pipelined_backward(tr: Trainer, step: int, rollout: Rollout, scored: Scored, timer: PhaseTimer,
                        loss_kw: dict):
    """parallel.pp / parallel.microbatches: this stage's forward and backward over the micro-batches
    (1F1B), the gradient sums (CP, DP, tied embedding) and the clipping by the global norms. With
    parallel.dp each data-parallel replica of the pipeline runs its share of the step's micro-batches."""
    cfg, par = tr.cfg, tr.cfg.parallel
    _zero_grad(tr)
    mbs, mine = _microbatches(tr, rollout, scored, loss_kw["draft_seed"])
    if tr.pipe is None:  # collective (the tap channels): on the first update, sized from its batch
        tr.pipe = build_pipeline(tr.policy, tr.draft if tr.trains_draft else None, tr.mesh,
                                 transport=par.taps, max_tokens=par.tap_tokens or _tap_tokens(mine, cfg),
                                 timeout=par.timeout)
    fsdp = named_collectives(tr.mesh, "the stage's forward and backward (FSDP's all-gathers and gradient sums)") \
        if tr.pipe.sharded else contextlib.nullcontext()  # (the schedule's own sends name their peers)
    with timer("forward_backward"), fsdp:
        loss, parts = pipeline_cotrain(tr.pipe, tr.policy, tr.draft, mine, step=step, merged=False, **loss_kw)
    loss, parts = _over_replicas(tr, loss, parts)
    with timer("backward"):  # here: the gradient sums and the clipping
        own, drafts = reduce_stage_gradients(tr.pipe, tr.policy, tr._owned()[1])
        policy_norm, draft_norm = clip_stage_gradients(tr.pipe, tr.policy, own, drafts, cfg.grpo.grad_clip,
                                                       cfg.draft.grad_clip if tr.draft_opt is not None else None)
    return loss, merge_metrics(parts, mbs), policy_norm, draft_norm


def _data_parallel_backward(tr: Trainer, step: int, rollout: Rollout, scored: Scored, timer: PhaseTimer,
                            loss_kw: dict):
    """parallel.dp: the step's groups as dp × parallel.microbatches micro-batches, a DP rank running its
    own in turn, each normalised by the step's totals (``codraft.rl.microbatch``), so the gradients FSDP sums
    over the ranks (policy and draft) are the one-batch step's; the sums wait for the last micro-batch;
    loss and metrics merged over the DP ranks as micro-batches'."""
    cfg, mesh = tr.cfg, tr.mesh
    mbs, mine = _microbatches(tr, rollout, scored, loss_kw["draft_seed"])
    wrapped = [tr.policy, *([tr.draft] if tr.trains_draft else [])]
    _zero_grad(tr)
    losses, metrics = [], []
    for i, mb in enumerate(mine):
        for module in wrapped:  # accumulate locally; sum over the ranks after the last micro-batch only
            module.set_requires_gradient_sync(i == len(mine) - 1)
        with timer("loss_forward"), named_collectives(mesh, "the policy's forward (FSDP all-gathers)"):
            loss, lm = cotrain_loss(tr.policy, tr.draft, mb.batch, mb.advantages, cp=tr.cp, totals=mb.totals,
                                    replay=mb.replay, **loss_kw)
        with timer("backward"), named_collectives(mesh, "the backward (FSDP gradient sums)"):
            loss.backward()
        losses.append(loss.detach())
        metrics.append(lm)
    with timer("backward"):
        policy_norm = clip_grad_norm(tr.policy.parameters(), cfg.grpo.grad_clip)
        draft_norm = None if tr.draft_opt is None else clip_grad_norm(tr.draft.trainable_parameters(),
                                                                      cfg.draft.grad_clip)
    loss, parts = _over_replicas(tr, torch.stack(losses).sum(), metrics)
    return loss, merge_metrics(parts, mbs), policy_norm, draft_norm


def _microbatches(tr: Trainer, rollout: Rollout, scored: Scored, draft_seed: int):
    """The step's groups as dp × parallel.microbatches micro-batches (with the step's draft normaliser when
    there are several), and this DP rank's (or replica's) ``parallel.microbatches`` of them."""
    cfg, mesh, m = tr.cfg, tr.mesh, tr.cfg.parallel.microbatches
    dp = 1 if mesh is None else mesh.dp
    mbs = split_microbatches(rollout.prompts, [o.tokens for o in rollout.out], [o.logprobs for o in rollout.out],
                             scored.advantages.to(cfg.device), cfg.rollout.group_size, dp * m, cfg.device,
                             [o.mask for o in rollout.out],
                             [o.routes for o in rollout.out] if cfg.grpo.routing_replay else None)
    if len(mbs) > 1 and tr.trains_draft:  # the draft's denominators: the whole step's (before the DP shares)
        mbs = with_draft_normaliser(mbs, tr.draft, draft_seed)
    return mbs, mbs[mesh.dp_rank * m:(mesh.dp_rank + 1) * m] if dp > 1 else mbs


def _over_replicas(tr: Trainer, loss: torch.Tensor, parts: list[dict]) -> tuple[torch.Tensor, list[dict]]:
    """This DP rank's loss and per-micro-batch metrics -> the step's: the losses summed and every rank's
    metrics in the step's order (one gather); unchanged without data parallelism."""
    if tr.mesh is None or tr.mesh.dp == 1:
        return loss, parts
    shared = tr.mesh.dp_group.all_gather_object((float(loss), parts), "the data-parallel ranks' losses and metrics")
    return torch.tensor(sum(x for x, _ in shared)), [p for _, share in shared for p in share]


def _tap_tokens(mbs, cfg: RunConfig) -> int:
    """TapChannel slots (tokens of one micro-batch at one rank) for the longest micro-batch the run can
    produce: the largest group count per micro-batch, each with twice this step's longest prompt and
    every completion at rollout.max_new_tokens; under CP a rank's share plus the zigzag padding."""
    r, par = cfg.rollout, cfg.parallel
    groups = -(-r.prompts_per_step // (par.microbatches * par.dp))  # (a DP replica's micro-batches)
    longest = max(int(mb.batch.cu_seqlens.diff().max()) for mb in mbs)  # a prompt and its completion
    tokens = groups * (2 * longest + r.group_size * r.max_new_tokens)
    return tokens if par.cp == 1 else -(-tokens // par.cp) + 2 * par.cp * groups * (r.group_size + 1)


def _zero_grad(tr: Trainer):
    tr.opt.zero_grad(set_to_none=True)
    if tr.draft_opt is not None:
        tr.draft_opt.zero_grad(set_to_none=True)


def commit(tr: Trainer, step: int, finite: bool, timer: PhaseTimer):
    """Commit point: a Ctrl-C or SIGTERM here waits until every optimiser and scheduler has stepped, so the
    step's update is all-or-nothing; from here on the step counts as completed. (Schedulers
    step on skipped updates too: the LR stays a function of the step index.)"""
    with hold_signals():
        if finite:
            with timer("optimizer"):
                tr.opt.step()  # (under pp: this stage's parameters)
                if tr.draft_opt is not None:
                    tr.draft_opt.step()
            if tr.pipe is not None:  # every rank's rollout engine decodes with every stage's update
                with timer("weight_sync"):
                    sync_stage_weights(tr.pipe, tr.policy,
                                       list(tr.draft.trainable_parameters()) if tr.trains_draft else [])
            if tr.rollout_weights.copies:  # the refit: the engine's copy gathered / cast from the trainer's
                gauge = PeakMemory(tr.cfg.device) if tr.layout.gathers else contextlib.nullcontext()
                with timer("refit"), gauge as peak:
                    tr.rollout_weights.refresh()
                if peak is not None:
                    tr.last_refit_peak = peak.bytes  # (the gathered tensors, transient)
            if tr.vllm is not None:  # rollout.backend=vllm: the weights pushed into vLLM in place, then checked
                with timer("refit"):
                    tr.vllm.refit(tr.draft if tr.trains_draft else None)
                with timer("refit_check"):
                    tr.vllm.check(f"step {step}")
        tr.sched.step()
        if tr.draft_sched is not None:
            tr.draft_sched.step()
        tr.steps_done, tr._done_prompts, tr._done_acceptance = step + 1, tr.prompts_used, tr._acceptance()
