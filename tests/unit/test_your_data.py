"""Data files and reward functions without a trainer: every format reads the same rows, prompts are rendered
(chat template, system prompt) and checked, each bad input is one line naming the file, row and column, and
the reward functions (TRL's and verl's conventions, built-ins, weights, None, failures, a worker that hangs or
dies) give what their code returns."""
import json
import math
from pathlib import Path

import pytest
import torch
from tokenizer_folder import tiny_tokenizer_folder

from codraft.config import ConfigError, load_config
from codraft.data import DataError, DataProblem, load_file_task
from codraft.data.file_task import FileTask
from codraft.policy.resolve import policy_config
from codraft.rewards import RewardError, build_rewards, calling
from codraft.rewards import worker as reward_worker
from codraft.rewards.calling import Batch, call
from codraft.rl import memory
from codraft.rl.grpo import group_advantages
from codraft.tokenizer import CharTokenizer, load_tokenizer

ROWS = [{"prompt": f"{i}+{i}=", "answer": f"is {2 * i}", "level": i % 3} for i in range(10)]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def data_cfg(*overrides):
    return load_config(None, list(overrides)).data


def load(path, *overrides, tok=None, context=512, max_new=10, seed=0):
    d = data_cfg(f"data.train={path}", "reward.funcs=exact", *overrides)
    return load_file_task(d, tok or CharTokenizer(), context=context, max_new_tokens=max_new, seed=seed)


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


# ---------------------------------------------------------------- formats, splits, order


def test_every_format_reads_the_same_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "folder"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "splits"))
    want = load(tmp_path / "d.jsonl", "data.shuffle=false")
    for name in ("d.json", "d.parquet", "d.csv", "folder", "splits"):
        got = load(tmp_path / name, "data.shuffle=false")
        text = name.endswith(".csv")  # (a CSV's every cell is text, as written)
        assert [(p.prompt, p.answer, p.meta) for p in got.train] == \
            [(p.prompt, p.answer, {k: str(v) if text else v for k, v in p.meta.items()}) for p in want.train]
        assert [p.row for p in got.val] == [p.row for p in want.val]


def test_held_out_fraction_order_and_epochs(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    task = load(path, "data.val_fraction=0.2", seed=3)
    assert len(task.val) == 2 and len(task.train) == 8
    assert not {p.row for p in task.val} & {p.row for p in task.train}
    assert [p.row for p in load(path, "data.val_fraction=0.2", seed=3).val] == [p.row for p in task.val]  # seeded
    stream = task.stream("train", seed=5)
    first, second = [next(stream) for _ in range(8)], [next(stream) for _ in range(8)]
    assert sorted(p.row for p in first) == sorted(p.row for p in task.train)  # each epoch: every row once
    assert [p.row for p in first] != [p.row for p in second]  # in its own order
    again = task.stream("train", seed=5)
    assert [next(again).row for _ in range(16)] == [p.row for p in first + second]  # a function of (seed, k)
    assert task.epoch(12) == 1.5
    plain = load(path, "data.shuffle=false", "data.val_fraction=0.2", seed=3)
    assert [p.row for p in plain.sample("train", 8)] == [p.row for p in plain.train]
    assert len(task.sample("val", 64)) == 2  # never more held-out rows than there are


def test_columns_reach_the_problem_and_verl_answers_are_found(tmp_path):
    rows = [{"prompt": "q", "reward_model": {"ground_truth": "7", "style": "rule"}, "data_source": "gsm",
             "extra_info": {"i": 0}}]
    task = load(write_jsonl(tmp_path / "v.jsonl", rows * 3), "data.val_fraction=0.3")
    p = task.train[0]
    assert p.answer == "7" and p.meta["data_source"] == "gsm" and p.meta["extra_info"] == {"i": 0}
    assert "prompt" not in p.meta and p.raw_prompt == "q"


def test_chat_template_and_system_prompt(tmp_path):
    tok = load_tokenizer(tiny_tokenizer_folder(tmp_path / "tok"))
    rows = [{"prompt": "hi there"}, {"prompt": [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "2+2?"}]}]
    path = write_jsonl(tmp_path / "c.jsonl", rows * 2)
    task = load(path, "data.shuffle=false", "data.val_fraction=0.25", tok=tok)
    text, chat = [p for p in task.train + task.val if p.row == 1][0], [p for p in task.train + task.val
                                                                       if p.row == 2][0]
    assert text.prompt_ids == tok.prompt_ids("hi there")  # a lone user turn: the built-in tasks' ids
    assert tok.decode(chat.prompt_ids, skip_special_tokens=False) == \
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    with_system = load(path, "data.shuffle=false", "data.val_fraction=0.25", "data.system_prompt=Think.", tok=tok)
    first = [p for p in with_system.train + with_system.val if p.row == 1][0]
    assert tok.decode(first.prompt_ids, skip_special_tokens=False).startswith("<|im_start|>system\nThink.<|im_end|>")
    raw = load(path, "data.chat_template=none", "data.val_fraction=0.25", tok=tok)
    assert [p for p in raw.train + raw.val if p.row == 1][0].prompt_ids == tok.encode("hi there")
    char = load(path, "data.val_fraction=0.25")  # the char tokenizer has no template: auto is none
    assert [p for p in char.train + char.val if p.row == 1][0].prompt_ids == CharTokenizer().prompt_ids("hi there")


