"""A small independent decoder as the draft ("model" kind): classic two-model speculative decoding.

The draft is a ``codraft.models.Transformer`` with the target's vocabulary (and by default
its widths, with fewer layers), its own static KV cache, randomly initialised unless weights
are given. It samples each proposal from its own softmax under the same
temperature/top-k/top-p transform as the target, and returns that row as q_k. It reads no
target features (``feature_layers == ()``).

Cache invariant (see base.py): the draft cache holds the context minus its last two tokens,
which are kept in ``last2`` and re-fed as a 2-token chunk at the start of every proposal.
Re-feeding the second-to-last token is what makes "all γ accepted" free: x_γ was never fed
to the draft, and it is exactly that token. When it was fed, rewriting it at the same
position stores the same K/V, so the rollback after a rejection is just lowering lengths.
A round that drafts nothing (γ = 0, no ``propose``) feeds the one token that leaves ``last2``.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn

from codraft.drafts.base import Draft, Features
from codraft.drafts.batch import DraftBatch
from codraft.models import KVCache, ModelConfig, Transformer, load_pretrained, save_pretrained
from codraft.models.config import DENSE_ARCHITECTURES
from codraft.models.tensor_files import load_pickle, load_safetensors
from codraft.spec.sampling import Sampler


class ModelDraftState(NamedTuple):
    cache: KVCache  # lengths = context length - 2
    last2: torch.Tensor  # (B,2) the last two context tokens


class ModelDraft(nn.Module, Draft):
    architectures = DENSE_ARCHITECTURES  # an HF-format model folder of a dense family

    def __init__(self, net: Transformer, *, default_gamma: int = 4):
        super().__init__()
        self.net = net
        self.vocab_size = net.config.vocab_size
        self.default_gamma = default_gamma

    def loss(self, batch: DraftBatch, *, normaliser: torch.Tensor | None = None):
        """Distillation: soft cross-entropy to the target's next-token distribution.

        Position t predicts token t+1; it is supervised where token t+1 is a loss target
        (a completion token, always preceded by its own prompt, so never across sequences).
        The net reads tokens only, so under context parallelism every rank computes the whole
        loss: each counts 1/num_ranks of it, and the ranks' summed gradients are the gradient.
        normaliser: the step's ``loss_normaliser`` (``Draft.loss``); None: this batch's.
        """
        rows = batch.teacher_rows  # the net's head runs on these rows only
        mask = self._supervised(batch)
        h = self.net(batch.input_ids, cu_seqlens=batch.cu_seqlens, head=False)  # (1,T,H)
        logits = self.net.logits(h[0, rows])  # (R,V)
        dt = torch.promote_types(torch.promote_types(logits.dtype, batch.teacher_logits.dtype), torch.float32)
        logits, teacher = logits.to(dt), batch.teacher_logits.to(dt).softmax(-1)  # the loss in >= fp32
        ce = -(teacher * logits.log_softmax(-1)).sum(-1)  # (R,)
        n = (mask.sum() if normaliser is None else normaliser[0].to(mask.device)).clamp_min(1)
        ctx = batch.context
        loss = ctx.total((ce * mask).sum() / n / ctx.num_ranks)
        acc = ((logits.argmax(-1) == teacher.argmax(-1)) & mask).sum() / n
        return loss, {"loss": loss.detach(), "acc": acc.detach()}

    def _supervised(self, batch: DraftBatch) -> torch.Tensor:
        """(R,) teacher rows t whose next token is a loss target (extra teacher rows are dropped)."""
        nxt, t = batch.teacher_rows + 1, batch.input_ids.shape[1]
        return (nxt < t) & batch.loss_mask[0, nxt.clamp(max=t - 1)]

    def loss_normaliser(self, batch: DraftBatch) -> torch.Tensor | None:
        """(1,) the supervised rows (the loss's and the accuracy's denominator)."""
        return self._supervised(batch).sum()[None]

    def save(self, path: str | os.PathLike) -> Path:
        save_pretrained(self.net, path)
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike, target_config: ModelConfig | None = None, *,
             gamma: int | None = None) -> "ModelDraft":
        """An HF-format model folder (``save``/``save_pretrained``) sharing the target's vocabulary."""
        net = load_pretrained(path)
        if target_config is not None and net.config.vocab_size != target_config.vocab_size:
            raise ValueError(f"draft weights in {path} have vocab_size={net.config.vocab_size}, "
                             f"target vocab_size={target_config.vocab_size}")
        return cls(net.eval(), default_gamma=gamma or 4)

    def begin(self, tokens, lengths, features: Features, *, max_len: int) -> ModelDraftState:
        b = tokens.shape[0]
        cache = KVCache.for_model(self.net, b, max_len)
        # writes tokens[:, :T-1]; only one logit row is computed, and none is used
        self.net(tokens[:, :-1], cache=cache, logit_index=torch.zeros_like(lengths))
        cache.set_lengths(lengths - 2)  # span stays at T-1, an upper bound
        last2 = tokens.gather(1, torch.stack([lengths - 2, lengths - 1], 1))
        return ModelDraftState(cache, last2)

    def propose(self, state: ModelDraftState, gamma: int, sampler: Sampler, *, context_len: int):
        cache = state.cache
        cache.span = max(context_len - 2, 0)  # host bound of lengths: keeps reads short without a sync
        b = state.last2.shape[0]
        inp, at = state.last2, torch.ones(b, dtype=torch.long, device=cache.lengths.device)
        tokens, qs = [], []
        for k in range(gamma):
            logits = self.net(inp, cache=cache, logit_index=at)[:, 0]  # (B,V)
            if sampler.greedy:
                tok = logits.argmax(-1)
            else:
                q = sampler.probs(logits)  # (B,V) the row x_k is drawn from
                tok = sampler.sample(q)
                qs.append(q)
            tokens.append(tok)
            inp, at = tok[:, None], torch.zeros_like(at)
        # the cache now also holds last2 and x_1..x_{γ-1}: lengths = context + γ - 1
        return torch.stack(tokens, 1), (torch.stack(qs, 1) if qs else None)

    def commit(self, state: ModelDraftState, tokens, counts, features: Features) -> ModelDraftState:
        gamma = tokens.shape[1] - 1
        cache = state.cache
        if gamma == 0:  # no proposal ran: feed the old last2[0], which leaves last2, to keep context-2
            self.net(state.last2[:, :1], cache=cache, head=False)
        else:  # keep context-2 + counts: the old last2 and the accepted x_1..x_{n-1} (n = counts-1)
            cache.set_lengths(cache.lengths - (gamma + 1) + counts)
        ext = torch.cat([state.last2[:, 1:], tokens], 1)  # (B,γ+2) old last token, then the new ones
        last2 = ext.gather(1, torch.stack([counts - 1, counts], 1))
        return ModelDraftState(cache, last2)

    def select(self, state: ModelDraftState, rows) -> ModelDraftState:
        state.cache.select(rows)
        return ModelDraftState(state.cache, state.last2[rows])

    def take(self, state: ModelDraftState, rows) -> ModelDraftState:
        return ModelDraftState(state.cache.take(rows), state.last2[rows])

    def join(self, states: list[ModelDraftState]) -> ModelDraftState:
        return ModelDraftState(KVCache.cat([s.cache for s in states]), torch.cat([s.last2 for s in states]))

    def extend(self, state: ModelDraftState, tokens, counts, features: Features) -> ModelDraftState:
        """No proposal ran: feed [last2, tokens] and keep context - 2 + counts of it."""
        ext = torch.cat([state.last2, tokens], 1)  # (B,2+m)
        start = state.cache.lengths.clone()
        state.cache.span = int(start.max())  # exact (after a proposal it is a loose bound): the rows fit
        self.net(ext, cache=state.cache, head=False)
        state.cache.set_lengths(start + counts)
        return ModelDraftState(state.cache, ext.gather(1, torch.stack([counts, counts + 1], 1)))


