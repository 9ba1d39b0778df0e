"""Offline block-draft recipes compared by held-out acceptance, without decoding (docs/real-preset.md,
"Session 14"). Trains a DFlash/DSpark draft on SmolLM2's cached features (``draft.init=offline``'s
cache, built here on first use: ~9 min), holding out the last 64 sequences, and prints the draft's
own metrics on them: DSpark's ``alpha_k`` (mean Σ min(p_draft, p_target) at slot k with the true
prefix: the acceptance probability at T = 1) and ``tau_est`` (1 + Σ_k Π_{j≤k} alpha, per block),
DFlash's ``acc_k`` (top-1 agreement).

Usage: python scripts/draft_recipe.py [--kind dspark] [--steps 150] [--lr 1e-3] [--layers 1]
       [--taps 1,14,26,29] [--vocab 8192] [--batch 8] [--init-layer 29] [--train-seqs 224]
       [--precision float32|bfloat16|auto]
(--taps: target layers to read, 29 = the cached last-layer output; default: the kind's own taps.
--init-layer: start every draft layer from that target layer's weights instead of random ones.
--train-seqs: train on only the first N of the 448 sequences, to see whether more data would help.)
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
    ap.add_argument("--topk", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="also print held-out candidate-set tree estimates for these widths (DSpark)")
    ap.add_argument("--init-layer", type=int, default=-1,
                    help="copy this target layer's weights into every draft layer (q/k norms stay 1)")
    ap.add_argument("--train-seqs", type=int, default=0, help="train on only the first N held-in sequences")
    ap.add_argument("--precision", default="float32", help="the draft's products: float32, bfloat16 (bf16 products), auto")
    a = ap.parse_args()
    torch.set_num_threads(2)
    policy, tok, folder = load_policy("smollm2-135m")
    policy.eval()
    fc = _cache(policy, tok, folder)
    held = list(range(len(fc) - HELD_OUT, len(fc)))
    # the other sequences, a prefix of the cache: its offsets into the stored features are the cache's
    seen = FeatureCache(fc.identity, fc.sequences[:-HELD_OUT][:a.train_seqs or None], fc.features, fc.last)
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
                               lr=a.lr, features=seen, precision=a.precision)
    layers = tuple(draft.feature_layers)
    draft.eval()
    with torch.no_grad():
        torch.manual_seed(123)  # the same anchors for every variant
        ms = [draft.loss(fc.batch(policy, held[i:i + 8], layers))[1] for i in range(0, HELD_OUT, 8)]
    keys = [k for k in ms[0] if k.startswith(("alpha", "acc", "tau", "loss"))]
    held_out = {k: round(sum(float(m[k]) for m in ms) / len(ms), 4) for k in keys}
    print(f"{vars(a)}: trained {report['train_seconds']:.0f} s; held out: {held_out}")
    if a.kind == "dspark" and a.topk:
        with torch.no_grad():
            torch.manual_seed(123)
            hits = torch.cat([candidate_hits(draft, fc.batch(policy, held[i:i + 8], layers), a.topk)
                              for i in range(0, HELD_OUT, 8)])
        print_candidate_sets(hits, a.topk)


def candidate_hits(draft, batch, ks: list[int]) -> torch.Tensor:
    """(blocks, len(ks), S) bool: whether the target's own next token at each slot of a held-out
    block is among the draft's top k at that slot (teacher-forced: the slot's previous token is the
    true one). The cache's completions are the target's samples at T = 1, so the mean of a product
    of hits along a block is the chance that a tree whose node at each depth has these k children
    (the draft's top k given the path) would be followed that far by sampling from the target: the
    candidate-set rule (sample the target's token, descend if it is a child, else stop) is exact."""
    s = draft.config.block_size
    blocks = draft.sample_anchors(batch, label_offset=1)
    held = draft.held_blocks(batch, blocks)
    h = draft.block_hidden(batch, blocks, s, held)[0]
    src = blocks.anchors[:, None] + torch.arange(s)
    t = batch.input_ids.shape[1]
    in_seq = src + 1 < blocks.seq_end[:, None]
    src = src.clamp(max=t - 1)
    lab_pos = (src + 1).clamp(max=t - 1)
    ids = batch.input_ids[0]
    labels, in_vocab = draft.vocab_labels(ids[lab_pos])
    ok = in_seq & batch.loss_mask[0, lab_pos]
    sel = held[0]
    z, _ = draft.slot_logits(h, ids[src][sel])
    top = z.topk(max(ks), -1).indices  # (N,S,kmax)
    hit = [((top[..., :k] == labels[sel][..., None]).any(-1) & in_vocab[sel]) for k in ks]
    return torch.stack(hit, 1) & ok[sel][:, None]  # slots past the sequence's end count as misses


def print_candidate_sets(hits: torch.Tensor, ks: list[int]):
    """Expected tokens per round (1 + Σ_d P(followed to depth d)) and verify rows for uniform trees."""
    blocks, _, s = hits.shape
    print(f"candidate-set trees over {blocks} held-out blocks: k children per node, depth d, "
          "tokens per round (the target's own token included) / verify rows (1 + k + k^2 + ...)")
    for j, k in enumerate(ks):
        reach = hits[:, j].float().cumprod(1).mean(0)  # P(followed to depth d), d = 1..S
        row = "  ".join(f"d={d + 1}: {1 + float(reach[:d + 1].sum()):.2f}/{sum(k ** i for i in range(d + 2))}"
                        for d in range(s))
        print(f"  k={k}: P(depth 1) {float(reach[0]):.3f}  {row}")

if __name__ == "__main__":
    main()
