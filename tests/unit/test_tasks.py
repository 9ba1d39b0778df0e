"""Tasks and rewards: determinism, disjoint splits, answers against independent oracles, reward edge cases."""
from __future__ import annotations

import re
import statistics

import pytest

from codraft.tasks import Problem, make_task, parse_number
from codraft.tokenizer import CHAR_ALPHABET

ARITH_KNOBS = [
    {},  # the defaults
    {"operands": (2, 6), "ops": "+-*/", "mul_digits": (2, 2), "max_value": None},
    {"operands": (3, 5), "allow_negative": True, "add_digits": (2, 4), "p_product": 0.8, "max_value": None},
    {"operands": (2, 3), "ops": "+", "min_products": 0, "add_digits": (1, 3), "max_value": 500},
    {"style": "steps"},
    {"style": "steps", "operands": (2, 6), "ops": "+-*/", "mul_digits": (2, 2), "max_value": None},
]


def _oracle(prompt: str) -> int:
    """Python's own precedence rules; '/' gives a float that must be integral."""
    assert prompt.endswith("=") and re.fullmatch(r"[0-9+\-*/]+", prompt[:-1]), prompt
    value = eval(prompt[:-1], {"__builtins__": {}})  # the prompt is digits and operators only (asserted)
    assert value == int(value), prompt
    return int(value)


# ---------------------------------------------------------------- arith problems


def test_arith_deterministic_per_seed():
    task = make_task("arith")
    a, b, c = (task.sample("train", 200, seed=s) for s in (0, 0, 1))
    assert [p.prompt + p.solution for p in a] == [p.prompt + p.solution for p in b]
    assert [p.prompt for p in a] != [p.prompt for p in c]
    # sample() is the distinct prefix of stream(), so growing n keeps earlier problems
    assert [p.prompt for p in task.sample("train", 50, seed=0)] == [p.prompt for p in a[:50]]


def test_arith_splits_disjoint():
    task = make_task("arith")
    train = {p.prompt for s in (0, 1) for p in task.sample("train", 2000, seed=s)}
    val = {p.prompt for s in (0, 1) for p in task.sample("val", 300, seed=s)}
    assert len(val) > 300 and train.isdisjoint(val)
    assert {task.split_of(p) for p in train} == {"train"} and {task.split_of(p) for p in val} == {"val"}


@pytest.mark.parametrize("knobs", ARITH_KNOBS)
def test_arith_solution_matches_python_eval(knobs):
    task = make_task("arith", **knobs)
    for p in task.sample("train", 500, seed=3) + task.sample("val", 50, seed=3):
        want = _oracle(p.prompt)
        assert p.answer == str(want), p
        worked, final = p.solution.split("#")
        assert final == p.answer and task.reward(p, task.format_completion(p)) == 1.0
        if task.style == "steps":
            for step in worked.split(";") if worked else []:  # every worked step is itself true
                lhs, rhs = step.split("=")
                assert _oracle(lhs + "=") == int(rhs), (p.prompt, step)
        else:  # a chain of equal expressions from the prompt's, one operator fewer each time
            chain = worked.split("=")
            assert chain[0] + "=" == p.prompt and chain[-1] == p.answer, p
            assert all(_oracle(e + "=") == want for e in chain), p
            ops = [len(re.findall(r"(?<=\d)[-+*/]", e)) for e in chain]
            assert ops == list(range(ops[0], -1, -1)), p
        assert set(p.prompt + p.solution) <= set(CHAR_ALPHABET)
        if not knobs.get("allow_negative"):
            assert "=-" not in p.solution and want >= 0
        if "*" in task.ops and task.min_products:
            assert re.search(r"[*/]", p.prompt), p.prompt


def test_arith_defaults_shape():
    task = make_task("arith")
    problems = task.sample("train", 2000, seed=0)
    assert statistics.mean(len(task.format_completion(p)) for p in problems) >= 24
    lo, hi = task.operands
    counts = {len(re.findall(r"\d+", p.prompt)) for p in problems}
    assert counts == set(range(lo, hi + 1))
    assert any("*" in p.prompt for p in problems) and not any("/" in p.prompt for p in problems)


def test_arith_knob_errors():
    with pytest.raises(ValueError, match="style"):
        make_task("arith", style="prose")
    with pytest.raises(ValueError, match="operands"):
        make_task("arith", operands=(1, 3))
    with pytest.raises(ValueError, match="ops"):
        make_task("arith", ops="*")
    with pytest.raises(ValueError, match="val_fraction"):
        make_task("arith", val_fraction=0.0)
    with pytest.raises(ValueError, match="distinct"):  # 9 one-digit sums only: asks for too many
        make_task("arith", operands=(2, 2), add_digits=(1, 1), ops="+", min_products=0).sample("train", 100)
    with pytest.raises(ValueError, match="no expression satisfies"):  # 2-digit products can't stay <= 20
        make_task("arith", mul_digits=(2, 2), min_products=1).sample("train", 1)


def test_make_task_errors_name_valid_choices():
    with pytest.raises(ValueError, match="arith, arith_haystack, chain_sum, gsm_symbolic"):
        make_task("nope")
    with pytest.raises(ValueError, match="unknown knob.*colour.*operands"):
        make_task("arith", colour="red")
    with pytest.raises(ValueError, match="split"):
        make_task("arith").sample("test", 3)


