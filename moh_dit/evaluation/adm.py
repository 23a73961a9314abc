"""ADM's evaluator (guided-diffusion ``evaluations/evaluator.py``) in PyTorch: images stream through a
feature network (:mod:`.inception`) into FID (Heusel et al. 2017), sFID (Nash et al. 2021), the
Inception Score (Salimans et al. 2016) and improved precision/recall (Kynkaanniemi et al. 2019, k = 3).
Statistics are ADM's (float64 ``np.mean``, ``np.cov``); an ADM reference batch's FID/sFID use its
stored statistics of the whole training set, not those of its ``arr_0``."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import itertools
import json
import logging
import math
import os
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from scipy.special import softmax, xlogy
from torch import nn

from ..data import load_image, scan_image_files
from ..outputs import atomic_write

ADM_SPLIT_SIZE = 5000  # Inception Score split size of ADM's evaluator
ADM_K = 3  # neighbourhood size of ADM's precision/recall
CACHE_ENV = "MOH_DIT_CACHE"

logger = logging.getLogger(__name__)


# ----- images ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Images:
    """Square RGB uint8 images, read as (N, H, W, 3) tensors in a fixed order."""

    description: str
    count: int | None  # None: an iterator, not known in advance
    resolution: int
    batches: Callable[[int, int], Iterator[torch.Tensor]]  # (batch_size, num_workers) -> batches
    fingerprint: str | None = None  # changes when the images change: what the cache is keyed on


def _check(shape: tuple, dtype: Any, where: str) -> None:
    if dtype not in (np.uint8, torch.uint8) or len(shape) != 4 or shape[-1] != 3 or shape[1] != shape[2]:
        raise ValueError(f"{where}: images must be square RGB uint8 (N, H, W, 3), got {dtype} {tuple(shape)}")


def _npz_images(path: Path, name: str) -> Images:
    """``arr_0`` of an .npz read a batch at a time: a zip member cannot be memory-mapped, and DiT's
    50,000 samples at 256 px are about 10 GB."""
    with zipfile.ZipFile(path) as archive, archive.open("arr_0.npy") as f:
        version = np.lib.format.read_magic(f)
        shape, fortran, dtype = getattr(np.lib.format, f"read_array_header_{version[0]}_0")(f)
        offset = f.tell()
    _check(shape, None if fortran else dtype, f"{name} {path}")

    def batches(batch_size: int, num_workers: int) -> Iterator[torch.Tensor]:
        with zipfile.ZipFile(path) as archive, archive.open("arr_0.npy") as f:
            f.read(offset)
            for start in range(0, shape[0], batch_size):
                n = min(batch_size, shape[0] - start)
                data = bytearray(f.read(n * math.prod(shape[1:])))
                if len(data) < n * math.prod(shape[1:]):
                    raise ValueError(f"{path}: arr_0 ends early; the file is truncated")
                yield torch.frombuffer(data, dtype=torch.uint8).view(n, *shape[1:])

    stat = path.stat()
    return Images(str(path), shape[0], shape[1], batches, f"npz:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}")


class _Decode(torch.utils.data.Dataset):
    def __init__(self, files: list[Path], size: int) -> None:
        self.files, self.size = files, size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> np.ndarray | str:
        try:  # a worker's exception reaches the user inside its traceback: hand back one line instead
            image = np.asarray(load_image(self.files[i]))
        except Exception as error:  # noqa: BLE001
            return str(error)
        return image if image.shape == (self.size, self.size, 3) else f"{self.files[i]}: not {self.size} px square"


def _stack(items: list) -> torch.Tensor:
    if any(isinstance(item, str) for item in items):
        raise ValueError(next(item for item in items if isinstance(item, str)))
    return torch.from_numpy(np.stack(items))


def open_images(images: Any, name: str = "images") -> Images:
    """An image folder, an .npz (``arr_0`` streamed), a uint8 NHWC array or tensor, or an iterable
    of such batches; checked as far as possible without decoding."""
    if isinstance(images, Images):
        return images
    if isinstance(images, (str, os.PathLike)):
        path = Path(images)
        if path.is_dir():
            from PIL import Image

            files = [Path(f) for f in scan_image_files(path)]  # the package's one folder scan
            if not files:
                raise FileNotFoundError(errno.ENOENT, f"{name}: no images in the folder", str(path))
            with Image.open(files[0]) as first:
                size = first.size[0]
            listing = [(f.relative_to(path).as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
            batches = lambda b, w: iter(torch.utils.data.DataLoader(  # noqa: E731
                _Decode(files, size), batch_size=b, num_workers=w, collate_fn=_stack))
            digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
            return Images(str(path), len(files), size, batches, f"folder:{path.resolve()}:{digest}")
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, f"{name}: no such file or folder", str(path))
        if not zipfile.is_zipfile(path) or "arr_0.npy" not in zipfile.ZipFile(path).namelist():
            raise ValueError(f"{name} {path}: neither an image folder nor an .npz with arr_0")
        return _npz_images(path, name)
    if isinstance(images, (np.ndarray, torch.Tensor)):
        array = torch.as_tensor(images)
        _check(array.shape, array.dtype, name)
        return Images(f"<{len(array)} images>", len(array), array.shape[1], lambda b, w: iter(array.split(b)))
    iterator = iter(images)  # batches from a pipeline: the first one tells the resolution
    first = torch.as_tensor(next(iterator))
    _check(first.shape, first.dtype, f"{name} batch 0")

    def batches(b: int, w: int) -> Iterator[torch.Tensor]:
        for i, batch in enumerate(itertools.chain([first], iterator)):
            batch = torch.as_tensor(batch)
            _check(batch.shape, batch.dtype, f"{name} batch {i}")
            if batch.shape[1] != first.shape[1]:
                raise ValueError(f"{name} batch {i} is {batch.shape[1]} px, batch 0 {first.shape[1]} px")
            yield from batch.split(b)

    return Images("<image batches>", None, first.shape[1], batches)


# ----- features -------------------------------------------------------------------------------

@dataclasses.dataclass
class Features:
    """An image set's features in image order, float32 (None where the extractor has none)."""

    pool: np.ndarray  # (N, 2048)
    logits: np.ndarray | None = None  # (N, 1008)
    spatial: np.ndarray | None = None  # (N, 2023)


