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
final norm, no head. With a draft vocabulary (``draft_vocab_size`` K > 0, block_vocab.py) the
logits cover only K target tokens. The MASK slot input is the target embedding of ``mask_token_id``
when the target vocabulary has a spare token for it, otherwise one learned vector
``mask_embedding`` (H,) owned by the draft (the default).

Decoding: block_decode.py (the context cache, one block forward per proposal over it).

Training helpers: ``sample_anchors`` (random anchors per packed sequence, notes 2.2; block_anchors.py),
``block_hidden`` (the forward above for N anchors of a packed ``DraftBatch`` row: context K/V
at per-sequence positions, one branch attention per layer over all N·S block queries) and
``chunked`` (the (N,S,V) head + loss in chunks of blocks, so the vocabulary-sized temporaries of
only one chunk are alive; checkpointed where what the backward keeps would not fit). Subclasses
(dflash.py, dspark.py) define the slot→label mapping, the loss and ``propose``.

Context parallelism (``DraftBatch.main``): anchors are drawn from the global row (the same on
every rank: same loss mask, same seeds or generator); each rank runs the blocks whose anchor row it
holds (``held_blocks``), with context K/V from its local feature rows, and reads labels and
teacher rows at global positions. The losses sum their numerators over ranks
(``MainAttention.total``) and divide by global counts, so every rank reports the global loss.

The parts live apart, their public names importable from here: the config and saved form
(block_config.py), the decoder layer (block_layer.py), the anchors (block_anchors.py), the draft
vocabulary (block_vocab.py), the decoding (block_decode.py).

Not here: sliding-window layers, the confidence-driven prefix scheduler, fused kernels.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.checkpoint import checkpoint

from codraft.atomic import atomic_dir
from codraft.drafts import block_anchors
from codraft.drafts.base import Draft, Features
from codraft.drafts.batch import DraftBatch
from codraft.drafts.block_anchors import Blocks
from codraft.drafts.block_config import (BlockDraftConfig, build_target_layer_ids, check_target, config_from_dict,
                                         make_config, read_saved)
from codraft.drafts.block_decode import BlockDecoding, BlockDraftState
from codraft.drafts.block_layer import BlockAttention, BlockDecoderLayer, MainPart
from codraft.drafts.block_vocab import DraftVocabulary
from codraft.models import bf16
from codraft.models.layers import RMSNorm, linear, rope_cos_sin, rope_inv_freq

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


class BlockDraftBase(BlockDecoding, DraftVocabulary, nn.Module, Draft):
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
    # the commit in C: ~0.7 ms a round less at batch 1 for SmolLM2's one-layer DSpark on a 2-core Xeon); the
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
        self.init_vocabulary()
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
        """Random anchors, at most ``config.num_anchors`` per packed sequence (``block_anchors.sample_anchors``)."""
        return block_anchors.sample_anchors(batch, self.config.num_anchors, label_offset=label_offset,
                                            generator=generator)

    def held_blocks(self, batch: DraftBatch, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks this rank trains (``block_anchors.held_blocks``)."""
        return block_anchors.held_blocks(batch, blocks)

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


def decay_weights(n: int, decay: float, first: int, device) -> torch.Tensor:
    """w_k = exp(−(k − first)/decay) for k = 0..n−1 (slots before ``first`` get weight 0)."""
    k = torch.arange(n, device=device, dtype=torch.float32)
    w = torch.exp(-(k - first) / decay)
    return torch.where(k >= first, w, torch.zeros_like(w))


__all__ = ["BlockAttention", "BlockDecoderLayer", "BlockDraftBase", "BlockDraftConfig", "BlockDraftState", "Blocks",
           "MainPart", "build_target_layer_ids", "make_config", "read_saved", "config_from_dict", "check_target",
           "decay_weights"]
