"""The CPU few-row product kernel (codraft.kernels.gemv), fp32 and bf16 weights, against fp64 torch
products, the fast ``linear`` that routes to it, and how the C kernels (it and
codraft.kernels.decode_ops) are built, cached, and switched off."""
import _ctypes
import copy
import ctypes
import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from codraft.kernels import cbuild, decode_ops, gemv
from codraft.kernels.products import linear


def test_kernel_builds_here():
    # the dev/CI machine has a C compiler: the fast paths must be live, not silently off
    assert gemv.kernel() is not None and decode_ops.kernels() is not None


def panel_product(lib, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ wᵀ through gemv.c's panel layout: w (bf16) packed by pack_panels_bf16, then gemv_panels_bf16."""
    (m, i), o = x.shape, w.shape[0]
    rows = lib.panel_rows()
    packed = torch.full((-(-o // rows) * rows, i), float("nan"), dtype=torch.bfloat16)  # every slot written
    y = torch.empty(m, o)
    lib.pack_panels_bf16(*(ctypes.c_void_p(t.data_ptr()) for t in (w, packed)), ctypes.c_int64(o), ctypes.c_int64(i))
    lib.gemv_panels_bf16(*(ctypes.c_void_p(t.data_ptr()) for t in (x, packed, y)), *map(ctypes.c_int64, (m, i, o)))
    return y


def within_fp32_summation(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """y is x @ wᵀ up to 8 fp32 roundings of the sum of |terms| (the products are exact in fp64)."""
    ref = x.double() @ w.double().T
    return bool(((y.double() - ref).abs() <= 8 * 2 ** -24 * (x.double().abs() @ w.double().abs().T)).all())


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("i,o", [(1, 1), (8, 5), (15, 3), (16, 64), (17, 7), (576, 33), (1000, 9)])
def test_matches_fp64_product(m, i, o):
    g = torch.Generator().manual_seed(m * 1000 + i + o)
    x, w = torch.randn(m, i, generator=g), torch.randn(o, i, generator=g)
    ref = x.double() @ w.double().T
    y = gemv.gemv(x, w)
    assert y.shape == (m, o) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * i ** 0.5)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 17, 33, 64, 70])
@pytest.mark.parametrize("i,o", [(1, 1), (7, 3), (16, 5), (31, 9), (32, 64), (33, 7), (47, 2), (576, 33),
                                 (1000, 9), (1536, 11)])  # sizes around the 8/16-lane blocks, and tails
def test_bf16_matches_fp64_product(m, i, o):
    """bf16 weights are widened exactly and summed in fp32: each product is exact in fp64, so the
    only error is fp32 summation, held to 8 roundings of the sum of |terms| (seen: under 3)."""
    g = torch.Generator().manual_seed(m * 1000 + i + o)
    x, w = torch.randn(m, i, generator=g), torch.randn(o, i, generator=g).bfloat16()
    y = gemv.gemv(x, w)
    assert y.shape == (m, o) and y.dtype == torch.float32 and within_fp32_summation(y, x, w)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 15, 16, 33])
@pytest.mark.parametrize("i,o", [(1, 1), (7, 3), (16, 5), (33, 7), (72, 100), (576, 33), (1000, 9), (1536, 40),
                                 (72, 800)])
def test_bf16_panels_match_fp64_product(m, i, o):
    """The packed layout (bf16 products on panels): every tile shape (tiles of 4 or 8 rows, then the
    last 1-7 rows over groups of 1-4 panels; 800 outputs: threads' chunks of an odd number of panels)
    and a last panel that is only partly outputs."""
    g = torch.Generator().manual_seed(m * 1000 + i + o)
    x, w = torch.randn(m, i, generator=g), torch.randn(o, i, generator=g).bfloat16()
    y = panel_product(decode_ops.kernels(), x, w)
    assert y.shape == (m, o) and within_fp32_summation(y, x, w)


