"""The target's sampling in C (``codraft.kernels.sampling``) against the torch code, same inputs and
seed: a decode step's draw against ``Sampler.sample_logits``, and the verify rule against
``verify_drafts`` (the same accepted counts and tokens, the same logprobs to fp32 rounding), at
vocabularies that are not whole vectors, for drafts close to the target (long accepted runs, bonus
tokens) and far from it (early rejections, residual draws). That the rule is exact is tested on the
engine's output distribution (test_spec_sampling, test_dflash_dspark), which runs through this."""
import pytest
import torch

from codraft.kernels import sampling
from codraft.spec.sampling import Sampler
from codraft.spec.verify import verify_drafts


@pytest.mark.parametrize("b,g,v", [(1, 4, 49152), (3, 2, 61), (8, 4, 1000), (2, 1, 17)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("near", [True, False], ids=["near", "far"])
def test_same_verdict_as_torch(b, g, v, temperature, near):
    gen = torch.Generator().manual_seed(b * 100 + g + v)
    logits = 2 * torch.randn(b, g + 1, v, generator=gen)
    # near: the draft's logits are the target's plus a little noise; far: unrelated
    draft_logits = logits[:, :g] + 0.5 * torch.randn(b, g, v, generator=gen) if near else \
        2 * torch.randn(b, g, v, generator=gen)
    q = Sampler(temperature).probs(draft_logits)
    x = Sampler(temperature, generator=gen).sample(q)
    rejected = bonus = 0
    for seed in range(20):
        want = verify_drafts(logits, x, q, Sampler(temperature, generator=torch.Generator().manual_seed(seed)))
        got = sampling.verify(logits, x, q, Sampler(temperature, generator=torch.Generator().manual_seed(seed)))
        assert got is not None
        n, tokens, logp = got
        assert torch.equal(n, want.n_accepted) and torch.equal(tokens, want.tokens)
        torch.testing.assert_close(logp, want.logprobs, rtol=1e-5, atol=1e-5)
        rejected, bonus = rejected + int((n < g).sum()), bonus + int((n == g).sum())
    assert (bonus if near else rejected) > 0  # both branches of the rule ran


@pytest.mark.parametrize("b,v", [(1, 49152), (5, 61), (8, 17)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_same_draws_as_torch(b, v, temperature):
    logits = 3 * torch.randn(b, v, generator=torch.Generator().manual_seed(b + v))
    seen = set()
    for seed in range(30):
        want = Sampler(temperature, generator=torch.Generator().manual_seed(seed)).sample_logits(logits)
        got = sampling.sample(logits, Sampler(temperature, generator=torch.Generator().manual_seed(seed)))
        assert got is not None and torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        seen.update(got[0].tolist())
    assert len(seen) > 3  # draws, not one token


def test_not_where_it_does_not_apply():
    logits, q, x = torch.randn(1, 3, 10), torch.full((1, 2, 10), 0.1), torch.zeros(1, 2, dtype=torch.long)
    for sampler in (Sampler(0.0), Sampler(1.0, top_p=0.9), Sampler(1.0, top_k=3)):
        assert sampling.verify(logits, x, q, sampler) is None and sampling.sample(logits[:, 0], sampler) is None
    assert sampling.verify(logits, x, None, Sampler(1.0)) is None  # a one-hot (deterministic) draft
    assert sampling.verify(logits.double(), x, q.double(), Sampler(1.0)) is None
    assert sampling.sample(logits[:, 0].double(), Sampler(1.0)) is None
