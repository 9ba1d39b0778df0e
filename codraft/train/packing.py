"""One packer for every training loop: prompt + completion sequences back to back in one row.

``pack`` gives the per-sequence layout (``cu_seqlens``; ``completion`` marks the generated
tokens, the only prediction targets; ``index`` finds completion token j of sequence i) and,
when consecutive prompts repeat (a GRPO group), the ``SharedPrompts`` layout with each group's
prompt packed once, which the policy runs on in the RL step (``codraft.rl.cotrain``). The
offline draft trainer uses the per-sequence layout, the SFT warm start its ``padded`` view.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from codraft.attention import PackedCausal


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

    def padded(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same sequences as a right-padded batch, for a plain batched forward (many short
        sequences run faster that way than one causal attention per packed sequence):
        ids (N,L) padded with ``pad_id``, and (N,L) bool marking completion tokens."""
        lens = self.cu_seqlens.diff()
        j = torch.arange(int(lens.max()), device=lens.device)
        valid = j < lens[:, None]                                                        # (N,L)
        pos = (self.cu_seqlens[:-1, None] + j).clamp(max=self.input_ids.shape[1] - 1)  # (N,L)
        ids = torch.where(valid, self.input_ids[0, pos], pad_id)
        return ids, valid & self.completion[0, pos]


def pack(prompts: list[list[int]], completions: list[list[int]], rollout_logprobs: list[list[float]] | None = None,
         device: torch.device | str = "cpu", *, share_prompts: bool = True, masks: list | None = None) -> Packed:
    """One packed row, sequence i = prompts[i] + completions[i]; ``share_prompts``: also the
    SharedPrompts layout when consecutive prompts repeat (a GRPO group), which the policy runs on.
    masks[i] (multi-turn episodes; None: every token): False on completion tokens the policy did not
    generate (observations), which stay context only: not ``completion``, not in ``index_mask``."""
    ids, comp, starts, lens = [], [], [], []
    masks = masks or [None] * len(prompts)
    for p, c, m in zip(prompts, completions, masks):
        starts.append(len(ids) + len(p))
        lens.append(len(c))
        ids += p + c
        comp += [False] * len(p) + ([True] * len(c) if m is None else [bool(x) for x in m])
    n, width = len(prompts), max(max(lens), 1)
    j = torch.arange(width)
    index = torch.tensor(starts)[:, None] + j
    index_mask = j < torch.tensor(lens)[:, None]
    for i, m in enumerate(masks):
        if m is not None:
            index_mask[i, :len(m)] &= torch.tensor(m, dtype=torch.bool)
    lp = torch.zeros(n, width)
    for i, l in enumerate(rollout_logprobs or []):
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