def same_on_one_and_two_threads(product, rows: int, dtype) -> bool:
    """``product`` (x, w) of SmolLM2's 1536x576 shape gives the same bits on 1 and 2 threads."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, 576, generator=g), torch.randn(1536, 576, generator=g).to(dtype)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = product(x, w)
        torch.set_num_threads(2)
        two = product(x, w)
    finally:
        torch.set_num_threads(n)
    return torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_count_does_not_change_the_result(dtype):
    assert same_on_one_and_two_threads(gemv.gemv, 5, dtype)  # each output is one thread's dot product


def test_portable_vector_width(portable_kernels):
    """gemv.c built with 8 lanes (what AVX2 machines get; this one may build 16) agrees too: panels of
    16 outputs."""
    lib = ctypes.CDLL(str(portable_kernels))
    g = torch.Generator().manual_seed(3)
    for m, i, o in [(1, 7, 3), (5, 33, 9), (16, 576, 40), (70, 47, 5)]:
        x, w = torch.randn(m, i, generator=g), torch.randn(o, i, generator=g)
        for weight, fn in [(w, lib.gemv_rows), (w.bfloat16(), lib.gemv_rows_bf16)]:
            y = torch.empty(m, o)
            fn(*(ctypes.c_void_p(t.data_ptr()) for t in (x, weight, y)), *map(ctypes.c_int64, (m, i, o)))
            assert within_fp32_summation(y, x, weight)
        assert lib.panel_rows() == 16 and within_fp32_summation(panel_product(lib, x, w.bfloat16()), x, w.bfloat16())


@pytest.mark.parametrize("mode", gemv.PREFETCH_MODES)
@pytest.mark.parametrize("pair_rows", [1, 3, gemv.NEVER])
def test_every_tuning_gives_the_product(mode, pair_rows):
    """The prefetch mode and the weight-row pairing (chosen per machine and weight dtype) change how
    weights stream, not the sums: row counts below, at and above the pairing threshold, odd and even
    weight rows."""
    lib = cbuild.library()
    before = gemv.kernel() and gemv.current(lib)
    g = torch.Generator().manual_seed(pair_rows)
    try:
        other = gemv.PREFETCH_MODES[gemv.PREFETCH_MODES.index(mode) - 1]  # a different mode for pairs
        tune = gemv.setting(mode, pair_rows, other)
        gemv.apply(lib, dict.fromkeys(gemv.KINDS, tune))
        assert gemv.current(lib) == dict.fromkeys(gemv.KINDS, tune)
        for m, i, o in [(1, 576, 70), (2, 47, 5), (3, 1536, 33), (4, 100, 9), (8, 47, 5), (9, 576, 17)]:
            x, w = torch.randn(m, i, generator=g), torch.randn(o, i, generator=g)
            for weight in (w, w.bfloat16()):
                assert within_fp32_summation(gemv.gemv(x, weight), x, weight)
            assert within_fp32_summation(panel_product(decode_ops.kernels(), x, w.bfloat16()), x, w.bfloat16())
    finally:
        gemv.apply(lib, before)


def test_the_weight_dtypes_and_panels_are_tuned_apart():
    lib = cbuild.library()
    before = gemv.kernel() and gemv.current(lib)
    try:
        gemv.apply(lib, {"float32": gemv.setting("L2", 4, "L1")})
        gemv.apply(lib, {"bfloat16": gemv.setting("none", gemv.NEVER)})
        gemv.apply(lib, {"panels": gemv.setting("L1", gemv.NEVER)})
        assert gemv.current(lib) == {"float32": gemv.setting("L2", 4, "L1"),
                                     "bfloat16": gemv.setting("none", gemv.NEVER),
                                     "panels": gemv.setting("L1", gemv.NEVER)}
    finally:
        gemv.apply(lib, before)


def test_choose_takes_the_least_total_time_relative_to_each_row_count():
    """Weight rows one at a time win at 1-2 rows, pairs from 4; below 4 rows no prefetch wins at 1 row
    but loses by more at 2, L2 is best over both; from 4 rows L1 is best: one at a time with L2 below 4
    rows, pairs with L1 from 4."""
    ms = {}
    for mode in gemv.PREFETCH_MODES:
        for pairs in (False, True):
            for rows, base in ((1, 10.0), (2, 12.0), (4, 16.0), (8, 30.0)):
                t = base * (1.2 if pairs == (rows < 4) else 1.0)
                if rows < 4:
                    t *= {"L1": 1.05, "L2": 1.0 if rows > 1 else 1.05, "none": 0.95 if rows == 1 else 1.3}[mode]
                else:
                    t *= {"L1": 1.0, "L2": 1.1, "none": 1.3}[mode]
                ms[mode, pairs, rows] = t
    assert gemv.choose(ms) == gemv.setting("L2", 4, "L1")
    slower_pairs = {k: t * (1.5 if k[1] else 1.0) for k, t in ms.items()}
    assert gemv.choose(slower_pairs)["pair_rows"] == gemv.NEVER  # pairs lose everywhere: never paired
    alone = {k: t for k, t in ms.items() if not k[1]}  # timed without pairs (panels): L1 over all the rows
    assert gemv.choose(alone) == gemv.setting("L1", gemv.NEVER)


def test_tuning_is_measured_once_per_machine(monkeypatch, tmp_path):
    """Timed on a miss, chosen per weight dtype and cached; read back, not timed, for the same CPU,
    thread count and library; timed again for another CPU or an unreadable file."""
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path))
    timed = []

    def fake(lib, fns):
        timed.append(1)
        fast = {"float32": "L2", "bfloat16": "L1" if len(timed) != 2 else "none", "panels": "none"}
        pairs_from = {"float32": 4, "bfloat16": 8, "panels": gemv.NEVER}
        return {(d, m, p, r): (1.0 if m == fast[d] else 2.0) * (1.0 if p == (r >= pairs_from[d]) else 1.5)
                for d in gemv.KINDS for m in gemv.PREFETCH_MODES for p in (False, True) for r in gemv.TUNE_ROWS
                if d != "panels" or not p}
    monkeypatch.setattr(gemv, "time_tuning", fake)
    lib, fns = cbuild.library(), gemv.kernel()
    want = {"float32": gemv.setting("L2", 4), "bfloat16": gemv.setting("L1", 8),
            "panels": gemv.setting("none", gemv.NEVER)}
    assert gemv.tuning(lib, fns) == want and len(timed) == 1
    (path,) = (tmp_path / "dispatch").iterdir()
    assert gemv.tuning(lib, fns) == want and len(timed) == 1  # cached
    real = cbuild._cpu_id
    monkeypatch.setattr(cbuild, "_cpu_id", lambda: real() + "\nflags : avx9000")
    assert gemv.tuning(lib, fns)["bfloat16"]["prefetch"] == "none" and len(timed) == 2  # another CPU: timed
    monkeypatch.setattr(cbuild, "_cpu_id", real)
    path.write_text("not json")
    assert gemv.tuning(lib, fns) == want and len(timed) == 3


def test_time_tuning_times_every_setting_restores_the_current_one_and_the_rng():
    lib = cbuild.library()
    fns = gemv.kernel()
    before = gemv.current(lib)
    torch.manual_seed(7)
    want = torch.rand(4)
    torch.manual_seed(7)
    ms = gemv.time_tuning(lib, fns, nbytes=4 << 20, rounds=1)
    assert torch.equal(torch.rand(4), want)  # the global RNG untouched: a run tuning midway samples the same
    assert set(ms) == {(d, m, p, r) for d in gemv.KINDS for m in gemv.PREFETCH_MODES for p in (False, True)
                       for r in gemv.TUNE_ROWS if d != "panels" or not p}  # panels: no pairs
    assert all(t > 0 for t in ms.values())
    assert gemv.current(lib) == before


@pytest.mark.parametrize("tune", [{"float32": gemv.setting("L1", 2, "none"), "bfloat16": gemv.setting("none", 5),
                                   "panels": gemv.setting("L2", gemv.NEVER)},
                                  {"float32": gemv.setting("L2", gemv.NEVER), "bfloat16": gemv.setting("L2", 1, "L1"),
                                   "panels": gemv.setting("none", gemv.NEVER)}])
def test_the_chosen_tuning_is_set_and_keys_the_dispatch_tables(tune, monkeypatch, fresh_kernels):
    from codraft.kernels import dispatch
    monkeypatch.setattr(gemv, "tuning", lambda lib, fns: tune)
    assert gemv.kernel() is not None
    assert gemv.current(cbuild.library()) == tune
    assert dispatch.machine()["gemv"] == tune


def test_applies_at_any_row_count_to_fp32_and_bf16_weights():
    x, w = torch.randn(200, 24), torch.randn(40, 24)
    with torch.no_grad():
        assert gemv.applies(x, w) and gemv.applies(x, w.bfloat16()) and gemv.applies(x[:1], w.bfloat16())
        assert not gemv.applies(x.double(), w) and not gemv.applies(x, w.double())
        assert not gemv.applies(x, w.half()) and not gemv.applies(x.bfloat16(), w.bfloat16())
        assert not gemv.applies(x, w.T.contiguous().T)  # column-major: the kernel reads rows as stored
    assert not gemv.applies(x, w.bfloat16().requires_grad_())  # autograd needs torch's product


def test_linear_routes_and_agrees():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g, requires_grad=True)
    x = torch.randn(3, 6, 24, generator=g)[:, ::2]  # non-contiguous (3,3,24): 9 rows
    ref = F.linear(x.double(), w.detach().double())
    with torch.no_grad():
        assert gemv.applies(x.reshape(9, 24), w)
        torch.testing.assert_close(linear(x, w).double(), ref, rtol=1e-5, atol=1e-5)
        assert not gemv.applies(x.reshape(9, 24).double(), w.double())
    # with autograd live the product must stay differentiable: torch's path
    assert not gemv.applies(x.reshape(9, 24), w)
    y = linear(x, w)
    y.sum().backward()
    torch.testing.assert_close(w.grad, x.reshape(9, 24).sum(0).expand(40, 24), rtol=1e-5, atol=1e-5)


def test_build_is_cached_and_fails_loudly(tmp_path, monkeypatch):
    first = cbuild.build(cache_dir=tmp_path)
    assert first.is_file() and cbuild.build(cache_dir=tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, first.name + ".sha256"]  # no temp files
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with pytest.raises(RuntimeError, match="false failed on gemv.c, amx.c, decode_ops.c"):
        cbuild.build(cache_dir=tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []


@pytest.fixture(scope="module")
def built_kernels(tmp_path_factory):
    """The kernels as built for this machine (in its cache: built once for every test), copied to a folder of
    their own; tests change copies of that."""
    lib = cbuild.build()
    folder = tmp_path_factory.mktemp("built") / "kernels"
    folder.mkdir()
    for f in (lib, lib.with_name(lib.name + ".sha256")):
        shutil.copy(f, folder / f.name)
    return folder / lib.name


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_replaced_library_is_rebuilt_before_loading(built_kernels, tmp_path, monkeypatch, fresh_kernels):
    """Another library put under the kernels' name (one that loads: a C extension of Python's) no longer
    matches the sha256 recorded when they were built: built again, and the rebuilt one is what loads."""
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path))
    shutil.copytree(built_kernels.parent, tmp_path / "kernels")
    lib = tmp_path / "kernels" / built_kernels.name
    shutil.copy(_ctypes.__file__, lib)
    loaded = cbuild.library()
    assert loaded is not None and loaded._name == str(lib) and hasattr(loaded, "amx_ready")
    assert _sha256(lib) == lib.with_name(lib.name + ".sha256").read_text() != _sha256(Path(_ctypes.__file__))


def test_a_library_without_its_record_is_rebuilt(built_kernels, tmp_path):
    """No record (a library from before records, or one put there): not trusted, built again."""
    shutil.copytree(built_kernels.parent, tmp_path / "kernels")
    lib, record = tmp_path / "kernels" / built_kernels.name, tmp_path / "kernels" / (built_kernels.name + ".sha256")
    record.unlink(missing_ok=True)
    before = lib.stat().st_ino
    assert cbuild.build(cache_dir=tmp_path / "kernels") == lib
    assert lib.stat().st_ino != before and record.read_text() == _sha256(lib)  # a new file, recorded


def test_no_compiler_warns_and_falls_back(tmp_path, monkeypatch, fresh_kernels):
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with pytest.warns(UserWarning, match="C kernels unavailable"):
        assert gemv.kernel() is None and decode_ops.kernels() is None
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    with torch.no_grad():
        assert not gemv.applies(x, w) and not decode_ops.applies(x, w)
        torch.testing.assert_close(linear(x, w), F.linear(x, w))


def test_opt_out(monkeypatch, fresh_kernels):
    monkeypatch.setenv("CODRAFT_KERNELS", "0")
    assert gemv.kernel() is None and decode_ops.kernels() is None


@pytest.mark.parametrize("tied", [True, False])
def test_bench_covers_every_decode_product(tied):
    from codraft.bench.bandwidth import weight_bytes
    from codraft.bench.gemv import decode_weights, measure
    from codraft.models import ModelConfig, Transformer
    cfg = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = Transformer(cfg)
    ws = decode_weights(model)
    norms = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 1)
    buffers = sum(b.numel() * 4 for b in model.buffers())  # rope frequencies
    embed = 0 if tied else model.embed_tokens.weight.numel() * 4  # a lookup, not a product
    assert sum(w.numel() * 4 for w in ws) + norms + buffers + embed == weight_bytes(model)
    (r,) = measure(ws, rows=[3], repeats=3)
    assert r["rows"] == 3 and r["bytes"] == sum(w.numel() * 4 for w in ws)
    assert all(r[f"{k}_ms"] > 0 for k in ("sum", "kernel", "linear", "transposed", "chosen"))
    assert set(r["vs_chosen"]) >= {"kernel", "linear", "transposed"} and r["same_path"] > 0
    assert sum(r["chosen_paths"].values()) == len(ws)
    assert r["chosen_is"] == (next(iter(r["chosen_paths"])) if len(r["chosen_paths"]) == 1 else None)
    assert r["chosen_vs_best"] == min(r["vs_chosen"].values()) == r["vs_chosen"][r["best_single"]]


def test_bench_summary_counts_a_path_compared_with_itself_apart():
    from codraft.bench.gemv import summary
    rows = [{"rows": 1, "chosen_is": "kernel", "best_single": "kernel", "chosen_vs_best": 0.9, "same_path": 0.95},
            {"rows": 2, "chosen_is": None, "best_single": "panels", "chosen_vs_best": 1.02, "same_path": 1.05},
            {"rows": 3, "chosen_is": "kernel", "best_single": "panels", "chosen_vs_best": 0.8, "same_path": 1.0}]
    assert summary(rows) == ("the chosen path is the best single path itself at 1/3 row counts; the same paths "
                             "timed twice: 0.95-1.05; elsewhere chosen vs best >= 1 at 1/2, >= 0.97 at 1, worst "
                             "0.80 at 3 rows")


def test_paired_ratio():
    from codraft.bench.gemv import paired_ratio
    # a side 10 % faster within every round: 1.1 however much the host's speed moves between rounds
    slow_host = [1.0, 3.0, 2.0, 5.0, 0.5]
    assert paired_ratio(slow_host, [t / 1.1 for t in slow_host]) == pytest.approx(1.1)
    # one side's lucky round (0.5 against 2) moves the median of the ratios 0.5, 1, 3 no further than 1
    assert paired_ratio([1, 2, 3], [2, 2, 1]) == 1.0
    with pytest.raises(ValueError, match="same number of rounds"):
        paired_ratio([1.0], [1.0, 2.0])


def test_bench_times_the_paths_a_decode_step_takes(monkeypatch):
    """A layer's products follow its one-call path where the layer table picks one; elsewhere (and the LM
    head always) each product's own table."""
    from types import SimpleNamespace

    from codraft import kernels
    from codraft.bench import gemv as bench
    from codraft.models import ModelConfig, Transformer
    cfg = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = kernels.enable(Transformer(cfg).eval())
    ws = bench.decode_weights(model)
    layer_paths = {1: "fused", 2: "fused-panels", 3: "unfused"}
    monkeypatch.setattr(bench, "layer_table", lambda layer: SimpleNamespace(path=layer_paths.get))
    monkeypatch.setattr(bench.products, "table", lambda w: SimpleNamespace(path=lambda m: f"own{m}"))
    for m, inside in ((1, "kernel"), (2, "panels"), (3, "own3")):
        assert bench.engine_paths(model, ws, m) == [inside] * 14 + [f"own{m}"]


