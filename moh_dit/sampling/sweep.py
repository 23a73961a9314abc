"""The head-activation sweep: sample quality and attention cost of one model at several ratios.

MoH lets a trained model run with fewer (or more) routed heads per token than it was
trained with (``MoHDiTTransformer2DModel.set_head_activation_ratio``). This module measures
what that costs: for each requested ratio it samples the same images (image ``i`` has class
``i mod num_classes`` and seed ``seed + i`` at every ratio, so differences come from the
ratio alone), evaluates them with ADM's metrics (:func:`moh_dit.evaluation.evaluate`)
against one reference whose statistics are computed once, and reports the ideal head-sparse
attention FLOPs of the realised per-layer top-K (:func:`attention_flops`) and the sampling
wall time. Samples stream from the pipeline into the feature extractor, so memory does not
grow with ``num_samples``.

``moh-dit sweep`` is the command-line front; everything here is callable::

    >>> from moh_dit.sampling.sweep import run_sweep, write_sweep
    >>> result = run_sweep("moh-dit-xl-2-90-pipeline", ratios=("trained", 1.0, 0.75, 0.6, "min"),
    ...                    reference="VIRTUAL_imagenet256_labeled.npz", num_samples=10_000,
    ...                    num_inference_steps=250, guidance_scale=1.5, device="cuda")
    >>> write_sweep(result, "sweeps/xl-90")  # sweep.json, sweep.csv, fid_vs_ratio.png
    >>> print(result.table())

The steps of :func:`sweep_head_activation` (``run_sweep`` takes its settings as keywords):
plan the ratios with every input checked on the model (:func:`plan_sweep`), compute the
reference statistics once, sample and evaluate each ratio, assemble the :class:`SweepResult`; what it produces and
how it is written lives in ``moh_dit.sampling.sweep_results`` (re-exported here). Attention FLOPs come
from ``moh_dit.models.flops``, the package's one FLOP account.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..evaluation.classifier import SampleClassifier, load_classifier
from ..evaluation import (
    ADM_K,
    EvaluationResult,
    ReferenceStatistics,
    build_random_inception,
    check_class_names,
    check_extractor_choice,
    check_feature_memory,
    evaluate,
    extractor_identity,
    load_inception,
    load_reference,
)
from ..errors import InputNotFound, InvalidInput
from ..pipelines.pipeline_moh_dit import MoHDiTPipeline
from ..utils.output_folders import check_folder_path as _refuse_file_path
from ..utils.output_folders import write_output_marker
from .sample import (
    SampleSettings,
    check_settings,
    class_labels_for,
    generate_batch,
    load_pipeline,
    png_path,
    run_identity,
    save_png_atomic,
)
from .sweep_intervals import BOOTSTRAP_RESAMPLES, PoolFeatureRecorder, bootstrap_fid, wilson_interval
from .sweep_plans import (
    DEFAULT_RATIOS,
    RATIO_KEYWORDS,
    RatioPlan,
    _label,
    attention_flops,
    layer_attention_flops,
    parse_ratios,
    plan_ratios,
    transformer_calls_per_image,
)
from .sweep_results import (
    CSV_COLUMNS,
    CSV_FILE,
    JSON_FILE,
    PLOT_FILE,
    PLOT_PANELS,
    SweepResult,
    SweepRow,
    figure_png,
    INTERVAL_NOTE,
    is_sweep_folder,
    model_name,
    plot_fid_vs_ratio,
    write_sweep,
)
from ..models.transformer_moh_dit import MoHDiTTransformer2DModel
from ..utils.logging import get_logger

logger = get_logger(__name__)

__all__ = [
    "DEFAULT_RATIOS",
    "RATIO_KEYWORDS",
    "ATTENTION_PATHS",
    "RatioPlan",
    "SweepRow",
    "SweepResult",
    "SweepSettings",
    "parse_ratios",
    "layer_attention_flops",
    "attention_flops",
    "transformer_calls_per_image",
    "plan_ratios",
    "plan_sweep",
    "check_sample_count",
    "check_device",
    "check_folder_path",
    "is_sweep_folder",
    "run_sweep",
    "sweep_head_activation",
    "write_sweep",
    "plot_fid_vs_ratio",
    "figure_png",
    "PLOT_PANELS",
    "JSON_FILE",
    "CSV_FILE",
    "PLOT_FILE",
    "CSV_COLUMNS",
]

PathLike = Union[str, os.PathLike]

# "auto": leave the model's setting (by default automatic: head-sparse for large layers with
#         at most half their heads active, on the CPU; dense-masked otherwise);
# "masked": dense-masked (the release's way: every head computed, unselected ones zeroed);
# "sparse": head-sparse (unselected routed heads skipped).
ATTENTION_PATHS = {"auto": None, "masked": False, "sparse": True}


# --------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------


@dataclass
class SweepSettings:
    """How a sweep runs, beyond what decides the images (:class:`~moh_dit.sampling.sample.SampleSettings`).

    ``batch_size``: images per sampling batch; ``eval_batch_size``: images per feature
    extractor pass. ``attention``: ``"auto"`` (the model's setting), ``"masked"`` or
    ``"sparse"`` (see ``ATTENTION_PATHS``); it matters for the wall time only.
    ``save_samples`` writes each ratio's PNGs to ``output_dir/ratio_X/samples/`` (the layout
    of ``moh_dit.sampling.sample``) as they are made. ``cache_dir`` / ``use_cache``: where the
    reference statistics are cached. ``warm_up``: one untimed single-step batch before each
    ratio's timed sampling. Unless :func:`sweep_head_activation` is given an extractor, the
    published TF Inception is used (``inception_weights`` or the usual search, a download if
    ``download``; a missing file raises ``InceptionWeightsNotFoundError``), or, only when asked
    with ``random_inception_seed``, a random Inception whose numbers are labelled not
    comparable. ``vae``, ``scheduler``, ``dtype``: how a model folder is loaded
    (:func:`moh_dit.sampling.sample.load_pipeline`); unused for a pipeline object. ``classifier``:
    a :class:`~moh_dit.evaluation.classifier.SampleClassifier`, a folder from ``train_classifier`` or
    ``"torchvision:NAME"`` (with ``classifier_weights``), to add each ratio's class accuracy.
    ``bootstrap``: resamples of the FID bootstrap interval (0: none; ``bootstrap_seed`` fixes
    them). ``match_flops``: add, for each schedule, the constant ratio of closest attention FLOPs.

    Checked when made (InvalidInput naming the field); nothing is loaded or written.
    """

    batch_size: int = 32
    eval_batch_size: int = 64
    device: torch.device | str = "cpu"
    attention: str = "auto"
    output_dir: PathLike | None = None
    save_samples: bool = False
    cache_dir: PathLike | None = None
    use_cache: bool = True
    warm_up: bool = True
    progress: bool = True
    inception_weights: PathLike | None = None
    random_inception_seed: int | None = None
    download: bool = True
    vae: str | None = None
    scheduler: str = "ddpm"
    dtype: str | torch.dtype = "float32"
    classifier: Any = None
    classifier_weights: PathLike | None = None
    bootstrap: int = BOOTSTRAP_RESAMPLES
    bootstrap_seed: int = 0
    match_flops: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"{name} must be >= 1, got {getattr(self, name)}.", parameters=name)
        if self.bootstrap != 0 and self.bootstrap < 2:
            raise InvalidInput(f"bootstrap must be 0 (no FID interval) or >= 2 resamples, got {self.bootstrap}.",
                               parameters="bootstrap")
        if self.bootstrap_seed < 0:
            raise InvalidInput(f"bootstrap_seed must be >= 0, got {self.bootstrap_seed}.", parameters="bootstrap_seed")
        if self.attention not in ATTENTION_PATHS:
            raise InvalidInput(f"attention={self.attention!r}; choose one of {list(ATTENTION_PATHS)}.",
                               parameters="attention")
        if self.save_samples and self.output_dir is None:
            raise InvalidInput("save_samples=True needs an output_dir.", parameters=("save_samples", "output_dir"))
        check_device(self.device)
        if self.output_dir is not None:
            check_folder_path(self.output_dir, "output_dir")
        if self.cache_dir is not None and self.use_cache:
            check_folder_path(self.cache_dir, "cache_dir")


@dataclass
class _Run:
    """What every ratio of one sweep shares, fixed before the first image."""

    pipe: MoHDiTPipeline
    images: SampleSettings
    settings: SweepSettings
    reference: ReferenceStatistics
    extractor: nn.Module
    extractor_identity: str
    calls: int  # transformer calls per image
    classifier: SampleClassifier | None = None
    labels: list[int] | None = None  # every image's class label, for the classifier (the same at every ratio)


class _Clock:
    seconds = 0.0


def _sample_batches(
    pipe: MoHDiTPipeline,
    settings: SampleSettings,
    realised: float,  # the plan's realised ratio (a schedule's mean)
    batch_size: int,
    clock: _Clock,
    save_dir: Path | None,
    bar: tqdm,
) -> Iterator[np.ndarray]:
    """uint8 (B, H, W, 3) batches of images ``0 .. num_samples - 1`` as ``sample_images``
    makes them (class ``class_labels_for(i)``, seed ``settings.seed + i``, DiT's quantisation);
    only the pipeline and decoding time is added to ``clock``."""
    synchronize = pipe._execution_device.type == "cuda"
    if save_dir is not None:
        png_path(save_dir, 0).parent.mkdir(parents=True, exist_ok=True)
    for start in range(0, settings.num_samples, batch_size):
        batch = list(range(start, min(start + batch_size, settings.num_samples)))
        if synchronize:
            torch.cuda.synchronize()
        began = time.perf_counter()
        images, ran_at = generate_batch(pipe, settings, batch)
        clock.seconds += time.perf_counter() - began
        if abs(ran_at - realised) > 1e-9:
            raise RuntimeError(f"the pipeline ran at head activation {ran_at:.4f}, not the planned {realised:.4f}.")
        if images.shape[-1] != 3:
            raise ValueError(f"the model makes {images.shape[-1]}-channel images; the evaluation needs RGB.")
        if save_dir is not None:
            for index, image in zip(batch, images):
                save_png_atomic(png_path(save_dir, index), image)
        bar.update(len(batch))
        yield images


def _warm_up(pipe: MoHDiTPipeline, settings: SampleSettings, batch_size: int) -> None:
    """One untimed single-step call on a full batch: the first call at a new ratio pays
    one-off costs (allocator growth, kernel selection, lazy initialisation) that would
    otherwise be charged to that ratio's wall time."""
    batch = list(range(min(batch_size, settings.num_samples)))
    generate_batch(pipe, dataclasses.replace(settings, num_inference_steps=1), batch)


def _resolve_extractor(extractor: nn.Module | None, settings: SweepSettings) -> nn.Module:
    check_extractor_choice(extractor, settings.inception_weights, settings.random_inception_seed)
    if extractor is not None:
        return extractor
    if settings.random_inception_seed is not None:
        return build_random_inception(settings.random_inception_seed)
    # Never a silent fallback: missing weights raise InceptionWeightsNotFoundError with advice.
    return load_inception(settings.inception_weights, download=settings.download)


def plan_sweep(pipe: MoHDiTPipeline, ratios: Sequence[float | str] | str, images: SampleSettings,
               match_flops: bool = False) -> list[RatioPlan]:
    """The sweep's plans (:func:`plan_ratios`) on ``pipe``, with every input checked once before any
    work: what decides the images by the pipeline's own check of a call (guidance, steps within the
    model's diffusion steps, scheduler / model agreement, ...), the ratios and every step of a
    schedule against the model's reachable range by the planning. InvalidInput names the input."""
    check_settings(pipe, dataclasses.replace(images, head_activation_ratio=None))  # each plan's ratio: planned below
    timesteps = pipe.sampling_timesteps(images.num_inference_steps, None)
    return plan_ratios(pipe.transformer, ratios, timesteps, match_flops=match_flops)


def check_sample_count(num_samples: int, extractor: nn.Module | None = None) -> None:
    """Enough images for the metrics (precision / recall use the k nearest neighbours), and the
    features of all of them within the machine's memory (they are kept for the metrics)."""
    if num_samples < ADM_K + 1:
        raise InvalidInput(f"num_samples must be >= {ADM_K + 1} (precision/recall use k={ADM_K}), got {num_samples}.",
                           parameters="num_samples")
    try:
        check_feature_memory(num_samples, f"num_samples {num_samples}",
                             "use a smaller num_samples (the features of every image are kept for the metrics)",
                             extractor)
    except ValueError as err:
        raise InvalidInput(str(err), parameters="num_samples") from None


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device`` that exists here; InvalidInput naming it otherwise."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidInput(f"device {device!r} is not one torch knows; use cpu, cuda or cuda:N.",
                           parameters="device") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInput(f"device {device!r} but CUDA is not available; use cpu.", parameters="device")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise InvalidInput(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA devices.",
                               parameters="device")
        return parsed
    backend = getattr(torch, parsed.type, None)
    if not (backend is not None and hasattr(backend, "is_available") and backend.is_available()):
        raise InvalidInput(f"device {device!r} is not available here; use cpu or cuda.", parameters="device")
    return parsed


