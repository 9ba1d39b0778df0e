"""The precision a model trains in: bf16 products (``codraft.models.bf16``) really run the products in bf16
and nothing else, padded, nested and recomputed as they should be; a bf16 draft loss stays close to fp32's
(loss, every gradient tensor) and never reaches the policy; a bf16 policy loss stays close to fp32's; and
"auto" (``codraft.train.precision``) is chosen by a measurement cached per machine and shapes and taken
again elsewhere."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from codraft import kernels
from codraft.drafts import init_draft
from codraft.models import Transformer, bf16
from codraft.policy.warmstart import tiny_model_config
from codraft.rl.cotrain import cotrain_loss
from codraft.rollout import Engine
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer
from codraft.train import precision
from codraft.train.offline_draft import Recipe, recipe_for, starting_draft, train_offline
from codraft.train.packing import pack
from precision_probe import Products


def _policy_and_batch():
    tok = CharTokenizer()
    cfg = tiny_model_config(tok)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.head_dim = 64, 128, 4, 16
    torch.manual_seed(0)
    policy = Transformer(cfg)
    prompts = [tok.prompt_ids(s) for s in ["12+3=", "7*8-1=", "5+5=", "99-9*2="]]
    out = Engine(policy).generate(prompts, 12, temperature=1.0, seed=0, eos_id=tok.eos_id)
    return policy, pack(prompts, [o.tokens for o in out], [o.logprobs for o in out])


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark", "model"])
def test_bf16_draft_loss_is_close_to_fp32_and_leaves_the_policy_alone(kind):
    policy, batch = _policy_and_batch()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    torch.manual_seed(1)
    draft = init_draft(kind, policy, gamma=3)
    losses, policy_grads, draft_grads, dtypes = {}, {}, {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        policy.zero_grad(set_to_none=True)
        draft.zero_grad(set_to_none=True)
        torch.manual_seed(2)  # same anchors for the block drafts
        with Products() as products:
            loss, m = cotrain_loss(policy, draft, batch, adv, temperature=1.0, lam=1.0, eps_low=0.2, eps_high=0.28,
                                   norm="token", draft_dtype=dtype)
        loss.backward()
        dtypes[dtype] = products.dtypes
        losses[dtype] = float(m["draft/loss"])
        policy_grads[dtype] = {n: p.grad.clone() for n, p in policy.named_parameters()}
        draft_grads[dtype] = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    assert dtypes[torch.float32] == {torch.float32}
    assert dtypes[torch.bfloat16] == {torch.float32, torch.bfloat16}  # the draft's products ran in bf16, the
    # policy's in fp32 on both sides (policy_dtype)
    for name, g in policy_grads[torch.float32].items():  # the draft sees detached features only
        assert torch.equal(g, policy_grads[torch.bfloat16][name]), name
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float32], rel=2e-2)
    assert draft_grads[torch.float32].keys() == draft_grads[torch.bfloat16].keys()
    for name, g in draft_grads[torch.float32].items():
        b = draft_grads[torch.bfloat16][name]
        assert b.dtype == g.dtype == torch.float32, name  # master weights and their gradients stay fp32
        if g.norm() > 1e-6:
            cos = float((g * b).sum() / (g.norm() * b.norm()))
            assert cos > 0.97, (name, cos)


def test_explicit_precisions_and_bad_input():
    draft = torch.nn.Linear(4, 4)
    assert precision.resolve("float32", draft) == torch.float32
    assert precision.resolve("bfloat16", draft) == torch.bfloat16
    with pytest.raises(ValueError, match="auto, float32, bfloat16.*'fp16'"):
        precision.resolve("fp16", draft)
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)  # nothing trains: nothing to measure
    assert precision.resolve("auto", frozen, timer=lambda *a: pytest.fail("measured")) == torch.float32


def test_auto_is_measured_once_per_machine_and_shapes(tmp_path):
    calls = []

    def timer(seconds: dict):
        def run(dtype, shapes, device):
            calls.append((dtype, tuple(map(tuple, shapes)), device.type))
            return seconds[dtype]
        return run
    bf16_wins = timer({torch.float32: 1.0, torch.bfloat16: 0.5})
    fp32_wins = timer({torch.float32: 1.0, torch.bfloat16: 0.95})  # within the margin: not worth bf16's rounding
    draft = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    assert precision.resolve("auto", draft, folder=tmp_path, timer=bf16_wins) == torch.bfloat16
    assert calls == [(d, ((8, 16), (16, 8)), "cpu") for d in (torch.float32, torch.bfloat16)]  # the weights' shapes
    # cached: the same shapes on the same machine are not measured again
    assert precision.resolve("auto", draft, folder=tmp_path, timer=fp32_wins) == torch.bfloat16
    assert len(calls) == 2
    # other shapes: another measurement, another file
    other = torch.nn.Linear(8, 32)
    assert precision.resolve("auto", other, folder=tmp_path, timer=fp32_wins) == torch.float32
    assert len(calls) == 4 and len(list(tmp_path.glob("*.json"))) == 2
    # a file recorded on another machine (same name, other key) or unreadable is measured again
    path = next(p for p in tmp_path.glob("*.json") if json.loads(p.read_text())["choice"] == "bfloat16")
    saved = json.loads(path.read_text())
    saved["key"]["machine"]["threads"] += 1
    path.write_text(json.dumps(saved))
    assert precision.resolve("auto", draft, folder=tmp_path, timer=fp32_wins) == torch.float32
    path.write_text("{not json")
    assert precision.resolve("auto", draft, folder=tmp_path, timer=bf16_wins) == torch.bfloat16
    assert len(calls) == 8
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "choice": "float16"}))  # not a choice resolve makes
    assert precision.resolve("auto", draft, folder=tmp_path, timer=fp32_wins) == torch.float32
    assert len(calls) == 10


def test_the_measurement_times_both_precisions():
    for dtype in (torch.float32, torch.bfloat16):
        s = precision._time_products(dtype, [(32, 16)], torch.device("cpu"), repeats=1)
        assert 0 < s < 5


def test_offline_training_in_bf16(tmp_path):
    tok = CharTokenizer()
    torch.manual_seed(0)
    policy = Transformer(tiny_model_config(tok)).eval()
    task = make_task("arith")
    runs = {}
    for name in ("float32", "bfloat16"):
        torch.manual_seed(1)
        draft = starting_draft("dspark", "random", policy=policy, tok=tok, task=None, policy_dir=None, gamma=3, seed=0)
        runs[name] = train_offline(policy, tok, task, draft, out_dir=tmp_path / name, steps=3, n_prompts=6,
                                   max_new_tokens=8, batch_sequences=3, progress=False, precision=name)
    assert runs["float32"]["precision"] == "float32" and runs["bfloat16"]["precision"] == "bfloat16"
    # the same data and seeds: the losses differ by bf16's rounding only
    assert runs["bfloat16"]["final_loss"] == pytest.approx(runs["float32"]["final_loss"], rel=2e-2)
    assert runs["bfloat16"]["final_loss"] != runs["float32"]["final_loss"]


def test_recipes_measure_on_real_models_only():
    assert recipe_for(CharTokenizer(), "dspark").precision == "float32"  # the tiny preset: exact, reproducible
    assert Recipe(steps=1, batch_sequences=1, lr=1.0, n_prompts=1, max_new_tokens=1).precision == "float32"

    class Big:
        vocab_size = 49152
    assert {recipe_for(Big(), k).precision for k in ("dflash", "dspark", "eagle3")} == {"auto"}


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 130])
def test_bf16_products_are_padded_and_give_the_unpadded_bf16_product(rows):
    """Under bf16 products every F.linear gets bf16 operands and, on CPU, a multiple of ROW_BUCKET rows
    (oneDNN compiles a kernel per shape); its output is in the input's dtype, and it and the gradients
    are those of the unpadded product of the bf16-rounded operands (the oracle), not fp32's."""
    gen = torch.Generator().manual_seed(rows)
    x0, w0 = torch.randn(rows, 3, 48, generator=gen), torch.randn(40, 48, generator=gen)
    b0 = torch.randn(40, generator=gen)
    x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
    with Products() as seen, bf16.products(torch.bfloat16):
        y = torch.nn.functional.linear(x, w, b)
    y.square().sum().backward()
    xr, wr, br = (t.clone().requires_grad_() for t in (x0, w0, b0))
    ref = torch.nn.functional.linear(xr.bfloat16(), wr.bfloat16()).float() + br
    ref.square().sum().backward()
    padded = -(-3 * rows // bf16.ROW_BUCKET) * bf16.ROW_BUCKET
    assert seen.inputs == [(padded, 48)] and seen.dtypes == {torch.bfloat16}
    assert y.shape == (rows, 3, 40) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert (y - torch.nn.functional.linear(x0, w0, b0)).abs().max() > 1e-3  # not fp32's product
    for a, r in zip((x.grad, w.grad, b.grad), (xr.grad, wr.grad, br.grad)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=1e-2, atol=1e-2)


def test_fp32_products_inside_bf16_ones_and_bad_input():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=gen), torch.randn(16, 32, generator=gen)
    exact = torch.nn.functional.linear(x, w)
    assert bf16.active() == torch.float32
    with bf16.products(torch.bfloat16):
        low = torch.nn.functional.linear(x, w)
        with bf16.products(torch.float32):  # e.g. a draft kept in fp32 under a bf16 policy
            assert bf16.active() == torch.float32
            inner = torch.nn.functional.linear(x, w)
        assert bf16.active() == torch.bfloat16
    assert bf16.active() == torch.float32
    assert torch.equal(inner, exact) and (low - exact).abs().max() > 1e-3
    with pytest.raises(ValueError, match="float32 or bfloat16.*float16"):
        with bf16.products(torch.float16):
            pass
    assert bf16.active() == torch.float32


