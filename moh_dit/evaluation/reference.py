"""Reference statistics: what the metrics compare the samples with, and their cache on disk.

A reference is an ADM reference batch ``.npz`` (stored training-set statistics ``mu``/``sigma``,
``mu_s``/``sigma_s`` and ``arr_0`` images for precision/recall), an image ``.npz`` or folder
(everything computed from its images), or :class:`ReferenceStatistics` made earlier. There
is one way in, taken by :func:`load_reference` and by :func:`moh_dit.evaluation.evaluate`
alike: :func:`open_reference` (cheap: reads and checks the file, no feature network),
:func:`check_reference` (against the extractor's feature widths and identity, before any
image is read) and :func:`reference_statistics` (computes them, or loads them from the cache).

The cache lives in one folder, :func:`reference_cache_dir`: ``reference_stats`` under
``$MOH_DIT_CACHE`` when that is set, else under ``$XDG_CACHE_HOME/moh-dit``, else under
``~/.cache/moh-dit``. Each file written there is logged with its path and size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import InputNotFound
from ..utils.io import atomic_write
from ..utils.logging import get_logger
from .features import extract_features, extractor_identity
from .frechet import FeatureStatistics, check_psd, compute_statistics
from .sources import FolderImageSource, ImageSource, NpzImageSource, PathLike, zip_member_names

__all__ = [
    "CACHE_ENV",
    "ReferenceOptions",
    "ReferenceSpec",
    "ReferenceStatistics",
    "check_reference",
    "load_reference",
    "open_reference",
    "reference_cache_dir",
    "reference_statistics",
]

logger = get_logger(__name__)

CACHE_ENV = "MOH_DIT_CACHE"  # the package's cache folder; reference statistics go in its reference_stats/
_CACHE_FORMAT_VERSION = 1


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
class ReferenceSpec:
    """A reference file or folder that has been read and checked, its statistics not yet computed."""

    path: Path
    kind: str  # "adm_npz" (stored statistics) or "images"
    images: ImageSource | None
    stored: dict[str, np.ndarray] | None

    @property
    def source(self) -> str:
        return str(self.path)

    @property
    def resolution(self) -> int | None:
        """The reference images' resolution; None when the file holds statistics only."""
        return self.images.resolution if self.images is not None else None


