"""Feature statistics and the Frechet distance between them (FID on pool_3, sFID on ADM's spatial layer).

Statistics are kept in float64 and made as ADM makes them (``np.mean``, ``np.cov`` unbiased,
dividing by N - 1). The distance has two routes that give the same number: from the D x D
covariances (:func:`frechet_distance`) or straight from two small feature sets
(:func:`frechet_distance_from_features`, cheaper while N < D).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

__all__ = ["FeatureStatistics", "check_psd", "compute_statistics", "frechet_distance", "frechet_distance_from_features"]


@dataclasses.dataclass
class FeatureStatistics:
    """Mean and unbiased covariance of a feature set, in float64 (as ADM's ``np.mean``/``np.cov``)."""

    mu: np.ndarray  # (D,)
    sigma: np.ndarray  # (D, D)

    def frechet_distance(self, other: "FeatureStatistics") -> float:
        return frechet_distance(self.mu, self.sigma, other.mu, other.sigma)


def compute_statistics(features: np.ndarray | torch.Tensor) -> FeatureStatistics:
    """Mean and covariance of ``features`` (N, D) exactly as ADM: float64, ``np.cov(rowvar=False)``."""
    if isinstance(features, torch.Tensor):
        features = features.detach().cpu().numpy()
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2:
        raise ValueError(f"features must be 2-D (N, D), got shape {features.shape}")
    if features.shape[0] < 2:
        raise ValueError(
            f"need at least 2 feature vectors for a covariance, got {features.shape[0]}; "
            "evaluate more images"
        )
    return FeatureStatistics(mu=features.mean(axis=0), sigma=np.cov(features, rowvar=False))


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """Frechet distance between the Gaussians N(mu1, sigma1) and N(mu2, sigma2) (Heusel et al. 2017).

    ``d^2 = |mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^(1/2))``, the quantity ADM's
    ``FIDStatistics.frechet_distance`` computes with ``scipy.linalg.sqrtm(S1 S2)``.

    ``tr((S1 S2)^(1/2))`` is computed here by symmetric eigendecompositions in float64 instead:
    S1 S2 has the same eigenvalues as the symmetric PSD matrix ``A = S1^(1/2) S2 S1^(1/2)``,
    so the trace is ``sum(sqrt(eigvalsh(A)))``. This is exact for PSD inputs, faster than
    ``sqrtm`` at 2048 dimensions, needs no complex arithmetic, and does not depend on
    ``sqrtm``'s keyword arguments, which SciPy has changed. A sigma that is not symmetric
    positive semi-definite (a negative eigenvalue beyond rounding, :func:`check_psd`) is refused
    with ValueError. Eigenvalues below the
    numerical-rank tolerance ``max(eigenvalue) * D * eps`` (NumPy's ``matrix_rank`` convention)
    are rounding noise of a singular covariance and are set to zero: their square roots would
    otherwise add up to a spurious ~1e-7 relative error when N < D. float32 is not accurate
    enough here; do not downcast. For N < D, :func:`frechet_distance_from_features` is faster.
    """
    dtypes = (np.asarray(sigma1).dtype, np.asarray(sigma2).dtype)
    mu1 = np.asarray(mu1, dtype=np.float64)
    mu2 = np.asarray(mu2, dtype=np.float64)
    sigma1 = np.asarray(sigma1, dtype=np.float64)
    sigma2 = np.asarray(sigma2, dtype=np.float64)
    if mu1.ndim != 1 or mu2.ndim != 1:
        raise ValueError(f"mu1 and mu2 must be 1-D mean vectors, got shapes {mu1.shape} and {mu2.shape}")
    if mu1.shape != mu2.shape:
        raise ValueError(
            f"mean vectors have different lengths: {mu1.shape[0]} vs {mu2.shape[0]}; "
            "both sides must come from the same feature layer"
        )
    d = mu1.shape[0]
    for name, sigma in (("sigma1", sigma1), ("sigma2", sigma2)):
        if sigma.shape != (d, d):
            raise ValueError(f"{name} must have shape ({d}, {d}) to match the means, got {sigma.shape}")
        if not np.isfinite(sigma).all():
            raise ValueError(f"{name} contains NaN or infinite values")
        scale = max(float(np.abs(sigma).max()), np.finfo(np.float64).tiny)
        if float(np.abs(sigma - sigma.T).max()) > 1e-5 * scale:
            raise ValueError(f"{name} is not symmetric; pass a covariance matrix (e.g. np.cov(x, rowvar=False))")
    if not (np.isfinite(mu1).all() and np.isfinite(mu2).all()):
        raise ValueError("mean vectors contain NaN or infinite values")

    # eigh reads one triangle only; symmetrise so both triangles agree exactly.
    sigma1 = 0.5 * (sigma1 + sigma1.T)
    sigma2 = 0.5 * (sigma2 + sigma2.T)
    eigenvalues, eigenvectors = np.linalg.eigh(sigma1)
    check_psd(eigenvalues, "sigma1", dtypes[0])
    check_psd(np.linalg.eigvalsh(sigma2), "sigma2", dtypes[1])
    sqrt_sigma1 = (eigenvectors * np.sqrt(_drop_below_rank_tolerance(eigenvalues))) @ eigenvectors.T
    middle = sqrt_sigma1 @ sigma2 @ sqrt_sigma1
    middle = 0.5 * (middle + middle.T)
    tr_covmean = float(np.sqrt(_drop_below_rank_tolerance(np.linalg.eigvalsh(middle))).sum())

    diff = mu1 - mu2
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * tr_covmean)