def extractor_identity(extractor: nn.Module) -> str:
    """What reference statistics are cached under: ``extractor.identity``, else a hash of its weights."""
    if getattr(extractor, "identity", None):
        return extractor.identity
    digest = hashlib.sha256(type(extractor).__qualname__.encode())
    for name, tensor in sorted(extractor.state_dict().items()):
        digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    return f"{type(extractor).__qualname__}:sha256={digest.hexdigest()[:16]}"


@torch.no_grad()
def extract_features(images: Any, extractor: nn.Module, *, device: torch.device | str = "cpu", batch_size: int = 64,
                     num_workers: int = 0, on_batch: Callable[[torch.Tensor], None] | None = None) -> Features:
    """Run ``extractor`` (uint8 (N, 3, H, W) -> dict of ``pool``, ``logits``, ``spatial``) over ``images``;
    ``on_batch`` sees each uint8 NHWC batch too (the classifier of class accuracy)."""
    from tqdm.auto import tqdm

    images = open_images(images)
    extractor = extractor.to(device).eval()
    parts: dict[str, list[torch.Tensor]] = {}
    with tqdm(total=images.count, desc=f"features of {images.description}", unit="img", disable=None) as bar:
        for batch in images.batches(batch_size, num_workers):
            if on_batch is not None:
                on_batch(batch)
            output = extractor(batch.to(device).permute(0, 3, 1, 2).contiguous())  # (N, 3, H, W) in
            for key, value in output.items():
                if value is not None:
                    parts.setdefault(key, []).append(value.float().cpu())
            bar.update(len(batch))
    joined = {key: torch.cat(value).numpy() for key, value in parts.items()}
    return Features(joined["pool"], joined.get("logits"), joined.get("spatial"))


