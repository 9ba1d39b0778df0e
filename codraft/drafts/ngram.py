"""Prompt-lookup draft ("ngram" kind): propose what followed the latest earlier copy of the suffix.

For each row, for m = n-1 down to 1: take the context's last m tokens, find their most recent
earlier occurrence in the context (prompt + generated), and propose the tokens that followed
it. If the continuation runs into the end of the context it is extended periodically (the
repeat "abcabc…" continues as a repeat). Rows with no match propose their last token repeated.
The proposal is deterministic, so q is one-hot (returned as None) and the rule stays exact.

Everything is batched tensor work on the model's device (no per-row loop, no host sync):
each round compares all length-m windows of the context against the suffix, O(B·L·n).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

from codraft.atomic import atomic_dir
from codraft.drafts.base import Draft, Features
from codraft.drafts.batch import DraftBatch
from codraft.models import ModelConfig
from codraft.spec.sampling import Sampler


class NgramState(NamedTuple):
    context: torch.Tensor  # (B,max_len) long; row b valid up to lengths[b]
    lengths: torch.Tensor  # (B,) long


class NgramDraft(Draft):
    architectures = ("NgramDraft",)

    def __init__(self, vocab_size: int, n: int = 3, default_gamma: int = 4):
        if n < 2:
            raise ValueError(f"ngram draft needs n >= 2 (matches the last n-1..1 tokens), got n={n}")
        self.vocab_size, self.n, self.default_gamma = vocab_size, n, default_gamma

    def loss(self, batch: DraftBatch, *, normaliser=None):
        raise ValueError("the ngram draft has no weights: there is nothing to train")

    def save(self, path: str | os.PathLike) -> Path:
        """A folder with its config.json only (no weights)."""
        with atomic_dir(path) as tmp:
            (tmp / "config.json").write_text(json.dumps(
                {"architectures": list(self.architectures), "vocab_size": self.vocab_size, "n": self.n,
                 "default_gamma": self.default_gamma}, indent=2))
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike, target_config: ModelConfig | None = None, *,
             gamma: int | None = None) -> "NgramDraft":
        d = json.loads((Path(path) / "config.json").read_text())
        if target_config is not None and d["vocab_size"] != target_config.vocab_size:
            raise ValueError(f"ngram draft {path} has vocab_size={d['vocab_size']}, "
                             f"target vocab_size={target_config.vocab_size}")
        return cls(d["vocab_size"], n=d["n"], default_gamma=gamma or d["default_gamma"])

    def begin(self, tokens, lengths, features: Features, *, max_len: int) -> NgramState:
        context = torch.zeros(tokens.shape[0], max_len, dtype=torch.long, device=tokens.device)
        context[:, :tokens.shape[1]] = tokens
        return NgramState(context, lengths.clone())

    def propose(self, state: NgramState, gamma: int, sampler: Sampler, *, context_len: int):
        ctx, lens = state.context[:, :context_len], state.lengths  # (B,L), (B,)
        b, length = ctx.shape
        dev = ctx.device
        start = torch.full((b,), -1, dtype=torch.long, device=dev)  # continuation start, -1 = none yet
        for m in range(min(self.n - 1, length - 1), 0, -1):
            suffix = ctx.gather(1, (lens[:, None] - m + torch.arange(m, device=dev)).clamp(min=0))  # (B,m)
            windows = ctx.unfold(1, m, 1)  # (B,L-m+1,m)
            s = torch.arange(windows.shape[1], device=dev)  # window starts
            # an earlier occurrence: some token follows it inside the context, s + m < lens
            hit = (windows == suffix[:, None]).all(-1) & (s[None] + m < lens[:, None])
            latest = torch.where(hit, s[None], -1).max(-1).values  # (B,)
            start = torch.where((start < 0) & (latest >= 0), latest + m, start)
        found = start >= 0
        period = (lens - start).clamp(min=1)  # continuation = ctx[start:lens], repeated
        idx = start[:, None] + torch.arange(gamma, device=dev) % period[:, None]  # (B,γ)
        last = lens[:, None] - 1
        idx = torch.where(found[:, None], idx, last)
        return ctx.gather(1, idx), None

    def commit(self, state: NgramState, tokens, counts, features: Features) -> NgramState:
        pos = state.lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)  # (B,γ+1)
        state.context.scatter_(1, pos, tokens)  # slots past counts are junk, overwritten later
        return NgramState(state.context, state.lengths + counts)

    def select(self, state: NgramState, rows) -> NgramState:
        return NgramState(state.context[rows], state.lengths[rows])

    take = select  # (indexing copies)

    def join(self, states: list[NgramState]) -> NgramState:
        return NgramState(torch.cat([s.context for s in states]), torch.cat([s.lengths for s in states]))


def build(target_config: ModelConfig, *, n: int = 3, gamma: int | None = None) -> NgramDraft:
    return NgramDraft(target_config.vocab_size, n=n, default_gamma=gamma or 4)
