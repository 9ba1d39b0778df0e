"""The `codraft train` loop: GRPO with speculative rollouts and an online co-trained draft.

Per step (``Trainer.step``: ``rollout`` -> ``probe`` -> ``score`` -> ``update`` -> ``observe``, each
returning a small dataclass):
  1. rollout    the engine (policy θ_t + draft φ_t, lossless speculative decoding) samples
                `group_size` completions for each of `prompts_per_step` training prompts
                (`rollout.draft_length=auto`: each round drafts 0..draft.gamma tokens, as many as
                pay off for the rows still running, none while a fresh draft is still poor; the
                draft co-trains either way, since it learns from the rollout tokens, not from its
                proposals); τ and the histogram of drafts per round (`gamma_chosen`) are logged;
  2. reward     the task scores each completion; GRPO advantages per group;
  3. train      one packed policy forward -> L_RL(θ) + λ·L_draft(φ; x, sg(H_θ(x))),
                one backward, policy and draft optimisers step (draft.mode=cotrain); its phases
                are timed (``PhaseTimer``: time_loss_forward, time_draft_loss, time_backward,
                time_optimizer in the metrics, within time_train);
  4. observe    metrics.jsonl / TensorBoard, every k steps held-out accuracy and the
                measured rollout speedup (a plain-decoding rollout of the same prompts),
                optionally τ of a frozen copy of the initial draft on the same prompts (drift;
                these two run in ``probe``, right after the rollout, and are not in time_step),
                checkpoints; plots at the end.
The engine holds references to the live policy and draft modules, so step t+1's rollout
uses the weights updated at step t with no copy; with ``rollout.dtype=bfloat16`` it decodes a
weight-only bf16 copy (``RolloutWeights``), refreshed after each update and checked against the
trainer's weights before each rollout (a stale copy is a ``StaleRolloutWeights`` error).

Determinism: every step reseeds from (seed, step), so a resumed run repeats an
uninterrupted one's rollouts and updates exactly (timings aside; with draft_length=auto the
running acceptance estimate is checkpointed, and the cost model is the one cached on disk for this
machine, so the same holds on the same machine).

Faults: a reward function that raises scores that sample 0 and is counted (`reward_errors`);
a step whose loss or grad norm is NaN/inf is skipped (no optimiser step, `skipped_update`),
and `grpo.max_nonfinite_steps` of those in a row stop the run with a RuntimeError, no
checkpoint being written while such a streak lasts; Ctrl-C checkpoints the last completed
step before re-raising, so `--resume` continues from it.

Context parallelism (``parallel.cp`` > 1, one process per rank under torchrun): the ranks decode
the rollouts' shards and gather them, every rank then runs the same step on its zigzag rows
(``cotrain_loss(..., cp=)``) and the gradients are summed over the ranks before clipping, so
every rank applies the same update; rank 0 alone writes the run folder and shows progress.

Run folder (``runs``, ``codraft.train.run_dir``, ``codraft.train.checkpoint``): a fresh run refuses
a folder that holds a run; a resume restores the newest checkpoint that verifies (sha256 of
every file, falling back with a warning), may change only the keys in ``runs.RESUMABLE`` and
records what it changed in ``resume_log.jsonl``. Checkpoint writes and prunes survive
``kill -9`` at any moment.
"""
from __future__ import annotations

import contextlib
import copy
import math
import random
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from codraft import kernels
from codraft.config import ConfigError, RunConfig
from codraft.parallel.comm import init_cp
from codraft.parallel.mesh import build_mesh
from codraft.parallel.context import sync_gradients
from codraft.policy import load_policy
from codraft.rl import runs
from codraft.rl.cotrain import cotrain_loss
from codraft.rl.grpo import group_advantages
from codraft.rl.logger import MetricsLogger
from codraft.rl.microbatch import split_microbatches
from codraft.rl.pipelined import (ConsolidatedState, build_pipeline, clip_gradients, keep_state, pipeline_cotrain,
                                  reduce_gradients, stage_parameters, sync_weights)
from codraft.rl.plots import plot_run
from codraft.rollout import Engine, SpecStats, load_or_calibrate
from codraft.rollout.weights import RolloutWeights
from codraft.tasks import make_task
from codraft.train import checkpoint as ckpt
from codraft.train.offline_draft import starting_draft
from codraft.train.precision import resolve as resolve_precision
from codraft.train.packing import pack
from codraft.train.schedule import warmup, warmup_cosine
from codraft.train.seeding import step_seed


