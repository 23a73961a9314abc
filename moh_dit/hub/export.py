"""Share a trained MoH-DiT like any diffusers model: a pipeline folder that carries its own code.

:func:`export_pipeline` (``moh-dit export``) loads a model the way
``moh_dit.sampling.sample.load_pipeline`` does and writes a folder that
``diffusers.DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` loads without
moh-dit installed, through diffusers' custom-pipeline and custom-component files::

    model_index.json          _class_name ["pipeline_moh_dit", "MoHDiTPipeline"],
                              transformer ["transformer_moh_dit", "MoHDiTTransformer2DModel"]
    pipeline_moh_dit.py       the pipeline module and the modules it imports, in one file
    transformer/              config.json, diffusion_pytorch_model[.VARIANT].safetensors,
                              transformer_moh_dit.py (the transformer and its modules, in one file)
    scheduler/, vae/          as save_pretrained writes them (no vae/ for pixel-space models)
    README.md                 the model card (moh_dit.hub.model_card)
    export_info.json          what wrote the folder, from what, and the code files' SHA-256

The two ``.py`` files are built from the package's source at export time by
:func:`moh_dit.hub.bundle.bundle_module`, so they cannot drift from it. With moh-dit installed,
``MoHDiTPipeline.from_pretrained(folder)`` and ``load_pipeline(folder)`` load the same
weights with the package's own classes, without running the folder's files
(:mod:`moh_dit.hub.export_format`, which also names the module files).

Every argument is checked before any work; the folder is built in a temporary sibling and
appears complete or not at all (``io_utils.publish_folder``), and ``overwrite`` replaces
only an earlier export. Pushing to the Hub happens after the local folder is complete, in
one commit; a repository this call created is deleted again if the upload fails.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
from tqdm.auto import tqdm

from .. import __version__
from ..errors import DamagedFile, InputNotFound, InvalidInput
from ..app import SPACE_BUNDLE, space_card, space_files
from .bundle import bundle_module
from .export_format import PIPELINE_MODULE, TRANSFORMER_MODULE
from ..utils.io import publish_folder, sha256_file, write_bytes_atomic, write_json_atomic
from .model_card import HEAD_USAGE_PLOT, model_card
from ..utils.output_folders import OUTPUT_MARKER, check_outside_inputs, hold_output_folder, write_output_marker
from .outputs import check_replaceable, local_path, naming_write_errors
from ..sampling.sample import check_model_flags, load_pipeline, model_folder
from ..sampling.sweep_results import JSON_FILE as SWEEP_JSON
from ..training import RUN_RECORD

__all__ = [
    "VARIANTS",
    "PIPELINE_MODULE",
    "TRANSFORMER_MODULE",
    "INFO_FILE",
    "HubPushError",
    "ExportSource",
    "resolve_model",
    "read_head_usage",
    "read_metrics",
    "read_sweep",
    "is_export",
    "export_pipeline",
    "push_folder",
]

VARIANTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
INFO_FILE = "export_info.json"
EXPORTED_BY = "moh_dit.hub.export"
_METRIC_KEYS = ("fid", "sfid", "inception_score", "precision", "recall")
# Weight formats that unpickle (run code) on load; an export holds safetensors only.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class HubPushError(RuntimeError):
    """The export is complete on disk but could not be pushed to the Hub (network, login)."""


@dataclass(frozen=True)
class ExportSource:
    """What ``model`` resolves to: the folder ``load_pipeline`` reads (a pipeline or a
    transformer folder) and the training record found beside it, if any."""

    model_dir: Path
    is_pipeline: bool
    record: dict[str, Any] | None
    record_path: Path | None


def _read_json(path: Path, parameter: str, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise DamagedFile(f"{parameter} {path}: cannot read it as JSON ({type(error).__name__}: {error}); give {what}.",
                          parameters=parameter) from None


def resolve_model(model: str | os.PathLike, vae: str | None = None) -> ExportSource:
    """``model``: a training run folder (its ``final/`` pipeline, with the run's VAE, is
    exported and its ``train_config.json`` goes into the card), a run's ``final/``, a pipeline
    folder or a ``save_pretrained`` transformer folder. A latent transformer folder needs ``vae``."""
    check_model_flags(str(model), vae)
    path = model_folder(model)
    record_path = path.parent / RUN_RECORD if path.name == "final" and (path.parent / RUN_RECORD).is_file() else None
    record = None
    if record_path is not None:
        record = _read_json(record_path, "model", "a run folder whose train_config.json moh-dit train wrote")
        if not isinstance(record, dict):
            raise DamagedFile(f"model {model}: {record_path} is not a training record; restore it or export final/ "
                              "alone from a copy without it.", parameters="model")
    is_pipeline = (path / "model_index.json").is_file()
    if not is_pipeline:
        if not (path / "config.json").is_file():
            raise InputNotFound(f"model {model} is neither a training run, a pipeline folder (model_index.json) "
                               "nor a transformer folder (config.json).", parameters="model")
        config = _read_json(path / "config.json", "model", "a save_pretrained transformer folder")
        channels = config.get("in_channels") if isinstance(config, dict) else None
        if channels not in (1, 3) and (vae is None or vae.lower() == "none"):
            raise InvalidInput(f"model {model} takes {channels}-channel latents: give its VAE as vae, e.g. "
                               "stabilityai/sd-vae-ft-ema.", parameters=("model", "vae"))
    return ExportSource(model_dir=path, is_pipeline=is_pipeline, record=record, record_path=record_path)


def read_metrics(path: str | os.PathLike) -> dict[str, Any]:
    """``metrics``: the JSON result ``moh-dit evaluate`` writes (fid, sfid, ...)."""
    path = Path(path)
    advice = "the JSON result moh-dit evaluate writes"
    if not path.is_file():
        raise InputNotFound(f"metrics {path} {'is a folder' if path.is_dir() else 'does not exist'}; give {advice}.",
                           parameters="metrics")
    values = _read_json(path, "metrics", advice)
    if not isinstance(values, dict) or not any(key in values for key in _METRIC_KEYS):
        raise InvalidInput(f"metrics {path} holds none of {', '.join(_METRIC_KEYS)}; give {advice}.",
                           parameters="metrics")
    for key in _METRIC_KEYS:
        value = values.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InvalidInput(f"metrics {path}: {key} is {value!r}, not a number; give {advice}.",
                               parameters="metrics")
    return values


def read_sweep(path: str | os.PathLike) -> dict[str, Any]:
    """``sweep``: a head-ratio sweep's output folder (or its ``sweep.json``), as
    ``moh_dit.sampling.sweep_results.write_sweep`` writes it: ``settings`` and one row per ratio."""
    path = Path(path)
    file = path / SWEEP_JSON if path.is_dir() else path
    advice = f"the output folder of moh-dit's head-ratio sweeps (it holds {SWEEP_JSON})"
    if not file.is_file():
        raise InputNotFound(f"sweep {path}: {file} does not exist; give {advice}.", parameters="sweep")
    results = _read_json(file, "sweep", advice)
    rows = results.get("rows") if isinstance(results, dict) else None
    if not isinstance(rows, list) or not rows or not isinstance(results.get("settings", {}), dict):
        raise InvalidInput(f"sweep {file} has no rows of results; give {advice}.", parameters="sweep")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "ratio" not in row or "realised_ratio" not in row:
            raise InvalidInput(f"sweep {file}: row {i} is not a row of results (ratio, realised_ratio, fid, ...); "
                               f"give {advice}.", parameters="sweep")
    return results


def is_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder this module wrote (``overwrite`` replaces only those)."""
    info = Path(path) / INFO_FILE
    try:
        return json.loads(info.read_text(encoding="utf-8")).get("exported_by") == EXPORTED_BY
    except (OSError, ValueError, AttributeError):
        return False


