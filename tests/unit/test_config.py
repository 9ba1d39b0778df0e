"""Every bad config value is refused before any work, in one line naming the key, the value and
what is allowed: ranges (``codraft.config.RULES``), rules between keys, YAML files and overrides,
`--config` names, and `codraft train` / `codraft plot` on the command line (nothing written)."""
import json
import math
import sys

import pytest
import yaml

import codraft.policy
import codraft.policy.warmstart
import codraft.rl.trainer
from codraft import cli
from codraft.cli import main
from codraft.config import (CROSS_RULES, RULES, ConfigError, RunConfig, _all_keys, load_config, preset_names,
                            validate)
from codraft.rl.logger import read_metrics
from codraft.rl.trainer import Trainer
from tiny_runs import save_tiny_policy


def _no_loading(monkeypatch):
    """Policy loading and the warm start fail the test if reached: validation comes first."""
    def called(*a, **k):
        raise AssertionError("a policy was loaded before the config was validated")
    for module in (codraft.policy, codraft.rl.trainer):
        monkeypatch.setattr(module, "load_policy", called)
    monkeypatch.setattr(codraft.policy.warmstart, "warm_start", called)


def _refused(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    message = str(e.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- the table


def test_rules_cover_every_key_and_the_presets_pass():
    assert set(RULES) == set(_all_keys(RunConfig))
    validate(RunConfig())
    for name in preset_names():
        load_config(name)
    assert CROSS_RULES and all(rule(RunConfig()) is None for rule in CROSS_RULES)


@pytest.mark.parametrize("override, message", [
    ("steps=0", "config key 'steps' must be >= 1, got 0"),
    ("steps=-3", "config key 'steps' must be >= 1, got -3"),
    ("seed=-1", "config key 'seed' must be in [0, "),
    ("run_dir=", "config key 'run_dir' must be a folder path"),
    ("device=gpu", "config key 'device' must be a device of this machine"),
    ("policy.init=", "config key 'policy.init' must be a policy name"),
    ("task.max_chars=0", "config key 'task.max_chars' must be >= 1"),
    ("task.format_reward=1", "config key 'task.format_reward' must be in [0, 1)"),
    ("rollout.prompts_per_step=0", "config key 'rollout.prompts_per_step' must be >= 1, got 0"),
    ("rollout.group_size=0", "config key 'rollout.group_size' must be >= 1, got 0"),
    ("rollout.max_new_tokens=0", "config key 'rollout.max_new_tokens' must be >= 1, got 0"),
    ("rollout.temperature=-1", "config key 'rollout.temperature' must be >= 0 (0 = greedy), got -1.0"),
    ("rollout.temperature=.nan", "config key 'rollout.temperature' must be a finite number >= 0 (0 = greedy), got nan"),
    ("rollout.top_p=0", "config key 'rollout.top_p' must be in (0, 1] (1 = off), got 0.0"),
    ("rollout.top_p=1.5", "config key 'rollout.top_p' must be in (0, 1]"),
    ("grpo.lr=-1", "config key 'grpo.lr' must be >= 0 (0 = the policy is not updated), got -1.0"),
    ("grpo.lr=.inf", "config key 'grpo.lr' must be a finite number >= 0"),
    ("grpo.warmup_steps=-1", "config key 'grpo.warmup_steps' must be >= 0"),
    ("grpo.eps_low=1.5", "config key 'grpo.eps_low' must be in [0, 1]"),
    ("grpo.eps_high=-0.1", "config key 'grpo.eps_high' must be >= 0"),
    ("grpo.kl_coef=-1", "config key 'grpo.kl_coef' must be >= 0"),
    ("grpo.grad_clip=0", "config key 'grpo.grad_clip' must be > 0"),
    ("grpo.weight_decay=-1", "config key 'grpo.weight_decay' must be >= 0"),
    ("grpo.max_nonfinite_steps=0", "config key 'grpo.max_nonfinite_steps' must be >= 1, got 0"),
    ("draft.gamma=0", "config key 'draft.gamma' must be >= 1 (tokens drafted per round, at most with "
                      "rollout.draft_length=auto: dflash builds blocks of gamma + 1 >= 2 slots"),
    ("draft.lam=-1", "config key 'draft.lam' must be >= 0"),
    ("draft.num_anchors=-1", "config key 'draft.num_anchors' must be >= 0 (0 = the draft's own), got -1"),
    ("draft.lr=.nan", "config key 'draft.lr' must be a finite number >= 0"),
    ("draft.warmup_steps=-1", "config key 'draft.warmup_steps' must be >= 0"),
    ("draft.grad_clip=-1", "config key 'draft.grad_clip' must be > 0"),
    ("log.val_every=-1", "config key 'log.val_every' must be >= 0 (every k steps; 0 = off), got -1"),
    ("log.val_size=0", "config key 'log.val_size' must be >= 1, got 0"),
    ("log.speedup_every=-1", "config key 'log.speedup_every' must be >= 0"),
    ("log.frozen_probe_every=-1", "config key 'log.frozen_probe_every' must be >= 0"),
    ("log.checkpoint_every=-1", "config key 'log.checkpoint_every' must be >= 0 (every k steps; 0 = off), got -1"),
    ("log.keep_last=-1", "config key 'log.keep_last' must be >= 0 (0 = keep every checkpoint), got -1"),
    ("draft.kind=medusa", "config key 'draft.kind' must be one of eagle3, dflash, dspark, model, ngram, got 'medusa'"),
])
def test_out_of_range_values_are_refused_with_the_key(override, message):
    assert _refused([override]).startswith(message)


def test_rules_between_keys():
    assert _refused(["rollout.draft_length=auto", "draft.mode=none"]) == (
        "config key 'rollout.draft_length' must be fixed with draft.mode=none (auto sizes the draft's proposals), "
        "got 'auto'")
    assert load_config(None, ["rollout.draft_length=auto", "draft.mode=frozen"]).rollout.draft_length == "auto"
    assert _refused(["rollout.draft_length=sometimes"]) == \
        "config key 'rollout.draft_length' must be one of fixed, auto, got 'sometimes'"
    with pytest.warns(UserWarning, match="'rollout.speculate' is retired .*; ignored"):  # an older run's config.yaml
        load_config(None, ["rollout.speculate=auto"])
    assert "config key 'draft.init' must be offline, random or an existing draft folder" in \
        _refused(["draft.init=/no/such/draft"])
    load_config(None, ["draft.mode=none", "draft.init=/no/such/draft"])  # no draft: init unused
    # the shared-memory tap channel is CPU only; a CUDA device (not on this machine: the rule alone) needs p2p
    cfg = load_config(None, ["parallel.pp=2", "rollout.prompts_per_step=2"])
    taps_rule = next(r for r in CROSS_RULES if r.__name__ == "_taps_reach_the_device")
    assert taps_rule(cfg) is None
    cfg.device = "cuda"
    assert taps_rule(cfg) == "config key 'parallel.taps' must not be shm on device=cuda: the shared-memory channel " \
        "is CPU only; give parallel.taps=p2p (point-to-point on the device's own group)"
    cfg.parallel.taps = "p2p"
    assert taps_rule(cfg) is None


def test_data_parallel_rules():
    """parallel.dp: whole groups per DP rank and micro-batch, every rank a rollout shard; fsdp or ddp at any
    layout."""
    assert load_config(None, ["parallel.dp=2", "rollout.prompts_per_step=4"]).parallel.dp == 2
    assert _refused(["parallel.dp=2", "rollout.prompts_per_step=3", "rollout.shards=0"]) == \
        "config key 'rollout.prompts_per_step' must be a multiple of parallel.dp=2 (each data-parallel rank trains " \
        "as many whole prompt groups), got 3"
    assert _refused(["parallel.dp=2", "rollout.prompts_per_step=4", "rollout.shards=3"]) == \
        "config key 'rollout.shards' must be 0 or a multiple of the ranks, parallel.dp × parallel.pp × parallel.cp × " \
        "parallel.tp = 2 (each rank decodes as many shards), got 3"
    assert _refused(["parallel.tp=2", "parallel.cp=2", "rollout.prompts_per_step=6", "rollout.shards=6"]) == \
        "config key 'rollout.shards' must be 0 or a multiple of the ranks, parallel.dp × parallel.pp × parallel.cp × " \
        "parallel.tp = 4 (each rank decodes as many shards), got 6"
    assert load_config(None, ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "rollout.prompts_per_step=8"])
    assert load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2",
                              "parallel.microbatches=2", "rollout.prompts_per_step=4"]).parallel.sequence_parallel
    assert _refused(["parallel.sequence_parallel=true"]) == \
        "config key 'parallel.sequence_parallel' must be false with parallel.tp=1 (it splits the residual stream over " \
        "the tensor-parallel ranks), got True"
    for keys in (["parallel.pp=2"], ["parallel.microbatches=2"]):  # the pipeline schedule
        assert _refused(["parallel.tp=2", "parallel.sequence_parallel=true", "rollout.prompts_per_step=4", *keys]) \
            .startswith("config key 'parallel.sequence_parallel' must be false under the pipeline schedule")
    for mode in ("fsdp", "ddp"):  # either, under pipeline stages too
        load_config(None, ["parallel.dp=2", "parallel.pp=2", f"parallel.dp_shard={mode}", "rollout.prompts_per_step=4"])
    assert _refused(["parallel.dp=2", "parallel.microbatches=3", "rollout.prompts_per_step=4"]) == \
        "config key 'parallel.microbatches' must be <= rollout.prompts_per_step / parallel.dp = 2 (each DP rank's " \
        "micro-batches hold whole groups), got 3"
    assert _refused(["parallel.dp_shard=zero3"]) == \
        "config key 'parallel.dp_shard' must be one of fsdp, ddp, got 'zero3'"


