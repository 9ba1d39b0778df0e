"""A block draft's vocabulary (EAGLE-3's d2t): the K target tokens it can propose, and its head.

With ``draft_vocab_size`` K > 0 (``set_vocabulary``) the logits cover only K target tokens, the
target head's rows for them gathered once per version of the head (``head_rows``): the head product
and the losses' passes over the vocabulary shrink by V/K; labels outside it get no loss
(``vocab_labels``), and proposals return target ids (``to_target``) with q zero outside
(``full_probs``): exact. With K = 0 every map is the identity and the head is the whole (V,H) one.

``DraftVocabulary`` is a mixin of the block draft module (block_backbone.py), which gives it
``config``, ``product`` and ``_bound()`` (the target's embedding and head) and calls
``init_vocabulary`` from its ``__init__``.
"""
from __future__ import annotations

import torch


class DraftVocabulary:
    """The draft's vocabulary and the head over it; mixed into an ``nn.Module`` (see the module doc)."""

    def init_vocabulary(self) -> None:
        """Register the vocabulary's buffers, K = ``config.draft_vocab_size`` tokens (0: the whole target's)."""
        k = self.config.draft_vocab_size
        # the draft's vocabulary: draft index -> target token (saved), and back (-1: not in it; derived
        # by set_vocabulary, also after a state dict is loaded)
        self.register_buffer("draft_vocab", torch.arange(k) if k else None)
        self.register_buffer("to_draft_index", None, persistent=False)
        if k:
            self.set_vocabulary(self.draft_vocab)
            self.register_load_state_dict_post_hook(lambda module, _: module.set_vocabulary(module.draft_vocab))
        self._head_rows = None  # (key, the head's rows for the draft's vocabulary), see head_rows

    @property
    def out_vocab(self) -> int:
        """How many tokens the draft's logits cover: K, or the target's whole vocabulary."""
        return self.config.draft_vocab_size or self.config.vocab_size

    def set_vocabulary(self, tokens: torch.Tensor) -> None:
        """The K target tokens the draft predicts (K = ``config.draft_vocab_size``, distinct, in range), e.g.
        the most frequent ones in its training data. The LM head's rows and every loss and proposal
        are over them: the head product and the losses' passes over the vocabulary shrink by V/K. The
        draft's proposals stay exact (a draft distribution with zeros outside them)."""
        k, v = self.config.draft_vocab_size, self.config.vocab_size
        tokens = torch.as_tensor(tokens).to(torch.long).flatten()
        if not k:
            raise ValueError("this draft predicts the whole vocabulary (config.draft_vocab_size = 0)")
        if tokens.numel() != k or tokens.unique().numel() != k or int(tokens.min()) < 0 or int(tokens.max()) >= v:
            raise ValueError(f"a draft vocabulary is {k} distinct token ids in [0, {v}); got {tokens.numel()} "
                             f"({tokens.unique().numel()} distinct, range {int(tokens.min())}..{int(tokens.max())})")
        dev = self.draft_vocab.device
        self.draft_vocab.copy_(tokens.to(dev))
        index = torch.full((v,), -1, dtype=torch.long, device=dev)
        index[self.draft_vocab] = torch.arange(k, device=dev)
        self.to_draft_index = index
        self._head_rows = None

    def to_draft(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids -> the draft's indices (-1 where not in its vocabulary); identity without one."""
        return tokens if self.draft_vocab is None else self.to_draft_index[tokens]

    def vocab_labels(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target label tokens -> (the draft's indices, valid as gather indices; whether each is in its
        vocabulary): a label it cannot propose gets no loss."""
        labels = self.to_draft(tokens)
        return labels.clamp_min(0), labels >= 0

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        """The draft's indices -> target token ids."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def full_probs(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft's vocabulary (…,K) as one over the target's (…,V), zeros outside:
        what the engine's verification compares with the target's."""
        if self.draft_vocab is None:
            return q
        full = q.new_zeros(*q.shape[:-1], self.config.vocab_size)
        return full.index_copy_(-1, self.draft_vocab, q)

    def head_rows(self) -> torch.Tensor:
        """The target head's rows the draft's logits use (K,H), gathered once per version of the head
        (an optimiser step or a rollout refresh changes it in place), or the whole head (V,H)."""
        w = self._bound()[1]
        if self.draft_vocab is None:
            return w
        try:
            key = (w.data_ptr(), w._version, w.dtype, w.device)
        except RuntimeError:  # an inference-mode tensor keeps no version: gather every call
            key = None
        if key is None:
            return w.index_select(0, self.draft_vocab.to(w.device))
        if self._head_rows is None or self._head_rows[0] != key:
            # gathered as a normal tensor even inside a rollout's inference mode: the next training step's
            # loss reuses it (the head has not changed), and autograd refuses inference tensors
            with torch.inference_mode(False):
                self._head_rows = (key, w.index_select(0, self.draft_vocab.to(w.device)))
        return self._head_rows[1]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden (…,H) -> float32 logits (…,K) through the frozen target head's rows of the
        draft's vocabulary (K = V without one); a head in another dtype (a weight-only bf16 rollout copy's)
        is widened to h's, as every product of such a copy is."""
        return self.product(h, self.head_rows()).float()


__all__ = ["DraftVocabulary"]
