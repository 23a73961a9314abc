"""Promises the help texts and docs make ("never ...", "nothing ...") that no other test held
to the letter: each runs the real command (or the library call the docs name) on tiny
inputs and fails if the promise is broken. Most promises of this kind are tested where
their subject is (tests/test_output_rules.py walks the output rules over every command)."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.data.demo_data import make_demo_dataset
from moh_dit.evaluation import inception
from moh_dit.utils.io import atomic_write, write_json_atomic
from moh_dit.utils.output_folders import OUTPUT_MARKER, hold_output_folder, write_output_marker

pytestmark = pytest.mark.usefixtures("one_thread")


def _moh(root: Path, **overrides) -> Path:
    folder = root / ("latent" if overrides else "moh")
    if not folder.exists():
        MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, **overrides).save_pretrained(folder)
    return folder


def _images(path: Path, count: int = 4, size: int = 8) -> Path:
    rng = np.random.default_rng(0)
    np.savez(path, arr_0=rng.integers(0, 256, (count, size, size, 3), dtype=np.uint8))
    return path


# --------------------------------------------------------------------------------------
# --no-download: "never try to download the Inception weights" (moh-dit evaluate, moh-dit sweep)
# --------------------------------------------------------------------------------------

@pytest.fixture
def network_attempts(tmp_path, monkeypatch):
    """No Inception weights anywhere, and every way out to the network recorded (and failing):
    the package's download function and any socket connection."""
    monkeypatch.delenv(inception.INCEPTION_WEIGHTS_ENV, raising=False)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "torch_hub"))
    attempts = []

    def download(destination, timeout):
        attempts.append(("download", str(destination)))
        raise OSError("network unreachable (test)")

    def connect(self, address, *args):
        attempts.append(("connect", address))
        raise OSError("network unreachable (test)")

    monkeypatch.setattr(inception, "_download_weights", download)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts


def _evaluate_argv(tmp_path: Path) -> list:
    return ["--samples", _images(tmp_path / "samples.npz", size=16), "--ref", _images(tmp_path / "ref.npz", size=16),
            "--output", tmp_path / "metrics.json", "--device", "cpu", "--num-workers", "0", "--no-cache"]


def _sweep_argv(tmp_path: Path) -> list:
    (tmp_path / "in").mkdir(exist_ok=True)
    return ["--model", _moh(tmp_path / "in"), "--ref", _images(tmp_path / "ref.npz"), "--ratios", "1.0",
            "--num-samples", "4", "--num-inference-steps", "1", "--no-cache", "--device", "cpu",
            "--output-dir", tmp_path / "sweep"]


@pytest.mark.parametrize("module, argv, output", [
    ("evaluate", _evaluate_argv, "metrics.json"),
    ("sweep_head_ratio", _sweep_argv, "sweep"),
])
def test_no_download_never_tries_to_download_the_inception_weights(module, argv, output, tmp_path, network_attempts,
                                                                   load_script, capsys):
    args = [str(a) for a in argv(tmp_path)]
    # Without the flag the command does try (the test can see a download attempt)...
    assert load_script(module).cli(args) == 1
    assert network_attempts and "the download failed" in capsys.readouterr().err
    network_attempts.clear()
    # ...with it, it never does: one line saying where to put the file, and nothing written.
    assert load_script(module).cli(args + ["--no-download"]) == 1
    err = capsys.readouterr().err
    assert network_attempts == [], network_attempts
    assert "downloading was disabled" in err and inception.INCEPTION_WEIGHTS_URL in err and "Traceback" not in err
    assert not (tmp_path / output).exists()


# --------------------------------------------------------------------------------------
# moh-dit train --dry-run: "writes nothing; refuses a folder that another command is writing"
# (that it writes nothing: tests/test_training.py::test_dry_run_writes_nothing_and_takes_no_lock)
# --------------------------------------------------------------------------------------

def _train_dry_run(tmp_path: Path, out: Path) -> list:
    if not (tmp_path / "data").exists():
        make_demo_dataset(tmp_path / "data", images_per_class=2, image_size=16)
    return ["--preset", "MoH-DiT-Tiny", "--data-dir", tmp_path / "data", "--vae", "none", "--image-size", "16",
            "--output-dir", out, "--max-steps", "1", "--global-batch-size", "4", "--num-workers", "0",
            "--report-to", "none", "--dry-run"]


