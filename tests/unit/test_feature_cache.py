"""Offline draft training from cached target features: a cached batch is the live batch (features,
teacher logits and every kind's loss, against a target forward written out here), training runs
no target forward per step, and a cache made from another policy, task or tap set is refused."""
from __future__ import annotations

import copy

import pytest
import torch

from codraft.drafts import DraftBatch, available_drafts, build_draft, draft_kind, init_draft
from codraft.drafts.batch import supervised_rows
from codraft.models import Transformer
from codraft.policy.warmstart import tiny_model_config
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer
from codraft.train import feature_cache
from codraft.train.feature_cache import FeatureCache, identity
from codraft.train.offline_draft import shared_layers, train_offline
from codraft.train.packing import pack

WEIGHTED = [k for k in available_drafts() if draft_kind(k).has_weights]


@pytest.fixture(scope="module")
def tiny():
    tok = CharTokenizer()
    torch.manual_seed(0)
    return Transformer(tiny_model_config(tok)).eval(), tok, make_task("arith")


def _ident(task, **kw):
    base = dict(policy_name="tiny", policy_key="k0", task=task, n_prompts=10, max_new_tokens=12, seed=0,
                temperature=1.0, layers=[0, 1])
    return identity(**{**base, **kw})


@pytest.fixture(scope="module")
def cache(tiny):
    policy, tok, task = tiny
    layers = shared_layers(policy.config)
    return feature_cache.build(policy, tok, task, layers=layers, n_prompts=10, max_new_tokens=12, seed=0,
                               ident=_ident(task, layers=layers), progress=False)


@torch.no_grad()
def live_batch(policy, sequences, layers) -> DraftBatch:
    """The oracle: the target run over exactly these sequences, as the co-training step does."""
    p = pack([s[0] for s in sequences], [s[1] for s in sequences], share_prompts=False)
    hidden, feats = policy(p.input_ids, cu_seqlens=p.cu_seqlens, taps=tuple(layers), head=False)
    rows = supervised_rows(p.completion)
    return DraftBatch(p.input_ids, p.cu_seqlens, p.completion, feats, policy.logits(hidden[0, rows]), rows)


@pytest.mark.parametrize("kind", WEIGHTED)
def test_cached_batch_is_the_live_batch(tiny, cache, kind):
    policy = tiny[0]
    torch.manual_seed(3)
    draft = init_draft(kind, policy, gamma=3)
    idx = [7, 2, 5]
    got = cache.batch(policy, idx, draft.feature_layers)
    want = live_batch(policy, [cache.sequences[i] for i in idx], draft.feature_layers)
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.cu_seqlens, want.cu_seqlens)
    assert torch.equal(got.loss_mask, want.loss_mask) and torch.equal(got.teacher_rows, want.teacher_rows)
    assert sorted(got.features) == sorted(draft.feature_layers)
    for l in draft.feature_layers:
        torch.testing.assert_close(got.features[l], want.features[l], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.teacher_logits, want.teacher_logits, rtol=1e-5, atol=1e-5)
    losses = []
    for batch in (got, want):
        torch.manual_seed(11)  # same anchor draws for the block drafts
        losses.append(draft.loss(batch)[0])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_training_runs_no_target_forward(tiny, cache, tmp_path, monkeypatch):
    policy, tok, task = tiny
    draft = init_draft("dflash", policy, gamma=3)
    calls = []
    monkeypatch.setattr(type(policy), "forward", lambda *a, **k: calls.append(1))
    report = train_offline(policy, tok, task, draft, out_dir=tmp_path / "d", steps=3, batch_sequences=4,
                           progress=False, features=cache)
    assert calls == [] and report["steps"] == 3 and (tmp_path / "d" / "draft").is_dir()


