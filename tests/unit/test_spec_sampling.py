"""Speculative sampling is lossless: emitted tokens follow the target's exact distribution.

Oracle: exact enumeration. The probability of every continuation of a fixed prompt is computed
with full target forwards over every prefix and an independent float64 implementation of
temperature/top-k/top-p; speculative samples (one batched generate of identical prompts) are
compared with it by a chi-square goodness-of-fit test at a fixed seed, cells with expected count
< 5 pooled, and any sample in a cell of probability 0 failing outright.

1. The harness (``spec_harness``; its power is proven in ``test_spec_mutations``): a peaky target
   and sharp bigram drafts, one far from the target and one fitted to it, ``CASES`` = γ 1..4 with
   temperatures 0.8-2 and top-k, top-p and both; the window is the first γ + 2 new tokens, so
   every slot of the first round, the bonus included, is inside it (asserted: every accept count
   0..γ occurs in the first round); N = 10,000 rows per case, alpha = 1e-4 per test, 3 seeds.
2. Real draft kinds in the original small setting, whose helpers ``test_dflash_dspark`` and
   ``test_eagle3`` import (V = 8, 3 tokens, N = 4,000, alpha = 1e-3): the model draft, the ngram
   draft, and negative controls; plus the model draft on the harness's peaky target.
"""
import math

import pytest
import torch

from codraft.drafts import build_draft
from codraft.models import Transformer
from codraft.rollout import Engine, Sampler, verify_drafts
import codraft.rollout.engine as engine_mod
import codraft.spec.verify as verify_mod

import spec_harness
from spec_harness import (  # noqa: F401  (chi2_critical, chi2_fits: imported from here by other tests)
    ALPHA, CASES, PROMPT, SEEDS, V, Case, chi2_critical, chi2_fits, histogram, sampling_probs,
)

N_NEW = 3
_scaled, _config = spec_harness.scaled, spec_harness.config  # (_scaled: imported by other tests)


@pytest.fixture(scope="module")
def target():
    return _scaled(Transformer(_config(2)), 0.35, seed=0)


@pytest.fixture(scope="module")
def exact(target):
    """exact(temperature, top_k, top_p) -> (V,V,V) probabilities, computed once per setting."""
    memo = {}

    def get(temperature=1.0, top_k=0, top_p=1.0):
        key = (temperature, top_k, top_p)
        if key not in memo:
            memo[key] = exact_distribution(target, *key)
        return memo[key]
    return get


def _poor_draft(std=0.1, seed=1):
    draft = build_draft("model", _config(2), num_hidden_layers=1)
    _scaled(draft.net, std, seed)  # a different random model, and flatter ("hotter") than the target
    return draft


