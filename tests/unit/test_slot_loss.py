"""The block drafts' fused per-slot losses (``codraft.drafts.slot_loss``).

Oracles: the same CE and L1 written with torch ops and differentiated by autograd (values and
gradients, for any upstream weights), ``gradcheck`` in fp64, and the whole DSpark loss with its
slot losses swapped for that autograd reference: loss, metrics and every parameter's gradient.
"""
import pytest
import torch

from codraft.drafts import dspark
from codraft.drafts.slot_loss import slot_losses

from test_dflash_dspark import _batch, _cfg, _draft, _target

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(z, labels, teacher_logp, outside):
    logp = z.log_softmax(-1)
    p = teacher_logp.exp()
    l1 = (logp.exp() - p).abs().sum(-1)
    if outside:
        l1 = l1 + (1 - p.sum(-1)).clamp_min(0)
    return -logp.gather(-1, labels[..., None])[..., 0], l1


def _inputs(shape, k, outside, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (3 * torch.randn(*shape, k, generator=g, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, k, shape, generator=g)
    full = torch.randn(*shape, k + (5 if outside else 0), generator=g, dtype=dtype).log_softmax(-1)
    return z, labels, full[..., :k]  # log-probs of the first k of k (+ 5) tokens


@pytest.mark.parametrize("outside", [False, True])
@pytest.mark.parametrize("shape,k", [((7,), 11), ((3, 4), 64), ((2, 5), 1000)])
def test_values_and_gradients_equal_autograd(shape, k, outside):
    z, labels, t = _inputs(shape, k, outside)
    g_ce, g_l1 = torch.randn(shape), torch.randn(shape)  # any weighting of the rows
    z_ref = z.detach().clone().requires_grad_()
    ce, l1 = slot_losses(z, labels, t, outside)
    ce_ref, l1_ref = reference(z_ref, labels, t, outside)
    torch.testing.assert_close(ce, ce_ref)
    torch.testing.assert_close(l1, l1_ref)
    ((ce * g_ce).sum() + (l1 * g_l1).sum()).backward()
    ((ce_ref * g_ce).sum() + (l1_ref * g_l1).sum()).backward()
    torch.testing.assert_close(z.grad, z_ref.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("outside", [False, True])
def test_gradcheck(outside):
    z, labels, t = _inputs((2, 3), 9, outside, dtype=torch.float64, seed=1)
    assert torch.autograd.gradcheck(lambda z: slot_losses(z, labels, t, outside), (z,))


def test_equal_distributions_give_zero_and_only_the_ce_gradient():
    z, labels, _ = _inputs((4,), 16, False)
    ce, l1 = slot_losses(z, labels, z.detach().log_softmax(-1), False)
    torch.testing.assert_close(l1, torch.zeros(4), atol=1e-6, rtol=0)
    l1.sum().backward()  # sign(q - p) is 0 (or a rounding) everywhere: no push
    assert z.grad.abs().max() < 1e-6


@pytest.mark.parametrize("vocab", [0, 29])
def test_dspark_loss_equals_the_autograd_reference(vocab, monkeypatch):
    """The whole DSpark loss (chunked: 3 blocks a chunk, checkpointed) with the fused slot losses and with
    the plain autograd ones: loss, metrics, every parameter's gradient."""
    target = _target(_cfg())
    runs = []
    for fn in (slot_losses, reference):
        monkeypatch.setattr(dspark, "slot_losses", fn)
        draft = _draft("dspark", target, num_anchors=16, **({"draft_vocab_size": vocab} if vocab else {}))
        if vocab:
            draft.set_vocabulary(torch.arange(3, 3 + 2 * vocab, 2))
        draft.config.loss_chunk_blocks = 3
        loss, metrics = draft.loss(_batch(target), generator=torch.Generator().manual_seed(0))
        loss.backward()
        runs.append((loss.detach(), metrics, {n: p.grad for n, p in draft.named_parameters()}))
    (loss, metrics, grads), (loss_ref, metrics_ref, grads_ref) = runs
    torch.testing.assert_close(loss, loss_ref)
    for k in metrics_ref:
        torch.testing.assert_close(metrics[k], metrics_ref[k])
    assert grads.keys() == grads_ref.keys() and all(g is not None for g in grads.values())
    for n in grads:
        torch.testing.assert_close(grads[n], grads_ref[n], atol=1e-6, rtol=1e-4, msg=n)
