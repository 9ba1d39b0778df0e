"""What a draft trains on: explicit tensors, so they can come from another rank.

A ``DraftBatch`` is one packed row of rollout sequences (B = 1, sequences delimited by
``cu_seqlens``, positions restarting per sequence) together with what the policy forward
produced for it, *detached*: the tapped layer outputs sg(H_θ(x)) and the teacher logits.
Nothing in it carries an autograd path back to the policy, which is the stop-gradient of
L(θ, φ) = L_RL(θ) + λ·L_draft(φ; x, sg(H_θ(x))).

Alignment convention (same as the policy's): ``teacher_logits[0, t]`` is the policy's
next-token distribution after reading token t, i.e. over token t + 1;
``features[l][0, t]`` is the output of policy layer l at token t; ``loss_mask[0, t]`` marks
tokens t that the draft should learn to predict (completion tokens; prompts are context).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftBatch:
    input_ids: torch.Tensor                 # (1,T) long, packed
    cu_seqlens: torch.Tensor                # (n+1,) long, cu_seqlens[-1] <= T (tail is padding)
    loss_mask: torch.Tensor                 # (1,T) bool: token t is a prediction target
    features: dict[int, torch.Tensor]       # layer -> (1,T,H), detached
    teacher_logits: torch.Tensor            # (1,T,V), detached

    def __post_init__(self):
        t = self.input_ids.shape[1]
        if self.input_ids.shape[0] != 1:
            raise ValueError(f"DraftBatch is one packed row; got input_ids of shape {tuple(self.input_ids.shape)}")
        for name, x in [("teacher_logits", self.teacher_logits), *((f"features[{l}]", f) for l, f in self.features.items())]:
            if x.requires_grad:
                raise ValueError(f"DraftBatch.{name} requires grad: draft inputs must be detached (stop-gradient)")
            if x.shape[:2] != (1, t):
                raise ValueError(f"DraftBatch.{name} has shape {tuple(x.shape)}, expected (1, {t}, ...)")
        if self.loss_mask.shape != (1, t):
            raise ValueError(f"DraftBatch.loss_mask has shape {tuple(self.loss_mask.shape)}, expected (1, {t})")

    @property
    def device(self) -> torch.device:
        return self.input_ids.device
