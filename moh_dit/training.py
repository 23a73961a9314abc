"""Class-conditional latent (or pixel) diffusion training of MoH-DiT / DiT on accelerate.

The recipe is DiT's (Peebles & Xie, *Scalable Diffusion Models with Transformers*, ICCV 2023),
which the MoH paper (Jin et al., *MoH: Multi-Head Attention as Mixture-of-Head Attention*,
ICML 2025) keeps for MoH-DiT; docs/design.md section 5 has it in full: AdamW at a constant
1e-4 without weight decay, EMA 0.9999 starting as an exact copy, class dropout 0.1, ADM
centre crop and horizontal flips, 1000-step linear diffusion with learned-range variance,
loss = MSE(eps) + VB, plus ``lb_coeff`` times the model's load-balance loss.

The run folder (docs/training.md) belongs to one run: while ``train`` runs it holds an
OS lock on ``OUT/.lock``; a second run into the folder, or a new run over a finished one,
is refused. To resume, run the same command again with ``--resume latest``: checkpoints
hold the model, EMA, optimiser, LR schedule, step, data position and every process's RNG
states, so a resumed run continues bit for bit (tested on CPU, with one and two processes).
Checkpoints are safetensors and JSON only -- nothing is unpickled -- written into a temporary
folder that is renamed into place when complete; their marker ``checkpoint.json`` records
every file's size and SHA-256, which a resume checks before it loads anything.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from .data import ImageFolderDataset, ResumableSampler, collate_skip_corrupt
from .io_utils import (FileLockedError, lock_file, sha256_file, write_json_atomic, write_lines_atomic,
                       write_lock_info)
from .diffusion import create_diffusion
from .latents import LatentDataset, load_vae, vae_downsample_factor
from .presets import PRESETS
from .transformer_moh_dit import MoHDiTTransformer2DModel

__all__ = ["TrainConfig", "train", "find_latest_checkpoint", "verify_checkpoint", "preflight", "TrainingDivergedError",
           "RunFolderBusyError", "CheckpointIntegrityError"]

CHECKPOINT_PREFIX = "step-"
COMPLETE_MARKER = "checkpoint.json"
CHECKPOINT_FORMAT = 2  # 1: accelerate's save_state with pickled custom state (not loaded any more)
RUN_RECORD = "train_config.json"
LOCK_FILE = ".lock"
LOG_FILES = ("train_log.jsonl", "head_usage.jsonl")
# The files of a checkpoint: tensors in safetensors, everything else in JSON.
MODEL_FILE = "model.safetensors"
EMA_FILE = "ema.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
SCHEDULER_FILE = "scheduler.json"
SCALER_FILE = "scaler.json"
STATE_FILE = "train_state.json"
RNG_FILE = "random_states_{}.safetensors"  # one per process
REQUIRED_FILES = (MODEL_FILE, EMA_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE, RNG_FILE.format(0))
DIFFUSION_STEPS = 1000


class TrainingDivergedError(FloatingPointError):
    """The loss became NaN or infinite."""


class RunFolderBusyError(FileExistsError):
    """Another training run holds the ``--output-dir`` (the message names its pid, host and start)."""


class CheckpointIntegrityError(ValueError):
    """A checkpoint file is missing, truncated, altered or unreadable (the message names it)."""


def _check(ok: bool, flag: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"{flag} must be {rule}, got {value!r}.")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class TrainConfig:
    """Every training option; ``scripts/train.py`` maps its flags onto these fields."""

    preset: str
    output_dir: str
    data_dir: str | None = None
    latents_dir: str | None = None
    vae: str = "stabilityai/sd-vae-ft-ema"
    vae_subfolder: str | None = None
    image_size: int = 256
    max_steps: int = 400_000
    global_batch_size: int = 256
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    max_grad_norm: float | None = None
    checkpoint_every: int = 50_000
    checkpoints_total_limit: int | None = 2
    resume: str | None = None
    mixed_precision: str = "no"
    allow_tf32: bool = True
    seed: int = 0
    lb_coeff: float = 0.01
    ema_decay: float = 0.9999
    class_dropout: float = 0.1
    gradient_checkpointing: bool = False
    num_workers: int = 4
    on_corrupt: str = "error"
    random_flip: bool = True
    log_every: int = 100
    sample_every: int = 0
    sample_steps: int = 50
    report_to: str = "tensorboard"
    model_overrides: dict[str, Any] = field(default_factory=dict)

    def validate(self, num_processes: int | None = None) -> None:
        """Every check that needs no data or model, so bad input fails before any work and
        before anything is written. The batch-size check runs when ``num_processes`` is known."""
        if self.preset not in PRESETS:
            raise ValueError(f"Unknown preset {self.preset!r}. Known presets: {', '.join(PRESETS)}.")
        if (self.data_dir is None) == (self.latents_dir is None):
            raise ValueError("Give exactly one of --data-dir (an ImageFolder) or --latents-dir (a latent cache).")
        flag, source = _source(self)
        if not Path(source).exists():
            raise ValueError(f"{flag} {str(source)!r}: the data folder does not exist.")
        if not Path(source).is_dir():
            expected = "an ImageFolder" if self.data_dir is not None else "a latent cache"
            raise ValueError(f"{flag} {str(source)!r} is not a folder (expected {expected}).")
        out = Path(self.output_dir)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--output-dir {str(out)!r} exists and is not a folder; give a folder for the run.")
        if self.data_dir is not None and self.vae.lower() != "none":
            if Path(self.vae).exists() and not Path(self.vae).is_dir():
                raise ValueError(f"--vae {self.vae!r} is a file; give a VAE folder or hub id, or --vae none for "
                                 "pixel space.")
        if self.vae_subfolder is not None and (self.data_dir is None or self.vae.lower() == "none"):
            raise ValueError(f"--vae-subfolder {self.vae_subfolder!r} needs a VAE, but the run uses "
                             f"{'--latents-dir' if self.data_dir is None else '--vae none'}; drop --vae-subfolder.")
        for name in ("max_steps", "global_batch_size", "checkpoint_every", "image_size", "log_every"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, f"--{name.replace('_', '-')}", value, "at least 1")
        for name in ("warmup_steps", "num_workers", "sample_every"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 0, f"--{name.replace('_', '-')}", value, "0 or more")
        limit = self.checkpoints_total_limit
        _check(limit is None or (isinstance(limit, int) and limit >= 0), "--checkpoints-total-limit", limit,
               "0 (keep every checkpoint) or more")
        if num_processes is not None and self.global_batch_size % num_processes:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by the number of processes "
                f"({num_processes}); use a multiple of {num_processes}."
            )
        _check(_finite(self.learning_rate) and self.learning_rate > 0, "--learning-rate", self.learning_rate,
               "a finite number above 0")
        _check(_finite(self.weight_decay) and self.weight_decay >= 0, "--weight-decay", self.weight_decay,
               "a finite number, 0 or more")
        _check(self.max_grad_norm is None or (_finite(self.max_grad_norm) and self.max_grad_norm > 0),
               "--max-grad-norm", self.max_grad_norm, "a finite number above 0 (leave it out for no clipping)")
        _check(_finite(self.lb_coeff) and self.lb_coeff >= 0, "--lb-coeff", self.lb_coeff, "a finite number, 0 or more")
        betas = tuple(self.adam_betas)
        _check(len(betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in betas), "adam_betas", self.adam_betas,
               "two numbers in [0, 1)")
        _check(isinstance(self.seed, int) and 0 <= self.seed < 2**31, "--seed", self.seed, f"in [0, {2**31 - 1}]")
        if self.sample_every:
            _check(isinstance(self.sample_steps, int) and 1 <= self.sample_steps <= DIFFUSION_STEPS, "--sample-steps",
                   self.sample_steps, f"in [1, {DIFFUSION_STEPS}] (the diffusion's steps) when --sample-every is on")
        if self.mixed_precision not in ("no", "fp16", "bf16"):
            raise ValueError(f"--mixed-precision must be no, fp16 or bf16, got {self.mixed_precision!r}.")
        _check(_finite(self.ema_decay) and 0.0 <= self.ema_decay < 1.0, "--ema-decay", self.ema_decay, "in [0, 1)")
        _check(_finite(self.class_dropout) and 0.0 <= self.class_dropout < 1.0, "--class-dropout", self.class_dropout,
               "in [0, 1)")
        if self.report_to not in ("tensorboard", "wandb", "none"):
            raise ValueError(f"--report-to must be tensorboard, wandb or none, got {self.report_to!r}.")
        if self.on_corrupt not in ("error", "skip"):
            raise ValueError(f"--on-corrupt must be error or skip, got {self.on_corrupt!r}.")
        if self.resume not in (None, "latest") and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume!r} is neither 'latest' nor an existing checkpoint folder.")


# --------------------------------------------------------------------------------------
# Checkpoint folders
# --------------------------------------------------------------------------------------


def _checkpoint_folders(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step-N`` folder, oldest first, finished or not."""
    found = []
    if checkpoint_dir.is_dir():
        for path in checkpoint_dir.iterdir():
            match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
    return sorted(found)