def test_save_load_roundtrip_and_identity_checks(tiny, cache, tmp_path):
    task = tiny[2]
    folder = cache.save(tmp_path / "fc")
    back = FeatureCache.load(folder, expect=cache.identity)
    assert back.sequences == cache.sequences and back.layers == cache.layers
    assert all(torch.equal(back.features[l], cache.features[l]) for l in cache.layers)
    assert torch.equal(back.last, cache.last) and torch.equal(back.offsets, cache.offsets)
    with pytest.raises(ValueError, match=r"made from policy 'tiny' \(weights k0\), not 'smollm2' \(weights k9\)"):
        FeatureCache.load(folder, expect=_ident(task, policy_name="smollm2", policy_key="k9"))
    other = make_task("arith", style="steps")
    with pytest.raises(ValueError, match=r"made from task 'arith' .*'style': 'rewrite'.*not 'arith' .*'style': 'steps'"):
        FeatureCache.load(folder, expect=_ident(other))
    with pytest.raises(ValueError, match="differs in max_new_tokens, seed"):
        FeatureCache.load(folder, expect=_ident(task, layers=cache.layers, seed=1, max_new_tokens=99))
    with pytest.raises(ValueError, match=r"not \[7\]"):
        FeatureCache.load(folder, expect=_ident(task, layers=[*cache.layers, 7]))
    with pytest.raises(FileNotFoundError, match="not a feature cache"):
        FeatureCache.load(tmp_path)


def test_a_draft_reading_layers_the_cache_lacks_is_refused(tiny, cache):
    with pytest.raises(ValueError, match=r"missing \[9\]"):
        cache.batch(tiny[0], [0], (cache.layers[0], 9))


def test_cached_builds_once(tiny, tmp_path, monkeypatch):
    policy, tok, task = tiny
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path))
    kw = dict(policy_name="tiny", policy_key="k0", layers=[0], n_prompts=3, max_new_tokens=5, seed=0, progress=False)
    first = feature_cache.cached(policy, tok, task, **kw)
    monkeypatch.setattr(feature_cache, "build", lambda *a, **k: pytest.fail("rebuilt a cached feature set"))
    again = feature_cache.cached(policy, tok, task, **kw)
    assert again.sequences == first.sequences and torch.equal(again.last, first.last)
    folders = [f for f in (tmp_path / "features").iterdir() if f.is_dir()]  # (and the build's lock file)
    assert len(folders) == 1 and folders[0].name.startswith("arith-")


def test_an_interrupted_build_continues_where_it_stopped(tiny, tmp_path, monkeypatch):
    """Sampling the real model's completions takes minutes: what an interrupted build had sampled is kept
    beside the cache, and the next build samples only the rest. The cache equals an uninterrupted one's."""
    policy, tok, task = tiny
    kw = dict(policy_name="tiny", policy_key="k0", layers=[0], n_prompts=5, max_new_tokens=6, seed=0, progress=False)
    monkeypatch.setattr(feature_cache, "SAMPLE_BATCH", 2)  # batches of 2, 2 and 1 prompts
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "whole"))
    whole = feature_cache.cached(policy, tok, task, **kw)
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "cut"))
    calls, real = [], feature_cache.Engine.generate

    def generate(self, prompts, *a, **k):
        calls.append(len(prompts))
        if len(calls) == 2 and stop:
            raise KeyboardInterrupt  # Ctrl-C during the second batch
        return real(self, prompts, *a, **k)
    monkeypatch.setattr(feature_cache.Engine, "generate", generate)
    stop = True
    with pytest.raises(KeyboardInterrupt):
        feature_cache.cached(policy, tok, task, **kw)
    (kept,) = (tmp_path / "cut" / "features").glob("*.sampled.json")
    assert not [f for f in (tmp_path / "cut" / "features").iterdir() if f.is_dir()]  # nothing that looks done
    calls.clear()
    stop = False
    again = feature_cache.cached(policy, tok, task, **kw)
    assert calls == [2, 1]  # the first batch was not sampled again
    assert again.sequences == whole.sequences and torch.equal(again.last, whole.last)
    assert torch.equal(again.features[0], whole.features[0]) and not kept.exists()
    kept.write_text("{not json")  # a damaged file: warned, sampled from the start
    with pytest.warns(UserWarning, match="unusable"):
        assert feature_cache._kept(kept, 2) == []


def test_reward_knobs_do_not_change_the_cached_data(tiny):
    """max_chars/format_reward change rewards only: the same problems, so the same cache identity."""
    task = tiny[2]
    strict = make_task("arith", max_chars=50, format_reward=0.5)
    assert _ident(strict) == _ident(task)
    assert _ident(make_task("arith", style="steps")) != _ident(task)