def test_a_recomputed_checkpoint_runs_its_products_as_it_first_did():
    """checkpoint(context_fn=recompute_alike): the backward recomputes outside the products context; its
    products must be bf16 again, or the recomputed tensors would not be the ones the forward saved."""
    gen = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(7, 32, generator=gen), torch.randn(16, 32, generator=gen)

    def f(x, w):
        return torch.nn.functional.linear(torch.nn.functional.linear(x, w).tanh(), w.T.contiguous())

    grads = {}
    for recompute in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with bf16.products(torch.bfloat16):
            y = torch.utils.checkpoint.checkpoint(f, x, w, use_reentrant=False, context_fn=bf16.recompute_alike) \
                if recompute else f(x, w)
        y.square().sum().backward()
        grads[recompute] = (y, x.grad, w.grad)
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)


def test_the_decode_kernels_step_aside_for_bf16_products():
    """A no-grad forward under bf16 products (the KL reference's) runs them in bf16, not in the fp32 C
    kernels a kernel-enabled model would use: the same result as the plain model's."""
    tok = CharTokenizer()
    torch.manual_seed(0)
    plain = Transformer(tiny_model_config(tok)).eval()
    fast = kernels.enable(copy.deepcopy(plain))
    ids = torch.randint(3, tok.vocab_size, (2, 3))
    with torch.no_grad():
        exact = plain(ids)
        with bf16.products(torch.bfloat16):
            want, got = plain(ids), fast(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - exact).abs().max() > 1e-4


