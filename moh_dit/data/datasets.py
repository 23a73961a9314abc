"""Image folders for training, as DiT reads ImageNet: labels from sorted class folders, ADM's
centre crop, a horizontal flip with probability 1/2, values in [-1, 1].

Randomness is a function of ``(seed, epoch, index)`` alone: the flip of image ``i`` in epoch
``e`` is the same in every run, DataLoader worker, batch size and process count. The
:class:`ResumableSampler` yields ``(index, epoch)`` keys, so the epoch travels with the index
into the workers, and its whole state is one integer (the position in an endless stream of
seeded permutations), so a resumed run sees exactly the data it would have seen.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler, default_collate

from ..outputs import write_json

# The package's one list of image extensions (training, latent caches, evaluation), any case.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class CorruptImageError(OSError):
    """An image file that cannot be decoded (its name is in the message)."""


def item_rng(seed: int, epoch: int, index: int, stream: int) -> np.random.Generator:
    """A generator of one (seed, epoch, index, stream): SeedSequence hashes the whole key, so
    neighbouring keys give unrelated streams. Stream 0 draws flips, stream 1 latent noise."""
    return np.random.default_rng([int(seed), int(epoch), int(index), int(stream)])


def flip_for(seed: int, epoch: int, index: int) -> bool:
    return bool(item_rng(seed, epoch, index, 0).random() < 0.5)


def _key(key, default_epoch: int) -> tuple[int, int]:
    """A dataset key: an index, or an ``(index, epoch)`` pair from ResumableSampler."""
    return (int(key[0]), int(key[1])) if isinstance(key, (tuple, list)) else (int(key), default_epoch)


# ----- files ----------------------------------------------------------------------------------

def scan_image_files(root: str | os.PathLike) -> list[str]:
    """Every image below ``root``, sorted by relative path; hidden names are skipped. Links to
    folders are followed, but no folder is entered twice and never ``root`` or a folder above
    it (a link ``up -> ..`` would list the other classes' images under this class)."""
    root = os.fspath(root)
    seen = set()
    for path in {Path(os.path.abspath(root)), Path(os.path.realpath(root))}:
        for folder in (path, *path.parents):
            st = os.stat(folder)
            seen.add((st.st_dev, st.st_ino))
    found = []
    for folder, dirs, files in os.walk(root, followlinks=True):
        kept = []
        for name in sorted(dirs):
            try:
                st = os.stat(os.path.join(folder, name))
            except OSError:  # a dangling link
                continue
            if not name.startswith(".") and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                kept.append(name)
        dirs[:] = kept
        found += [os.path.join(folder, name) for name in files
                  if not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS)]
    return sorted(found, key=lambda p: Path(os.path.relpath(p, root)).as_posix())


def find_image_folder(root: str | os.PathLike) -> tuple[list[str], dict[str, int], list[tuple[str, int]]]:
    """``(classes, class_to_idx, samples)`` of ``root/<class>/**/<image>``, classes sorted by
    name as torchvision's ImageFolder; an empty class would get a label the model never sees."""
    if not Path(root).is_dir():
        raise FileNotFoundError(2, "the image folder does not exist", str(root))
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"{root} has no class folders; expected the layout {root}/<class>/<image>.png")
    class_to_idx = {name: i for i, name in enumerate(classes)}
    samples = []
    for name in classes:
        files = scan_image_files(Path(root) / name)
        if not files:
            raise ValueError(f"the class folder {Path(root) / name} holds no image ({', '.join(IMG_EXTENSIONS)}); "
                             "add images or remove it")
        samples += [(f, class_to_idx[name]) for f in files]
    return classes, class_to_idx, samples


def write_class_index(class_to_idx: dict[str, int], path: str | os.PathLike) -> None:
    write_json(path, dict(sorted(class_to_idx.items(), key=lambda kv: kv[1])))


# ----- images ---------------------------------------------------------------------------------

def _grey(values: np.ndarray, full_scale: float) -> Image.Image:
    values = np.nan_to_num(values.astype(np.float64), nan=0.0, posinf=full_scale, neginf=0.0)
    return Image.fromarray(np.clip(np.rint(values * 255.0 / full_scale), 0, 255).astype(np.uint8)).convert("RGB")


def to_rgb(img: Image.Image, path: str | os.PathLike | None = None) -> Image.Image:
    """8-bit RGB keeping the values: ``convert("RGB")`` as DiT and ADM (alpha dropped, the stored
    colours kept), except for 16-bit, 32-bit and float grey, which it would clip to white:
    those are scaled by their type's range (a PNG's by the bit depth in its header)."""
    if img.mode.startswith("I;16"):
        return _grey(np.asarray(img), 65535.0)
    if img.mode == "I":
        values = np.asarray(img)
        if path is not None and img.format == "PNG":
            with open(path, "rb") as f:
                return _grey(values, 2.0 ** f.read(25)[24] - 1)  # IHDR's bit depth
        in_16_bits = values.size == 0 or (values.min() >= 0 and values.max() <= 65535)
        return _grey(values, 65535.0 if in_16_bits else 2.0**31 - 1)
    if img.mode == "F":
        values = np.asarray(img)
        finite = values[np.isfinite(values)]
        return _grey(values, 1.0 if finite.size == 0 or finite.max() <= 1.0 else 65535.0)
    if img.mode == "PA" or (img.mode == "P" and "transparency" in img.info):
        return img.convert("RGBA").convert("RGB")
    return img.convert("RGB")


