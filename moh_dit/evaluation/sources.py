"""Image sources: where the images to evaluate come from, as square RGB uint8 batches.

An ADM-style ``.npz`` (``arr_0``, streamed from the zip without loading it), a folder of
image files (read with the package's one scan and loader, :mod:`moh_dit.data.datasets`), an in-memory
array or tensor, or an iterable of batches (e.g. straight from a sampling pipeline). Each
source checks what it can before any image is decoded, so bad inputs fail before the
expensive feature extraction.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import os
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Union

import numpy as np
import torch

from ..errors import InputNotFound
from ..data.datasets import IMG_EXTENSIONS, CorruptImageError, load_image, read_image_size, scan_image_files

__all__ = [
    "FolderImageSource",
    "ImageSource",
    "IterableImageSource",
    "NpzArrayReader",
    "NpzImageSource",
    "PathLike",
    "open_image_source",
    "zip_member_names",
]

PathLike = Union[str, os.PathLike]


def _read_exactly(f: BinaryIO, out: np.ndarray, what: str) -> None:
    view = memoryview(out.reshape(-1).view(np.uint8))
    filled = 0
    while filled < len(view):
        n = f.readinto(view[filled:])
        if not n:
            raise ValueError(f"{what} ended early: read {filled} of {len(view)} bytes; the file is truncated")
        filled += n


def zip_member_names(path: Path) -> list[str]:
    """The member names of the zip (``.npz``) at ``path``; a file that is not a zip is a ValueError naming it."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.namelist()
    except zipfile.BadZipFile as error:
        raise ValueError(f"{path} is not a valid .npz (zip) file: {error}") from error


class NpzArrayReader:
    """Stream one array of an ``.npz`` in chunks along its first axis, without loading it.

    ``np.load(mmap_mode=...)`` cannot map arrays inside a zip, and DiT's 50k-sample file is
    ~9.8 GB, so the ``.npy`` member is opened through ``zipfile`` (stored or deflated alike),
    its header parsed with ``numpy.lib.format`` and the data read ``batch_size`` rows at a time.
    Opening validates the header; every :meth:`iter_batches` call re-opens the file.
    """

    def __init__(self, path: PathLike, key: str = "arr_0") -> None:
        self.path = Path(path)
        self.key = key
        if not self.path.is_file():
            raise FileNotFoundError(f"npz file not found: {self.path}")
        names = zip_member_names(self.path)
        if f"{key}.npy" not in names:
            keys = sorted(n[:-4] for n in names if n.endswith(".npy"))
            raise ValueError(f"{self.path} has no array '{key}' (arrays: {keys})")
        with self._open() as f:
            self.shape, self.dtype, self._data_offset = self._read_header(f)

    @contextlib.contextmanager
    def _open(self) -> Iterator[BinaryIO]:
        with zipfile.ZipFile(self.path) as archive, archive.open(f"{self.key}.npy") as member:
            yield member

    def _read_header(self, f: BinaryIO) -> tuple[tuple[int, ...], np.dtype, int]:
        fmt = np.lib.format
        try:
            version = fmt.read_magic(f)
            if version == (1, 0):
                shape, fortran_order, dtype = fmt.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran_order, dtype = fmt.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy format version {version}")
        except (zipfile.BadZipFile, EOFError) as error:  # small members are CRC-checked on the first read
            raise ValueError(f"'{self.key}' in {self.path} is corrupt: {error}") from error
        except ValueError as error:
            raise ValueError(f"cannot read '{self.key}' in {self.path}: {error}") from error
        if fortran_order or dtype.hasobject:
            raise ValueError(
                f"'{self.key}' in {self.path} is stored {'in Fortran order' if fortran_order else 'as objects'}, "
                "which cannot be streamed; re-save it with np.savez(path, arr_0=np.ascontiguousarray(x))"
            )
        return tuple(shape), dtype, f.tell()

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def iter_batches(self, batch_size: int) -> Iterator[np.ndarray]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        with self._open() as f:
            f.read(self._data_offset)  # skip magic + header (zip members cannot always seek cheaply)
            for start in range(0, len(self), batch_size):
                batch = np.empty((min(batch_size, len(self) - start), *self.shape[1:]), dtype=self.dtype)
                try:
                    _read_exactly(f, batch, f"'{self.key}' in {self.path}")
                except (zipfile.BadZipFile, EOFError, OSError) as error:  # bad CRC, cut-off deflate stream
                    raise ValueError(f"'{self.key}' in {self.path} is corrupt at image {start}: {error}") from error
                yield batch


def _check_nhwc_shape(shape: tuple[int, ...], where: str) -> None:
    if len(shape) != 4 or shape[-1] != 3:
        looks_nchw = len(shape) == 4 and shape[1] == 3
        hint = " (it looks like NCHW; permute to NHWC with .permute(0, 2, 3, 1))" if looks_nchw else ""
        raise ValueError(f"{where}: images must be RGB in NHWC layout (N, H, W, 3), got shape {tuple(shape)}{hint}")
    if shape[1] != shape[2]:
        raise ValueError(f"{where}: images must be square, got {shape[1]}x{shape[2]}; center-crop them first")


