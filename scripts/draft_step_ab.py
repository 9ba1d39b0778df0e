"""An offline draft training step on SmolLM2-135M's cached features, as it is against as it was
before session 22, same process, interleaved (docs/real-preset.md, "Session 22").

"now": DSpark's CE and L1 through ``slot_losses`` (hand-written backward), loss chunks not
recomputed where what the backward keeps fits ``KEPT_LOSS_BYTES``, no teacher logits for a kind
whose loss does not read them (``reads_teacher``: DFlash) and only the draft vocabulary's columns for
one that reads those (``teacher_columns``: DSpark; each row's logsumexp computed once, before timing).
"before": the same losses through autograd, every chunk recomputed in the backward, teacher logits
(the whole LM head over every supervised row) for every kind.

Usage: python scripts/draft_step_ab.py [KIND] [ROUNDS]   (KIND: dspark or dflash; the feature
cache is built on first use, a few minutes)
Prints seconds per step (packing the batch, the teacher, the loss's forward and backward), mean
over 6 batches of 8 sequences, per side, rounds after the first (warm-up) alternating the order.
"""
import random
import sys
import time
from pathlib import Path

import torch

from codraft.drafts import block_backbone, build_draft, dspark
from codraft.drafts.slot_loss import slot_losses
from codraft.policy import load_policy
from codraft.tasks import make_task
from codraft.train.offline_draft import draft_vocabulary, offline_features, recipe_for


def autograd_slot_losses(z, labels, teacher_logp, outside):
    logp = z.log_softmax(-1)
    p = teacher_logp.exp()
    l1 = (logp.exp() - p).abs().sum(-1) + ((1 - p.sum(-1)).clamp_min(0) if outside else 0)
    return -logp.gather(-1, labels[..., None])[..., 0], l1


def offline_setup(policy, tok, folder, kind: str):
    """A fresh ``kind`` draft with the recipe's vocabulary, SmolLM2's feature cache (each row's logsumexp
    computed) and 6 of the recipe's batches of sequence indices. Also used by precision_ab.py."""
    recipe = recipe_for(tok, kind)
    torch.manual_seed(0)
    draft = build_draft(kind, policy.config, target=policy, gamma=4, draft_vocab_size=recipe.draft_vocab)
    features = offline_features(policy, tok, make_task("chain_sum"), policy_dir=Path(folder), seed=0,
                                layers=draft.feature_layers, n_prompts=recipe.n_prompts,
                                max_new_tokens=recipe.max_new_tokens)
    draft.set_vocabulary(draft_vocabulary(features, policy.config.vocab_size, recipe.draft_vocab)[0])
    if draft.teacher_columns() is not None:
        features.teacher_lse(policy)
    picks = [random.Random(s).sample(range(len(features)), recipe.batch_sequences) for s in range(6)]
    return draft, features, picks


def main(kind: str = "dspark", rounds: int = 3):
    policy, tok, folder = load_policy("smollm2-135m")
    policy.eval()
    draft, features, picks = offline_setup(policy, tok, folder, kind)
    columns = draft.teacher_columns()
    sides = {"now": (slot_losses, block_backbone.KEPT_LOSS_BYTES, draft.reads_teacher, columns),
             "before": (autograd_slot_losses, 0, True, None)}
    seconds = dict.fromkeys(sides, 0.0)
    for r in range(rounds + 1):
        for name in (list(sides) if r % 2 else list(sides)[::-1]):
            dspark.slot_losses, block_backbone.KEPT_LOSS_BYTES, teacher, columns = sides[name]
            for pick in picks:
                t = time.perf_counter()
                batch = features.batch(policy, pick, tuple(draft.feature_layers), teacher=teacher, columns=columns)
                draft.zero_grad()
                draft.loss(batch, generator=torch.Generator().manual_seed(0))[0].backward()
                if r:
                    seconds[name] += time.perf_counter() - t
    steps = rounds * len(picks)
    print(f"{kind}, {torch.get_num_threads()} threads: " + ", ".join(f"{n} {s / steps:.3f} s/step" for n, s in
                                                                      seconds.items())
          + f"; before / now {seconds['before'] / seconds['now']:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dspark", int(sys.argv[2]) if len(sys.argv) > 2 else 3)
