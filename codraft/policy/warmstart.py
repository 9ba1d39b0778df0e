"""Supervised warm start of the tiny policy on `arith` (`codraft sft`), cached for reuse; ``tiny-tools`` is
the same on the `lookup` environment's tool-using episodes (its tool results masked out of the loss),
``tiny-moe`` the same recipe for a mixture-of-experts tiny policy.

The tiny preset is a ~1 M-parameter character-level Llama trained from scratch on worked
`arith` solutions for a fixed number of steps, a CPU budget of about a minute (figures in
docs/experiments.md). The size is chosen for that budget: a 2.9 M model costs twice as much
per step and learns less in the same time. The result is an HF-format folder in the cache, keyed by a
hash of everything that determines it, so `codraft train` starts from it without retraining.

Noisy demonstrations (``answer_noise``, default 0.3): that fraction of the SFT targets end
in a wrong final answer (the worked chain is kept, the number after the last marker is
replaced), the way pretraining text carries mistakes. The policy learns to imitate them: at
T = 1 it writes a wrong final answer about that often, while its greedy answer stays the
computed one. That is the behaviour GRPO removes within the default run's 100 steps, so its
reward visibly rises. With clean demonstrations the remaining errors are slips in the chain,
and no GRPO setting we tried improves those on this policy in that budget
(docs/experiments.md).

The lr decays to ``min_lr_ratio`` of its peak rather than to 0 (docs/experiments.md: it helps
on clean data). Each step reseeds its batch and noise draws from ``step_seed(seed, step)``, as
every training loop does; the batch comes from the one packer (its padded view).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from codraft.cache import cache_root
from codraft.envs import ENVS, make_env, play
from codraft.models import ModelConfig, Transformer, load_pretrained, save_pretrained
from codraft.models.hf_io import read_config
from codraft.train.packing import Packed, pack
from codraft.train.schedule import warmup_cosine
from codraft.train.seeding import step_seed
from codraft.rollout import Engine
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer

CHAR_TOKENIZER_FILE = "char_tokenizer.json"
# The position limit a loaded tiny model declares. RoPE has no table, so the saved 512 (part of the
# warm start's cache key) is nominal; raising it at load lets the engine take the long prompts of
# `arith_haystack` (up to 32768 chars, docs/long-context.md). Positions past ~64 were never trained.
TINY_MAX_POSITIONS = 65536
RECIPE = 2  # part of the cache key: bump when the training loop changes what it produces


def tiny_model_config(tok: CharTokenizer, moe: bool = False) -> ModelConfig:
    """The tiny policy; ``moe``: as a Qwen3-MoE target of 8 experts, top-2, each half the dense MLP (the same
    parameters per token), its first layer dense."""
    c = ModelConfig(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                    num_attention_heads=4, head_dim=64, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, max_position_embeddings=512,
                    bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    if moe:
        c = dataclasses.replace(c, architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=192, norm_topk_prob=True, mlp_only_layers=[0])
    return c


@dataclass
class SFTConfig:
    steps: int = 400
    batch_size: int = 48
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    val_size: int = 200
    max_new_tokens: int = 96
    answer_noise: float = 0.3  # fraction of targets with a wrong final answer (module docstring)
    min_lr_ratio: float = 0.1  # cosine decay floor, as a fraction of lr

    def __post_init__(self):
        if not 0.0 <= self.answer_noise < 1.0:
            raise ValueError(f"answer_noise must be in [0, 1), got {self.answer_noise}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def wrong_answer(task, problem, rng: random.Random) -> str:
    """The SFT target with its final answer replaced by a different integer."""
    head = problem.solution[:problem.solution.rindex(task.marker) + len(task.marker)]
    value = int(problem.answer)
    wrong = rng.choice([v for v in range(0, max(9, 2 * abs(value)) + 1) if v != value])
    return head + str(wrong)


def sft_targets(task, problems, answer_noise: float, rng: random.Random) -> list[str]:
    """Completion texts for one SFT batch: each one's final answer is wrong with probability ``answer_noise``."""
    return [wrong_answer(task, p, rng) if rng.random() < answer_noise else task.format_completion(p)
            for p in problems]


def _batch(tok: CharTokenizer, problems, texts: list[str], device) -> Packed:
    """The batch packed (``codraft.train.packing``); completions end with EOS. Tool results in a
    demonstration (``{...}`` after a call, codraft.envs) are context, not targets: the environment writes
    them."""
    return pack([tok.prompt_ids(p.prompt) for p in problems], [tok.encode(t) + [tok.eos_id] for t in texts],
                device=device, share_prompts=False, masks=[_own_chars(t) + [True] for t in texts])


def _own_chars(text: str) -> list[bool]:
    """Per character (one token each): False inside an observation ``{...}`` that follows a tool call."""
    own, inside = [], False
    for i, ch in enumerate(text):
        inside = inside or (ch == "{" and i > 0 and text[i - 1] == "]")
        own.append(not inside)
        inside = inside and ch != "}"
    return own


