"""A run's checkpoints, ``checkpoints/step-N``: safetensors and JSON, nothing pickled.

Each folder holds the model, EMA and optimiser (``*.safetensors``), the step, data position,
LR schedule and loss scale (``train_state.json``) and every process's random states (Python,
NumPy, torch CPU and CUDA; ``random_states_R.safetensors``). It is built in scratch and renamed
into place (:func:`moh_dit.outputs.publish_folder`): a folder under its final name is complete.
"""

from __future__ import annotations

import errno
import json
import logging
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..outputs import publish_folder, read_json, write_json

logger = logging.getLogger(__name__)


class Checkpoint:
    """Save, find and load the ``checkpoints/step-N`` folders of the run folder ``run_dir``."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir) / "checkpoints"

    def folders(self) -> list[Path]:
        """The step-N folders, oldest first."""
        found = [p for p in self.dir.glob("step-*") if re.fullmatch(r"step-\d+", p.name)] if self.dir.is_dir() else []
        return sorted(found, key=lambda p: int(p.name[5:]))

    def latest(self) -> Path | None:
        return (self.folders() or [None])[-1]

    def find(self, resume: str) -> Path | None:
        """The checkpoint ``resume`` names: ``latest`` (None before the first), ``checkpoint-N`` or
        ``step-N`` (diffusers' and this package's names), or a folder."""
        if resume == "latest":
            return self.latest()
        name = re.fullmatch(r"(?:checkpoint|step)-(\d+)", resume)
        path = self.dir / f"step-{int(name.group(1)):07d}" if name else Path(resume)
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(errno.ENOENT, "no checkpoint there (no model.safetensors); resume takes latest, "
                                    "checkpoint-N or a checkpoint folder", str(path))
        return path

    def save(self, step: int, acc, model, ema, optimizer, state: dict, keep: int | None) -> Path:
        """Write ``step-N`` (the main process; the others hand it their random states), then keep
        the newest ``keep`` checkpoints (None or 0: all)."""
        from accelerate.utils import gather_object

        rngs = gather_object([_rng_state()]) if acc.num_processes > 1 else [_rng_state()]
        path = self.dir / f"step-{step:07d}"
        if acc.is_main_process:
            try:
                with publish_folder(path) as tmp:
                    save_file(_cpu(model.state_dict()), tmp / "model.safetensors")
                    save_file(_cpu(ema.state_dict()), tmp / "ema.safetensors")
                    optim = optimizer.state_dict()  # {"state": {i: {name: tensor}}, "param_groups": [...]}
                    groups = {"param_groups": json.dumps(optim["param_groups"])}
                    save_file({f"{i}.{k}": v for i, s in optim["state"].items() for k, v in _cpu(s).items()},
                              tmp / "optimizer.safetensors", metadata=groups)
                    write_json(tmp / "train_state.json", state)
                    for rank, (tensors, rest) in enumerate(rngs):
                        save_file(tensors, tmp / f"random_states_{rank}.safetensors",
                                  metadata={"rest": json.dumps(rest)})
                    umask_modes(tmp)
            except (OSError, SafetensorError) as error:  # a full disk: say which checkpoint, and what is safe
                raise OSError(getattr(error, "errno", None) or errno.EIO, f"{error}; this checkpoint was not saved, "
                              "the earlier ones are intact: free space, then resume", str(path)) from error
            for old in self.folders()[:-keep] if keep else []:
                shutil.rmtree(old)
        acc.wait_for_everyone()
        return path

    def load(self, path: Path, acc, model, ema, optimizer) -> dict:
        """Load ``path`` into the model, EMA, optimiser and this process's random states; returns
        the train state (step, data position, LR schedule, loss scale)."""
        model.load_state_dict(load_file(path / "model.safetensors"))
        ema.load_state_dict(load_file(path / "ema.safetensors"))
        with safe_open(path / "optimizer.safetensors", framework="pt") as f:
            groups = json.loads(f.metadata()["param_groups"])
            state: dict[int, dict] = {}
            for key in f.keys():
                index, name = key.split(".", 1)
                state.setdefault(int(index), {})[name] = f.get_tensor(key)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        rng = path / f"random_states_{acc.process_index}.safetensors"
        if rng.is_file():
            with safe_open(rng, framework="pt") as f:
                _set_rng_state({k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["rest"]))
        else:
            logger.warning(f"{path} holds no random states of process {acc.process_index} (saved with fewer "
                           "processes): the run goes on, but not bit for bit as an uninterrupted one")
        return read_json(path / "train_state.json")


def umask_modes(folder: Path) -> None:
    """The files below ``folder`` (made by ``publish_folder``, so its mode is the umask's) get the
    mode the umask gives: safetensors writes its files readable by their owner only."""
    mode = folder.stat().st_mode & 0o666
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(mode)


def _cpu(tensors: dict) -> dict:
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def _rng_state() -> tuple[dict, dict]:
    """This process's random states: tensors (torch, CUDA) and the rest (Python, NumPy) as JSON."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return tensors, {"python": [version, list(internal), gauss],
                     "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def _set_rng_state(tensors: dict, rest: dict) -> None:
    version, internal, gauss = rest["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = rest["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors) - 1)]
    if cuda and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