def _complete_checkpoints(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every finished checkpoint, oldest first. Temporary folders of an
    interrupted save start with '.' and have no marker, so they are never picked."""
    return [(step, path) for step, path in _checkpoint_folders(checkpoint_dir) if (path / COMPLETE_MARKER).is_file()]


def find_latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``output_dir/checkpoints``, or None (its files
    are not checked here: :func:`verify_checkpoint` does that)."""
    found = _complete_checkpoints(Path(output_dir) / "checkpoints")
    return found[-1][1] if found else None


def _read_marker(folder: Path) -> dict | None:
    try:
        marker = json.loads((folder / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def verify_checkpoint(folder: str | os.PathLike) -> dict:
    """Check a checkpoint against its marker -- every recorded file present, with the recorded
    size and SHA-256 -- and return the marker; raise CheckpointIntegrityError naming the
    first bad file. Files the marker does not list are never read."""
    folder = Path(folder)
    marker_path = folder / COMPLETE_MARKER
    if not marker_path.is_file():
        raise CheckpointIntegrityError(f"{marker_path} is missing: {folder} is not a finished checkpoint "
                                       "(an interrupted save, or not a checkpoint folder).")
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


class _TrainState:
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
class _Parts:
    """What a checkpoint saves and restores."""

    accelerator: Any
    model: torch.nn.Module  # unwrapped
    ema: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    state: _TrainState


def _state_dict_for_file(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}


def _write_checkpoint_files(parts: _Parts, folder: Path) -> None:
    """Every process writes its RNG states; the main process writes the rest."""
    acc = parts.accelerator
    _save_tree(_rng_state(), folder / RNG_FILE.format(acc.process_index))
    if acc.is_main_process:
        save_file(_state_dict_for_file(parts.model), str(folder / MODEL_FILE))
        save_file(_state_dict_for_file(parts.ema), str(folder / EMA_FILE))
        _save_tree(parts.optimizer.state_dict(), folder / OPTIMIZER_FILE)
        _save_json_tree(parts.lr_scheduler.state_dict(), folder / SCHEDULER_FILE)
        if acc.scaler is not None:
            _save_json_tree(acc.scaler.state_dict(), folder / SCALER_FILE)
        write_json_atomic(folder / STATE_FILE, parts.state.state_dict())


def _load_checkpoint(parts: _Parts, folder: Path) -> None:
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
            _warn(f"{folder} has no {SCALER_FILE} (saved without fp16); the loss scale starts afresh.")
    train_state = load(STATE_FILE, lambda p: json.loads(p.read_text(encoding="utf-8")))
    try:
        parts.state.load_state_dict(train_state)  # the sampler names a changed dataset or seed itself
    except (KeyError, TypeError, AttributeError) as error:
        raise CheckpointIntegrityError(f"cannot load {folder / STATE_FILE}: {type(error).__name__}: {error}") from None
    rng = folder / RNG_FILE.format(acc.process_index)
    if rng.is_file():
        load(rng.name, lambda p: _set_rng_state(_load_tree(p)))
    else:
        _warn(f"{folder} has no random states for process {acc.process_index} (saved with fewer processes); this "
              "process keeps its seeded ones, so the run is not bit-identical to an uninterrupted one.")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


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


def _save_checkpoint(parts: _Parts, cfg: TrainConfig, step: int, run: dict[str, Any]) -> Path:
    """All files into '.step-N.tmp', the marker (sizes and SHA-256) last, an atomic rename,
    a re-check of what landed on disk, and only then rotation of this run's older ones.
    A failure on any process (a full disk) is raised on all of them, none left at a barrier."""
    accelerator = parts.accelerator
    ckpt_dir = Path(cfg.output_dir) / "checkpoints"
    final = ckpt_dir / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = ckpt_dir / f".{final.name}.tmp"  # this run's own scratch folder (one run per folder)

    def prepare() -> None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    def finish() -> None:
        files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p, fsync=True)}
                 for p in sorted(tmp.iterdir()) if p.is_file()}
        write_json_atomic(tmp / COMPLETE_MARKER, {
            "format": CHECKPOINT_FORMAT, "step": step, "preset": cfg.preset,
            "num_processes": accelerator.num_processes, "run": run, "files": files})
        if final.exists():
            # Only a damaged checkpoint (resume fell back past it) or another run's can be
            # here: keep it under another name.
            theirs = ((_read_marker(final) or {}).get("run") or {}).get("run_id")
            moved = _set_aside(final, "damaged" if theirs in (None, run["run_id"]) else "other-run")
            _warn(f"{final} was in the way of the new checkpoint; moved it to {moved}.")
        os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        verify_checkpoint(final)
        _prune_checkpoints(ckpt_dir, run["run_id"], step, cfg.checkpoints_total_limit)

    _on_main(accelerator, prepare)
    _everywhere(accelerator, lambda: _write_checkpoint_files(parts, tmp))
    _on_main(accelerator, finish)
    return final