def check_repo_id(repo_id: str) -> None:
    """``push_to_hub``: a Hub model id, ``name`` or ``org/name``."""
    from huggingface_hub.utils import validate_repo_id

    if repo_id.count("/") > 1 or Path(repo_id).expanduser().exists():
        raise InvalidInput(f"push_to_hub {repo_id!r} is not a Hub repository id; give name or org/name.",
                           parameters="push_to_hub")
    try:
        validate_repo_id(repo_id)
    except ValueError as error:
        raise InvalidInput(f"push_to_hub {repo_id!r} is not a Hub repository id ({error}); give name or org/name.",
                           parameters="push_to_hub") from None


def _rewrite_index(folder: Path) -> None:
    """Point ``model_index.json`` at the module files in the folder instead of the package."""
    path = folder / "model_index.json"
    index = json.loads(path.read_text(encoding="utf-8"))
    pipeline_class, transformer_class = index["_class_name"], index["transformer"][1]
    if isinstance(pipeline_class, list):  # save_pretrained already names its loader module
        pipeline_class = pipeline_class[1]
    index["_class_name"] = [PIPELINE_MODULE, pipeline_class]
    index["transformer"] = [TRANSFORMER_MODULE, transformer_class]
    index.pop("_name_or_path", None)  # a path on the exporting machine
    write_json_atomic(path, index, sort_keys=True)