# ----- statistics and the Frechet distance ----------------------------------------------------

@dataclasses.dataclass
class FeatureStatistics:
    mu: np.ndarray  # (D,) float64
    sigma: np.ndarray  # (D, D) float64

    def frechet_distance(self, other: "FeatureStatistics") -> float:
        return frechet_distance(self.mu, self.sigma, other.mu, other.sigma)


def compute_statistics(features: np.ndarray) -> FeatureStatistics:
    """ADM's statistics: np.mean and np.cov (unbiased) in float64."""
    features = np.asarray(features, dtype=np.float64)
    return FeatureStatistics(features.mean(axis=0), np.cov(features, rowvar=False))


def check_statistics(mu: Any, sigma: Any, where: str, dim: int | None = None, psd: bool = True) -> None:
    """Refuse what is not a mean (D,) and covariance (D, D): wrong shapes, NaN, asymmetry, or (``psd``)
    a negative eigenvalue beyond rounding, whose Frechet distance is meaningless (even negative)."""
    mu, sigma = np.asarray(mu), np.asarray(sigma, dtype=np.float64)
    dim = mu.shape[0] if dim is None and mu.ndim == 1 else dim
    if mu.shape != (dim,) or sigma.shape != (dim, dim):
        raise ValueError(f"{where}: mean {mu.shape} and covariance {sigma.shape} should be ({dim},) and ({dim}, {dim})")
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise ValueError(f"{where}: NaN or infinite values")
    if np.abs(sigma - sigma.T).max(initial=0.0) > 1e-5 * max(np.abs(sigma).max(initial=0.0), 1e-300):
        raise ValueError(f"{where}: the covariance is not symmetric")
    if psd:
        _check_psd(np.linalg.eigvalsh(sigma), where)


def _check_psd(eigenvalues: np.ndarray, where: str) -> None:
    # rounding: what float32 storage allows at this size, and never less than a millionth of the largest
    tolerance = max(4 * len(eigenvalues) * np.finfo(np.float32).eps, 1e-6) * np.abs(eigenvalues).max(initial=0.0)
    if eigenvalues.min(initial=0.0) < -tolerance:
        raise ValueError(f"{where}: not a covariance matrix, it has a negative eigenvalue ({eigenvalues.min():.4g})")


def frechet_distance(mu1: Any, sigma1: Any, mu2: Any, sigma2: Any) -> float:
    """|mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^(1/2)), in float64.

    ADM takes ``scipy.linalg.sqrtm(S1 S2)``; ``S1 S2`` has the eigenvalues of the symmetric
    ``S1^(1/2) S2 S1^(1/2)``, so two ``eigh`` give the trace exactly for covariances, faster
    and without complex arithmetic. Eigenvalues below NumPy's rank tolerance are rounding noise
    of a singular covariance (N < D) and count as zero. float32 is not accurate enough here.
    """
    dim = np.shape(mu1)[0] if np.ndim(mu1) == 1 else None
    check_statistics(mu1, sigma1, "mu1, sigma1", dim, psd=False)
    check_statistics(mu2, sigma2, "mu2, sigma2", dim, psd=False)
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    sigma1, sigma2 = (0.5 * (s + s.T) for s in (np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)))
    eigenvalues, eigenvectors = np.linalg.eigh(sigma1)
    _check_psd(eigenvalues, "sigma1")
    sqrt_sigma1 = (eigenvectors * np.sqrt(_above_rank_tolerance(eigenvalues))) @ eigenvectors.T
    middle = sqrt_sigma1 @ sigma2 @ sqrt_sigma1
    middle_eigenvalues = np.linalg.eigvalsh(0.5 * (middle + middle.T))
    _check_psd(middle_eigenvalues, "sigma2")  # the inertia of S2 where S1 is not singular (Sylvester)
    diff = mu1 - mu2
    tr_covmean = np.sqrt(_above_rank_tolerance(middle_eigenvalues)).sum()
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * tr_covmean)


