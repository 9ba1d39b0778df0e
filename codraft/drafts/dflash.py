"""DFlash: a block draft that predicts γ−1 tokens in one parallel forward (notes section 2).

Backbone and data flow: block_backbone.py. The block of size S = ``block_size`` is
[x_anchor, MASK×(S−1)]; slot k ≥ 1 predicts x_{anchor+k}, slot 0 (the anchor itself) is
not a prediction. So a block of size S drafts S − 1 tokens.

gamma ↔ block size. The engine's ``gamma`` is the number of drafted tokens:
``gamma = block_size − 1`` (``default_gamma``; build with ``gamma=γ`` to get block_size = γ+1).
``propose(gamma)`` runs a block of max(block_size, gamma + 1) slots and returns slots
1..gamma: asking for fewer drafts than trained truncates a full trained block (each slot still
sees the S−1 MASK slots it was trained with); asking for more extends the block past what
was trained (still lossless, just lower acceptance).

Training (``loss``), per packed row of a ``DraftBatch``:
  * anchors: up to ``num_anchors`` random a per sequence with loss_mask[a] and loss_mask[a+1]
    in the same sequence (``sample_anchors``: from the batch's per-sequence seeds, else redrawn every call);
  * context of block n: target features at positions < a_n of the same sequence;
  * labels: slot k ≥ 1 predicts x_{a+k}; masked (m = 0) where a+k is past the sequence end or
    loss_mask[a+k] is 0;
  * L = Σ_{n,k} w_k·m_{n,k}·CE_{n,k} / Σ_{n,k} w_k·m_{n,k},  w_k = exp(−(k−1)/decay), k ≥ 1,
    CE_{n,k} = −log softmax(h_{n,k} W_headᵀ)[x_{a_n+k}].
  Metrics: loss, acc (weighted over all supervised slots), acc_j = top-1 accuracy of draft
  position j = slot j, num_blocks.

Decoding: one block forward per round over the cached context (no loop over slots);
q_k = sampler.probs(logits of slot k), x_k = sampler.sample(q_k), all slots at once.
"""
from __future__ import annotations

import os

import torch

from codraft.drafts.batch import DraftBatch
from codraft.drafts.block_backbone import (
    BlockDraftBase, BlockDraftConfig, BlockDraftState, check_target, config_from_dict, decay_weights,
    make_config, read_saved,
)
from codraft.models.config import ModelConfig
from codraft.spec.sampling import Sampler


