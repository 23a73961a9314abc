"""The latent cache: every image encoded by the VAE once (fast-DiT's idea), trained on from
memory-mapped shards.

To keep DiT's training distribution the cache stores the encoder's Gaussian (mean and std) of
the plain and the flipped image, so training still flips with probability 1/2 and draws a
fresh ``z = mean + std * eps`` each time. A cache folder::

    index.json          shapes, classes, shards, image size, VAE, scaling factor, settings
    labels.npy          int64 (N,)
    files.json          each sample's source image, relative to the data folder
    shard_00000.npy     (n, 2, 2, C, h, w): [sample, view (plain, flipped), stat (mean, std)]

Each shard is written atomically with a small ``shard_K.json`` beside it when done, so
rerunning the same extraction after an interruption continues with the first missing shard;
``index.json`` is written last and the shard markers go.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..outputs import atomic_write, output_folder, read_json, write_json
from .datasets import CorruptImageError, _key, center_crop_arr, find_image_folder, flip_for, image_to_tensor, \
    item_rng, load_image

logger = logging.getLogger(__name__)
LATENT_FORMAT = "moh-dit-latents"


def load_vae(vae: str | os.PathLike, subfolder: str | None = None, device: str | torch.device = "cpu"):
    """A frozen float32 ``AutoencoderKL`` (the SD VAE overflows in float16) from a hub id or a folder."""
    from diffusers import AutoencoderKL

    kwargs = {"subfolder": subfolder} if subfolder else {}
    return AutoencoderKL.from_pretrained(str(vae), torch_dtype=torch.float32, **kwargs).to(device).eval() \
        .requires_grad_(False)


def vae_downsample_factor(vae) -> int:
    """2 per encoder block after the first (8 for the SD VAE)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


@torch.no_grad()
def encode_distribution(vae, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 3, H, W) in [-1, 1] -> the posterior's mean and std, each (B, C, h, w)."""
    dist = vae.encode(images).latent_dist
    return dist.mean, dist.std


class _CropItems(Dataset):
    """(index, image, error message or "") for the indices of one shard: a worker reports an
    unreadable image instead of raising, so the main process decides (stop or skip)."""

    def __init__(self, samples: list[tuple[str, int]], indices: range, image_size: int):
        self.samples, self.indices, self.image_size = samples, indices, image_size

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        index = self.indices[i]
        try:
            return index, image_to_tensor(center_crop_arr(load_image(self.samples[index][0]), self.image_size)), ""
        except CorruptImageError as error:
            return index, torch.zeros(3, self.image_size, self.image_size), str(error)


