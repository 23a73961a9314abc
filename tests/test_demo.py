"""The README's first command, at toy scale: dataset -> training -> labelled grid -> sweep."""

import json
import os
import runpy
import stat
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MOH_DIT_INCEPTION_WEIGHTS", raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # no cached real weights
    previous_umask = os.umask(0o022)
    try:
        _run_demo(tmp_path, capsys)
    finally:
        os.umask(previous_umask)


def _run_demo(tmp_path, capsys):
    demo = runpy.run_path(str(ROOT / "scripts" / "demo.py"))
    args = demo["parse_args"]([
        "--output-dir", str(tmp_path / "demo"), "--images-per-class", "3", "--max-steps", "4", "--batch-size", "8",
        "--sample-steps", "2", "--sweep-samples", "12", "--reference-per-class", "2", "--ratios", "1.0,trained,min",
    ])
    assert demo["main"](args) == 0
    out = capsys.readouterr().out
    assert "randomly initialised InceptionV3" in out and "NOT comparable" in out
    grid = Image.open(tmp_path / "demo" / "samples_grid.png")
    assert grid.height > 12 * 90  # one row per class
    # The same seeds at three head activation ratios: three rows of twelve classes, labelled.
    ratios = Image.open(tmp_path / "demo" / "ratios.png")
    assert 3 * 96 < ratios.height < 4 * 96 and ratios.width > 12 * 96
    assert "the same seeds at 1.0, trained, min head activation" in out
    sweep = json.loads((tmp_path / "demo" / "sweep" / "sweep.json").read_text())
    realised = sorted(row["realised_ratio"] for row in sweep["rows"])
    assert realised == [0.5, 0.75, 1.0]
    # The classifier of the real images is trained and reported, and every ratio has a class accuracy.
    assert "% on held-out real images" in out and "class accuracy of the samples at the trained ratio" in out
    assert all(0.0 <= row["class_accuracy"] <= 1.0 for row in sweep["rows"])
    usage = json.loads((tmp_path / "demo" / "sweep" / "head_usage" / "head_usage.json").read_text())
    assert usage["settings"]["images_per_class"] == 2 and len(usage["per_class"]) == 12
    assert (tmp_path / "demo" / "sweep" / "head_usage" / "head_usage.png").is_file()
    summary = json.loads((tmp_path / "demo" / "demo_summary.json").read_text())
    assert summary["ratios_picture"] == str(tmp_path / "demo" / "ratios.png")
    assert 0.0 <= summary["classifier_held_out_accuracy"] <= 1.0 and set(summary["class_accuracy"]) == {
        row["ratio"] for row in sweep["rows"]}
    assert (tmp_path / "demo" / "classifier" / "classifier.json").exists()
    assert (tmp_path / "demo" / "run" / "final" / "transformer" / "config.json").exists()
    # The folder is marked as the demo's (a rerun continues it; another folder is refused), and no
    # lock is left beside it.
    from moh_dit.utils.output_folders import OUTPUT_MARKER

    assert json.loads((tmp_path / "demo" / OUTPUT_MARKER).read_text())["written_by"] == "moh-dit demo"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    # Everything the demo wrote is readable by others under the usual umask.
    modes = {("dir" if p.is_dir() else "file", oct(stat.S_IMODE(p.stat().st_mode)))
             for p in [tmp_path / "demo", *(tmp_path / "demo").rglob("*")]}
    assert modes == {("dir", "0o755"), ("file", "0o644")}


def test_ratio_picture_rows_are_the_same_seeds_at_each_ratio(tiny_pipe):
    """ratios.png: one row per distinct realised ratio (highest first), one column per class, the
    pipeline's own images at that ratio with seed seed + column, scaled by nearest neighbour."""
    import numpy as np

    from moh_dit.commands.demo import ratio_picture

    pipe = tiny_pipe(seed=1, num_classes=3, class_names=["a", "b", "c"])
    pipe.set_progress_bar_config(disable=True)
    scale, label_w, header, cell = 2, 130, 16, 16  # 8 px samples, twice as large
    picture = np.asarray(ratio_picture(pipe, ratios=(1.0, "trained", "min", 0.5), steps=2, guidance_scale=2.0, seed=5,
                                       scale=scale))
    assert picture.shape == (header + 3 * (cell + 2), label_w + 3 * (cell + 2), 3)  # "min" is 0.5: three rows
    for row, ratio in enumerate([1.0, 0.75, 0.5]):
        images = pipe([0, 1, 2], guidance_scale=2.0, num_inference_steps=2, head_activation_ratio=ratio,
                      seeds=[5, 6, 7], output_type="np").images
        expected = (images * 255).round().astype(np.uint8).repeat(scale, axis=1).repeat(scale, axis=2)
        for column in range(3):
            y, x = header + row * (cell + 2), label_w + column * (cell + 2)
            np.testing.assert_array_equal(picture[y:y + cell, x:x + cell], expected[column])
    assert (picture[:, :label_w] < 128).any()  # the row labels are drawn
    assert pipe.transformer.top_k_per_layer == pipe.transformer.trained_top_k
