"""EAGLE-3 building blocks: the one decoder layer ("midlayer"), the draft vocabulary map, tap defaults.

The midlayer is a Llama decoder layer whose attention reads two streams, the token embedding
and the hidden state, concatenated after their own RMSNorms::

    x = cat(input_layernorm(emb), hidden_norm(hidden))        # (B,T,2H)
    h = hidden + o_proj(Attn(q_proj(x), k_proj(x), v_proj(x))) # q/k/v: Linear(2H, heads·D)
    h = h + mlp(post_attention_layernorm(h))                   # SwiGLU, the returned *pre-norm* output

The layer is split into ``qkv`` and ``finish`` so the caller chooses the attention: training
runs the TTT branch primitive (codraft.attention.branch), decoding a static KV cache. Parameter
names are those of the public EAGLE-3 checkpoints (``midlayer.self_attn.q_proj.weight`` ...).

Not here: the TTT unroll, decoding, checkpoint I/O (eagle3.py); the optional ``fc_norm``
variant of some public checkpoints.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from codraft.models.config import ModelConfig
from codraft.models.layers import MLP, RMSNorm, apply_rope


class Eagle3Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)


class Eagle3Layer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def qkv(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """emb, hidden (B,T,H); cos/sin (B,1,T,D) -> q (B,Hq,T,D), k, v (B,Hkv,T,D), RoPE applied."""
        a = self.self_attn
        b, t, _ = emb.shape
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # (B,T,2H)
        q = a.q_proj(x).view(b, t, a.n_heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, t, a.n_kv, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, t, a.n_kv, a.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, o: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Attention output o (B,Hq,T,D) and the residual hidden (B,T,H) -> pre-norm layer output (B,T,H)."""
        b, _, t, _ = o.shape
        h = hidden + self.self_attn.o_proj(o.to(hidden.dtype).transpose(1, 2).reshape(b, t, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


def default_layers(num_layers: int) -> list[int]:
    """Target layer outputs to tap: [1, L//2-1, L-4] (0-based), clamped to [0, L-1], deduplicated, ascending.

    Tiny targets collapse: L=4 -> [0, 1], L=2 -> [0, 1], L=1 -> [0]; from L=8 on there are three.
    """
    if num_layers < 1:
        raise ValueError(f"target has num_hidden_layers={num_layers}; EAGLE-3 needs at least one layer to tap")
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    return sorted({min(max(i, 0), num_layers - 1) for i in ids})


# fc is Linear(3·hidden, hidden) in vLLM, SGLang and SpecForge alike (docs/serving.md): only three-tap
# EAGLE-3 drafts can be served (codraft.export.eagle3 refuses others; ``draft.taps`` asks for three)
SERVED_TAPS = 3


def parse_taps(text: str) -> list[int] | None:
    """``draft.taps`` / ``train-draft --taps``: "auto" -> None (``default_layers``), "2,5,8" -> [2, 5, 8]
    (layer outputs, 0-based, ascending: the order is no choice, the stacks concatenate taps in layer
    order). ValueError for anything else: empty, not an integer, negative, a duplicate."""
    text = str(text).strip()
    if text == "auto":
        return None
    try:
        taps = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"taps must be auto or comma-separated layer ids such as 2,5,8, got {text!r}") from None
    if any(t < 0 for t in taps) or len(set(taps)) != len(taps):
        raise ValueError(f"taps must be distinct layer ids >= 0, got {text!r}")
    return sorted(taps)


def check_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    layers = [int(i) for i in layers]
    if not layers or len(set(layers)) != len(layers) or any(not 0 <= i < num_layers for i in layers):
        raise ValueError(f"layers must be distinct target layer ids in [0, {num_layers - 1}], got {layers}")
    return layers


def vocab_map(vocab_size: int, draft_vocab_size: int | None = None,
              token_counts: torch.Tensor | Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocabulary as (d2t int64 (V_d,), t2d bool (V,)).

    The draft vocabulary is the ``draft_vocab_size`` most frequent tokens of ``token_counts``
    (ties broken towards the smaller id), sorted ascending as ``used``; then
    ``d2t[i] = used[i] - i`` (target id = draft id + d2t[draft id]) and ``t2d[j] = j in used``.
    ``draft_vocab_size`` None or equal to ``vocab_size``: the full vocabulary (d2t = 0, t2d all True).
    """
    v = vocab_size
    n = v if draft_vocab_size is None else int(draft_vocab_size)
    if not 0 < n <= v:
        raise ValueError(f"draft_vocab_size must be in [1, vocab_size={v}], got {draft_vocab_size}")
    if token_counts is None:
        if n != v:
            raise ValueError(f"draft_vocab_size={n} < vocab_size={v} needs token_counts (V,) to choose the tokens")
        used = torch.arange(v)
    else:
        counts = torch.as_tensor(token_counts)
        if counts.shape != (v,):
            raise ValueError(f"token_counts must have shape ({v},) (one count per target token), "
                             f"got {tuple(counts.shape)}")
        order = torch.sort(counts.double(), descending=True, stable=True).indices  # ties: smaller id first
        used = torch.sort(order[:n]).values
    d2t = used - torch.arange(n)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[used] = True
    return d2t.long(), t2d
