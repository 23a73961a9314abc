"""A small class-conditional dataset the package draws itself: bold coloured shapes.

Twelve classes (4 shapes x 3 colours, folders such as ``red_circle``), RGB PNGs (16x16 for
the CPU demo, any size from 12 up) in the ImageFolder layout, with a random position, a
narrow range of sizes, a small rotation, a little colour jitter and a nearly flat light
background. The variation is kept small on purpose: a tiny DiT trained for minutes on a CPU
must be able to learn every class's form, so the demo shows whether conditioning works
rather than how much variety a tiny model can cover. It exists so that the whole recipe (latent cache,
training, sampling, evaluation) can run end to end in minutes without downloads, and so
that a tiny DiT's samples can be judged by eye: shapes are bold and the three colours are
far apart, so a class is recognisable at a glance.

Image ``i`` of class ``c`` depends only on ``(seed, c, i)``: the same seed gives the same
files whatever ``images_per_class`` is.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..outputs import output_folder, write_json

__all__ = ["DEMO_SHAPES", "DEMO_COLOURS", "demo_classes", "render_demo_image", "make_demo_dataset"]

DEMO_SHAPES = ("circle", "square", "triangle", "cross")
# Saturated and mutually distant, and all dark enough to stand out on the light background.
DEMO_COLOURS = {"red": (215, 35, 35), "green": (30, 160, 50), "blue": (40, 70, 220)}

_SUPERSAMPLE = 4  # draw at 4x and box-downsample: anti-aliased edges without blur
_FORMAT = "moh-dit-demo-shapes"
_FORMAT_VERSION = 2  # recorded in demo_dataset.json; raised whenever the drawing changes, so drawings can be told apart
RADIUS_RANGE = (0.30, 0.36)  # shape radius as a fraction of the image size
# The largest shape with its margin must fit: 2 (1.25 * 0.36 S + 0.5) <= S, i.e. S >= 10;
# 12 leaves every shape at least a few pixels across.
MIN_IMAGE_SIZE = 12
MAX_IMAGE_SIZE = 1024  # drawn at 4x supersampling: 4096^2 masks; larger is not a "small" dataset


def demo_classes() -> list[str]:
    """Class folder names, sorted, i.e. in label order: ``blue_circle``, ``blue_cross``, ..."""
    return sorted(f"{colour}_{shape}" for colour in DEMO_COLOURS for shape in DEMO_SHAPES)


def _shape_polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """Vertices of a polygonal shape of radius ~r centred at (cx, cy), rotated by angle (rad)."""
    if shape == "square":
        h = 0.85 * r  # a square of half-side r looks larger than a circle of radius r
        pts = [(-h, -h), (h, -h), (h, h), (-h, h)]
    elif shape == "triangle":
        # Equilateral, apex up, centred on its centroid; slightly larger to match the others' area.
        R = 1.15 * r
        pts = [(R * math.cos(a), R * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    elif shape == "cross":
        a, w = 1.1 * r, 0.30 * r  # arm half-length, arm half-width: long thin arms read as a cross at 16 px
        pts = [(-w, -a), (w, -a), (w, -w), (a, -w), (a, w), (w, w),
               (w, a), (-w, a), (-w, w), (-a, w), (-a, -w), (-w, -w)]
    else:
        raise ValueError(f"unknown shape {shape!r}; choose from {DEMO_SHAPES}")
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + c * x - s * y, cy + s * x + c * y) for x, y in pts]


def render_demo_image(class_name: str, rng: np.random.Generator, image_size: int = 32) -> Image.Image:
    """Draw one image of ``class_name`` (e.g. ``"red_circle"``) with the jitter drawn from ``rng``."""
    import numpy as np  # here, so that the command's --help stays fast
    from PIL import Image, ImageDraw

    colour_name, _, shape = class_name.partition("_")
    if colour_name not in DEMO_COLOURS or shape not in DEMO_SHAPES:
        raise ValueError(f"unknown demo class {class_name!r}; choose from {demo_classes()}")
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be at least {MIN_IMAGE_SIZE} for recognisable shapes, got {image_size}")
    S = image_size
    r = rng.uniform(*RADIUS_RANGE) * S
    # Keep the whole (possibly rotated) shape inside the image.
    margin = 1.25 * r + 0.5
    cx, cy = rng.uniform(margin, S - margin, size=2)
    angle = math.radians(rng.uniform(-10.0, 10.0))

    k = _SUPERSAMPLE
    mask = Image.new("L", (S * k, S * k), 0)
    draw = ImageDraw.Draw(mask)
    if shape == "circle":
        draw.ellipse([(cx - r) * k, (cy - r) * k, (cx + r) * k, (cy + r) * k], fill=255)
    else:
        draw.polygon([(x * k, y * k) for x, y in _shape_polygon(shape, cx, cy, r, angle)], fill=255)
    alpha = np.asarray(mask.resize((S, S), resample=Image.BOX), dtype=np.float32)[..., None] / 255.0

    background = rng.uniform(205.0, 235.0) + rng.normal(0.0, 2.0, size=(S, S, 3))
    colour = np.clip(np.asarray(DEMO_COLOURS[colour_name], dtype=np.float64) + rng.uniform(-20, 20, size=3), 0, 255)
    image = background * (1.0 - alpha) + colour * alpha
    return Image.fromarray(np.clip(np.rint(image), 0, 255).astype(np.uint8))


def make_demo_dataset(output_dir: str | os.PathLike, images_per_class: int = 300, image_size: int = 32, seed: int = 0,
                      overwrite: bool = False) -> Path:
    """Write the dataset to ``output_dir`` (ImageFolder layout, built whole and then renamed into
    place) and return its path; ``overwrite`` replaces only a dataset this function wrote.
    ``demo_dataset.json`` in the root records the settings (ImageFolder readers ignore it)."""
    import numpy as np

    with output_folder(output_dir, "make-demo-dataset", overwrite=overwrite, publish=True) as tmp:
        classes = demo_classes()
        for label, name in enumerate(classes):
            (tmp / name).mkdir()
            for i in range(images_per_class):
                img = render_demo_image(name, np.random.default_rng([seed, label, i]), image_size)
                img.save(tmp / name / f"{name}_{i:05d}.png")
        write_json(tmp / "demo_dataset.json", {"format": _FORMAT, "version": _FORMAT_VERSION, "seed": seed,
                                               "images_per_class": images_per_class, "image_size": image_size,
                                               "classes": classes})
    return Path(output_dir)
