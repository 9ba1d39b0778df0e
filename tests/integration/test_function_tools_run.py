"""env.tools end to end: plain functions in a file written here are the tools of a real multi-turn run.

The oracle: the `lookup` environment's two tools written as typed functions give the very same run as
`env.name=lookup` (seeded, env.overlap=false): the same tool calls, turns and rewards step for step, though
the functions run in worker processes that import the file by its path and the built-in tools on threads.
And the tiny policy on `arith` with a tool it never learned finishes its run."""
from __future__ import annotations

import json

import pytest

from codraft.config import load_config
from codraft.rl.trainer import train

LOOKUP_TOOLS = '''
from codraft.tasks import make_task

TABLE = make_task("lookup")


def dept(who: str) -> str:
    """An employee's department.

    Args:
        who: the employee's name
    """
    return TABLE.dept_of.get(who, "error: no such employee")


def budget(d: str) -> int | str:
    """A department's budget.

    Args:
        d: the department
    """
    return TABLE.budget_of.get(d, "error: no such department")
'''


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_lookup_as_functions_equals_the_lookup_environment(tiny_tools_policy, tmp_path):
    (tmp_path / "lookup_tools.py").write_text(LOOKUP_TOOLS)
    common = [f"policy.init={tiny_tools_policy}", "steps=2", "draft.mode=none", "rollout.prompts_per_step=2",
              "log.val_every=0", "log.speedup_every=0", "log.checkpoint_every=0", "env.overlap=false"]
    train(load_config("tiny-tools", [*common, f"run_dir={tmp_path / 'env'}", "env.name=lookup"]), progress=False)
    train(load_config("tiny-tools", [*common, f"run_dir={tmp_path / 'fn'}", "env.name=none",
                                      f"env.tools={tmp_path / 'lookup_tools.py'}:dept,budget"]), progress=False)
    env, fn = _rows(tmp_path / "env"), _rows(tmp_path / "fn")
    assert len(env) == len(fn) == 2
    for a, b in zip(env, fn):
        assert a["tool_calls_mean"] >= 1 and b["env_errors"] == 0
        assert a.keys() == b.keys()
        for key in a:  # the same episodes, so the same update: everything but the clocks
            if not key.startswith("time_") and key != "tokens_per_s":
                assert a[key] == pytest.approx(b[key], rel=1e-6), key


def test_a_run_with_a_tool_it_never_learned_completes(tmp_path):
    """tiny-sft on arith with an `add` tool: the run completes and logs its episodes (it may never call it)."""
    (tmp_path / "t.py").write_text('def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: one\n'
                                   '        b: two\n    """\n    return a + b\n')
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "steps=2", "draft.init=random",
                             "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=24",
                             "log.val_every=2", "log.val_size=4", "log.speedup_every=0", "log.checkpoint_every=0",
                             f"env.tools={tmp_path / 't.py'}:add"])
    train(cfg, progress=False)
    rows = [r for r in _rows(tmp_path / "run") if "turns_mean" in r]  # (step 0: the validation before training)
    assert [r["step"] for r in rows] == [1, 2] and all(r["env_errors"] == 0 for r in rows)
    assert all(0 <= r["tool_calls_mean"] and r["turns_mean"] >= 1 for r in rows)