def _write_code(folder: Path, app: bool = False) -> dict[str, list[str]]:
    """The pipeline's and the transformer's one-file modules (and, with ``app``, the app's: docs/app.md);
    returns file -> bundled modules."""
    written = {}
    for file, entry in ((f"{PIPELINE_MODULE}.py", "moh_dit.pipelines.pipeline_moh_dit"),
                        (f"transformer/{TRANSFORMER_MODULE}.py", "moh_dit.models.transformer_moh_dit"),
                        *([(f"{SPACE_BUNDLE}.py", "moh_dit.app")] if app else [])):
        bundle = bundle_module(entry, __version__)
        write_bytes_atomic(folder / file, bundle.source.encode("utf-8"))
        written[file] = list(bundle.modules)
    return written


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _write_weights(pipe, folder: Path, variant: str | None) -> None:
    """Full-precision weights, plus ``variant`` copies under diffusers' variant names (each
    model reloaded in that dtype, as diffusers casts on loading)."""
    pipe.save_pretrained(folder, safe_serialization=True)
    if variant is not None:
        for name in ("transformer", "vae"):
            model = getattr(pipe, name)
            if model is not None:
                half = type(model).from_pretrained(folder / name, torch_dtype=VARIANTS[variant])
                half.save_pretrained(folder / name, safe_serialization=True, variant=variant)
    unsafe = [name for name in _files(folder) if name.endswith(_PICKLE_SUFFIXES)]
    if unsafe:
        raise RuntimeError(f"save_pretrained wrote pickle weights {unsafe}; the export holds safetensors only.")


def read_head_usage(path: str | os.PathLike) -> tuple[dict[str, Any], bytes | None]:
    """``head_usage``: the output folder of ``moh-dit plot-head-usage`` (or its
    ``head_usage.json``): the measured usage, checked, and the figure's PNG bytes if present."""
    from ..evaluation.head_usage import JSON_FILE as USAGE_JSON, PLOT_FILE as USAGE_PNG, HeadUsage

    path = Path(path).expanduser()
    file = path / USAGE_JSON if path.is_dir() else path
    advice = f"the output folder of moh-dit plot-head-usage (it holds {USAGE_JSON})"
    if not file.is_file():
        raise InputNotFound(f"head_usage {path}: {file} does not exist; give {advice}.", parameters="head_usage")
    usage = _read_json(file, "head_usage", advice)
    try:
        HeadUsage.from_dict(usage)
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        raise InvalidInput(f"head_usage {file} is not a head-usage record ({error}); give {advice}.",
                           parameters="head_usage") from None
    png = file.parent / USAGE_PNG
    return usage, png.read_bytes() if png.is_file() else None


@dataclass(frozen=True)
class _Request:
    """Every checked argument of one export."""

    source: ExportSource
    output: Path
    vae: str | None
    variant: str | None
    metrics: dict[str, Any] | None
    sweep: dict[str, Any] | None
    head_usage: tuple[dict[str, Any], bytes | None] | None
    repo_id: str | None
    license: str
    model_label: str