def _prune_checkpoints(ckpt_dir: Path, run_id: str, newest: int, limit: int | None) -> None:
    """Keep the newest ``limit`` checkpoints of this run (0/None: all). Only finished
    checkpoints whose marker names this run and that are older than the one just written
    and verified are removed; anything else in the folder is left alone."""
    if not limit:
        return
    mine = [(step, path) for step, path in _complete_checkpoints(ckpt_dir)
            if step < newest and ((_read_marker(path) or {}).get("run") or {}).get("run_id") == run_id]
    for _, old in mine[: max(0, len(mine) - (limit - 1))]:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------
# The run folder: one run, its record, its lock
# --------------------------------------------------------------------------------------


def _source(cfg_or_record: Any) -> tuple[str, str | None]:
    get = cfg_or_record.get if isinstance(cfg_or_record, dict) else lambda k: getattr(cfg_or_record, k)
    return ("--data-dir", get("data_dir")) if get("data_dir") is not None else ("--latents-dir", get("latents_dir"))


def _resolved(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def _run_identity(cfg: TrainConfig) -> dict[str, Any]:
    """What must stay the same for a resume: preset, data and seed (the model config is added
    once the model is built)."""
    flag, source = _source(cfg)
    return {"preset": cfg.preset, "data_dir": cfg.data_dir, "latents_dir": cfg.latents_dir,
            "data_path": _resolved(source), "seed": cfg.seed}


def _read_record(out: Path) -> dict | None:
    path = out / RUN_RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is unreadable ({type(error).__name__}: {error}); restore it, or start a new run "
                         "with another --output-dir.") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path} is not a run record; restore it, or start a new run with another --output-dir.")
    return record


