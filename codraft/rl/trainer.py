"""The `codraft train` loop: GRPO with speculative rollouts and an online co-trained draft.

``Trainer`` builds the run (policy, draft, optimisers, engines, run folder) and ``fit`` runs the steps.
Per step (``Trainer.step``), each phase in a module of its own, called through the Trainer method of the
same name and returning a small dataclass:
  1. rollout   (``rollout_phase``) the engine (policy θ_t + draft φ_t, lossless speculative decoding)
               samples `group_size` completions for each of `prompts_per_step` training prompts;
               ``probe`` then runs the measurement extras on the same prompts (the rollout speedup, the
               frozen initial draft's τ; not in time_step);
  2. score     (``scoring``) rewards, GRPO advantages per group;
  3. update    (``update_phase``) one packed policy forward -> L_RL(θ) + λ·L_draft(φ; x, sg(H_θ(x))),
               one backward, policy and draft optimisers step (draft.mode=cotrain) at the commit point;
  4. observe   (``observation``) the metrics row, which the loop logs (metrics.jsonl / TensorBoard);
the loop checkpoints (``checkpointing``) every `log.checkpoint_every` steps and plots the run at the end.
The engine holds references to the live policy and draft modules, so step t+1's rollout uses the
weights updated at step t with no copy; with ``rollout.dtype=bfloat16`` it decodes a weight-only bf16
copy (``RolloutWeights``), refreshed after each update and checked against the trainer's weights before
each rollout (a stale copy is a ``StaleRolloutWeights`` error). With ``rollout.backend=vllm`` the engines are
vLLM's in this process (``codraft.vllm``): the weights are pushed into them after every update and checked
there (docs/vllm.md).

Determinism: every step reseeds from (seed, step), so a resumed run repeats an
uninterrupted one's rollouts and updates exactly (timings aside; with draft_length=auto the
running acceptance estimate is checkpointed, and the cost model is the one cached on disk for this
machine, so the same holds on the same machine).

Faults: a failing reward function scores 0 (``scoring``) and a non-finite update is skipped
(``update_phase``); `grpo.max_nonfinite_steps` of those in a row stop the run with a NonFiniteError, no
checkpoint being written while such a streak lasts; Ctrl-C or SIGTERM checkpoints the last completed step
before re-raising (``interrupt.Interrupted``: exit 130 / 143), so `--resume` continues from it (more signals
wait for the checkpoint write to finish, then say where the run stopped); several ranks stop together at the
step boundary after the signal (``interrupt``). A full disk is one line (``DiskFullError``), the previous
checkpoint kept.

Parallelism (``parallel.dp``, ``tp``, ``cp``, ``pp`` > 1: one process per rank under torchrun, placed by
one ``Layout`` and its DeviceMesh, ``codraft.parallel.mesh``): every rank runs the step (its share of the
rollouts, then its part of the update). ``codraft.parallel.parallelize`` applies the layout to the models from
outside, once, and returns the update's machinery for it (``train_step``), which the update phase runs; where
the layout splits the weights the engine decodes a gathered copy; rank 0 alone writes the run folder and
shows progress.

Run folder (``runs``, ``codraft.train.run_dir``, ``codraft.train.checkpoint``): rank 0 locks it for
the run's life before anything loads (a folder that cannot be written, or that another run holds, is
refused in one line); a fresh run refuses a folder that holds a run; a resume restores the newest
checkpoint that verifies (sha256 of every file, falling back with a warning), may change only the keys
in ``runs.RESUMABLE`` and records what it changed in ``resume_log.jsonl``. Checkpoint writes and prunes
survive ``kill -9`` at any moment.
"""
from __future__ import annotations