def sft_loss(model: Transformer, batch: Packed, pad_id: int) -> torch.Tensor:
    """Next-token cross-entropy on completion tokens (EOS included), over the padded batch."""
    ids, completion = batch.padded(pad_id)
    logits = model(ids[:, :-1])  # position t predicts token t + 1
    mask = completion[:, 1:]
    return F.cross_entropy(logits[mask], ids[:, 1:][mask])


def evaluate(model, tok, task, problems, max_new_tokens: int, batch_size: int = 100) -> float:
    """Greedy held-out accuracy (mean reward); a task with tools (``lookup``) as episodes in its environment."""
    engine = Engine(model)
    env = make_env(task.name, task) if task.name in ENVS else None
    rewards = []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        if env is not None:
            rewards += [e.reward for e in play(engine, env, chunk, tok, max_tokens=max_new_tokens, temperature=0.0)]
            continue
        outs = engine.generate([tok.prompt_ids(p.prompt) for p in chunk], max_new_tokens=max_new_tokens,
                               temperature=0.0, eos_id=tok.eos_id)
        rewards += [task.reward(p, tok.decode(o.tokens)) for p, o in zip(chunk, outs)]
    return sum(rewards) / len(rewards)


def train_sft(model: Transformer, tok, task, cfg: SFTConfig, progress: bool = True) -> dict:
    torch.manual_seed(cfg.seed)
    device = model.embed_tokens.weight.device
    pool = list(itertools.islice(task.stream("train", seed=cfg.seed), 20_000))  # repeats: the task's own mix
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    model.train()
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="sft", disable=not progress, dynamic_ncols=True)
    for step in bar:
        rng = random.Random(step_seed(cfg.seed, step))
        problems = rng.sample(pool, cfg.batch_size)
        batch = _batch(tok, problems, sft_targets(task, problems, cfg.answer_noise, rng), device)
        loss = sft_loss(model, batch, tok.pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    train_s = time.perf_counter() - t0
    model.eval()
    val = task.sample("val", cfg.val_size, seed=cfg.seed)
    acc = evaluate(model, tok, task, val, cfg.max_new_tokens)
    return {"final_loss": loss.item(), "train_seconds": train_s, "val_accuracy": acc,
            "parameters": sum(p.numel() for p in model.parameters())}


# policy name -> (the task its demonstrations are of, whether it is the mixture-of-experts tiny policy)
WARM_STARTS = {"tiny-sft": ("arith", False), "tiny-tools": ("lookup", False), "tiny-moe": ("arith", True)}


def warm_start(cfg: SFTConfig | None = None, *, cache_dir: str | os.PathLike | None = None,
               force: bool = False, progress: bool = True, name: str = "tiny-sft") -> Path:
    """Return the cached warm start ``name`` (``WARM_STARTS``: tiny-sft on arith, tiny-tools on the lookup
    environment's tool-using episodes, tiny-moe: the mixture-of-experts policy on arith), training it first
    if missing (or ``force``)."""
    cfg = cfg or SFTConfig()
    tok = CharTokenizer()
    task_name, moe = WARM_STARTS[name]
    task = make_task(task_name)
    model_cfg = tiny_model_config(tok, moe)
    key = json.dumps({"sft": asdict(cfg), "model": model_cfg.to_dict(), "alphabet": tok.alphabet,
                      "task": repr(task), "recipe": RECIPE}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = Path(cache_dir) if cache_dir else cache_root() / f"{name}-{digest}"
    if (folder / "sft.json").is_file() and not force:
        return folder
    torch.manual_seed(cfg.seed)
    model = Transformer(model_cfg)
    report = train_sft(model, tok, task, cfg, progress=progress)
    report.update(cache_key=digest, config=asdict(cfg))
    save_pretrained(model, folder, extra_files={
        CHAR_TOKENIZER_FILE: json.dumps({"alphabet": tok.alphabet}),
        "sft.json": json.dumps(report, indent=2)})  # sft.json last-written marks a complete folder
    return folder


def read_tiny(folder: str | os.PathLike | None = None, name: str = "tiny-sft") -> tuple[ModelConfig, CharTokenizer]:
    """The config and tokenizer ``load_tiny`` gives, without the weights: a saved folder's, or (None) the
    warm start ``name``'s before it is trained (what a run checks before loading anything)."""
    if folder is None:
        tok = CharTokenizer()
        config = tiny_model_config(tok, WARM_STARTS[name][1])
    else:
        tok = CharTokenizer(json.loads((Path(folder) / CHAR_TOKENIZER_FILE).read_text())["alphabet"])
        config = read_config(folder)
    config.max_position_embeddings = max(config.max_position_embeddings, TINY_MAX_POSITIONS)
    return config, tok


def load_tiny(folder: str | os.PathLike):
    config, tok = read_tiny(folder)
    model = load_pretrained(folder)
    model.config.max_position_embeddings = config.max_position_embeddings
    return model, tok
