"""The block-draft backbone shared by DFlash and DSpark: context-conditioned parallel block prediction.

Data flow (K draft layers, m tapped target layers, block of S slots)::

    target features h^(l_1..l_m) (…,T,H_t), detached
        └─ ctx = hidden_norm(fc(cat_m h^(l_m)))                     (…,T,H)   once per forward
             └─ per layer i:  K_ctx = k_norm(W_k^i·ctx), V_ctx = W_v^i·ctx, RoPE at positions 0..T-1
    block input  [emb(x_anchor), MASK, …, MASK]                      (…,N,S,H)  target embedding, frozen
        └─ K layers, each:  x += o_proj(Attn(Q_blk ; [K_ctx ; K_blk], [V_ctx ; V_blk]))
                            x += MLP(post_norm(x))
             Q/K_blk = q_norm/k_norm(W_q/W_k·input_norm(x)) roped at anchor_pos + 0..S-1
        └─ h = norm(x)                                               (…,N,S,H)
        └─ logits = h · W_head[vocab]^T (the target's LM head, frozen) (…,N,S,K)

Attention of block n (anchor a_n) is branch attention (codraft.attention.branch) with
``local="block", include_anchor=False``: its queries see the context strictly before a_n
(features at a_n do not exist yet at decode time, the anchor is the pending token) within
the same packed sequence, and the S keys of their own block bidirectionally. In the notes'
dense form over keys [context (T) ; blocks (N·S)], for query slot q of block n = q // S:

    ctx_ok(q, kv)   = kv < T and seq(kv) == seq(a_n) and kv < a_n
    draft_ok(q, kv) = kv ≥ T and (kv − T) // S == n

The two parts are computed apart and merged by LSE: the context part is a ``MainPart``
callable the layers are given (training: the batch's ``MainAttention.branch``, a ring under
context parallelism; decoding: ``branch_main_part`` over the cache), the block part is
``branch_local_part``.

Shared and frozen target parts: ``bind_target(embed_weight, head_weight)`` stores the
target's token embedding (V,H) and LM head (V,H) by reference (in a plain holder object: not
parameters, buffers or saved; ``copy.deepcopy`` shares it), and every use reads them
``.detach()``-ed: no draft gradient reaches the policy, while in-place policy updates are seen
immediately (rebind if the policy's tensors are replaced or moved). The draft owns its
final norm, no head. With a draft vocabulary (``draft_vocab_size`` K > 0, ``set_vocabulary``;
EAGLE-3's d2t) the logits cover only K target tokens, the head's rows for them gathered once per
version of the head: the head product and the losses' passes over the vocabulary shrink by V/K;
labels outside it get no loss, and proposals return target ids with q zero outside (exact). The
MASK slot input is the target embedding of ``mask_token_id`` when
the target vocabulary has a spare token for it, otherwise one learned vector
``mask_embedding`` (H,) owned by the draft (the default).

Decoding (base.py's context invariant): the state keeps, per layer, K_ctx/V_ctx for every
context position that has target features (0..len-2) in a static (L,B,Hkv,M,D) cache, plus
the pending token (position len-1), which is the block anchor. ``commit`` projects only the
new features (a plain step's one token is kept in ``deferred`` and projected with the others in one
call before the next proposal); ``propose`` runs one block forward over [pending, MASK×(S−1)] at positions
len-1..len-2+S against the cache. There the block's own K/V are written into the cache at those
positions (free until ``commit`` writes the next context there; M leaves ``block_size`` of room past
the target's cache), so the two parts of the branch attention are one attention over each row's
prefix [0, len-1+S): a third of the ops of computing and merging two. No host syncs: reads are
bounded by the host-known ``context_len``, writes are scatters at per-row positions.

Training helpers: ``sample_anchors`` (random anchors per packed sequence, notes 2.2),
``block_hidden`` (the forward above for N anchors of a packed ``DraftBatch`` row: context K/V
at per-sequence positions, one branch attention per layer over all N·S block queries) and
``chunked`` (the (N,S,V) head + loss in chunks of blocks, so the vocabulary-sized temporaries of
only one chunk are alive; checkpointed where what the backward keeps would not fit). Subclasses
(dflash.py, dspark.py) define the slot→label mapping, the loss and ``propose``.

Context parallelism (``DraftBatch.main``): anchors are drawn from the global row (the same on
every rank: same loss mask, same generator); each rank runs the blocks whose anchor row it
holds (``held_blocks``), with context K/V from its local feature rows, and reads labels and
teacher rows at global positions. The losses sum their numerators over ranks
(``MainAttention.total``) and divide by global counts, so every rank reports the global loss.

Not here: sliding-window layers, the confidence-driven prefix scheduler, fused kernels.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

from codraft.atomic import atomic_dir
from codraft.attention import branch_local_part, branch_main_part, merge_lse, sdpa
from codraft.drafts.base import Draft, Features
from codraft.drafts.batch import DraftBatch
from codraft.models import bf16
from codraft.models.config import ModelConfig
from codraft.models.layers import MLP, RMSNorm, apply_rope, linear, rope_cos_sin, rope_inv_freq

# q (B,H,N,S,D), context k/v (B,Hkv,T,D) -> (O (B,H,N,S,D), LSE (B,H,N,S)): blocks over the context
MainPart = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default tapped target layers (0-based layer outputs), DFlash's rule (notes 2.1).

    K = 1: [L // 2]; K > 1: round(1 + i·(L − 4)/(K − 1)), e.g. L=36, K=5 → [1, 9, 17, 25, 33].
    Small targets where that rule leaves [0, L) or repeats a layer get K evenly spaced layers.
    """
    n, k = num_target_layers, num_draft_layers
    if k < 1 or n < 1:
        raise ValueError(f"need >= 1 target and draft layer, got num_target_layers={n}, num_draft_layers={k}")
    if k == 1:
        return [n // 2]
    ids = [round(1 + i * (n - 4) / (k - 1)) for i in range(k)]
    if len(set(ids)) == k and all(0 <= i < n for i in ids):
        return ids
    if k > n:
        raise ValueError(f"cannot tap {k} distinct layers of a {n}-layer target; pass layers=[...] explicitly")
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


# ---- configuration ---------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class BlockDraftConfig:
    """Everything that defines a block draft's weights and behaviour (saved as config.json)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    max_position_embeddings: int
    target_hidden_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int | None = None  # None: a learned mask embedding
    loss_decay: float = 7.0
    num_anchors: int = 128  # per packed sequence and step
    loss_chunk_blocks: int = 256  # head + loss run over this many blocks at a time (``chunked``)
    draft_vocab_size: int = 0  # K > 0: the draft predicts only K target tokens (``set_vocabulary``); 0: all

    def layer_config(self) -> ModelConfig:
        """The Qwen3-style decoder config of one draft layer (q/k norm, GQA, SwiGLU)."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, architectures=["Qwen3ForCausalLM"])


_LAYER_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
               "rope_scaling", "rms_norm_eps", "max_position_embeddings")


