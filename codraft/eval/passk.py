"""pass@k from n samples per prompt, the unbiased estimator of Chen et al. 2021 (Codex, eq. 1):

    pass@k = E_prompts[1 - C(n - c, k) / C(n, k)]

for a prompt with c correct samples out of n: the chance that k samples drawn without replacement from
the n hold at least one correct one. Computed as a product, which stays exact in floats for large n.
"""
from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """One prompt's pass@k from ``c`` correct samples of ``n`` (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0  # C(n - c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i)
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def default_ks(n: int) -> list[int]:
    """The k reported without ``--k``: the powers of two up to n, and n itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == n else [*ks, n]
