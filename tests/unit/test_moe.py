"""Mixture-of-experts targets (codraft.models.moe): logits equal transformers' Qwen3-MoE and Qwen2-MoE
(shared expert) on random tiny configs with dense layers mixed in, through an HF folder both ways; the
grouped expert products equal a per-token reference; checkpoints that disagree with their config are
refused in one line; the CPU fast path gives the reference's logits on a MoE target."""
from __future__ import annotations

import pytest
import torch

from codraft import kernels
from codraft.models import ModelConfig, Transformer, load_pretrained, save_pretrained
from codraft.models.moe import SparseMoE

CASES = {
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(norm_topk_prob=True)),
    "qwen3-moe-mixed": ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[1], decoder_sparse_step=1)),
    "qwen3-moe-sparse-step": ("Qwen3MoeForCausalLM", dict(decoder_sparse_step=2, norm_topk_prob=True)),
    "qwen2-moe-shared": ("Qwen2MoeForCausalLM", dict(shared_expert_intermediate_size=24, qkv_bias=False,
                                                     mlp_only_layers=[2])),
}


def _hf(case, seed=0):
    import transformers
    arch, extra = CASES[case]
    cfg_cls = {"Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
               "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig}[arch]
    cfg = cfg_cls(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
                  max_position_embeddings=128, tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():  # HF initialises some tensors to constants: random everywhere
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_transformers(case, tmp_path):
    hf = _hf(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    assert ours.config.moe and any(isinstance(l.mlp, SparseMoE) for l in ours.layers)
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert (got - ref).abs().max() <= 1e-4
    save_pretrained(ours, tmp_path / "ours")  # and back: transformers reads what codraft writes
    import transformers
    again = getattr(transformers, CASES[case][0]).from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert (again(ids).logits - ref).abs().max() <= 1e-4


def _config(**kw):
    return ModelConfig(**{**dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen3MoeForCausalLM"],
                                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                 norm_topk_prob=True, max_position_embeddings=128), **kw})


def test_grouped_products_equal_the_per_token_reference():
    torch.manual_seed(0)
    moe = SparseMoE(_config())
    x = torch.randn(5, 32)
    _, w, e = moe.route(x)
    ref = torch.stack([sum(w[n, j] * moe.experts[int(e[n, j])](x[n:n + 1])[0] for j in range(moe.top_k))
                       for n in range(len(x))])
    assert torch.allclose(moe(x[None])[0], ref, atol=1e-6)
    # gradients too, for the weights of the experts that were used
    x.requires_grad_(True)
    moe(x[None]).square().sum().backward()
    used = set(e.flatten().tolist())
    assert len(used) < 8  # some expert got no token: its gradient is zeros, not None (data parallelism)
    assert all((moe.experts[i].down_proj.weight.grad.abs().sum() > 0) == (i in used) for i in range(8))


@pytest.mark.parametrize("bad,msg", [
    (dict(num_experts=0), "num_experts >= 1"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok <= num_experts"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size >= 1"),
    (dict(qkv_bias=True, architectures=["Qwen2MoeForCausalLM"]), "attention biases are not modelled"),
    (dict(shared_expert_intermediate_size=8), "Qwen3MoeForCausalLM has no shared expert"),
    (dict(architectures=["MixtralForCausalLM"]), "unsupported architecture 'MixtralForCausalLM'"),
])
def test_bad_configs_are_one_line(bad, msg):
    with pytest.raises(ValueError, match=msg):
        _config(**bad)


def test_a_checkpoint_with_other_experts_is_refused(tmp_path):
    save_pretrained(Transformer(_config()), tmp_path / "m")
    cfg = (tmp_path / "m" / "config.json")
    cfg.write_text(cfg.read_text().replace('"num_experts": 8', '"num_experts": 6'))
    with pytest.raises(ValueError, match="has 8 experts \\(model.layers.0.mlp.gate.weight\\), config.json says "
                                         "num_experts=6"):
        load_pretrained(tmp_path / "m")
    cfg.write_text(cfg.read_text().replace('"num_experts": 6', '"num_experts": 8').replace(
        '"moe_intermediate_size": 16', '"moe_intermediate_size": 12'))
    with pytest.raises(ValueError, match="experts.0.down_proj.weight in model.safetensors has shape "
                                         "\\(32, 16\\), expected \\(32, 12\\)"):
        load_pretrained(tmp_path / "m")


def test_fast_path_on_a_moe_target():
    torch.manual_seed(0)
    ref = Transformer(_config(mlp_only_layers=[1])).eval()
    fast = kernels.enable(Transformer(_config(mlp_only_layers=[1])).eval())
    fast.load_state_dict(ref.state_dict())
    from codraft.rollout import Engine
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    a = Engine(ref).generate(prompts, 12, temperature=0, eos_id=[])
    b = Engine(fast).generate(prompts, 12, temperature=0, eos_id=[])
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.logprobs, rb.logprobs)) <= 1e-4


