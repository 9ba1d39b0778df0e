"""The co-training step and the trainer loop: stop-gradient, alignment, resume, config, CLI."""
import json
import math
import warnings

import pytest
import torch

from codraft.config import ConfigError, load_config
from codraft.drafts import init_draft
from codraft.rl import cotrain
from codraft.rl.cotrain import cotrain_loss
from codraft.train.packing import pack
from codraft.rl.trainer import Trainer
from tiny_runs import comparable, run_config, sample_rollouts, tiny_policy


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark", "model"])
def test_draft_loss_never_reaches_policy(kind):
    policy, tok = tiny_policy()
    prompts, out = sample_rollouts(policy, tok)
    batch = pack(prompts, [o.tokens for o in out], [o.logprobs for o in out])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    torch.manual_seed(1)
    draft = init_draft(kind, policy, gamma=3)

    grads = {}
    for lam in (0.0, 1.0):
        policy.zero_grad(set_to_none=True)
        draft.zero_grad(set_to_none=True)
        torch.manual_seed(2)  # same anchors for the block drafts
        loss, m = cotrain_loss(policy, draft, batch, adv, temperature=1.0, lam=lam, eps_low=0.2, eps_high=0.28,
                               norm="token")
        loss.backward()
        grads[lam] = {n: p.grad.clone() for n, p in policy.named_parameters()}
        if lam > 0:
            draft_grads = [p.grad for p in draft.parameters() if p.requires_grad]
            assert all(g is not None for g in draft_grads)
            assert sum(g.abs().sum() for g in draft_grads) > 0
            assert m["draft/loss"] > 0
    for name in grads[0.0]:
        assert torch.equal(grads[0.0][name], grads[1.0][name]), name
    assert any(g.abs().sum() > 0 for g in grads[1.0].values())  # the RL loss itself does train θ


def test_packed_logprobs_match_rollout_engine():
    """The trainer's token alignment reproduces the engine's own logprobs (independent path)."""
    policy, tok = tiny_policy()
    prompts, out = sample_rollouts(policy, tok)
    batch = pack(prompts, [o.tokens for o in out], [o.logprobs for o in out])
    _, m = cotrain_loss(policy, None, batch, torch.zeros(4), temperature=1.0, lam=0.0, eps_low=0.2,
                        eps_high=0.2, norm="token")
    assert abs(float(m["policy/token_mult_prob_error"]) - 1.0) < 1e-4
    assert abs(float(m["policy/rollout_kl"])) < 1e-5
    assert m["policy/num_tokens"] == sum(len(o.tokens) for o in out)


@pytest.mark.parametrize("rollout", [[], ["rollout.dtype=bfloat16"]], ids=["fp32", "bf16-copies"])
def test_resume_repeats_uninterrupted_run(tmp_path, tiny_policy_dir, monkeypatch, rollout):
    """Also with bf16 rollout copies: the draft's copy, made before the checkpoint's draft is restored,
    is refreshed from it (else the first rollout after the resume refuses a stale copy)."""
    from codraft.rl.logger import read_metrics
    from codraft.rl.trainer import train
    probe = ["log.frozen_probe_every=1", *rollout]  # the frozen copy must be the initial draft after a resume too
    train(run_config(tiny_policy_dir, tmp_path / "full", 4, extra=probe), progress=False)

    real_step = Trainer.step

    def crash_at_2(self, step):
        if step == 2:
            raise KeyboardInterrupt  # interrupted after the step-2 checkpoint
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "step", crash_at_2)
    with pytest.raises(KeyboardInterrupt):
        train(run_config(tiny_policy_dir, tmp_path / "cut", 4, extra=probe), progress=False)
    monkeypatch.setattr(Trainer, "step", real_step)
    assert (tmp_path / "cut" / "step_2" / "policy" / "config.json").is_file()
    train(run_config(tiny_policy_dir, tmp_path / "cut", 4, extra=probe), resume=str(tmp_path / "cut"), progress=False)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert all("frozen_acceptance_length" in r for r in full if "time_step" in r)
    assert [r["step"] for r in cut] == [0, 1, 2, 3, 4]
    assert comparable(full) == comparable(cut)
    from codraft.train.checkpoint import list_checkpoints
    assert [p.name for p in list_checkpoints(tmp_path / "full")] == ["step_2", "step_4"]
    for png in ("reward.png", "acceptance.png", "step_time.png"):
        assert (tmp_path / "full" / png).stat().st_size > 0


def test_frozen_copy_probe_measures_the_initial_draft(tmp_path, tiny_policy_dir):
    """log.frozen_probe_every: a frozen copy of the initial draft runs on the step's own prompts and
    seed. At step 0 both drafts are the same weights, so both rollouts and their τ are identical;
    then the co-trained draft moves and the copy does not."""
    t = Trainer(run_config(tiny_policy_dir, tmp_path / "run", 2, extra=["log.frozen_probe_every=1", "log.speedup_every=0"]),
                progress=False)
    copy = t.frozen_engine.draft
    initial = {k: v.clone() for k, v in t.draft.state_dict().items()}
    m0 = t.step(0)
    assert m0["frozen_acceptance_length"] == m0["acceptance_length"]
    assert t.frozen_engine.stats.acceptance_per_position == m0["acceptance_per_position"]
    m1 = t.step(1)
    assert "frozen_acceptance_length" in m1
    assert all(torch.equal(initial[k], v) for k, v in copy.state_dict().items())
    assert not all(torch.equal(initial[k], v) for k, v in t.draft.state_dict().items())
    with pytest.raises(ConfigError, match="frozen_probe_every"):
        Trainer(run_config(tiny_policy_dir, tmp_path / "b", 1, extra=["log.frozen_probe_every=-1"]), progress=False)


