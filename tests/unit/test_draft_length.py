"""Adaptive draft length (``codraft.rollout.draft_length``, ``Engine(gamma="auto")``).

Oracles: the rule against hand-computed costs (injected cost models, never timing): no
speculation when it loses, small g at many rows and large g at one row, in ``choose`` and in the
engine as rows finish; the acceptance estimate's counting convention; the calibration cache
(a file recorded on another machine or unreadable is recalibrated and rewritten, never
trusted); losslessness with the number of drafts changing every round as a function of the
past (``spec_harness``: chi-square against the exact enumerated distribution); the trainer's
metrics and an exact resume with draft_length=auto.
"""
import copy
import json
import warnings

import pytest
import torch

import codraft.rollout.draft_length as dl
import codraft.rollout.engine as engine_mod
import spec_harness
from codraft import kernels
from codraft.drafts import build_draft
from codraft.kernels import dispatch, fast_layers
from codraft.models import ModelConfig, Transformer
from codraft.rl import trainer as trainer_mod
from codraft.rl.logger import read_metrics
from codraft.rl.trainer import Trainer, train
from codraft.rollout import AcceptanceEstimate, CostModel, Engine, choose, load_or_calibrate
from spec_harness import ADAPTIVE_CASES, SEEDS, harness, scaled
from tiny_runs import run_config, comparable

PROMPTS = [[5, 17, 3], [9, 9, 40, 2, 33, 7, 1, 12, 60], [4]]


class Cost:
    """target = fixed + per_token·rows·tokens, draft = commit + per_draft·rows·g (seconds)."""

    def __init__(self, fixed=1.0, per_token=0.0, commit=0.0, per_draft=0.0):
        self.fixed, self.per_token, self.commit, self.per_draft = fixed, per_token, commit, per_draft

    def target(self, rows, tokens):
        return self.fixed + self.per_token * rows * tokens

    def draft(self, rows, g):
        return self.commit + self.per_draft * rows * g


# ---------------------------------------------------------------- the rule


def test_no_speculation_when_it_loses():
    good = [0.9, 0.8, 0.7, 0.6]
    assert choose(4, good, Cost(per_draft=0.01)) == 4  # memory-bound target, cheap draft: draft all
    assert choose(4, good, Cost(per_draft=10.0)) == 0  # a very expensive draft
    assert choose(4, [0.01] * 4, Cost(per_draft=0.01)) == 0  # nothing is accepted
    assert choose(4, [0.0] * 4, Cost()) == 0  # free drafts that are never accepted: ties go to g = 0
    assert choose(1, [0.5, 0.0, 0.0], Cost(fixed=1.0, per_token=0.1)) == 1  # positions past 1 never pay


def test_g_grows_as_rows_finish():
    """A target whose cost grows with rows x tokens (compute-bound at many rows): few drafts at
    64 rows, many at one row, and never fewer as rows leave."""
    cost, acc = Cost(fixed=1.0, per_token=0.05, per_draft=0.005), [0.8, 0.64, 0.51, 0.41, 0.33, 0.26]
    by_rows = {r: choose(r, acc, cost) for r in (64, 32, 16, 8, 4, 2, 1)}
    assert by_rows[64] <= 1 and by_rows[1] == 6
    assert list(by_rows.values()) == sorted(by_rows.values())


def test_acceptance_estimate_counts_drafted_positions_only():
    est = AcceptanceEstimate(3, prior=0.5, weight=2.0, decay=1.0)
    assert est.values() == [0.5, 0.25, 0.125]
    est.observe(10, [6, 3])  # 10 rows drafted 2 tokens: 6 accepted >= 1, 3 accepted both
    assert est.drafted == [10, 10, 0] and est.accepted == [6, 3, 0]
    assert est.values() == pytest.approx([7 / 12, 3.5 / 12, 0.125])
    est.observe(10, [])  # a g = 0 round: nothing drafted, nothing counted
    assert est.drafted == [10, 10, 0]
    est.observe(4, [4, 4, 4])  # position 3 beats position 2 on few rows: kept non-increasing
    v = est.values()
    assert v == sorted(v, reverse=True) and v[2] == v[1]
    other = AcceptanceEstimate(3)
    other.load_state_dict(est.state_dict())
    assert other.drafted == est.drafted and other.accepted == est.accepted
    with pytest.raises(ValueError, match="this engine drafts up to 2"):
        AcceptanceEstimate(2).load_state_dict(est.state_dict())


