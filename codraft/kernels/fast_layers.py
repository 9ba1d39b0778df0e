"""The kernel-enabled layers: subclasses of the reference modules of ``codraft.models`` whose
forward takes the CPU C path when it applies and otherwise runs the reference code.

When it applies, checked per call as cheaply as a few attribute reads: CPU fp32 tensors that
need no autograd (``cbuild.fits``); products through ``products.linear`` (the GEMV kernel for few
rows); RMSNorm in C; into a KV cache with the default ``varlen_attention``, RoPE + cache write +
attention in C (not for a prefill into an empty cache: SDPA), and a whole decoder layer in one C
call for steps of at most ``gemv.KERNEL_ROWS`` rows without q/k norms. ``SWAPS`` maps each reference class to its subclass; the subclasses add
no parameters, buffers or attributes, so only ``type(module)`` changes.
Not here: the kernels and their build (``gemv``, ``decode_ops``, ``cbuild``), installing these
(``codraft.kernels.enable``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from codraft.attention import varlen_attention
from codraft.kernels import decode_ops, gemv
from codraft.kernels.products import linear
from codraft.models.layers import MLP, RMSNorm
from codraft.models.transformer import Attention, DecoderLayer, Transformer


class FastRMSNorm(RMSNorm):
    def forward(self, x):
        if decode_ops.applies(x, self.weight):
            return decode_ops.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class FastMLP(MLP):
    def forward(self, x):  # the reference forward with the fast products
        return linear(F.silu(linear(x, self.gate_proj.weight)) * linear(x, self.up_proj.weight),
                      self.down_proj.weight)


class FastAttention(Attention):
    def forward(self, x, cos, sin, attn, mask, cache, layer: int, positions, span):
        b, t, _ = x.shape
        q, k, v = self.heads(linear(x, self.q_proj.weight), linear(x, self.k_proj.weight),
                             linear(x, self.v_proj.weight))
        # decode and verify steps; a prefill into an empty cache (mask None) is plain causal attention,
        # which SDPA's flash kernel does in O(T) memory, where this loop over keys is O(T²) per row
        if cache is not None and mask is not None and attn is varlen_attention and decode_ops.applies(q, k, v, cache.k):
            o = decode_ops.cache_attention(q, k, v, cos, sin, cache.k[layer], cache.v[layer], cache.lengths)
        else:
            o = self.attend(q, k, v, cos, sin, attn, mask, cache, layer, positions, span)
        return linear(o.reshape(b, t, -1), self.o_proj.weight)


class FastDecoderLayer(DecoderLayer):
    def forward(self, x, cos, sin, attn, mask, cache, layer: int, positions, span):
        # a few-row CPU decode step: the whole layer in one C call
        if (cache is not None and attn is varlen_attention and self.self_attn.q_norm is None
                and x.shape[0] * x.shape[1] <= gemv.KERNEL_ROWS
                and decode_ops.applies(x, cache.k, self.mlp.down_proj.weight)):
            return decode_ops.decoder_layer(self, x, cos, sin, cache.k[layer], cache.v[layer], cache.lengths)
        return super().forward(x, cos, sin, attn, mask, cache, layer, positions, span)


class FastTransformer(Transformer):
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(self.norm(h), self.head_weight)


SWAPS: dict[type, type] = {RMSNorm: FastRMSNorm, MLP: FastMLP, Attention: FastAttention,
                           DecoderLayer: FastDecoderLayer, Transformer: FastTransformer}
