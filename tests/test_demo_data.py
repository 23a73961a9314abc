"""The demo's dataset of shapes (moh_dit.data.demo_data): its layout, its exact pixels, classes that
look like their names, and `moh-dit make-demo-dataset`."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from moh_dit.data.demo_data import DEMO_COLOURS, MIN_IMAGE_SIZE, demo_classes, make_demo_dataset, render_demo_image


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*.png"))}


def test_layout_and_exact_pixels(tmp_path):
    root = make_demo_dataset(tmp_path / "shapes", images_per_class=2, image_size=16, seed=0)
    classes = demo_classes()
    assert len(classes) == 12 and sorted(p.name for p in root.iterdir() if p.is_dir()) == classes
    with Image.open(root / "red_circle" / "red_circle_00001.png") as img:
        assert img.size == (16, 16) and img.mode == "RGB"
    meta = json.loads((root / "demo_dataset.json").read_text())
    assert meta["classes"] == classes and meta["images_per_class"] == 2 and meta["image_size"] == 16
    files = hashlib.sha256(b"".join((root / name).read_bytes() for name in _digest(root)))
    assert files.hexdigest() == "0018c86c5142d63330a79ca8218b13fc676ea09aa86dead6537f56b9639c1d6f"  # the drawing's
    assert [p.name for p in tmp_path.iterdir()] == ["shapes"]  # no scratch left beside it


def test_image_i_depends_on_seed_class_and_i_alone(tmp_path):
    a = _digest(make_demo_dataset(tmp_path / "a", images_per_class=2, image_size=12, seed=7))
    c = _digest(make_demo_dataset(tmp_path / "c", images_per_class=3, image_size=12, seed=7))
    d = _digest(make_demo_dataset(tmp_path / "d", images_per_class=2, image_size=12, seed=8))
    assert all(c[k] == v for k, v in a.items()) and all(d[k] != v for k, v in a.items())


def test_classes_look_like_their_names_and_fit_at_the_smallest_size():
    for name in demo_classes():
        colour = np.array(DEMO_COLOURS[name.split("_")[0]], dtype=float)
        image = np.asarray(render_demo_image(name, np.random.default_rng(0)), float)
        distance = np.linalg.norm(image - colour, axis=-1)
        inside = distance < 60
        assert inside.mean() > 0.10 and np.median(distance[~inside]) > 150, name  # bold, on a far background
    for seed in range(100):
        for shape in ("circle", "square", "triangle", "cross"):
            image = np.asarray(render_demo_image(f"red_{shape}", np.random.default_rng([seed]), MIN_IMAGE_SIZE), float)
            inside = np.linalg.norm(image - np.array(DEMO_COLOURS["red"]), axis=-1) < 90
            border = np.concatenate([inside[0], inside[-1], inside[:, 0], inside[:, -1]])
            assert inside.any() and not border.any(), (seed, shape)
    with pytest.raises(ValueError):
        render_demo_image("purple_star", np.random.default_rng(0))


def test_the_command(tmp_path, load_script, refuses, capsys):
    command = load_script("make-demo-dataset")
    argv = ["--output-dir", tmp_path / "shapes", "--images-per-class", "1", "--image-size", "12"]
    assert command.cli(argv) == 0 and "12 images" in capsys.readouterr().out
    refuses("make-demo-dataset", argv, "shapes")  # exists: --overwrite replaces it
    assert command.cli(argv + ["--overwrite", "--seed", "3"]) == 0
    assert json.loads((tmp_path / "shapes" / "demo_dataset.json").read_text())["seed"] == 3
    for flag, value in (("--images-per-class", "0"), ("--image-size", str(MIN_IMAGE_SIZE - 1)), ("--seed", "-1")):
        assert flag in refuses("make-demo-dataset", argv + [flag, value], flag, status=2)
