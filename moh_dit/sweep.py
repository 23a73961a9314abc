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

``scripts/sweep_head_ratio.py`` is the command-line front; everything here is callable::

    >>> from moh_dit.sweep import run_sweep, write_sweep
    >>> result = run_sweep("moh-dit-xl-2-90-pipeline", ratios=("trained", 1.0, 0.75, 0.6, "min"),
    ...                    reference="VIRTUAL_imagenet256_labeled.npz", num_samples=10_000,
    ...                    num_inference_steps=250, guidance_scale=1.5, device="cuda")
    >>> write_sweep(result, "sweeps/xl-90")  # sweep.json, sweep.csv, fid_vs_ratio.png
    >>> print(result.table())
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import numpy as np
import PIL.Image
import PIL.ImageDraw
import PIL.ImageFont
import torch
from torch import nn
from tqdm.auto import tqdm

from .evaluation import (
    ADM_K,
    ReferenceStatistics,
    build_random_inception,
    evaluate,
    extractor_identity,
    load_inception,
    load_reference,
)
from .io_utils import write_bytes_atomic, write_json_atomic
from .pipelines.pipeline_moh_dit import GUIDANCE_CHANNELS, MoHDiTPipeline
from .sampling import (
    SampleSettings,
    check_settings,
    generate_batch,
    load_pipeline,
    png_path,
    preview_head_activation,
    run_identity,
    save_png_atomic,
)
from .transformer_moh_dit import MoHDiTTransformer2DModel

__all__ = [
    "DEFAULT_RATIOS",
    "RATIO_KEYWORDS",
    "ATTENTION_PATHS",
    "RatioPlan",
    "SweepRow",
    "SweepResult",
    "parse_ratios",
    "layer_attention_flops",
    "attention_flops",
    "transformer_calls_per_image",
    "plan_ratios",
    "check_plans",
    "check_device",
    "check_folder_path",
    "run_sweep",
    "write_sweep",
    "plot_fid_vs_ratio",
]

PathLike = Union[str, os.PathLike]

RATIO_KEYWORDS = ("trained", "min")
DEFAULT_RATIOS: tuple[float | str, ...] = ("trained", 1.0, 0.9, 0.75, 0.6, "min")
# "auto": leave the model's setting (by default automatic: head-sparse for large layers with
#         at most half their heads active, on the CPU; dense-masked otherwise);
# "masked": dense-masked (the release's way: every head computed, unselected ones zeroed);
# "sparse": head-sparse (unselected routed heads skipped).
ATTENTION_PATHS = {"auto": None, "masked": False, "sparse": True}
JSON_FILE, CSV_FILE, PLOT_FILE = "sweep.json", "sweep.csv", "fid_vs_ratio.png"


# --------------------------------------------------------------------------------------
# Ratios and FLOPs
# --------------------------------------------------------------------------------------


def parse_ratios(text: str | Sequence[float | str]) -> list[float | str]:
    """``"trained,1.0,0.75,min"`` (or a sequence) -> ``["trained", 1.0, 0.75, "min"]``."""
    items = text.split(",") if isinstance(text, str) else list(text)
    ratios: list[float | str] = []
    for item in items:
        if isinstance(item, str):
            item = item.strip()
            if not item:
                continue
            if item.lower() in RATIO_KEYWORDS:
                ratios.append(item.lower())
                continue
            try:
                item = float(item)
            except ValueError:
                raise ValueError(
                    f"ratio {item!r} is neither a number nor one of {RATIO_KEYWORDS}; e.g. --ratios trained,1.0,0.75,min"
                ) from None
        value = float(item)
        if not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise ValueError(f"head activation ratio {value} must be in (0, 1] (--ratios takes e.g. trained,1.0,0.75,min).")
        ratios.append(value)
    if not ratios:
        raise ValueError(f"no ratios given ({text!r}); e.g. --ratios trained,1.0,0.75,min")
    return ratios


def _label(ratio: float | str) -> str:
    return ratio if isinstance(ratio, str) else str(float(ratio))


