"""Offline draft training (`codraft train-draft`) and the drafts a run or a command starts from.

Data comes from the target itself: the rollout engine samples completions for the task's
training prompts (temperature 1, like RL rollouts), and every training step runs the target
once over a packed batch of them (no grad) to get the tapped features and teacher logits —
the same ``DraftBatch`` the co-training step builds, so offline and online training share
one loss. The result is the starting point of a "frozen" draft and the initial weights for
co-training. Progress is checkpointed (``resume/``, written atomically; each step reseeds from
``step_seed``) so an interrupted run continues where it stopped, with the same draws.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from codraft.atomic import atomic_dir
from codraft.cache import cache_root
from codraft.drafts import Draft, DraftBatch, available_drafts, draft_kind, init_draft, load_draft
from codraft.drafts.batch import supervised_rows
from codraft.rollout import Engine
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer
from codraft.train.packing import pack
from codraft.train.schedule import warmup_cosine
from codraft.train.seeding import step_seed

CACHE_VERSION = 2  # bump when the offline recipe changes: cached drafts of older recipes are not reused


# ---------------------------------------------------------------- data


def sample_sequences(policy, tok, task, *, n_prompts: int, max_new_tokens: int, seed: int,
                     temperature: float = 1.0, batch: int = 64) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) pairs sampled from the target on the task's train prompts."""
    engine = Engine(policy)
    problems = task.sample("train", n_prompts, seed=seed + 17)
    out = []
    for i in range(0, n_prompts, batch):
        prompts = [tok.prompt_ids(p.prompt) for p in problems[i:i + batch]]
        res = engine.generate(prompts, max_new_tokens, temperature=temperature, seed=seed + i, eos_id=tok.eos_id)
        out += [(p, r.tokens) for p, r in zip(prompts, res)]
    return out


@torch.no_grad()
def target_batch(policy, sequences, feature_layers) -> DraftBatch:
    """Pack sequences into one row and run the target once: detached features + teacher logits."""
    dev = policy.embed_tokens.weight.device
    p = pack([s[0] for s in sequences], [s[1] for s in sequences], device=dev, share_prompts=False)
    hidden, feats = policy(p.input_ids, cu_seqlens=p.cu_seqlens, taps=tuple(feature_layers), head=False)
    rows = supervised_rows(p.completion)  # the only teacher rows a draft reads: the head runs on these alone
    return DraftBatch(p.input_ids, p.cu_seqlens, p.completion, feats, policy.logits(hidden[0, rows]), rows)


# ---------------------------------------------------------------- training


def train_offline(policy, tok, task, draft: Draft, *, out_dir: str | os.PathLike, steps: int = 200,
                  batch_sequences: int = 16, lr: float = 1e-3, n_prompts: int = 512, max_new_tokens: int = 64,
                  seed: int = 0, checkpoint_every: int = 50, progress: bool = True) -> dict:
    """Train ``draft`` on target samples; resumes from ``out_dir/resume``; saves ``out_dir/draft``."""
    _check_arguments(steps=steps, batch_sequences=batch_sequences, n_prompts=n_prompts,
                     max_new_tokens=max_new_tokens, checkpoint_every=checkpoint_every, lr=lr)
    params = draft.trainable_parameters()
    if not params:
        raise ValueError(f"draft {type(draft).__name__} has no trainable parameters")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(20, steps, floor=0.1))
    start, history = _restore(out_dir / "resume", draft, opt, sched)
    policy.eval()
    t0 = time.perf_counter()
    data = sample_sequences(policy, tok, task, n_prompts=n_prompts, max_new_tokens=max_new_tokens, seed=seed)
    t_data = time.perf_counter() - t0
    bar = tqdm(range(start, steps), desc="train-draft", initial=start, total=steps, disable=not progress,
               dynamic_ncols=True)
    for step in bar:
        s = step_seed(seed, step)
        batch = target_batch(policy, random.Random(s).sample(data, min(batch_sequences, len(data))),
                             draft.feature_layers)
        torch.manual_seed(s)
        loss, _ = draft.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        history.append(float(loss.detach()))
        bar.set_postfix(loss=f"{history[-1]:.3f}")
        if (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            with atomic_dir(out_dir / "resume") as tmp:
                torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "step": step + 1, "history": history}, tmp / "state.pt")
    draft.save(out_dir / "draft")
    report = {"steps": steps, "final_loss": history[-1] if history else None, "data_seconds": t_data,
              "train_seconds": time.perf_counter() - t0 - t_data, "sequences": len(data)}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))  # written last: marks complete
    shutil.rmtree(out_dir / "resume", ignore_errors=True)
    return report