# ---------------------------------------------------------------- bad inputs: one line each


@pytest.mark.parametrize("content, overrides, message", [
    (['{"prompt": "a"}', '{"prompt": "b"'], (), r"bad\.jsonl: row 2 \(line 2\): not JSON"),
    (['{"prompt": "a"}', '[1, 2]'], (), r"bad\.jsonl: row 2 \(line 2\): not an object of columns"),
    ([{"question": "a"}] * 3, (), r"bad\.jsonl: no column 'prompt' \(data\.prompt_key\); its columns: question"),
    ([{"prompt": "a"}, {"prompt": None}, {"prompt": "c"}], ("data.shuffle=false", "data.val_fraction=0.3"),
     r"bad\.jsonl: row 2: column 'prompt': the prompt must be text or a list of chat messages .*got null"),
    ([{"prompt": "a"}, {"prompt": "  "}, {"prompt": "c"}], ("data.val_fraction=0.3",),
     r"bad\.jsonl: row 2: column 'prompt': the prompt is empty"),
    ([{"p": "a"}, {"p": [{"role": "user"}]}], ("data.prompt_key=p", "data.val_fraction=0.3"),
     r"bad\.jsonl: row 2: column 'p': message 1 is not"),
    ([{"prompt": "a"}, {"prompt": "x" * 600}], ("data.val_fraction=0.3",),
     r"bad\.jsonl: row 2: column 'prompt': the prompt is 601 tokens; with rollout\.max_new_tokens=10 it passes the "
     r"policy's context of 512"),
    ([{"prompt": "a"}], (), r"bad\.jsonl: 1 row\(s\) leave none to train on"),
    ([], (), r"bad\.jsonl: no rows"),
])
def test_bad_inputs_are_one_line_naming_file_row_and_column(tmp_path, content, overrides, message):
    path = write_jsonl(tmp_path / "bad.jsonl", content)
    with pytest.raises(DataError, match=message) as e:
        load(path, *overrides)
    one_line(e)


def test_bad_files_of_other_kinds(tmp_path):
    (tmp_path / "bad.parquet").write_text("not parquet")
    (tmp_path / "d.txt").write_text("x")
    (tmp_path / "empty_folder").mkdir()
    for name, message in (("bad.parquet", r"bad\.parquet: cannot be read as parquet"),
                          ("d.txt", r"d\.txt: unknown data format '\.txt'"),
                          ("empty_folder", r"empty_folder: not a save_to_disk dataset folder")):
        with pytest.raises(DataError, match=message) as e:
            load(tmp_path / name)
        one_line(e)
    val = write_jsonl(tmp_path / "val.jsonl", [{"question": "x"}])
    with pytest.raises(DataError, match=r"val\.jsonl: no column 'prompt'"):
        load(write_jsonl(tmp_path / "t.jsonl", ROWS), f"data.val={val}")


