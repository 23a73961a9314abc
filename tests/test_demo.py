"""The demos (moh_dit.demo): the README's first command and the upcycling comparison, at toy scale."""

import json
import os
import stat

import numpy as np
import pytest
from PIL import Image

from moh_dit.demo import ratio_picture

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ratio_picture_rows_are_the_pipelines_images_at_each_ratio(tiny_pipe):
    pipe = tiny_pipe(seed=1, num_classes=3, class_names=["a", "b", "c"])
    pipe.set_progress_bar_config(disable=True)
    scale, left, top, cell = 2, 90, 16, 16  # 8 px samples, twice as large
    picture = np.asarray(ratio_picture(pipe, [1.0, None, 0.5], num_inference_steps=2, guidance_scale=2.0, seed=5,
                                       scale=scale))
    assert picture.shape == (top + 3 * (cell + 2), left + 3 * (cell + 2), 3)
    for row, ratio in enumerate([1.0, 0.75, 0.5]):
        images = pipe([0, 1, 2], guidance_scale=2.0, num_inference_steps=2, head_activation_ratio=ratio,
                      seeds=[5, 5, 5]).images
        for column, image in enumerate(images):
            y, x = top + row * (cell + 2), left + column * (cell + 2)
            expected = np.asarray(image).repeat(scale, axis=0).repeat(scale, axis=1)
            np.testing.assert_array_equal(picture[y:y + cell, x:x + cell], expected)
    assert (picture[:, :left] < 128).any()  # the row labels are drawn


@pytest.mark.slow
def test_the_demo_end_to_end_and_its_rerun(tmp_path, monkeypatch, load_script, refuses):
    monkeypatch.delenv("MOH_DIT_INCEPTION_WEIGHTS", raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # no cached real weights
    out = tmp_path / "demo"
    argv = ["--output-dir", out, "--images-per-class", "3", "--reference-per-class", "1", "--max-steps", "2",
            "--batch-size", "8", "--sample-steps", "2", "--sweep-samples", "12", "-q"]
    umask = os.umask(0o022)
    try:
        assert load_script("demo").cli(argv) == 0
    finally:
        os.umask(umask)
    assert Image.open(out / "ratios.png").size == (90 + 12 * 98, 16 + 3 * 98)  # 16 px shown 6 times larger
    sweep = json.loads((out / "sweep" / "sweep.json").read_text())
    assert [round(row["realised_ratio"], 2) for row in sweep["rows"]] == [1.0, 0.92, 0.75, 0.58, 0.5]  # highest first
    assert all(0 <= row["class_accuracy"] <= 1 for row in sweep["rows"])
    assert "NOT comparable" in sweep["settings"]["extractor"] or not sweep["settings"]["comparable_to_published"]
    assert len(json.loads((out / "sweep" / "head_usage" / "head_usage.json").read_text())["per_class"]) == 12
    assert (out / "run" / "final" / "transformer" / "config.json").is_file()
    modes = {(p.is_dir(), stat.S_IMODE(p.stat().st_mode)) for p in [out, *out.rglob("*")]}
    assert modes == {(True, 0o755), (False, 0o644)}
    before = (out / "run" / "final" / "transformer" / "config.json").stat().st_mtime_ns
    assert load_script("demo").cli(argv) == 0  # a rerun keeps the finished stages
    assert (out / "run" / "final" / "transformer" / "config.json").stat().st_mtime_ns == before
    refuses("demo", argv[:-1] + ["--max-steps", "3"], "max_steps")  # other settings: another folder


@pytest.mark.slow
def test_the_upcycle_demo_at_toy_scale(tmp_path, load_script):
    out = tmp_path / "up"
    assert load_script("upcycle-demo").cli([
        "--output-dir", out, "--dense-steps", "1", "--continue-steps", "1", "--router-warmup-steps", "0",
        "--images-per-class", "2", "--reference-per-class", "1", "--eval-samples", "4", "--sample-steps", "1",
        "--batch-size", "4", "-q"]) == 0
    rows = json.loads((out / "upcycle_demo.json").read_text())["rows"]
    assert [r["training_steps"] for r in rows] == [1, 2, 1, 2, 2]
    assert [round(r["head_activation"], 2) for r in rows] == [1.0, 1.0, 0.75, 0.75, 0.75]
    assert (out / "upcycle_demo.md").read_text().count("\n| ") == 6  # the header and a row per model
