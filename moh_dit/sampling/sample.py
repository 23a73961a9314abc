"""Sampling at scale: per-index seeds, class balance, resumable PNG output, ADM ``.npz``.

Image ``i`` of a run is a function of the run settings and ``i`` alone: its class label
(:func:`class_labels_for`) and its seed (``seed + i``, which drives its initial noise and
every DDPM step's noise through :class:`~moh_dit.MoHDiTPipeline`'s ``seeds``) do not depend
on the batch size or on how many processes share the work. So a run can be spread over any
number of devices, and to resume after a crash one runs the same command again: indices
whose PNG exists are skipped (PNGs are written to a temporary name and renamed, so a PNG
that exists is complete). The up-to-50k images are finally streamed into one ADM-format
``.npz`` (``arr_0``, uint8 NHWC) without holding them in memory.

``moh-dit sample`` is the command-line front; everything here is callable from Python::

    pipe = load_pipeline("moh-dit-xl-2-90", vae="stabilityai/sd-vae-ft-ema")
    settings = SampleSettings(num_samples=50_000, guidance_scale=1.5, num_inference_steps=250)
    sample_images(pipe, "samples/xl-90", settings, batch_size=32)
    write_adm_npz("samples/xl-90", settings.num_samples)

To run a model at another head activation ratio for a while, use
``with head_activation(model, ratio):`` (``moh_dit.models.head_activation``, re-exported here): the
pipeline's ``head_activation_ratio=`` and :func:`preview_head_activation` both go through it,
and it restores the model's per-layer top-K on exit, also on error.
"""

from __future__ import annotations

import dataclasses
from collections import abc
import json
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import DamagedFile, InputNotFound, InvalidInput
from ..models.head_activation import head_activation, preview_head_activation
from ..models.head_schedule import HeadActivationPlan, schedule_setting
from ..utils.io import write_json_atomic
from ..utils.resources import check_fits_on_disk
from ..data.latents import load_vae
from ..utils.output_folders import check_folder_path, write_output_marker
from .sample_files import (IMAGE_DIR, NPZ_FILE, SETTINGS_FILE, DamagedSampleError, check_sample_folder,
                           existing_indices, intact_png, missing_batches, missing_indices, png_path,
                           save_png_atomic, write_adm_npz)
from ..diffusion.schedulers import SCHEDULERS, make_scheduler
from ..pipelines.pipeline_moh_dit import SEED_RANGE, MoHDiTPipeline
from ..models.config_checks import check_transformer_config_file
from ..models.transformer_moh_dit import MoHDiTTransformer2DModel
from ..training import RUN_RECORD
from ..utils.logging import get_logger

logger = get_logger(__name__)

__all__ = [
    "CLASS_LABEL_MODES",
    "DTYPES",
    "ClassLabels",
    "DamagedSampleError",
    "SampleSettings",
    "check_npz_fits_on_disk",
    "check_sample_folder",
    "image_shape",
    "remake_image",
    "class_labels_for",
    "indices_for_rank",
    "png_path",
    "missing_indices",
    "quantize_dit",
    "save_png_atomic",
    "write_adm_npz",
    "load_pipeline",
    "model_folder",
    "head_activation",
    "preview_head_activation",
    "run_identity",
    "check_or_write_settings",
    "check_settings",
    "check_folder_path",
    "check_model_flags",
    "sample_images",
    "generate_batch",
]

