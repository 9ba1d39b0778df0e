"""The Llama/Qwen3-family decoder, free of distributed code.

Features: token embedding, RMSNorm, RoPE (with Llama-3 frequency scaling), grouped-query
attention, optional q/k RMSNorm (Qwen3), SwiGLU MLP or a sparse mixture of experts per layer
(Qwen3-MoE, Qwen2-MoE: ``codraft.models.moe``), tied or untied LM head. Parameter
names follow HF (`model.layers.N.self_attn.q_proj.weight` minus the `model.` prefix), so
state dicts map one-to-one.

One forward covers the three layouts the system needs:
  * plain batch (B,T), causal;
  * packed varlen: one row holding several sequences delimited by ``cu_seqlens``,
    positions restarting per sequence, no attention across sequences;
  * KV-cache decode: new tokens written at per-row ``cache.lengths``.
Attention itself is a pluggable function ``attn(q, k, v, mask)`` (see codraft.attention),
which is where context parallelism hooks in later. The packed layout hands it a ``PackedCausal``
descriptor, not a dense mask: the default ``varlen_attention`` runs one causal SDPA per sequence,
``attention=sdpa`` materialises the T×T mask (the reference).

The plain reference, torch ops only. The CPU decode fast path (C kernels for few-row products,
norms, attention into the KV cache, whole decoder layers) is not here: ``codraft.kernels.enable``
installs it on a built model, as subclasses that take the C path when it applies and otherwise
run these forwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from codraft.attention import PackedCausal, cache_causal_mask, varlen_attention
from codraft.models.config import ModelConfig
from codraft.models.layers import MLP, RMSNorm, apply_rope, linear, rope_cos_sin, rope_inv_freq
from codraft.models.kv_cache import KVCache
from codraft.models.moe import SparseMoE

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | PackedCausal | None"], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def heads(self, q, k, v):
        """Projections (B,T,·) -> q (B,T,H,D), k, v (B,T,Hkv,D), with the q/k norms (Qwen3)."""
        b, t, _ = q.shape
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        v = v.view(b, t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attend(self, q, k, v, cos, sin, attn: AttnFn, mask, cache: KVCache | None, layer: int, positions, span):
        """RoPE, KV-cache write (when given) and attention: q (B,T,H,D), k, v (B,T,Hkv,D) -> (B,T,H,D)."""
        v = v.transpose(1, 2)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B,H,T,D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B,Hkv,T,D)
        if cache is not None:
            k, v = cache.write(layer, k, v, positions, span)
        return attn(q, k, v, mask).transpose(1, 2)

    def forward(self, x, cos, sin, attn: AttnFn, mask, cache: KVCache | None, layer: int, positions, span):
        b, t, _ = x.shape
        q, k, v = self.heads(linear(x, self.q_proj.weight), linear(x, self.k_proj.weight),
                             linear(x, self.v_proj.weight))
        o = self.attend(q, k, v, cos, sin, attn, mask, cache, layer, positions, span)
        return linear(o.reshape(b, t, -1), self.o_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoE(c) if c.sparse_layer(index) else MLP(c)  # (MoE: codraft.models.moe)

    def forward(self, x, cos, sin, attn: AttnFn, mask, cache: KVCache | None, layer: int, positions, span):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, mask, cache, layer, positions, span)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttnFn = varlen_attention):
        super().__init__()
        self.config = config
        self.attention = attention
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.apply(self._init)

    def _init(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype: the norms'. Weight-only bf16 (rollout copies) keeps it fp32."""
        return self.norm.weight.dtype

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings in the activations' dtype."""
        return self.embed_tokens(ids).to(self.compute_dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on layer outputs."""
        return linear(self.norm(h), self.head_weight)

    def forward(self, input_ids: torch.Tensor, *, taps: tuple[int, ...] | None = None,
                cu_seqlens: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, logit_index: torch.Tensor | None = None,
                attention: AttnFn | None = None, head: bool = True, layout: PackedCausal | None = None):
        """input_ids (B,T) -> logits (B,T,V), or (logits, {i: output of layer i}) when ``taps`` is given.

        cu_seqlens: packed layout (B must be 1); layout: the same given as a ``PackedCausal``, which may
        also share prefixes between segments (positions then come from ``layout.positions()``);
        cache: decode into a KVCache (advances its lengths);
        logit_index (B,): only compute logits at that position per row -> (B,1,V).
        head=False: return the last layer's output (B,T,H) in place of the logits, so a caller that
        needs only some rows runs the final norm + LM head on those alone (``model.logits(h[rows])``).
        """
        b, t = input_ids.shape
        ctx = self.layer_inputs(b, t, input_ids.device, cu_seqlens=cu_seqlens, positions=positions, cache=cache,
                                attention=attention, layout=layout)
        x, tapped = self.run_layers(self.embed(input_ids), ctx, range(len(self.layers)), taps)
        if cache is not None:
            cache.advance(t, ctx.span)
        if logit_index is not None:
            x = x[torch.arange(b, device=x.device), logit_index][:, None]
        if not head:
            return (x, tapped) if taps is not None else x
        logits = self.logits(x)
        return (logits, tapped) if taps is not None else logits

    def layer_inputs(self, b: int, t: int, device, *, cu_seqlens: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None, cache: KVCache | None = None,
                     attention: AttnFn | None = None, layout: PackedCausal | None = None) -> "LayerInputs":
        """What every decoder layer reads besides its input (see ``forward`` for the arguments): a
        pipeline stage builds it from the batch alone and runs its layers on received hidden states."""
        attn = attention or self.attention
        span = None
        if cache is not None:
            if cu_seqlens is not None or layout is not None:
                raise ValueError("packed input (cu_seqlens) cannot be decoded into a KV cache")
            empty = cache.span == 0  # host-known: a prefill into an empty cache
            span = cache.reserve(t)
            positions = cache.lengths[:, None] + torch.arange(t, device=device)
            # an empty cache is plain causal attention over the new tokens (flash-capable, no (B,T,T)
            # mask); otherwise an additive mask: SDPA would convert a boolean one again in every layer
            mask = None if empty else torch.zeros((), dtype=self.compute_dtype,
                                                  device=device).masked_fill(
                ~cache_causal_mask(cache.lengths, t, span), float("-inf"))
        elif cu_seqlens is not None or layout is not None:
            if b != 1:
                raise ValueError(f"packed input must have batch 1, got {b}")
            if layout is None:
                layout = PackedCausal.of(cu_seqlens, t)
            elif cu_seqlens is not None or layout.total != t:
                raise ValueError(f"give cu_seqlens or a layout for {t} tokens, not both "
                                 f"(layout.total={layout.total})")
            positions = layout.positions()[None]
            mask = layout
        else:
            mask = None
            if positions is None:
                positions = torch.arange(t, device=device)[None].expand(b, t)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.compute_dtype)
        return LayerInputs(cos, sin, attn, mask, cache, positions, span)

    def run_layers(self, x: torch.Tensor, ctx: "LayerInputs", layers: range,
                   taps: tuple[int, ...] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Decoder layers ``layers`` (global indices: the KV cache and the taps are keyed by them) on
        hidden states x (B,T,H) -> (output, {i: output of layer i for the taps among them})."""
        tapped, want = {}, set(taps or ())
        for i in layers:
            x = self.layers[i](x, ctx.cos, ctx.sin, ctx.attn, ctx.mask, ctx.cache, i, ctx.positions, ctx.span)
            if i in want:
                tapped[i] = x
        return x, tapped


@dataclass
class LayerInputs:
    """RoPE tables, attention function and mask, KV cache and its span: shared by all layers."""
    cos: torch.Tensor
    sin: torch.Tensor
    attn: AttnFn
    mask: object
    cache: KVCache | None
    positions: torch.Tensor
    span: object