def test_environment_keys_are_checked():
    """An unknown environment is refused listing the known ones; lookup's tools need lookup's table."""
    assert load_config("tiny-tools", []).env.name == "lookup"
    assert _refused(["env.name=search"]) == "config key 'env.name' must be one of none, calculator, lookup, got 'search'"
    assert _refused(["env.name=lookup"]) == \
        "config key 'task.name' must be lookup exactly when env.name=lookup (the environment's tools read the " \
        "task's table), got task.name='arith' with env.name='lookup'"
    assert _refused(["task.name=lookup"]).startswith("config key 'task.name' must be lookup exactly when")
    assert _refused(["env.name=calculator", "env.timeout=0"]) == \
        "config key 'env.timeout' must be in (0, 3600] (seconds, at most an hour), got 0.0"
    assert "env.max_turns" in _refused(["env.max_turns=0"])


def test_environment_bounds_are_refused_in_one_line():
    """Values that used to pass the config and fail at the first tool call (an overflowing wait, a thread
    per worker past what the machine starts) are refused naming the key."""
    assert _refused(["env.timeout=1e10"]) == \
        "config key 'env.timeout' must be in (0, 3600] (seconds, at most an hour), got 10000000000.0"
    assert load_config(None, ["env.timeout=3600"]).env.timeout == 3600
    assert _refused(["env.workers=100000"]) == \
        "config key 'env.workers' must be in [1, 256] (threads or worker processes), got 100000"
    assert load_config(None, ["env.workers=256"]).env.workers == 256
    assert _refused(["env.isolation=fork"]) == \
        "config key 'env.isolation' must be one of auto, thread, process, got 'fork'"
    assert _refused(["env.max_observation_chars=0"]).startswith("config key 'env.max_observation_chars' must be in")


