"""Run configuration: typed sections, YAML presets shipped in the package, `key=value` overrides.

Everything is validated before any work starts: an unknown key names the closest valid
keys, a wrong type names the key and the expected type. The resolved config is what
gets saved in the run folder, so a run can be reproduced from it alone.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

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
    speculate: str = "always"       # always | auto: decode plainly while the last measured speedup is < 1


@dataclass
class GRPOConfig:
    lr: float = 1e-5
    warmup_steps: int = 2
    eps_low: float = 0.2
    eps_high: float = 0.28
    norm: str = "token"             # token | sequence
    leave_one_out: bool = False
    kl_coef: float = 0.0
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    max_nonfinite_steps: int = 3    # stop after this many skipped (NaN/inf loss or grad norm) steps in a row


@dataclass
class DraftConfig:
    mode: str = "cotrain"           # none | frozen | cotrain
    kind: str = "dflash"            # a kind of codraft.drafts.available_drafts()
    init: str = "offline"           # "offline" (cached short offline training), "random", or a checkpoint folder
    gamma: int = 7
    lam: float = 1.0                # λ in L = L_RL + λ·L_draft
    num_anchors: int = 0            # dflash/dspark: blocks per sequence in the draft loss (0 = the draft's own); others ignore it
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "task.name": tuple(TASKS),
    "grpo.norm": ("token", "sequence"),
    "rollout.speculate": ("always", "auto"),
    "draft.mode": ("none", "frozen", "cotrain"),
    "draft.kind": available_drafts(),
    "policy.dtype": ("float32", "bfloat16"),
}


class ConfigError(ValueError):
    pass


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


def _coerce(key: str, value, typ: type):
    """Convert a YAML/CLI value to ``typ``; strings from the command line are parsed as YAML scalars."""
    if isinstance(value, str) and typ is not str:
        value = yaml.safe_load(value)
    if typ is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"config key {key!r} expects {typ.__name__}, got {value!r} ({type(value).__name__})")
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"config key {key!r} must be one of {', '.join(CHOICES[key])}; got {value!r}")
    return value


def _flatten(d: dict, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def apply(cfg: RunConfig, flat: dict) -> RunConfig:
    keys = _all_keys(RunConfig)
    for key, value in flat.items():
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(sorted(keys))}"
            raise ConfigError(f"unknown config key {key!r}{hint}")
        obj = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, _coerce(key, value, keys[key]))
    return cfg


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("codraft.configs").iterdir() if p.name.endswith(".yaml"))


def load_config(preset_or_file: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """Preset name (e.g. "tiny") or YAML file, then `key=value` overrides, validated."""
    name = preset_or_file or "tiny"
    if Path(name).suffix in (".yaml", ".yml"):
        if not Path(name).is_file():
            raise ConfigError(f"config file {name!r} does not exist")
        data = yaml.safe_load(Path(name).read_text()) or {}
    elif name in preset_names():
        data = yaml.safe_load(resources.files("codraft.configs").joinpath(f"{name}.yaml").read_text()) or {}
    else:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(preset_names())} (or pass a .yaml file)")
    if not isinstance(data, dict):
        raise ConfigError(f"config {name!r} must be a mapping of keys, got {type(data).__name__}")
    cfg = apply(RunConfig(), _flatten(data))
    flat = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        k, v = item.split("=", 1)
        flat[k.strip()] = v
    return apply(cfg, flat)
