"""Rollout engine: greedy speculative == plain greedy (fixed γ, and a varying number of drafts per
round for every draft kind), logprobs == a fresh forward's, KV rollback, draft state after
variable rounds, ngram lookup, seeds, stats, and input validation. Tiny random models, CPU, a few
seconds."""
import itertools
import math
from unittest import mock

import pytest
import torch

import codraft.rollout.engine as engine_mod
from codraft.drafts import available_drafts, build_draft
from codraft.models import KVCache, ModelConfig, Transformer
from codraft.rollout import Engine, Sampler
from spec_harness import scaled

V = 61
PROMPTS = [[5, 17, 3], [9, 9, 40, 2, 33, 7, 1, 12, 60], [4]]  # different lengths: right-padded prefill


def _config(layers=2, **kw):
    return ModelConfig(**{**dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), **kw})


@pytest.fixture(scope="module")
def target():
    return scaled(Transformer(_config()), 0.3, seed=0)  # decisive argmaxes


def _drafts(target):
    """(id, draft) pairs: a random 1-layer model, a copy of the target (everything accepted), prompt lookup."""
    torch.manual_seed(1)
    return {
        "model": build_draft("model", target.config, num_hidden_layers=1),
        "model-self": build_draft("model", target.config, num_hidden_layers=2, weights=target.state_dict()),
        "ngram": build_draft("ngram", target.config, n=3),
    }


def _full_logits(model, prompt, tokens):
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1]  # (n,V): predicts each new token


# --------------------------------------------------------------------------- greedy equivalence
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind", ["model", "model-self", "ngram"])
@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_spec_equals_plain(target, kind, batch, gamma):
    prompts = PROMPTS[1:2] if batch == 1 else PROMPTS
    plain = Engine(target).generate(prompts, 16, temperature=0, eos_id=[])
    spec_engine = Engine(target, _drafts(target)[kind], gamma=gamma)
    spec = spec_engine.generate(prompts, 16, temperature=0, eos_id=[])
    for a, b in zip(plain, spec):
        assert a.tokens == b.tokens and len(a.tokens) == 16 and a.finish_reason == b.finish_reason == "length"
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    if kind == "model-self":  # a perfect draft: every round accepts all γ (rule-level count)
        assert spec_engine.stats.acceptance_length == gamma + 1


@pytest.mark.parametrize("kind", ["model", "model-self", "ngram"])
def test_greedy_eos_stops_rows(target, kind):
    plain = Engine(target).generate(PROMPTS, 16, temperature=0, eos_id=[])
    eos = plain[0].tokens[6]  # stops row 0 at its 7th token (or earlier); other rows wherever it occurs
    expect = []
    for r in plain:
        cut = r.tokens.index(eos) + 1 if eos in r.tokens else 16
        expect.append(r.tokens[:cut])
    for engine in (Engine(target), Engine(target, _drafts(target)[kind], gamma=3)):
        out = engine.generate(PROMPTS, 16, temperature=0, eos_id=eos)
        assert [r.tokens for r in out] == expect
        assert [r.finish_reason for r in out] == ["eos" if t[-1] == eos else "length" for t in expect]
        assert all(len(r.logprobs) == len(r.tokens) for r in out)
    # eos given as a list, and taken from the model config when not given
    assert [r.tokens for r in Engine(target).generate(PROMPTS, 16, temperature=0, eos_id=[eos, V + 5])] == expect
    target.config.eos_token_id = eos
    try:
        assert [r.tokens for r in Engine(target).generate(PROMPTS, 16, temperature=0)] == expect
    finally:
        target.config.eos_token_id = None