def test_the_aux_loss_needs_the_one_batch_step():
    assert load_config(None, ["grpo.routing_replay=true", "grpo.router_aux_coef=0.01"]).grpo.routing_replay
    assert load_config(None, ["grpo.routing_replay=true", "parallel.microbatches=2"]).parallel.microbatches == 2
    assert _refused(["grpo.router_aux_coef=0.01", "parallel.cp=2"]) == \
        "config key 'grpo.router_aux_coef' must be 0 with parallel.dp, cp, pp or microbatches > 1 (the load-" \
        "balancing loss is a product of batch means: split, it is another loss), got 0.01"
    assert _refused(["grpo.router_aux_coef=-1"]).startswith("config key 'grpo.router_aux_coef' must be >= 0")


def _policy_folder(tmp_path, layers: int) -> str:
    """A policy folder as far as the config reads it: config.json with the layer count."""
    folder = tmp_path / f"policy{layers}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    return str(folder)


def test_draft_taps_rules(tmp_path):
    """draft.taps: auto, or the EAGLE-3 draft's three target layers (what every serving stack builds),
    each below the policy's last layer (whose output no stack captures); a folder policy's layer count
    is read from its config.json before anything is loaded."""
    four = f"policy.init={_policy_folder(tmp_path, 4)}"
    eagle = ["draft.kind=eagle3", "draft.init=random", four]
    assert load_config(None, [*eagle, "draft.taps=2,0,1"]).draft.taps == "2,0,1"
    assert load_config(None, eagle).draft.taps == "auto"
    assert _refused([*eagle, "draft.taps=2,5,8"]) == (
        "config key 'draft.taps' must be layer ids in [0, 2] for the 4-layer policy (layer 3's output, the last, "
        "is no serving stack's tap), got '2,5,8'")
    assert _refused([*eagle, "draft.taps=1,1,2"]) == (
        "config key 'draft.taps' must be auto or distinct layer ids >= 0, comma-separated (e.g. 2,5,8), got '1,1,2'")
    assert _refused([*eagle, "draft.taps=two"]).startswith("config key 'draft.taps' must be auto or distinct")
    assert _refused([*eagle, "draft.taps=0,1"]) == (
        "config key 'draft.taps' must name 3 layers with draft.kind=eagle3 (vLLM, SGLang and SpecForge build its "
        "fc for exactly 3 taps), got '0,1'")
    assert _refused([four, "draft.kind=dflash", "draft.taps=0,1,2"]) == (
        "config key 'draft.taps' must be auto with draft.kind=dflash (it sets the EAGLE-3 draft's taps), "
        "got '0,1,2'")
    load_config(None, [four, "draft.kind=dflash", "draft.mode=none", "draft.taps=0,1,2"])  # no draft: unused
    # a named policy's depth is known once it is loaded: the trainer checks then, before building the draft
    load_config(None, ["draft.kind=eagle3", "draft.taps=2,5,8"])