def _check_arguments(*, lr: float, **counts: int):
    """train_offline's arguments, refused before anything is created: counts >= 1, lr > 0 and finite."""
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"train_offline: {name} must be an int >= 1, got {value!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"train_offline: lr must be > 0 and finite, got {lr!r}")


def _restore(folder: Path, draft, opt, sched) -> tuple[int, list[float]]:
    """(first step, loss history) from a ``resume/`` checkpoint, restoring the modules in place."""
    if not (folder / "state.pt").is_file():
        return 0, []
    state = torch.load(folder / "state.pt", weights_only=True)  # never unpickle code from a folder
    draft.load_state_dict(state["draft"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    return state["step"], state["history"]


# ---------------------------------------------------------------- the drafts runs and commands start from


def default_task_name(tok) -> str:
    """The task a policy's drafts are trained on offline: arith for the char model, gsm_symbolic otherwise."""
    return "arith" if isinstance(tok, CharTokenizer) else "gsm_symbolic"


def _policy_key(policy_dir: Path) -> str:
    files = sorted(policy_dir.glob("*.safetensors"))
    sig = [str(policy_dir.resolve())] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return hashlib.sha256("|".join(sig).encode()).hexdigest()[:10]


def offline_draft_dir(kind: str, *, policy, tok, task, policy_dir: Path, gamma: int | None, seed: int,
                      steps: int = 200, progress: bool = True) -> Path:
    """A cached draft of ``kind`` after ``steps`` of offline training on ``policy``; trained on first use."""
    key = f"{kind}-g{gamma}-s{steps}-seed{seed}-{_policy_key(Path(policy_dir))}-v{CACHE_VERSION}"
    folder = cache_root() / "drafts" / key
    if not (folder / "report.json").is_file():
        torch.manual_seed(seed)
        draft = init_draft(kind, policy, gamma=gamma)
        train_offline(policy, tok, task, draft, out_dir=folder, steps=steps, seed=seed, progress=progress)
    return folder / "draft"


def starting_draft(kind: str, init: str, *, policy, tok, task, policy_dir: Path, gamma: int | None, seed: int,
                   progress: bool = True, **options) -> Draft:
    """A run's initial draft: ``init`` "random", "offline" (cached short offline training) or a folder.

    Kinds without weights have nothing to train offline: "offline" builds them as they are."""
    if init == "offline":
        init = offline_draft_dir(kind, policy=policy, tok=tok, task=task, policy_dir=policy_dir, gamma=gamma,
                                 seed=seed, progress=progress) if draft_kind(kind).has_weights else "random"
    return init_draft(kind, policy, init=init, gamma=gamma, **options)


def draft_for_command(spec: str, policy, tok, policy_dir, *, gamma: int = 4, init: str = "offline", seed: int = 0,
                      progress: bool = True) -> Draft:
    """The draft `codraft generate` / `codraft bench spec` ask for: a kind (``init`` "offline": cached
    short offline training on the policy's default task; "random": untrained) or a saved folder."""
    if spec in available_drafts():
        task = make_task(default_task_name(tok)) if init == "offline" else None
        return starting_draft(spec, init, policy=policy, tok=tok, task=task, policy_dir=Path(policy_dir),
                              gamma=gamma, seed=seed, progress=progress)
    if not Path(spec).is_dir():
        raise ValueError(f"unknown draft {spec!r}: not a draft folder, and not a kind "
                         f"(valid kinds: {', '.join(available_drafts())})")
    return load_draft(spec, policy, gamma=gamma)