# --------------------------------------------------------------------------- logprobs
def _oracle_logprobs(logits, tokens, temperature, top_k, top_p):
    """Independent float64 transform: logits/T, keep top-k (ties kept), keep the top-p nucleus, renormalise."""
    out = []
    for row, tok in zip(logits.double(), tokens):
        if temperature == 0:
            out.append(torch.log_softmax(row, 0)[tok].item())
            continue
        x = row / temperature
        keep = torch.ones_like(x, dtype=torch.bool)
        if top_k:
            keep &= x >= torch.sort(x, descending=True).values[top_k - 1]
        p = torch.softmax(x.masked_fill(~keep, -math.inf), 0)
        vals, order = torch.sort(p, descending=True)
        before = torch.cumsum(vals, 0) - vals
        nucleus = torch.zeros_like(keep)
        nucleus[order[before < top_p]] = True
        keep &= nucleus
        assert keep[tok], "emitted a token outside the sampling support"
        out.append(torch.log_softmax(x.masked_fill(~keep, -math.inf), 0)[tok].item())
    return out


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=20),
                                      dict(temperature=0)], ids=["t1", "t0.8-p0.9-k20", "greedy"])
@pytest.mark.parametrize("kind", [None, "model", "ngram"])
def test_logprobs_equal_fresh_forward(target, kind, settings):
    draft = None if kind is None else _drafts(target)[kind]
    out = Engine(target, draft, gamma=None if draft is None else 3).generate(
        PROMPTS, 12, seed=5, eos_id=[], **settings)
    for prompt, r in zip(PROMPTS, out):
        ref = _oracle_logprobs(_full_logits(target, prompt, r.tokens), r.tokens, settings["temperature"],
                               settings.get("top_k", 0), settings.get("top_p", 1.0))
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref)) <= 1e-5


def test_seed_reproducible(target):
    engine = Engine(target, _drafts(target)["model"], gamma=2)
    a = engine.generate(PROMPTS, 10, seed=3, eos_id=[])
    b = engine.generate(PROMPTS, 10, seed=3, eos_id=[])
    c = engine.generate(PROMPTS, 10, seed=4, eos_id=[])
    assert [r.tokens for r in a] == [r.tokens for r in b] and [r.logprobs for r in a] == [r.logprobs for r in b]
    assert [r.tokens for r in a] != [r.tokens for r in c]
    torch.manual_seed(0)
    d = engine.generate(PROMPTS, 10, eos_id=[])
    torch.manual_seed(0)
    assert [r.tokens for r in engine.generate(PROMPTS, 10, eos_id=[])] == [r.tokens for r in d]


