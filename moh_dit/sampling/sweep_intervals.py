"""Uncertainty of a sweep row's numbers: a bootstrap interval for FID, a Wilson interval for class accuracy.

A sweep's rows differ by a few FID points or accuracy percents, measured on a few hundred or
thousand images; the intervals say which differences the sample size can resolve.

* **FID**: the generated images' pool features are resampled with replacement
  (``resamples`` times, a fixed seed) and FID is computed each time against the fixed
  reference statistics, by the route :func:`moh_dit.evaluation.evaluate` takes. Resampling
  repeats images, which by itself raises FID at small sample sizes (fewer distinct images
  narrow the fitted Gaussian); the interval is therefore the bootstrap's 2.5 and 97.5
  percentiles shifted by that bias (the mean bootstrap FID minus the measured FID), which
  centres the spread on the measured value. The bias is kept in the row.
* **Class accuracy**: the Wilson score interval of ``correct`` of ``n`` at 95%.

Only the generated side varies: the reference statistics are treated as exact, as in every
sweep row. :class:`PoolFeatureRecorder` collects the pool features from the extractor during
the sweep's own evaluation pass, so nothing is extracted twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..evaluation import ReferenceStatistics, as_inception_features, compute_statistics, frechet_distance_from_features

__all__ = ["BOOTSTRAP_RESAMPLES", "FidInterval", "PoolFeatureRecorder", "bootstrap_fid", "fid_of_features",
           "wilson_interval"]

BOOTSTRAP_RESAMPLES = 200
_Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(correct: int, total: int, z: float = _Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion ``correct / total`` (95% by default).

    Unlike the normal approximation it stays inside [0, 1] and is not zero-width at 0 or 100%."""
    if total < 1 or not 0 <= correct <= total:
        raise ValueError(f"need 0 <= correct <= total and total >= 1; got {correct} of {total}.")
    p = correct / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def fid_of_features(features: np.ndarray, reference: ReferenceStatistics) -> float:
    """FID of sample pool ``features`` (N, D) against ``reference``, by the route ``evaluate`` takes:
    straight from both feature sets while they are smaller than D, else from the covariances."""
    reference_features = reference.pool_features if reference.statistics_from_images else None
    d = features.shape[1]
    if reference_features is not None and features.shape[0] <= d and reference_features.shape[0] <= d:
        return frechet_distance_from_features(features, reference_features)
    return compute_statistics(features).frechet_distance(reference.pool)


@dataclass
class FidInterval:
    """A bootstrap interval of FID: ``low``/``high`` (bias-shifted 2.5 / 97.5 percentiles) and ``bias``."""

    low: float
    high: float
    bias: float
    resamples: int


def bootstrap_fid(features: np.ndarray, reference: ReferenceStatistics, fid: float,
                  resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> FidInterval:
    """The 95% bootstrap interval of the measured ``fid`` of ``features`` (N, D) (see the module notes)."""
    if resamples < 2:
        raise ValueError(f"resamples must be >= 2, got {resamples}.")
    features = np.asarray(features, dtype=np.float64)
    rng = np.random.default_rng(seed)
    n = features.shape[0]
    values = np.array([fid_of_features(features[rng.integers(0, n, n)], reference) for _ in range(resamples)])
    bias = float(values.mean() - fid)
    low, high = np.percentile(values, [2.5, 97.5])
    return FidInterval(low=float(low) - bias, high=float(high) - bias, bias=bias, resamples=resamples)


class PoolFeatureRecorder:
    """Records the pool features an extractor computes inside a ``with`` block (a forward hook,
    removed on exit): the features the evaluation used, in order, as one float32 (N, D) array."""

    def __init__(self, extractor: nn.Module):
        self.extractor = extractor
        self.batches: list[torch.Tensor] = []
        self._handle = None

    def _hook(self, module: nn.Module, inputs, output) -> None:
        self.batches.append(as_inception_features(output).pool.detach().float().cpu())

    def __enter__(self) -> "PoolFeatureRecorder":
        self._handle = self.extractor.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    @property
    def features(self) -> np.ndarray:
        return torch.cat(self.batches).numpy() if self.batches else np.zeros((0, 0), dtype=np.float32)