CLASS_LABEL_MODES = ("balanced", "uniform")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SampleSettings:
    """Everything that decides what image ``i`` looks like (besides the model).

    ``num_samples`` is the size of the set; growing it later keeps the earlier images
    (labels and seeds depend on the index only), so it is not part of the resume check.
    ``head_activation_ratio``: a ratio, a head-activation schedule's spec (``"linear:0.5:1.0"``,
    ``"step:0.5@t>500,1.0"``; kept in its canonical spelling, so a resume with another schedule is
    refused), or None for the model's trained ratio.

    Checked when made: what is its own (the set's size, the label mode, image i's seed ``seed +
    i``; a schedule's spelling). What it passes to the pipeline (guidance, steps, the ratio) the
    pipeline checks against the model (:func:`check_settings`). InvalidInput names the field.
    """

    num_samples: int = 50_000
    guidance_scale: float = 1.5
    guidance_channels: str = "dit"
    num_inference_steps: int = 250
    head_activation_ratio: float | str | None = None
    seed: int = 0
    class_labels: str = "balanced"

    def __post_init__(self) -> None:
        if not _is_int(self.num_samples) or self.num_samples < 1:
            raise InvalidInput(f"num_samples must be an int >= 1, got {self.num_samples!r}.", parameters="num_samples")
        if isinstance(self.head_activation_ratio, str):  # a schedule's spec (or a number), spelt canonically
            try:
                self.head_activation_ratio = schedule_setting(self.head_activation_ratio)
            except ValueError as err:
                raise InvalidInput(f"head_activation_ratio: {err}", parameters="head_activation_ratio") from None
        if self.class_labels not in CLASS_LABEL_MODES:
            raise InvalidInput(f"class_labels={self.class_labels!r}; choose one of {CLASS_LABEL_MODES}.",
                               parameters="class_labels")
        if not _is_int(self.seed) or self.seed < 0:
            raise InvalidInput(f"seed must be an int >= 0 (image i uses seed + i), got {self.seed!r}.", parameters="seed")
        if self.seed + self.num_samples - 1 > SEED_RANGE[1]:
            raise InvalidInput(
                f"seed {self.seed} + num_samples {self.num_samples} - 1 exceeds {SEED_RANGE[1]}, the largest seed "
                "torch.Generator takes (image i uses seed + i); use a smaller seed.", parameters=("seed", "num_samples"),
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------
# Indices, labels, files
# --------------------------------------------------------------------------------------


def class_labels_for(indices: Iterable[int], num_classes: int, mode: str = "balanced", seed: int = 0) -> list[int]:
    """Class label of each image index.

    ``"balanced"``: ``i mod num_classes``, so 50k images give exactly 50 per class of
    ImageNet and every block of ``num_classes`` consecutive images (each IS split of 5000)
    is balanced too. ``"uniform"``: an independent uniform draw per index from
    ``numpy.random.default_rng([seed, i])`` (DiT's sample_ddp.py draws labels uniformly).
    """
    if mode == "balanced":
        return [int(i) % num_classes for i in indices]
    if mode == "uniform":
        return [int(np.random.default_rng([seed, int(i)]).integers(num_classes)) for i in indices]
    raise ValueError(f"class label mode {mode!r}; choose one of {CLASS_LABEL_MODES}.")


class ClassLabels(abc.Sequence):
    """The class labels of images ``0 .. num_samples - 1`` of a run, computed when read (an int or
    a slice at a time), so that a run of any size never holds one Python object per image."""

    def __init__(self, num_samples: int, num_classes: int, mode: str = "balanced", seed: int = 0):
        if mode not in CLASS_LABEL_MODES:
            raise ValueError(f"class label mode {mode!r}; choose one of {CLASS_LABEL_MODES}.")
        self.num_samples, self.num_classes, self.mode, self.seed = num_samples, num_classes, mode, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, item):
        if isinstance(item, slice):
            return class_labels_for(range(self.num_samples)[item], self.num_classes, self.mode, self.seed)
        index = range(self.num_samples)[item]  # IndexError outside the run, negative indices from the end
        return class_labels_for([index], self.num_classes, self.mode, self.seed)[0]