def _adamw(params, **kw) -> torch.optim.AdamW:
    """AdamW, with the fused kernel on CPU/CUDA: several times faster than foreach on CPU
    (docs/bench-e2e.md has the figures)."""
    params = list(params)
    return torch.optim.AdamW(params, fused=all(p.device.type in ("cpu", "cuda") for p in params) or None, **kw)


@contextlib.contextmanager
def _hold_ctrl_c():
    """Defer SIGINT to the end of the block, so the block (the optimiser updates) is all-or-nothing."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # signals reach only the main thread; None: a handler set outside Python, leave it be
        return
    got = []
    old = signal.signal(signal.SIGINT, lambda *a: got.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got and callable(old):
            old(*got[0])  # the default handler raises KeyboardInterrupt here


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
class Rollout:
    """Step 1: the step's sampled completions."""
    group: list                 # the task problem of each completion (each prompt repeated group_size times)
    prompts: list               # their prompt token ids
    out: list                   # the engine's outputs (tokens, logprobs), one per completion
    stats: object               # the engine's statistics of this rollout
    seconds: float              # wall time of the rollout
    seed: int                   # the sampling seed (the measurement extras reuse it)
    metrics: dict = field(default_factory=dict)  # time_rollout, acceptance_*, gamma_*


@dataclass
class Probes:
    """The measurement extras on the step's prompts: the plain rollout for the speedup figure and
    the frozen-draft probe. Their time is not part of the step time."""
    metrics: dict               # time_rollout_plain, rollout_speedup, frozen_acceptance_length (when run)
    seconds: float              # wall time of both


@dataclass
class Scored:
    """Step 2: rewards and GRPO advantages."""
    rewards: torch.Tensor       # (N,)
    advantages: torch.Tensor    # (N,)
    errors: list                # the exceptions of reward functions that failed (those samples scored 0)


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


