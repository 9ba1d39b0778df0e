"""Multi-turn episodes on the engine (codraft.rollout.turns): a row's observation appended to its own
cache gives the logits a fresh forward over the whole history gives, greedy speculative episodes equal
plain ones token for token with every draft kind, and observation tokens are masked outputs."""
from __future__ import annotations

import math

import pytest
import torch

from codraft.drafts import build_draft
from codraft.models import ModelConfig, Transformer
from codraft.rollout import Engine
from codraft.rollout.turns import run_episodes
from spec_harness import scaled

V = 61
PROMPTS = [[5, 17, 3], [9, 9, 40, 2, 33, 7, 1, 12, 60], [4], [22, 23]]
STOP = list(range(3, 12))  # frequent: turns end after a few tokens


class Scripted:
    """An environment double answering in the caller's thread: each turn's observation is a function of
    the turn's tokens (1 to 4 tokens), and the third turn ends the episode."""

    def __init__(self, ends_after: int = 3):
        self.pending, self.turns, self.queue, self.ends_after = 0, {}, [], ends_after

    def submit(self, row, turn):
        self.turns[row] = self.turns.get(row, 0) + 1
        self.pending += 1
        obs = None if self.turns[row] >= self.ends_after else \
            [(sum(turn) + i * 7) % V for i in range(1 + (sum(turn) + row) % 4)]
        self.queue.append((row, obs))

    def ready(self, wait):
        out, self.queue = self.queue, []
        self.pending -= len(out)
        return out


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    return scaled(Transformer(cfg), 0.3, seed=0)


def _draft(kind, target):
    torch.manual_seed(1)
    if kind is None:
        return None
    if kind in ("eagle3", "dflash", "dspark"):
        return build_draft(kind, target.config, target=target)
    if kind == "model-self":
        return build_draft("model", target.config, num_hidden_layers=3, weights=target.state_dict())
    return build_draft(kind, target.config, **({"n": 3} if kind == "ngram" else {"num_hidden_layers": 1}))


def _episodes(engine, temperature=0.0, seed=0, max_tokens=40, **kw):
    out = run_episodes(engine, PROMPTS, Scripted(), max_tokens=max_tokens, max_turns=5, stop=STOP, eos_id=[],
                          temperature=temperature, seed=seed, **kw)
    return out


@pytest.mark.parametrize("kind", ["model", "model-self", "ngram", "eagle3", "dflash", "dspark"])
def test_greedy_speculative_episodes_equal_plain(target, kind):
    plain = _episodes(Engine(target))
    spec = _episodes(Engine(target, _draft(kind, target), gamma=3))
    assert max(r.turns for r in plain) >= 3  # the observations really were appended, more than once
    for a, b in zip(plain, spec):
        assert (a.tokens, a.mask, a.turns, a.finish_reason) == (b.tokens, b.mask, b.turns, b.finish_reason)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


@pytest.mark.parametrize("kind", [None, "model", "ngram", "eagle3", "dflash", "dspark"])
def test_policy_logprobs_equal_a_fresh_forward_over_the_history(target, kind):
    """T = 1: every policy token's logprob equals the one a forward over prompt + all earlier tokens
    (observations included) gives: the appended observation left the cache as a full prefill would."""
    out = _episodes(Engine(target, _draft(kind, target), gamma=None if kind is None else 3), temperature=1.0, seed=3)
    checked = 0
    for prompt, r in zip(PROMPTS, out):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + r.tokens]))[0, len(prompt) - 1:-1].double()
        ref = logits.log_softmax(-1).gather(1, torch.tensor(r.tokens)[:, None])[:, 0].tolist()
        for j, (m, lp) in enumerate(zip(r.mask, r.logprobs)):
            if m:
                assert abs(lp - ref[j]) <= 1e-4, (j, lp, ref[j])
                checked += j > 0 and not r.mask[j - 1]  # the first token after an observation
            else:
                assert lp == 0.0
    assert checked >= 2