def layer_attention_flops(tokens: int, hidden: int, heads: int, head_dim: int, active_heads: int) -> tuple[int, int]:
    """(ideal head-sparse, dense) FLOPs of one attention layer for one image.

    With N tokens, width D, inner width D_in = h d and r = active / h the fraction of
    (token, head) pairs that compute (MoH's per-token head selection; docs/design.md section
    4): dense ``2 N D D_in * 4 + 4 N^2 D_in`` (q, k, v, out projections; QK^T and AV), head-sparse
    ``2 N D D_in (2 + 2r) + 4 r N^2 D_in``: the query and output projections and the
    attention core scale with r, the key and value projections do not (any query may
    attend to any key). Multiplied out in integers (r D_in = active * d), so exact.
    Routers, softmax and gating are not counted.
    """
    if not 0 <= active_heads <= heads:
        raise ValueError(f"active_heads={active_heads} must be in [0, heads={heads}].")
    n, d = tokens, head_dim
    dense = 2 * n * hidden * heads * d * 4 + 4 * n * n * heads * d
    sparse = 2 * n * hidden * d * (2 * heads + 2 * active_heads) + 4 * n * n * active_heads * d
    return sparse, dense


def attention_flops(transformer: MoHDiTTransformer2DModel, top_k: Sequence[int] | None = None) -> tuple[int, int]:
    """(ideal head-sparse, dense) attention FLOPs of one forward pass for one image.

    Layer l has ``hs_l + K_l`` active heads of ``h_l`` (every head for a dense DiT); ``top_k``
    defaults to the model's current per-layer top-K.
    """
    cfg = transformer.config
    tokens = (cfg.sample_size // cfg.patch_size) ** 2
    heads = transformer.layer_heads
    if transformer.is_moh:
        top_k = transformer.top_k_per_layer if top_k is None else list(top_k)
        if len(top_k) != len(heads):
            raise ValueError(f"top_k has {len(top_k)} entries for a {len(heads)}-layer model.")
        active = [s + k for s, k in zip(transformer.layer_shared, top_k)]
    else:
        active = list(heads)
    sparse = dense = 0
    for h, a in zip(heads, active):
        s, d = layer_attention_flops(tokens, cfg.hidden_size, h, cfg.attention_head_dim, a)
        sparse, dense = sparse + s, dense + d
    return sparse, dense


def transformer_calls_per_image(num_inference_steps: int, guidance_scale: float) -> int:
    """Forward passes per image: one per step, two with classifier-free guidance (the
    pipeline runs the unconditional half only when ``guidance_scale > 1``)."""
    return num_inference_steps * (2 if guidance_scale > 1.0 else 1)


@dataclass
class RatioPlan:
    """One row to be: the requested ratios that realise the same per-layer top-K."""

    requested: list[str]
    realised_ratio: float
    top_k_per_layer: list[int]

    @property
    def label(self) -> str:
        return "/".join(self.requested)


def plan_ratios(transformer: MoHDiTTransformer2DModel, ratios: Sequence[float | str]) -> list[RatioPlan]:
    """Validate ``ratios`` and resolve each to its realised ratio and per-layer top-K.

    ``"trained"`` is the trained layout, ``"min"`` the lowest reachable ratio. Requests that
    realise the same top-K (e.g. ``0.75`` and ``"trained"`` on a -75 model) collapse into one
    plan. Plans are sorted by realised ratio, highest first. The model is left as it was.
    Raises ValueError for a ratio outside the reachable range (naming it) and for any ratio
    other than 1.0 on a dense DiT.
    """
    ratios = parse_ratios(ratios)
    low, high = transformer.head_activation_range
    plans: dict[tuple[int, ...], RatioPlan] = {}
    for ratio in ratios:
        if ratio == "trained":
            value = transformer.trained_head_activation_ratio
        elif ratio == "min":
            value = low
        else:
            value = float(ratio)
        if not transformer.is_moh and abs(value - 1.0) > 1e-9:
            raise ValueError(
                f"ratio {_label(ratio)} requested for a dense DiT: without routed heads its head activation ratio "
                "is always 1.0. Sweep a MoH-DiT model, or pass --ratios 1.0."
            )
        if not low - 1e-9 <= value <= high + 1e-9:
            raise ValueError(
                f"ratio {_label(ratio)} is outside this model's reachable range [{low:.4f}, {high:.4f}] (shared heads "
                "are always active); use ratios in that range, or 'min' for the lowest. Nothing was sampled."
            )
        realised, top_k = preview_head_activation(transformer, value)
        key = tuple(top_k)
        if key in plans:
            if _label(ratio) not in plans[key].requested:
                plans[key].requested.append(_label(ratio))
        else:
            plans[key] = RatioPlan([_label(ratio)], realised, list(top_k))
    return sorted(plans.values(), key=lambda plan: -plan.realised_ratio)


# --------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------


@dataclass
class SweepRow:
    """Results at one head activation ratio.

    ``attention_flops_per_image``: ideal head-sparse attention FLOPs of all transformer
    calls that make one image (``transformer_calls_per_image`` forward passes); the dense
    count is the same model with every head active. ``sampling_seconds``: wall time of
    sampling (transformer, scheduler, decoding) for all ``num_samples`` images;
    ``evaluation_seconds``: the rest (feature extraction, metrics, PNG writing if asked).
    """

    ratio: str
    realised_ratio: float
    top_k_per_layer: list[int]
    fid: float | None
    sfid: float | None
    inception_score: float | None
    precision: float | None
    recall: float | None
    attention_flops_per_image: int
    dense_attention_flops_per_image: int
    attention_flop_ratio: float
    sampling_seconds: float
    evaluation_seconds: float
    num_samples: int
    requested: list[str] = field(default_factory=list)
    samples_dir: str | None = None

    @property
    def seconds_per_image(self) -> float:
        return self.sampling_seconds / self.num_samples


@dataclass
class SweepResult:
    """All rows (highest ratio first) and the settings that produced them."""

    rows: list[SweepRow]
    settings: dict[str, Any]

    @property
    def comparable_to_published(self) -> bool:
        return bool(self.settings.get("comparable_to_published"))

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "rows": [dataclasses.asdict(row) for row in self.rows]}

    def table(self) -> str:
        """A compact fixed-width table for the terminal."""
        header = f"{'ratio':<14}{'realised':>9}{'FID':>9}{'sFID':>9}{'IS':>8}{'prec':>7}{'rec':>7}" \
                 f"{'attn GFLOP/img':>16}{'vs dense':>9}{'s/img':>9}"
        lines = [header, "-" * len(header)]

        def num(value: float | None, width: int, digits: int) -> str:
            return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"

        for row in self.rows:
            lines.append(
                f"{row.ratio:<14}{row.realised_ratio:>9.4f}{num(row.fid, 9, 2)}{num(row.sfid, 9, 2)}"
                f"{num(row.inception_score, 8, 2)}{num(row.precision, 7, 3)}{num(row.recall, 7, 3)}"
                f"{row.attention_flops_per_image / 1e9:>16.3f}{row.attention_flop_ratio:>9.3f}"
                f"{row.seconds_per_image:>9.4f}"
            )
        lines.append(f"extractor: {self.settings.get('extractor')}"
                     + ("" if self.comparable_to_published else " (NOT comparable to published numbers)"))
        return "\n".join(lines)