def check_folder_path(path: PathLike, parameter: str) -> None:
    """Refuse a folder path (``~`` expanded) that is a file or lies under one, before anything is
    made; InvalidInput names ``parameter``."""
    _refuse_file_path(Path(path).expanduser(), parameter)


def _ratio_dir(output_dir: Path, plan: RatioPlan) -> Path:
    """``ratio_0.7500`` for a constant ratio; a schedule's folder adds its spec (its mean ratio
    may equal a constant's): ``ratio_0.7600_linear_0.5_1``."""
    name = f"ratio_{plan.realised_ratio:.4f}"
    if plan.schedule is not None:
        name += "_" + re.sub(r"[^A-Za-z0-9.]+", "_", plan.schedule.spec).strip("_")
    return output_dir / name


def _load_model(model: MoHDiTPipeline | PathLike, settings: SweepSettings, label: str | None) -> tuple[MoHDiTPipeline, str]:
    """The pipeline to sweep and the model's name in the results (``label``, if given)."""
    if isinstance(model, MoHDiTPipeline):
        return model, label or str(model.transformer.config.get("_name_or_path") or "<in-memory pipeline>")
    pipe = load_pipeline(model, vae=settings.vae, scheduler=settings.scheduler, dtype=settings.dtype)
    return pipe, label or str(Path(model).resolve())


