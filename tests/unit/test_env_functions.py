"""Tools as plain functions (env.tools, codraft.envs.functions): the JSON schema from the hints and docstring
(transformers' get_json_schema as the oracle), the arguments checked against the hints (a bad one is an
error observation), scripted episodes in the tiny and the chat formats, the tools in the chat prompt, the
refusals in one line, and the functions isolated in worker processes that import the file by its path."""
from __future__ import annotations

import json
import os
import pickle
import re
from types import SimpleNamespace

import pytest

from codraft.config import load_config
from codraft.config.schema import ConfigError
from codraft.envs import EpisodeBatch, FunctionTools, ToolFormat, ToolSpecError, json_schema, make_env, prompt_ids
from codraft.envs.functions import load_functions, parse_docstring
from codraft.rewards.calling import Result
from codraft.rewards.reward_set import RewardFn, RewardSet
from codraft.rl import scoring
from codraft.rl.rollout_phase import Rollout
from codraft.rollout.engine import GenerationResult
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer, HFTokenizer
from tokenizer_folder import tiny_tokenizer_folder

TOK = CharTokenizer()
FMT = ToolFormat.for_tokenizer(TOK)
TASK = make_task("arith")

TOOLS = '''
import os
from typing import Any, Literal, Optional, Union


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number
        b: The second number
    """
    return a + b


def weather(city: str, unit: Literal["c", "f"] = "c", days: Optional[int] = None) -> dict:
    """The weather in a city.

    Longer text about it.

    Args:
        city: The city's name, e.g. Paris,
            in any case.
        unit: Celsius or Fahrenheit
        days: How many days ahead

    Returns:
        The forecast.
    """
    if city == "atlantis":
        raise ValueError("no such city")
    return {"city": city, "unit": unit, "days": days}


def kinds(xs: list[int], m: dict[str, float], flag: bool, x: Union[int, str], y: float | None, z: Any,
          w: list[Union[int, list[str]]], drink: str, r: float = 0.5) -> str:
    """Every supported hint.

    Args:
        xs: integers
        m: a map to numbers
        flag: a flag
        x: an integer or text
        y: a number or nothing
        z: anything
        w: nested lists
        drink: a drink (choices: ["tea", "coffee"])
        r: a ratio
    """
    return json.dumps([xs, m, flag, x, y, z, w, drink, r])


def pid() -> str:
    """The process the tool runs in."""
    return str(os.getpid())


def leave(code: int) -> str:
    """Exit the process.

    Args:
        code: exit code
    """
    os._exit(code)


def shout(text: str) -> str:
    """Upper case.

    Args:
        text: what to shout
    """
    return text.upper()


def blob() -> object:
    """Returns what JSON cannot write."""
    return object()


def untyped(a, b: int):
    """No hint for a."""


def starry(*xs: int):
    """Any number."""


def tupled(p: tuple[int, int]):
    """A tuple."""


class Point:
    pass


def custom(p: Point):
    """A class."""
'''


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"  # (not on sys.path: the trainer and the workers import it by its path)
    path.write_text("import json\n" + TOOLS)
    return path


def _wait(batch) -> dict:
    out = []
    while batch.pending:
        out += batch.ready("any")
    return dict(out)


def test_schemas_equal_transformers_get_json_schema(tools_file):
    transformers = pytest.importorskip("transformers.utils")
    funcs = load_functions(f"{tools_file}:add,weather,kinds,shout")
    for fn in funcs.values():
        assert json_schema(fn) == transformers.get_json_schema(fn), fn.__name__
    s = json_schema(funcs["weather"])["function"]
    assert s["description"] == "The weather in a city.\n\nLonger text about it."
    assert s["parameters"]["required"] == ["city"]
    assert s["parameters"]["properties"]["city"]["description"] == "The city's name, e.g. Paris, in any case."
    assert s["parameters"]["properties"]["unit"] == {"type": "string", "enum": ["c", "f"],
                                                     "description": "Celsius or Fahrenheit"}
    assert s["parameters"]["properties"]["days"] == {"type": "integer", "nullable": True,
                                                     "description": "How many days ahead"}
    assert s["return"] == {"type": "object", "description": "The forecast."}


def test_docstring_sections():
    doc = "Says hi.\n\nArgs:\n    a: first\n        and more\n    b (int): second\nRaises:\n    ValueError: never"
    assert parse_docstring(doc) == ("Says hi.", {"a": "first and more", "b": "second"}, None)


