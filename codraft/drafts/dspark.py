"""DSpark: the DFlash backbone with every slot a prediction, a Markov head and a confidence head.

Notes section 3. Backbone and data flow: block_backbone.py. Differences from DFlash:

* Slot k = 0..S−1 of the block [x_a, MASK×(S−1)] predicts x_{a+k+1}: S inputs → S drafts,
  all slots supervised. gamma ↔ block size: ``gamma = block_size`` (``default_gamma``; build
  with ``gamma=γ`` for block_size = γ). ``propose(gamma)`` runs max(block_size, gamma) slots
  and uses the first gamma.
* Markov head over the base logits U_k = h_k·W_headᵀ, conditioned on the previous token
  (x_{k−1}, with x_0 = the anchor / pending token), e = W1[x_{k−1}] (rank r):
      vanilla:  z_k = U_k + W2·e
      gated:    z_k = U_k + W2·(σ(Wg·[h_k; e]) ⊙ e)
  p_d,k = softmax(z_k). W2 starts at zero, so a fresh head is exactly DFlash-style base logits.
* Confidence head c_k = σ(wᵀ[h_k; e] + b), trained toward the slot's acceptance probability.

Training (teacher forcing: previous tokens are the ground truth x_a, x_{a+1}, …):
    p_t,k  = softmax(teacher logits of row a+k)       the target's distribution over x_{a+k+1}
    CE_k   = −log p_d,k(x_{a+k+1})
    L1_k   = ‖p_d,k − p_t,k‖₁                          (= 2·TV, as DeepSpec's "TV" term)
    c*_k   = clamp(1 − ½·L1_k, 0, 1), detached          (the acceptance prob. Σ min(p_d, p_t))
    BCE_k  = BCEWithLogits(conf_logit_k, c*_k)
    L = ce_weight·Σ w m CE/Σ w m + tv_weight·Σ w m L1/Σ w m + conf_weight·Σ w m BCE/Σ w m,
    w_k = exp(−k/decay) (k = 0..S−1), m_{n,k} = a+k+1 inside the sequence and a loss token;
    default weights 0.1 / 0.9 / 1.0, decay 4.0 (DeepSpec's configs). With a draft vocabulary of K
  tokens (block_vocab.py) p_d,k lives on those K, W2 has K outputs and W1 K + 1 rows (the last for
  a previous token outside the vocabulary), labels outside it get no loss, and L1 is taken against
  the teacher over the whole vocabulary (its mass outside the K tokens counts in full). CE and L1
  with their gradient in one function: slot_loss.py.
  Metrics: loss, ce, tv (mean L1), conf, acc, acc_j (draft position j = slot j−1), alpha_j (mean c*),
  tau_est = mean over blocks of 1 + Σ_k Π_{j≤k} c*_j (expected acceptance length against the
  teacher at temperature 1, cut at the first unsupervised slot), num_blocks.

Decoding: one block forward, then left to right through the Markov head:
x_1 ~ T(z_1 | x_0 = pending), x_2 ~ T(z_2 | x_1), …, where T is the sampler's transform
(temperature/top-k/top-p), and the q_k returned for slot k is exactly T(z_k) given the token
actually drawn at k−1, so the engine's acceptance rule stays exact (notes 4: block drafts).
The loop is over γ slots (small), all batched, no host syncs. Not here: the confidence-driven
prefix scheduler and temperature calibration (the confidence head is trained, not used).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from codraft.drafts.batch import DraftBatch
from codraft.drafts.block_backbone import (
    BlockDraftBase, BlockDraftConfig, BlockDraftState, check_target, config_from_dict, decay_weights,
    make_config, read_saved,
)
from codraft.drafts.dflash import _block_size
from codraft.drafts.slot_loss import slot_losses
from codraft.models.config import ModelConfig
from codraft.models.layers import linear
from codraft.spec.sampling import Sampler

MARKOV_KINDS = ("vanilla", "gated")


class MarkovHead(nn.Module):
    """Low-rank transition bias B(h_k, x_{k−1}) (…,K) added to the base logits: ``inputs`` previous
    tokens (the draft's vocabulary, plus one row for every token outside it), ``outputs`` logits."""

    def __init__(self, inputs: int, outputs: int, hidden_size: int, rank: int, kind: str):
        super().__init__()
        if kind not in MARKOV_KINDS:
            raise ValueError(f"markov must be one of {MARKOV_KINDS}, got {kind!r}")
        if rank < 1:
            raise ValueError(f"markov_rank must be >= 1, got {rank}")
        self.kind = kind
        self.w1 = nn.Embedding(inputs, rank)
        self.w2 = nn.Linear(rank, outputs, bias=False)
        self.gate = nn.Linear(hidden_size + rank, rank) if kind == "gated" else None
        nn.init.normal_(self.w1.weight, std=1.0)
        nn.init.zeros_(self.w2.weight)
        if self.gate is not None:
            nn.init.normal_(self.gate.weight, std=0.02)
            nn.init.zeros_(self.gate.bias)

    # x @ wᵀ for the transition bias; codraft.kernels.enable sets the measured fastest one on CPU
    product = staticmethod(linear)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """h (…,H) slot hidden, e = W1[x_{k−1}] (…,r) -> bias (…,V) float32."""
        z = e if self.gate is None else torch.sigmoid(self.gate(torch.cat([h, e], -1))) * e
        return self.product(z, self.w2.weight).float()


class DSparkDraft(BlockDraftBase):
    architectures = ("DSparkDraftModel",)

    def __init__(self, config: BlockDraftConfig, *, markov: str = "vanilla", markov_rank: int = 32,
                 ce_weight: float = 0.1, tv_weight: float = 0.9, conf_weight: float = 1.0):
        super().__init__(config)
        self.default_gamma = config.block_size
        self.markov_kind, self.markov_rank = markov, markov_rank
        self.ce_weight, self.tv_weight, self.conf_weight = ce_weight, tv_weight, conf_weight
        k = self.out_vocab
        self.markov_head = MarkovHead(k + 1 if config.draft_vocab_size else k, k, config.hidden_size, markov_rank,
                                      markov)
        self.confidence_head = nn.Linear(config.hidden_size + markov_rank, 1)
        nn.init.normal_(self.confidence_head.weight, std=0.02)
        nn.init.zeros_(self.confidence_head.bias)

    def markov_input(self, prev: torch.Tensor) -> torch.Tensor:
        """Previous target tokens -> rows of W1: their draft index, or the last row (K) outside it."""
        if self.draft_vocab is None:
            return prev
        d = self.to_draft(prev)
        return torch.where(d >= 0, d, self.config.draft_vocab_size)

    def slot_logits(self, h: torch.Tensor, prev: torch.Tensor):
        """h (…,H) final-normed slot hidden, prev (…) previous target tokens -> (z = U + B (…,K) float,
        e (…,r))."""
        e = self.markov_head.w1(self.markov_input(prev))
        return self.logits(h) + self.markov_head(h, e), e

    # ---- training ----

    def loss(self, batch: DraftBatch, *, generator: torch.Generator | None = None,
             normaliser: torch.Tensor | None = None):
        """-> (scalar loss, metrics {name: detached 0-dim tensor}); see the module docstring.

        normaliser: the step's ``loss_normaliser`` (``Draft.loss``); None: this batch's.
        Context parallelism (``batch.main``): every rank returns the global loss and metrics, the
        gradient flowing through the blocks it holds. Collective calls, the same on every rank:
        ``branch`` × num_hidden_layers (``block_hidden``), then one ``total`` of a (5S+1,) vector;
        none when the row has no valid anchor at all.
        """
        s = self.config.block_size
        blocks = self.sample_anchors(batch, label_offset=1, generator=generator)  # global: same on every rank
        n = blocks.anchors.shape[0]
        if n == 0:
            z = self.zero_loss()
            return z, {"loss": z.detach(), "acc": z.detach(), "num_blocks": z.detach()}
        dev = batch.device
        src, labels, m = self._targets(batch, blocks)  # every block's (global), then the blocks this rank runs
        prev = batch.input_ids[0, src]  # (N,S) x_{a+k}
        count = m.sum(0) if normaliser is None else normaliser[:s].to(dev)  # (S,) global
        step_blocks = None if normaliser is None else normaliser[s].to(dev)
        held = self.held_blocks(batch, blocks)
        sel = held[0]
        h = self.block_hidden(batch, blocks, s, held)[0]  # (N_l,S,H)
        teacher = self._teacher(batch)

        def slot_sums(h_c, labels_c, prev_c, src_c, m_c):
            z, e = self.slot_logits(h_c, prev_c)  # (n,S,K), (n,S,r)
            # (n,S) each; rows outside m_c: placeholders
            ce, l1 = slot_losses(z, labels_c, teacher.teacher_at(src_c), outside=self.draft_vocab is not None)
            c_star = (1 - 0.5 * l1).clamp(0, 1).detach()
            conf = self.confidence_head(torch.cat([h_c, e.to(h_c.dtype)], -1))[..., 0].float()
            bce = F.binary_cross_entropy_with_logits(conf, c_star, reduction="none")
            hit = (z.argmax(-1) == labels_c).float()
            alpha = c_star * m_c
            tau = alpha.cumprod(1).sum()  # Σ_blocks Σ_k Π_{j≤k} α_j
            return ((ce * m_c).sum(0), (l1 * m_c).sum(0), (bce * m_c).sum(0), (hit * m_c).sum(0).detach(),
                    alpha.sum(0).detach(), tau.detach())

        sums = self.chunked(slot_sums, sel.shape[0], h, labels[sel], prev[sel], src[sel], m[sel],
                            kept_per_block=8 * s * self.out_vocab)  # slot_losses keeps q and sign(q − p)
        sums = batch.context.total(torch.cat([*sums[:5], sums[5][None]]))  # over ranks
        ce_s, l1_s, bce_s, hit_s, alpha_s, tau_s = (*sums[:5 * s].split(s), sums[5 * s])
        w = decay_weights(s, self.config.loss_decay, 0, dev)
        denom = (w * count).sum().clamp_min(1e-9)
        ce, tv, conf = ((w * x).sum() / denom for x in (ce_s, l1_s, bce_s))
        loss = self.ce_weight * ce + self.tv_weight * tv + self.conf_weight * conf
        metrics = {"loss": loss.detach(), "ce": ce.detach(), "tv": tv.detach(), "conf": conf.detach(),
                   "acc": ((w * hit_s).sum() / denom).detach(),
                   # with the step's normaliser: this batch's share of the step's 1 + Σ tau / Σ n
                   "tau_est": 1 + tau_s.detach() / n if normaliser is None else (n + tau_s.detach()) / step_blocks,
                   "num_blocks": torch.tensor(float(n))}
        for k in range(s):
            metrics[f"acc_{k + 1}"] = hit_s[k].detach() / count[k].clamp_min(1)
            metrics[f"alpha_{k + 1}"] = alpha_s[k].detach() / count[k].clamp_min(1)
        return loss, metrics

    def _targets(self, batch: DraftBatch, blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(src (N,S) a+k: the previous token's and the teacher's row, labels (N,S) x_{a+k+1} in the draft's
        vocabulary, m (N,S) float: x_{a+k+1} is a loss token of a's sequence) of every block."""
        s, t = self.config.block_size, batch.input_ids.shape[1]
        src = blocks.anchors[:, None] + torch.arange(s, device=batch.device)
        in_seq = src + 1 < blocks.seq_end[:, None]
        src = src.clamp(max=t - 1)
        lab_pos = (src + 1).clamp(max=t - 1)
        labels, in_vocab = self.vocab_labels(batch.input_ids[0, lab_pos])
        unbroken = batch.unbroken(blocks.anchors[:, None], lab_pos)  # (no observation inside the chain)
        return src, labels, (in_seq & batch.loss_mask[0, lab_pos] & in_vocab & unbroken).float()

    def loss_normaliser(self, batch: DraftBatch) -> torch.Tensor | None:
        """(S+1,) the supervised slots k of the batch's blocks (the loss divides by Σ_k w_k·count_k, acc_k
        and alpha_k by count_k), then its blocks (tau_est's); None without per-sequence seeds."""
        if batch.seeds is None:
            return None
        m = self._targets(batch, self.sample_anchors(batch, label_offset=1))[2]
        return torch.cat([m.sum(0), m.new_full((1,), float(m.shape[0]))])

    def teacher_columns(self) -> torch.Tensor | None:
        return self.draft_vocab

    def _teacher(self, batch: DraftBatch) -> DraftBatch:
        """The batch whose teacher rows the loss reads: the teacher's log-probabilities (normalised over
        the whole vocabulary, once per teacher row, not per slot) of the draft's K tokens, or of all; a
        batch that holds them already (``teacher_tokens``) as is."""
        if batch.teacher_tokens is not None:
            if self.draft_vocab is None or not torch.equal(batch.teacher_tokens.to(self.draft_vocab.device),
                                                           self.draft_vocab):
                raise ValueError("the batch's teacher holds the log-probabilities of other tokens than this "
                                 f"draft's vocabulary ({len(batch.teacher_tokens)} tokens, the draft "
                                 f"{self.out_vocab})")
            return batch
        t = batch.teacher_logits.float()
        # logsumexp 64 rows at a time: its (rows x V) temporaries stay in cache (whole: ~5x slower on CPU)
        lse = torch.cat([t[i:i + 64].logsumexp(-1, keepdim=True) for i in range(0, t.shape[0], 64)] or [t[:, :1]])
        kept = t if self.draft_vocab is None else t.index_select(-1, self.draft_vocab)
        return dataclasses.replace(batch, teacher_logits=kept - lse)

    # ---- decoding ----

    # (base (B,γ,K), prev (B,), W1, W2, sampler) -> (tokens, q) of the vanilla head's loop below, or None:
    # run it here. codraft.kernels.enable sets one that runs it in one C call
    fused_markov = None

    @torch.no_grad()
    def propose(self, state: BlockDraftState, gamma: int, sampler: Sampler, *, context_len: int):
        slots = max(self.config.block_size, gamma)
        h = self.decode_hidden(state, slots, context_len)[:, :gamma]  # (B,γ,H)
        base = self.logits(h)  # (B,γ,K) U_k
        prev = self.markov_input(state.pending)  # x_0, as a row of W1
        head = self.markov_head
        done = None if self.fused_markov is None or head.gate is not None else \
            self.fused_markov(base, prev, head.w1.weight, head.w2.weight, sampler)
        if done is not None:
            tokens, q = done
            return self.to_target(tokens), (None if q is None else self.full_probs(q))
        tokens, qs = [], []
        for k in range(gamma):
            e = self.markov_head.w1(prev)  # (B,r)
            z = base[:, k] + self.markov_head(h[:, k], e)  # (B,K) Markov-corrected logits
            if sampler.greedy:
                prev = z.argmax(-1)  # (a draft index: the row of W1 too)
            else:
                q = sampler.probs(z)  # exactly the row x_k is drawn from
                prev = sampler.sample(q)
                qs.append(q)
            tokens.append(prev)
        return self.to_target(torch.stack(tokens, 1)), (self.full_probs(torch.stack(qs, 1)) if qs else None)

    # ---- save / load ----

    def extra_config(self) -> dict:
        return {"dspark_config": {"mask_token_id": self.config.mask_token_id,
                                  "target_layer_ids": list(self.config.target_layer_ids),
                                  "learned_mask_embedding": self.config.mask_token_id is None,
                                  "markov": self.markov_kind, "markov_rank": self.markov_rank,
                                  "confidence_head": True, "ce_weight": self.ce_weight,
                                  "tv_weight": self.tv_weight, "conf_weight": self.conf_weight}}

    @classmethod
    def load(cls, path: str | os.PathLike, target_config: ModelConfig | None = None, *, gamma: int | None = None,
             num_anchors: int | None = None) -> "DSparkDraft":
        """A draft saved by ``save`` (``num_anchors``: change the loss's blocks per sequence); bind before use."""
        d, state = read_saved(path, cls.architectures[0])
        ds = d.get("dspark_config", {})
        draft = cls(config_from_dict(d, num_anchors), markov=ds.get("markov", "vanilla"), markov_rank=ds["markov_rank"],
                    ce_weight=ds.get("ce_weight", 0.1), tv_weight=ds.get("tv_weight", 0.9),
                    conf_weight=ds.get("conf_weight", 1.0))
        check_target(draft.config, target_config, path)
        draft.load_state_dict(state)
        if gamma is not None:
            draft.default_gamma = gamma
        return draft


def default_markov_rank(hidden_size: int) -> int:
    """Small for tiny targets (32 at H ≤ 256), 256 at H ≥ 2048 (DeepSpec's Qwen3-8B setting)."""
    return min(256, max(32, hidden_size // 8))


def build(target_config: ModelConfig, *, num_layers: int = 1, block_size: int | None = None,
          gamma: int | None = None, layers=None, mask_token_id: int | None = None,
          markov: str = "vanilla", markov_rank: int | None = None, decay: float = 4.0,
          ce_weight: float = 0.1, tv_weight: float = 0.9, conf_weight: float = 1.0,
          num_anchors: int = 128, loss_chunk_blocks: int = 256, draft_vocab_size: int = 0,
          weights: str | os.PathLike | None = None, **overrides) -> DSparkDraft:
    """A DSpark draft for ``target_config`` (random init, or ``weights`` = a folder written by ``save``).

    block_size: S (default 7) = drafted tokens per round; ``gamma`` is a synonym (block_size = gamma).
    markov: "vanilla" | "gated"; markov_rank: r (default ``default_markov_rank(H)``).
    Other options as ``dflash.build``. Bind the target with ``draft.bind_target(embed, head)``.
    """
    if weights is not None:
        return DSparkDraft.load(weights, target_config, gamma=gamma, num_anchors=num_anchors)
    block_size = _block_size(block_size, gamma, offset=0)
    cfg = make_config(target_config, num_layers=num_layers, block_size=block_size, layers=layers,
                      mask_token_id=mask_token_id, decay=decay, num_anchors=num_anchors,
                      loss_chunk_blocks=loss_chunk_blocks, overrides=overrides,
                      draft_vocab_size=draft_vocab_size)
    rank = default_markov_rank(target_config.hidden_size) if markov_rank is None else markov_rank
    return DSparkDraft(cfg, markov=markov, markov_rank=rank, ce_weight=ce_weight, tv_weight=tv_weight,
                       conf_weight=conf_weight)
