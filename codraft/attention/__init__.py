"""Attention functions: dense references with explicit masks, and varlen/cache mask builders.

Every attention function has the signature ``attn(q, k, v, mask) -> o`` with
q (B,H,T,D), k/v (B,Hkv,S,D), mask bool (B|1, 1, T, S) where True = attend, or
``None`` for plain causal attention with T == S. The model calls whatever function
it is given, so context-parallel rings plug in without touching the model.
"""
from codraft.attention.dense import sdpa, varlen_causal_mask, cache_causal_mask, positions_from_cu_seqlens

__all__ = ["sdpa", "varlen_causal_mask", "cache_causal_mask", "positions_from_cu_seqlens"]
