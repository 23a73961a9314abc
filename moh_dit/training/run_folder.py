"""The run folder (``--output-dir``): one run, its record, its lock.

While a run trains, its main process holds an OS lock on ``OUT/.lock``: a second run into
the folder is refused at once, and so is a new run (no ``--resume``) over a folder that
holds one. :func:`plan_run` makes every read-only decision -- which run this is, where it
resumes from, every reason to refuse it -- before any work; the record ``train_config.json``
is written only once the run's state has loaded (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..data.datasets import write_class_index
from ..utils.io import (FileLockedError, LinkRefusedError, lock_file, read_lock_info, write_json_atomic,
                        write_lines_atomic, write_lock_info)
from ..utils.output_folders import is_package_output, write_output_marker
from .checkpoints import checkpoint_folders, checkpoint_run_id, complete_checkpoints, verify_checkpoint
from .config import (CHECKPOINT_NAME, DEFAULT_GLOBAL_BATCH_SIZE, CheckpointIntegrityError, RunFolderBusyError,
                     TrainConfig, check_batch_memory, data_source, warn)

RUN_RECORD = "train_config.json"
LOCK_FILE = ".lock"
LOG_FILES = ("train_log.jsonl", "head_usage.jsonl")


def _resolved(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def run_identity(cfg: TrainConfig) -> dict[str, Any]:
    """What must stay the same for a resume: preset, data (and the VAE that encodes it), seed and
    router warm-up (the model config is added once the model is built)."""
    flag, source = data_source(cfg)
    return {"preset": cfg.preset, "data_dir": cfg.data_dir, "latents_dir": cfg.latents_dir,
            "data_path": _resolved(source), "vae": cfg.vae, "seed": cfg.seed,
            "router_warmup_steps": cfg.router_warmup_steps}


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
    flag, source = data_source(cfg)
    rec_flag, rec_source = data_source(recorded)
    if rec_source is not None:
        rec_path = recorded.get("data_path") or _resolved(rec_source)
        if (flag, _resolved(source)) != (rec_flag, rec_path):
            raise ValueError(f"{flag} {source} is not the data of {where}, which was trained on {rec_flag} {rec_path}; "
                             f"resume with {rec_flag} {rec_path}, or start a new run with another --output-dir.")
    if recorded.get("vae") is not None and recorded["vae"] != cfg.vae:  # None: a record from before it was kept
        raise ValueError(f"--vae {cfg.vae} does not match {where}, whose latents are those of --vae {recorded['vae']}; "
                         f"resume with --vae {recorded['vae']}, or start a new run with another --output-dir.")
    warmup = recorded.get("router_warmup_steps")
    if warmup is not None and warmup != cfg.router_warmup_steps:
        raise ValueError(f"--router-warmup-steps {cfg.router_warmup_steps} does not match {where}, which was trained "
                         f"with --router-warmup-steps {warmup}; resume with --router-warmup-steps {warmup}, or start a "
                         "new run with another --output-dir.")
    if recorded.get("seed") is not None and recorded["seed"] != cfg.seed:
        raise ValueError(f"--seed {cfg.seed} does not match {where}, which was trained with --seed {recorded['seed']}; "
                         f"resume with --seed {recorded['seed']}, or start a new run with another --output-dir.")


def normalized(config: dict) -> dict:
    return json.loads(json.dumps(config, default=str))


def check_same_model(model_config: dict, recorded: dict | None, where: str) -> None:
    if recorded is None:
        return
    ours, theirs = normalized(model_config), normalized(recorded)
    diffs = [f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} now" for k in sorted(set(ours) | set(theirs))
             if ours.get(k) != theirs.get(k)]
    if diffs:
        raise ValueError(f"the model this command builds differs from {where}: {'; '.join(diffs)}. Resume with the "
                         "run's --image-size, --vae, --class-dropout and data (and its --preset, or none to take the "
                         "run's model), or start a new run with another --output-dir.")


def _holds_run(out: Path) -> str | None:
    """What in ``out`` shows that a run lives there, or None."""
    ckpts = out / "checkpoints"
    for what, present in ((RUN_RECORD, (out / RUN_RECORD).exists()), ("final/", (out / "final").exists()),
                          ("checkpoints/", ckpts.is_dir() and any(ckpts.iterdir())),
                          (LOG_FILES[0], (out / LOG_FILES[0]).exists())):
        if present:
            return what
    return None


def _holds_run_beyond_start(out: Path) -> str | None:
    """What in ``out`` shows that its run got past its start (a checkpoint folder, or final/), or None."""
    ckpts = out / "checkpoints"
    if (out / "final").exists():
        return "final/"
    if ckpts.is_dir() and any(ckpts.iterdir()):
        return "checkpoints/"
    return None


def _busy_message(out: Path, holder: dict | None) -> str:
    if holder:
        who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}")
    else:
        who = "holder unknown: it is just starting"
    return (f"--output-dir {out} is in use by another training run ({who}; lock {out / LOCK_FILE}). Wait for it to "
            "finish, or use another --output-dir.")


@dataclass
class Plan:
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
    # A save in progress or interrupted is a hidden '.step-N.tmp' folder, renamed to 'step-N'
    # only once its marker is written: a 'step-N' folder without a marker is damage (a deleted
    # or lost checkpoint.json), named like any other.
    for _, folder in reversed(checkpoint_folders(out / "checkpoints")):
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


def plan_run(cfg: TrainConfig) -> Plan:
    """Read-only checks of the run folder (nothing is written): which run this is, where it
    resumes from, and every reason to refuse it."""
    out = Path(cfg.output_dir)
    notes: list[str] = []
    warnings: list[str] = []
    record = _read_record(out)
    if cfg.resume is None:
        what = _holds_run(out)
        if what is not None:
            started = what in (RUN_RECORD, LOG_FILES[0]) and _holds_run_beyond_start(out) is None
            hint = (" (an earlier run of this command stopped before its first checkpoint; --resume latest starts it "
                    "again from step 0)" if started else "")
            raise FileExistsError(f"--output-dir {out} already holds a run ({what} exists). Continue it with --resume "
                                  f"latest{hint}, or start a new run with another --output-dir; nothing of it is "
                                  "replaced.")
        return Plan(None, None, None, uuid.uuid4().hex, notes, warnings)
    if record is not None:
        _check_same_run(cfg, record, str(out / RUN_RECORD))
    if cfg.resume == "latest":
        folder, marker = _latest_intact(out, record, warnings)
        if folder is None:
            notes.append(f"--resume latest: no checkpoint in {out / 'checkpoints'} yet, starting from scratch.")
    else:
        folder = Path(cfg.resume)
        if not folder.is_dir():  # checkpoint-N: this folder's checkpoint of step N
            step = int(CHECKPOINT_NAME.fullmatch(cfg.resume).group(1))
            found = dict(checkpoint_folders(out / "checkpoints"))
            if step not in found:
                raise FileNotFoundError(f"--resume {cfg.resume}: {out / 'checkpoints'} holds no checkpoint of step "
                                        f"{step} (its steps: {', '.join(map(str, sorted(found))) or 'none'}).")
            folder = found[step]
        try:
            marker = verify_checkpoint(folder)
        except CheckpointIntegrityError as error:
            raise CheckpointIntegrityError(f"--resume {folder}: {error}") from None
        newer = [p for s, p in complete_checkpoints(out / "checkpoints") if s > marker["step"]
                 and checkpoint_run_id(p) == marker["run"]["run_id"]]
        if newer:
            raise ValueError(f"--resume {folder} is at step {marker['step']}, but {out / 'checkpoints'} already holds "
                             f"the newer {newer[-1].name}; continuing from the older one here would mix two histories. "
                             "Resume it into another --output-dir (or use --resume latest).")
    if marker is None:
        run_id = (record or {}).get("run_id") or uuid.uuid4().hex
        return Plan(None, None, record, run_id, notes, warnings)
    where = f"checkpoint {folder}"
    _check_same_run(cfg, marker["run"], where)
    if record is not None and record.get("run_id") not in (None, marker["run"]["run_id"]):
        raise ValueError(f"{where} belongs to another run (run id {marker['run']['run_id']}) than the one in "
                         f"--output-dir {out} (run id {record['run_id']}); resume it into another --output-dir.")
    if marker["step"] > cfg.max_steps:
        raise ValueError(f"--max-steps {cfg.max_steps} is below step {marker['step']} of {where}; pass --max-steps "
                         f"{marker['step']} or more to continue the run.")
    return Plan(str(folder), marker, record, marker["run"]["run_id"], notes, warnings)


def recorded_model(plan: Plan) -> dict | None:
    """The model config of the run a resume continues: its checkpoint's, else its record's; None
    for a new run."""
    recorded = plan.marker["run"] if plan.marker is not None else plan.record
    return (recorded or {}).get("model_config")


def with_run_preset(cfg: TrainConfig, plan: Plan) -> TrainConfig:
    """``cfg``, and for a resume without --preset (or --init-from) the preset the run recorded
    (None for a run whose architecture came from an --init-from folder: its recorded model
    config is then the architecture). A resume with no run to continue needs --preset."""
    if cfg.preset is not None or cfg.init_from is not None:
        return cfg
    if recorded_model(plan) is None:
        raise ValueError(f"--resume {cfg.resume}: --output-dir {cfg.output_dir} holds no run to take the model from; "
                         "give --preset (or --init-from a saved model folder) to start one.")
    recorded = plan.marker["run"] if plan.marker is not None else plan.record
    return dataclasses.replace(cfg, preset=recorded.get("preset"))


def preflight(cfg: TrainConfig) -> str:
    """Validate ``cfg`` and check its run folder as ``train`` would, writing nothing and
    taking no lock (``--dry-run``); returns what ``train`` would do. A folder that a live run
    holds is refused, as ``train`` would refuse it (:meth:`FolderLock.peek`)."""
    cfg.validate()
    resolved = cfg.resolved()
    # The batch of one process (the launch's number of processes is not known here).
    check_batch_memory(resolved, cfg.train_batch_size or max(1, (cfg.global_batch_size or DEFAULT_GLOBAL_BATCH_SIZE)
                                                              // resolved.gradient_accumulation_steps))
    FolderLock(Path(cfg.output_dir)).peek()
    plan = plan_run(resolved)  # with the VAE the run would use, as train's plan has it
    with_run_preset(cfg, plan)
    for message in [*plan.warnings, cfg.ema_warning()]:
        if message is not None:
            warn(message)
    if plan.resume_from:
        return f"would resume from {plan.resume_from} (step {plan.marker['step']})"
    return "would start a new run" if cfg.resume is None else (plan.notes or ["would start from scratch"])[0]


class FolderLock:
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

    def peek(self) -> None:
        """Whether a live run holds the folder, without taking or creating the lock and without
        writing: a shared lock tried on the existing file and let go at once (a live holder has
        it exclusively). A link in place of the lock is refused, as :meth:`probe` refuses it."""
        import fcntl

        if self.path.is_symlink():
            raise LinkRefusedError(f"{self.path} is a symbolic link, and a lock file is never written through a "
                                   "link; delete the link and run the command again")
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderBusyError(_busy_message(self.out, read_lock_info(self.path))) from None
        except OSError:
            return  # a file system without locks: train itself says so when it takes the lock
        finally:
            os.close(fd)

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


def probe_and_plan(lock: FolderLock, cfg: TrainConfig) -> Plan:
    """The main process's first look, before any work: is the folder busy, whose run is
    it, where to resume from."""
    lock.probe()
    return plan_run(cfg)


def claim_folder(cfg: TrainConfig, plan: Plan, lock: FolderLock, model_config: dict,
                 say: Callable[[str], None]) -> None:
    """On the main process, once the model is built: is it the same model as the run's?
    Then take the folder (lock and holder), re-check it, and pass on the plan's warnings and
    notes (``say`` prints a note)."""
    out_dir = Path(cfg.output_dir)
    if plan.marker is not None:
        check_same_model(model_config, plan.marker["run"].get("model_config"), f"checkpoint {plan.resume_from}")
    elif plan.record is not None:
        check_same_model(model_config, plan.record.get("model_config"), str(out_dir / RUN_RECORD))
    if lock.acquire():
        again = plan_run(cfg)  # another process may have started a run here meanwhile
        if again.resume_from != plan.resume_from:
            raise FileExistsError(f"--output-dir {out_dir} changed while this run was starting; "
                                  "run the command again.")
    for message in plan.warnings:
        warn(message)
    for message in plan.notes:
        say(message)


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
    _trim_logs(out_dir, step)
    return changed


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
