"""Building blocks shared by the policy decoder and the drafts: RMSNorm (and Gemma's (1 + w) form), RoPE
(with Llama-3 frequency scaling), the gated MLP (SwiGLU, or GeGLU for Gemma), the product ``linear`` and
``Linear``, the projection module that runs it.

The plain reference, torch ops only. The CPU decode fast path (C kernels for few-row products
and norms) is not here: ``codraft.kernels.enable(module)`` installs it on a module tree."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from codraft.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scaled by (1 + w), w initialised to 0. A subclass, so the CPU fast path (which
    swaps exact classes) leaves it on this reference forward."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x):
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def rope_inv_freq(config: ModelConfig, theta: float | None = None) -> torch.Tensor:
    """theta: a base other than the config's (Gemma 3's sliding layers: rope_local_base_freq, unscaled)."""
    d = config.head_dim
    inv = 1.0 / ((theta or config.rope_theta) ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if theta is not None:
        return inv
    s = config.rope_scaling
    if s and s.get("rope_type", s.get("type")) == "llama3":
        # Llama-3: keep high frequencies, divide low ones by `factor`, interpolate between.
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif s and s.get("rope_type", s.get("type", "default")) != "default":
        raise ValueError(f"unsupported rope_scaling type {s.get('rope_type')!r}; supported: default, llama3")
    return inv


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions (B,T) -> cos, sin (B,1,T,D) in the rotate-half convention."""
    freqs = positions[..., None].float() * inv_freq  # (B,T,D/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias), always as one 2-D product: F.linear on a non-contiguous 3-D
    input (e.g. a slice of a block's slots) runs a bmm against a broadcast copy of ``w``, several
    times slower for an LM head. A weight stored in a narrower dtype than x (bf16 rollout weights,
    ``codraft.rollout.weights``) is widened, exactly, so the product runs in x's dtype. A weight split over
    ranks (a DTensor: a vocabulary-parallel LM head, ``codraft.parallel.tp``) takes a plain x as the same
    on every rank, and the product is split as the weight is."""
    if isinstance(w, DTensor) and not isinstance(x, DTensor):
        x = DTensor.from_local(x, w.device_mesh, [Replicate()] * w.device_mesh.ndim)
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    y = F.linear(x.reshape(-1, x.shape[-1]), w)
    return y.view(*x.shape[:-1], w.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` running ``linear``. The models call their projections as modules, so that a
    tensor-parallel plan's hooks (``codraft.parallel.tp``) run around them."""

    def forward(self, x):
        y = linear(x, self.weight)
        return y if self.bias is None else y + self.bias


def activate(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    """The gate's activation: silu (SwiGLU) or gelu with the tanh approximation (Gemma's GeGLU)."""
    return F.gelu(x, approximate="tanh") if gelu else F.silu(x)


class MLP(nn.Module):
    """SwiGLU, or GeGLU where the config's activation is gelu_pytorch_tanh (Gemma); ``size``: its
    intermediate size (default the config's; a MoE expert's is smaller)."""

    def __init__(self, c: ModelConfig, size: int | None = None):
        super().__init__()
        size = size or c.intermediate_size
        self.gelu = c.activation == "gelu_pytorch_tanh"
        self.gate_proj = Linear(c.hidden_size, size, bias=False)
        self.up_proj = Linear(c.hidden_size, size, bias=False)
        self.down_proj = Linear(size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(activate(self.gate_proj(x), self.gelu) * self.up_proj(x))


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one process holds it: gathered when it is split over ranks (a DTensor: collective over its
    mesh), else ``t``. What the trainer's split policy gives the loss, the refit and checkpoints."""
    return t.full_tensor() if isinstance(t, DTensor) else t

