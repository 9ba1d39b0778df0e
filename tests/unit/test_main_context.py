"""The main attention context (``MainAttention``): the drafts' one seam to the main packed row.

Oracles:
  * the base context's ``causal``/``branch`` equal an explicitly masked dense attention written
    here (and, merged with the local part, ``dense_branch_reference``);
  * with the base context, each draft's loss and every parameter gradient equal an independent
    computation: EAGLE-3's naive per-sequence TTT loss (test_eagle3), and for DFlash/DSpark the
    loss formulas of their docstrings over the dense-masked block forward (test_dflash_dspark);
  * a context whose rows are a permutation of the packed row plus padding rows (features given
    in that order, padding rows filled with noise) gives the same loss, metrics and gradients:
    the drafts' global/local index bookkeeping;
  * two simulated ranks (threads, an in-process exchange standing in for the collectives) holding
    complementary row subsets each report the single-process loss and metrics, their gradients sum
    to the single-process gradient, and both make the same sequence of collective calls, also when
    one rank holds nothing but padding rows (no branch, no teacher row).
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_dflash_dspark as blk
import test_eagle3 as e3
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from codraft.attention import (
    MainAttention,
    branch_local_part,
    dense_branch_reference,
    merge_lse,
)
from codraft.attention.dense import positions_from_cu_seqlens
from codraft.drafts.batch import DraftBatch


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- an explicitly masked attention over the global row (the oracle the test contexts use) --------


def _seq_of(cu: torch.Tensor, t: int) -> torch.Tensor:
    """(T,) sequence of every packed position; the padding tail gets its own id."""
    bounds = cu.tolist()
    return torch.tensor([sum(int(p >= e) for e in bounds[1:]) for p in range(t)])


def _attend(q, k, v, allowed):
    """q (B,H,M,D) over k/v (B,Hkv,T,D) with allowed (M,T) -> O (B,H,M,D), LSE (B,H,M); empty rows: 0, -inf."""
    h, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    dt = torch.promote_types(q.dtype, torch.float32)
    k = k.to(dt).repeat_interleave(h // hkv, 1)
    v = v.to(dt).repeat_interleave(h // hkv, 1)
    scores = q.to(dt) @ k.transpose(-1, -2) / math.sqrt(d)  # (B,H,M,T)
    some = allowed.any(-1)[:, None]  # (M,1)
    scores = torch.where(allowed, scores, float("-inf"))
    scores = torch.where(some, scores, torch.zeros_like(scores))  # empty rows: no -inf - -inf
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse[..., None]) * some
    return p @ v, torch.where(some[:, 0], lse, float("-inf"))


def _main_mask(query_pos, cu, t, *, include_anchor):
    """(M,T): may a query at global position query_pos[m] (-1: a padding row) see main key s."""
    seq = _seq_of(cu, t)
    s = torch.arange(t)
    qp = query_pos[:, None]
    before = s <= qp if include_anchor else s < qp
    return (qp >= 0) & before & (seq[qp.clamp_min(0)] == seq) & (s < cu[-1])


# ---- (1) the base context ------------------------------------------------------------------------


def test_base_context_against_dense_oracles():
    g = torch.Generator().manual_seed(0)
    cu, t = torch.tensor([0, 5, 6, 13]), 16  # three sequences (one of length 1) and a padding tail
    main = MainAttention(cu, t)
    assert main.num_ranks == 1 and torch.equal(main.rows, torch.arange(t)) and main.length == t
    idx = torch.randint(0, t, (3, 4), generator=g)
    assert torch.equal(main.local_index(idx), idx)
    assert torch.equal(main.positions(), positions_from_cu_seqlens(cu, t))
    x = torch.randn(3, requires_grad=True)
    assert main.total(x) is x
    b, h, hkv, d = 2, 4, 2, 8
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64) for _ in range(2))
    o, lse = main.causal(q, k, v)
    o_ref, lse_ref = _attend(q, k, v, _main_mask(torch.arange(t), cu, t, include_anchor=True))
    assert_close(o, o_ref)
    assert_close(lse, lse_ref)
    # branch: main part merged with the local block part equals the dense reference
    anchors = torch.tensor([0, 3, 5, 9, 12, 14])  # a sequence start, mid, a length-1 sequence, padding tail
    qb = torch.randn(b, h, 6, 3, d, generator=g, dtype=torch.float64)
    kb, vb = (torch.randn(b, hkv, 6, 3, d, generator=g, dtype=torch.float64) for _ in range(2))
    for include in (False, True):
        om, lm = main.branch(qb, k, v, anchors, include_anchor=include)
        mask = _main_mask(anchors.repeat_interleave(3), cu, t, include_anchor=include)
        om_ref, lm_ref = _attend(qb.reshape(b, h, 18, d), k, v, mask)
        assert_close(om, om_ref.reshape(om.shape))
        assert_close(lm, lm_ref.reshape(lm.shape))
        o, lse = merge_lse(om, lm, *branch_local_part(qb, kb, vb, local="block"))
        o_d, lse_d = dense_branch_reference(qb, kb, vb, k, v, anchors, local="block", include_anchor=include,
                                            cu_seqlens=cu)
        assert_close(o, o_d)
        assert_close(lse, lse_d)
    # a rank without branches: empty outputs, no error
    om, lm = main.branch(qb[:, :, :0], k, v, anchors[:0], include_anchor=False)
    assert om.shape == (b, h, 0, 3, d) and lm.shape == (b, h, 0, 3)


def test_draft_batch_checks_the_local_rows():
    target, d = e3._setup(ttt_steps=2)
    batch = e3._packed_batch(target, d)
    t = batch.input_ids.shape[1]
    rows = torch.cat([torch.arange(t), torch.tensor([-1, -1])])
    main = _Shuffled(batch.cu_seqlens, t, rows)
    with pytest.raises(ValueError, match="features"):  # global features with a context of T + 2 rows
        DraftBatch(batch.input_ids, batch.cu_seqlens, batch.loss_mask, batch.features, batch.teacher_logits,
                   batch.teacher_rows, main)
    with pytest.raises(ValueError, match="main describes"):
        DraftBatch(batch.input_ids, batch.cu_seqlens, batch.loss_mask, batch.features, batch.teacher_logits,
                   batch.teacher_rows, _Shuffled(batch.cu_seqlens, t + 1, rows))
    ok = _local_batch(batch, main, torch.Generator().manual_seed(0))
    assert ok.context is main and batch.context.length == t and batch.main is None


def test_eagle3_base_context_matches_the_naive_oracle():
    target, d = e3._setup(ttt_steps=3)
    batch = e3._packed_batch(target, d, lens=(8, 1, 10, 5))
    ref = e3._naive_loss(d, batch)
    g_ref = torch.autograd.grad(ref, list(d.parameters()))
    explicit = DraftBatch(batch.input_ids, batch.cu_seqlens, batch.loss_mask, batch.features, batch.teacher_logits,
                          batch.teacher_rows, MainAttention(batch.cu_seqlens, batch.input_ids.shape[1]))
    for b in (batch, explicit):
        loss, _ = d.loss(b)
        assert_close(loss, ref, rtol=1e-10, atol=1e-10)
        for (name, _), a, r in zip(d.named_parameters(), torch.autograd.grad(loss, list(d.parameters())), g_ref):
            assert_close(a, r, rtol=1e-8, atol=1e-10, msg=name)


def _block_ref_loss(kind, draft, batch, blocks):
    """DFlash / DSpark loss from the docstring formulas over the dense-masked block forward."""
    c, s = draft.config, draft.config.block_size
    h = blk._naive_block_hidden(draft, batch, blocks.anchors, s)  # (N,S,H)
    _, head = draft._bound()
    ids, lm, t = batch.input_ids[0], batch.loss_mask[0], batch.input_ids.shape[1]
    k = torch.arange(s)
    u = (h @ head.T).float()  # (N,S,V) base logits
    if kind == "dflash":
        pos = blocks.anchors[:, None] + k  # slot k predicts x_{a+k}
        m = ((pos < blocks.seq_end[:, None]) & lm[pos.clamp(max=t - 1)] & (k >= 1)).float()
        ce = -u.log_softmax(-1).gather(-1, ids[pos.clamp(max=t - 1)][..., None])[..., 0]
        w = torch.where(k >= 1, torch.exp(-(k - 1) / c.loss_decay), torch.zeros(()))
        return (w * m * ce).sum() / (w * m).sum()
    src = (blocks.anchors[:, None] + k).clamp(max=t - 1)  # slot k: previous token / teacher row a+k
    lab = (blocks.anchors[:, None] + k + 1).clamp(max=t - 1)
    m = ((blocks.anchors[:, None] + k + 1 < blocks.seq_end[:, None]) & lm[lab]).float()
    mh = draft.markov_head
    e = mh.w1.weight[ids[src]]  # (N,S,r)
    z = u + (e @ mh.w2.weight.T).float()  # vanilla Markov head
    logp = z.log_softmax(-1)
    ce = -logp.gather(-1, ids[lab][..., None])[..., 0]
    l1 = (logp.exp() - batch.teacher_at(src).float().softmax(-1)).abs().sum(-1)
    c_star = (1 - l1 / 2).clamp(0, 1).detach()
    conf = (torch.cat([h, e], -1) @ draft.confidence_head.weight[0] + draft.confidence_head.bias[0]).float()
    bce = F.binary_cross_entropy_with_logits(conf, c_star, reduction="none")
    w = torch.exp(-k / c.loss_decay)
    den = (w * m).sum()
    return sum(cw * (w * m * x).sum() / den for cw, x in ((draft.ce_weight, ce), (draft.tv_weight, l1),
                                                          (draft.conf_weight, bce)))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_loss_base_context_matches_the_dense_oracle(kind):
    target = blk._target(blk._cfg())
    draft = blk._draft(kind, target, num_layers=2, block_size=5, num_anchors=6)
    batch = blk._batch(target)
    blocks = draft.sample_anchors(batch, label_offset=1, generator=torch.Generator().manual_seed(0))
    assert blocks.anchors.shape[0] == 16  # 6 + 6 + the 4 valid anchors of the short sequence
    ref = _block_ref_loss(kind, draft, batch, blocks)
    loss, metrics = draft.loss(batch, generator=torch.Generator().manual_seed(0))
    assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    assert metrics["num_blocks"] == 16
    g = torch.autograd.grad(loss, list(draft.parameters()))
    g_ref = torch.autograd.grad(ref, list(draft.parameters()))
    for (name, _), a, r in zip(draft.named_parameters(), g, g_ref):
        assert_close(a, r, rtol=1e-4, atol=2e-6, msg=name)


# ---- (2) contexts whose rows are not the packed row ---------------------------------------------


class _Shuffled(MainAttention):
    """All (or some) global rows in a given order, with padding rows (-1). ``causal``/``branch``
    put every rank's local K/V back in global order and attend with the explicit mask above;
    ``exchange`` (rank, tag, payload) -> every rank's payload is the collective (one rank: itself)."""

    def __init__(self, cu, total, rows, exchange=None, rank=0, ranks=1):
        super().__init__(cu, total)
        self.rows, self.rank, self.ranks = rows, rank, ranks
        self.exchange = exchange or (lambda rank, tag, payload: [payload])

    @property
    def num_ranks(self):
        return self.ranks

    def local_index(self, g):
        table = torch.full((self.length,), -1, dtype=torch.long)
        real = (self.rows >= 0).nonzero()[:, 0]
        table[self.rows[real]] = real
        return table[g]

    def positions(self):
        pos = positions_from_cu_seqlens(self.cu_seqlens, self.length)[self.rows.clamp_min(0)]
        return torch.where(self.rows >= 0, pos, 1000)  # padding rows: any finite value

    def _global_kv(self, tag, k, v):
        """Every rank's (rows, k, v) scattered into (B,Hkv,T,D), differentiable in each rank's k/v."""
        b, hkv, _, d = k.shape
        kg = k.new_zeros(b, hkv, self.length, d)
        vg = v.new_zeros(b, hkv, self.length, d)
        for rows, kr, vr in self.exchange(self.rank, tag, (self.rows, k, v)):
            real = (rows >= 0).nonzero()[:, 0]
            kg = kg.index_copy(2, rows[real], kr[:, :, real])
            vg = vg.index_copy(2, rows[real], vr[:, :, real])
        return kg, vg

    def causal(self, q, k, v):
        kg, vg = self._global_kv("causal", k, v)
        return _attend(q, kg, vg, _main_mask(self.rows, self.cu_seqlens, self.length, include_anchor=True))

    def branch(self, q, k, v, anchors, *, include_anchor):
        kg, vg = self._global_kv("branch", k, v)
        b, h, n, gq, d = q.shape
        a = self.rows[anchors]
        assert (a >= 0).all(), "a branch anchored at a padding row"
        mask = _main_mask(a.repeat_interleave(gq), self.cu_seqlens, self.length, include_anchor=include_anchor)
        o, lse = _attend(q.reshape(b, h, n * gq, d), kg, vg, mask)
        return o.reshape(b, h, n, gq, d), lse.reshape(b, h, n, gq)

    def total(self, x):
        parts = self.exchange(self.rank, "total", x)
        return x + sum(p.detach() for r, p in enumerate(parts) if r != self.rank)


