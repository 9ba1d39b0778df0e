"""Training the tiny policy on a data file with reward functions of a file of their own: the logged reward is
what the functions returned, failures are counted, None drops samples from the update, the chain_sum preset
as a data file with the built-in reward repeats the preset's run step for step, and a run resumed mid-epoch
repeats an uninterrupted one."""
import json
import shutil

import pytest
from tiny_runs import checkpoint_weights, comparable, run_config, same_tensors

from codraft.rl import trainer as trainer_mod
from codraft.rl.logger import read_metrics
from codraft.rl.trainer import Trainer, train
from codraft.train.run_dir import read_resume_log

REWARDS = '''
import json, pathlib

def parity(prompts, completions, completion_ids, answer, level, **kwargs):
    """TRL's convention; records what it was given and what it returned."""
    out = [float(len(c) % 2) + 0.25 * lv for c, lv in zip(completions, level)]
    with open(pathlib.Path(__file__).with_name("calls.jsonl"), "a") as f:
        f.write(json.dumps({"prompts": prompts, "answer": answer, "ids": [len(i) for i in completion_ids],
                            "out": out}) + "\\n")
    return out

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0 if len(solution_str) % 3 == 0 else 0.0}

def flaky(completions, **kwargs):
    if any(len(c) % 2 for c in completions):
        raise ValueError("reward bug")
    return [1.0] * len(completions)

def odd_only(completions, **kwargs):
    return [float(len(c) % 4) if len(c) % 2 else None for c in completions]

def never(completions, **kwargs):
    return [None] * len(completions)
'''


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    monkeypatch.setattr(trainer_mod, "plot_run", lambda run_dir: [])