def test_config_rules_of_the_new_keys(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    for overrides, message in (
            ([f"data.train={tmp_path / 'nope.jsonl'}"], r"'data\.train' must be an existing data file"),
            ([f"data.train={path}"], r"'reward\.funcs' must name the reward functions of data\.train"),
            ([f"data.val={path}"], r"'data\.val' needs data\.train"),
            ([f"data.train={path}", "reward.funcs=exact", "env.name=calculator"], r"'env\.name' must be none"),
            (["reward.funcs=nope"], r"'reward\.funcs' must be comma-separated rewards"),
            ([f"reward.funcs={tmp_path / 'r.py'}:f"], r"no such file"),
            (["reward.funcs=math,exact", "reward.weights=1"], r"one weight per reward function \(2\), got 1"),
            (["reward.weights=1,x"], r"'reward\.weights' must be comma-separated numbers"),
            (["reward.regex=("], r"'reward\.regex' must be a Python regular expression"),
            (["data.val_fraction=1"], r"'data\.val_fraction' must be in \(0, 1\)")):
        with pytest.raises(ConfigError, match=message) as e:
            load_config(None, overrides)
        one_line(e)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"data: {{train: {path}}}\nreward: {{funcs: [math, exact], weights: [1, 0.5]}}\n")
    cfg = load_config(str(yaml_file))
    assert (cfg.reward.funcs, cfg.reward.weights) == ("math,exact", "1,0.5")  # YAML lists accepted


# ---------------------------------------------------------------- reward functions

REWARDS = '''
import os, time

def trl_len(prompts, completions, completion_ids, level, **kwargs):
    return [float(len(c)) + lv for c, lv in zip(completions, level)]

def trl_named(completions, answer):                 # no **kwargs: gets only what it names
    return [1.0 if c == a else None for c, a in zip(completions, answer)]

async def trl_async(completions, **kwargs):
    return [0.25] * len(completions)

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth) + (0.5 if data_source == "src" else 0.0)}

def verl_float(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise RuntimeError("verl bug")
    return 2.0

def raises(completions, **kwargs):
    raise ValueError("reward bug")

def short(completions, **kwargs):
    return [1.0]

def bad_values(completions, **kwargs):
    return ["1", float("nan")] + [1.0] * (len(completions) - 2)

def hangs(completions, **kwargs):
    time.sleep(60)

def exits(completions, **kwargs):
    os._exit(3)

def ok(completions, **kwargs):
    return [1.0] * len(completions)

def wrong(a, b):
    return []
'''


