"""See MoH at work in the browser: a Gradio page that samples a ``MoHDiTPipeline`` at any head
activation ratio and shows the images, the ratio realised, the attention FLOPs against dense and
which heads each layer used.

    >>> demo = build_app(pipe, title="MoH-DiT-XL/2-90")
    >>> demo.launch()                      # what ``moh-dit app --model FOLDER`` does

The page has no file input and takes no upload (its ``launch`` sets Gradio's upload limit to 0
bytes); one request runs at a time, with at most ``max_images`` images and ``max_steps`` steps.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Sequence

__all__ = ["build_app", "generate"]

_DISPLAY_PIXELS = 256  # small images are shown enlarged by a whole factor (nearest neighbour) to about this


def _class_label(value: Any) -> Any:
    """A class typed in the page: digits are an id, anything else a name (the pipeline checks both)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return int(value) if isinstance(value, float) and value.is_integer() else value


def generate(pipe, classes: Sequence[Any], seeds_per_class: int = 1, first_seed: int = 0, guidance_scale: float = 4.0,
             num_inference_steps: int = 50, head_activation_ratio: float | None = None, *, max_images: int = 16,
             max_steps: int = 250):
    """One request of the page: ``seeds_per_class`` images of each class (seeds ``first_seed``,
    ``first_seed + 1``, ...). Returns the images, a record of the numbers and the head-usage figure
    (None for a dense DiT). ValueError, before any sampling, for what the limits or the pipeline's
    ``check_inputs`` refuse."""
    from moh_dit.head_usage import HeadUsage, plot_head_usage
    from moh_dit.models import HeadLayout, head_activation, model_attention_flops

    labels = [_class_label(c) for c in classes for _ in range(int(seeds_per_class))]
    seeds = [int(first_seed or 0) + i for _ in classes for i in range(int(seeds_per_class))]
    if len(labels) > max_images:
        raise ValueError(f"{len(labels)} images (classes x seeds); this app makes at most {max_images} a request")
    if int(num_inference_steps) > max_steps:
        raise ValueError(f"{int(num_inference_steps)} steps; this app takes at most {max_steps}")
    start = time.perf_counter()
    out = pipe(labels, guidance_scale=float(guidance_scale), num_inference_steps=int(num_inference_steps),
               head_activation_ratio=head_activation_ratio, seeds=seeds, output_head_usage=True)
    model = pipe.transformer
    sparse, dense = model_attention_flops(model, ratio=out.head_activation_ratio)
    record = {"class_labels": pipe.get_label_ids(labels), "seeds": seeds, "guidance_scale": float(guidance_scale),
              "num_inference_steps": int(num_inference_steps), "head_activation_ratio": out.head_activation_ratio,
              "attention_flops_vs_dense": sparse / dense, "seconds": time.perf_counter() - start,
              "head_usage": [u.tolist() for u in out.head_usage]}
    figure = None
    if model.is_moh:
        with head_activation(model, out.head_activation_ratio):
            top_k = list(model.top_k_per_layer)
        usage = HeadUsage(record["head_usage"], {}, [], list(HeadLayout.of_config(model.config).shared), top_k)
        figure = plot_head_usage(usage, f"head usage at ratio {out.head_activation_ratio:.3f}",
                                 "fraction of tokens using each head over all steps; rows: layer shared+top-K")
    return out.images, record, figure


def build_app(pipe, *, title: str = "MoH-DiT", max_images: int = 16, max_steps: int = 250):
    """The Gradio ``Blocks`` of the page for ``pipe``; ``launch()`` it or mount it in your own app."""
    try:
        import gradio as gr
    except ImportError:
        raise ModuleNotFoundError("the app needs Gradio: pip install gradio", name="gradio") from None
    import PIL.Image

    model = pipe.transformer
    low, high = model.head_activation_range
    names, null = pipe.id2label, model.config.num_classes
    choices = [(f"{i}: {names[i]}" if i in names else str(i), i) for i in range(null)] + [(f"{null}: unconditional",
                                                                                          null)]

    def run(classes, seeds_per_class, first_seed, guidance_scale, steps, ratio):
        try:
            images, record, figure = generate(pipe, classes, seeds_per_class, first_seed, guidance_scale, steps, ratio,
                                              max_images=max_images, max_steps=max_steps)
        except ValueError as error:  # the limits' or the pipeline's message, on the page
            raise gr.Error(str(error), duration=None) from None
        scale = max(1, _DISPLAY_PIXELS // images[0].width)
        shown = [(image.resize((image.width * scale, image.height * scale), PIL.Image.NEAREST),
                  f"{names.get(label, label)}, seed {seed}")
                 for image, label, seed in zip(images, record["class_labels"], record["seeds"])]
        summary = (f"realised ratio **{record['head_activation_ratio']:.4f}**, attention FLOPs "
                   f"**{100 * record['attention_flops_vs_dense']:.1f}%** of dense, **{record['seconds']:.2f} s**")
        return shown, summary, figure, json.dumps(record, indent=1)

    with gr.Blocks(title=f"{title}: MoH head activation", analytics_enabled=False, delete_cache=(600, 3600)) as demo:
        gr.Markdown(f"# {title}\nMixture-of-Head attention: sample at any head activation ratio (reachable: "
                    f"{low:.4f} to {high:.4f}) and see which heads each layer used. At most {max_images} images and "
                    f"{max_steps} steps a request.")
        with gr.Row():
            with gr.Column(scale=2):
                classes = gr.Dropdown(choices, value=list(range(min(2, null))), multiselect=True,
                                      allow_custom_value=True, label="classes (a name or an id)", elem_id="classes")
                seeds = gr.Slider(1, max_images, value=min(2, max_images), step=1, label="seeds per class",
                                  elem_id="seeds")
                first_seed = gr.Number(0, precision=0, label="first seed", elem_id="first_seed")
                guidance = gr.Number(4.0, label="guidance scale (1: none)", elem_id="guidance")
                steps = gr.Slider(1, max_steps, value=min(50, max_steps), step=1, label="steps", elem_id="steps")
                ratio = gr.Slider(low, high, value=model.head_activation_ratio, label="head activation ratio",
                                  interactive=low < high, elem_id="ratio")
                button = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column(scale=3):
                gallery = gr.Gallery(label="samples", format="png", columns=4, elem_id="gallery")
                summary = gr.Markdown(elem_id="summary")
                figure = gr.Plot(label="head usage", elem_id="usage")
                numbers = gr.Textbox(label="the numbers", lines=4, max_lines=12, interactive=False, elem_id="numbers")
        button.click(run, [classes, seeds, first_seed, guidance, steps, ratio], [gallery, summary, figure, numbers],
                     api_name="generate")
    demo.queue(default_concurrency_limit=1, max_size=16)
    # No input of the page is a file, so the server takes no upload from any origin (0 bytes).
    demo.launch = functools.partial(demo.launch, max_file_size=0)
    return demo
