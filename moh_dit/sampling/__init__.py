"""Sampling at scale, as DiT's ``sample_ddp.py``: PNGs, one ADM ``.npz``, any number of processes.

Image ``i`` is a function of the settings and ``i`` alone: its class (``i mod num_classes``,
or a uniform draw seeded by ``(seed, i)``) and its seed ``seed + i``, which the pipeline's
``seeds`` turns into its initial noise and every step's noise. So a run gives the same images
for any batch size or process count, and to resume one runs the same command again: PNGs are
written atomically, so one that exists is complete and is skipped.

    >>> pipe = load_pipeline("runs/b2-75")          # a run folder: its final/ pipeline
    >>> sample("runs/b2-75", "samples/b2-75", num_samples=50_000, num_inference_steps=250)

``moh-dit sample`` (``accelerate launch -m moh_dit.commands sample``) is the command-line front.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import zipfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import PIL.Image
import torch

from ..outputs import atomic_write, output_folder, read_json, write_json

__all__ = ["CONFIG_FILE", "IMAGE_DIR", "NPZ_FILE", "class_labels_for", "generate", "load_pipeline", "png_path",
           "sample", "sample_images", "save_png", "to_uint8", "write_npz"]

IMAGE_DIR, NPZ_FILE, CONFIG_FILE = "samples", "samples.npz", "sample_config.json"
logger = logging.getLogger(__name__)
RUN_CONFIG = "train_config.json"  # what marks a training run's folder


def load_pipeline(path: str | os.PathLike, vae: str | None = None, scheduler: str | None = None,
                  clip_sample: bool | None = None, dtype: torch.dtype | None = None):
    """A ``MoHDiTPipeline`` from a pipeline folder, a training run's folder (its ``final/``) or a
    ``save_pretrained`` transformer folder.

    ``vae``: an ``AutoencoderKL`` path or Hub id, or ``"none"`` for a pixel-space model; None keeps
    a pipeline folder's own. ``scheduler``: None keeps a pipeline folder's own (so the images are
    ``MoHDiTPipeline.from_pretrained``'s; a transformer folder gets the paper's DDPM); ``"ddpm"``,
    ``"ddim"`` or ``"dpm"`` replaces it with :func:`moh_dit.diffusion.make_scheduler`'s.
    ``clip_sample`` applies to a scheduler built here; None: on for pixel-space models (IDDPM clips
    predicted images to [-1, 1]), off for latent ones (DiT does not clip) and for DPM-Solver.
    """
    from diffusers import AutoencoderKL

    from ..diffusion import make_scheduler
    from ..models import MoHDiTTransformer2DModel
    from ..pipelines.pipeline_moh_dit import MoHDiTPipeline

    path = Path(path).expanduser()
    if (path / RUN_CONFIG).is_file() and not (path / "model_index.json").is_file():
        path = path / "final"
        if not path.is_dir():
            raise FileNotFoundError(errno.ENOENT, "a training run without final/ (it has not finished); resume "
                                    "its training to the end, or give a pipeline or transformer folder", str(path))
    if (path / "model_index.json").is_file():
        pipe = MoHDiTPipeline.from_pretrained(path)
    elif (path / "config.json").is_file():
        pipe = MoHDiTPipeline(transformer=MoHDiTTransformer2DModel.from_pretrained(path),
                              scheduler=make_scheduler("ddpm"))
        scheduler = scheduler or "ddpm"
    else:
        raise FileNotFoundError(errno.ENOENT, "neither a pipeline folder (model_index.json), a training run "
                                f"({RUN_CONFIG}) nor a transformer folder (config.json)", str(path))
    if vae is not None:
        pipe.vae = None if vae.lower() == "none" else AutoencoderKL.from_pretrained(vae).eval()
    if pipe.vae is None and pipe.transformer.config.in_channels not in (1, 3):
        raise ValueError(f"{path} is a latent model ({pipe.transformer.config.in_channels} channels): give its "
                         "VAE, e.g. vae='stabilityai/sd-vae-ft-ema'")
    if scheduler is not None:
        if clip_sample is None:
            clip_sample = pipe.vae is None and scheduler != "dpm"
        pipe.scheduler = make_scheduler(scheduler, clip_sample=clip_sample)
    if dtype is not None and dtype != pipe.transformer.dtype:
        pipe.transformer.to(dtype)
    return pipe


def class_labels_for(indices: Sequence[int], num_classes: int, mode: str = "balanced", seed: int = 0) -> np.ndarray:
    """The class of each image index (int64): ``"balanced"``, ``i mod num_classes`` (50k images give
    50 per ImageNet class, and so does every block of ``num_classes``); ``"uniform"``, a draw from
    ``numpy.random.default_rng([seed, i])`` (DiT's sample_ddp.py draws labels uniformly)."""
    indices = np.asarray(indices, dtype=np.int64)
    if mode == "balanced":
        return indices % num_classes
    return np.array([np.random.default_rng([seed, i]).integers(num_classes) for i in indices.tolist()], np.int64)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, C, H, W) in [-1, 1] -> (B, H, W, C) uint8 by DiT's rule, ``clamp(127.5 x + 128, 0, 255)`` truncated."""
    return torch.clamp(127.5 * images.float() + 128.0, 0, 255).permute(0, 2, 3, 1).to("cpu", torch.uint8).numpy()