@pytest.fixture
def reward_file(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return tmp_path / "my_rewards.py"


def problems(n=4):
    return [DataProblem(prompt=f"p{i}", answer="ok", solution="", meta={"level": i, "data_source": "src", "answer": "ok"},
                        raw_prompt=f"p{i}") for i in range(n)]


def reward_set(funcs, *extra, task=None):
    cfg = load_config(None, [f"reward.funcs={funcs}", *extra])
    return build_rewards(cfg, task or FileTask([], [], {"val_fraction": 0.1}, False))


@pytest.mark.parametrize("isolation", ["process", "inline"])
def test_trl_verl_and_built_in_rewards_with_weights(reward_file, isolation):
    f = reward_file
    rs = reward_set(f"{f}:trl_len,{f}:trl_named,{f}:compute_score,{f}:trl_async,exact",
                    "reward.weights=1,2,0.5,4,10", f"reward.isolation={isolation}")
    texts = ["ok", "no", "okay", "ok"]
    s = rs.score(problems(), texts, [[1]] * 4)
    assert s.per_function == {"trl_len": [2.0, 3.0, 6.0, 5.0], "trl_named": [1.0, None, None, 1.0],
                              "compute_score": [1.5, 0.5, 0.5, 1.5], "trl_async": [0.25] * 4,
                              "exact": [1.0, 0.0, 0.0, 1.0]}
    want = [2 + 2 + 0.75 + 1 + 10, 3 + 0.25 + 1 + 0, 6 + 0.25 + 1 + 0, 5 + 2 + 0.75 + 1 + 10]
    assert s.totals == pytest.approx(want) and s.errors == []
    rs.close()


def test_failures_are_counted_never_raised_and_a_hung_worker_is_replaced(reward_file):
    f = reward_file
    rs = reward_set(f"{f}:raises,{f}:short,{f}:bad_values,{f}:verl_float,{f}:hangs,{f}:exits,{f}:ok",
                    "reward.timeout=2")
    s = rs.score(problems(), ["a", "boom", "c", "d"], [[1]] * 4)
    assert s.per_function["raises"] == [0.0] * 4 and s.per_function["short"] == [0.0] * 4
    assert s.per_function["bad_values"] == [0.0, 0.0, 1.0, 1.0]
    assert s.per_function["verl_float"] == [2.0, 0.0, 2.0, 2.0]
    assert s.per_function["hangs"] == [0.0] * 4 and s.per_function["exits"] == [0.0] * 4
    assert s.per_function["ok"] == [1.0] * 4  # after a hang and a death: a fresh worker answers
    errors = "\n".join(s.errors)
    for what in ("raises: ValueError('reward bug')", "short: ValueError('returned 1 values for 4 completions')",
                 "bad_values: TypeError", "non-finite reward nan", "verl_float: RuntimeError('verl bug')",
                 "hangs: no answer within reward.timeout=2 s", "exits: the reward worker process died (exit code 3)"):
        assert what in errors
    assert len(s.errors) == 4 + 4 + 2 + 1 + 4 + 4
    rs.close()


def test_reward_functions_that_cannot_be_used_are_one_line(reward_file, tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    for funcs, message in ((f"{reward_file}:missing", r"my_rewards\.py has no function 'missing'"),
                           (f"{reward_file}:wrong", r"parameters \(a, b\) match neither TRL's"),
                           (f"{tmp_path / 'broken.py'}:f", r"broken\.py raised ModuleNotFoundError"),
                           ("no_such_module_xyz:f", r"module 'no_such_module_xyz' cannot be imported")):
        for isolation in ("process", "inline"):
            with pytest.raises(RewardError, match=message) as e:
                reward_set(funcs, f"reward.isolation={isolation}")
            one_line(e)
    task = FileTask(problems(2), problems(1), {"val_fraction": 0.1, "train": "t.jsonl"}, False)
    for p in task.train:
        p.answer = ""
    with pytest.raises(RewardError, match=r"'math' compares completions with an answer column .* t\.jsonl has none"):
        reward_set("math", task=task)


def test_math_exact_regex_built_ins():
    pytest.importorskip("math_verify")
    rs = reward_set("math,regex")
    ps = [DataProblem(prompt="", answer=a, solution="") for a in ("\\frac{1}{2}", "42", "3")]
    s = rs.score(ps, ["so it is $0.5$", "<think>hm</think> <answer>41</answer>", "\\boxed{3}"], [[1]] * 3)
    assert s.per_function == {"math": [1.0, 0.0, 1.0], "regex": [0.0, 1.0, 0.0]}


# ---------------------------------------------------------------- None: out of the group's statistics


def test_dropped_samples_leave_their_groups_statistics():
    r = torch.tensor([1.0, 0.0, 5.0, 0.5, 2.0, 2.0, 7.0, 3.0])
    keep = torch.tensor([True, True, False, True, True, False, False, False])
    for loo in (False, True):
        got = group_advantages(r, 4, leave_one_out=loo, keep=keep)
        want_first = group_advantages(torch.tensor([1.0, 0.0, 0.5]), 3, leave_one_out=loo)
        assert torch.equal(got[[0, 1, 3]], want_first) and got[2] == 0
        assert torch.equal(got[4:], torch.zeros(4))  # one kept member: no signal; dropped ones: 0
        assert torch.equal(group_advantages(r, 4, leave_one_out=loo, keep=torch.ones(8, dtype=torch.bool)),
                           group_advantages(r, 4, leave_one_out=loo))
    assert not any(math.isnan(x) for x in group_advantages(r, 4, keep=torch.zeros(8, dtype=torch.bool)).tolist())


# ---------------------------------------------------------------- values as the file writes them


def test_json_lines_split_at_newlines_only(tmp_path):
    """U+2028, U+2029, \\x85, \\x0b, \\x0c and \\x1c-\\x1e are text inside a JSON string (str.splitlines splits
    at them); a leading byte order mark and CRLF line ends are not the rows'."""
    odd = "line one\u2028two\u2029three\x85four\x0bfive\x0csix\x1cseven\x1deight\x1enine"
    rows = [{"prompt": odd, "answer": "1"}, {"prompt": "b\u2028c", "answer": "2"}] * 5
    want = sorted([(r["prompt"], r["answer"]) for r in rows])
    for name, end, bom in (("plain.jsonl", "\n", b""), ("crlf.jsonl", "\r\n", b"\xef\xbb\xbf")):
        text = end.join(json.dumps(r, ensure_ascii=False) for r in rows) + end
        (tmp_path / name).write_bytes(bom + text.encode())
        task = load(tmp_path / name, "data.shuffle=false", "data.val_fraction=0.1")
        assert sorted([(p.raw_prompt, p.answer) for p in task.train + task.val]) == want
    (tmp_path / "bad.jsonl").write_text(json.dumps(rows[0], ensure_ascii=False) + "\n{\"prompt\": \"x\u2028\n")
    with pytest.raises(DataError, match=r"bad\.jsonl: row 2 \(line 2\): not JSON"):
        load(tmp_path / "bad.jsonl")


def test_answers_keep_the_type_they_are_written_with(tmp_path):
    """JSON: 42 among floats stays the int 42 (Arrow's one type per column would make it 42.0); CSV: every
    cell is text as written, 007 stays "007" even in a column with an empty cell."""
    rows = [{"prompt": f"q{i}", "answer": a} for i, a in enumerate([42, 1.5, 7, 2.25, 10**18 + 1] * 2)]
    write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.json").write_text(json.dumps(rows))
    for name in ("d.jsonl", "d.json"):
        task = load(tmp_path / name, "data.shuffle=false", "data.val_fraction=0.1")
        got = {p.raw_prompt: (p.answer, p.meta["answer"]) for p in task.train + task.val}
        assert got == {r["prompt"]: (str(r["answer"]), r["answer"]) for r in rows}
        assert all(type(p.meta["answer"]) is type(rows[p.row - 1]["answer"]) for p in task.train + task.val)
    (tmp_path / "d.csv").write_text("prompt,answer,level\n" + "".join(
        f"q{i},{a},{lv}\n" for i, (a, lv) in enumerate([("007", "1"), ("", "2"), ("NA", ""), ("3.0", "0")] * 3)))
    task = load(tmp_path / "d.csv", "data.shuffle=false", "data.val_fraction=0.1")
    got = {p.raw_prompt: (p.answer, p.meta) for p in task.train + task.val}
    assert got["q0"] == ("007", {"answer": "007", "level": "1"})
    assert got["q1"] == ("", {"answer": "", "level": "2"})
    assert got["q2"] == ("NA", {"answer": "NA", "level": ""})
    assert got["q3"] == ("3.0", {"answer": "3.0", "level": "0"})


def test_json_rows_lacking_a_column_have_it_as_none(tmp_path):
    task = load(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "x": [1]}] * 3),
                "data.shuffle=false", "data.val_fraction=0.1")
    assert {p.raw_prompt: p.meta for p in task.train + task.val} == {"a": {"answer": "1", "x": None},
                                                                     "b": {"answer": None, "x": [1]}}