def _check_output(out: Path, overwrite: bool) -> None:
    """``output_dir``: created, or an empty folder, or with ``overwrite`` an earlier export
    (marked by moh-dit export, or with :data:`INFO_FILE`); nothing else is replaced."""
    empty = out.is_dir() and not any(out.iterdir())
    check_replaceable(out, overwrite or empty, "export", is_export, f"an export of {EXPORTED_BY} (it has {INFO_FILE})",
                      "output_dir")


def _check_request(model, output_dir, vae, variant, sweep, metrics, push_to_hub, overwrite, license,
                   head_usage=None) -> _Request:
    """All the checks, in the order of the parameters, before anything is loaded or written."""
    source = resolve_model(model, vae)
    if variant is not None and variant not in VARIANTS:
        raise InvalidInput(f"variant {variant!r}: choose one of {', '.join(VARIANTS)} (or leave it out).",
                           parameters="variant")
    metrics_dict = None if metrics is None else read_metrics(metrics)
    sweep_dict = None if sweep is None else read_sweep(sweep)
    if head_usage is None and sweep is not None:  # a sweep's own head-usage figure, if it drew one
        folder = Path(sweep).expanduser()
        folder = (folder if folder.is_dir() else folder.parent) / "head_usage"
        head_usage = folder if (folder / "head_usage.json").is_file() else None
    usage = None if head_usage is None else read_head_usage(head_usage)
    if push_to_hub is not None:
        check_repo_id(push_to_hub)
    if not license or any(c.isspace() for c in license):
        raise InvalidInput(f"license {license!r}: give a Hub license id such as apache-2.0 or cc-by-nc-4.0.",
                           parameters="license")
    out = Path(output_dir).expanduser()
    _check_output(out, overwrite)
    vae_path = None if vae is None or vae.lower() == "none" else local_path(vae)
    check_outside_inputs(out, {"model": Path(model).expanduser(), "vae": vae_path, "sweep": sweep,
                               "metrics": metrics, "head_usage": head_usage}, "output_dir")
    return _Request(source=source, output=out, vae=vae, variant=variant, metrics=metrics_dict, sweep=sweep_dict,
                    head_usage=usage, repo_id=push_to_hub, license=license, model_label=str(model))


def export_pipeline(
    model: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    vae: str | None = None,
    variant: str | None = None,
    sweep: str | os.PathLike | None = None,
    metrics: str | os.PathLike | None = None,
    head_usage: str | os.PathLike | None = None,
    push_to_hub: str | None = None,
    overwrite: bool = False,
    license: str = "apache-2.0",
    private: bool | None = None,
    token: str | None = None,
    progress: bool = True,
    app: bool = False,
) -> Path:
    """Export ``model`` (see :func:`resolve_model`) as a self-contained pipeline folder ``output_dir``.

    ``vae``: an ``AutoencoderKL`` folder or Hub id, or ``"none"``; default: a pipeline
    folder's own (a latent transformer folder needs one). ``variant``: also write ``fp16`` or
    ``bf16`` weights under diffusers' variant names. ``sweep`` / ``metrics``: results for the
    model card; ``head_usage``: a ``moh-dit plot-head-usage`` output, whose figure goes into
    the folder and the card (default: the sweep's ``head_usage/``, when it has one). ``push_to_hub``: a Hub repository id to upload the finished folder to
    (``private`` / ``token`` for a new repository). ``overwrite`` replaces an earlier export
    (never another folder). ``license``: the Hub license id in the card. ``app``: also write
    ``app.py`` and its code, so that the folder runs as a Gradio app and a Hugging Face Space
    (:func:`moh_dit.app.space_files`, docs/app.md). Returns ``output_dir``.
    Raises ValueError / FileNotFoundError / FileExistsError for bad arguments (before any
    work) and :class:`HubPushError` when the folder is written but the push failed.
    """
    request = _check_request(model, output_dir, vae, variant, sweep, metrics, push_to_hub, overwrite, license,
                             head_usage)
    with hold_output_folder(request.output, "export", "output_dir"):
        _export(request, overwrite, private, token, progress, app)
    return request.output


