"""Checkpoints: ``OUT/checkpoints/step-N`` folders of safetensors and JSON (nothing pickled),
and where a run starts.

A checkpoint holds the model, EMA, optimiser, LR schedule, loss scaler, step and data
position, and every process's random states, so that a resumed run continues bit for bit.
:func:`save_checkpoint` writes it into a hidden temporary folder renamed into place when
complete; its marker ``checkpoint.json`` records every file's size and SHA-256, which
:func:`verify_checkpoint` checks before anything is loaded. :func:`find_start` decides once,
reading only, where a run starts -- a new run, or the checkpoint it resumes from -- with
every reason to refuse it; :func:`resume` loads that checkpoint; :func:`record_run` then
writes the run record ``train_config.json``. Rotation removes only this run's verified-older
checkpoints.

Every process takes part in a save; the run folder's decisions are the main process's.
:func:`on_main` and :func:`everywhere` make either kind of work end the same way on all
processes -- all go on, or all raise together -- so that none is left at a barrier.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..data.datasets import ResumableSampler, write_class_index
from ..errors import DamagedFile, FolderInUse, InputNotFound, InvalidInput, MoHDiTError, OutputExists, TrainingDiverged
from ..utils.io import (naming_write_errors, set_ordinary_permissions, sha256_file, write_json_atomic,
                        write_lines_atomic)
from ..utils.output_folders import is_package_output, write_output_marker
from .config import CHECKPOINT_NAME, TrainConfig, data_source, warn

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
RUN_RECORD = "train_config.json"
LOG_FILES = ("train_log.jsonl", "head_usage.jsonl")


# --------------------------------------------------------------------------------------
# Work shared by the processes
# --------------------------------------------------------------------------------------

_ERRORS = {cls.__name__: cls for cls in (InvalidInput, InputNotFound, FolderInUse, OutputExists, DamagedFile,
                                          TrainingDiverged, FileExistsError, FileNotFoundError, ValueError, OSError)}


def _report(error: BaseException) -> tuple:
    """What another process needs to raise ``error`` again: the nearest class (itself or a base)
    that every process knows, the message, its parameters, and an OSError's errno and path."""
    name = next((cls.__name__ for cls in type(error).__mro__ if cls.__name__ in _ERRORS), None)
    message = str(error) if name is not None else f"{type(error).__name__}: {error}"
    return (name, message, getattr(error, "parameters", ()), getattr(error, "errno", None),
            getattr(error, "strerror", None), getattr(error, "filename", None))


def _rebuild(report: tuple) -> Exception:
    name, message, parameters, code, strerror, filename = report
    cls = _ERRORS.get(name) if name is not None else None
    if cls is None:
        return RuntimeError(f"the main process failed: {message}")
    if issubclass(cls, MoHDiTError):
        return cls(message, parameters=parameters)
    error = cls(code, strerror, filename) if issubclass(cls, OSError) and code is not None else cls(message)
    if parameters:
        error.parameters = parameters
    return error


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

        payload = [result, None if error is None else _report(error)]
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


def interrupted(error: OSError, what: str, after: str = "") -> OSError:
    """The error of a write the machine refused (a full disk, a quota): its errno and file, what
    was not saved, and how the run goes on. ``parameters`` names the option the message names,
    as a :class:`~moh_dit.errors.MoHDiTError` does, for the command to show as its flag."""
    fault = OSError(error.errno, f"{error.strerror or error}; {what}: free space (or fix the file system), then run "
                    f"it again with resume='latest'{after}", error.filename)
    fault.parameters = ("resume",)
    return fault


# --------------------------------------------------------------------------------------
# Checkpoint folders: find, verify
# --------------------------------------------------------------------------------------


