"""Attention functions: dense references with explicit masks, and varlen/cache mask builders.

Every attention function has the signature ``attn(q, k, v, mask) -> o`` with
q (B,H,T,D), k/v (B,Hkv,S,D), mask bool (B|1, 1, T, S) where True = attend, ``None`` for
plain causal attention with T == S, or a ``PackedCausal`` descriptor for the packed layout
(causal within each sequence of ``cu_seqlens``, optionally within a sliding window; ``.dense()``
materialises it). ``softcapped_attention`` (softcap.py) is Gemma 2's attention with tanh-capped scores. The model
calls whatever function it is given, so context-parallel rings plug in without touching the
model. ``varlen_attention`` (varlen.py, the model's default) runs one causal SDPA per packed
sequence; ``sdpa`` materialises the dense mask and is its reference.

Partial attentions return (O, LSE) and combine exactly with ``merge_lse`` (merge.py);
``branch_attention`` (branch.py) runs draft branches (EAGLE-3 TTT diagonal, DFlash/DSpark
blocks) as a main-prefix part and a local part merged that way. ``MainAttention`` (context.py) is
how the drafts' training losses reach the main sequence: single-process here, a ring under context
parallelism.
"""
from codraft.attention.dense import (
    PackedCausal,
    cache_causal_mask,
    positions_from_cu_seqlens,
    sdpa,
    sliding_causal_mask,
    varlen_causal_mask,
)
from codraft.attention.varlen import varlen_attention
from codraft.attention.softcap import softcapped_attention
from codraft.attention.merge import attention_with_lse, merge_lse, softmax_with_lse
from codraft.attention.branch import (
    branch_attention,
    branch_attention_with_lse,
    branch_local_part,
    branch_main_part,
    dense_branch_reference,
)
from codraft.attention.context import MainAttention

__all__ = ["sdpa", "PackedCausal", "varlen_attention", "varlen_causal_mask", "cache_causal_mask", "positions_from_cu_seqlens",
           "sliding_causal_mask", "softcapped_attention",
           "attention_with_lse", "merge_lse", "softmax_with_lse",
           "branch_attention", "branch_attention_with_lse", "branch_main_part", "branch_local_part",
           "dense_branch_reference", "MainAttention"]
