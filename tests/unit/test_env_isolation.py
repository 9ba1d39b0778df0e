"""Tools cannot take the trainer down (codraft.envs.workers): a tool that exits its process or hangs ends
its episode as a counted environment error, the worker is replaced and the threads and processes stay
flat; an answer longer than env.max_observation_chars is cut before it is tokenised."""
from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import pytest

from codraft.envs import Calculator, Environment, EpisodeBatch, ToolFormat, calc
from codraft.envs.base import ToolCall
from codraft.envs.workers import Job, ToolWorkerError, resolve, tools_for
from codraft.rollout.engine import GenerationResult
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer

TOK = CharTokenizer()
FMT = ToolFormat.for_tokenizer(TOK)
TASK = make_task("arith")
RELEASE = threading.Event()  # the thread-isolated hangs wait on it (a thread cannot be killed)


class Unruly(Environment):
    """A user environment whose tools are lambdas (it does not pickle: a worker rebuilds it as cls(task))
    and which keeps per-episode state."""
    name = "unruly"

    def __init__(self, task):
        self.task = task
        self.tools = {"calc": calc, "exit": lambda code: os._exit(int(code)),
                      "hang": lambda _: time.sleep(60) or "late", "count": lambda _: "unused",
                      "big": lambda n: "x" * int(n)}

    def start(self, problem):
        return {"calls": 0}

    def call(self, problem, state, call):
        state["calls"] += 1
        if call.name == "count":
            return str(state["calls"])  # the state comes back from the worker with the answer
        return super().call(problem, state, call)


class Flaky(Calculator):
    """A subclass of a built-in: your code, so process-isolated by auto. Odd arguments hang."""

    def __post_init__(self):
        self.tools = {"calc": self.run}

    def run(self, args):
        if int(args) % 2:
            RELEASE.wait(60)  # (in a worker process: killed at env.timeout; on a thread: released by the test)
        return args


def _wait(batch) -> dict:
    out = []
    while batch.pending:
        out += batch.ready("any")
    return dict(out)


def _descendants() -> int:
    """Processes under this one, at any depth (the forkserver and its workers), zombies included."""
    parent = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # (gone meanwhile)
    ours, grew = {os.getpid()}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in ours} - ours
        ours |= more
        grew = bool(more)
    return len(ours) - 1


def test_auto_isolation_is_thread_only_for_the_built_in_environments():
    assert resolve(Calculator(TASK), "auto") == "thread" and resolve(make_env_lookup(), "auto") == "thread"
    assert resolve(Flaky(TASK), "auto") == "process" and resolve(Unruly(TASK), "auto") == "process"
    assert resolve(Flaky(TASK), "thread") == "thread" and resolve(Calculator(TASK), "process") == "process"


def make_env_lookup():
    from codraft.envs import make_env
    return make_env("lookup", make_task("lookup"))


def test_a_tool_that_exits_or_hangs_ends_only_its_episode():
    """os._exit(3) inside a tool: that episode ends as an environment error naming the exit code, the dead
    worker is replaced, and the other episodes (and later calls) go on."""
    problems = TASK.sample("train", 4)
    env = Unruly(TASK)
    batch = EpisodeBatch(env, problems, TOK, FMT, timeout=0.5, workers=2)
    assert batch.pool.kind == "process"
    for row, text in enumerate(["[exit 3]", "[calc 2+3]", "[hang x]", "[count x]"]):
        batch.submit(row, TOK.encode(text))
    t0 = time.monotonic()
    answers = _wait(batch)
    assert time.monotonic() - t0 < 5  # the hung call is given up at env.timeout, not waited for
    assert answers[1] == TOK.encode("{5}") and answers[3] == TOK.encode("{1}")
    assert answers[0] is None and answers[2] is None and batch.faults == {0, 2}
    assert "died (exit code 3) during tool 'exit'" in batch.reasons[0]
    assert "env.timeout=0.5" in batch.reasons[2] and "killed and replaced" in batch.reasons[2]
    # the pool is whole again, and an episode's state travels with its calls
    workers = batch.pool.idle + batch.pool.starting
    assert len(workers) == 2 and all(w.process.is_alive() for w in workers)
    batch.submit(3, TOK.encode("[count x]"))
    batch.submit(1, TOK.encode("[calc 6*7]"))
    assert _wait(batch) == {3: TOK.encode("{2}"), 1: TOK.encode("{42}")}
    results = [GenerationResult(TOK.encode(f"#{p.answer}"), [], "eos", None) for p in problems]
    episodes = batch.score(results)
    assert [e.fault for e in episodes] == [True, False, True, False]  # what env_errors sums
    assert [e.reward for e in episodes][:3:2] == [0.0, 0.0] and [e.tool_calls for e in episodes] == [1, 2, 1, 2]