class Trainer:
    def __init__(self, cfg: RunConfig, *, resume: str | None = None, progress: bool = True):
        cfg.validate()  # every key's range and the rules between keys (codraft.config.RULES), before any work
        self._join_ranks(cfg)
        self.progress = progress and self.is_main
        dtype = getattr(torch, cfg.policy.dtype)
        # a fresh run refuses a folder holding a run; a resume reads the newest checkpoint that verifies
        # and refuses changes to keys outside runs.RESUMABLE (nothing is written until record_start)
        cfg, self.run_dir, found, changed = runs.open_run(cfg, resume, dtype)
        if self.world is not None:  # every rank has checked the folder before rank 0 writes to it
            self.world.all_gather_object(str(self.run_dir), "the run folder")
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.policy, self.tok, self.policy_dir = load_policy(cfg.policy.init, dtype)
        self.task = make_task(cfg.task.name, max_chars=cfg.task.max_chars, format_reward=cfg.task.format_reward)
        init_policy = self.policy
        if found is not None:
            self.policy = kernels.enable(found.policy)  # as load_policy's
        self.policy.to(cfg.device)
        # what the engines decode with: the policy, or (rollout.dtype) a cast copy refreshed after every update
        r = cfg.rollout
        self.rollout_weights = RolloutWeights(self.policy, getattr(torch, cfg.policy.dtype if r.dtype == "policy"
                                                                   else r.dtype))

        d = cfg.draft
        self.draft = None if d.mode == "none" else starting_draft(
            d.kind, d.init, policy=self.policy, tok=self.tok, task=self.task, policy_dir=self.policy_dir,
            gamma=d.gamma, seed=cfg.seed, progress=self.progress, num_anchors=d.num_anchors)
        self.trains_draft = d.mode == "cotrain" and self.draft is not None and bool(self.draft.trainable_parameters())
        self.policy_dtype, self.draft_dtype = self._training_precisions(cfg)
        # draft_length=auto: one cost model for every engine, timed now (or read from the cache) for the
        # largest batch any of them decodes
        rows = max(r.prompts_per_step * r.group_size, cfg.log.val_size if cfg.log.val_every else 1)
        self.cost_model = load_or_calibrate(self.rollout_weights.policy, self.rollout_weights.draft_for(self.draft),
                                            self.draft.default_gamma, rows) \
            if self.draft is not None and r.draft_length == "auto" else None
        # log.frozen_probe_every: the initial draft, kept frozen and run on the same prompts as the
        # co-trained one, so staleness is measured against the very same policy (copied before a resume
        # restores the trained draft)
        self.frozen_engine = self._engine(copy.deepcopy(self.draft).requires_grad_(False)) \
            if cfg.log.frozen_probe_every and self.trains_draft else None
        self.reference = None
        if cfg.grpo.kl_coef > 0:  # KL to the initial policy, also after a resume (not to the checkpoint's)
            ref = init_policy if init_policy is not self.policy else copy.deepcopy(self.policy)
            self.reference = ref.to(cfg.device).eval().requires_grad_(False)

        g = cfg.grpo
        self.opt = _adamw(self.policy.parameters(), lr=g.lr, weight_decay=g.weight_decay, betas=(0.9, 0.99))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup_cosine(g.warmup_steps, cfg.steps, floor=0.1))
        self.draft_opt = self.draft_sched = None
        if self.trains_draft:
            self.draft_opt = _adamw(self.draft.trainable_parameters(), lr=d.lr, betas=(0.9, 0.95))
            self.draft_sched = torch.optim.lr_scheduler.LambdaLR(self.draft_opt, warmup(d.warmup_steps))
        self.start_step, self.prompts_used, self._stream = 0, 0, None
        # the rollout engine; validation (greedy) has its own, so its rounds stay out of the rollouts'
        # acceptance estimate (draft_length=auto), which checkpoints carry
        self.engine, self.val_engine, self.plain_engine = self._engine(self.draft), self._engine(self.draft), \
            self._engine(None)
        if found is not None:
            self._resume_from(found)
        # steps_done/_done_prompts/_done_acceptance: the last step whose update is fully applied (what
        # Ctrl-C saves); _saved: the last step on disk; nonfinite_streak: skipped updates in a row
        self.steps_done, self._done_prompts, self._saved = self.start_step, self.prompts_used, self.start_step
        self._done_acceptance = self._acceptance()
        self.nonfinite_streak, self.last_rollout, self.last_stats = 0, None, None
        self.val = self.task.sample("val", cfg.log.val_size, seed=cfg.seed)
        if self.is_main:
            runs.record_start(self.run_dir, cfg, found, changed)  # the first write to the run folder
        self.logger = MetricsLogger(self.run_dir, resume_step=self.start_step if found is not None else None) \
            if self.is_main else _NoLogger()
        self.plots: list[Path] = []

    def _resume_from(self, found) -> None:
        """Continue from checkpoint ``found``: the draft, optimisers and schedulers, the step and prompt
        counters, the acceptance estimates (a "spec_pays" of checkpoints from before draft_length is
        ignored)."""
        state = ckpt.restore(found, draft=self.draft, optimizers=self._optimizers())
        self.rollout_weights.refresh()  # the engines' draft copies were made from the draft before this
        self.start_step, self.prompts_used = state["step"], state["prompts_used"]
        estimates = self._estimates()  # (log.frozen_probe_every may have changed: no frozen probe now)
        for name, saved in state.get("acceptance", {}).items():
            if name in estimates:
                estimates[name].load_state_dict(saved)
        _follow_schedule(self.sched)  # `steps` may have changed on resume: the lr is the cosine's
        if self.mesh is not None and self.mesh.pp > 1:  # a stage keeps the optimiser state of what it trains only
            own, drafts = self._owned()
            keep_state(self.opt, own)
            keep_state(self.draft_opt, drafts)

    def _training_precisions(self, cfg: RunConfig) -> tuple[torch.dtype, torch.dtype]:
        """grpo.precision, draft.precision: the products of the policy's and the draft's losses, fp32 or bf16
        ("auto": measured here). Rank 0 chooses and every rank takes its choice, so the ranks of a step
        compute one loss (and only one measures, undisturbed by the others)."""
        policy_dtype = draft_dtype = torch.float32
        if self.is_main:
            policy_dtype = resolve_precision(cfg.grpo.precision, self.policy, what="policy")
            if self.trains_draft:
                draft_dtype = resolve_precision(cfg.draft.precision, self.draft, what="draft")
        if self.world is not None:
            policy_dtype, draft_dtype = self.world.all_gather_object((policy_dtype, draft_dtype),
                                                                     "the training precisions")[0]
        if self.is_main and policy_dtype == torch.bfloat16 and self.rollout_weights.dtype == torch.float32:
            warnings.warn("grpo.precision: the policy trains in bf16 products while rollouts decode from its fp32 "
                          "weights, whose updates the trainer's products round away: the mismatch KL was ~10x "
                          "larger on the real preset (docs/real-preset.md, session 30); rollout.dtype=bfloat16 "
                          "rounds the weights as the trainer does", stacklevel=3)
        return policy_dtype, draft_dtype

    def _join_ranks(self, cfg: RunConfig) -> None:
        """parallel.pp · parallel.cp > 1: one process per rank (torchrun); every rank decodes its rollout
        share and gathers all, trains its stage on its CP rows; only rank 0 writes (metrics, plots,
        checkpoints, progress)."""
        par = cfg.parallel
        self.world = init_cp(cfg.device, par.timeout) if par.cp * par.pp > 1 else None
        if self.world is not None and self.world.size != par.cp * par.pp:
            raise ConfigError(f"parallel.pp={par.pp} × parallel.cp={par.cp} but torchrun started {self.world.size} "
                              f"processes; launch with torchrun --nproc-per-node {par.cp * par.pp}")
        self.mesh = build_mesh(par.pp, par.cp, par.timeout) if self.world is not None else None
        self.cp = None if self.mesh is None else self.mesh.cp_group
        self.pipelined, self.pipe = par.pp > 1 or par.microbatches > 1, None
        self.is_main = self.world is None or self.world.rank == 0

    def _engine(self, draft) -> Engine:
        """An engine over the rollout weights and ``draft`` (None: plain), drafting draft.gamma tokens per
        round or, with rollout.draft_length=auto, up to that many."""
        policy, draft = self.rollout_weights.policy, self.rollout_weights.draft_for(draft)
        if draft is None:
            return Engine(policy)
        if self.cost_model is None:
            return Engine(policy, draft, self.cfg.draft.gamma)
        return Engine(policy, draft, "auto", cost_model=self.cost_model)

    def _estimates(self) -> dict:
        """The running acceptance estimates (draft_length=auto) a resume must continue: rollout, frozen probe."""
        engines = {"rollout": self.engine, "frozen": self.frozen_engine}
        return {k: e.acceptance for k, e in engines.items() if e is not None and e.acceptance is not None}

    def _acceptance(self) -> dict:
        return {k: a.state_dict() for k, a in self._estimates().items()}

    def _optimizers(self) -> dict:
        return {"policy": self.opt, "policy_sched": self.sched, "draft": self.draft_opt, "draft_sched": self.draft_sched}

    def _prompts(self) -> list:
        """The next training prompts from the task's train stream (position saved in checkpoints)."""
        if self._stream is None:  # (re)open at the loader position, e.g. after a resume
            self._stream = self.task.stream("train", seed=self.cfg.seed)
            for _ in range(self.prompts_used):
                next(self._stream)
        n = self.cfg.rollout.prompts_per_step
        self.prompts_used += n
        return [next(self._stream) for _ in range(n)]

    def _generate(self, engine: Engine, prompts, seed: int, temperature=None, group: int = 1):
        """-> (results for every prompt, seconds, SpecStats).

        The prompts are decoded in ``rollout.shards`` shards of whole groups (0: one per CP rank),
        shard i with its own seed; each CP rank decodes a contiguous run of shards and the results
        are gathered in order. The rollouts are thus a function of (seed, shards), whatever the
        number of ranks: cp=1 with shards=2 samples exactly what cp=2 does (with draft.gamma fixed;
        draft_length=auto adapts to the rows each engine has seen). Stats are pooled; the time is
        the slowest rank's, the gather included."""
        r = self.cfg.rollout
        t0 = time.perf_counter()
        ranks, rank = (1, 0) if self.world is None else (self.world.size, self.world.rank)
        shards = r.shards or ranks
        groups = len(prompts) // group
        bounds = [groups * i // shards * group for i in range(shards)] + [len(prompts)]
        mine = range(shards * rank // ranks, shards * (rank + 1) // ranks)
        out, stats = [], []
        for i in mine:
            part = prompts[bounds[i]:bounds[i + 1]]
            if part:
                shard_seed = seed if i == 0 else (seed + i * 0x9E3779B97F4A7C15) % 2**63  # a stream per shard
                out += engine.generate(part, r.max_new_tokens, temperature=r.temperature if temperature is None
                                       else temperature, top_p=r.top_p, seed=shard_seed, eos_id=self.tok.eos_id)
                stats.append(engine.stats)
        if self.world is not None:
            shares = self.world.all_gather_object((out, stats), "the rollout shards")
            out, stats = [o for share, _ in shares for o in share], [st for _, sts in shares for st in sts]
        return out, time.perf_counter() - t0, stats[0] if len(stats) == 1 else SpecStats.pool(stats)

    def validate(self) -> float:
        self.policy.eval()
        self.rollout_weights.check("validation")
        prompts = [self.tok.prompt_ids(p.prompt) for p in self.val]
        out, _, _ = self._generate(self.val_engine, prompts, seed=0, temperature=0.0)
        return sum(self.task.reward(p, self.tok.decode(o.tokens)) for p, o in zip(self.val, out)) / len(self.val)

    def step(self, step: int) -> dict:
        """One RL step (rollout, reward, update, metrics); returns the step's metrics row."""
        torch.manual_seed(step_seed(self.cfg.seed, step))
        t_step = time.perf_counter()
        rollout = self.rollout(step)
        probes = self.probe(step, rollout)
        scored = self.score(step, rollout)
        update = self.update(step, rollout, scored)
        return self.observe(step, rollout, probes, scored, update, t_step)

    def rollout(self, step: int) -> Rollout:
        """1. The step's prompts, `group_size` completions each, decoded with the draft (if any)."""
        cfg, r = self.cfg, self.cfg.rollout
        seed = step_seed(cfg.seed, step)
        problems = self._prompts()
        group = [p for p in problems for _ in range(r.group_size)]
        prompts = [self.tok.prompt_ids(p.prompt) for p in group]
        self.policy.eval()
        self.rollout_weights.check(f"step {step}")
        out, seconds, stats = self._generate(self.engine, prompts, seed, group=r.group_size)
        self.last_stats = stats
        self.last_rollout = out
        m = {"time_rollout": seconds}
        if self.draft is not None:  # gamma_chosen[g]: rounds that drafted g tokens; gamma_mean: per row-round
            m.update(acceptance_length=stats.acceptance_length, acceptance_per_position=stats.acceptance_per_position,
                     gamma_chosen=stats.gamma_chosen, gamma_mean=stats.mean_gamma)
        return Rollout(group, prompts, out, stats, seconds, seed, m)

    def _measures(self, step: int) -> bool:
        """Does this step measure the rollout speedup (log.speedup_every)?"""
        every = self.cfg.log.speedup_every
        return bool(every) and step % every == 0

    def probe(self, step: int, rollout: Rollout) -> Probes:
        """The measurement extras on the rollout's prompts and seed: a plain rollout for the speedup
        and the frozen initial draft's τ."""
        m, seconds = {}, 0.0
        if self._measures(step):
            _, t_plain, _ = self._generate(self.plain_engine, rollout.prompts, rollout.seed,
                                           group=self.cfg.rollout.group_size)
            m.update(time_rollout_plain=t_plain, rollout_speedup=t_plain / rollout.seconds)
            seconds += t_plain
        if self.frozen_engine is not None and step % self.cfg.log.frozen_probe_every == 0:
            _, t_probe, frozen = self._generate(self.frozen_engine, rollout.prompts, rollout.seed,
                                                group=self.cfg.rollout.group_size)
            m["frozen_acceptance_length"] = frozen.acceptance_length
            seconds += t_probe
        return Probes(m, seconds)

    def score(self, step: int, rollout: Rollout) -> Scored:
        """2. Rewards (a failing reward function scores 0, with one warning per step) and advantages."""
        r, g = self.cfg.rollout, self.cfg.grpo
        scored = [self.task.score(p, self.tok.decode(o.tokens)) for p, o in zip(rollout.group, rollout.out)]
        rewards = torch.tensor([x for x, _ in scored])
        errors = [e for _, e in scored if e is not None]
        if errors:
            warnings.warn(f"step {step}: reward function failed on {len(errors)}/{len(rollout.group)} samples, "
                          f"scored 0 (first error: {errors[0]!r})", stacklevel=3)  # at step()'s caller
        return Scored(rewards, group_advantages(rewards, r.group_size, leave_one_out=g.leave_one_out), errors)

    def update(self, step: int, rollout: Rollout, scored: Scored) -> Update:
        """3. One packed forward, L_RL + λ·L_draft, one backward, clipping, then the commit (`_commit`);
        a non-finite loss or grad norm drops the gradients instead (the schedulers still step)."""
        cfg, g = self.cfg, self.cfg.grpo
        t_train = time.perf_counter()
        timer = PhaseTimer("train", "loss_forward", "backward", "optimizer")
        self.policy.train()
        loss_kw = dict(temperature=cfg.rollout.temperature, lam=cfg.draft.lam, eps_low=g.eps_low, eps_high=g.eps_high,
                       norm=g.norm, kl_coef=g.kl_coef, reference=self.reference, tis_cap=g.tis_cap or None,
                       train_draft=self.trains_draft, policy_dtype=self.policy_dtype,
                       draft_dtype=self.draft_dtype,
                       phase=timer)
        if self.pipelined:
            loss, lm, policy_norm, draft_norm = self._pipelined_backward(step, rollout, scored, timer, loss_kw)
        else:
            batch = pack(rollout.prompts, [o.tokens for o in rollout.out], [o.logprobs for o in rollout.out],
                         device=cfg.device)
            with timer("loss_forward"):
                loss, lm = cotrain_loss(self.policy, self.draft, batch, scored.advantages.to(cfg.device), cp=self.cp,
                                        **loss_kw)
            self._zero_grad()
            with timer("backward"):
                loss.backward()
                if self.cp is not None:  # each rank holds its share of the gradient: the sum is the gradient
                    sync_gradients(self.policy.parameters(), self.cp, "policy")
                    if self.trains_draft:
                        sync_gradients(self.draft.trainable_parameters(), self.cp, "draft")
                policy_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), g.grad_clip)
                draft_norm = None if self.draft_opt is None else torch.nn.utils.clip_grad_norm_(
                    self.draft.trainable_parameters(), cfg.draft.grad_clip)
        loss = loss.detach()
        finite = all(math.isfinite(float(x)) for x in (loss, policy_norm, 0.0 if draft_norm is None else draft_norm))
        self.nonfinite_streak = 0 if finite else self.nonfinite_streak + 1
        if not finite:  # one bad batch must not corrupt θ, φ or the Adam moments: drop its gradients
            self._zero_grad()
            warnings.warn(f"step {step}: non-finite loss or grad norm (loss={float(loss):.4g}, policy grad norm="
                          f"{float(policy_norm):.4g}); update skipped ({self.nonfinite_streak} in a row)",
                          stacklevel=3)  # at step()'s caller
        self._commit(step, finite, timer)
        timer.seconds["train"] = time.perf_counter() - t_train
        return Update(loss, lm, policy_norm, draft_norm, finite, self.nonfinite_streak, timer.seconds)

    def _pipelined_backward(self, step: int, rollout: Rollout, scored: Scored, timer: PhaseTimer, loss_kw: dict):
        """parallel.pp / parallel.microbatches: this stage's forward and backward over the micro-batches
        (1F1B), the gradient sums (CP, tied embedding) and the clipping by the global norms."""
        cfg, par = self.cfg, self.cfg.parallel
        self._zero_grad()
        mbs = split_microbatches(rollout.prompts, [o.tokens for o in rollout.out], [o.logprobs for o in rollout.out],
                                 scored.advantages.to(cfg.device), cfg.rollout.group_size, par.microbatches,
                                 cfg.device)
        if self.pipe is None:  # collective (the tap channels): on the first update, sized from its batch
            self.pipe = build_pipeline(self.policy, self.draft if self.trains_draft else None, self.mesh,
                                       transport=par.taps, max_tokens=par.tap_tokens or _tap_tokens(mbs, cfg),
                                       timeout=par.timeout)
        torch.manual_seed(step_seed(cfg.seed, step) ^ 1)  # the draft's anchors: one draw, whatever the split
        with timer("forward_backward"):
            loss, lm = pipeline_cotrain(self.pipe, self.policy, self.draft, mbs, step=step, **loss_kw)
        with timer("backward"):  # here: the gradient sums and the clipping
            own, drafts = reduce_gradients(self.pipe, self.policy, self._owned()[1])
            policy_norm, draft_norm = clip_gradients(self.pipe, self.policy, own, drafts, cfg.grpo.grad_clip,
                                                     cfg.draft.grad_clip if self.draft_opt is not None else None)
        return loss, lm, policy_norm, draft_norm

    def _owned(self) -> tuple[list, list]:
        """The policy and draft parameters this rank trains (all of them without pipeline stages)."""
        drafts = list(self.draft.trainable_parameters()) if self.trains_draft else []
        if self.mesh is None or self.mesh.pp == 1:
            return list(self.policy.parameters()), drafts
        return stage_parameters(self.policy, self.mesh.stage, self.mesh.pp), drafts if self.mesh.last else []

    def _zero_grad(self):
        self.opt.zero_grad(set_to_none=True)
        if self.draft_opt is not None:
            self.draft_opt.zero_grad(set_to_none=True)

    def _commit(self, step: int, finite: bool, timer: PhaseTimer):
        """Commit point: a Ctrl-C here waits until every optimiser and scheduler has stepped, so the
        step's update is all-or-nothing; from here on the step counts as completed. (Schedulers
        step on skipped updates too: the LR stays a function of the step index.)"""
        with _hold_ctrl_c():
            if finite:
                with timer("optimizer"):
                    self.opt.step()  # (under pp: the parameters with a gradient, i.e. this stage's)
                    if self.draft_opt is not None:
                        self.draft_opt.step()
                if self.pipe is not None:  # every rank's rollout engine decodes with every stage's update
                    with timer("weight_sync"):
                        sync_weights(self.pipe, self.policy,
                                     list(self.draft.trainable_parameters()) if self.trains_draft else [])
                self.rollout_weights.refresh()
            self.sched.step()
            if self.draft_sched is not None:
                self.draft_sched.step()
            self.steps_done, self._done_prompts, self._done_acceptance = step + 1, self.prompts_used, \
                self._acceptance()

    def observe(self, step: int, rollout: Rollout, probes: Probes, scored: Scored, update: Update,
                t_step: float) -> dict:
        """4. The step's metrics row; every `log.val_every` steps also the held-out accuracy."""
        m = {**rollout.metrics, **probes.metrics, "reward_errors": len(scored.errors),
             "policy/grad_norm": update.policy_grad_norm}
        if update.draft_grad_norm is not None:
            m["draft/grad_norm"] = update.draft_grad_norm
        m.update(skipped_update=int(not update.finite), nonfinite_streak=update.nonfinite_streak)
        m.update({f"time_{k}": v for k, v in update.timings.items()})  # time_train and its breakdown
        m.update(update.metrics)
        lm, rewards, lens = update.metrics, scored.rewards, [len(o.tokens) for o in rollout.out]
        m.update(reward_mean=rewards.mean(), reward_std=rewards.std() if len(rewards) > 1 else 0.0,
                 completion_len=sum(lens) / len(lens), lr=self.sched.get_last_lr()[0],
                 mismatch_kl=lm.get("policy/rollout_kl"), token_mult_prob_error=lm.get("policy/token_mult_prob_error"))
        # step time = rollout + reward + train; the measurement extras are not part of it
        m["time_step"] = time.perf_counter() - t_step - probes.seconds
        if self.cfg.log.val_every and (step + 1) % self.cfg.log.val_every == 0:
            m["val_accuracy"] = self.validate()
        m["tokens_per_s"] = sum(lens) / rollout.seconds
        return m

    def save(self) -> Path | None:
        """Checkpoint the last completed step (`steps_done`); only rank 0 writes, one consolidated
        checkpoint (under pp every rank holds every weight; the stages' optimiser states are gathered)."""
        optimizers = self._optimizers()
        if self.mesh is not None and self.mesh.pp > 1:
            own, drafts = self._owned()
            optimizers.update(policy=ConsolidatedState(self.opt, own, self.world),
                              draft=self.draft_opt and ConsolidatedState(self.draft_opt, drafts, self.world))
        if not self.is_main:
            self._saved = self.steps_done
            return None
        path = ckpt.save_checkpoint(self.run_dir, self.steps_done, policy=self.policy, draft=self.draft,
                                    optimizers=optimizers,
                                    state=self._checkpoint_state(),
                                    config=self.cfg.to_dict(), keep_last=self.cfg.log.keep_last,
                                    extra_files=_tokenizer_files(self.policy_dir))
        self._saved = self.steps_done
        return path

    def _checkpoint_state(self) -> dict:
        state = {"prompts_used": self._done_prompts}
        if self._done_acceptance:  # draft_length=auto: a resume continues the same estimates
            state["acceptance"] = self._done_acceptance
        return state

    def fit(self):
        cfg = self.cfg
        bar = tqdm(range(self.start_step, cfg.steps), desc="train", disable=not self.progress, dynamic_ncols=True,
                   initial=self.start_step, total=cfg.steps)
        try:
            if self.start_step == 0 and cfg.log.val_every:
                self.logger.log(0, {"val_accuracy": self.validate()})
            for step in bar:
                m = self.step(step)
                self.logger.log(step + 1, m)
                if self.nonfinite_streak >= cfg.grpo.max_nonfinite_steps:
                    raise RuntimeError(f"step {step}: {self.nonfinite_streak} non-finite (NaN/inf) steps in a row "
                                       f"(grpo.max_nonfinite_steps={cfg.grpo.max_nonfinite_steps}); stopping. "
                                       f"Last good checkpoint: {ckpt.latest_checkpoint(self.run_dir) or 'none'}")
                post = {"reward": f"{float(m['reward_mean']):.2f}", "step_s": f"{m['time_step']:.1f}"}
                if "acceptance_length" in m:
                    post["tau"] = f"{m['acceptance_length']:.2f}"
                bar.set_postfix(post)
                # no checkpoint mid NaN streak: it could rotate the last good one out (keep_last)
                if cfg.log.checkpoint_every and ((step + 1) % cfg.log.checkpoint_every == 0 or step + 1 == cfg.steps) \
                        and not self.nonfinite_streak:
                    self.save()
        except KeyboardInterrupt:
            # Only completed steps count. Before a step's commit point (see step()) θ, φ and the
            # optimisers still hold step `steps_done`'s state and `_done_prompts` rewinds the data
            # position; after it the step is complete (its metrics row may be missing). RNG needs
            # no rewind: every step reseeds from (seed, step).
            bar.close()
            if self.steps_done > self._saved and not self.nonfinite_streak:
                self.save()
            last = ckpt.latest_checkpoint(self.run_dir)
            print(f"interrupted after step {self.steps_done}; latest checkpoint: {last or 'none'}"
                  + (f" (continue with --resume {self.run_dir})" if last else ""), file=sys.stderr)
            raise
        finally:  # never checkpoints: after an error the in-memory state may be bad
            self.logger.close()
            if self.is_main:
                self.plots = plot_run(self.run_dir)
        return self.run_dir

    def report(self) -> str:
        """Where the run is and how it went (what `codraft train` prints at the end and on Ctrl-C)."""
        return runs.report(self.run_dir, self.plots)


