"""Offline draft training (`codraft train-draft`) and draft initialisation for the RL job.

Data comes from the target itself: the rollout engine samples completions for the task's
training prompts (temperature 1, like RL rollouts), and every training step runs the target
once over a packed batch of them (no grad) to get the tapped features and teacher logits —
the same ``DraftBatch`` the co-training step builds, so offline and online training share
one loss. The result is the starting point of a "frozen" draft and the initial weights for
co-training. Progress is checkpointed (`resume.pt`, written atomically) so an interrupted
run continues where it stopped.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from codraft.cache import cache_root
from codraft.drafts import build_draft
from codraft.drafts.batch import DraftBatch, supervised_rows

# architectures in a saved draft's config.json -> the module that loads it
_LOADERS = {"LlamaForCausalLMEagle3": "eagle3", "DFlashDraftModel": "dflash", "DSparkDraftModel": "dspark",
            "LlamaForCausalLM": "model", "Qwen3ForCausalLM": "model"}


def build_for(kind: str, policy, *, gamma: int | None = None, weights=None, **options):
    """``build_draft`` with the options every kind understands mapped onto its own names."""
    if kind in ("dflash", "dspark"):
        options.update(gamma=gamma, weights=weights)
    elif kind == "model":
        options.update(default_gamma=gamma or 4, weights=weights)
    elif kind == "eagle3":
        options.update(default_gamma=gamma or 4)
    draft = build_draft(kind, policy.config, target=policy, **options)
    if kind == "eagle3" and weights is not None:
        from codraft.drafts.eagle3 import load
        draft = load(weights)
        if max(draft.layers) >= policy.config.num_hidden_layers:
            raise ValueError(f"EAGLE-3 draft {weights} taps layers {list(draft.layers)}, "
                             f"target has {policy.config.num_hidden_layers} layers")
        draft.default_gamma = gamma or draft.default_gamma
        draft.bind_target(policy.embed_tokens.weight, policy.head_weight)
    return draft.to(policy.embed_tokens.weight.device) if isinstance(draft, torch.nn.Module) else draft


def saved_kind(path: str | os.PathLike) -> str:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"draft folder {str(path)!r} has no config.json")
    arch = (json.loads(cfg.read_text()).get("architectures") or [None])[0]
    if arch not in _LOADERS:
        raise ValueError(f"{path}: unknown draft architecture {arch!r}; known: {', '.join(_LOADERS)}")
    return _LOADERS[arch]


def save_draft(draft, path: str | os.PathLike):
    if hasattr(draft, "save"):
        draft.save(path)
    elif hasattr(draft, "net"):  # the "model" kind: an HF-format Transformer folder
        from codraft.models import save_pretrained
        save_pretrained(draft.net, path)
    else:
        raise ValueError(f"draft {type(draft).__name__} has no weights to save")


# ---------------------------------------------------------------- data


def sample_sequences(policy, tok, task, *, n_prompts: int, max_new_tokens: int, seed: int,
                     temperature: float = 1.0, batch: int = 64) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) pairs sampled from the target on the task's train prompts."""
    from codraft.rollout import Engine
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
    ids, mask, lens = [], [], []
    for p, c in sequences:
        ids += p + c
        mask += [False] * len(p) + [True] * len(c)
        lens.append(len(p) + len(c))
    dev = policy.embed_tokens.weight.device
    input_ids = torch.tensor(ids, device=dev)[None]
    cu = torch.tensor([0] + lens, device=dev).cumsum(0)
    hidden, feats = policy(input_ids, cu_seqlens=cu, taps=tuple(feature_layers), head=False)
    loss_mask = torch.tensor(mask, device=dev)[None]
    rows = supervised_rows(loss_mask)  # the only teacher rows a draft reads: the head runs on these alone
    return DraftBatch(input_ids, cu, loss_mask, feats, policy.logits(hidden[0, rows]), rows)


# ---------------------------------------------------------------- training


def train_offline(policy, tok, task, draft, *, out_dir: str | os.PathLike, steps: int = 200,
                  batch_sequences: int = 16, lr: float = 1e-3, n_prompts: int = 512, max_new_tokens: int = 64,
                  seed: int = 0, checkpoint_every: int = 50, progress: bool = True) -> dict:
    """Train ``draft`` on target samples; resumes from ``out_dir/resume.pt``; saves ``out_dir/draft``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    params = [p for p in draft.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"draft {type(draft).__name__} has no trainable parameters")
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    start, history = 0, []
    resume = out_dir / "resume.pt"
    if resume.is_file():
        state = torch.load(resume, weights_only=False)
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start, history = state["step"], state["history"]
    policy.eval()
    t0 = time.perf_counter()
    data = sample_sequences(policy, tok, task, n_prompts=n_prompts, max_new_tokens=max_new_tokens, seed=seed)
    t_data = time.perf_counter() - t0
    bar = tqdm(range(start, steps), desc="train-draft", initial=start, total=steps, disable=not progress,
               dynamic_ncols=True)
    for step in bar:
        rng = random.Random(seed * 100_003 + step)  # per-step seeding: a resumed run repeats exactly
        batch = target_batch(policy, rng.sample(data, min(batch_sequences, len(data))), draft.feature_layers)
        torch.manual_seed(seed * 100_003 + step)
        loss, metrics = draft.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        history.append(float(loss.detach()))
        bar.set_postfix(loss=f"{history[-1]:.3f}")
        if (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            tmp = resume.with_suffix(".tmp")
            torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step + 1, "history": history}, tmp)
            os.replace(tmp, resume)
    save_draft(draft, out_dir / "draft")
    report = {"steps": steps, "final_loss": history[-1] if history else None, "data_seconds": t_data,
              "train_seconds": time.perf_counter() - t0 - t_data, "sequences": len(data)}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    resume.unlink(missing_ok=True)
    return report


def _policy_key(policy_dir: Path) -> str:
    files = sorted(policy_dir.glob("*.safetensors"))
    sig = [str(policy_dir.resolve())] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return hashlib.sha256("|".join(sig).encode()).hexdigest()[:10]


def init_draft(kind: str, init: str, *, policy, tok, task, policy_dir: Path, gamma: int, seed: int,
               progress: bool = True, offline_steps: int = 200):
    """The RL job's starting draft: "random", "offline" (cached short offline training) or a folder."""
    if kind == "ngram":
        return build_draft("ngram", policy.config)
    if init == "random":
        return build_for(kind, policy, gamma=gamma)
    if init == "offline":
        folder = cache_root() / "drafts" / f"{kind}-g{gamma}-s{offline_steps}-seed{seed}-{_policy_key(Path(policy_dir))}"
        if not (folder / "report.json").is_file():
            torch.manual_seed(seed)
            draft = build_for(kind, policy, gamma=gamma)
            train_offline(policy, tok, task, draft, out_dir=folder, steps=offline_steps, seed=seed, progress=progress)
        return build_for(kind, policy, gamma=gamma, weights=folder / "draft")
    path = Path(init)
    if saved_kind(path) != kind:
        raise ValueError(f"draft.init {init!r} holds a {saved_kind(path)} draft but draft.kind={kind}")
    return build_for(kind, policy, gamma=gamma, weights=path)