def test_frozen_draft_does_not_change(tmp_path, tiny_policy_dir):
    from codraft.rl.trainer import Trainer
    t = Trainer(run_config(tiny_policy_dir, tmp_path / "run", 1, kind="dspark", mode="frozen"), progress=False)
    before = {k: v.clone() for k, v in t.draft.state_dict().items()}
    t.step(0)
    assert all(torch.equal(before[k], v) for k, v in t.draft.state_dict().items())
    assert t.draft_opt is None


def test_config_validation():
    cfg = load_config(None, ["steps=3", "seed=7", "run_dir=/tmp/r"])
    assert (cfg.steps, cfg.seed, cfg.run_dir) == (3, 7, "/tmp/r")
    assert load_config("smollm2-chainsum", ["steps=1"]).task.name == "chain_sum"
    with pytest.raises(ConfigError, match="did you mean steps"):
        load_config(None, ["stepz=3"])
    with pytest.raises(ConfigError, match="'steps' expects int"):
        load_config(None, ["steps=three"])
    with pytest.raises(ConfigError, match="draft.kind.*one of eagle3, dflash, dspark"):
        load_config(None, ["draft.kind=medusa"])
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config("huge")
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(None, ["steps"])


def test_cli_train_writes_run_folder(tmp_path, tiny_policy_dir, capsys):
    from codraft.cli import main
    main(["train", f"policy.init={tiny_policy_dir}", "steps=1", f"run_dir={tmp_path / 'run'}",
          "rollout.prompts_per_step=1", "rollout.max_new_tokens=8", "log.val_size=2", "draft.kind=eagle3",
          "draft.init=random", "draft.gamma=2", "log.checkpoint_every=1"])
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and "acceptance_length" in rows[-1] and "reward_mean" in rows[-1]
    assert (tmp_path / "run" / "config.yaml").is_file()
    with pytest.raises(SystemExit, match="unknown config key"):
        main(["train", "stepz=1"])


def test_num_anchors_bounds_the_draft_loss(tmp_path, tiny_policy_dir):
    """draft.num_anchors caps the DFlash blocks per sequence (the draft loss's cost); kinds without
    anchors ignore it (a preset sets it for its block draft), a negative value is an error."""
    t = Trainer(run_config(tiny_policy_dir, tmp_path / "a", 1, extra=["draft.num_anchors=2"]), progress=False)
    m = t.step(0)
    n_seq = t.cfg.rollout.prompts_per_step * t.cfg.rollout.group_size
    assert t.draft.config.num_anchors == 2 and 0 < float(m["draft/num_blocks"]) <= 2 * n_seq
    e = Trainer(run_config(tiny_policy_dir, tmp_path / "b", 1, kind="eagle3", extra=["draft.num_anchors=2"]), progress=False)
    assert not hasattr(e.draft.config, "num_anchors")  # EAGLE-3 trains on every row; the knob is not its
    with pytest.raises(ConfigError, match="num_anchors"):
        Trainer(run_config(tiny_policy_dir, tmp_path / "c", 1, extra=["draft.num_anchors=-1"]), progress=False)


def test_draft_lr_warms_up(tmp_path, tiny_policy_dir):
    """The draft's lr ramps linearly over draft.warmup_steps (a fresh Adam's first updates are
    sign-sized and would knock back an offline-trained draft); a negative warm-up is an error."""
    t = Trainer(run_config(tiny_policy_dir, tmp_path / "a", 3, extra=["draft.lr=4e-4", "draft.warmup_steps=4"]),
                progress=False)
    lrs = []
    for step in range(3):
        lrs.append(t.draft_opt.param_groups[0]["lr"])
        t.step(step)
    assert lrs == pytest.approx([1e-4, 2e-4, 3e-4])
    with pytest.raises(ConfigError, match="draft.warmup_steps"):
        Trainer(run_config(tiny_policy_dir, tmp_path / "b", 1, extra=["draft.warmup_steps=-1"]), progress=False)


