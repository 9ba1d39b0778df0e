"""The kernel-enabled layers: subclasses of the reference modules of ``codraft.models`` whose
forward takes the CPU C path when it applies and otherwise runs the reference code.

When it applies, checked per call as cheaply as a few attribute reads: CPU fp32 activations that
need no autograd (``cbuild.fits``); products through ``products.linear`` (the fastest of the GEMV
kernel, torch's two forms and, for bf16 weights on an AMX CPU, the tile kernel, for the row count,
measured); RMSNorm in C; into a KV cache with the default ``varlen_attention``, RoPE + cache
write + attention in C (not for a prefill into an empty cache: SDPA); and a whole decoder layer
in one C call (``decode_ops.decoder_stack`` over it, where ``layer_applies``: no q/k norms; its
products on the vector kernel, and with bf16 weights on the same kernel with copies packed in
panels or on an AMX CPU on AMX tiles: one candidate each) where that is faster than the layer's
C norms + C attention + products, as measured on this machine per layer shape, weight dtype and
row count (``LAYER``, ``codraft.kernels.dispatch``); there the model runs its whole stack of such
layers in one C call.
What the C code does not model runs the reference code: the C attention only where the layer's scores
are plain (no Gemma scale or soft-cap) and its sliding window, if any, reaches back over every cached
position (q/k/v biases, Qwen2's, are added to the fast products in torch); the one-call layer only for
Llama-shaped layers (no biases, plain norms, SwiGLU, no window shorter than the cache). Gemma's layers and
norms are subclasses (``SandwichDecoderLayer``, ``GemmaRMSNorm``) and stay as they are; its
soft-capped logits are capped here as in the reference.
``SWAPS`` maps each reference class to its subclass; the subclasses add no parameters, buffers or
attributes, so only ``type(module)`` changes.
Not here: the kernels and their build (``gemv``, ``amx``, ``decode_ops``, ``cbuild``), installing these
(``codraft.kernels.enable``).
"""
from __future__ import annotations

import copy
import itertools

import torch
import torch.nn as nn

from codraft.attention import cache_causal_mask, varlen_attention
from codraft.kernels import amx, decode_ops, dispatch, panels as panel_copies
from codraft.kernels.products import linear
from codraft.models.kv_cache import KVCache
from codraft.models.layers import MLP, RMSNorm, activate
from codraft.models.transformer import Attention, DecoderLayer, Transformer

CONTEXT = 16  # cached tokens per row while timing a layer: both paths run the same C attention over them


class FastRMSNorm(RMSNorm):
    def forward(self, x):
        if decode_ops.applies(x, self.weight):
            return decode_ops.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class FastMLP(MLP):
    def forward(self, x):  # the reference forward with the fast products
        return linear(activate(linear(x, self.gate_proj.weight), self.gelu) * linear(x, self.up_proj.weight),
                      self.down_proj.weight)


class FastAttention(Attention):
    def forward(self, x, cos, sin, attn, mask, cache, layer: int, positions, span):
        b, t, _ = x.shape
        q, k, v = self.heads(*self.project(x, linear))
        # decode and verify steps; a prefill into an empty cache (mask None) is plain causal attention,
        # which SDPA's flash kernel does in O(T) memory, where this loop over keys is O(T²) per row.
        # The C attention is causal over all of a row's cache with head_dim ** -0.5 scores: not for a window
        # shorter than what is read (span), Gemma's scale or soft-cap
        if cache is not None and mask is not None and attn is varlen_attention \
                and self.scale is None and self.softcap is None and (self.window is None or span <= self.window) \
                and decode_ops.applies(q, k, v, cache.k):
            o = decode_ops.cache_attention(q, k, v, cos, sin, cache.k[layer], cache.v[layer], cache.lengths)
        else:
            o = self.attend(q, k, v, cos, sin, attn, mask, cache, layer, positions, span)
        return linear(o.reshape(b, t, -1), self.o_proj.weight)