import copy
import random
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from codraft import kernels
from codraft.config import ConfigError, RunConfig, check_policy
from codraft.errors import CodraftError, NonFiniteError
from codraft.parallel.comm import join_world, leave_process_group
from codraft.parallel.layout import Layout
from codraft.parallel.mesh import build_mesh
from codraft.parallel import tp
from codraft.parallel.parallelize import parallelize
from codraft.policy import load_policy
from codraft.rl import checkpointing, memory, observation, rollout_phase, runs, scoring, update_phase
from codraft.rl.logger import MetricsLogger
from codraft.rl.plots import plot_run
from codraft.rl.rollout_phase import Probes, Rollout
from codraft.rl.scoring import Scored
from codraft.rl.interrupt import Interrupted, Signals
from codraft.rl.update_phase import Learner, Optimisers, Update, adamw
from codraft.rollout import Engine, load_or_calibrate
from codraft.rollout.weights import RolloutWeights
from codraft.envs import make_env
from codraft.eval import evaluate
from codraft.data import build_task
from codraft.rewards import build_rewards
from codraft.train import checkpoint as ckpt
from codraft.train.disk_full import DiskFullError, is_disk_full, run_full
from codraft.drafts.eagle3_layer import parse_taps
from codraft.train.offline_draft import starting_draft
from codraft.train.run_dir import FreshFolder
from codraft.train.precision import resolve as resolve_precision
from codraft.train.schedule import warmup, warmup_cosine
from codraft.train.seeding import step_seed
from codraft.vllm.backend import VllmBackend


