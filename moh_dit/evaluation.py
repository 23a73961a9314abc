"""ADM-comparable evaluation of image samples: FID, sFID, Inception Score, precision, recall.

The numbers diffusion papers report (ADM, DiT, MoH-DiT) come from the TensorFlow evaluator of
guided-diffusion (``evaluations/evaluator.py``, Dhariwal & Nichol 2021). This module reproduces
that evaluator in PyTorch:

* Features come from torch-fidelity's TF-compatible InceptionV3 (``"inception-v3-compat"``,
  weights ``weights-inception-2015-12-05-6726825d.pth``), which reproduces the TF1 resize to
  299 and the ``(x - 128) / 128`` normalisation of the 2015 Inception graph. Other Inception
  ports (pytorch-fid's resize, torchmetrics' antialiased resize, clean-fid's PIL bicubic) give
  numbers that are not comparable to ADM's.
* FID (Heusel et al. 2017) on ``pool_3`` (2048 values); sFID (Nash et al. 2021) on the first
  7 channels of ``mixed_6/conv`` (``Mixed_6d.branch1x1``, 17 x 17 x 7 = 2023 values flattened
  height-width-channel); Inception Score (Salimans et al. 2016) on softmax(pool_3 @ W) without
  the bias, in splits of 5000 in order; improved precision and recall (Kynkaanniemi et al.
  2019) with k = 3 on pool_3 features, the reference side being the reference batch's images.
* Statistics in float64: ``np.mean`` and ``np.cov`` (unbiased, divides by N - 1).

Everything the ``scripts/evaluate.py`` front does is callable from here::

    >>> from moh_dit.evaluation import evaluate
    >>> result = evaluate("samples.npz", "VIRTUAL_imagenet256_labeled.npz", device="cuda")
    >>> result.fid, result.sfid, result.inception_score, result.precision, result.recall

A randomly initialised Inception (:func:`build_random_inception`) exists for offline demos and
tests only; its numbers are labelled as not comparable to published ones.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import numbers
import os
import tempfile
import urllib.request
import warnings
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Union

import numpy as np
import torch
from torch import nn

from .data import IMG_EXTENSIONS, CorruptImageError, load_image, read_image_size, scan_image_files
from .io_utils import atomic_write

__all__ = [
    "ADM_K",
    "ADM_SPLIT_SIZE",
    "INCEPTION_WEIGHTS_ENV",
    "INCEPTION_WEIGHTS_NAME",
    "INCEPTION_WEIGHTS_URL",
    "EvaluationResult",
    "ExtractedFeatures",
    "FeatureExtractor",
    "FeatureStatistics",
    "ImageSource",
    "InceptionFeatures",
    "InceptionWeightsNotFoundError",
    "NpzArrayReader",
    "ReferenceStatistics",
    "TFInceptionV3Features",
    "as_inception_features",
    "build_random_inception",
    "compute_statistics",
    "evaluate",
    "extract_features",
    "extractor_identity",
    "frechet_distance",
    "frechet_distance_from_features",
    "inception_score",
    "inception_score_from_logits",
    "load_inception",
    "load_reference",
    "manifold_radii_squared",
    "open_image_source",
    "precision_recall",
    "random_inception_state_dict",
    "resolve_inception_weights",
    "save_random_inception_weights",
    "tf32_disabled",
]

PathLike = Union[str, os.PathLike]

# torch-fidelity's conversion of the 2015-12-05 TF Inception graph (the same weights as
# pytorch-fid's pt_inception-2015-12-05-6726825d.pth). Following the torch hub convention,
# the 8 hex digits in the name are the start of the file's SHA-256; that is how a file is
# recognised as the published weights (and a randomly initialised one is not).
INCEPTION_WEIGHTS_NAME = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_WEIGHTS_URL = (
    "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/" + INCEPTION_WEIGHTS_NAME
)
INCEPTION_WEIGHTS_SHA256_PREFIX = "6726825d"
INCEPTION_WEIGHTS_ENV = "MOH_DIT_INCEPTION_WEIGHTS"

ADM_SPLIT_SIZE = 5000  # Inception Score split size of ADM's evaluator
ADM_K = 3  # neighbourhood size of ADM's precision/recall

NOT_COMPARABLE = "not comparable to published numbers"

_CACHE_FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Frechet distance (FID / sFID)
# ---------------------------------------------------------------------------------------------


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
    so the trace is ``sum(sqrt(eigvalsh(A)))``. This is exact for PSD inputs, about 5x faster
    than ``sqrtm`` at 2048 dimensions, needs no complex arithmetic, and does not depend on
    ``sqrtm``'s signature (SciPy 1.18 removed its ``disp`` argument). Eigenvalues below the
    numerical-rank tolerance ``max(eigenvalue) * D * eps`` (NumPy's ``matrix_rank`` convention)
    are rounding noise of a singular covariance and are set to zero: their square roots would
    otherwise add up to a spurious ~1e-7 relative error when N < D. float32 is not accurate
    enough here; do not downcast. For N < D, :func:`frechet_distance_from_features` is faster.
    """
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
    sqrt_sigma1 = (eigenvectors * np.sqrt(_drop_below_rank_tolerance(eigenvalues))) @ eigenvectors.T
    middle = sqrt_sigma1 @ sigma2 @ sqrt_sigma1
    middle = 0.5 * (middle + middle.T)
    tr_covmean = float(np.sqrt(_drop_below_rank_tolerance(np.linalg.eigvalsh(middle))).sum())

    diff = mu1 - mu2
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * tr_covmean)


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


# ---------------------------------------------------------------------------------------------
# Inception Score
# ---------------------------------------------------------------------------------------------


def inception_score(probs: np.ndarray | torch.Tensor, split_size: int = ADM_SPLIT_SIZE) -> float:
    """Inception Score (Salimans et al. 2016) of class probabilities ``probs`` (N, C), as ADM.

    ADM's ``compute_inception_score`` cuts the predictions *in order* into splits of
    ``split_size`` (the last split may be shorter), computes per split
    ``exp(mean_i sum_c p_ic (log p_ic - log mean_j p_jc))`` and returns the mean over splits.
    With 50,000 samples that is 10 splits of 5000; with fewer than ``split_size`` samples it is
    a single split (scores from few samples are biased low, so compare like with like).
    ``0 log 0`` is taken as 0.
    """
    if isinstance(probs, torch.Tensor):
        probs = probs.detach().cpu().numpy()
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or probs.shape[0] == 0:
        raise ValueError(f"probs must be a non-empty 2-D array (N, classes), got shape {probs.shape}")
    if split_size < 1:
        raise ValueError(f"split_size must be >= 1, got {split_size}")
    if (probs < 0).any() or not np.allclose(probs.sum(axis=1), 1.0, atol=1e-3):
        raise ValueError(
            "probs must be probabilities (non-negative, rows summing to 1); "
            "for raw logits use inception_score_from_logits"
        )
    scores = []
    for start in range(0, probs.shape[0], split_size):
        part = probs[start : start + split_size]
        marginal = part.mean(axis=0, keepdims=True)
        positive = part > 0
        # where p == 0 the term p (log p - log m) is 0; m > 0 wherever some p > 0.
        log_ratio = np.log(np.where(positive, part, 1.0)) - np.log(np.where(positive, marginal, 1.0))
        kl = np.where(positive, part * log_ratio, 0.0).sum(axis=1).mean()
        scores.append(math.exp(kl))
    return float(np.mean(scores))


def inception_score_from_logits(logits: np.ndarray | torch.Tensor, split_size: int = ADM_SPLIT_SIZE) -> float:
    """Inception Score from logits (N, C): softmax in float64, then :func:`inception_score`.

    For ADM's number the logits are ``pool_3 @ W`` without the bias (torch-fidelity's
    ``"logits_unbiased"``), which is what :class:`TFInceptionV3Features` returns.
    """
    if isinstance(logits, torch.Tensor):
        logits = logits.detach().cpu().numpy()
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 2:
        raise ValueError(f"logits must be 2-D (N, classes), got shape {logits.shape}")
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return inception_score(exp / exp.sum(axis=1, keepdims=True), split_size=split_size)