class _NoLogger:
    """The metrics logger of ranks other than 0: they compute the same rows, rank 0 writes them."""

    def log(self, step, metrics):
        pass

    def close(self):
        pass


def _follow_schedule(sched):
    """Set the optimiser's lr to the scheduler's own function of the restored step (LambdaLR's
    formula): the same value when nothing changed, the new cosine's when `steps` did."""
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)
    sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]


def _tap_tokens(mbs, cfg: RunConfig) -> int:
    """TapChannel slots (tokens of one micro-batch at one rank) for the longest micro-batch the run can
    produce: the largest group count per micro-batch, each with twice this step's longest prompt and
    every completion at rollout.max_new_tokens; under CP a rank's share plus the zigzag padding."""
    r, par = cfg.rollout, cfg.parallel
    groups = -(-r.prompts_per_step // par.microbatches)
    longest = max(int(mb.batch.cu_seqlens.diff().max()) for mb in mbs)  # a prompt and its completion
    tokens = groups * (2 * longest + r.group_size * r.max_new_tokens)
    return tokens if par.cp == 1 else -(-tokens // par.cp) + 2 * par.cp * groups * (r.group_size + 1)


def _tokenizer_files(policy_dir: Path) -> dict[str, str]:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
             "char_tokenizer.json")
    return {n: (policy_dir / n).read_text() for n in names if (policy_dir / n).is_file()}


def train(cfg: RunConfig, resume: str | None = None, progress: bool = True) -> Path:
    return Trainer(cfg, resume=resume, progress=progress).fit()
