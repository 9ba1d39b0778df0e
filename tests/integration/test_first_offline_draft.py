"""The first run on a policy of your own with the default draft.init=offline: before building the offline
draft it says what it builds, on which data (your data.train), its estimated time, where it is cached and
how to skip it; the draft is trained on your file's prompts as the run renders them; the cache is keyed by
(policy, data, kind), and a rerun reuses it, saying so, without training."""
import json
import os

import pytest

from codraft.config import load_config
from codraft.data import DataProblem, FileTask
from codraft.rl import trainer as trainer_mod
from codraft.rl.trainer import Trainer
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer
from codraft.train import feature_cache, offline_draft
from codraft.train.feature_cache import FeatureCache, sample_sequences
from tiny_runs import tiny_policy

# the offline recipe made tiny: 3 steps on 6 completions (the real ones take minutes)
RECIPE = offline_draft.Recipe(steps=3, batch_sequences=2, lr=1e-3, n_prompts=6, max_new_tokens=6)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Offline drafts and feature caches in a folder of the test's own, built by the tiny recipe."""
    monkeypatch.setattr(offline_draft, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(feature_cache, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(offline_draft, "recipe_for", lambda tok, kind: RECIPE)
    monkeypatch.setattr(trainer_mod, "plot_run", lambda run_dir: [])
    return tmp_path / "cache"


def write_rows(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    return path


def config(policy, data, run, kind="dflash"):
    return load_config(None, [f"policy.init={policy}", f"run_dir={run}", "steps=1", f"data.train={data}",
                              "reward.funcs=exact", "data.val_fraction=0.2", "rollout.prompts_per_step=2",
                              "rollout.group_size=2", "rollout.max_new_tokens=6", "log.val_size=2", "log.val_every=0",
                              "log.speedup_every=0", f"draft.kind={kind}", "draft.init=offline", "draft.gamma=3"])


def test_the_first_run_says_what_it_builds_and_a_rerun_reuses_it(tmp_path, cache, tiny_policy_dir, capfd,
                                                                  monkeypatch):
    data = write_rows(tmp_path / "mine.jsonl", ["7*7=", "8-3=", "9+9=", "6*2=", "5-5="])
    Trainer(config(tiny_policy_dir, data, tmp_path / "run1"), progress=False)._unlock()
    err = capfd.readouterr().err
    folder, = (cache / "drafts").glob("dflash-*")
    announced = err[err.index("the draft starts from offline training"):]
    for said in (f"data.train={data}", "draft.init=random", "offline dflash draft", "3 training steps of 2",
                 "6 completions", str(folder)):
        assert said in announced, said
    assert "the offline dflash draft needs about" in announced and "steps timed" in announced  # the estimate
    assert err.index("offline dflash draft of this policy") < err.index("needs about")  # said before building
    assert "reusing" not in err and (folder / "report.json").is_file()

    # the draft was trained on the file's training prompts, rendered as the run renders them
    features = FeatureCache.load(next((cache / "features").glob("data-*")))
    tok = CharTokenizer()  # (the tiny policy's: a row's text is its prompt, no chat template)
    rows = {tuple(tok.prompt_ids(p)) for p in ["7*7=", "8-3=", "9+9=", "6*2=", "5-5="]}
    prompts = {tuple(p) for p, _ in features.sequences}
    assert prompts <= rows and len(prompts) == 4  # four training rows (one held out), cycled to 6 prompts
    assert features.identity["task"] == "data" and features.identity["task_knobs"]["train"] == str(data)

    # the same policy, data and kind: reused, one line, no training
    def no_training(*a, **k):
        raise AssertionError("the cached offline draft was trained again")
    monkeypatch.setattr(offline_draft, "train_offline", no_training)
    monkeypatch.setattr(feature_cache, "build", no_training)
    Trainer(config(tiny_policy_dir, data, tmp_path / "run2"), progress=False)._unlock()
    err = capfd.readouterr().err
    reuse = [line for line in err.splitlines() if "offline" in line]
    assert reuse == [f"codraft: reusing the offline dflash draft of this policy on data.train={data} ({folder})"]


def test_the_cache_key_is_the_policy_the_data_and_the_kind(tmp_path, cache, tiny_policy_dir):
    def task(prompts, name="a.jsonl"):
        path = write_rows(tmp_path / name, prompts)
        return FileTask([DataProblem(prompt=p, answer="0", solution="", prompt_ids=None) for p in prompts], [],
                        {"train": str(path), "val": "", "prompt_key": "prompt", "chat_template": "auto",
                         "system_prompt": "", "val_fraction": 0.05, "shuffle": True}, True)

    def key(kind="dflash", data=None, policy=tiny_policy_dir):
        return offline_draft.offline_draft_folder(kind, task=data or task(["1+1="]), policy_dir=policy, gamma=3,
                                                  seed=0, recipe=RECIPE)

    base = key()
    assert key() == base  # the same policy, data and kind
    assert key(kind="dspark") != base and key(kind="eagle3") != base
    assert key(data=task(["1+2="])) != base  # the file's contents
    assert key(data=make_task("arith")) != base and key(data=make_task("chain_sum")) != key(data=make_task("arith"))
    other = tmp_path / "other"  # another policy folder with the same weights, and the same folder retrained
    other.mkdir()
    for f in tiny_policy_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    assert key(policy=other) != base
    weights, = tiny_policy_dir.glob("*.safetensors")
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert key() != base


def test_prompts_are_sampled_from_the_ids_the_task_rendered():
    """A data row's prompt as the run decodes it (chat template, system prompt: its prompt_ids), not its text
    through the tokenizer."""
    policy, tok = tiny_policy(layers=2, hidden=32)
    rendered = tok.prompt_ids("9*9=")
    problems = [DataProblem(prompt="1+1=", answer="2", solution="", prompt_ids=rendered)]
    task = FileTask(problems, problems, {"train": "x.jsonl", "val": "", "val_fraction": 0.05}, False)
    pairs = sample_sequences(policy.eval(), tok, task, n_prompts=3, max_new_tokens=4, seed=0, progress=False)
    assert [p for p, _ in pairs] == [rendered] * 3


def test_other_ranks_say_nothing(tmp_path, cache, tiny_policy_dir, capfd):
    policy, tok = tiny_policy(layers=2, hidden=32)
    offline_draft.offline_draft_dir("dflash", policy=policy.eval(), tok=tok, task=make_task("arith"),
                                    policy_dir=tiny_policy_dir, gamma=3, seed=0, progress=False, announce=False)
    err = capfd.readouterr().err  # (a first run on a machine may time its decode paths: those lines are not ours)
    assert (tmp_path / "cache" / "drafts").is_dir() and "offline" not in err and "draft.init" not in err
