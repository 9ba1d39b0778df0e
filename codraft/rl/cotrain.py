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
on short-completion workloads. ``codraft.train.packing.pack`` also lays the batch out with each
group's prompt packed once (``SharedPrompts``) and the policy runs on that layout: each
completion attends to its prompt plus itself, and the prompt's gradient sums over the group.
The RL loss reads rows through ``SharedPrompts.gather``. The drafts keep the per-sequence
layout (their losses pick anchors, positions and context per sequence): their taps are expanded
per sequence with the same gather, which copies detached features only and costs no policy
compute.

Context parallelism (``cp``): the same step on ``codraft.parallel.context.ShardedRow``, which
holds this rank's zigzag rows of the same layouts. The losses are written over full per-token
tensors (``assemble``) whose gradients reach the local entries only, so every rank computes the
same loss and metrics, and the ranks' summed gradients are the single-process gradient.
"""
from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from codraft.drafts.batch import DraftBatch
from codraft.models.bf16 import products
from codraft.models.layers import whole
from codraft.models.moe import Routing, load_balancing_loss
from codraft.parallel.comm import Group
from codraft.parallel import tp
from codraft.parallel.context import ShardedRow
from codraft.rl.grpo import entropy_from_logits, grpo_loss, token_logprobs
from codraft.train.packing import Packed
from codraft.train.seeding import sequence_seeds


class Row(Protocol):
    """One packed batch as this rank runs it: ``PackedRow`` (all of it) or, under context parallelism,
    ``codraft.parallel.context.ShardedRow`` (this rank's zigzag rows). The losses are written against this."""
    main: object  # the drafts' MainAttention (None: their default)

    def model_inputs(self) -> tuple[torch.Tensor, dict]:
        """The ids the policy runs on and the layout keywords of its forward / ``layer_inputs``."""

    def draft_features(self, feats: dict) -> dict:
        """Taps in the policy's layout -> detached, in the drafts' per-sequence layout."""

    def forward(self, model, taps: tuple[int, ...] | None) -> tuple[torch.Tensor, dict]:
        """The model's last-layer output on the policy's layout and its taps in the drafts'."""

    def select(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of the drafts' layout -> (their indices in this rank's hidden states, which of them are held
        here: None for all)."""

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """A tensor over the policy layout's tokens (along ``dim``) at the rows this rank runs."""

    def assemble(self, x: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """Values of the rows held here (``select``'s) -> over every row, differentiable at this rank's."""

    def mean(self, m: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's mean ``m`` of ``n`` values -> the mean over every rank's."""


class PackedRow:
    """The single-process ``Row``: the policy runs on the shared-prompt layout when there is one, every row
    is held here."""
    main = None  # the drafts' default MainAttention

    def __init__(self, batch: Packed):
        self.batch, self.sh = batch, batch.shared

    def model_inputs(self) -> tuple[torch.Tensor, dict]:
        if self.sh is None:
            return self.batch.input_ids, {"cu_seqlens": self.batch.cu_seqlens}
        return self.sh.input_ids, {"layout": self.sh.layout}

    def draft_features(self, feats: dict) -> dict:
        """Taps in the policy's layout -> detached, in the drafts' per-sequence layout (each prompt
        copied to its completions: copies of features only, no policy compute)."""
        if self.sh is None:
            return {l: f.detach() for l, f in feats.items()}
        return {l: f.detach()[:, self.sh.gather] for l, f in feats.items()}

    def forward(self, model, taps):
        ids, kw = self.model_inputs()
        out = model(ids, taps=taps, head=False, **kw)
        hidden, feats = out if taps is not None else (out, {})
        return whole(hidden), self.draft_features({l: whole(f) for l, f in feats.items()})

    def select(self, rows: torch.Tensor):
        return (rows if self.sh is None else self.sh.gather[rows]), None

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x

    def assemble(self, x: torch.Tensor, live) -> torch.Tensor:
        return x

    def mean(self, m: torch.Tensor, n: int) -> torch.Tensor:
        return m


def packed_row(batch: Packed, cp: Group | None) -> Row:
    """This rank's view of the batch: all of it, or its zigzag rows under context parallelism."""
    return ShardedRow(batch, cp) if cp is not None and cp.size > 1 else PackedRow(batch)


def replay_routes(batch: Packed, routes: list[torch.Tensor]) -> torch.Tensor:
    """The rollout's routes of each sequence (prompt + completion, MoE layers, k; −1: none) -> (MoE layers,
    tokens, k) in the layout the policy's forward runs on (``PackedRow``: a group's prompt once)."""
    flat = torch.cat(list(routes)).to(device=batch.input_ids.device, dtype=torch.long)  # (T, L, k)
    if flat.shape[0] != batch.input_ids.shape[1]:
        raise ValueError(f"routing replay: the rollout's routes cover {flat.shape[0]} tokens, the batch has "
                         f"{batch.input_ids.shape[1]}")
    if batch.shared is not None:  # a prompt's routes are its group's (one prefill)
        shared = flat.new_full((batch.shared.input_ids.shape[1], *flat.shape[1:]), -1)
        shared[batch.shared.gather] = flat
        flat = shared
    return flat.permute(1, 0, 2)


def draft_taps(draft, train_draft: bool = True) -> tuple[int, ...] | None:
    return tuple(draft.feature_layers) if (draft is not None and train_draft) else None


def cotrain_loss(policy, draft, batch: Packed, advantages: torch.Tensor, *, temperature: float, lam: float,
                 eps_low: float, eps_high: float, norm: str, kl_coef: float = 0.0, reference=None,
                 tis_cap: float | None = None, train_draft: bool = True, phase=None, cp: Group | None = None,
                 totals=None, policy_dtype: torch.dtype = torch.float32,
                 draft_dtype: torch.dtype = torch.float32, draft_seed: int | None = None,
                 replay: torch.Tensor | None = None, router_aux_coef: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Total loss and metrics for one packed batch (the caller runs backward and the optimisers).

    phase: optional timing hook, a callable returning a context manager (e.g. the trainer's
    ``PhaseTimer``); the draft's loss runs inside ``phase("draft_loss")``.
    cp: a context-parallel group of more than one rank: every rank calls this with the same batch,
    runs on its zigzag rows (``codraft.parallel.context.ShardedRow``) and gets the same loss
    value; the caller sums the gradients over the group (``sync_gradients``).
    totals: this batch as one micro-batch of a larger step (``codraft.rl.microbatch``).
    tis_cap: weigh each token's policy gradient by min(π_train/π_rollout, tis_cap) against the
    batch's rollout logprobs (truncated importance sampling, ``grpo.grpo_loss``); None = off.
    policy_dtype, draft_dtype: the products of the policy's forward (its LM head and the reference's
    included) and of the draft's loss, fp32 or bf16 (``codraft.models.bf16``; chosen by
    ``codraft.train.precision``); everything else stays fp32.
    draft_seed: the step's seed (``train.seeding.step_seed``): the draft loss draws each sequence's anchors
    from a seed of (draft_seed, the sequence's index in the step: ``totals.first`` + its index here;
    ``train.seeding.sequence_seeds``), the same at every layout. None: from the global RNG.
    replay: routing replay on a MoE policy (``replay_routes``): the experts its forward routes each token to,
    (MoE layers, tokens of the policy's layout, k).
    router_aux_coef: > 0 adds that times the routers' load-balancing loss (``moe.load_balancing_loss``) over the
    batch's tokens (a MoE policy, the one-batch step).
    """
    row = packed_row(batch, cp)
    replay = None if replay is None else row.local(replay)  # (CP: this rank's rows of it)
    routing = Routing(policy, replay, logits=router_aux_coef > 0) if replay is not None or router_aux_coef > 0 \
        else contextlib.nullcontext()
    with products(policy_dtype), routing:
        hidden, feats = row.forward(policy, draft_taps(draft, train_draft))
    loss, m = loss_from_hidden(policy, draft, batch, row, hidden, feats, advantages, temperature=temperature, lam=lam,
                               eps_low=eps_low, eps_high=eps_high, norm=norm, kl_coef=kl_coef, reference=reference,
                               tis_cap=tis_cap, train_draft=train_draft, phase=phase, totals=totals,
                               policy_dtype=policy_dtype, draft_dtype=draft_dtype, draft_seed=draft_seed)
    if router_aux_coef > 0:  # (the one-batch step only: a product of batch means does not split)
        aux = load_balancing_loss(routing.logits, policy.config.num_experts_per_tok)
        loss, m["policy/router_aux_loss"] = loss + router_aux_coef * aux, aux.detach()
    return loss, m


def loss_from_hidden(policy, draft, batch: Packed, row: Row, hidden: torch.Tensor, feats: dict,
                     advantages: torch.Tensor, *, temperature: float, lam: float, eps_low: float, eps_high: float,
                     norm: str, kl_coef: float = 0.0, reference=None, tis_cap: float | None = None,
                     train_draft: bool = True, phase=None, totals=None, policy_dtype: torch.dtype = torch.float32,
                     draft_dtype: torch.dtype = torch.float32, draft_seed: int | None = None
                     ) -> tuple[torch.Tensor, dict]:
    """The two losses from the policy's last-layer output ``hidden`` (row's layout) and the detached
    taps ``feats`` (drafts' layout): what the last pipeline stage runs (see ``cotrain_loss``).

    totals (``codraft.rl.microbatch.Totals``): the whole step's token and sequence counts, so the RL
    losses of the micro-batches add up to the step's, and its draft normaliser (``draft_normaliser``
    summed over the micro-batches) for the draft loss, or else this micro-batch's weight in it."""
    # logprob of token t comes from the logits at t-1. Only those rows (one per completion token,
    # ~30 % of the packed row) go through the LM head; they are also the draft's teacher rows.
    t = max(temperature, 1e-6)
    targets = batch.index[batch.index_mask]                    # (R,) packed positions of completion tokens
    rows = (targets - 1).clamp_min(0)                          # (R,)
    here, live = row.select(rows)                              # rows of hidden; which of the R are held here
    with products(policy_dtype):
        logits = policy.logits(hidden[0, here])                # (R_l,V)
    ids = batch.input_ids[0, targets]
    ids_here = ids if live is None else ids[live]
    logp = _unflatten(row.assemble(_logprobs(logits / t, ids_here), live), batch.index_mask)  # (N,L)
    ref_logp = None
    if reference is not None:
        with torch.no_grad(), products(policy_dtype):  # the policy's own arithmetic: the KL compares models only
            ref_hidden, _ = row.forward(reference, None)
            ref_logits = reference.logits(ref_hidden[0, here])
            ref_logp = _unflatten(row.assemble(token_logprobs(ref_logits / t, ids_here), live), batch.index_mask)
    rl_loss, m = grpo_loss(logp, logp.detach(), advantages, batch.index_mask, eps_low=eps_low, eps_high=eps_high,
                           norm=norm, ref_logprobs=ref_logp, kl_coef=kl_coef,
                           rollout_logprobs=batch.rollout_logprobs, is_correction=None if tis_cap is None else "token",
                           is_cap=tis_cap or 2.0,
                           global_tokens=None if totals is None else totals.tokens,
                           global_sequences=None if totals is None else totals.sequences)
    metrics = {f"policy/{k}": v for k, v in m.items()}
    if isinstance(row, ShardedRow):  # padding rows over real tokens, all ranks (zigzag pads to 2·cp)
        metrics["cp/padding_ratio"] = row.plan.padding_ratio
    with torch.no_grad():
        entropy = tp.mean_entropy(logits.detach() / t) if isinstance(logits, DTensor) else \
            entropy_from_logits(logits.detach()[None], torch.ones_like(ids_here)[None], temperature=t)
        metrics["policy/entropy"] = row.mean(entropy, ids_here.shape[0])
    loss = rl_loss
    if draft is not None and train_draft:
        db = DraftBatch(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, loss_mask=batch.completion,
                        features=feats, teacher_logits=row.assemble(whole(logits.detach()), live), teacher_rows=rows,
                        main=row.main, seeds=_draft_seeds(batch, draft_seed, 0 if totals is None else totals.first))
        norm = None if totals is None else totals.draft_norm  # the step's: this micro-batch's share of its loss
        with phase("draft_loss") if phase is not None else contextlib.nullcontext(), products(draft_dtype):
            draft_loss, dm = draft.loss(db) if norm is None else draft.loss(db, normaliser=norm)
        metrics.update({f"draft/{k}": v for k, v in dm.items()})
        metrics["draft/loss"] = draft_loss.detach()
        loss = loss + lam * (draft_loss if totals is None or norm is not None else totals.draft_weight * draft_loss)
    return loss, metrics


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each row's logprob of its id; from vocabulary-split logits (tensor parallelism) without gathering them."""
    return tp.token_logprobs(logits, ids) if isinstance(logits, DTensor) else token_logprobs(logits, ids)


def draft_normaliser(draft, batch: Packed, *, draft_seed: int | None, first: int = 0) -> torch.Tensor | None:
    """``draft.loss_normaliser`` of the draft batch ``loss_from_hidden`` builds from ``batch`` (its tokens,
    layout, teacher rows and seeds; ``first``: its first sequence's index in the step), before any
    forward: the batch holds no features and no teacher columns. Global (the same on every CP rank)."""
    rows = (batch.index[batch.index_mask] - 1).clamp_min(0)
    db = DraftBatch(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, loss_mask=batch.completion, features={},
                    teacher_logits=torch.zeros(rows.shape[0], 0, device=rows.device), teacher_rows=rows,
                    seeds=_draft_seeds(batch, draft_seed, first))
    return draft.loss_normaliser(db)


def _draft_seeds(batch: Packed, draft_seed: int | None, first: int) -> torch.Tensor | None:
    return None if draft_seed is None else sequence_seeds(draft_seed, first, batch.cu_seqlens.shape[0] - 1)


def _unflatten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(R,) values of the True entries of mask (N,L), row-major -> (N,L) with zeros elsewhere."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)
