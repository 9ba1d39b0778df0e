"""Shared harness of the losslessness tests (test_spec_sampling, test_spec_mutations).

The oracle is exact enumeration: for a target on a vocabulary of 8, the probability of every
L-token continuation of a fixed prompt (8^L cells, L <= 6) is the product of per-token
probabilities computed with full target forwards over every prefix and an independent float64
implementation of temperature/top-k/top-p (pairwise comparisons, no sorting, unlike
``codraft.spec.sampling``). Many speculative samples from one batched ``Engine.generate`` of
identical prompts are compared with it by a chi-square goodness-of-fit test (cells with expected
count < 5 pooled into one).

The drafts here are cheap test doubles: bigram tables (q depends on the previous token and on the
slot in the round), so that tens of thousands of rows can be drafted quickly. They implement the
engine's ``Draft`` interface and report the row they really sample from, like every draft kind.

``Case.adaptive``: ``Engine(gamma="auto")`` with the rule replaced by an adversarial function of
the past (``scrambled_length``: a hash of the round index and the running acceptance estimate, so
each round's g in 0..γ jumps with what the earlier rounds accepted), the hardest choice the
engine allows.
"""
from __future__ import annotations

import copy
import functools
import itertools
import math
from dataclasses import dataclass

import torch

from codraft.drafts.base import Draft
from codraft.models import ModelConfig, Transformer
from codraft.rollout import Engine
import codraft.rollout.engine as engine_mod
import codraft.spec.verify as verify_mod

V, PROMPT = 8, [3, 1, 4, 1]
ALPHA = 1e-4  # per (case, seed) test


def scaled(model: Transformer, std: float, seed: int) -> Transformer:
    """Re-draw the weights with std ``std`` (norms kept): larger std, peakier next-token distributions."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def config(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


# ---- the oracle -------------------------------------------------------------------------------

def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(N,V) logits -> (N,V) float64 probabilities after temperature, top-k, top-p (vectorised oracle).

    Token j survives top-k iff fewer than k tokens are strictly more likely, and top-p iff the
    mass of the strictly more likely survivors is < top_p (the smallest most-likely set reaching
    top_p). Pairwise comparisons instead of the production code's sort and cumsum.
    """
    x = logits.double() / temperature
    above = x[:, None, :] > x[:, :, None]  # (N,V,V): [n, j, i] = token i strictly more likely than j
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k:
        keep &= above.sum(-1) < top_k
    p = torch.softmax(x.masked_fill(~keep, -math.inf), -1)
    if top_p < 1.0:
        keep &= (p[:, None, :] * above).sum(-1) < top_p
        p = torch.softmax(x.masked_fill(~keep, -math.inf), -1)
    return p


