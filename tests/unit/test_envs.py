"""Environments (codraft.envs): the tools, the formats, and faults that end one episode only: a tool that
raises, hangs past env.timeout or returns something other than text, an unknown tool."""
from __future__ import annotations

import time

import pytest

from codraft.envs import Calculator, EpisodeBatch, ToolFormat, calc, make_env
from codraft.rollout.engine import GenerationResult
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer

TOK = CharTokenizer()
FMT = ToolFormat.for_tokenizer(TOK)


def test_calc():
    assert calc("17+23*4-8") == "101" and calc("7/2") == "3.5" and calc(" -3 * (2+1) ") == "-9"
    for bad in ("1/0", "__import__('os')", "2**3", "x+1", "9" * 10 + "*" + "9" * 10):
        assert calc(bad).startswith("error:")


def test_formats():
    assert FMT.parse("12+[calc 3*4]") .args == "3*4" and FMT.parse("no call#3") is None
    assert FMT.render("12") == "{12}" and FMT.stop_ids(TOK) == TOK.encode("]")
    chat = ToolFormat("<tool_call>", "</tool_call>", str)
    call = chat.parse("I will compute.<tool_call>calc 2+2</tool_call>")
    assert (call.name, call.args) == ("calc", "2+2")


def test_lookup_task_and_env():
    task = make_task("lookup")
    env = make_env("lookup", task)
    for p in task.sample("train", 20):
        who = p.prompt.split("+")[0]
        d = env.tools["dept"](who)
        assert p.solution.startswith(f"[dept {who}]{{{d}}}[budget {d}]")
        assert task.reward(p, p.solution) == 1.0
    assert env.tools["dept"]("nobody").startswith("error")
    with pytest.raises(ValueError, match="known: calculator, lookup"):
        make_env("search", task)
    with pytest.raises(ValueError, match="task.name=lookup"):
        make_env("lookup", make_task("arith"))


class Faulty(Calculator):
    """calc misbehaves on chosen arguments."""
    def __init__(self):
        super().__init__(make_task("arith"))
        self.tools = {"calc": self.run}

    def run(self, args):
        if args == "raise":
            raise RuntimeError("tool crashed")
        if args == "hang":
            time.sleep(30)
        if args == "bytes":
            return b"12"
        return calc(args)


def _wait(batch):
    out = []
    while batch.pending:
        out += batch.ready("any")
    return dict(out)


def test_faults_end_only_their_episode():
    problems = make_task("arith").sample("train", 5)
    batch = EpisodeBatch(Faulty(), problems, TOK, FMT, timeout=0.5)
    turns = ["[calc 2+3]", "[calc raise]", "[calc hang]", "[calc bytes]", "[search x]"]
    t0 = time.monotonic()
    for row, text in enumerate(turns):
        batch.submit(row, TOK.encode(text))
    answers = _wait(batch)
    assert time.monotonic() - t0 < 5  # the hung call is given up at env.timeout, not waited for
    assert answers[0] == TOK.encode("{5}") and all(answers[r] is None for r in (1, 2, 3, 4))
    assert "RuntimeError('tool crashed')" in batch.reasons[1] and "env.timeout=0.5" in batch.reasons[2]
    assert "returned bytes, not text" in batch.reasons[3] and "unknown tool 'search'" in batch.reasons[4]
    assert batch.faults == {1, 2, 3}  # an unknown tool is the policy's mistake, not an environment fault
    # the run goes on: the healthy episode continues and ends with its final turn
    batch.submit(0, TOK.encode(f"5#{problems[0].answer}"))
    assert _wait(batch) == {0: None}
    results = [GenerationResult(TOK.encode(t + f"#{p.answer}"), [], "eos", None) for t, p in zip(turns, problems)]
    episodes = batch.score(results)
    assert [e.fault for e in episodes] == [False, True, True, True, False]
    assert [e.reward for e in episodes] == [1.0, 0.0, 0.0, 0.0, 1.0]  # (faults score 0 whatever they wrote)
    assert [e.tool_calls for e in episodes] == [1] * 5  # calls made, failed ones too
    assert episodes[0].reason is None and "unknown tool" in episodes[4].reason


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="env.timeout"):
        EpisodeBatch(Faulty(), [], TOK, FMT, timeout=0)


def test_chat_format_answers_as_a_tool_turn(tmp_path):
    """A ChatML tokenizer: the turn ends with EOS (no other stop token) and the result comes back as a
    `tool` turn of the template, special tokens as their single ids, then a new assistant turn."""
    from codraft.tokenizer import HFTokenizer
    from tokenizer_folder import tiny_tokenizer_folder
    tok = HFTokenizer(tiny_tokenizer_folder(tmp_path / "tok"))
    fmt = ToolFormat.for_tokenizer(tok)
    assert fmt.stop_ids(tok) == []
    batch = EpisodeBatch(Calculator(make_task("arith")), make_task("arith").sample("train", 1), tok, fmt, timeout=5)
    batch.submit(0, tok.encode("Let me compute. <tool_call>calc 2+3</tool_call>") + [tok.eos_id])
    (row, obs), = _wait(batch).items()
    start, end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    assert len(start) == len(end) == 1 and end == [tok.eos_id]
    assert obs == tok.encode("\n") + start + tok.encode("tool\n5") + end + tok.encode("\n") + start \
        + tok.encode("assistant\n")
    batch.close()