def test_trainer_checks_draft_taps_against_the_loaded_policy(tmp_path, monkeypatch):
    """A policy whose depth the config cannot read without loading it (tiny-sft, smollm2-135m): the
    trainer checks draft.taps once the policy is loaded, with the config's message, before the draft."""
    import codraft.config.taps
    save_tiny_policy(tmp_path / "policy", layers=4)  # as deep as the tiny preset's
    monkeypatch.setattr(codraft.config.taps, "_policy_layers", lambda init: None)  # as for a named policy
    cfg = load_config(None, [f"policy.init={tmp_path / 'policy'}", "draft.kind=eagle3", "draft.init=random",
                             "draft.taps=1,2,3", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"^config key 'draft.taps' must be layer ids in \[0, 2\] for the 4-layer"):
        Trainer(cfg, progress=False)


def test_boundary_values_are_accepted():
    cfg = load_config(None, ["rollout.temperature=0", "rollout.top_p=1", "grpo.lr=0", "log.val_every=0",
                             "log.speedup_every=0", "log.checkpoint_every=0", "log.keep_last=0", "draft.gamma=1",
                             "grpo.eps_low=0", "draft.num_anchors=0", "grpo.warmup_steps=0", "steps=1"])
    assert (cfg.rollout.temperature, cfg.draft.gamma, cfg.log.checkpoint_every) == (0.0, 1, 0)


def test_a_config_built_in_python_is_validated_and_by_the_trainer(tmp_path, monkeypatch):
    _no_loading(monkeypatch)
    cfg = RunConfig(steps=0, run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="'steps' must be >= 1, got 0"):
        cfg.validate()
    with pytest.raises(ConfigError, match="'steps' must be >= 1, got 0"):
        Trainer(cfg, progress=False)
    cfg.steps, cfg.rollout.top_p = 1, math.nan
    with pytest.raises(ConfigError, match=r"'rollout.top_p' must be a finite number in \(0, 1\]"):
        Trainer(cfg, progress=False)
    cfg.rollout.top_p, cfg.rollout.group_size = 1.0, "4"
    with pytest.raises(ConfigError, match="'rollout.group_size' expects int, got '4'"):
        Trainer(cfg, progress=False)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- YAML and --config


def test_malformed_override_is_one_line_with_the_column():
    assert _refused(["steps=[1"]) == ("override 'steps=[1': invalid YAML at line 1, column 9: "
                                      "expected ',' or ']', but got '<stream end>'")
    assert _refused(["grpo.lr=a: b: c"]) == ("override 'grpo.lr=a: b: c': invalid YAML at line 1, column 13: "
                                             "mapping values are not allowed here")  # the second colon


def test_malformed_yaml_file_names_the_file_and_the_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("steps: 3\nrollout:\n  group_size: [4\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(f))
    assert str(e.value).startswith(f"config file '{f}': invalid YAML at line 4, column 1:") and "\n" not in str(e.value)
    f.write_text("steps: 3\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml': invalid YAML at line 2, column 7: mapping values"):
        load_config(str(f))
    f.write_text("- steps\n- 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml': must be a mapping of keys .*got a list"):
        load_config(str(f))
    f.write_text("stepz: 3\n")
    with pytest.raises(ConfigError, match=r"^config file '.*bad.yaml': unknown config key 'stepz'; did you mean steps"):
        load_config(str(f))
    f.write_text("rollout:\n  top_p: 0\n")
    with pytest.raises(ConfigError, match="'rollout.top_p' must be in"):
        load_config(str(f))
    f.write_bytes(b"\xff\xfe\x00steps")
    with pytest.raises(ConfigError, match="bad.yaml': not a text file"):
        load_config(str(f))


def test_a_key_given_twice_in_a_yaml_file_is_refused_with_both_lines(tmp_path):
    """yaml keeps the last of two equal keys silently; a config key written nested and dotted is the same key."""
    f = tmp_path / "twice.yaml"
    for text, key, lines in (("steps: 3\nseed: 1\nsteps: 0\n", "steps", (1, 3)),
                             ("rollout:\n  group_size: 2\n  top_p: 1\n  group_size: 4\n", "rollout.group_size", (2, 4)),
                             ("grpo.lr: 0.1\ngrpo:\n  kl_coef: 0\n  lr: 0.2\n", "grpo.lr", (1, 4)),
                             ("grpo:\n  lr: 0.1\nseed: 1\ngrpo:\n  kl_coef: 0\n", "grpo", (1, 4))):
        f.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_config(str(f))
        assert str(e.value) == f"config file '{f}': config key {key!r} is given twice (lines {lines[0]} and " \
                               f"{lines[1]}); give each key once"
    f.write_text("grpo.lr: 0.1\ngrpo:\n  kl_coef: 0.5\n")  # one section, keys written both ways: each once
    cfg = load_config(str(f))
    assert (cfg.grpo.lr, cfg.grpo.kl_coef) == (0.1, 0.5)


def test_config_names_a_preset_or_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError,
                       match=r"^unknown preset 'huge' \(presets: smollm2-chainsum, tiny, tiny-long, tiny-moe, tiny-tools\); no file 'huge'"):
        load_config("huge")
    with pytest.raises(ConfigError, match=r"^unknown preset 'x.txt' \(presets: .*\); no file 'x.txt' either"):
        load_config("x.txt")
    with pytest.raises(ConfigError, match="^config file 'x.yaml' does not exist"):
        load_config("x.yaml")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match="^config file 'folder' is not a file"):
        load_config("folder")
    (tmp_path / "x.txt").write_text("steps: 2\nseed: 5\n")
    assert (load_config("x.txt").steps, load_config("x.txt").seed) == (2, 5)  # any extension: read as YAML
    (tmp_path / "x.txt").write_text("this is: not: yaml\n")
    with pytest.raises(ConfigError, match=r"^config file 'x.txt' \(not a preset name: read as a YAML file\): "
                                          r"invalid YAML at line 1, column 13: mapping values"):
        load_config("x.txt")
    (tmp_path / "x.txt").write_text("just some notes\n")
    with pytest.raises(ConfigError, match=r"^config file 'x.txt' \(not a preset name: read as a YAML file\): "
                                          "must be a mapping of keys .*got a str"):
        load_config("x.txt")


