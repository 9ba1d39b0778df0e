"""The interface every draft implements for decoding (``Draft``), as the rollout engine uses it.

Lifecycle of one ``Engine.generate`` call with a draft::

    state = draft.begin(tokens, lengths, features, max_len=...)    # after the target prefill
    loop:
        x, q = draft.propose(state, gamma, sampler, context_len=...)
        ... target verifies [last, x_1..x_γ] in one forward, the rule accepts n per row ...
        state = draft.commit(state, emitted, counts, features)
        state = draft.select(state, rows)                          # when rows finish

γ may change from round to round (``Engine(gamma="auto")``), anywhere in 1..the engine's
maximum (which may be below a block draft's block size). A round may also draft nothing
(γ = 0): then ``propose`` is not called, the target takes a plain step over the pending token
(still tapping ``feature_layers``) and ``commit`` gets that one token (width 1, counts 1).

Context invariant. A row's *context* is its prompt followed by every token emitted so far.
The target has run over every context token except the last one (the pending token, fed
at the start of the next verify forward), so target features exist for context positions
0..len-2. Both ``begin`` and ``commit`` hand the draft exactly those features:

  * ``begin(tokens (B,T), lengths (B,), features {layer: (B,T-1 or more,H)})``: tokens are
    the right-padded contexts (prompt + the first token sampled from the prefill logits),
    lengths their true lengths (>= 2); features[l][b, t] is target layer l's output at
    position t for t < lengths[b] - 1 (entries beyond are padding junk).
  * ``commit(state, tokens (B,γ+1), counts (B,), features {layer: (B,γ+1,H)})``: row b's
    context grew by tokens[b, :counts[b]] (accepted drafts then the correction/bonus token;
    counts = n_accepted + 1 >= 1); features[l][b, j] for j < counts[b] are the target's at
    the previous pending token (j = 0) and the accepted drafts, i.e. at the token *before*
    each appended one. Entries past counts[b] are junk. Rows that stop at EOS or
    max_new_tokens may be committed too and are dropped by ``select`` right after.

EAGLE-3 reads (h_t, emb(x_{t+1})) pairs and DFlash/DSpark read the context features plus the
pending token as the block anchor: both fit this invariant (``feature_layers`` lists which
target layer outputs to tap, 0-based; the engine taps them in the prefill and in every
verify forward, and passes ``{}`` when the tuple is empty).

``propose(state, gamma, sampler, *, context_len)`` returns
  * tokens (B,γ) long: x_1..x_γ continuing each row's context;
  * q (B,γ,V) float: the row q_k each x_k was *really* drawn from (after the sampler's
    temperature/top-k/top-p transform: use ``sampler.probs(logits)`` and
    ``sampler.sample(probs)``), or None when the proposal is deterministic (q_k one-hot at
    x_k). Under greedy decoding (``sampler.greedy``) q is ignored and may be None.
  ``context_len`` is a host-side upper bound of the longest context, so a draft can size its
  attention reads without a device sync. propose may mutate state (speculative cache
  writes): commit must leave it consistent with the context invariant again.

Drafts must not sync the host with the device in propose/commit (no .item(), .tolist(),
boolean-mask indexing): the engine does one sync per round. ``vocab_size`` must equal the
target's (the engine checks). ``default_gamma`` is used when the engine gets gamma=None.

Training and checkpoints, the same for every kind:
  * ``loss(batch: DraftBatch) -> (loss, metrics)``: the draft's training loss on one packed
    batch of detached target features (offline training and co-training call the same loss);
  * ``save(path)`` writes a folder with ``config.json`` whose ``architectures[0]`` is one of the
    class's ``architectures``; ``Kind.load(path, target_config, *, gamma=None, **options)``
    reads it back, checking it fits the target;
  * ``bind_target(embed_weight, head_weight)``: kinds that share the target's (frozen) token
    embedding / LM head keep references to them; the others ignore it;
  * ``trainable_parameters()``: what an optimiser steps (empty for kinds with no weights).

To add a draft kind: subclass ``Draft`` (also ``torch.nn.Module`` if it has weights; the
engine moves modules to the target's device), implement the methods above, and add one row
to ``KINDS`` in ``codraft/drafts/registry.py``.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from codraft.drafts.batch import DraftBatch
from codraft.models.config import ModelConfig
from codraft.spec.sampling import Sampler

Features = dict[int, torch.Tensor]  # target layer id -> (B,T,H) output of that decoder layer


class Draft(ABC):
    vocab_size: int
    feature_layers: tuple[int, ...] = ()
    default_gamma: int = 4
    architectures: tuple[str, ...] = ()  # config.json "architectures" names this kind saves and loads
    # whether ``loss`` reads ``batch.teacher_logits``: offline training computes them (the target's whole
    # LM head over every supervised row, a step's dearest product) only for kinds that do
    reads_teacher: bool = True
    # parameter-name prefixes whose matrices a weight-only rollout copy narrows (``RolloutWeights``:
    # the products its decode streams, in C where it runs there); () keeps the draft's own weights
    rollout_narrowed: tuple[str, ...] = ()

    def teacher_columns(self) -> torch.Tensor | None:
        """The target tokens whose teacher log-probabilities ``loss`` reads where that is a subset of the
        vocabulary (offline batches then carry only those columns: ``DraftBatch.teacher_tokens``); None:
        the logits over the whole vocabulary."""
        return None

    # ---- training and checkpoints ----------------------------------------------------------

    @abstractmethod
    def loss(self, batch: DraftBatch, *, normaliser: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Training loss on one packed batch of detached target features, and detached metrics.

        normaliser: the whole step's denominators, the sum of ``loss_normaliser`` over the step's
        micro-batches: the loss and metrics are then this batch's numerators over the step's, so the
        micro-batches' losses, gradients and metrics add up to the one-batch step's. None: this batch's."""

    def loss_normaliser(self, batch: DraftBatch) -> torch.Tensor | None:
        """(k,) the denominators ``loss(batch)`` divides by (target counts, sums of position weights),
        from the batch's tokens, layout and seeds alone: ``features`` and the teacher may be empty. Global
        under context parallelism; summed over micro-batches it is the step's. None: it needs more (the
        teacher, or random choices that are not seeded), so the step cannot be split exactly."""
        return None

    @abstractmethod
    def save(self, path: str | os.PathLike) -> Path:
        """Write the draft (not the target's shared tensors) to the folder ``path``, atomically."""

    @classmethod
    @abstractmethod
    def load(cls, path: str | os.PathLike, target_config: ModelConfig, *, gamma: int | None = None,
             **options) -> "Draft":
        """A draft saved by ``save``, checked against the target; ``gamma`` overrides its default."""

    def bind_target(self, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> "Draft":
        """Share the target's token embedding and LM head (V,H); kinds that do not share ignore this."""
        return self

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        if not isinstance(self, torch.nn.Module):
            return []
        return [p for p in self.parameters() if p.requires_grad]

    # ---- decoding ----------------------------------------------------------------------------

    @abstractmethod
    def begin(self, tokens: torch.Tensor, lengths: torch.Tensor, features: Features, *, max_len: int) -> Any:
        """Start a batch: tokens (B,T) right-padded contexts, lengths (B,); returns the draft's state.

        max_len: positions any per-row buffer needs (longest context + γ + 1 spare slots).
        """

    @abstractmethod
    def propose(self, state: Any, gamma: int, sampler: Sampler, *,
                context_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (tokens (B,γ) long, q (B,γ,V) float or None for one-hot)."""

    @abstractmethod
    def commit(self, state: Any, tokens: torch.Tensor, counts: torch.Tensor, features: Features) -> Any:
        """Append tokens[b, :counts[b]] to row b's context; returns the updated state."""

    @abstractmethod
    def select(self, state: Any, rows: torch.Tensor) -> Any:
        """Keep only ``rows`` (long tensor of batch indices, in order); returns the new state."""

    # ---- rows that leave the batch and come back (multi-turn episodes) ----------------------

    def take(self, state: Any, rows: torch.Tensor) -> Any:
        """A new state holding copies of ``rows``; ``state`` stays valid and unchanged."""
        raise NotImplementedError(f"the {type(self).__name__} draft cannot continue rows across turns")

    def join(self, states: list) -> Any:
        """One state: the rows of ``states`` in order (states of one batch: one ``begin``'s buffers sizes)."""
        raise NotImplementedError(f"the {type(self).__name__} draft cannot continue rows across turns")

    def extend(self, state: Any, tokens: torch.Tensor, counts: torch.Tensor, features: Features) -> Any:
        """Append tokens the draft did not propose (an observation, then the target's next token): as
        ``commit`` for drafts whose commit does not rely on a proposal having run."""
        return self.commit(state, tokens, counts, features)
