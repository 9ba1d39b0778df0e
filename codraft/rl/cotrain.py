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

Shared prompts: a GRPO group's n sequences share one prompt, which is ~70 % of the packed row
on short-completion workloads. ``pack`` also lays the batch out with each group's prompt packed
once (``SharedPrompts``) and the policy runs on that layout: each completion attends to its
prompt plus itself, and the prompt's gradient sums over the group. The RL loss reads rows
through ``SharedPrompts.gather``. The drafts keep the per-sequence layout (their losses pick
anchors, positions and context per sequence): their taps are expanded per sequence with the
same gather, which copies detached features only and costs no policy compute.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from codraft.attention import PackedCausal
from codraft.drafts.batch import DraftBatch
from codraft.rl.grpo import entropy_from_logits, grpo_loss, token_logprobs


@dataclass
class SharedPrompts:
    """The same batch with each GRPO group's prompt packed once: the layout the policy runs on.

    Segments: a group's prompt, then each of its completions, which sees the whole prompt and
    itself causally (``PackedCausal.prefix``), at positions continuing after the prompt. Every
    token has the same context as in the unshared row, so hidden states are equal; the prompt's
    gradient is the sum over its completions, as autograd gives through the shared rows.
    """
    input_ids: torch.Tensor      # (1,T_s)
    layout: PackedCausal         # over T_s tokens
    gather: torch.Tensor         # (T,) position in input_ids of each unshared packed token


@dataclass
class Packed:
    input_ids: torch.Tensor      # (1,T) prompts and completions back to back
    cu_seqlens: torch.Tensor     # (N+1,)
    completion: torch.Tensor     # (1,T) bool: token t was generated (is an RL/draft target)
    index: torch.Tensor          # (N,L) packed position of completion token j of sequence i (0 where padded)
    index_mask: torch.Tensor     # (N,L) bool
    rollout_logprobs: torch.Tensor  # (N,L) the engine's logprobs of those tokens
    shared: SharedPrompts | None = None  # set when consecutive sequences repeat a prompt


def pack(prompts: list[list[int]], completions: list[list[int]], rollout_logprobs: list[list[float]],
         device: torch.device | str = "cpu", *, share_prompts: bool = True) -> Packed:
    """One packed row, sequence i = prompts[i] + completions[i]; ``share_prompts``: also the
    SharedPrompts layout when consecutive prompts repeat (a GRPO group), which the policy runs on."""
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
    shared = share_prompt_layout(prompts, completions, device) if share_prompts else None
    return Packed(torch.tensor(ids, device=device)[None], cu.to(device), torch.tensor(comp, device=device)[None],
                  torch.where(index_mask, index, 0).to(device), index_mask.to(device), lp.to(device), shared)


def share_prompt_layout(prompts: list[list[int]], completions: list[list[int]],
                        device: torch.device | str = "cpu") -> SharedPrompts | None:
    """Runs of equal consecutive prompts packed once each; None when no prompt repeats."""
    if all(a != b for a, b in zip(prompts[:-1], prompts[1:])):
        return None
    ids, bounds, prefix, gather = [], [0], [], []
    prompt_start = prompt_seg = -1
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if i == 0 or p != prompts[i - 1]:  # a new group: its prompt segment
            prompt_start, prompt_seg = len(ids), len(prefix)
            ids += p
            bounds.append(len(ids))
            prefix.append(-1)
        gather += range(prompt_start, prompt_start + len(p))
        gather += range(len(ids), len(ids) + len(c))
        ids += c
        bounds.append(len(ids))
        prefix.append(prompt_seg)
    cu = torch.tensor(bounds, device=device)
    return SharedPrompts(torch.tensor(ids, device=device)[None], PackedCausal.of(cu, len(ids), tuple(prefix)),
                         torch.tensor(gather, device=device))


def policy_hidden(model, batch: Packed, taps: tuple[int, ...] | None):
    """``model``'s last-layer output and taps over the batch, run on the shared layout when there is one.

    Returns hidden (1,T_p,H) in the layout the model ran on, taps {l: (1,T,H)} in the per-sequence
    layout, and to_policy: per-sequence packed positions -> rows of hidden (identity when unshared).
    """
    sh = batch.shared
    if sh is None:
        out = model(batch.input_ids, cu_seqlens=batch.cu_seqlens, taps=taps, head=False)
        hidden, feats = out if taps is not None else (out, {})
        return hidden, feats, lambda pos: pos
    out = model(sh.input_ids, layout=sh.layout, taps=taps, head=False)
    hidden, feats = out if taps is not None else (out, {})
    # taps expanded per sequence (each prompt copied to its completions): the drafts' layout
    return hidden, {l: f[:, sh.gather] for l, f in feats.items()}, lambda pos: sh.gather[pos]


def cotrain_loss(policy, draft, batch: Packed, advantages: torch.Tensor, *, temperature: float, lam: float,
                 eps_low: float, eps_high: float, norm: str, kl_coef: float = 0.0, reference=None,
                 train_draft: bool = True) -> tuple[torch.Tensor, dict]:
    """Total loss and metrics for one packed batch (the caller runs backward and the optimisers)."""
    taps = tuple(draft.feature_layers) if (draft is not None and train_draft) else None
    hidden, feats, to_policy = policy_hidden(policy, batch, taps)
    # logprob of token t comes from the logits at t-1. Only those rows (one per completion token,
    # ~30 % of the packed row) go through the LM head; they are also the draft's teacher rows.
    t = max(temperature, 1e-6)
    targets = batch.index[batch.index_mask]                    # (R,) packed positions of completion tokens
    rows = (targets - 1).clamp_min(0)                          # (R,)
    logits = policy.logits(hidden[0, to_policy(rows)])         # (R,V)
    ids = batch.input_ids[0, targets]
    logp = _unflatten(token_logprobs(logits / t, ids), batch.index_mask)  # (N,L), 0 where padded
    ref_logp = None
    if reference is not None:
        with torch.no_grad():
            ref_hidden, _, _ = policy_hidden(reference, batch, None)
            ref_logits = reference.logits(ref_hidden[0, to_policy(rows)])
            ref_logp = _unflatten(token_logprobs(ref_logits / t, ids), batch.index_mask)
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