def test_bf16_policy_loss_is_close_to_fp32():
    """grpo.precision=bfloat16: every product of the policy's forward, LM head included, runs in bf16; its
    logprobs move from the (fp32) rollout's by a small KL; the gradients stay fp32 and close to fp32's."""
    policy, batch = _policy_and_batch()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads, dtypes, kl = {}, {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        policy.zero_grad(set_to_none=True)
        with Products() as seen:
            loss, m = cotrain_loss(policy, None, batch, adv, temperature=1.0, lam=1.0, eps_low=0.2, eps_high=0.28,
                                   norm="token", policy_dtype=dtype)
        loss.backward()
        dtypes[dtype], kl[dtype] = seen.dtypes, float(m["policy/rollout_kl"])
        grads[dtype] = {n: p.grad.clone() for n, p in policy.named_parameters()}
    assert dtypes == {torch.float32: {torch.float32}, torch.bfloat16: {torch.bfloat16}}
    assert kl[torch.float32] < 1e-9 < kl[torch.bfloat16] < 1e-4  # the rollout decoded in fp32: exact there
    for name, g in grads[torch.float32].items():
        b = grads[torch.bfloat16][name]
        assert b.dtype == torch.float32 and not torch.equal(b, g), name
        cos = float((g * b).sum() / (g.norm() * b.norm()))
        assert cos > 0.97, (name, cos)
