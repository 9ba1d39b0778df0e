"""Run configuration: typed sections, YAML presets shipped in the package, `key=value` overrides.

Everything is validated before any work starts (``load_config`` and ``Trainer`` both run
``validate``): an unknown key names the closest valid keys, a wrong type names the key and the
expected type, a value out of range names the key, the value and the allowed range (``RULES``:
one row per key; ``CROSS_RULES``: rules between keys), a malformed YAML file or override names
the file or the override and the line and column. The resolved config is what gets saved in the
run folder, so a run can be reproduced from it alone.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

import torch
import yaml

from codraft.drafts import available_drafts
from codraft.tasks import TASKS


@dataclass
class PolicyConfig:
    init: str = "tiny-sft"          # "tiny-sft" (cached warm start), "smollm2-135m", or an HF folder
    dtype: str = "float32"


@dataclass
class TaskConfig:
    name: str = "arith"
    max_chars: int = 400            # longer completions get reward 0
    format_reward: float = 0.0


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


@dataclass
class DraftConfig:
    mode: str = "cotrain"           # none | frozen | cotrain
    kind: str = "dflash"            # a kind of codraft.drafts.available_drafts()
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


@dataclass
class ParallelConfig:
    cp: int = 1                     # context-parallel ranks (launch with torchrun --nproc-per-node pp·cp)
    pp: int = 1                     # pipeline stages (the policy's decoder layers split over them)
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
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
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


class ConfigError(ValueError):
    pass


# ---------------------------------------------------------------- the rules: one row per key


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


COUNT = Range(1)
EVERY = Range(0, note="every k steps; 0 = off")
NON_NEGATIVE = Range(0)
PRECISION = OneOf(("float32", "bfloat16", "auto"))  # a loss's products (codraft.train.precision)
POSITIVE = Range(0, lo_open=True)

# Every key of RunConfig, with the values it allows (tests/test_config.py checks the table is complete).
RULES: dict[str, Range | OneOf | Text | Device | Flag] = {
    "seed": Range(0, 2**63 - 1),
    "steps": COUNT,
    "run_dir": Text("a folder path (not empty)"),
    "device": Device(),
    "policy.init": Text("a policy name (tiny-sft, smollm2-135m) or an HF-format folder (not empty)"),
    "policy.dtype": OneOf(("float32", "bfloat16")),
    "task.name": OneOf(tuple(TASKS)),
    "task.max_chars": Range(1, note="longer completions get reward 0"),
    "task.format_reward": Range(0, 1, hi_open=True, note="below a correct answer's 1"),
    "rollout.prompts_per_step": COUNT,
    "rollout.group_size": COUNT,
    "rollout.max_new_tokens": COUNT,
    "rollout.temperature": Range(0, note="0 = greedy"),
    "rollout.top_p": Range(0, 1, lo_open=True, note="1 = off"),
    "rollout.shards": Range(0, note="0 = one per rank (parallel.pp × parallel.cp)"),
    "rollout.dtype": OneOf(("policy", "float32", "bfloat16")),
    "rollout.draft_length": OneOf(("fixed", "auto")),
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
    "draft.mode": OneOf(("none", "frozen", "cotrain")),
    "draft.kind": OneOf(available_drafts()),
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
    "parallel.cp": Range(1, note="ranks that split each packed row (zigzag ring); > 1 needs torchrun"),
    "parallel.pp": Range(1, note="pipeline stages, at most the policy's layers; > 1 needs torchrun"),
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
    ranks = c.parallel.cp * c.parallel.pp
    shards = c.rollout.shards or ranks
    if shards % ranks:
        return f"config key 'rollout.shards' must be 0 or a multiple of the ranks, parallel.pp × parallel.cp = " \
               f"{ranks} (each rank decodes as many shards), got {c.rollout.shards}"
    if c.rollout.prompts_per_step < shards:
        return f"config key 'rollout.prompts_per_step' must be >= the rollout shards ({shards}: rollout.shards, " \
               f"or parallel.pp × parallel.cp), so that every shard has a prompt group; got " \
               f"{c.rollout.prompts_per_step}"
    if c.parallel.microbatches > c.rollout.prompts_per_step:
        return f"config key 'parallel.microbatches' must be <= rollout.prompts_per_step=" \
               f"{c.rollout.prompts_per_step} (micro-batches hold whole groups), got {c.parallel.microbatches}"
    return None


def _taps_reach_the_device(c: RunConfig) -> str | None:
    if c.parallel.pp > 1 and c.parallel.taps == "shm" and c.device != "cpu":
        return f"config key 'parallel.taps' must not be shm on device={c.device}: the shared-memory channel is " \
               "CPU only; give parallel.taps=p2p (point-to-point on the device's own group)"
    return None


# Rules between keys: each returns the error message, or None.
CROSS_RULES: tuple[Callable[[RunConfig], str | None], ...] = (_auto_needs_a_draft, _rollout_copy_is_narrower,
                                                               _draft_folder_exists, _every_rank_has_work,
                                                               _taps_reach_the_device)


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


# ---------------------------------------------------------------- keys, types, overrides


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


def _yaml_load(text: str, where: str, column_offset: int = 0):
    """``yaml.safe_load``; a syntax error is one ConfigError line: ``where``, line, column, the problem."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        if mark is not None:
            line, column = mark.line, mark.column
        else:  # a ReaderError (a character YAML does not allow) has only a position
            pos = getattr(e, "position", 0)
            line, column = text.count("\n", 0, pos), pos - (text.rfind("\n", 0, pos) + 1)
        column += column_offset if line == 0 else 0
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML at line {line + 1}, column {column + 1}: {problem}") from None


