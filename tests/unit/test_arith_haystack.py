"""`arith_haystack`: prompt lengths, determinism, disjoint splits, arith's rewards, the char alphabet,
knob checks, and the `tiny-long` preset that runs it."""
from __future__ import annotations

import json

import pytest
import torch

from codraft.config import load_config
from codraft.models import Transformer, save_pretrained
from codraft.policy import warmstart
from codraft.rollout import Engine
from codraft.tasks import TASKS, make_task
from codraft.tasks.arith_haystack import MAX_CONTEXT_CHARS, ArithHaystackTask
from codraft.tokenizer import CHAR_ALPHABET, CharTokenizer


@pytest.mark.parametrize("context_chars", [0, 1, 100, 1024, 4096])
def test_prompt_length_is_context_plus_question(context_chars):
    task = make_task("arith_haystack", context_chars=context_chars)
    for p in task.sample("train", 20, seed=0) + task.sample("val", 5, seed=0):
        q = p.meta["question"]
        assert p.prompt.endswith(q) and task.question_of(p.prompt) == q
        assert len(p.prompt) == context_chars + len(q)


def test_longest_context_and_layout_both():
    task = make_task("arith_haystack", context_chars=MAX_CONTEXT_CHARS)
    (p,) = task.sample("val", 1, seed=0)
    assert len(p.prompt) == MAX_CONTEXT_CHARS + len(p.meta["question"])
    both = make_task("arith_haystack", context_chars=256, layout="both")
    for p in both.sample("train", 10, seed=0):
        q = p.meta["question"]
        assert p.prompt.startswith(q + "\n") and p.prompt.endswith(q) and len(p.prompt) == 256 + 2 * len(q) + 1
        assert both.split_of(p.prompt) == "train"


def test_context_zero_is_arith():
    arith, hay = make_task("arith"), make_task("arith_haystack", context_chars=0)
    for split in ("train", "val"):
        a, h = arith.sample(split, 100, seed=2), hay.sample(split, 100, seed=2)
        assert [(p.prompt, p.answer, p.solution) for p in a] == [(p.prompt, p.answer, p.solution) for p in h]


def test_deterministic_per_seed_and_a_function_of_the_question():
    task = make_task("arith_haystack", context_chars=512)
    a, b, c = (task.sample("train", 30, seed=s) for s in (0, 0, 1))
    assert [p.prompt + p.solution for p in a] == [p.prompt + p.solution for p in b]
    assert [p.prompt for p in a] != [p.prompt for p in c]
    # the same question comes with the same context, and its questions are arith's, in arith's order
    assert [p.meta["question"] for p in a] == [p.prompt for p in make_task("arith").sample("train", 30, seed=0)]
    assert task.embed(make_task("arith").sample("train", 1, seed=0)[0]).prompt == a[0].prompt
    # different questions get different contexts
    assert len({p.prompt[:512] for p in a}) == len(a)


def test_splits_disjoint_by_question_and_no_val_solution_in_any_context():
    task = make_task("arith_haystack", context_chars=256)
    train = task.sample("train", 400, seed=0) + task.sample("train", 400, seed=1)
    val = task.sample("val", 60, seed=0) + task.sample("val", 60, seed=1)
    train_q, val_q = {p.meta["question"] for p in train}, {p.meta["question"] for p in val}
    assert len(val_q) >= 60 and train_q.isdisjoint(val_q)
    assert {task.split_of(p.prompt) for p in train} == {"train"} and {task.split_of(p.prompt) for p in val} == {"val"}
    arith = make_task("arith")
    assert {arith.split_of(q) for q in val_q} == {"val"}
    for p in train + val:  # distractor lines are worked train questions, never the prompt's own
        lines = p.prompt.split("\n")
        assert lines[-1] == p.meta["question"]
        for line in lines[1:-1]:  # the first line is usually cut
            question = line[:line.index("=") + 1]
            assert arith.split_of(question) == "train" and question != p.meta["question"]
            chain, answer = line[len(question):].split("#")  # a complete worked solution, correct
            assert chain.startswith(question[:-1]) and int(answer) == eval(question[:-1], {"__builtins__": {}})


