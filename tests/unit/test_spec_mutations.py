"""Mutation test of the losslessness harness: planted bugs in the verify rule or a draft are rejected.

The harness (``spec_harness``; the test of the real code is
``test_spec_sampling::test_speculative_sampling_is_lossless``, which passes every case at seeds 0, 1, 2):
a peaky target, sharp bigram drafts, 5 cases (γ 1..4, T 0.8..2, top-k, top-p, both), the first
γ + 2 tokens of n = 10,000 rows per case, chi-square at alpha = 1e-4, samples in probability-0
cells failing outright.

Mutants are single planted changes. Verify-rule mutants: ``mutant_verify``, a copy of
``verify_drafts`` that is bit-identical to it when unmutated (tested), installed through the
engine's own reference ``codraft.rollout.engine.verify_drafts``. Draft mutants:
``MisreportingDraft``, which samples x_k from the right row and reports a wrong q_k. Each test runs
its mutant on one case (* below) at test seed 0 and asserts rejection; an equivalent mutant (a
valid rule with lower acceptance) must pass.

Power study (``python tests/unit/test_spec_mutations.py [n_seeds]``, a few minutes): every mutant on every
case at n = 10,000, study seeds 100..104 (not the test seeds). Entry: median of chi2/critical over
the 5 seeds, then how many of the 5 rejected (inf: samples in probability-0 cells). Power on the
test's case (*): with lam = mean(chi2) - df the statistic is ~ noncentral chi-square, mean df + lam,
variance 2 (df + 2 lam); z = (df + lam - crit) / sd, and P(reject) = Phi(z), so z >= 9.1 means
power > 1 - 1e-19; where every run lands m samples in p = 0 cells, P(reject) >= 1 - exp(-m).
n99 is the n at which power would fall to 0.99 (lam or m proportional to n, df held fixed): the
weakest mutant needs ~2,200, so n = 10,000 keeps a 4.5x margin for bugs subtler than these.

                               near-g4    near-g3    near-g2    far-g2     far-g1
    mutant                     t1         t1.4-k4    t0.8-p0.9  t2-k3-p0.9 t1.3-p0.85 power on *
    (correct rule)             0.7 0      0.7 0      0.6 0      0.6 0      0.4 0
    q_treated_as_one_hot (eq.) 0.8 0      0.8 0      0.5 0      0.5 0      0.5 0
    accept_ignores_q           16.3 5     28.0 5     83.5 5*    26.7 5     6.0 5      z 43.8, n99 123
    accept_q_prev_position     21.9 5*    8.7 5      11.7 5     1.2 4      0.4 0      z 47.4, n99 206
    accept_q_other_row         13.5 5     8.9 5      24.6 5     21.8 5     49.4 5*    z 26.7, n99 266
    bonus_wrong_position       5.6 5*     inf 5      inf 5      inf 5      inf 5      z 21.6, n99 871
    residual_is_p              5.9 5      5.0 5      14.8 5     20.7 5     17.6 5*    z 15.2, n99 776
    residual_q_next_position   8.2 5      4.6 5*     13.9 5     42.0 5     0.4 0      z 18.7, n99 1124
    residual_p_on_support      1.5 5      1.8 5      0.9 1      11.6 5*    7.7 5      z 18.2, n99 756
    residual_not_renormalised  13.8 5*    inf 5      inf 5      inf 5      inf 5      z 37.0, n99 331
    residual_unfiltered        0.7 0      inf 5*     inf 5      inf 5      inf 5      1685 in p=0, n99 27
    untempered_p               0.7 0      4.6 5      inf 5      43.1 5*    9.8 5      z 37.0, n99 198
    count_not_prefix           25.1 5*    inf 5      inf 5      inf 5      0.4 0      z 50.4, n99 183
    n_accepted_plus_one        21.3 5     inf 5      inf 5      inf 5      inf 5*     5981 in p=0, n99 8
    n_accepted_minus_one       3.6 5      3.0 5      5.0 5*     2.5 5      0.5 0      z 9.1, n99 2220
    q_at_temperature_1         0.7 0      1.8 5      4.1 5      11.1 5*    0.9 2      z 17.4, n99 823
    q_unfiltered               0.7 0      1.5 5      1.4 5      15.9 5*    1.6 5      z 21.5, n99 558
    q_prev_position            23.6 5     11.2 5*    13.6 5     7.3 5      0.4 0      z 33.0, n99 414

Reading: the review's weak spots are gone. A draft that reports q at T = 1 is rejected by 3 of 5
cases (every seed), acceptance that ignores q by all 5, a bonus from the wrong position by all 5
(at γ = 4 too, by the chi-square alone). The correct rule stays at 0.4-0.7 of the critical value.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch

import codraft.rollout.engine as engine_mod
from codraft.rollout import Sampler, Verdict, verify_drafts
from codraft.spec.verify import residual

from spec_harness import ALPHA, CASES, SEEDS, V, BigramDraft, Harness, chi2_fits, harness


# ---- mutants of the verify rule -------------------------------------------------------------------

EQUIVALENT_MUTANTS = [  # changes that keep the rule exact (a valid rule with lower acceptance): must pass
    "q_treated_as_one_hot",  # dense q ignored: accept w.p. p_k(x_k), residual p_k without x_k
]
VERIFY_MUTANTS = [
    "accept_ignores_q",          # accept x_k if u < p_k(x_k)
    "accept_q_prev_position",    # u < p_k(x_k)/q_{k-1}(x_k) (q_1 for k = 1)
    "accept_q_other_row",        # u < p_k(x_k)/q_k(x_k) of the next batch row
    "bonus_wrong_position",      # all accepted: bonus ~ p_γ instead of p_{γ+1}
    "residual_is_p",             # resample from p_k instead of norm(max(0, p_k - q_k))
    "residual_q_next_position",  # max(0, p_k - q_{k+1}) (q_γ for k = γ)
    "residual_p_on_support",     # resample from p_k restricted to {p_k > q_k}
    "residual_not_renormalised", # inverse-CDF draw over the unnormalised residual: the missing mass goes to token V-1
    "residual_unfiltered",       # residual and bonus from the tempered p_k without top-k/top-p
    "untempered_p",              # p_k at temperature 1 (top-k/top-p still applied)
    "count_not_prefix",          # n = number of accepted slots, not the accepted prefix
    "n_accepted_plus_one",       # reports one more accepted token than the rule accepted (at most γ)
    "n_accepted_minus_one",      # reports one fewer (at least 0): the correction token is dropped
]


def mutant_verify(mutation: str | None):
    """``verify_drafts`` (sampling path, dense q) with one planted bug; None reproduces it exactly.

    If ``verify_drafts`` changes, ``test_unmutated_copy_is_the_production_rule`` fails until this
    copy mirrors it again (the mutants must stay single changes of the real rule).
    """

    def verify(target_logits, draft_tokens, draft_probs, sampler: Sampler) -> Verdict:
        assert not sampler.greedy and draft_probs is not None
        b, g = draft_tokens.shape
        rows = torch.arange(b, device=draft_tokens.device)
        logp = sampler.logprobs(target_logits)
        if mutation == "untempered_p":
            logp = Sampler(1.0, sampler.top_p, sampler.top_k).logprobs(target_logits)
        p = logp.exp()
        q = draft_probs.float()
        x = draft_tokens[..., None]
        if mutation == "q_treated_as_one_hot":
            q = torch.zeros_like(q).scatter_(-1, x, 1.0)
        q_acc = q
        if mutation == "accept_q_prev_position":
            q_acc = torch.cat([q[:, :1], q[:, :-1]], 1)
        elif mutation == "accept_q_other_row":
            q_acc = q.roll(1, 0)
        p_x = p[:, :g].gather(-1, x).squeeze(-1)
        q_x = q_acc.gather(-1, x).squeeze(-1)
        u = sampler.uniform((b, g), device=p.device)
        accept = u < p_x if mutation == "accept_ignores_q" else u * q_x < p_x
        n = accept.long().sum(-1) if mutation == "count_not_prefix" else accept.long().cumprod(-1).sum(-1)

        p_res = p
        if mutation == "residual_unfiltered":
            p_res = (target_logits.float() / sampler.temperature).softmax(-1)
        p_n = p_res[rows, n.clamp(max=g - 1) if mutation == "bonus_wrong_position" else n]
        q_row = (n + 1 if mutation == "residual_q_next_position" else n).clamp(max=g - 1)
        q_n = torch.where((n < g)[:, None], q[rows, q_row], 0.0)
        r = residual(p_n, q_n)
        if mutation == "residual_is_p":
            r = p_n
        elif mutation == "residual_p_on_support":
            r = torch.where(p_n > q_n, p_n, 0.0)
        if mutation == "residual_not_renormalised":
            u2 = sampler.uniform((b, 1), device=p.device)
            y = torch.searchsorted(r.cumsum(-1), u2).squeeze(-1).clamp(max=r.shape[-1] - 1)
        else:
            y = sampler.sample(r)

        tokens = torch.cat([draft_tokens, draft_tokens[:, :1]], 1).scatter(1, n[:, None], y[:, None])
        if mutation == "n_accepted_plus_one":
            n = (n + 1).clamp(max=g)
        elif mutation == "n_accepted_minus_one":
            n = (n - 1).clamp(min=0)
        return Verdict(n, tokens, logp.gather(-1, tokens[..., None]).squeeze(-1))

    return verify


# ---- mutants of the draft: x_k is sampled from the right row, q_k is misreported ----------------

class MisreportingDraft(BigramDraft):
    def __init__(self, base: BigramDraft, mutation: str):
        super().__init__(base.table)
        self.mutation = mutation

    def reported(self, q, logits, sampler, prev_q):
        if self.mutation == "q_at_temperature_1":  # softmax(logits): no temperature, no top-k/top-p
            return logits.float().softmax(-1)
        if self.mutation == "q_unfiltered":  # temperature applied, top-k/top-p forgotten
            return (logits.float() / sampler.temperature).softmax(-1)
        if self.mutation == "q_prev_position":  # a stale row: q_{k-1} for k >= 2
            return q if prev_q is None else prev_q
        raise ValueError(self.mutation)


DRAFT_MUTANTS = ["q_at_temperature_1", "q_unfiltered", "q_prev_position"]


# ---- the tests -----------------------------------------------------------------------------------

# each mutant -> the case of CASES that the test runs it on (one of those that reject it decisively,
# see the table in the module docstring; the others are no weaker as a whole)
REJECTED_BY = {
    "accept_ignores_q": "near-g2-t0.8-p0.9",
    "accept_q_prev_position": "near-g4-t1",
    "accept_q_other_row": "far-g1-t1.3-p0.85",
    "bonus_wrong_position": "near-g4-t1",
    "residual_is_p": "far-g1-t1.3-p0.85",
    "residual_q_next_position": "near-g3-t1.4-k4",
    "residual_p_on_support": "far-g2-t2-k3-p0.9",
    "residual_not_renormalised": "near-g4-t1",
    "residual_unfiltered": "near-g3-t1.4-k4",
    "untempered_p": "far-g2-t2-k3-p0.9",
    "count_not_prefix": "near-g4-t1",
    "n_accepted_plus_one": "far-g1-t1.3-p0.85",
    "n_accepted_minus_one": "near-g2-t0.8-p0.9",
    "q_at_temperature_1": "far-g2-t2-k3-p0.9",
    "q_unfiltered": "far-g2-t2-k3-p0.9",
    "q_prev_position": "near-g3-t1.4-k4",
}
CASE = {c.id: c for c in CASES}


@pytest.fixture(scope="module")
def h():
    return harness()


def test_every_mutant_has_a_case():
    assert sorted(REJECTED_BY) == sorted(VERIFY_MUTANTS + DRAFT_MUTANTS)
    assert set(REJECTED_BY.values()) <= set(CASE)


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                      dict(temperature=1.5, top_k=3, top_p=0.9)],
                         ids=["t1", "t0.7-p0.8", "t1.5-k3-p0.9"])
def test_unmutated_copy_is_the_production_rule(settings):
    """mutant_verify(None) is verify_drafts bit for bit (same random draws), so each mutant is one planted change."""
    g = torch.Generator().manual_seed(0)
    b, gamma = 4096, 3
    target_logits = torch.randn(b, gamma + 1, V, generator=g) * 2
    sampler = Sampler(**settings, generator=g)
    q = sampler.probs(torch.randn(b, gamma, V, generator=g) * 2)
    x = sampler.sample(q)
    out = [rule(target_logits, x, q, Sampler(**settings, generator=torch.Generator().manual_seed(1)))
           for rule in (verify_drafts, mutant_verify(None))]
    assert 0 < out[0].n_accepted.float().mean() < gamma  # rejections and bonus tokens both happen
    for a, c in zip(*out):
        assert torch.equal(a, c)


@pytest.mark.parametrize("mutation", VERIFY_MUTANTS)
def test_verify_mutant_is_rejected(h, monkeypatch, mutation):
    case = CASE[REJECTED_BY[mutation]]
    monkeypatch.setattr(engine_mod, "verify_drafts", mutant_verify(mutation))
    ok, stat, crit = h.check(case, SEEDS[0])
    assert not ok, f"{mutation} passed {case.id}: chi2 {stat:.1f} < {crit:.1f}"


@pytest.mark.parametrize("mutation", DRAFT_MUTANTS)
def test_draft_mutant_is_rejected(h, mutation):
    case = CASE[REJECTED_BY[mutation]]
    ok, stat, crit = h.check(case, SEEDS[0], draft=MisreportingDraft(h.drafts[case.draft], mutation))
    assert not ok, f"{mutation} passed {case.id}: chi2 {stat:.1f} < {crit:.1f}"


@pytest.mark.parametrize("mutation", EQUIVALENT_MUTANTS)
def test_equivalent_mutant_passes(h, monkeypatch, mutation):
    """A change that keeps the rule exact is not rejected: the harness tests the distribution, not the code."""
    monkeypatch.setattr(engine_mod, "verify_drafts", mutant_verify(mutation))
    for case in (CASE["near-g4-t1"], CASE["far-g2-t2-k3-p0.9"]):
        ok, stat, crit = h.check(case, SEEDS[0])
        assert ok, f"{mutation} failed {case.id}: chi2 {stat:.1f} >= {crit:.1f}"


# ---- the power study (python tests/unit/test_spec_mutations.py [SEEDS]): the table in the docstring ----

def _power_study(seeds: range):
    """Every mutant on every case at the case's n, at study seeds (not the test seeds).

    Prints, per case, the median of stat/crit over the seeds and how many seeds rejected; then for
    the case the test uses, the power: when samples land in probability-0 cells (m per run on
    average) P(reject) >= 1 - exp(-m); otherwise the statistic is ~ noncentral chi-square with
    df = cells - 1 and noncentrality lam = mean(stat) - df, mean df + lam, variance 2 (df + 2 lam),
    and the power is P(stat >= crit) in the normal approximation (z = its standard score).
    """
    h = Harness()
    torch.set_num_threads(1)
    normal = torch.distributions.Normal(0.0, 1.0)
    print("mutant".ljust(26), *(c.id.ljust(19) for c in CASES), "power on the test's case")
    rule = engine_mod.verify_drafts
    for m in [None, *EQUIVALENT_MUTANTS, *VERIFY_MUTANTS, *DRAFT_MUTANTS]:
        cols, power = [], ""
        for case in CASES:
            exact = h.exact(case)
            draft = MisreportingDraft(h.drafts[case.draft], m) if m in DRAFT_MUTANTS else None
            engine_mod.verify_drafts = rule if m is None or draft is not None else mutant_verify(m)
            runs = []
            for seed in seeds:
                counts = h.sample(case, seed, draft=draft)[0]
                runs.append((*chi2_fits(counts, exact, ALPHA), counts[exact.flatten() == 0].sum().item()))
            engine_mod.verify_drafts = rule
            stats = sorted(r[1] for r in runs)
            crit = runs[0][2]
            cols.append(f"{stats[len(stats) // 2] / crit:7.2f} {sum(not r[0] for r in runs)}/{len(runs)}".ljust(19))
            if REJECTED_BY.get(m) == case.id:
                impossible = sum(r[3] for r in runs) / len(runs)
                if min(r[3] for r in runs) > 0:  # n99: m(n) = m n / case.n reaches log(100)
                    n99 = case.n * math.log(100) / impossible
                    power = f"{impossible:.0f} samples/run in p=0 cells: 1 - exp(-{impossible:.0f}); n99 {n99:.0f}"
                else:
                    df = int((exact.flatten() * case.n >= 5).sum())  # kept cells + the pooled one, minus 1
                    lam = max(sum(stats) / len(stats) - df, 0.0)
                    z = (df + lam - crit) / (2 * (df + 2 * lam)) ** 0.5
                    # n99: lam(n) = lam n / case.n (df and crit held fixed) with z = 2.326, power 0.99
                    lo, hi = 0.0, lam
                    for _ in range(60):
                        mid = (lo + hi) / 2
                        lo, hi = (mid, hi) if (df + mid - crit) < 2.326 * (2 * (df + 2 * mid)) ** 0.5 else (lo, mid)
                    power = (f"df {df}, crit {crit:.0f}, lam {lam:.0f}, z {z:.1f}, "
                             f"power {normal.cdf(torch.tensor(z)).item():.6f}; n99 {case.n * hi / lam:.0f}")
        print(str(m).ljust(26), *cols, power, flush=True)


if __name__ == "__main__":
    _power_study(range(100, 100 + (int(sys.argv[1]) if len(sys.argv) > 1 else 5)))
