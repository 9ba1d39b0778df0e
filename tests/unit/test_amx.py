"""The AMX tile kernel for bf16-weight products (codraft.kernels.amx) against fp64 products, on a
CPU that has AMX; where it has none, that it says so and the product path never offers it."""
from pathlib import Path

import pytest
import torch

from codraft.kernels import amx, gemv, products

from test_gemv import same_on_one_and_two_threads


def _cpu_has_amx() -> bool:
    flags = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags.split())


def test_ready_exactly_where_the_cpu_has_amx():
    # an AMX machine that silently lost the kernel (build flags, Linux's permission) must fail here
    assert amx.ready() == _cpu_has_amx()
    w = torch.randn(32, 64).bfloat16()
    assert amx.applies(torch.randn(3, 64), w) == _cpu_has_amx()
    candidates = products._candidates(w)
    assert "amx" in candidates and (candidates["amx"](3) is not None) == _cpu_has_amx()


needs_amx = pytest.mark.skipif(not _cpu_has_amx(), reason="this CPU has no AMX (the kernel is not offered)")


@needs_amx
@pytest.mark.parametrize("m", [1, 5, 16, 17, 31, 32, 33, 40, 64, 70])
@pytest.mark.parametrize("i,o", [(32, 16), (64, 48), (96, 80), (576, 192), (1536, 576)])  # 16-output tails
def test_matches_fp64_product(m, i, o):
    """x is split exactly into three bf16 parts whose products with a bf16 weight are exact: the only
    error is fp32 summation. Each output is one running sum over 3·I/2 pair products (the vector
    kernel keeps 32 shorter ones), whose rounding errors grow like the square root of its length:
    held to 2·sqrt(1.5·I) roundings of the sum of |terms| (seen: up to 18 at I = 1536, with one
    term 10⁴ times the others; ~1 without)."""
    g = torch.Generator().manual_seed(m * 1000 + i + o)
    x, w = torch.randn(m, i, generator=g), torch.randn(o, i, generator=g).bfloat16()
    x[0, :5] = torch.tensor([1e-3, -3e4, 1 + 2 ** -20, 0.0, -(2 ** -30)])  # small, large, every bit set
    ref = x.double() @ w.double().T
    assert amx.applies(x, w)
    y = amx.gemm(x, w)
    assert y.shape == (m, o) and y.dtype == torch.float32
    roundings = 2 * (1.5 * i) ** 0.5
    assert ((y.double() - ref).abs() <= roundings * 2 ** -24 * (x.double().abs() @ w.double().abs().T)).all()


@needs_amx
def test_not_a_bf16_rounding_of_x():
    """Rounding x to bf16 (what a bf16 x bf16 product does) would be ~1000x further off: the parts
    keep all of x's significand."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 256, generator=g), torch.randn(64, 256, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    coarse = (x.bfloat16().double() @ w.double().T - ref).abs().max()
    assert (amx.gemm(x, w).double() - ref).abs().max() < coarse / 300


@needs_amx
def test_thread_count_does_not_change_the_result():
    assert same_on_one_and_two_threads(amx.gemm, 20, torch.bfloat16)  # each output is one thread's


@needs_amx
def test_shapes_it_does_not_take():
    """Inputs not a multiple of 32, outputs not of 16, fp32 weights, autograd: not offered; the C
    function given such a shape anyway computes it with the vector kernel, not a faulting tile load."""
    x = torch.randn(4, 48)
    assert not amx.applies(x, torch.randn(16, 48).bfloat16())
    assert not amx.applies(torch.randn(4, 64), torch.randn(24, 64).bfloat16())
    assert not amx.applies(torch.randn(4, 64), torch.randn(32, 64))
    w = torch.randn(16, 64).bfloat16().requires_grad_()
    assert not amx.applies(torch.randn(4, 64), w)
    odd = torch.randn(16, 48).bfloat16()
    torch.testing.assert_close(amx.gemm(x, odd), gemv.gemv(x, odd), rtol=0, atol=0)
