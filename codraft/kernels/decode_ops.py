"""A KV-cache decode step on CPU in C (``decode_ops.c``): RMSNorm; RoPE + cache write +
grouped-query attention; and a run of whole decoder layers (a model's stack, or one layer) in one call.

At batch 1 a step is bound by streaming the weights (``codraft.kernels.gemv``), but the ~45
small torch ops and Python calls per layer around them (norms, rope, cache scatter, one-query
SDPA, views, module calls) each pay torch's dispatch, which added up to a large part of the
step (figures in docs/bench-spec.md). A run of layers of one shape without q/k norms
(``layer_applies``), a model's whole stack or a single layer, is one C call (``decoder_stack``; the
Python around a call per layer cost ~100 us a layer, a quarter of the layer's own time). Its
products go through the GEMV kernel with the layers' fp32 or bf16 projection weights (rollout
copies; norm weights, activations and the KV cache stay fp32), or with bf16 weights through the
AMX kernel (``amx=True``: ``codraft.kernels.amx``) or packed in panels (``panels=True``: a copy of
each bf16 projection in ``gemv.c``'s panel layout, ``codraft.kernels.panels``, made when the run is
first decoded and again whenever a weight changes, e.g. at a rollout copy's refresh).
Used on CPU without autograd; built with the GEMV kernel (``codraft.kernels.cbuild``;
``CODRAFT_KERNELS=0`` opts out). Results match the torch ops (bf16 weights widened to fp32) up to
fp32 summation order. Not here: when a model uses them, e.g. up to which row count the one-call
layer wins (``codraft.kernels.fast_layers``).
"""
from __future__ import annotations

import ctypes
import functools
import weakref

import torch

from codraft.kernels import cbuild, gemv
from codraft.models.layers import GemmaRMSNorm
from codraft.kernels import panels as panel_copies  # (`panels` is decoder_stack's flag)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@functools.cache
def kernels():
    """The C library with its argument types, or None (opted out, or no compiler: warned once)."""
    lib = cbuild.library()
    if lib is None or gemv.kernel() is None:  # (gemv: the library's tuning, set once)
        return None
    lib.rms_norm_rows.restype = lib.decode_attention.restype = lib.decode_stack.restype = None
    lib.rms_norm_rows.argtypes = [_P, _P, _P, _I, _I, _F]
    lib.decode_attention.argtypes = [_P] * 9 + [_I] * 6 + [_F, _P, _P, _F, ctypes.c_int]
    lib.decode_stack.argtypes = [_P] * 10 + [_I] * 9 + [_F, ctypes.c_int, ctypes.c_int]
    lib.context_stack.restype = None
    lib.context_stack.argtypes = [_P] * 8 + [_I] * 8 + [_F, ctypes.c_int]
    return lib


def applies(*tensors: torch.Tensor) -> bool:
    """CPU fp32 tensors that need no autograd, and the kernels are built."""
    return cbuild.fits(*tensors) and kernels() is not None


def _stack_order(layer) -> tuple[torch.Tensor, ...]:
    """A layer's 9 weights for decode_stack (input norm, q, k, v, o, post-attention norm, gate, up, down) by plain
    dict reads: ``nn.Module.__getattr__`` for all of them cost ~20 us a layer, and this runs every step."""
    mods = layer._modules
    a, mlp = mods["self_attn"]._modules, mods["mlp"]._modules
    return (mods["input_layernorm"]._parameters["weight"], a["q_proj"]._parameters["weight"],
            a["k_proj"]._parameters["weight"], a["v_proj"]._parameters["weight"], a["o_proj"]._parameters["weight"],
            mods["post_attention_layernorm"]._parameters["weight"], mlp["gate_proj"]._parameters["weight"],
            mlp["up_proj"]._parameters["weight"], mlp["down_proj"]._parameters["weight"])


