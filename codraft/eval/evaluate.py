"""Decode prompts, score the completions with the run's ``RewardSet``, and the figures: what ``codraft eval``
reports and what the trainer's validation logs (``val_accuracy`` is the greedy pass's ``mean_reward``), one
code path for both.

A pass decodes every prompt (``group`` times: n samples per prompt) through a ``decode`` function, so each
caller keeps its own way of running the engine (the trainer: its shards and ranks, ``rollout_phase.generate``;
the command: batches under a progress bar, ``batched``), and scores the outputs: with the reward functions,
or, for multi-turn episodes, with the rewards the environment gave them.

The figures of a pass: ``mean_reward`` (over the samples some function judged: a sample every function
returned None for is left out, as in training), ``accuracy`` (the share of judged samples whose reward
reaches ``threshold``, 1 by default: "solved" for a 0/1 reward), and with n samples per prompt
``pass@k`` (``passk``; a sample left unjudged counts as not solved, a prompt none of whose samples was
judged is left out).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from tqdm import tqdm

from codraft.envs import Episode
from codraft.eval.passk import pass_at_k
from codraft.rewards import RewardSet, Scores
from codraft.rollout import Engine, SpecStats

# decode(prompt ids, problems, temperature, seed, group) -> (outputs, seconds, SpecStats); prompts come in
# whole groups of ``group`` repeats
Decode = Callable[[list, list, float, int, int], tuple]


@dataclass
class Pass:
    """One decode of the prompts (each ``group`` times), scored."""
    rewards: list               # each sample's reward (None: no function judged it)
    per_function: dict          # reward function name -> each sample's value (None: not judged)
    errors: list[str]           # one line per failed (function, sample)
    lengths: list[int]          # each completion's tokens
    stats: SpecStats
    seconds: float
    group: int = 1              # samples per prompt, consecutive

    @property
    def judged(self) -> list[float]:
        return [r for r in self.rewards if r is not None]

    @property
    def mean_reward(self) -> float:
        """The mean over judged samples (0 when none was judged): the trainer's ``val_accuracy``."""
        judged = self.judged
        return sum(judged) / len(judged) if judged else 0.0

    def accuracy(self, threshold: float = 1.0) -> float:
        """The share of judged samples whose reward reaches ``threshold``."""
        judged = self.judged
        return sum(r >= threshold for r in judged) / len(judged) if judged else 0.0

    def pass_at(self, ks: list[int], threshold: float = 1.0) -> dict[int, float]:
        """pass@k for each k, over the prompts with at least one judged sample."""
        n = self.group
        prompts = [self.rewards[i:i + n] for i in range(0, len(self.rewards), n)]
        counts = [sum(r is not None and r >= threshold for r in p) for p in prompts if any(r is not None for r in p)]
        return {k: sum(pass_at_k(n, c, k) for c in counts) / len(counts) if counts else 0.0 for k in ks}

    def function_means(self) -> dict[str, float]:
        """Each reward function's mean over the samples it judged (the trainer's reward/NAME_mean)."""
        out = {}
        for name, values in self.per_function.items():
            judged = [v for v in values if v is not None]
            if judged:
                out[name] = sum(judged) / len(judged)
        return out


def problem_ids(tok, problem) -> list[int]:
    """The ids a problem's prompt is decoded from: rendered at load (data files), or the tokenizer's."""
    return problem.prompt_ids if problem.prompt_ids is not None else tok.prompt_ids(problem.prompt)


def score(outputs: list, problems: list, rewards: RewardSet, tok) -> Scores:
    """The outputs' rewards: an environment's episodes carry theirs; completions go to the reward functions."""
    if outputs and isinstance(outputs[0], Episode):
        return Scores([o.reward for o in outputs], {},
                      [f"environment: {o.reward_error!r}" for o in outputs if o.reward_error is not None])
    return rewards.score(problems, [tok.decode(o.tokens) for o in outputs], [o.tokens for o in outputs])


def run_pass(decode: Decode, problems: list, prompts: list, rewards: RewardSet, tok, *, temperature: float,
             seed: int, group: int = 1) -> Pass:
    """Decode each prompt ``group`` times (consecutive) and score the samples."""
    problems = [p for p in problems for _ in range(group)]
    prompts = [p for p in prompts for _ in range(group)]
    outputs, seconds, stats = decode(prompts, problems, temperature, seed, group)
    s = score(outputs, problems, rewards, tok)
    return Pass(s.totals, s.per_function, s.errors, [len(o.tokens) for o in outputs], stats, seconds, group)


def greedy(decode: Decode, problems: list, prompts: list, rewards: RewardSet, tok) -> Pass:
    """The greedy pass (one sample per prompt): what validation reports."""
    return run_pass(decode, problems, prompts, rewards, tok, temperature=0.0, seed=0)


def batched(engine: Engine, max_new_tokens: int, *, eos_id, top_p: float = 1.0, batch: int = 64,
            progress: bool = True, desc: str = "eval") -> Decode:
    """A ``Decode`` over ``engine``: at most ``batch`` rows per ``generate`` call (whole groups, at least one),
    batch i seeded from (seed, i); a progress bar over the samples. The batches' statistics are pooled."""
    def decode(prompts, problems, temperature, seed, group):
        per = max(group, batch // group * group)
        out, stats, t0 = [], [], time.perf_counter()
        with tqdm(total=len(prompts), desc=desc, unit="sample", disable=not progress, dynamic_ncols=True,
                  leave=False) as bar:
            for i, start in enumerate(range(0, len(prompts), per)):
                part = prompts[start:start + per]
                out += engine.generate(part, max_new_tokens, temperature=temperature, top_p=top_p,
                                       seed=(seed + i * 0x9E3779B97F4A7C15) % 2**63, eos_id=eos_id)
                stats.append(engine.stats)
                bar.update(len(part))
        return out, time.perf_counter() - t0, stats[0] if len(stats) == 1 else SpecStats.pool(stats)
    return decode


@dataclass
class Evaluation:
    greedy: Pass | None
    sampled: Pass | None
    pass_at_k: dict[int, float]
    threshold: float


def evaluate(decode: Decode, problems: list, prompts: list, rewards: RewardSet, tok, *, do_greedy: bool = True,
             samples: int = 0, temperature: float = 1.0, seed: int = 0, ks: list[int] = (),
             threshold: float = 1.0) -> Evaluation:
    """The greedy pass (``do_greedy``) and ``samples`` samples per prompt at ``temperature`` with pass@k."""
    g = greedy(decode, problems, prompts, rewards, tok) if do_greedy else None
    s = run_pass(decode, problems, prompts, rewards, tok, temperature=temperature, seed=seed, group=samples) \
        if samples else None
    return Evaluation(g, s, s.pass_at(list(ks), threshold) if s is not None else {}, threshold)