@pytest.mark.parametrize("kind", WEIGHTED)
def test_a_batch_without_teacher_serves_exactly_the_kinds_that_do_not_read_one(tiny, cache, kind):
    """``reads_teacher`` False lets offline training skip the head product: such a kind's loss is the same
    without the teacher's logits; a kind that reads them gets another loss (or an error)."""
    policy = tiny[0]
    torch.manual_seed(3)
    draft = init_draft(kind, policy, gamma=3)
    idx = [7, 2, 5]
    full = cache.batch(policy, idx, draft.feature_layers)
    bare = cache.batch(policy, idx, draft.feature_layers, teacher=False)
    assert bare.teacher_logits.shape == (0, policy.config.vocab_size) and len(bare.teacher_rows) == 0
    assert torch.equal(bare.input_ids, full.input_ids) and torch.equal(bare.loss_mask, full.loss_mask)
    losses = []
    for batch in (full, bare):
        torch.manual_seed(11)
        try:
            losses.append(draft.loss(batch)[0].detach())
        except (ValueError, RuntimeError, IndexError):
            losses.append(None)
    if draft.reads_teacher:
        assert losses[1] is None or not torch.allclose(losses[0], losses[1])
    else:
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


def _dspark_with_vocab(policy, tokens):
    torch.manual_seed(3)
    draft = build_draft("dspark", policy.config, target=policy, gamma=3, draft_vocab_size=len(tokens))
    draft.set_vocabulary(torch.tensor(tokens))
    return draft


def test_a_batch_of_the_draft_vocabulary_columns_gives_the_same_loss(tiny, cache):
    """The teacher's log-probabilities of the draft's K tokens (head rows of K, logsumexp cached per row)
    give DSpark the same loss, metrics and gradients as the whole-vocabulary logits."""
    policy = tiny[0]
    draft = _dspark_with_vocab(policy, list(range(2, policy.config.vocab_size, 3)))
    idx, layers = [7, 2, 5], draft.feature_layers
    full = cache.batch(policy, idx, layers)
    part = cache.batch(policy, idx, layers, columns=draft.teacher_columns())
    assert torch.equal(part.teacher_tokens, draft.draft_vocab) and torch.equal(part.teacher_rows, full.teacher_rows)
    torch.testing.assert_close(part.teacher_logits, full.teacher_logits.log_softmax(-1)[:, draft.draft_vocab])
    runs = []
    for batch in (full, part):
        draft.zero_grad()
        loss, metrics = draft.loss(batch, generator=torch.Generator().manual_seed(0))
        loss.backward()
        runs.append((metrics, [p.grad.clone() for p in draft.parameters() if p.grad is not None]))
    for k in runs[0][0]:
        torch.testing.assert_close(runs[0][0][k], runs[1][0][k], rtol=1e-5, atol=1e-6)
    assert len(runs[0][1]) == len(runs[1][1]) > 0
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_column_batches_are_refused_by_drafts_that_read_other_columns(tiny, cache):
    policy = tiny[0]
    columns = torch.arange(2, policy.config.vocab_size, 3)
    other = _dspark_with_vocab(policy, list(range(1, policy.config.vocab_size, 3)))
    part = cache.batch(policy, [7, 2, 5], other.feature_layers, columns=columns)
    with pytest.raises(ValueError, match="other tokens than this draft's vocabulary"):
        other.loss(part)
    for kind in ("dspark", "eagle3"):  # the whole vocabulary's logits expected
        draft = init_draft(kind, policy, gamma=3)
        with pytest.raises(ValueError, match="vocab"):
            draft.loss(cache.batch(policy, [7, 2, 5], draft.feature_layers, columns=columns))


def test_teacher_lse_follows_the_head(tiny, cache):
    policy = copy.deepcopy(tiny[0])
    first = cache.teacher_lse(policy).clone()
    rows = ~first.isnan()
    assert rows.sum() == sum(len(c) for _, c in cache.sequences)  # one row before every completion token
    with torch.no_grad():
        policy.head_weight.mul_(2.0)  # in place, as an optimiser step would
    again = cache.teacher_lse(policy)
    assert not torch.allclose(again[rows], first[rows])
    with torch.no_grad():
        want = policy.logits(cache.last[rows]).logsumexp(-1)
    torch.testing.assert_close(again[rows], want, rtol=1e-5, atol=1e-5)