def test_forgetting_brings_back_the_prior():
    """Counts fade each round, so positions no longer drafted drift back to the (optimistic)
    prior and the rule tries them again; the first rounds of a fresh engine speculate."""
    est = AcceptanceEstimate(2)
    assert choose(8, est.values(), Cost(per_draft=0.05)) == 2
    est.observe(8, [0, 0])  # a useless draft
    assert choose(8, est.values(), Cost(per_draft=0.05)) == 0
    for _ in range(200):
        est.observe(8, [])
    assert choose(8, est.values(), Cost(per_draft=0.05)) == 2


def test_cost_model_interpolates_in_rows():
    cost = CostModel((1, 2, 4), ((1.0, 2.0), (2.0, 3.0), (4.0, 7.0)), ((0.1, 0.2), (0.2, 0.4), (0.4, 0.8)))
    assert cost.max_gamma == 1 and cost.target(2, 2) == 3.0 and cost.draft(4, 1) == 0.8
    assert cost.target(3, 1) == 3.0 and cost.target(3, 2) == 5.0  # linear between grid points
    assert cost.target(8, 1) == 8.0 and cost.draft(6, 0) == pytest.approx(0.6)  # the last segment extended


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return scaled(Transformer(cfg), 0.3, seed=0)


def test_engine_drafts_more_once_rows_finish(target, monkeypatch):
    """Rows 0 and 2 stop at EOS early; the draft (a copy of the target) is always right. With a
    cost that grows with rows: no drafts while 3 rows run, drafts once row 1 runs alone."""
    plain = Engine(target).generate(PROMPTS, 24, temperature=0, eos_id=[])

    def cuts(eos):
        return [next((i + 1 for i, t in enumerate(p.tokens) if t in eos), 24) for p in plain]
    eos = next([a, b] for a in plain[0].tokens[2:6] for b in plain[2].tokens[2:6]
               if cuts([a, b])[1] == 24 and min(cuts([a, b])[::2]) >= 3)  # rows 0 and 2 stop after a round
    draft = build_draft("model", target.config, num_hidden_layers=2, weights=target.state_dict())
    seen = []

    def spy(rows, acceptance, cost):
        seen.append((rows, choose(rows, acceptance, cost)))
        return seen[-1][1]
    monkeypatch.setattr(engine_mod, "choose", spy)
    engine = Engine(target, draft, gamma="auto", cost_model=Cost(fixed=1.0, per_token=0.5, per_draft=0.5))
    out = engine.generate(PROMPTS, 24, temperature=0, eos_id=eos)
    assert [r.tokens for r in out] == [p.tokens[:n] for p, n in zip(plain, cuts(eos))]
    assert {g for rows, g in seen if rows == 3} == {0} and max(g for rows, g in seen if rows == 1) >= 1
    s = engine.stats
    assert s.gamma_chosen[0] >= 2 and sum(s.gamma_chosen[1:]) >= 1 and s.mean_gamma > 0
    assert s.acceptance_per_position[0] == 1.0  # over the row-rounds that drafted it, not all row-rounds


