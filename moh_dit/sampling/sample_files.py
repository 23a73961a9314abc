"""The files of a sample folder: ``samples/NNNNNN.png`` per image, ``samples.npz`` (ADM's format),
``sample_config.json``, and the marker that says ``moh-dit sample`` wrote the folder.

Everything here costs memory per file that exists, never per requested sample: a run of any
size is planned from one listing of ``samples/``, and the ``.npz`` is streamed image by image
(and its labels chunk by chunk). A PNG a resumed run relies on is checked before it is
trusted: PNGs are written atomically, so a damaged one can only come from outside the package
(a copy, a disk that lost the last write); it is the package's own output and deterministic by
seed, so it is made again.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import PIL.Image

from ..errors import DamagedFile, OutputExists
from ..utils.io import atomic_write
from ..utils.output_folders import marked_by

__all__ = ["IMAGE_DIR", "NPZ_FILE", "SETTINGS_FILE", "DamagedSampleError", "check_own_folder", "check_sample_folder",
           "existing_indices", "intact_png", "missing_batches", "missing_indices", "png_path", "read_png",
           "save_png_atomic", "write_adm_npz"]

SETTINGS_FILE = "sample_config.json"
IMAGE_DIR = "samples"
NPZ_FILE = "samples.npz"
COMMAND = "sample"

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the IEND chunk every complete PNG ends with
_LABEL_CHUNK = 1 << 16


class DamagedSampleError(DamagedFile):
    """A PNG of a sample folder that cannot be decoded; ``path`` and ``index`` name it."""

    def __init__(self, path: Path, index: int, cause: BaseException | str):
        super().__init__(
            f"sample image {path} is damaged ({cause}); sampling into {path.parent.parent} again with the same "
            "settings makes damaged images again"
        )
        self.path, self.index = path, index


def png_path(output: str | os.PathLike, index: int) -> Path:
    return Path(output) / IMAGE_DIR / f"{index:06d}.png"


def existing_indices(output: str | os.PathLike) -> set[int]:
    """The indices whose PNG exists in ``output/samples`` (one listing of the folder; temporary
    files and other names are left out)."""
    found: set[int] = set()
    try:
        entries = os.scandir(Path(output) / IMAGE_DIR)
    except FileNotFoundError:
        return found
    with entries:
        for entry in entries:
            stem, dot, ext = entry.name.partition(".")
            if dot and ext == "png" and len(stem) >= 6 and stem.isdigit() and entry.is_file():
                found.add(int(stem))
    return found


def missing_indices(output: str | os.PathLike, indices: Iterable[int]) -> list[int]:
    """The indices among ``indices`` that have no finished PNG yet."""
    existing = existing_indices(output)
    return [i for i in indices if i not in existing]


def intact_png(path: str | os.PathLike) -> bool:
    """Whether ``path`` starts like a PNG and ends with its closing IEND chunk: a cheap check (two
    small reads) that catches a file cut short, which is how a sample PNG gets damaged."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_PNG_SIGNATURE))
            f.seek(0, os.SEEK_END)
            if f.tell() < len(_PNG_SIGNATURE) + len(_PNG_END):
                return False
            f.seek(-len(_PNG_END), os.SEEK_END)
            return head == _PNG_SIGNATURE and f.read() == _PNG_END
    except FileNotFoundError:
        return False


def missing_batches(todo: Iterable[int], batch_size: int) -> Iterator[list[int]]:
    """``todo`` (any iterable, e.g. a lazy filter over a range) in lists of ``batch_size``."""
    batch: list[int] = []
    for index in todo:
        batch.append(index)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def save_png_atomic(path: str | os.PathLike, image: np.ndarray) -> None:
    """Write a (H, W, C) uint8 image so that ``path`` either does not exist or is complete; an
    OSError while writing (a full disk) names ``path``."""
    array = image[..., 0] if image.shape[-1] == 1 else image
    with atomic_write(path) as f:
        PIL.Image.fromarray(array).save(f, format="PNG")


def read_png(path: Path, index: int) -> np.ndarray:
    """The decoded image of a sample PNG; :class:`DamagedSampleError` naming it when it cannot be
    decoded (cut short, corrupt). Errors of the machine (an I/O error, ...) pass unchanged."""
    try:
        with PIL.Image.open(path) as image:
            image.load()
            return np.asarray(image)
    except FileNotFoundError:
        raise
    except OSError as error:
        if error.errno is not None:
            raise
        raise DamagedSampleError(path, index, error) from None
    except (SyntaxError, ValueError, EOFError, PIL.Image.DecompressionBombError) as error:
        raise DamagedSampleError(path, index, error) from None