def test_arguments_are_checked_against_the_hints(tools_file):
    env = FunctionTools(TASK, f"{tools_file}:add,weather,kinds,shout,pid")
    t = env.tools
    assert t["add"]("2 3") == "5" and t["add"]('{"a": 2, "b": -3}') == "-1"  # the return as JSON
    assert t["shout"]("hi there") == "HI THERE"  # text as is; the last parameter takes the rest
    assert json.loads(t["weather"]("oslo f 2")) == {"city": "oslo", "unit": "f", "days": 2}
    assert json.loads(t["weather"]('{"city": "oslo", "days": null}'))["days"] is None
    kinds = json.loads(t["kinds"](json.dumps({"xs": [1, 2], "m": {"a": 1}, "flag": True, "x": "v", "y": None,
                                              "z": {"any": [1]}, "w": [3, ["a"]], "drink": "tea"})))
    assert kinds == [[1, 2], {"a": 1.0}, True, "v", None, {"any": [1]}, [3, ["a"]], "tea", 0.5]
    bad = {"add": ["2", "2 x", '{"a": 2, "b": "3"}', '{"a": 2.5, "b": 1}', '{"a": true, "b": 1}',
                   '{"a": 1, "b": 2, "c": 3}', '{"a": 1', "[1, 2]"],
           "weather": ["oslo kelvin", '{"city": 3}', '{"unit": "c"}'],
           "kinds": ['{"xs": [1, "2"], "m": {}, "flag": true, "x": 1, "y": 1, "z": 0, "w": [], "drink": "tea"}',
                     '{"xs": [], "m": {"a": "b"}, "flag": true, "x": 1, "y": 1, "z": 0, "w": [], "drink": "tea"}',
                     '{"xs": [], "m": {}, "flag": 1, "x": 1, "y": 1, "z": 0, "w": [], "drink": "tea"}',
                     '{"xs": [], "m": {}, "flag": true, "x": 1.5, "y": 1, "z": 0, "w": [], "drink": "tea"}',
                     '{"xs": [], "m": {}, "flag": true, "x": 1, "y": 1, "z": 0, "w": [[1]], "drink": "tea"}'],
           "pid": ["x"]}
    for name, calls in bad.items():
        for args in calls:
            assert t[name](args).startswith(f"error: {name}: "), (name, args)
    assert t["add"]("2") == "error: add: missing argument 'b'"
    assert t["add"]('{"a": 1, "b": 2, "c": 3}') == "error: add: unknown argument 'c' (parameters: a, b)"
    assert t["add"]("2 x") == "error: add: 'b' must be an integer, got \"x\""
    # an exception of the function is the policy's observation too (its way of saying "bad input")
    assert t["weather"]("atlantis") == "error: weather raised ValueError: no such city"


def test_refusals_are_one_line(tools_file, tmp_path):
    cases = {f"{tmp_path}/nope.py:f": "no such file",
             f"{tools_file}:nothing": "has no function 'nothing'",
             f"{tools_file}:untyped": "parameter 'a' has no type hint",
             f"{tools_file}:tupled": "parameter 'p': type hint tuple[int, int] is not supported",
             f"{tools_file}:custom": "parameter 'p': type hint Point is not supported",
             f"{tools_file}:add,add": "two tools are named 'add'",
             f"{tools_file}:add,{tools_file}:add": "two tools are named 'add'",
             "add": "names no file or module",
             "no_such_module_xyz:f": "module 'no_such_module_xyz' cannot be imported"}
    for spec, why in cases.items():
        with pytest.raises(ToolSpecError, match=re.escape(why)) as e:
            FunctionTools(TASK, spec)
        assert "\n" not in str(e.value)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('at import')\n")
    with pytest.raises(ToolSpecError, match="raised RuntimeError"):
        FunctionTools(TASK, f"{broken}:f")
    with pytest.raises(ToolSpecError, match=r"not \*args or \*\*kwargs"):
        FunctionTools(TASK, f"{tools_file}:starry")


