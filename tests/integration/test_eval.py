"""`codraft eval`: on a run's checkpoint it repeats the run's last validation (same prompts, greedy decode and
reward); greedy speculative equals plain (lossless) and τ is reported only with a draft; pass@k matches the
unbiased estimator computed by hand; the JSON holds every figure; bad inputs are one line."""
import json
import math
import shutil
import subprocess
import sys

import pytest

from codraft.cli import main
from codraft.eval.evaluate import evaluate
from codraft.eval.passk import default_ks, pass_at_k
from codraft.rewards import RewardSet
from codraft.rewards.calling import Result
from codraft.rewards.reward_set import RewardFn
from codraft.rl.trainer import train
from codraft.rollout import SpecStats
from codraft.rollout.engine import GenerationResult
from codraft.tasks import Problem
from tiny_runs import run_config, save_tiny_policy

REWARDS = '''
def checksum(completions, **kwargs):
    """A value in [0, 1] that any change of any token changes (almost surely)."""
    return [(sum(map(ord, c)) % 97) / 96 for c in completions]


def parity(completions, answer, **kwargs):
    """1 for an odd answer column: which rows were decoded shows."""
    return [float(int(a) % 2) for a in answer]
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step tiny run on a JSONL written here, scored by a reward file written here, validated at steps 0
    and 2 (log.val_every=2) and checkpointed at step 2."""
    root = tmp_path_factory.mktemp("eval")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(4) for b in range(4)))
    (root / "rewards.py").write_text(REWARDS)
    funcs = f"{root / 'rewards.py'}:checksum,{root / 'rewards.py'}:parity"
    cfg = run_config(save_tiny_policy(root / "policy"), root / "run", steps=2,
                     extra=[f"data.train={data}", f"reward.funcs={funcs}",
                            "reward.weights=1,0.5", "data.val_fraction=0.25"])
    train(cfg, progress=False)
    return root


def _eval(capsys, tmp_path, *args):
    out = tmp_path / "eval.json"
    main(["eval", *map(str, args), "--json", str(out), "--no-progress"])
    return json.loads(out.read_text()), capsys.readouterr().out


def test_eval_of_a_run_equals_its_last_validation(run, capsys, tmp_path):
    rows = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val_accuracy" in r][-1]
    assert last["step"] == 2
    got, table = _eval(capsys, tmp_path, run / "run", "--trust-run-rewards")
    assert got["origin"] == f"checkpoint {run / 'run' / 'step_2'} (step 2)"
    assert got["draft"] == "the run's dflash (co-trained)" and got["gamma"] == 3
    assert got["settings"]["prompts"] == 4 and got["settings"]["max_new_tokens"] == 10
    assert got["greedy"]["mean_reward"] == last["val_accuracy"] > 0
    assert got["greedy"]["mean_reward"] == pytest.approx(got["greedy"]["reward/checksum_mean"]
                                                         + 0.5 * got["greedy"]["reward/parity_mean"])
    assert got["greedy"]["samples"] == got["greedy"]["judged"] == 4
    # the checkpoint named directly is the same evaluation
    again, _ = _eval(capsys, tmp_path, run / "run" / "step_2", "--trust-run-rewards")
    assert again["greedy"]["mean_reward"] == last["val_accuracy"]
    assert "mean reward" in table and "τ (tokens/round)" in table


def test_speculative_and_plain_greedy_agree_and_tau_only_with_a_draft(run, capsys, tmp_path):
    spec, spec_table = _eval(capsys, tmp_path, run / "run", "--trust-run-rewards")
    plain, plain_table = _eval(capsys, tmp_path, run / "run", "--trust-run-rewards", "--draft", "none")
    ngram, _ = _eval(capsys, tmp_path, run / "run", "--trust-run-rewards", "--draft", "ngram", "--gamma", 2)
    for key in ("mean_reward", "accuracy", "completion_len", "tokens", "reward/checksum_mean",
                "reward/parity_mean"):
        assert spec["greedy"][key] == plain["greedy"][key] == ngram["greedy"][key], key
    assert plain["draft"] == "none" and plain["gamma"] is None
    assert "acceptance_length" not in plain["greedy"] and "τ" not in plain_table
    assert 1.0 <= spec["greedy"]["acceptance_length"] <= 4.0 and len(spec["greedy"]["acceptance_per_position"]) == 3
    assert ngram["draft"] == "ngram" and ngram["gamma"] == 2 and len(ngram["greedy"]["acceptance_per_position"]) == 2


def test_a_policy_folder_on_a_data_file_or_a_task(run, capsys, tmp_path):
    """A policy (no run): plain decoding by default, --draft ngram the same greedy figures with τ; --task
    takes a built-in task's held-out prompts and its own reward."""
    plain, _ = _eval(capsys, tmp_path, run / "policy", "--data", run / "data.jsonl", "--reward", "exact", "--limit", 3)
    ngram, _ = _eval(capsys, tmp_path, run / "policy", "--data", run / "data.jsonl", "--reward", "exact", "--limit", 3,
                     "--draft", "ngram")
    assert plain["origin"] == f"policy {run / 'policy'} ({run / 'policy'})" and plain["draft"] == "none"
    assert plain["settings"]["prompts"] == 3 and plain["settings"]["reward_funcs"] == ["exact"]
    assert "acceptance_length" not in plain["greedy"] and "acceptance_length" in ngram["greedy"]
    for key in ("mean_reward", "completion_len", "tokens"):
        assert plain["greedy"][key] == ngram["greedy"][key]
    task, _ = _eval(capsys, tmp_path, run / "policy", "--task", "arith", "--limit", 2, "--max-new-tokens", 8)
    assert task["settings"]["reward_funcs"] == ["arith"] and task["settings"]["prompts"] == 2
    assert task["settings"]["max_new_tokens"] == 8 and task["greedy"]["completion_len"] <= 8


def test_samples_give_pass_at_k_and_the_json_has_every_figure(run, capsys, tmp_path):
    data = run / "data.jsonl"
    got, table = _eval(capsys, tmp_path, run / "run", "--trust-run-rewards", "--data", data, "--limit", 5,
                       "--samples", 4, "--temperature", 1.5, "--seed", 3)
    common = {"mean_reward", "accuracy", "samples", "judged", "reward_errors", "completion_len", "reward/checksum_mean",
              "reward/parity_mean",
              "acceptance_length", "acceptance_per_position", "tokens", "tokens_per_s", "seconds"}
    assert set(got["greedy"]) == common
    assert set(got["sampled"]) == common | {"pass@1", "pass@2", "pass@4"}
    assert set(got["settings"]) == {"data", "prompts", "reward_funcs", "reward_weights", "max_new_tokens", "top_p",
                                    "samples", "temperature", "seed", "ks", "threshold", "batch_size", "device",
                                    "dtype", "rollout_dtype"}
    s = got["sampled"]
    assert got["settings"]["prompts"] == 5 and s["samples"] == 20 and got["settings"]["ks"] == [1, 2, 4]
    assert s["pass@1"] == pytest.approx(s["accuracy"])  # (every sample judged: pass@1 is the share solved)
    assert s["pass@1"] <= s["pass@2"] <= s["pass@4"]
    assert 0 < s["accuracy"] < 1  # a varied reward: the estimator was exercised
    assert "pass@4" in table and "T=1.5, n=4" in table
    # the same seed samples the same completions; the greedy pass does not depend on it
    again, _ = _eval(capsys, tmp_path, run / "run", "--trust-run-rewards", "--data", data, "--limit", 5,
                     "--samples", 4, "--temperature", 1.5, "--seed", 3, "--k", "1,3")
    assert again["sampled"]["accuracy"] == s["accuracy"] and set(again["sampled"]) == common | {"pass@1", "pass@3"}


def test_pass_at_k_matches_the_estimator_by_hand():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(5, 3, 1) == pytest.approx(0.6)
    for n, c, k in [(10, 3, 5), (200, 7, 10), (16, 15, 2)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    assert default_ks(4) == [1, 2, 4] and default_ks(6) == [1, 2, 4, 6] and default_ks(1) == [1]


def test_evaluate_on_a_stub_gives_the_hand_computed_pass_at_k():
    """A stub decode and reward whose every sample's reward is set by hand: prompt A solves 2 of 4 samples (its
    unjudged one counts as a miss), B none, C all 4; D, none of whose samples was judged, is left out."""
    solved = {"A": [1, 0, None, 1], "B": [0, 0, 0, 0], "C": [1, 1, 1, 1], "D": [None] * 4}

    def decode(prompts, problems, temperature, seed, group):
        assert group == 4 and temperature == 0.7 and seed == 5
        return [GenerationResult([1, 2], [0.0, 0.0], "eos") for _ in prompts], 1.0, SpecStats(gamma=0)

    count = {}

    def stub(problems, batch):
        values = []
        for p in problems:
            i = count[p.prompt] = count.get(p.prompt, -1) + 1
            values.append(solved[p.prompt][i])
        return Result(values, [None] * len(values))

    class Tok:
        def decode(self, ids):
            return "xx"

    problems = [Problem(n, "", "") for n in solved]
    ev = evaluate(decode, problems, [[1]] * 4, RewardSet([RewardFn("stub", 1.0, stub)]), Tok(), do_greedy=False,
                  samples=4, temperature=0.7, seed=5, ks=[1, 2, 3, 4])
    a = {k: 1 - math.comb(4 - 2, k) / math.comb(4, k) if 4 - 2 >= k else 1.0 for k in (1, 2, 3, 4)}
    want = {k: (a[k] + 0.0 + 1.0) / 3 for k in (1, 2, 3, 4)}  # by hand: A 1/2, 5/6, 1, 1; B 0; C 1
    assert ev.pass_at_k == pytest.approx(want)
    assert want[1] == pytest.approx(0.5) and want[2] == pytest.approx((5 / 6 + 1) / 3)
    assert ev.sampled.mean_reward == ev.sampled.accuracy() == pytest.approx(6 / 11)  # 11 judged, 6 solved


@pytest.mark.parametrize("args, message", [
    (["{root}/nope"], r"'\S+/nope' is not a run folder, a checkpoint \(RUN/step_N\), a policy folder or a policy "
                      r"name .*: no such folder"),
    (["{root}/run", "--trust-run-rewards", "--data", "{root}/noprompt.jsonl"],
     r"\S+noprompt.jsonl: no column 'prompt' \(data.prompt_key\); its columns: question, answer"),
    (["{root}/run", "--reward", "nope"], r"config key 'reward.funcs' must be comma-separated rewards"),
    (["{root}/policy", "--data", "{root}/data.jsonl"], r"--data \S+: name its reward with --reward"),
    (["{root}/policy"], r"\S+/policy is a policy, with no data of its own: give --data FILE \(and --reward\) or "
                        r"--task NAME"),
    (["{root}/run", "grpo.lr=1"], r"'grpo.lr=1': eval takes key=value overrides of data.\*, reward.\*, task.\*"),
    (["{root}/run", "--samples", "2", "--k", "4"], r"--k must be in 1..--samples \(2\), got '4'"),
    (["{root}/run", "--k", "1"], r"--k 1 needs --samples n"),
    (["{root}/run", "--temperature", "0", "--samples", "2"], r"--temperature must be > 0 and finite"),
    (["{root}/run", "--gamma", "0"], r"--gamma must be an int >= 1 or auto, got '0'"),
])
def test_bad_inputs_are_one_line(run, args, message):
    (run / "noprompt.jsonl").write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(SystemExit, match=f"^codraft eval: error: {message}"):
        main(["eval", *[a.format(root=run) for a in args], "--no-progress"])


def test_a_run_folders_reward_code_runs_only_on_the_users_word(run, capsys, tmp_path):
    """A run folder is not trusted: eval refuses, in one line naming it, the reward code its config names (it would
    import and run it) unless --reward names the reward (the user's own choice) or --trust-run-rewards."""
    rewards, marker = run / "rewards.py", tmp_path / "imported"
    kept = rewards.read_text()
    rewards.write_text(f"open({str(marker)!r}, 'w').close()\n" + kept)  # (what a planted file could do)
    try:
        with pytest.raises(SystemExit, match=rf"^codraft eval: error: \S+/run: the run's config names reward code "
                                             rf"\({rewards}:checksum, {rewards}:parity\), which eval would import and "
                                             r"run; a run folder is not trusted: give --reward FUNCS .* or "
                                             r"--trust-run-rewards$"):
            main(["eval", str(run / "run"), "--no-progress"])
        assert not marker.exists()
        got, _ = _eval(capsys, tmp_path, run / "run", "reward.weights=", "--reward", "exact")
        assert got["settings"]["reward_funcs"] == ["exact"] and got["greedy"]["samples"] == 4
        assert not marker.exists()
        _eval(capsys, tmp_path, run / "run", "--trust-run-rewards")
        assert marker.exists()
    finally:
        rewards.write_text(kept)


def test_a_checkpoint_that_does_not_verify_is_skipped_or_refused(run, tmp_path):
    """A run's newest checkpoint whose file no longer matches its sha256 is not evaluated: with no older one the
    run is refused naming it, and the checkpoint named directly is refused too."""
    copy = tmp_path / "run"
    shutil.copytree(run / "run", copy)
    draft = copy / "step_2" / "draft.pt"
    data = bytearray(draft.read_bytes())
    data[-9] ^= 0xFF  # same size, other content
    draft.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=r"^codraft eval: error: no checkpoint of \S+ verifies: step_2: draft.pt does "
                                         r"not match its sha256 \(corrupted\)$"):
        main(["eval", str(copy), "--no-progress"])
    with pytest.raises(SystemExit, match=r"^codraft eval: error: \S+step_2 is not a complete run checkpoint: draft.pt"):
        main(["eval", str(copy / "step_2"), "--no-progress"])


def test_a_missing_run_is_one_line_without_a_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "codraft", "eval", str(tmp_path / "runs" / "gone")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"codraft eval: error: {str(tmp_path / 'runs' / 'gone')!r} is not a run folder, a checkpoint (RUN/step_N), a "
        f"policy folder or a policy name (tiny-sft, tiny-tools, tiny-moe, smollm2-135m): no such folder"]
