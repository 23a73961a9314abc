"""The model card (``README.md``) of an exported pipeline folder, in the Hugging Face Hub's format.

A YAML metadata header (library, pipeline tag, license, tags) and then, from the pipeline and
the files given: the model (preset, size, classes, VAE), its per-layer head layout, the head
activation it was trained at and the range it can run at, the training recipe from the run's
``train_config.json``, evaluation results (``moh-dit evaluate``'s JSON), a head-ratio
sweep (``sweep.json``), the head-usage figure (``head_usage.png``, written by
``moh_dit.evaluation.head_usage.write_head_usage`` into the folder) and a table of its numbers,
how to load and sample it, and the MoH paper's citation.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import diffusers
from huggingface_hub import ModelCardData

from ..models.layout import HeadLayout
from ..models.presets import PRESETS

__all__ = ["HEAD_USAGE_PLOT", "PIPELINE_TAG", "TAGS", "CITATION", "match_presets", "model_card"]

# The Hub has no class-conditional image task; its image-generation task without a text or
# image input is the closest, and the tags say what the condition is.
PIPELINE_TAG = "unconditional-image-generation"
TAGS = ["moh-dit", "mixture-of-head-attention", "diffusion-transformer", "dit", "class-conditional-image-generation"]
CITATION = """@inproceedings{jin2025moh,
  title     = {MoH: Multi-Head Attention as Mixture-of-Head Attention},
  author    = {Jin, Peng and Zhu, Bo and Yuan, Li and Yan, Shuicheng},
  booktitle = {Proceedings of the 42nd International Conference on Machine Learning (ICML)},
  year      = {2025},
  note      = {arXiv:2410.11842}
}"""
# Constructor arguments that fix the architecture (not the data: sample size, classes, names).
_ARCHITECTURE = ("patch_size", "in_channels", "learn_sigma", "hidden_size", "num_layers", "attention_head_dim",
                 "mlp_ratio", "gate_mode")
_RECIPE = (  # train_config.json key, row label
    ("preset", "preset"), ("max_steps", "steps"), ("global_batch_size", "global batch"),
    ("learning_rate", "learning rate"), ("weight_decay", "weight decay"), ("warmup_steps", "warm-up steps"),
    ("max_grad_norm", "gradient clipping"), ("ema_decay", "EMA decay"), ("class_dropout", "class dropout"),
    ("lb_coeff", "load-balance coefficient"), ("mixed_precision", "mixed precision"), ("random_flip", "horizontal flips"),
    ("image_size", "image size"), ("vae", "VAE"), ("seed", "seed"),
)
_METRICS = (("fid", "FID"), ("sfid", "sFID"), ("inception_score", "IS"), ("precision", "precision"), ("recall", "recall"))
_CLASS_ACCURACY = (("class_accuracy", "class accuracy"),)  # only when a classifier measured it
HEAD_USAGE_PLOT = "head_usage.png"  # moh_dit.evaluation.head_usage.PLOT_FILE: embedded when the folder has it


def match_presets(config: dict[str, Any]) -> list[str]:
    """The presets whose architecture (layers, widths, per-layer heads, shared heads and top-K,
    patch, channels) equals ``config``'s; sample size and classes may differ."""
    defaults = {"mlp_ratio": 4.0, "gate_mode": "release", "learn_sigma": True}
    layout = HeadLayout.of_config(config)
    names = []
    for name, preset in PRESETS.items():
        same = all(preset.get(key, defaults.get(key)) == config.get(key, defaults.get(key)) for key in _ARCHITECTURE)
        if same and HeadLayout.of_config(preset) == layout:
            names.append(name)
    return names