def _check_same_run(cfg: TrainConfig, recorded: dict, where: str) -> None:
    """Refuse a resume whose preset, data or seed differ from what ``where`` records."""
    if recorded.get("preset") is not None and recorded["preset"] != cfg.preset:
        raise ValueError(f"--preset {cfg.preset} does not match {where}, which was trained with --preset "
                         f"{recorded['preset']}; resume with --preset {recorded['preset']}, or start a new run with "
                         "another --output-dir.")
    flag, source = _source(cfg)
    rec_flag, rec_source = _source(recorded)
    if rec_source is not None:
        rec_path = recorded.get("data_path") or _resolved(rec_source)
        if (flag, _resolved(source)) != (rec_flag, rec_path):
            raise ValueError(f"{flag} {source} is not the data of {where}, which was trained on {rec_flag} {rec_path}; "
                             f"resume with {rec_flag} {rec_path}, or start a new run with another --output-dir.")
    if recorded.get("seed") is not None and recorded["seed"] != cfg.seed:
        raise ValueError(f"--seed {cfg.seed} does not match {where}, which was trained with --seed {recorded['seed']}; "
                         f"resume with --seed {recorded['seed']}, or start a new run with another --output-dir.")


def _normalized(config: dict) -> dict:
    return json.loads(json.dumps(config, default=str))


def _check_same_model(model_config: dict, recorded: dict | None, where: str) -> None:
    if recorded is None:
        return
    ours, theirs = _normalized(model_config), _normalized(recorded)
    diffs = [f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} now" for k in sorted(set(ours) | set(theirs))
             if ours.get(k) != theirs.get(k)]
    if diffs:
        raise ValueError(f"the model this command builds differs from {where}: {'; '.join(diffs)}. Resume with the "
                         "run's --image-size, --vae, --class-dropout and data, or start a new run with another "
                         "--output-dir.")


def _holds_run(out: Path) -> str | None:
    """What in ``out`` shows that a run lives there, or None."""
    ckpts = out / "checkpoints"
    for what, present in ((RUN_RECORD, (out / RUN_RECORD).exists()), ("final/", (out / "final").exists()),
                          ("checkpoints/", ckpts.is_dir() and any(ckpts.iterdir())),
                          (LOG_FILES[0], (out / LOG_FILES[0]).exists())):
        if present:
            return what
    return None


def _busy_message(out: Path, holder: dict | None) -> str:
    if holder:
        who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}")
    else:
        who = "holder unknown: it is just starting"
    return (f"--output-dir {out} is in use by another training run ({who}; lock {out / LOCK_FILE}). Wait for it to "
            "finish, or use another --output-dir.")


@dataclass
class _Plan:
    """What the main process decided about the run folder, handed to every process."""

    resume_from: str | None
    marker: dict | None
    record: dict | None
    run_id: str
    notes: list[str]
    warnings: list[str]


def _latest_intact(out: Path, record: dict | None, warnings: list[str]) -> tuple[Path | None, dict | None]:
    """The newest checkpoint of this run that passes verification; damaged ones are named."""
    run_id = (record or {}).get("run_id")
    damaged: list[tuple[Path, str]] = []
    for _, folder in reversed(_checkpoint_folders(out / "checkpoints")):
        if not (folder / COMPLETE_MARKER).exists():
            continue  # a save that never finished is not a checkpoint
        try:
            marker = verify_checkpoint(folder)
        except CheckpointIntegrityError as error:
            damaged.append((folder, str(error)))
            continue
        if run_id is not None and marker["run"]["run_id"] != run_id:
            warnings.append(f"{folder} belongs to another run (run id {marker['run']['run_id']}, this folder's is "
                            f"{run_id}); skipped.")
            continue
        for bad, why in damaged:
            warnings.append(f"checkpoint {bad} is damaged ({why}); resuming from {folder}, the newest intact one.")
        return folder, marker
    if damaged:
        raise CheckpointIntegrityError(
            f"--resume latest: no intact checkpoint in {out / 'checkpoints'}; every one is damaged: "
            + " ".join(why for _, why in damaged)
            + " Restore a checkpoint, or start a new run with another --output-dir.")
    return None, None