class Trainer:
    def __init__(self, cfg: RunConfig, *, resume: str | None = None, progress: bool = True):
        self._run_lock = None  # rank 0's lock on the run folder, held until fit() ends
        try:
            self._setup(cfg, resume, progress)
        except BaseException:  # a run that fails to start leaves its folder free for a rerun
            self._unlock()
            raise

    def _unlock(self):
        if self._run_lock is not None:
            self._run_lock.release()

    def _setup(self, cfg: RunConfig, resume: str | None, progress: bool):
        cfg.validate()  # every key's range and the rules between keys (codraft.config.RULES), before any work
        self._join_ranks(cfg)
        self.progress = progress and self.is_main
        dtype = getattr(torch, cfg.policy.dtype)
        cfg, found, changed = self._open_run(cfg, resume, dtype)
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.policy, self.tok, self.policy_dir = load_policy(cfg.policy.init, dtype)
        check_policy(cfg, self.policy.config)  # what depends on the policy: known from here
        if self.layout.tp > 1 and (why := tp.check(self.policy.config, self.layout.tp)):
            raise ConfigError(why)
        # the prompts (a built-in task's generator, or your data files) and the reward functions that score them
        self.task = build_task(cfg, self.tok, self.policy.config.max_position_embeddings)
        self.rewards = build_rewards(cfg, self.task)
        # multi-turn: the environment over the task, and how this policy writes tool calls
        self.env = None if cfg.env.name == "none" and not cfg.env.tools else \
            make_env(cfg.env.name, self.task, cfg.env.tools, self.rewards)  # (env.tools: your functions, your rewards)
        init_policy = self.policy
        if found is not None:
            self.policy = kernels.enable(found.policy)  # as load_policy's
        self.policy.to(cfg.device)
        # what the engines decode with: the policy, or (rollout.dtype) a cast copy refreshed after every update
        r = cfg.rollout
        # (rollout.backend=vllm: vLLM holds the rollout dtype's copy; here only the gathered one, under dp)
        self.rollout_weights = RolloutWeights(self.policy, getattr(torch, cfg.policy.dtype if r.dtype == "policy"
                                                                   or r.backend == "vllm" else r.dtype),
                                              gather=self.layout.gathers)

        d = cfg.draft
        self.draft = None if d.mode == "none" else starting_draft(
            d.kind, d.init, policy=self.policy, tok=self.tok, task=self.task, policy_dir=self.policy_dir,
            gamma=d.gamma, seed=cfg.seed, progress=self.progress, num_anchors=d.num_anchors,
            layers=parse_taps(d.taps), announce=self.is_main)  # (an offline draft: what it builds, said by rank 0)
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
        # rollout.backend=vllm: its engines, built from the policy and draft before they are sharded
        self.vllm = VllmBackend(cfg, self.rollout_weights.policy, self.draft, self._probe(),
                                max_rows=rows) if r.backend == "vllm" else None
        # the layout applied from outside the models, once (codraft.parallel.parallelize)
        self.train_step = parallelize(self.policy, self.draft, self.mesh, cfg, self.rollout_weights,
                                      trains_draft=self.trains_draft)  # (and the update's machinery for it)
        self.learner = self._learner(cfg)
        self.checkpoints = checkpointing.Checkpoints(cfg, self.run_dir, self.policy_dir, self.world, self.mesh,
                                                     self.learner)
        self.start_step = 0
        self.engine, self.val_engine, self.plain_engine = self._rollout_engines(cfg)
        self.train_prompts = rollout_phase.TrainPrompts(self.task, cfg.seed)  # opens at prompts_used (resume sets it)
        if found is not None:
            state = checkpointing.resume_from(self.checkpoints, found)
            self.start_step, self.prompts_used = state["step"], state["prompts_used"]
            estimates = self._estimates()  # (log.frozen_probe_every may have changed: no frozen probe now)
            for name, saved in state.get("acceptance", {}).items():
                if name in estimates:
                    estimates[name].load_state_dict(saved)
        # steps_done/_done_prompts/_done_acceptance: the last step whose update is fully applied (what
        # Ctrl-C saves); _saved: the last step on disk; nonfinite_streak: skipped updates in a row
        self.steps_done, self._done_prompts, self._saved = self.start_step, self.prompts_used, self.start_step
        self._done_acceptance = self._acceptance()
        self.nonfinite_streak, self.last_rollout, self.last_stats = 0, None, None
        self.observer = observation.Observer(cfg, self.tok, self.world, self.is_main)  # step 4, its no-signal streak
        self.val = self.task.sample("val", cfg.log.val_size, seed=cfg.seed)
        if self.is_main:
            runs.record_start(self.run_dir, cfg, found, changed)  # the first write to the run folder
        self.logger = MetricsLogger(self.run_dir, resume_step=self.start_step if found is not None else None) \
            if self.is_main else _NoLogger()
        self.plots: list[Path] = []

    def _open_run(self, cfg: RunConfig, resume: str | None, dtype: torch.dtype):
        """The run folder, before anything loads -> (the effective config, the checkpoint resumed or None, the
        keys a resume changed). Rank 0 locks the folder (refused: unwritable, or another run holds it); then a
        fresh run refuses a folder holding a run; a resume reads the newest checkpoint that verifies and
        refuses changes to keys outside runs.RESUMABLE (nothing else is written until record_start). Then
        the prompts against the policy's context and the step against the memory: refused, the folder is
        left as it was."""
        self._fresh = FreshFolder(cfg.run_dir) if resume is None and self.is_main else None  # what the run adds
        cfg, self.run_dir, found, changed, self._run_lock = runs.open_run(cfg, resume, dtype, lock=self.is_main)
        if self.world is not None:  # every rank has checked the folder before rank 0 writes to it
            self.world.all_gather_object(str(self.run_dir),
                                         "the run folder (rank 0 may have refused it: see its error)")
        try:
            memory.check_run(cfg)
        except CodraftError:
            self._unlock()
            if self._fresh is not None:
                self._fresh.discard()
            raise
        return cfg, found, changed

    def _learner(self, cfg: RunConfig) -> Learner:
        """What the update reads and changes: the models, the layout's step, and AdamW with its schedule for
        the policy (warm-up, then cosine to 10 %) and the co-trained draft (warm-up), over the parameters this
        rank trains (FSDP's shards where the layout shards, a stage's under pp)."""
        g, d = cfg.grpo, cfg.draft
        opt = adamw(self.train_step.owned()[0], lr=g.lr, weight_decay=g.weight_decay, betas=(0.9, 0.99))
        optimisers = Optimisers(opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(g.warmup_steps, cfg.steps,
                                                                                          floor=0.1)))
        if self.trains_draft:
            optimisers.draft = adamw(self.draft.trainable_parameters(), lr=d.lr, betas=(0.9, 0.95))
            optimisers.draft_sched = torch.optim.lr_scheduler.LambdaLR(optimisers.draft, warmup(d.warmup_steps))
        return Learner(self.policy, self.draft, self.trains_draft, self.train_step, optimisers, self.rollout_weights,
                       self.vllm, self.reference, self.policy_dtype, self.draft_dtype, cfg.device)

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.learner.optimisers.policy

    @property
    def sched(self):
        return self.learner.optimisers.policy_sched

    @property
    def draft_opt(self) -> torch.optim.Optimizer | None:
        return self.learner.optimisers.draft

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
                          "larger on the real preset (docs/real-preset.md); rollout.dtype=bfloat16 "
                          "rounds the weights as the trainer does", stacklevel=3)
        return policy_dtype, draft_dtype

    def _join_ranks(self, cfg: RunConfig) -> None:
        """More than one rank (parallel.dp · pp · cp · tp > 1): one process per rank (torchrun), placed by the
        layout's DeviceMesh (``codraft.parallel.mesh``); every rank decodes its rollout share and gathers all,
        trains its prompt groups (dp), stage (pp), rows (cp) and share of each product (tp); only rank 0 writes
        (metrics, plots, checkpoints, progress)."""
        par = cfg.parallel
        self.layout = Layout.of(par)
        self.world = join_world(cfg.device, par.timeout, self.layout.keys(), self.layout.world) \
            if self.layout.world > 1 else None
        self.mesh = build_mesh(self.layout, cfg.device, par.timeout) if self.world is not None else None
        self.is_main = self.world is None or self.world.rank == 0

    def _engine(self, draft, routes: bool = False) -> Engine:
        """An engine over the rollout weights and ``draft`` (None: plain), drafting draft.gamma tokens per
        round or, with rollout.draft_length=auto, up to that many; ``routes``: its rollouts record the experts
        each token went to (routing replay)."""
        policy, draft = self.rollout_weights.policy, self.rollout_weights.draft_for(draft)
        if draft is None:
            return Engine(policy, record_routes=routes)
        if self.cost_model is None:
            return Engine(policy, draft, self.cfg.draft.gamma, record_routes=routes)
        return Engine(policy, draft, "auto", cost_model=self.cost_model, record_routes=routes)

    def _rollout_engines(self, cfg: RunConfig) -> tuple:
        """(rollout, validation, plain) engines: vLLM's (rollout.backend=vllm) or codraft's. Validation (greedy)
        has its own, so its rounds stay out of the rollouts' acceptance estimate (draft_length=auto), which
        checkpoints carry; the plain one (the speedup probe's rollout) records routes as the rollout does."""
        if self.vllm is not None:
            return self.vllm.engine, self.vllm.val_engine, self.vllm.plain_engine
        replay = cfg.grpo.routing_replay
        return self._engine(self.draft, replay), self._engine(self.draft), self._engine(None, replay)

    @property
    def prompts_used(self) -> int:
        """The train stream's position (saved in checkpoints; a resume sets it)."""
        return self.train_prompts.used

    @prompts_used.setter
    def prompts_used(self, used: int) -> None:
        self.train_prompts.seek(used)

    def _probe(self) -> list[int]:
        """The sequence the vLLM refit check scores: the prompt of the first validation problem."""
        return evaluate.problem_ids(self.tok, self.task.sample("val", 1, seed=self.cfg.seed)[0])

    def _estimates(self) -> dict:
        """The running acceptance estimates (draft_length=auto) a resume must continue: rollout, frozen probe."""
        engines = {"rollout": self.engine, "frozen": self.frozen_engine}
        return {k: e.acceptance for k, e in engines.items() if e is not None and e.acceptance is not None}

    def _acceptance(self) -> dict:
        return {k: a.state_dict() for k, a in self._estimates().items()}

    def step(self, step: int) -> dict:
        """One RL step (rollout, reward, update, metrics); returns the step's metrics row."""
        torch.manual_seed(step_seed(self.cfg.seed, step))
        t_step = time.perf_counter()
        rollout = self.rollout(step)
        probes = self.probe(step, rollout)
        scored = self.score(step, rollout)
        update = self.update(step, rollout, scored)
        return self.observe(step, rollout, probes, scored, update, t_step)

    # The phases, each in its module; methods, so that a caller (a test, the e2e benchmark) can run or patch one.
    def rollout(self, step: int) -> Rollout:
        r = rollout_phase.rollout(step, self.cfg, self.train_prompts, self._generate, engine=self.engine,
                                  policy=self.policy, weights=self.rollout_weights, tok=self.tok, env=self.env,
                                  speculative=self.draft is not None)
        self.last_rollout, self.last_stats = r.out, r.stats  # (what tests and the e2e benchmark read)
        return r

    def probe(self, step: int, rollout: Rollout) -> Probes:
        return rollout_phase.probe(step, self.cfg, rollout, self._generate, plain_engine=self.plain_engine,
                                   frozen_engine=self.frozen_engine, speculative=self.draft is not None)

    def score(self, step: int, rollout: Rollout) -> Scored:
        return scoring.score(step, rollout, self.cfg, env=self.env, rewards=self.rewards, tok=self.tok,
                             world=self.world)

    def update(self, step: int, rollout: Rollout, scored: Scored) -> Update:
        return update_phase.update(self.cfg, self.learner, step, rollout, scored, streak=self.nonfinite_streak,
                                   committed=lambda streak: self._completed(step, streak))

    def _completed(self, step: int, streak: int) -> None:
        """The update's commit point reached (signals held): from here on ``step`` counts as completed."""
        self.steps_done, self._done_prompts, self._done_acceptance = step + 1, self.prompts_used, self._acceptance()
        self.nonfinite_streak = streak

    def observe(self, step: int, rollout: Rollout, probes: Probes, scored: Scored, update: Update,
                t_step: float) -> dict:
        return self.observer.observe(step, rollout, probes, scored, update, t_step, lr=self.sched.get_last_lr()[0],
                                     logger=self.logger, validate=self.validate)

    def validate(self) -> float:
        return rollout_phase.validate(self.val, self._generate, engine=self.val_engine, policy=self.policy,
                                      weights=self.rollout_weights, tok=self.tok, env=self.env,
                                      rewards=self.rewards, world=self.world)

    def _generate(self, engine: Engine, prompts, seed: int, temperature=None, group: int = 1, problems=None):
        decoding = rollout_phase.Decoding(self.cfg, self.tok, self.env, self.world, self.progress)
        return rollout_phase.generate(decoding, engine, prompts, seed, temperature, group, problems)

    def save(self) -> Path | None:
        state = {"prompts_used": self._done_prompts}
        if self._done_acceptance:  # draft_length=auto: a resume continues the same estimates
            state["acceptance"] = self._done_acceptance
        return checkpointing.save(self.checkpoints, self.steps_done, state,
                                  saved=lambda: setattr(self, "_saved", self.steps_done))

    def fit(self):
        """Run the steps (``_fit``). An allocation that fails is one line naming the keys to lower; when no step
        had completed, the folder this run created is removed, so it does not block a rerun. A full disk is one
        line too."""
        try:
            return self._fit()
        except Exception as e:
            if is_disk_full(e) and not isinstance(e, DiskFullError):
                raise run_full(self.run_dir, e, ckpt.latest_checkpoint(self.run_dir)) from e
            if not memory.is_out_of_memory(e):
                raise
            removed = self.run_dir if self.steps_done == 0 and self._fresh is not None and self._fresh.discard() \
                else None
            raise memory.out_of_memory(self.cfg, e, self.steps_done, removed) from e

    def _fit(self):
        cfg = self.cfg
        bar = tqdm(range(self.start_step, cfg.steps), desc="train", disable=not self.progress, dynamic_ncols=True,
                   initial=self.start_step, total=cfg.steps)
        # SIGINT / SIGTERM: one process stops at once; several ranks at the next step boundary, all together
        with Signals(immediate=self.world is None) as signals:
            try:
                if self.start_step == 0 and cfg.log.val_every:
                    self.logger.log(0, {"val_accuracy": self.validate()})
                for step in bar:
                    m = self.step(step)
                    self.logger.log(step + 1, m)
                    if self.nonfinite_streak >= cfg.grpo.max_nonfinite_steps:
                        raise NonFiniteError(
                            f"step {step}: {self.nonfinite_streak} non-finite (NaN/inf) steps in a row "
                            f"(grpo.max_nonfinite_steps={cfg.grpo.max_nonfinite_steps}); stopping. "
                            f"Last good checkpoint: {ckpt.latest_checkpoint(self.run_dir) or 'none'}")
                    post = {"reward": f"{float(m['reward_mean']):.2f}", "step_s": f"{m['time_step']:.1f}"}
                    if "acceptance_length" in m:
                        post["tau"] = f"{m['acceptance_length']:.2f}"
                    bar.set_postfix(post)
                    # no checkpoint mid NaN streak: it could rotate the last good one out (keep_last)
                    every = cfg.log.checkpoint_every
                    if every and ((step + 1) % every == 0 or step + 1 == cfg.steps) and not self.nonfinite_streak:
                        self.save()
                    stop = signals.agreed(self.world, step + 1)  # (a signal during the save above: it is kept)
                    if stop:
                        raise Interrupted(stop)
            except KeyboardInterrupt as e:
                # Only completed steps count. Before a step's commit point (update_phase.commit) θ, φ and the
                # optimisers still hold step `steps_done`'s state and `_done_prompts` rewinds the data
                # position; after it the step is complete (its metrics row may be missing). RNG needs
                # no rewind: every step reseeds from (seed, step). Several ranks are all here, after the same step.
                signals.stopping()  # more signals wait for the checkpoint and the line saying where it is
                bar.close()
                if self.steps_done > self._saved and not self.nonfinite_streak:
                    self.save()
                sys.stderr.write(self._interrupted(e) + "\n")  # one write: the ranks' lines do not interleave
                sys.stderr.flush()
                raise
            finally:  # never checkpoints: after an error the in-memory state may be bad
                self._close_run()
        return self.run_dir

    def leave(self) -> None:
        """After a run every rank ended at the same step (completed, or stopped by an agreed signal): the tap
        channel's last transfers finished (bounded), then the process groups destroyed while this process is
        whole. Not after an error: a peer may be gone, and the exit must not wait on it."""
        if self.world is None:
            return
        self.train_step.close()  # (the pipeline's tap channel)
        if self.vllm is not None:  # vLLM's groups over the trainer's ranks, while they are valid
            self.vllm.release()
        leave_process_group()

    def _interrupted(self, e: KeyboardInterrupt) -> str:
        """The line each rank prints when a signal stopped the run: after which step, and where it is saved."""
        last = ckpt.latest_checkpoint(self.run_dir)
        who = "" if self.world is None else f"rank {self.world.rank} of {self.world.size}: "
        how = f" by {e.args[0]}" if isinstance(e, Interrupted) else ""
        return (f"{who}interrupted after step {self.steps_done}{how}; latest checkpoint: {last or 'none'}"
                + (f" (continue with --resume {self.run_dir})" if last else ""))

    def _close_run(self):
        """Close the metrics and plot the run; a full disk leaves a warning instead of plots (the run's own
        error, if any, is the one raised). vLLM's engines (rollout.backend=vllm) are shut down: their memory
        is freed only so."""
        if self.vllm is not None:
            self.vllm.close()
        try:
            self.logger.close()
            if self.is_main:
                self.plots = plot_run(self.run_dir)
        except Exception as e:
            if not is_disk_full(e):
                raise
            warnings.warn(f"no space left on device for the metrics or plots of {self.run_dir}", stacklevel=2)
        finally:
            self._unlock()  # the run is over: the folder is free for a resume

    def report(self) -> str:
        """Where the run is and how it went (what `codraft train` prints at the end and on Ctrl-C)."""
        return runs.report(self.run_dir, self.plots)


class _NoLogger:
    """The metrics logger of ranks other than 0: they compute the same rows, rank 0 writes them."""

    def log(self, step, metrics):
        pass

    def samples(self, step, rows):
        pass

    def close(self):
        pass


def train(cfg: RunConfig, resume: str | None = None, progress: bool = True) -> Path:
    return Trainer(cfg, resume=resume, progress=progress).fit()