def test_train_dry_run_refuses_a_folder_another_command_is_writing(tmp_path, refuses):
    out = tmp_path / "run"
    out.mkdir()
    with hold_output_folder(out, "sample", "--output-dir"):
        refuses("train", _train_dry_run(tmp_path, out),
                r"--output-dir .*run is being written by another command \(moh-dit sample, pid \d+")


def test_train_dry_run_refuses_a_folder_another_command_is_still_building(tmp_path, refuses):
    """export, convert and upcycle build their folder aside and rename it when complete: the
    folder they are writing need not exist yet, and the dry run refuses it as the run does."""
    out = tmp_path / "run"
    argv = _train_dry_run(tmp_path, out)
    with hold_output_folder(out, "export", "--output-dir"):
        refuses("train", [a for a in argv if a != "--dry-run"], r"being written by another command")  # the run
        refuses("train", argv, r"being written by another command \(moh-dit export")  # and its dry run


# --------------------------------------------------------------------------------------
# moh-dit plot-head-usage --vae: "never run: latents are not decoded"; docs/head_usage.md:
# "the output is never inside --model or the log's folder"
# --------------------------------------------------------------------------------------

def test_plot_head_usage_never_runs_the_vae(tmp_path, tiny_vae, load_script, monkeypatch):
    from diffusers import AutoencoderKL

    tiny_vae(levels=2).save_pretrained(tmp_path / "vae")
    model = _moh(tmp_path, in_channels=4)
    ran = []

    def refuse(name):
        def run(self, *args, **kwargs):
            ran.append(name)
            raise AssertionError(f"AutoencoderKL.{name} ran")
        return run

    for name in ("decode", "encode", "forward", "_decode"):
        monkeypatch.setattr(AutoencoderKL, name, refuse(name))
    argv = ["--model", model, "--vae", tmp_path / "vae", "--output-dir", tmp_path / "figures", "--images-per-class",
            "1", "--num-inference-steps", "1", "--classes", "0", "--device", "cpu", "-q"]
    assert load_script("plot_head_usage").cli([str(a) for a in argv]) == 0
    assert ran == [] and (tmp_path / "figures" / "head_usage.json").is_file()