def _plan_run(cfg: TrainConfig) -> _Plan:
    """Read-only checks of the run folder (nothing is written): which run this is, where it
    resumes from, and every reason to refuse it."""
    out = Path(cfg.output_dir)
    notes: list[str] = []
    warnings: list[str] = []
    record = _read_record(out)
    if cfg.resume is None:
        what = _holds_run(out)
        if what is not None:
            raise FileExistsError(f"--output-dir {out} already holds a run ({what} exists). Continue it with --resume "
                                  "latest, or start a new run with another --output-dir; nothing of it is replaced.")
        return _Plan(None, None, None, uuid.uuid4().hex, notes, warnings)
    if record is not None:
        _check_same_run(cfg, record, str(out / RUN_RECORD))
    if cfg.resume == "latest":
        folder, marker = _latest_intact(out, record, warnings)
        if folder is None:
            notes.append(f"--resume latest: no checkpoint in {out / 'checkpoints'} yet, starting from scratch.")
    else:
        folder = Path(cfg.resume)
        try:
            marker = verify_checkpoint(folder)
        except CheckpointIntegrityError as error:
            raise CheckpointIntegrityError(f"--resume {folder}: {error}") from None
        newer = [p for s, p in _complete_checkpoints(out / "checkpoints") if s > marker["step"]
                 and ((_read_marker(p) or {}).get("run") or {}).get("run_id") == marker["run"]["run_id"]]
        if newer:
            raise ValueError(f"--resume {folder} is at step {marker['step']}, but {out / 'checkpoints'} already holds "
                             f"the newer {newer[-1].name}; continuing from the older one here would mix two histories. "
                             "Resume it into another --output-dir (or use --resume latest).")
    if marker is None:
        run_id = (record or {}).get("run_id") or uuid.uuid4().hex
        return _Plan(None, None, record, run_id, notes, warnings)
    where = f"checkpoint {folder}"
    _check_same_run(cfg, marker["run"], where)
    if record is not None and record.get("run_id") not in (None, marker["run"]["run_id"]):
        raise ValueError(f"{where} belongs to another run (run id {marker['run']['run_id']}) than the one in "
                         f"--output-dir {out} (run id {record['run_id']}); resume it into another --output-dir.")
    if marker["step"] > cfg.max_steps:
        raise ValueError(f"--max-steps {cfg.max_steps} is below step {marker['step']} of {where}; pass --max-steps "
                         f"{marker['step']} or more to continue the run.")
    return _Plan(str(folder), marker, record, marker["run"]["run_id"], notes, warnings)


def preflight(cfg: TrainConfig) -> str:
    """Validate ``cfg`` and check its run folder as ``train`` would, writing nothing and
    taking no lock (``--dry-run``); returns what ``train`` would do."""
    cfg.validate()
    plan = _plan_run(cfg)
    for message in plan.warnings:
        _warn(message)
    if plan.resume_from:
        return f"would resume from {plan.resume_from} (step {plan.marker['step']})"
    return "would start a new run" if cfg.resume is None else (plan.notes or ["would start from scratch"])[0]