class _Clock:
    seconds = 0.0


def _sample_batches(
    pipe: MoHDiTPipeline,
    settings: SampleSettings,
    realised: float,
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


def _resolve_extractor(
    extractor: nn.Module | None, inception_weights: PathLike | None, random_inception_seed: int | None, download: bool
) -> nn.Module:
    given = [name for name, value in (("extractor", extractor), ("inception_weights", inception_weights),
                                      ("random_inception_seed", random_inception_seed)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"pass at most one of extractor, inception_weights, random_inception_seed; got {given}.")
    if extractor is not None:
        return extractor
    if random_inception_seed is not None:
        return build_random_inception(random_inception_seed)
    # Never a silent fallback: missing weights raise InceptionWeightsNotFoundError with advice.
    return load_inception(inception_weights, download=download)


def check_plans(pipe: MoHDiTPipeline, plans: Sequence[RatioPlan], settings: SampleSettings) -> None:
    """The model's limits on a sweep, before any work: the step count within its diffusion
    steps, and the pipeline's own rules (scheduler / model agreement, ...) at every ratio."""
    train_steps = int(getattr(pipe.scheduler.config, "num_train_timesteps", 1000))
    if settings.num_inference_steps > train_steps:
        raise ValueError(
            f"num_inference_steps (--num-inference-steps) {settings.num_inference_steps} is more than the "
            f"{train_steps} diffusion steps the model was trained with; use 1..{train_steps}."
        )
    for plan in plans:
        check_settings(pipe, dataclasses.replace(settings, head_activation_ratio=plan.realised_ratio))


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device`` that exists here; ValueError naming it otherwise."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device (--device) {device!r} is not a torch device; use cpu, cuda or cuda:N.") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device (--device) {device!r} but CUDA is not available; use cpu.")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device (--device) {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s).")
        return parsed
    backend = getattr(torch, parsed.type, None)
    if not (backend is not None and hasattr(backend, "is_available") and backend.is_available()):
        raise ValueError(f"device (--device) {device!r} is not available here; use cpu or cuda.")
    return parsed


