"""Feature extractors: what they return, who they are, and running one over an image set.

Any ``nn.Module`` mapping uint8 images (N, 3, H, W) to pool features (and optionally logits
and spatial features) can be evaluated with; :class:`FeatureExtractor` is the documented
contract and :class:`moh_dit.evaluation.inception.TFInceptionV3Features` the ADM-comparable
one. :func:`extractor_identity` names an extractor and its weights, which is what cached
reference statistics are keyed on.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..utils.resources import check_fits_in_memory
from ..utils.runtime import tf32_disabled
from .sources import open_image_source

__all__ = [
    "check_feature_memory",
    "feature_bytes_per_image",
    "ExtractedFeatures",
    "FeatureExtractor",
    "InceptionFeatures",
    "as_inception_features",
    "extract_features",
    "extractor_identity",
]


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
    on_batch: Callable[[torch.Tensor], None] | None = None,
) -> ExtractedFeatures:
    """Run ``extractor`` over ``images`` (anything :func:`open_image_source` takes) in batches.

    The extractor is moved to ``device`` and put in eval mode; batches go to ``device`` as
    uint8 NCHW and features come back to the CPU as float32. ``on_batch`` sees every uint8
    NHWC batch as it passes (e.g. to classify the same images in the same single pass).
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
            if on_batch is not None:
                on_batch(batch)
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


# The widths the TF-compatible Inception gives per image (pool_3, logits, ADM's spatial layer):
# what a size check assumes before the network is loaded, or for an extractor that does not say.
_DEFAULT_WIDTHS = {"pool_dim": 2048, "num_logits": 1008, "spatial_dim": 17 * 17 * 7}


def feature_bytes_per_image(extractor: nn.Module | None = None) -> int:
    """Bytes of memory :func:`extract_features` holds per image: its float32 features (pool,
    logits, spatial) twice over, as batches and then as the joined array."""
    widths = [getattr(extractor, name, None) or default for name, default in _DEFAULT_WIDTHS.items()]
    return 2 * 4 * sum(int(width) for width in widths)


def check_feature_memory(num_images: int, what: str, advice: str, extractor: nn.Module | None = None,
                         parameters: str | tuple[str, ...] = ()) -> None:
    """Refuse, before any image is read, an evaluation of ``num_images`` images whose features
    cannot fit in the available memory (``what`` names the count, e.g. ``"num_samples N"``, and
    ``parameters`` the names in it)."""
    check_fits_in_memory(num_images * feature_bytes_per_image(extractor), what, advice, parameters=parameters)
