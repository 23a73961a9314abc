"""Latent cache: encode an ImageFolder dataset with the VAE once, train from memory-mapped shards.

Training DiT on images spends most of its time in the frozen VAE encoder; encoding every
image once (the "fast-DiT" idea) removes that cost from every epoch. To keep the training
distribution exactly DiT's, the cache stores the encoder's Gaussian (mean and std) rather
than one sample, for both the plain and the horizontally flipped image, so training can
still flip with probability 1/2 and draw a fresh ``z = mean + std * eps`` each time.

Layout of a cache folder::

    index.json            format, version, shapes, dtype, image size, VAE id, scaling factor, class map, shards
    .moh-dit-output.json  the marker of moh-dit extract-latents (what overwrite may replace)
    labels.npy            int64 (N,)
    files.json            source image of every cached sample, relative to the data folder
    shard_00000.npy ...   (n, 2, 2, C, h, w): [sample, view (plain, flipped), stat (mean, std)]

Shards are plain ``.npy`` files opened with ``np.load(mmap_mode="r")``. Extraction writes
into ``.<output>.partial`` beside the output and renames it when complete; each shard is
committed (renamed, then its ``.json`` marker written) as soon as it is done, so a rerun of
the same command after an interruption continues with the first missing shard. One
extraction at a time writes an output folder (a lock ``.<output>.lock`` beside it), the
output never lies inside the data folder or the VAE's, and a cache never replaces anything
but an earlier cache.

A cache records the image size and the VAE it was made at and with; training on it takes
both from the cache (``read_cache_index``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .datasets import (
    _NOISE_STREAM,
    CorruptImageError,
    ON_CORRUPT,
    _split_key,
    center_crop_arr,
    find_image_folder,
    flip_for,
    image_to_tensor,
    item_rng,
    load_image,
)
from ..errors import InvalidInput
from ..utils.io import naming_path, publish_folder, write_json_atomic
from ..utils.logging import get_logger
from ..utils.output_folders import check_output_folder, check_outside_inputs, hold_output_folder, write_output_marker
from ..utils.resources import check_fits_in_memory

__all__ = [
    "LATENT_FORMAT",
    "LatentDataset",
    "encode_distribution",
    "extract_latents",
    "load_vae",
    "read_cache_index",
    "vae_downsample_factor",
]

LATENT_FORMAT = "moh-dit-latents"
logger = get_logger(__name__)
_VERSION = 1
_INDEX = "index.json"
_PROGRESS = "progress.json"
_DTYPES = ("float32", "float16")


# --------------------------------------------------------------------------------------
# VAE
# --------------------------------------------------------------------------------------


def load_vae(vae: str | os.PathLike, subfolder: str | None = None, device: str | torch.device = "cpu"):
    """``AutoencoderKL.from_pretrained`` for a hub id (``stabilityai/sd-vae-ft-ema``) or a local folder.

    The VAE is kept in float32: the SD VAE overflows in float16.
    """
    from diffusers import AutoencoderKL

    kwargs = {"subfolder": subfolder} if subfolder else {}
    try:
        model = AutoencoderKL.from_pretrained(str(vae), torch_dtype=torch.float32, **kwargs)
    except (OSError, ValueError) as err:
        # FileNotFoundError (an OSError) so the scripts print it as one line, not a traceback.
        raise FileNotFoundError(
            f"cannot load an AutoencoderKL from {str(vae)!r}{f' (subfolder {subfolder!r})' if subfolder else ''}: "
            f"{err}. Pass a diffusers VAE folder (with config.json) or a hub id such as stabilityai/sd-vae-ft-ema; "
            "a full pipeline repository keeps its VAE in the subfolder 'vae'."
        ) from err
    return model.to(device).eval().requires_grad_(False)


def vae_downsample_factor(vae) -> int:
    """Spatial downsampling of an AutoencoderKL: 2 per encoder block after the first (8 for SD)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