def _local_batch(batch: DraftBatch, main: _Shuffled, g: torch.Generator) -> DraftBatch:
    """The batch as a rank holding ``main.rows`` sees it: local features (noise on padding rows)."""
    rows = main.rows
    feats = {}
    for l, f in batch.features.items():
        noise = torch.randn(1, rows.shape[0], f.shape[-1], generator=g, dtype=f.dtype)
        feats[l] = torch.where((rows >= 0)[None, :, None], f[:, rows.clamp_min(0)], noise)
    return DraftBatch(batch.input_ids, batch.cu_seqlens, batch.loss_mask, feats, batch.teacher_logits,
                      batch.teacher_rows, main)


def _with_padding(rows: torch.Tensor, pads: int, g: torch.Generator) -> torch.Tensor:
    rows = torch.cat([rows, torch.full((pads,), -1)])
    return rows[torch.randperm(rows.shape[0], generator=g)]


def _setup(kind):
    """(draft, global batch, loss function of a batch) for each kind, small enough for loops."""
    if kind == "eagle3":
        target, d = e3._setup(ttt_steps=3)
        return d, e3._packed_batch(target, d, lens=(8, 1, 10, 5)), d.loss
    target = blk._target(blk._cfg())
    d = blk._draft(kind, target, num_layers=2, block_size=4, num_anchors=5)
    d.config.loss_chunk_blocks = 4  # checkpointed chunks too
    return d, blk._batch(target), lambda b: d.loss(b, generator=torch.Generator().manual_seed(0))