class FastDecoderLayer(DecoderLayer):
    def forward(self, x, cos, sin, attn, mask, cache, layer: int, positions, span):
        # a CPU decode step: the whole layer in one C call, for the row counts where that is faster
        if cache is not None and attn is varlen_attention and decode_ops.layer_applies(self, x, cache.k):
            path = layer_path(self, x)
            if path in FUSED:  # this layer alone as a run of one (whose plan keeps any packed copy)
                done = decode_ops.decoder_stack(self, layer, [self], x, cos, sin, cache, amx=path == "fused-amx",
                                                panels=path == "fused-panels")
                if done is not None:
                    return done[0]
        return super().forward(x, cos, sin, attn, mask, cache, layer, positions, span)


class FastTransformer(Transformer):
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.cap_logits(linear(self.norm(h), self.head_weight))

    @property
    def decode_path(self) -> str:
        """What this model's CPU decode steps run on (the kernel library's file name, ``off``): a timing
        kept across runs (the draft-length cost model) holds for this build only."""
        return dispatch.machine()["kernels"]

    def run_layers(self, x, ctx, layers: range, taps=None):
        # a CPU decode step where one C call per layer is the fastest path: the whole run in one call
        if ctx.cache is not None and ctx.attn is varlen_attention and layers.step == 1 and len(layers):
            stack = list(self.layers._modules.values())[layers.start:layers.stop]
            first = stack[0]
            reach = ctx.cache.k.shape[-2]  # (a window at least the cache's length never masks a key)
            if isinstance(first, FastDecoderLayer) and all(type(l) is type(first) for l in stack) \
                    and all(hasattr(l.mlp, "gate_proj") for l in stack) \
                    and all(w is None or w >= reach for w in self.windows[layers.start:layers.stop]) \
                    and decode_ops.layer_applies(first, x, ctx.cache.k):  # (dense layers only)
                path = layer_path(first, x)
                if path in FUSED:
                    done = decode_ops.decoder_stack(self, layers.start, stack, x, ctx.cos, ctx.sin, ctx.cache,
                                                    taps or (), amx=path == "fused-amx",
                                                    panels=path == "fused-panels")
                    if done is not None:
                        return done
        return super().run_layers(x, ctx, layers, taps)


SWAPS: dict[type, type] = {RMSNorm: FastRMSNorm, MLP: FastMLP, Attention: FastAttention,
                           DecoderLayer: FastDecoderLayer, Transformer: FastTransformer}


def _amx_fits(layer) -> bool:
    """Whether the one-call layer can run its products on AMX: bf16 weights of shapes the tile
    kernel takes, on a CPU that has it."""
    _, projections = decode_ops._layer_weights(layer)
    with torch.no_grad():  # (decode steps run without autograd; the weights are the trainer's parameters)
        return all(amx.applies(torch.empty(1, w.shape[1]), w) for w in projections)