def oracle_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent float64 reference of the sampling transform, row by row: (N,V) -> (N,V) logprobs."""
    out = torch.full(logits.shape, -math.inf, dtype=torch.float64)
    for i, row in enumerate(logits.double()):
        x = row / temperature
        order = sorted(range(len(x)), key=lambda j: -x[j].item())
        if top_k:
            kth = x[order[top_k - 1]].item()
            order = [j for j in order if x[j].item() >= kth]
        p = torch.softmax(x[order], 0)
        kept, mass = [], 0.0
        for j, pj in zip(order, p.tolist()):
            if mass >= top_p:
                break
            kept.append(j)
            mass += pj
        out[i, kept] = torch.log_softmax(x[kept], 0)
    return out


def exact_distribution(model, temperature, top_k, top_p) -> torch.Tensor:
    """P(next 3 tokens = s) for all 512 s, by enumeration: (V,V,V) float64."""
    seqs = torch.cartesian_prod(*[torch.arange(V)] * N_NEW)  # (512,3)
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = model(ids)[:, len(PROMPT) - 1:-1]  # (512,3,V): position t predicts new token t
    logp = oracle_logprobs(logits.reshape(-1, V), temperature, top_k, top_p).view(len(seqs), N_NEW, V)
    total = logp.gather(-1, seqs[..., None]).squeeze(-1).sum(-1)
    return total.exp().view(V, V, V)


def _histogram(results) -> torch.Tensor:
    return histogram(results, N_NEW)


N = 4000
MODEL_CASES = [  # (settings, gamma): γ=1 exercises the bonus token within 3 new tokens, γ=2 a second draft position
    (dict(temperature=1.0), 1),
    (dict(temperature=1.0), 2),
    (dict(temperature=0.7, top_p=0.8), 2),
    (dict(temperature=1.0, top_k=3), 1),
]


@pytest.mark.parametrize("settings,gamma", MODEL_CASES, ids=["t1-g1", "t1-g2", "t0.7-p0.8-g2", "k3-g1"])
@pytest.mark.parametrize("rule", ["engine", "torch"])
def test_model_draft_is_lossless(target, exact, settings, gamma, rule, monkeypatch):
    """rule: as the engine runs it (without top-k / top-p on CPU, in C: codraft.kernels.sampling), or
    ``verify_drafts`` and ``Sampler.sample_logits`` in torch everywhere."""
    if rule == "torch":
        monkeypatch.setattr(engine_mod, "fast_verify", lambda *a: None)
        monkeypatch.setattr(engine_mod, "fast_sample", lambda *a: None)
    engine = Engine(target, _poor_draft(), gamma=gamma)
    results = engine.generate([PROMPT] * N, N_NEW, seed=123, eos_id=[], **settings)
    # the draft is poor: rejections happen at every position, and acceptances too
    assert all(0.01 < a < 0.9 for a in engine.stats.acceptance_per_position), engine.stats.acceptance_per_position
    ok, stat, crit = chi2_fits(_histogram(results), exact(**settings))
    assert ok, f"chi2 {stat:.1f} >= critical {crit:.1f}"


def test_ngram_draft_is_lossless(target, exact):
    engine = Engine(target, build_draft("ngram", target.config, n=2), gamma=2)
    results = engine.generate([PROMPT] * N, N_NEW, temperature=1.0, seed=7, eos_id=[])
    assert engine.stats.accepted > 0 and engine.stats.acceptance_rate < 0.9
    ok, stat, crit = chi2_fits(_histogram(results), exact())
    assert ok, f"chi2 {stat:.1f} >= critical {crit:.1f}"


def test_negative_control_draft_samples_are_rejected(exact):
    """Plain samples from the draft model itself must fail the test against the target."""
    draft = _poor_draft()
    results = Engine(draft.net).generate([PROMPT] * N, N_NEW, temperature=1.0, seed=123, eos_id=[])
    ok, stat, crit = chi2_fits(_histogram(results), exact())
    assert not ok, f"draft samples passed: chi2 {stat:.1f} < {crit:.1f}"


def test_negative_control_biased_rule_is_rejected(target, exact, monkeypatch):
    """A classic bug, resampling from p instead of norm(max(0, p - q)) after a rejection, is caught (in
    the torch rule; the C one equals it, test_verify_kernel)."""
    monkeypatch.setattr(verify_mod, "residual", lambda p, q: p)
    monkeypatch.setattr(engine_mod, "fast_verify", lambda *a: None)
    results = Engine(target, _poor_draft(), gamma=2).generate([PROMPT] * N, N_NEW, temperature=1.0, seed=123,
                                                              eos_id=[])
    ok, stat, crit = chi2_fits(_histogram(results), exact())
    assert not ok, f"biased rule passed: chi2 {stat:.1f} < {crit:.1f}"


@pytest.mark.parametrize("one_hot", [False, True])
def test_verify_first_token_is_target_distributed(one_hot):
    """The rule in isolation: the first emitted token ~ p_1 whatever q is (dense or one-hot)."""
    g = torch.Generator().manual_seed(0)
    b, gamma, v = 50_000, 2, 6
    target_logits = (torch.randn(1, gamma + 1, v, generator=g) * 2).expand(b, -1, -1)
    q = torch.softmax(torch.randn(gamma, v, generator=g) * 2, -1)
    if one_hot:
        x = target_logits[0, :gamma].argmax(-1).expand(b, -1)  # a likely, fixed proposal
        probs = None
    else:
        x = torch.multinomial(q, b, replacement=True, generator=g).T  # (B,γ), x_k ~ q_k
        probs = q.expand(b, -1, -1)
    sampler = Sampler(1.0, generator=g)
    out = verify_drafts(target_logits, x, probs, sampler)
    p1 = torch.softmax(target_logits[0, 0].double(), -1)
    ok, stat, crit = chi2_fits(torch.bincount(out.tokens[:, 0], minlength=v), p1)
    assert ok, f"chi2 {stat:.1f} >= critical {crit:.1f}"
    # and it has power: the draft's own first tokens do not fit p_1
    assert not chi2_fits(torch.bincount(x[:, 0], minlength=v), p1)[0]
    # bonus tokens (all accepted) are distributed as p_{γ+1}
    full = out.n_accepted == gamma
    p3 = torch.softmax(target_logits[0, gamma].double(), -1)
    assert chi2_fits(torch.bincount(out.tokens[full, gamma], minlength=v), p3)[0]


# ---- the harness: peaky target and drafts, γ 1..4, temperature with top-k/top-p ------------------

@pytest.fixture(scope="module")
def harness():
    return spec_harness.harness()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_speculative_sampling_is_lossless(harness, case, seed):
    counts, first_round = harness.sample(case, seed)
    # every slot of the first round is inside the window and exercised: a rejection at each of
    # slots 1..γ (accepted 0..γ-1), and the bonus token after all γ accepted
    assert (first_round > 0.02).all(), first_round
    ok, stat, crit = chi2_fits(counts, harness.exact(case), ALPHA)
    assert ok, f"chi2 {stat:.1f} >= critical {crit:.1f}"


def test_model_draft_is_lossless_on_peaky_target(harness):
    """A real draft kind through the harness: a model draft = the target's weights + noise of equal std."""
    draft = build_draft("model", harness.target.config, num_hidden_layers=1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for (name, p), w in zip(draft.net.named_parameters(), harness.target.parameters()):
            p.copy_(w if "norm" in name else w + 0.8 * torch.randn(p.shape, generator=g))
    case = Case("model", 2, 1.5, top_k=4)
    counts, first_round = harness.sample(case, SEEDS[0], draft=draft)
    assert (first_round > 0.02).all(), first_round
    ok, stat, crit = chi2_fits(counts, harness.exact(case), ALPHA)
    assert ok, f"chi2 {stat:.1f} >= critical {crit:.1f}"


def test_harness_drafts_are_sharp_and_far_from_the_target(harness):
    """q-shape bugs only show when q is far from uniform and from p: check the first slot's rows."""
    with torch.no_grad():
        logits = harness.target(torch.tensor([PROMPT + [a] for a in range(V)]))[:, -1]  # (V,V) after token a
    for case in CASES:
        weight = spec_harness.exact_joint(harness.target, 1, **case.settings)  # P(first new token = a)
        p = sampling_probs(logits, **case.settings)
        q = Sampler(**case.settings).probs(harness.drafts[case.draft].table[0]).double()  # slot 1 after token a
        tv_uniform = (weight * (q - 1 / V).abs().sum(-1) / 2).sum()
        tv_target = (weight * (q - p).abs().sum(-1) / 2).sum()
        assert tv_uniform > 0.5 and tv_target > 0.15, (case.id, tv_uniform.item(), tv_target.item())


def test_oracles_agree():
    """The vectorised oracle of the harness equals the row-by-row one above (and both are float64)."""
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(0)) * 3
    settings = [c.settings for c in CASES] + [dict(temperature=0.7, top_k=0, top_p=0.8),
                                              dict(temperature=1.0, top_k=3, top_p=1.0)]
    for s in settings:
        expected = oracle_logprobs(logits, s["temperature"], s["top_k"], s["top_p"]).exp()
        torch.testing.assert_close(sampling_probs(logits, **s), expected, rtol=1e-12, atol=1e-12)