def _export(request: _Request, overwrite: bool, private: bool | None, token: str | None, progress: bool,
            app: bool = False) -> None:
    """The checked export: load, write the folder beside ``request.output`` and publish it, push it."""
    vae, variant, push_to_hub, license = request.vae, request.variant, request.repo_id, request.license
    stages = ["load", "weights", "code", "card"] + (["push"] if push_to_hub else [])
    bar = tqdm(total=len(stages), desc="export", unit="step", disable=not progress)
    source = request.source
    pipe = load_pipeline(source.model_dir, vae=vae, scheduler="saved" if source.is_pipeline else "ddpm")
    bar.update()
    _check_output(request.output, overwrite)  # again under the lock: the folder may have appeared since
    with naming_write_errors(request.output), publish_folder(request.output, replace=request.output.exists()) as tmp:
        _write_weights(pipe, tmp, variant)
        _rewrite_index(tmp)
        bar.update()
        code = _write_code(tmp, app)
        for name, text in (space_files(request.output.name) if app else {}).items():
            write_bytes_atomic(tmp / name, text.encode("utf-8"))
        usage, figure = request.head_usage or (None, None)
        if figure is not None:
            write_bytes_atomic(tmp / HEAD_USAGE_PLOT, figure)
        bar.update()
        card = model_card(pipe, title=request.output.name, repo=push_to_hub or str(request.output), license=license,
                          record=source.record, metrics=request.metrics, sweep=request.sweep, variant=variant,
                          files=sorted(_files(tmp) + ["README.md", INFO_FILE]), head_usage=usage)
        card = space_card(card) if app else card
        write_bytes_atomic(tmp / "README.md", card.encode("utf-8"))
        write_json_atomic(tmp / INFO_FILE, {
            "exported_by": EXPORTED_BY, "moh_dit_version": __version__, "diffusers_version": diffusers.__version__,
            "torch_version": torch.__version__, "source": request.model_label,
            "training_record": None if source.record_path is None else source.record_path.name,
            "variant": variant, "bundled_modules": code,
            "code_sha256": {name: sha256_file(tmp / name) for name in code},
        })
        write_output_marker(tmp, "export")  # local bookkeeping: not in the card's file list, never pushed
        bar.update()
    if push_to_hub:
        push_folder(request.output, push_to_hub, token=token, private=private)
        bar.update()
    bar.close()


def _network_message(error: BaseException, repo_id: str, folder: Path) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    later = (f"the export is complete in {folder}; push it later with "
             f"`hf upload {repo_id} {folder} --exclude {OUTPUT_MARKER}`")
    if isinstance(error, OfflineModeIsEnabled):
        return f"cannot push to the Hugging Face Hub: offline mode is on (HF_HUB_OFFLINE=1); {later}"
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, HfHubHTTPError) and status in (401, 403):
        return (f"the Hugging Face Hub refused the push to {repo_id} (HTTP {status}): log in with `hf auth login` or "
                f"set HF_TOKEN to a token with write access; {later}")
    return (f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} to push {repo_id} "
            f"({type(error).__name__}: {error}); {later}")


def push_folder(folder: str | os.PathLike, repo_id: str, *, token: str | None = None, private: bool | None = None,
                api=None) -> str:
    """Upload a finished export to the Hub model repository ``repo_id`` in one commit.

    The repository is created if needed; if this call created it and the upload then fails,
    it is deleted again, so no empty or half-filled repository is left. Network, offline and
    login problems raise :class:`HubPushError` with the cause. Returns the commit URL.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HTTPError

    api = api if api is not None else HfApi(token=token)
    folder = Path(folder)
    created = False
    try:
        if not api.repo_exists(repo_id):
            api.create_repo(repo_id, private=private, exist_ok=True)
            created = True
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, ignore_patterns=[OUTPUT_MARKER],
                                   commit_message=f"MoH-DiT pipeline exported by moh-dit {__version__}")
    except (HTTPError, OSError) as error:
        if created:
            try:
                api.delete_repo(repo_id, missing_ok=True)
            except (HTTPError, OSError):
                pass  # the push error below is the one to report
        raise HubPushError(_network_message(error, repo_id, folder)) from error
    return str(getattr(commit, "commit_url", commit))