def indices_for_rank(num_samples: int, rank: int, world_size: int) -> list[int]:
    """The indices process ``rank`` owns: ``i = rank (mod world_size)``. Ownership does not
    depend on what exists on disk, so processes never race for an index after a resume."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size}).")
    return list(range(rank, num_samples, world_size))


def quantize_dit(images: torch.Tensor) -> np.ndarray:
    """(B, C, H, W) images in [-1, 1] -> (B, H, W, C) uint8, DiT's exact rule
    ``clamp(127.5 x + 128, 0, 255)`` truncated to an integer (sample_ddp.py)."""
    return torch.clamp(127.5 * images.float() + 128.0, 0, 255).permute(0, 2, 3, 1).to("cpu", dtype=torch.uint8).numpy()


# --------------------------------------------------------------------------------------
# Loading and settings
# --------------------------------------------------------------------------------------


def model_folder(model: str | os.PathLike) -> Path:
    """The model folder that ``model`` names: for a training run's folder (it holds
    ``train_config.json``), the run's ``final/`` pipeline folder; else ``model`` itself."""
    path = Path(model).expanduser()
    if not (path / RUN_RECORD).is_file():
        return path
    if not (path / "final").is_dir():
        raise InputNotFound(f"model {model} is a training run without final/ (it has not finished): resume its "
                            "training to the end, or give a pipeline or transformer folder.", parameters="model")
    return path / "final"


def load_pipeline(
    model: str | os.PathLike,
    vae: str | None = None,
    scheduler: str | None = None,
    clip_sample: bool | None = None,
    dtype: str | torch.dtype = "float32",
) -> MoHDiTPipeline:
    """A pipeline from a pipeline folder, a training run's folder (its ``final/``, a pipeline
    folder) or a ``save_pretrained`` transformer folder.

    ``vae``: a path or Hub id of an ``AutoencoderKL``, ``"none"`` for a pixel-space model, or
    None (a pipeline folder -- a run's ``final/`` too -- keeps its own; a transformer folder
    must be pixel-space).
    ``scheduler``: None (or ``"saved"``) keeps a pipeline folder's own scheduler, so that this
    gives the same images as ``MoHDiTPipeline.from_pretrained(model)``; a transformer folder, which
    has none, gets the paper's DDPM. ``"ddpm"`` / ``"ddim"`` / ``"dpm"`` replace it with
    :func:`make_scheduler`'s (logged at info level). ``clip_sample`` applies to a scheduler built
    here; None: on for pixel-space models (IDDPM clips predicted images to [-1, 1]), off for latent
    ones (DiT's sampler does not clip) and for DPM-Solver (which has no clipping).
    ``dtype`` applies to the transformer; the VAE stays in float32. Every argument is checked
    before anything is loaded; InvalidInput / InputNotFound name the parameter.
    """
    check_model_flags(model, vae)
    model = model_folder(model)
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise InvalidInput(f"dtype={dtype!r}; choose one of {list(DTYPES)}.", parameters="dtype")
    if scheduler not in SCHEDULERS + ("saved", None):
        raise InvalidInput(f"scheduler={scheduler!r}; choose one of {SCHEDULERS + ('saved',)} (None: the saved one).",
                           parameters="scheduler")
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    is_pipeline = (model / "model_index.json").is_file()
    if is_pipeline:
        if scheduler in (None, "saved") and clip_sample is not None:
            raise InvalidInput("clip_sample applies only where scheduler is 'ddpm' or 'ddim' (built here): a saved one "
                               "keeps its own clipping. Leave clip_sample out, or set scheduler to 'ddpm' or 'ddim'.",
                               parameters=("clip_sample", "scheduler"))
        if (model / "transformer" / "config.json").is_file():
            check_transformer_config_file(model / "transformer")
        pipe = MoHDiTPipeline.from_pretrained(model)
        if vae is not None:
            pipe = MoHDiTPipeline(transformer=pipe.transformer, scheduler=pipe.scheduler, vae=_load_vae(vae),
                                  id2label=pipe.id2label or None)
    elif (model / "config.json").is_file():
        if scheduler == "saved":
            raise InvalidInput(f"scheduler 'saved' needs a pipeline folder; {model} is a transformer folder (none "
                               "saved): give scheduler ddpm, ddim or dpm.", parameters="scheduler")
        check_transformer_config_file(model)  # one line naming config.json and the field, before building
        transformer = MoHDiTTransformer2DModel.from_pretrained(model)
        channels = transformer.config.in_channels
        if channels not in (1, 3) and (vae is None or vae.lower() == "none"):
            raise InvalidInput(f"{model} holds a latent transformer ({channels}-channel inputs): pass its VAE as vae, "
                               "e.g. vae stabilityai/sd-vae-ft-ema.", parameters="vae")
        pipe = MoHDiTPipeline(transformer=transformer, scheduler=make_scheduler("ddpm"), vae=_load_vae(vae))
        scheduler = scheduler or "ddpm"
    else:
        raise InputNotFound(f"{model} is neither a pipeline folder (model_index.json) nor a transformer folder "
                            "(config.json).")
    if scheduler not in (None, "saved"):
        if clip_sample is None:
            clip_sample = pipe.vae is None and scheduler != "dpm"
        instead = f"instead of the saved {type(pipe.scheduler).__name__}" if is_pipeline else "(a transformer folder has none)"
        logger.info(f"scheduler: make_scheduler({scheduler!r}, clip_sample={clip_sample}) {instead}.")
        pipe.scheduler = make_scheduler(scheduler, clip_sample=clip_sample)
    if pipe.transformer.dtype != torch_dtype:
        pipe.transformer.to(torch_dtype)
    return pipe


