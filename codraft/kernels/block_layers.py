"""A block draft's decode in one C call: its layers over one block of slots per row
(``BlockDecoderLayer.decode`` in ``codraft.drafts.block_layer``: q/k norms, every slot of a row sees
the row's cached context and the whole block), where that is measured faster than the layers' own
per-op decode; and its commit's context K/V in one call (``commit``), where the same choice holds.

A DSpark/DFlash proposal runs one block of S slots per row through its layer(s). Per op, that is ~60
torch calls a layer (norms, q/k norms, RoPE, two scatters into the cache, SDPA, views), which cost
more than streaming the layer's weights at batch 1 (docs/real-preset.md, "Where the draft's time
goes"). ``decode_ops.decoder_stack`` with ``block=True`` runs the same in one call. The choice per row
count (B·S slots) is timed on this machine like the target's layers (``dispatch``, operation
``block-layer``), the candidates each call on the next of copies of the layer and into the next of
one-layer caches (``dispatch.KVRing``), m rows of one slot after ``CONTEXT`` cached positions.

Installed from outside: ``codraft.kernels.enable`` sets a block draft's ``fused_block_decode`` and
``fused_commit`` hooks to ``decode`` and ``commit``. Not here: the C code (``decode_ops.c``), the
target's layers (``fast_layers``).
"""
from __future__ import annotations

import copy
import ctypes
import itertools
from typing import NamedTuple

import torch
import torch.nn as nn

from codraft.kernels import cbuild, decode_ops, dispatch

CONTEXT = 16  # cached positions per row while timing


class _Cache(NamedTuple):  # what decoder_stack reads of a cache
    k: torch.Tensor  # (L,B,Hkv,M,D)
    v: torch.Tensor
    lengths: torch.Tensor  # (B,)


def decode(layers: nn.ModuleList, x: torch.Tensor, cos, sin, k: torch.Tensor, v: torch.Tensor,
           ctx_len: torch.Tensor) -> torch.Tensor | None:
    """``layers`` (a block draft's) on x (B,S,H), slot s of row b at position ctx_len[b] + s (cos/sin
    (B,1,S,D)), over the context cache k, v (L,B,Hkv,M,D) whose rows hold ctx_len[b] positions; the
    block's keys and values are written at those positions -> (B,S,H) before the final norm; None where
    the one call does not apply or is not the measured faster path, for the caller's per-op decode."""
    stack = list(layers)
    if not stack or not decode_ops.layer_applies(stack[0], x, k) or \
            block_table(stack[0]).path(x.shape[0] * x.shape[1]) != "fused":
        return None
    done = decode_ops.decoder_stack(layers, 0, stack, x, cos, sin, _Cache(k, v, ctx_len), block=True)
    return None if done is None else done[0]


def commit(fc: torch.Tensor, hidden_norm: nn.Module, layers: nn.ModuleList, x: torch.Tensor, cos, sin,
           k: torch.Tensor, v: torch.Tensor, ctx_len: torch.Tensor) -> bool:
    """A block draft's commit in one C call: the context c = hidden_norm(fc · x) of x (B,T,Din), the
    tapped features of T new positions per row at ctx_len[b] + t (cos/sin (B,1,T,D)), projected by every
    layer to keys (k-normed, roped) and values written into k, v (L,B,Hkv,M,D) (none past M − 1) ->
    whether it ran. Where the block-layer table picks the per-op decode for B·T rows, so does this
    (the same products and cache write, and the taps' fc), and it returns False: the caller runs it."""
    stack = list(layers)
    kd = decode_ops.kernels()
    if kd is None or not stack or x.dim() != 3:
        return False
    b, t, _ = x.shape
    a0 = stack[0].self_attn
    weights = [fc, *(w for l in stack for w in (l.self_attn.k_proj.weight, l.self_attn.v_proj.weight))]
    norms = [hidden_norm.weight, *(l.self_attn.k_norm.weight for l in stack)]
    eps = hidden_norm.eps
    if not (cbuild.fits(x, k, v, cos, sin, *norms) and cbuild.weight_fits(*weights)
            and all(l.self_attn.k_norm.eps == eps for l in stack) and k.is_contiguous() and v.is_contiguous()
            and k.shape == v.shape and tuple(k.shape[:3]) == (len(stack), b, a0.n_kv) and k.shape[4] == a0.head_dim
            and cos.shape == (b, 1, t, a0.head_dim) and fc.shape[1] == x.shape[2]) \
            or block_table(stack[0]).path(b * t) != "fused":
        return False
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    lengths = ctx_len.to(torch.int64).contiguous()
    kd.context_stack(x.data_ptr(), (ctypes.c_void_p * len(weights))(*(w.data_ptr() for w in weights)),
                     (ctypes.c_void_p * len(norms))(*(w.data_ptr() for w in norms)), cos.data_ptr(), sin.data_ptr(),
                     k.data_ptr(), v.data_ptr(), lengths.data_ptr(), len(stack), b, t, x.shape[2], fc.shape[0],
                     a0.n_kv, a0.head_dim, k.shape[3], eps, decode_ops._kind(fc.dtype is torch.bfloat16, False))
    return True


def _candidates(layer: nn.Module) -> dict[str, dispatch.At]:
    a = layer.self_attn
    nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    with torch.inference_mode(False):
        timed = nn.ModuleList(copy.deepcopy(layer) for _ in range(dispatch.copies(nbytes)))
    ring, turn = dispatch.KVRing(a.n_kv, a.head_dim, CONTEXT, torch.float32), itertools.count()

    def at(path: str):
        def rows(m):
            ctx_len = torch.full((m,), CONTEXT)
            slots = [(_Cache(k, v, ctx_len), k[0], v[0]) for k, v in ring.views(m)]
            x = torch.randn(m, 1, a.q_proj.weight.shape[1])
            cos, sin = torch.ones(m, 1, 1, a.head_dim), torch.zeros(m, 1, 1, a.head_dim)  # RoPE at angle 0
            with torch.no_grad():
                if path == "fused" and not decode_ops.layer_applies(layer, x, slots[0][1]):
                    return None

            @torch.no_grad()
            def run():  # the next copy of the layer, into the next cache (a copy's plan is its own, as layer 0)
                j = next(turn)
                cache, k, v = slots[j % len(slots)]
                layer_j = timed[j % len(timed)]
                if path == "fused":
                    out = decode_ops.decoder_stack(layer_j, 0, [layer_j], x, cos, sin, cache, block=True)
                    assert out is not None, "decoder_stack refused a layer that layer_applies accepted"
                    return out
                return layer_j.decode(x, cos, sin, k, v, ctx_len, CONTEXT + 1)
            return run
        return rows
    return {path: at(path) for path in BLOCK_LAYER.paths}


BLOCK_LAYER = dispatch.Operation("block-layer", ("fused", "unfused"), "unfused", _candidates)


def block_table(layer: nn.Module) -> dispatch.Table:
    """The measured choice per row count (B·S slots) between one C call and the per-op decode, for block
    layers shaped like ``layer`` with its weight dtype."""
    a = layer.self_attn
    key = (a.q_proj.weight.shape[1], layer.mlp.gate_proj.weight.shape[0], a.n_heads, a.n_kv, a.head_dim,
           a.q_proj.weight.dtype)
    return dispatch.lookup(BLOCK_LAYER, key, layer)