# --------------------------------------------------------------------------- cache rollback
@pytest.mark.parametrize("kind,temperature", [("model", 1.0), ("ngram", 0.0)])
def test_kv_rollback_matches_fresh_prefill(target, kind, temperature):
    draft = _drafts(target)[kind]
    engine = Engine(target, draft, gamma=3)
    run = engine.start(PROMPTS, 40, temperature=temperature, seed=11, eos_id=[])
    for _ in range(6):
        run.step()
    assert 0 < run.stats.row_rounds * 3 and run.rows.tolist() == [0, 1, 2]  # no row finished yet
    assert 0 < sum(run.stats.accepted_per_position) < run.stats.row_rounds * 3  # acceptances and rejections
    n_out = run.n_out.tolist()
    for b, prompt in enumerate(PROMPTS):
        context = prompt + run.out_tokens[b, :n_out[b]].tolist()
        assert run.last[b].item() == context[-1]
        n = len(context) - 1  # the cache holds everything but the pending token
        assert run.cache.lengths[b].item() == n
        fresh = KVCache.for_model(target, 1, 64)
        with torch.no_grad():
            target(torch.tensor([context[:-1]]), cache=fresh)
        torch.testing.assert_close(run.cache.k[:, b, :, :n], fresh.k[:, 0, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run.cache.v[:, b, :, :n], fresh.v[:, 0, :, :n], rtol=1e-5, atol=1e-5)
        if kind == "model":  # the draft's own cache: context minus its last two tokens
            dcache = run.draft_state.cache
            m = len(context) - 2
            assert dcache.lengths[b].item() == m and run.draft_state.last2[b].tolist() == context[-2:]
            dfresh = KVCache.for_model(draft.net, 1, 64)
            with torch.no_grad():
                draft.net(torch.tensor([context[:-2]]), cache=dfresh)
            torch.testing.assert_close(dcache.k[:, b, :, :m], dfresh.k[:, 0, :, :m], rtol=1e-5, atol=1e-5)
        else:
            st = run.draft_state
            assert st.lengths[b].item() == len(context) and st.context[b, :len(context)].tolist() == context


def test_finished_rows_are_dropped(target):
    """A row that stops at EOS leaves the batch (cache, draft state) while the others go on."""
    plain = Engine(target).generate(PROMPTS, 30, temperature=0, eos_id=[])
    others = {t for r in (plain[0], plain[2]) for t in r.tokens}
    eos = next((t for t in plain[1].tokens[2:8] if t not in others), None)
    assert eos is not None, "pick another seed: no token unique to row 1"
    run = Engine(target, _drafts(target)["ngram"], gamma=2).start(PROMPTS, 30, temperature=0, eos_id=eos)
    sizes = []
    while not run.finished:
        run.step()
        sizes.append((run.cache.k.shape[1], run.draft_state.context.shape[0], run.rows.numel()))
    assert sizes[0] == (3, 3, 3) and all(a == b == c for a, b, c in sizes)
    assert any(s[0] < 3 for s in sizes[:-1]) and sorted(sizes, reverse=True) == sizes
    out = run.results()
    assert out[1].tokens == plain[1].tokens[:plain[1].tokens.index(eos) + 1] and out[1].finish_reason == "eos"
    assert out[0].tokens == plain[0].tokens and out[2].tokens == plain[2].tokens


@pytest.mark.parametrize("keep", [[0, 2, 3], [1], [4], [0, 1, 2, 3, 4], [3, 1], [0, 0, 2, 4, 4, 1]])
def test_cache_select_keeps_each_rows_positions(keep):
    """Rows that only drop compact in place (the same memory, contiguous, nothing allocated); other
    selections (reordered, repeated: a prefill copying a prompt's row) gather. Either way every kept row
    holds its positions below ``span`` as before, and the memory past it stays finite."""
    cache = KVCache(num_layers=3, batch=5, max_len=9, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.v.normal_(generator=torch.Generator().manual_seed(1))
    cache.set_lengths(torch.tensor([6, 2, 5, 7, 1]), span=7)
    k, v, ptr = cache.k.clone(), cache.v.clone(), cache.k.data_ptr()
    rows = torch.tensor(keep)
    cache.select(rows)
    assert cache.k.shape == (3, len(keep), 2, 9, 4) and cache.k.is_contiguous() and cache.v.is_contiguous()
    assert cache.lengths.tolist() == [[6, 2, 5, 7, 1][i] for i in keep]
    in_place = keep == sorted(set(keep))
    assert (cache.k.data_ptr() == ptr) == in_place
    torch.testing.assert_close(cache.k[..., :7, :], k[:, rows, :, :7], rtol=0, atol=0)
    torch.testing.assert_close(cache.v[..., :7, :], v[:, rows, :, :7], rtol=0, atol=0)
    assert cache.k.isfinite().all() and cache.v.isfinite().all()
    if in_place and len(keep) > 1:  # and again, from the compacted layout
        cache.select(torch.tensor([len(keep) - 1]))
        torch.testing.assert_close(cache.k[..., :7, :], k[:, rows[-1:], :, :7], rtol=0, atol=0)


# --------------------------------------------------------------------------- drafts and stats
def test_ngram_lookup_proposals():
    draft = build_draft("ngram", _config(), n=3)
    ctx = torch.tensor([[5, 6, 7, 8, 5, 6, 0, 0],    # suffix (5,6) seen at 0 -> 7, 8, 5, 6
                        [1, 2, 3, 4, 9, 9, 9, 0],    # suffix (9,9) seen at 4 -> 9 (period 1)
                        [1, 2, 3, 4, 5, 2, 0, 0],    # (5,2) unseen, (2,) seen at 1 -> 3, 4, 5, 2
                        [1, 2, 3, 4, 0, 0, 0, 0]])   # no match: repeat the last token
    lens = torch.tensor([6, 7, 6, 4])
    state = draft.begin(ctx, lens, {}, max_len=16)
    tokens, q = draft.propose(state, 4, None, context_len=8)
    assert q is None
    assert tokens.tolist() == [[7, 8, 5, 6], [9, 9, 9, 9], [3, 4, 5, 2], [4, 4, 4, 4]]
    state = draft.commit(state, torch.tensor([[7, 8, 0, 0, 0]] * 4), torch.tensor([2, 1, 1, 1]), {})
    assert state.lengths.tolist() == [8, 8, 7, 5] and state.context[0, :8].tolist() == [5, 6, 7, 8, 5, 6, 7, 8]
    tokens, _ = draft.propose(state, 2, None, context_len=8)
    assert tokens[0].tolist() == [5, 6]


def test_stats(target):
    engine = Engine(target)
    engine.generate(PROMPTS, 8, temperature=1.0, seed=0, eos_id=[])
    s = engine.stats
    assert s.acceptance_length == 1.0 and s.emitted_tokens == 24 and s.rounds == 7 and s.row_rounds == 21
    assert s.total_s > 0 and s.verify_s > 0 and s.tokens_per_s > 0 and s["acceptance_length"] == 1.0
    engine = Engine(target, _drafts(target)["model"], gamma=3)
    engine.generate(PROMPTS, 20, temperature=1.0, seed=0, eos_id=[])
    s = engine.stats
    rates = s.acceptance_per_position
    assert len(rates) == 3 and all(a >= b for a, b in zip(rates, rates[1:]))
    assert s.acceptance_length == pytest.approx(1 + sum(rates))
    assert s.drafted == 3 * s.row_rounds and s.accepted == sum(s.accepted_per_position) <= s.drafted
    assert s.drafted_per_position == [s.row_rounds] * 3 and s.gamma_chosen == [0, 0, 0, s.rounds]
    assert s.mean_gamma == 3 and s.emitted_tokens == 60 and s.draft_s > 0 and s.verify_s > 0
    assert set(s.as_dict()) >= {"acceptance_length", "acceptance_per_position", "tokens_per_s", "bookkeeping_s"}
    engine.generate(PROMPTS[:1], 1, eos_id=[])  # reset per call; 1 token comes from the prefill alone
    assert engine.stats.rounds == 0 and engine.stats.emitted_tokens == 1


def test_model_draft_weights_from_file(target, tmp_path):
    src = build_draft("model", target.config, num_hidden_layers=1)
    torch.save(src.net.state_dict(), tmp_path / "d.pt")
    loaded = build_draft("model", target.config, num_hidden_layers=1, weights=tmp_path / "d.pt")
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), loaded.state_dict().values()))
    small = build_draft("model", target.config, hidden_size=16, num_attention_heads=2, intermediate_size=24)
    assert small.net.config.head_dim == 8 and small.vocab_size == V


