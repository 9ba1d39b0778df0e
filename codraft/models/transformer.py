"""The Llama/Qwen3-family decoder, free of distributed code.

Features: token embedding, RMSNorm, RoPE (with Llama-3 frequency scaling), grouped-query
attention, optional q/k RMSNorm (Qwen3), SwiGLU MLP or a sparse mixture of experts per layer
(Qwen3-MoE, Qwen2-MoE: ``codraft.models.moe``), tied or untied LM head. The families users start
from add: q/k/v biases (Qwen2); sliding-window layers (Mistral, Phi-3, Qwen2's option, Gemma's
alternate ones: a mask per window, built once per forward where the window is shorter than what a
query could see, so a window longer than the context costs nothing); Gemma's (1 + w) norms before and
after both sub-blocks (``SandwichDecoderLayer``), GeGLU, embeddings scaled by sqrt(hidden), scores
scaled by query_pre_attn_scalar ** -0.5, tanh soft-capping of scores (Gemma 2) and of the final logits,
and Gemma 3's q/k norms and local RoPE base on its sliding layers. Parameter
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

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from codraft.attention import (PackedCausal, cache_causal_mask, sdpa, sliding_causal_mask, softcapped_attention,
                               varlen_attention)
from codraft.models.config import ModelConfig
from codraft.models.layers import MLP, GemmaRMSNorm, Linear, RMSNorm, apply_rope, linear, rope_cos_sin, rope_inv_freq
from codraft.models.kv_cache import KVCache
from codraft.models.moe import SparseMoE

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | PackedCausal | None"], torch.Tensor]


def _norm(c: ModelConfig) -> type[RMSNorm]:
    return GemmaRMSNorm if c.gemma else RMSNorm


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, self.n_heads * self.head_dim, bias=c.qkv_biased)
        self.k_proj = Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.qkv_biased)
        self.v_proj = Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.qkv_biased)
        self.o_proj = Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = _norm(c)(self.head_dim, c.rms_norm_eps)
            self.k_norm = _norm(c)(self.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.window = c.window(index)  # sliding window (the mask the layer is given holds it), or None
        self.softcap = c.attention_softcap  # Gemma 2: tanh cap on the scores, or None
        self.scale = c.attention_scale  # the scores' scale where it is not head_dim ** -0.5 (Gemma), or None
        if c.qkv_biased:
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                nn.init.zeros_(proj.bias)

    def project(self, x, product=None):
        """x (B,T,·) -> the q, k, v projections (with Qwen2's biases); ``product``: x @ wᵀ, or None: the
        projection modules (a tensor-parallel plan's hooks run: each rank gets its heads' columns)."""
        if product is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = product(x, self.q_proj.weight), product(x, self.k_proj.weight), product(x, self.v_proj.weight)
        if self.q_proj.bias is not None:
            q, k, v = q + self.q_proj.bias, k + self.k_proj.bias, v + self.v_proj.bias
        return q, k, v

    def heads(self, q, k, v):
        """Projections (B,T,·) -> q (B,T,H,D), k, v (B,T,Hkv,D), with the q/k norms (Qwen3). H, Hkv: the heads
        this rank holds (all, or its share under tensor parallelism)."""
        b, t, _ = q.shape
        q = q.view(b, t, -1, self.head_dim)
        k = k.view(b, t, -1, self.head_dim)
        v = v.view(b, t, -1, self.head_dim)
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
        if self.scale is not None:  # attention scales by head_dim ** -0.5: fold the rest into q
            q = q * (self.scale * self.head_dim ** 0.5)
        if self.softcap is not None:
            return softcapped_attention(q, k, v, mask, self.softcap).transpose(1, 2)
        return attn(q, k, v, mask).transpose(1, 2)

    def forward(self, x, cos, sin, attn: AttnFn, mask, cache: KVCache | None, layer: int, positions, span):
        b, t, _ = x.shape
        q, k, v = self.heads(*self.project(x))
        o = self.attend(q, k, v, cos, sin, attn, mask, cache, layer, positions, span)
        return self.o_proj(o.reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = _norm(c)(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, index)
        self.post_attention_layernorm = _norm(c)(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoE(c) if c.sparse_layer(index) else MLP(c)  # (MoE: codraft.models.moe)

    def forward(self, x, cos, sin, attn: AttnFn, mask, cache: KVCache | None, layer: int, positions, span):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, mask, cache, layer, positions, span)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichDecoderLayer(DecoderLayer):
    """Gemma's layer: a norm before and after each sub-block (post_attention_layernorm normalises the
    attention's output here, not the MLP's input). A subclass, so the CPU fast path's one-call layer
    (a Llama-shaped layer) never takes it."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__(c, index)
        self.pre_feedforward_layernorm = _norm(c)(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = _norm(c)(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, attn: AttnFn, mask, cache: KVCache | None, layer: int, positions, span):
        a = self.self_attn(self.input_layernorm(x), cos, sin, attn, mask, cache, layer, positions, span)
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttnFn = varlen_attention):
        super().__init__()
        self.config = config
        self.attention = attention
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer = SandwichDecoderLayer if config.gemma else DecoderLayer
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = _norm(config)(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # per layer: its sliding window (None: global), and whether it takes the local RoPE (Gemma 3)
        self.windows = [config.window(i) for i in range(config.num_hidden_layers)]
        self.local_rope = [config.rope_local_base_freq is not None and config.layer_types is not None
                           and config.layer_types[i] == "sliding_attention" for i in range(config.num_hidden_layers)]
        self.rope_buffers()
        self.apply(self._init)

    def rope_buffers(self):
        """(Re)build the non-persistent RoPE tables: after a load onto the meta device, for one."""
        self.register_buffer("inv_freq", rope_inv_freq(self.config), persistent=False)
        if any(self.local_rope):
            self.register_buffer("local_inv_freq", rope_inv_freq(self.config, self.config.rope_local_base_freq),
                                 persistent=False)

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
        """Token embeddings in the activations' dtype (Gemma: times sqrt(hidden), rounded to the weights'
        dtype as transformers does)."""
        x = self.embed_tokens(ids)
        if self.config.gemma:
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        return x.to(self.compute_dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on layer outputs."""
        return self.cap_logits(linear(self.norm(h), self.head_weight))

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma's final soft-capping, cap · tanh(logits / cap); the logits as they are elsewhere."""
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
        span, longest = None, t  # longest: the most keys one query may see, what a window must be shorter than
        if cache is not None:
            if cu_seqlens is not None or layout is not None:
                raise ValueError("packed input (cu_seqlens) cannot be decoded into a KV cache")
            empty = cache.span == 0  # host-known: a prefill into an empty cache
            span = longest = cache.reserve(t)
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
            if any(w is not None for w in self.windows):  # (another layout, a CP shard: its furthest position)
                longest = layout.longest() if isinstance(layout, PackedCausal) else int(positions.max()) + 1
        else:
            mask = None
            if positions is None:
                positions = torch.arange(t, device=device)[None].expand(b, t)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.compute_dtype)
        local = rope_cos_sin(self.local_inv_freq, positions, self.compute_dtype) if any(self.local_rope) else None
        short = sorted({w for w in self.windows if w is not None and w < longest})  # windows that mask a key
        if (short or self.config.attention_softcap is not None) and attn not in (varlen_attention, sdpa):
            raise ValueError(f"{self.config.architectures[0]}: sliding windows shorter than the sequence "
                             f"({short} < {longest}) and soft-capped attention run only on codraft's own "
                             f"attention, not {getattr(attn, '__name__', type(attn).__name__)} (context parallelism)")
        windowed = {}  # window -> this forward's mask for it
        for w in short:
            if cache is not None:
                windowed[w] = torch.zeros((), dtype=self.compute_dtype, device=device).masked_fill(
                    ~cache_causal_mask(cache.lengths, t, span, w), float("-inf"))
            elif isinstance(mask, PackedCausal):
                windowed[w] = dataclasses.replace(mask, window=w)
            else:
                windowed[w] = sliding_causal_mask(t, w, device)
        return LayerInputs(cos, sin, attn, mask, cache, positions, span, local, windowed)

    def run_layers(self, x: torch.Tensor, ctx: "LayerInputs", layers: range,
                   taps: tuple[int, ...] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Decoder layers ``layers`` (global indices: the KV cache and the taps are keyed by them) on
        hidden states x (B,T,H) -> (output, {i: output of layer i for the taps among them})."""
        tapped, want = {}, set(taps or ())
        for i in layers:
            cos, sin = ctx.local if self.local_rope[i] else (ctx.cos, ctx.sin)
            mask = ctx.windowed.get(self.windows[i], ctx.mask)
            x = self.layers[i](x, cos, sin, ctx.attn, mask, ctx.cache, i, ctx.positions, ctx.span)
            if i in want:
                tapped[i] = x
        return x, tapped


@dataclass
class LayerInputs:
    """RoPE tables, attention function and mask, KV cache and its span: shared by all layers; the local
    RoPE tables (Gemma 3's sliding layers) and the masks of windows shorter than the sequence."""
    cos: torch.Tensor
    sin: torch.Tensor
    attn: AttnFn
    mask: object
    cache: KVCache | None
    positions: torch.Tensor
    span: object
    local: tuple[torch.Tensor, torch.Tensor] | None = None
    windowed: dict = dataclasses.field(default_factory=dict)