def _load_vae(vae: str | None):
    if vae is None or vae.lower() == "none":
        return None
    return load_vae(vae)


def run_identity(pipe: MoHDiTPipeline, settings: SampleSettings, model: str) -> dict[str, Any]:
    """The settings that decide the images, as written to / compared with the run's JSON."""
    identity = dataclasses.asdict(settings)
    del identity["num_samples"]
    transformer = pipe.transformer
    identity.update(
        model=str(Path(model).resolve()),
        transformer_config=json.loads(transformer.to_json_string()),
        vae_config=None if pipe.vae is None else json.loads(pipe.vae.to_json_string()),
        scheduler=json.loads(pipe.scheduler.to_json_string()),
        dtype=str(transformer.dtype).removeprefix("torch."),
    )
    for config in (identity["transformer_config"], identity["vae_config"], identity["scheduler"]):
        if config is not None:
            for key in ("_diffusers_version", "_name_or_path", "_use_default_values"):
                config.pop(key, None)
    return identity


def check_settings(pipe: MoHDiTPipeline, settings: SampleSettings) -> HeadActivationPlan | None:
    """Check ``settings`` against the model and scheduler of ``pipe`` without sampling, before
    anything is written: the pipeline's own check of a call (:meth:`MoHDiTPipeline.check_inputs`:
    guidance, steps within the model's diffusion steps, the ratio or every step of a schedule
    within its reachable range, scheduler / model agreement) for the run's first and last image.
    Returns the schedule's plan (None for one ratio); InvalidInput names the setting."""
    last = settings.num_samples - 1
    labels = class_labels_for([0, last], pipe.transformer.config.num_classes, settings.class_labels, settings.seed)
    return pipe.check_inputs(
        labels, settings.guidance_scale, settings.num_inference_steps,
        head_activation_ratio=settings.head_activation_ratio, seeds=[settings.seed, settings.seed + last],
        guidance_channels=settings.guidance_channels, output_type="latent",
    )


def image_shape(pipe: MoHDiTPipeline) -> tuple[int, int, int]:
    """(H, W, C) of the images ``pipe`` makes: the transformer's size, times the VAE's
    downsampling for a latent model."""
    size, channels = pipe.transformer.config.sample_size, pipe.transformer.config.in_channels
    if pipe.vae is not None:
        size *= 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        channels = pipe.vae.config.out_channels
    return size, size, channels


