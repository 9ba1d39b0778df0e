"""bf16 rollout weights (``codraft.rollout.weights``): the copy is weight-only bf16 and computes
what an fp32 model with bf16-rounded weights computes; the engine samples exactly that model's
distribution (the exact-enumeration oracle of ``spec_harness``, speculative and plain); the copy
follows every optimiser step, and a skipped or partial refresh is caught; the trainer's
``rollout.dtype`` and ``grpo.tis_cap`` keys."""
import copy
import sys

import pytest
import torch

import spec_harness
from test_hugepages import thp_mode
from codraft.config import ConfigError, load_config
from codraft.kernels import hugepages
from codraft.drafts import init_draft
from codraft.models import ModelConfig, Transformer, load_pretrained, save_pretrained
from codraft.rl.trainer import Trainer
from codraft.rollout import Engine
from codraft.rollout.weights import RolloutWeights, StaleRolloutWeights
from codraft.spec.sampling import Sampler
from tiny_runs import run_config

BF16 = torch.bfloat16


def _model(seed=0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Transformer(cfg).eval()


def _rounded(model: Transformer) -> Transformer:
    """The fp32 model whose matrices are the bf16-rounded values: what a weight-only bf16 copy computes."""
    r = copy.deepcopy(model)
    with torch.no_grad():
        for p in r.parameters():
            if p.dim() >= 2:
                p.copy_(p.to(BF16).float())
    return r


def test_copy_is_weight_only_and_computes_the_rounded_model():
    model = _model()
    rw = RolloutWeights(model, BF16)
    copy_ = rw.policy
    dtypes = {n: p.dtype for n, p in copy_.named_parameters()}
    assert all(d == (BF16 if "norm" not in n else torch.float32) for n, d in dtypes.items()), dtypes
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the trainer's weights are untouched
    ids = torch.randint(0, 40, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, ref, fp32 = copy_(ids), _rounded(model)(ids), model(ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert (got - fp32).abs().max() > 1e-4  # the rounding is real: not the fp32 model
    # decoding into the KV cache (the kernels' paths, few rows) gives the rounded model's greedy tokens
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    out = Engine(copy_).generate(prompts, 12, temperature=0.0, eos_id=[])
    want = Engine(_rounded(model)).generate(prompts, 12, temperature=0.0, eos_id=[])
    assert [o.tokens for o in out] == [w.tokens for w in want]


def test_a_draft_that_narrows_nothing_is_shared_and_reads_the_copy():
    model = _model()
    rw = RolloutWeights(model, BF16)
    torch.manual_seed(2)
    draft = init_draft("eagle3", model, gamma=3)
    assert draft.rollout_narrowed == ()
    rolling = rw.draft_for(draft)
    assert rolling is not draft and rolling._target[0] is rw.policy.embed_tokens.weight  # what bind_target kept
    assert draft._target[0] is model.embed_tokens.weight  # the trainer's draft is still bound to fp32
    assert all(a is b for a, b in zip(rolling.parameters(), draft.parameters()))  # trained in place: never stale
    _greedy_is_plain(rw.policy, rolling)


def _greedy_is_plain(policy, draft):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    spec = Engine(policy, draft, 3).generate(prompts, 16, temperature=0.0, eos_id=[])
    plain = Engine(policy).generate(prompts, 16, temperature=0.0, eos_id=[])
    assert [s.tokens for s in spec] == [p.tokens for p in plain]


def _proposal(policy, draft, seed=3):
    """A draft's proposal (tokens, q) of 3 tokens at T = 1 after a prefill of two prompts."""
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        _, feats = policy(ids, taps=tuple(draft.feature_layers))
        pending = torch.tensor([[5], [7]])
        state = draft.begin(torch.cat([ids, pending], 1), torch.full((2,), 10), feats, max_len=32)
        return draft.propose(state, 3, Sampler(1.0, generator=torch.Generator().manual_seed(seed)), context_len=10)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_block_drafts_copy_narrows_its_backbone_and_computes_the_rounded_draft(kind):
    model = _model()
    rw = RolloutWeights(model, BF16)
    torch.manual_seed(2)
    draft = init_draft(kind, model, gamma=3)
    rolling = rw.draft_for(draft)
    assert rw.draft_for(draft) is rolling  # one copy per draft, refreshed in place
    narrowed = {n for n, p in rolling.named_parameters() if p.dtype == BF16}
    assert narrowed and narrowed == {n for n, p in draft.named_parameters()
                                     if p.dim() >= 2 and n.startswith(("fc.", "layers."))}
    assert all(p.dtype == torch.float32 for p in draft.parameters()) and rolling.dtype == torch.float32
    assert rolling._target.head is rw.policy.head_weight and draft._target.head is model.head_weight
    # oracle: the fp32 draft whose narrowed matrices hold the bf16-rounded values, on the same bf16 target
    oracle = copy.deepcopy(draft)
    with torch.no_grad():
        for n, p in oracle.named_parameters():
            if n in narrowed:
                p.copy_(p.to(BF16).float())
    oracle.bind_target(rw.policy.embed_tokens.weight, rw.policy.head_weight)
    (x, q), (x_ref, q_ref) = _proposal(rw.policy, rolling), _proposal(rw.policy, oracle)
    assert torch.equal(x, x_ref)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-6)
    _greedy_is_plain(rw.policy, rolling)


def test_a_drafts_copy_follows_refresh_and_a_stale_one_is_loud():
    model = _model()
    rw = RolloutWeights(model, BF16)
    torch.manual_seed(2)
    draft = init_draft("dspark", model, gamma=3)
    rolling = rw.draft_for(draft)
    rw.check("step 0")
    with torch.no_grad():  # the draft's optimiser step: a narrowed matrix, then every tensor
        draft.fc.weight.add_(0.01)
        with pytest.raises(StaleRolloutWeights, match=r"step 1: .*DSparkDraft draft's 'fc.weight'.*not refreshed"):
            rw.check("step 1")
        for p in draft.parameters():
            p.add_(0.01)
    rw.refresh()
    rw.check("step 1")
    for (n, p), r in zip(draft.state_dict().items(), rolling.state_dict().values()):
        assert torch.equal(r, p.to(BF16) if r.dtype == BF16 else p), n
    with torch.no_grad():  # a half-refreshed copy: one of the draft's tensors left behind
        rolling.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    with pytest.raises(StaleRolloutWeights, match="draft's 'layers.0.mlp.up_proj.weight'"):
        rw.check("step 2")


def test_same_dtype_is_the_policy_itself():
    model = _model()
    rw = RolloutWeights(model, torch.float32)
    assert rw.policy is model and not rw.copies and rw.draft_for("a draft") == "a draft"
    rw.check("step 0")  # nothing to compare


def test_the_trainers_own_matrices_move_into_huge_pages_and_stay_trainable_and_savable(tmp_path):
    """No copy: the engine streams the trainer's matrices, moved in place into one buffer of 2 MB pages;
    the same Parameter objects (the optimiser's), the same values, updates land in the buffer, and the
    policy still saves (every matrix a view into the one buffer) and loads back equal."""
    model = _model(3)
    params = dict(model.named_parameters())
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    rw = RolloutWeights(model, torch.float32)
    assert dict(model.named_parameters()) == params  # the very same objects
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    buffer = matrices[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == buffer for p in matrices)
    # a buffer aligned to 2 MB pages; huge pages themselves only where the kernel offers them (whether it
    # backs this small buffer with them depends on its free memory: tests/unit/test_hugepages.py checks that)
    assert min(p.data_ptr() for p in matrices) % hugepages.PAGE == 0
    assert not rw.huge_pages or (sys.platform.startswith("linux") and thp_mode() in ("always", "madvise"))
    model.train()
    model(torch.randint(0, 40, (2, 6))).float().pow(2).mean().backward()
    opt.step()
    assert all(p.untyped_storage().data_ptr() == buffer for p in matrices)  # updated in place
    assert not torch.equal(model.embed_tokens.weight, before["embed_tokens.weight"])
    save_pretrained(model, tmp_path / "saved")
    loaded = load_pretrained(tmp_path / "saved")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize("case", [spec_harness.Case("far", 3, n=8000),
                                  spec_harness.Case("near", 4, temperature=0.7, top_p=0.9, n=8000, adaptive=True)],
                         ids=lambda c: c.id)
def test_bf16_engine_samples_the_bf16_model_exactly(case):
    h = spec_harness.Harness()
    h.target = RolloutWeights(h.target, BF16).policy  # the oracle enumerates the bf16 model too
    ok, stat, crit = h.check(case, seed=11)
    assert ok, f"chi2 {stat:.1f} >= critical {crit:.1f}"
    plain = Engine(h.target).generate([spec_harness.PROMPT] * case.n, case.length, seed=5, eos_id=[], **case.settings)
    ok, stat, crit = spec_harness.chi2_fits(spec_harness.histogram(plain, case.length), h.exact(case))
    assert ok, f"plain: chi2 {stat:.1f} >= critical {crit:.1f}"


def test_refresh_follows_the_optimiser_and_a_stale_copy_is_loud():
    model = _model().train()
    rw = RolloutWeights(model, BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 40, (2, 8))).square().mean().backward()
    opt.step()
    with pytest.raises(StaleRolloutWeights, match=r"step 1: .*'embed_tokens.weight'.*not refreshed"):
        rw.check("step 1")  # the refresh was skipped
    rw.refresh()
    rw.check("step 1")
    for n, p in model.state_dict().items():  # the copy is the cast of the new weights, tensor by tensor
        assert torch.equal(rw.policy.state_dict()[n], p.to(BF16) if p.dim() >= 2 else p), n
    with torch.no_grad():  # a half-refreshed copy: one tensor left behind
        rw.policy.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    with pytest.raises(StaleRolloutWeights, match="layers.1.mlp.down_proj.weight"):
        rw.check("step 2")


def test_trainer_decodes_the_refreshed_bf16_copy(tiny_policy_dir, tmp_path, monkeypatch, varied_reward):
    cfg = run_config(tiny_policy_dir, tmp_path / "run", 3, extra=("rollout.dtype=bfloat16", "grpo.tis_cap=2.0",
                                                             "log.val_every=0", "log.checkpoint_every=0"))
    t = Trainer(cfg, progress=False)
    assert t.engine.model is t.rollout_weights.policy and t.plain_engine.model is t.rollout_weights.policy
    assert t.engine.draft._target.head is t.rollout_weights.policy.head_weight
    assert t.rollout_weights.policy.layers[0].mlp.up_proj.weight.dtype == BF16
    assert t.engine.draft.layers[0].mlp.up_proj.weight.dtype == BF16  # the co-trained draft's copy narrows too
    m = t.step(0)
    t.rollout_weights.check("after step 0")  # refreshed after the update (the policy and the draft)
    assert torch.equal(t.engine.draft.fc.weight, t.draft.fc.weight.to(BF16))
    assert float(m["mismatch_kl"]) > 0 and "policy/is_weight_mean" in m  # bf16 logprobs differ; TIS is on
    monkeypatch.setattr(t.rollout_weights, "refresh", lambda: None)
    before = copy.deepcopy(t.policy.state_dict())
    t.step(1)  # its update is not copied...
    assert any(not torch.equal(v, before[k]) for k, v in t.policy.state_dict().items())
    with pytest.raises(StaleRolloutWeights, match="step 2"):
        t.step(2)  # ...which the next rollout refuses


def test_config_keys():
    ok = load_config(None, ["rollout.dtype=bfloat16", "grpo.tis_cap=2"])
    assert ok.rollout.dtype == "bfloat16" and ok.grpo.tis_cap == 2.0
    with pytest.raises(ConfigError, match="rollout.dtype.*policy.dtype=bfloat16"):
        load_config(None, ["policy.dtype=bfloat16", "rollout.dtype=float32"])
    with pytest.raises(ConfigError, match="grpo.tis_cap"):
        load_config(None, ["grpo.tis_cap=-1"])
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config(None, ["rollout.dtype=float16"])


def test_the_copy_lives_in_one_buffer_of_huge_pages_and_refreshes_in_place():
    model = _model(5)
    rw = RolloutWeights(model, BF16)
    matrices = [p for p in rw.policy.parameters() if p.dim() >= 2]
    buffer = matrices[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == buffer for p in matrices)
    # a buffer aligned to 2 MB pages; huge pages themselves only where the kernel offers them (whether it
    # backs this small buffer with them depends on its free memory: tests/unit/test_hugepages.py checks that)
    assert min(p.data_ptr() for p in matrices) % hugepages.PAGE == 0
    assert not rw.huge_pages or (sys.platform.startswith("linux") and thp_mode() in ("always", "madvise"))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    rw.refresh()
    rw.check("after a refresh")  # the values followed, into the same buffer
    assert all(p.untyped_storage().data_ptr() == buffer for p in matrices)
