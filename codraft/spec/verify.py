"""The lossless speculative accept/reject rule, vectorised over the batch, with no host sync.

Notation (design.md): the draft proposed x_1..x_γ, x_k drawn from q_k; one target forward
over [last emitted token, x_1..x_γ] gives p_1..p_{γ+1}, where p_k is the target's
distribution for the k-th new token (p_{γ+1} follows x_γ). Temperature/top-k/top-p are
applied to p here and, by the draft, to q (both through ``Sampler``).

    accept x_k with probability min(1, p_k(x_k) / q_k(x_k)), left to right;
    at the first rejection (slot n+1 = k) emit y ~ norm(max(0, p_k - q_k)) and stop;
    if all γ are accepted emit a bonus y ~ p_{γ+1}.

Why it is exact: for one slot, P(emit v) = min(p(v), q(v)) + (1 - Σ_u min(p(u), q(u))) ·
max(0, p(v) - q(v)) / Σ_u max(0, p(u) - q(u)) = p(v), because both normalisers equal the
total variation distance Σ max(0, p - q) = 1 - Σ min(p, q). Induction over slots gives the
chain. A draft that is deterministic (prompt lookup, or any draft under greedy decoding)
passes q = None, meaning q_k is one-hot at x_k: accept with probability p_k(x_k), and the
residual is p_k with x_k removed.

Greedy targets (temperature 0): p_k is one-hot at argmax, so this reduces to accepting
the longest prefix with x_k == argmax p_k and emitting argmax at the first mismatch (or
as the bonus), which is what the fast path below computes directly.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from codraft.spec.sampling import Sampler


class Verdict(NamedTuple):
    n_accepted: torch.Tensor  # (B,) long in [0, γ]: accepted draft tokens per row
    tokens: torch.Tensor  # (B,γ+1) long: row b emits tokens[b, :n_accepted[b] + 1]
    logprobs: torch.Tensor  # (B,γ+1) float32: target logprob of tokens[b, j] under p_{j+1}


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised (the sampler does not need normalised weights).

    (B,V) rows. Where p == q exactly the rejection branch has probability 0; if float
    round-off still lands here (all-zero residual) fall back to p so a token is emitted.
    """
    r = (p - q).clamp_min(0.0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def verify_drafts(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           sampler: Sampler) -> Verdict:
    """Apply the speculative rule to one verify forward.

    target_logits (B,γ+1,V): raw target logits at [last, x_1..x_γ];
    draft_tokens (B,γ): x_1..x_γ; draft_probs (B,γ,V) q rows the draft sampled from,
    or None for a one-hot (deterministic) draft. Ignored under greedy decoding.
    """
    b, g = draft_tokens.shape
    rows = torch.arange(b, device=draft_tokens.device)
    if sampler.greedy:
        best = target_logits.argmax(-1)  # (B,γ+1)
        match = draft_tokens == best[:, :g]  # (B,γ)
        n = match.long().cumprod(-1).sum(-1)  # (B,) length of the matching prefix
        # accepted x_k equal argmax p_k, and the correction/bonus at slot n+1 is argmax too
        logp = sampler.logprobs(target_logits).gather(-1, best[..., None]).squeeze(-1)
        return Verdict(n, best, logp)

    logp = sampler.logprobs(target_logits)  # (B,γ+1,V) log p_k after temperature/top-k/top-p
    p = logp.exp()
    x = draft_tokens[..., None]  # (B,γ,1)
    p_x = p[:, :g].gather(-1, x).squeeze(-1)  # (B,γ) p_k(x_k)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.float().gather(-1, x).squeeze(-1)
    # u < p/q happens with probability min(1, p/q); q_x > 0 since x_k was drawn from q_k.
    u = sampler.uniform((b, g), device=p.device)
    accept = u * q_x < p_x  # (B,γ)
    n = accept.long().cumprod(-1).sum(-1)  # (B,) accepted prefix length; slot n+1 is resampled

    # Row of slot n+1 (0-based index n). With q_{γ+1} := 0 the residual max(0, p_{γ+1} - 0)
    # is exactly the bonus distribution, so one formula covers rejection and bonus.
    p_n = p[rows, n]  # (B,V)
    if draft_probs is None:
        x_n = draft_tokens[rows, n.clamp(max=g - 1)]  # (B,)
        q_n = torch.zeros_like(p_n).scatter_(-1, x_n[:, None], (n < g).float()[:, None])
    else:
        q_n = torch.where((n < g)[:, None], draft_probs[rows, n.clamp(max=g - 1)].float(), 0.0)
    y = sampler.sample(residual(p_n, q_n))  # (B,)

    tokens = torch.cat([draft_tokens, draft_tokens[:, :1]], 1)  # (B,γ+1); slot γ+1 is filler
    tokens = tokens.scatter(1, n[:, None], y[:, None])
    return Verdict(n, tokens, logp.gather(-1, tokens[..., None]).squeeze(-1))