def _training_log(run: Path) -> Path:
    run.mkdir()
    lines = [{"step": s, "usage": [[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]} for s in (10, 20)]
    (run / "head_usage.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run / "head_usage.jsonl"


def test_plot_head_usage_never_writes_into_the_run_folder_it_reads(tmp_path, refuses, load_script):
    run = tmp_path / "run"
    log = _training_log(run)
    refuses("plot_head_usage", ["--log", run, "--output-dir", run / "figures", "--step-bins", "1"],
            r"--output-dir .*figures .*lies inside --log")
    # The same log plots into a folder elsewhere: the refusal was the folder's place.
    argv = ["--log", log, "--output-dir", tmp_path / "figures", "--step-bins", "1", "-q"]
    assert load_script("plot_head_usage").cli([str(a) for a in argv]) == 0


def test_plot_head_usage_never_writes_into_the_folder_of_the_log_file(tmp_path, refuses):
    """--log RUN/head_usage.jsonl reads a run folder: the output may not lie in RUN either."""
    run = tmp_path / "run"
    log = _training_log(run)
    refuses("plot_head_usage", ["--log", log, "--output-dir", run / "figures", "--step-bins", "1"],
            r"--output-dir .*figures")


# --------------------------------------------------------------------------------------
# moh-dit convert: "never contains the checkpoint; beside a checkpoint file, as in the
# examples, is fine" (refusals: tests/test_convert.py::test_script_refuses_bad_input)
# --------------------------------------------------------------------------------------

def test_convert_writes_beside_its_checkpoint_file_as_its_examples_do(tmp_path, load_script):
    from moh_dit.hub.convert import model_to_release_state_dict

    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8)
    torch.save({"ema": model_to_release_state_dict(model), "args": argparse.Namespace()}, tmp_path / "7000000.pt")
    argv = ["--checkpoint", tmp_path / "7000000.pt", "--preset", "MoH-DiT-Tiny", "--output-dir", tmp_path / "moh-dit",
            "-q"]
    assert load_script("convert_checkpoint").cli([str(a) for a in argv]) == 0
    assert (tmp_path / "moh-dit" / "config.json").is_file() and (tmp_path / "7000000.pt").is_file()


# --------------------------------------------------------------------------------------
# docs/design.md: "Records and markers are written to a temporary file and renamed over the
# target, which replaces a link itself, never the file it points to."
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("write", ["atomic_write", "json", "marker"])
def test_a_record_replaces_a_link_never_the_file_it_points_to(tmp_path, write):
    victim = tmp_path / "victim.json"
    victim.write_text("the user's file\n")
    folder = tmp_path / "out"
    folder.mkdir()
    target = folder / (OUTPUT_MARKER if write == "marker" else "record.json")
    target.symlink_to(victim)
    if write == "atomic_write":
        with atomic_write(target) as f:
            f.write(b"{}")
    elif write == "json":
        write_json_atomic(target, {"step": 1})
    else:
        write_output_marker(folder, "convert")
    assert victim.read_text() == "the user's file\n"
    assert not target.is_symlink() and target.is_file()


# --------------------------------------------------------------------------------------
# docs/design.md, docs/training.md: "a crash never leaves a stale lock"
# --------------------------------------------------------------------------------------

def test_a_killed_writer_never_leaves_a_stale_lock(tmp_path):
    out = tmp_path / "out"
    code = ("import time\nfrom moh_dit.utils.output_folders import hold_output_folder\n"
            f"with hold_output_folder({str(out)!r}, 'sample', '--output-dir'):\n"
            "    print('ready', flush=True)\n    time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(FileExistsError, match="being written by another command"):  # held while it lives
            with hold_output_folder(out, "convert"):
                pass
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    with hold_output_folder(out, "convert"):  # free at once after the kill
        pass


# --------------------------------------------------------------------------------------
# docs/sharing.md: the output marker "is not listed in the model card and is never pushed"
# (never pushed: tests/test_export.py::test_push_is_one_upload_and_a_failed_one_leaves_no_new_repo)
# --------------------------------------------------------------------------------------

def test_the_export_marker_is_not_listed_in_the_model_card(tmp_path, load_script):
    argv = ["--model", _moh(tmp_path), "--output-dir", tmp_path / "export", "-q"]
    assert load_script("export_pipeline").cli([str(a) for a in argv]) == 0
    assert (tmp_path / "export" / OUTPUT_MARKER).is_file()
    assert OUTPUT_MARKER not in (tmp_path / "export" / "README.md").read_text()


# --------------------------------------------------------------------------------------
# moh-dit sweep: "prints a table (not with --quiet)"
# --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_sweep_prints_its_table_but_not_with_quiet(tmp_path, load_script, capsys):
    argv = [str(a) for a in _sweep_argv(tmp_path)] + ["--random-inception-seed", "0", "--bootstrap", "0"]
    assert load_script("sweep_head_ratio").cli(argv) == 0
    shown = capsys.readouterr()
    assert "ratio" in shown.out and "fid" in shown.out.lower()
    argv[argv.index(str(tmp_path / "sweep"))] = str(tmp_path / "quiet")
    assert load_script("sweep_head_ratio").cli(argv + ["--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert (tmp_path / "quiet" / "sweep.json").is_file()


# --------------------------------------------------------------------------------------
# docs/evaluation.md: "Distances are computed in blocks, so a 50k x 50k matrix never exists"
# --------------------------------------------------------------------------------------

def test_precision_recall_never_holds_more_than_a_block_of_distances(monkeypatch):
    from moh_dit.evaluation import metrics

    rng = np.random.default_rng(0)
    ref, smp = rng.normal(size=(40, 6)), rng.normal(size=(37, 6)) + 0.3
    whole = metrics.precision_recall(ref, smp)  # one block: the reference numbers
    shapes = []
    distances = metrics._squared_distances

    def recorded(u, v, adm_float16):
        shapes.append((u.shape[0], v.shape[0]))
        return distances(u, v, adm_float16)

    monkeypatch.setattr(metrics, "_squared_distances", recorded)
    assert metrics.precision_recall(ref, smp, batch_size=8) == whole
    assert shapes and max(r for r, _ in shapes) <= 8 and max(c for _, c in shapes) <= 8


# --------------------------------------------------------------------------------------
# moh-dit evaluate: a sample .npz is "streamed, never loaded whole"
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("compressed", [False, True])
def test_a_sample_npz_is_streamed_never_loaded_whole(tmp_path, compressed):
    import tracemalloc

    from moh_dit.evaluation.sources import open_image_source

    images = np.random.default_rng(0).integers(0, 256, (4096, 16, 16, 3), dtype=np.uint8)  # 3 MiB
    (np.savez_compressed if compressed else np.savez)(tmp_path / "samples.npz", arr_0=images)
    source = open_image_source(tmp_path / "samples.npz", "samples")
    seen = 0
    tracemalloc.start()
    try:
        for batch in source.batches(16):
            assert np.array_equal(batch.numpy(), images[seen:seen + len(batch)])
            seen += len(batch)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == len(images)
    assert peak < images.nbytes / 8, f"peak {peak} bytes while reading a {images.nbytes}-byte array"


# --------------------------------------------------------------------------------------
# moh-dit demo / upcycle-demo: offline; the TF Inception "when its weights are found",
# otherwise a random one, said so (never a download); README: "Nothing is downloaded at
# run time unless you ask for Hub weights"
# --------------------------------------------------------------------------------------

DEMOS = {
    "demo": ["--images-per-class", "1", "--max-steps", "1", "--batch-size", "4", "--sample-steps", "1",
             "--sweep-samples", "4", "--reference-per-class", "1", "--ratios", "1.0"],
    "upcycle_demo": ["--dense-steps", "1", "--continue-steps", "1", "--router-warmup-steps", "0",
                     "--images-per-class", "1", "--reference-per-class", "1", "--eval-samples", "4",
                     "--sample-steps", "1", "--classifier-epochs", "1", "--calibration-batches", "1",
                     "--batch-size", "4"],
}


@pytest.mark.slow
@pytest.mark.parametrize("module", DEMOS)
def test_the_demos_never_reach_the_network(module, tmp_path, network_attempts, load_script, capsys):
    argv = ["--output-dir", str(tmp_path / "out"), *DEMOS[module]]
    assert load_script(module).cli(argv) == 0
    assert network_attempts == [], network_attempts
    shown = capsys.readouterr()
    assert "NOT comparable" in shown.out + shown.err  # the random Inception, said so


# --------------------------------------------------------------------------------------
# docs/evaluation.md: "--output ... and a reference cache folder that is, lies inside or
# contains --samples or --ref: what a command writes never becomes what it reads"
# (--output equal to --samples / --labels: tests/test_evaluation_safety.py::test_output_is_never_an_input)
# --------------------------------------------------------------------------------------

class _TinyFeatures(torch.nn.Module):
    """A cheap stand-in for the random Inception, should a refusal ever let the command run."""

    def forward(self, images: torch.Tensor) -> dict:
        pooled = torch.nn.functional.adaptive_avg_pool2d(images.float() / 255.0, 4).flatten(1)
        return {"pool": pooled, "logits": pooled[:, :10], "spatial": pooled[:, :6]}


@pytest.mark.parametrize("flags, match", [
    ({"--cache-dir": "{tmp}"}, r"--cache-dir .* contains --samples"),
    ({"--cache-dir": "{ref}"}, r"--cache-dir .*ref is --ref"),
    ({"--cache-dir": "{ref}/cache"}, r"--cache-dir .*cache lies inside --ref"),
    ({"--output": "{ref}/metrics.json"}, r"--output .*metrics\.json lies inside --ref"),
    ({"--output": "{tmp}/samples.npz"}, r"--output .*samples\.npz is --samples"),
])
def test_evaluate_never_writes_what_it_reads(flags, match, tmp_path, refuses, load_script, monkeypatch):
    from PIL import Image

    from moh_dit import evaluation

    monkeypatch.setattr(evaluation, "build_random_inception", lambda seed: _TinyFeatures())
    (tmp_path / "ref").mkdir()
    for i, image in enumerate(np.random.default_rng(1).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)):
        Image.fromarray(image).save(tmp_path / "ref" / f"{i}.png")
    _images(tmp_path / "samples.npz", count=5, size=16)
    base = {"--samples": "{tmp}/samples.npz", "--ref": "{ref}", "--random-inception-seed": "0", "--device": "cpu",
            "--num-workers": "0", "--cache-dir": "{tmp}/cache", "--output": "{tmp}/metrics.json"}
    fill = lambda value: value.replace("{tmp}", str(tmp_path)).replace("{ref}", str(tmp_path / "ref"))
    argv = lambda extra: [x for flag, value in {**base, **extra}.items() for x in (flag, fill(value))]
    refuses("evaluate", argv(flags), match)
    # The same command writing elsewhere runs: the refusal was the place.
    assert load_script("evaluate").cli(argv({})) == 0
    assert (tmp_path / "metrics.json").is_file() and (tmp_path / "cache").is_dir()
