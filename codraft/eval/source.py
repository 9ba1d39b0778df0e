"""What ``codraft eval MODEL_OR_RUN`` evaluates, and on what.

``MODEL_OR_RUN`` is one of
  * a run folder: its newest checkpoint that verifies (sizes and sha256 of every file; a newer one that does
    not is skipped with a warning naming what is wrong);
  * a checkpoint ``RUN/step_N`` (refused in one line when it does not verify);
  * a policy name (tiny-sft, smollm2-135m, ...) or an HF-format folder.
A checkpoint gives the RL-trained policy, the co-trained draft (the default ``--draft``: speculative with
the run's own draft, as its validation decoded) and the run's config, whose data, reward and task are the
defaults the command's options override; its rollout weights (``rollout.dtype``) are made as the trainer
made them. A policy has no draft (plain decoding unless ``--draft``) and no data (``--data`` and
``--reward``, or ``--task``).

A run folder is not trusted (as its pickles are not): where its config's ``reward.funcs`` names code of yours
(``FILE.py:NAME``, ``module:NAME``) it is refused in one line unless ``--reward`` (or ``reward.funcs=``) names
the reward or ``--trust-run-rewards`` says the run is yours; the built-in rewards need no word.

The prompts: ``--data FILE``'s rows (all, or the first ``--limit``); else a built-in task's held-out split
(``--task``); else the run's own validation prompts: the first ``log.val_size`` of its held-out split,
exactly what its in-run validation decoded.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from codraft.config import ConfigError, RunConfig, load_config
from codraft.data import build_task
from codraft.drafts import Draft, draft_kind, init_draft
from codraft.drafts.eagle3_layer import parse_taps
from codraft.eval.evaluate import problem_ids
from codraft.export.source import checkpoint_draft
from codraft.policy import load_policy
from codraft.policy.warmstart import WARM_STARTS
from codraft.rewards import RewardSet, build_rewards, parse_funcs
from codraft.rollout.weights import RolloutWeights
from codraft.train import checkpoint as ckpt
from codraft.train.offline_draft import draft_for_command

# the config keys an evaluation may change (the others describe training); key=value on the command line
EVAL_SECTIONS = ("data.", "reward.", "task.")
EVAL_KEYS = ("device", "seed", "policy.dtype", "rollout.dtype", "rollout.top_p", "rollout.max_new_tokens",
             "log.val_size")
POLICY_NAMES = (*WARM_STARTS, "smollm2-135m")


@dataclass
class Target:
    """The policy and draft to decode with, the config, the prompts and the reward."""
    policy: torch.nn.Module     # what the engine decodes with (the rollout weights' policy)
    tok: object
    draft: Draft | None
    gamma: int | str | None     # tokens drafted per round, or "auto"
    cfg: RunConfig              # the run's config (defaults for a policy) with the command's overrides
    origin: str                 # what was loaded, for the report
    draft_label: str            # which draft, for the report ("none": plain decoding)
    problems: list
    prompts: list               # their prompt ids
    rewards: RewardSet
    data: str                   # where the prompts come from, for the report


def kind_of(name: str) -> str:
    """"checkpoint", "run" or "policy"; a path that is none of them: one line."""
    p = Path(name)
    if p.is_dir() and (p / ckpt.MARKER).is_file():
        return "checkpoint"
    if p.is_dir() and ((p / "config.yaml").is_file() or any(p.glob("step_*"))):
        return "run"
    if p.is_dir() or name in POLICY_NAMES:
        return "policy"
    raise FileNotFoundError(f"{name!r} is not a run folder, a checkpoint (RUN/step_N), a policy folder or a policy "
                            f"name ({', '.join(POLICY_NAMES)}): no such folder")


def newest_verified(run_dir: Path) -> Path:
    """The run's newest checkpoint whose every file matches its marker (sizes and sha256)."""
    skipped = []
    for path in reversed(ckpt.list_checkpoints(run_dir)):
        problem = ckpt.verify(path)
        if problem is None:
            if skipped:
                warnings.warn(f"skipped newer checkpoints that do not verify: {'; '.join(skipped)}", stacklevel=2)
            return path
        skipped.append(f"{path.name}: {problem}")
    if skipped:
        raise ckpt.CheckpointError(f"no checkpoint of {run_dir} verifies: {'; '.join(skipped)}")
    raise ckpt.CheckpointError(f"{run_dir} has no step_N checkpoint to evaluate (the run stopped before its first "
                               f"checkpoint: log.checkpoint_every)")


def check_overrides(overrides: list[str]) -> None:
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not (key.startswith(EVAL_SECTIONS) or key in EVAL_KEYS):
            raise ConfigError(f"{item!r}: eval takes key=value overrides of data.*, reward.*, task.* and "
                              f"{', '.join(EVAL_KEYS)} (the other keys describe training)")