def _to_uint8_nhwc(batch: Any, where: str) -> torch.Tensor:
    """Check an image batch is uint8 (N, H, W, 3) with H == W and return it as a tensor."""
    if isinstance(batch, np.ndarray):
        if batch.dtype != np.uint8:
            raise ValueError(
                f"{where}: images must be uint8 in [0, 255] (N, H, W, 3), got dtype {batch.dtype}; "
                "convert like ADM: np.clip(np.round(x * 255), 0, 255).astype(np.uint8) for x in [0, 1]"
            )
        batch = torch.from_numpy(batch if batch.flags.writeable else batch.copy())
    elif not isinstance(batch, torch.Tensor):
        raise TypeError(f"{where}: expected a numpy array or torch tensor batch, got {type(batch).__name__}")
    if batch.dtype != torch.uint8:
        raise ValueError(
            f"{where}: images must be uint8 in [0, 255] (N, H, W, 3), got dtype {batch.dtype}; "
            "convert with (x * 255).round().clamp(0, 255).to(torch.uint8)"
        )
    _check_nhwc_shape(tuple(batch.shape), where)
    return batch


class ImageSource(abc.ABC):
    """A set of square RGB uint8 images, yielded as (N, H, W, 3) batches in a fixed order.

    Constructors validate everything that can be checked without decoding all images, so bad
    inputs fail before the expensive feature extraction.
    """

    description: str = ""
    num_images: int | None = None  # None when unknown in advance (iterators)
    resolution: int | None = None

    @abc.abstractmethod
    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        """uint8 (N, H, W, 3) tensors, at most ``batch_size`` images each."""

    def fingerprint(self) -> str | None:
        """A string that changes when the images change (for caching); None if not cacheable."""
        return None


class NpzImageSource(ImageSource):
    """``arr_0`` (N, H, W, 3) uint8 of an ADM-style ``.npz``, streamed."""

    def __init__(self, path: PathLike, key: str = "arr_0") -> None:
        self.reader = NpzArrayReader(path, key)
        shape, dtype = self.reader.shape, self.reader.dtype
        where = f"'{key}' in {self.reader.path}"
        if dtype != np.uint8:
            raise ValueError(f"{where}: images must be uint8 (N, H, W, 3), got dtype {dtype}")
        _check_nhwc_shape(shape, where)
        if shape[0] == 0:
            raise ValueError(f"{where} holds no images")
        self.num_images, self.resolution = shape[0], shape[1]
        self.description = str(self.reader.path)

    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        for batch in self.reader.iter_batches(batch_size):
            yield torch.from_numpy(batch)

    def fingerprint(self) -> str:
        stat = self.reader.path.stat()
        return json.dumps(["npz", str(self.reader.path.resolve()), self.reader.key, stat.st_size, stat.st_mtime_ns])


class _Unreadable(str):
    """What a loader worker hands back for an image it cannot read: the one-line message. Raised
    in the main process, because an error raised inside a DataLoader worker reaches the user
    wrapped in the worker's traceback."""


def _sample_folder_advice(path: Path) -> str | None:
    """How to continue when ``path`` is a damaged PNG of a ``moh-dit sample`` folder (its
    ``samples/`` folder lies beside ``sample_config.json``); None for any other image."""
    output = path.parent.parent
    if path.parent.name != "samples" or not (output / "sample_config.json").is_file():
        return None
    return (f"it is a moh-dit sample image: run moh-dit sample again with the same settings into {output} "
            "(it makes damaged images again), then evaluate again")


class _ImageFiles(torch.utils.data.Dataset):
    def __init__(self, files: list[Path], resolution: int) -> None:
        self.files, self.resolution = files, resolution

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> np.ndarray | _Unreadable:
        # The package's one loader: 16-bit and float images keep their values (see load_image).
        path = self.files[index]
        try:
            array = np.array(load_image(path))  # (H, W, 3) uint8
        except CorruptImageError as error:
            cause = error.__cause__ or error
            advice = _sample_folder_advice(path) or "replace or delete the file"
            return _Unreadable(f"cannot read image {path}: {type(cause).__name__}: {cause}; {advice}")
        if array.shape != (self.resolution, self.resolution, 3):
            expected = (self.resolution, self.resolution, 3)
            return _Unreadable(f"{path} decoded to {array.shape}, expected {expected}")
        return array


def _stack_images(arrays: list[np.ndarray | _Unreadable]) -> torch.Tensor | _Unreadable:
    unreadable = next((item for item in arrays if isinstance(item, _Unreadable)), None)
    return unreadable if unreadable is not None else torch.from_numpy(np.stack(arrays))