def _coerce(key: str, value, typ: type, where: str | None = None, column_offset: int = 0):
    """Convert a YAML/CLI value to ``typ``; strings from the command line are parsed as YAML scalars."""
    if isinstance(value, str) and typ is not str:
        value = _yaml_load(value, where or f"value {value!r} of config key {key!r}", column_offset)
    if typ is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    _check_type(key, value, typ)
    return value


def flatten(d: dict, prefix="") -> dict:
    """Nested sections -> {"section.key": value}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Keys that existed once, ignored with a warning so the config.yaml of an older run still loads.
RETIRED = {"rollout.speculate": "superseded by rollout.draft_length (auto sizes each round's drafts)"}


def apply(cfg: RunConfig, flat: dict, *, where: str | None = None, column_offset: int = 0) -> RunConfig:
    """Set each ``key: value`` of ``flat`` (types converted and checked; ranges: ``validate``).
    where/column_offset: the override the values come from, for YAML errors."""
    keys = _all_keys(RunConfig)
    for key, value in flat.items():
        if key in RETIRED:
            warnings.warn(f"config key {key!r} is retired ({RETIRED[key]}); ignored", stacklevel=2)
            continue
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(sorted(keys))}"
            raise ConfigError(f"unknown config key {key!r}{hint}")
        obj = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, _coerce(key, value, keys[key], where, column_offset))
    return cfg


# ---------------------------------------------------------------- presets and files


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("codraft.configs").iterdir() if p.name.endswith(".yaml"))


def _read_source(name: str) -> tuple[str, dict]:
    """(how messages name it, its mapping) of ``--config NAME``: a preset name, else a file read as YAML
    whatever its extension."""
    path, yaml_suffix = Path(name), Path(name).suffix in (".yaml", ".yml")
    if name in preset_names():
        label, text = f"preset {name!r}", resources.files("codraft.configs").joinpath(f"{name}.yaml").read_text()
    elif path.is_file():
        label = f"config file {name!r}" + ("" if yaml_suffix else " (not a preset name: read as a YAML file)")
        try:
            text = path.read_text()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{label}: not a text file ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise ConfigError(f"{label}: cannot be read ({e.strerror})") from None
    elif yaml_suffix:
        raise ConfigError(f"config file {name!r} does not exist")
    elif path.exists():
        raise ConfigError(f"config file {name!r} is not a file (and not a preset: {', '.join(preset_names())})")
    else:
        raise ConfigError(f"unknown preset {name!r} (presets: {', '.join(preset_names())}); "
                          f"no file {name!r} either")
    data = _yaml_load(text, label)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: must be a mapping of keys (key: value lines), got a {type(data).__name__}")
    return label, data


def _split_override(item: str) -> tuple[str, str]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value")
    key, value = item.split("=", 1)
    return key.strip(), value


def load_config(preset_or_file: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """Preset name (e.g. "tiny") or YAML file, then `key=value` overrides, then ``validate``."""
    label, data = _read_source(preset_or_file or "tiny")
    try:
        cfg = apply(RunConfig(), flatten(data))
    except ConfigError as e:
        raise ConfigError(f"{label}: {e}") from None
    for item in overrides:
        key, value = _split_override(item)
        apply(cfg, {key: value}, where=f"override {item!r}", column_offset=len(item) - len(value))
    return validate(cfg)
