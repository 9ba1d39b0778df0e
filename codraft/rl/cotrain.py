"""One co-training step: L(θ, φ) = L_RL(θ) + λ·L_draft(φ; x, sg(H_θ(x))).

The rollout sequences (prompt + completion) are packed into one row; ONE policy forward
over it gives the logits for the GRPO loss and, detached, the tapped features and the
teacher logits the draft trains on: there is no second policy forward. Because the draft
only ever sees detached tensors, its loss cannot move θ (tested: policy gradients with
λ > 0 equal those with λ = 0). One backward, then two optimisers with separate clipping.

Token alignment: the packed row holds tokens x_0..x_{T-1}; the policy's logprob of x_t is
read from the logits at t-1, scaled by the rollout temperature (the convention the rollout
engine used for its logprobs, so the two are comparable). The LM head runs only on those rows
(the policy forward returns hidden states); the draft gets the same rows as its teacher logits,
which are the only teacher rows any draft reads (see DraftBatch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from codraft.drafts.batch import DraftBatch
from codraft.rl.grpo import entropy_from_logits, grpo_loss, token_logprobs


@dataclass
class Packed:
    input_ids: torch.Tensor      # (1,T) prompts and completions back to back
    cu_seqlens: torch.Tensor     # (N+1,)
    completion: torch.Tensor     # (1,T) bool: token t was generated (is an RL/draft target)
    index: torch.Tensor          # (N,L) packed position of completion token j of sequence i (0 where padded)
    index_mask: torch.Tensor     # (N,L) bool
    rollout_logprobs: torch.Tensor  # (N,L) the engine's logprobs of those tokens


def pack(prompts: list[list[int]], completions: list[list[int]], rollout_logprobs: list[list[float]],
         device: torch.device | str = "cpu") -> Packed:
    ids, comp, starts, lens = [], [], [], []
    for p, c in zip(prompts, completions):
        starts.append(len(ids) + len(p))
        lens.append(len(c))
        ids += p + c
        comp += [False] * len(p) + [True] * len(c)
    n, width = len(prompts), max(max(lens), 1)
    j = torch.arange(width)
    index = torch.tensor(starts)[:, None] + j
    index_mask = j < torch.tensor(lens)[:, None]
    lp = torch.zeros(n, width)
    for i, l in enumerate(rollout_logprobs):
        lp[i, :len(l)] = torch.tensor(l, dtype=torch.float32)
    seq_lens = torch.tensor([len(p) + len(c) for p, c in zip(prompts, completions)])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), seq_lens.cumsum(0)])
    return Packed(torch.tensor(ids, device=device)[None], cu.to(device), torch.tensor(comp, device=device)[None],
                  torch.where(index_mask, index, 0).to(device), index_mask.to(device), lp.to(device))


def cotrain_loss(policy, draft, batch: Packed, advantages: torch.Tensor, *, temperature: float, lam: float,
                 eps_low: float, eps_high: float, norm: str, kl_coef: float = 0.0, reference=None,
                 train_draft: bool = True) -> tuple[torch.Tensor, dict]:
    """Total loss and metrics for one packed batch (the caller runs backward and the optimisers)."""
    taps = tuple(draft.feature_layers) if (draft is not None and train_draft) else None
    out = policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, taps=taps, head=False)
    hidden, feats = out if taps is not None else (out, {})
    # logprob of token t comes from the logits at t-1. Only those rows (one per completion token,
    # ~30 % of the packed row) go through the LM head; they are also the draft's teacher rows.
    t = max(temperature, 1e-6)
    targets = batch.index[batch.index_mask]                    # (R,) packed positions of completion tokens
    rows = (targets - 1).clamp_min(0)                          # (R,)
    logits = policy.logits(hidden[0, rows])                    # (R,V)
    ids = batch.input_ids[0, targets]
    logp = _unflatten(token_logprobs(logits / t, ids), batch.index_mask)  # (N,L), 0 where padded
    ref_logp = None
    if reference is not None:
        with torch.no_grad():
            ref_hidden = reference(batch.input_ids, cu_seqlens=batch.cu_seqlens, head=False)
            ref_logp = _unflatten(token_logprobs(reference.logits(ref_hidden[0, rows]) / t, ids), batch.index_mask)
    rl_loss, m = grpo_loss(logp, logp.detach(), advantages, batch.index_mask, eps_low=eps_low, eps_high=eps_high,
                           norm=norm, ref_logprobs=ref_logp, kl_coef=kl_coef,
                           rollout_logprobs=batch.rollout_logprobs)
    metrics = {f"policy/{k}": v for k, v in m.items()}
    with torch.no_grad():
        metrics["policy/entropy"] = entropy_from_logits(logits.detach()[None] / t, torch.ones_like(rows)[None])
    loss = rl_loss
    if taps is not None:
        db = DraftBatch(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, loss_mask=batch.completion,
                        features={l: f.detach() for l, f in feats.items()},
                        teacher_logits=logits.detach(), teacher_rows=rows)
        draft_loss, dm = draft.loss(db)
        metrics.update({f"draft/{k}": v for k, v in dm.items()})
        metrics["draft/loss"] = draft_loss.detach()
        loss = loss + lam * draft_loss
    return loss, metrics


def _unflatten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(R,) values of the True entries of mask (N,L), row-major -> (N,L) with zeros elsewhere."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)