def test_module_functions(tmp_path, monkeypatch):
    (tmp_path / "pkg_tools_mod.py").write_text("def twice(n: int) -> int:\n    '''Twice.'''\n    return 2 * n\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = FunctionTools(TASK, "pkg_tools_mod:twice")
    assert env.tools["twice"]("21") == "42" and env.schemas[0]["function"]["name"] == "twice"


def test_config_keys(tools_file, tmp_path):
    cfg = load_config(None, [f"env.tools={tools_file}:add,weather"]).validate()
    assert cfg.env.tools.endswith("my_tools.py:add,weather")
    load_config(None, ["task.name=lookup", f"env.tools={tools_file}:add"]).validate()  # (your tools: any task)
    for override, why in ((f"env.tools={tmp_path}/none.py:f", "no such file"),
                          ("env.tools=add", "'env.tools' must be FILE.py:f,g"),
                          (f"env.tools={tools_file}:1x", "'env.tools' must be FILE.py:f,g")):
        with pytest.raises(ConfigError, match=why):
            load_config(None, [override]).validate()
    with pytest.raises(ConfigError, match="needs env.name=none"):
        load_config(None, ["env.name=calculator", f"env.tools={tools_file}:add"]).validate()
    env = make_env("none", TASK, f"{tools_file}:add")
    assert isinstance(env, FunctionTools)


def test_scripted_episodes_in_the_tiny_format(tools_file):
    """Calls answered in worker processes (auto isolation: your code), bad calls answered with an error the
    policy reads, a function that returns what JSON cannot write ends its episode, and the episodes score
    with the task's reward."""
    problems = TASK.sample("train", 5)
    env = FunctionTools(TASK, f"{tools_file}:add,pid,blob")
    batch = EpisodeBatch(env, problems, TOK, FMT, timeout=10, workers=2)
    assert batch.pool.kind == "process"
    turns = ["[add 2 3]", '[add {"a": 40, "b": 2}]', "[add 2 x]", "[pid]", "[blob]"]
    for row, text in enumerate(turns):
        batch.submit(row, TOK.encode(text))
    answers = _wait(batch)
    assert answers[0] == TOK.encode("{5}") and answers[1] == TOK.encode("{42}")
    assert TOK.decode(answers[2]) == "{error: add: 'b' must be an integer, got \"x\"}"
    assert int(TOK.decode(answers[3])[1:-1]) != os.getpid()  # it ran in a worker process
    assert answers[4] is None and 4 in batch.faults and "not JSON serializable" in batch.reasons[4]
    results = [GenerationResult(TOK.encode(f"{t}#{p.answer}"), [], "eos", None) for t, p in zip(turns, problems)]
    episodes = batch.score(results)
    assert [e.reward for e in episodes] == [1.0, 1.0, 1.0, 1.0, 0.0] and [e.fault for e in episodes] == [0, 0, 0, 0, 1]


def test_a_function_that_exits_ends_only_its_episode(tools_file):
    problems = TASK.sample("train", 3)
    env = FunctionTools(TASK, f"{tools_file}:add,leave")
    batch = EpisodeBatch(env, problems, TOK, FMT, timeout=10, workers=2)
    for row, text in enumerate(["[leave 7]", "[add 1 1]", "[add 2 2]"]):
        batch.submit(row, TOK.encode(text))
    answers = _wait(batch)
    assert answers == {0: None, 1: TOK.encode("{2}"), 2: TOK.encode("{4}")}
    assert batch.faults == {0} and "died (exit code 7) during tool 'leave'" in batch.reasons[0]
    batch.submit(1, TOK.encode("[add 5 5]"))  # the pool is whole again
    assert _wait(batch) == {1: TOK.encode("{10}")}
    batch.close()


def test_chat_format_json_calls_and_the_tools_in_the_prompt(tools_file, tmp_path):
    """A ChatML model: the tools' schemas reach the prompt (the Hermes block in the system turn for a template
    that takes no tools, the template's own rendering where it does), and a Hermes JSON call is answered."""
    tok = HFTokenizer(tiny_tokenizer_folder(tmp_path / "tok"))
    assert not tok.renders_tools
    env = FunctionTools(TASK, f"{tools_file}:add,weather")
    problem = TASK.sample("train", 1)[0]
    text = tok.decode(prompt_ids(env, tok, problem), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(env.schemas[0]) in text
    assert text.endswith(f"<|im_start|>user\n{problem.prompt}<|im_end|>\n<|im_start|>assistant\n")
    template = ("{% if tools %}{{ '<|im_start|>system\\nTOOLS ' + (tools | map(attribute='function.name') | join(',')) "
                "+ '<|im_end|>\\n' }}{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + "
                "m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tok2 = HFTokenizer(tiny_tokenizer_folder(tmp_path / "tok2", template=template))
    assert tok2.renders_tools
    text2 = tok2.decode(prompt_ids(env, tok2, problem), skip_special_tokens=False)
    assert text2.startswith("<|im_start|>system\nTOOLS add,weather<|im_end|>\n<|im_start|>user\n")
    assert prompt_ids(env, TOK, problem) == TOK.prompt_ids(problem.prompt)  # the tiny policy: its own prompt

    fmt = ToolFormat.for_tokenizer(tok)
    call = fmt.parse('Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    assert (call.name, json.loads(call.args)) == ("add", {"a": 2, "b": 3})
    batch = EpisodeBatch(env, [problem] * 2, tok, fmt, timeout=10, workers=1)
    batch.submit(0, tok.encode('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
                 + [tok.eos_id])
    batch.submit(1, tok.encode('<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"oslo\\"}"}</tool_call>'))
    answers = _wait(batch)
    assert tok.decode(answers[0], skip_special_tokens=False) == \
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert '{"city": "oslo", "unit": "c", "days": null}' in tok.decode(answers[1])
    batch.close()


class _Rewards:
    """The run's reward set, as the trainer hands it (codraft.rewards.RewardSet.score's surface)."""

    class Scores:
        def __init__(self, totals, errors):
            self.totals, self.errors = totals, errors

    def score(self, problems, texts, ids):
        assert len(texts) == 1 and ids[0] == TOK.encode(texts[0])
        if "boom" in texts[0]:
            return self.Scores([0.0], ["mine: RuntimeError('boom')"])
        return self.Scores([None if "skip" in texts[0] else float(len(texts[0]))], [])


def test_episodes_score_with_the_runs_reward_functions(tools_file):
    problems = TASK.sample("train", 3)
    env = FunctionTools(TASK, f"{tools_file}:add", rewards=_Rewards())
    batch = EpisodeBatch(env, problems, TOK, FMT, timeout=10, workers=1)
    results = [GenerationResult(TOK.encode(t), [], "eos", None) for t in ("abc", "boom", "skip")]
    episodes = batch.score(results)
    assert [e.reward for e in episodes] == [3.0, 0.0, None]  # None: no function judged it (dropped)
    assert episodes[0].reward_error is None and "boom" in str(episodes[1].reward_error)


def test_a_failing_reward_function_scores_0_and_the_others_count_as_in_a_single_turn_run(tools_file):
    """The run's RewardSet: a function that raises scores 0 on that episode and the others' values still
    count (its error comes with the reward, not in place of it), exactly the single-turn total; an episode
    no function judged has no reward (None), and the step drops it."""
    def good(problems, batch):
        return Result([None if "skip" in t else 1.0 for t in batch.texts], [None] * len(problems))

    def bad(problems, batch):
        return Result([None] * len(problems), [None if "skip" in t else "RuntimeError('boom')"
                                               for t in batch.texts])
    rewards = RewardSet([RewardFn("good", 1.0, good), RewardFn("bad", 0.5, bad)])
    problems = TASK.sample("train", 2)
    single = rewards.score(problems, ["abc", "skip"], [TOK.encode("abc"), TOK.encode("skip")])
    assert single.totals == [1.0, None]
    env = FunctionTools(TASK, f"{tools_file}:add", rewards=rewards)
    batch = EpisodeBatch(env, problems, TOK, FMT, timeout=10, workers=1)
    episodes = batch.score([GenerationResult(TOK.encode(t), [], "eos", None) for t in ("abc", "skip")])
    assert [e.reward for e in episodes] == single.totals
    assert "bad: RuntimeError('boom')" in str(episodes[0].reward_error) and episodes[1].reward_error is None

    cfg = SimpleNamespace(rollout=SimpleNamespace(group_size=2), grpo=SimpleNamespace(leave_one_out=False))
    rollout = Rollout(problems, [[0]] * 2, episodes, None, 0.0, 0)
    with pytest.warns(UserWarning, match="failed on 1/2 samples"):
        scored = scoring.score(0, rollout, cfg, env=env, rewards=None, tok=TOK, world=None)
    assert scored.kept.tolist() == [True, False] and scored.rewards.tolist() == [1.0, 0.0]
    assert scored.metrics["reward_dropped"] == 1 and len(scored.errors) == 1
    assert not any(rollout.out[1].mask) and scored.advantages.tolist() == [0.0, 0.0]  # its tokens leave the losses


def test_the_environment_reaches_a_worker_by_the_files_path(tools_file):
    """Pickled as (task, spec) with the file's absolute path: rebuilt in a worker from another folder."""
    env = FunctionTools(TASK, f"{os.path.relpath(tools_file)}:add", rewards=_Rewards())
    cls, (task, spec) = env.__reduce__()
    assert cls is FunctionTools and spec == f"{tools_file}:add"
    again = pickle.loads(pickle.dumps(env))
    assert again.rewards is None and again.tools["add"]("1 2") == "3"