class DFlashDraft(BlockDraftBase):
    architectures = ("DFlashDraftModel",)

    reads_teacher = False  # trained on the sampled tokens (CE), not on the teacher's distribution

    def __init__(self, config: BlockDraftConfig):
        super().__init__(config)
        self.default_gamma = config.block_size - 1

    # ---- training ----

    def loss(self, batch: DraftBatch, *, generator: torch.Generator | None = None,
             normaliser: torch.Tensor | None = None):
        """-> (scalar loss, metrics {name: detached 0-dim tensor}); see the module docstring.

        normaliser: the step's ``loss_normaliser`` (``Draft.loss``); None: this batch's.
        Context parallelism (``batch.main``): every rank returns the global loss and metrics, the
        gradient flowing through the blocks it holds. Collective calls, the same on every rank:
        ``branch`` × num_hidden_layers (``block_hidden``), then one ``total`` of a (2S,) vector;
        none when the row has no valid anchor at all.
        """
        s = self.config.block_size
        blocks = self.sample_anchors(batch, label_offset=1, generator=generator)  # global: same on every rank
        n = blocks.anchors.shape[0]
        if n == 0:
            z = self.zero_loss()
            return z, {"loss": z.detach(), "acc": z.detach(), "num_blocks": z.detach()}
        dev = batch.device
        labels, m = self._targets(batch, blocks)  # every block's (global), then the blocks this rank runs
        count = m.sum(0) if normaliser is None else normaliser.to(dev)  # (S,) global
        held = self.held_blocks(batch, blocks)
        sel = held[0]
        h = self.block_hidden(batch, blocks, s, held)[0]  # (N_l,S,H)

        def slot_sums(h_c, labels_c, m_c):
            logits = self.logits(h_c)  # (n,S,K) float32
            ce = torch.logsumexp(logits, -1) - logits.gather(-1, labels_c[..., None])[..., 0]  # (n,S)
            hit = (logits.argmax(-1) == labels_c).float()
            return (ce * m_c).sum(0), (hit * m_c).sum(0).detach()  # (S,), (S,)

        ce_sum, hit_sum = self.chunked(slot_sums, sel.shape[0], h, labels[sel], m[sel],
                                       kept_per_block=4 * s * self.out_vocab)  # logsumexp keeps the fp32 logits
        ce_sum, hit_sum = batch.context.total(torch.cat([ce_sum, hit_sum])).split(s)  # over ranks
        w = decay_weights(s, self.config.loss_decay, 1, dev)  # (S,) w_0 = 0
        denom = (w * count).sum().clamp_min(1e-9)
        loss = (w * ce_sum).sum() / denom
        metrics = {"loss": loss.detach(), "acc": ((w * hit_sum).sum() / denom).detach(),
                   "num_blocks": torch.tensor(float(n))}
        acc = hit_sum.detach() / count.clamp_min(1)
        for k in range(1, s):
            metrics[f"acc_{k}"] = acc[k]
        return loss, metrics

    def _targets(self, batch: DraftBatch, blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels (N,S) in the draft's vocabulary, m (N,S) float: slot k ≥ 1 predicts a loss token
        x_{a+k} of a's sequence) of every block."""
        s, t = self.config.block_size, batch.input_ids.shape[1]
        lab_pos = blocks.anchors[:, None] + torch.arange(s, device=batch.device)  # (N,S): slot k -> a+k
        in_seq = lab_pos < blocks.seq_end[:, None]
        lab_pos = lab_pos.clamp(max=t - 1)
        labels, in_vocab = self.vocab_labels(batch.input_ids[0, lab_pos])
        m = in_seq & batch.loss_mask[0, lab_pos] & in_vocab & batch.unbroken(blocks.anchors[:, None], lab_pos)
        m[:, 0] = False  # slot 0 is the anchor, not a prediction
        return labels, m.float()

    def loss_normaliser(self, batch: DraftBatch) -> torch.Tensor | None:
        """(S,) the supervised slots k of the batch's blocks (the loss divides by Σ_k w_k·count_k, acc_k by
        count_k); None without per-sequence seeds (the loss then draws other anchors)."""
        if batch.seeds is None:
            return None
        return self._targets(batch, self.sample_anchors(batch, label_offset=1))[1].sum(0)

    # ---- decoding ----

    @torch.no_grad()
    def propose(self, state: BlockDraftState, gamma: int, sampler: Sampler, *, context_len: int):
        slots = max(self.config.block_size, gamma + 1)
        h = self.decode_hidden(state, slots, context_len)[:, 1:gamma + 1]  # (B,γ,H) slots 1..γ
        logits = self.logits(h)  # (B,γ,K)
        if sampler.greedy:
            return self.to_target(logits.argmax(-1)), None
        q = sampler.probs(logits)  # (B,γ,K): the rows x_k is drawn from
        return self.to_target(sampler.sample(q)), self.full_probs(q)

    # ---- save / load ----

    def extra_config(self) -> dict:
        return {"dflash_config": {"mask_token_id": self.config.mask_token_id,
                                  "target_layer_ids": list(self.config.target_layer_ids),
                                  "learned_mask_embedding": self.config.mask_token_id is None}}

    @classmethod
    def load(cls, path: str | os.PathLike, target_config: ModelConfig | None = None, *, gamma: int | None = None,
             num_anchors: int | None = None) -> "DFlashDraft":
        """A draft saved by ``save`` (``num_anchors``: change the loss's blocks per sequence); bind before use."""
        d, state = read_saved(path, cls.architectures[0])
        draft = cls(config_from_dict(d, num_anchors))
        check_target(draft.config, target_config, path)
        draft.load_state_dict(state)
        if gamma is not None:
            draft.default_gamma = gamma
        return draft


def build(target_config: ModelConfig, *, num_layers: int = 1, block_size: int | None = None,
          gamma: int | None = None, layers=None, mask_token_id: int | None = None, decay: float = 7.0,
          num_anchors: int = 128, loss_chunk_blocks: int = 256, draft_vocab_size: int = 0,
          weights: str | os.PathLike | None = None, **overrides) -> DFlashDraft:
    """A DFlash draft for ``target_config`` (random init, or ``weights`` = a folder written by ``save``).

    block_size: S (default 7), drafting S − 1 tokens per round; or give ``gamma`` (drafted tokens)
    for S = gamma + 1. layers: tapped target layers (default ``build_target_layer_ids(L, num_layers)``).
    mask_token_id: a spare target token for MASK slots; None = a learned mask embedding.
    draft_vocab_size: K > 0 predicts K target tokens only, set by ``draft.set_vocabulary`` (e.g. the
    most frequent in the training data: ``codraft.train.offline_draft``); 0 = all of them.
    overrides: intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rope_theta, ….
    Bind the target's embedding and head with ``draft.bind_target(embed_weight, head_weight)``.
    """
    if weights is not None:
        return DFlashDraft.load(weights, target_config, gamma=gamma, num_anchors=num_anchors)
    block_size = _block_size(block_size, gamma, offset=1)
    if block_size < 2:
        raise ValueError(f"a DFlash block needs >= 2 slots (anchor + drafts), got block_size={block_size}")
    cfg = make_config(target_config, num_layers=num_layers, block_size=block_size, layers=layers,
                      mask_token_id=mask_token_id, decay=decay, num_anchors=num_anchors,
                      loss_chunk_blocks=loss_chunk_blocks, overrides=overrides,
                      draft_vocab_size=draft_vocab_size)
    return DFlashDraft(cfg)


def _block_size(block_size: int | None, gamma: int | None, *, offset: int) -> int:
    if gamma is None:
        return 7 if block_size is None else block_size
    if block_size is not None and block_size != gamma + offset:
        raise ValueError(f"block_size={block_size} and gamma={gamma} disagree: this draft drafts "
                         f"block_size - {offset} tokens per block")
    return gamma + offset
