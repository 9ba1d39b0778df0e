"""Decode weights moved into one buffer of 2 MB pages (codraft.kernels.hugepages); the rollout copy's
placement is in test_rollout_weights.py. Oracle for the pages: the kernel's own account, /proc/self/smaps."""
import ctypes
import mmap
import sys
from pathlib import Path

import pytest
import torch

from codraft.kernels import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The bracketed mode of transparent huge pages here, or "" where there are none."""
    try:
        text = THP.read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text else ""


def test_rehome_keeps_values_and_parameters_and_shares_one_aligned_buffer():
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 577, generator=g)),
              torch.nn.Parameter(torch.randn(64, 33, generator=g).bfloat16(), requires_grad=False),
              torch.nn.Parameter(torch.randn(5, generator=g))]
    before = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    hugepages.rehome(params)
    assert [id(p) for p in params] == ids  # the same Parameter objects: optimisers keep them
    for p, b in zip(params, before):
        assert p.dtype == b.dtype and p.shape == b.shape and torch.equal(p.detach(), b) and p.is_contiguous()
        assert p.data_ptr() % hugepages.ALIGN == 0
    assert [p.requires_grad for p in params] == [True, False, True]
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    with torch.no_grad():
        params[0].add_(1)  # in place, as an optimiser step or a refresh writes
    assert torch.equal(params[0].detach(), before[0] + 1) and torch.equal(params[1].detach(), before[1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off or absent here")
def test_rehome_gets_huge_pages_where_the_kernel_offers_them():
    ws = [torch.randn(1536, 576) for _ in range(8)]  # 28 MB
    assert hugepages.rehome(ws) is True
    buf = ws[0].untyped_storage()
    assert hugepages.huge_bytes(buf.data_ptr(), buf.nbytes()) >= 2 << 20
    if thp_mode() == "madvise":  # the control: a fresh mapping of the same size, written but not advised
        assert unadvised_huge_bytes(buf.nbytes()) == 0


def unadvised_huge_bytes(nbytes: int) -> int:
    """Huge-page bytes of a private anonymous mapping of its own, every page written, never advised. (Not a
    tensor: the allocator may serve one from heap addresses an earlier rehome advised and freed, which
    keep the advice; smaps then counts that heap's huge pages.)"""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.write(b"\1" * nbytes)
        start = ctypes.c_char.from_buffer(region)
        try:
            return hugepages.huge_bytes(ctypes.addressof(start), nbytes)
        finally:
            del start  # (an exported buffer keeps the mapping from closing)
    finally:
        region.close()


def test_rehome_refuses_other_devices_and_takes_nothing():
    assert hugepages.rehome([]) is False
    with pytest.raises(ValueError, match="CPU"):
        hugepages.rehome([torch.empty(2, 2, device="meta")])