def _refuse_earlier_samples(plans: Sequence[RatioPlan], settings: SweepSettings) -> None:
    """With ``save_samples``, no ratio's samples folder may already hold images (they would mix)."""
    if not settings.save_samples:
        return
    for plan in plans:
        folder = _ratio_dir(Path(settings.output_dir), plan) / "samples"
        if folder.is_dir() and any(folder.glob("*.png")):
            raise InvalidInput(f"{folder} already holds samples; use a new output_dir or delete it.",
                               parameters="output_dir")


def _reference_statistics(
    reference: PathLike | ReferenceStatistics, extractor: nn.Module, identity: str, settings: SweepSettings,
    log: Callable[[str], None] | None,
) -> ReferenceStatistics:
    """The reference's statistics under ``extractor``, computed once for every ratio (and cached
    on disk unless ``use_cache=False``)."""
    if log:
        log(f"reference statistics of {reference if not isinstance(reference, ReferenceStatistics) else reference.source} "
            f"with {identity} ...")
    ref = load_reference(reference, extractor, device=settings.device, batch_size=settings.eval_batch_size,
                         cache_dir=settings.cache_dir, use_cache=settings.use_cache, progress=settings.progress)
    if ref.num_images is not None and ref.num_images < ADM_K + 1:
        raise ValueError(f"{ref.source}: {ref.num_images} reference images; need at least {ADM_K + 1}.")
    return ref