def make_config(target: ModelConfig, *, num_layers: int, block_size: int, layers, mask_token_id,
                decay: float, num_anchors: int, loss_chunk_blocks: int, overrides: dict,
                draft_vocab_size: int = 0) -> BlockDraftConfig:
    """The draft config for ``target``: its widths, K layers, tapped layers, with ``overrides``."""
    bad = set(overrides) - set(_LAYER_KEYS)
    if bad:
        raise ValueError(f"unknown block-draft options {sorted(bad)}; layer overrides allowed: {list(_LAYER_KEYS)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ids = list(layers) if layers is not None else build_target_layer_ids(target.num_hidden_layers, num_layers)
    if not ids or any(not 0 <= i < target.num_hidden_layers for i in ids):
        raise ValueError(f"target layer ids {ids} must lie in [0, {target.num_hidden_layers})")
    if mask_token_id is not None and not 0 <= mask_token_id < target.vocab_size:
        raise ValueError(f"mask_token_id={mask_token_id} outside the target vocabulary [0, {target.vocab_size})")
    if not 0 <= draft_vocab_size <= target.vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size}: 0 (the whole vocabulary) or 1..{target.vocab_size}")
    base = {k: getattr(target, k) for k in _LAYER_KEYS}
    if {"num_attention_heads"} & overrides.keys():  # re-derive dependent widths unless given
        base["head_dim"] = target.hidden_size // overrides["num_attention_heads"]
        base["num_key_value_heads"] = overrides["num_attention_heads"]
    base.update(overrides)
    return BlockDraftConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, num_hidden_layers=num_layers,
        target_hidden_size=target.hidden_size, num_target_layers=target.num_hidden_layers,
        target_layer_ids=ids, block_size=block_size, mask_token_id=mask_token_id, loss_decay=float(decay),
        num_anchors=num_anchors, loss_chunk_blocks=loss_chunk_blocks, draft_vocab_size=draft_vocab_size, **base)


# ---- layers ----------------------------------------------------------------------------------


