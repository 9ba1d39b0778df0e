"""One step's co-training objective, as the layout's step machinery runs it (``codraft.parallel.step``): the
step's rollouts and advantages, the policy and draft, and the loss's settings. The machinery decides how the
step is cut (one batch, micro-batches, pipeline stages) and which part a rank runs; this packs the parts and
computes L_RL(θ) + λ·L_draft(φ; x, sg(H_θ(x))) on them (``codraft.rl.cotrain``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from codraft.rl.cotrain import Row, cotrain_loss, draft_taps, loss_from_hidden, packed_row, replay_routes
from codraft.rl.microbatch import MicroBatch, merge_metrics, split_microbatches, with_draft_normaliser
from codraft.train.packing import Packed, pack


@dataclass
class CoTrainingLoss:
    """The loss of a (micro-)batch: the policy's forward and L_RL + λ·L_draft (``cotrain_loss``), or from the
    policy's last hidden states on the last pipeline stage (``loss_from_hidden``)."""
    policy: torch.nn.Module
    draft: torch.nn.Module | None
    loss_kw: dict            # cotrain_loss's settings (temperature, λ, clip range, precisions, draft_seed, ...)

    @property
    def taps(self) -> tuple[int, ...]:
        return draft_taps(self.draft, self.loss_kw["train_draft"]) or ()

    @property
    def policy_dtype(self) -> torch.dtype:
        return self.loss_kw["policy_dtype"]

    def row(self, batch: Packed, cp) -> Row:
        return packed_row(batch, cp)

    def loss(self, mb: MicroBatch, cp) -> tuple[torch.Tensor, dict]:
        return cotrain_loss(self.policy, self.draft, mb.batch, mb.advantages, cp=cp, totals=mb.totals,
                            replay=mb.replay, **self.loss_kw)

    def hidden_loss(self, mb: MicroBatch, row: Row, hidden: torch.Tensor, feats: dict) -> tuple[torch.Tensor, dict]:
        return loss_from_hidden(self.policy, self.draft, mb.batch, row, hidden, row.draft_features(feats),
                                mb.advantages, totals=mb.totals, **self.loss_kw)

    def merge(self, parts: list[dict], mbs: list[MicroBatch]) -> dict:
        return merge_metrics(parts, mbs)


@dataclass
class CoTraining(CoTrainingLoss):
    """One step's objective: its rollouts and advantages, cut as the step machinery asks."""
    prompts: list            # per sequence, group by group
    completions: list
    logprobs: list           # the rollout's, per completion token
    masks: list              # which completion tokens are the policy's (multi-turn: not the observations)
    routes: list | None      # routing replay: the experts each token went to in the rollout (None: off)
    advantages: torch.Tensor
    group_size: int
    device: str

    def whole(self) -> MicroBatch:
        """The step as one packed batch (normalised by its own totals)."""
        batch = pack(self.prompts, self.completions, self.logprobs, device=self.device, masks=self.masks)
        return MicroBatch(batch, self.advantages.to(self.device), None,
                          None if self.routes is None else replay_routes(batch, self.routes))

    def microbatches(self, n: int) -> list[MicroBatch]:
        """The step as ``n`` micro-batches of whole groups, with the step's draft normaliser when there are
        several (``codraft.rl.microbatch``)."""
        mbs = split_microbatches(self.prompts, self.completions, self.logprobs, self.advantages.to(self.device),
                                 self.group_size, n, self.device, self.masks, self.routes)
        if len(mbs) > 1 and self.loss_kw["train_draft"]:  # the draft's denominators: the whole step's
            mbs = with_draft_normaliser(mbs, self.draft, self.loss_kw["draft_seed"])
        return mbs
