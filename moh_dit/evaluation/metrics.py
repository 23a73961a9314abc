"""Inception Score and improved precision/recall, computed as ADM's evaluator computes them.

Pure maths on features that have already been extracted: numpy for the score, torch (on any
device, in blocks) for the k-NN distances of precision/recall. Nothing here reads files or
needs torch-fidelity.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "ADM_K",
    "ADM_SPLIT_SIZE",
    "inception_score",
    "inception_score_from_logits",
    "manifold_radii_squared",
    "precision_recall",
]

ADM_SPLIT_SIZE = 5000  # Inception Score split size of ADM's evaluator
ADM_K = 3  # neighbourhood size of ADM's precision/recall


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
    ``"logits_unbiased"``), which is what :class:`moh_dit.evaluation.inception.TFInceptionV3Features` returns.
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