class BlockAttention(nn.Module):
    """GQA with q/k RMSNorm; block queries over [injected context K/V ; own block K/V]."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    # the projections x @ wᵀ; codraft.kernels.enable sets the measured fastest one on CPU
    product = staticmethod(linear)

    def _q(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x (B,T,H) -> q (B,H,T,D), normed then roped."""
        b, t, _ = x.shape
        q = self.q_norm(self.product(x, self.q_proj.weight).view(b, t, self.n_heads, self.head_dim))
        return apply_rope(q.transpose(1, 2), cos, sin)

    def _kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B,T,H) -> k, v (B,Hkv,T,D); k normed then roped."""
        b, t, _ = x.shape
        k = self.k_norm(self.product(x, self.k_proj.weight).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.product(x, self.v_proj.weight).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def context_kv(self, ctx: torch.Tensor, cos, sin):
        """Injected context: ctx (B,T,H) at positions of cos/sin (B,1,T,D) -> K, V (B,Hkv,T,D)."""
        return self._kv(ctx, cos, sin)

    def forward(self, x, cos, sin, k_main, v_main, main_part: MainPart):
        """x (B,N,S,H) normed block input, cos/sin (B,1,N·S,D), k/v_main (B,Hkv,T,D) -> (B,N,S,H).

        ``main_part(q, k_main, v_main)`` is the blocks' attention over the context (O, LSE); it is
        merged with the block's own bidirectional part."""
        b, n, s, _ = x.shape
        xf = x.reshape(b, n * s, x.shape[-1])  # explicit H: N may be 0 (a CP rank without blocks)
        q = self._q(xf, cos, sin).reshape(b, self.n_heads, n, s, self.head_dim)  # (B,H,N,S,D)
        k, v = self._kv(xf, cos, sin)
        k = k.reshape(b, self.n_kv, n, s, self.head_dim)  # (B,Hkv,N,S,D)
        v = v.reshape(b, self.n_kv, n, s, self.head_dim)
        om, lm = main_part(q, k_main, v_main)  # (B,H,N,S,D), (B,H,N,S)
        ob, lb = branch_local_part(q, k, v, local="block")
        o = merge_lse(om, lm, ob, lb)[0].to(q.dtype)  # (B,H,N,S,D)
        return self.product(o.permute(0, 2, 3, 1, 4).reshape(b, n, s, self.n_heads * self.head_dim),
                            self.o_proj.weight)

    def decode(self, x, cos, sin, k_cache, v_cache, ctx_len, keys: int):
        """One block per row at decode: x (B,S,H) normed, at positions ctx_len + 0..S−1 (cos/sin (B,1,S,D))
        -> (B,S,H). The block's K/V go into the context cache k/v_cache (B,Hkv,M,D) at those positions,
        which hold no context yet (commit overwrites them), so the branch attention's key set, the
        context before the anchor plus the whole block, is the prefix [0, ctx_len + S) of each row: one
        attention over the cache's first ``keys`` (host-known, >= every ctx_len + S) positions, where
        the training path computes two parts and merges them."""
        b, s, _ = x.shape
        q = self._q(x, cos, sin)  # (B,H,S,D)
        k, v = self._kv(x, cos, sin)  # (B,Hkv,S,D)
        at = (ctx_len[:, None] + torch.arange(s, device=x.device))[:, None, :, None].expand_as(k)
        k_cache.scatter_(2, at, k)
        v_cache.scatter_(2, at, v)
        seen = torch.arange(keys, device=x.device) < (ctx_len + s)[:, None]  # (B,keys)
        g = self.n_heads // self.n_kv  # query head h reads KV head h // g, and every query the same keys
        o = sdpa(q.reshape(b, self.n_kv, g * s, self.head_dim), k_cache[:, :, :keys], v_cache[:, :, :keys],
                 seen[:, None, None])  # (sdpa keeps cuDNN off on a GPU: the key count changes every round)
        return self.product(o.reshape(b, self.n_heads, s, self.head_dim).transpose(1, 2).reshape(b, s, -1),
                            self.o_proj.weight)


class BlockDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = BlockAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, k_main, v_main, main_part: MainPart):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_main, v_main, main_part)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x, cos, sin, k_cache, v_cache, ctx_len, keys: int):
        """``forward`` of one block per row x (B,S,H) over the context cache (``BlockAttention.decode``)."""
        x = x + self.self_attn.decode(self.input_layernorm(x), cos, sin, k_cache, v_cache, ctx_len, keys)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---- decoding state --------------------------------------------------------------------------


class BlockDraftState(NamedTuple):
    k: torch.Tensor  # (L,B,Hkv,M,D) context keys (k-normed, roped) at absolute positions
    v: torch.Tensor  # (L,B,Hkv,M,D) context values
    ctx_len: torch.Tensor  # (B,) long: positions 0..ctx_len-1 hold valid context K/V (= context length - 1)
    pending: torch.Tensor  # (B,) long: the last context token, at position ctx_len: the block anchor
    # tapped features (B,1,F) of the last positions before ctx_len whose K/V are not written yet: plain
    # steps' commits, written together before the next proposal (``written``, which empties this list in
    # place, as it writes the cache tensors in place)
    deferred: list