class FolderImageSource(ImageSource):
    """All images under a folder (recursive, :data:`moh_dit.data.datasets.IMG_EXTENSIONS`), sorted by relative path.

    The folder is scanned by :func:`moh_dit.data.datasets.scan_image_files` (hidden names ignored, links
    to folders followed, no folder entered twice) and images are read by
    :func:`moh_dit.data.datasets.load_image` (grey, CMYK, palette and 16-bit files are converted to 8-bit
    RGB keeping their values; alpha is dropped, as ADM's ``convert("RGB")``). All images must be
    square and of one size; each header is read up front so a bad file fails early.
    """

    def __init__(self, path: PathLike) -> None:
        self.root = Path(path)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder not found: {self.root}")
        files = [Path(p) for p in scan_image_files(self.root)]
        if not files:
            raise ValueError(f"no images ({', '.join(IMG_EXTENSIONS)}) found under {self.root}")
        size = None
        for file in files:
            try:
                file_size = read_image_size(file)  # header only, no decode
            except CorruptImageError as error:
                raise ValueError(f"{error}; replace or delete the file") from error
            if file_size[0] != file_size[1]:
                raise ValueError(
                    f"{file} is {file_size[0]}x{file_size[1]}; images must be square (center-crop them first)"
                )
            if size is None:
                size = file_size
            elif file_size != size:
                raise ValueError(
                    f"{file} is {file_size[0]}x{file_size[1]} but {files[0]} is {size[0]}x{size[1]}; "
                    "all images in a folder must have the same size"
                )
        self.files = files
        self.num_images, self.resolution = len(files), size[0]
        self.description = str(self.root)

    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        loader = torch.utils.data.DataLoader(
            _ImageFiles(self.files, self.resolution),
            batch_size=batch_size,
            shuffle=False,
            num_workers=num_workers,
            collate_fn=_stack_images,
        )
        for batch in loader:
            if isinstance(batch, _Unreadable):
                raise ValueError(str(batch))
            yield batch

    def fingerprint(self) -> str:
        listing = []
        for file in self.files:
            stat = file.stat()
            listing.append([file.relative_to(self.root).as_posix(), stat.st_size, stat.st_mtime_ns])
        digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
        return json.dumps(["folder", str(self.root.resolve()), digest])


class _TensorImageSource(ImageSource):
    """One in-memory uint8 (N, H, W, 3) array or tensor."""

    def __init__(self, images: np.ndarray | torch.Tensor) -> None:
        self.images = _to_uint8_nhwc(images, "images")
        if self.images.shape[0] == 0:
            raise ValueError("images: the array holds no images")
        self.num_images, self.resolution = self.images.shape[0], self.images.shape[1]
        self.description = f"<array of {self.num_images} images>"

    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        yield from self.images.split(batch_size)


class IterableImageSource(ImageSource):
    """Batches from an iterator (e.g. a sampling pipeline); each batch is validated as it comes."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self._batches = batches
        self._iterator: Iterator[Any] | None = None
        self._first: torch.Tensor | None = None
        self.description = "<iterator of image batches>"

    def peek_resolution(self) -> int | None:
        """Take (and keep) the first batch to learn the resolution before any feature is computed."""
        if self.resolution is None and self._iterator is None:
            self._iterator = iter(self._batches)
            first = next(self._iterator, None)
            if first is not None:
                self._first = _to_uint8_nhwc(first, "batch 0")
                self.resolution = self._first.shape[1]
        return self.resolution

    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        iterator = self._iterator if self._iterator is not None else iter(self._batches)
        first, self._first, self._iterator = self._first, None, None
        start = 0
        if first is not None:
            start = 1
            yield from first.split(batch_size)
        for index, batch in enumerate(iterator, start=start):
            batch = _to_uint8_nhwc(batch, f"batch {index}")
            if self.resolution is None:
                self.resolution = batch.shape[1]
            elif batch.shape[1] != self.resolution:
                raise ValueError(
                    f"batch {index} is {batch.shape[1]}x{batch.shape[2]} but the first batch was "
                    f"{self.resolution}x{self.resolution}; all samples must have one resolution"
                )
            yield from batch.split(batch_size)


def open_image_source(images: Any, parameter: str = "images") -> ImageSource:
    """An :class:`ImageSource` for a folder, an ``.npz`` (``arr_0``), an array/tensor or an iterable
    of batches; ``parameter`` is the caller's name for ``images`` (``samples``), for its errors."""
    if isinstance(images, ImageSource):
        return images
    if isinstance(images, (str, os.PathLike)):
        path = Path(images)
        if not path.exists():
            raise InputNotFound(f"{parameter} {path}: no such file or folder", parameters=parameter)
        if path.is_dir():
            return FolderImageSource(path)
        if zipfile.is_zipfile(path):
            return NpzImageSource(path)
        raise ValueError(f"{path} is neither a folder of images nor an .npz file with 'arr_0'")
    if isinstance(images, (np.ndarray, torch.Tensor)):
        return _TensorImageSource(images)
    if isinstance(images, Iterable):
        return IterableImageSource(images)
    raise TypeError(f"cannot read images from {type(images).__name__}")
