"""Speculative sampling is lossless: emitted tokens follow the target's exact distribution.

Oracle: on a vocabulary of 8, the probability of every 3-token continuation (8^3 = 512
cells) is computed by enumeration with full target forwards and an independent float64
implementation of temperature/top-k/top-p. Thousands of speculative samples (one batched
generate call of identical prompts, with a deliberately poor draft so that rejections
happen at every position) are compared with a chi-square goodness-of-fit test at a fixed
seed; cells with expected count < 5 are pooled. Negative controls show the test has power:
samples from the draft, and from a rule with a planted bug, are rejected by the same test.
"""
import math

import pytest
import torch

from codraft.drafts import build_draft
from codraft.models import ModelConfig, Transformer
from codraft.rollout import Engine, Sampler, verify_drafts
import codraft.spec.verify as verify_mod

V, PROMPT, N_NEW = 8, [3, 1, 4, 1], 3


def _scaled(model: Transformer, std: float, seed: int) -> Transformer:
    """Re-draw the weights with a larger std so the next-token distributions are far from uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def _config(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


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


def chi2_critical(df: int, alpha: float) -> float:
    """Upper-alpha chi-square quantile, Wilson-Hilferty approximation (accurate to ~1% for df >= 10)."""
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - alpha)).item()
    c = 2.0 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def chi2_fits(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3) -> tuple[bool, float, float]:
    """Goodness of fit, pooling cells with expected count < 5 into one cell."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    expected = n * probs / probs.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    assert len(obs) >= 3, "too few populated cells for a meaningful test"
    stat = ((obs - exp) ** 2 / exp).sum().item()
    crit = chi2_critical(len(obs) - 1, alpha)
    return stat < crit, stat, crit


def _histogram(results) -> torch.Tensor:
    counts = torch.zeros(V ** N_NEW)
    for r in results:
        assert len(r.tokens) == N_NEW
        a, b, c = r.tokens
        counts[(a * V + b) * V + c] += 1
    return counts


N = 4000
CASES = [  # (settings, gamma): γ=1 exercises the bonus token within 3 new tokens, γ=2 a second draft position
    (dict(temperature=1.0), 1),
    (dict(temperature=1.0), 2),
    (dict(temperature=0.7, top_p=0.8), 2),
    (dict(temperature=1.0, top_k=3), 1),
]


@pytest.mark.parametrize("settings,gamma", CASES, ids=["t1-g1", "t1-g2", "t0.7-p0.8-g2", "k3-g1"])
def test_model_draft_is_lossless(target, exact, settings, gamma):
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
    """A classic bug, resampling from p instead of norm(max(0, p - q)) after a rejection, is caught."""
    monkeypatch.setattr(verify_mod, "residual", lambda p, q: p)
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
