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
    sweep = json.loads((tmp_path / "demo" / "sweep" / "sweep.json").read_text())
    realised = sorted(row["realised_ratio"] for row in sweep["rows"])
    assert realised == [0.5, 0.75, 1.0]
    # The classifier of the real images is trained and reported, and every ratio has a class accuracy.
    assert "% on held-out real images" in out and "class accuracy of the samples at the trained ratio" in out
    assert all(0.0 <= row["class_accuracy"] <= 1.0 for row in sweep["rows"])
    summary = json.loads((tmp_path / "demo" / "demo_summary.json").read_text())
    assert 0.0 <= summary["classifier_held_out_accuracy"] <= 1.0 and set(summary["class_accuracy"]) == {
        row["ratio"] for row in sweep["rows"]}
    assert (tmp_path / "demo" / "classifier" / "classifier.json").exists()
    assert (tmp_path / "demo" / "run" / "final" / "config.json").exists()
    # The folder is marked as the demo's (a rerun continues it; another folder is refused), and no
    # lock is left beside it.
    from moh_dit.utils.output_folders import OUTPUT_MARKER

    assert json.loads((tmp_path / "demo" / OUTPUT_MARKER).read_text())["written_by"] == "moh-dit demo"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    # Everything the demo wrote is readable by others under the usual umask.
    modes = {("dir" if p.is_dir() else "file", oct(stat.S_IMODE(p.stat().st_mode)))
             for p in [tmp_path / "demo", *(tmp_path / "demo").rglob("*")]}
    assert modes == {("dir", "0o755"), ("file", "0o644")}