def test_reward_is_arith_on_the_question():
    arith, hay = make_task("arith"), make_task("arith_haystack", context_chars=300)
    for p, q in zip(hay.sample("val", 20, seed=0), arith.sample("val", 20, seed=0)):
        assert p.meta["question"] == q.prompt and (p.answer, p.solution) == (q.answer, q.solution)
        assert hay.format_completion(p) == arith.format_completion(q)
        wrong = q.solution[:q.solution.rindex("#") + 1] + str(int(q.answer) + 1)
        for completion in (q.solution, wrong, "", "no marker", f"#{q.answer}", b"\xff"):
            assert hay.reward(p, completion) == arith.reward(q, completion)
        assert hay.reward(p, q.solution) == 1.0


def test_every_character_is_in_the_tiny_alphabet():
    tok = CharTokenizer()
    unk = tok.encode("?")[0]
    for knobs in ({}, {"ops": "+-*/", "max_value": 50, "mul_digits": (1, 2)}, {"style": "steps"}, {"layout": "both"}):
        task = make_task("arith_haystack", context_chars=2048, **knobs)
        for p in task.sample("train", 5, seed=0) + task.sample("val", 2, seed=0):
            text = p.prompt + task.format_completion(p)
            assert set(text) <= set(CHAR_ALPHABET) and "?" not in text
            assert unk not in tok.encode(text) and tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("knobs, message", [
    ({"context_chars": -1}, r"context_chars must be an int in \[0, 32768\].*got -1"),
    ({"context_chars": MAX_CONTEXT_CHARS + 1}, r"context_chars must be an int in \[0, 32768\].*got 32769"),
    ({"context_chars": 4096.0}, r"context_chars must be an int.*got 4096.0"),
    ({"context_chars": True}, r"context_chars must be an int.*got True"),
    ({"layout": "middle"}, r"layout must be one of end, both, got 'middle'"),
    ({"operands": (1, 3)}, r"arith: operands must be"),  # arith's own knobs are checked as arith's
    ({"colour": "red"}, r"unknown knob.*colour.*context_chars"),
])
def test_bad_knobs_are_refused(knobs, message):
    with pytest.raises(ValueError, match=message):
        make_task("arith_haystack", **knobs)


def test_registered_and_preset_loads():
    assert TASKS["arith_haystack"] is ArithHaystackTask
    cfg = load_config("tiny-long")
    assert cfg.task.name == "arith_haystack" and cfg.policy.init == "tiny-sft"
    assert cfg.draft.mode == "cotrain" and cfg.draft.kind == "dflash"
    task = make_task(cfg.task.name, max_chars=cfg.task.max_chars, format_reward=cfg.task.format_reward)  # as the trainer
    assert task.context_chars == 4096
    (p,) = task.sample("val", 1, seed=cfg.seed)
    assert len(CharTokenizer().prompt_ids(p.prompt)) + cfg.rollout.max_new_tokens <= 65536
    assert cfg.rollout.max_new_tokens >= max(len(q.solution) for q in task.sample("train", 200, seed=0)) + 1


def test_loaded_tiny_model_takes_the_longest_prompts(tmp_path):
    """The tiny folder says 512 positions (nominal: RoPE has no table); loaded, it takes 32K-char prompts."""
    tok = CharTokenizer()
    torch.manual_seed(0)
    save_pretrained(Transformer(warmstart.tiny_model_config(tok)), tmp_path,
                    extra_files={warmstart.CHAR_TOKENIZER_FILE: json.dumps({"alphabet": tok.alphabet})})
    assert json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"] == 512
    model, tok = warmstart.load_tiny(tmp_path)
    assert model.config.max_position_embeddings == warmstart.TINY_MAX_POSITIONS >= MAX_CONTEXT_CHARS + 1 + 32 + 400
    prompt = tok.prompt_ids(make_task("arith_haystack", context_chars=1024).sample("val", 1)[0].prompt)
    (out,) = Engine(model).generate([prompt], 4, temperature=0.0)  # refused above 512 before
    assert len(out.tokens) >= 1