def _tol(kind):
    return {"rtol": 1e-9, "atol": 1e-11} if kind == "eagle3" else {"rtol": 1e-5, "atol": 1e-6}


def _grad_tol(kind):
    return _tol(kind) if kind == "eagle3" else {"rtol": 1e-4, "atol": 2e-6}


def _check_metrics(got, want, kind):
    assert set(got) == set(want)
    for k in want:
        assert_close(got[k].double(), want[k].double(), msg=k, **_tol(kind))


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_permuted_rows_with_padding_give_the_same_loss(kind):
    d, batch, loss_fn = _setup(kind)
    t = batch.input_ids.shape[1]
    g = torch.Generator().manual_seed(1)
    main = _Shuffled(batch.cu_seqlens, t, _with_padding(torch.arange(t), 4, g))
    assert not torch.equal(main.rows[main.rows >= 0], torch.arange(t))
    ref, ref_m = loss_fn(batch)
    loss, metrics = loss_fn(_local_batch(batch, main, g))
    assert_close(loss, ref, **_tol(kind))
    _check_metrics(metrics, ref_m, kind)
    params = list(d.parameters())
    for (name, _), a, r in zip(d.named_parameters(), torch.autograd.grad(loss, params),
                               torch.autograd.grad(ref, params)):
        assert_close(a, r, msg=name, **_grad_tol(kind))