def check_npz_fits_on_disk(output: str | os.PathLike, pipe: MoHDiTPipeline, num_samples: int) -> None:
    """Refuse a run whose ``.npz`` alone (``num_samples`` raw images; the PNGs come on top) is
    larger than the free space of the disk that holds ``output``, before anything is written."""
    height, width, channels = image_shape(pipe)
    check_fits_on_disk(num_samples * height * width * channels, Path(output).expanduser(),
                       f"num_samples {num_samples} (a {NPZ_FILE} of {height}x{width} images)",
                       "use a smaller num_samples, another output_dir, or no .npz (no_npz)",
                       parameters=("num_samples", "output_dir", "no_npz"))


def _holds_samples(output: Path) -> bool:
    folder = output / IMAGE_DIR
    return folder.is_dir() and any(folder.glob("*.png"))


def check_or_write_settings(
    output: str | os.PathLike, identity: dict[str, Any], run_info: dict[str, Any]
) -> str | None:
    """Write ``sample_config.json`` and the output marker into the output folder, or check a
    resumed run against the settings file. A folder holding files ``moh-dit sample`` did not
    write is refused (:func:`~moh_dit.sampling.sample_files.check_sample_folder`).

    Resuming with different settings would mix two sample sets in one folder, so any
    difference in ``identity`` raises (with the differing keys); ``run_info`` (batch size,
    process count, num_samples, ...) may change between runs and is rewritten. A folder whose
    settings file was written but that holds no sample yet (a run that stopped before its
    first image) mixes nothing: its settings are replaced, and the returned note says so
    (None otherwise).
    """
    output = Path(output)
    path = output / SETTINGS_FILE
    _check_output_folder(output)
    check_sample_folder(output)
    note = None
    if path.is_file():
        try:
            previous = json.loads(path.read_text(encoding="utf-8")).get("identity", {})
        except (json.JSONDecodeError, AttributeError) as err:
            raise DamagedFile(f"{path} is not a sample settings file ({err}); use a new output_dir.",
                              parameters="output_dir") from None
        current = json.loads(json.dumps(identity))  # normalise tuples / key types the way JSON stores them
        changed = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
        if changed and _holds_samples(output):
            raise InvalidInput(
                f"{output} holds samples made with different settings ({', '.join(changed)} differ; see {path}). "
                "Use a new output_dir, or delete the folder to start over.", parameters="output_dir",
            )
        if changed:
            note = (f"{path} held other settings ({', '.join(changed)}) but no samples (an earlier run stopped before "
                    "its first image); it now holds this run's settings.")
    (output / IMAGE_DIR).mkdir(parents=True, exist_ok=True)
    write_output_marker(output, "sample")
    write_json_atomic(path, {"identity": identity, "run": run_info})
    return note


def _check_output_folder(output: Path) -> None:
    """Refuse an output that is a file, or that lies under a file, before anything is made."""
    check_folder_path(output, "output_dir", "give a folder (it is created if missing)")  # InvalidInput naming it


# --------------------------------------------------------------------------------------
# The paths of a model and its VAE
# --------------------------------------------------------------------------------------


def _looks_like_path(name: str) -> bool:
    """A ``vae`` that can only be a local path: a Hub id is exactly ``org/name``."""
    return name.startswith((".", "/", "~")) or name.count("/") != 1 or Path(name).exists()


def check_model_flags(model: str | os.PathLike, vae: str | None) -> None:
    """``model`` must be a folder; ``vae``, when it can only be a local path, must be one. Checks
    the paths only (nothing is read); :func:`load_pipeline` starts with it."""
    path = Path(model).expanduser()
    if not path.exists():
        raise InputNotFound(f"model {model} does not exist; give a pipeline folder or a save_pretrained transformer "
                            "folder.", parameters="model")
    if not path.is_dir():
        raise InvalidInput(f"model {model} is a file; give a pipeline folder or a save_pretrained transformer folder.",
                           parameters="model")
    if vae is not None and vae.lower() != "none" and _looks_like_path(vae) and not Path(vae).expanduser().is_dir():
        what = "is not a folder" if Path(vae).expanduser().exists() else "does not exist"
        raise InputNotFound(f"vae {vae} {what}; give an AutoencoderKL folder, a Hub id (org/name) or 'none'.",
                            parameters="vae")