@dataclasses.dataclass(frozen=True)
class ReferenceOptions:
    """How reference features are computed and cached (the keyword arguments of :func:`load_reference`)."""

    device: torch.device | str = "cpu"
    batch_size: int = 64
    num_workers: int = 0
    cache_dir: PathLike | None = None
    use_cache: bool = True
    progress: bool = False


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
    cached in ``cache_dir`` (default :func:`reference_cache_dir`; ``use_cache=False``: neither
    read nor written), keyed on the
    path, size and mtime of the input (every file's, for folders) and the extractor identity;
    cache files are written atomically. :class:`ReferenceStatistics` passed in are checked
    against ``extractor`` and returned as they are.
    """
    identity = extractor_identity(extractor)
    opened = open_reference(reference)
    check_reference(opened, extractor, identity)  # before the reference images are read
    options = ReferenceOptions(device, batch_size, num_workers, cache_dir, use_cache, progress)
    return reference_statistics(opened, extractor, identity, options)


def open_reference(reference: PathLike | ReferenceStatistics) -> ReferenceSpec | ReferenceStatistics:
    """``reference`` read and checked as far as possible without a feature network.

    Both results have ``source`` and ``resolution`` (None when unknown), so a caller can check
    the samples against them before the network is loaded.
    """
    if isinstance(reference, ReferenceStatistics):
        return reference
    return _inspect_reference(reference)


def check_reference(opened: ReferenceSpec | ReferenceStatistics, extractor: nn.Module, identity: str) -> None:
    """Refuse a reference that ``extractor`` (whose identity is ``identity``) cannot be compared with.

    Stored or given statistics must have the extractor's feature widths (where it declares
    them); given statistics must have been made by the same extractor. Cheap: no image is read.
    """
    if isinstance(opened, ReferenceSpec):
        _check_stored_dims(opened, extractor)
        return
    if opened.extractor != identity:
        raise ValueError(
            f"the reference statistics were made with extractor {opened.extractor!r}, "
            f"not with {identity!r}; recompute them with the same extractor"
        )
    _check_given_reference(opened, extractor)


def reference_statistics(
    opened: ReferenceSpec | ReferenceStatistics, extractor: nn.Module, identity: str, options: ReferenceOptions
) -> ReferenceStatistics:
    """The statistics of a reference passed through :func:`check_reference`: loaded from the cache, or computed.

    :class:`ReferenceStatistics` are returned as they are. Otherwise the features of the
    reference images are read from the cache when it holds them for this input and this
    extractor, else computed and cached; an ADM reference batch's stored statistics are
    always taken from the file itself.
    """
    if isinstance(opened, ReferenceStatistics):
        return opened
    spec = opened
    cached = cache_file = key = None
    if options.use_cache and spec.images is not None:
        cache_dir = Path(options.cache_dir).expanduser() if options.cache_dir is not None else reference_cache_dir()
        cache_file, key = _cache_path(cache_dir, spec, identity)
        cached = _load_cache(cache_file, key, spec.images.num_images, extractor)
    arrays: dict[str, np.ndarray] = {}
    if cached is not None:
        logger.info(f"reference statistics of {spec.source} read from the cache {cache_file}")
        arrays = cached
    elif spec.images is not None:
        arrays = _arrays_from_images(spec, extractor, options)
        if cache_file is not None:
            _write_cache(cache_file, arrays, key)
    if spec.kind == "adm_npz":
        arrays.update(spec.stored)
    spatial_stats = None
    if "mu_s" in arrays and "sigma_s" in arrays:
        spatial_stats = FeatureStatistics(arrays["mu_s"], arrays["sigma_s"])
    return ReferenceStatistics(
        pool=FeatureStatistics(arrays["mu"], arrays["sigma"]),
        spatial=spatial_stats,
        pool_features=arrays.get("pool_features"),
        num_images=spec.images.num_images if spec.images is not None else None,
        source=spec.source,
        extractor=identity,
        resolution=spec.resolution,
        from_cache=cached is not None,
        statistics_from_images=spec.kind == "images",
        spatial_features=arrays.get("spatial_features"),
    )


def _arrays_from_images(spec: ReferenceSpec, extractor: nn.Module, options: ReferenceOptions) -> dict[str, np.ndarray]:
    """What the cache holds for a reference: its images' pool features, and for image references their statistics."""
    features = extract_features(
        spec.images,
        extractor,
        device=options.device,
        batch_size=options.batch_size,
        num_workers=options.num_workers,
        progress=options.progress,
    )
    arrays = {"pool_features": features.pool}
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
    return arrays


# ---------------------------------------------------------------------------------------------
# Reading and checking a reference
# ---------------------------------------------------------------------------------------------


def _inspect_reference(reference: PathLike) -> ReferenceSpec:
    """Read what ``reference`` holds and check its stored statistics; no feature network is needed."""
    path = Path(reference)
    if not path.exists():
        raise InputNotFound(f"reference {path}: no such file or folder", parameters="reference")
    if path.is_dir():
        return ReferenceSpec(path, "images", FolderImageSource(path), None)
    names = [n[:-4] for n in zip_member_names(path) if n.endswith(".npy")]
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
        return ReferenceSpec(path, "adm_npz", images, stored)
    if "arr_0" in names:
        return ReferenceSpec(path, "images", NpzImageSource(path), None)
    raise ValueError(
        f"{path} is neither an ADM reference batch (mu, sigma, mu_s, sigma_s, arr_0) nor an image "
        f".npz (arr_0); it has {sorted(names)}"
    )