def open_target(name: str, *, data: str | None, task: str | None, reward: str | None, overrides: list[str],
                max_new_tokens: int | None, limit: int | None, draft: str | None, gamma: str | None,
                draft_init: str, progress: bool, trust_run_rewards: bool = False) -> Target:
    check_overrides(overrides)
    kind = kind_of(name)
    checkpoint = None
    if kind == "checkpoint":
        checkpoint = Path(name)
        problem = ckpt.verify(checkpoint)
        if problem is not None:
            raise ckpt.CheckpointError(f"{checkpoint} is not a complete run checkpoint: {problem}")
    elif kind == "run":
        checkpoint = newest_verified(Path(name))
    saved = (yaml.safe_load((checkpoint / "config.yaml").read_text()) or {}) if checkpoint is not None else {}
    cfg = _config(name, checkpoint, saved, data=data, task=task, reward=reward, overrides=overrides,
                  max_new_tokens=max_new_tokens)
    chosen = reward is not None or any(o.split("=", 1)[0].strip() == "reward.funcs" for o in overrides)
    if checkpoint is not None and not chosen and not trust_run_rewards:
        check_trusted(name, cfg.reward.funcs)
    if cfg.env.name != "none" or cfg.env.tools:
        raise ValueError(f"{name}: the run plays multi-turn episodes (env.name={cfg.env.name}, env.tools="
                         f"{cfg.env.tools!r}); eval scores single completions only, for now")
    dtype = getattr(torch, cfg.policy.dtype)
    policy, tok, folder = load_policy(str(checkpoint / "policy") if checkpoint is not None else name, dtype)
    policy.to(cfg.device).eval()
    step = None if checkpoint is None else json.loads((checkpoint / ckpt.MARKER).read_text())["step"]
    origin = f"checkpoint {checkpoint} (step {step})" if checkpoint is not None else f"policy {name} ({folder})"

    source_task = build_task(cfg, tok, policy.config.max_position_embeddings)
    if data is not None:  # every row of the file (data.train = data.val = FILE)
        problems, where = list(source_task.val[:limit]), data
    else:
        problems = source_task.sample("val", limit or cfg.log.val_size, seed=cfg.seed)
        where = f"{cfg.data.val or cfg.data.train or cfg.task.name} (held-out split" + \
            (", the run's validation prompts)" if checkpoint is not None and not task and not limit else ")")
    rewards = build_rewards(cfg, source_task)
    prompts = [problem_ids(tok, p) for p in problems]

    r = cfg.rollout  # the weights the engine decodes with, made as the trainer made them
    weights = RolloutWeights(policy, getattr(torch, cfg.policy.dtype if r.dtype == "policy" else r.dtype))
    chosen, label, default_gamma = _draft(cfg, checkpoint, saved, policy, tok, folder, draft, gamma, draft_init,
                                          progress)
    gamma = None if chosen is None else _gamma(gamma, default_gamma)
    return Target(weights.policy, tok, weights.draft_for(chosen), gamma, cfg, origin, label, problems, prompts,
                  rewards, where)


def check_trusted(name: str, funcs: str) -> None:
    """A run folder is not trusted: the reward code its config names (FILE.py:NAME, module:NAME) is imported only
    on the user's word (``--reward``, ``reward.funcs=``, or ``--trust-run-rewards``); the built-in rewards are."""
    code = [s for s in parse_funcs(funcs) if ":" in s]
    if code:
        raise ValueError(f"{name}: the run's config names reward code ({', '.join(code)}), which eval would import "
                         f"and run; a run folder is not trusted: give --reward FUNCS (the same, if you trust that "
                         f"code) or --trust-run-rewards")


def _config(name: str, checkpoint: Path | None, saved: dict, *, data, task, reward, overrides,
            max_new_tokens) -> RunConfig:
    """The run's config (a policy: the defaults, plain decoding) with the options and ``key=value`` applied."""
    ran = saved.get("data") or {}
    ran_reward = (saved.get("reward") or {}).get("funcs") or ""
    extra = []
    if data is not None:
        extra += [f"data.train={data}", f"data.val={data}"]
        if reward is None and not ran_reward:
            if checkpoint is None:
                raise ValueError(f"--data {data}: name its reward with --reward (math, exact, regex, a task's name, "
                                 f"FILE.py:NAME or module:NAME; docs/your-data.md)")
            reward = (saved.get("task") or {}).get("name", "arith")  # the run's task's own reward, on the answer column
    elif task is not None:
        extra += [f"task.name={task}", "data.train=", "data.val="]
        if ran_reward and reward is None and ran.get("train"):
            extra.append("reward.funcs=")  # the task's own reward, not the run's data's
    elif checkpoint is None:
        raise ValueError(f"{name} is a policy, with no data of its own: give --data FILE (and --reward) or --task NAME")
    if reward is not None:
        extra.append(f"reward.funcs={reward}")
    if max_new_tokens is not None:
        extra.append(f"rollout.max_new_tokens={max_new_tokens}")
    if checkpoint is None:
        return load_config(None, [f"policy.init={name}", "draft.mode=none", *extra, *overrides])
    return load_config(str(checkpoint / "config.yaml"), [*extra, *overrides])


def _draft(cfg: RunConfig, checkpoint: Path | None, saved: dict, policy, tok, folder, spec: str | None,
           gamma: str | None, init: str, progress: bool):
    """(the draft or None, its label, the gamma it decodes with by default)."""
    d = cfg.draft
    if spec == "none" or (spec is None and (checkpoint is None or d.mode == "none")):
        return None, "none", None
    if spec is None:  # the run's own draft, from the checkpoint
        if draft_kind(d.kind).has_weights:
            found = checkpoint_draft(checkpoint, saved.get("draft") or {}, policy)
        else:
            found = init_draft(d.kind, policy, gamma=d.gamma, layers=parse_taps(d.taps))
        how = "auto" if cfg.rollout.draft_length == "auto" else d.gamma
        return found, f"the run's {d.kind} ({'co-trained' if d.mode == 'cotrain' else d.mode})", how
    fixed = int(gamma) if gamma not in (None, "auto") else 4
    found = draft_for_command(spec, policy, tok, folder, gamma=fixed, init=init, seed=cfg.seed, progress=progress)
    return found, spec, fixed


def _gamma(given: str | None, default):
    if given is None:
        return default
    return "auto" if given == "auto" else int(given)