def _draft_config(target: ModelConfig, num_hidden_layers: int, overrides: dict) -> ModelConfig:
    if overrides.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(f"a model draft must share the target's vocabulary: vocab_size="
                         f"{overrides['vocab_size']} given, target vocab_size={target.vocab_size}")
    derived = {}
    if {"hidden_size", "num_attention_heads"} & overrides.keys():  # let ModelConfig re-derive these
        derived = {"head_dim": None, "num_key_value_heads": None}
    return dataclasses.replace(target, **{**derived, "num_hidden_layers": num_hidden_layers, **overrides})


def build(target_config: ModelConfig, *, num_hidden_layers: int = 1,
          weights: dict | str | os.PathLike | None = None, gamma: int | None = None, **overrides) -> ModelDraft:
    """A draft Transformer: the target's config with ``num_hidden_layers`` and ``overrides`` applied.

    weights: a state dict of ``Transformer`` parameter names, a ``.safetensors``/``.pt`` file of
    one, or an HF model folder (``ModelDraft.load``; its own config.json then defines the
    architecture). None: random init (seed with torch.manual_seed beforehand). gamma: tokens
    drafted per round by default (4).
    """
    if weights is not None and not isinstance(weights, dict) and Path(weights).is_dir():
        return ModelDraft.load(weights, target_config, gamma=gamma)
    net = Transformer(_draft_config(target_config, num_hidden_layers, overrides))
    if weights is not None:
        if not isinstance(weights, dict):
            path = Path(weights)
            if not path.is_file():
                raise FileNotFoundError(f"draft weights {str(path)!r} do not exist")
            weights = load_safetensors(path) if path.suffix == ".safetensors" else load_pickle(path)
        net.load_state_dict(weights)
    return ModelDraft(net.eval(), default_gamma=gamma or 4)