def png_path(output_dir: str | os.PathLike, index: int) -> Path:
    return Path(output_dir) / IMAGE_DIR / f"{index:06d}.png"


@torch.no_grad()
def generate(pipe, indices: Sequence[int], *, guidance_scale: float = 1.5, guidance_channels: str = "dit",
             num_inference_steps: int = 250, head_activation_ratio: Any = None, seed: int = 0,
             class_labels: str = "balanced"):
    """uint8 (B, H, W, C) images of run indices ``indices`` and the pipeline's output (for its realised
    head activation). Latents are decoded here so that the quantisation is exactly DiT's."""
    labels = class_labels_for(indices, pipe.transformer.config.num_classes, class_labels, seed).tolist()
    out = pipe(labels, guidance_scale=guidance_scale, guidance_channels=guidance_channels,
               num_inference_steps=num_inference_steps, head_activation_ratio=head_activation_ratio,
               seeds=[seed + i for i in indices], output_type="latent", output_head_usage=False)
    x = out.images  # (B, C, h, w)
    if pipe.vae is not None:
        x = pipe.vae.decode((x / pipe.vae.config.scaling_factor).to(pipe.vae.dtype)).sample  # (B, 3, H, W)
    return to_uint8(x), out


def save_png(path: Path, image: np.ndarray) -> None:
    with atomic_write(path) as f:
        PIL.Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(f, format="PNG")


def sample_images(pipe, output_dir: str | os.PathLike, num_samples: int, *, batch_size: int = 32, rank: int = 0,
                  world_size: int = 1, progress: bool = True, **settings) -> int:
    """Write the PNGs of process ``rank``'s indices (``i = rank mod world_size``) that do not exist yet,
    ``batch_size`` at a time; returns how many it made. ``settings`` are :func:`generate`'s keywords."""
    from tqdm.auto import tqdm

    folder = Path(output_dir) / IMAGE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    mine = range(rank, num_samples, world_size)
    done = {i for i in (int(p.stem) for p in folder.glob("*.png") if p.stem.isdigit()) if i in mine}  # one listing
    todo = (i for i in mine if i not in done)  # lazy: memory grows with the PNGs that exist, not num_samples
    pipe.set_progress_bar_config(disable=True)
    with tqdm(total=len(mine) - len(done), disable=not progress, desc=f"sampling (rank {rank})") as bar:
        for batch in iter(lambda: list(itertools.islice(todo, batch_size)), []):
            images, _ = generate(pipe, batch, **settings)
            for index, image in zip(batch, images):
                save_png(png_path(output_dir, index), image)
            bar.update(len(batch))
    return len(mine) - len(done)