def _check_statistics(
    where: str, mu: Any, sigma: Any, expected_dim: int | None, names: tuple[str, str] = ("mu", "sigma"),
    psd: bool = True,
) -> None:
    """Refuse statistics that cannot be used: ``mu`` not (D,), ``sigma`` not (D, D), non-numeric,
    non-finite, not symmetric, or (with ``psd``) with a negative eigenvalue beyond rounding.

    ``expected_dim`` is the feature network's D when known (2048 for pool_3, 2023 for ADM's
    sFID layer); otherwise D is taken from ``mu``. It runs before any image is processed; the
    eigenvalues of a 2048 x 2048 sigma take a second or two, so statistics already checked
    pass ``psd=False``.
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
    if psd:
        symmetric = 0.5 * (sigma.astype(np.float64) + sigma.T.astype(np.float64))
        check_psd(np.linalg.eigvalsh(symmetric), f"{where}: '{sigma_name}'",
                  sigma.dtype if np.issubdtype(sigma.dtype, np.floating) else None)


def _check_stored_dims(spec: ReferenceSpec, extractor: nn.Module) -> None:
    """Stored reference statistics against the extractor's declared feature widths."""
    if not spec.stored:
        return
    for mu, sigma, attribute in (("mu", "sigma", "pool_dim"), ("mu_s", "sigma_s", "spatial_dim")):
        if mu in spec.stored:
            expected = getattr(extractor, attribute, None)
            # psd=False: open_reference checked the stored matrices' eigenvalues already.
            _check_statistics(f"reference {spec.path}", spec.stored[mu], spec.stored[sigma], expected, (mu, sigma),
                              psd=False)


def _check_given_reference(ref: ReferenceStatistics, extractor: nn.Module) -> None:
    """A ReferenceStatistics passed in (e.g. reused across a sweep) checked like a stored one."""
    where = f"reference statistics of {ref.source}"
    # Statistics this package computed from images (np.cov) are positive semi-definite by construction.
    psd = not ref.statistics_from_images
    _check_statistics(where, ref.pool.mu, ref.pool.sigma, getattr(extractor, "pool_dim", None), ("mu", "sigma"), psd)
    if ref.spatial is not None:
        _check_statistics(
            where, ref.spatial.mu, ref.spatial.sigma, getattr(extractor, "spatial_dim", None), ("mu_s", "sigma_s"), psd
        )
    if ref.pool_features is not None and np.ndim(ref.pool_features) == 2:
        if ref.pool_features.shape[1] != ref.pool.mu.shape[0]:
            raise ValueError(
                f"{where}: pool_features have {ref.pool_features.shape[1]} values per image but mu has "
                f"{ref.pool.mu.shape[0]}"
            )


# ---------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------


def reference_cache_dir() -> Path:
    """Where reference statistics are cached unless a ``cache_dir`` is given: ``reference_stats``
    in ``$MOH_DIT_CACHE``, else in ``$XDG_CACHE_HOME/moh-dit``, else in ``~/.cache/moh-dit``."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg or os.path.join(os.path.expanduser("~"), ".cache"), "moh-dit")
    return Path(root).expanduser() / "reference_stats"


def _size_text(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def _write_cache(cache_file: Path, arrays: Mapping[str, np.ndarray], key: str) -> None:
    with atomic_write(cache_file) as f:
        np.savez(f, **arrays, cache_key=np.array(key))
    logger.info(f"wrote the reference statistics cache {cache_file} ({_size_text(cache_file.stat().st_size)}); "
                "remove it to free the space, or set use_cache=False not to write it")


def _cache_path(cache_dir: Path, spec: ReferenceSpec, identity: str) -> tuple[Path, str]:
    fingerprint = spec.images.fingerprint() if spec.images is not None else None
    if spec.kind == "adm_npz":
        # stored statistics are read from the file each time; only arr_0's features are cached
        stat = spec.path.stat()
        fingerprint = json.dumps(["adm_npz", str(spec.path.resolve()), stat.st_size, stat.st_mtime_ns])
    key = json.dumps({"version": _CACHE_FORMAT_VERSION, "kind": spec.kind, "source": fingerprint, "extractor": identity})
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir / f"{spec.path.name}-{digest}.npz", key


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
