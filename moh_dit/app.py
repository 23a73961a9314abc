"""See MoH at work: a local web app that samples a pipeline at any head activation ratio and shows,
beside the images, the ratio it realised, the attention FLOPs relative to dense, the time taken
and which heads each layer used.

:func:`build_app` builds the Gradio ``Blocks`` for a ``MoHDiTPipeline`` (``moh-dit app`` launches
it; mount it in your own app the same way). Gradio is imported only there, and a missing one says
to ``pip install ".[app]"``. What the page does is :class:`MoHApp`'s, which needs no Gradio:

* classes by name or id (the pipeline's ``id2label``), seeds ``first .. first + n - 1`` for each
  class, guidance, steps and a scheduler (the pipeline's own, or :func:`make_scheduler`'s);
* one to three head activation ratios, each a number in ``transformer.head_activation_range`` or a
  schedule spec (``linear:0.5:1.0``; :mod:`moh_dit.models.head_schedule`), sampled with the same
  seeds so that they compare side by side;
* per ratio the images, ``out.head_activation_ratio``, ``out.mean_attention_flop_ratio``, the
  seconds, and the call's ``out.head_usage`` as the package's head-usage figure
  (:func:`~moh_dit.evaluation.head_usage.plot_head_usage`) and as numbers; all of it in a zip with
  the settings (``settings.json``).

Every input is checked by the pipeline's own ``check_inputs`` for every ratio before any sampling;
its ValueError is what the page shows. The app adds only its limits (:class:`AppLimits`: images per
request and steps, derived from the model's FLOPs and the machine's speed), so that it is safe to
leave running: one generation at a time (a queue with concurrency 1), nothing read from paths the
browser names, and nothing written outside one temporary folder (plus Gradio's own cache, which
it cleans).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import PIL.Image

from .diffusion.schedulers import SCHEDULERS, make_scheduler
from .evaluation.head_usage import HeadUsage, default_classes, figure_png, plot_head_usage
from .models.flops import forward_flops
from .pipelines.pipeline_moh_dit import MoHDiTPipeline
from .utils.speed import peak_flops

__all__ = ["AppLimits", "MoHApp", "RatioResult", "AppResult", "build_app", "default_limits", "require_gradio",
           "MAX_RATIOS", "SAVED_SCHEDULER", "SPACE_BUNDLE", "space_files", "space_card"]

MAX_RATIOS = 3  # ratios side by side in one request
SAVED_SCHEDULER = "saved"  # the scheduler the pipeline came with
_MAX_IMAGES = 16  # images per request, whatever the machine: a page of results stays readable
_DEFAULT_STEPS = 50  # the pipeline's default; max_images is set so that this many steps fit the budget
# Fraction of the machine's peak (datasheet or timed matmul) a sampling step reaches: small batches,
# attention and the scheduler keep it well below the matmul peak.
_EFFICIENCY = 0.25
_DISPLAY_PIXELS = 256  # small images are shown enlarged by a whole factor (nearest neighbour) to about this


def require_gradio():
    """The ``gradio`` module, or ModuleNotFoundError saying how to install it."""
    try:
        import gradio
    except ImportError as error:
        raise ModuleNotFoundError(
            f"the app needs Gradio ({error}); install the app extra: pip install \".[app]\" (from a clone of "
            "moh-dit), or pip install gradio.", name="gradio") from None
    return gradio


@dataclass(frozen=True)
class AppLimits:
    """What one request may ask for: ``max_images`` images in all (classes x seeds x ratios) and
    ``max_steps`` denoising steps."""

    max_images: int
    max_steps: int

    def check(self, images: int, steps: Any) -> None:
        """ValueError naming the limit a request of ``images`` images and ``steps`` steps passes."""
        if images > self.max_images:
            raise ValueError(f"this request makes {images} images (classes x seeds x ratios); this app makes at most "
                             f"{self.max_images} per request (max_images): pick fewer classes, seeds or ratios.")
        if isinstance(steps, (int, float)) and not isinstance(steps, bool) and steps > self.max_steps:
            raise ValueError(f"num_inference_steps={steps} is more than this app's {self.max_steps} (max_steps); "
                             "use fewer steps.")


def default_limits(pipe: MoHDiTPipeline, seconds: float = 60.0, flop_rate: float | None = None) -> AppLimits:
    """Limits under which a request takes about ``seconds`` at most on this machine.

    One image-step costs two forward passes (guidance) with every head active
    (:func:`~moh_dit.models.flops.forward_flops`); the machine does ``flop_rate`` FLOP/s (default:
    a quarter of :func:`~moh_dit.utils.speed.peak_flops` of the pipeline's device). The budget of
    image-steps sets ``max_images`` (at most 16) so that 50 steps fit, then ``max_steps`` (at most
    the model's diffusion steps) so that ``max_images`` images fit."""
    model = pipe.transformer
    if flop_rate is None:
        flop_rate = _EFFICIENCY * peak_flops(pipe._execution_device, model.dtype)[0]
    per_image_step = 2 * forward_flops(model, ratio=model.head_activation_range[1])
    budget = int(seconds * flop_rate // per_image_step)  # image-steps
    train_steps = int(getattr(pipe.scheduler.config, "num_train_timesteps", 1000))
    max_images = min(_MAX_IMAGES, max(1, budget // _DEFAULT_STEPS))
    return AppLimits(max_images=max_images, max_steps=min(train_steps, max(1, budget // max_images)))


@dataclass
class RatioResult:
    """One ratio of a request: what the pipeline returned and where its files are."""

    requested: float | str
    images: list[Path]  # PNGs as the pipeline made them
    shown: list[Path]  # the same, enlarged by ``scale`` for the page
    captions: list[str]
    head_activation_ratio: float
    head_activation_ratios: list[float]
    mean_attention_flop_ratio: float
    seconds: float
    head_usage: list[list[float]] | None  # per layer, the fraction of tokens that used each head
    figure: Path | None  # the head-usage figure (None for a dense DiT: every head always on)

    def record(self, folder: Path) -> dict[str, Any]:
        return {"requested": self.requested, "head_activation_ratio": self.head_activation_ratio,
                "head_activation_ratios": self.head_activation_ratios,
                "mean_attention_flop_ratio": self.mean_attention_flop_ratio, "seconds": self.seconds,
                "images": [str(p.relative_to(folder)) for p in self.images], "head_usage": self.head_usage}


@dataclass
class AppResult:
    """One request: its settings, a :class:`RatioResult` per ratio, the zip of everything."""

    settings: dict[str, Any]
    ratios: list[RatioResult]
    scale: int  # the enlargement of the shown images
    zip_path: Path

    @property
    def record(self) -> dict[str, Any]:
        """The settings and the numbers of every ratio (``settings.json`` in the zip)."""
        return {**self.settings, "ratios": [r.record(self.zip_path.parent) for r in self.ratios]}


def _class_value(value: Any) -> Any:
    """A class typed in the page: digits are an id, anything else a name (the pipeline checks both)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _seed_list(first: Any, count: Any) -> list[Any]:
    """``first .. first + count - 1``; a ``first`` that is no int is passed on for the pipeline to name."""
    if isinstance(first, float) and first.is_integer():
        first = int(first)
    count = int(count) if isinstance(count, (int, float)) and not isinstance(count, bool) and count >= 1 else 1
    if not isinstance(first, int) or isinstance(first, bool):
        return [first] * count
    return list(range(first, first + count))


def _ratio_value(value: Any) -> Any:
    """A ratio or a schedule spec typed in the page; numbers as floats."""
    if isinstance(value, str):
        text = value.strip()
        try:
            return float(text)
        except ValueError:
            return text
    return value


class MoHApp:
    """What the page does, without Gradio: ``generate`` samples one request into ``workdir``.

    Requests run one at a time (the page's queue has concurrency 1); each one's files go into a
    new folder under ``workdir`` and the previous request's folder is removed."""

    def __init__(self, pipe: MoHDiTPipeline, limits: AppLimits, workdir: str | Path, title: str = "MoH-DiT"):
        self.pipe, self.limits, self.workdir, self.title = pipe, limits, Path(workdir), title
        self._requests = 0
        self._saved_scheduler = pipe.scheduler

    # ------------------------------------------------------------------ what the page offers
    @property
    def class_choices(self) -> list[tuple[str, int]]:
        """(label, id) of every class and the null class (unconditional samples)."""
        names, null = self.pipe.id2label, self.pipe.transformer.config.num_classes
        return [(f"{i}: {names[i]}" if i in names else str(i), i) for i in range(null)] + [(f"{null}: unconditional", null)]

    @property
    def default_classes(self) -> list[int]:
        return default_classes(self.pipe.transformer.config.num_classes)[:2]

    @property
    def scheduler_choices(self) -> list[tuple[str, str]]:
        """The pipeline's own scheduler and, for a linear-beta diffusion, :func:`make_scheduler`'s kinds."""
        saved = [(f"{type(self._saved_scheduler).__name__} (the pipeline's)", SAVED_SCHEDULER)]
        if getattr(self._saved_scheduler.config, "beta_schedule", None) != "linear":
            return saved
        return saved + [(kind, kind) for kind in SCHEDULERS]

    def scheduler(self, name: str):
        """The scheduler ``name`` (:data:`SAVED_SCHEDULER` or a :func:`make_scheduler` kind) for the
        pipeline's diffusion, with the saved scheduler's clipping."""
        if name == SAVED_SCHEDULER:
            return self._saved_scheduler
        config = self._saved_scheduler.config
        return make_scheduler(name, clip_sample=bool(getattr(config, "clip_sample", False)) and name != "dpm",
                              num_train_timesteps=config.num_train_timesteps, beta_start=config.beta_start,
                              beta_end=config.beta_end)

    # ------------------------------------------------------------------ one request
    def generate(self, classes: Sequence[Any], first_seed: Any = 0, seeds_per_class: int = 1,
                 guidance_scale: float = 4.0, num_inference_steps: int = _DEFAULT_STEPS,
                 scheduler: str = SAVED_SCHEDULER, ratios: Sequence[Any] = (None,)) -> AppResult:
        """Sample every class with seeds ``first_seed .. first_seed + seeds_per_class - 1`` at each of
        ``ratios`` (numbers, schedule specs, or None for the model's current ratio).

        ValueError, before any sampling, for a request over :attr:`limits` or any input the
        pipeline's ``check_inputs`` refuses (its message)."""
        classes = [_class_value(c) for c in (classes if isinstance(classes, (list, tuple)) else [classes])]
        seeds = _seed_list(first_seed, seeds_per_class)
        ratios = [_ratio_value(r) for r in ratios] or [None]
        if len(ratios) > MAX_RATIOS:
            raise ValueError(f"{len(ratios)} ratios given; the app compares at most {MAX_RATIOS}.")
        labels = [c for c in classes for _ in seeds]
        image_seeds = [s for _ in classes for s in seeds]
        self.limits.check(len(labels) * len(ratios), num_inference_steps)
        pipe = self.pipe
        pipe.scheduler = self.scheduler(scheduler)
        try:
            for ratio in ratios:  # everything the pipeline checks, for every ratio, before any compute
                pipe.check_inputs(labels, guidance_scale, num_inference_steps, head_activation_ratio=ratio,
                                  seeds=image_seeds)
            folder = self._new_folder()
            ids = pipe.get_label_ids(labels)
            names = [pipe.id2label.get(i, "unconditional" if i == pipe.transformer.config.num_classes else str(i))
                     for i in ids]
            settings = {
                "model": self.title, "classes": [{"id": i, "name": n} for i, n in dict(zip(ids, names)).items()],
                "seeds": seeds, "guidance_scale": float(guidance_scale), "num_inference_steps": int(num_inference_steps),
                "scheduler": type(pipe.scheduler).__name__,
            }
            scale = max(1, _DISPLAY_PIXELS // self._image_size())
            results = [self._one_ratio(folder, index, ratio, ids, names, image_seeds, settings, scale)
                       for index, ratio in enumerate(ratios)]
        finally:
            pipe.scheduler = self._saved_scheduler
        result = AppResult(settings=settings, ratios=results, scale=scale, zip_path=folder / "moh-dit-samples.zip")
        self._write_zip(result)
        return result

    def _image_size(self) -> int:
        size = self.pipe.transformer.config.sample_size
        return size * (2 ** (len(self.pipe.vae.config.block_out_channels) - 1) if self.pipe.vae is not None else 1)

    def _new_folder(self) -> Path:
        """A fresh folder for this request; the previous request's is removed (Gradio has copied its files)."""
        self._requests += 1
        for old in self.workdir.glob("request-*"):
            shutil.rmtree(old, ignore_errors=True)
        folder = self.workdir / f"request-{self._requests}"
        folder.mkdir(parents=True)
        return folder

    def _one_ratio(self, folder: Path, index: int, ratio: Any, ids: list[int], names: list[str], seeds: list[int],
                   settings: dict[str, Any], scale: int) -> RatioResult:
        pipe = self.pipe
        start = time.perf_counter()
        out = pipe(ids, guidance_scale=settings["guidance_scale"], num_inference_steps=settings["num_inference_steps"],
                   head_activation_ratio=ratio, seeds=seeds, output_type="pil", output_head_usage=True)
        seconds = time.perf_counter() - start
        sub = folder / f"ratio-{index + 1}"
        sub.mkdir()
        images, shown, captions = [], [], []
        for n, (image, class_id, name, seed) in enumerate(zip(out.images, ids, names, seeds)):
            path = sub / f"{n:03d}_class-{class_id}_seed-{seed}.png"
            image.save(path)
            images.append(path)
            big = sub / "shown" / path.name
            big.parent.mkdir(exist_ok=True)
            image.resize((image.width * scale, image.height * scale), PIL.Image.NEAREST).save(big)
            shown.append(big)
            captions.append(f"{name}, seed {seed}")
        usage = [u.tolist() for u in out.head_usage] if out.head_usage else None
        figure = None
        if usage is not None:
            figure = sub / "head_usage.png"
            figure.write_bytes(figure_png(self._figure(ratio, out, usage, settings)))
        return RatioResult(
            requested=ratio if ratio is not None else pipe.transformer.head_activation_ratio, images=images, shown=shown,
            captions=captions, head_activation_ratio=float(out.head_activation_ratio),
            head_activation_ratios=[float(r) for r in out.head_activation_ratios],
            mean_attention_flop_ratio=float(out.mean_attention_flop_ratio), seconds=seconds, head_usage=usage,
            figure=figure)

    def _figure(self, ratio: Any, out, usage: list[list[float]], settings: dict[str, Any]):
        """The package's head-usage figure of one call: its per-layer top-K is the plan's (for a
        schedule, each layer's largest over the steps, which the row labels then show)."""
        transformer = self.pipe.transformer
        plan = self.pipe.head_activation_plan(ratio, settings["num_inference_steps"])
        top_k = [max(step[layer] for step in plan.top_k) for layer in range(len(usage))]
        shared = transformer.layer_shared if transformer.is_moh else transformer.layer_heads
        head_usage = HeadUsage(overall=usage, per_class={}, per_timestep=[], shared_heads=list(shared), top_k=top_k)
        varies = "" if plan.is_constant else f"; schedule {plan.spec}: rows show each layer's largest top-K"
        guided = " (both halves of guidance)" if settings["guidance_scale"] > 1 else ""
        subtitle = (f"{len(out.images)} images, {settings['num_inference_steps']} {settings['scheduler']} steps, "
                    f"guidance {settings['guidance_scale']:g}: fraction of tokens using each head over all steps"
                    f"{guided}{varies}")
        return plot_head_usage(head_usage, f"{self.title}: head usage at ratio {out.head_activation_ratio:.3f}",
                               subtitle)

    def _write_zip(self, result: AppResult) -> None:
        """The images as the pipeline made them, each ratio's figure and ``settings.json``."""
        folder = result.zip_path.parent
        with zipfile.ZipFile(result.zip_path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for ratio in result.ratios:
                for path in ratio.images + ([ratio.figure] if ratio.figure is not None else []):
                    archive.write(path, str(path.relative_to(folder)))
            archive.writestr("settings.json", json.dumps(result.record, indent=2))


# ------------------------------------------------------------------------------ the page

def _summary_rows(result: AppResult) -> list[list[Any]]:
    return [[str(r.requested), round(r.head_activation_ratio, 4), round(r.mean_attention_flop_ratio, 4),
             round(r.seconds, 2)] for r in result.ratios]


def _ratio_heading(index: int, ratio: RatioResult) -> str:
    return (f"### Ratio {index + 1}: {ratio.requested}\nrealised **{ratio.head_activation_ratio:.4f}**, attention "
            f"FLOPs **{100 * ratio.mean_attention_flop_ratio:.1f}%** of dense, **{ratio.seconds:.2f} s**")


def build_app(pipe: MoHDiTPipeline, *, title: str | None = None, limits: AppLimits | None = None,
              seconds_per_request: float = 60.0, workdir: str | Path | None = None):
    """The Gradio ``Blocks`` of the app for ``pipe``; ``launch()`` it or mount it in your own app.

    ``title`` names the model on the page and in the figures; ``limits`` default to
    :func:`default_limits` (requests of about ``seconds_per_request`` at most on this machine);
    ``workdir``: where requests write their files (default: a temporary folder removed at exit).
    The queue runs one generation at a time. ModuleNotFoundError when Gradio is missing."""
    gr = require_gradio()
    limits = limits or default_limits(pipe, seconds_per_request)
    if workdir is None:
        holder = tempfile.TemporaryDirectory(prefix="moh-dit-app-")
        workdir = holder.name
    else:
        holder = None
    app = MoHApp(pipe, limits, workdir, title or "MoH-DiT")
    model = pipe.transformer
    low, high = model.head_activation_range
    current = model.head_activation_ratio
    # Ratios to compare by default: the current one, all heads, the fewest heads.
    defaults = [current, high, low]

    def generate(classes, first_seed, seeds_per_class, guidance, steps, scheduler, *ratio_inputs):
        ratios = []
        for index in range(MAX_RATIOS):
            use, slider, schedule = ratio_inputs[3 * index: 3 * index + 3]
            if index == 0 or use:
                ratios.append(schedule if isinstance(schedule, str) and schedule.strip() else slider)
        try:
            result = app.generate(classes, first_seed, seeds_per_class, guidance, steps, scheduler, ratios)
        except ValueError as error:  # the pipeline's (or the limits') message, on the page
            raise gr.Error(str(error), duration=None) from None
        panels = []
        for index in range(MAX_RATIOS):
            if index < len(result.ratios):
                r = result.ratios[index]
                panels += [gr.Column(visible=True), _ratio_heading(index, r),
                           gr.Gallery([(str(p), c) for p, c in zip(r.shown, r.captions)],  # a row per class
                                      columns=min(len(result.settings["seeds"]), 6)),
                           str(r.figure) if r.figure is not None else None]
            else:
                panels += [gr.Column(visible=False), "", [], None]
        return [_summary_rows(result), json.dumps(result.record, indent=1), str(result.zip_path), *panels]

    with gr.Blocks(title=f"{app.title}: MoH head activation", analytics_enabled=False,
                   delete_cache=(600, 3600)) as demo:
        gr.Markdown(f"# {app.title}\nMixture-of-Head attention: sample the same seeds at up to {MAX_RATIOS} head "
                    f"activation ratios (reachable: {low:.4f} to {high:.4f}; now {current:.4f}) and see which heads "
                    f"each layer used. Up to {limits.max_images} images and {limits.max_steps} steps per request.")
        with gr.Row():
            with gr.Column(scale=2):
                classes = gr.Dropdown(app.class_choices, value=app.default_classes, multiselect=True, filterable=True,
                                      allow_custom_value=True, label="classes (type a name or an id)",
                                      elem_id="classes")
                with gr.Row():
                    first_seed = gr.Number(0, precision=0, label="first seed", elem_id="first_seed")
                    seeds = gr.Slider(1, limits.max_images, value=min(2, limits.max_images), step=1,
                                      label="seeds per class", elem_id="seeds")
                with gr.Row():
                    guidance = gr.Number(4.0, label="guidance scale (1: none)", elem_id="guidance")
                    steps = gr.Slider(1, limits.max_steps, value=min(_DEFAULT_STEPS, limits.max_steps), step=1,
                                      label="steps", elem_id="steps")
                    scheduler = gr.Dropdown(app.scheduler_choices, value=SAVED_SCHEDULER, label="scheduler",
                                            elem_id="scheduler")
            with gr.Column(scale=3):
                ratio_inputs = []
                for index in range(MAX_RATIOS):
                    with gr.Row():
                        use = gr.Checkbox(index < 2 and low < high, label=f"ratio {index + 1}", interactive=index > 0,
                                          elem_id=f"use_{index + 1}", scale=1, min_width=90)
                        slider = gr.Slider(low, high, value=defaults[index], label="head activation ratio",
                                           interactive=low < high, elem_id=f"ratio_{index + 1}", scale=3)
                        schedule = gr.Textbox("", label="or a schedule (replaces the slider)",
                                              placeholder="linear:0.5:1.0", elem_id=f"schedule_{index + 1}", scale=2)
                    ratio_inputs += [use, slider, schedule]
                button = gr.Button("Generate", variant="primary", elem_id="generate")
        summary = gr.Dataframe(headers=["requested", "realised ratio", "attention FLOPs / dense", "seconds"],
                               label="per ratio", interactive=False, elem_id="summary")
        panels = []
        with gr.Row():
            for index in range(MAX_RATIOS):
                with gr.Column(visible=False) as column:
                    heading = gr.Markdown(elem_id=f"heading_{index + 1}")
                    gallery = gr.Gallery(label=f"ratio {index + 1}", format="png", columns=4, object_fit="contain",
                                         height="auto", elem_id=f"gallery_{index + 1}")
                    figure = gr.Image(label="head usage", show_label=False, format="png", type="filepath",
                                      interactive=False, elem_id=f"usage_{index + 1}")
                panels += [column, heading, gallery, figure]
        with gr.Row():
            download = gr.File(label="images (as the pipeline made them), figures and settings.json",
                               interactive=False, elem_id="download")
            numbers = gr.Textbox(label="the numbers (settings.json): realised ratios, FLOPs, seconds, head usage",
                                 lines=6, max_lines=12, interactive=False, elem_id="numbers")
        button.click(generate, [classes, first_seed, seeds, guidance, steps, scheduler, *ratio_inputs],
                     [summary, numbers, download, *panels], api_name="generate")
    demo.queue(default_concurrency_limit=1, max_size=16)
    demo.moh_app = app  # the Python side, for tests and for embedding
    demo._moh_workdir = holder  # removed with the Blocks (or at exit)
    return demo


# ------------------------------------------------------------------------------ an exported folder as a Space

SPACE_BUNDLE = "app_moh_dit"  # module file of an export that holds this module and what it imports
# What app.py runs, when moh-dit is not installed, besides Gradio (which a Space brings).
_SPACE_REQUIREMENTS = ("torch", "diffusers", "safetensors", "numpy", "pillow", "matplotlib", "tqdm")
_SPACE_APP = '''"""The moh-dit app on this folder's pipeline: a Hugging Face Space (Gradio SDK), or `python app.py`."""

from pathlib import Path

import torch

try:  # moh-dit installed
    from moh_dit.app import build_app
    from moh_dit.pipelines.pipeline_moh_dit import MoHDiTPipeline
except ImportError:  # this folder's own copy of the code ({bundle}.py, written by moh-dit export --app)
    from {bundle} import MoHDiTPipeline, build_app

pipe = MoHDiTPipeline.from_pretrained(Path(__file__).resolve().parent)
pipe.to("cuda" if torch.cuda.is_available() else "cpu")
pipe.set_progress_bar_config(disable=True)
demo = build_app(pipe, title={title!r})

if __name__ == "__main__":
    demo.launch()
'''


def space_files(title: str) -> dict[str, str]:
    """``app.py`` and ``requirements.txt`` of an exported folder that runs as a Gradio app (a Hugging
    Face Space); ``app.py`` imports moh-dit when it is installed, else the folder's
    ``{SPACE_BUNDLE}.py`` (this module and what it imports, one file, which the export writes)."""
    return {"app.py": _SPACE_APP.format(title=title, bundle=SPACE_BUNDLE),
            "requirements.txt": "\n".join(_SPACE_REQUIREMENTS) + "\n"}


def space_card(card: str, gradio_version: str | None = None) -> str:
    """A model card (``---`` YAML header first) that is also a Space's README: the Space keys
    (``sdk: gradio``, ``app_file: app.py``, and ``sdk_version``: ``gradio_version``, by default the
    installed Gradio's, left out without one) in its header, and a line on running the app before
    its citation."""
    if gradio_version is None:
        from importlib import metadata

        try:
            gradio_version = metadata.version("gradio")
        except metadata.PackageNotFoundError:
            pass
    keys = ["sdk: gradio", "app_file: app.py"] + ([f"sdk_version: {gradio_version}"] if gradio_version else [])
    if not card.startswith("---\n"):
        raise ValueError("the model card has no YAML header (---) to add the Space's keys to.")
    card = "---\n" + "\n".join(keys) + "\n" + card[4:]
    note = ("## App\n\n`python app.py` (with gradio installed) opens a page that samples this model at any head "
            "activation ratio, with the head usage beside the images; the folder also runs as a Hugging Face Space "
            "(Gradio SDK). It uses moh-dit when installed, else this folder's own code.\n\n")
    return card.replace("## Citation", note + "## Citation", 1) if "## Citation" in card else card + "\n" + note