def _above_rank_tolerance(eigenvalues: np.ndarray) -> np.ndarray:
    tolerance = max(float(eigenvalues.max()), 0.0) * len(eigenvalues) * np.finfo(np.float64).eps
    return np.where(eigenvalues > tolerance, eigenvalues, 0.0)


def frechet_distance_from_features(features1: np.ndarray, features2: np.ndarray) -> float:
    """The Frechet distance of two feature sets' Gaussians without D x D matrices (cheaper while N < D).

    With ``A = (X1 - mu1) / sqrt(N1 - 1)`` and ``B`` likewise, ``S1 = A^T A``, ``S2 = B^T B``, and
    the non-zero eigenvalues of ``S1 S2`` are those of ``C C^T`` with ``C = A B^T``: the trace
    term is the sum of C's singular values.
    """
    x1, x2 = np.asarray(features1, np.float64), np.asarray(features2, np.float64)
    if x1.shape[1] != x2.shape[1]:
        raise ValueError(f"feature widths differ: {x1.shape[1]} and {x2.shape[1]}")
    a = (x1 - x1.mean(0)) / math.sqrt(len(x1) - 1)  # (N1, D)
    b = (x2 - x2.mean(0)) / math.sqrt(len(x2) - 1)  # (N2, D)
    diff = x1.mean(0) - x2.mean(0)
    return float(diff @ diff + (a * a).sum() + (b * b).sum() - 2.0 * np.linalg.svd(a @ b.T, compute_uv=False).sum())


# ----- Inception Score, precision and recall --------------------------------------------------

def inception_score(probs: np.ndarray, split_size: int = ADM_SPLIT_SIZE) -> float:
    """ADM's ``compute_inception_score``: splits of ``split_size`` in order (the last may be shorter),
    exp(mean KL(p || mean p)) per split, averaged; 0 log 0 = 0."""
    probs = np.asarray(probs, dtype=np.float64)
    scores = []
    for start in range(0, len(probs), split_size):
        part = probs[start:start + split_size]
        kl = (xlogy(part, part) - xlogy(part, part.mean(axis=0, keepdims=True))).sum(axis=1).mean()
        scores.append(math.exp(kl))
    return float(np.mean(scores))


def _squared_distances(u: torch.Tensor, v: torch.Tensor, adm_float16: bool) -> torch.Tensor:
    """|u - v|^2 for all pairs (R, C). ADM's DistanceBlock works in float16 and falls back to float32
    only where that overflows; which points land inside a radius depends on it, so it is emulated."""
    def distances(u, v):
        return ((u * u).sum(1, keepdim=True) - 2.0 * (u @ v.T) + (v * v).sum(1)[None]).clamp_min_(0.0)

    if adm_float16:
        block = distances(u.half().float(), v.half().float()).half()
        if bool(torch.isfinite(block).all()):
            return block.float()
    return distances(u, v)


@torch.no_grad()
def manifold_radii_squared(features: Any, k: int = ADM_K, *, batch_size: int = 4096,
                           device: torch.device | str | None = None, adm_float16: bool = True) -> torch.Tensor:
    """Squared distance to the k-th nearest neighbour but itself (ADM's ``manifold_radii``: position k of
    the sorted row, whose position 0 is the self-distance 0), in blocks."""
    x = torch.as_tensor(np.asarray(features), dtype=torch.float32, device=device)
    radii = torch.empty(len(x), device=x.device)
    for start in range(0, len(x), batch_size):
        rows = x[start:start + batch_size]
        smallest = torch.full((len(rows), k + 1), math.inf, device=x.device)  # (R, k + 1)
        for col in range(0, len(x), batch_size):
            merged = torch.cat([smallest, _squared_distances(rows, x[col:col + batch_size], adm_float16)], dim=1)
            smallest = merged.topk(k + 1, dim=1, largest=False).values
        radii[start:start + len(rows)] = smallest[:, k]
    return radii