# ---------------------------------------------------------------- verl's ground_truth, loading, the worker


def test_verl_gets_reward_models_ground_truth_raw():
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(ground_truth)
        return 1.0

    columns = [{"reward_model": {"ground_truth": ["1", "2"]}, "answer": "x", "ground_truth": "y"},
               {"reward_model": {"ground_truth": 72}, "answer": "x"},
               {"reward_model": {"style": "rule"}, "ground_truth": {"a": 1}, "answer": "x"},
               {"answer": 5},
               {"solution": [3]},
               {}]
    n = len(columns)
    batch = Batch([""] * n, [""] * n, [""] * n, [[1]] * n, columns, ["A"] * n)
    out = call(compute_score, "verl", batch)
    assert out.errors == [None] * n
    assert seen == [["1", "2"], 72, {"a": 1}, 5, [3], "A"]


def test_a_file_of_several_functions_is_imported_once(tmp_path):
    f = tmp_path / "twice.py"
    f.write_text("import pathlib\n"
                 "p = pathlib.Path(__file__).with_name('imports.txt')\n"
                 "p.write_text(p.read_text() + 'x' if p.exists() else 'x')\n"
                 "def a(completions, **kw):\n    return [1.0] * len(completions)\n"
                 "def b(completions, **kw):\n    return [2.0] * len(completions)\n")
    a, b = calling.load(f"{f}:a"), calling.load(f"{tmp_path / '.' / 'twice.py'}:b")
    assert (tmp_path / "imports.txt").read_text() == "x"
    assert a.__globals__ is b.__globals__
    rs = reward_set(f"{f}:a,{f}:b", "reward.isolation=inline")
    assert (tmp_path / "imports.txt").read_text() == "x"
    rs.close()


