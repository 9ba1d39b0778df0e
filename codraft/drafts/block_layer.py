"""A block draft's decoder layer: GQA with q/k RMSNorm whose block queries attend over
[injected context K/V ; their own block's K/V], then a SwiGLU MLP (Qwen3-style, pre-norm).

Training (``forward``): the context part is a ``MainPart`` callable the layer is given (the batch's
``MainAttention.branch``, a ring under context parallelism) and the block's own bidirectional part
is ``branch_local_part``; the two are merged by LSE. Decoding (``decode``): one block per row whose
K/V are written into the context cache, so both parts are one attention over each row's prefix.

Not here: the context projection, the block inputs and the decoding state (block_backbone.py,
block_decode.py); the fused C path (codraft.kernels.block_layers).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from codraft.attention import branch_local_part, merge_lse, sdpa
from codraft.models.config import ModelConfig
from codraft.models.layers import MLP, RMSNorm, apply_rope, linear

# q (B,H,N,S,D), context k/v (B,Hkv,T,D) -> (O (B,H,N,S,D), LSE (B,H,N,S)): blocks over the context
MainPart = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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


__all__ = ["BlockAttention", "BlockDecoderLayer", "MainPart"]
