"""The output promises (tests/test_promises.py) walked over every command that writes a folder: each
one goes through moh_dit.outputs, so a second writer stops at once, --overwrite never replaces a
user's folder, and no output lands inside an input, each refused in one line before any work."""

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_vae_

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.commands import build_parser
from moh_dit.data.demo_data import make_demo_dataset
from moh_dit.outputs import hold_lock

pytestmark = pytest.mark.usefixtures("one_thread")


def _moh(root: Path, preset: str = "MoH-DiT-Tiny") -> Path:
    folder = root / preset.replace("/", "_")
    if not folder.exists():
        MoHDiTTransformer2DModel.from_preset(preset, sample_size=8).save_pretrained(folder)
    return folder


def _data(root: Path) -> Path:
    if not (root / "data").exists():
        make_demo_dataset(root / "data", images_per_class=2, image_size=16)
    return root / "data"


def _extract_latents(root, out):
    tiny_vae_(levels=2).save_pretrained(root / "vae")
    return ["--data-dir", _data(root), "--vae", root / "vae", "--image-size", "16", "--output-dir", out,
            "--num-workers", "0", "--device", "cpu", "--batch-size", "4"]


def _sweep(root, out):
    np.savez(root / "ref.npz", arr_0=np.zeros((4, 8, 8, 3), np.uint8))
    return ["--model", _moh(root), "--ref", root / "ref.npz", "--ratios", "1.0", "--num-samples", "4",
            "--num-inference-steps", "1", "--random-inception-seed", "0", "--no-cache", "--device", "cpu",
            "--output-dir", out]


def _convert(root, out):
    from moh_dit.hub.convert import model_to_release_state_dict

    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8)
    torch.save({"ema": model_to_release_state_dict(model), "args": argparse.Namespace()}, root / "ckpt.pt")
    return ["--checkpoint", root / "ckpt.pt", "--preset", "MoH-DiT-Tiny", "--output-dir", out]


# command -> (recipe: its argv with inputs made under ``root``, the input folder an output may not lie in)
WRITERS = {
    "train": (lambda root, out: ["--preset", "MoH-DiT-Tiny", "--data-dir", _data(root), "--vae", "none",
                                 "--image-size", "16", "--output-dir", out, "--max-steps", "1"], "data"),
    "extract-latents": (_extract_latents, "data"),
    "sample": (lambda root, out: ["--model", _moh(root), "--output-dir", out, "--num-samples", "2",
                                  "--num-inference-steps", "1"], "MoH-DiT-Tiny"),
    "sweep": (_sweep, "MoH-DiT-Tiny"),
    "convert": (_convert, None),
    "upcycle": (lambda root, out: ["--checkpoint", _moh(root, "DiT-Tiny"), "--activation", "0.75", "--output-dir", out],
                "DiT-Tiny"),
    "export": (lambda root, out: ["--model", _moh(root), "--output-dir", out], "MoH-DiT-Tiny"),
    "train-classifier": (lambda root, out: ["--data-dir", _data(root), "--output-dir", out, "--image-size", "16",
                                            "--epochs", "1", "--width", "2"], "data"),
    "make-demo-dataset": (lambda root, out: ["--output-dir", out, "--images-per-class", "1", "--image-size", "12"],
                          None),
    "plot-head-usage": (lambda root, out: ["--model", _moh(root), "--output-dir", out, "--images-per-class", "1",
                                           "--num-inference-steps", "1", "--classes", "0", "--device", "cpu"],
                        "MoH-DiT-Tiny"),
    "demo": (lambda root, out: ["--output-dir", out, "--images-per-class", "1", "--max-steps", "1",
                                "--sample-steps", "1", "--sweep-samples", "4"], None),
    "upcycle-demo": (lambda root, out: ["--output-dir", out, "--dense-steps", "1", "--continue-steps", "1",
                                        "--router-warmup-steps", "0", "--images-per-class", "1", "--eval-samples", "4",
                                        "--sample-steps", "1"], None),
}


def _argv(name: str, root: Path, out: Path) -> list:
    root.mkdir(exist_ok=True)
    overwrite = "--overwrite" in build_parser(name)._option_string_actions
    return WRITERS[name][0](root, out) + (["--overwrite"] if overwrite else [])


@pytest.mark.parametrize("name", WRITERS)
def test_a_second_writer_stops_at_once(name, tmp_path, refuses):
    argv = _argv(name, tmp_path / "in", tmp_path / "out")
    with hold_lock(tmp_path / "out", "sample"):
        refuses(name, argv, r"being written by")


@pytest.mark.parametrize("name", WRITERS)
def test_a_users_folder_is_never_replaced(name, tmp_path, refuses):
    argv = _argv(name, tmp_path / "in", tmp_path / "out")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("the user's notes")
    refuses(name, argv, r"out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "the user's notes"


@pytest.mark.parametrize("name", [name for name, (_, source) in WRITERS.items() if source])
def test_no_output_inside_an_input(name, tmp_path, refuses):
    root = tmp_path / "in"
    _argv(name, root, tmp_path / "unused")  # the inputs
    refuses(name, _argv(name, root, root / WRITERS[name][1] / "out"), WRITERS[name][1])