@pytest.fixture
def files(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    rows = [{"prompt": f"{i}+{i % 3}=", "answer": str(i + i % 3), "level": i % 2} for i in range(7)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    return tmp_path


def data_config(files, run, steps, funcs, *extra):
    return run_config(files / "policy", run, steps, extra=[
        f"data.train={files / 'train.jsonl'}", f"data.val={files / 'val.jsonl'}", f"reward.funcs={funcs}",
        "log.val_size=3", *extra])


@pytest.fixture
def policy(files, tiny_policy_dir):
    return tiny_policy_dir  # (tmp_path / "policy": data_config's policy.init)


def test_a_reward_file_trains_the_tiny_policy_and_its_values_are_logged(files, policy):
    f = files / "rewards.py"
    cfg = data_config(files, files / "run", 3, f"{f}:parity,{f}:compute_score", "reward.weights=1,2")
    tr = Trainer(cfg, progress=False)
    tr.fit()
    rows = [r for r in read_metrics(files / "run") if "reward_mean" in r]
    calls = [json.loads(x) for x in (files / "calls.jsonl").read_text().splitlines()]
    steps = [c for c in calls if len(c["out"]) == 4]  # (2 prompts x 2; validation batches have 3)
    assert len(rows) == 3 and len(steps) == 3
    for row, call in zip(rows, steps):
        assert row["reward/parity_mean"] == pytest.approx(sum(call["out"]) / 4)
        assert call["answer"] == [str(int(p[0]) + int(p[2])) for p in call["prompts"]]  # columns by name
    assert [r["epoch"] for r in rows] == pytest.approx([2 / 7, 4 / 7, 6 / 7])
    last = tr.last_rollout
    texts = [tr.tok.decode(o.tokens) for o in last]
    want = [p + 2 * float(len(t) % 3 == 0) for p, t in zip(steps[-1]["out"], texts)]
    assert rows[-1]["reward_mean"] == pytest.approx(sum(want) / 4)  # the weighted sum the functions gave
    vals = [c for c in calls if len(c["out"]) == 3]
    assert len(vals) == 2 and all(c["prompts"] == ["0+0=", "1+1=", "2+2="] for c in vals)  # data.val, greedy


def test_failures_are_counted_and_none_drops_samples(files, policy):
    f = files / "rewards.py"
    tr = Trainer(data_config(files, files / "flaky", 2, f"{f}:flaky"), progress=False)
    with pytest.warns(UserWarning, match=r"reward function failed on 4/4 samples, scored 0 \(first error: flaky: "
                                         r"ValueError\('reward bug'\)\)"):
        tr.fit()
    rows = [r for r in read_metrics(files / "flaky") if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]  # never a crash
    odd = any(len(tr.tok.decode(o.tokens)) % 2 for o in tr.last_rollout)
    assert (rows[-1]["reward_errors"], rows[-1]["reward_mean"]) == ((4, 0.0) if odd else (0, 1.0))
    assert sum(r["reward_errors"] for r in rows) > 0

    tr = Trainer(data_config(files, files / "odd", 2, f"{f}:odd_only"), progress=False)
    tr.fit()
    row = [r for r in read_metrics(files / "odd") if "reward_mean" in r][-1]
    lens = [len(tr.tok.decode(o.tokens)) for o in tr.last_rollout]
    kept = [n % 2 == 1 for n in lens]
    assert row["reward_dropped"] == kept.count(False) and row["reward_errors"] == 0
    assert row["reward_mean"] == pytest.approx(sum(n % 4 for n, k in zip(lens, kept) if k) / max(kept.count(True), 1))
    # a dropped completion is out of the update: its tokens are masked and not counted in the policy loss
    assert row["policy/num_tokens"] == sum(len(o.tokens) for o, k in zip(tr.last_rollout, kept) if k)
    assert all(o.mask == [False] * len(o.tokens) for o, k in zip(tr.last_rollout, kept) if not k)

    tr = Trainer(data_config(files, files / "never", 1, f"{f}:never"), progress=False)
    tr.fit()  # every sample dropped: the step runs and changes nothing
    row = [r for r in read_metrics(files / "never") if "reward_mean" in r][0]
    assert (row["reward_dropped"], row["policy/num_tokens"], row["reward_mean"]) == (4, 0, 0.0)


def test_chain_sum_as_a_data_file_repeats_the_preset_run(tmp_path, tiny_policy_dir):
    pytest.importorskip("reasoning_gym")
    from codraft.tasks import make_task
    steps, seed = 3, 5
    common = ["log.val_size=4", f"seed={seed}", "rollout.max_new_tokens=8"]
    task = make_task("chain_sum")
    stream = task.stream("train", seed=seed)
    train_rows = [next(stream) for _ in range(steps * 2)]
    val_rows = task.sample("val", 4, seed=seed)
    for name, ps in (("train.jsonl", train_rows), ("val.jsonl", val_rows)):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in ps))
    train(run_config(tiny_policy_dir, tmp_path / "preset", steps, extra=["task.name=chain_sum", *common]),
          progress=False)
    train(run_config(tiny_policy_dir, tmp_path / "data", steps, extra=[
        f"data.train={tmp_path / 'train.jsonl'}", f"data.val={tmp_path / 'val.jsonl'}", "data.shuffle=false",
        "reward.funcs=chain_sum", *common]), progress=False)
    preset, data = read_metrics(tmp_path / "preset"), read_metrics(tmp_path / "data")
    assert [r.pop("epoch") for r in data if "epoch" in r] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert comparable(data) == comparable(preset)
    assert any("val_accuracy" in r for r in preset) and "reward/chain_sum_mean" in preset[-1]
    assert same_tensors(checkpoint_weights(tmp_path / "preset" / f"step_{steps}"),
                        checkpoint_weights(tmp_path / "data" / f"step_{steps}"))


def test_resume_mid_epoch_equals_the_uninterrupted_run(files, policy):
    f = files / "rewards.py"
    extra = ("log.checkpoint_every=2", "log.keep_last=0", "reward.isolation=inline")
    train(data_config(files, files / "full", 4, f"{f}:parity", *extra), progress=False)
    shutil.copytree(files / "full", files / "cut")
    shutil.rmtree(files / "cut" / "step_4")  # from step_2: 4 of the 7 rows seen, mid-epoch
    train(data_config(files, files / "cut", 4, f"{f}:parity", *extra), resume=str(files / "cut"), progress=False)
    assert read_resume_log(files / "cut")[-1]["step"] == 2
    full, cut = read_metrics(files / "full"), read_metrics(files / "cut")
    assert comparable(cut) == comparable(full)
    assert [r["epoch"] for r in full if "epoch" in r] == pytest.approx([2 / 7, 4 / 7, 6 / 7, 8 / 7])
    assert same_tensors(checkpoint_weights(files / "full" / "step_4"), checkpoint_weights(files / "cut" / "step_4"))