def test_hung_tools_leave_threads_and_processes_flat():
    """100 calls, every other one hanging past env.timeout: with process isolation the worker processes are
    killed and replaced (as many as before, no thread started); with thread isolation the abandoned threads
    are capped at env.workers."""
    gc.collect()  # (an earlier test's environment collected mid-test would close its workers)
    workers, n = 4, 100
    problems = TASK.sample("train", n)
    env = Flaky(TASK)
    batch = EpisodeBatch(env, problems, TOK, FMT, timeout=0.2, workers=workers, isolation="process")
    threads, procs, children = threading.active_count(), _descendants(), len(mp.active_children())
    assert children >= workers
    seen = []
    for row in range(n):
        batch.submit(row, TOK.encode(f"[calc {row}]"))
        if row % workers == workers - 1:
            _wait(batch)
            seen.append((threading.active_count(), _descendants(), len(mp.active_children())))
    assert batch.faults == set(range(1, n, 2)) and batch.pool.replaced == n // 2
    assert all(s == (threads, procs, children) for s in seen), (threads, procs, children, seen)
    batch.close()

    RELEASE.clear()
    batch = EpisodeBatch(env, problems, TOK, FMT, timeout=0.2, workers=workers, isolation="thread")
    threads = threading.active_count()
    most = threads
    for row in range(n):
        batch.submit(row, TOK.encode(f"[calc {row}]"))
        if row % workers == workers - 1:
            _wait(batch)
            most = max(most, threading.active_count())
    assert set(range(1, n, 2)) <= batch.faults  # (past the cap, calls fail at once: every thread is stuck)
    assert most <= threads + workers, (threads, most)
    assert any("every tool thread is stuck" in r for r in batch.reasons.values())
    RELEASE.set()  # the stuck threads return, see they were abandoned, and end
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_long_answer_is_cut_before_it_is_tokenised(isolation):
    """A 10 MB answer: the tokenizer never sees more than env.max_observation_chars of it (plus the
    format's tags), and the cut is counted."""
    seen = []

    class Watching(CharTokenizer):
        def encode(self, text):
            seen.append(len(text))
            return super().encode(text)

    tok = Watching()
    problems = TASK.sample("train", 2)
    batch = EpisodeBatch(Unruly(TASK), problems, tok, FMT, timeout=5, isolation=isolation, max_observation_chars=1000)
    batch.submit(0, tok.encode("[big 10000000]"))
    batch.submit(1, tok.encode("[big 12]"))
    seen.clear()
    answers = _wait(batch)
    assert max(seen) <= 1000 + 2 and answers[0] == tok.encode("{" + "x" * 1000 + "}")
    assert answers[1] == tok.encode("{" + "x" * 12 + "}")
    episodes = batch.score([GenerationResult([], [], "eos", None)] * 2)
    assert [e.observations_cut for e in episodes] == [1, 0]


def test_an_environment_that_cannot_reach_a_worker_is_refused_in_one_line():
    class Nested(Environment):  # a local class: neither it nor its instances pickle
        name = "nested"

        def __init__(self, task):
            self.task, self.tools = task, {"calc": calc}

    with pytest.raises(ToolWorkerError, match="env.isolation=thread") as e:
        tools_for(Nested(TASK), "auto", 1)
    assert "\n" not in str(e.value)
    assert tools_for(Nested(TASK), "thread", 1).kind == "thread"


def test_the_pool_is_the_environments_across_batches():
    """A trainer makes a batch per rollout: the workers are started once per environment object."""
    env = Unruly(TASK)
    problems = TASK.sample("train", 1)
    first = EpisodeBatch(env, problems, TOK, FMT, timeout=5, workers=2)
    first.close()
    procs = [w.process for w in first.pool.idle + first.pool.starting]
    assert EpisodeBatch(env, problems, TOK, FMT, timeout=5, workers=2).pool is first.pool
    assert EpisodeBatch(env, problems, TOK, FMT, timeout=5, workers=3).pool is not first.pool  # (resized)
    assert first.pool.closed and len(procs) == 2 and not any(p.is_alive() for p in procs)


