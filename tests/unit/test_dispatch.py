"""The measured choice of CPU fast paths (codraft.kernels.dispatch): every path it chooses between
against an fp64 reference (products with fp32 and bf16 weights; the one-call and the per-op decoder
layer), how a table is built from timings (made-up ones: no test depends on this machine's clock),
cached, reused and rebuilt, and that the fast layers take the path the table names."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F

from codraft import kernels
from codraft.kernels import cbuild, decode_ops, dispatch, fast_layers, gemv, panels, products
from codraft.models import KVCache, ModelConfig, Transformer
from codraft.models.transformer import DecoderLayer

U = 2.0 ** -24  # fp32 unit roundoff


@pytest.fixture
def fresh_tables(monkeypatch, tmp_path):
    """An empty disk cache and no tables in this process (the GEMV kernel's tuning, set from the real
    cache: it is read once per process)."""
    gemv.kernel()
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(dispatch, "TABLES", {})
    return tmp_path / "dispatch"


@pytest.fixture
def made_up_times(monkeypatch, fresh_tables):
    """Tables measured with made-up times: ``use(times)`` with ``times(name, rows) -> seconds``;
    returns the list of measurements made (the names of the candidates that apply at 1 row). The
    candidates are built (and checked to apply) but not run."""
    made = []

    def use(times):
        real = dispatch.measure

        def measure(candidates, grid=dispatch.GRID, timer=None):
            made.append(sorted(name for name, at in candidates.items() if at(1) is not None))
            return real(candidates, grid, lambda name, rows, run: times(name, rows))
        monkeypatch.setattr(dispatch, "measure", measure)
        return made
    return use


def _fixed(name, rows):
    return {"kernel": 1.0, "panels": 1.2, "linear": 2.0, "transposed": 3.0, "amx": 4.0, "fused": 1.0,
            "fused-panels": 1.5, "fused-amx": 3.0, "unfused": 2.0}[name]


# ---- every path against fp64 -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("o,i", [(1, 1), (7, 33), (64, 48), (33, 576), (130, 17)])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 40, 129])
def test_every_product_path_matches_fp64(dtype, o, i, m):
    """Each path, and ``products.linear`` for any row count (above the grid too), against fp64 of the
    same values (a bf16 weight widens exactly): within (i + 1)·u·Σ|x·w|, the worst-case error of fp32
    products summed in any order."""
    g = torch.Generator().manual_seed(m * 7 + o * 3 + i)
    x, w = torch.randn(m, i, generator=g), torch.randn(o, i, generator=g).to(dtype)
    ref = x.double() @ w.double().T
    bound = (i + 1) * U * (x.double().abs() @ w.double().abs().T)
    with torch.no_grad():
        assert gemv.applies(x, w)
        for name, path in [*products.PATHS.items(), ("chosen", products.linear)]:
            if name in products.APPLIES and not products.APPLIES[name](x, w):
                continue  # (AMX: bf16 weights of some shapes, on CPUs that have it; its own tests in test_amx)
            y = path(x, w)
            assert y.shape == (m, o) and y.dtype == torch.float32, name
            assert ((y.double() - ref).abs() <= bound).all(), name


def _layer_and_cache(dtype, b, t, seed):
    cfg = ModelConfig(vocab_size=50, hidden_size=40, intermediate_size=72, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)  # head size 10: vector tails
    torch.manual_seed(seed)
    model = kernels.enable(Transformer(cfg).eval())
    with torch.no_grad():
        for p in model.layers[0].parameters():
            p.copy_(torch.randn_like(p) * 0.3 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
            if p.dim() == 2:
                p.data = p.data.to(dtype)  # weight-only: norms stay fp32
    lengths = torch.randint(0, 20, (b,), generator=torch.Generator().manual_seed(seed))
    cache = KVCache(num_layers=1, batch=b, max_len=20 + t, num_kv_heads=2, head_dim=10, dtype=torch.float32,
                    device="cpu")
    cache.k.normal_(generator=torch.Generator().manual_seed(seed + 1))
    cache.v.normal_(generator=torch.Generator().manual_seed(seed + 2))
    cache.set_lengths(lengths, span=int(lengths.max()))
    return model, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,t", [(1, 1), (3, 1), (2, 5), (1, 24), (40, 1)])
def test_both_layer_paths_match_fp64(dtype, b, t):
    """The one-call layer and the per-op fast layer against the reference layer in fp64 (bf16 weights
    widened exactly), output and written cache: within a few fp32 roundings of outputs ~10."""
    model, cache = _layer_and_cache(dtype, b, t, seed=b * 10 + t)
    layer = model.layers[0]
    ref_layer = copy.deepcopy(layer).double()
    for m in ref_layer.modules():  # the reference classes: torch's ops throughout
        m.__class__ = next((ref for ref, fast in kernels.SWAPS.items() if fast is type(m)), type(m))
    x = torch.randn(b, t, 40, generator=torch.Generator().manual_seed(3))
    ref_cache = copy.deepcopy(cache)
    ref_cache.k, ref_cache.v = ref_cache.k.double(), ref_cache.v.double()
    with torch.no_grad():
        ctx = model.layer_inputs(b, t, "cpu", cache=ref_cache)
        want = ref_layer(x.double(), ctx.cos.double(), ctx.sin.double(), ctx.attn,
                         None if ctx.mask is None else ctx.mask.double(), ref_cache, 0, ctx.positions, ctx.span)
        assert want.abs().max() > 5
        assert decode_ops.layer_applies(layer, x, cache.k)
        for name in ("fused", "unfused"):
            c = copy.deepcopy(cache)
            if name == "fused":
                y, _ = decode_ops.decoder_stack(model, 0, [layer], x, ctx.cos, ctx.sin, c)
            else:
                y = DecoderLayer.forward(layer, x, ctx.cos, ctx.sin, ctx.attn, ctx.mask, c, 0, ctx.positions, ctx.span)
            torch.testing.assert_close(y, want.float(), rtol=1e-5, atol=1e-4, msg=name)
            torch.testing.assert_close(c.k, ref_cache.k.float(), rtol=1e-5, atol=1e-5, msg=name)


# ---- building a table from timings ---------------------------------------------------------------


def test_ranges_take_the_fastest_and_the_nearer_grid_point():
    times = {1: {"a": 1, "b": 2}, 2: {"a": 1, "b": 2}, 4: {"a": 3, "b": 2}, 8: {"a": 3, "b": 2},
             12: {"a": 1, "b": 2, "c": 0.5}}
    # 3 lies between 2 (a) and 4 (b): a tie, the lower point's; 10 between 8 (b) and 12 (c): a tie too
    assert dispatch.ranges(times) == ((1, 3, "a"), (4, 10, "b"), (11, 12, "c"))


def test_measure_keeps_the_best_sample_interleaves_and_skips_what_does_not_apply():
    """Spikes (a busy moment) do not decide: the best of the rounds does (the first call of each is a
    warm-up, not counted); each round sweeps the grid, candidates in an order that rotates, 7 rounds
    of µs calls; one that does not apply at a row count is not timed there."""
    cost = {"a": lambda rows: 1e-6 * rows, "b": lambda rows: 1e-6 * (0.5 + 0.625 * rows),
            "slow": lambda rows: 9e-6 * rows}
    calls = []
    spikes = iter([50e-6] * 6)  # the warm-up calls and the first round at 1 row are slow

    def timer(name, rows, run):
        calls.append((name, rows))
        return next(spikes, None) or cost[name](rows)

    def up_to(most):  # a candidate that applies up to ``most`` rows; its calls do nothing
        return lambda rows: (lambda: None) if rows <= most else None
    times = dispatch.measure({"a": up_to(4), "b": up_to(4), "slow": up_to(2)}, grid=(1, 2, 4), timer=timer)
    assert times == {m: {n: f(m) for n, f in cost.items() if n != "slow" or m <= 2} for m in (1, 2, 4)}
    assert dispatch.ranges(times) == ((1, 1, "a"), (2, 4, "b"))
    assert calls[:3] == [("a", 1), ("b", 1), ("slow", 1)]  # the warm-up
    rounds = [calls[3 + 8 * r:3 + 8 * (r + 1)] for r in range(7)]
    assert len(calls) == 3 + 8 * 7
    for r, sweep in enumerate(rounds):
        assert [rows for _, rows in sweep] == [1, 1, 1, 2, 2, 2, 4, 4]
        three, two = ["a", "b", "slow"], ["a", "b"]
        assert [n for n, _ in sweep] == 2 * (three[r % 3:] + three[:r % 3]) + two[r % 2:] + two[:r % 2]


def test_measure_spends_fewer_rounds_on_long_calls():
    """Rounds of 10-100 ms: best of 3; over 100 ms: of 2; and a candidate 2× the best after two rounds of
    ms calls gets no more."""
    calls = []
    times = dispatch.measure({"a": lambda rows: lambda: None, "b": lambda rows: lambda: None}, grid=(8,),
                             timer=lambda name, rows, run: calls.append(name) or {"a": 0.03, "b": 0.05}[name])
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b"] and times == {8: {"a": 0.03, "b": 0.05}}
    calls = []
    times = dispatch.measure({"a": lambda rows: lambda: None, "b": lambda rows: lambda: None}, grid=(8,),
                             timer=lambda name, rows, run: calls.append(name) or {"a": 0.06, "b": 0.15}[name])
    assert calls == ["a", "b", "a", "b", "b", "a"] and times == {8: {"a": 0.06, "b": 0.15}}  # 2 rounds
    calls = []
    times = dispatch.measure({name: lambda rows: lambda: None for name in "abc"}, grid=(8,),
                             timer=lambda name, rows, run: calls.append(name) or {"a": 0.005, "b": 0.0075,
                                                                                   "c": 0.0125}[name])
    # rounds of 25 ms: 3; "c" (2.5× after the first two) gets no third, "b" (1.5×) does
    assert calls == ["a", "b", "c"] + ["a", "b", "c"] + ["b", "c", "a"] + ["a", "b"]
    assert times[8] == {"a": 0.005, "b": 0.0075, "c": 0.0125}


def test_one_slow_sample_does_not_drop_the_fastest_candidate():
    """A single slow call of the fastest candidate (page faults on its operands' first touch, a
    preemption: seen at 10× a fused layer's time, which then lost to the per-op path at 1 row) is
    outvoted by its next samples: no candidate is dropped on one sample."""
    slow_once = iter([0.02])  # fused's first counted call

    def timer(name, rows, run):
        if name == "fused" and rows == 1 and timer.warm:
            return next(slow_once, 0.001)
        timer.warm = timer.warm or name == "unfused"  # after the warm-up calls
        return {"fused": 0.001, "unfused": 0.003}[name]
    timer.warm = False
    times = dispatch.measure({"fused": lambda rows: lambda: None, "unfused": lambda rows: lambda: None},
                             grid=(1,), timer=timer)
    assert times == {1: {"fused": 0.001, "unfused": 0.003}}
    assert dispatch.ranges(times) == ((1, 1, "fused"),)


def test_linear_takes_the_chosen_path_per_row_count(made_up_times, monkeypatch):
    """With times in which the kernel wins up to 5 rows and (w @ xᵀ)ᵀ from 6, ``products.linear``
    calls exactly those, and above the grid (w @ xᵀ)ᵀ too, the fastest at its top (torch's products
    scale to a prefill's rows); for bf16 weights as for fp32."""
    made = made_up_times(lambda name, rows: {"kernel": 1.0 if rows <= 5 else 3.0, "panels": 2.5, "linear": 2.0,
                                             "transposed": 1.5}[name])
    calls = []
    for name, fn in list(products.PATHS.items()):
        monkeypatch.setitem(products.PATHS, name, lambda x, w, _n=name, _f=fn: calls.append(_n) or _f(x, w))
    beyond = products.torch_linear
    monkeypatch.setattr(products, "torch_linear", lambda x, w: calls.append("beyond") or beyond(x, w))
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(24, 16).to(dtype)
            for m in (1, 5, 6, 7, 128, 129, 300):
                assert products.linear(torch.randn(1, m, 16), w).shape == (1, m, 24)
            assert products.table(w).ranges == ((1, 5, "kernel"), (6, 128, "transposed"))
    assert calls == ["kernel", "kernel", "transposed", "transposed", "transposed", "transposed", "transposed"] * 2
    # one table per dtype; packed copies of bf16 weights only
    assert made == [["kernel", "linear", "transposed"], ["kernel", "linear", "panels", "transposed"]]


def test_above_the_grid_the_top_choice_only_if_it_scales():
    """Above the grid a path that was fastest at its top is kept only if it scales to more rows (torch's
    products, AMX tiles); the vector kernel (passes over the weights per 4 rows) gives way to the
    operation's ``beyond``."""
    top = dispatch.GRID[-1]
    for last, beyond in [("transposed", "transposed"), ("amx", "amx"), ("kernel", "linear")]:
        table = dispatch._table(((1, 8, "kernel"), (9, top, last)), {}, products.PRODUCT)
        assert table.by_rows[0] == beyond and table.by_rows[top] == last and table.by_rows[1] == "kernel"
    from codraft.kernels.fast_layers import LAYER
    assert dispatch._table(((1, top, "fused-amx"),), {}, LAYER).by_rows[0] == "unfused"


def test_autograd_and_other_dtypes_keep_f_linear(made_up_times):
    made = made_up_times(_fixed)
    w = torch.randn(24, 16, requires_grad=True)
    x = torch.randn(3, 16)
    y = products.linear(x, w)  # autograd on: F.linear, differentiable
    y.sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(24, 16))
    with torch.no_grad():
        torch.testing.assert_close(products.linear(x.double(), w.double()), F.linear(x.double(), w.double()))
    assert made == []  # nothing measured


# ---- the cache ---------------------------------------------------------------------------------------


def test_table_is_reused_and_rebuilt_for_another_cpu_or_thread_count(made_up_times, fresh_tables, monkeypatch):
    made = made_up_times(_fixed)
    w = torch.randn(40, 24)
    n = torch.get_num_threads()

    def lookup():
        with torch.no_grad():
            return products.table(w)
    first = lookup()
    assert len(made) == 1 and lookup() is first  # this process: one dict access
    monkeypatch.setattr(dispatch, "TABLES", {})
    assert lookup() == first and len(made) == 1  # another process: read from disk
    (path,) = fresh_tables.iterdir()
    key = json.loads(path.read_text())["key"]
    assert key["threads"] == n and key["key"] == "40x24 float32" and key["cpu_id"] and key["kernels"] != "off"
    try:
        torch.set_num_threads(n + 1)
        lookup()
        assert len(made) == 2  # another thread count: measured
        torch.set_num_threads(n)
        lookup()
        assert len(made) == 2  # back: the first table
    finally:
        torch.set_num_threads(n)
    real = cbuild._cpu_id
    monkeypatch.setattr(cbuild, "_cpu_id", lambda: real() + "\nflags : avx9000")
    monkeypatch.setattr(dispatch, "TABLES", {})
    lookup()
    assert len(made) == 3  # another CPU: measured
    assert len(list(fresh_tables.iterdir())) == 3  # one file per key, no temporary files left


def test_measuring_a_table_leaves_the_callers_rng_alone(fresh_tables, capfd):
    """A table first needed midway through a run is measured there, on random inputs: the run's RNG must
    not move, so the run samples as one that read the table from the cache (a resumed run, or a child
    forked after the tables were filled, repeats the uninterrupted run bit for bit)."""
    w = torch.randn(24, 16)
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    with torch.no_grad():
        products.table(w)
    assert "timing fast paths for product 24x16" in capfd.readouterr().err  # measured here, not read
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("damage", ["not json", "foreign", "bad ranges"])
def test_unusable_file_is_measured_again(made_up_times, fresh_tables, monkeypatch, damage):
    made = made_up_times(_fixed)
    w = torch.randn(40, 24)
    with torch.no_grad():
        products.table(w)
    (path,) = fresh_tables.iterdir()
    d = json.loads(path.read_text())
    if damage == "foreign":  # e.g. a cache folder copied from another machine under the same name
        d["key"]["cpu"] = "some other CPU"
    elif damage == "bad ranges":
        d["ranges"] = [[1, 7, "kernel"], [9, 128, "linear"]]
    path.write_text("{truncated" if damage == "not json" else json.dumps(d))
    monkeypatch.setattr(dispatch, "TABLES", {})
    with pytest.warns(UserWarning, match="measuring again"), torch.no_grad():
        table = products.table(w)
    assert len(made) == 2 and table.ranges == ((1, 128, "kernel"),)
    assert json.loads(path.read_text())["ranges"] == [[1, 128, "kernel"]]  # rewritten


def test_table_timed_on_a_busy_machine_is_not_kept(made_up_times, fresh_tables, monkeypatch):
    """Other processes holding every core during the measurement (as /proc tells): the table serves
    this process, is not written, and the next process measures again."""
    made = made_up_times(_fixed)
    readings = iter([(0.0, 100.0, 10.0), (1.0, 100.0 + 2.5, 10.0 + 0.5)])  # others: 2 cores for 1 s
    monkeypatch.setattr(dispatch, "_cpu_seconds", lambda: next(readings))
    w = torch.randn(40, 24)
    with pytest.warns(UserWarning, match="2.0 cores busy"), torch.no_grad():
        table = products.table(w)
    assert table.ranges == ((1, 128, "kernel"),) and table.busy == 2.0
    assert not fresh_tables.exists() or not list(fresh_tables.iterdir())
    monkeypatch.setattr(dispatch, "_cpu_seconds", lambda: None)  # quiet (or not Linux): kept
    monkeypatch.setattr(dispatch, "TABLES", {})
    with torch.no_grad():
        assert products.table(w).busy == 0
    assert len(made) == 2 and len(list(fresh_tables.iterdir())) == 1


def test_opt_out_leaves_torch_paths_only(made_up_times, monkeypatch, fresh_kernels):
    monkeypatch.setenv("CODRAFT_KERNELS", "0")
    made = made_up_times(_fixed)  # the kernel would win: but there is none
    with torch.no_grad():
        w = torch.randn(40, 24)
        assert products.table(w).ranges == ((1, 128, "linear"),)
        x = torch.randn(3, 24)
        torch.testing.assert_close(products.linear(x, w), F.linear(x, w))
    assert made == [["linear", "transposed"]]


# ---- the fast layers follow the table ---------------------------------------------------------------


def test_decoder_layer_takes_the_chosen_path(made_up_times, monkeypatch):
    """Made-up times in which the one-call layer wins up to 4 rows: a decode with steps of 1..8 rows
    per forward runs it exactly there."""
    made = made_up_times(lambda name, rows: {"fused": 1.0 if rows <= 4 else 3.0, "fused-panels": 2.5, "unfused": 2.0,
                                             "kernel": 1.0, "panels": 1.5, "linear": 2.0, "transposed": 3.0}[name])
    calls = []
    real = decode_ops.decoder_stack  # one layer, one call for the stack
    monkeypatch.setattr(decode_ops, "decoder_stack",
                        lambda *a, **k: calls.append(a[3].shape[0] * a[3].shape[1]) or real(*a, **k))
    model, _ = _layer_and_cache(torch.float32, 1, 1, seed=0)
    cache = KVCache.for_model(model, 2, 40)
    with torch.inference_mode():
        for t in (1, 2, 3, 4):  # 2, 4, 6, 8 rows
            model(torch.randint(0, 50, (2, t)), cache=cache)
    assert calls == [2, 4]  # one layer
    assert ["fused", "unfused"] in made and fast_layers.layer_table(model.layers[0]).ranges == (
        (1, 4, "fused"), (5, 128, "unfused"))


def test_a_layer_with_qk_norms_has_a_table_of_its_own(made_up_times):
    """A Qwen3-style layer (q/k RMSNorm) and a Llama-style one of the same widths are timed apart: the
    norms are work the other's table never timed."""
    made = made_up_times(_fixed)
    tables = []
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"):
        cfg = ModelConfig(vocab_size=50, hidden_size=40, intermediate_size=72, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, architectures=[arch])
        tables.append(fast_layers.layer_table(kernels.enable(Transformer(cfg).eval()).layers[0]))
    assert len(made) == 2 and tables[0] is tables[2] and tables[1] is not tables[0]


# ---- what a measurement times ------------------------------------------------------------------------


def test_measurements_time_the_paths_not_the_packing(monkeypatch):
    """The panels paths run on copies of a bf16 weight (or layer) packed on first use. A measurement
    cycles through up to 256 copies and packing one costs ~10 products at 1 row, so every sample
    timed the packing and the panels lost where they were fastest (SmolLM2 on the Xeon).
    The copies are packed when a candidate is built, before its first timed call: also those the
    per-op layer's products pack where their own table picks panels (here: always)."""
    packs = []
    real = panels.pack
    monkeypatch.setattr(panels, "pack", lambda w, into: packs.append(w.shape) or real(w, into))
    monkeypatch.setattr(products, "table", lambda w: dispatch.Table((), ("panels",), {}))  # every row count
    model, _ = _layer_and_cache(torch.bfloat16, 1, 1, seed=0)
    model.requires_grad_(False)  # a rollout copy's weights: packed copies follow them
    with torch.inference_mode(False):
        w = torch.randn(64, 48).bfloat16()
    layer = model.layers[0]
    nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    built = {"product": (products._candidates(w), dispatch.copies(w.numel() * 2)),  # (packed: one weight a copy)
             "layer": (fast_layers._layer_candidates(layer), 2 * 7 * dispatch.copies(nbytes))}  # (both layers' 7)
    for op, (candidates, copies) in built.items():
        before = len(packs)
        runs = [run for at in candidates.values() for m in (1, 3) if (run := at(m)) is not None]  # as measure does
        made = len(packs)
        assert made - before == copies, op  # every copy, once
        for run in runs * 2:
            run()
        assert len(packs) == made, f"{op}: a timed call packed {len(packs) - made} copies"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_timing_a_layer_holds_one_ring_of_caches_for_every_row_count(monkeypatch, dtype):
    """``measure`` builds every row count's candidates before its first round and keeps them to the end.
    With a cache per row count (a layer in it per copy of the layer), the tiny preset's layer took 10 GB at
    its first timing, and two CP ranks timing at once ran out of memory. Every timed call, at any row
    count and on any path, must write into one of the ring's slots, whose total is the cold budget that
    ``copies`` sizes (not a multiple of the grid), and consecutive calls into different slots (so the
    keys come from memory)."""
    rings, seen, ring_type = [], [], dispatch.KVRing
    monkeypatch.setattr(dispatch, "KVRing", lambda *a: rings.append(ring_type(*a)) or rings[-1])
    real_stack, real_attention = decode_ops.decoder_stack, decode_ops.cache_attention

    def stack(model, first, layers, x, cos, sin, cache, *a, **k):
        seen.append((x.shape[0], cache.k[first]))
        return real_stack(model, first, layers, x, cos, sin, cache, *a, **k)

    def attention(q, k, v, cos, sin, k_cache, *a):
        seen.append((q.shape[0], k_cache))
        return real_attention(q, k, v, cos, sin, k_cache, *a)
    monkeypatch.setattr(decode_ops, "decoder_stack", stack)
    monkeypatch.setattr(decode_ops, "cache_attention", attention)
    model, _ = _layer_and_cache(dtype, 1, 1, seed=0)
    candidates = fast_layers._layer_candidates(model.layers[0])
    runs = {m: [run for at in candidates.values() if (run := at(m)) is not None] for m in dispatch.GRID}
    (ring,) = rings
    slot_bytes = ring.k[0].nbytes
    cold = min(2 * dispatch._last_level_cache(), dispatch.MAX_COLD_BYTES)
    assert ring.k.nbytes + ring.v.nbytes <= cold + 2 * slot_bytes  # (at most MAX_COPIES slots, at least 2)
    assert len(ring.k) == dispatch.MAX_COPIES or ring.k.nbytes + ring.v.nbytes >= cold
    seen.clear()
    for m in (1, 5, 64, 128):
        for run in runs[m] * 2:
            run()
    k0, end = ring.k.data_ptr(), ring.k.data_ptr() + ring.k.nbytes
    assert len(seen) == 2 * len(runs[1]) + 2 * len(runs[5]) + 2 * len(runs[64]) + 2 * len(runs[128]) > 8
    assert all(k0 <= k.data_ptr() and k.data_ptr() + k.nbytes <= end and k.shape[0] == m for m, k in seen)
    slots = [(k.data_ptr() - k0) // slot_bytes for _, k in seen]
    assert all(a != b for a, b in zip(slots, slots[1:]))