def write_npz(output_dir: str | os.PathLike, num_samples: int, labels: Sequence[int] | None = None) -> Path:
    """Stream PNGs ``0 .. num_samples - 1`` into ``samples.npz`` as ADM and DiT read it: ``arr_0``
    uint8 (N, H, W, C) and, with ``labels``, ``arr_1`` int64 (N,), ADM's convention for
    class-conditional samples. One image is in memory at a time (50k at 256 px are 9.8 GB)."""
    output_dir = Path(output_dir)
    first = np.asarray(PIL.Image.open(png_path(output_dir, 0)))
    path = output_dir / NPZ_FILE
    with atomic_write(path) as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        with archive.open("arr_0.npy", "w", force_zip64=True) as member:
            header = {"descr": "|u1", "fortran_order": False, "shape": (num_samples, *first.shape)}
            np.lib.format.write_array_header_1_0(member, header)
            for i in range(num_samples):
                with PIL.Image.open(png_path(output_dir, i)) as png:
                    image = np.asarray(png)
                if image.shape != first.shape:
                    raise ValueError(f"{png_path(output_dir, i)} is {image.shape}, image 0 is {first.shape}: "
                                     "the folder mixes runs; sample into a new folder")
                member.write(np.ascontiguousarray(image).tobytes())
        if labels is not None:
            with archive.open("arr_1.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(labels, dtype=np.int64))
    return path


def sample(model: str | os.PathLike, output_dir: str | os.PathLike, *, num_samples: int = 50_000,
           batch_size: int = 32, guidance_scale: float = 1.5, guidance_channels: str = "dit",
           num_inference_steps: int = 250, head_activation_ratio: Any = None, seed: int = 0,
           class_labels: str = "balanced", vae: str | None = None, scheduler: str | None = None,
           clip_sample: bool | None = None, dtype: torch.dtype | None = None, npz: bool = True,
           compile: bool = False, compile_mode: str | None = None, overwrite: bool = False,
           dry_run: bool = False, progress: bool = True) -> dict:
    """Sample ``model`` (what :func:`load_pipeline` takes) into ``output_dir`` on every process of an
    ``accelerate`` launch: ``samples/NNNNNN.png``, ``samples.npz`` and ``sample_config.json``.

    Rank 0 takes the folder (one writer, only a folder ``moh-dit sample`` wrote, never inside the
    model) and writes the settings; a rerun continues a folder with the same settings and refuses
    one whose samples were made otherwise (``num_samples`` may grow). Returns the settings.
    """
    from accelerate import Accelerator

    accelerator = Accelerator()
    inputs = {"model": model, "vae": vae if vae is not None and Path(vae).exists() else None}
    held = contextlib.nullcontext()
    if accelerator.is_main_process and not dry_run:  # the folder first: a refused one costs no loading
        held = output_folder(output_dir, "sample", overwrite=overwrite, resume=not overwrite, inputs=inputs,
                             setup=(CONFIG_FILE,))
    with held:
        pipe = load_pipeline(model, vae=vae, scheduler=scheduler, clip_sample=clip_sample, dtype=dtype)
        settings = dict(guidance_scale=guidance_scale, guidance_channels=guidance_channels,
                        num_inference_steps=num_inference_steps, head_activation_ratio=head_activation_ratio,
                        seed=seed, class_labels=class_labels)
        scheduler_config = {k: v for k, v in json.loads(pipe.scheduler.to_json_string()).items() if k[0] != "_"}
        config = {**settings, "model": str(Path(model).resolve()), "vae": vae, "dtype": str(pipe.transformer.dtype),
                  "scheduler": {"_class_name": type(pipe.scheduler).__name__, **scheduler_config}}
        if dry_run:
            if accelerator.is_main_process:
                print(json.dumps(config, indent=2))
            return config
        if accelerator.is_main_process:
            _check_config(Path(output_dir), config)
        accelerator.wait_for_everyone()
        pipe.to(accelerator.device)
        if compile:
            pipe.transformer.compile(mode=compile_mode)
        sample_images(pipe, output_dir, num_samples, batch_size=batch_size, rank=accelerator.process_index,
                      world_size=accelerator.num_processes, progress=progress and accelerator.is_local_main_process,
                      **settings)
        accelerator.wait_for_everyone()
        if npz and accelerator.is_main_process:
            labels = class_labels_for(np.arange(num_samples), pipe.transformer.config.num_classes, class_labels, seed)
            logger.info("wrote %s (%d images, their labels in arr_1)", write_npz(output_dir, num_samples, labels),
                        num_samples)
    return config


def _check_config(output_dir: Path, config: dict) -> None:
    """Refuse to mix samples of other settings into a folder; write this run's settings."""
    path = output_dir / CONFIG_FILE
    if path.is_file() and any((output_dir / IMAGE_DIR).glob("*.png")):
        before = read_json(path)
        config = json.loads(json.dumps(config))  # as JSON stores it (tuples as lists)
        changed = sorted(k for k in set(before) | set(config) if before.get(k) != config.get(k))
        if changed:
            raise ValueError(f"{output_dir} holds samples made with other settings ({', '.join(changed)} differ, "
                             f"see {path}); sample into a new folder")
    write_json(path, config)
