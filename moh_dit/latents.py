"""Latent cache: encode an ImageFolder dataset with the VAE once, train from memory-mapped shards.

Training DiT on images spends most of its time in the frozen VAE encoder; encoding every
image once (the "fast-DiT" idea) removes that cost from every epoch. To keep the training
distribution exactly DiT's, the cache stores the encoder's Gaussian (mean and std) rather
than one sample, for both the plain and the horizontally flipped image, so training can
still flip with probability 1/2 and draw a fresh ``z = mean + std * eps`` each time.

Layout of a cache folder::

    index.json            format, version, shapes, dtype, VAE id, scaling factor, class map, shards
    labels.npy            int64 (N,)
    files.json            source image of every cached sample, relative to the data folder
    shard_00000.npy ...   (n, 2, 2, C, h, w): [sample, view (plain, flipped), stat (mean, std)]

Shards are plain ``.npy`` files opened with ``np.load(mmap_mode="r")``. Extraction writes
into ``.<output>.partial`` beside the output and renames it when complete; each shard is
committed (renamed, then its ``.json`` marker written) as soon as it is done, so a rerun of
the same command after an interruption continues with the first missing shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .data import (
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
from .io_utils import write_json_atomic

__all__ = [
    "LATENT_FORMAT",
    "LatentDataset",
    "encode_distribution",
    "extract_latents",
    "load_vae",
    "vae_downsample_factor",
]

LATENT_FORMAT = "moh-dit-latents"
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
            f"for a full pipeline repository add --vae-subfolder vae."
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

    Rerunning the same call after an interruption resumes from the completed shards.
    Returns the path of the finished cache. Every argument is checked before the VAE is
    loaded or anything is written.
    """
    if on_corrupt not in ON_CORRUPT:
        raise ValueError(f"on_corrupt must be one of {ON_CORRUPT}, got {on_corrupt!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    for name, value, least in (("image_size", image_size, 1), ("batch_size", batch_size, 1),
                               ("shard_size", shard_size, 1), ("num_workers", num_workers, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} (--{name.replace('_', '-')}) must be an integer >= {least}, got {value!r}")
    data_dir, output_dir = Path(data_dir), Path(output_dir)
    classes, class_to_idx, samples = find_image_folder(data_dir)
    _check_output_dir(data_dir, output_dir, overwrite)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but CUDA is not available; use --device cpu")
    if isinstance(vae, (str, os.PathLike)):
        vae = load_vae(vae, vae_subfolder, device)
    else:
        if vae.dtype != torch.float32:
            vae = vae.to(dtype=torch.float32)
        vae = vae.to(device).eval().requires_grad_(False)
    factor = vae_downsample_factor(vae)
    if image_size % factor:
        raise ValueError(f"image_size {image_size} is not a multiple of the VAE's downsampling factor {factor}")
    latent_shape = [int(vae.config.latent_channels), image_size // factor, image_size // factor]
    np_dtype = np.dtype(dtype)

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
    # The weights are not hashed (hundreds of MB); the VAE's id and config stand for them.
    fingerprint = _fingerprint(settings)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = output_dir.parent / f".{output_dir.name}.partial"
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

    num_shards = -(-len(samples) // shard_size)
    iterator = range(num_shards)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc="latent shards", unit="shard")
    start = time.perf_counter()
    encoded = 0
    for k in iterator:
        if (partial / f"shard_{k:05d}.json").exists():
            continue
        indices = range(k * shard_size, min((k + 1) * shard_size, len(samples)))
        encoded += _extract_shard(
            vae, samples, indices, partial, k, image_size, latent_shape, np_dtype, batch_size, num_workers, device, on_corrupt
        )

    # Gather the shard markers into the final index.
    shards, labels, files, skipped = [], [], [], []
    for k in range(num_shards):
        meta = json.loads((partial / f"shard_{k:05d}.json").read_text())
        shards.append({"file": f"shard_{k:05d}.npy", "count": meta["count"]})
        labels += meta["labels"]
        files += [os.path.relpath(samples[i][0], data_dir) for i in meta["indices"]]
        skipped += [os.path.relpath(samples[i][0], data_dir) for i in meta["skipped"]]
    if not labels:
        raise CorruptImageError(f"none of the {len(samples)} images in {str(data_dir)!r} could be read")
    np.save(partial / "labels.npy", np.asarray(labels, dtype=np.int64))
    write_json_atomic(partial / "files.json", files)
    index = {
        "format": LATENT_FORMAT,
        "version": _VERSION,
        "num_samples": len(labels),
        "latent_shape": latent_shape,
        "layout": "(sample, view[plain, hflip], stat[mean, std], C, h, w)",
        "dtype": dtype,
        "shards": shards,
        "labels": "labels.npy",
        "files": "files.json",
        "classes": classes,
        "class_to_idx": class_to_idx,
        "image_size": image_size,
        "preprocessing": "ADM center_crop_arr, [-1, 1]; view 1 is the horizontal flip",
        "vae": settings["vae"],
        "vae_subfolder": vae_subfolder,
        "scaling_factor": float(getattr(vae.config, "scaling_factor", None) or 0.18215),
        "shift_factor": float(getattr(vae.config, "shift_factor", None) or 0.0),
        "data_dir": str(data_dir.resolve()),
        "num_skipped": len(skipped),
        "skipped": skipped,
    }
    write_json_atomic(partial / _INDEX, index)
    (partial / _PROGRESS).unlink()
    for k in range(num_shards):
        (partial / f"shard_{k:05d}.json").unlink()
    if output_dir.exists():  # overwrite: move the old cache aside first, delete it last
        old = output_dir.parent / f".{output_dir.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(output_dir, old)
        os.replace(partial, output_dir)
        shutil.rmtree(old)
    else:
        os.replace(partial, output_dir)
    if progress:
        elapsed = time.perf_counter() - start
        rate = f", {encoded / elapsed:.1f} images/s" if encoded and elapsed > 0 else ""
        print(f"cached {len(labels)} latents of shape {latent_shape} to {output_dir}{rate}; skipped {len(skipped)}")
    return output_dir


def _is_latent_cache(path: Path) -> bool:
    try:
        return json.loads((path / _INDEX).read_text()).get("format") == LATENT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _check_output_dir(data_dir: Path, output_dir: Path, overwrite: bool) -> None:
    """Refuse outputs that would mix with or destroy something else; nothing is written here."""
    data_real, out_real = data_dir.resolve(), output_dir.resolve()
    if out_real == data_real or data_real in out_real.parents or out_real in data_real.parents:
        raise ValueError(
            f"--output-dir {str(output_dir)!r} and --data-dir {str(data_dir)!r} overlap; put the cache "
            "in a folder outside the data folder"
        )
    if output_dir.exists() or output_dir.is_symlink():
        if not output_dir.is_dir():
            raise FileExistsError(f"--output-dir {str(output_dir)!r} exists and is not a folder; choose another --output-dir")
        if not overwrite:
            raise FileExistsError(
                f"{str(output_dir)!r} already exists; delete it, choose another --output-dir or pass --overwrite"
            )
        if not _is_latent_cache(output_dir) and any(output_dir.iterdir()):
            # --overwrite replaces a latent cache; it never deletes an unrelated folder.
            raise FileExistsError(
                f"--overwrite would replace {str(output_dir)!r}, which is not a latent cache (no {_INDEX} "
                f"of format {LATENT_FORMAT!r}); choose another --output-dir, or delete it yourself"
            )
    partial = output_dir.parent / f".{output_dir.name}.partial"
    if partial.exists() and not partial.is_dir():
        raise FileExistsError(f"{str(partial)!r} is in the way of the extraction (not a folder); move it away")
    # Missing parent folders are created when the work starts; a file in their place cannot be.
    ancestor = output_dir.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise FileExistsError(f"cannot create --output-dir {str(output_dir)!r}: {str(ancestor)!r} is a file")


def _extract_shard(
    vae, samples, indices, partial, k, image_size, latent_shape, np_dtype, batch_size, num_workers, device, on_corrupt
) -> int:
    """Encode one shard and commit it: .npy renamed into place, then its .json marker."""
    loader = DataLoader(
        _CropItems(samples, indices, image_size),
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=str(device).startswith("cuda"),
    )
    tmp = partial / f"shard_{k:05d}.tmp.npy"
    try:
        kept, skipped, n = _fill_shard(vae, loader, tmp, len(indices), latent_shape, np_dtype, device, on_corrupt)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, partial / f"shard_{k:05d}.npy")
    write_json_atomic(
        partial / f"shard_{k:05d}.json",
        {"count": n, "indices": kept, "labels": [samples[i][1] for i in kept], "skipped": skipped},
    )
    return n


def _fill_shard(vae, loader, tmp, capacity, latent_shape, np_dtype, device, on_corrupt) -> tuple[list[int], list[int], int]:
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np_dtype, shape=(capacity, 2, 2, *latent_shape))
    kept, skipped, n = [], [], 0
    batches = iter(loader)
    error = None
    for index, images, errors in batches:
        ok = torch.tensor([not e for e in errors], dtype=torch.bool)
        if on_corrupt == "error" and not ok.all():
            error = next(e for e in errors if e)
            break
        skipped += index[~ok].tolist()
        images = images[ok].to(device, non_blocking=True)
        if images.shape[0] == 0:
            continue
        b = images.shape[0]
        # One encoder call for both views; flipping the tensor equals flipping the PIL image.
        mean, std = encode_distribution(vae, torch.cat([images, images.flip(-1)]))
        stats = torch.stack([mean, std], dim=1)  # (2b, 2, C, h, w)
        stats = stats.reshape(2, b, 2, *latent_shape).transpose(0, 1)  # (b, view, stat, C, h, w)
        out[n : n + b] = stats.float().cpu().numpy().astype(np_dtype)
        kept += index[ok].tolist()
        n += b
    del batches  # stop the DataLoader workers now rather than when a traceback is freed
    if error is not None:
        raise CorruptImageError(error)
    out.flush()
    del out
    if n < capacity:  # images were skipped: keep only the filled rows
        full = np.load(tmp, mmap_mode="r")
        compact = tmp.with_name(tmp.name.replace(".tmp.npy", ".tmp2.npy"))
        np.save(compact, np.ascontiguousarray(full[:n]))
        del full
        os.replace(compact, tmp)
    return kept, skipped, n


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------


class LatentDataset(Dataset):
    """Training items ``(latent, label)`` from a latent cache.

    Args:
        root: cache folder written by :func:`extract_latents`.
        random_flip: use the flipped view with probability 1/2, decided by
            ``flip_for(seed, epoch, index)`` exactly as :class:`~moh_dit.data.ImageFolderDataset`.
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
        index_path = self.root / _INDEX
        if not index_path.is_file():
            raise ValueError(
                f"{str(self.root)!r} is not a latent cache (no {_INDEX}); create one with scripts/extract_latents.py"
            )
        meta = json.loads(index_path.read_text())
        if meta.get("format") != LATENT_FORMAT or meta.get("version") != _VERSION:
            raise ValueError(
                f"{str(index_path)!r} has format {meta.get('format')!r} version {meta.get('version')!r}; "
                f"this code reads {LATENT_FORMAT!r} version {_VERSION}"
            )
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