class _FolderLock:
    """The main process's hold on ``OUT/.lock``: probed before any work (an existing lock
    file is locked without being changed), created if needed only once every check passed."""

    def __init__(self, out: Path):
        self.out, self.path, self.fd = out, out / LOCK_FILE, None

    def probe(self) -> None:
        if self.out.is_dir():
            try:
                self.fd = lock_file(self.path, create=False)
            except FileLockedError as error:
                raise RunFolderBusyError(_busy_message(self.out, error.holder)) from None

    def acquire(self) -> bool:
        """Hold the lock and write who holds it; True if it had to be created (then the
        caller re-checks the folder, which another process may have changed meanwhile)."""
        created = self.fd is None
        if created:
            self.out.mkdir(parents=True, exist_ok=True)
            try:
                self.fd = lock_file(self.path, create=True)
            except FileLockedError as error:
                raise RunFolderBusyError(_busy_message(self.out, error.holder)) from None
        write_lock_info(self.fd, {"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "argv": sys.argv})
        return created

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


_ERRORS = {cls.__name__: cls for cls in (RunFolderBusyError, CheckpointIntegrityError, FileExistsError,
                                          FileNotFoundError, ValueError, TrainingDivergedError, OSError)}


def _on_main(accelerator, fn: Callable[[], Any]) -> Any:
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

        payload = [result, None if error is None else (type(error).__name__, str(error))]
        broadcast_object_list(payload, from_process=0)
        if not accelerator.is_main_process:
            result = payload[0]
            if payload[1] is not None:
                name, message = payload[1]
                cls = next((c for n, c in _ERRORS.items() if n == name), None)
                raise (cls(message) if cls is not None else RuntimeError(f"the main process failed: {name}: {message}"))
    if error is not None:
        raise error
    return result


def _everywhere(accelerator, fn: Callable[[], Any]) -> None:
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


def _trim_logs(out: Path, step: int) -> None:
    """Keep each logged step once: drop entries after ``step`` (written by a run that died
    after its last checkpoint) and any half-written line, rewriting the file atomically."""
    for name in LOG_FILES:
        path = out / name
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


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * model, parameter by parameter (DiT's constant decay)."""
    ema_params = dict(ema.named_parameters())
    for name, param in model.named_parameters():
        ema_params[name].mul_(decay).add_(param.detach().to(ema_params[name].dtype), alpha=1 - decay)


# --------------------------------------------------------------------------------------
# Sampling a grid while training
# --------------------------------------------------------------------------------------


@torch.no_grad()
def sample_grid(model, diffusion, num_classes: int, latent_shape, vae=None, steps: int = 50, per_class: int = 1,
                seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Images in [0, 1] (N, 3, H, W) from ``model`` with a respaced DDPM, one row per seed,
    classes in order (up to 16), no guidance. For monitoring, not evaluation."""
    sampler = diffusion.respace(steps)
    classes = list(range(min(num_classes, 16)))
    labels = torch.tensor(classes * per_class, device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn((len(labels), *latent_shape), generator=gen).to(device)
    timestep_map = sampler.timestep_map.to(device)
    for i in reversed(range(sampler.num_timesteps)):
        t = torch.full((len(labels),), i, device=device, dtype=torch.long)
        out = model(x, timestep_map[t], labels).sample
        noise = torch.randn(x.shape, generator=gen).to(device)
        # IDDPM clips the predicted image to [-1, 1] in pixel space; DiT does not clip latents.
        x = sampler.p_sample(out.float(), x.float(), t, noise=noise, clip_denoised=vae is None)["sample"]
    if vae is not None:
        x = vae.decode(x / vae.config.scaling_factor).sample
    return ((x.clamp(-1, 1) + 1) / 2).float().cpu()


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


def _build_data(cfg: TrainConfig, num_processes: int, rank: int):
    if cfg.latents_dir is not None:
        dataset = LatentDataset(cfg.latents_dir, random_flip=cfg.random_flip, seed=cfg.seed)
        return dataset, dataset.classes, dataset.class_to_idx
    dataset = ImageFolderDataset(
        cfg.data_dir, cfg.image_size, random_flip=cfg.random_flip, seed=cfg.seed, on_corrupt=cfg.on_corrupt
    )
    return dataset, dataset.classes, dataset.class_to_idx


def _infinite_batches(loader):
    while True:
        yield from loader


def _set_tf32(enabled: bool) -> None:
    # torch >= 2.9 has per-backend fp32_precision switches, and mixing them with the old
    # allow_tf32 flags raises; use the new ones where they exist.
    mode = "tf32" if enabled else "ieee"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
    else:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def _export_final(ema: torch.nn.Module, out: Path, class_to_idx: dict[str, int]) -> Path:
    """``OUT/final``: the EMA model and its class map, built in a temporary folder and swapped in."""
    final = out / "final"
    tmp = Path(tempfile.mkdtemp(prefix=".final.tmp-", dir=out))
    try:
        ema.save_pretrained(tmp, safe_serialization=True)
        write_json_atomic(tmp / "class_index.json", class_to_idx)
        old = None
        if final.exists():  # this run's previous export (a refused start protects any other)
            old = out / f".final.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def train(cfg: TrainConfig) -> Path:
    """Train ``cfg.preset`` and return the folder of the exported EMA model (``OUT/final``)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    cfg.validate()
    log_with = None if cfg.report_to == "none" else cfg.report_to
    accelerator = Accelerator(
        mixed_precision=cfg.mixed_precision,
        log_with=log_with,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / "logs")),
    )
    cfg.validate(accelerator.num_processes)
    kind = str(accelerator.distributed_type).upper()
    if any(name in kind for name in ("DEEPSPEED", "FSDP", "MEGATRON")):
        raise ValueError(f"accelerate's {accelerator.distributed_type} is not supported by this trainer's checkpoints; "
                         "launch plain data-parallel (accelerate launch --multi_gpu, or torchrun).")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and accelerator.num_processes == 1:
        # Every launched process would train alone (and all but one would find the folder busy).
        raise ValueError(f"launched as {world} processes (WORLD_SIZE={world}) but accelerate sees one; on CPU set "
                         "ACCELERATE_USE_CPU=1 for torchrun, or use accelerate launch --cpu.")
    lock = _FolderLock(Path(cfg.output_dir))
    try:
        return _train(cfg, accelerator, lock, log_with)
    finally:
        lock.release()


def _train(cfg: TrainConfig, accelerator, lock: _FolderLock, log_with: str | None) -> Path:
    from accelerate.utils import set_seed

    device = accelerator.device
    out_dir = Path(cfg.output_dir)

    # ---- the run folder, before any work: busy? another run? where to resume from?
    def plan_on_main() -> _Plan:
        lock.probe()
        return _plan_run(cfg)

    plan: _Plan = _on_main(accelerator, plan_on_main)

    if device.type == "cuda":
        _set_tf32(cfg.allow_tf32)
    set_seed(cfg.seed, device_specific=True)

    # ---- data (validated before any model or VAE work)
    dataset, classes, class_to_idx = _build_data(cfg, accelerator.num_processes, accelerator.process_index)
    per_process = cfg.global_batch_size // accelerator.num_processes
    sampler = ResumableSampler(len(dataset), num_replicas=accelerator.num_processes,
                               rank=accelerator.process_index, seed=cfg.seed)
    collate = collate_skip_corrupt if cfg.on_corrupt == "skip" else None
    # A private generator: DataLoader iterators draw a seed from the global RNG otherwise,
    # which would shift every later random number after a resume.
    loader_kwargs = dict(batch_size=per_process, sampler=sampler, num_workers=cfg.num_workers, drop_last=False,
                         generator=torch.Generator(), pin_memory=device.type == "cuda",
                         persistent_workers=False)
    if collate is not None:
        loader_kwargs["collate_fn"] = collate

    # ---- VAE and model
    vae = None
    if cfg.latents_dir is not None:
        latent_shape = tuple(dataset.latent_shape)
        scaling = dataset.scaling_factor
    elif cfg.vae.lower() == "none":
        latent_shape = (3, cfg.image_size, cfg.image_size)
        scaling = None
    else:
        vae = load_vae(cfg.vae, cfg.vae_subfolder, device=device)
        factor = vae_downsample_factor(vae)
        if cfg.image_size % factor:
            raise ValueError(f"--image-size {cfg.image_size} is not divisible by the VAE's downsampling factor {factor}.")
        latent_shape = (vae.config.latent_channels, cfg.image_size // factor, cfg.image_size // factor)
        scaling = vae.config.scaling_factor
    overrides = dict(cfg.model_overrides)
    overrides.update(sample_size=latent_shape[1], in_channels=latent_shape[0], num_classes=len(classes),
                     class_dropout_prob=cfg.class_dropout, class_names=list(classes))
    model = MoHDiTTransformer2DModel.from_preset(cfg.preset, **overrides)
    model_config = _normalized({k: v for k, v in dict(model.config).items() if not k.startswith("_")})
    run = {"run_id": plan.run_id, **_run_identity(cfg), "model_config": model_config}

    # ---- the same model as the run's? Then take the folder: lock, holder, re-check.
    def claim_on_main() -> None:
        if plan.marker is not None:
            _check_same_model(model_config, plan.marker["run"].get("model_config"), f"checkpoint {plan.resume_from}")
        elif plan.record is not None:
            _check_same_model(model_config, plan.record.get("model_config"), str(out_dir / RUN_RECORD))
        if lock.acquire():
            again = _plan_run(cfg)  # another process may have started a run here meanwhile
            if again.resume_from != plan.resume_from:
                raise FileExistsError(f"--output-dir {out_dir} changed while this run was starting; "
                                      "run the command again.")
        for message in plan.warnings:
            _warn(message)
        for message in plan.notes:
            accelerator.print(message)

    _on_main(accelerator, claim_on_main)

    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    ema = copy.deepcopy(model).to(device).requires_grad_(False).eval()
    model.train()
    diffusion = create_diffusion()

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  betas=tuple(cfg.adam_betas))
    warmup = max(cfg.warmup_steps, 0)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    unwrapped = accelerator.unwrap_model(model)
    state = _TrainState(sampler)
    # EMA and step/data position are saved by this module (safetensors + JSON), not
    # registered with accelerate, whose custom state is a pickle loaded with weights_only=False.
    parts = _Parts(accelerator, unwrapped, ema, optimizer, lr_scheduler, state)

    if plan.resume_from is not None:
        _load_checkpoint(parts, Path(plan.resume_from))
        accelerator.print(f"Resumed from {plan.resume_from} at step {state.step}.")

    # ---- run folder: resolved options and class map, written once the state has loaded
    if accelerator.is_main_process:
        write_json_atomic(out_dir / RUN_RECORD, {
            **dataclasses.asdict(cfg), "run_id": plan.run_id, "data_path": run["data_path"],
            "num_processes": accelerator.num_processes, "per_process_batch_size": per_process,
            "latent_shape": list(latent_shape), "model_config": model_config,
        })
        write_json_atomic(out_dir / "class_index.json", class_to_idx)
        _trim_logs(out_dir, state.step)

    if log_with is not None:
        accelerator.init_trackers("moh-dit", config={k: v for k, v in dataclasses.asdict(cfg).items()
                                                     if isinstance(v, (int, float, str, bool))})

    loader = DataLoader(dataset, **loader_kwargs)
    batches = _infinite_batches(loader)
    is_moh = unwrapped.is_moh
    sums = {"loss": 0.0, "mse": 0.0, "vb": 0.0, "lb": 0.0, "grad_norm": 0.0}
    count, window_start, window_images = 0, time.perf_counter(), 0
    progress = None
    if accelerator.is_main_process:
        from tqdm.auto import tqdm

        progress = tqdm(total=cfg.max_steps, initial=state.step, desc="train", dynamic_ncols=True)

    last_ckpt = plan.resume_from
    while state.step < cfg.max_steps:
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sampler.advance(per_process)
        state.images_skipped += per_process - x.shape[0]  # unreadable images dropped (--on-corrupt skip)
        if vae is not None:
            with torch.no_grad():
                shift = getattr(vae.config, "shift_factor", None) or 0.0
                x = (vae.encode(x).latent_dist.sample() - shift) * scaling
        log_now = (state.step + 1) % cfg.log_every == 0 or state.step + 1 == cfg.max_steps
        t = diffusion.sample_timesteps(x.shape[0], device=device)
        noise = torch.randn_like(x)
        x_t = diffusion.q_sample(x, t, noise)
        with accelerator.autocast():
            out = model(x_t, t, y, output_load_balance_loss=True, output_head_usage=log_now and is_moh)
        terms = diffusion.training_losses(out.sample, x, x_t, t, noise)
        loss = terms["loss"].mean() + cfg.lb_coeff * out.load_balance_loss
        bad = (~torch.isfinite(loss.detach())).float()
        if accelerator.num_processes > 1:  # decided together: a rank that stopped alone would leave the others waiting
            bad = accelerator.reduce(bad, "sum")
        if bad.item():
            raise TrainingDivergedError(
                f"The loss became {loss.item()} at step {state.step + 1}"
                f"{' here, NaN/inf on another process' if torch.isfinite(loss) else ''} (mse {terms['mse'].mean().item():.4g}, "
                f"vb {terms['vb'].mean().item():.4g}, lb {out.load_balance_loss.item():.4g}). "
                f"The last good checkpoint is {last_ckpt or 'none'}; lower --learning-rate, set --max-grad-norm, "
                "or use bf16 instead of fp16, then resume."
            )
        accelerator.backward(loss)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        update_ema(ema, unwrapped, cfg.ema_decay)
        state.step += 1
        state.images_seen += cfg.global_batch_size
        window_images += cfg.global_batch_size

        sums["loss"] += loss.detach()
        sums["mse"] += terms["mse"].mean().detach()
        sums["vb"] += terms["vb"].mean().detach()
        sums["lb"] += out.load_balance_loss.detach()
        sums["grad_norm"] += grad_norm.detach() if torch.is_tensor(grad_norm) else grad_norm
        count += 1
        if progress is not None:
            progress.update(1)

        if log_now:
            elapsed = time.perf_counter() - window_start
            logs = {k: float(accelerator.reduce(torch.as_tensor(v, device=device, dtype=torch.float32), "mean")) / count
                    for k, v in sums.items()}
            logs.update(steps_per_sec=count / elapsed, images_per_sec=window_images / elapsed,
                        lr=lr_scheduler.get_last_lr()[0], images_skipped=state.images_skipped)
            if is_moh and out.head_usage is not None:
                for i, usage in enumerate(out.head_usage):
                    routed = usage[unwrapped.layer_shared[i]:]
                    if routed.numel() > 1:
                        # coefficient of variation of routed-head usage: 0 = perfectly balanced
                        logs[f"head_balance_cv/layer_{i:02d}"] = (routed.std() / routed.mean().clamp_min(1e-8)).item()
                if accelerator.is_main_process:
                    with open(out_dir / "head_usage.jsonl", "a") as f:
                        f.write(json.dumps({"step": state.step, "usage": [u.tolist() for u in out.head_usage]}) + "\n")
            if log_with is not None:
                accelerator.log(logs, step=state.step)
            if progress is not None:
                progress.set_postfix(loss=f"{logs['loss']:.4f}", mse=f"{logs['mse']:.4f}", lb=f"{logs['lb']:.3f}",
                                     it_s=f"{logs['steps_per_sec']:.2f}")
                with open(out_dir / "train_log.jsonl", "a") as f:
                    f.write(json.dumps({"step": state.step, **logs}) + "\n")
            sums = {k: 0.0 for k in sums}
            count, window_start, window_images = 0, time.perf_counter(), 0

        if cfg.sample_every and state.step % cfg.sample_every == 0 and accelerator.is_main_process:
            _save_sample_grid(ema, diffusion, len(classes), latent_shape, vae, cfg, state.step, device)

        if state.step % cfg.checkpoint_every == 0 or state.step == cfg.max_steps:
            last_ckpt = _save_checkpoint(parts, cfg, state.step, run)

    if progress is not None:
        progress.close()
    if state.images_skipped:
        accelerator.print(f"Skipped {state.images_skipped} unreadable images (--on-corrupt skip).")
    final = out_dir / "final"
    if accelerator.is_main_process:
        _export_final(ema, out_dir, class_to_idx)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final


def _save_sample_grid(ema, diffusion, num_classes, latent_shape, vae, cfg: TrainConfig, step: int, device) -> None:
    from torchvision.utils import save_image

    images = sample_grid(ema, diffusion, num_classes, latent_shape, vae, steps=cfg.sample_steps, per_class=4,
                         seed=cfg.seed, device=device)
    folder = Path(cfg.output_dir) / "samples"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".step-{step:07d}.tmp.png"
    save_image(images, tmp, nrow=min(num_classes, 16))
    os.replace(tmp, folder / f"step-{step:07d}.png")

