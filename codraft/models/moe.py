"""The sparse mixture-of-experts MLP of Qwen3-MoE and Qwen2-MoE (``SparseMoE``), HF's parameter names.

Router: logits = x W_gᵀ over the E experts; their softmax in fp32; each token's top-k experts, their
probabilities renormalised over the k when ``norm_topk_prob``, cast to x's dtype. Experts: SwiGLU MLPs
of ``moe_intermediate_size``; Qwen2-MoE adds a shared expert (a SwiGLU MLP of
``shared_expert_intermediate_size``) on every token, gated by sigmoid(x w_sᵀ).

The routers' load-balancing loss (``load_balancing_loss``, the trainer's ``grpo.router_aux_coef``) and
routing replay (``Routing``: record the experts a forward chose, make another forward choose the same)
are applied from outside the module.

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
        self.routing = None  # a ``Routing`` while one is installed on the model

    def route(self, x: torch.Tensor, replay: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N,H) -> router logits (N,E), the top-k weights (N,k) in x's dtype and experts (N,k).
        ``replay`` (N,k): experts chosen elsewhere (the rollout's; −1: route this token here); their weights
        are this router's probabilities of them, so the router still learns."""
        logits = linear(x, self.gate.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if replay is not None:
            experts = torch.where(replay >= 0, replay.to(experts.dtype), experts)
            weights = probs.gather(-1, experts)
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
        start, training = 0, torch.is_grad_enabled()
        for e, n in enumerate(counts):
            # an expert no token chose still runs (on no rows) when training: its gradient is then zeros, not
            # None, so every rank of a data-parallel group reduces the same tensors (FSDP, replicate)
            if n or training:
                t = tokens[start:start + n]
                y = self.experts[e](x[t]) * w[start:start + n, None]
                out.index_add_(0, t, y.to(out.dtype))
                start += n
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        routing = self.routing  # set from outside (``Routing``): None in plain use
        logits, weights, experts = self.route(x2, None if routing is None else routing.replayed(self, len(x2)))
        if routing is not None:
            routing.record(self, experts, logits)
        out = self.grouped(x2, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(linear(x2, self.shared_expert_gate.weight)) * self.shared_expert(x2)
        return out.view(x.shape)


class Routing:
    """Routing replay from outside the model: installed on every ``SparseMoE`` of ``model`` for a ``with``
    block, it records the experts each forward chose (``calls``: per forward, (L, N, k) over the MoE
    layers in order and the forward's tokens in (B, T) order) and, given ``replay`` (L, N, k; −1: free),
    makes the next forward route its N tokens that way (the trainer's forward on the rollout's routes);
    with ``logits``, keeps every layer's router logits for ``load_balancing_loss``."""

    def __init__(self, model: nn.Module, replay: torch.Tensor | None = None, logits: bool = False):
        self.layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        self.replay, self.calls, self._call = replay, [], []
        self.logits = [] if logits else None  # the router logits (with their graph): the load-balancing loss

    def __enter__(self) -> "Routing":
        for m in self.layers:
            m.routing = self
        return self

    def __exit__(self, *exc):
        for m in self.layers:
            m.routing = None

    def replayed(self, module: SparseMoE, n: int) -> torch.Tensor | None:
        if self.replay is None:
            return None
        r = self.replay[self.index[id(module)]]
        if r.shape[0] != n:
            raise ValueError(f"routing replay holds {r.shape[0]} tokens, the forward runs {n}")
        return r

    def record(self, module: SparseMoE, experts: torch.Tensor, logits: torch.Tensor):
        if self.logits is not None:
            self.logits.append(logits)
        self._call.append(experts.detach())
        if len(self._call) == len(self.layers):  # the last MoE layer of this forward
            self.calls.append(torch.stack(self._call))
            self._call = []

    def pop(self) -> torch.Tensor:
        """The last forward's routes (L, N, k)."""
        return self.calls.pop()


def load_balancing_loss(logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """The routers' auxiliary load-balancing loss over every layer's tokens (Switch Transformer's, as
    transformers computes it): E · Σ_e (fraction of the top-k slots given to e) · (mean probability of e)."""
    cat = torch.cat(logits).float()  # (L·N, E)
    probs = F.softmax(cat, dim=-1)
    chosen = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, cat.shape[-1]).float()  # (L·N, k, E)
    return cat.shape[-1] * (chosen.mean(0) * probs.mean(0)[None]).sum()
