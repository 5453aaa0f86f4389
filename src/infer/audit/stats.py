"""Goodness-of-fit statistics for the audit, without scipy: chi-square tests and their power.

``chi2_sf`` and ``ncx2_sf`` are exact: the chi-square survival function is the regularised upper
incomplete gamma function (``torch.special.gammaincc``), and the noncentral one is its Poisson
mixture, summed until the Poisson weights left out are below 1e-15.

Power as a deviation size: a binned alternative ``p0 + Δ`` gives the chi-square test the
noncentrality ``λ = n Σ Δ_i² / p0_i``, and by Cauchy-Schwarz ``(Σ|Δ_i|)² ≤ Σ Δ_i²/p0_i · Σ p0_i``,
so a deviation of total variation ``δ = Σ|Δ_i| / 2`` has ``λ ≥ 4 n δ²`` whatever its direction (equal
when ``|Δ_i| ∝ p0_i``). The test therefore detects every deviation with ``δ ≥ sqrt(λ* / 4n)``, where
``λ*`` is the noncentrality at which it rejects with the wanted power.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

MIN_EXPECTED = 5.0  # the usual validity rule of the chi-square approximation


def chi2_sf(x: float, dof: int) -> float:
    """P(X > x) for X ~ chi-square(dof)."""
    if dof <= 0:
        return 1.0
    if x <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def ncx2_sf(x: float, dof: int, noncentrality: float) -> float:
    """P(X > x) for X ~ noncentral chi-square(dof, noncentrality): a Poisson(λ/2) mixture of chi-squares."""
    if noncentrality <= 0:
        return chi2_sf(x, dof)
    half = noncentrality / 2
    top = int(half + 12 * math.sqrt(half) + 40)  # the Poisson tail beyond this is < 1e-15
    j = torch.arange(top + 1, dtype=torch.float64)
    log_weights = -half + j * math.log(half) - torch.lgamma(j + 1)
    tails = torch.special.gammaincc(dof / 2 + j, torch.full_like(j, max(x, 0.0) / 2))
    return float((log_weights.exp() * tails).sum().clamp(0.0, 1.0))


def _bisect(f: Callable[[float], float], lo: float, hi: float, iterations: int = 100) -> float:
    """The root of an increasing ``f`` on [lo, hi], where f(lo) <= 0 <= f(hi)."""
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def chi2_isf(alpha: float, dof: int) -> float:
    """The critical value c with P(X > c) = alpha for X ~ chi-square(dof)."""
    hi = dof + 10.0
    while chi2_sf(hi, dof) > alpha:
        hi *= 2
    return _bisect(lambda x: alpha - chi2_sf(x, dof), 0.0, hi)


def noncentrality_for_power(dof: int, alpha: float, power: float) -> float:
    """The smallest noncentrality at which the level-``alpha`` test rejects with probability ``power``."""
    critical = chi2_isf(alpha, dof)
    hi = 10.0
    while ncx2_sf(critical, dof, hi) < power:
        hi *= 2
    return _bisect(lambda lam: ncx2_sf(critical, dof, lam) - power, 0.0, hi)


def detectable_tv(samples: int, dof: int, alpha: float, power: float) -> float | None:
    """The total-variation deviation every direction of which the test detects with ``power`` (None: no test)."""
    if samples <= 0 or dof <= 0:
        return None
    return math.sqrt(noncentrality_for_power(dof, alpha, power) / (4 * samples))


@dataclass
class ChiSquare:
    """A chi-square statistic over some cells, summable over independent groups."""

    statistic: float = 0.0
    dof: int = 0
    samples: int = 0
    # sum over groups of samples x the binned total variation between observed and expected
    weighted_tv: float = 0.0

    def __add__(self, other: ChiSquare) -> ChiSquare:
        return ChiSquare(self.statistic + other.statistic, self.dof + other.dof, self.samples + other.samples,
                         self.weighted_tv + other.weighted_tv)

    @property
    def p_value(self) -> float:
        return chi2_sf(self.statistic, self.dof)

    @property
    def observed_tv(self) -> float | None:
        """Sample-weighted total variation between the observed and expected binned distributions."""
        return self.weighted_tv / self.samples if self.samples else None


def cell_chisquare(observed: np.ndarray, expected: np.ndarray) -> ChiSquare:
    """Pearson's statistic over cells (expected counts summing to the sample count).

    Cells expected below 5 are merged into one; if that merged cell is itself below 5 it joins the
    smallest other cell. Fewer than two cells left means no test (dof 0).
    """
    observed, expected = np.asarray(observed, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    total = int(round(observed.sum()))
    small = expected < MIN_EXPECTED
    obs, exp = list(observed[~small]), list(expected[~small])
    if small.any():
        merged_o, merged_e = float(observed[small].sum()), float(expected[small].sum())
        if merged_e >= MIN_EXPECTED or not exp:
            obs.append(merged_o)
            exp.append(merged_e)
        else:
            i = int(np.argmin(exp))
            obs[i] += merged_o
            exp[i] += merged_e
    if len(exp) < 2 or total == 0:
        return ChiSquare(samples=0)
    o, e = np.array(obs), np.array(exp)
    return ChiSquare(float(((o - e) ** 2 / e).sum()), len(e) - 1, total, float(np.abs(o - e).sum() / 2))