def load_image(path: str | os.PathLike) -> Image.Image:
    """Open and fully decode an image as 8-bit RGB (:func:`to_rgb`), or raise CorruptImageError.
    Multi-frame files give their first frame; EXIF orientation is not applied (as DiT, ADM)."""
    try:
        with Image.open(path) as img:
            return to_rgb(img, path)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise CorruptImageError(f"cannot read the image {path}: {error}; replace or delete it") from error


def read_image_size(path: str | os.PathLike) -> tuple[int, int]:
    """(width, height) from the header, without decoding."""
    try:
        with Image.open(path) as img:
            return img.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise CorruptImageError(f"cannot read the image {path}: {error}") from error


def center_crop_arr(pil_image: Image.Image, image_size: int) -> Image.Image:
    """ADM's centre crop (as DiT): BOX-halve while the short side is at least twice the size,
    BICUBIC-resize the short side to ``image_size``, crop the centre. FID is sensitive to it."""
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
    arr = np.asarray(pil_image)
    top, left = (arr.shape[0] - image_size) // 2, (arr.shape[1] - image_size) // 2
    return Image.fromarray(arr[top : top + image_size, left : left + image_size])


def image_to_tensor(img: Image.Image) -> torch.Tensor:
    """uint8 RGB -> float32 (3, H, W) in [-1, 1], bit-identical to ToTensor + Normalize(0.5, 0.5)."""
    arr = torch.from_numpy(np.array(img, dtype=np.uint8, copy=True)).permute(2, 0, 1)
    return (arr.float().div(255.0) - 0.5) / 0.5


# ----- dataset and sampler --------------------------------------------------------------------

class ImageFolderDataset(Dataset):
    """``(image, label)`` items of an image folder: float32 (3, size, size) in [-1, 1] and an int.
    ``on_corrupt="skip"`` returns None for an unreadable image (with a warning), which
    :func:`collate_skip_corrupt` drops from the batch; ``"error"`` raises CorruptImageError."""

    def __init__(self, root: str | os.PathLike, image_size: int, *, random_flip: bool = True, seed: int = 0,
                 on_corrupt: str = "error"):
        self.root, self.image_size, self.random_flip, self.seed = str(root), image_size, random_flip, seed
        self.on_corrupt = on_corrupt
        self.classes, self.class_to_idx, self.samples = find_image_folder(root)
        self.targets = [label for _, label in self.samples]
        self.epoch = 0  # for plain integer keys

    def __len__(self) -> int:
        return len(self.samples)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def write_class_index(self, path: str | os.PathLike) -> None:
        write_class_index(self.class_to_idx, path)

    def load(self, index: int, flip: bool = False) -> torch.Tensor:
        img = center_crop_arr(load_image(self.samples[index][0]), self.image_size)
        return image_to_tensor(img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else img)

    def __getitem__(self, key):
        index, epoch = _key(key, self.epoch)
        try:
            image = self.load(index, self.random_flip and flip_for(self.seed, epoch, index))
        except CorruptImageError as error:
            if self.on_corrupt == "error":
                raise
            warnings.warn(f"skipped: {error}", stacklevel=2)
            return None
        return image, self.samples[index][1]


def collate_skip_corrupt(batch: list):
    """default_collate of the items that are not None (a shorter batch; the trainer counts it)."""
    kept = [item for item in batch if item is not None]
    if not kept:
        raise CorruptImageError(f"every image of a batch of {len(batch)} was unreadable; check the data")
    return default_collate(kept)


class ResumableSampler(Sampler):
    """An endless, seeded sample order that resumes exactly, for any number of processes.

    The global stream is the permutation of epoch 0 (drawn from ``(seed, epoch)``), then that
    of epoch 1, and so on; process ``rank`` of ``num_replicas`` takes every ``num_replicas``-th
    element from ``position + rank``. :meth:`advance` after each step by the items this process
    consumed; :meth:`load_state_dict` before the DataLoader's iterator is created (prefetching
    does not move the position). Yields ``(index, epoch)`` keys."""

    def __init__(self, num_samples, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0):
        self.num_samples = num_samples if isinstance(num_samples, int) else len(num_samples)
        self.num_replicas, self.rank, self.shuffle, self.seed = num_replicas, rank, shuffle, seed
        self.position = 0
        self._cache: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != epoch:
            order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_samples) if self.shuffle
                     else np.arange(self.num_samples))
            self._cache = (epoch, order)
        return self._cache[1]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        position = self.position + self.rank
        while True:
            epoch, offset = divmod(position, self.num_samples)
            yield int(self.permutation(epoch)[offset]), epoch
            position += self.num_replicas

    def advance(self, num_samples_this_process: int) -> None:
        self.position += num_samples_this_process * self.num_replicas

    def set_position(self, epoch: int, offset: int = 0) -> None:
        self.position = epoch * self.num_samples + offset

    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.position // self.num_samples,
                "offset": self.position % self.num_samples, "num_samples": self.num_samples, "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the data order was saved with {key} {state[key]}, this run has "
                                 f"{getattr(self, key)}: resume with the run's data and seed")
        self.position = int(state["position"])
