"""A trained MoH-DiT as a pipeline folder that carries its own code, with a model card; optionally pushed.

The folder loads with ``MoHDiTPipeline.from_pretrained(folder)`` and, without moh-dit installed, with
``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)``::

    model_index.json        _class_name ["pipeline_moh_dit", "MoHDiTPipeline"],
                            transformer ["transformer_moh_dit", "MoHDiTTransformer2DModel"]
    pipeline_moh_dit.py     the package's pipeline file, copied as it is (torch and diffusers only)
    transformer/            config.json (with diffusers' auto_map), the weights, and
                            transformer_moh_dit.py, the package's model file, copied as it is
    scheduler/, vae/        as save_pretrained writes them (no vae/ for a pixel-space model)
    README.md               the model card
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..models import PRESETS, HeadLayout
from ..outputs import MARKER, output_folder, read_json, write_json

__all__ = ["VARIANTS", "export_pipeline", "model_card", "push_folder"]

VARIANTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
PIPELINE_FILE, TRANSFORMER_FILE = "pipeline_moh_dit", "transformer_moh_dit"
HEAD_USAGE_PLOT = "head_usage.png"  # what moh-dit plot-head-usage draws
CITATION = """@inproceedings{jin2025moh,
  title     = {MoH: Multi-Head Attention as Mixture-of-Head Attention},
  author    = {Jin, Peng and Zhu, Bo and Yuan, Li and Yan, Shuicheng},
  booktitle = {Proceedings of the 42nd International Conference on Machine Learning (ICML)},
  year      = {2025},
  note      = {arXiv:2410.11842}
}"""
_METRICS = {"fid": "FID", "sfid": "sFID", "inception_score": "IS", "precision": "precision", "recall": "recall",
            "class_accuracy": "class accuracy"}
_SPACE_APP = '''"""moh-dit's app on this folder's pipeline: a Hugging Face Space (Gradio SDK), or `python app.py`."""

from pathlib import Path

import torch

from moh_dit import MoHDiTPipeline
from moh_dit.app import build_app

pipe = MoHDiTPipeline.from_pretrained(Path(__file__).resolve().parent)
pipe.to("cuda" if torch.cuda.is_available() else "cpu")
demo = build_app(pipe, title={title!r})

if __name__ == "__main__":
    demo.launch()
'''
_SPACE_REQUIREMENTS = "# where the name does not resolve: moh-dit @ git+<its repository URL>\nmoh-dit\n"


def _edit_json(path: Path, **values: Any) -> None:
    """Set ``values`` in a JSON file and drop ``_name_or_path`` (a path on the exporting machine)."""
    data = read_json(path)
    data.pop("_name_or_path", None)
    write_json(path, {**data, **values}, sort_keys=True)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cell = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(map(cell, row)) + " |" for row in rows), ""]


def model_card(pipe, *, title: str, repo: str, license: str = "apache-2.0", record: dict | None = None,
               metrics: dict | None = None, sweep: dict | list | None = None, head_usage_plot: bool = False,
               variant: str | None = None, app: bool = False) -> str:
    """The ``README.md`` of an exported ``pipe``: YAML metadata, the model and its heads, the training
    record (``train_config.json``), ``moh-dit evaluate``'s metrics, a sweep's rows, the head-usage
    figure, how to load it, and the paper. ``repo`` is what the snippet passes to ``from_pretrained``."""
    from huggingface_hub import ModelCardData

    transformer, cfg = pipe.transformer, pipe.transformer.config
    layout, (low, high) = HeadLayout.of_config(cfg), transformer.head_activation_range
    data_keys = ("sample_size", "num_classes", "class_dropout_prob", "class_names")
    presets = [n for n, p in PRESETS.items() if all(cfg.get(k) == v for k, v in p.items() if k not in data_keys)]
    data = ModelCardData(library_name="diffusers", pipeline_tag="unconditional-image-generation", license=license,
                         tags=["moh-dit", "mixture-of-head-attention", "diffusion-transformer", "dit",
                               "class-conditional-image-generation"], **({"sdk": "gradio", "app_file": "app.py"}
                                                                          if app else {}))
    size = f"{cfg.in_channels} x {cfg.sample_size} x {cfg.sample_size}"
    preset = (record or {}).get("preset") or " / ".join(presets) or "a custom layout"
    lines = ["---", data.to_yaml(), "---", "", f"# {title}", "",
             "A class-conditional diffusion transformer with Mixture-of-Head attention (MoH-DiT; Jin et al., 2025) "
             f"for diffusers, exported by moh-dit: {preset}, {sum(p.numel() for p in transformer.parameters()):,} "
             f"parameters, {cfg.num_classes} classes "
             f"(class {cfg.num_classes}: unconditional), {size} {'latents of its VAE' if pipe.vae else 'images'}. "
             f"Trained head activation {layout.activation_ratio():.4f}; it samples at any activation in "
             f"[{low:.4f}, {high:.4f}] (`head_activation_ratio=` in the pipeline call).", ""]
    if layout.is_moh:
        rows = [[i, h, s, h - s, k] for i, (h, s, k) in enumerate(zip(layout.heads, layout.shared, layout.top_k))]
        lines += ["## Attention heads", "", "Shared heads are always on; of the routed ones each token uses its "
                  "top-K.", "", *_table(["layer", "heads", "shared", "routed", "top-K"], rows)]
    if record:
        rows = [[f"`{k}`", f"`{v}`"] for k, v in record.items() if isinstance(v, (str, int, float, bool))]
        lines += ["## Training", "", "From the run's `train_config.json`:", "", *_table(["setting", "value"], rows)]
    if metrics:
        keys = [k for k in _METRICS if metrics.get(k) is not None]
        lines += ["## Evaluation", "", *_table([_METRICS[k] for k in keys], [[metrics[k] for k in keys]])]
    if rows := (sweep.get("rows") if isinstance(sweep, dict) else sweep):
        columns = [k for k, v in rows[0].items() if isinstance(v, (str, int, float)) or v is None]
        lines += ["## Head-activation sweep", "", "The same seeds and labels sampled at each head activation:", "",
                  *_table(columns, [[row.get(k) for k in columns] for row in rows])]
    if head_usage_plot:
        lines += ["## Head usage", "", f"![Which heads each layer uses]({HEAD_USAGE_PLOT})", ""]
    half = f', variant="{variant}", torch_dtype={VARIANTS[variant]}' if variant else ""
    lines += ["## Use it", "", "With diffusers alone (the code travels with the weights: read "
              f"`{PIPELINE_FILE}.py` and `transformer/{TRANSFORMER_FILE}.py`):", "", "```python", "import torch",
              "from diffusers import DiffusionPipeline", "",
              f'pipe = DiffusionPipeline.from_pretrained("{repo}", trust_remote_code=True{half})',
              "images = pipe(class_labels=[0, 1], num_inference_steps=250, seeds=[0, 1]).images",
              f"fewer_heads = pipe([0, 1], seeds=[0, 1], head_activation_ratio={(low + high) / 2:.2f}).images",
              "```", "", "With moh-dit installed, `MoHDiTPipeline.from_pretrained(folder)` loads it with the "
              "package's classes.", ""]
    if app:
        lines += ["## App", "", "`python app.py` (with gradio and moh-dit installed) opens a page that samples this "
                  "model at any head activation; the folder also runs as a Hugging Face Space (Gradio SDK).", ""]
    return "\n".join(lines + ["## Citation", "", "```bibtex", CITATION, "```", ""])


def export_pipeline(model: str | os.PathLike, output_dir: str | os.PathLike, *, vae: str | None = None,
                    variant: str | None = None, sweep: str | os.PathLike | None = None,
                    metrics: str | os.PathLike | None = None, head_usage: str | os.PathLike | None = None,
                    push_to_hub: str | None = None, overwrite: bool = False, license: str = "apache-2.0",
                    private: bool | None = None, token: str | None = None, app: bool = False) -> Path:
    """Export ``model`` (a training run folder, a pipeline folder or a model folder, as
    ``moh_dit.sampling.load_pipeline`` reads them, with ``vae``) as a pipeline folder ``output_dir``.

    ``variant``: also ``fp16`` or ``bf16`` weights under diffusers' variant names. ``metrics``
    (``moh-dit evaluate``'s JSON), ``sweep`` (a sweep's folder or its ``sweep.json``) and
    ``head_usage`` (``moh-dit plot-head-usage``'s folder; default: the sweep's ``head_usage/``) go
    into the model card. ``app``: also ``app.py`` and ``requirements.txt``, so that the folder runs as
    a Gradio Space. ``overwrite`` replaces only an earlier export. ``push_to_hub``: a Hub model
    repository to upload the finished folder to (``private`` and ``token`` for a new one).
    """
    from ..sampling import load_pipeline

    model, output_dir = Path(model).expanduser(), Path(output_dir).expanduser()
    run = model if (model / "train_config.json").is_file() else model.parent if model.name == "final" else None
    record = read_json(run / "train_config.json") if run and (run / "train_config.json").is_file() else None
    sweep_file = Path(sweep) / "sweep.json" if sweep and Path(sweep).is_dir() else sweep
    if head_usage is None and sweep_file and (Path(sweep_file).parent / "head_usage" / HEAD_USAGE_PLOT).is_file():
        head_usage = Path(sweep_file).parent / "head_usage"
    figure = Path(head_usage) / HEAD_USAGE_PLOT if head_usage and Path(head_usage).is_dir() else head_usage
    if figure is not None and not Path(figure).is_file():
        raise FileNotFoundError(2, "no head-usage figure", str(figure))
    results = {}
    for name, path in (("metrics", metrics), ("sweep", sweep_file)):
        try:  # a missing file is an OSError that names it
            results[name] = path and read_json(path)
        except ValueError as error:
            raise ValueError(f"{name} {path} is not JSON ({error})") from None
    local = {name: p for name, p in (("model", model), ("vae", vae)) if p and Path(p).expanduser().exists()}
    with output_folder(output_dir, "export", overwrite=overwrite, publish=True,
                       inputs={**local, "metrics": metrics, "sweep": sweep_file, "head_usage": figure}) as tmp:
        pipe = load_pipeline(model, vae=vae)
        pipe.save_pretrained(tmp, safe_serialization=True)
        for name in ("transformer", "vae") if variant else ():
            if getattr(pipe, name, None) is not None:  # as diffusers casts on loading
                half = type(getattr(pipe, name)).from_pretrained(tmp / name, torch_dtype=VARIANTS[variant])
                half.save_pretrained(tmp / name, safe_serialization=True, variant=variant)
        for cls, file in ((type(pipe), tmp / f"{PIPELINE_FILE}.py"),
                          (type(pipe.transformer), tmp / "transformer" / f"{TRANSFORMER_FILE}.py")):
            shutil.copyfile(importlib.import_module(cls.__module__).__file__, file)  # as it is: no moh_dit imports
        # diffusers' AutoModel reads auto_map from model_index.json when given subfolder="transformer"
        auto_map = {"AutoModel": f"{TRANSFORMER_FILE}.{type(pipe.transformer).__name__}"}
        _edit_json(tmp / "model_index.json", _class_name=[PIPELINE_FILE, type(pipe).__name__],
                   transformer=[TRANSFORMER_FILE, type(pipe.transformer).__name__], auto_map=auto_map)
        _edit_json(tmp / "transformer" / "config.json", auto_map=auto_map)
        for config in tmp.glob("*/*config.json"):
            _edit_json(config)
        if figure is not None:
            shutil.copyfile(figure, tmp / HEAD_USAGE_PLOT)
        if app:
            (tmp / "app.py").write_text(_SPACE_APP.format(title=output_dir.name), encoding="utf-8")
            (tmp / "requirements.txt").write_text(_SPACE_REQUIREMENTS, encoding="utf-8")
        card = model_card(pipe, title=output_dir.name, repo=push_to_hub or str(output_dir), license=license,
                          record=record, variant=variant, app=app, head_usage_plot=figure is not None, **results)
        (tmp / "README.md").write_text(card, encoding="utf-8")
    if push_to_hub:
        push_folder(output_dir, push_to_hub, token=token, private=private)
    return output_dir


def push_folder(folder: str | os.PathLike, repo_id: str, *, token: str | None = None,
                private: bool | None = None) -> str:
    """Upload a finished export to the Hub model repository ``repo_id`` (created if needed) in one commit."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, ignore_patterns=[MARKER],
                                   commit_message="MoH-DiT pipeline exported by moh-dit")
    except Exception as error:  # network, login, offline mode: the export itself is complete
        raise RuntimeError(f"the export is complete in {folder}, but pushing it to {repo_id} failed ({error}); push "
                           f"it later with `hf upload {repo_id} {folder} --exclude {MARKER}`") from error
    return str(commit.commit_url)
