"""What a draft trains on: explicit tensors, so they can come from another rank.

A ``DraftBatch`` is one packed row of rollout sequences (B = 1, sequences delimited by
``cu_seqlens``, positions restarting per sequence) together with what the policy forward
produced for it, *detached*: the tapped layer outputs sg(H_θ(x)) and the teacher logits.
Nothing in it carries an autograd path back to the policy, which is the stop-gradient of
L(θ, φ) = L_RL(θ) + λ·L_draft(φ; x, sg(H_θ(x))).

Alignment convention (same as the policy's): the teacher logits of packed row t are the
policy's next-token distribution after reading token t, i.e. over token t + 1;
``features[l][0, t]`` is the output of policy layer l at token t; ``loss_mask[0, t]`` marks
tokens t that the draft should learn to predict (completion tokens; prompts are context).

Teacher logits only where drafts read them. A draft supervises the prediction of token t + 1
from row t only when ``loss_mask[0, t + 1]``, so those are the only teacher rows any draft
reads: the rows just before completion tokens, which are also the rows the RL loss needs.
``teacher_logits`` (R,V) holds the logits of the distinct packed rows ``teacher_rows`` (R,),
which must include every such row (extra rows are allowed and ignored); the (T,V) tensor over
the whole row, mostly prompt, is never built. ``teacher_at(rows)`` looks rows up. An offline batch
for a draft that predicts K tokens may hold only those columns, as log-probabilities
(``teacher_tokens``): the head product over K rows instead of V, with each row's logsumexp over the
whole vocabulary computed once per cached row (``codraft.train.feature_cache``).

Context parallelism: ``main`` (a ``MainAttention``; None = the single-process default) says which
packed positions this rank's feature rows are. Then ``features[l]`` are the LOCAL rows
(1, T_l, H), aligned with ``main.rows`` (padding rows included), while ``input_ids``,
``cu_seqlens``, ``loss_mask`` and the teacher rows/logits stay GLOBAL (every rank's rows): a
draft reads tokens and teacher rows at global positions and features at local ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from codraft.attention.context import MainAttention


def supervised_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """(R,) packed rows t whose next token is a prediction target (loss_mask[0, t+1]); host sync."""
    return loss_mask[0, 1:].nonzero()[:, 0]


@dataclass
class DraftBatch:
    input_ids: torch.Tensor                 # (1,T) long, packed
    cu_seqlens: torch.Tensor                # (n+1,) long, cu_seqlens[-1] <= T (tail is padding)
    loss_mask: torch.Tensor                 # (1,T) bool: token t is a prediction target
    features: dict[int, torch.Tensor]       # layer -> (1,T,H), detached
    teacher_logits: torch.Tensor            # (R,V), detached: the policy's logits at teacher_rows
    teacher_rows: torch.Tensor              # (R,) long, distinct packed rows ⊇ supervised_rows(loss_mask)
    main: MainAttention | None = None       # None: single process, features cover the whole row
    # None: teacher_logits span the whole vocabulary. Else (K,) the target tokens of its columns, which
    # then hold log-probabilities normalised over the whole vocabulary (for a draft vocabulary of K)
    teacher_tokens: torch.Tensor | None = None
    # None: a loss's random choices come from its generator. Else (n,) int64 one seed per sequence of
    # cu_seqlens (``codraft.train.seeding.sequence_seeds``), which ``uniforms`` draws from
    seeds: torch.Tensor | None = None

    def __post_init__(self):
        t = self.input_ids.shape[1]
        if self.input_ids.shape[0] != 1:
            raise ValueError(f"DraftBatch is one packed row; got input_ids of shape {tuple(self.input_ids.shape)}")
        for name, x in [("teacher_logits", self.teacher_logits), *((f"features[{l}]", f) for l, f in self.features.items())]:
            if x.requires_grad:
                raise ValueError(f"DraftBatch.{name} requires grad: draft inputs must be detached (stop-gradient)")
        if self.main is not None and self.main.length != t:
            raise ValueError(f"DraftBatch.main describes a packed row of {self.main.length} tokens, input_ids has {t}")
        t_l = t if self.main is None else len(self.main.rows)
        for l, f in self.features.items():
            if f.shape[:2] != (1, t_l):
                raise ValueError(f"DraftBatch.features[{l}] has shape {tuple(f.shape)}, expected (1, {t_l}, ...)"
                                 + ("" if self.main is None else " (the rows of DraftBatch.main)"))
        if self.loss_mask.shape != (1, t):
            raise ValueError(f"DraftBatch.loss_mask has shape {tuple(self.loss_mask.shape)}, expected (1, {t})")
        if self.teacher_rows.dim() != 1 or self.teacher_logits.dim() != 2 \
                or self.teacher_logits.shape[0] != self.teacher_rows.shape[0]:
            raise ValueError(f"DraftBatch.teacher_logits must be (R,V) and teacher_rows (R,); got "
                             f"{tuple(self.teacher_logits.shape)} and {tuple(self.teacher_rows.shape)}")
        if self.seeds is not None and self.seeds.shape != (self.cu_seqlens.shape[0] - 1,):
            raise ValueError(f"DraftBatch.seeds has shape {tuple(self.seeds.shape)}, expected one seed per "
                             f"sequence ({self.cu_seqlens.shape[0] - 1},)")
        if self.teacher_tokens is not None and self.teacher_tokens.shape != self.teacher_logits.shape[1:]:
            raise ValueError(f"DraftBatch.teacher_tokens {tuple(self.teacher_tokens.shape)} must name the "
                             f"{self.teacher_logits.shape[1]} columns of teacher_logits")

    def unbroken(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Whether packed positions lo..hi (inclusive, same shapes) hold no observation: a non-target token
        after a target of its sequence (multi-turn episodes: the environment's text between two turns). A
        draft never proposes across one (a turn ends before it), so no draft target chain spans one;
        single-turn sequences have none (their only non-targets, the prompt, come first)."""
        lm = self.loss_mask[0].long()
        cu = self.cu_seqlens.to(lm.device, torch.long)
        targets = lm.cumsum(0)
        seq = torch.searchsorted(cu[1:], torch.arange(lm.shape[0], device=lm.device), right=True)
        before = torch.cat([targets.new_zeros(1), targets])[cu[:-1].clamp(max=lm.shape[0])]  # targets before seq
        seen = targets - lm - torch.cat([before, before.new_zeros(1)])[seq] > 0  # a target earlier in the sequence
        breaks = torch.cat([lm.new_zeros(1), ((lm == 0) & seen).long().cumsum(0)])  # (T+1,) prefix counts
        t = lm.shape[0]
        return breaks[(hi + 1).clamp(0, t)] == breaks[lo.clamp(0, t)]

    def uniforms(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """(T,) uniforms in [0,1), one per packed position (the block drafts' anchor scores).

        With ``seeds``, sequence s draws its tokens' uniforms in order from a CPU generator seeded by
        seeds[s]: what a sequence draws depends on its seed alone, not on the row it is packed in, its
        micro-batch, the rank or the device. Padding past the last sequence gets 1. Without ``seeds``:
        ``torch.rand`` from ``generator`` (None: the global RNG)."""
        t = self.input_ids.shape[1]
        if self.seeds is None:
            dev = generator.device if generator is not None else self.device
            return torch.rand(t, generator=generator, device=dev).to(self.device)
        lens = self.cu_seqlens.diff().tolist()  # one host sync: training only
        parts = [torch.rand(n, generator=torch.Generator().manual_seed(int(s))) for n, s in zip(lens, self.seeds.tolist())]
        return torch.cat(parts + [torch.ones(t - sum(lens))]).to(self.device)

    @classmethod
    def from_full_logits(cls, input_ids, cu_seqlens, loss_mask, features, logits: torch.Tensor,
                         main: MainAttention | None = None) -> "DraftBatch":
        """Build from logits over the whole (global) row, (1,T,V): keeps only ``supervised_rows(loss_mask)``."""
        rows = supervised_rows(loss_mask)
        return cls(input_ids, cu_seqlens, loss_mask, features, logits[0, rows], rows, main)

    @property
    def context(self) -> MainAttention:
        """How the draft attends to the main row: ``main``, or the single-process default."""
        if self.main is not None:
            return self.main
        return MainAttention(self.cu_seqlens.to(self.device, torch.long), self.input_ids.shape[1])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def vocab_size(self) -> int:
        """The teacher's columns: the target's vocabulary, or the K of ``teacher_tokens``."""
        return self.teacher_logits.shape[-1]

    def teacher_at(self, rows: torch.Tensor) -> torch.Tensor:
        """Teacher logits at packed rows of any shape -> (*rows.shape, V); zeros at rows not held.

        Zeros are a placeholder: a draft reads rows outside ``teacher_rows`` only where its loss
        mask drops them.
        """
        t, r = self.input_ids.shape[1], self.teacher_rows.shape[0]
        if r == 0:
            return self.teacher_logits.new_zeros(*rows.shape, self.vocab_size)
        slot = torch.full((t,), -1, dtype=torch.long, device=rows.device)
        slot[self.teacher_rows.to(rows.device)] = torch.arange(r, device=rows.device)
        s = slot[rows]
        picked = self.teacher_logits[s.clamp_min(0)]
        return torch.where((s >= 0)[..., None], picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