def test_observations_are_masked_outputs(target):
    env = Scripted()
    out = run_episodes(Engine(target), PROMPTS, env, max_tokens=60, max_turns=5, stop=STOP, eos_id=[],
                          temperature=0.0)
    for r in out:
        assert len(r.mask) == len(r.tokens)
        # a policy turn ends with a stop token; an observation follows it (the last turn has none)
        obs_starts = [j for j in range(1, len(r.mask)) if not r.mask[j] and r.mask[j - 1]]
        assert all(r.tokens[j - 1] in STOP for j in obs_starts)
        assert len(obs_starts) == r.turns - 1
        if r.finish_reason == "eos":
            assert r.turns == 3 and r.tokens[-1] in STOP


def test_budgets_end_episodes(target):
    out = run_episodes(Engine(target), PROMPTS, Scripted(ends_after=99), max_tokens=40, max_turns=2, stop=STOP,
                          eos_id=[], temperature=0.0)
    assert {r.finish_reason for r in out} <= {"turns", "length", "context"}
    assert all(r.turns <= 2 and len(r.tokens) <= 40 for r in out)
    with pytest.raises(ValueError, match="max_turns"):
        run_episodes(Engine(target), PROMPTS, Scripted(), max_tokens=10, max_turns=0, stop=STOP)


def test_an_observation_longer_than_the_room_left_ends_the_episode(target):
    class Long(Scripted):
        def submit(self, row, turn):
            super().submit(row, turn)
            self.queue[-1] = (row, [7] * 30)  # more than max_tokens leaves after any turn
    out = run_episodes(Engine(target), PROMPTS, Long(), max_tokens=30, max_turns=5, stop=STOP, eos_id=[],
                       temperature=0.0)
    assert {r.finish_reason for r in out} <= {"context", "length"} and "context" in {r.finish_reason for r in out}
    assert all(r.turns == 1 and all(r.mask) for r in out)  # nothing of it was appended


def test_seeded_episodes_repeat(target):
    engine = Engine(target, _draft("dflash", target), gamma=3)
    a, b = (_episodes(engine, temperature=1.0, seed=11) for _ in range(2))
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert not math.isnan(sum(sum(r.logprobs) for r in a))


def test_exact_distribution_after_an_observation():
    """T = 1: the first token, then an observation appended to every row's cache, then L = γ + 2 tokens
    (the target's sample from the observation's last logits, then a whole speculative round with its bonus):
    their joint distribution is the enumerated one over prompt + first token + observation (chi-square)."""
    from spec_harness import PROMPT, V as V8, chi2_fits, config, exact_joint, sampling_probs
    from codraft.rollout.turns import TurnRollout
    target = scaled(Transformer(config(2)), 0.35, seed=0)
    torch.manual_seed(1)
    draft = build_draft("model", config(2), num_hidden_layers=1)
    scaled(draft.net, 0.1, 1)  # flatter than the target: rounds reject as well as accept
    obs, gamma, n = [6, 2], 2, 6000
    window = gamma + 2
    run = Engine(target, draft, gamma=gamma).start([PROMPT] * n, 1 + len(obs) + window, seed=0, eos_id=[],
                                                  kind=TurnRollout)
    run._leave(list(range(n)), [])  # every row ends its turn after its first token ...
    run.rejoin([(r, obs) for r in range(n)])  # ... and its observation comes back
    while not run.finished:
        run.step()
    res = run.results()
    assert all(r.mask == [True, False, False] + [True] * window and r.tokens[1:3] == obs for r in res)
    with torch.no_grad():
        first = sampling_probs(target(torch.tensor([PROMPT]))[:, -1], 1.0)[0]  # (V,)
    joint = torch.stack([first[t] * exact_joint(target, window, prompt=PROMPT + [t] + obs) for t in range(V8)])
    seqs = torch.tensor([[r.tokens[0]] + r.tokens[1 + len(obs):] for r in res])  # (n, 1 + window)
    counts = torch.bincount(seqs @ (V8 ** torch.arange(window, -1, -1)), minlength=V8 ** (window + 1))
    fits, stat, crit = chi2_fits(counts, joint, alpha=1e-4)
    assert fits, f"chi-square {stat:.1f} >= {crit:.1f}"
    # the same samples against the distribution without the observation: the test can tell them apart
    wrong = torch.stack([first[t] * exact_joint(target, window, prompt=PROMPT + [t]) for t in range(V8)])
    assert not chi2_fits(counts, wrong, alpha=1e-4)[0]
