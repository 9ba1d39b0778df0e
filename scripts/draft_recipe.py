"""Offline block-draft recipes compared by held-out acceptance, without decoding (docs/real-preset.md,
"Session 14"). Trains a DFlash/DSpark draft on SmolLM2's cached features (``draft.init=offline``'s
cache, built here on first use: ~9 min), holding out the last 64 sequences, and prints the draft's
own metrics on them: DSpark's ``alpha_k`` (mean Σ min(p_draft, p_target) at slot k with the true
prefix: the acceptance probability at T = 1) and ``tau_est`` (1 + Σ_k Π_{j≤k} alpha, per block),
DFlash's ``acc_k`` (top-1 agreement).

Usage: python scripts/draft_recipe.py [--kind dspark] [--steps 150] [--lr 1e-3] [--layers 1]
       [--taps 1,14,26,29] [--vocab 8192] [--batch 8] [--init-layer 29]
(--taps: target layers to read, 29 = the cached last-layer output; default: the kind's own taps.
--init-layer: start every draft layer from that target layer's weights instead of random ones.)
Training is the offline recipe's own loop (``train_offline``); about 1 s per step on 2 cores with the
8 192-token vocabulary.
"""
import argparse
import tempfile

import torch

from codraft.drafts import build_draft
from codraft.policy import load_policy
from codraft.tasks import make_task
from codraft.train.feature_cache import FeatureCache
from codraft.train.offline_draft import draft_vocabulary, offline_features, recipe_for, train_offline

HELD_OUT = 64


def _cache(policy, tok, folder) -> FeatureCache:
    """The feature cache ``draft.init=offline`` trains SmolLM2's drafts from (built on first use)."""
    r = recipe_for(tok, "dspark")
    fc = offline_features(policy, tok, make_task("chain_sum"), policy_dir=folder, layers=(), seed=0,
                          n_prompts=r.n_prompts, max_new_tokens=r.max_new_tokens)
    fc.features[policy.config.num_hidden_layers - 1] = fc.last  # the last layer's output, readable as a tap
    return fc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="dspark", choices=("dspark", "dflash"))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--taps", default="")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--init-layer", type=int, default=-1,
                    help="copy this target layer's weights into every draft layer (q/k norms stay 1)")
    a = ap.parse_args()
    torch.set_num_threads(2)
    policy, tok, folder = load_policy("smollm2-135m")
    policy.eval()
    fc = _cache(policy, tok, folder)
    held = list(range(len(fc) - HELD_OUT, len(fc)))
    # the other sequences, a prefix of the cache: its offsets into the stored features are the cache's
    seen = FeatureCache(fc.identity, fc.sequences[:-HELD_OUT], fc.features, fc.last)
    torch.manual_seed(0)
    opts = {"gamma": 4, "num_layers": a.layers, "draft_vocab_size": a.vocab}
    if a.taps:
        opts["layers"] = [int(x) for x in a.taps.split(",")]
    draft = build_draft(a.kind, policy.config, target=policy, **opts)
    if a.init_layer >= 0:
        src = policy.layers[a.init_layer].state_dict()
        for layer in draft.layers:
            res = layer.load_state_dict(src, strict=False)
            print(f"draft layer from target layer {a.init_layer}; kept {res.missing_keys}, "
                  f"unused {res.unexpected_keys}")
    if a.vocab:
        draft.set_vocabulary(draft_vocabulary(seen, policy.config.vocab_size, a.vocab)[0])
    with tempfile.TemporaryDirectory() as out:  # the offline recipe's own loop, on the seen sequences
        report = train_offline(policy, tok, None, draft, out_dir=out, steps=a.steps, batch_sequences=a.batch,
                               lr=a.lr, features=seen)
    layers = tuple(draft.feature_layers)
    draft.eval()
    with torch.no_grad():
        torch.manual_seed(123)  # the same anchors for every variant
        ms = [draft.loss(fc.batch(policy, held[i:i + 8], layers))[1] for i in range(0, HELD_OUT, 8)]
    keys = [k for k in ms[0] if k.startswith(("alpha", "acc", "tau", "loss"))]
    held_out = {k: round(sum(float(m[k]) for m in ms) / len(ms), 4) for k in keys}
    print(f"{vars(a)}: trained {report['train_seconds']:.0f} s; held out: {held_out}")

if __name__ == "__main__":
    main()
