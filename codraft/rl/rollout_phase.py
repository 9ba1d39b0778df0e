"""Step 1 of an RL step (``Trainer.rollout``), the measurement extras on its prompts (``Trainer.probe``)
and the held-out accuracy (``Trainer.validate``): every decode the trainer runs.

The rollout engine (policy θ_t + draft φ_t, lossless speculative decoding) samples `group_size`
completions for each of `prompts_per_step` training prompts (`rollout.draft_length=auto`: each round
drafts 0..draft.gamma tokens, as many as pay off for the rows still running, none while a fresh draft is
still poor; the draft co-trains either way, since it learns from the rollout tokens, not from its
proposals); τ and the histogram of drafts per round (`gamma_chosen`) are logged. The probes run right
after the rollout, on its prompts and seed, and are not in time_step: every `log.speedup_every` steps the
measured rollout speedup (a plain-decoding rollout of the same prompts), and every
`log.frozen_probe_every` steps τ of a frozen copy of the initial draft (drift).

Context parallelism: the ranks decode the rollouts' shards and gather them (``generate``).

Every phase decodes through a ``generate`` it is given (the trainer's ``_generate``, which tests patch) rather
than calling ``generate`` here directly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from tqdm import tqdm

from codraft.config import RunConfig
from codraft.envs import Episode, play
from codraft.envs import prompt_ids as env_prompt_ids
from codraft.eval import evaluate
from codraft.rewards import ScoredOnce
from codraft.rl import memory
from codraft.rollout import Engine, SpecStats
from codraft.rollout.weights import RolloutWeights
from codraft.train.seeding import step_seed

# (engine, prompts, seed, temperature=None, group=1, problems=None) -> (results, seconds, SpecStats): ``generate``
# with its ``Decoding`` bound
Generate = Callable[..., tuple]


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
class Decoding:
    """What every decode reads besides its engine and prompts (``generate``)."""
    cfg: RunConfig              # rollout.* (shards, sampling), env.* (the episodes' limits)
    tok: object
    env: object                 # the multi-turn environment (env.name), or None: one completion per prompt
    world: object               # the ranks that share the rollouts, or None: one process
    progress: bool              # show a long rollout's progress bar (rank 0)


class TrainPrompts:
    """The task's train stream (a built-in generator or your data files) and its position, ``used`` (the
    trainer's prompts_used, saved in checkpoints). The stream opens at the first draw, so it starts where a
    resume has set the position."""

    def __init__(self, task, seed: int):
        self.task, self.seed = task, seed
        self.used, self._stream = 0, None

    def seek(self, used: int) -> None:
        """Move to position ``used``: the stream reopens there at the next draw."""
        self.used, self._stream = used, None

    def next(self, n: int) -> list:
        """The next ``n`` prompts."""
        if self._stream is None:  # (re)open at the position, e.g. after a resume
            self._stream = self.task.stream("train", seed=self.seed)
            for _ in range(self.used):
                next(self._stream)
        self.used += n
        return [next(self._stream) for _ in range(n)]


def prompt_ids(env, tok, problem) -> list[int]:
    """The ids a problem's prompt is decoded from: the environment's (env.tools: the tools' schemas in it),
    rendered at load (data files), or the tokenizer's."""
    if env is not None:
        return env_prompt_ids(env, tok, problem)
    return evaluate.problem_ids(tok, problem)


def generate(d: Decoding, engine: Engine, prompts, seed: int, temperature=None, group: int = 1, problems=None):
    """-> (results for every prompt, seconds, SpecStats). With an environment (``env.name``) each result
    is a multi-turn ``Episode`` of its problem (``problems``), scored.

    The prompts are decoded in ``rollout.shards`` shards of whole groups (0: one per CP rank),
    shard i with its own seed; each CP rank decodes a contiguous run of shards and the results
    are gathered in order. The rollouts are thus a function of (seed, shards), whatever the
    number of ranks: cp=1 with shards=2 samples exactly what cp=2 does (with draft.gamma fixed;
    draft_length=auto adapts to the rows each engine has seen). Stats are pooled; the time is
    the slowest rank's, the gather included."""
    r = d.cfg.rollout
    t0 = time.perf_counter()
    ranks, rank = (1, 0) if d.world is None else (d.world.size, d.world.rank)
    shards = r.shards or ranks
    groups = len(prompts) // group
    bounds = [groups * i // shards * group for i in range(shards)] + [len(prompts)]
    mine = range(shards * rank // ranks, shards * (rank + 1) // ranks)
    out, stats = [], []
    # a long rollout shows its rounds (at most max_new_tokens a shard) and its finished rows, after 2 s
    bar = tqdm(total=len(mine) * r.max_new_tokens, desc="rollout", unit="round", leave=False, delay=2,
               disable=not d.progress, dynamic_ncols=True)
    for k, i in enumerate(mine):
        part = prompts[bounds[i]:bounds[i + 1]]
        if part:
            shard_seed = seed if i == 0 else (seed + i * 0x9E3779B97F4A7C15) % 2**63  # a stream per shard
            kw = dict(temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                      seed=shard_seed, eos_id=d.tok.eos_id, progress=lambda done, n=len(part): _round(bar, done, n))
            if d.env is None:
                out += engine.generate(part, r.max_new_tokens, **kw)
            else:
                out += episodes(d, engine, part, problems[bounds[i]:bounds[i + 1]], **kw)
            stats.append(engine.stats)
        bar.update((k + 1) * r.max_new_tokens - bar.n)
    bar.close()
    if d.world is not None:
        shares = d.world.all_gather_object((out, stats), "the rollout shards")
        out, stats = [o for share, _ in shares for o in share], [st for _, sts in shares for st in sts]
    return out, time.perf_counter() - t0, stats[0] if len(stats) == 1 else SpecStats.pool(stats)


def episodes(d: Decoding, engine: Engine, prompts, problems, **kw) -> list[Episode]:
    """Multi-turn episodes of ``problems`` against the run's environment, scored."""
    e = d.cfg.env
    return play(engine, d.env, problems, d.tok, prompts=prompts, max_tokens=d.cfg.rollout.max_new_tokens,
                max_turns=e.max_turns, timeout=e.timeout, latency_ms=e.latency_ms, workers=e.workers,
                overlap=e.overlap, isolation=e.isolation, max_observation_chars=e.max_observation_chars, **kw)


def _round(bar, done: int, rows: int):
    """One decode round of a rollout: the bar advances a round and shows the rows finished."""
    bar.set_postfix_str(f"{done}/{rows} sequences done", refresh=False)
    bar.update()


def validate(problems: list, generate: Generate, *, engine: Engine, policy, weights: RolloutWeights, tok, env,
             rewards, world) -> float:
    """The held-out accuracy: the greedy pass of ``codraft eval`` (``codraft.eval.evaluate``) over the
    validation ``problems``, with their own ``engine``, scored by the run's ``rewards`` (or environment): its mean
    reward. Over several ranks rank 0 scores the gathered completions and the others get its scores
    (``ScoredOnce``)."""
    policy.eval()
    weights.check("validation")
    prompts = [prompt_ids(env, tok, p) for p in problems]

    def decode(prompts, problems, temperature, seed, group):
        return generate(engine, prompts, seed, temperature=temperature, group=group, problems=problems)
    return evaluate.greedy(decode, problems, prompts, ScoredOnce(rewards, world), tok).mean_reward


def rollout(step: int, cfg: RunConfig, train: TrainPrompts, generate: Generate, *, engine: Engine, policy,
            weights: RolloutWeights, tok, env, speculative: bool) -> Rollout:
    """1. The step's prompts (drawn from ``train``), `group_size` completions each, decoded by ``engine`` with
    the draft (``speculative``) or without."""
    r = cfg.rollout
    seed = step_seed(cfg.seed, step)
    problems = train.next(r.prompts_per_step)
    group = [p for p in problems for _ in range(r.group_size)]
    prompts = [prompt_ids(env, tok, p) for p in group]
    memory.check_prompts(train.task.name, max(map(len, prompts)), r.max_new_tokens,
                         policy.config.max_position_embeddings, cfg.policy.init)
    policy.eval()
    weights.check(f"step {step}")
    out, seconds, stats = generate(engine, prompts, seed, group=r.group_size, problems=group)
    m = {"time_rollout": seconds}
    epoch = train.task.epoch(train.used)
    if epoch is not None:  # data files: passes over data.train so far (1.5: half way through the second)
        m["epoch"] = epoch
    if speculative:  # gamma_chosen[g]: rounds that drafted g tokens; gamma_mean: per row-round
        m.update(acceptance_length=stats.acceptance_length, acceptance_per_position=stats.acceptance_per_position,
                 gamma_chosen=stats.gamma_chosen, gamma_mean=stats.mean_gamma)
    if env is not None:
        m.update(_episode_metrics(out, stats, speculative))
    return Rollout(group, prompts, out, stats, seconds, seed, m)


def _episode_metrics(out: list[Episode], stats, speculative: bool) -> dict:
    """Turns and tool calls per episode, environment errors, tool answers cut to env.max_observation_chars,
    the time spent in the environment (inside the tool calls, over every worker; and waiting with no row
    to decode), τ per turn."""
    n = len(out)
    m = dict(turns_mean=sum(o.turns for o in out) / n, tool_calls_mean=sum(o.tool_calls for o in out) / n,
             env_errors=sum(o.fault for o in out), episodes_ended_early=sum(o.reason is not None for o in out),
             observations_cut=sum(o.observations_cut for o in out),
             time_env=sum(o.env_s for o in out), time_env_wait=stats.env_wait_s)
    if speculative:
        m["acceptance_length_per_turn"] = stats.acceptance_length_per_turn
    return m


def _measures(every: int, step: int) -> bool:
    """Does this step measure the rollout speedup (log.speedup_every)?"""
    return bool(every) and step % every == 0


def probe(step: int, cfg: RunConfig, rollout: Rollout, generate: Generate, *, plain_engine: Engine,
          frozen_engine: Engine | None, speculative: bool) -> Probes:
    """The measurement extras on the rollout's prompts and seed: a plain rollout for the speedup (when the
    rollout is ``speculative``) and the frozen initial draft's τ (when there is a ``frozen_engine``)."""
    m, seconds = {}, 0.0
    group_size = cfg.rollout.group_size
    if _measures(cfg.log.speedup_every, step) and speculative:  # (without a draft the rollout is the plain one)
        _, t_plain, _ = generate(plain_engine, rollout.prompts, rollout.seed, group=group_size,
                                 problems=rollout.group)
        m.update(time_rollout_plain=t_plain, rollout_speedup=t_plain / rollout.seconds)
        seconds += t_plain
    if frozen_engine is not None and step % cfg.log.frozen_probe_every == 0:
        _, t_probe, frozen = generate(frozen_engine, rollout.prompts, rollout.seed, group=group_size,
                                      problems=rollout.group)
        m["frozen_acceptance_length"] = frozen.acceptance_length
        seconds += t_probe
    return Probes(m, seconds)