def _qk_norms(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A layer's per-head q and k RMSNorm weights (Qwen3, block drafts), or None (Llama)."""
    a = layer._modules["self_attn"]._modules
    if a.get("q_norm") is None:
        return None
    return a["q_norm"]._parameters["weight"], a["k_norm"]._parameters["weight"]


def _layer_weights(layer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A decoder layer's norm weights and its 7 projection weights, in decode_stack's order."""
    w = _stack_order(layer)
    return [w[0], w[5]], [*w[1:5], *w[6:]]


def layer_applies(layer, x: torch.Tensor, cache_k: torch.Tensor) -> bool:
    """Whether ``decoder_stack`` can run this decoder layer (a model's ``DecoderLayer``, a block draft's)
    on x, at any row count: x, the cache and the norm weights CPU fp32 without autograd (q/k norms, if
    any, with the layer's eps), the 7 projection weights contiguous and all fp32 or all bf16, kernels
    built; a dense layer (a mixture of experts runs its C attention and its experts' products, not this
    call); a Llama-shaped one: no q/k/v biases (Qwen2), no Gemma scale, soft-cap, norms or GeGLU, and no
    sliding window shorter than the cache (the C attention is causal over all of it). Whether it is the
    fastest path is the caller's call."""
    if not hasattr(layer.mlp, "gate_proj") or not _llama_shaped(layer, cache_k.shape[-2]):
        return False
    norms, projections = _layer_weights(layer)
    qk, a = _qk_norms(layer), layer.self_attn
    if qk is not None:
        if not (a.q_norm.eps == a.k_norm.eps == layer.input_layernorm.eps and qk[0].shape == (a.head_dim,)):
            return False
        norms = [*norms, *qk]
    return cbuild.fits(x, cache_k, *norms) and cbuild.weight_fits(*projections) and kernels() is not None


def _llama_shaped(layer, cache_len: int) -> bool:
    """What decode_stack computes: plain RMSNorms, SwiGLU, unbiased projections, head_dim ** -0.5 scores, no
    window that masks one of ``cache_len`` positions (block drafts' layers have none of these attributes)."""
    a = layer.self_attn
    window = getattr(a, "window", None)
    return (type(layer.input_layernorm) is type(layer.post_attention_layernorm) and not isinstance(
                layer.input_layernorm, GemmaRMSNorm) and not hasattr(layer, "pre_feedforward_layernorm")
            and not getattr(layer.mlp, "gelu", False) and a.q_proj.bias is None
            and getattr(a, "scale", None) is None and getattr(a, "softcap", None) is None
            and (window is None or window >= cache_len))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * F.rms_norm(x, (d,), eps=eps)`` over the last dimension."""
    if w.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {tuple(w.shape)} does not match x {tuple(x.shape)}")
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty_like(x)
    kernels().rms_norm_rows(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return y


def _check_cache(k_cache, v_cache, lengths, b: int, t: int, hkv: int, d: int):
    """The C code writes into the cache in place and trusts every shape: check them first."""
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[:2]) != (b, hkv) or k_cache.shape[3] != d \
            or lengths.shape != (b,):
        raise ValueError(f"cache {tuple(k_cache.shape)}/{tuple(v_cache.shape)}, lengths {tuple(lengths.shape)} "
                         f"do not fit {b} rows x {hkv} KV heads x head size {d}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache is written in place: it must be contiguous")
    if int(lengths.max()) + t > k_cache.shape[2]:
        raise ValueError(f"KV cache overflow: {int(lengths.max())} + {t} new tokens > {k_cache.shape[2]} slots")


def cache_attention(q, k, v, cos, sin, k_cache, v_cache, lengths) -> torch.Tensor:
    """q (B,T,H,D), k/v (B,T,Hkv,D) of T new tokens per row at positions ``lengths[b] + t``; cos/sin
    (B,1,T,D). Ropes q and k, writes k and v into this layer's cache (B,Hkv,L,D) and attends each
    query over its row's keys up to its own position -> (B,T,H,D). Does not touch ``lengths``."""
    b, t, h, d = q.shape
    hkv, L = k.shape[2], k_cache.shape[2]
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != d or h % hkv or cos.shape != (b, 1, t, d) \
            or sin.shape != cos.shape:
        raise ValueError(f"cache_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cos/sin {tuple(cos.shape)} do not fit (B,T,H,D), (B,T,Hkv,D), (B,1,T,D)")
    _check_cache(k_cache, v_cache, lengths, b, t, hkv, d)
    q, k, v, cos, sin = (x.contiguous() for x in (q, k, v, cos, sin))
    lengths = lengths.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    kernels().decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                               k_cache.data_ptr(), v_cache.data_ptr(), lengths.data_ptr(), out.data_ptr(),
                               b, t, h, hkv, d, L, d ** -0.5, None, None, 0.0, 0)
    return out


def _kind(bf16: bool, amx: bool, panels: bool = False) -> int:
    """decode_ops.c's FP32, BF16, BF16_AMX or BF16_PANELS: how the layer's products run."""
    return (3 if panels else 2 if amx else 1) if bf16 else 0


class _Stack:
    """What ``decode_stack`` reads for a run of layers: their weights' addresses (kept as a ctypes
    array) and the layers' dimensions; ``stamp`` (every weight's address, dtype and version counter)
    tells whether the layers still hold those weights with those values, so a step pays one pass of
    dict reads, not the checks, and a packed copy (``panel_ptrs``) is never stale."""

    def __init__(self, layers: list, weights: list[torch.Tensor], x: torch.Tensor, cache_k: torch.Tensor,
                 stamp: tuple, previous: "_Stack | None" = None):
        self.dims, self.eps = _dims(layers[0])
        self.ok = all(layer_applies(l, x, cache_k) and _dims(l) == (self.dims, self.eps) for l in layers)
        self.bf16 = weights[1].dtype is torch.bfloat16
        self.ptrs = (ctypes.c_void_p * len(weights))(*(w.data_ptr() for w in weights))
        qk = [_qk_norms(l) for l in layers]
        self.ok = self.ok and len({q is None for q in qk}) == 1
        self.qk = None if qk[0] is None else (ctypes.c_void_p * (2 * len(layers)))(
            *(w.data_ptr() for pair in qk for w in pair))
        self.stamp = stamp
        self.weights, self.packed = weights, None
        # the previous plan's packed copies, to pack into again when only the values changed (a refresh
        # step: no new buffer to fault in)
        self.reuse = previous.packed if previous is not None and previous.packed is not None and all(
            (w.shape, w.dtype) == (o.shape, o.dtype) for w, o in zip(weights, previous.weights)) else None

    def panel_ptrs(self):
        """The addresses with every (bf16) projection replaced by its copy packed in panels, made on first
        use in one buffer of 2 MB pages (the stream the decode step reads)."""
        if self.packed is None:
            projections = [i for i in range(len(self.weights)) if i % 9 not in (0, 5)]  # not the two norms
            self.packed = self.reuse or dict(zip(projections,
                                                 panel_copies.empty([self.weights[i] for i in projections])))
            self.reuse = None
            for i, p in self.packed.items():
                panel_copies.pack(self.weights[i], p)
            self.panel = (ctypes.c_void_p * len(self.weights))(
                *(self.packed[i].data_ptr() if i in self.packed else w.data_ptr() for i, w in enumerate(self.weights)))
        return self.panel


def _dims(layer) -> tuple:
    """((hidden, heads, KV heads, head size, intermediate), RMSNorm eps): what decode_stack takes once
    for all the layers."""
    a, mlp = layer.self_attn, layer.mlp
    return ((a.q_proj.weight.shape[1], a.n_heads, a.n_kv, a.head_dim, mlp.gate_proj.weight.shape[0]),
            layer.input_layernorm.eps)


_stacks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decoder_stack(model, first: int, layers: list, x, cos, sin, cache, taps=(), amx: bool = False,
                  panels: bool = False, block: bool = False) -> tuple | None:
    """``layers`` (decoder layers ``first``, ``first + 1``, ... of ``model``; each ``layer_applies``,
    one shape) on x (B,T,D) into ``cache`` (``.k``, ``.v`` (layers,B,Hkv,L,D), ``.lengths`` (B,)) in
    one C call -> (output, {i: output of layer i for i in taps}); None when it does not apply (grad
    mode, a layer that does not fit, other shapes), for the caller to run the layers one by one. bf16
    products on AMX tiles (``amx``) or on copies packed in panels (``panels``); fp32 weights ignore
    both. Attention is causal over each row's cache, or with ``block`` every query of row b sees keys
    0..lengths[b] + T − 1 (a block draft's slots). Whether one call per layer (and which products) is
    the fastest path for the row count is the caller's call."""
    if torch.is_grad_enabled() or kernels() is None:
        return None
    b, t, d = x.shape
    weights = [w for l in layers for w in _stack_order(l)]
    versions = panel_copies.versions(weights)  # None: weights nothing may pack (trainable, or inference tensors)
    qk = [w.data_ptr() for l in layers for w in _qk_norms(l) or ()]
    stamp = (x.dtype, cache.k.dtype, *(w.data_ptr() for w in weights), *(w.dtype for w in weights), versions, *qk)
    key = (first, len(layers))
    plans = _stacks.setdefault(model, {})
    plan = plans.get(key)
    if plan is None or plan.stamp != stamp:
        plan = plans[key] = _Stack(layers, weights, x, cache.k, stamp, previous=plan)
    D, H, Hkv, hd, inter = plan.dims
    if not plan.ok or d != D or cos.shape != (b, 1, t, hd) or sin.shape != cos.shape:
        return None
    _check_cache(cache.k[first], cache.v[first], cache.lengths, b, t, Hkv, hd)
    if first + len(layers) > cache.k.shape[0] or not (cache.k.is_contiguous() and cache.v.is_contiguous()):
        raise ValueError(f"layers {first}..{first + len(layers) - 1}: the KV cache {tuple(cache.k.shape)} must hold "
                         "them and be contiguous (the C code steps through it by layer)")
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    lengths = cache.lengths.to(torch.int64).contiguous()
    tapped = {i: torch.empty_like(x) for i in taps if first <= i < first + len(layers)}
    tap_ptrs = (ctypes.c_void_p * len(layers))(*(tapped[i].data_ptr() if i in tapped else None
                                                 for i in range(first, first + len(layers))))
    y = torch.empty_like(x)
    kc, vc = cache.k[first], cache.v[first]  # layer `first`; the C code steps by one layer's size
    panels = panels and plan.bf16 and not amx and versions is not None
    kernels().decode_stack(x.data_ptr(), y.data_ptr(), plan.panel_ptrs() if panels else plan.ptrs, plan.qk,
                           cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(), lengths.data_ptr(), tap_ptrs,
                           len(layers), b, t, D, H, Hkv, hd, inter, cache.k.shape[3], plan.eps,
                           _kind(plan.bf16, amx, panels), int(block))
    return y, tapped