# --------------------------------------------------------------------------- validation
class _Counting(Transformer):
    calls = 0

    def forward(self, *a, **k):
        type(self).calls += 1
        return super().forward(*a, **k)


def test_bad_inputs():
    model = _Counting(_config(max_position_embeddings=32)).eval()
    ok = build_draft("ngram", model.config)
    with pytest.raises(ValueError, match="gamma must be an int >= 1"):
        Engine(model, ok, gamma=0)
    with pytest.raises(ValueError, match='gamma must be an int >= 1 or "auto"'):
        Engine(model, ok, gamma="4")
    with pytest.raises(ValueError, match='a cost_model is for gamma="auto"'):
        Engine(model, ok, gamma=2, cost_model=object())
    with pytest.raises(ValueError, match="without a draft"):
        Engine(model, gamma=2)
    with pytest.raises(ValueError, match=r"draft vocab_size=50 != target vocab_size=61"):
        Engine(model, build_draft("ngram", _config(vocab_size=50)))
    with pytest.raises(ValueError, match="share the target's vocabulary"):
        build_draft("model", model.config, vocab_size=50)
    with pytest.raises(ValueError, match=r"unknown draft kind 'medusa'; valid kinds: eagle3, dflash, dspark, model, ngram"):
        build_draft("medusa", model.config)
    assert {"model", "ngram"} <= set(available_drafts())
    engine = Engine(model, ok, gamma=2)
    cases = [
        (dict(prompts=[], max_new_tokens=4), "prompts is empty"),
        (dict(prompts=[[1], []], max_new_tokens=4), "prompt 1 is empty"),
        (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(prompts=[[1] * 40], max_new_tokens=1), r"prompt 0 has 40 tokens \+ max_new_tokens=1 > max_len=32"),
        (dict(prompts=[[1], [1] * 20], max_new_tokens=13), r"prompt 1 has 20 tokens \+ max_new_tokens=13"),
        (dict(prompts=[[1, V]], max_new_tokens=2), r"outside \[0, 61\)"),
        (dict(prompts=[[1]], max_new_tokens=2, temperature=-1), "temperature must be >= 0"),
        (dict(prompts=[[1]], max_new_tokens=2, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(prompts=[[1]], max_new_tokens=2, top_k=-1), "top_k must be >= 0"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            engine.generate(**kwargs)
    assert _Counting.calls == 0  # every check ran before any forward
    with pytest.raises(ValueError, match="max_len=8"):
        Engine(model, max_len=8).generate([[1] * 5], 4)
    assert len(Engine(model, ok, gamma=2).generate([[1] * 20], 12)[0].tokens) <= 12  # exactly max_len fits


# --------------------------------------------------------------------------- repeated prompts
GROUPED = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]]  # GRPO groups, interleaved


@pytest.mark.parametrize("kind", [None, "model", "dflash"])
def test_repeated_prompts_prefill_once(target, kind):
    """A repeated prompt is prefilled once and copied: the cache, the first logits and the draft's
    features of every copy equal a fresh single-prompt run, and the copies still sample independently."""
    torch.manual_seed(2)
    draft = None if kind is None else (build_draft("dflash", target.config, target=target) if kind == "dflash"
                                       else _drafts(target)[kind])
    engine = Engine(target, draft, gamma=None if draft is None else 3)
    run = engine.start(GROUPED, 40, temperature=1.0, seed=11, eos_id=[])
    assert run.cache.k.shape[1] == len(GROUPED)
    for _ in range(4):
        run.step()
    for b, prompt in enumerate(GROUPED):  # the cache of every row equals a fresh prefill of its context
        context = prompt + run.out_tokens[b, :run.n_out[b]].tolist()
        n = len(context) - 1
        fresh = KVCache.for_model(target, 1, 64)
        with torch.no_grad():
            target(torch.tensor([context[:-1]]), cache=fresh)
        torch.testing.assert_close(run.cache.k[:, b, :, :n], fresh.k[:, 0, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run.cache.v[:, b, :, :n], fresh.v[:, 0, :, :n], rtol=1e-5, atol=1e-5)
    out = engine.generate(GROUPED, 12, temperature=1.0, seed=5, eos_id=[])
    for prompt, r in zip(GROUPED, out):  # first-token logprob included
        ref = _oracle_logprobs(_full_logits(target, prompt, r.tokens), r.tokens, 1.0, 0, 1.0)
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref)) <= 1e-5
    assert len({tuple(out[i].tokens) for i in (0, 2, 3)}) > 1  # copies are independent samples
    greedy = engine.generate(GROUPED, 12, temperature=0, eos_id=[])
    for prompt, r in zip(GROUPED, greedy):  # equal to plain greedy on the prompt alone
        assert r.tokens == Engine(target).generate([prompt], 12, temperature=0, eos_id=[])[0].tokens


