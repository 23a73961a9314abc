"""The rules every command that writes follows (moh_dit.utils.output_folders, io, cli): one
writer per output folder, locks never written through links, --overwrite only over the
package's own output, outputs never inside inputs, faults of the machine in one line."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil

import pytest

from moh_dit.utils.cli import ArgumentParser, run_cli
from moh_dit.utils.io import LinkRefusedError, atomic_write, lock_file
from moh_dit.utils.output_folders import (OUTPUT_MARKER, OutputFolderBusyError, check_output_folder,
                                          check_outside_inputs, hold_output_folder, is_package_output, lock_path,
                                          write_output_marker)
from moh_dit.errors import InvalidInput
from moh_dit.utils.resources import check_fits_in_memory, check_fits_on_disk


@pytest.mark.parametrize("target", ["file", "missing"])
@pytest.mark.parametrize("create", [True, False])
def test_lock_file_refuses_a_link_and_leaves_its_target_alone(tmp_path, target, create):
    victim = tmp_path / "victim.txt"
    if target == "file":
        victim.write_text("user data\n")
    (tmp_path / ".lock").symlink_to(victim)
    with pytest.raises(LinkRefusedError, match="symbolic link"):
        lock_file(tmp_path / ".lock", create=create)
    assert (victim.read_text() == "user data\n") if target == "file" else not victim.exists()


def test_one_writer_per_output_folder_and_the_lock_goes_away(tmp_path):
    out = tmp_path / "out"
    with hold_output_folder(out, "sample", "--output"):
        lock = tmp_path / ".out.lock"
        assert json.loads(lock.read_text())["command"] == "moh-dit sample"
        with pytest.raises(OutputFolderBusyError, match=r"--output .*out is being written by another command "
                                                        r"\(moh-dit sample, pid \d+"):
            with hold_output_folder(tmp_path / "x" / ".." / "out", "sample", "--output"):
                pass
    assert not lock.exists() and not out.exists()
    with hold_output_folder(out, "convert"):  # free again
        pass


def test_a_link_in_place_of_the_output_lock_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("user data\n")
    (tmp_path / ".out.lock").symlink_to(victim)
    with pytest.raises(LinkRefusedError):
        with hold_output_folder(tmp_path / "out", "sample"):
            pass
    assert victim.read_text() == "user data\n"


def test_overwrite_replaces_only_a_marked_or_recognised_folder(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="pass overwrite") as error:
        check_output_folder(user, False)
    assert error.value.for_command({"overwrite": "--overwrite", "output_dir": "--output-dir"}).endswith(
        "choose another --output-dir or pass --overwrite")
    with pytest.raises(FileExistsError, match="which is not the output of a moh-dit command"):
        check_output_folder(user, True)
    check_output_folder(user, True, is_ours=lambda p: (p / "notes.txt").exists())
    write_output_marker(user, "convert")
    assert is_package_output(user)
    check_output_folder(user, True)
    (user / OUTPUT_MARKER).unlink()
    (user / OUTPUT_MARKER).symlink_to(tmp_path / "elsewhere.json")
    write_output_marker(tmp_path, "convert")  # a marker reached through a link does not count
    (tmp_path / OUTPUT_MARKER).rename(tmp_path / "elsewhere.json")
    assert not is_package_output(user)


@pytest.mark.parametrize("output, source, word", [("data", "data", "is"), ("data/run", "data", "lies inside"),
                                                  ("runs", "runs/data", "contains")])
def test_outputs_never_inside_inputs(tmp_path, output, source, word):
    (tmp_path / source).mkdir(parents=True)
    with pytest.raises(InvalidInput, match=f"^output_dir .* {word} data_dir") as error:
        check_outside_inputs(tmp_path / output, {"data_dir": tmp_path / source, "other": None})
    assert set(error.value.parameters) == {"output_dir", "data_dir"}
    check_outside_inputs(tmp_path / "elsewhere", {"data_dir": tmp_path / source})


def test_outputs_inside_inputs_are_found_through_links(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "data")
    with pytest.raises(ValueError, match="lies inside"):
        check_outside_inputs(tmp_path / "alias" / "run", {"--data-dir": tmp_path / "data"})


def test_a_failed_write_names_its_file(tmp_path, monkeypatch):
    target = tmp_path / "big.bin"

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match=f"while writing {target}") as error:
        with atomic_write(target) as f:
            monkeypatch.setattr(f, "write", full)
            f.write(b"x")
    assert error.value.errno == errno.ENOSPC and error.value.filename == str(target)
    assert list(tmp_path.iterdir()) == []


def _command(error):
    def parse(argv):
        return ArgumentParser().parse_args(argv)

    def main(args):
        raise error

    return main, parse


@pytest.mark.parametrize("error, expected", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/run/x.png"), "No space left on device: /data/run/x.png"),
    (MemoryError(), "out of memory"),
    (PermissionError(errno.EACCES, "Permission denied", "/srv/model"), "Permission denied: /srv/model"),
])
def test_faults_of_the_machine_are_one_line_and_debug_shows_the_traceback(capsys, error, expected):
    main, parse = _command(error)
    assert run_cli(main, parse, []) == 1
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(type(error)):
        run_cli(main, parse, ["--debug"])


def test_a_bug_keeps_its_traceback():
    main, parse = _command(OSError(errno.EBADF, "Bad file descriptor"))
    with pytest.raises(OSError):
        run_cli(main, parse, [])
    main, parse = _command(KeyError("bug"))
    with pytest.raises(KeyError):
        run_cli(main, parse, [])


def test_sizes_beyond_the_machine_are_refused(tmp_path):
    with pytest.raises(InvalidInput, match=r"num_samples 9 needs about 1\.0 GiB of memory, more than the 1\.0 MiB") as error:
        check_fits_in_memory(2**30, "num_samples 9", "use fewer", available=2**20, parameters="num_samples")
    assert error.value.for_command({"num_samples": "--num-samples"}).startswith("--num-samples 9 needs")
    check_fits_in_memory(2**19, "num_samples 9", "use fewer", available=2**20)
    with pytest.raises(InvalidInput, match=r"writes about 8\.0 EiB|writes about 8192\.0 PiB"):
        check_fits_on_disk(2.0**63, tmp_path / "new" / "folder", "images_per_class 9", "use fewer")
    check_fits_on_disk(1, tmp_path / "new", "images_per_class 9", "use fewer")
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------------------
# Each rule, walked over every command that writes an output folder. A recipe makes the
# command's inputs under ``root`` and returns its argv with ``out`` as the output folder;
# inputs are tiny, and every recipe's flags keep a run short should a check ever let it
# through. ``inputs`` names the input folder an output could be put inside (None: the
# command reads no folder of the user's).
# --------------------------------------------------------------------------------------

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from moh_dit import MoHDiTTransformer2DModel  # noqa: E402
from moh_dit.data.demo_data import make_demo_dataset  # noqa: E402
from moh_dit.hub.convert import model_to_release_state_dict  # noqa: E402


def _moh(root: Path) -> Path:
    if not (root / "moh").exists():
        MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8).save_pretrained(root / "moh")
    return root / "moh"


def _data(root: Path) -> Path:
    if not (root / "data").exists():
        make_demo_dataset(root / "data", images_per_class=2, image_size=16)
    return root / "data"


def _images(path: Path, count: int = 4) -> Path:
    rng = np.random.default_rng(0)
    np.savez(path, arr_0=rng.integers(0, 256, (count, 8, 8, 3), dtype=np.uint8))  # the size _moh samples
    return path


def _train(root, out):
    return ["--preset", "MoH-DiT-Tiny", "--data-dir", _data(root), "--vae", "none", "--image-size", "16",
            "--output-dir", out, "--max-steps", "1", "--global-batch-size", "4", "--num-workers", "0",
            "--report-to", "none"]


def _extract_latents(root, out):
    from conftest import tiny_vae_

    if not (root / "vae").exists():
        tiny_vae_(levels=2).save_pretrained(root / "vae")
    return ["--data-dir", _data(root), "--vae", root / "vae", "--image-size", "16", "--output-dir", out,
            "--num-workers", "0", "--device", "cpu", "--batch-size", "4"]


def _sample(root, out):
    return ["--model", _moh(root), "--output-dir", out, "--num-samples", "2", "--per-device-batch-size", "2",
            "--num-inference-steps", "1"]


def _sweep(root, out):
    return ["--model", _moh(root), "--ref", _images(root / "ref.npz"), "--ratios", "1.0", "--num-samples", "4",
            "--num-inference-steps", "1", "--random-inception-seed", "0", "--no-cache", "--device", "cpu",
            "--output-dir", out]


def _convert(root, out):
    (root / "release").mkdir(exist_ok=True)
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8)
    torch.save({"ema": model_to_release_state_dict(model), "args": argparse.Namespace()}, root / "release" / "ckpt.pt")
    return ["--checkpoint", root / "release" / "ckpt.pt", "--preset", "MoH-DiT-Tiny", "--output-dir", out]


def _upcycle(root, out):
    if not (root / "dense").exists():
        MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8).save_pretrained(root / "dense")
    return ["--checkpoint", root / "dense", "--activation", "0.75", "--output-dir", out]


def _export(root, out):
    return ["--model", _moh(root), "--output-dir", out]


def _train_classifier(root, out):
    return ["--data-dir", _data(root), "--output-dir", out, "--image-size", "16", "--epochs", "1", "--width", "2",
            "--batch-size", "8"]


def _make_demo_dataset(root, out):
    return ["--output-dir", out, "--images-per-class", "1", "--image-size", "12"]


def _demo(root, out):
    return ["--output-dir", out, "--images-per-class", "1", "--max-steps", "1", "--batch-size", "4",
            "--sample-steps", "1", "--sweep-samples", "4", "--reference-per-class", "1", "--ratios", "1.0"]


def _upcycle_demo(root, out):
    return ["--output-dir", out, "--dense-steps", "1", "--continue-steps", "1", "--router-warmup-steps", "0",
            "--images-per-class", "1", "--reference-per-class", "1", "--eval-samples", "4", "--sample-steps", "1",
            "--classifier-epochs", "1", "--calibration-batches", "1", "--batch-size", "4"]


def _plot_head_usage(root, out):
    return ["--model", _moh(root), "--output-dir", out, "--images-per-class", "1", "--num-inference-steps", "1",
            "--classes", "0", "--device", "cpu"]


# module -> (marker name, recipe, input folder flag whose folder an output may not lie in, has --overwrite)
WRITERS = {
    "train": ("train", _train, "data", False),
    "extract_latents": ("extract-latents", _extract_latents, "data", True),
    "sample": ("sample", _sample, "moh", False),
    "sweep_head_ratio": ("sweep", _sweep, "moh", False),
    "convert_checkpoint": ("convert", _convert, None, True),  # reads a file: writing beside it is fine
    "upcycle": ("upcycle", _upcycle, "dense", True),
    "export_pipeline": ("export", _export, "moh", True),
    "train_classifier": ("train-classifier", _train_classifier, "data", True),
    "make_demo_dataset": ("make-demo-dataset", _make_demo_dataset, None, True),
    "demo": ("demo", _demo, None, False),
    "upcycle_demo": ("upcycle-demo", _upcycle_demo, None, False),
    "plot_head_usage": ("plot-head-usage", _plot_head_usage, "moh", True),
}




@pytest.mark.parametrize("module", WRITERS)
def test_a_second_writer_stops_at_once_naming_the_first(module, tmp_path, refuses):
    name, recipe, _, _ = WRITERS[module]
    out = tmp_path / "out"
    (tmp_path / "in").mkdir()
    argv = recipe(tmp_path / "in", out)
    with hold_output_folder(out, "sample", "--output-dir"):
        refuses(module, argv, r"--output-dir .*out is being written by another command \(moh-dit sample, pid \d+")


@pytest.mark.parametrize("module", WRITERS)
def test_a_link_in_place_of_the_lock_is_never_written_through(module, tmp_path, refuses):
    name, recipe, _, _ = WRITERS[module]
    (tmp_path / "in").mkdir()
    out = tmp_path / "out"
    argv = recipe(tmp_path / "in", out)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    lock_path(out).symlink_to(victim)
    refuses(module, argv, r"is a symbolic link")
    assert victim.read_text() == "the user's file\n"


@pytest.mark.parametrize("module", WRITERS)
def test_a_folder_the_package_did_not_write_is_never_replaced(module, tmp_path, refuses, load_script):
    name, recipe, _, overwrite = WRITERS[module]
    (tmp_path / "in").mkdir()
    out = tmp_path / "out"
    argv = recipe(tmp_path / "in", out) + (["--overwrite"] if overwrite else [])
    out.mkdir()
    (out / "notes.txt").write_text("the user's notes\n")
    if module == "train":
        # A run folder may be one the user made (holding notes, a launch script): training
        # only adds its own files there, and refuses a folder that already holds a run.
        assert load_script(module).cli([str(a) for a in argv]) == 0
        assert (out / "notes.txt").read_text() == "the user's notes\n" and (out / "final").is_dir()
        return
    refuses(module, argv, r"out")  # the refusal names the folder
    assert (out / "notes.txt").read_text() == "the user's notes\n"


@pytest.mark.parametrize("module", [m for m, (_, _, source, _) in WRITERS.items() if source is not None])
@pytest.mark.parametrize("where", ["inside", "equal"])
def test_an_output_inside_an_input_is_refused_before_any_work(module, where, tmp_path, refuses):
    name, recipe, source, _ = WRITERS[module]
    root = tmp_path / "in"
    root.mkdir()
    recipe(root, tmp_path / "unused")  # make the inputs
    out = root / source / "out" if where == "inside" else root / source
    argv = recipe(root, out) + (["--overwrite"] if where == "equal" and WRITERS[module][3] else [])
    # Equal to an input, the folder is also not the command's own output: either refusal will do.
    refuses(module, argv, r"lies inside" if where == "inside" else r"is --|already|would replace")


@pytest.mark.parametrize("module", WRITERS)
def test_every_spelling_of_a_folder_meets_the_same_lock(module, tmp_path, refuses):
    """A link to the output folder is the same folder: a command writing it through the link
    stops at once while another writes it under its own name (and the other way round)."""
    name, recipe, _, _ = WRITERS[module]
    (tmp_path / "in").mkdir()
    real, alias = tmp_path / "real", tmp_path / "alias"
    real.mkdir()
    alias.symlink_to(real, target_is_directory=True)
    for held, used in ((real, alias), (alias, real)):
        with hold_output_folder(held, "sample"):
            refuses(module, _rerun(module, recipe(tmp_path / "in", used)),
                    r"being written by another command \(moh-dit sample")


def _rerun(module: str, argv: list) -> list:
    """The arguments that run ``module`` again on the folder it made (replacing it where the
    command replaces, else resuming or finishing it)."""
    return argv + (["--overwrite"] if WRITERS[module][3] else [])


@pytest.mark.slow
@pytest.mark.parametrize("module", WRITERS)
def test_a_link_inside_the_output_is_never_written_through(module, tmp_path, refuses, load_script):
    """A link planted anywhere below a finished output folder (here in place of a subfolder or
    beside the files) is refused, naming it, before the command writes anything, and the
    folder it points to is left as it was."""
    name, recipe, _, _ = WRITERS[module]
    (tmp_path / "in").mkdir()
    out = tmp_path / "out"
    argv = [str(a) for a in recipe(tmp_path / "in", out)]
    assert load_script(module).cli(argv) == 0
    victim = tmp_path / "user"
    victim.mkdir()
    (victim / "000003.png").write_bytes(b"the user's image")
    sub = next((p for p in sorted(out.rglob("*")) if p.is_dir()), None)
    planted = out / "planted" if sub is None else sub
    if sub is not None:
        shutil.move(sub, tmp_path / "moved")
    planted.symlink_to(victim, target_is_directory=True)
    refuses(module, _rerun(module, argv), re.escape(str(planted.relative_to(tmp_path))))
    assert [p.name for p in victim.iterdir()] == ["000003.png"]
    assert (victim / "000003.png").read_bytes() == b"the user's image"


@pytest.mark.parametrize("module", [m for m in WRITERS if m != "train"])
def test_training_never_continues_in_another_commands_folder(module, tmp_path, refuses):
    """A folder another command wrote (its marker says which) is not a run folder: training
    into it is refused naming the writer, whatever that folder holds."""
    name = WRITERS[module][0]
    (tmp_path / "in").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    write_output_marker(out, name)
    refuses("train", _train(tmp_path / "in", out), rf"--output-dir .*out was written by moh-dit {name}")
