"""Goodness-of-fit checks for the sampling tests: Pearson's chi-square against a known
distribution or between two samples, with the critical value at a fixed significance.

The tests draw with fixed seeds, so each check is deterministic; the significance says how
surprising a failure of a correct sampler would be (1 in 1000), and the tests show a wrong
sampler failing the same check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z_999 = 3.090  # the standard normal's 0.999 quantile: checks at significance 0.001
MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled (chi-square's rule)


def chi2_critical(df: int, z: float = Z_999) -> float:
    """The chi-square quantile of ``df`` degrees of freedom at the normal quantile ``z``
    (Wilson-Hilferty: within 3 % of the exact value at these tails, slightly above it)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def fits(counts: Sequence[int], probs: Sequence[float]) -> tuple[float, float]:
    """(statistic, critical value) of ``counts`` against the distribution ``probs``; cells
    expected rarely are pooled. A cell of probability 0 must be empty (checked by the caller:
    it adds nothing here)."""
    n = sum(counts)
    stat, df = 0.0, -1
    pool_obs, pool_exp = 0, 0.0
    for c, p in zip(counts, probs):
        e = n * p
        if e <= 0:
            continue
        if e < MIN_EXPECTED:
            pool_obs, pool_exp = pool_obs + c, pool_exp + e
            continue
        stat += (c - e) ** 2 / e
        df += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        df += 1
    return stat, chi2_critical(max(df, 1))


def same(a: Sequence[int], b: Sequence[int]) -> tuple[float, float]:
    """(statistic, critical value) of two samples' counts over the same cells coming from one
    distribution (the two-sample chi-square; the samples may differ in size); cells seen
    rarely in both are pooled."""
    na, nb = sum(a), sum(b)
    ka, kb = math.sqrt(nb / na), math.sqrt(na / nb)
    cells = [(x, y) for x, y in zip(a, b) if x + y >= 2 * MIN_EXPECTED]
    rare = [(x, y) for x, y in zip(a, b) if 0 < x + y < 2 * MIN_EXPECTED]
    if rare:
        cells.append((sum(x for x, _ in rare), sum(y for _, y in rare)))
    stat = sum((ka * x - kb * y) ** 2 / (x + y) for x, y in cells)
    return stat, chi2_critical(max(len(cells) - 1, 1))