@torch.no_grad()
def precision_recall(reference_features: Any, sample_features: Any, k: int = ADM_K, *, batch_size: int = 4096,
                     device: torch.device | str | None = None, adm_float16: bool = True) -> tuple[float, float]:
    """ADM's ``compute_prec_recall``: precision is the fraction of samples inside some reference ball
    (its k-NN radius, boundary included), recall the fraction of reference points inside some sample
    ball. Only (batch_size x batch_size) distances exist at a time."""
    ref = torch.as_tensor(np.asarray(reference_features), dtype=torch.float32, device=device)
    smp = torch.as_tensor(np.asarray(sample_features), dtype=torch.float32, device=device)
    ref_radii = manifold_radii_squared(ref, k, batch_size=batch_size, adm_float16=adm_float16)
    smp_radii = manifold_radii_squared(smp, k, batch_size=batch_size, adm_float16=adm_float16)
    sample_inside = torch.zeros(len(smp), dtype=torch.bool, device=ref.device)
    reference_inside = torch.zeros(len(ref), dtype=torch.bool, device=ref.device)
    for i in range(0, len(ref), batch_size):
        for j in range(0, len(smp), batch_size):
            block = _squared_distances(ref[i:i + batch_size], smp[j:j + batch_size], adm_float16)  # (R, S)
            sample_inside[j:j + batch_size] |= (block <= ref_radii[i:i + batch_size, None]).any(dim=0)
            reference_inside[i:i + batch_size] |= (block <= smp_radii[None, j:j + batch_size]).any(dim=1)
    return sample_inside.double().mean().item(), reference_inside.double().mean().item()


# ----- references and their cache -------------------------------------------------------------

@dataclasses.dataclass
class Reference:
    """FID/sFID statistics (stored, or of the images) and the images' features (precision/recall)."""

    source: str
    pool: FeatureStatistics
    spatial: FeatureStatistics | None
    features: Features | None
    from_images: bool  # statistics of `features` (else stored ones)
    resolution: int | None
    extractor: str
    from_cache: bool = False


def reference_cache_dir() -> Path:
    """``$MOH_DIT_CACHE/reference_stats``, else ``$XDG_CACHE_HOME/moh-dit/reference_stats``, else
    ``~/.cache/moh-dit/reference_stats``."""
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moh-dit"
    return Path(root).expanduser() / "reference_stats"


STATISTICS = ("mu", "sigma", "mu_s", "sigma_s")