def _layer_candidates(layer: FastDecoderLayer) -> dict[str, dispatch.At]:
    """The one-call layer (as a decode step runs it: ``decoder_stack``, here over one layer; its
    products on the vector kernel, and for bf16 weights on it with copies packed in panels and where it
    applies on AMX tiles) and the per-op one (``DecoderLayer.forward`` over the fast submodules); m rows
    of one new token each after ``CONTEXT`` cached ones. Each call runs on the next of copies of
    ``layer`` and into the next of one-layer caches (``dispatch.KVRing``), so its weights and keys come from
    memory."""
    a = layer.self_attn
    dtype = layer.input_layernorm.weight.dtype
    nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    with torch.inference_mode(False):  # weights that keep version counters, as a model's (for packed copies)
        timed = nn.ModuleList(copy.deepcopy(layer) for _ in range(dispatch.copies(nbytes)))
    ring = dispatch.KVRing(a.n_kv, a.head_dim, CONTEXT, dtype)
    turn, packed, packed_products, caches = itertools.count(), [], [], {}

    def cache_for(m: int) -> KVCache:
        if m not in caches:
            caches[m] = KVCache(num_layers=0, batch=m, max_len=CONTEXT + 1, num_kv_heads=a.n_kv, head_dim=a.head_dim,
                                dtype=dtype, device="cpu")
            caches[m].set_lengths(torch.full((m,), CONTEXT), span=CONTEXT)
            caches[m].k, caches[m].v = ring.views(m)[0]
        return caches[m]

    def at(path: str):
        fused, on_amx, panels = path in FUSED, path == "fused-amx", path == "fused-panels"

        def rows(m):
            cache = cache_for(m)
            x = torch.randn(m, 1, a.q_proj.weight.shape[1], dtype=cache.k.dtype)
            cos, sin = torch.ones(m, 1, 1, a.head_dim), torch.zeros(m, 1, 1, a.head_dim)  # RoPE at angle 0
            positions, span = cache.lengths[:, None], CONTEXT + 1
            mask = torch.zeros(()).masked_fill(~cache_causal_mask(cache.lengths, 1, span), float("-inf"))
            slots = ring.views(m)
            with torch.no_grad():  # as a decode step runs (the table may be looked up under autograd)
                if not applies(path, layer, x, cache.k):
                    return None
                # each copy packs on its first call (the one-call layer's plan, or the per-op layer's products
                # where their table picks panels): done here, not timed. A copy's plan is its own (one layer
                # owning it as layer 0), as a model's layer that runs alone keeps its own
                if panels and not packed:
                    packed.extend(decode_ops.decoder_stack(layer_j, 0, [layer_j], x, cos, sin, cache, panels=True)
                                  for layer_j in timed)
                if not fused and not packed_products:
                    packed_products.append(panel_copies.prepare([w for copy in timed
                                                                 for w in decode_ops._layer_weights(copy)[1]]))

            @torch.no_grad()
            def run():
                j = next(turn)
                cache.k, cache.v = slots[j % len(slots)]
                layer_j = timed[j % len(timed)]
                if fused:
                    out = decode_ops.decoder_stack(layer_j, 0, [layer_j], x, cos, sin, cache, amx=on_amx, panels=panels)
                    assert out is not None, "decoder_stack refused a layer that layer_applies accepted"
                    return out
                return DecoderLayer.forward(layer_j, x, cos, sin, varlen_attention, mask, cache, 0, positions, span)
            return run
        return rows
    return {path: at(path) for path in LAYER.paths}


# the one-call layer, its products on the vector kernel (bf16 weights as they are or packed in panels) or
# AMX tiles
FUSED = ("fused", "fused-panels", "fused-amx")
LAYER = dispatch.Operation("layer", (*FUSED, "unfused"), "unfused", _layer_candidates)


def applies(path: str, layer: FastDecoderLayer, x: torch.Tensor, cache_k: torch.Tensor) -> bool:
    """Whether ``path`` (one of ``LAYER.paths``) can run this layer on x (B,T,D) over a cache like ``cache_k``."""
    if path == "unfused":
        return True
    bf16 = layer.self_attn.q_proj.weight.dtype is torch.bfloat16
    return decode_ops.layer_applies(layer, x, cache_k) and (
        path == "fused" or path == "fused-panels" and bf16 or path == "fused-amx" and _amx_fits(layer))


def layer_path(layer: FastDecoderLayer, x: torch.Tensor) -> str:
    """The measured path for a decode step of x (B,T,D): B·T new tokens."""
    return layer_table(layer).path(x.shape[0] * x.shape[1])


def layer_table(layer: FastDecoderLayer) -> dispatch.Table:
    """The measured choice per row count (B·T new tokens) between the one-call layer and the per-op
    one, for layers shaped like ``layer`` with its weight dtype and, where it has them, q/k norms (a
    Qwen3-style layer's table is not a Llama-style one's of the same widths)."""
    a = layer.self_attn
    key = (a.q_proj.weight.shape[1], layer.mlp.gate_proj.weight.shape[0], a.n_heads, a.n_kv, a.head_dim,
           a.q_proj.weight.dtype, *(("qk-norm",) if a.q_norm is not None else ()))
    return dispatch.lookup(LAYER, key, layer)