def check_folder_path(path: PathLike, what: str) -> None:
    """Refuse a folder path that is a file or lies under one, before anything is made."""
    path = Path(path).expanduser()
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "is a file" if folder == path else f"lies under {folder}, which is a file"
                raise ValueError(f"{what} {path} {where}; give a folder.")
            return


def _ratio_dir(output_dir: Path, realised: float) -> Path:
    return output_dir / f"ratio_{realised:.4f}"


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
    log: Callable[[str], None] | None = print,
) -> SweepResult:
    """Sample and evaluate ``model`` at each head activation ratio of ``ratios``.

    ``model``: a :class:`MoHDiTPipeline` (moved to ``device``) or a transformer / pipeline
    folder, loaded with :func:`moh_dit.sampling.load_pipeline` (``vae``, ``scheduler``,
    ``dtype`` apply only then). ``ratios``: numbers in (0, 1], ``"trained"`` and ``"min"``
    (:func:`plan_ratios`). ``reference``: an ADM reference batch, an image folder / ``.npz``,
    or :class:`ReferenceStatistics`; its statistics are computed once (and cached on disk
    unless ``use_cache=False``). The feature extractor is ``extractor``, else the published
    TF Inception (``inception_weights`` or the usual search; a missing file raises
    ``InceptionWeightsNotFoundError``), else, only when asked with ``random_inception_seed``,
    a random Inception whose numbers are labelled not comparable. ``attention``: ``"auto"``
    (the model's setting), ``"masked"`` or ``"sparse"`` (see ``ATTENTION_PATHS``); it matters
    for the wall time only. ``save_samples`` writes each ratio's PNGs to
    ``output_dir/ratio_X/samples/`` (the layout of ``moh_dit.sampling``) as they are made.
    ``warm_up``: one untimed single-step batch before each ratio's timed sampling.

    Everything is validated, and the extractor and reference are loaded, before the first
    image is sampled. Nothing but ``save_samples``' PNGs is written here; use
    :func:`write_sweep` to write the results (so a sweep that fails midway leaves no table).
    """
    if num_samples < ADM_K + 1:
        raise ValueError(f"num_samples must be >= {ADM_K + 1} (precision/recall use k={ADM_K}), got {num_samples}.")
    for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size),
                        ("num_inference_steps", num_inference_steps)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    if not (math.isfinite(guidance_scale) and guidance_scale >= 1.0):
        raise ValueError(f"guidance_scale={guidance_scale} must be a finite number >= 1 (1 = no guidance).")
    if guidance_channels not in GUIDANCE_CHANNELS:
        raise ValueError(f"guidance_channels={guidance_channels!r}; choose one of {GUIDANCE_CHANNELS}.")
    if attention not in ATTENTION_PATHS:
        raise ValueError(f"attention={attention!r}; choose one of {list(ATTENTION_PATHS)}.")
    if save_samples and output_dir is None:
        raise ValueError("save_samples=True needs an output_dir.")
    check_device(device)
    if not isinstance(reference, ReferenceStatistics) and not Path(reference).exists():
        raise FileNotFoundError(f"reference not found: {reference}")
    if output_dir is not None:
        check_folder_path(output_dir, "output_dir (--output)")
    if cache_dir is not None and use_cache:
        check_folder_path(cache_dir, "cache_dir (--cache-dir)")
    settings = SampleSettings(num_samples=num_samples, guidance_scale=guidance_scale,
                              guidance_channels=guidance_channels, num_inference_steps=num_inference_steps,
                              seed=seed, class_labels="balanced")

    if isinstance(model, MoHDiTPipeline):
        pipe = model
        model_label = str(pipe.transformer.config.get("_name_or_path") or "<in-memory pipeline>")
    else:
        pipe = load_pipeline(model, vae=vae, scheduler=scheduler, dtype=dtype)
        model_label = str(Path(model).resolve())
    transformer = pipe.transformer
    plans = plan_ratios(transformer, ratios)
    check_plans(pipe, plans, settings)
    if save_samples:
        for plan in plans:
            folder = _ratio_dir(Path(output_dir), plan.realised_ratio) / "samples"
            if folder.is_dir() and any(folder.glob("*.png")):
                raise ValueError(f"{folder} already holds samples; use a new --output (output_dir) or delete it.")

    extractor = _resolve_extractor(extractor, inception_weights, random_inception_seed, download)
    identity = extractor_identity(extractor)
    if log:
        log(f"reference statistics of {reference if not isinstance(reference, ReferenceStatistics) else reference.source} "
            f"with {identity} ...")
    ref = load_reference(reference, extractor, device=device, batch_size=eval_batch_size, cache_dir=cache_dir,
                         use_cache=use_cache, progress=progress)
    if ref.num_images is not None and ref.num_images < ADM_K + 1:
        raise ValueError(f"{ref.source}: {ref.num_images} reference images; need at least {ADM_K + 1}.")

    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    calls = transformer_calls_per_image(num_inference_steps, guidance_scale)
    saved_paths = [getattr(block.attn1, "sparse_inference", None) for block in transformer.transformer_blocks]
    if ATTENTION_PATHS[attention] is not None:
        transformer.set_sparse_inference(ATTENTION_PATHS[attention])
    sparse_setting = getattr(transformer.transformer_blocks[0].attn1, "sparse_inference", None)
    # The pipeline samples in eval mode under no_grad, where None means the automatic choice.
    attention_path = (
        "dense" if not transformer.is_moh
        else {False: "dense-masked", True: "head-sparse"}.get(sparse_setting, "automatic (per layer)")
    )
    rows: list[SweepRow] = []
    notes: list[str] = []
    comparable = True
    try:
        for plan in plans:
            ratio_settings = dataclasses.replace(settings, head_activation_ratio=plan.realised_ratio)
            save_dir = _ratio_dir(Path(output_dir), plan.realised_ratio) if save_samples else None
            if warm_up:
                _warm_up(pipe, ratio_settings, batch_size)
            clock = _Clock()
            began = time.perf_counter()
            with tqdm(total=num_samples, disable=not progress, unit="img",
                      desc=f"ratio {plan.label} ({plan.realised_ratio:.4f})") as bar:
                result = evaluate(
                    _sample_batches(pipe, ratio_settings, plan.realised_ratio, batch_size, clock, save_dir, bar),
                    ref, extractor=extractor, device=device, batch_size=eval_batch_size,
                )
            total = time.perf_counter() - began
            sparse, dense = attention_flops(transformer, plan.top_k_per_layer)
            rows.append(SweepRow(
                ratio=plan.label, requested=list(plan.requested), realised_ratio=plan.realised_ratio,
                top_k_per_layer=list(plan.top_k_per_layer),
                fid=result.fid, sfid=result.sfid, inception_score=result.inception_score,
                precision=result.precision, recall=result.recall,
                attention_flops_per_image=sparse * calls, dense_attention_flops_per_image=dense * calls,
                attention_flop_ratio=sparse / dense,
                sampling_seconds=clock.seconds, evaluation_seconds=total - clock.seconds,
                num_samples=result.num_samples, samples_dir=None if save_dir is None else str(save_dir),
            ))
            comparable = comparable and result.comparable_to_published
            notes += [note for note in result.notes if note not in notes]
            if log:
                log(f"ratio {plan.label}: realised {plan.realised_ratio:.4f}, FID {result.fid:.3f}, "
                    f"{clock.seconds / num_samples:.4f} s/img")
    finally:
        for block, value in zip(transformer.transformer_blocks, saved_paths):
            block.attn1.sparse_inference = value

    identity_settings = run_identity(pipe, settings, model_label)
    identity_settings.pop("head_activation_ratio", None)
    identity_settings["model"] = model_label
    cfg = transformer.config
    sweep_settings = {
        **identity_settings,
        "ratios": [_label(r) for r in parse_ratios(ratios)],
        "batch_size": batch_size,
        "num_samples": num_samples,
        "device": str(device),
        "attention": attention,
        "sparse_inference": sparse_setting,
        "attention_path": attention_path,
        "warm_up": warm_up,
        "is_moh": transformer.is_moh,
        "trained_head_activation_ratio": transformer.trained_head_activation_ratio,
        "head_activation_range": list(transformer.head_activation_range),
        "layer_heads": list(transformer.layer_heads),
        "layer_shared": None if transformer.layer_shared is None else list(transformer.layer_shared),
        "tokens": (cfg.sample_size // cfg.patch_size) ** 2,
        "transformer_calls_per_image": calls,
        "flops_note": "ideal head-sparse attention FLOPs (only the selected heads' queries, outputs and attention "
                      "core counted, as MoH's per-token routing allows) of all transformer calls "
                      "of one image; routers, MLPs and the VAE are not counted",
        "reference": ref.source if isinstance(reference, ReferenceStatistics) else str(Path(reference).resolve()),
        "reference_images": ref.num_images,
        "reference_statistics_from_images": ref.statistics_from_images,
        "extractor": identity,
        "inception_weights": dict(getattr(extractor, "weights_info", {}) or {}),
        "comparable_to_published": comparable,
        "notes": notes,
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return SweepResult(rows=rows, settings=sweep_settings)


# --------------------------------------------------------------------------------------
# Output files
# --------------------------------------------------------------------------------------

CSV_COLUMNS = (
    "ratio", "realised_ratio", "fid", "sfid", "inception_score", "precision", "recall",
    "attention_flops_per_image", "dense_attention_flops_per_image", "attention_flop_ratio",
    "sampling_seconds", "seconds_per_image", "evaluation_seconds", "num_samples", "top_k_per_layer",
)


def _csv_text(rows: Sequence[SweepRow]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        values = {**dataclasses.asdict(row), "seconds_per_image": row.seconds_per_image,
                  "top_k_per_layer": " ".join(str(k) for k in row.top_k_per_layer)}
        writer.writerow(["" if values[c] is None else values[c] for c in CSV_COLUMNS])
    return buffer.getvalue()


def write_sweep(result: SweepResult, output_dir: PathLike) -> dict[str, Path]:
    """Write ``sweep.json`` (settings + rows), ``sweep.csv`` and ``fid_vs_ratio.png``.

    Everything is rendered in memory first and each file goes through a temporary name and
    ``os.replace``, so a failure leaves no partial file. Returns the paths.
    """
    output_dir = Path(output_dir)
    csv_text = _csv_text(result.rows)
    png = io.BytesIO()
    title, subtitle = _plot_titles(result.settings)
    plot_fid_vs_ratio(result.rows, title, subtitle, comparable=result.comparable_to_published).save(png, format="PNG")
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": output_dir / JSON_FILE, "csv": output_dir / CSV_FILE, "plot": output_dir / PLOT_FILE}
    write_bytes_atomic(paths["csv"], csv_text.encode("utf-8"))
    write_bytes_atomic(paths["plot"], png.getvalue())
    write_json_atomic(paths["json"], result.to_dict())  # last: its presence means the sweep is complete
    return paths


def _plot_titles(settings: dict[str, Any]) -> tuple[str, str]:
    model = Path(str(settings.get("model", ""))).name or "model"
    steps, cfg = settings.get("num_inference_steps"), settings.get("guidance_scale")
    title = f"{model}: FID-{settings.get('num_samples')} vs head activation ({steps} steps, cfg {cfg})"
    extractor = str(settings.get("extractor", "?"))
    if settings.get("comparable_to_published"):
        subtitle = "ADM-comparable: published TF Inception weights"
    elif "RANDOM" in extractor:
        seed = extractor.rsplit("seed=", 1)[-1] if "seed=" in extractor else "?"
        subtitle = f"random Inception (seed {seed}): NOT comparable to published numbers"
    else:
        subtitle = f"extractor {extractor}: NOT comparable to published numbers"
    return title, subtitle


def _font(size: int) -> PIL.ImageFont.ImageFont:
    try:
        return PIL.ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has only the fixed bitmap font
        return PIL.ImageFont.load_default()


def _nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (steps of 1, 2, 2.5 or 5 x 10^k) covering [low, high]."""
    if not high - low > 1e-12 * max(abs(low), abs(high), 1.0):
        pad = 0.1 * abs(low) or 1.0  # a single value: centre it
        low, high = low - pad, high + pad
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    ticks, index = [], math.floor(low / step + 1e-9)
    while not ticks or ticks[-1] < high - 1e-9 * step:
        ticks.append(round(index * step, 12))
        index += 1
    return ticks


def _tick_label(value: float, step: float) -> str:
    decimals = next(d for d in range(8) if abs(step * 10**d - round(step * 10**d)) < 1e-6)
    return f"{value:.{decimals}f}"


def plot_fid_vs_ratio(
    rows: Sequence[SweepRow], title: str, subtitle: str, comparable: bool, size: tuple[int, int] = (720, 460)
) -> PIL.Image.Image:
    """FID against realised head activation ratio as a small PIL chart (no matplotlib).

    Points joined by a line, each labelled with its FID (and its keyword, e.g. ``trained``);
    the subtitle names the extractor and is green when the numbers are comparable to
    published ones, red when not.
    """
    points = sorted((row.realised_ratio, row.fid, row.ratio) for row in rows if row.fid is not None)
    width, height = size
    left, right, top, bottom = 78, 24, 64, 58
    image = PIL.Image.new("RGB", size, "white")
    draw = PIL.ImageDraw.Draw(image)
    title_font, font, small = _font(15), _font(12), _font(11)
    draw.text((left, 10), _fit(draw, title, title_font, width - left - 8), fill="black", font=title_font)
    subtitle_colour = (20, 110, 20) if comparable else (190, 30, 30)
    draw.text((left, 32), _fit(draw, subtitle, font, width - left - 8), fill=subtitle_colour, font=font)
    plot = (left, top, width - right, height - bottom)
    if not points:
        draw.text((left, top + 20), "no FID values", fill="black", font=font)
        return image

    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_ticks = _nice_ticks(min(xs), max(xs))
    y_ticks = _nice_ticks(min(ys), max(ys))
    x_lo, x_hi = x_ticks[0], x_ticks[-1]
    y_lo, y_hi = y_ticks[0], y_ticks[-1]

    def to_px(x: float, y: float) -> tuple[float, float]:
        px = plot[0] + (x - x_lo) / (x_hi - x_lo) * (plot[2] - plot[0])
        py = plot[3] - (y - y_lo) / (y_hi - y_lo) * (plot[3] - plot[1])
        return px, py

    grid, axis = (225, 225, 225), (60, 60, 60)
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else 1.0
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0
    for x in x_ticks:
        px, _ = to_px(x, y_lo)
        draw.line([(px, plot[1]), (px, plot[3])], fill=grid)
        draw.line([(px, plot[3]), (px, plot[3] + 5)], fill=axis)
        text = _tick_label(x, x_step)
        w = draw.textlength(text, font=font)
        draw.text((px - w / 2, plot[3] + 8), text, fill="black", font=font)
    for y in y_ticks:
        _, py = to_px(x_lo, y)
        draw.line([(plot[0], py), (plot[2], py)], fill=grid)
        draw.line([(plot[0] - 5, py), (plot[0], py)], fill=axis)
        text = _tick_label(y, y_step)
        w = draw.textlength(text, font=font)
        draw.text((plot[0] - 9 - w, py - 7), text, fill="black", font=font)
    draw.rectangle(plot, outline=axis)

    xlabel = "head activation ratio (realised)"
    draw.text(((plot[0] + plot[2]) / 2 - draw.textlength(xlabel, font=font) / 2, height - 24), xlabel,
              fill="black", font=font)
    ylabel = PIL.Image.new("RGBA", (60, 18), (255, 255, 255, 0))
    PIL.ImageDraw.Draw(ylabel).text((0, 2), "FID", fill="black", font=font)
    rotated = ylabel.rotate(90, expand=True)
    image.paste(rotated, (8, int((plot[1] + plot[3]) / 2 - rotated.height / 2)), rotated)

    line_colour = (31, 90, 180)
    pixels = [to_px(x, y) for x, y in zip(xs, ys)]
    if len(pixels) > 1:
        draw.line(pixels, fill=line_colour, width=2)
    for (px, py), (_, fid, label) in zip(pixels, points):
        draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=line_colour, outline="white")
        text = f"{label}: {fid:.2f}" if not _is_number(label) else f"{fid:.2f}"
        x = min(px + 6, width - 4 - draw.textlength(text, font=small))
        draw.text((x, py - 16), text, fill=(40, 40, 40), font=small)
    return image


def _fit(draw: PIL.ImageDraw.ImageDraw, text: str, font: PIL.ImageFont.ImageFont, width: float) -> str:
    """``text`` cut with "..." to at most ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while len(text) > 1 and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