def exact_joint(model: Transformer, length: int, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(next ``length`` tokens = s) for all V^length s, by enumeration of every prefix: (V,)*length float64."""
    seqs = torch.zeros(1, 0, dtype=torch.long)
    probs = torch.ones(1, dtype=torch.float64)
    for _ in range(length):
        ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
        with torch.no_grad():
            step = sampling_probs(model(ids.to(model.embed_tokens.weight.device))[:, -1].cpu(), temperature, top_k,
                                  top_p)  # (M,V), the model on any device
        probs = (probs[:, None] * step).flatten()
        seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(len(seqs))[:, None]], 1)
    return probs.view((V,) * length)


# ---- the test statistic -------------------------------------------------------------------------

def chi2_critical(df: int, alpha: float) -> float:
    """Upper-alpha chi-square quantile, Wilson-Hilferty approximation (accurate to ~1% for df >= 10)."""
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - alpha, dtype=torch.float64)).item()
    c = 2.0 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def chi2_fits(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3) -> tuple[bool, float, float]:
    """Goodness of fit, pooling cells with expected count < 5 into one cell: (fits, statistic, critical).

    A sample in a cell of probability exactly 0 (e.g. a token top-k/top-p removes) fails outright
    (statistic inf).
    """
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    expected = n * probs / probs.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    assert len(obs) >= 3, "too few populated cells for a meaningful test"
    crit = chi2_critical(len(obs) - 1, alpha)
    if counts[probs == 0].sum() > 0:
        return False, math.inf, crit
    stat = ((obs - exp) ** 2 / exp).sum().item()
    return stat < crit, stat, crit


def histogram(results, length: int) -> torch.Tensor:
    """Counts of the first ``length`` new tokens of each result over the V^length cells (flat)."""
    tokens = torch.tensor([r.tokens[:length] for r in results])
    assert tokens.shape[1] == length
    index = tokens @ (V ** torch.arange(length - 1, -1, -1))
    return torch.bincount(index, minlength=V ** length)


# ---- cheap drafts -------------------------------------------------------------------------------

class BigramDraft(Draft):
    """q_k = sampler.probs(table[k, previous token]): a draft with no network, for big test batches."""

    def __init__(self, table: torch.Tensor):
        self.table = table.float()  # (slots, V, V) logits; slot k of a round uses table[min(k, slots-1)]
        self.vocab_size = table.shape[-1]

    @classmethod
    def random(cls, seed: int, std: float, slots: int = 4) -> "BigramDraft":
        g = torch.Generator().manual_seed(seed)
        return cls(torch.randn(slots, V, V, generator=g) * std)

    def loss(self, batch):
        raise NotImplementedError

    def save(self, path):
        raise NotImplementedError

    @classmethod
    def load(cls, path, target_config, *, gamma=None, **options):
        raise NotImplementedError

    def begin(self, tokens, lengths, features, *, max_len):
        return tokens.gather(1, (lengths - 1)[:, None])[:, 0]  # (B,) the last context token

    def reported(self, q: torch.Tensor, logits: torch.Tensor, sampler, prev_q: torch.Tensor | None) -> torch.Tensor:
        """The q row returned for a slot: the row its token was drawn from (test subclasses misreport it).

        logits: the slot's raw logits; prev_q: the previous slot's true row (None for the first).
        """
        return q

    def propose(self, state, gamma, sampler, *, context_len):
        prev, tokens, qs, q = state, [], [], None
        for k in range(gamma):
            logits = self.table[min(k, len(self.table) - 1), prev]  # (B,V)
            q, prev_q = sampler.probs(logits), q
            prev = sampler.sample(q)
            tokens.append(prev)
            qs.append(self.reported(q, logits, sampler, prev_q))
        return torch.stack(tokens, 1), torch.stack(qs, 1)

    def commit(self, state, tokens, counts, features):
        return tokens.gather(1, (counts - 1)[:, None])[:, 0]

    def select(self, state, rows):
        return state[rows]


# ---- the harness --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One setting: a draft ("far" or "near"), γ, the sampling transform, and the sample size n.

    The first new token comes from the prefill, so the first round's slots k = 1..γ+1 are the new
    tokens 2..γ+2: a window of L = γ + 2 tokens holds every slot of the first round, its bonus too.
    """
    draft: str
    gamma: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 10_000
    adaptive: bool = False  # gamma="auto" with g per round from ``scrambled_length`` (γ = the maximum)

    @property
    def length(self) -> int:
        return self.gamma + 2

    @property
    def settings(self) -> dict:
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def id(self) -> str:
        s = f"{self.draft}-g{'auto' if self.adaptive else ''}{self.gamma}-t{self.temperature:g}"
        return s + (f"-k{self.top_k}" if self.top_k else "") + (f"-p{self.top_p:g}" if self.top_p < 1 else "")


def fitted_bigram(model: Transformer, slots: int) -> torch.Tensor:
    """(slots,V,V) logits: slot k's table is log P(token k+2 | token k+1) of the first round at T=1, exactly."""
    joint = exact_joint(model, slots + 1)  # P(t_1..t_{slots+1})
    pairs = [joint.sum(dim=[d for d in range(slots + 1) if d not in (k, k + 1)]) for k in range(slots)]
    return torch.stack([(pair / pair.sum(-1, keepdim=True)).log() for pair in pairs]).float()


class Harness:
    """The peaky target, the drafts, and the memoised exact distributions (one per process: ``harness()``).

    target: a 1-layer transformer with weights of std 0.8 (the most likely 5-token continuation
    has probability ~6% at T = 1); drafts: "far", a random bigram table of std 2 (sharp, unrelated
    to the target); "near", the exact first-round bigram conditionals of the target plus N(0,1)
    noise on the logits (sharp, close enough that all γ = 4 drafts are accepted in ~20% of rows).
    """

    def __init__(self):
        self.target = scaled(Transformer(config(1)), 0.8, seed=0)
        noise = torch.randn(4, V, V, generator=torch.Generator().manual_seed(3))
        self.drafts = {"far": BigramDraft.random(seed=1, std=2.0),
                       "near": BigramDraft(fitted_bigram(self.target, slots=4) + noise)}
        self._exact = {}

    def exact(self, case: Case) -> torch.Tensor:
        key = (case.length, case.temperature, case.top_k, case.top_p)
        if key not in self._exact:
            self._exact[key] = exact_joint(self.target, *key)
        return self._exact[key]

    def sample(self, case: Case, seed: int, n: int | None = None,
               draft: Draft | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """n speculative samples (one batched generate): counts over the V^L cells (flat), and the
        fractions of rows that accepted exactly 0..γ draft tokens in the first round."""
        first = []
        rule = engine_mod.verify_drafts  # whatever is installed (tests monkeypatch it with mutants)
        # the engine's rule in C (codraft.kernels.sampling) where it applies, unless a mutant is installed
        saved_fast = engine_mod.fast_verify
        fast = saved_fast if rule is verify_mod.verify_drafts else (lambda *args: None)

        def note(n_accepted):
            if not first:
                first.append(torch.bincount(n_accepted, minlength=case.gamma + 1) / len(n_accepted))

        def spy(*args):
            verdict = rule(*args)
            note(verdict.n_accepted)
            return verdict

        def fast_spy(*args):
            out = fast(*args)
            if out is not None:
                note(out[0])
            return out

        draft = draft or self.drafts[case.draft]
        if case.adaptive:
            draft = copy.copy(draft)
            draft.default_gamma = case.gamma  # the most a round drafts
            engine = Engine(self.target, draft, gamma="auto", cost_model=object())  # the rule ignores costs
        else:
            engine = Engine(self.target, draft, gamma=case.gamma)
        choose = engine_mod.choose
        engine_mod.verify_drafts, engine_mod.fast_verify = spy, fast_spy
        rounds = itertools.count()
        engine_mod.choose = (lambda rows, acceptance, cost: scrambled_length(next(rounds), acceptance)) \
            if case.adaptive else choose
        try:
            results = engine.generate([PROMPT] * (n or case.n), case.length, seed=seed, eos_id=[], **case.settings)
        finally:
            engine_mod.verify_drafts, engine_mod.choose, engine_mod.fast_verify = rule, choose, saved_fast
        return histogram(results, case.length), first[0]

    def check(self, case: Case, seed: int, alpha: float = ALPHA, n: int | None = None,
              draft: Draft | None = None) -> tuple[bool, float, float]:
        """The harness's verdict on one case: (fits, chi-square statistic, critical value)."""
        return chi2_fits(self.sample(case, seed, n, draft)[0], self.exact(case), alpha)


def scrambled_length(round_index: int, acceptance: list[float]) -> int:
    """g in 0..len(acceptance) from a hash of the round's index and the acceptance estimate (a function
    of every earlier verdict). hash() of ints and floats is the same in every process."""
    return hash((round_index, *acceptance)) % (len(acceptance) + 1)


@functools.cache
def harness() -> Harness:
    return Harness()


# Settings of the losslessness test: γ = 1..4 (the first round's bonus lands inside the window in
# every case), temperatures 0.8..2 with top-k, top-p and both. Every draft row is far from uniform.
CASES = [
    Case("near", 4, 1.0),
    Case("near", 3, 1.4, top_k=4),
    Case("near", 2, 0.8, top_p=0.9),
    Case("far", 2, 2.0, top_k=3, top_p=0.9),
    Case("far", 1, 1.3, top_p=0.85),
]
SEEDS = (0, 1, 2)  # the correct rule must pass every case at every seed (15 tests at ALPHA)

# The same test with a number of drafts that changes every round (0..4), as a function of the
# past verdicts: at three temperatures, with a top-p and a top-k.
ADAPTIVE_CASES = [
    Case("near", 4, 0.7, adaptive=True),
    Case("near", 4, 1.0, top_p=0.9, adaptive=True),
    Case("far", 4, 1.5, top_k=4, adaptive=True),
]
