"""The sparse mixture-of-experts MLP of Qwen3-MoE and Qwen2-MoE (``SparseMoE``), HF's parameter names.

Router: logits = x W_gᵀ over the E experts; their softmax in fp32; each token's top-k experts, their
probabilities renormalised over the k when ``norm_topk_prob``, cast to x's dtype. Experts: SwiGLU MLPs
of ``moe_intermediate_size``; Qwen2-MoE adds a shared expert (a SwiGLU MLP of
``shared_expert_intermediate_size``) on every token, gated by sigmoid(x w_sᵀ).

Grouped products: the (token, slot) pairs are sorted by expert once; each active expert runs one
product over its tokens, never a loop over tokens, and the weighted outputs are added back per token
in expert order (as transformers does). A decode step of R rows runs at most min(E, R·k) experts: why a
verify forward of γ + 1 tokens costs a MoE target more than a dense one of the same active size.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from codraft.models.config import ModelConfig
from codraft.models.layers import MLP, linear


class SparseMoE(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = c.num_experts, c.num_experts_per_tok, c.norm_topk_prob
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(c, c.moe_intermediate_size) for _ in range(c.num_experts))
        shared = c.shared_expert_intermediate_size
        self.shared_expert = MLP(c, shared) if shared else None
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N,H) -> router logits (N,E), the top-k weights (N,k) in x's dtype and experts (N,k)."""
        logits = linear(x, self.gate.weight)
        weights, experts = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(x.dtype), experts

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ_j weights[n, j] · expert_{experts[n, j]}(x[n]): one product per active expert."""
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (N·k,) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per layer call
        tokens, w = order // self.top_k, weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                t = tokens[start:start + n]
                y = self.experts[e](x[t]) * w[start:start + n, None]
                out.index_add_(0, t, y.to(out.dtype))
                start += n
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        _, weights, experts = self.route(x2)
        out = self.grouped(x2, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(linear(x2, self.shared_expert_gate.weight)) * self.shared_expert(x2)
        return out.view(x.shape)