def test_a_worker_that_does_not_start_names_the_start_timeout(tmp_path, monkeypatch):
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(30)\n"
                                      "def f(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.setattr(reward_worker, "START_TIMEOUT_S", 1.5)
    with pytest.raises(RewardError, match=r"no answer within 1\.5 s of loading the reward functions") as e:
        reward_set(f"{tmp_path / 'slow.py'}:f", "reward.timeout=300")
    assert "reward.timeout" not in one_line(e)


# ---------------------------------------------------------------- the run's checks before the policy loads


def test_the_memory_check_sizes_a_data_run_from_its_longest_prompt(tmp_path, monkeypatch):
    seen, real = [], memory.estimate
    monkeypatch.setattr(memory, "estimate", lambda cfg, m, p, v=0: seen.append(p) or real(cfg, m, p, v))
    monkeypatch.setattr(memory, "available", lambda device: (1 << 62, "the test's machine has"))
    short = [{"prompt": "1+1=", "answer": "2"}] * 20
    val = write_jsonl(tmp_path / "val.jsonl", short[:2])

    def cfg(path):
        return load_config(None, [f"data.train={path}", f"data.val={val}", "reward.funcs=exact",
                                  "policy.init=tiny-sft", "memory_check=true"])

    memory.check_run(cfg(write_jsonl(tmp_path / "short.jsonl", short)))
    long = cfg(write_jsonl(tmp_path / "long.jsonl", short[:10] + [{"prompt": "7" * 30000, "answer": "2"}] + short))
    memory.check_run(long)
    assert seen[0] < 100 and seen[1] >= 30000  # (the built-in task's prompts would be the same short ones)
    m, _ = policy_config("tiny-sft")
    need = real(long, m, seen[1]).peak
    monkeypatch.setattr(memory, "available", lambda device: (need - 1, "the test's machine has"))
    with pytest.raises(memory.OutOfMemory):
        memory.check_run(long)
    past = cfg(write_jsonl(tmp_path / "past.jsonl", short + [{"prompt": "7" * 70000, "answer": "2"}]))
    with pytest.raises(DataError, match=r"past\.jsonl: row 21: column 'prompt': the prompt is 7000\d tokens"):
        memory.check_run(past)
