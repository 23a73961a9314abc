import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from moh_dit.data import ImageFolderDataset
from moh_dit.demo_data import DEMO_COLOURS, demo_classes, make_demo_dataset, render_demo_image

def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*.png"))}


def test_layout_counts_and_size(tmp_path):
    root = make_demo_dataset(tmp_path / "shapes", images_per_class=5, seed=0)
    classes = demo_classes()
    assert 8 <= len(classes) <= 12 and "red_circle" in classes
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == classes
    for name in classes:
        files = sorted((root / name).iterdir())
        assert len(files) == 5
        with Image.open(files[0]) as img:
            assert img.size == (32, 32) and img.mode == "RGB"
    meta = json.loads((root / "demo_dataset.json").read_text())
    assert meta["classes"] == classes and meta["images_per_class"] == 5
    # The dataset reader sees the same classes in the same order; the JSON file is ignored.
    ds = ImageFolderDataset(root, 32)
    assert ds.classes == classes and len(ds) == 5 * len(classes)
    # No temporary folders are left beside the output.
    assert [p.name for p in tmp_path.iterdir()] == ["shapes"]


def test_deterministic_and_independent_of_count(tmp_path):
    a = _digest(make_demo_dataset(tmp_path / "a", images_per_class=4, seed=7))
    b = _digest(make_demo_dataset(tmp_path / "b", images_per_class=4, seed=7))
    c = _digest(make_demo_dataset(tmp_path / "c", images_per_class=6, seed=7))
    d = _digest(make_demo_dataset(tmp_path / "d", images_per_class=4, seed=8))
    assert a == b
    assert all(c[k] == v for k, v in a.items())
    assert all(d[k] != v for k, v in a.items())


def test_classes_look_like_their_names():
    """The shape's pixels carry the class colour; the shapes differ in filled area profile."""
    for name in demo_classes():
        colour = np.array(DEMO_COLOURS[name.split("_")[0]], dtype=float)
        img = np.asarray(render_demo_image(name, np.random.default_rng(0)), dtype=float)
        distance = np.linalg.norm(img - colour, axis=-1)
        inside = distance < 60
        # A bold shape: at least 10% of the image, and the background is far from every colour.
        assert inside.mean() > 0.10, name
        assert np.median(distance[~inside]) > 150, name
    # A circle of radius r fills pi r^2, its bounding square 4 r^2: fill ratios tell shapes apart.
    ratios = {}
    for shape in ("circle", "cross"):
        img = np.asarray(render_demo_image(f"red_{shape}", np.random.default_rng(1)), dtype=float)
        mask = np.linalg.norm(img - np.array(DEMO_COLOURS["red"]), axis=-1) < 60
        ys, xs = np.nonzero(mask)
        ratios[shape] = mask.sum() / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))
    assert ratios["circle"] > 0.7 and ratios["cross"] < 0.6


def test_errors_and_script(tmp_path, capsys, load_script):
    script = load_script("make_demo_dataset")
    out = tmp_path / "demo"
    script.main(script.parse_args(["--output-dir", str(out), "--images-per-class", "2", "--image-size", "24"]))
    assert "24 images" in capsys.readouterr().out
    with Image.open(out / "blue_cross" / "blue_cross_00001.png") as img:
        assert img.size == (24, 24)
    with pytest.raises(FileExistsError, match="already exists"):
        make_demo_dataset(out, images_per_class=1)
    make_demo_dataset(out, images_per_class=1, overwrite=True)
    assert len(list((out / "red_square").iterdir())) == 1
    with pytest.raises(ValueError, match="images_per_class"):
        make_demo_dataset(tmp_path / "x", images_per_class=0)
    with pytest.raises(ValueError, match="unknown demo class"):
        render_demo_image("purple_star", np.random.default_rng(0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]
