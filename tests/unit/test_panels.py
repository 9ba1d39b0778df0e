"""Packed copies of weights (codraft.kernels.panels): the product through them against fp64, and a
copy that follows its weight (changed in place, swapped, reshaped) instead of going stale."""
import torch

from codraft.kernels import panels


def _close(y, x, w):
    ref = x.double() @ w.double().T
    return y.shape == ref.shape and bool(((y.double() - ref).abs()
                                          <= 8 * 2 ** -24 * (x.double().abs() @ w.double().abs().T)).all())


def test_a_packed_copy_follows_its_weight():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16,):
        w = torch.nn.Parameter(torch.randn(40, 33, generator=g).to(dtype), requires_grad=False)  # a rollout copy's
        x = torch.randn(3, 33, generator=g)
        with torch.inference_mode():  # as decode steps run
            assert _close(panels.product(x, w), x, w)
            first = panels.packed(w)
        with torch.no_grad():
            w.mul_(-1)  # in place (an optimiser step, a refresh): same address, new version
        with torch.inference_mode():
            assert _close(panels.product(x, w), x, w)
            assert panels.packed(w).data_ptr() == first.data_ptr()  # packed again into the same memory
        w.data = torch.randn(40, 33, generator=g).to(dtype)  # swapped
        with torch.inference_mode():
            assert _close(panels.product(x, w), x, w)
        w.data = torch.randn(50, 33, generator=g).to(dtype)  # another shape
        with torch.inference_mode():
            assert _close(panels.product(x, w), x, w)
        key = id(w)
        del w
        assert key not in panels._copies  # the copy goes with its weight


def test_inference_tensors_and_trainable_weights_run_unpacked():
    """No version counter (inference tensors), or one a fused optimiser step does not bump (weights
    that require grad, of any dtype: the trainer's): no packed copy."""
    with torch.inference_mode():
        w, x = torch.randn(20, 16).bfloat16(), torch.randn(2, 16)
        assert _close(panels.product(x, w), x, w)
        assert id(w) not in panels._copies
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(torch.randn(20, 16).to(dtype))
        p.grad = torch.randn(20, 16).to(dtype)
        before, value = p._version, p.detach().clone()
        torch.optim.AdamW([p], fused=True).step()
        assert p._version == before and not torch.equal(p.detach(), value)  # changed, unseen by the counter
        with torch.no_grad():
            y = panels.product(x, p)
        assert id(p) not in panels._copies and _close(y, x, p.detach())
    assert not panels.applies(x, p.detach().float()) and panels.applies(x, p.detach())