def write_adm_npz(output: str | os.PathLike, num_samples: int, path: str | os.PathLike | None = None,
                  labels: Sequence[int] | None = None,
                  on_damaged: Callable[[int, Path], None] | None = None) -> Path:
    """Stream PNGs ``0 .. num_samples-1`` of ``output`` into an ADM-format ``.npz``.

    The file holds ``arr_0`` (uint8, (N, H, W, 3)) as the ADM evaluator and DiT's
    sample_ddp.py expect and, when ``labels`` are given (one per image; any sequence that can
    be sliced, such as :class:`~moh_dit.sampling.sample.ClassLabels`), ``arr_1`` (int64, (N,)):
    ADM's convention for class-conditional samples, which the class-accuracy metric reads. Both
    ``.npy`` members are written piece by piece into an uncompressed (ZIP64) archive, so memory
    stays at one image whatever N is (50k 256px images are ~9.8 GB). Written to a temporary
    name and renamed; an OSError while writing (a full disk) names the file. A PNG that cannot
    be decoded is passed to ``on_damaged(index, path)``, which may write it again (it is then
    read once more), else :class:`DamagedSampleError` names it. Returns the path.
    """
    output = Path(output)
    path = Path(path) if path is not None else output / NPZ_FILE
    if labels is not None and len(labels) != num_samples:
        raise ValueError(f"{len(labels)} labels for {num_samples} images; give one label per image")
    existing = existing_indices(output)
    missing = next((i for i in range(num_samples) if i not in existing), None)
    if missing is not None:
        count = sum(1 for i in range(num_samples) if i not in existing)
        raise FileNotFoundError(
            f"{count} of {num_samples} PNGs are missing in {output / IMAGE_DIR} (first: {missing:06d}.png); "
            "finish sampling (run the same command again) before writing the .npz."
        )
    shape = _read_sample(output, 0, on_damaged).shape
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
              "shape": (num_samples, *shape)}
    with atomic_write(path) as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        with archive.open("arr_0.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(member, header)
            for i in range(num_samples):
                array = _read_sample(output, i, on_damaged)
                if array.shape != shape or array.dtype != np.uint8:
                    raise ValueError(
                        f"{png_path(output, i)} is {array.shape} {array.dtype}, but image 0 is {shape} uint8; "
                        "the folder mixes runs."
                    )
                member.write(np.ascontiguousarray(array).tobytes())
        if labels is not None:
            with archive.open("arr_1.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, {
                    "descr": np.lib.format.dtype_to_descr(np.dtype(np.int64)), "fortran_order": False,
                    "shape": (num_samples,)})
                for start in range(0, num_samples, _LABEL_CHUNK):
                    chunk = np.asarray(labels[start:start + _LABEL_CHUNK], dtype=np.int64)
                    member.write(chunk.tobytes())
    return path


def _read_sample(output: Path, index: int, on_damaged: Callable[[int, Path], None] | None) -> np.ndarray:
    path = png_path(output, index)
    try:
        return read_png(path, index)
    except DamagedSampleError:
        if on_damaged is None:
            raise
    on_damaged(index, path)
    return read_png(path, index)


def check_own_folder(output: str | os.PathLike, command: str, is_ours: Callable[[Path], bool],
                     parameter: str = "output_dir") -> None:
    """Refuse an existing, non-empty folder that ``moh-dit <command>`` did not write: one without
    its marker that ``is_ours`` does not recognise either (how its folders from before markers
    are known). A command resumes or updates only its own folder, so nothing of the user's is
    overwritten or mixed into its output. Writes nothing; OutputExists names ``parameter``."""
    output = Path(output).expanduser()
    if not output.is_dir():
        return
    if marked_by(output) == f"moh-dit {command}" or is_ours(output):
        return
    names = sorted(entry.name for entry in output.iterdir())
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise OutputExists(
            f"{parameter} {output} already holds files that moh-dit {command} did not write ({shown}); choose a new "
            f"or empty {parameter}", parameters=parameter,
        )


def check_sample_folder(output: str | os.PathLike, parameter: str = "output_dir") -> None:
    """:func:`check_own_folder` for a sample folder: resumed only when marked by ``moh-dit sample``
    or holding ``sample_config.json``."""
    check_own_folder(output, COMMAND, lambda folder: (folder / SETTINGS_FILE).is_file(), parameter)
