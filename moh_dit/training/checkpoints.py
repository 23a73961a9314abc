"""Checkpoints: ``OUT/checkpoints/step-N`` folders of safetensors and JSON, nothing pickled.

A checkpoint holds the model, EMA, optimiser, LR schedule, loss scaler, step and data
position, and every process's random states, so that a resumed run continues bit for bit.
It is written into a temporary folder renamed into place when complete; its marker
``checkpoint.json`` records every file's size and SHA-256, which :func:`verify_checkpoint`
checks before anything is loaded. Rotation removes only this run's verified-older ones.

Every process takes part in a save; the run folder's decisions are the main process's.
:func:`on_main` and :func:`everywhere` make either kind of work end the same way on all
processes -- all go on, or all raise together -- so that none is left at a barrier.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..data.datasets import ResumableSampler
from ..utils.io import naming_write_errors, set_ordinary_permissions, sha256_file, write_json_atomic
from .config import CheckpointIntegrityError, RunFolderBusyError, TrainConfig, TrainingDivergedError, warn

CHECKPOINT_PREFIX = "step-"
COMPLETE_MARKER = "checkpoint.json"
CHECKPOINT_FORMAT = 2  # 1: accelerate's save_state with pickled custom state (not loaded any more)
# The files of a checkpoint: tensors in safetensors, everything else in JSON.
MODEL_FILE = "model.safetensors"
EMA_FILE = "ema.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
SCHEDULER_FILE = "scheduler.json"
SCALER_FILE = "scaler.json"
STATE_FILE = "train_state.json"
RNG_FILE = "random_states_{}.safetensors"  # one per process
REQUIRED_FILES = (MODEL_FILE, EMA_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE, RNG_FILE.format(0))


# --------------------------------------------------------------------------------------
# Work shared by the processes
# --------------------------------------------------------------------------------------

_ERRORS = {cls.__name__: cls for cls in (RunFolderBusyError, CheckpointIntegrityError, FileExistsError,
                                          FileNotFoundError, ValueError, TrainingDivergedError, OSError)}


def _known_class(error: BaseException) -> str | None:
    """The name of the nearest class of ``error`` (itself or a base) that every process knows."""
    return next((cls.__name__ for cls in type(error).__mro__ if cls.__name__ in _ERRORS), None)


def _rebuild(report: tuple) -> Exception:
    """The error another process reported: its kind, message, and an OSError's errno and path."""
    name, message, code, strerror, filename = report
    cls = _ERRORS.get(name) if name is not None else None
    if cls is None:
        return RuntimeError(f"the main process failed: {message}")
    if issubclass(cls, OSError) and code is not None:
        return cls(code, strerror, filename)
    return cls(message)