# ---- (3) two simulated ranks ---------------------------------------------------------------------


class _Exchange:
    """All-gather between threads; records each rank's sequence of collective calls."""

    def __init__(self, n):
        self.barrier = threading.Barrier(n, timeout=60)
        self.box = [None] * n
        self.calls = [[] for _ in range(n)]

    def __call__(self, rank, tag, payload):
        self.calls[rank].append(tag)
        self.box[rank] = (tag, payload)
        self.barrier.wait()
        got = list(self.box)
        self.barrier.wait()
        if any(tg != tag for tg, _ in got):
            self.barrier.abort()
            raise AssertionError(f"ranks disagree on the collective: {[tg for tg, _ in got]}")
        return [p for _, p in got]


@pytest.mark.parametrize("split", ["random", "all_on_one"])
@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_two_ranks_report_the_global_loss_and_share_the_gradient(kind, split):
    d, batch, loss_fn = _setup(kind)
    t = batch.input_ids.shape[1]
    g = torch.Generator().manual_seed(2)
    perm = torch.randperm(t, generator=g)
    halves = (perm[: t // 2], perm[t // 2:]) if split == "random" else (perm, perm[:0])
    ex = _Exchange(2)
    mains = [_Shuffled(batch.cu_seqlens, t, _with_padding(h, 3, g), ex, r, 2) for r, h in enumerate(halves)]
    batches = [_local_batch(batch, m, g) for m in mains]

    def run(rank):
        try:
            return loss_fn(batches[rank])
        except BaseException:
            ex.barrier.abort()
            raise

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run, r) for r in range(2)]
    errors = [f.exception() for f in futures]
    first = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if first or any(errors):
        raise (first or [e for e in errors if e is not None])[0]
    (l0, m0), (l1, m1) = (f.result() for f in futures)
    ref, ref_m = loss_fn(batch)
    assert torch.equal(l0.detach(), l1.detach())
    assert_close(l0, ref, **_tol(kind))
    _check_metrics(m0, ref_m, kind)
    _check_metrics(m1, ref_m, kind)
    # the collective calls, the same on both ranks (also the one holding only padding rows)
    steps = d.ttt_steps if kind == "eagle3" else len(d.layers)
    assert ex.calls[0] == ex.calls[1] == [("causal" if kind == "eagle3" else "branch")] * steps + ["total"]
    params = list(d.parameters())
    got = torch.autograd.grad(l0 + l1, params)  # each rank's backward, summed (the CP gradient all-reduce)
    for (name, _), a, r in zip(d.named_parameters(), got, torch.autograd.grad(ref, params)):
        assert_close(a, r, msg=name, **_grad_tol(kind))