def extract_latents(data_dir: str | os.PathLike, vae, output_dir: str | os.PathLike, image_size: int = 256, *,
                    batch_size: int = 64, shard_size: int = 4096, num_workers: int = 4,
                    device: str | torch.device | None = None, vae_subfolder: str | None = None,
                    on_corrupt: str = "error", dtype: str = "float32", overwrite: bool = False,
                    progress: bool = True) -> Path:
    """Encode the image folder ``data_dir`` (``<class>/<image>``) into a latent cache at
    ``output_dir`` and return it. ``vae``: a hub id, a folder or a loaded AutoencoderKL;
    ``image_size``: ADM's centre crop, a multiple of the VAE's downsampling; ``shard_size``:
    images per shard (the unit of resumption); ``on_corrupt="skip"`` leaves unreadable images
    out and lists them in ``index.json``; ``dtype``: ``"float16"`` halves the disk. Running the
    same call again continues an interrupted extraction; ``overwrite`` replaces an earlier cache."""
    from tqdm.auto import tqdm

    data_dir, device = Path(data_dir), device or ("cuda" if torch.cuda.is_available() else "cpu")
    classes, class_to_idx, samples = find_image_folder(data_dir)
    local_vae = Path(vae).absolute() if isinstance(vae, (str, os.PathLike)) and Path(vae).is_dir() else None
    with output_folder(output_dir, "extract-latents", overwrite=overwrite, resume=not overwrite,
                       inputs={"data_dir": data_dir, "vae": local_vae}, setup=("progress.json",)) as out:
        if isinstance(vae, (str, os.PathLike)):
            vae = load_vae(vae, vae_subfolder, device)
        vae = vae.to(device, torch.float32).eval().requires_grad_(False)
        factor = vae_downsample_factor(vae)
        if image_size % factor:
            raise ValueError(f"image_size {image_size} is not a multiple of the VAE's downsampling factor {factor}")
        files = "\n".join(f"{os.path.relpath(p, data_dir)}\t{y}" for p, y in samples)
        settings = {"image_size": image_size, "dtype": dtype, "shard_size": shard_size,
                    "vae": str(local_vae or getattr(vae.config, "_name_or_path", "")), "vae_subfolder": vae_subfolder,
                    "vae_config": json.loads(json.dumps(dict(vae.config), default=str)),
                    "files": hashlib.sha256(files.encode()).hexdigest()}
        earlier = next((read_json(out / n) for n in ("index.json", "progress.json") if (out / n).is_file()), None)
        if earlier is not None and earlier.get("settings") != settings:
            raise FileExistsError(errno.EEXIST, "holds a latent cache of other settings or data; pass overwrite "
                                  "(--overwrite) to replace it", str(out))
        if (out / "index.json").is_file():
            return out
        write_json(out / "progress.json", {"settings": settings})
        shape = [int(vae.config.latent_channels), image_size // factor, image_size // factor]
        num_shards = -(-len(samples) // shard_size)
        for k in tqdm(range(num_shards), desc="latent shards", unit="shard", disable=not progress):
            if not (out / f"shard_{k:05d}.json").is_file():
                indices = range(k * shard_size, min((k + 1) * shard_size, len(samples)))
                loader = DataLoader(_CropItems(samples, indices, image_size), batch_size=batch_size,
                                    num_workers=num_workers, pin_memory=torch.device(device).type == "cuda")
                _encode_shard(vae, loader, out, k, len(indices), shape, dtype, on_corrupt, samples)
        index = _write_index(out, data_dir, samples, num_shards, shape, classes, class_to_idx, vae, settings)
    logger.info(f"cached {index['num_samples']} latents of shape {shape} to {out}; skipped {index['num_skipped']}")
    return out


def _encode_shard(vae, loader, out: Path, k: int, capacity: int, shape: list[int], dtype: str, on_corrupt: str,
                  samples: list[tuple[str, int]]) -> None:
    """Shard ``k``: its .npy written atomically, then its .json marker (the shard is done)."""
    stats = np.empty((capacity, 2, 2, *shape), dtype=dtype)
    kept, skipped, n = [], [], 0
    for index, images, errors in loader:
        ok = torch.tensor([not e for e in errors])
        if on_corrupt == "error" and not ok.all():
            raise CorruptImageError(next(e for e in errors if e))
        skipped += index[~ok].tolist()
        images, b = images[ok].to(vae.device), int(ok.sum())
        if b:  # one encoder call for both views; flipping the tensor equals flipping the image
            mean, std = encode_distribution(vae, torch.cat([images, images.flip(-1)]))
            both = torch.stack([mean, std], dim=1).reshape(2, b, 2, *shape).transpose(0, 1)  # (b, view, stat, C, h, w)
            stats[n : n + b] = both.float().cpu().numpy()
            kept += index[ok].tolist()
            n += b
    with atomic_write(out / f"shard_{k:05d}.npy") as f:
        np.save(f, stats[:n])
    write_json(out / f"shard_{k:05d}.json", {"count": n, "indices": kept, "skipped": skipped,
                                             "labels": [samples[i][1] for i in kept]})


def _write_index(out: Path, data_dir: Path, samples, num_shards: int, shape, classes, class_to_idx, vae,
                 settings: dict) -> dict:
    shards, labels, files, skipped = [], [], [], []
    for k in range(num_shards):
        meta = read_json(out / f"shard_{k:05d}.json")
        shards.append({"file": f"shard_{k:05d}.npy", "count": meta["count"]})
        labels += meta["labels"]
        files += [os.path.relpath(samples[i][0], data_dir) for i in meta["indices"]]
        skipped += [os.path.relpath(samples[i][0], data_dir) for i in meta["skipped"]]
    if not labels:
        raise CorruptImageError(f"none of the {len(samples)} images in {data_dir} could be read")
    with atomic_write(out / "labels.npy") as f:
        np.save(f, np.asarray(labels, dtype=np.int64))
    write_json(out / "files.json", files)
    index = {"format": LATENT_FORMAT, "num_samples": len(labels), "latent_shape": shape,
             "layout": "(sample, view[plain, hflip], stat[mean, std], C, h, w)", "dtype": settings["dtype"],
             "shards": shards, "labels": "labels.npy", "files": "files.json", "classes": classes,
             "class_to_idx": class_to_idx, "image_size": settings["image_size"], "vae": settings["vae"],
             "vae_subfolder": settings["vae_subfolder"],
             "scaling_factor": float(getattr(vae.config, "scaling_factor", None) or 0.18215),
             "shift_factor": float(getattr(vae.config, "shift_factor", None) or 0.0),
             "data_dir": str(data_dir.resolve()), "num_skipped": len(skipped), "skipped": skipped,
             "settings": settings}
    write_json(out / "index.json", index)
    for name in ["progress.json", *(f"shard_{k:05d}.json" for k in range(num_shards))]:
        (out / name).unlink()
    return index


def read_cache_index(root: str | os.PathLike) -> dict:
    """The ``index.json`` of the latent cache ``root``."""
    path = Path(root) / "index.json"
    if not path.is_file() or read_json(path).get("format") != LATENT_FORMAT:
        raise FileNotFoundError(errno.ENOENT, "not a latent cache (no index.json); make one with moh-dit "
                                "extract-latents", str(root))
    return read_json(path)


class LatentDataset(Dataset):
    """``(latent, label)`` items of a latent cache: ``(z - shift_factor) * scaling_factor``,
    float32 (C, h, w), with ``z = mean + std * eps`` (DiT's ``latent_dist.sample()``; the mean
    alone with ``sample_posterior=False``). The view (plain or flipped) and ``eps`` are drawn
    from ``(seed, epoch, index)`` exactly as :class:`~.datasets.ImageFolderDataset` flips."""

    def __init__(self, root: str | os.PathLike, *, random_flip: bool = True, seed: int = 0,
                 sample_posterior: bool = True):
        self.root, self.meta = Path(root), read_cache_index(root)
        self.classes, self.class_to_idx = self.meta["classes"], self.meta["class_to_idx"]
        self.latent_shape = tuple(self.meta["latent_shape"])
        self.scaling_factor, self.shift_factor = float(self.meta["scaling_factor"]), float(self.meta["shift_factor"])
        self.labels = np.load(self.root / self.meta["labels"])
        self._starts = np.cumsum([0] + [s["count"] for s in self.meta["shards"]])
        self.random_flip, self.seed, self.sample_posterior = random_flip, seed, sample_posterior
        self.epoch = 0
        self._shards = None  # memory maps, opened in each DataLoader worker

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __getstate__(self):
        return {**self.__dict__, "_shards": None}  # a pickled memory map would copy its contents

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def stats(self, index: int, flip: bool) -> tuple[np.ndarray, np.ndarray]:
        """The stored (mean, std) of sample ``index``'s plain or flipped view, unscaled."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is outside the cache's {len(self)} samples")
        if self._shards is None:
            self._shards = [np.load(self.root / s["file"], mmap_mode="r") for s in self.meta["shards"]]
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        view = self._shards[k][index - self._starts[k], int(flip)]
        return view[0], view[1]

    def __getitem__(self, key):
        index, epoch = _key(key, self.epoch)
        mean, std = self.stats(index, self.random_flip and flip_for(self.seed, epoch, index))
        z = mean.astype(np.float32)
        if self.sample_posterior:
            z = z + std.astype(np.float32) * item_rng(self.seed, epoch, index, 1).standard_normal(
                self.latent_shape, dtype=np.float32)
        return torch.from_numpy((z - self.shift_factor) * self.scaling_factor), int(self.labels[index])