# ---------------------------------------------------------------- codraft train: refused before any work


@pytest.mark.parametrize("args, message", [
    (["steps=0"], "config key 'steps' must be >= 1, got 0"),
    (["steps=-2"], "config key 'steps' must be >= 1, got -2"),
    (["log.checkpoint_every=-1"], "config key 'log.checkpoint_every' must be >= 0"),
    (["rollout.prompts_per_step=0"], "config key 'rollout.prompts_per_step' must be >= 1"),
    (["rollout.group_size=0"], "config key 'rollout.group_size' must be >= 1"),
    (["rollout.max_new_tokens=0"], "config key 'rollout.max_new_tokens' must be >= 1"),
    (["rollout.temperature=-1"], "config key 'rollout.temperature' must be >= 0"),
    (["rollout.top_p=0"], r"config key 'rollout.top_p' must be in \(0, 1\]"),
    (["draft.gamma=0"], "config key 'draft.gamma' must be >= 1"),
    (["grpo.lr=-1"], "config key 'grpo.lr' must be >= 0"),
    (["steps=[1"], r"override 'steps=\[1': invalid YAML at line 1, column 9"),
    (["--config", "x.txt"],
     r"unknown preset 'x.txt' \(presets: smollm2-chainsum, tiny, tiny-long, tiny-moe, tiny-tools\); no file 'x.txt' either"),
])
def test_cli_train_refuses_before_any_work(tmp_path, monkeypatch, args, message):
    _no_loading(monkeypatch)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=f"^codraft train: error: {message}"):
        main(["train", f"run_dir={run}", *args])
    assert not run.exists() and list(tmp_path.iterdir()) == []


