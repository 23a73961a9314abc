import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from moh_dit.data.datasets import ImageFolderDataset
from moh_dit.data.demo_data import DEMO_COLOURS, demo_classes, make_demo_dataset, render_demo_image
from moh_dit.errors import InvalidInput

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
    assert ratios["circle"] > 0.72 and ratios["cross"] < 0.7


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
    with pytest.raises(InvalidInput) as error:
        make_demo_dataset(tmp_path / "x", images_per_class=0)
    assert error.value.parameters == ("images_per_class",)
    with pytest.raises(ValueError, match="unknown demo class"):
        render_demo_image("purple_star", np.random.default_rng(0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


@pytest.fixture
def demo_inputs(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "notes.txt").write_text("mine")
    return {"--output-dir": tmp_path / "shapes", "--images-per-class": "1", "--image-size": "20"}


@pytest.mark.parametrize(
    "change, extra, match",
    [
        ({"--images-per-class": "0"}, [], r"--images-per-class .*got 0"),
        ({"--images-per-class": "-5"}, [], r"--images-per-class .*got -5"),
        ({"--images-per-class": "1.5"}, [], "invalid int value"),
        ({"--image-size": "11"}, [], r"--image-size .*\[12, 1024\], got 11"),
        ({"--image-size": "0"}, [], r"--image-size .*got 0"),
        ({"--image-size": "4096"}, [], r"--image-size .*got 4096"),
        ({"--seed": "-1"}, [], r"--seed .*got -1"),
        ({"--output-dir": "{tmp}/existing"}, [], "already exists.*--overwrite"),
        ({"--output-dir": "{tmp}/existing"}, ["--overwrite"], "not a demo dataset"),
        ({"--output-dir": "{tmp}/a_file"}, ["--overwrite"], "exists and is not a folder"),
        ({"--output-dir": "{tmp}/a_file/shapes"}, [], "is a file"),
        # About 48 TB of PNGs: refused at once, before the hours of writing that would fill the disk.
        ({"--images-per-class": "1000000000"}, [], r"--images-per-class 1000000000 .* more than the .* free on the disk"),
    ],
)
def test_make_demo_dataset_script_refuses_bad_flags(tmp_path, demo_inputs, refuses, change, extra, match):
    flags = {**demo_inputs, **{k: v.format(tmp=tmp_path) for k, v in change.items()}}
    refuses("make_demo_dataset", [item for pair in flags.items() for item in pair] + extra, match)


def test_overwrite_replaces_only_a_demo_dataset(tmp_path):
    out = make_demo_dataset(tmp_path / "shapes", images_per_class=1, image_size=20)
    make_demo_dataset(out, images_per_class=2, image_size=20, overwrite=True)
    assert len(list((out / "red_circle").iterdir())) == 2
    (tmp_path / "empty").mkdir()
    make_demo_dataset(tmp_path / "empty", images_per_class=1, image_size=20, overwrite=True)  # nothing to lose
    assert (tmp_path / "empty" / "demo_dataset.json").is_file()


def test_help_states_the_sizes_the_check_accepts(tmp_path, load_script, capsys):
    """The help said 20 to 1024 while 12 to 19 were accepted: both now come from one range."""
    from moh_dit.data.demo_data import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE

    script = load_script("make_demo_dataset")
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    low, high = map(int, re.search(r"square image side in pixels \((\d+) to (\d+)\)", text).groups())
    assert (low, high) == (MIN_IMAGE_SIZE, MAX_IMAGE_SIZE)
    for size in (low - 1, high + 1):
        with pytest.raises(ValueError, match=rf"must be in \[{low}, {high}\], got {size}"):
            make_demo_dataset(tmp_path / "x", images_per_class=1, image_size=size)
    assert script.cli(["--output-dir", str(tmp_path / "small"), "--images-per-class", "1", "--image-size", str(low)]) == 0
    with Image.open(tmp_path / "small" / "red_circle" / "red_circle_00000.png") as img:
        assert img.size == (low, low)


# scripts/demo.py: every numeric flag is checked before the dataset is written or a step trained.
DEMO_BAD_FLAGS = [
    (["--preset", "MoH-DiT-Huge-Nonexistent"], "--preset .* is not a known preset"),
    (["--images-per-class", "0"], "--images-per-class must be >= 1, got 0"),
    (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    (["--max-steps", "-10"], "--max-steps must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--learning-rate", "0"], "--learning-rate must be a positive finite number, got 0.0"),
    (["--learning-rate=-1e-3"], "--learning-rate must be a positive finite number"),
    (["--learning-rate", "nan"], "--learning-rate must be a positive finite number, got nan"),
    (["--learning-rate", "inf"], "--learning-rate must be a positive finite number, got inf"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
    (["--ema-decay", "1.0"], r"--ema-decay must be in \[0, 1\), got 1.0"),
    (["--ema-decay", "-0.1"], r"--ema-decay must be in \[0, 1\)"),
    (["--ema-decay", "nan"], r"--ema-decay must be in \[0, 1\), got nan"),
    (["--grid-guidance", "0.5"], "--grid-guidance must be a finite number >= 1"),
    (["--grid-guidance", "inf"], "--grid-guidance must be a finite number >= 1"),
    (["--sample-steps", "0"], "--sample-steps must be >= 1, got 0"),
    (["--sample-steps", "5000"], "--sample-steps must be at most 1000"),
    (["--sweep-samples", "3"], "--sweep-samples must be >= 4, got 3"),
    (["--reference-per-class", "0"], "--reference-per-class must be >= 1, got 0"),
    (["--ratios", "1.0,1.5"], r"ratio 1.5 must be in \(0, 1\]"),
    (["--ratios", "1.0,half"], "ratio 'half' is neither a number, one of"),
    (["--ratios", " , "], "--ratios"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--inception-weights", "{tmp}/none.pth"], "--inception-weights .*none.pth: no such file"),
    (["--output-dir", "{tmp}/a_file"], "--output-dir .*a_file is a file"),
    (["--max-steps", "ten"], "invalid int value"),
]


@pytest.mark.parametrize("flags, match", DEMO_BAD_FLAGS)
def test_demo_script_refuses_bad_flags(tmp_path, refuses, flags, match):
    (tmp_path / "a_file").write_text("x")
    argv = ["--output-dir", tmp_path / "demo", *[f.format(tmp=tmp_path) for f in flags]]
    refuses("demo", argv, match)


def test_every_allowed_size_has_room_for_every_shape():
    """At the smallest size every draw fits the largest shape, whole, inside the image."""
    from moh_dit.data.demo_data import MIN_IMAGE_SIZE

    for seed in range(300):
        for shape in ("circle", "square", "triangle", "cross"):
            image = np.asarray(render_demo_image(f"red_{shape}", np.random.default_rng([seed]), MIN_IMAGE_SIZE), float)
            inside = np.linalg.norm(image - np.array(DEMO_COLOURS["red"]), axis=-1) < 90
            border = np.concatenate([inside[0], inside[-1], inside[:, 0], inside[:, -1]])
            assert inside.any() and not border.any(), (seed, shape)
    with pytest.raises(ValueError, match=f"at least {MIN_IMAGE_SIZE}"):
        render_demo_image("red_circle", np.random.default_rng(0), MIN_IMAGE_SIZE - 1)