# --------------------------------------------------------------------------- a prefix shared by every prompt
SHARED = [1, 8, 22, 5, 30, 11, 2, 47, 19, 3, 3, 56, 14, 9, 28, 40, 7, 21]  # a chat template's role
PREFIXED = [SHARED + [5, 17, 3], SHARED + [9, 40, 2, 33, 7, 1, 12, 60], SHARED + [5, 17, 3], SHARED + [4]]


def _state_tensors(state):
    for v in state:  # the drafts keep their state in named tuples
        if isinstance(v, KVCache):
            yield from (v.k, v.v)
        elif isinstance(v, torch.Tensor):
            yield v


def test_shared_prefix_rule():
    assert engine_mod.shared_prefix([tuple(p) for p in PREFIXED[1:]]) == len(SHARED)  # 2 x 18 tokens saved
    assert engine_mod.shared_prefix([tuple(PREFIXED[0]), tuple(PREFIXED[1])]) == 0  # 18 < 32 saved: not worth it
    assert engine_mod.shared_prefix([tuple(PREFIXED[0])]) == 0  # one distinct prompt: nothing shared
    whole = (SHARED * 2, SHARED * 3, SHARED * 4)  # one prompt is a prefix of the others: it keeps a token
    assert engine_mod.shared_prefix([tuple(p) for p in whole]) == 2 * len(SHARED) - 1


