"""Offline draft training: an interrupted run resumes to exactly the weights of an uninterrupted one
(per-step seeds, atomic ``resume/`` checkpoint, loaded without unpickling code), and the drafts a
run starts from come from the registry for every kind."""
from __future__ import annotations

import json

import pytest
import torch

from codraft.drafts import available_drafts, draft_kind, load_draft
from codraft.models import Transformer
from codraft.policy.warmstart import tiny_model_config
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer
from codraft.train import offline_draft
from codraft.train.feature_cache import FeatureCache
from codraft.train.offline_draft import starting_draft, train_offline


@pytest.fixture(scope="module")
def tiny():
    tok = CharTokenizer()
    torch.manual_seed(0)
    return Transformer(tiny_model_config(tok)).eval(), tok, make_task("arith")


def _train(tiny, out, **kw):
    policy, tok, task = tiny
    torch.manual_seed(1)
    draft = starting_draft("dflash", "random", policy=policy, tok=tok, task=None, policy_dir=None, gamma=3, seed=0)
    train_offline(policy, tok, task, draft, out_dir=out, steps=4, n_prompts=6, max_new_tokens=8, batch_sequences=3,
                  checkpoint_every=2, progress=False, **kw)
    return load_draft(out / "draft", policy)


def test_interrupted_training_resumes_to_the_same_weights(tiny, tmp_path, monkeypatch):
    full = _train(tiny, tmp_path / "full")
    calls = {"n": 0}
    real = FeatureCache.batch

    def stop_at_step_3(*a, **k):  # the 4th batch (step 3): after the step-2 checkpoint
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(FeatureCache, "batch", stop_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        _train(tiny, tmp_path / "cut")
    assert (tmp_path / "cut" / "resume" / "state.pt").is_file() and not (tmp_path / "cut" / "draft").exists()
    monkeypatch.setattr(FeatureCache, "batch", real)
    resumed = _train(tiny, tmp_path / "cut")
    assert not (tmp_path / "cut" / "resume").exists()
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", available_drafts())
def test_every_kind_saves_and_loads_through_the_registry(tiny, tmp_path, kind):
    policy = tiny[0]
    draft = starting_draft(kind, "random", policy=policy, tok=None, task=None, policy_dir=None, gamma=3, seed=0)
    assert draft.default_gamma == 3 and draft.vocab_size == policy.config.vocab_size
    path = draft.save(tmp_path / kind)
    loaded = load_draft(path, policy, gamma=5)
    assert type(loaded) is draft_kind(kind).cls and loaded.default_gamma == 5
    a, b = (d.state_dict() if isinstance(d, torch.nn.Module) else {} for d in (draft, loaded))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert bool(draft.trainable_parameters()) == (kind != "ngram")


def test_shared_options_reach_only_the_kinds_that_take_them(tiny, tmp_path):
    from codraft.drafts import init_draft
    policy = tiny[0]
    for kind in available_drafts():
        draft = init_draft(kind, policy, gamma=3, num_anchors=5)  # kinds without blocks ignore num_anchors
        if "num_anchors" in draft_kind(kind).options:
            assert draft.config.num_anchors == 5
            draft.save(tmp_path / kind)
            assert init_draft(kind, policy, init=tmp_path / kind, num_anchors=9).config.num_anchors == 9
    with pytest.raises(ValueError, match="unknown draft kind .medusa.; valid kinds: eagle3, dflash, dspark, model, ngram"):
        init_draft("medusa", policy)


def test_a_draft_for_another_target_tokenizer_or_tap_set_is_refused(tiny, tmp_path):
    """The record a trained draft keeps of its target: a different tokenizer file, model shape or tap set
    is an error naming what differs; a draft folder without a record gets the structural checks only."""
    policy = tiny[0]
    mine, other = tmp_path / "mine", tmp_path / "other"
    for folder, text in ((mine, '{"vocab": "abc"}'), (other, '{"vocab": "abd"}')):
        folder.mkdir()
        (folder / "tokenizer.json").write_text(text)
    draft = starting_draft("dflash", "random", policy=policy, tok=None, task=None, policy_dir=None, gamma=3, seed=0)
    path = draft.save(tmp_path / "d")
    assert starting_draft("dflash", str(path), policy=policy, tok=None, task=None, policy_dir=mine, gamma=3, seed=0)
    offline_draft.write_target_record(path, policy, mine, draft.feature_layers)
    starting_draft("dflash", str(path), policy=policy, tok=None, task=None, policy_dir=mine, gamma=3, seed=0)
    with pytest.raises(ValueError, match=r"trained for another target: tokenizer '\w+' \(draft\) != '\w+' \(this policy\)"):
        starting_draft("dflash", str(path), policy=policy, tok=None, task=None, policy_dir=other, gamma=3, seed=0)
    record = json.loads((path / "target.json").read_text())
    (path / "target.json").write_text(json.dumps({**record, "hidden_size": 999, "taps": [0, 5]}))
    with pytest.raises(ValueError, match=r"hidden_size 999 \(draft\) != \d+ \(this policy\); taps \[0, 5\] \(draft\)"):
        offline_draft.draft_for_command(str(path), policy, None, mine, gamma=3)


def test_draft_vocabulary_is_the_most_frequent_completion_tokens_then_low_ids():
    seqs = [([1, 2], [7, 7, 7, 3, 3, 9]), ([4], [3, 7, 11])]  # completions: 7 x4, 3 x3, 9, 11; prompts do not count
    fc = FeatureCache(identity={}, sequences=seqs, features={0: torch.zeros(14, 4)}, last=torch.zeros(14, 4))
    tokens, covered = offline_draft.draft_vocabulary(fc, 20, 5)
    assert tokens.tolist() == [7, 3, 9, 11, 0] and covered == 1.0  # ties: the lower id first; then ids 0, 1, ...
    tokens, covered = offline_draft.draft_vocabulary(fc, 20, 1)
    assert tokens.tolist() == [7] and covered == pytest.approx(4 / 9)
    with pytest.raises(ValueError, match="draft vocabulary"):
        offline_draft.draft_vocabulary(fc, 20, 21)


def test_an_offline_eagle3_draft_with_chosen_taps(tiny, tmp_path, monkeypatch):
    """draft.taps with draft.init=offline: the cached draft is built on those layers (its own cache entry,
    features cached for them) and a run starts from it; a folder trained on other taps is refused."""
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "cache"))
    recipe = offline_draft.Recipe(steps=2, batch_sequences=3, lr=1e-3, n_prompts=6, max_new_tokens=8)
    monkeypatch.setattr(offline_draft, "recipe_for", lambda tok, kind: recipe)
    policy, tok, task = tiny
    (tmp_path / "policy").mkdir()
    start = lambda init, **kw: starting_draft("eagle3", init, policy=policy, tok=tok, task=task,  # noqa: E731
                                              policy_dir=tmp_path / "policy", gamma=3, seed=0, progress=False, **kw)
    draft = start("offline", layers=[0, 1, 2])
    assert draft.feature_layers == (0, 1, 2)
    folder, = (tmp_path / "cache" / "drafts").glob("eagle3-*")
    assert "-taps0.1.2-" in folder.name and load_draft(folder / "draft", policy).layers == [0, 1, 2]
    assert start("offline").feature_layers == (0, 1)  # auto: the default taps, the default cache entry
    assert start(str(folder / "draft"), layers=[0, 1, 2]).feature_layers == (0, 1, 2)
    with pytest.raises(ValueError, match=r"draft.taps=0,1,3 .* taps \[0, 1, 2\]"):
        start(str(folder / "draft"), layers=[0, 1, 3])


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_an_offline_draft_with_a_vocabulary(kind, tiny, tmp_path, monkeypatch):
    """A recipe with ``draft_vocab``: the cached draft predicts the feature cache's most frequent
    completion tokens (a block draft set after it is built, EAGLE-3 built with them: its head has K rows),
    its report says how many of them it covers, and a run starts from it."""
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "cache"))
    policy, tok, task = tiny
    (tmp_path / "policy").mkdir()
    recipe = offline_draft.Recipe(steps=2, batch_sequences=3, lr=1e-3, n_prompts=6, max_new_tokens=8, draft_vocab=12)
    folder = offline_draft.offline_draft_dir(kind, policy=policy, tok=tok, task=task,
                                             policy_dir=tmp_path / "policy", gamma=3, seed=0, recipe=recipe,
                                             progress=False)
    assert "-dv12-" in folder.parent.name
    report = json.loads((folder.parent / "report.json").read_text())
    assert report["draft_vocab"] == 12 and 0 < report["draft_vocab_coverage"] < 1  # (12 of the char vocabulary)
    draft = starting_draft(kind, str(folder), policy=policy, tok=tok, task=task, policy_dir=tmp_path / "policy",
                           gamma=3, seed=0)
    features = offline_draft.offline_features(policy, tok, task, policy_dir=tmp_path / "policy",
                                              layers=draft.feature_layers, seed=0, n_prompts=6, max_new_tokens=8,
                                              progress=False)
    want, covered = offline_draft.draft_vocabulary(features, policy.config.vocab_size, 12)
    assert covered == report["draft_vocab_coverage"]
    if kind == "eagle3":
        assert draft.used_ids().tolist() == sorted(want.tolist()) and draft.lm_head.weight.shape[0] == 12
    else:
        assert draft.draft_vocab.tolist() == want.tolist()
    assert offline_draft.recipe_for(tok, kind).draft_vocab == 0  # the char model: its whole vocabulary