class Blocks(NamedTuple):
    """Training anchors of one packed row, N blocks kept (sorted by packed index)."""
    anchors: torch.Tensor  # (N,) packed index a_n
    seq_end: torch.Tensor  # (N,) packed index one past a_n's sequence
    pos: torch.Tensor  # (N,) position of a_n inside its sequence (RoPE position of slot 0)


# a loss's tensors kept for the backward over all its blocks, above which its chunks are recomputed instead
KEPT_LOSS_BYTES = 1 << 30


class _Bound:
    """References to the target's embedding and head. ``copy.deepcopy`` of a draft (a frozen copy,
    a snapshot) shares them instead of copying the target's weights."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor):
        self.embed, self.head = embed, head

    def __deepcopy__(self, memo):
        return self


# ---- the shared module -----------------------------------------------------------------------


class BlockDraftBase(nn.Module, Draft):
    """Backbone + decoding state machinery; subclasses add the loss, ``propose`` and heads."""

    architectures = ("BlockDraftModel",)
    # the product with the LM head over the target's (V,H) weight; codraft.kernels.enable sets a faster one
    product = staticmethod(linear)
    # (layers, x, cos, sin, k, v, ctx_len) -> the layers' decode of one block per row, or None: run them
    # here. codraft.kernels.enable sets one that runs them in one C call where that is faster
    fused_block_decode = None
    # (fc weight, hidden norm, layers, tapped features, cos, sin, k, v, ctx_len) -> whether it wrote the
    # commit's context K/V into the cache (else: here). codraft.kernels.enable sets a C one
    fused_commit = None
    # a bf16 rollout copy streams the taps' fc and the layers' projections in bf16 (the block decode and
    # the commit in C: ~0.7 ms a round less at batch 1 for SmolLM2's one-layer DSpark, session 27); the
    # Markov head's fused loop reads fp32
    rollout_narrowed = ("fc.", "layers.")

    def __init__(self, config: BlockDraftConfig):
        super().__init__()
        self.config = config
        lc = config.layer_config()
        self.vocab_size = config.vocab_size
        self.feature_layers = tuple(config.target_layer_ids)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(BlockDecoderLayer(lc) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mask_embedding = (nn.Parameter(torch.empty(config.hidden_size)) if config.mask_token_id is None
                               else None)
        self.register_buffer("inv_freq", rope_inv_freq(lc), persistent=False)
        self._target: _Bound | None = None  # the target's (embed, head): not registered, not saved
        k = config.draft_vocab_size
        # the draft's vocabulary: draft index -> target token (saved), and back (-1: not in it; derived
        # by set_vocabulary, also after a state dict is loaded)
        self.register_buffer("draft_vocab", torch.arange(k) if k else None)
        self.register_buffer("to_draft_index", None, persistent=False)
        if k:
            self.set_vocabulary(self.draft_vocab)
            self.register_load_state_dict_post_hook(lambda module, _: module.set_vocabulary(module.draft_vocab))
        self._head_rows = None  # (key, the head's rows for the draft's vocabulary), see head_rows
        self.reset_parameters()

    def reset_parameters(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if self.mask_embedding is not None:
            nn.init.normal_(self.mask_embedding, std=0.02)

    # ---- the frozen target parts ----

    def bind_target(self, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> "BlockDraftBase":
        """Share the target's token embedding and LM head, both (V,H); stored by reference, never trained."""
        v, h = self.config.vocab_size, self.config.hidden_size
        for name, w in (("embed_weight", embed_weight), ("head_weight", head_weight)):
            if tuple(w.shape) != (v, h):
                raise ValueError(f"{name} has shape {tuple(w.shape)}, expected (vocab_size, hidden_size) = ({v}, {h})")
        self._target = _Bound(embed_weight, head_weight)  # a plain object: nn.Module registers nothing
        return self

    def _bound(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._target is None:
            raise RuntimeError(f"{type(self).__name__}: call bind_target(model.embed_tokens.weight, "
                               "model.head_weight) first (the draft shares the target's embedding and head)")
        return self._target.embed.detach(), self._target.head.detach()

    @property
    def dtype(self) -> torch.dtype:
        """The activations' and the cache's dtype: the norms' (a weight-only rollout copy narrows only
        matrices)."""
        return self.hidden_norm.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self._bound()[0]).to(self.dtype)

    # ---- the draft's vocabulary (EAGLE-3's d2t): the target tokens it can propose ----

    @property
    def out_vocab(self) -> int:
        """How many tokens the draft's logits cover: K, or the target's whole vocabulary."""
        return self.config.draft_vocab_size or self.config.vocab_size

    def set_vocabulary(self, tokens: torch.Tensor) -> None:
        """The K target tokens the draft predicts (K = ``config.draft_vocab_size``, distinct, in range), e.g.
        the most frequent ones in its training data. The LM head's rows and every loss and proposal
        are over them: the head product and the losses' passes over the vocabulary shrink by V/K. The
        draft's proposals stay exact (a draft distribution with zeros outside them)."""
        k, v = self.config.draft_vocab_size, self.config.vocab_size
        tokens = torch.as_tensor(tokens).to(torch.long).flatten()
        if not k:
            raise ValueError("this draft predicts the whole vocabulary (config.draft_vocab_size = 0)")
        if tokens.numel() != k or tokens.unique().numel() != k or int(tokens.min()) < 0 or int(tokens.max()) >= v:
            raise ValueError(f"a draft vocabulary is {k} distinct token ids in [0, {v}); got {tokens.numel()} "
                             f"({tokens.unique().numel()} distinct, range {int(tokens.min())}..{int(tokens.max())})")
        dev = self.draft_vocab.device
        self.draft_vocab.copy_(tokens.to(dev))
        index = torch.full((v,), -1, dtype=torch.long, device=dev)
        index[self.draft_vocab] = torch.arange(k, device=dev)
        self.to_draft_index = index
        self._head_rows = None

    def to_draft(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids -> the draft's indices (-1 where not in its vocabulary); identity without one."""
        return tokens if self.draft_vocab is None else self.to_draft_index[tokens]

    def vocab_labels(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target label tokens -> (the draft's indices, valid as gather indices; whether each is in its
        vocabulary): a label it cannot propose gets no loss."""
        labels = self.to_draft(tokens)
        return labels.clamp_min(0), labels >= 0

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        """The draft's indices -> target token ids."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def full_probs(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft's vocabulary (…,K) as one over the target's (…,V), zeros outside:
        what the engine's verification compares with the target's."""
        if self.draft_vocab is None:
            return q
        full = q.new_zeros(*q.shape[:-1], self.config.vocab_size)
        return full.index_copy_(-1, self.draft_vocab, q)

    def head_rows(self) -> torch.Tensor:
        """The target head's rows the draft's logits use (K,H), gathered once per version of the head
        (an optimiser step or a rollout refresh changes it in place), or the whole head (V,H)."""
        w = self._bound()[1]
        if self.draft_vocab is None:
            return w
        try:
            key = (w.data_ptr(), w._version, w.dtype, w.device)
        except RuntimeError:  # an inference-mode tensor keeps no version: gather every call
            key = None
        if key is None:
            return w.index_select(0, self.draft_vocab.to(w.device))
        if self._head_rows is None or self._head_rows[0] != key:
            # gathered as a normal tensor even inside a rollout's inference mode: the next training step's
            # loss reuses it (the head has not changed), and autograd refuses inference tensors
            with torch.inference_mode(False):
                self._head_rows = (key, w.index_select(0, self.draft_vocab.to(w.device)))
        return self._head_rows[1]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden (…,H) -> float32 logits (…,K) through the frozen target head's rows of the
        draft's vocabulary (K = V without one); a head in another dtype (a weight-only bf16 rollout copy's)
        is widened to h's, as every product of such a copy is."""
        return self.product(h, self.head_rows()).float()

    def mask_vector(self) -> torch.Tensor:
        """(H,) the MASK slot input."""
        if self.mask_embedding is not None:
            return self.mask_embedding
        return self._bound()[0][self.config.mask_token_id].to(self.dtype)

    # ---- the backbone ----

    def tapped(self, features: Features) -> torch.Tensor:
        """The tapped layers side by side: {layer: (B,T,H_t)} -> (B,T,m·H_t), detached, the draft's dtype."""
        missing = [l for l in self.feature_layers if l not in features]
        if missing:
            raise KeyError(f"features lack target layers {missing}; this draft taps {list(self.feature_layers)}")
        return torch.cat([features[l].detach().to(self.dtype) for l in self.feature_layers], dim=-1)

    def context(self, features: Features) -> torch.Tensor:
        """ctx = hidden_norm(fc(cat of tapped layers)): {layer: (B,T,H_t)} -> (B,T,H)."""
        return self.hidden_norm(self.product(self.tapped(features), self.fc.weight))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer injected K, V (B,Hkv,T,D) for ctx (B,T,H) at positions (B,T)."""
        cos, sin = rope_cos_sin(self.inv_freq, positions, ctx.dtype)
        return [layer.self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    def block_input(self, anchor_tokens: torch.Tensor, slots: int) -> torch.Tensor:
        """[emb(anchor), MASK×(slots−1)]: anchor_tokens (B,N) -> (B,N,S,H)."""
        first = self.embed(anchor_tokens)[:, :, None]  # (B,N,1,H)
        rest = self.mask_vector().expand(*anchor_tokens.shape, slots - 1, -1)
        return torch.cat([first, rest.to(first.dtype)], dim=2)

    def run_blocks(self, x: torch.Tensor, pos0: torch.Tensor, kv: list, main_part: MainPart) -> torch.Tensor:
        """x (B,N,S,H) block inputs, slot 0 at RoPE position pos0 (B,N); kv per-layer (B,Hkv,T,D) context;
        main_part(q, k, v) -> (O, LSE): the blocks' part over the context (called once per layer)
        -> final-normed hidden (B,N,S,H)."""
        b, n, s, _ = x.shape
        positions = (pos0[..., None] + torch.arange(s, device=x.device)).reshape(b, n * s)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # (B,1,N·S,D)
        for layer, (k, v) in zip(self.layers, kv):
            x = layer(x, cos, sin, k, v, main_part)
        return self.norm(x)

    # ---- training: anchors and the packed forward ----

    def sample_anchors(self, batch: DraftBatch, *, label_offset: int,
                       generator: torch.Generator | None = None) -> Blocks:
        """Random anchors, at most ``config.num_anchors`` per packed sequence (notes 2.2).

        a is valid when a and a + label_offset lie in the same sequence and both are loss tokens
        (the anchor is a completion token, as the pending token always is at decode time, and the
        first supervised slot has a label). Redrawn on every call; ``generator`` makes it repeatable.
        """
        cu, lm = batch.cu_seqlens.to(batch.device, torch.long), batch.loss_mask[0]
        t, n_seq = lm.shape[0], cu.shape[0] - 1
        idx = torch.arange(t, device=lm.device)
        seq = torch.searchsorted(cu[1:], idx, right=True)  # (T,) sequence id, padding -> n_seq
        end = torch.cat([cu[1:], cu[-1:]])[seq]  # (T,) one past the sequence (padding: cu[-1])
        nxt = (idx + label_offset).clamp(max=t - 1)
        valid = lm & lm[nxt] & (idx + label_offset < end)
        g_dev = generator.device if generator is not None else lm.device
        score = torch.rand(t, generator=generator, device=g_dev).to(lm.device)  # [0,1)
        key = seq.double() * 4 + torch.where(valid, score.double(), torch.full_like(score, 2.0).double())
        order = torch.argsort(key)  # sequence s occupies sorted slots cu[s]..cu[s+1]-1, valid ones first
        r = torch.arange(self.config.num_anchors, device=lm.device)
        at = cu[:-1, None] + r  # (n_seq,N)
        chosen = order[at.clamp(max=t - 1)]
        keep = (at < cu[1:, None]) & valid[chosen]
        a = chosen[keep].sort().values  # (N,) one host sync: training only
        return Blocks(a, end[a], a - cu[seq[a]])

    def held_blocks(self, batch: DraftBatch, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks this rank trains, those whose anchor row it holds (all of them without context
        parallelism): (sel (N_l,) indices into ``blocks``, ascending; their anchors' local rows (N_l,)).
        One host sync."""
        local = batch.context.local_index(blocks.anchors.to(batch.device))
        sel = (local >= 0).nonzero()[:, 0]
        return sel, local[sel]

    def block_hidden(self, batch: DraftBatch, blocks: Blocks, slots: int,
                     held: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Training forward: final-normed hidden (1,N_l,S,H) of the blocks [x_a, MASK…] of ``blocks``
        (global anchors) that this rank holds, ``held`` (default ``held_blocks``), in that order.

        Context K/V come from the batch's local feature rows at their positions; the blocks' context
        part is ``batch.context.branch`` (collective under CP: called once per layer on every rank,
        also with N_l = 0)."""
        main = batch.context
        sel, local = self.held_blocks(batch, blocks) if held is None else held
        ctx = self.context(batch.features)  # (1,T_l,H)
        kv = self.context_kv(ctx, main.positions().to(batch.device)[None])
        anchors = blocks.anchors.to(batch.device)[sel]  # (N_l,) global
        x = self.block_input(batch.input_ids[0, anchors][None], slots)  # (1,N_l,S,H)
        part = functools.partial(main.branch, anchors=local, include_anchor=False)
        return self.run_blocks(x, blocks.pos.to(batch.device)[sel][None], kv, part)

    def chunked(self, fn: Callable[..., tuple[torch.Tensor, ...]], n: int, *per_block: torch.Tensor,
                kept_per_block: int = 0):
        """Sum of fn(*slices) over chunks of ``config.loss_chunk_blocks`` blocks (dim 0 of every tensor);
        fn must return a tuple of tensors of fixed shapes.

        Chunks bound the (n,S,V) temporaries alive at a time. What fn keeps for the backward
        (``kept_per_block`` bytes a block; 0: unknown) stays alive over all chunks unless each is
        checkpointed, which runs its forward, the head product included, again in the backward. So
        chunks are checkpointed only where the whole would keep more than ``KEPT_LOSS_BYTES``.
        """
        c = max(1, self.config.loss_chunk_blocks)
        if n <= c:
            return fn(*per_block)
        again = not kept_per_block or n * kept_per_block > KEPT_LOSS_BYTES
        total = None
        for i in range(0, n, c):
            part = [x[i:i + c] for x in per_block]
            out = checkpoint(fn, *part, use_reentrant=False, context_fn=bf16.recompute_alike) if again else fn(*part)
            total = out if total is None else tuple(a + b for a, b in zip(total, out))
        return total

    def zero_loss(self) -> torch.Tensor:
        """A zero that still reaches every parameter (a batch without a single valid anchor)."""
        return sum(p.sum() for p in self.parameters()) * 0.0

    # ---- decoding (base.py) ----

    @torch.no_grad()
    def begin(self, tokens, lengths, features: Features, *, max_len: int) -> BlockDraftState:
        b, t = tokens.shape
        lc = self.config.layer_config()
        shape = (len(self.layers), b, lc.num_key_value_heads, max_len + self.config.block_size, lc.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=tokens.device)
        v = torch.zeros_like(k)
        ctx_len = lengths.to(torch.long) - 1
        n = min(features[self.feature_layers[0]].shape[1], max_len)
        ctx = self.context({l: features[l][:, :n] for l in self.feature_layers})  # (B,n,H); >= ctx_len: junk
        pos = torch.arange(n, device=tokens.device)[None].expand(b, n)
        for i, (kc, vc) in enumerate(self.context_kv(ctx, pos)):
            k[i, :, :, :n] = kc
            v[i, :, :, :n] = vc
        pending = tokens.gather(1, ctx_len[:, None])[:, 0]
        return BlockDraftState(k, v, ctx_len, pending, [])

    @torch.no_grad()
    def commit(self, state: BlockDraftState, tokens, counts, features: Features) -> BlockDraftState:
        g1 = tokens.shape[1]
        pending = tokens.gather(1, (counts - 1)[:, None])[:, 0]
        x = self.tapped({l: features[l][:, :g1] for l in self.feature_layers})  # (B,γ+1,m·H_t)
        if g1 == 1:  # a plain step's token (no proposal ran): its K/V wait for the next proposal
            return BlockDraftState(state.k, state.v, state.ctx_len + counts, pending, [*state.deferred, x])
        # features[:, j] belong at position ctx_len + j (the old pending token, then accepted drafts)
        self.write_context(self.written(state), x, state.ctx_len)
        return BlockDraftState(state.k, state.v, state.ctx_len + counts, pending, [])

    def written(self, state: BlockDraftState) -> BlockDraftState:
        """``state`` with its deferred context K/V written into its cache (all in place), in one call: a
        rollout whose draft length is 0 for many rounds (many rows, ``gamma=auto``) pays the draft's
        context once, when it drafts again, not a one-token commit every round."""
        if state.deferred:
            x = torch.cat(state.deferred, 1)  # (B,n,F): positions ctx_len − n .. ctx_len − 1
            self.write_context(state, x, state.ctx_len - x.shape[1])
            state.deferred.clear()
        return state

    def write_context(self, state: BlockDraftState, x: torch.Tensor, start: torch.Tensor) -> None:
        """Context K/V of tapped features x (B,n,F) at positions start + 0..n−1 into the cache, none past
        its end (positions past a row's accepted tokens hold junk, overwritten later)."""
        pos = start[:, None] + torch.arange(x.shape[1], device=x.device)  # (B,n)
        if self.fused_commit is not None:
            cos, sin = rope_cos_sin(self.inv_freq, pos, x.dtype)
            if self.fused_commit(self.fc.weight, self.hidden_norm, self.layers, x, cos, sin, state.k, state.v,
                                 start):
                return
        ctx = self.hidden_norm(self.product(x, self.fc.weight))  # (B,n,H)
        idx = pos.clamp(max=state.k.shape[3] - 1)  # only junk slots can exceed the buffer
        for i, (kc, vc) in enumerate(self.context_kv(ctx, pos)):
            gidx = idx[:, None, :, None].expand_as(kc)
            state.k[i].scatter_(2, gidx, kc)
            state.v[i].scatter_(2, gidx, vc)

    def select(self, state: BlockDraftState, rows) -> BlockDraftState:
        return BlockDraftState(state.k[:, rows], state.v[:, rows], state.ctx_len[rows], state.pending[rows],
                               [x[rows] for x in state.deferred])

    def decode_hidden(self, state: BlockDraftState, slots: int, context_len: int) -> torch.Tensor:
        """Final-normed hidden (B,S,H) of the block [pending, MASK×(S−1)] over the cached context.

        The block's K/V are written past each row's context (``BlockDecoderLayer.decode``) when the
        buffer has room for them (``begin`` leaves ``block_size`` positions beyond ``max_len``); longer
        blocks at the end of the buffer take the training path's two-part attention instead."""
        state = self.written(state)
        keys = context_len - 1 + slots  # context_len - 1 >= every row's ctx_len
        if keys <= state.k.shape[3]:
            x = self.block_input(state.pending[:, None], slots)[:, 0]  # (B,S,H)
            positions = state.ctx_len[:, None] + torch.arange(slots, device=x.device)
            cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # (B,1,S,D)
            fused = self.fused_block_decode
            done = None if fused is None else fused(self.layers, x, cos, sin, state.k, state.v, state.ctx_len)
            if done is not None:
                return self.norm(done)
            for i, layer in enumerate(self.layers):
                x = layer.decode(x, cos, sin, state.k[i], state.v[i], state.ctx_len, keys)
            return self.norm(x)
        span = max(1, min(context_len - 1, state.k.shape[3]))  # context K/V live at positions < ctx_len
        kv = [(state.k[i, :, :, :span], state.v[i, :, :, :span]) for i in range(len(self.layers))]
        x = self.block_input(state.pending[:, None], slots)  # (B,1,S,H)
        anchors = state.ctx_len[:, None]  # (B,1): attend to context positions < ctx_len
        part = functools.partial(branch_main_part, anchors=anchors, include_anchor=False)
        return self.run_blocks(x, anchors, kv, part)[:, 0]

    # ---- save / load ----

    def extra_config(self) -> dict:
        return {}

    def config_dict(self) -> dict:
        c = dataclasses.asdict(self.config)
        return {"architectures": [self.architectures[0]], "model_type": "qwen3", **c,
                "tie_word_embeddings": False, **self.extra_config()}

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``path/config.json`` and ``path/model.safetensors`` atomically (not the target's embed/head)."""
        with atomic_dir(path) as tmp:
            (tmp / "config.json").write_text(json.dumps(self.config_dict(), indent=2))
            save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                      str(tmp / "model.safetensors"))
        return Path(path)


def read_saved(path: str | os.PathLike, architecture: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a saved block draft; checks the architecture name."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a saved draft (needs config.json and model.safetensors)")
    d = json.loads((path / "config.json").read_text())
    arch = (d.get("architectures") or [None])[0]
    if arch != architecture:
        raise ValueError(f"{str(path)!r} holds a {arch!r} draft, expected {architecture!r}")
    return d, load_file(str(path / "model.safetensors"))


def config_from_dict(d: dict, num_anchors: int | None = None) -> BlockDraftConfig:
    """The saved config; ``num_anchors`` (blocks per sequence in the loss, its cost) may be changed."""
    names = {f.name for f in dataclasses.fields(BlockDraftConfig)}
    config = BlockDraftConfig(**{k: v for k, v in d.items() if k in names})
    return config if not num_anchors else dataclasses.replace(config, num_anchors=num_anchors)


def check_target(config: BlockDraftConfig, target: ModelConfig | None, where: Any) -> None:
    if target is None:
        return
    if (config.vocab_size, config.hidden_size) != (target.vocab_size, target.hidden_size):
        raise ValueError(f"draft {where} has vocab_size={config.vocab_size}, hidden_size={config.hidden_size}; "
                         f"target has {target.vocab_size}, {target.hidden_size}")
    if max(config.target_layer_ids) >= target.num_hidden_layers:
        raise ValueError(f"draft {where} taps layers {config.target_layer_ids}, target has "
                         f"{target.num_hidden_layers} layers")


def decay_weights(n: int, decay: float, first: int, device) -> torch.Tensor:
    """w_k = exp(−(k − first)/decay) for k = 0..n−1 (slots before ``first`` get weight 0)."""
    k = torch.arange(n, device=device, dtype=torch.float32)
    w = torch.exp(-(k - first) / decay)
    return torch.where(k >= first, w, torch.zeros_like(w))


__all__ = ["BlockDraftBase", "BlockDraftConfig", "BlockDraftState", "Blocks", "build_target_layer_ids",
           "make_config", "read_saved", "config_from_dict", "check_target", "decay_weights"]