def on_main(accelerator, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the main process only and give its result -- or its error -- to every
    process, so that all of them go on or all raise together (none waits forever)."""
    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = fn()
        except Exception as exc:  # handed to the other processes, then raised here too
            error = exc
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        report = None if error is None else (
            _known_class(error), f"{type(error).__name__}: {error}" if _known_class(error) is None else str(error),
            getattr(error, "errno", None), getattr(error, "strerror", None), getattr(error, "filename", None))
        payload = [result, report]
        broadcast_object_list(payload, from_process=0)
        if not accelerator.is_main_process:
            result = payload[0]
            if payload[1] is not None:
                raise _rebuild(payload[1])
    if error is not None:
        raise error
    return result


def everywhere(accelerator, fn: Callable[[], Any]) -> None:
    """Run ``fn`` on every process; if it fails on any of them, raise on all."""
    error = None
    try:
        fn()
    except Exception as exc:  # reported to the others, then raised here
        error = exc
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        reports = gather_object([None if error is None else
                                 f"process {accelerator.process_index}: {type(error).__name__}: {error}"])
        failed = [r for r in reports if r]
        if failed and error is None:
            raise OSError(f"another process failed: {'; '.join(failed)}")
    if error is not None:
        raise error


# --------------------------------------------------------------------------------------
# Checkpoint folders
# --------------------------------------------------------------------------------------


def checkpoint_folders(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step-N`` folder, oldest first, finished or not."""
    found = []
    if checkpoint_dir.is_dir():
        for path in checkpoint_dir.iterdir():
            match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
    return sorted(found)


def complete_checkpoints(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every finished checkpoint, oldest first. Temporary folders of an
    interrupted save start with '.' and have no marker, so they are never picked."""
    return [(step, path) for step, path in checkpoint_folders(checkpoint_dir) if (path / COMPLETE_MARKER).is_file()]


def find_latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``output_dir/checkpoints``, or None (its files
    are not checked here: :func:`verify_checkpoint` does that)."""
    found = complete_checkpoints(Path(output_dir) / "checkpoints")
    return found[-1][1] if found else None


def _read_marker(folder: Path) -> dict | None:
    try:
        marker = json.loads((folder / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def checkpoint_run_id(folder: Path) -> str | None:
    """The run id a checkpoint's marker names, or None (no readable marker, no run record);
    the files are not checked here."""
    return ((_read_marker(folder) or {}).get("run") or {}).get("run_id")


def verify_checkpoint(folder: str | os.PathLike) -> dict:
    """Check a checkpoint against its marker -- every recorded file present, with the recorded
    size and SHA-256 -- and return the marker; raise CheckpointIntegrityError naming the
    first bad file. Files the marker does not list are never read."""
    folder = Path(folder)
    marker_path = folder / COMPLETE_MARKER
    if not marker_path.is_file():
        raise CheckpointIntegrityError(f"{marker_path} is missing: {folder} is not a finished checkpoint (its "
                                       "completion marker was deleted or lost, or the folder is an interrupted "
                                       "save or not a checkpoint).")
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointIntegrityError(f"{marker_path} is unreadable ({type(error).__name__}: {error}); "
                                       "the checkpoint is damaged.") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("step"), int):
        raise CheckpointIntegrityError(f"{marker_path} is not a checkpoint marker; the checkpoint is damaged.")
    if marker.get("format") != CHECKPOINT_FORMAT or not isinstance(marker.get("files"), dict):
        raise CheckpointIntegrityError(
            f"{marker_path}: {folder} was written by an older moh-dit (pickled state, no checksums), which is not "
            "loaded because unpickling can run code; start a new run with another --output-dir.")
    if not isinstance(marker.get("run"), dict) or not isinstance(marker["run"].get("run_id"), str):
        raise CheckpointIntegrityError(f"{marker_path} has no run record; the checkpoint is damaged.")
    files = marker["files"]
    for name in REQUIRED_FILES:
        if name not in files:
            raise CheckpointIntegrityError(f"{marker_path} does not list {name}; the checkpoint is damaged.")
    for name, meta in sorted(files.items()):
        path = folder / name
        if (not isinstance(name, str) or "/" in name or "\\" in name or name.startswith(".")
                or not isinstance(meta, dict) or not isinstance(meta.get("size"), int)
                or not isinstance(meta.get("sha256"), str)):
            raise CheckpointIntegrityError(f"{marker_path} has a malformed entry {name!r}; the checkpoint is damaged.")
        if not path.is_file():
            raise CheckpointIntegrityError(f"{path} is missing; the checkpoint is damaged.")
        size = path.stat().st_size
        if size != meta["size"]:
            raise CheckpointIntegrityError(f"{path} has {size} bytes but the checkpoint recorded {meta['size']} "
                                           "(truncated or altered); the checkpoint is damaged.")
        if sha256_file(path) != meta["sha256"]:
            raise CheckpointIntegrityError(f"{path} does not match its recorded SHA-256 (altered or corrupted); "
                                           "the checkpoint is damaged.")
    return marker


# --------------------------------------------------------------------------------------
# State files: tensors in safetensors, the rest as JSON (nothing is ever unpickled)
# --------------------------------------------------------------------------------------


def _encode(obj: Any, tensors: dict[str, torch.Tensor] | None) -> Any:
    """A JSON tree of ``obj`` that keeps dict key types and tuples; tensors go to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        if tensors is None:
            raise TypeError("a tensor in a JSON-only state")
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__dict__"]}
    return obj


def _save_tree(tree: Any, path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    encoded = json.dumps(_encode(tree, tensors))
    save_file(tensors, str(path), metadata={"moh_dit_tree": encoded})


def _load_tree(path: Path) -> Any:
    with safe_open(str(path), framework="pt") as f:
        encoded = (f.metadata() or {})["moh_dit_tree"]
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _decode(json.loads(encoded), tensors)


def _save_json_tree(tree: Any, path: Path) -> None:
    write_json_atomic(path, _encode(tree, None))


def _load_json_tree(path: Path) -> Any:
    return _decode(json.loads(path.read_text(encoding="utf-8")), {})


def _rng_state() -> dict[str, Any]:
    """This process's random states (Python, NumPy, torch CPU and CUDA) as ints and tensors."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
             "numpy": {"name": name, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], np.array(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


class TrainState:
    """Step counter and data position, saved as train_state.json with each checkpoint."""

    def __init__(self, sampler: ResumableSampler):
        self.step = 0
        self.images_seen = 0
        self.images_skipped = 0
        self.sampler = sampler

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "images_seen": self.images_seen, "images_skipped": self.images_skipped,
                "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.images_seen = int(state["images_seen"])
        self.images_skipped = int(state.get("images_skipped", 0))
        self.sampler.load_state_dict(state["sampler"])


@dataclass
class Parts:
    """What a checkpoint saves and restores."""

    accelerator: Any
    model: torch.nn.Module  # unwrapped
    ema: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    state: TrainState


def _state_dict_for_file(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}


def _write_checkpoint_files(parts: Parts, folder: Path) -> None:
    """Every process writes its RNG states; the main process writes the rest."""
    acc = parts.accelerator
    writers: list[tuple[str, Callable[[Path], None]]] = [(RNG_FILE.format(acc.process_index),
                                                          lambda p: _save_tree(_rng_state(), p))]
    if acc.is_main_process:
        writers += [(MODEL_FILE, lambda p: save_file(_state_dict_for_file(parts.model), str(p))),
                    (EMA_FILE, lambda p: save_file(_state_dict_for_file(parts.ema), str(p))),
                    (OPTIMIZER_FILE, lambda p: _save_tree(parts.optimizer.state_dict(), p)),
                    (SCHEDULER_FILE, lambda p: _save_json_tree(parts.lr_scheduler.state_dict(), p)),
                    (STATE_FILE, lambda p: write_json_atomic(p, parts.state.state_dict()))]
        if acc.scaler is not None:
            writers.append((SCALER_FILE, lambda p: _save_json_tree(acc.scaler.state_dict(), p)))
    for name, write in writers:
        with naming_write_errors(folder / name):
            write(folder / name)


def load_checkpoint(parts: Parts, folder: Path) -> None:
    """Restore everything from a verified checkpoint; a file that cannot be loaded is named."""
    acc = parts.accelerator

    def load(name: str, fn: Callable[[Path], Any]) -> Any:
        path = folder / name
        try:
            return fn(path)
        except Exception as error:  # safetensors' and JSON's parse errors, wrong keys or shapes
            raise CheckpointIntegrityError(f"cannot load {path}: {type(error).__name__}: {error}") from None

    load(MODEL_FILE, lambda p: parts.model.load_state_dict(load_file(str(p))))
    load(EMA_FILE, lambda p: parts.ema.load_state_dict(load_file(str(p))))
    load(OPTIMIZER_FILE, lambda p: parts.optimizer.load_state_dict(_load_tree(p)))
    load(SCHEDULER_FILE, lambda p: parts.lr_scheduler.load_state_dict(_load_json_tree(p)))
    if acc.scaler is not None:
        if (folder / SCALER_FILE).is_file():
            load(SCALER_FILE, lambda p: acc.scaler.load_state_dict(_load_json_tree(p)))
        else:
            warn(f"{folder} has no {SCALER_FILE} (saved without fp16); the loss scale starts afresh.")
    train_state = load(STATE_FILE, lambda p: json.loads(p.read_text(encoding="utf-8")))
    try:
        parts.state.load_state_dict(train_state)  # the sampler names a changed dataset or seed itself
    except (KeyError, TypeError, AttributeError) as error:
        raise CheckpointIntegrityError(f"cannot load {folder / STATE_FILE}: {type(error).__name__}: {error}") from None
    rng = folder / RNG_FILE.format(acc.process_index)
    if rng.is_file():
        load(rng.name, lambda p: _set_rng_state(_load_tree(p)))
    else:
        warn(f"{folder} has no random states for process {acc.process_index} (saved with fewer processes); this "
             "process keeps its seeded ones, so the run is not bit-identical to an uninterrupted one.")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _set_aside(folder: Path, why: str) -> Path:
    """Rename a folder out of the way (never delete what may be someone's data)."""
    for i in range(1000):
        target = folder.with_name(f"{folder.name}.{why}" + (f"-{i}" if i else ""))
        if not target.exists():
            os.replace(folder, target)
            return target
    raise FileExistsError(f"cannot set {folder} aside: too many {folder.name}.{why}-N folders; remove some.")


def save_checkpoint(parts: Parts, cfg: TrainConfig, step: int, run: dict[str, Any]) -> Path:
    """All files into '.step-N.tmp', the marker (sizes and SHA-256) last, an atomic rename,
    a re-check of what landed on disk, and only then rotation of this run's older ones.
    A failure on any process (a full disk) is raised on all of them, none left at a barrier."""
    accelerator = parts.accelerator
    ckpt_dir = Path(cfg.output_dir) / "checkpoints"
    final = ckpt_dir / f"{CHECKPOINT_PREFIX}{step:07d}"
    # This run's own scratch folder (one run per folder), under a name every process knows
    # without being told: all of them write into it, so publish_folder's random one would not do.
    tmp = ckpt_dir / f".{final.name}.tmp"

    def prepare() -> None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    def finish() -> None:
        files = {}
        for p in sorted(tmp.iterdir()):
            if p.is_file():
                with naming_write_errors(p):  # the flush to disk is where a full disk may show
                    files[p.name] = {"size": p.stat().st_size, "sha256": sha256_file(p, fsync=True)}
        write_json_atomic(tmp / COMPLETE_MARKER, {
            "format": CHECKPOINT_FORMAT, "step": step, "preset": cfg.preset,
            "num_processes": accelerator.num_processes, "run": run, "files": files})
        if final.exists():
            # Only a damaged checkpoint (resume fell back past it) or another run's can be
            # here: keep it under another name.
            theirs = checkpoint_run_id(final)
            moved = _set_aside(final, "damaged" if theirs in (None, run["run_id"]) else "other-run")
            warn(f"{final} was in the way of the new checkpoint; moved it to {moved}.")
        set_ordinary_permissions(tmp)  # readable as the umask allows, like any folder the user makes
        os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        verify_checkpoint(final)
        _prune_checkpoints(ckpt_dir, run["run_id"], step, cfg.checkpoints_total_limit)

    on_main(accelerator, prepare)
    try:
        everywhere(accelerator, lambda: _write_checkpoint_files(parts, tmp))
        on_main(accelerator, finish)
    except OSError as error:
        # Every process is past its writes here: the half-written folder goes (on a full disk
        # it holds the space a rerun needs); finished checkpoints were never touched.
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if error.errno is None:
            raise
        raise OSError(error.errno, f"{error.strerror or error}; checkpoint {final} was not saved and the earlier "
                      "checkpoints are intact: free space (or fix the file system), then run the same command "
                      "with --resume latest", error.filename) from error
    return final


def _prune_checkpoints(ckpt_dir: Path, run_id: str, newest: int, limit: int | None) -> None:
    """Keep the newest ``limit`` checkpoints of this run (0/None: all). Only finished
    checkpoints whose marker names this run and that are older than the one just written
    and verified are removed; anything else in the folder is left alone."""
    if not limit:
        return
    mine = [(step, path) for step, path in complete_checkpoints(ckpt_dir)
            if step < newest and checkpoint_run_id(path) == run_id]
    for _, old in mine[: max(0, len(mine) - (limit - 1))]:
        shutil.rmtree(old, ignore_errors=True)

