"""Can the draft's own confidence pick the draft length? (docs/real-preset.md, session 29; not in the
engine.) Records, for SmolLM2's bf16 rollout copy with its offline DSpark draft at γ = 4, T = 1, every
drafted position's max q (the draft's top probability: known before its token is drawn, so a rule on it
stays lossless) and the exact acceptance probability of its drawn token, r = min(1, p(x)/q(x)). Then:

1. acceptance by max-q bin and position (a calibration fitted on one half of the rounds);
2. the rules priced by the cached draft-length cost model on the other half, per live row count, as
   expected tokens per second against plain decoding: fixed g = 1..4; one g for all rows, stopped at the
   first position whose estimated gain no longer pays (common); one g per row, a position verified while
   its estimated cumulative acceptance is ≥ θ, best θ in hindsight (ragged: needs a verify with ragged rows).

Usage: python scripts/draft_confidence.py [PROMPTS] [BATCH]   (default 128 8; ~2 minutes after the draft)
"""
import sys

import torch

import codraft.rollout.engine as engine_module
from codraft.bench.spec import _prompts
from codraft.rollout import Engine, load_or_calibrate

from rollout_ab import smollm2_dspark  # (this folder)

BINS = 20


def record(prompts: int, batch: int):
    tok, weights, draft = smollm2_dspark()
    target, draft = weights.policy, weights.draft_for(draft)
    rounds, verify = [], engine_module.fast_verify

    def recording(logits, x, q, sampler):  # (B,g+1,V), (B,g), (B,g,V)
        p = torch.softmax(logits[:, :x.shape[1]].float(), -1)
        r = (p.gather(-1, x[..., None]) / q.float().gather(-1, x[..., None])).clamp(max=1.0)[..., 0]
        rounds.append(torch.stack([q.float().amax(-1), r], -1))  # (B,g,2)
        return verify(logits, x, q, sampler)
    engine_module.fast_verify = recording
    engine = Engine(target, draft, 4)
    ps = _prompts(tok, prompts)
    for i in range(0, prompts, batch):
        engine.generate(ps[i:i + batch], 128, temperature=1.0, eos_id=[tok.eos_id], seed=1 + i)
    engine_module.fast_verify = verify
    return rounds, load_or_calibrate(target, draft, 4, batch)


def calibration(rounds) -> torch.Tensor:
    """(4, BINS) mean r per position and max-q bin, shrunk toward 0.4 by 5 pseudo-counts."""
    d = torch.cat(rounds)
    idx = (d[..., 0] * BINS).long().clamp(max=BINS - 1)
    out = torch.zeros(4, BINS)
    for k in range(4):
        for b in range(BINS):
            m = idx[:, k] == b
            out[k, b] = (d[m, k, 1].sum() + 2.0) / (m.sum() + 5)
    return out


def estimate(f: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """(rows, 4) estimated cumulative acceptance from each position's max q, through calibration f."""
    return torch.stack([f[k][(t[:, k, 0] * BINS).long().clamp(max=BINS - 1)] for k in range(4)], 1).cumprod(1)


def main(prompts: int = 128, batch: int = 8):
    rounds, cost = record(prompts, batch)
    d = torch.cat(rounds)
    print(f"{len(d)} row-rounds; mean r per position {[round(float(v), 3) for v in d[..., 1].mean(0)]}")
    edges = [0, .2, .4, .6, .8, .9, .95, .99, 1.01]
    for k in range(4):
        cells = []
        for lo, hi in zip(edges[:-1], edges[1:]):
            m = (d[:, k, 0] >= lo) & (d[:, k, 0] < hi)
            cells.append(f"{lo:.2f}+: {int(m.sum())} / {float(d[m, k, 1].mean()) if m.any() else 0:.2f}")
        print(f"position {k + 1}, max q bin: rows / mean r  " + "  ".join(cells))

    def target(b, t):  # the cost model, linear between whole tokens per row
        lo = int(t)
        if t == lo:
            return cost.target(b, lo)
        return (lo + 1 - t) * cost.target(b, lo) + (t - lo) * cost.target(b, lo + 1)

    half = len(rounds) // 2
    for fit, test in ((rounds[:half], rounds[half:]), (rounds[half:], rounds[:half])):
        f = calibration(fit)
        groups = {}
        for t in test:
            groups.setdefault("1-2" if len(t) <= 2 else "3-5" if len(t) <= 5 else "6-8", []).append(t)
        for key, ts in sorted(groups.items()):
            plain = sum(len(t) for t in ts) / sum(cost.target(len(t), 1) for t in ts)
            out = {}
            for g in range(1, 5):
                e = sum(float((1 + t[..., 1].cumprod(1)[:, :g].sum(1)).sum()) for t in ts)
                c = sum(target(len(t), g + 1) + cost.draft(len(t), g) for t in ts)
                out[f"g={g}"] = e / c / plain
            e = c = 0.0
            for t in ts:
                b, true = len(t), t[..., 1].cumprod(1)
                est = estimate(f, t)
                g, best = 0, b / target(b, 1)
                for k in range(1, 5):  # stop at the first position that does not pay: a stopping rule
                    rate = (b + float(est[:, :k].sum())) / (target(b, k + 1) + cost.draft(b, 4))
                    if rate < best:
                        break
                    g, best = k, rate
                e += b + float(true[:, :g].sum())
                c += target(b, g + 1) + (cost.draft(b, 4) if g else cost.draft(b, 0))
            out["common"] = e / c / plain
            best = (0.0, None)
            for th in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
                e = c = 0.0
                for t in ts:
                    b, true = len(t), t[..., 1].cumprod(1)
                    est = estimate(f, t)
                    keep = (est >= th).long().cumprod(1)
                    n = int(keep.sum())
                    e += b + float((true * keep).sum())
                    c += target(b, 1 + n / b) + (cost.draft(b, 4) if n else cost.draft(b, 0))
                best = max(best, (e / c / plain, th))
            out[f"ragged (θ {best[1]})"] = best[0]
            print(f"rows {key}, {len(ts)} rounds, vs plain: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