# --------------------------------------------------------------------------------------
# The sampling loop
# --------------------------------------------------------------------------------------


def generate_batch(pipe: MoHDiTPipeline, settings: SampleSettings, indices: Sequence[int]) -> tuple[np.ndarray, float]:
    """uint8 (B, H, W, C) images of run indices ``indices`` (class ``class_labels_for(i)``, seed
    ``settings.seed + i``, DiT's quantisation) and the head activation ratio the pipeline ran at.
    No head usage: nothing here reports it, and at every step it would cost routing statistics
    the images do not need."""
    labels = class_labels_for(indices, pipe.transformer.config.num_classes, settings.class_labels, settings.seed)
    out = pipe(
        labels,
        guidance_scale=settings.guidance_scale,
        guidance_channels=settings.guidance_channels,
        num_inference_steps=settings.num_inference_steps,
        head_activation_ratio=settings.head_activation_ratio,
        seeds=[settings.seed + i for i in indices],
        output_type="latent",
        output_head_usage=False,
    )
    with torch.no_grad():
        images = quantize_dit(pipe.decode(out.images))  # (B, H, W, C) uint8; the copy to CPU synchronises
    return images, out.head_activation_ratio


def sample_images(
    pipe: MoHDiTPipeline,
    output: str | os.PathLike,
    settings: SampleSettings,
    batch_size: int = 32,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
    on_batch: Callable[[Sequence[int]], None] | None = None,
) -> int:
    """Generate this process's missing images of the run as PNGs; returns how many it made.

    Process ``rank`` of ``world_size`` makes the indices ``i = rank (mod world_size)`` whose
    PNG does not exist yet, ``batch_size`` at a time; image ``i`` has class
    ``class_labels_for([i])`` and seed ``settings.seed + i``. A PNG it finds cut short (see
    :func:`~moh_dit.sampling.sample_files.intact_png`) is made again, with a warning naming it.
    ``on_batch`` is called with each finished batch's indices. Memory does not grow with
    ``num_samples``: the work is planned from one listing of the folder. The pipeline checks
    ``settings`` at its first call, before any image is written (:func:`check_settings` checks
    them beforehand, as ``moh-dit sample`` does before it writes its settings file).
    """
    if not _is_int(batch_size) or batch_size < 1:
        raise InvalidInput(f"batch_size must be an int >= 1, got {batch_size!r}.", parameters="batch_size")
    if not 0 <= rank < world_size:
        raise InvalidInput(f"rank {rank} is outside [0, {world_size}).", parameters="rank")
    _check_output_folder(Path(output))
    (Path(output) / IMAGE_DIR).mkdir(parents=True, exist_ok=True)
    mine = range(rank, settings.num_samples, world_size)
    done = {i for i in existing_indices(output) if i < settings.num_samples and i % world_size == rank}
    for index in sorted(done):
        if not intact_png(png_path(output, index)):
            logger.warning(f"{png_path(output, index)} is damaged (cut short); making image {index} again.")
            done.discard(index)
    total = len(mine) - len(done)
    pipe.set_progress_bar_config(disable=True)
    with tqdm(total=total, disable=not progress, unit="img", desc=f"sampling (rank {rank})") as bar:
        for batch in missing_batches((i for i in mine if i not in done), batch_size):
            images, _ = generate_batch(pipe, settings, batch)
            for index, image in zip(batch, images):
                save_png_atomic(png_path(output, index), image)
            bar.update(len(batch))
            if on_batch is not None:
                on_batch(batch)
    return total


def remake_image(pipe: MoHDiTPipeline, output: str | os.PathLike, settings: SampleSettings, index: int) -> None:
    """Make image ``index`` of the run again (the same image: its class and seed follow from the
    index) and write it over its PNG; for a PNG found damaged."""
    images, _ = generate_batch(pipe, settings, [index])
    save_png_atomic(png_path(output, index), images[0])