def check_psd(eigenvalues: np.ndarray, name: str, dtype: np.dtype | None = None) -> None:
    """Refuse a covariance matrix, given its eigenvalues, with a negative eigenvalue beyond
    rounding: a covariance is positive semi-definite, and the Frechet distance of anything else
    is a meaningless number (even a negative "FID"). Rounding is what the matrix's storage
    precision (``dtype``; float64 when not floating) allows at its size, and never less than a
    millionth of the largest eigenvalue."""
    eigenvalues = np.asarray(eigenvalues, dtype=np.float64)
    if eigenvalues.size == 0:
        return
    eps = np.finfo(dtype if dtype is not None and np.issubdtype(dtype, np.floating) else np.float64).eps
    scale = float(np.abs(eigenvalues).max())
    tolerance = scale * max(4.0 * eigenvalues.size * float(eps), 1e-6)
    smallest = float(eigenvalues.min())
    if smallest < -tolerance:
        raise ValueError(
            f"{name} is not a covariance matrix: it has a negative eigenvalue ({smallest:.4g}, largest "
            f"{float(eigenvalues.max()):.4g}), so it is not positive semi-definite; the statistics are damaged or "
            "were not made as np.cov(features, rowvar=False)"
        )


def _drop_below_rank_tolerance(eigenvalues: np.ndarray) -> np.ndarray:
    tolerance = max(float(eigenvalues.max()), 0.0) * eigenvalues.shape[0] * np.finfo(np.float64).eps
    return np.where(eigenvalues > tolerance, eigenvalues, 0.0)


def frechet_distance_from_features(features1: np.ndarray | torch.Tensor, features2: np.ndarray | torch.Tensor) -> float:
    """Frechet distance between the Gaussians fitted to two feature sets (N1, D) and (N2, D).

    Same value as ``frechet_distance`` of their ``compute_statistics``, computed without D x D
    matrices: with ``A = (X1 - mu1) / sqrt(N1 - 1)`` and ``B`` likewise, ``S1 = A^T A`` and
    ``S2 = B^T B``, the non-zero eigenvalues of ``S1 S2`` are those of ``C C^T`` with
    ``C = A B^T`` (N1 x N2), so ``tr((S1 S2)^(1/2))`` is the sum of C's singular values and
    ``tr(S1) = |A|_F^2``. It costs O(N1 N2 D) instead of O(D^3), which is what makes small
    evaluations (tests, CPU demos, N < D) fast; with N >= D the covariance route is cheaper.
    """
    arrays = []
    for name, features in (("features1", features1), ("features2", features2)):
        if isinstance(features, torch.Tensor):
            features = features.detach().cpu().numpy()
        features = np.asarray(features, dtype=np.float64)
        if features.ndim != 2 or features.shape[0] < 2:
            raise ValueError(f"{name} must be 2-D (N >= 2, D), got shape {features.shape}")
        arrays.append(features)
    x1, x2 = arrays
    if x1.shape[1] != x2.shape[1]:
        raise ValueError(
            f"feature widths differ: {x1.shape[1]} vs {x2.shape[1]}; both sides must come from the same layer"
        )
    mu1, mu2 = x1.mean(axis=0), x2.mean(axis=0)
    a = (x1 - mu1) / math.sqrt(x1.shape[0] - 1)  # (N1, D)
    b = (x2 - mu2) / math.sqrt(x2.shape[0] - 1)  # (N2, D)
    tr_covmean = float(np.linalg.svd(a @ b.T, compute_uv=False).sum())
    diff = mu1 - mu2
    return float(diff @ diff + (a * a).sum() + (b * b).sum() - 2.0 * tr_covmean)
