"""Image data for MoH-DiT training: ImageFolder dataset with ADM preprocessing, resumable sampler.

Preprocessing is DiT's (itself ADM's): ``center_crop_arr`` (box-halve, bicubic resize of
the short side, centre crop), a horizontal flip with probability 1/2, scaling to [-1, 1].

Randomness is a pure function of ``(seed, epoch, index)`` -- the flip of image ``i`` in
epoch ``e`` is the same in every run, in any DataLoader worker, for any batch size or
number of processes -- so a resumed run sees exactly the data it would have seen.
:class:`ResumableSampler` yields ``(index, epoch)`` pairs, which the datasets here accept
as keys, so the epoch travels with the index into the workers (a dataset attribute set in
the main process would not reach persistent workers).

Saving and restoring the data position (the whole of it is one integer)::

    sampler = ResumableSampler(len(dataset), num_replicas=world, rank=rank, seed=seed)
    loader = DataLoader(dataset, batch_size=b, sampler=sampler, num_workers=8)
    sampler.load_state_dict(ckpt["sampler"])     # on resume, before iter(loader)
    for batch in loader:                         # infinite: stop by step count
        ...train step...
        sampler.advance(b)                       # samples this process consumed
        if save_now: ckpt["sampler"] = sampler.state_dict()

With accelerate, build the DataLoader as above and do not pass it to
``accelerator.prepare`` (which would shard the already sharded stream again).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterator, Sized

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler, default_collate

from ..errors import InvalidInput, MoHDiTError
from ..utils.io import write_json_atomic

__all__ = [
    "IMG_EXTENSIONS",
    "CorruptImageError",
    "ImageFolderDataset",
    "ResumableSampler",
    "center_crop_arr",
    "collate_skip_corrupt",
    "find_image_folder",
    "flip_for",
    "item_rng",
    "load_class_index",
    "load_image",
    "image_to_tensor",
    "read_image_size",
    "scan_image_files",
    "to_rgb",
    "write_class_index",
]

# The one list of image file extensions of the package (training, latent extraction and
# evaluation folders all use it), compared case-insensitively.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
ON_CORRUPT = ("error", "skip")

# Independent random streams drawn from the same (seed, epoch, index) key.
_FLIP_STREAM = 0
_NOISE_STREAM = 1


# --------------------------------------------------------------------------------------
# Per-item randomness
# --------------------------------------------------------------------------------------


def item_rng(seed: int, epoch: int, index: int, stream: int) -> np.random.Generator:
    """A generator owned by one (seed, epoch, index, stream): reproducible anywhere.

    NumPy's SeedSequence hashes the whole key, so neighbouring keys give unrelated streams
    (unlike ``seed + epoch``, where seed 0 epoch 1 would equal seed 1 epoch 0).
    """
    return np.random.default_rng([int(seed), int(epoch), int(index), int(stream)])


def flip_for(seed: int, epoch: int, index: int) -> bool:
    """Whether sample ``index`` is horizontally flipped in ``epoch`` (probability 1/2)."""
    return bool(item_rng(seed, epoch, index, _FLIP_STREAM).random() < 0.5)


def _split_key(key: Any, default_epoch: int) -> tuple[int, int]:
    """Dataset keys are an index, or an ``(index, epoch)`` pair from ResumableSampler."""
    if isinstance(key, (tuple, list)):
        index, epoch = key
        return int(index), int(epoch)
    return int(key), default_epoch


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


def write_class_index(class_to_idx: dict[str, int], path: str | os.PathLike) -> None:
    """Save the class-folder -> label map as JSON (``{"red_circle": 0, ...}``), atomically."""
    write_json_atomic(path, dict(sorted(class_to_idx.items(), key=lambda kv: kv[1])))


def load_class_index(path: str | os.PathLike) -> dict[str, int]:
    with open(path, encoding="utf-8") as f:
        return {str(k): int(v) for k, v in json.load(f).items()}


def scan_image_files(root: str | os.PathLike) -> list[str]:
    """Every image file under ``root`` (recursive), sorted by path relative to ``root``.

    The one folder scan of the package (ImageFolder classes, latent extraction, evaluation
    image folders). An image is a file whose name ends with one of :data:`IMG_EXTENSIONS`
    (any case); names starting with "." (hidden files and folders) are ignored.

    Links to folders are followed -- datasets assembled from symlinks to folders elsewhere
    are common -- but a folder is entered at most once: a link to a folder already visited
    (a loop such as ``a/self -> .``, a link to an ancestor, or a second link to the same
    folder) is skipped, so no image is listed twice through folder links. Folders are
    compared by ``(st_dev, st_ino)`` and walked in sorted order, so when two paths lead to one
    folder the first in that order is the one listed. Links to files are listed as they are
    (a dangling one is listed and fails, naming itself, when it is read). A folder that cannot
    be listed raises ValueError rather than being skipped silently.
    """
    root_str = os.fspath(root)
    if not os.path.isdir(root_str):
        raise ValueError(f"{root_str!r} does not exist or is not a directory")

    def refuse(error: OSError) -> None:
        raise ValueError(f"cannot list folder {error.filename!r}: {error.strerror or error}; fix its permissions")

    visited = _root_and_ancestors(root_str)
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root_str, followlinks=True, onerror=refuse):
        kept = []
        for name in sorted(dirnames):
            if name.startswith("."):
                continue
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:  # a dangling link that os.walk listed as a folder: nothing to scan
                continue
            key = (st.st_dev, st.st_ino)
            if key not in visited:
                visited.add(key)
                kept.append(name)
        dirnames[:] = kept  # os.walk descends only into these, in this order
        rel_dir = os.path.relpath(dirpath, root_str)
        for name in filenames:
            if not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS):
                rel = name if rel_dir == "." else os.path.join(rel_dir, name)
                found.append((Path(rel).as_posix(), os.path.join(dirpath, name)))
    found.sort()
    return [path for _, path in found]


def _root_and_ancestors(root: str) -> set[tuple[int, int]]:
    """``(st_dev, st_ino)`` of ``root`` and of every folder above it, along its path as given
    and along its real path (links resolved): a scan never enters any of them again."""
    keys = set()
    for path in {Path(os.path.abspath(root)), Path(os.path.realpath(root))}:
        for folder in (path, *path.parents):
            try:
                st = os.stat(folder)
            except OSError:  # an ancestor that cannot be read cannot be entered either
                continue
            keys.add((st.st_dev, st.st_ino))
    return keys


def find_image_folder(root: str | os.PathLike) -> tuple[list[str], dict[str, int], list[tuple[str, int]]]:
    """Scan an ImageFolder tree: ``root/<class>/**/<image>``.

    Returns ``(classes, class_to_idx, samples)`` with classes sorted by name (labels 0..K-1
    in that order, as torchvision's ImageFolder) and ``samples`` a sorted list of
    ``(path, label)``. Hidden folders and files (names starting with ".") are ignored. Each
    class folder is scanned with :func:`scan_image_files` (links to folders followed, no
    folder entered twice within a class, never the data folder or a folder above it). Raises
    :class:`~moh_dit.errors.InvalidInput` about ``data_dir`` (what the readers of an ImageFolder
    call ``root``), naming the problem, when the root is missing, has no class folders, or a
    class folder holds no image -- before any image is decoded.
    """
    root = Path(root)
    if not root.is_dir():
        raise InvalidInput(f"data_dir {str(root)!r} does not exist or is not a directory", parameters="data_dir")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise InvalidInput(
            f"data_dir {str(root)!r} has no class subfolders; expected the ImageFolder layout "
            f"root/<class_name>/<image>.png (e.g. moh-dit make-demo-dataset writes one)", parameters="data_dir"
        )
    class_to_idx = {name: i for i, name in enumerate(classes)}
    samples: list[tuple[str, int]] = []
    empty: list[str] = []
    for name in classes:
        found = scan_image_files(root / name)
        if not found:
            empty.append(name)
        samples.extend((path, class_to_idx[name]) for path in found)
    if empty:
        shown = ", ".join(repr(c) for c in empty[:5]) + (" ..." if len(empty) > 5 else "")
        raise InvalidInput(
            f"{len(empty)} of {len(classes)} class folders in data_dir {str(root)!r} contain no images "
            f"(extensions {', '.join(IMG_EXTENSIONS)}): {shown}. Remove them or add images; "
            f"an empty class would get a label the model never sees.", parameters="data_dir"
        )
    return classes, class_to_idx, samples


# --------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------


class CorruptImageError(MoHDiTError, OSError):
    """An image file that cannot be decoded; the message names the file (and ``on_corrupt``, the
    parameter of the readers that can skip such files)."""


_MAX_16BIT = 65535.0
_MAX_INT32 = float(2**31 - 1)


def _png_bit_depth(path: str | os.PathLike) -> int | None:
    """The bit depth in a PNG's IHDR chunk (byte 24 of the file), or None if not a PNG."""
    try:
        with open(path, "rb") as f:
            head = f.read(26)
    except OSError:
        return None
    if len(head) < 26 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return head[24]


def _grey_to_rgb(values: np.ndarray, full_scale: float) -> Image.Image:
    """Grey values in [0, full_scale] -> 8-bit RGB (scaled, rounded; out-of-range clipped, NaN -> 0)."""
    scaled = np.nan_to_num(values.astype(np.float64), nan=0.0, posinf=full_scale, neginf=0.0) * (255.0 / full_scale)
    grey = np.clip(np.rint(scaled), 0, 255).astype(np.uint8)
    return Image.fromarray(grey).convert("RGB")  # 2-D uint8 -> mode L


def to_rgb(img: Image.Image, path: str | os.PathLike | None = None) -> Image.Image:
    """An opened image as an 8-bit RGB PIL image, keeping its values; see :func:`load_image`.

    ``path`` (the file the image came from) lets a mode-``I`` PNG be recognised by its bit depth.
    """
    mode = img.mode
    if mode.startswith("I;16"):
        # I;16, I;16L, I;16B (and I;16N/I;16S): 16-bit grey. convert("RGB") clips every value
        # above 255 to white, so scale by the type's range instead.
        return _grey_to_rgb(np.asarray(img), _MAX_16BIT)
    if mode == "I":
        values = np.asarray(img)
        depth = _png_bit_depth(path) if path is not None and img.format == "PNG" else None
        if depth is not None:
            # A PNG stores at most 16 bits per sample; Pillow opens 16-bit grey PNGs as "I" or
            # "I;16" depending on its version. Its IHDR says which range the values have.
            return _grey_to_rgb(values, float(2**depth - 1))
        if values.size == 0 or (values.min() >= 0 and values.max() <= _MAX_16BIT):
            return _grey_to_rgb(values, _MAX_16BIT)
        return _grey_to_rgb(values, _MAX_INT32)
    if mode == "F":
        values = np.asarray(img)
        finite = values[np.isfinite(values)]
        return _grey_to_rgb(values, 1.0 if finite.size == 0 or finite.max() <= 1.0 else _MAX_16BIT)
    if mode == "PA" or (mode == "P" and "transparency" in img.info):
        # Through RGBA so the palette and its transparency are read as Pillow intends; the
        # alpha is then dropped like that of any other image (see load_image).
        return img.convert("RGBA").convert("RGB")
    # RGB, RGBA, L, LA, 1, P, CMYK, YCbCr, ...: Pillow's conversion. For RGBA/LA it drops the
    # alpha channel and keeps the stored colours, exactly what DiT's and ADM's
    # Image.open(...).convert("RGB") does, so 8-bit images give the same pixels (and FID) as there.
    return img.convert("RGB")


def load_image(path: str | os.PathLike) -> Image.Image:
    """Open and fully decode an image as 8-bit RGB, or raise CorruptImageError naming the file.

    The one image loader of training, latent extraction and evaluation. Values are kept:

    * 8-bit images are converted by Pillow's ``convert("RGB")``, as DiT and ADM do: ``L`` and
      ``1`` (bilevel) become grey, ``P`` (palette) its colours, ``CMYK`` Pillow's conversion.
    * Alpha (``RGBA``, ``LA``, ``PA``, palette transparency) is dropped: the stored colours are
      kept, not composited over a background (as ``convert("RGB")`` in DiT/ADM).
    * 16-bit grey (``I;16``, ``I;16L``, ``I;16B``) is scaled by its type's range,
      ``round(v * 255 / 65535)`` (32768 -> 128, 65535 -> 255) -- not by the image's own
      min/max, so a dark image stays dark. ``convert("RGB")`` would clip it to white.
    * 32-bit integer (``I``): from a PNG (Pillow opens 16-bit grey PNGs as ``I`` or ``I;16``
      depending on its version) by the bit depth in the PNG header; otherwise values within
      [0, 65535] are taken as 16-bit, and any other as the non-negative int32 range
      [0, 2^31 - 1] (negative values clip to 0).
    * 32-bit float (``F``): [0, 1] -> [0, 255] when the largest finite value is <= 1, else
      as 16-bit ([0, 65535]); values outside clip, NaN becomes 0.
    * 16-bit RGB/RGBA PNGs are read by Pillow as 8-bit ``RGB``/``RGBA`` (the high byte of each
      sample), which is kept.

    Multi-frame files give their first frame; EXIF orientation is not applied (as in DiT/ADM).
    """
    try:
        with Image.open(path) as img:
            # the conversion forces the full decode, so truncated files fail here, not later.
            return to_rgb(img, path)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise CorruptImageError(
            f"cannot read image {str(path)!r}: {type(err).__name__}: {err}. Replace or delete the "
            "file, or set on_corrupt to 'skip' to leave such images out.", parameters="on_corrupt"
        ) from err


def read_image_size(path: str | os.PathLike) -> tuple[int, int]:
    """``(width, height)`` of an image from its header, without decoding it; CorruptImageError if unreadable."""
    try:
        with Image.open(path) as img:
            return img.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise CorruptImageError(f"cannot read image {str(path)!r}: {type(err).__name__}: {err}") from err


def center_crop_arr(pil_image: Image.Image, image_size: int) -> Image.Image:
    """ADM's centre crop, as used by DiT for ImageNet.

    Halve with a BOX filter while the short side is at least twice ``image_size`` (cheap,
    alias-free downscaling), then BICUBIC-resize so the short side is ``image_size``, then
    crop the centre square. Keeping this exact matters: FID is sensitive to resizing.
    """
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
    arr = np.asarray(pil_image)
    top = (arr.shape[0] - image_size) // 2
    left = (arr.shape[1] - image_size) // 2
    return Image.fromarray(arr[top : top + image_size, left : left + image_size])


def image_to_tensor(img: Image.Image) -> torch.Tensor:
    """uint8 RGB image -> float32 (3, H, W) in [-1, 1].

    Same operations as torchvision's ToTensor + Normalize(0.5, 0.5) (divide by 255, then
    (x - 0.5) / 0.5), so the values are bit-identical to DiT's pipeline.
    """
    arr = torch.from_numpy(np.array(img, dtype=np.uint8, copy=True)).permute(2, 0, 1)
    return (arr.float().div(255.0) - 0.5) / 0.5


# --------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------


class ImageFolderDataset(Dataset):
    """Class-conditional images from an ImageFolder tree, with DiT's preprocessing.

    Args:
        root: folder with one subfolder per class (labels follow sorted folder names).
        image_size: output resolution (square), e.g. 256.
        random_flip: flip horizontally with probability 1/2, decided by
            ``flip_for(seed, epoch, index)``.
        seed: seed of the flips.
        on_corrupt: ``"error"`` (default) raises CorruptImageError naming the file;
            ``"skip"`` warns and returns None for that item -- use
            :func:`collate_skip_corrupt` to drop such items from batches.

    Items are ``(image, label)``: float32 (3, image_size, image_size) in [-1, 1] and an int.
    Keys are an index (epoch from :meth:`set_epoch`) or an ``(index, epoch)`` pair.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        image_size: int,
        *,
        random_flip: bool = True,
        seed: int = 0,
        on_corrupt: str = "error",
    ):
        if on_corrupt not in ON_CORRUPT:
            raise InvalidInput(f"on_corrupt must be one of {ON_CORRUPT}, got {on_corrupt!r}", parameters="on_corrupt")
        if image_size < 1:
            raise ValueError(f"image_size must be positive, got {image_size}")
        self.root = str(root)
        self.image_size = int(image_size)
        self.random_flip = random_flip
        self.seed = int(seed)
        self.on_corrupt = on_corrupt
        self.classes, self.class_to_idx, self.samples = find_image_folder(root)
        self.targets = [label for _, label in self.samples]
        self.epoch = 0
        self.num_skipped = 0  # per process; with DataLoader workers count None items instead

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def set_epoch(self, epoch: int) -> None:
        """Epoch used for plain integer keys (pairs from ResumableSampler carry their own)."""
        self.epoch = int(epoch)

    def write_class_index(self, path: str | os.PathLike) -> None:
        write_class_index(self.class_to_idx, path)

    def load(self, index: int, flip: bool = False) -> torch.Tensor:
        """The preprocessed image ``index`` with an explicit flip; raises CorruptImageError."""
        img = center_crop_arr(load_image(self.samples[index][0]), self.image_size)
        if flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return image_to_tensor(img)

    def flip(self, index: int, epoch: int) -> bool:
        return self.random_flip and flip_for(self.seed, epoch, index)

    def __getitem__(self, key):
        index, epoch = _split_key(key, self.epoch)
        try:
            image = self.load(index, self.flip(index, epoch))
        except CorruptImageError as err:
            if self.on_corrupt == "error":
                raise
            self.num_skipped += 1
            warnings.warn(f"skipping: {err}", stacklevel=2)
            return None
        return image, self.samples[index][1]


def collate_skip_corrupt(batch: list) -> Any:
    """default_collate after dropping the None items a dataset returns for skipped images.

    The batch can then be shorter than batch_size; the caller counts the difference.
    """
    kept = [item for item in batch if item is not None]
    if not kept:
        raise CorruptImageError(f"every image of a batch of {len(batch)} was unreadable; check the dataset")
    return default_collate(kept)


# --------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------


class ResumableSampler(Sampler):
    """Infinite, seeded, distributed-aware sample order that resumes exactly.

    The global order is one endless stream: the permutation of epoch 0, then that of
    epoch 1, ... (each drawn from ``(seed, epoch)``; identity when ``shuffle=False``).
    Process ``rank`` of ``num_replicas`` takes stream positions ``p, p + R, p + 2R, ...``
    from the current position ``p + rank``. Batches may straddle an epoch boundary; there
    is no padding and nothing is dropped. The data position is the number of stream
    elements consumed by all processes together, so a run resumed with another number of
    processes still continues the same global order.

    Yields ``(index, epoch)`` pairs (both datasets of this package take them as keys).
    Call :meth:`advance` with the number of samples this process consumed after each
    step, save :meth:`state_dict` with the checkpoint, and :meth:`load_state_dict` before
    creating the DataLoader iterator on resume (an iterator starts at the position current
    when it is created; DataLoader prefetching does not move the position).
    """

    def __init__(
        self,
        num_samples: int | Sized,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ):
        n = num_samples if isinstance(num_samples, int) else len(num_samples)
        if n < 1:
            raise ValueError(f"cannot sample from an empty dataset (num_samples={n})")
        if num_replicas is None or rank is None:
            dist = torch.distributed.is_available() and torch.distributed.is_initialized()
            if num_replicas is None:
                num_replicas = torch.distributed.get_world_size() if dist else 1
            if rank is None:
                rank = torch.distributed.get_rank() if dist else 0
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need num_replicas >= 1 and 0 <= rank < num_replicas, got {num_replicas}, {rank}")
        self.num_samples = n
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.position = 0
        self._perm_cache: tuple[int, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        return self.position // self.num_samples

    @property
    def offset(self) -> int:
        """Position inside the current epoch's permutation (global, all processes)."""
        return self.position % self.num_samples

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of epoch ``epoch``: a permutation of range(num_samples)."""
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1]
        if self.shuffle:
            perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples)
        else:
            perm = np.arange(self.num_samples)
        self._perm_cache = (epoch, perm)
        return perm

    def __iter__(self) -> Iterator[tuple[int, int]]:
        position = self.position + self.rank
        while True:
            epoch, offset = divmod(position, self.num_samples)
            yield int(self.permutation(epoch)[offset]), epoch
            position += self.num_replicas

    def advance(self, num_samples_this_process: int) -> None:
        """Record that every process consumed ``num_samples_this_process`` more samples."""
        self.position += int(num_samples_this_process) * self.num_replicas

    def set_position(self, epoch: int, offset: int = 0) -> None:
        """Start at ``offset`` (global count) inside ``epoch``."""
        if not 0 <= offset < self.num_samples:
            raise ValueError(f"offset must be in [0, {self.num_samples}), got {offset}")
        self.position = int(epoch) * self.num_samples + int(offset)

    def set_epoch(self, epoch: int) -> None:
        """Start at the beginning of ``epoch`` (DistributedSampler-style)."""
        self.set_position(epoch, 0)

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "position": self.position,
            "epoch": self.epoch,
            "offset": self.offset,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; refuses a state from another dataset size, seed or shuffle."""
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {key}={getattr(self, key)!r}; "
                    f"resume with the same dataset and seed, or start a fresh data order"
                )
        self.position = int(state["position"])
