"""ADM-comparable evaluation of image samples: FID, sFID, Inception Score, precision, recall.

The numbers diffusion papers report (ADM, DiT, MoH-DiT) come from the TensorFlow evaluator of
guided-diffusion (``evaluations/evaluator.py``, Dhariwal & Nichol 2021). This package reproduces
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

Everything the ``moh-dit evaluate`` front does is callable from here::

    >>> from moh_dit.evaluation import evaluate
    >>> result = evaluate("samples.npz", "VIRTUAL_imagenet256_labeled.npz", device="cuda")
    >>> result.fid, result.sfid, result.inception_score, result.precision, result.recall

A randomly initialised Inception (:func:`build_random_inception`, ``random_inception_seed=N``)
exists for offline demos and smoke tests only; its numbers are labelled as not comparable to
published ones.

The package's modules, each with one job: :mod:`.frechet` (feature statistics, FID/sFID),
:mod:`.metrics` (Inception Score, precision/recall), :mod:`.features` (the extractor contract
and running one over images), :mod:`.inception` (the TF-compatible InceptionV3 and its
weights), :mod:`.sources` (where images come from) and :mod:`.reference` (reference statistics
and their cache). :func:`evaluate` here puts them together; every public name is re-exported.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import InvalidInput
from .classifier import SampleClassifier
from ..data.datasets import IMG_EXTENSIONS
from ..utils.runtime import tf32_disabled
from .class_accuracy import (
    ClassAccuracy,
    ClassAccuracyMeter,
    check_class_names,
    class_accuracy,
    read_class_map,
    read_sample_labels,
    sample_class_names,
)
from .features import (
    ExtractedFeatures,
    FeatureExtractor,
    InceptionFeatures,
    as_inception_features,
    check_feature_memory,
    extract_features,
    extractor_identity,
    feature_bytes_per_image,
)
from .frechet import FeatureStatistics, compute_statistics, frechet_distance, frechet_distance_from_features
from .inception import (
    INCEPTION_WEIGHTS_ENV,
    INCEPTION_WEIGHTS_NAME,
    INCEPTION_WEIGHTS_SHA256_PREFIX,
    INCEPTION_WEIGHTS_URL,
    NOT_COMPARABLE,
    MAX_RANDOM_INCEPTION_SEED,
    InceptionWeightsNotFoundError,
    TFInceptionV3Features,
    build_random_inception,
    load_inception,
    random_inception_state_dict,
    resolve_inception_weights,
    save_random_inception_weights,
)
from .metrics import (
    ADM_K,
    ADM_SPLIT_SIZE,
    inception_score,
    inception_score_from_logits,
    manifold_radii_squared,
    precision_recall,
)
from .reference import (
    CACHE_ENV,
    ReferenceOptions,
    ReferenceSpec,
    ReferenceStatistics,
    check_reference,
    load_reference,
    open_reference,
    reference_cache_dir,
    reference_statistics,
)
from .sources import (
    FolderImageSource,
    ImageSource,
    IterableImageSource,
    NpzArrayReader,
    NpzImageSource,
    PathLike,
    open_image_source,
)

# IMG_EXTENSIONS, INCEPTION_WEIGHTS_SHA256_PREFIX, NOT_COMPARABLE, FolderImageSource,
# NpzImageSource and PathLike are imported above so that callers can import them from here too;
# they are not part of __all__.
__all__ = [
    "ADM_K",
    "check_extractor_choice",
    "check_feature_memory",
    "feature_bytes_per_image",
    "ADM_SPLIT_SIZE",
    "CACHE_ENV",
    "ClassAccuracy",
    "ClassAccuracyMeter",
    "INCEPTION_WEIGHTS_ENV",
    "INCEPTION_WEIGHTS_NAME",
    "INCEPTION_WEIGHTS_URL",
    "MAX_RANDOM_INCEPTION_SEED",
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
    "check_class_names",
    "class_accuracy",
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
    "read_class_map",
    "read_sample_labels",
    "sample_class_names",
    "reference_cache_dir",
    "resolve_inception_weights",
    "save_random_inception_weights",
    "tf32_disabled",
]


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
    class_accuracy: float | None = None
    class_accuracy_per_class: dict[str, float] | None = None
    class_accuracy_counts: dict[str, int] | None = None
    classifier: str | None = None
    classifier_held_out_accuracy: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def evaluate(
    samples: Any,
    reference: PathLike | ReferenceStatistics,
    *,
    extractor: nn.Module | None = None,
    inception_weights: PathLike | None = None,
    random_inception_seed: int | None = None,
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
    classifier: SampleClassifier | None = None,
    labels: Sequence[int] | np.ndarray | None = None,
    class_map: Mapping[int, int] | None = None,
    class_names: Sequence[str] | None = None,
) -> EvaluationResult:
    """FID, sFID, Inception Score, precision and recall of ``samples`` against ``reference``, as ADM.

    ``samples``: an image folder, an ``.npz`` with ``arr_0`` uint8 (N, H, W, 3) (streamed), a
    uint8 NHWC array/tensor, or an iterable of such batches (e.g. straight from a pipeline).
    ``reference``: an ADM reference batch ``.npz``, an image ``.npz``/folder, or
    :class:`ReferenceStatistics` from :func:`load_reference` (reuse it across a sweep).
    ``extractor`` defaults to the TF-compatible InceptionV3 with weights from
    :func:`resolve_inception_weights` (``inception_weights`` > env > hub cache > download);
    ``random_inception_seed`` takes :func:`build_random_inception` with that seed instead (offline
    smoke tests: the result says its numbers are not comparable). Give at most one of the three.
    Inputs are validated before the extractor is loaded or any image is processed, and the
    stored reference statistics (shapes against the extractor's feature widths) and the two
    resolutions before any feature is computed.

    Samples and reference of different resolutions (e.g. 32 px samples against a 64 px reference;
    an ADM reference batch's resolution is that of its ``arr_0``) are refused: their FID measures
    the resizing as much as the model. ``allow_resolution_mismatch=True`` evaluates anyway and
    records it in the result. A reference
    holding statistics only (no images) has no known resolution; the result's notes say so.

    With a ``classifier`` (:func:`moh_dit.evaluation.classifier.load_classifier`) and the samples'
    ``labels`` (one per sample, in order), the result also holds the class accuracy of the
    samples, overall and per class, computed in the same pass over the images
    (:mod:`.class_accuracy`; ``class_map`` and ``class_names`` as for
    :class:`~.class_accuracy.ClassAccuracyMeter`).
    """
    _check_arguments(batch_size=batch_size, num_workers=num_workers, split_size=split_size, k=k)
    check_extractor_choice(extractor, inception_weights, random_inception_seed)
    minimum = max(2, k + 1)
    sample_source, opened = _open_inputs(samples, reference, minimum)
    check_resolution = functools.partial(_check_resolutions, sample_source, opened, allow_resolution_mismatch)
    check_resolution(sample_source.resolution)  # both known here unless the samples come from an iterator
    meter = _class_accuracy_meter(sample_source, classifier, labels, class_map, class_names)
    if extractor is None and random_inception_seed is not None:
        extractor = build_random_inception(random_inception_seed)
    elif extractor is None:
        extractor = load_inception(inception_weights, download=download)
    identity = extractor_identity(extractor)
    check_reference(opened, extractor, identity)
    _check_memory(sample_source, opened, extractor)
    if sample_source.resolution is None and opened.resolution is not None and isinstance(
        sample_source, IterableImageSource
    ):
        # Take the first batch now (after the cheap checks, before any feature) to learn its size.
        check_resolution(sample_source.peek_resolution())
    options = ReferenceOptions(device, batch_size, num_workers, cache_dir, use_cache, progress)
    ref = reference_statistics(opened, extractor, identity, options)

    features = extract_features(
        sample_source, extractor, device=device, batch_size=batch_size, num_workers=num_workers, progress=progress,
        on_batch=None if meter is None else meter.update,
    )
    if len(features) < minimum:
        raise ValueError(f"{sample_source.description}: {len(features)} images; need at least {minimum}")
    consistency = {} if meter is None else dict(
        meter.result().to_dict(), classifier=classifier.identity,
        classifier_held_out_accuracy=classifier.held_out_accuracy)

    comparable = bool(getattr(extractor, "comparable_to_published", False))
    notes = _notes(identity, comparable, sample_source.resolution, ref, features, split_size)
    return EvaluationResult(
        **_metrics(features, ref, split_size, k, device),
        num_samples=len(features),
        num_reference_images=ref.num_images,
        samples=sample_source.description,
        reference=ref.source,
        extractor=identity,
        inception_weights=dict(getattr(extractor, "weights_info", {}) or {}),
        comparable_to_published=comparable,
        sample_resolution=sample_source.resolution,
        reference_resolution=ref.resolution,
        reference_from_cache=ref.from_cache,
        notes=notes,
        allow_resolution_mismatch=bool(allow_resolution_mismatch),
        **consistency,
    )


def _class_accuracy_meter(sample_source: ImageSource, classifier: SampleClassifier | None, labels: Any,
                          class_map: Mapping[int, int] | None, class_names: Sequence[str] | None
                          ) -> ClassAccuracyMeter | None:
    """The class-accuracy meter when a classifier is given, checked against the samples before any work."""
    if classifier is None:
        if labels is not None:
            raise InvalidInput("labels were given without a classifier to measure class accuracy with",
                               parameters=("labels", "classifier"))
        return None
    if labels is None:
        raise InvalidInput("class accuracy needs labels, the class label of each sample", parameters="labels")
    if sample_source.num_images is not None and sample_source.num_images != len(labels):
        raise InvalidInput(f"labels has {len(labels)} entries for the {sample_source.num_images} images of "
                           f"{sample_source.description}; every sample needs its class label", parameters="labels")
    return ClassAccuracyMeter(classifier, labels, class_map, class_names)


def _check_memory(sample_source: ImageSource, reference: ReferenceSpec | ReferenceStatistics,
                  extractor: nn.Module) -> None:
    """Refuse, before any feature is computed, image sets whose features cannot fit in memory."""
    samples = sample_source.num_images or 0
    images = reference.images if isinstance(reference, ReferenceSpec) else None
    total = samples + (images.num_images or 0 if images is not None else 0)
    if total:
        check_feature_memory(total, f"evaluating {samples} samples of {sample_source.description} and the reference "
                             f"images ({total} images in all)", "evaluate fewer samples", extractor)


def _check_arguments(**values: Any) -> None:
    """The numeric arguments of :func:`evaluate`, before anything is opened."""
    least = {"batch_size": 1, "num_workers": 0, "split_size": 1, "k": 1}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least[name]:
            raise InvalidInput(f"{name} must be an integer >= {least[name]}, got {value!r}", parameters=name)


def check_extractor_choice(extractor: nn.Module | None, inception_weights: PathLike | None,
                            random_inception_seed: int | None) -> None:
    """At most one way to the feature network, and a seed ``torch.Generator`` accepts (also
    the sweep's check)."""
    given = [name for name, value in (("extractor", extractor), ("inception_weights", inception_weights),
                                      ("random_inception_seed", random_inception_seed)) if value is not None]
    if len(given) > 1:
        raise InvalidInput(f"give at most one of {', '.join(given)}", parameters=tuple(given))
    seed = random_inception_seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not 0 <= seed <= MAX_RANDOM_INCEPTION_SEED):
        raise InvalidInput(f"random_inception_seed must be an integer in [0, {MAX_RANDOM_INCEPTION_SEED}], got {seed!r}",
                           parameters="random_inception_seed")


def _open_inputs(
    samples: Any, reference: PathLike | ReferenceStatistics, minimum: int
) -> tuple[ImageSource, ReferenceSpec | ReferenceStatistics]:
    """Both sides opened and counted (where their size is known) before the feature network is loaded."""
    sample_source = open_image_source(samples, "samples")
    if sample_source.num_images is not None and sample_source.num_images < minimum:
        raise ValueError(f"{sample_source.description}: {sample_source.num_images} images; need at least {minimum}")
    opened = open_reference(reference)
    if isinstance(opened, ReferenceSpec) and opened.images is not None and opened.images.num_images < minimum:
        raise ValueError(f"{opened.path}: {opened.images.num_images} reference images; need at least {minimum}")
    return sample_source, opened


def _resolution_text(resolution: int | None) -> str:
    return "of unknown resolution" if resolution is None else f"{resolution}x{resolution} px"


def _check_resolutions(
    sample_source: ImageSource,
    reference: ReferenceSpec | ReferenceStatistics,
    allow_mismatch: bool,
    sample_resolution: int | None,
) -> None:
    """Refuse samples and reference of different resolutions (where both are known) unless allowed."""
    reference_resolution = reference.resolution
    mismatch = None not in (sample_resolution, reference_resolution) and sample_resolution != reference_resolution
    if mismatch and not allow_mismatch:
        raise InvalidInput(
            f"samples {sample_source.description} are {_resolution_text(sample_resolution)} but "
            f"reference {reference.source} is {_resolution_text(reference_resolution)}; FID between different "
            "resolutions is not comparable. Make them match, or set allow_resolution_mismatch to evaluate anyway", parameters=("samples", "reference", "allow_resolution_mismatch")
        )


def _notes(
    identity: str,
    comparable: bool,
    sample_resolution: int | None,
    ref: ReferenceStatistics,
    features: ExtractedFeatures,
    split_size: int,
) -> list[str]:
    """What a reader of the numbers must know: which are missing, and why some are not comparable."""
    notes: list[str] = []
    if not comparable:
        notes.append(f"extractor {identity} is not the published TF Inception: {NOT_COMPARABLE}")
    if ref.resolution is None:
        notes.append(
            f"reference resolution unknown: {ref.source} holds statistics only (no arr_0 images), so the "
            f"sample resolution ({_resolution_text(sample_resolution)}) could not be checked against it"
        )
    elif sample_resolution is not None and sample_resolution != ref.resolution:
        notes.append(
            f"samples are {_resolution_text(sample_resolution)} but the reference is "
            f"{_resolution_text(ref.resolution)} (allowed by allow_resolution_mismatch): these numbers are "
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
    return notes


def _frechet(samples: np.ndarray, reference: FeatureStatistics, reference_features: np.ndarray | None) -> float:
    # Both routes give the same number; the feature route is much cheaper while N < D.
    d = samples.shape[1]
    if reference_features is not None and samples.shape[0] <= d and reference_features.shape[0] <= d:
        return frechet_distance_from_features(samples, reference_features)
    return compute_statistics(samples).frechet_distance(reference)


def _metrics(
    features: ExtractedFeatures, ref: ReferenceStatistics, split_size: int, k: int, device: torch.device | str
) -> dict[str, float | None]:
    """The five numbers (None where a side lacks what one needs), in ADM's order."""
    fid = _frechet(features.pool, ref.pool, ref.pool_features if ref.statistics_from_images else None)
    sfid = None
    if ref.spatial is not None and features.spatial is not None:
        sfid = _frechet(features.spatial, ref.spatial, ref.spatial_features if ref.statistics_from_images else None)
    score = inception_score_from_logits(features.logits, split_size) if features.logits is not None else None
    precision = recall = None
    if ref.pool_features is not None:
        precision, recall = precision_recall(ref.pool_features, features.pool, k, device=device)
    return {"fid": fid, "sfid": sfid, "inception_score": score, "precision": precision, "recall": recall}