def test_speculative_sampling_is_exact_on_a_moe_target():
    """T = 1, γ = 2: the first γ + 2 new tokens of speculative decoding with a MoE target follow the
    enumerated distribution (the verify forward routes γ + 1 tokens at once, a decode step one)."""
    from codraft.drafts import build_draft
    from codraft.rollout import Engine
    from spec_harness import PROMPT, V, chi2_fits, exact_joint, histogram, scaled
    cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, architectures=["Qwen3MoeForCausalLM"],
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    target = scaled(Transformer(cfg), 0.35, seed=0)
    torch.manual_seed(1)
    draft = build_draft("model", target.config, num_hidden_layers=1)
    scaled(draft.net, 0.1, 1)
    gamma, n = 2, 6000
    out = Engine(target, draft, gamma=gamma).generate([PROMPT] * n, gamma + 2, seed=0, eos_id=[])
    fits, stat, crit = chi2_fits(histogram(out, gamma + 2), exact_joint(target, gamma + 2), alpha=1e-4)
    assert fits, f"chi-square {stat:.1f} >= {crit:.1f}"


def _replayed_logprobs(model, prompts, out, replay_from=None):
    """Per completion token, the model's logprob (T = 1) in one packed forward, routed as the rollout did
    (``replay_from``: the results whose routes to replay; None: the model's own routing)."""
    from codraft.models.moe import Routing
    from codraft.rl.cotrain import replay_routes
    from codraft.train.packing import pack
    batch = pack(prompts, [o.tokens for o in out], share_prompts=False)
    replay = None if replay_from is None else replay_routes(batch, [o.routes for o in replay_from])
    with torch.no_grad(), Routing(model, replay):
        logits = model(batch.input_ids, cu_seqlens=batch.cu_seqlens)[0]
    targets = batch.index[batch.index_mask]
    return logits[targets - 1].log_softmax(-1).gather(1, batch.input_ids[0, targets][:, None])[:, 0]


def test_routing_replay():
    """The engine records each token's experts (the prompts' too; none for the last token, never an input);
    the trainer's packed forward replaying them gives the rollout's logprobs, replaying other experts does
    not: the replay is what routes the forward."""
    import copy
    from codraft.rollout import Engine
    torch.manual_seed(0)
    policy = Transformer(_config(num_hidden_layers=3, mlp_only_layers=[0])).eval()
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(10)  # peaky routers and logits: routes matter
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    out = Engine(policy, record_routes=True).generate(prompts, 12, seed=0, eos_id=[])
    rollout_lp = torch.tensor([lp for o in out for lp in o.logprobs])
    assert all(o.routes.shape == (len(p) + 12, 2, 2) and (o.routes[:-1] >= 0).all() and (o.routes[-1] < 0).all()
               for p, o in zip(prompts, out))
    replayed = _replayed_logprobs(policy, prompts, out, out)
    assert (replayed - rollout_lp).abs().max() <= 1e-3  # (fp32 rounding of peaky logits)
    wrong = [copy.copy(o) for o in out]
    for o in wrong:
        o.routes = torch.where(o.routes >= 0, (o.routes + 1) % 8, o.routes)
    assert (_replayed_logprobs(policy, prompts, out, wrong) - rollout_lp).abs().max() > 1e-2


def test_load_balancing_loss_is_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    from codraft.models.moe import Routing, load_balancing_loss
    torch.manual_seed(0)
    model = Transformer(_config(num_hidden_layers=3, mlp_only_layers=[1]))
    ids = torch.randint(0, 50, (1, 17))
    with Routing(model, logits=True) as r:
        model(ids)
    assert len(r.logits) == 2
    ours = load_balancing_loss(r.logits, 2)
    ref = load_balancing_loss_func(tuple(r.logits), num_experts=8, top_k=2)
    assert torch.allclose(ours, ref, atol=1e-6)
    ours.backward()  # the routers learn from it
    assert model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