@torch.no_grad()
def encode_distribution(vae, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of the VAE posterior for images in [-1, 1], (B, 3, H, W) -> 2 x (B, C, h, w).

    The std is the one diffusers samples with (its log variance clamped to [-30, 20]).
    """
    dist = vae.encode(images).latent_dist
    return dist.mean, dist.std


def _vae_id(vae) -> str:
    return str(getattr(vae.config, "_name_or_path", "") or "")


def _local_vae_folder(vae: Any, subfolder: str | None) -> Path | None:
    """The folder holding a local VAE's config.json, or None (a hub id, or a loaded VAE)."""
    if not isinstance(vae, (str, os.PathLike)) or not Path(vae).is_dir():
        return None
    folder = Path(vae) / subfolder if subfolder else Path(vae)
    return folder if (folder / "config.json").is_file() else None


def _check_factor_early(vae: Any, subfolder: str | None, image_size: int) -> None:
    """``image_size`` against a local VAE's downsampling, read from its config.json before the
    VAE is loaded (a hub VAE is checked once loaded)."""
    folder = _local_vae_folder(vae, subfolder)
    try:
        channels = json.loads((folder / "config.json").read_text(encoding="utf-8"))["block_out_channels"]
    except (TypeError, OSError, ValueError, KeyError):
        return
    factor = 2 ** (len(channels) - 1) if isinstance(channels, list) and channels else None
    if factor and image_size % factor:
        raise InvalidInput(f"image_size {image_size} is not a multiple of the VAE's downsampling factor {factor}",
                           parameters="image_size")


# --------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------


class _CropItems(Dataset):
    """(index, image in [-1, 1], error message or "") for the dataset indices of one shard.

    Unreadable images are reported, not raised: the main process decides (error or skip),
    so the message stays clean and the workers are shut down before the error propagates.
    """

    def __init__(self, samples: list[tuple[str, int]], indices: range, image_size: int):
        self.samples, self.indices, self.image_size = samples, indices, image_size

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        index = self.indices[i]
        try:
            image = image_to_tensor(center_crop_arr(load_image(self.samples[index][0]), self.image_size))
            return index, image, ""
        except CorruptImageError as err:
            return index, torch.zeros(3, self.image_size, self.image_size), str(err)


def _fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def extract_latents(
    data_dir: str | os.PathLike,
    vae: Any,
    output_dir: str | os.PathLike,
    image_size: int = 256,
    *,
    batch_size: int = 64,
    shard_size: int = 8192,
    num_workers: int = 4,
    device: str | torch.device | None = None,
    vae_subfolder: str | None = None,
    on_corrupt: str = "error",
    dtype: str = "float32",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Encode every image of an ImageFolder tree into a latent cache at ``output_dir``.

    Args:
        data_dir: ImageFolder root (``<class>/<image>``); labels follow sorted folder names.
        vae: hub id or local diffusers folder of an AutoencoderKL, or a loaded one.
        output_dir: cache folder to create.
        image_size: ADM centre-crop size; must be a multiple of the VAE's downsampling.
        batch_size: images per encoder call (each is encoded plain and flipped).
        shard_size: images per shard file (a shard is also the unit of resumption).
        num_workers: DataLoader processes decoding and cropping images.
        device: where the VAE runs; default CUDA when available.
        vae_subfolder: subfolder of ``vae`` holding the VAE (``"vae"`` for full pipelines).
        on_corrupt: ``"error"`` stops at the first unreadable image, naming it; ``"skip"``
            leaves it out and lists it in ``index.json``.
        dtype: storage dtype of mean and std, ``"float32"`` or ``"float16"`` (half the disk).
        overwrite: replace an existing ``output_dir``, which must be a latent cache: the old
            cache is kept until the new one is complete, then removed.
        progress: show a progress bar of the shards; the summary at the end is logged at
            info level (shown by ``moh-dit extract-latents``, not to a Python caller).

    Rerunning the same call after an interruption resumes from the completed shards.
    Returns the path of the finished cache, which carries the marker of ``moh-dit
    extract-latents``. Every argument is checked before the VAE is loaded or anything is
    written: ``output_dir`` must not be, lie inside or contain ``data_dir`` (or a local VAE
    folder), and one batch must fit in the available memory. While the extraction runs it
    holds ``.NAME.lock`` beside ``output_dir``: a second extraction into it stops at once.
    """
    _check_arguments(on_corrupt, dtype, image_size, batch_size, shard_size, num_workers)
    device = _check_device(device)
    data_dir, output_dir = Path(data_dir), Path(output_dir)
    vae_folder = _local_vae_folder(vae, vae_subfolder)
    check_outside_inputs(output_dir, {"data_dir": data_dir, "vae": vae_folder}, "output_dir")
    classes, class_to_idx, samples = find_image_folder(data_dir)
    _check_output_dir(output_dir, overwrite)
    _check_factor_early(vae, vae_subfolder, image_size)
    # One batch of images, plain and flipped, as float32 on the host: a lower bound of what
    # the encoder's input takes (its activations take more).
    check_fits_in_memory(batch_size * 2 * 3 * image_size**2 * 4, f"batch_size {batch_size} at image_size "
                         f"{image_size}", "use a smaller batch_size", parameters=("batch_size", "image_size"))
    # A local VAE is recorded by its absolute path, so that training finds it from any folder.
    local_vae = str(Path(vae).absolute()) if vae_folder is not None else None
    with hold_output_folder(output_dir, "extract-latents", "output_dir"):
        _check_output_dir(output_dir, overwrite)  # another extraction may have finished it meanwhile
        vae = _ready_vae(vae, vae_subfolder, device)
        factor = vae_downsample_factor(vae)
        if image_size % factor:
            raise InvalidInput(f"image_size {image_size} is not a multiple of the VAE's downsampling factor {factor}",
                               parameters="image_size")
        settings = {
            "format": LATENT_FORMAT,
            "version": _VERSION,
            "image_size": image_size,
            "dtype": dtype,
            "shard_size": shard_size,
            "vae": _vae_id(vae),
            "vae_subfolder": vae_subfolder,
            "vae_config": json.loads(json.dumps(dict(vae.config), default=str)),
            "files": hashlib.sha256("\n".join(f"{os.path.relpath(p, data_dir)}\t{y}" for p, y in samples).encode()).hexdigest(),
        }
        latent_shape = [int(vae.config.latent_channels), image_size // factor, image_size // factor]
        job = _ShardJob(vae=vae, samples=samples, partial=_open_partial(output_dir, settings), image_size=image_size,
                        latent_shape=latent_shape, np_dtype=np.dtype(dtype), shard_size=shard_size,
                        batch_size=batch_size, num_workers=num_workers, device=device, on_corrupt=on_corrupt)
        start = time.perf_counter()
        encoded = _encode_missing_shards(job, progress)
        index = _write_index(job, data_dir, classes, class_to_idx, {**settings, "vae": local_vae or settings["vae"]})
        with publish_folder(output_dir, replace=True) as tmp:  # _check_output_dir refused what may not be replaced
            os.replace(job.partial, tmp)  # the finished cache takes the empty temporary folder's place
            write_output_marker(tmp, "extract-latents")
    elapsed = time.perf_counter() - start
    rate = f", {encoded / elapsed:.1f} images/s" if encoded and elapsed > 0 else ""
    logger.info(f"cached {index['num_samples']} latents of shape {job.latent_shape} to {output_dir}{rate}; "
                f"skipped {index['num_skipped']}")
    return output_dir


def _check_arguments(on_corrupt: str, dtype: str, image_size: int, batch_size: int, shard_size: int,
                     num_workers: int) -> None:
    if on_corrupt not in ON_CORRUPT:
        raise InvalidInput(f"on_corrupt must be one of {ON_CORRUPT}, got {on_corrupt!r}", parameters="on_corrupt")
    if dtype not in _DTYPES:
        raise InvalidInput(f"dtype must be one of {_DTYPES}, got {dtype!r}", parameters="dtype")
    for name, value, least in (("image_size", image_size, 1), ("batch_size", batch_size, 1),
                               ("shard_size", shard_size, 1), ("num_workers", num_workers, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidInput(f"{name} must be an integer >= {least}, got {value!r}", parameters=name)


def _check_device(device: str | torch.device | None) -> str | torch.device:
    """``device``, CUDA when available if None; refused when torch does not know it or it is a
    CUDA device on a machine without CUDA."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidInput(f"device must be cpu, cuda or cuda:N, got {device!r}", parameters="device") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInput(f"device {device} but CUDA is not available; use cpu", parameters="device")
    return device


def _ready_vae(vae: Any, subfolder: str | None, device: str | torch.device):
    """A hub id or folder loaded, or a loaded VAE moved: float32, on ``device``, frozen."""
    if isinstance(vae, (str, os.PathLike)):
        return load_vae(vae, subfolder, device)
    if vae.dtype != torch.float32:
        vae = vae.to(dtype=torch.float32)
    return vae.to(device).eval().requires_grad_(False)


def _partial_dir(output_dir: Path) -> Path:
    return output_dir.parent / f".{output_dir.name}.partial"


def _open_partial(output_dir: Path, settings: dict) -> Path:
    """The folder the cache is built in: an unfinished extraction of the same settings and
    data is continued; one of other settings is refused."""
    # The weights are not hashed (hundreds of MB); the VAE's id and config stand for them.
    fingerprint = _fingerprint(settings)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial_dir(output_dir)
    if partial.exists():
        try:
            previous = json.loads((partial / _PROGRESS).read_text())["fingerprint"]
        except (OSError, ValueError, KeyError):
            previous = None
        if previous != fingerprint:
            raise FileExistsError(
                f"{str(partial)!r} holds an unfinished extraction with other settings or data; "
                f"delete it, or rerun with the same arguments to resume it"
            )
    else:
        partial.mkdir()
        write_json_atomic(partial / _PROGRESS, {"fingerprint": fingerprint, "settings": settings})
    return partial


@dataclass(frozen=True)
class _ShardJob:
    """What every shard of one extraction shares."""

    vae: Any
    samples: list[tuple[str, int]]  # (image path, label) of the whole data folder
    partial: Path  # the folder the cache is built in
    image_size: int
    latent_shape: list[int]  # [C, h, w]
    np_dtype: np.dtype
    shard_size: int
    batch_size: int
    num_workers: int
    device: str | torch.device
    on_corrupt: str

    @property
    def num_shards(self) -> int:
        return -(-len(self.samples) // self.shard_size)

    def shard(self, k: int, suffix: str) -> Path:
        return self.partial / f"shard_{k:05d}{suffix}"


def _encode_missing_shards(job: _ShardJob, progress: bool) -> int:
    """Encode every shard without a marker; returns the number of images encoded now."""
    shards: Any = range(job.num_shards)
    if progress:
        from tqdm.auto import tqdm

        shards = tqdm(shards, desc="latent shards", unit="shard")
    encoded = 0
    for k in shards:
        if not job.shard(k, ".json").exists():
            encoded += _extract_shard(job, k)
    return encoded


def _write_index(job: _ShardJob, data_dir: Path, classes: list[str], class_to_idx: dict[str, int],
                 settings: dict) -> dict:
    """Gather the shard markers into labels.npy, files.json and index.json, then drop the
    markers and the progress file: what is left is the finished cache. Returns the index."""
    shards, labels, files, skipped = [], [], [], []
    samples = job.samples
    for k in range(job.num_shards):
        meta = json.loads(job.shard(k, ".json").read_text())
        shards.append({"file": job.shard(k, ".npy").name, "count": meta["count"]})
        labels += meta["labels"]
        files += [os.path.relpath(samples[i][0], data_dir) for i in meta["indices"]]
        skipped += [os.path.relpath(samples[i][0], data_dir) for i in meta["skipped"]]
    if not labels:
        raise CorruptImageError(f"none of the {len(samples)} images in {str(data_dir)!r} could be read")
    try:
        np.save(job.partial / "labels.npy", np.asarray(labels, dtype=np.int64))
    except OSError as error:  # a full disk: say which file
        raise naming_path(error, job.partial / "labels.npy") from None
    write_json_atomic(job.partial / "files.json", files)
    vae_config = job.vae.config
    index = {
        "format": LATENT_FORMAT,
        "version": _VERSION,
        "num_samples": len(labels),
        "latent_shape": job.latent_shape,
        "layout": "(sample, view[plain, hflip], stat[mean, std], C, h, w)",
        "dtype": settings["dtype"],
        "shards": shards,
        "labels": "labels.npy",
        "files": "files.json",
        "classes": classes,
        "class_to_idx": class_to_idx,
        "image_size": job.image_size,
        "preprocessing": "ADM center_crop_arr, [-1, 1]; view 1 is the horizontal flip",
        "vae": settings["vae"],
        "vae_subfolder": settings["vae_subfolder"],
        "scaling_factor": float(getattr(vae_config, "scaling_factor", None) or 0.18215),
        "shift_factor": float(getattr(vae_config, "shift_factor", None) or 0.0),
        "data_dir": str(data_dir.resolve()),
        "num_skipped": len(skipped),
        "skipped": skipped,
    }
    write_json_atomic(job.partial / _INDEX, index)
    (job.partial / _PROGRESS).unlink()
    for k in range(job.num_shards):
        job.shard(k, ".json").unlink()
    return index


def _is_latent_cache(path: Path) -> bool:
    try:
        return json.loads((path / _INDEX).read_text()).get("format") == LATENT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _check_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse outputs that would destroy something else; nothing is written here (the data
    folder and the VAE are kept apart by ``check_outside_inputs``)."""
    check_output_folder(output_dir, overwrite, _is_latent_cache,
                        f"a latent cache (no {_INDEX} of format {LATENT_FORMAT!r})", named="output_dir ", parameter="output_dir")
    partial = _partial_dir(output_dir)
    if partial.exists() and not partial.is_dir():
        raise FileExistsError(f"{str(partial)!r} is in the way of the extraction (not a folder); move it away")


def _extract_shard(job: _ShardJob, k: int) -> int:
    """Encode shard ``k`` and commit it: .npy renamed into place, then its .json marker.
    Returns the number of images it holds."""
    indices = range(k * job.shard_size, min((k + 1) * job.shard_size, len(job.samples)))
    loader = DataLoader(
        _CropItems(job.samples, indices, job.image_size),
        batch_size=job.batch_size,
        num_workers=job.num_workers,
        pin_memory=str(job.device).startswith("cuda"),
    )
    # Filled in place through a memory map, which needs a named file: the .tmp.npy is this
    # shard's own scratch file, renamed only once complete.
    tmp = job.shard(k, ".tmp.npy")
    try:
        kept, skipped, n = _fill_shard(job, loader, tmp, len(indices))
    except OSError as error:  # a full disk (or an unreadable image, which names itself)
        tmp.unlink(missing_ok=True)
        raise naming_path(error, tmp) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, job.shard(k, ".npy"))
    write_json_atomic(
        job.shard(k, ".json"),
        {"count": n, "indices": kept, "labels": [job.samples[i][1] for i in kept], "skipped": skipped},
    )
    return n


def _reserve(path: Path) -> None:
    """Allocate a new memory-mapped file's blocks now. Writing through the map into a sparse
    file on a full disk kills the process (SIGBUS) with no word of the file; allocated up
    front, a full disk is an OSError (ENOSPC) naming it, before any image is encoded."""
    if not hasattr(os, "posix_fallocate"):
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOSYS", -1)):
            raise naming_path(error, path) from None  # file systems without it keep the sparse file
    finally:
        os.close(fd)


def _fill_shard(job: _ShardJob, loader: DataLoader, tmp: Path, capacity: int) -> tuple[list[int], list[int], int]:
    """Encode the loader's images into ``tmp`` (plain and flipped view, mean and std); returns
    the dataset indices kept and skipped, and how many rows were filled."""
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=job.np_dtype, shape=(capacity, 2, 2, *job.latent_shape))
    _reserve(tmp)
    kept, skipped, n = [], [], 0
    batches = iter(loader)
    error = None
    for index, images, errors in batches:
        ok = torch.tensor([not e for e in errors], dtype=torch.bool)
        if job.on_corrupt == "error" and not ok.all():
            error = next(e for e in errors if e)
            break
        skipped += index[~ok].tolist()
        images = images[ok].to(job.device, non_blocking=True)
        if images.shape[0] == 0:
            continue
        b = images.shape[0]
        # One encoder call for both views; flipping the tensor equals flipping the PIL image.
        mean, std = encode_distribution(job.vae, torch.cat([images, images.flip(-1)]))
        stats = torch.stack([mean, std], dim=1)  # (2b, 2, C, h, w)
        stats = stats.reshape(2, b, 2, *job.latent_shape).transpose(0, 1)  # (b, view, stat, C, h, w)
        out[n : n + b] = stats.float().cpu().numpy().astype(job.np_dtype)
        kept += index[ok].tolist()
        n += b
    del batches  # stop the DataLoader workers now rather than when a traceback is freed
    if error is not None:
        raise CorruptImageError(error, parameters="on_corrupt")
    out.flush()
    del out
    if n < capacity:  # images were skipped: keep only the filled rows
        # A plain sibling file, written with the permissions the umask gives, like every
        # other shard of the cache.
        full = np.load(tmp, mmap_mode="r")
        compact = tmp.with_name(tmp.name.replace(".tmp.npy", ".tmp2.npy"))
        np.save(compact, np.ascontiguousarray(full[:n]))
        del full
        os.replace(compact, tmp)
    return kept, skipped, n


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------


def read_cache_index(root: str | os.PathLike) -> dict[str, Any]:
    """The ``index.json`` of the latent cache at ``root``, or ValueError saying what it is not:
    shapes, classes, shards, and what the cache was made at and with (``image_size``, ``vae``,
    ``vae_subfolder``, ``scaling_factor``, ``shift_factor``)."""
    index_path = Path(root) / _INDEX
    if not index_path.is_file():
        raise ValueError(f"{str(root)!r} is not a latent cache (no {_INDEX}); create one with moh-dit extract-latents")
    try:
        meta = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{str(index_path)!r} is unreadable ({type(error).__name__}: {error}); make the cache "
                         "again with moh-dit extract-latents") from None
    if not isinstance(meta, dict) or meta.get("format") != LATENT_FORMAT or meta.get("version") != _VERSION:
        meta = meta if isinstance(meta, dict) else {}
        raise ValueError(
            f"{str(index_path)!r} has format {meta.get('format')!r} version {meta.get('version')!r}; "
            f"this code reads {LATENT_FORMAT!r} version {_VERSION}"
        )
    return meta


class LatentDataset(Dataset):
    """Training items ``(latent, label)`` from a latent cache.

    Args:
        root: cache folder written by :func:`extract_latents`.
        random_flip: use the flipped view with probability 1/2, decided by
            ``flip_for(seed, epoch, index)`` exactly as :class:`~moh_dit.data.datasets.ImageFolderDataset`.
        seed: seed of flips and latent noise.
        sample_posterior: return ``mean + std * eps`` (DiT's ``latent_dist.sample()``);
            False returns the mean.

    The latent is ``(z - shift_factor) * scaling_factor`` (0.18215 and 0 for the SD VAE), float32
    (C, h, w); eps comes from a generator keyed by ``(seed, epoch, index)``. Keys are an
    index (epoch from :meth:`set_epoch`) or an ``(index, epoch)`` pair. Indices are
    positions in the cache, equal to ImageFolder indices when nothing was skipped.
    """

    def __init__(
        self, root: str | os.PathLike, *, random_flip: bool = True, seed: int = 0, sample_posterior: bool = True
    ):
        self.root = Path(root)
        meta = read_cache_index(self.root)
        self.meta = meta
        self.classes: list[str] = meta["classes"]
        self.class_to_idx: dict[str, int] = meta["class_to_idx"]
        self.latent_shape = tuple(meta["latent_shape"])
        self.scaling_factor = float(meta["scaling_factor"])
        self.shift_factor = float(meta["shift_factor"])
        self.labels = np.load(self.root / meta["labels"])
        counts = [s["count"] for s in meta["shards"]]
        self._starts = np.cumsum([0] + counts)
        if self._starts[-1] != len(self.labels) or len(self.labels) != meta["num_samples"]:
            raise ValueError(f"latent cache {str(self.root)!r} is inconsistent: shard counts {counts}, labels {len(self.labels)}")
        self.random_flip = random_flip
        self.seed = int(seed)
        self.sample_posterior = sample_posterior
        self.epoch = 0
        self._shards: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __getstate__(self):
        # Memory maps are reopened in each DataLoader worker instead of being pickled (which
        # would copy their contents).
        state = self.__dict__.copy()
        state["_shards"] = None
        return state

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def stats(self, index: int, flip: bool) -> tuple[np.ndarray, np.ndarray]:
        """Stored (mean, std) of sample ``index``'s plain or flipped view, unscaled, as stored."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a cache of {len(self)} samples")
        if self._shards is None:
            self._shards = [np.load(self.root / s["file"], mmap_mode="r") for s in self.meta["shards"]]
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        view = self._shards[k][index - self._starts[k], int(flip)]
        return view[0], view[1]

    def __getitem__(self, key):
        index, epoch = _split_key(key, self.epoch)
        flip = self.random_flip and flip_for(self.seed, epoch, index)
        mean, std = self.stats(index, flip)
        z = mean.astype(np.float32)
        if self.sample_posterior:
            eps = item_rng(self.seed, epoch, index, _NOISE_STREAM).standard_normal(self.latent_shape, dtype=np.float32)
            z = z + std.astype(np.float32) * eps
        latent = torch.from_numpy((z - self.shift_factor) * self.scaling_factor)
        return latent, int(self.labels[index])