# ---- drawing a token from a row of weights ------------------------------------------------------------

def test_inverse_cdf_picks_each_token_over_its_share_of_u():
    """Deterministic: u at both ends of every token's interval, zero weights never picked, unnormalised
    and batched rows; a token of weight 1e-4 beside 49 151 tokens of weight 1 keeps its interval (the
    fp32 running sum would round it away: 49 151 + 1e-4 == 49 151 in fp32)."""
    from codraft.spec.sampling import inverse_cdf
    w = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0])  # total 4: intervals [0, .5), [.5, .75), [.75, 1)
    u = torch.tensor([0.0, 0.4999, 0.5, 0.7499, 0.75, 0.9999], dtype=torch.float64)
    assert inverse_cdf(w.expand(6, 5), u).tolist() == [1, 1, 3, 3, 4, 4]
    batched = torch.stack([w, w.flip(0)])[:, None].expand(2, 3, 5)  # (2, 3, V), leading dims kept
    assert inverse_cdf(batched, torch.full((2, 3), 0.1, dtype=torch.float64)).tolist() == [[1] * 3, [0] * 3]
    assert inverse_cdf(torch.zeros(5), torch.tensor(0.3, dtype=torch.float64)).item() == 4
    big = torch.ones(49152)
    big[-1] = 1e-4
    assert float(big[:-1].sum() + big[-1]) == float(big[:-1].sum())  # what fp32 would lose
    total = 49151 + 1e-4
    inside = torch.tensor([(49151 + 0.5e-4) / total], dtype=torch.float64)
    assert inverse_cdf(big, inside).item() == 49151
    assert inverse_cdf(big, torch.tensor([(49151 - 0.5) / total], dtype=torch.float64)).item() == 49150


@pytest.mark.parametrize("shape", [(6,), (3, 6), (2, 2, 6)])
def test_sample_follows_the_weights(shape):
    """Sampler.sample against the normalised weights (chi-square, 40 000 draws per row position),
    unnormalised weights with zeros (never drawn); one generator seed reproduces the draws."""
    w = torch.tensor([0.0, 3.0, 1.0, 0.0, 0.5, 0.01]).expand(*shape).contiguous()
    sampler = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(0))
    draws = torch.stack([sampler.sample(w) for _ in range(40_000)])  # (N, *shape[:-1])
    counts = torch.zeros(6).index_add_(0, draws.flatten(), torch.ones(draws.numel()))
    fits, stat, crit = spec_harness.chi2_fits(counts, w.reshape(-1, 6)[0], alpha=1e-4)
    assert fits, (stat, crit, counts.tolist())
    again = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.stack([again.sample(w) for _ in range(100)]), draws[:100])