# ---------------------------------------------------------------- rewards


@pytest.fixture
def arith_problem() -> Problem:
    return Problem(prompt="17+23*4-8=", answer="101", solution="23*4=92;17+92=109;109-8=101#101")


def test_reward_correct_and_wrong(arith_problem):
    task = make_task("arith")
    p = arith_problem
    assert task.reward(p, p.solution) == 1.0
    assert task.reward(p, "#101") == 1.0  # the steps are not graded, only the final answer
    assert task.reward(p, "23*4=92;17+92=109;109-8=101#101.0") == 1.0
    assert task.reward(p, "#1 01") == 1.0 and task.reward(p, "# +101") == 1.0
    assert task.reward(p, "23*4=92;17+92=109;109-8=100#100") == 0.0
    assert task.reward(p, "#101#100") == 0.0 and task.reward(p, "#100#101") == 1.0  # the last marker counts
    assert task.reward(p, "101") == 0.0  # no marker
    assert task.reward(p, "#101;5+5=10") == 0.0  # junk after the answer
    assert task.reward(p, "#-101") == 0.0


def test_format_reward(arith_problem):
    task = make_task("arith", format_reward=0.1)
    assert task.reward(arith_problem, "#100") == pytest.approx(0.1)
    assert task.reward(arith_problem, "#10x") == 0.0 and task.reward(arith_problem, "no marker") == 0.0
    assert task.reward(arith_problem, "#101") == 1.0


@pytest.mark.parametrize("bad", [
    "", "#", "####", "#abc", "#1.2.3", "#nan", "#inf", "#1e2", "\x00\x01#", "#" + "9" * 5000,
    "#101\ufffd", "#101\udc80", b"\xff\xfe#101", b"#101\x80", None, 101, ["#101"], Problem("", "", ""),
])
def test_reward_garbage_is_zero(arith_problem, bad):
    assert make_task("arith").reward(arith_problem, bad) == 0.0


def test_reward_bytes_and_length(arith_problem):
    task = make_task("arith", max_chars=40)
    assert task.reward(arith_problem, arith_problem.solution.encode()) == 1.0
    assert task.reward(arith_problem, bytearray(b"#101")) == 1.0
    assert task.reward(arith_problem, " " * 36 + "#101") == 1.0  # exactly max_chars
    assert task.reward(arith_problem, " " * 37 + "#101") == 0.0  # over-long


def test_parse_number():
    assert parse_number("42.0") == parse_number("42") == parse_number(" 4,2 ") == parse_number("$42.")
    assert parse_number("-1,081.50") == parse_number("-1081.5")
    for bad in ("", "-", ".", "4-2", "42abc", "1e3", "0x10", "nan"):
        assert parse_number(bad) is None, bad


# ---------------------------------------------------------------- gsm_symbolic


@pytest.fixture(scope="module")
def gsm():
    pytest.importorskip("reasoning_gym")
    return make_task("gsm_symbolic")


def test_gsm_deterministic_and_disjoint(gsm):
    a, b, c = (gsm.sample("train", 150, seed=s) for s in (0, 0, 1))
    assert [(p.prompt, p.solution) for p in a] == [(p.prompt, p.solution) for p in b]
    assert [p.prompt for p in a] != [p.prompt for p in c]
    val = {p.prompt for s in (0, 1) for p in gsm.sample("val", 40, seed=s)}
    train = {p.prompt for p in a + c}
    assert len(val) == 80 and train.isdisjoint(val)
    assert all(gsm.instruction in q for q in train | val)


def test_gsm_rewards_agree_with_reasoning_gym(gsm):
    import reasoning_gym

    problems = gsm.sample("train", 60, seed=0)
    entries = {}
    for p in problems:  # rebuild each source entry, to score with reasoning_gym's own checker
        seed, i = p.meta["rg_seed"], p.meta["rg_index"]
        if seed not in entries:
            entries[seed] = reasoning_gym.create_dataset("gsm_symbolic", size=gsm.chunk, seed=seed)
        entry = entries[seed][i]
        assert entry["question"].strip() in p.prompt and entry["answer"] == p.answer
        target = gsm.format_completion(p)
        assert target.splitlines()[-1].startswith("####")
        assert gsm.reward(p, target) == 1.0
        assert entries[seed].score_answer(gsm.extract_answer(target), entry) == 1.0
        wrong = f"I think so.\n#### {parse_number(p.answer) + 7}"
        assert gsm.reward(p, wrong) == 0.0
        assert entries[seed].score_answer(gsm.extract_answer(wrong), entry) < 1.0
        assert gsm.reward(p, f"#### {p.answer}\nthe end") == 1.0
        assert gsm.reward(p, f"#### {p.answer} apples") == 0.0  # "Do not include units."


def test_gsm_minimal_solution_when_no_worked_one(gsm):
    p = gsm.from_entry({"question": "What is 1,000+234?", "answer": "1234", "metadata": {}})
    assert p.solution == "#### 1234" and gsm.reward(p, "#### 1,234") == 1.0


def test_gsm_missing_package_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "reasoning_gym" else real(n, *a))
    with pytest.raises(ImportError, match="pip install reasoning-gym"):
        make_task("gsm_symbolic")