@contextlib.contextmanager
def _attention_path(transformer: MoHDiTTransformer2DModel, attention: str) -> Iterator[tuple[bool | None, str]]:
    """Every MoH layer on the ``attention`` path for the block, each layer's own setting given
    back after it; yields (the ``sparse_inference`` setting, the path's name)."""
    saved = [getattr(block.attn1, "sparse_inference", None) for block in transformer.transformer_blocks]
    try:
        if ATTENTION_PATHS[attention] is not None:
            transformer.set_sparse_inference(ATTENTION_PATHS[attention])
        setting = getattr(transformer.transformer_blocks[0].attn1, "sparse_inference", None)
        # The pipeline samples in eval mode under no_grad, where None means the automatic choice.
        name = (
            "dense" if not transformer.is_moh
            else {False: "dense-masked", True: "head-sparse"}.get(setting, "automatic (per layer)")
        )
        yield setting, name
    finally:
        for block, value in zip(transformer.transformer_blocks, saved):
            block.attn1.sparse_inference = value


def _evaluate_ratio(run: _Run, plan: RatioPlan) -> tuple[SweepRow, EvaluationResult]:
    """Sample the run's images at ``plan``'s ratio, streamed into the evaluation; the table row
    and the evaluation result."""
    images = dataclasses.replace(run.images, head_activation_ratio=plan.setting)
    settings = run.settings
    save_dir = _ratio_dir(Path(settings.output_dir), plan) if settings.save_samples else None
    if settings.warm_up:
        _warm_up(run.pipe, images, settings.batch_size)
    clock = _Clock()
    began = time.perf_counter()
    with tqdm(total=images.num_samples, disable=not settings.progress, unit="img",
              desc=f"sampling + evaluating ratio {plan.label} ({plan.realised_ratio:.4f})") as bar, \
            PoolFeatureRecorder(run.extractor) as recorder:
        result = evaluate(
            _sample_batches(run.pipe, images, plan.realised_ratio, settings.batch_size, clock, save_dir, bar),
            run.reference, extractor=run.extractor, device=settings.device, batch_size=settings.eval_batch_size,
            **_class_accuracy_arguments(run),
        )
    total = time.perf_counter() - began
    sparse, dense, steps = plan.attention_flops(run.pipe.transformer)  # summed over `steps` steps
    row = SweepRow(
        ratio=plan.label, requested=list(plan.requested), realised_ratio=plan.realised_ratio,
        top_k_per_layer=list(plan.top_k_per_layer),
        fid=result.fid, sfid=result.sfid, inception_score=result.inception_score,
        precision=result.precision, recall=result.recall,
        # run.calls forward passes per image, spread evenly over the steps
        attention_flops_per_image=sparse * run.calls // steps, dense_attention_flops_per_image=dense * run.calls // steps,
        attention_flop_ratio=sparse / dense,
        sampling_seconds=clock.seconds, evaluation_seconds=total - clock.seconds,
        num_samples=result.num_samples, samples_dir=None if save_dir is None else str(save_dir),
        class_accuracy=result.class_accuracy, class_accuracy_per_class=result.class_accuracy_per_class,
        mean_attention_flops=sparse / steps, **_schedule_fields(plan), **_intervals(run, result, recorder),
    )
    return row, result