def _decode_step_model():
    from codraft import kernels
    from codraft.models import KVCache, ModelConfig, Transformer
    cfg = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    reference = Transformer(cfg).eval()
    model = kernels.enable(copy.deepcopy(reference))
    cache = KVCache.for_model(model, batch=3, max_len=9)
    cache.k.normal_(), cache.v.normal_()
    return reference, model, cache


def test_forcing_gives_one_path_at_every_row_count_and_restores_the_tables():
    from codraft.kernels import dispatch, products
    w = torch.randn(32, 48)
    measured = products.table(w)
    with dispatch.forcing({"product": "transposed"}):
        assert {products.table(w).path(m) for m in (1, 7, 64, 1000)} == {"transposed"}
        with dispatch.forcing({"product": "kernel", "layer": "unfused"}):
            assert products.table(w).path(3) == "kernel"
        assert products.table(w).path(3) == "transposed"
    with pytest.raises(RuntimeError), dispatch.forcing({"product": "linear"}):
        raise RuntimeError
    assert products.table(w) is measured


def test_a_forced_decode_step_runs_the_forced_path_and_computes_the_same(monkeypatch):
    """The whole-step sides of ``codraft bench gemv`` run what they name: a product path for every product
    with the layers per op, or the one-call layer; each gives the reference model's logits."""
    from codraft.bench import gemv as bench
    from codraft.kernels import dispatch, products
    reference, model, cache = _decode_step_model()
    token = torch.randint(61, (3, 1), generator=torch.Generator().manual_seed(1))
    start = torch.tensor([2, 5, 0])
    with torch.inference_mode():
        cache.set_lengths(start, span=5)
        expected = reference(token, cache=cache)
        sides = bench.step_sides(model, 3, cache.k)
    assert {"chosen", "kernel", "linear", "transposed", "fused"} <= set(sides)
    calls = []
    for name, fn in products.PATHS.items():
        monkeypatch.setitem(products.PATHS, name, lambda x, w, n=name, f=fn: calls.append(n) or f(x, w))
    real_stack = decode_ops.decoder_stack
    monkeypatch.setattr(decode_ops, "decoder_stack", lambda *a, **k: calls.append("stack") or real_stack(*a, **k))
    for name, paths in sides.items():
        calls.clear()
        with torch.inference_mode(), dispatch.forcing(paths):
            cache.set_lengths(start, span=5)
            got = model(token, cache=cache)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=name)
        if name in products.PATHS:
            assert calls == [name] * (7 * 2 + 1), name  # 7 products a layer and the LM head
        elif name in ("fused", "fused-panels", "fused-amx"):
            assert calls[0] == "stack" and "stack" not in calls[1:] and len(calls) == 2, (name, calls)


def test_bench_times_whole_decode_steps_against_each_forced_path():
    from codraft.bench import gemv as bench
    _, model, _ = _decode_step_model()
    result = bench.measure_steps(model, rows=[1, 3], repeats=2)
    assert [r["rows"] for r in result] == [1, 3]
    for r in result:
        assert {"kernel", "linear", "transposed", "fused"} <= set(r["vs_chosen"])
        assert all(r[f"{n}_ms"] > 0 for n in (*r["vs_chosen"], "chosen", "chosen_again"))
        assert r["chosen_vs_best"] == min(r["vs_chosen"].values()) == r["vs_chosen"][r["best_single"]]
    assert bench.steps_summary(result).startswith("whole steps: chosen vs best")