# ---------------------------------------------------------------------------------------------
# Improved precision and recall (Kynkaanniemi et al. 2019)
# ---------------------------------------------------------------------------------------------


def _squared_distances_float(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # |u|^2 - 2 u.v + |v|^2 with one matmul, clamped at 0 against cancellation (as ADM).
    norm_u = (u * u).sum(dim=1, keepdim=True)  # (R, 1)
    norm_v = (v * v).sum(dim=1).unsqueeze(0)  # (1, C)
    return (norm_u - 2.0 * (u @ v.T) + norm_v).clamp_min_(0.0)  # (R, C)


def _squared_distances(u: torch.Tensor, v: torch.Tensor, adm_float16: bool) -> torch.Tensor:
    """Pairwise squared Euclidean distances (R, C) between rows of ``u`` and ``v``.

    ADM's ``DistanceBlock`` computes them in float16 and falls back to float32 only when the
    float16 block has non-finite values. ``adm_float16=True`` emulates that: inputs rounded to
    float16, arithmetic in float32, the block rounded to float16; which samples land inside a
    radius depends on this rounding, so it is the default for ADM-comparable numbers.
    """
    if adm_float16:
        block = _squared_distances_float(u.half().float(), v.half().float()).half()
        if bool(torch.isfinite(block).all()):
            return block.float()
    return _squared_distances_float(u, v)


def _as_float_tensor(features: np.ndarray | torch.Tensor, device: torch.device | str | None, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(np.asarray(features) if not isinstance(features, torch.Tensor) else features)
    if tensor.ndim != 2:
        raise ValueError(f"{name} must be 2-D (N, D), got shape {tuple(tensor.shape)}")
    return tensor.to(device=device if device is not None else tensor.device, dtype=torch.float32)


@torch.no_grad()
def manifold_radii_squared(
    features: np.ndarray | torch.Tensor,
    k: int = ADM_K,
    *,
    batch_size: int = 4096,
    device: torch.device | str | None = None,
    adm_float16: bool = True,
) -> torch.Tensor:
    """Squared radius of each feature's k-NN ball (Kynkaanniemi et al. 2019; ADM's ``manifold_radii``).

    The radius of point i is its distance to its k-th nearest neighbour other than itself:
    ADM sorts each row of the distance matrix, which includes the zero self-distance at
    position 0, and takes position k. Distances are computed in (batch_size x batch_size)
    blocks and only the k + 1 smallest per row are kept, so 50k x 50k never materialises.
    Returns a float32 tensor (N,) of squared distances on ``device``.
    """
    x = _as_float_tensor(features, device, "features")
    n = x.shape[0]
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if n < k + 1:
        raise ValueError(f"need more than k={k} feature vectors to estimate k-NN radii, got {n}")
    radii = torch.empty(n, dtype=torch.float32, device=x.device)
    for start in range(0, n, batch_size):
        rows = x[start : start + batch_size]
        smallest = torch.full((rows.shape[0], k + 1), math.inf, device=x.device)  # (R, k+1)
        for col_start in range(0, n, batch_size):
            block = _squared_distances(rows, x[col_start : col_start + batch_size], adm_float16)  # (R, C)
            merged = torch.cat([smallest, block], dim=1)
            smallest = merged.topk(min(k + 1, merged.shape[1]), dim=1, largest=False).values
        radii[start : start + rows.shape[0]] = smallest[:, k]
    return radii


@torch.no_grad()
def precision_recall(
    reference_features: np.ndarray | torch.Tensor,
    sample_features: np.ndarray | torch.Tensor,
    k: int = ADM_K,
    *,
    batch_size: int = 4096,
    device: torch.device | str | None = None,
    adm_float16: bool = True,
) -> tuple[float, float]:
    """Improved precision and recall (Kynkaanniemi et al. 2019) as ADM's ``compute_prec_recall``.

    Each set's manifold is the union of balls around its points with their k-NN radius
    (:func:`manifold_radii_squared`). Precision is the fraction of samples inside the reference
    manifold; recall the fraction of reference points inside the sample manifold. A point on a
    ball's boundary counts as inside (``<=``, as ADM). ADM uses k = 3 and pool_3 features of the
    reference batch's 10k images. Work is blocked so only (batch_size x batch_size) distances
    exist at a time.
    """
    ref = _as_float_tensor(reference_features, device, "reference_features")
    smp = _as_float_tensor(sample_features, ref.device, "sample_features")
    if ref.shape[1] != smp.shape[1]:
        raise ValueError(
            f"reference and sample features have different widths: {ref.shape[1]} vs {smp.shape[1]}"
        )
    ref_radii = manifold_radii_squared(ref, k, batch_size=batch_size, adm_float16=adm_float16)
    smp_radii = manifold_radii_squared(smp, k, batch_size=batch_size, adm_float16=adm_float16)
    sample_inside = torch.zeros(smp.shape[0], dtype=torch.bool, device=ref.device)
    reference_inside = torch.zeros(ref.shape[0], dtype=torch.bool, device=ref.device)
    for i in range(0, ref.shape[0], batch_size):
        for j in range(0, smp.shape[0], batch_size):
            block = _squared_distances(ref[i : i + batch_size], smp[j : j + batch_size], adm_float16)  # (R, S)
            sample_inside[j : j + batch_size] |= (block <= ref_radii[i : i + batch_size, None]).any(dim=0)
            reference_inside[i : i + batch_size] |= (block <= smp_radii[None, j : j + batch_size]).any(dim=1)
    precision = sample_inside.double().mean().item()
    recall = reference_inside.double().mean().item()
    return float(precision), float(recall)


# ---------------------------------------------------------------------------------------------
# Feature extractor protocol
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class InceptionFeatures:
    """Features of one batch of N images, the output contract of every feature extractor.

    ``pool`` feeds FID and precision/recall, ``logits`` (pre-softmax) the Inception Score and
    ``spatial`` sFID. ``logits`` and ``spatial`` may be None; the matching metric is then
    reported as None.
    """

    pool: torch.Tensor  # (N, D_pool)
    logits: torch.Tensor | None = None  # (N, classes)
    spatial: torch.Tensor | None = None  # (N, D_spatial)


class FeatureExtractor(nn.Module, abc.ABC):
    """Maps uint8 images (N, 3, H, W) in [0, 255] to :class:`InceptionFeatures`.

    Subclass it to evaluate other domains. ``identity`` names the extractor *and its weights*;
    cached reference statistics are keyed on it, so two extractors with different weights must
    have different identities. ``pool_dim``/``spatial_dim`` (optional) let stored reference
    statistics be checked before any image is processed. Any plain ``nn.Module`` returning a
    dict (``pool``, ``logits``, ``spatial``) or a tuple in that order is accepted as well; see
    :func:`as_inception_features` and :func:`extractor_identity`.
    """

    identity: str = ""
    comparable_to_published: bool = False
    pool_dim: int | None = None
    spatial_dim: int | None = None

    @abc.abstractmethod
    def forward(self, images: torch.Tensor) -> InceptionFeatures:
        """``images``: uint8 (N, 3, H, W) in [0, 255] on the extractor's device."""


def as_inception_features(output: Any) -> InceptionFeatures:
    """Normalise an extractor's output (InceptionFeatures, dict or tuple) to :class:`InceptionFeatures`."""
    if isinstance(output, InceptionFeatures):
        return output
    if isinstance(output, Mapping):
        unknown = set(output) - {"pool", "logits", "spatial"}
        if "pool" not in output or unknown:
            raise ValueError(
                "a feature extractor returning a dict must use the keys 'pool' (required), "
                f"'logits' and 'spatial'; got {sorted(output)}"
            )
        return InceptionFeatures(output["pool"], output.get("logits"), output.get("spatial"))
    if isinstance(output, (tuple, list)) and 1 <= len(output) <= 3:
        return InceptionFeatures(*output)
    if isinstance(output, torch.Tensor):
        return InceptionFeatures(output)
    raise TypeError(
        "a feature extractor must return InceptionFeatures, a dict with 'pool'/'logits'/'spatial', "
        f"or a tuple (pool, logits, spatial); got {type(output).__name__}"
    )


def extractor_identity(extractor: nn.Module) -> str:
    """The cache/metadata identity of ``extractor``.

    Uses its ``identity`` attribute when set; otherwise a fingerprint of its class and weights,
    so a plain ``nn.Module`` cannot silently reuse statistics cached for other weights.
    """
    identity = getattr(extractor, "identity", "")
    if identity:
        return str(identity)
    digest = hashlib.sha256(type(extractor).__qualname__.encode())
    for name, tensor in sorted(extractor.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return f"{type(extractor).__qualname__}:sha256={digest.hexdigest()[:16]}"


# ---------------------------------------------------------------------------------------------
# TF-compatible InceptionV3 (torch-fidelity)
# ---------------------------------------------------------------------------------------------


class InceptionWeightsNotFoundError(FileNotFoundError):
    """The InceptionV3 weights file could not be found or downloaded."""


@contextlib.contextmanager
def tf32_disabled() -> Iterator[None]:
    """Run the block with TF32 off for CUDA matmuls and convolutions, then restore the settings.

    TF32 keeps 10 mantissa bits; Inception features computed with it drift enough to move FID
    in the second decimal, so extraction always runs in full float32. torch >= 2.9 has the
    ``fp32_precision`` switches and raises when they are mixed with the legacy ``allow_tf32``
    flags, so only the new switches are touched where they exist.
    """
    matmul, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    if hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision"):
        saved = (matmul.fp32_precision, conv.fp32_precision)
        try:
            matmul.fp32_precision = conv.fp32_precision = "ieee"
            yield
        finally:
            matmul.fp32_precision, conv.fp32_precision = saved
        return
    cudnn = torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    try:
        matmul.allow_tf32 = cudnn.allow_tf32 = False
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_uint8_nchw(images: torch.Tensor) -> None:
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8:
        raise TypeError(f"expected a uint8 torch.Tensor (N, 3, H, W), got {getattr(images, 'dtype', type(images))}")
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images of shape (N, 3, H, W), got {tuple(images.shape)}")


class TFInceptionV3Features(FeatureExtractor):
    """ADM's feature layers from torch-fidelity's TF-compatible InceptionV3.

    ``pool`` = pool_3 (2048), ``logits`` = pool_3 @ W without bias (1008, torch-fidelity's
    ``"logits_unbiased"``) and ``spatial`` = ``Mixed_6d.branch1x1`` (the TF graph's
    ``mixed_6/conv``, post-ReLU, (N, 192, 17, 17)) cut to channels [:7] and flattened in
    height-width-channel order (ADM slices ``[..., :7]`` of an NHWC tensor), 2023 values.
    The spatial layer is read with a forward hook so the forward pass is torch-fidelity's own.
    Extraction runs in float32 with TF32 disabled.
    """

    pool_dim = 2048
    spatial_dim = 17 * 17 * 7
    num_logits = 1008

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        identity: str,
        comparable_to_published: bool = False,
        weights_info: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        # torch-fidelity only loads weights from a path/file object (with pickle); hand it the
        # already validated tensors through memory so its own constructor and strict load run.
        buffer = io.BytesIO()
        torch.save(dict(state_dict), buffer)
        buffer.seek(0)
        try:
            self.inception = FeatureExtractorInceptionV3(
                "inception-v3-compat",
                features_list=["2048", "logits_unbiased"],
                feature_extractor_weights_path=buffer,
            )
        except RuntimeError as error:
            raise ValueError(
                "the weights are not a TF-compatible InceptionV3 state dict in torch-fidelity / "
                f"pytorch-fid format ({INCEPTION_WEIGHTS_NAME}): {error}"
            ) from error
        self.identity = identity
        self.comparable_to_published = comparable_to_published
        self.weights_info = dict(weights_info or {})
        self._spatial: torch.Tensor | None = None
        self.inception.Mixed_6d.branch1x1.register_forward_hook(self._capture_spatial)

    @classmethod
    def from_file(cls, path: PathLike) -> "TFInceptionV3Features":
        """Load weights from ``path`` (a ``.pth`` state dict), safely (``weights_only=True``)."""
        path = Path(path)
        if not path.is_file():
            raise InceptionWeightsNotFoundError(f"Inception weights file not found: {path}")
        sha256 = _sha256_file(path)
        try:
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # corrupt file, HTML page saved as .pth, ...
            raise ValueError(f"could not read Inception weights {path}: {error}") from error
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"{path} does not hold a state dict (got {type(state_dict).__name__})")
        comparable = sha256.startswith(INCEPTION_WEIGHTS_SHA256_PREFIX)
        return cls(
            state_dict,
            identity=f"tf-inception-v3-compat:sha256={sha256[:16]}",
            comparable_to_published=comparable,
            weights_info={"path": str(path.resolve()), "name": path.name, "sha256": sha256},
        )

    def _capture_spatial(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        n = output.shape[0]
        self._spatial = output[:, :7].permute(0, 2, 3, 1).reshape(n, -1).float()  # (N, 17*17*7) HWC

    def forward(self, images: torch.Tensor) -> InceptionFeatures:
        _check_uint8_nchw(images)
        self._spatial = None
        with tf32_disabled(), torch.no_grad():
            pool, logits = self.inception(images)  # (N, 2048), (N, 1008)
        spatial, self._spatial = self._spatial, None
        return InceptionFeatures(pool=pool, logits=logits, spatial=spatial)


def _download_weights(destination: Path, timeout: float) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=destination.parent, prefix=destination.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(INCEPTION_WEIGHTS_URL, timeout=timeout) as response:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                out.write(chunk)
        sha256 = _sha256_file(Path(tmp))
        if not sha256.startswith(INCEPTION_WEIGHTS_SHA256_PREFIX):
            raise OSError(
                f"downloaded file has SHA-256 {sha256}, expected it to start with {INCEPTION_WEIGHTS_SHA256_PREFIX}"
            )
        os.replace(tmp, destination)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def resolve_inception_weights(
    path: PathLike | None = None, *, download: bool = True, timeout: float = 10.0
) -> Path:
    """Find the Inception weights file.

    Order: ``path`` > environment variable ``MOH_DIT_INCEPTION_WEIGHTS`` > torch hub cache
    (``torch.hub.get_dir()/checkpoints/weights-inception-2015-12-05-6726825d.pth``) > a download
    from torch-fidelity's release into that cache (``download=True``, ``timeout`` seconds per
    network operation). An explicit path or environment variable that points nowhere is an
    error rather than a silent fallback. Raises :class:`InceptionWeightsNotFoundError` saying
    where to put the file and where to get it.
    """
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise InceptionWeightsNotFoundError(
                f"Inception weights file not found: {path}. Download {INCEPTION_WEIGHTS_URL} "
                "and pass its path."
            )
        return path
    from_env = os.environ.get(INCEPTION_WEIGHTS_ENV)
    if from_env:
        env_path = Path(from_env).expanduser()
        if not env_path.is_file():
            raise InceptionWeightsNotFoundError(
                f"{INCEPTION_WEIGHTS_ENV}={from_env} does not point to a file. Download "
                f"{INCEPTION_WEIGHTS_URL} there, or unset the variable."
            )
        return env_path
    cached = Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_WEIGHTS_NAME
    if cached.is_file():
        return cached
    failure = "downloading was disabled"
    if download:
        try:
            _download_weights(cached, timeout)
            return cached
        except Exception as error:  # no network, proxy, timeout, bad file: all end in the same advice
            failure = f"the download failed ({type(error).__name__}: {error})"
    raise InceptionWeightsNotFoundError(
        f"InceptionV3 weights not found and {failure}. Get {INCEPTION_WEIGHTS_URL} "
        f"on a machine with internet and either put it at {cached}, set "
        f"{INCEPTION_WEIGHTS_ENV}=/path/to/{INCEPTION_WEIGHTS_NAME}, or pass the path "
        "explicitly (--inception-weights FILE)."
    )


def load_inception(
    weights: PathLike | None = None, *, download: bool = True, timeout: float = 10.0
) -> TFInceptionV3Features:
    """The ADM-comparable extractor with weights found by :func:`resolve_inception_weights`."""
    return TFInceptionV3Features.from_file(resolve_inception_weights(weights, download=download, timeout=timeout))


class _InceptionV3Architecture(nn.Module):
    """torch-fidelity's InceptionV3 layer layout without weights, to make random state dicts.

    The attribute names and blocks are torch-fidelity's own, so the state dict loads strictly
    into ``FeatureExtractorInceptionV3`` (which :class:`TFInceptionV3Features` verifies).
    """

    def __init__(self) -> None:
        super().__init__()
        from torch_fidelity.feature_extractor_inceptionv3 import (
            BasicConv2d,
            InceptionA,
            InceptionB,
            InceptionC,
            InceptionD,
            InceptionE_1,
            InceptionE_2,
        )

        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, channels_7x7=128)
        self.Mixed_6c = InceptionC(768, channels_7x7=160)
        self.Mixed_6d = InceptionC(768, channels_7x7=160)
        self.Mixed_6e = InceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE_1(1280)
        self.Mixed_7c = InceptionE_2(2048)
        self.fc = nn.Linear(2048, 1008)


def random_inception_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded random InceptionV3 state dict (torch-fidelity layout); results are not comparable.

    Conv weights are Kaiming-normal (fan-in, ReLU gain: std = sqrt(2 / fan_in)) so activations
    keep their scale through the 94 conv layers; with PyTorch's default init pool_3 collapses
    to nearly constant features (FID ~ 1e-13 between unrelated image sets), useless even for
    tests. Batch norms are identities, the classifier is normal with std 1/sqrt(2048). Values
    are drawn from one seeded CPU generator, so the same seed gives the same weights anywhere.
    """
    generator = torch.Generator().manual_seed(seed)
    model = _InceptionV3Architecture()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                fan_in = module.weight[0].numel()
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * math.sqrt(2.0 / fan_in))
            elif isinstance(module, nn.BatchNorm2d):
                module.reset_parameters()  # weight 1, bias 0, running mean 0, running var 1
            elif isinstance(module, nn.Linear):
                std = 1.0 / math.sqrt(module.in_features)
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                module.bias.zero_()
    return model.state_dict()


def build_random_inception(seed: int = 0) -> TFInceptionV3Features:
    """TF-compatible InceptionV3 with random weights, for the offline CPU demo and tests.

    Its numbers are NOT comparable to published numbers; its identity and every result made
    with it say so.
    """
    return TFInceptionV3Features(
        random_inception_state_dict(seed),
        identity=f"tf-inception-v3-compat:RANDOM-kaiming-seed={seed}",
        comparable_to_published=False,
        weights_info={"name": f"random-kaiming-seed={seed}", "note": NOT_COMPARABLE},
    )


def save_random_inception_weights(path: PathLike, seed: int = 0) -> Path:
    """Write :func:`random_inception_state_dict` to ``path`` (atomically), loadable like the real file.

    Results made with it are flagged as not comparable, because its SHA-256 is not the
    published file's.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(random_inception_state_dict(seed), f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


# ---------------------------------------------------------------------------------------------
# Image sources: ADM .npz (streamed), image folders, in-memory batches
# ---------------------------------------------------------------------------------------------


def _read_exactly(f: BinaryIO, out: np.ndarray, what: str) -> None:
    view = memoryview(out.reshape(-1).view(np.uint8))
    filled = 0
    while filled < len(view):
        n = f.readinto(view[filled:])
        if not n:
            raise ValueError(f"{what} ended early: read {filled} of {len(view)} bytes; the file is truncated")
        filled += n


def _zip_member_names(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.namelist()
    except zipfile.BadZipFile as error:
        raise ValueError(f"{path} is not a valid .npz (zip) file: {error}") from error


class NpzArrayReader:
    """Stream one array of an ``.npz`` in chunks along its first axis, without loading it.

    ``np.load(mmap_mode=...)`` cannot map arrays inside a zip, and DiT's 50k-sample file is
    ~9.8 GB, so the ``.npy`` member is opened through ``zipfile`` (stored or deflated alike),
    its header parsed with ``numpy.lib.format`` and the data read ``batch_size`` rows at a time.
    Opening validates the header; every :meth:`iter_batches` call re-opens the file.
    """

    def __init__(self, path: PathLike, key: str = "arr_0") -> None:
        self.path = Path(path)
        self.key = key
        if not self.path.is_file():
            raise FileNotFoundError(f"npz file not found: {self.path}")
        names = _zip_member_names(self.path)
        if f"{key}.npy" not in names:
            keys = sorted(n[:-4] for n in names if n.endswith(".npy"))
            raise ValueError(f"{self.path} has no array '{key}' (arrays: {keys})")
        with self._open() as f:
            self.shape, self.dtype, self._data_offset = self._read_header(f)

    @contextlib.contextmanager
    def _open(self) -> Iterator[BinaryIO]:
        with zipfile.ZipFile(self.path) as archive, archive.open(f"{self.key}.npy") as member:
            yield member

    def _read_header(self, f: BinaryIO) -> tuple[tuple[int, ...], np.dtype, int]:
        fmt = np.lib.format
        try:
            version = fmt.read_magic(f)
            if version == (1, 0):
                shape, fortran_order, dtype = fmt.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran_order, dtype = fmt.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy format version {version}")
        except (zipfile.BadZipFile, EOFError) as error:  # small members are CRC-checked on the first read
            raise ValueError(f"'{self.key}' in {self.path} is corrupt: {error}") from error
        except ValueError as error:
            raise ValueError(f"cannot read '{self.key}' in {self.path}: {error}") from error
        if fortran_order or dtype.hasobject:
            raise ValueError(
                f"'{self.key}' in {self.path} is stored {'in Fortran order' if fortran_order else 'as objects'}, "
                "which cannot be streamed; re-save it with np.savez(path, arr_0=np.ascontiguousarray(x))"
            )
        return tuple(shape), dtype, f.tell()

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def iter_batches(self, batch_size: int) -> Iterator[np.ndarray]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        with self._open() as f:
            f.read(self._data_offset)  # skip magic + header (zip members cannot always seek cheaply)
            for start in range(0, len(self), batch_size):
                batch = np.empty((min(batch_size, len(self) - start), *self.shape[1:]), dtype=self.dtype)
                try:
                    _read_exactly(f, batch, f"'{self.key}' in {self.path}")
                except (zipfile.BadZipFile, EOFError, OSError) as error:  # bad CRC, cut-off deflate stream
                    raise ValueError(f"'{self.key}' in {self.path} is corrupt at image {start}: {error}") from error
                yield batch


def _check_nhwc_shape(shape: tuple[int, ...], where: str) -> None:
    if len(shape) != 4 or shape[-1] != 3:
        looks_nchw = len(shape) == 4 and shape[1] == 3
        hint = " (it looks like NCHW; permute to NHWC with .permute(0, 2, 3, 1))" if looks_nchw else ""
        raise ValueError(f"{where}: images must be RGB in NHWC layout (N, H, W, 3), got shape {tuple(shape)}{hint}")
    if shape[1] != shape[2]:
        raise ValueError(f"{where}: images must be square, got {shape[1]}x{shape[2]}; center-crop them first")


def _to_uint8_nhwc(batch: Any, where: str) -> torch.Tensor:
    """Check an image batch is uint8 (N, H, W, 3) with H == W and return it as a tensor."""
    if isinstance(batch, np.ndarray):
        if batch.dtype != np.uint8:
            raise ValueError(
                f"{where}: images must be uint8 in [0, 255] (N, H, W, 3), got dtype {batch.dtype}; "
                "convert like ADM: np.clip(np.round(x * 255), 0, 255).astype(np.uint8) for x in [0, 1]"
            )
        batch = torch.from_numpy(batch if batch.flags.writeable else batch.copy())
    elif not isinstance(batch, torch.Tensor):
        raise TypeError(f"{where}: expected a numpy array or torch tensor batch, got {type(batch).__name__}")
    if batch.dtype != torch.uint8:
        raise ValueError(
            f"{where}: images must be uint8 in [0, 255] (N, H, W, 3), got dtype {batch.dtype}; "
            "convert with (x * 255).round().clamp(0, 255).to(torch.uint8)"
        )
    _check_nhwc_shape(tuple(batch.shape), where)
    return batch


class ImageSource(abc.ABC):
    """A set of square RGB uint8 images, yielded as (N, H, W, 3) batches in a fixed order.

    Constructors validate everything that can be checked without decoding all images, so bad
    inputs fail before the expensive feature extraction.
    """

    description: str = ""
    num_images: int | None = None  # None when unknown in advance (iterators)
    resolution: int | None = None

    @abc.abstractmethod
    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        """uint8 (N, H, W, 3) tensors, at most ``batch_size`` images each."""

    def fingerprint(self) -> str | None:
        """A string that changes when the images change (for caching); None if not cacheable."""
        return None


class NpzImageSource(ImageSource):
    """``arr_0`` (N, H, W, 3) uint8 of an ADM-style ``.npz``, streamed."""

    def __init__(self, path: PathLike, key: str = "arr_0") -> None:
        self.reader = NpzArrayReader(path, key)
        shape, dtype = self.reader.shape, self.reader.dtype
        where = f"'{key}' in {self.reader.path}"
        if dtype != np.uint8:
            raise ValueError(f"{where}: images must be uint8 (N, H, W, 3), got dtype {dtype}")
        _check_nhwc_shape(shape, where)
        if shape[0] == 0:
            raise ValueError(f"{where} holds no images")
        self.num_images, self.resolution = shape[0], shape[1]
        self.description = str(self.reader.path)

    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        for batch in self.reader.iter_batches(batch_size):
            yield torch.from_numpy(batch)

    def fingerprint(self) -> str:
        stat = self.reader.path.stat()
        return json.dumps(["npz", str(self.reader.path.resolve()), self.reader.key, stat.st_size, stat.st_mtime_ns])


class _ImageFiles(torch.utils.data.Dataset):
    def __init__(self, files: list[Path], resolution: int) -> None:
        self.files, self.resolution = files, resolution

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> np.ndarray:
        # The package's one loader: 16-bit and float images keep their values (see load_image).
        try:
            array = np.array(load_image(self.files[index]))  # (H, W, 3) uint8
        except CorruptImageError as error:
            cause = error.__cause__ or error
            raise ValueError(
                f"cannot read image {self.files[index]}: {type(cause).__name__}: {cause}; replace or delete the file"
            ) from error
        if array.shape != (self.resolution, self.resolution, 3):
            expected = (self.resolution, self.resolution, 3)
            raise ValueError(f"{self.files[index]} decoded to {array.shape}, expected {expected}")
        return array


def _stack_images(arrays: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(arrays))


class FolderImageSource(ImageSource):
    """All images under a folder (recursive, :data:`moh_dit.data.IMG_EXTENSIONS`), sorted by relative path.

    The folder is scanned by :func:`moh_dit.data.scan_image_files` (hidden names ignored, links
    to folders followed, no folder entered twice) and images are read by
    :func:`moh_dit.data.load_image` (grey, CMYK, palette and 16-bit files are converted to 8-bit
    RGB keeping their values; alpha is dropped, as ADM's ``convert("RGB")``). All images must be
    square and of one size; each header is read up front so a bad file fails early.
    """

    def __init__(self, path: PathLike) -> None:
        self.root = Path(path)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder not found: {self.root}")
        files = [Path(p) for p in scan_image_files(self.root)]
        if not files:
            raise ValueError(f"no images ({', '.join(IMG_EXTENSIONS)}) found under {self.root}")
        size = None
        for file in files:
            try:
                file_size = read_image_size(file)  # header only, no decode
            except CorruptImageError as error:
                raise ValueError(f"{error}; replace or delete the file") from error
            if file_size[0] != file_size[1]:
                raise ValueError(
                    f"{file} is {file_size[0]}x{file_size[1]}; images must be square (center-crop them first)"
                )
            if size is None:
                size = file_size
            elif file_size != size:
                raise ValueError(
                    f"{file} is {file_size[0]}x{file_size[1]} but {files[0]} is {size[0]}x{size[1]}; "
                    "all images in a folder must have the same size"
                )
        self.files = files
        self.num_images, self.resolution = len(files), size[0]
        self.description = str(self.root)

    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        loader = torch.utils.data.DataLoader(
            _ImageFiles(self.files, self.resolution),
            batch_size=batch_size,
            shuffle=False,
            num_workers=num_workers,
            collate_fn=_stack_images,
        )
        yield from loader

    def fingerprint(self) -> str:
        listing = []
        for file in self.files:
            stat = file.stat()
            listing.append([file.relative_to(self.root).as_posix(), stat.st_size, stat.st_mtime_ns])
        digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
        return json.dumps(["folder", str(self.root.resolve()), digest])


class _TensorImageSource(ImageSource):
    """One in-memory uint8 (N, H, W, 3) array or tensor."""

    def __init__(self, images: np.ndarray | torch.Tensor) -> None:
        self.images = _to_uint8_nhwc(images, "images")
        if self.images.shape[0] == 0:
            raise ValueError("images: the array holds no images")
        self.num_images, self.resolution = self.images.shape[0], self.images.shape[1]
        self.description = f"<array of {self.num_images} images>"

    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        yield from self.images.split(batch_size)


class _IterableImageSource(ImageSource):
    """Batches from an iterator (e.g. a sampling pipeline); each batch is validated as it comes."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self._batches = batches
        self._iterator: Iterator[Any] | None = None
        self._first: torch.Tensor | None = None
        self.description = "<iterator of image batches>"

    def peek_resolution(self) -> int | None:
        """Take (and keep) the first batch to learn the resolution before any feature is computed."""
        if self.resolution is None and self._iterator is None:
            self._iterator = iter(self._batches)
            first = next(self._iterator, None)
            if first is not None:
                self._first = _to_uint8_nhwc(first, "batch 0")
                self.resolution = self._first.shape[1]
        return self.resolution

    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        iterator = self._iterator if self._iterator is not None else iter(self._batches)
        first, self._first, self._iterator = self._first, None, None
        start = 0
        if first is not None:
            start = 1
            yield from first.split(batch_size)
        for index, batch in enumerate(iterator, start=start):
            batch = _to_uint8_nhwc(batch, f"batch {index}")
            if self.resolution is None:
                self.resolution = batch.shape[1]
            elif batch.shape[1] != self.resolution:
                raise ValueError(
                    f"batch {index} is {batch.shape[1]}x{batch.shape[2]} but the first batch was "
                    f"{self.resolution}x{self.resolution}; all samples must have one resolution"
                )
            yield from batch.split(batch_size)


def open_image_source(images: Any) -> ImageSource:
    """An :class:`ImageSource` for a folder, an ``.npz`` (``arr_0``), an array/tensor or an iterable of batches."""
    if isinstance(images, ImageSource):
        return images
    if isinstance(images, (str, os.PathLike)):
        path = Path(images)
        if not path.exists():
            raise FileNotFoundError(f"no such file or folder: {path}")
        if path.is_dir():
            return FolderImageSource(path)
        if zipfile.is_zipfile(path):
            return NpzImageSource(path)
        raise ValueError(f"{path} is neither a folder of images nor an .npz file with 'arr_0'")
    if isinstance(images, (np.ndarray, torch.Tensor)):
        return _TensorImageSource(images)
    if isinstance(images, Iterable):
        return _IterableImageSource(images)
    raise TypeError(f"cannot read images from {type(images).__name__}")


# ---------------------------------------------------------------------------------------------
# Feature extraction
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ExtractedFeatures:
    """Features of a whole image set, float32 numpy arrays in image order."""

    pool: np.ndarray  # (N, D_pool)
    logits: np.ndarray | None  # (N, classes)
    spatial: np.ndarray | None  # (N, D_spatial)

    def __len__(self) -> int:
        return self.pool.shape[0]


def _collect(parts: list[torch.Tensor | None], name: str) -> np.ndarray | None:
    if any(p is None for p in parts):
        if not all(p is None for p in parts):
            raise ValueError(f"the feature extractor returned '{name}' for some batches but not for others")
        return None
    return torch.cat(parts).numpy()


@torch.no_grad()
def extract_features(
    images: Any,
    extractor: nn.Module,
    *,
    device: torch.device | str = "cpu",
    batch_size: int = 64,
    num_workers: int = 0,
    progress: bool = False,
) -> ExtractedFeatures:
    """Run ``extractor`` over ``images`` (anything :func:`open_image_source` takes) in batches.

    The extractor is moved to ``device`` and put in eval mode; batches go to ``device`` as
    uint8 NCHW and features come back to the CPU as float32.
    """
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    source = open_image_source(images)
    extractor = extractor.to(device).eval()
    pools, logits, spatials = [], [], []
    bar = tqdm(total=source.num_images, desc=f"features {source.description}", unit="img", disable=not progress)
    with bar, tf32_disabled():
        for batch in source.batches(batch_size, num_workers):
            nchw = batch.to(device, non_blocking=True).permute(0, 3, 1, 2).contiguous()  # (N, 3, H, W)
            features = as_inception_features(extractor(nchw))
            n = nchw.shape[0]
            for name, value in (("pool", features.pool), ("logits", features.logits), ("spatial", features.spatial)):
                if value is not None and (value.ndim != 2 or value.shape[0] != n):
                    raise ValueError(
                        f"feature '{name}' must have shape ({n}, D) for a batch of {n}, got {tuple(value.shape)}"
                    )
            pools.append(features.pool.float().cpu())
            logits.append(None if features.logits is None else features.logits.float().cpu())
            spatials.append(None if features.spatial is None else features.spatial.float().cpu())
            bar.update(n)
    if not pools:
        raise ValueError(f"{source.description} yielded no images")
    return ExtractedFeatures(
        pool=torch.cat(pools).numpy(), logits=_collect(logits, "logits"), spatial=_collect(spatials, "spatial")
    )


# ---------------------------------------------------------------------------------------------
# Reference statistics (ADM reference batch or real images), cached on disk
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ReferenceStatistics:
    """Everything the metrics need from the reference side.

    ``pool``/``spatial`` are FID/sFID statistics (for an ADM reference batch, the stored
    training-set statistics ``mu``/``sigma`` and ``mu_s``/``sigma_s``); ``pool_features`` are the
    pool_3 features of the reference images for precision/recall (None when the reference has
    no images). ``extractor`` is the identity of the extractor that made them. When the
    statistics were computed from the reference images (``statistics_from_images``), FID and
    sFID of small sets use the features directly (:func:`frechet_distance_from_features`).
    """

    pool: FeatureStatistics
    spatial: FeatureStatistics | None
    pool_features: np.ndarray | None  # (N_ref, D_pool) float32
    num_images: int | None
    source: str
    extractor: str
    resolution: int | None = None
    from_cache: bool = False
    statistics_from_images: bool = False  # False for ADM's stored training-set statistics
    spatial_features: np.ndarray | None = None  # (N_ref, D_spatial), kept only when N_ref <= D_spatial


@dataclasses.dataclass
class _ReferenceSpec:
    """A validated, not yet computed reference."""

    path: Path
    kind: str  # "adm_npz" (stored statistics) or "images"
    images: ImageSource | None
    stored: dict[str, np.ndarray] | None


def _inspect_reference(reference: PathLike) -> _ReferenceSpec:
    path = Path(reference)
    if not path.exists():
        raise FileNotFoundError(f"reference not found: {path}")
    if path.is_dir():
        return _ReferenceSpec(path, "images", FolderImageSource(path), None)
    names = [n[:-4] for n in _zip_member_names(path) if n.endswith(".npy")]
    present = [key for key in ("mu", "sigma", "mu_s", "sigma_s") if key in names]
    if present:
        for first, second in (("mu", "sigma"), ("mu_s", "sigma_s")):
            if (first in names) != (second in names):
                have, lack = (first, second) if first in names else (second, first)
                raise ValueError(
                    f"{path} has '{have}' but no '{lack}'; an ADM reference batch stores mu, sigma "
                    "(and mu_s, sigma_s for sFID) in pairs"
                )
        if "mu" not in names:
            raise ValueError(f"{path} has {present} but no 'mu'/'sigma'; FID needs the pool_3 statistics mu, sigma")
        try:
            with np.load(path, allow_pickle=False) as archive:
                stored = {key: archive[key] for key in present}
        except (ValueError, OSError, zipfile.BadZipFile, EOFError) as error:
            raise ValueError(f"cannot read the statistics in {path}: {error}") from error
        _check_statistics(f"reference {path}", stored["mu"], stored["sigma"], None, ("mu", "sigma"))
        if "mu_s" in stored:
            _check_statistics(f"reference {path}", stored["mu_s"], stored["sigma_s"], None, ("mu_s", "sigma_s"))
        images = NpzImageSource(path) if "arr_0" in names else None
        return _ReferenceSpec(path, "adm_npz", images, stored)
    if "arr_0" in names:
        return _ReferenceSpec(path, "images", NpzImageSource(path), None)
    raise ValueError(
        f"{path} is neither an ADM reference batch (mu, sigma, mu_s, sigma_s, arr_0) nor an image "
        f".npz (arr_0); it has {sorted(names)}"
    )


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moh_dit" / "reference_stats"


def _cache_path(cache_dir: Path, spec: _ReferenceSpec, identity: str) -> tuple[Path, str]:
    fingerprint = spec.images.fingerprint() if spec.images is not None else None
    if spec.kind == "adm_npz":
        # stored statistics are read from the file each time; only arr_0's features are cached
        stat = spec.path.stat()
        fingerprint = json.dumps(["adm_npz", str(spec.path.resolve()), stat.st_size, stat.st_mtime_ns])
    key = json.dumps({"version": _CACHE_FORMAT_VERSION, "kind": spec.kind, "source": fingerprint, "extractor": identity})
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir / f"{spec.path.name}-{digest}.npz", key


def _save_npz_atomic(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    with atomic_write(path) as f:
        np.savez(f, **arrays)


def _load_cache(
    path: Path, key: str, num_images: int | None = None, extractor: nn.Module | None = None
) -> dict[str, np.ndarray] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as archive:
            if str(archive["cache_key"]) != key:
                return None
            arrays = {name: archive[name] for name in archive.files}
    except Exception as error:  # a damaged cache is recomputed, never trusted
        warnings.warn(f"ignoring unreadable reference cache {path}: {error}")
        return None
    problem = _cache_problem(arrays, num_images, extractor)
    if problem is not None:  # the key matched but the contents do not fit: recompute, and say so
        warnings.warn(f"ignoring reference cache {path}: {problem}; recomputing it")
        return None
    return arrays


def _cache_problem(arrays: Mapping[str, np.ndarray], num_images: int | None, extractor: nn.Module | None) -> str | None:
    """Why cached reference arrays cannot be used (shapes that do not fit together), or None."""
    pool_dim = getattr(extractor, "pool_dim", None)
    spatial_dim = getattr(extractor, "spatial_dim", None)
    try:
        features = arrays.get("pool_features")
        if features is not None:
            if features.ndim != 2 or (num_images is not None and features.shape[0] != num_images):
                return f"pool_features has shape {features.shape}, expected ({num_images}, D)"
            pool_dim = pool_dim if pool_dim is not None else features.shape[1]
            if features.shape[1] != pool_dim:
                return f"pool_features has {features.shape[1]} values per image, the extractor {pool_dim}"
        for mu, sigma, dim in (("mu", "sigma", pool_dim), ("mu_s", "sigma_s", spatial_dim)):
            if mu in arrays or sigma in arrays:
                if mu not in arrays or sigma not in arrays:
                    return f"it has only one of '{mu}'/'{sigma}'"
                _check_statistics("cache", arrays[mu], arrays[sigma], dim, (mu, sigma))
        spatial = arrays.get("spatial_features")
        if spatial is not None and "mu_s" in arrays and spatial.shape[1:] != arrays["mu_s"].shape:
            return f"spatial_features has shape {spatial.shape}, not matching mu_s {arrays['mu_s'].shape}"
    except ValueError as error:
        return str(error)
    return None


def load_reference(
    reference: PathLike | ReferenceStatistics,
    extractor: nn.Module,
    *,
    device: torch.device | str = "cpu",
    batch_size: int = 64,
    num_workers: int = 0,
    cache_dir: PathLike | None = None,
    use_cache: bool = True,
    progress: bool = False,
) -> ReferenceStatistics:
    """Reference statistics for ``reference``: an ADM reference batch ``.npz``, an image ``.npz`` or a folder.

    An ADM reference batch supplies its stored ``mu``/``sigma``/``mu_s``/``sigma_s`` (statistics
    of the whole training set, as ADM uses them) and its ``arr_0`` images for precision/recall.
    For image references all statistics are computed with ``extractor``. Computed parts are
    cached in ``cache_dir`` (default ``$XDG_CACHE_HOME/moh_dit/reference_stats``), keyed on the
    path, size and mtime of the input (every file's, for folders) and the extractor identity;
    cache files are written atomically.
    """
    identity = extractor_identity(extractor)
    if isinstance(reference, ReferenceStatistics):
        if reference.extractor != identity:
            raise ValueError(
                f"the reference statistics were made with extractor {reference.extractor!r}, "
                f"not with {identity!r}; recompute them with the same extractor"
            )
        return reference
    spec = _inspect_reference(reference)
    _check_stored_dims(spec, extractor)  # before the reference images are read
    return _compute_reference(spec, extractor, identity, device, batch_size, num_workers, cache_dir, use_cache, progress)


def _compute_reference(
    spec: _ReferenceSpec,
    extractor: nn.Module,
    identity: str,
    device: torch.device | str,
    batch_size: int,
    num_workers: int,
    cache_dir: PathLike | None,
    use_cache: bool,
    progress: bool,
) -> ReferenceStatistics:
    num_images = spec.images.num_images if spec.images is not None else None
    resolution = spec.images.resolution if spec.images is not None else None
    cached = None
    if use_cache and spec.images is not None:
        cache_file, key = _cache_path(Path(cache_dir) if cache_dir is not None else _default_cache_dir(), spec, identity)
        cached = _load_cache(cache_file, key, num_images, extractor)
    arrays: dict[str, np.ndarray] = {}
    if cached is not None:
        arrays = cached
    elif spec.images is not None:
        features = extract_features(
            spec.images, extractor, device=device, batch_size=batch_size, num_workers=num_workers, progress=progress
        )
        arrays["pool_features"] = features.pool
        if spec.kind == "adm_npz" and features.pool.shape[1] != spec.stored["mu"].shape[0]:
            # caught here, before any sample is processed, for extractors that do not declare pool_dim
            raise ValueError(
                f"{spec.path}: 'mu' has {spec.stored['mu'].shape[0]} values but the extractor's pool features "
                f"have {features.pool.shape[1]}; the reference was made with a different feature layer"
            )
        if spec.kind == "images":
            pool = compute_statistics(features.pool)
            arrays["mu"], arrays["sigma"] = pool.mu, pool.sigma
            if features.spatial is not None:
                spatial = compute_statistics(features.spatial)
                arrays["mu_s"], arrays["sigma_s"] = spatial.mu, spatial.sigma
                if features.spatial.shape[0] <= features.spatial.shape[1]:
                    arrays["spatial_features"] = features.spatial
        if use_cache:
            _save_npz_atomic(cache_file, {**arrays, "cache_key": np.array(key)})
    if spec.kind == "adm_npz":
        arrays.update(spec.stored)
    spatial_stats = None
    if "mu_s" in arrays and "sigma_s" in arrays:
        spatial_stats = FeatureStatistics(arrays["mu_s"], arrays["sigma_s"])
    return ReferenceStatistics(
        pool=FeatureStatistics(arrays["mu"], arrays["sigma"]),
        spatial=spatial_stats,
        pool_features=arrays.get("pool_features"),
        num_images=num_images,
        source=str(spec.path),
        extractor=identity,
        resolution=resolution,
        from_cache=cached is not None,
        statistics_from_images=spec.kind == "images",
        spatial_features=arrays.get("spatial_features"),
    )


# ---------------------------------------------------------------------------------------------
# The evaluation
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class EvaluationResult:
    """The five ADM numbers plus what is needed to trust and reproduce them."""

    fid: float | None
    sfid: float | None
    inception_score: float | None
    precision: float | None
    recall: float | None
    num_samples: int
    num_reference_images: int | None
    samples: str
    reference: str
    extractor: str
    inception_weights: dict[str, Any]
    comparable_to_published: bool
    sample_resolution: int | None = None
    reference_resolution: int | None = None
    reference_from_cache: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    allow_resolution_mismatch: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_statistics(
    where: str, mu: Any, sigma: Any, expected_dim: int | None, names: tuple[str, str] = ("mu", "sigma")
) -> None:
    """Refuse statistics that cannot be used: ``mu`` not (D,), ``sigma`` not (D, D), non-numeric or non-finite.

    ``expected_dim`` is the feature network's D when known (2048 for pool_3, 2023 for ADM's
    sFID layer); otherwise D is taken from ``mu``. Cheap, so it runs before any image is processed.
    """
    mu_name, sigma_name = names
    mu, sigma = np.asarray(mu), np.asarray(sigma)
    for name, array in ((mu_name, mu), (sigma_name, sigma)):
        if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"{where}: '{name}' has dtype {array.dtype}; expected floating-point statistics")
    if mu.ndim != 1:
        raise ValueError(f"{where}: '{mu_name}' has shape {mu.shape}; expected a mean vector (D,)")
    d = expected_dim if expected_dim is not None else mu.shape[0]
    layer = "" if expected_dim is None else f" (the feature extractor produces {expected_dim} values)"
    if mu.shape != (d,):
        raise ValueError(
            f"{where}: '{mu_name}' has shape {mu.shape} but should be ({d},){layer}; "
            "the reference was made with a different feature layer or is damaged"
        )
    if sigma.shape != (d, d):
        raise ValueError(
            f"{where}: '{sigma_name}' has shape {sigma.shape} but should be ({d}, {d}) to match "
            f"'{mu_name}'{layer}; the reference was made with a different feature layer or is damaged"
        )
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise ValueError(f"{where}: '{mu_name}' or '{sigma_name}' contains NaN or infinite values")
    scale = max(float(np.abs(sigma).max(initial=0.0)), np.finfo(np.float64).tiny)
    if float(np.abs(sigma - sigma.T).max(initial=0.0)) > 1e-5 * scale:  # the tolerance of frechet_distance
        raise ValueError(f"{where}: '{sigma_name}' is not symmetric, so it is not a covariance matrix")


def _check_stored_dims(spec: _ReferenceSpec, extractor: nn.Module) -> None:
    """Stored reference statistics against the extractor's declared feature widths."""
    if not spec.stored:
        return
    for mu, sigma, attribute in (("mu", "sigma", "pool_dim"), ("mu_s", "sigma_s", "spatial_dim")):
        if mu in spec.stored:
            expected = getattr(extractor, attribute, None)
            _check_statistics(f"reference {spec.path}", spec.stored[mu], spec.stored[sigma], expected, (mu, sigma))


def _check_given_reference(ref: ReferenceStatistics, extractor: nn.Module) -> None:
    """A ReferenceStatistics passed in (e.g. reused across a sweep) checked like a stored one."""
    where = f"reference statistics of {ref.source}"
    _check_statistics(where, ref.pool.mu, ref.pool.sigma, getattr(extractor, "pool_dim", None), ("mu", "sigma"))
    if ref.spatial is not None:
        _check_statistics(
            where, ref.spatial.mu, ref.spatial.sigma, getattr(extractor, "spatial_dim", None), ("mu_s", "sigma_s")
        )
    if ref.pool_features is not None and np.ndim(ref.pool_features) == 2:
        if ref.pool_features.shape[1] != ref.pool.mu.shape[0]:
            raise ValueError(
                f"{where}: pool_features have {ref.pool_features.shape[1]} values per image but mu has "
                f"{ref.pool.mu.shape[0]}"
            )


def _resolution_text(resolution: int | None) -> str:
    return "of unknown resolution" if resolution is None else f"{resolution}x{resolution} px"


def _frechet(samples: np.ndarray, reference: FeatureStatistics, reference_features: np.ndarray | None) -> float:
    # Both routes give the same number; the feature route is much cheaper while N < D.
    d = samples.shape[1]
    if reference_features is not None and samples.shape[0] <= d and reference_features.shape[0] <= d:
        return frechet_distance_from_features(samples, reference_features)
    return compute_statistics(samples).frechet_distance(reference)


def evaluate(
    samples: Any,
    reference: PathLike | ReferenceStatistics,
    *,
    extractor: nn.Module | None = None,
    inception_weights: PathLike | None = None,
    download: bool = True,
    device: torch.device | str = "cpu",
    batch_size: int = 64,
    num_workers: int = 0,
    cache_dir: PathLike | None = None,
    use_cache: bool = True,
    split_size: int = ADM_SPLIT_SIZE,
    k: int = ADM_K,
    progress: bool = False,
    allow_resolution_mismatch: bool = False,
) -> EvaluationResult:
    """FID, sFID, Inception Score, precision and recall of ``samples`` against ``reference``, as ADM.

    ``samples``: an image folder, an ``.npz`` with ``arr_0`` uint8 (N, H, W, 3) (streamed), a
    uint8 NHWC array/tensor, or an iterable of such batches (e.g. straight from a pipeline).
    ``reference``: an ADM reference batch ``.npz``, an image ``.npz``/folder, or
    :class:`ReferenceStatistics` from :func:`load_reference` (reuse it across a sweep).
    ``extractor`` defaults to the TF-compatible InceptionV3 with weights from
    :func:`resolve_inception_weights` (``inception_weights`` > env > hub cache > download).
    Inputs are validated before the extractor is loaded or any image is processed, and the
    stored reference statistics (shapes against the extractor's feature widths) and the two
    resolutions before any feature is computed.

    Samples and reference of different resolutions (e.g. 32 px samples against a 64 px reference;
    an ADM reference batch's resolution is that of its ``arr_0``) are refused: their FID measures
    the resizing as much as the model. ``allow_resolution_mismatch=True``
    (``--allow-resolution-mismatch``) evaluates anyway and records it in the result. A reference
    holding statistics only (no images) has no known resolution; the result's notes say so.
    """
    for name, value, least in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0),
                               ("split_size", split_size, 1), ("k", k, 1)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    sample_source = open_image_source(samples)
    minimum = max(2, k + 1)
    if sample_source.num_images is not None and sample_source.num_images < minimum:
        raise ValueError(f"{sample_source.description}: {sample_source.num_images} images; need at least {minimum}")
    spec = None if isinstance(reference, ReferenceStatistics) else _inspect_reference(reference)
    if spec is not None and spec.images is not None and spec.images.num_images < minimum:
        raise ValueError(f"{spec.path}: {spec.images.num_images} reference images; need at least {minimum}")
    if spec is not None:
        reference_resolution = spec.images.resolution if spec.images is not None else None
        reference_name = str(spec.path)
    else:
        reference_resolution, reference_name = reference.resolution, reference.source

    def check_resolutions(sample_resolution: int | None) -> None:
        mismatch = None not in (sample_resolution, reference_resolution) and sample_resolution != reference_resolution
        if mismatch and not allow_resolution_mismatch:
            raise ValueError(
                f"the samples ({sample_source.description}) are {_resolution_text(sample_resolution)} but the "
                f"reference ({reference_name}) is {_resolution_text(reference_resolution)}; FID between different "
                "resolutions is not comparable. Evaluate samples at the reference's resolution, or pass "
                "--allow-resolution-mismatch (allow_resolution_mismatch=True in Python) to evaluate anyway"
            )

    check_resolutions(sample_source.resolution)  # both known here unless the samples come from an iterator
    if extractor is None:
        extractor = load_inception(inception_weights, download=download)
    identity = extractor_identity(extractor)
    if spec is not None:
        _check_stored_dims(spec, extractor)
    else:
        if reference.extractor != identity:
            raise ValueError(
                f"the reference statistics were made with extractor {reference.extractor!r}, "
                f"not with {identity!r}; recompute them with the same extractor"
            )
        _check_given_reference(reference, extractor)
    if sample_source.resolution is None and reference_resolution is not None and isinstance(
        sample_source, _IterableImageSource
    ):
        # Take the first batch now (after the cheap checks, before any feature) to learn its size.
        check_resolutions(sample_source.peek_resolution())
    if spec is not None:
        ref = _compute_reference(
            spec, extractor, identity, device, batch_size, num_workers, cache_dir, use_cache, progress
        )
    else:
        ref = reference

    features = extract_features(
        sample_source, extractor, device=device, batch_size=batch_size, num_workers=num_workers, progress=progress
    )
    if len(features) < minimum:
        raise ValueError(f"{sample_source.description}: {len(features)} images; need at least {minimum}")

    notes: list[str] = []
    comparable = bool(getattr(extractor, "comparable_to_published", False))
    if not comparable:
        notes.append(f"extractor {identity} is not the published TF Inception: {NOT_COMPARABLE}")
    sample_resolution = sample_source.resolution
    if ref.resolution is None:
        notes.append(
            f"reference resolution unknown: {ref.source} holds statistics only (no arr_0 images), so the "
            f"sample resolution ({_resolution_text(sample_resolution)}) could not be checked against it"
        )
    elif sample_resolution is not None and sample_resolution != ref.resolution:
        notes.append(
            f"samples are {_resolution_text(sample_resolution)} but the reference is "
            f"{_resolution_text(ref.resolution)} (allowed by --allow-resolution-mismatch): these numbers are "
            "not comparable to ones at the reference's resolution"
        )
    if ref.spatial is None or features.spatial is None:
        notes.append("sFID unavailable: no spatial features/statistics on one side")
    if features.logits is None:
        notes.append("Inception Score unavailable: the extractor returns no logits")
    if ref.pool_features is None:
        notes.append("precision/recall unavailable: the reference has no images (arr_0)")
    if len(features) < split_size:
        notes.append(f"{len(features)} samples < split size {split_size}: Inception Score uses a single split")

    fid = _frechet(features.pool, ref.pool, ref.pool_features if ref.statistics_from_images else None)
    sfid = None
    if ref.spatial is not None and features.spatial is not None:
        sfid = _frechet(features.spatial, ref.spatial, ref.spatial_features if ref.statistics_from_images else None)
    score = inception_score_from_logits(features.logits, split_size) if features.logits is not None else None
    precision = recall = None
    if ref.pool_features is not None:
        precision, recall = precision_recall(ref.pool_features, features.pool, k, device=device)

    return EvaluationResult(
        fid=fid,
        sfid=sfid,
        inception_score=score,
        precision=precision,
        recall=recall,
        num_samples=len(features),
        num_reference_images=ref.num_images,
        samples=sample_source.description,
        reference=ref.source,
        extractor=identity,
        inception_weights=dict(getattr(extractor, "weights_info", {}) or {}),
        comparable_to_published=comparable,
        sample_resolution=sample_resolution,
        reference_resolution=ref.resolution,
        reference_from_cache=ref.from_cache,
        notes=notes,
        allow_resolution_mismatch=bool(allow_resolution_mismatch),
    )