def test_a_thread_retired_as_it_answers_ends_and_the_pool_keeps_its_size():
    """The race at a call's deadline: the thread puts its answer and goes back to its inbox just as the pool
    retires it. It must end (not wait there forever, counted among the hung threads), and closing the pool
    ends the hung threads whose calls return later."""
    env = Calculator(TASK)
    pool = tools_for(env, "thread", 1)
    problem = TASK.sample("train", 1)[0]
    pool.submit(Job(0, problem, None, True, ToolCall("calc", "2+3"), 0.0, 100), 10)
    worker = pool.busy[0].worker
    deadline = time.monotonic() + 10
    while pool.done.empty() and time.monotonic() < deadline:  # it has answered ...
        time.sleep(0.01)
    time.sleep(0.1)  # ... and waits on its inbox again
    del pool.busy[0]  # ... when the pool, past the deadline, retires it (as poll does)
    pool._retire(worker)
    worker.join(5)
    assert not worker.is_alive()
    assert pool.poll(0.0) == [] and len(pool.idle) == 1  # (its answer is nobody's; a fresh thread took its place)

    RELEASE.clear()
    flaky = Flaky(TASK)
    pool = tools_for(flaky, "thread", 1)
    pool.submit(Job(1, problem, None, True, ToolCall("calc", "1"), 0.0, 100), 0.1)
    got = pool.poll(5)
    assert got and got[0].kind == "fault" and len(pool.hung) == 1
    hung = pool.hung[0]
    pool.close()
    RELEASE.set()
    hung.join(5)
    assert not hung.is_alive() and pool.hung == []


SIGTERMED = r'''
import json, os, signal, sys, time
from codraft.envs import Calculator, EpisodeBatch, ToolFormat
from codraft.rewards.reward_set import make_batch
from codraft.rewards.worker import RewardWorker
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer


def main():
    tok, task = CharTokenizer(), make_task("arith")
    problems = task.sample("train", 2)
    signals = []
    signal.signal(signal.SIGTERM, lambda *_: signals.append("SIGTERM"))  # (a rank finishes its step in flight)
    batch = EpisodeBatch(Calculator(task), problems, tok, ToolFormat.for_tokenizer(tok), timeout=10, workers=2,
                         isolation="process")
    rewards = RewardWorker([sys.argv[1] + ":pid"], 10)
    workers = [w.process.pid for w in batch.pool.idle] + [rewards.process.pid]
    os.killpg(0, signal.SIGTERM)  # torchrun's stop: the rank's whole process group, the workers and forkserver too
    time.sleep(0.5)
    for pid in workers:
        os.kill(pid, signal.SIGTERM)  # (and each worker on its own)
    time.sleep(0.5)
    batch.submit(0, tok.encode("[calc 2+3]"))
    batch.submit(1, tok.encode("[calc 4*5]"))
    answers = {}
    while batch.pending:
        answers.update(batch.ready("any"))
    got = rewards.call(0, make_batch(problems, ["a", "b"], [[1], [2]]))
    batch.close()
    print(json.dumps({"signals": signals, "answers": {r: a and tok.decode(a) for r, a in answers.items()},
                      "reasons": batch.reasons,
                      "rewards": got.values, "errors": got.errors, "pids": workers}))


if __name__ == "__main__":  # (the forkserver imports this file)
    main()
'''


def test_workers_outlive_a_sigterm_to_the_process_group_and_still_answer(tmp_path):
    """torchrun forwards SIGTERM to each rank's process group; the rank finishes its step, so its tool and reward
    workers (and the forkserver they are forked from) ignore it and answer that step's calls. The process then
    exits (its workers killed at exit, not waited on)."""
    reward = tmp_path / "pid_reward.py"
    reward.write_text("import os\n\n\ndef pid(completions, **kwargs):\n"
                      "    return [float(os.getpid())] * len(completions)\n")
    script = tmp_path / "sigtermed.py"
    script.write_text(SIGTERMED)
    done = subprocess.run([sys.executable, str(script), str(reward)], capture_output=True, text=True, timeout=120,
                          process_group=0, cwd=os.getcwd(),  # (its own group: the killpg stays in it)
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["signals"] == ["SIGTERM"]
    assert out["answers"] == {"0": "{5}", "1": "{20}"}, out
    assert out["errors"] == [None, None] and out["rewards"] == [float(out["pids"][-1])] * 2