def _number(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if math.isfinite(value) else str(value)
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def _model_section(pipe, preset: str) -> list[str]:
    transformer, cfg = pipe.transformer, pipe.transformer.config
    params = sum(p.numel() for p in transformer.parameters())
    tokens = (cfg.sample_size // cfg.patch_size) ** 2
    vae = pipe.vae
    space = (f"latent ({cfg.in_channels} x {cfg.sample_size} x {cfg.sample_size}); VAE `AutoencoderKL`, "
             f"scaling factor {vae.config.scaling_factor}" if vae is not None else
             f"pixel space ({cfg.in_channels} x {cfg.sample_size} x {cfg.sample_size} images in [-1, 1])")
    names = list(pipe.id2label.values())
    classes = f"{cfg.num_classes}" + (f" ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})" if names else "")
    rows = [("preset", preset), ("parameters", f"{params:,}"), ("layers / hidden size", f"{cfg.num_layers} / {cfg.hidden_size}"),
            ("patch size / tokens", f"{cfg.patch_size} / {tokens}"), ("inputs", space), ("classes", classes),
            ("null class (guidance)", cfg.num_classes), ("learned variance", cfg.learn_sigma),
            ("gates", f"`{cfg.gate_mode}`" if transformer.is_moh else "dense attention (no routers)"),
            ("scheduler", type(pipe.scheduler).__name__)]
    return ["## Model", "", *_table(("", ""), rows), ""]


def _heads_section(transformer) -> list[str]:
    if not transformer.is_moh:
        return ["## Attention heads", "", f"A dense DiT: every layer uses all of its heads "
                f"({', '.join(str(h) for h in transformer.layer_heads)}).", ""]
    rows = []
    for i, (h, s, k) in enumerate(zip(transformer.layer_heads, transformer.layer_shared, transformer.trained_top_k)):
        rows.append((i, h, s, h - s, k, f"{(s + k) / h:.3f}"))
    low, high = transformer.head_activation_range
    total = sum(transformer.layer_heads)
    active = sum(s + k for s, k in zip(transformer.layer_shared, transformer.trained_top_k))
    return [
        "## Attention heads (Mixture-of-Head)", "",
        "Each layer has shared heads (always on) and routed heads, of which every token selects its top-K; the "
        "selected heads' outputs are weighted by the routers' gates (Jin et al., 2025).", "",
        *_table(("layer", "heads", "shared", "routed", "top-K", "active"), rows), "",
        f"Trained head activation: **{active}/{total} = {transformer.trained_head_activation_ratio:.4f}** "
        "(head-weighted: sum of shared + top-K over all heads).", "",
        f"It can run at any head activation in **[{low:.4f}, {high:.4f}]**: pass `head_activation_ratio=` to the "
        "pipeline call (shared heads stay on; routed heads are added or dropped in proportion per layer).", "",
    ]


def _recipe_section(record: dict[str, Any] | None) -> list[str]:
    if not record:
        return ["## Training", "", "No training record (`train_config.json`) came with this model.", ""]
    rows = [(label, f"`{record[key]}`") for key, label in _RECIPE if key in record]
    data = record.get("latents_dir") or record.get("data_dir")
    if data:
        rows.append(("data", f"`{data}`" + (" (latent cache)" if record.get("latents_dir") else "")))
    return ["## Training", "", "From the run's `train_config.json`:", "", *_table(("", ""), rows), ""]


def _metrics_section(metrics: dict[str, Any] | None) -> list[str]:
    if not metrics:
        return []
    columns = _METRICS + (_CLASS_ACCURACY if metrics.get("class_accuracy") is not None else ())
    header = [label for key, label in columns]
    lines = ["## Evaluation", "", *_table(header, [[_number(metrics.get(key)) for key, _ in columns]]), ""]
    facts = [f"{metrics['num_samples']:,} samples" if isinstance(metrics.get("num_samples"), int) else None,
             f"reference `{metrics['reference']}`" if metrics.get("reference") else None,
             f"features: {metrics['extractor']}" if metrics.get("extractor") else None]
    lines += [", ".join(f for f in facts if f) + ".", ""] if any(facts) else []
    if "comparable_to_published" in metrics:
        lines += ["Computed as the ADM evaluator does (comparable to published numbers)." if metrics["comparable_to_published"]
                  else "**Not comparable to published numbers** (not the ADM evaluator's Inception weights).", ""]
    return lines


def _sweep_section(sweep: dict[str, Any] | None) -> list[str]:
    if not sweep:
        return []
    settings = sweep.get("settings", {})
    columns = _METRICS + (_CLASS_ACCURACY if any(r.get("class_accuracy") is not None for r in sweep["rows"]) else ())
    rows = []
    for row in sweep["rows"]:
        rows.append((row.get("ratio"), _number(row.get("realised_ratio")), *(_number(row.get(k)) for k, _ in columns),
                     _number(row.get("attention_flop_ratio"), 3),
                     _number(row["sampling_seconds"] / row["num_samples"], 3) if row.get("num_samples") else "-"))
    header = ("ratio", "realised", *(label for _, label in columns), "attention FLOPs vs dense", "s / image")
    what = [f"{settings[k]} {label}" for k, label in (("num_samples", "samples per ratio"),
            ("num_inference_steps", "sampling steps"), ("guidance_scale", "guidance scale")) if k in settings]
    lines = ["## Head-activation sweep", "", "The same seeds and labels sampled at each head activation ratio"
             + (f" ({', '.join(what)})" if what else "") + ":", "", *_table(header, rows), ""]
    if "comparable_to_published" in settings and not settings["comparable_to_published"]:
        lines += ["**Not comparable to published numbers** (not the ADM evaluator's Inception weights).", ""]
    return lines


def _routed_balance(loads: Sequence[float]) -> tuple[str, str]:
    """(min-max, coefficient of variation) of a layer's routed loads; "-" for fewer than two."""
    if len(loads) < 2:
        return "-", "-"
    mean = sum(loads) / len(loads)
    spread = math.sqrt(sum((x - mean) ** 2 for x in loads) / (len(loads) - 1))
    return f"{min(loads):.3f}-{max(loads):.3f}", f"{spread / mean:.3f}" if mean > 0 else "-"


def _head_usage_section(head_usage: Any, files: Sequence[str]) -> list[str]:
    """The head-usage figure when the folder has :data:`HEAD_USAGE_PLOT`, and the per-layer
    balance of the routed heads from ``head_usage`` (``HeadUsage`` or its ``to_dict()``)."""
    has_plot = HEAD_USAGE_PLOT in files
    if head_usage is None and not has_plot:
        return []
    lines = ["## Head usage", "", "The load of a head is the fraction of tokens that use it: shared heads are always on "
             "(load 1); each token picks its top-K of a layer's routed heads, so perfectly balanced routing gives every "
             "routed head K / routed.", ""]
    if has_plot:
        lines += [f"![Head usage per layer and head: overall, per class and per timestep range]({HEAD_USAGE_PLOT})", ""]
    if head_usage is not None:
        from ..evaluation.head_usage import HeadUsage

        usage = head_usage if isinstance(head_usage, HeadUsage) else HeadUsage.from_dict(head_usage)
        rows = []
        for i, (loads, s, k) in enumerate(zip(usage.overall, usage.shared_heads, usage.top_k)):
            routed = loads[s:]
            rows.append((i, s, len(routed), k, f"{k / len(routed):.3f}" if routed else "-", *_routed_balance(routed)))
        settings = usage.settings
        measured = (f" ({len(settings.get('classes', {}))} classes x {settings.get('images_per_class')} images, "
                    f"{settings.get('num_inference_steps')} steps)" if settings.get("source") == "sampling" else "")
        lines += [f"Routed-head loads over everything measured{measured}; CV is the coefficient of variation "
                  "(0 = perfectly balanced):", "",
                  *_table(("layer", "shared", "routed", "top-K", "balanced load", "routed loads", "CV"), rows), ""]
    return lines


def _usage_section(pipe, repo: str, variant: str | None) -> list[str]:
    names = list(pipe.id2label.values())[:2]
    labels = ", ".join(repr(n.split(",")[0]) for n in names) if len(names) == 2 else "0, 1"
    cfg = pipe.transformer.config
    dtype = {"fp16": "torch.float16", "bf16": "torch.bfloat16"}.get(variant or "")
    half = (f'\n# or the {variant} weights (half the download and memory):\n# pipe = DiffusionPipeline.from_pretrained('
            f'"{repo}", trust_remote_code=True, variant="{variant}", dtype={dtype})' if dtype else "")
    low, trained = pipe.transformer.head_activation_range[0], pipe.transformer.trained_head_activation_ratio
    ratio_line = (f"\nfewer_heads = pipe([{labels}], guidance_scale=1.5, num_inference_steps=250, "
                  f"head_activation_ratio={(low + trained) / 2:.2f}, seeds=[0, 1])"
                  if low < trained else "")
    return [
        "## Use it", "",
        "With diffusers alone (the pipeline's and the transformer's code travel with the model, so it needs "
        "`trust_remote_code=True`; read `pipeline_moh_dit.py` and `transformer/transformer_moh_dit.py` first):", "",
        "```python", "import torch", "from diffusers import DiffusionPipeline", "",
        f'pipe = DiffusionPipeline.from_pretrained("{repo}", trust_remote_code=True){half}',
        'pipe = pipe.to("cuda" if torch.cuda.is_available() else "cpu")',
        f"out = pipe([{labels}], guidance_scale=1.5, num_inference_steps=250, seeds=[0, 1])",
        'out.images[0].save("sample.png")' + ratio_line, "```", "",
        "Class labels are ids or names; `seeds` gives each image its own noise (the same image whatever the batch); "
        f"class id {cfg.num_classes} gives unconditional samples. With "
        "moh-dit installed, the same folder loads with its own classes, without running the folder's files:", "",
        "```python", "from moh_dit import MoHDiTPipeline", "", f'pipe = MoHDiTPipeline.from_pretrained("{repo}")  '
        "# a local folder; for a Hub id pass huggingface_hub.snapshot_download(id)", "```", "",
    ]


def model_card(
    pipe, *, title: str, repo: str, license: str = "apache-2.0", preset: str | None = None,
    record: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
    sweep: dict[str, Any] | None = None, variant: str | None = None, files: Sequence[str] = (),
    head_usage: Any = None,
) -> str:
    """The text of ``README.md`` for an exported ``pipe``.

    ``repo`` is what the loading snippet passes to ``from_pretrained`` (a Hub id or a folder);
    ``preset`` defaults to the record's, else to the presets whose architecture matches;
    ``record`` / ``metrics`` / ``sweep`` are the parsed ``train_config.json``, evaluation JSON
    and ``sweep.json``; ``files`` are listed under "Files", and embedded as the head-usage
    figure when they include :data:`HEAD_USAGE_PLOT`; ``head_usage`` (a
    ``moh_dit.evaluation.head_usage.HeadUsage`` or the ``head_usage.json`` it writes) adds
    the table of routed-head loads.
    """
    if preset is None:
        matches = match_presets(dict(pipe.transformer.config))
        preset = (record or {}).get("preset") or (" / ".join(matches) if matches else "custom layout")
    data = ModelCardData(library_name="diffusers", pipeline_tag=PIPELINE_TAG, license=license, tags=list(TAGS))
    ratio = pipe.transformer.trained_head_activation_ratio
    lines = [
        "---", data.to_yaml(), "---", "", f"# {title}", "",
        f"A class-conditional diffusion transformer with Mixture-of-Head attention (MoH-DiT, preset {preset}, "
        f"trained head activation {ratio:.4f}) for diffusers, exported by moh-dit.", "",
        *_model_section(pipe, preset), *_heads_section(pipe.transformer), *_recipe_section(record),
        *_metrics_section(metrics), *_sweep_section(sweep), *_head_usage_section(head_usage, files),
        *_usage_section(pipe, repo, variant),
    ]
    if files:
        lines += ["## Files", "", *(f"- `{name}`" for name in files), "",
                  f"Written with diffusers {diffusers.__version__}; weights are safetensors only.", ""]
    lines += ["## Citation", "", "```bibtex", CITATION, "```", ""]
    return "\n".join(lines)