def test_drift_experiment_per_seed(tmp_path, tiny_policy_dir):
    """`codraft bench drift`: per kind and seed a frozen-draft run and a co-trained run that also
    probes a frozen copy; the summary has a row per run and a ratio per seed."""
    from codraft.bench.experiments import drift
    extra = [f"policy.init={tiny_policy_dir}", "rollout.prompts_per_step=2", "rollout.group_size=2",
             "rollout.max_new_tokens=8", "log.val_size=4", "draft.init=random", "draft.gamma=3"]
    rows = drift(tmp_path, kinds=("dflash",), steps=2, seeds=(0, 1), extra=extra, progress=False)
    assert sorted(rows) == ["dflash/0/cotrain", "dflash/0/frozen", "dflash/1/cotrain", "dflash/1/frozen"]
    assert rows["dflash/0/cotrain"]["frozen_tau_first"] is not None and rows["dflash/0/frozen"]["frozen_tau_first"] is None
    assert rows["dflash/0/cotrain"]["reward_first"] != rows["dflash/1/cotrain"]["reward_first"] or \
        rows["dflash/0/cotrain"]["tau_first"] != rows["dflash/1/cotrain"]["tau_first"]  # the seeds differ
    summary = (tmp_path / "drift.md").read_text()
    assert summary.count("| dflash |") == 6 and "same run (same policy): dflash" in summary
    assert (tmp_path / "drift-plots" / "compare_acceptance.png").is_file()


def test_an_interrupted_experiment_run_continues_from_its_checkpoint(tmp_path, tiny_policy_dir, monkeypatch):
    """`codraft bench drift|parity|rollout-dtype` rerun after Ctrl-C: the unfinished run continues from the
    checkpoint Ctrl-C left (it was removed and run again from step 0), and ends as an uninterrupted run."""
    from codraft.bench import experiments
    from codraft.rl.logger import read_metrics
    overrides = [f"policy.init={tiny_policy_dir}", "steps=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
                 "rollout.max_new_tokens=8", "log.val_every=0", "log.speedup_every=0", "log.checkpoint_every=0",
                 "draft.kind=dflash", "draft.init=random", "draft.gamma=3", "grpo.lr=1e-3"]
    ran, real = [], Trainer.step

    def step(self, i):
        if i == 2 and interrupt:
            raise KeyboardInterrupt  # Ctrl-C in step 2: steps 0 and 1 are done and checkpointed
        ran.append(i)
        return real(self, i)
    monkeypatch.setattr(Trainer, "step", step)
    interrupt = True
    with pytest.raises(KeyboardInterrupt):
        experiments._run(tmp_path, "cut", overrides, progress=False)
    assert ran == [0, 1] and not (tmp_path / "cut" / "done").exists()
    interrupt, ran[:] = False, []
    experiments._run(tmp_path, "cut", overrides, progress=False)
    assert ran == [2, 3] and (tmp_path / "cut" / "done").is_file()
    experiments._run(tmp_path, "whole", overrides, progress=False)
    cut, whole = (comparable(read_metrics(tmp_path / n)) for n in ("cut", "whole"))
    assert [r["step"] for r in cut] == [1, 2, 3, 4] and cut == whole


def test_training_precisions_reach_the_losses(tmp_path, tiny_policy_dir, monkeypatch):
    """grpo.precision, draft.precision: the trainer's policy forward, LM head and draft loss run under the
    chosen products (recorded by the loss's ``products`` contexts), "auto" is measured into the cache
    for each model, and an unknown name is a config error."""
    used, real = [], cotrain.products
    monkeypatch.setattr(cotrain, "products", lambda dtype: used.append(dtype) or real(dtype))
    for policy, draft in (("float32", "bfloat16"), ("bfloat16", "float32")):
        cfg = run_config(tiny_policy_dir, tmp_path / policy, 1,
                   extra=[f"grpo.precision={policy}", f"draft.precision={draft}"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = Trainer(cfg, progress=False)
        # bf16 products against rollouts from the fp32 weights: the user is told to pair them with bf16 rollouts
        assert any("rollout.dtype=bfloat16" in str(w.message) for w in caught) == (policy == "bfloat16")
        assert (t.policy_dtype, t.draft_dtype) == (getattr(torch, policy), getattr(torch, draft))
        used.clear()
        m = t.step(0)
        # the policy's forward, LM head and KL reference (grpo.kl_coef > 0); the draft's loss
        assert used == [getattr(torch, policy)] * 3 + [getattr(torch, draft)]
        assert torch.isfinite(torch.as_tensor(m["draft/loss"])) and math.isfinite(m["policy/rollout_kl"])
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "cache"))
    t = Trainer(run_config(tiny_policy_dir, tmp_path / "auto", 1, extra=["draft.precision=auto", "grpo.precision=auto"]),
                progress=False)
    saved = {tuple(map(tuple, s["key"]["shapes"])): s["choice"] for s in
             (json.loads(p.read_text()) for p in (tmp_path / "cache" / "precision").glob("*.json"))}

    def shapes(model):
        return tuple(sorted({tuple(p.shape) for p in model.parameters() if p.requires_grad and p.ndim == 2}))
    assert saved.keys() == {shapes(t.policy), shapes(t.draft)}  # each model measured for its own products
    assert t.policy_dtype == getattr(torch, saved[shapes(t.policy)])
    assert t.draft_dtype == getattr(torch, saved[shapes(t.draft)])
    for key in ("draft.precision", "grpo.precision"):
        with pytest.raises(ConfigError, match=key):
            run_config(tiny_policy_dir, tmp_path / "bad", 1, extra=[f"{key}=fp16"])