def _schedule_fields(plan: RatioPlan) -> dict[str, Any]:
    """A schedule row's spec, per-step realised ratios and top-K, and its FLOP-matched constant."""
    if plan.schedule is None:
        return {}
    return dict(schedule=plan.schedule.spec, head_activation_ratios=list(plan.schedule.realised),
                top_k_per_step=[list(k) for k in plan.schedule.top_k],
                matched_constant=None if plan.matched is None else plan.matched.label)


def _intervals(run: _Run, result: EvaluationResult, recorder: PoolFeatureRecorder) -> dict[str, Any]:
    """The row's 95% intervals: FID by bootstrap over the recorded features, class accuracy by Wilson."""
    out: dict[str, Any] = {}
    if result.class_accuracy is not None:
        correct = round(result.class_accuracy * result.num_samples)
        out["class_accuracy_low"], out["class_accuracy_high"] = wilson_interval(correct, result.num_samples)
    if run.settings.bootstrap and result.fid is not None:
        features = recorder.features
        if len(features) != result.num_samples:
            raise RuntimeError(f"recorded {len(features)} feature rows for {result.num_samples} samples; the FID "
                               "bootstrap needs exactly the evaluated images' features.")
        interval = bootstrap_fid(features, run.reference, result.fid, run.settings.bootstrap, run.settings.bootstrap_seed)
        out.update(fid_low=interval.low, fid_high=interval.high, fid_bootstrap_bias=interval.bias)
    return out


def _class_accuracy_arguments(run: _Run) -> dict[str, Any]:
    """What :func:`evaluate` needs to measure class accuracy; nothing without a classifier."""
    if run.classifier is None:
        return {}
    return dict(classifier=run.classifier, labels=run.labels,
                class_names=run.pipe.transformer.config.get("class_names"))


def _resolve_classifier(settings: SweepSettings) -> SampleClassifier | None:
    if settings.classifier is None or isinstance(settings.classifier, SampleClassifier):
        return settings.classifier
    return load_classifier(settings.classifier, settings.classifier_weights, device=settings.device)