def checkpoint_folders(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step-N`` folder, oldest first, finished or not. A save in
    progress or interrupted is a hidden ``.step-N.tmp`` folder, never listed."""
    found = []
    if checkpoint_dir.is_dir():
        for path in checkpoint_dir.iterdir():
            match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
    return sorted(found)


def complete_checkpoints(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint with its marker, oldest first."""
    return [(step, path) for step, path in checkpoint_folders(checkpoint_dir) if (path / COMPLETE_MARKER).is_file()]


def find_latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``output_dir/checkpoints``, or None (its files
    are not checked here: :func:`verify_checkpoint` does that)."""
    found = complete_checkpoints(Path(output_dir) / "checkpoints")
    return found[-1][1] if found else None


def checkpoint_run_id(folder: Path) -> str | None:
    """The run id a checkpoint's marker names, or None (no readable marker); files not checked."""
    try:
        marker = json.loads((folder / COMPLETE_MARKER).read_text(encoding="utf-8"))
        return marker["run"]["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def verify_checkpoint(folder: str | os.PathLike) -> dict:
    """Check a checkpoint against its marker -- every recorded file present, with the recorded
    size and SHA-256 -- and return the marker; raise DamagedFile naming the first bad file.
    Files the marker does not list are never read."""
    folder = Path(folder)
    marker_path = folder / COMPLETE_MARKER
    if not marker_path.is_file():
        raise DamagedFile(f"{marker_path} is missing: {folder} is not a finished checkpoint (its completion marker "
                          "was deleted or lost, or the folder is an interrupted save or not a checkpoint).")
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DamagedFile(f"{marker_path} is unreadable ({type(error).__name__}: {error}); the checkpoint is "
                          "damaged.") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("step"), int):
        raise DamagedFile(f"{marker_path} is not a checkpoint marker; the checkpoint is damaged.")
    if marker.get("format") != CHECKPOINT_FORMAT or not isinstance(marker.get("files"), dict):
        raise DamagedFile(f"{marker_path}: {folder} was written by an older moh-dit (pickled state, no checksums), "
                          "which is not loaded because unpickling can run code; start a new run with another "
                          "output_dir.", parameters="output_dir")
    if not isinstance(marker.get("run"), dict) or not isinstance(marker["run"].get("run_id"), str):
        raise DamagedFile(f"{marker_path} has no run record; the checkpoint is damaged.")
    files = marker["files"]
    for name in REQUIRED_FILES:
        if name not in files:
            raise DamagedFile(f"{marker_path} does not list {name}; the checkpoint is damaged.")
    for name, meta in sorted(files.items()):
        path = folder / name
        if (not isinstance(name, str) or "/" in name or "\\" in name or name.startswith(".")
                or not isinstance(meta, dict) or not isinstance(meta.get("size"), int)
                or not isinstance(meta.get("sha256"), str)):
            raise DamagedFile(f"{marker_path} has a malformed entry {name!r}; the checkpoint is damaged.")
        if not path.is_file():
            raise DamagedFile(f"{path} is missing; the checkpoint is damaged.")
        size = path.stat().st_size
        if size != meta["size"]:
            raise DamagedFile(f"{path} has {size} bytes but the checkpoint recorded {meta['size']} (truncated or "
                              "altered); the checkpoint is damaged.")
        if sha256_file(path) != meta["sha256"]:
            raise DamagedFile(f"{path} does not match its recorded SHA-256 (altered or corrupted); the checkpoint is "
                              "damaged.")
    return marker


# --------------------------------------------------------------------------------------
# Where a run starts: one decision, before any work, reading only
# --------------------------------------------------------------------------------------


@dataclass
class Start:
    """Where a run starts, as the main process decided it: from step 0, or from ``folder``
    (a verified checkpoint of step ``step``). ``cfg``: the run's config, with the run's preset for
    a resume that gives none; ``recorded``: what the run recorded about itself (the checkpoint's
    marker, else ``train_config.json``; None for a new run); ``note``: what to say about it."""

    cfg: TrainConfig
    run_id: str
    folder: Path | None = None
    step: int = 0
    recorded: dict | None = None
    note: str | None = None


def _resolved(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def run_identity(cfg: TrainConfig) -> dict[str, Any]:
    """What must stay the same for a resume: preset, data (and the VAE that encodes it), seed and
    router warm-up (the model config is added once the model is built)."""
    return {"preset": cfg.preset, "data_dir": cfg.data_dir, "latents_dir": cfg.latents_dir,
            "data_path": _resolved(data_source(cfg)[1]), "vae": cfg.vae, "seed": cfg.seed,
            "router_warmup_steps": cfg.router_warmup_steps}


def normalized(config: dict) -> dict:
    return json.loads(json.dumps(config, default=str))


def _read_record(out: Path) -> dict | None:
    path = out / RUN_RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DamagedFile(f"{path} is unreadable ({type(error).__name__}: {error}); restore it, or start a new run "
                          "with another output_dir.", parameters="output_dir") from None
    if not isinstance(record, dict):
        raise DamagedFile(f"{path} is not a run record; restore it, or start a new run with another output_dir.",
                          parameters="output_dir")
    return record


def _check_same_run(cfg: TrainConfig, recorded: dict, where: str) -> None:
    """Refuse a resume whose preset, data, VAE, router warm-up or seed differ from what ``where``
    records (None there: a record from before the value was kept)."""
    name, source = data_source(cfg)
    rec_name, rec_source = data_source(recorded)
    rec_path = recorded.get("data_path") or _resolved(rec_source)
    for key in ("preset", "data", "vae", "router_warmup_steps", "seed"):
        if key == "data":
            if rec_source is None or (name, _resolved(source)) == (rec_name, rec_path):
                continue
            (now, given), (then, kept) = (name, source), (rec_name, rec_path)
        elif recorded.get(key) is None or recorded[key] == getattr(cfg, key):
            continue
        else:
            (now, given), (then, kept) = (key, getattr(cfg, key)), (key, recorded[key])
        raise InvalidInput(f"{now} {given} does not match {where}, which was trained with {then} {kept}; resume with "
                           f"{then} {kept}, or start a new run with another output_dir.",
                           parameters=(now, then, "output_dir"))


def _latest_intact(out: Path, record: dict | None) -> tuple[Path | None, dict | None]:
    """The newest checkpoint of this run that passes verification; damaged ones are named."""
    run_id = (record or {}).get("run_id")
    damaged: list[tuple[Path, str]] = []
    for _, folder in reversed(checkpoint_folders(out / "checkpoints")):
        try:
            marker = verify_checkpoint(folder)
        except DamagedFile as error:
            damaged.append((folder, str(error)))
            continue
        if run_id is not None and marker["run"]["run_id"] != run_id:
            warn(f"{folder} belongs to another run (run id {marker['run']['run_id']}, this folder's is {run_id}); "
                 "skipped.")
            continue
        for bad, why in damaged:
            warn(f"checkpoint {bad} is damaged ({why}); resuming from {folder}, the newest intact one.")
        return folder, marker
    if damaged:
        raise DamagedFile(f"resume='latest': no intact checkpoint in {out / 'checkpoints'}; every one is damaged: "
                          + " ".join(why for _, why in damaged)
                          + " Restore a checkpoint, or start a new run with another output_dir.",
                          parameters=("resume", "output_dir"))
    return None, None


def _chosen_checkpoint(cfg: TrainConfig, out: Path) -> tuple[Path, dict]:
    """The checkpoint ``cfg.resume`` names (a folder, or checkpoint-N of this run), verified, and
    its marker; one older than a checkpoint of its run already in ``out`` is refused."""
    folder = Path(cfg.resume)
    if not folder.is_dir():  # checkpoint-N: this folder's checkpoint of step N
        step = int(CHECKPOINT_NAME.fullmatch(cfg.resume).group(1))
        found = dict(checkpoint_folders(out / "checkpoints"))
        if step not in found:
            raise InputNotFound(f"resume {cfg.resume}: {out / 'checkpoints'} holds no checkpoint of step {step} (its "
                               f"steps: {', '.join(map(str, sorted(found))) or 'none'}).", parameters="resume")
        folder = found[step]
    try:
        marker = verify_checkpoint(folder)
    except DamagedFile as error:
        raise DamagedFile(f"resume {folder}: {error}", parameters=("resume", *error.parameters)) from None
    newer = [p for s, p in complete_checkpoints(out / "checkpoints") if s > marker["step"]
             and checkpoint_run_id(p) == marker["run"]["run_id"]]
    if newer:
        raise InvalidInput(f"resume {folder} is at step {marker['step']}, but {out / 'checkpoints'} already holds the "
                           f"newer {newer[-1].name}; continuing from the older one here would mix two histories. "
                           "Continue it in another output_dir (or use resume='latest').",
                           parameters=("resume", "output_dir"))
    return folder, marker


def find_start(cfg: TrainConfig) -> Start:
    """Where the run of ``cfg`` starts, and every reason to refuse it, reading the run folder
    only (nothing is written): a new run into a folder without one; else the checkpoint that
    ``cfg.resume`` names (``latest``: the newest intact one of this run; none yet: step 0), the
    same run as the command's (preset, data, VAE, seed, router warm-up) and not past
    ``max_steps``. Damaged and other runs' checkpoints that ``latest`` passes are warned about."""
    out = Path(cfg.output_dir)
    record = _read_record(out)
    if cfg.resume is None:
        ckpts = out / "checkpoints"
        present = {RUN_RECORD: (out / RUN_RECORD).exists(), "final/": (out / "final").exists(),
                   "checkpoints/": ckpts.is_dir() and any(ckpts.iterdir()), LOG_FILES[0]: (out / LOG_FILES[0]).exists()}
        what = next((name for name, there in present.items() if there), None)
        if what is not None:
            started = not (present["final/"] or present["checkpoints/"])
            raise OutputExists(f"output_dir {out} already holds a run ({what} exists). Continue it with "
                               "resume='latest'" + (" (an earlier run of this command stopped before its first "
                                                    "checkpoint; resume='latest' starts it again from step 0)"
                                                    if started else "")
                               + ", or start a new run with another output_dir; nothing of it is replaced.",
                               parameters=("output_dir", "resume"))
        return Start(cfg, uuid.uuid4().hex)
    if record is not None:
        _check_same_run(cfg, record, str(out / RUN_RECORD))
    if cfg.resume == "latest":
        folder, marker = _latest_intact(out, record)
    else:
        folder, marker = _chosen_checkpoint(cfg, out)
    if marker is not None:
        where = f"checkpoint {folder}"
        _check_same_run(cfg, marker["run"], where)
        if record is not None and record.get("run_id") not in (None, marker["run"]["run_id"]):
            raise InvalidInput(f"{where} belongs to another run (run id {marker['run']['run_id']}) than the one in "
                               f"output_dir {out} (run id {record['run_id']}); continue it in another output_dir.",
                               parameters="output_dir")
        if marker["step"] > cfg.max_steps:
            raise InvalidInput(f"max_steps {cfg.max_steps} is below step {marker['step']} of {where}; give max_steps "
                               f"{marker['step']} or more to continue the run.", parameters="max_steps")
    elif (record or {}).get("init_from"):  # without its init_from (refused with resume) it would start from random
        raise InvalidInput(f"output_dir {out} holds a run started with init_from {record['init_from']} that has no "
                           "checkpoint yet; start it again with init_from into another output_dir.",
                           parameters=("output_dir", "init_from"))
    recorded = marker["run"] if marker is not None else record
    if cfg.preset is None and cfg.init_from is None:  # the run's own (None: its recorded model config)
        if (recorded or {}).get("model_config") is None:
            raise InvalidInput(f"resume {cfg.resume}: output_dir {out} holds no run to take the model from; give "
                               "preset (or init_from a saved model folder) to start one.",
                               parameters=("resume", "output_dir", "preset", "init_from"))
        cfg = dataclasses.replace(cfg, preset=recorded.get("preset"))
    if marker is None:
        note = f"resume='latest': no checkpoint in {out / 'checkpoints'} yet, starting from scratch."
        return Start(cfg, (record or {}).get("run_id") or uuid.uuid4().hex, recorded=record, note=note)
    return Start(cfg, marker["run"]["run_id"], folder, marker["step"], marker["run"])


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


# --------------------------------------------------------------------------------------
# Save, resume, rotate
# --------------------------------------------------------------------------------------


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
    raise OutputExists(f"cannot set {folder} aside: too many {folder.name}.{why}-N folders; remove some.")


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
        raise interrupted(error, f"checkpoint {final} was not saved and the earlier checkpoints are intact") from error
    return final


def _check_same_model(model_config: dict, recorded: dict | None, where: str) -> None:
    if recorded is None:
        return
    ours, theirs = normalized(model_config), normalized(recorded)
    diffs = [f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} now" for k in sorted(set(ours) | set(theirs))
             if ours.get(k) != theirs.get(k)]
    if diffs:
        raise InvalidInput(f"the model built here differs from {where}: {'; '.join(diffs)}. Resume with the run's "
                           "image_size, vae, class_dropout and data (and its preset, or none to take the run's model), "
                           "or start a new run with another output_dir.",
                           parameters=("image_size", "vae", "class_dropout", "preset", "output_dir"))


def resume(parts: Parts, start: Start, model_config: dict) -> None:
    """Continue the run where :func:`find_start` said it starts, on every process: the model
    built must be the run's (else refused, naming each difference); from a checkpoint, every
    part's state, then this command's learning rate, weight decay and betas. A file that
    cannot be loaded is named."""
    where = f"checkpoint {start.folder}" if start.folder is not None else str(Path(start.cfg.output_dir) / RUN_RECORD)
    _check_same_model(model_config, (start.recorded or {}).get("model_config"), where)
    if start.folder is None:
        return
    acc, folder, cfg = parts.accelerator, start.folder, start.cfg

    def load(name: str, fn: Callable[[Path], Any]) -> Any:
        try:
            return fn(folder / name)
        except Exception as error:  # safetensors' and JSON's parse errors, wrong keys or shapes
            raise DamagedFile(f"cannot load {folder / name}: {type(error).__name__}: {error}") from None

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
        raise DamagedFile(f"cannot load {folder / STATE_FILE}: {type(error).__name__}: {error}") from None
    rng = folder / RNG_FILE.format(acc.process_index)
    if rng.is_file():
        load(rng.name, lambda p: _set_rng_state(_load_tree(p)))
    else:
        warn(f"{folder} has no random states for process {acc.process_index} (saved with fewer processes); this "
             "process keeps its seeded ones, so the run is not bit-identical to an uninterrupted one.")
    # The saved optimiser state restored the learning rate, weight decay and betas it was saved
    # with, which would silently override changed ones. The rate is the LR schedule's at the
    # step the run continues from: the same number when nothing changed, so an exact resume stays exact.
    schedule = parts.lr_scheduler
    schedule.base_lrs = [cfg.learning_rate] * len(schedule.base_lrs)
    for group, factor in zip(parts.optimizer.param_groups, schedule.lr_lambdas):  # diffusers' schedules: LambdaLR
        group.update(lr=cfg.learning_rate * factor(schedule.last_epoch), initial_lr=cfg.learning_rate,
                     weight_decay=cfg.weight_decay, betas=tuple(cfg.adam_betas))
    schedule._last_lr = [group["lr"] for group in parts.optimizer.param_groups]  # what get_last_lr() reports


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


# --------------------------------------------------------------------------------------
# The run record
# --------------------------------------------------------------------------------------

# Keys of the record that are the run's, not a segment's (a resume that changes them is refused).
_RUN_KEYS = ("run_id", "model_config")
# A segment's keys that say how it started, not what it trains with: never reported as changes.
_START_KEYS = ("start_step", "resume", "init_from")


def record_run(cfg: TrainConfig, facts: dict[str, Any], class_to_idx: dict[str, int], step: int) -> list[str]:
    """Once the state has loaded: the run record, the class map, and the logs trimmed to ``step``.

    The record holds the settings this start trains with (every option plus ``facts``) and, under
    ``segments``, those of every start whose steps the run's history holds: a resume at ``step``
    keeps the segments that began before it (later ones left nothing: their log lines are dropped
    too) and adds its own. Returns the settings that differ from the segment it continues, each as
    ``name old -> new``."""
    out_dir = Path(cfg.output_dir)
    if not is_package_output(out_dir):  # once: the run folder is moh-dit train's
        write_output_marker(out_dir, "train")
    settings = normalized({**dataclasses.asdict(cfg), **facts})
    segment = {"start_step": step, **{k: v for k, v in settings.items() if k not in _RUN_KEYS}}
    previous = (_read_record(out_dir) or {}) if step else {}
    first = {"start_step": 0, **{k: v for k, v in previous.items() if k not in _RUN_KEYS}}  # a record without segments
    segments = [s for s in previous.get("segments", [first] if previous else []) if s.get("start_step", 0) < step]
    changed = [f"{k} {segments[-1].get(k)!r} -> {v!r}" for k, v in segment.items()
               if segments and k not in _START_KEYS and segments[-1].get(k) != v]
    write_json_atomic(out_dir / RUN_RECORD, {**settings, "segments": [*segments, segment]})
    write_class_index(class_to_idx, out_dir / "class_index.json")
    # Each logged step once: drop entries after ``step`` (written by a run that died after its
    # last checkpoint) and any half-written line, rewriting the file atomically.
    for name in LOG_FILES:
        path = out_dir / name
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        kept = []
        for line in lines:
            try:
                entry_step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(entry_step, int) and entry_step <= step:
                kept.append(line)
        if kept != lines:
            write_lines_atomic(path, kept)
    return changed