def _codraft(*args, cwd, monkeypatch, capsys) -> tuple[int, str]:
    """The command's exit status and stderr, run in this process as its entry point runs it."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["codraft", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli.run()
    return done.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args, first, second", [
    (["steps=3", "steps=0"], "steps=3", "steps=0"),
    (["grpo.lr=1e-3", "seed=2", " grpo.lr =1e-4"], "grpo.lr=1e-3", " grpo.lr =1e-4"),  # spaces: the same key
])
def test_cli_train_refuses_a_key_given_twice(tmp_path, monkeypatch, capsys, args, first, second):
    """On the command line, fresh or on --resume, a key given twice is one error line naming it: the run
    does not pick one of the two values."""
    _no_loading(monkeypatch)
    key = first.split("=")[0].strip()
    message = f"config key {key!r} is given twice ({first!r} and {second!r}); give it once"
    common = dict(cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert _codraft("train", f"run_dir={tmp_path / 'run'}", *args, **common) == (1, f"codraft train: error: {message}\n")
    run_dir = tmp_path / "saved"  # a run folder to resume: its config.yaml is all a resume reads before refusing
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(RunConfig(run_dir=str(run_dir)).to_dict()))
    assert _codraft("train", "--resume", str(run_dir), *args, **common) == (1, f"codraft train: error: {message}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]
    assert [p.name for p in run_dir.iterdir()] == ["config.yaml"]


# ---------------------------------------------------------------- codraft plot


def _plot_error(capsys, run_dir) -> str:
    with pytest.raises(SystemExit) as e:
        main(["plot", str(run_dir)])
    assert capsys.readouterr().out == ""
    return str(e.value.code)


def test_plot_names_a_missing_empty_or_malformed_metrics_file(tmp_path, capsys):
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    assert _plot_error(capsys, run) == f"codraft plot: error: {metrics} does not exist: not a codraft run folder"
    run.mkdir()
    metrics.write_text("")
    assert _plot_error(capsys, run) == f"codraft plot: error: {metrics} is empty: the run logged no step, " \
                                       "nothing to plot"
    metrics.write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n{\"step\": 2, \"rew\n")
    assert _plot_error(capsys, run).startswith(f"codraft plot: error: {metrics}: line 2 is not valid JSON")
    metrics.write_text("[1, 2]\n")
    assert _plot_error(capsys, run) == f"codraft plot: error: {metrics}: line 1 is not a metrics row " \
                                       "(a JSON object with an int \"step\")"
    metrics.write_text(json.dumps({"step": 1, "something_else": 1}) + "\n")
    assert _plot_error(capsys, run).startswith("codraft plot: error: nothing to plot: no metrics.jsonl of")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]  # no plot written


def test_plot_of_a_good_run_and_read_metrics_of_an_empty_one(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert read_metrics(run) == []  # the trainer plots even a run that stopped before its first step
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": s / 4}) + "\n"
                                               for s in (1, 2, 3)))
    main(["plot", str(run)])
    assert capsys.readouterr().out.strip() == str(run / "reward.png")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward_me')  # a crash cut the last write short: that row is skipped
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