@pytest.mark.parametrize("case", ADAPTIVE_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("seed", SEEDS)
def test_varying_draft_lengths_are_lossless(case, seed, monkeypatch):
    """The number of drafts changes every round with the past verdicts; the first γ + 2 tokens
    still follow the target's exact distribution (chi-square, alpha 1e-4)."""
    chosen, scrambled = [], spec_harness.scrambled_length

    def record(round_index, acceptance):
        chosen.append(scrambled(round_index, acceptance))
        return chosen[-1]
    monkeypatch.setattr(spec_harness, "scrambled_length", record)
    fits, stat, crit = harness().check(case, seed)
    assert fits, f"{case.id} seed {seed}: chi2 {stat:.1f} >= {crit:.1f}"
    assert len(set(chosen)) >= 2  # the rule was in force, and the choice varied


# ---------------------------------------------------------------- calibration and its cache


@pytest.fixture
def small():
    """A 1-layer target and an ngram draft: a calibration takes a fraction of a second."""
    cfg = ModelConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model = Transformer(cfg).eval()
    return model, build_draft("ngram", cfg, gamma=2)


@pytest.fixture
def calibrations(monkeypatch):
    """Counts the calibrations load_or_calibrate runs (each with one repeat, to be quick)."""
    calls = []
    real = dl.calibrate

    def counted(model, draft, max_gamma, rows):
        calls.append(rows)
        return real(model, draft, max_gamma, rows, repeats=1)
    monkeypatch.setattr(dl, "calibrate", counted)
    return calls


def test_calibration_times_the_grid_without_touching_the_global_rng(small, capsys):
    model, draft = small
    rng = torch.get_rng_state()
    cost = dl.calibrate(model, draft, 2, 3, repeats=1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert cost.rows == (1, 2, 4) and cost.max_gamma == 2
    assert all(len(r) == 3 and min(r) > 0 for r in cost.target_s + cost.draft_s)
    assert "calibrating draft length on cpu: 36/36 timings in" in capsys.readouterr().err


def test_cache_is_reused_and_a_doctored_or_corrupt_file_is_recalibrated(small, calibrations, tmp_path):
    model, draft = small
    first = load_or_calibrate(model, draft, 2, 2, folder=tmp_path)
    (path,) = tmp_path.glob("*.json")
    assert load_or_calibrate(model, draft, 2, 2, folder=tmp_path) == first and calibrations == [2]
    saved = json.loads(path.read_text())
    assert saved["key"]["machine"] == dl.machine_key(torch.device("cpu"))
    assert saved["key"]["machine"]["threads"] == torch.get_num_threads()

    for field, value in (("threads", 999), ("processor", "another CPU"), ("device", "cuda:7")):
        doctored = json.loads(path.read_text())
        doctored["key"]["machine"][field] = value
        doctored["target_s"] = [[1e9] * 3] * len(doctored["rows"])
        path.write_text(json.dumps(doctored))
        with pytest.warns(UserWarning, match="recorded for another setting"):
            cost = load_or_calibrate(model, draft, 2, 2, folder=tmp_path)
        assert cost.target(1, 1) < 1e9 and json.loads(path.read_text())["key"] == saved["key"]  # rewritten
    assert len(calibrations) == 4

    for text in ("{not json", json.dumps({"key": saved["key"], "rows": [1], "target_s": [], "draft_s": []})):
        path.write_text(text)
        with pytest.warns(UserWarning, match="unreadable draft-length calibration"):
            load_or_calibrate(model, draft, 2, 2, folder=tmp_path)
        assert json.loads(path.read_text())["key"] == saved["key"]
    assert len(calibrations) == 6

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_or_calibrate(model, draft, 2, 5, folder=tmp_path).rows == (1, 2, 4, 8)  # a bigger batch
        assert load_or_calibrate(model, draft, 2, 3, folder=tmp_path).rows == (1, 2, 4, 8)  # covered
    assert calibrations[-1] == 5 and len(calibrations) == 7 and len(list(tmp_path.glob("*.json"))) == 1


def test_cache_key_follows_the_model_draft_and_threads(small, calibrations, tmp_path):
    model, draft = small
    load_or_calibrate(model, draft, 2, 1, folder=tmp_path)
    load_or_calibrate(model, build_draft("ngram", model.config, n=4, gamma=2), 2, 1, folder=tmp_path)
    load_or_calibrate(model, draft, 1, 1, folder=tmp_path)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        load_or_calibrate(model, draft, 2, 1, folder=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert len(calibrations) == 4 and len(list(tmp_path.glob("*.json"))) == 4


def test_cache_key_follows_the_kernels_build(small, calibrations, tmp_path, monkeypatch):
    """A calibration timed on another build of the C kernels (they changed, or were turned off) is not
    reused: the decode path is part of the key."""
    model, draft = small
    fast = kernels.enable(copy.deepcopy(model))
    assert isinstance(fast, fast_layers.FastTransformer)  # (the suite needs the C compiler: test_gemv)
    load_or_calibrate(fast, draft, 2, 1, folder=tmp_path)
    load_or_calibrate(fast, draft, 2, 1, folder=tmp_path)
    assert len(calibrations) == 1
    monkeypatch.setattr(fast_layers.FastTransformer, "decode_path", property(lambda self: "kernels-rebuilt.so"))
    load_or_calibrate(fast, draft, 2, 1, folder=tmp_path)
    assert len(calibrations) == 2 and len(list(tmp_path.glob("*.json"))) == 2
    keys = [json.loads(p.read_text())["key"]["model"]["decode_path"] for p in tmp_path.glob("*.json")]
    assert sorted(keys) == sorted([dispatch.machine()["kernels"], "kernels-rebuilt.so"])


def test_engine_calibrates_once_into_the_cache_folder(small, calibrations, tmp_path, monkeypatch):
    model, draft = small
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path))
    engine = Engine(model, draft, gamma="auto")
    assert engine.cost_model is None  # calibrated at the first call, for its batch
    out = engine.generate(PROMPTS, 6, seed=0, eos_id=[])
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1 and calibrations == [3]
    assert all(len(r.tokens) == 6 for r in out) and sum(engine.stats.gamma_chosen) == engine.stats.rounds
    engine.generate(PROMPTS[:2], 6, seed=0, eos_id=[])
    Engine(model, draft, gamma="auto").generate(PROMPTS, 6, seed=0, eos_id=[])  # from the file
    assert calibrations == [3]


# ---------------------------------------------------------------- the trainer


def test_trainer_auto_logs_the_histogram_and_resumes_exactly(tmp_path, tiny_policy_dir, monkeypatch):
    """rollout.draft_length=auto: metrics carry τ and the drafts-per-round histogram; the running
    acceptance estimates (rollout and frozen probe) are checkpointed, so a run cut at step 2 and
    resumed repeats the uninterrupted one (a fixed cost model: timing plays no part)."""
    cost = CostModel((1,), ((1.0, 1.0, 1.0, 1.0),), ((0.0, 0.1, 0.2, 0.3),))
    monkeypatch.setattr(trainer_mod, "load_or_calibrate", lambda policy, draft, gamma, rows: cost)
    extra = ["rollout.draft_length=auto", "log.frozen_probe_every=1", "log.val_every=0"]
    train(run_config(tiny_policy_dir, tmp_path / "full", 4, extra=extra), progress=False)
    real_step = Trainer.step

    def crash_at_2(self, step):
        if step == 2:
            raise KeyboardInterrupt  # after the step-2 checkpoint
        return real_step(self, step)
    monkeypatch.setattr(Trainer, "step", crash_at_2)
    with pytest.raises(KeyboardInterrupt):
        train(run_config(tiny_policy_dir, tmp_path / "cut", 4, extra=extra), progress=False)
    monkeypatch.setattr(Trainer, "step", real_step)
    state = json.loads((tmp_path / "cut" / "step_2" / "state.json").read_text())
    assert set(state["acceptance"]) == {"rollout", "frozen"} and len(state["acceptance"]["rollout"]["drafted"]) == 3
    train(run_config(tiny_policy_dir, tmp_path / "cut", 4, extra=extra), resume=str(tmp_path / "cut"), progress=False)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    steps = [r for r in full if "reward_mean" in r]
    assert len(steps) == 4 and all(len(r["gamma_chosen"]) == 4 and "acceptance_length" in r for r in steps)
    assert steps[0]["gamma_chosen"][3] >= 1 and all(0 <= r["gamma_mean"] <= 3 for r in steps)
    assert comparable(full) == comparable(cut)
