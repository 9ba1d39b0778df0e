"""Run folders and checkpoints under crashes: `kill -9` during checkpoint writes and prunes, corrupt or
malicious checkpoint files, stale temporaries, and the rules for starting and resuming a run.

Oracle throughout: a resumed run's metrics (timings aside) and weights equal an uninterrupted run's.

Run as a script (``python tests/integration/test_checkpoint.py POLICY OUT SEEDS``), this file is the crash harness:
one fresh interpreter runs the uninterrupted reference run, recording the file-system operations of
its checkpoint saves, then per seed forks a child that repeats the run and SIGKILLs itself just
before one of those operations, chosen by the seed.
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from tiny_runs import checkpoint_weights, comparable, run_config, same_tensors

from codraft.config import ConfigError
from codraft.rl import trainer as trainer_mod
from codraft.rl.logger import read_metrics
from codraft.rl.trainer import Trainer, train
from codraft.tasks import ArithTask
from codraft.train import checkpoint as ckpt
from codraft.train.run_dir import LOCK, RunDirError, check_fresh, read_resume_log
from codraft.train.schedule import warmup_cosine

KILL_OPS = ("rename", "replace", "unlink", "rmdir", "fsync")  # what a checkpoint write or prune does to disk
CRASH_EXTRA = ["log.checkpoint_every=1", "log.keep_last=2"]


def _varied(self, problem, completion):  # as test_faults.varied_reward
    return float(len(completion) % 2)


def _no_plots(run_dir):
    return []


@pytest.fixture
def no_plots(monkeypatch):
    """Runs without their PNGs (drawing them takes most of a tiny run's time; tested elsewhere)."""
    monkeypatch.setattr(trainer_mod, "plot_run", _no_plots)


# ---------------------------------------------------------------- the crash harness (child side)


def _install_kill_hook(state: dict) -> list:
    """Wrap os.rename/replace/unlink/rmdir/fsync: inside checkpoint saves each call is recorded as
    (op, phase, save number), phase "write" or "prune"; the call numbered ``state["kill_at"]`` is
    replaced by SIGKILL of this process. Returns the record."""
    events = []

    def wrap(name):
        real = getattr(os, name)

        def op(*a, **k):
            if state["phase"]:
                if len(events) == state["kill_at"]:
                    os.kill(os.getpid(), signal.SIGKILL)
                events.append((name, state["phase"], state["saves"]))
            return real(*a, **k)
        setattr(os, name, op)
    for name in KILL_OPS:
        wrap(name)
    real_save, real_prune = ckpt.save_checkpoint, ckpt.prune

    def save(*a, **k):
        state["phase"], state["saves"] = "write", state["saves"] + 1
        try:
            return real_save(*a, **k)
        finally:
            state["phase"] = None

    def prune(*a, **k):
        state["phase"] = "prune"
        try:
            return real_prune(*a, **k)
        finally:
            state["phase"] = "write"
    ckpt.save_checkpoint, ckpt.prune = save, prune  # the trainer and save_checkpoint look them up there
    return events


def _kill_point(events: list, seed: int) -> int:
    """An operation of the second or a later save; even seeds one of a write, odd seeds one of a prune."""
    phase = "prune" if seed % 2 else "write"
    return random.Random(seed).choice([i for i, (_, p, n) in enumerate(events) if n >= 2 and p == phase])


def _harness(policy_dir: str, out: str, seeds: list[int]) -> dict:
    torch.set_num_threads(1)  # as conftest: the same arithmetic as the test process
    ArithTask._reward = _varied
    trainer_mod.plot_run = _no_plots
    state = {"phase": None, "saves": 0, "kill_at": None}
    events = _install_kill_hook(state)
    train(run_config(policy_dir, Path(out) / "full", 3, extra=CRASH_EXTRA), progress=False)
    reference, kills = list(events), []
    for seed in seeds:
        k = _kill_point(reference, seed)
        pid = os.fork()
        if pid == 0:  # the child: the same run, killed at operation k
            signal.alarm(120)  # never outlive the test
            events.clear()
            state.update(saves=0, kill_at=k)
            try:
                train(run_config(policy_dir, Path(out) / f"cut{seed}", 3, extra=CRASH_EXTRA), progress=False)
            except BaseException:  # noqa: BLE001 - whatever went wrong, report it and exit below
                traceback.print_exc()
            os._exit(3)  # not killed: the test fails on it
        _, status = os.waitpid(pid, 0)
        kills.append({"seed": seed, "at": k, "op": reference[k],
                      "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None})
    # resumed here, not in the test process: a bit-for-bit repeat needs the same fast paths as the full
    # run, and a table timed on a busy machine serves only the process that timed it (kernels.dispatch)
    for kill in kills:
        run = Path(out) / f"cut{kill['seed']}"
        latest = ckpt.latest_checkpoint(run)
        kill["files"] = sorted(p.name for p in run.iterdir())
        kill["latest"] = latest and latest.name
        kill["verify"] = latest and ckpt.verify(latest)
        if latest is None or kill["verify"] is not None:
            continue  # nothing to resume from: the test reports it with the folder's listing
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            train(run_config(policy_dir, run, 3, extra=CRASH_EXTRA), resume=str(run), progress=False)
        kill["warnings"] = [str(w.message) for w in seen]
    return {"events": len(reference), "kills": kills}


# ---------------------------------------------------------------- kill -9


def test_sigkill_during_checkpoint_writes_and_prunes_always_resumes(tmp_path, tiny_policy_dir, varied_reward,
                                                                   no_plots):
    seeds = [0, 1, 2, 3, 4, 5]
    harnesses = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])  # tiny_runs
    r = subprocess.run([sys.executable, __file__, str(tiny_policy_dir), str(tmp_path), json.dumps(seeds)],
                       env={**os.environ, "PYTHONPATH": harnesses}, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    assert {k["op"][1] for k in result["kills"]} == {"write", "prune"}
    full = comparable(read_metrics(tmp_path / "full"))
    for kill in result["kills"]:
        run = tmp_path / f"cut{kill['seed']}"
        assert kill["signal"] == signal.SIGKILL, kill
        assert kill["latest"] is not None and kill["verify"] is None, kill
        assert not [w for w in kill["warnings"] if "not usable" in w], kill  # no fallback: the newest verifies
        assert read_resume_log(run)[-1]["step"] == int(kill["latest"].split("_")[1])
        assert comparable(read_metrics(run)) == full, kill
        assert same_tensors(checkpoint_weights(tmp_path / "full" / "step_3"), checkpoint_weights(run / "step_3"))
        assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_2", "step_3"]
        assert not [p.name for p in run.iterdir() if p.name.startswith(".") and p.name != LOCK], kill  # temporaries


# ---------------------------------------------------------------- corrupt and malicious checkpoints


@pytest.fixture
def full_run(tmp_path, tiny_policy_dir, varied_reward, no_plots):
    """An uninterrupted 3-step run with a checkpoint every step (all kept), and a maker of copies."""
    full = tmp_path / "full"
    train(run_config(tiny_policy_dir, full, 3, extra=["log.checkpoint_every=1", "log.keep_last=3"]), progress=False)

    def copy(name):
        shutil.copytree(full, tmp_path / name)
        return tmp_path / name
    return full, copy


def _resume(policy_dir, run, **kw):
    return train(run_config(policy_dir, run, 3, extra=["log.checkpoint_every=1", "log.keep_last=3"]), resume=str(run),
                 progress=False, **kw)


def _assert_matches(full, run):
    assert comparable(read_metrics(run)) == comparable(read_metrics(full))
    assert same_tensors(checkpoint_weights(full / "step_3"), checkpoint_weights(run / "step_3"))


@pytest.mark.parametrize("name", ["policy/model.safetensors", "optim.pt", "draft.pt", "rng.pt"])
def test_truncated_file_in_latest_checkpoint_falls_back(full_run, tiny_policy_dir, name):
    full, copy = full_run
    run = copy("cut")
    f = run / "step_3" / name
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert ckpt.verify(run / "step_3").startswith(f"{name} is ")
    with pytest.warns(UserWarning, match=rf"step_3 is not usable: {name} is \d+ bytes, expected \d+ \(truncated\?\); "
                                         "falling back"):
        _resume(tiny_policy_dir, run)
    assert read_resume_log(run)[-1]["step"] == 2 and "step_3" in read_resume_log(run)[-1]["skipped"][0]
    _assert_matches(full, run)  # step 3 ran again, from step_2


class _SideEffect:
    """A pickle that writes a file when loaded (what a planted checkpoint could do with plain torch.load)."""

    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        return exec, (f"open({str(self.flag)!r}, 'w').write('ran')",)


@pytest.mark.parametrize("name", ["optim.pt", "rng.pt", "draft.pt"])
def test_pickle_with_side_effect_is_never_run(full_run, tiny_policy_dir, tmp_path, name):
    """A planted optim.pt/rng.pt/draft.pt, its checksum updated to match (a crafted folder): torch.load with
    weights_only refuses it, the checkpoint is skipped like a corrupt one, the code never runs."""
    full, copy = full_run
    run, flag = copy("cut"), tmp_path / "side-effect-ran"
    torch.save({"policy": _SideEffect(flag)}, run / "step_3" / name)
    marker = json.loads((run / "step_3" / "state.json").read_text())
    marker["files"][name] = {"size": (run / "step_3" / name).stat().st_size,
                             "sha256": ckpt._sha256(run / "step_3" / name)}
    (run / "step_3" / "state.json").write_text(json.dumps(marker))
    assert ckpt.verify(run / "step_3") is None  # the checksums alone would not catch it
    planted = tmp_path / "planted.pt"
    shutil.copy(run / "step_3" / name, planted)
    with pytest.warns(UserWarning, match=rf"step_3 is not usable: \S*step_3/{name}: refused: it would run code when "
                                         r"loaded \(pickled GLOBAL '[\w.]*exec'\); codraft loads only tensors"):
        _resume(tiny_policy_dir, run)
    assert not flag.exists()
    _assert_matches(full, run)
    torch.load(planted, weights_only=False)  # the premise: an unsafe load does run it
    assert flag.read_text() == "ran"


def test_no_checkpoint_verifies_is_a_clear_error(full_run, tiny_policy_dir, capsys):
    from codraft.cli import main
    _, copy = full_run
    run = copy("cut")
    for step in (1, 2, 3):
        (run / f"step_{step}" / "rng.pt").write_bytes(b"")
    before = sorted(p.name for p in run.iterdir())
    with pytest.warns(UserWarning, match="not usable"), \
            pytest.raises(SystemExit, match=r"no checkpoint in .* verifies: step_3: rng.pt is 0 bytes.*; step_2: .*; "
                                            r"step_1: "):
        main(["train", "--resume", str(run)])
    assert sorted(p.name for p in run.iterdir()) == before  # nothing removed or written


def test_stale_temporaries_and_half_pruned_folders(full_run, tiny_policy_dir):
    _, copy = full_run
    run = copy("cut")
    for name in (".step_4.tmp-abc12", ".step_1.old-x", ".step_0.trash-y"):
        (run / name / "policy").mkdir(parents=True)
        (run / name / "optim.pt").write_bytes(b"partial")
    (run / ".config.yaml.tmp-zz").write_text("half")
    shutil.rmtree(run / "step_1" / "policy")  # a prune interrupted by an older codraft: marker kept, weights gone
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_2", "step_3"]
    assert ckpt.verify(run / "step_1") == "policy/char_tokenizer.json is missing"
    (run / "step_2").rename(run / ".step_2.trash-k")  # a prune killed between its rename and its delete
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_3"]

    _resume(tiny_policy_dir, run)  # the run had finished: nothing to train, the folder is tidied
    assert sorted(p.name for p in run.iterdir() if p.name.startswith((".", "step_"))) == [LOCK, "step_3"]


# ---------------------------------------------------------------- the run folder: never overwritten


def _cli_run(tiny_policy_dir, run, steps=2, extra=()):
    return ["train", f"policy.init={tiny_policy_dir}", f"steps={steps}", f"run_dir={run}", "rollout.prompts_per_step=1",
            "rollout.group_size=2", "rollout.max_new_tokens=8", "log.val_size=2", "log.val_every=1",
            "draft.kind=eagle3", "draft.init=random", "draft.gamma=2", "log.checkpoint_every=1", "log.keep_last=1",
            *extra]


def _snapshot(run: Path) -> dict:
    return {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_fresh_train_refuses_a_folder_holding_a_run(tmp_path, tiny_policy_dir, monkeypatch, capsys):
    from codraft.cli import main
    run = tmp_path / "run"
    main(_cli_run(tiny_policy_dir, run))
    out = capsys.readouterr().out
    for what in (f"run folder: {run}", "reward: ", "tau (acceptance_length): ", "held-out accuracy: ",
                 f"plots: {run / 'reward.png'}", f"last checkpoint: {run / 'step_2'}"):
        assert what in out, out
    before = _snapshot(run)

    def no_load(*a, **k):
        raise AssertionError("loaded a policy before refusing")
    monkeypatch.setattr(trainer_mod, "load_policy", no_load)
    with pytest.raises(SystemExit, match=rf"run_dir={run} already holds a run \(config.yaml, metrics.jsonl, step_2\).*"
                                         rf"--resume {run}.*new run_dir="):
        main(_cli_run(tiny_policy_dir, run, steps=5))
    assert _snapshot(run) == before
    # a checkpoint of the run, or a folder in one, is no run of its own: the message names the run to resume
    step = run / "step_2"
    for target, where in ((step, ""), (step / "policy", "inside "), (step / "new", "inside ")):
        with pytest.raises(SystemExit, match=re.escape(f"run_dir={target} is {where}checkpoint step_2 of the run in "
                                                       f"{run}: continue that run with --resume {run}, or start")):
            main(_cli_run(tiny_policy_dir, target))
        if target.exists():
            with pytest.raises(SystemExit, match=re.escape(f"--resume {target} is {where}checkpoint step_2 of the run "
                                                           f"in {run}: give the run folder, --resume {run}:")):
                main(["train", "--resume", str(target)])
    assert _snapshot(run) == before and not (step / "new").exists()
    lone = tmp_path / "lone"
    (lone / "step_7").mkdir(parents=True)  # any step_N makes it a run
    with pytest.raises(RunDirError, match="already holds a run"):
        check_fresh(lone)
    (tmp_path / "empty").mkdir()
    check_fresh(tmp_path / "empty")  # an empty folder is fine


def test_resume_keeps_the_runs_config_and_refuses_unsafe_overrides(tmp_path, tiny_policy_dir, capsys, monkeypatch):
    from codraft.cli import main
    run = tmp_path / "run"
    real_step = Trainer.step

    def ctrl_c_at_1(self, step):
        if step == 1:
            raise KeyboardInterrupt
        return real_step(self, step)
    monkeypatch.setattr(Trainer, "step", ctrl_c_at_1)
    with pytest.raises(SystemExit) as stop:
        main(_cli_run(tiny_policy_dir, run))  # a 2-step run (the tiny preset has 100), stopped after step 1
    out = capsys.readouterr()
    assert stop.value.code == 130 and "interrupted after step 1" in out.err
    assert f"run folder: {run}" in out.out and f"last checkpoint: {run / 'step_1'}" in out.out
    monkeypatch.setattr(Trainer, "step", real_step)

    main(["train", "--resume", str(run)])  # no overrides repeated: the run's own config
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_2"]
    assert yaml.safe_load((run / "config.yaml").read_text())["steps"] == 2
    assert read_resume_log(run)[-1]["changed"] == {} and read_resume_log(run)[-1]["step"] == 1

    before = _snapshot(run)
    for args, match in ((["grpo.lr=1e-3"], r"config key 'grpo.lr' cannot change on resume"),
                        (["seed=3", "steps=4"], r"config key 'seed' cannot change"),
                        (["steps=1"], r"steps=1 is below the 2 steps already completed"),
                        ([f"run_dir={tmp_path / 'elsewhere'}"], "a resumed run stays in its folder"),
                        (["stepz=4"], "unknown config key 'stepz'")):
        with pytest.raises(SystemExit, match=match):
            main(["train", "--resume", str(run), *args])
    with pytest.raises(SystemExit, match="--config tiny with --resume"):
        main(["train", "--config", "tiny", "--resume", str(run)])
    assert _snapshot(run) == before  # a refused resume writes nothing

    main(["train", "--resume", str(run), "steps=3", "log.val_every=3"])
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_3"]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert (cfg["steps"], cfg["log"]["val_every"]) == (3, 3)
    entry = read_resume_log(run)[-1]
    assert (entry["step"], entry["checkpoint"], entry["changed"]) == \
        (2, "step_2", {"steps": [2, 3], "log.val_every": [1, 3]})


def test_resume_of_a_missing_or_empty_folder_creates_nothing(tmp_path):
    from codraft.cli import main
    with pytest.raises(SystemExit, match="no such folder"):
        main(["train", "--resume", str(tmp_path / "missing" / "run")])
    assert not (tmp_path / "missing").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="holds no codraft run"):
        main(["train", "--resume", str(tmp_path / "empty")])
    assert not list((tmp_path / "empty").iterdir())


def test_api_resume_checks_the_config_against_the_checkpoint(full_run, tiny_policy_dir):
    """Trainer(cfg, resume=...) compares cfg with the restored checkpoint's config: a changed lr is
    refused (it would be recorded but the restored scheduler would train with the old one); a changed
    `steps` is taken, and the lr follows the cosine over the new total from the resumed step on."""
    _, copy = full_run
    run = copy("cut")
    changed = run_config(tiny_policy_dir, run, 3, extra=["log.checkpoint_every=1", "log.keep_last=3", "grpo.lr=5e-4"])
    with pytest.raises(ConfigError, match=r"'grpo.lr' cannot change on resume \(the run has 0.001, asked for 0.0005\)"):
        Trainer(changed, resume=str(run), progress=False)
    longer = run_config(tiny_policy_dir, run, 6, extra=["log.checkpoint_every=1", "log.keep_last=3"])
    t = Trainer(longer, resume=str(run), progress=False)
    expected = 1e-3 * warmup_cosine(longer.grpo.warmup_steps, 6, floor=0.1)(3)
    assert t.opt.param_groups[0]["lr"] == expected and t.sched.get_last_lr() == [expected]
    m = t.step(3)
    assert m["lr"] == 1e-3 * warmup_cosine(longer.grpo.warmup_steps, 6, floor=0.1)(4)
    t.logger.close()
    assert read_resume_log(run)[-1]["changed"] == {"steps": [3, 6]}


if __name__ == "__main__":
    print(json.dumps(_harness(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