def _open_reference(reference: str | os.PathLike) -> tuple[str, Images | None, dict[str, np.ndarray]]:
    """A reference's name, images and stored statistics, checked; no feature network needed."""
    path = Path(reference)
    names = set()
    if path.is_file() and zipfile.is_zipfile(path):
        names = {n[:-4] for n in zipfile.ZipFile(path).namelist() if n.endswith(".npy")}
    if not names & set(STATISTICS):
        return str(path), open_images(path, "reference"), {}
    with np.load(path, allow_pickle=False) as archive:
        stored = {key: archive[key] for key in STATISTICS if key in names}
    if set(stored) not in ({"mu", "sigma"}, set(STATISTICS)):
        raise ValueError(f"reference {path}: statistics come as mu, sigma (and mu_s, sigma_s), got {sorted(stored)}")
    for mu, sigma in (("mu", "sigma"), ("mu_s", "sigma_s"))[:len(stored) // 2]:
        check_statistics(stored[mu], stored[sigma], f"reference {path}: {mu}, {sigma}")
    return str(path), (open_images(path, "reference") if "arr_0" in names else None), stored


def _reference(opened: tuple[str, Images | None, dict], extractor: nn.Module, device: torch.device | str,
               batch_size: int, num_workers: int, cache_dir: str | os.PathLike | None, use_cache: bool) -> Reference:
    source, images, stored = opened
    identity = extractor_identity(extractor)
    for mu, dim in (("mu", "pool_dim"), ("mu_s", "spatial_dim")):
        if mu in stored and len(stored[mu]) != getattr(extractor, dim, len(stored[mu])):
            raise ValueError(f"reference {source}: {mu} has {len(stored[mu])} values, but the feature network "
                             f"gives {getattr(extractor, dim)}; the reference was made with another network")
    features, cache_file, key = None, None, json.dumps([images and images.fingerprint, identity])
    if images is not None and use_cache:
        name = f"{Path(source).name}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.npz"
        cache_file = Path(cache_dir or reference_cache_dir()).expanduser() / name
        with contextlib.suppress(OSError, ValueError, KeyError), np.load(cache_file, allow_pickle=False) as archive:
            if str(archive["key"]) == key:  # else another input under the same name: recomputed
                features = Features(archive["pool"], None, archive["spatial"] if "spatial" in archive else None)
    from_cache = features is not None
    if images is not None and features is None:
        features = extract_features(images, extractor, device=device, batch_size=batch_size, num_workers=num_workers)
        features = Features(features.pool, None, None if stored else features.spatial)  # stored: FID/sFID from file
        if cache_file is not None:
            with atomic_write(cache_file) as f:
                spatial = {} if features.spatial is None else {"spatial": features.spatial}
                np.savez(f, key=np.array(key), pool=features.pool, **spatial)
            logger.info("wrote the reference statistics cache %s", cache_file)
    if stored:
        pool = FeatureStatistics(stored["mu"], stored["sigma"])
        spatial = FeatureStatistics(stored["mu_s"], stored["sigma_s"]) if "mu_s" in stored else None
    else:
        pool = compute_statistics(features.pool)
        spatial = None if features.spatial is None else compute_statistics(features.spatial)
    return Reference(source, pool, spatial, features, not stored, images and images.resolution, identity, from_cache)


def load_reference(reference: str | os.PathLike | Reference, extractor: nn.Module, *,
                   device: torch.device | str = "cpu", batch_size: int = 64, num_workers: int = 0,
                   cache_dir: str | os.PathLike | None = None, use_cache: bool = True) -> Reference:
    """Reference statistics of an ADM reference batch .npz, a statistics .npz (``mu``, ``sigma``), an
    image .npz or an image folder. What is computed from images is cached in ``cache_dir``
    (:func:`reference_cache_dir` by default), keyed on the images and the extractor's identity."""
    if isinstance(reference, Reference):
        return reference
    return _reference(_open_reference(reference), extractor, device, batch_size, num_workers, cache_dir, use_cache)


# ----- the metrics ----------------------------------------------------------------------------

def _frechet(x: np.ndarray, statistics: FeatureStatistics, reference_x: np.ndarray | None) -> float:
    # From both feature sets while they are smaller than D: the same number, much cheaper.
    if reference_x is not None and len(x) <= x.shape[1] and len(reference_x) <= x.shape[1]:
        return frechet_distance_from_features(x, reference_x)
    return compute_statistics(x).frechet_distance(statistics)


def fid_from_features(pool: np.ndarray, reference: Reference) -> float:
    """FID of sample pool features (N, D) against ``reference`` (what the sweep's bootstrap resamples)."""
    return _frechet(pool, reference.pool, reference.features.pool if reference.from_images else None)


def compute_metrics(features: Features, reference: Reference, *, split_size: int = ADM_SPLIT_SIZE, k: int = ADM_K,
                    device: torch.device | str | None = None) -> dict[str, float | None]:
    """FID, sFID, Inception Score, precision and recall; None where a side lacks what one needs."""
    sfid = precision = recall = score = None
    if reference.spatial is not None and features.spatial is not None:
        reference_spatial = reference.features.spatial if reference.from_images else None
        sfid = _frechet(features.spatial, reference.spatial, reference_spatial)
    if features.logits is not None:
        score = inception_score(softmax(features.logits.astype(np.float64), axis=1), split_size)
    if reference.features is not None:
        precision, recall = precision_recall(reference.features.pool, features.pool, k, device=device)
    return {"fid": fid_from_features(features.pool, reference), "sfid": sfid, "inception_score": score,
            "precision": precision, "recall": recall}


def evaluate(samples: Any, reference: str | os.PathLike | Reference, *, extractor: nn.Module | None = None,
             inception_weights: str | os.PathLike | None = None, random_inception_seed: int | None = None,
             download: bool = True, device: torch.device | str = "cpu", batch_size: int = 64, num_workers: int = 0,
             cache_dir: str | os.PathLike | None = None, use_cache: bool = True, split_size: int = ADM_SPLIT_SIZE,
             k: int = ADM_K, allow_resolution_mismatch: bool = False, classifier: Any = None,
             labels: Iterable[int] | None = None, class_map: dict[int, int] | None = None) -> dict[str, Any]:
    """FID, sFID, Inception Score, precision and recall of ``samples`` (what :func:`open_images` takes)
    against ``reference`` (a path, or :func:`load_reference`'s result), and with a ``classifier`` and the
    samples' ``labels`` their class accuracy, in one pass. The network is ``extractor``, else the seeded
    random Inception (offline tests: NOT comparable), else the TF Inception. Inputs are checked first."""
    from . import classes, inception

    images = open_images(samples, "samples")
    opened = None if isinstance(reference, Reference) else _open_reference(reference)
    ref_resolution = getattr(reference if opened is None else opened[1], "resolution", None)
    if ref_resolution not in (None, images.resolution) and not allow_resolution_mismatch:
        raise ValueError(f"the samples are {images.resolution} px but the reference is {ref_resolution} px: FID would "
                         "measure the resizing (allow_resolution_mismatch, --allow-resolution-mismatch, allows it)")
    meter = None if classifier is None else classes.ClassAccuracyMeter(classifier, labels, class_map, images.count)
    if extractor is None:
        extractor = (inception.build_random_inception(random_inception_seed) if random_inception_seed is not None
                     else inception.load_inception(inception_weights, download=download))
    if opened is not None:
        reference = _reference(opened, extractor, device, batch_size, num_workers, cache_dir, use_cache)
    elif reference.extractor != extractor_identity(extractor):
        raise ValueError(f"the reference statistics were made with {reference.extractor}, not with "
                         f"{extractor_identity(extractor)}")
    features = extract_features(images, extractor, device=device, batch_size=batch_size, num_workers=num_workers,
                                on_batch=None if meter is None else meter.update)
    result = compute_metrics(features, reference, split_size=split_size, k=k, device=device)
    result.update(
        num_samples=len(features.pool), samples=images.description, reference=reference.source,
        num_reference_images=None if reference.features is None else len(reference.features.pool),
        sample_resolution=images.resolution, reference_resolution=reference.resolution,
        allow_resolution_mismatch=allow_resolution_mismatch, extractor=extractor_identity(extractor),
        comparable_to_published=bool(getattr(extractor, "comparable_to_published", False)),
        reference_from_cache=reference.from_cache)
    if meter is not None:
        result.update(meter.result())
    return result


def class_accuracy(classifier: Any, images: Any, labels: Sequence[int],
                   class_map: dict[int, int] | None = None, batch_size: int = 100) -> dict[str, Any]:
    """Class accuracy of ``images`` (anything :func:`open_images` takes) made for ``labels``."""
    from . import classes

    images = open_images(images)
    meter = classes.ClassAccuracyMeter(classifier, labels, class_map, images.count)
    for batch in images.batches(batch_size, 0):
        meter.update(batch)
    return meter.result()
