"""Class-conditional latent (or pixel) diffusion training of MoH-DiT / DiT on accelerate.

The recipe is DiT's (Peebles & Xie, *Scalable Diffusion Models with Transformers*, ICCV 2023),
which the MoH paper (Jin et al., *MoH: Multi-Head Attention as Mixture-of-Head Attention*,
ICML 2025) keeps for MoH-DiT; docs/design.md section 5 has it in full: AdamW at a constant
1e-4 without weight decay, EMA 0.9999 starting as an exact copy, class dropout 0.1, ADM
centre crop and horizontal flips, 1000-step linear diffusion with learned-range variance,
loss = MSE(eps) + VB, plus ``lb_coeff`` times the model's load-balance loss.

The run folder (docs/training.md) belongs to one run: while ``train`` runs it holds the
OS lock every command holds on the folder it writes (``.OUT.lock`` beside it); a second writer
of the folder, a new run over a finished one, or a run into another command's output, is
refused. To resume, call ``train`` again with ``resume="latest"``: checkpoints hold the
model, EMA, optimiser, LR schedule, step, data position and every process's RNG states, so
a resumed run continues bit for bit (tested on CPU, with one and two processes).
Checkpoints are safetensors and JSON only -- nothing is unpickled -- written into a temporary
folder that is renamed into place when complete; their marker ``checkpoint.json`` records
every file's size and SHA-256, which a resume checks before it loads anything.

Reading order of the modules (a resume crosses the first two, from ``moh-dit train``):

- ``trainer``: :func:`train`, one run top to bottom -- set up, resume, loop, checkpoint,
  finish -- the folder's lock, and :func:`preflight` (a dry run);
- ``checkpoints``: where a run starts (:func:`find_start`, every refusal), saving, verifying,
  loading (:func:`resume`) and rotating checkpoints, the run record, and the work all
  processes share;
- ``config``: :class:`TrainConfig`, every option, checked before any work;
- ``schedules``: what changes with the step: the LR schedule (diffusers') and the EMA decay;
- ``tracking``: ``report_to`` through accelerate's trackers.

Errors are :mod:`moh_dit.errors`' (``TrainingDiverged``, ``FolderInUse``, ``DamagedFile``,
``InvalidInput``, ``OutputExists``); the names this package gave the first three before
remain as aliases.
"""

from __future__ import annotations

from ..errors import DamagedFile, FolderInUse, TrainingDiverged
from .checkpoints import (CHECKPOINT_FORMAT, CHECKPOINT_PREFIX, COMPLETE_MARKER, EMA_FILE, LOG_FILES, MODEL_FILE,
                          OPTIMIZER_FILE, REQUIRED_FILES, RNG_FILE, RUN_RECORD, SCALER_FILE, SCHEDULER_FILE, STATE_FILE,
                          find_latest_checkpoint, verify_checkpoint)
from .config import DIFFUSION_STEPS, TrainConfig
from .trainer import preflight, sample_grid, train, update_ema

TrainingDivergedError = TrainingDiverged
RunFolderBusyError = FolderInUse
CheckpointIntegrityError = DamagedFile

__all__ = ["TrainConfig", "train", "find_latest_checkpoint", "verify_checkpoint", "preflight", "TrainingDivergedError",
           "RunFolderBusyError", "CheckpointIntegrityError"]