def _assemble_result(
    run: _Run,
    rows: list[SweepRow],
    results: Sequence[EvaluationResult],
    model_label: str,
    ratios: Sequence[float | str] | str,
    reference: PathLike | ReferenceStatistics,
    attention: tuple[bool | None, str],
) -> SweepResult:
    """The rows and every setting that produced them (``sweep.json``'s ``settings``)."""
    pipe, images, settings, transformer = run.pipe, run.images, run.settings, run.pipe.transformer
    notes: list[str] = []
    for result in results:
        notes += [note for note in result.notes if note not in notes]
    identity_settings = run_identity(pipe, images, model_label)
    identity_settings.pop("head_activation_ratio", None)
    identity_settings["model"] = model_label
    cfg = transformer.config
    return SweepResult(rows=rows, settings={
        **identity_settings,
        "model_name": model_name(model_label),
        "ratios": [_label(r) for r in parse_ratios(ratios)],
        "match_flops": settings.match_flops,
        "batch_size": settings.batch_size,
        "num_samples": images.num_samples,
        "device": str(settings.device),
        "attention": settings.attention,
        "sparse_inference": attention[0],
        "attention_path": attention[1],
        "warm_up": settings.warm_up,
        "is_moh": transformer.is_moh,
        "trained_head_activation_ratio": transformer.trained_head_activation_ratio,
        "head_activation_range": list(transformer.head_activation_range),
        "layer_heads": list(transformer.layer_heads),
        "layer_shared": None if transformer.layer_shared is None else list(transformer.layer_shared),
        "tokens": (cfg.sample_size // cfg.patch_size) ** 2,
        "transformer_calls_per_image": run.calls,
        "flops_note": "ideal head-sparse attention FLOPs (only the selected heads' queries, outputs and attention "
                      "core counted, as MoH's per-token routing allows) of all transformer calls "
                      "of one image; routers, MLPs and the VAE are not counted",
        "reference": run.reference.source if isinstance(reference, ReferenceStatistics) else str(Path(reference).resolve()),
        "reference_images": run.reference.num_images,
        "reference_statistics_from_images": run.reference.statistics_from_images,
        "extractor": run.extractor_identity,
        "inception_weights": dict(getattr(run.extractor, "weights_info", {}) or {}),
        "comparable_to_published": all(result.comparable_to_published for result in results),
        "bootstrap_resamples": settings.bootstrap,
        "bootstrap_seed": settings.bootstrap_seed,
        "interval_note": INTERVAL_NOTE,
        "notes": notes,
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })


def sweep_head_activation(
    model: MoHDiTPipeline | PathLike,
    ratios: Sequence[float | str] | str,
    reference: PathLike | ReferenceStatistics,
    images: SampleSettings,
    settings: SweepSettings | None = None,
    extractor: nn.Module | None = None,
    log: Callable[[str], None] | None = logger.info,
    model_label: str | None = None,
) -> SweepResult:
    """Sample and evaluate ``model`` at each head activation ratio of ``ratios``.

    ``model``: a :class:`MoHDiTPipeline` (moved to ``settings.device``) or a transformer /
    pipeline folder (loaded as ``settings`` says). ``model_label``: the model's name in the results
    (default: the folder's resolved path, or a pipeline's ``_name_or_path``). ``ratios``: numbers in (0, 1],
    ``"trained"``, ``"min"`` and head-activation schedules' specs (:func:`plan_ratios`). ``reference``: an ADM reference batch,
    an image folder / ``.npz``, or :class:`ReferenceStatistics`; its statistics are computed
    once. ``images``: what decides image ``i`` (its ``head_activation_ratio`` is each plan's;
    ``num_samples`` at least ``ADM_K + 1``). ``extractor``: a feature extractor to use instead
    of the one ``settings`` names.

    The steps: plan the ratios (and check them against the model), load or compute the
    reference statistics once, then per ratio sample the images and evaluate them as they
    stream in, and assemble the result. Everything is validated, and the extractor and reference are
    loaded, before the first image is sampled. Nothing but ``save_samples``' PNGs is written
    here; use :func:`write_sweep` to write the results (so a sweep that fails midway leaves no
    table).
    """
    settings = SweepSettings() if settings is None else settings
    check_sample_count(images.num_samples, extractor)
    if not isinstance(reference, ReferenceStatistics) and not Path(reference).exists():
        raise InputNotFound(f"reference not found: {reference}", parameters="reference")
    pipe, model_label = _load_model(model, settings, model_label)
    plans = plan_sweep(pipe, ratios, images, match_flops=settings.match_flops)
    _refuse_earlier_samples(plans, settings)
    classifier = _resolve_classifier(settings)
    labels = None
    if classifier is not None:  # checked against the model's classes before any work
        check_class_names(classifier, pipe.transformer.config.get("class_names"))
        # as generate_batch draws them: the same labels at every ratio, computed once
        labels = class_labels_for(range(images.num_samples), pipe.transformer.config.num_classes,
                                  images.class_labels, images.seed)
    extractor = _resolve_extractor(extractor, settings)
    identity = extractor_identity(extractor)
    ref = _reference_statistics(reference, extractor, identity, settings, log)

    if settings.save_samples:
        Path(settings.output_dir).mkdir(parents=True, exist_ok=True)
        write_output_marker(settings.output_dir, "sweep")
    pipe.to(settings.device)
    pipe.set_progress_bar_config(disable=True)
    calls = transformer_calls_per_image(images.num_inference_steps, images.guidance_scale)
    run = _Run(pipe, images, settings, ref, extractor, identity, calls, classifier, labels)
    rows, results = [], []
    with _attention_path(pipe.transformer, settings.attention) as attention:
        for plan in plans:
            row, result = _evaluate_ratio(run, plan)
            rows.append(row)
            results.append(result)
            if log:
                accuracy = "" if row.class_accuracy is None else f", class accuracy {row.class_accuracy:.3f}"
                log(f"ratio {plan.label}: realised {plan.realised_ratio:.4f}, FID {result.fid:.3f}{accuracy}, "
                    f"{row.sampling_seconds / images.num_samples:.4f} s/img")
    return _assemble_result(run, rows, results, model_label, ratios, reference, attention)


def run_sweep(
    model: MoHDiTPipeline | PathLike,
    ratios: Sequence[float | str] | str = DEFAULT_RATIOS,
    *,
    reference: PathLike | ReferenceStatistics,
    num_samples: int = 50_000,
    batch_size: int = 32,
    num_inference_steps: int = 250,
    guidance_scale: float = 1.5,
    guidance_channels: str = "dit",
    seed: int = 0,
    extractor: nn.Module | None = None,
    inception_weights: PathLike | None = None,
    random_inception_seed: int | None = None,
    download: bool = True,
    device: torch.device | str = "cpu",
    attention: str = "auto",
    output_dir: PathLike | None = None,
    save_samples: bool = False,
    eval_batch_size: int = 64,
    cache_dir: PathLike | None = None,
    use_cache: bool = True,
    vae: str | None = None,
    scheduler: str = "ddpm",
    dtype: str | torch.dtype = "float32",
    warm_up: bool = True,
    progress: bool = True,
    classifier: Any = None,
    classifier_weights: PathLike | None = None,
    bootstrap: int = BOOTSTRAP_RESAMPLES,
    bootstrap_seed: int = 0,
    match_flops: bool = False,
    log: Callable[[str], None] | None = logger.info,
) -> SweepResult:
    """:func:`sweep_head_activation` with its settings as keywords.

    ``num_samples``, ``num_inference_steps``, ``guidance_scale``, ``guidance_channels`` and
    ``seed`` make the :class:`SampleSettings` (class ``i mod num_classes`` for image ``i``);
    the other keywords are :class:`SweepSettings` fields of the same names.
    """
    images = SampleSettings(num_samples=num_samples, guidance_scale=guidance_scale,
                            guidance_channels=guidance_channels, num_inference_steps=num_inference_steps,
                            seed=seed, class_labels="balanced")
    settings = SweepSettings(
        batch_size=batch_size, eval_batch_size=eval_batch_size, device=device, attention=attention,
        output_dir=output_dir, save_samples=save_samples, cache_dir=cache_dir, use_cache=use_cache, warm_up=warm_up,
        progress=progress, inception_weights=inception_weights, random_inception_seed=random_inception_seed,
        download=download, vae=vae, scheduler=scheduler, dtype=dtype, classifier=classifier,
        classifier_weights=classifier_weights, bootstrap=bootstrap, bootstrap_seed=bootstrap_seed,
        match_flops=match_flops,
    )
    return sweep_head_activation(model, ratios, reference, images, settings, extractor=extractor, log=log)