@pytest.mark.parametrize("kind", [None, "dflash", "eagle3"])
def test_shared_prefix_prefill(target, kind):
    """Prompts that share a prefix: it is prefilled once, and the cache, the first logprobs, the draft's
    state after the prefill (built from the tapped features) and greedy outputs equal a prefill of
    every prompt whole."""
    draft = None if kind is None else _draft_of(kind, target)
    engine = Engine(target, draft, gamma=None if draft is None else 3)
    assert engine_mod.shared_prefix(list(dict.fromkeys(map(tuple, PREFIXED)))) == len(SHARED)
    calls = []
    hook = target.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape))
    try:
        run = engine.start(PREFIXED, 12, temperature=0, eos_id=[])
    finally:
        hook.remove()
    assert calls == [(1, len(SHARED)), (3, 8)]  # the prefix once, then the 3 distinct prompts' own tokens
    for b, prompt in enumerate(PREFIXED):
        fresh = KVCache.for_model(target, 1, 64)
        with torch.no_grad():
            logits = target(torch.tensor([prompt]), cache=fresh)[0, -1]
        n = len(prompt)
        torch.testing.assert_close(run.cache.k[:, b, :, :n], fresh.k[:, 0, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run.cache.v[:, b, :, :n], fresh.v[:, 0, :, :n], rtol=1e-5, atol=1e-5)
        assert run.out_logp[b, 0].item() == pytest.approx(torch.log_softmax(logits, -1).max().item(), abs=1e-5)
    if draft is not None:  # the draft's state (built from the tapped features) as after a whole prefill
        with mock.patch.object(engine_mod, "shared_prefix", return_value=0):
            whole = engine_mod.Rollout(engine, PREFIXED, 12, run.sampler, [])
        pairs = list(zip(_state_tensors(run.draft_state), _state_tensors(whole.draft_state)))
        assert pairs
        for a, b in pairs:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    out = engine.generate(PREFIXED, 12, temperature=0, eos_id=[])
    for prompt, r in zip(PREFIXED, out):
        assert r.tokens == Engine(target).generate([prompt], 12, temperature=0, eos_id=[])[0].tokens


# --------------------------------------------------------------------------- a varying number of drafts per round
SCHEDULE = (0, 3, 1, 0, 4, 2)
KINDS = ("eagle3", "dflash", "dspark", "ngram", "model", "model-self")


def _draft_of(kind, target, gamma=4):
    """A draft of ``kind`` built for γ = 4 (dflash: blocks of 5 slots, dspark: 4), bound to ``target``."""
    torch.manual_seed(1)
    if kind == "model-self":
        return build_draft("model", target.config, num_hidden_layers=2, weights=target.state_dict(), gamma=gamma)
    opts = {"model": dict(num_hidden_layers=1), "ngram": dict(n=3)}.get(kind, {})
    return build_draft(kind, target.config, target=target, gamma=gamma, **opts)


@pytest.fixture
def scheduled(monkeypatch):
    """gamma="auto" with the rule replaced by SCHEDULE, cycled: every round's g is forced."""
    def force(schedule=SCHEDULE):
        it = itertools.cycle(schedule)
        monkeypatch.setattr(engine_mod, "choose", lambda rows, acceptance, cost: next(it))
    return force


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_varying_draft_lengths_equals_plain(target, kind, scheduled):
    """g = 0, 3, 1, 0, 4, 2, … per round (g = 0: a plain step, the draft only commits; g below a
    block draft's block size): greedy output is plain greedy's, rows stopping at EOS included."""
    plain = Engine(target).generate(PROMPTS, 20, temperature=0, eos_id=[])
    eos = plain[0].tokens[9]
    expect = [r.tokens[:r.tokens.index(eos) + 1] if eos in r.tokens else r.tokens for r in plain]
    scheduled()
    engine = Engine(target, _draft_of(kind, target), gamma="auto", cost_model=object())
    out = engine.generate(PROMPTS, 20, temperature=0, eos_id=eos)
    assert [r.tokens for r in out] == expect
    s = engine.stats
    rounds = [SCHEDULE[i % len(SCHEDULE)] for i in range(s.rounds)]
    assert s.gamma_chosen == [rounds.count(g) for g in range(5)] and s.rounds >= len(SCHEDULE)
    assert s.drafted_per_position[0] >= s.drafted_per_position[3] > 0 and sum(s.gamma_chosen) == s.rounds
    if kind == "model-self":  # a perfect draft: every drafted token accepted, also after g = 0 rounds
        assert s.accepted_per_position == s.drafted_per_position and s.acceptance_per_position == [1.0] * 4


@pytest.mark.parametrize("kind", KINDS[:-1])
def test_draft_state_after_varying_rounds_equals_a_fresh_begin(target, kind, scheduled):
    """After rounds of g = 0, 3, 1, 0, 4, 2 drafts at temperature 1, the draft's next proposal
    (its first q row) equals that of a draft begun afresh on the same contexts with a full
    target forward's features: every commit, of width 1 too, left the state as begin would."""
    scheduled()
    draft = _draft_of(kind, target)
    run = Engine(target, draft, gamma="auto", cost_model=object()).start(PROMPTS, 40, seed=3, eos_id=[])
    for _ in range(2 * len(SCHEDULE)):
        run.step()
    assert run.rows.tolist() == [0, 1, 2]  # no row finished
    contexts = [p + run.out_tokens[b, :run.n_out[b]].tolist() for b, p in enumerate(PROMPTS)]
    t = max(map(len, contexts))
    ids = torch.tensor([c + [0] * (t - len(c)) for c in contexts])
    lens = torch.tensor([len(c) for c in contexts])

    def first_q(state):
        sampler = Sampler(1.0, generator=torch.Generator().manual_seed(0))
        tokens, q = draft.propose(state, 1, sampler, context_len=t)
        return tokens if q is None else q[:, 0]
    with torch.inference_mode():  # as the engine runs the draft
        _, feats = target(ids, taps=tuple(draft.feature_layers))
        fresh = draft.begin(ids, lens, feats, max_len=run.cache.max_len)
        torch.testing.assert_close(first_q(run.draft_state), first_q(fresh), rtol=1e-4, atol=1e-5)
