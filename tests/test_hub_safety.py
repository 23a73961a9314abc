"""The output rules of the commands that make models and data (convert, upcycle, export,
train-classifier, make-demo-dataset, demo, upcycle-demo): every output is marked and readable
by others, --overwrite replaces only the command's own output, one writer per folder, outputs
never inside inputs, a full disk in one line; and a classifier folder or weights file that was
edited or damaged is refused in one line naming the file, before anything large is allocated."""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.data.demo_data import make_demo_dataset
from moh_dit.errors import DamagedFile, InvalidInput
from moh_dit.evaluation import classifier as clf
from moh_dit.hub.convert import model_to_release_state_dict
from moh_dit.utils.output_folders import OUTPUT_MARKER, hold_output_folder, write_output_marker

pytestmark = pytest.mark.usefixtures("one_thread")

DISK_FULL = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


# Each recipe prepares the inputs of one command under ``root`` and returns the argv that reaches
# its output-folder checks, writing to ``out``.
def _convert(root: Path, out: Path) -> list[str]:
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8)
    torch.save({"ema": model_to_release_state_dict(model), "args": argparse.Namespace()}, root / "ckpt.pt")
    return ["--checkpoint", root / "ckpt.pt", "--preset", "MoH-DiT-Tiny", "--output-dir", out]


def _upcycle(root: Path, out: Path) -> list[str]:
    MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8).save_pretrained(root / "dense")
    return ["--checkpoint", root / "dense", "--activation", "0.75", "--output-dir", out]


def _export(root: Path, out: Path) -> list[str]:
    MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8).save_pretrained(root / "model")
    return ["--model", root / "model", "--output-dir", out]


def _train_classifier(root: Path, out: Path) -> list[str]:
    make_demo_dataset(root / "data", images_per_class=3, image_size=16)
    return ["--data-dir", root / "data", "--output-dir", out, "--image-size", "16", "--epochs", "1", "--width", "2",
            "--batch-size", "8"]


def _make_demo_dataset(root: Path, out: Path) -> list[str]:
    return ["--output-dir", out, "--images-per-class", "1", "--image-size", "12"]


# The demos at their smallest: should a check ever let them through, the test stays short.
def _demo(root: Path, out: Path) -> list[str]:
    return ["--output-dir", out, "--images-per-class", "1", "--max-steps", "1", "--batch-size", "4", "--sample-steps",
            "1", "--sweep-samples", "4", "--reference-per-class", "1", "--ratios", "1.0"]


def _upcycle_demo(root: Path, out: Path) -> list[str]:
    return ["--output-dir", out, "--dense-steps", "1", "--continue-steps", "1", "--router-warmup-steps", "0",
            "--images-per-class", "1", "--reference-per-class", "1", "--eval-samples", "4", "--sample-steps", "1",
            "--classifier-epochs", "1", "--calibration-batches", "1", "--batch-size", "4"]


WRITERS = {"convert_checkpoint": ("convert", _convert), "upcycle": ("upcycle", _upcycle),
           "export_pipeline": ("export", _export), "train_classifier": ("train-classifier", _train_classifier),
           "make_demo_dataset": ("make-demo-dataset", _make_demo_dataset)}
DEMOS = {"demo": ("demo", _demo), "upcycle_demo": ("upcycle-demo", _upcycle_demo)}


def _argv(recipe, tmp_path: Path, out: Path, *extra: str) -> list[str]:
    inputs = tmp_path / "inputs"
    inputs.mkdir(exist_ok=True)
    return [str(a) for a in recipe(inputs, out)] + list(extra)


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _modes(root: Path) -> set[tuple[str, str]]:
    """(kind, octal mode) of the folder and everything in it."""
    return {("dir" if p.is_dir() else "file", oct(stat.S_IMODE(p.stat().st_mode))) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("script", WRITERS)
@pytest.mark.slow
def test_outputs_are_marked_readable_by_others_and_replaced_only_with_overwrite(script, tmp_path, umask_022,
                                                                                load_script, capsys):
    command, recipe = WRITERS[script]
    out = tmp_path / "out"
    argv = _argv(recipe, tmp_path, out)
    assert load_script(script).cli(argv) == 0, capsys.readouterr().err
    assert json.loads((out / OUTPUT_MARKER).read_text())["written_by"] == f"moh-dit {command}"
    # Whoever wrote the files (safetensors and mkdtemp make them owner-only), the umask decides.
    assert _modes(out) == {("dir", "0o755"), ("file", "0o644")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs", "out"]  # no lock, no temporary folder left
    capsys.readouterr()
    assert load_script(script).cli(argv) == 1 and "pass --overwrite" in capsys.readouterr().err
    assert load_script(script).cli(argv + ["--overwrite"]) == 0  # its own output: replaced
    assert json.loads((out / OUTPUT_MARKER).read_text())["written_by"] == f"moh-dit {command}"


@pytest.mark.parametrize("script", WRITERS)
@pytest.mark.parametrize("writer", [None, "train"])
def test_overwrite_never_replaces_a_folder_the_command_did_not_write(script, writer, tmp_path, refuses):
    command, recipe = WRITERS[script]
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    if writer is not None:  # another command's output, such as a training run
        write_output_marker(out, writer)
    match = "which moh-dit train wrote" if writer else "--overwrite would replace .*theirs', which is not"
    refuses(script, _argv(recipe, tmp_path, out, "--overwrite"), match)


@pytest.mark.parametrize("script", {**WRITERS, **DEMOS})
def test_one_writer_per_output_folder(script, tmp_path, refuses):
    _, recipe = {**WRITERS, **DEMOS}[script]
    out = tmp_path / "out"
    argv = _argv(recipe, tmp_path, out)
    with hold_output_folder(out, "sample", "--output-dir"):
        refuses(script, argv, r"--output-dir .*out is being written by another command \(moh-dit sample, pid")


@pytest.mark.parametrize("script", DEMOS)
def test_a_demo_writes_only_into_its_own_folder(script, tmp_path, refuses):
    _, recipe = DEMOS[script]
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refuses(script, _argv(recipe, tmp_path, out), r"--output-dir .*mine exists and is not a.* demo")
    (out / "notes.txt").unlink()
    write_output_marker(out, "train")
    refuses(script, _argv(recipe, tmp_path, out), r"not a.* demo.*moh-dit train wrote it")


def test_an_earlier_demo_folder_is_recognised(tmp_path, load_script):
    demo = load_script("demo")
    out = tmp_path / "demo"
    make_demo_dataset(out / "data", images_per_class=1, image_size=12)
    (out / "demo_summary.json").write_text("{}")
    (out / "data" / OUTPUT_MARKER).unlink()  # from before the marker
    demo.check_demo_folder(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a demo's folder"):
        demo.check_demo_folder(out)


def _conv_holding_its_checkpoint(root: Path) -> list:
    argv = _convert(root, root / "conv")
    (root / "conv").mkdir()
    write_output_marker(root / "conv", "convert")  # a folder convert may replace...
    (root / "ckpt.pt").rename(root / "conv" / "ckpt.pt")  # ...holding the checkpoint it reads
    return argv[:1] + [root / "conv" / "ckpt.pt"] + argv[2:] + ["--overwrite"]


def _export_holding_its_metrics(root: Path) -> list:
    out = root / "export"
    out.mkdir()
    write_output_marker(out, "export")
    (out / "metrics.json").write_text(json.dumps({"fid": 1.0}))
    return _export(root, out) + ["--metrics", out / "metrics.json", "--overwrite"]


def _demo_holding_its_weights(root: Path) -> list:
    (root / "inception.pth").write_bytes(b"weights")
    return _demo(root, root) + ["--inception-weights", root / "inception.pth"]


def _upcycle_demo_holding_its_weights(root: Path) -> list:
    (root / "inception.pth").write_bytes(b"weights")
    return _upcycle_demo(root, root) + ["--inception-weights", root / "inception.pth"]


def _calibration_inside(root: Path) -> list:
    (root / "calib" / "a").mkdir(parents=True)
    return _upcycle(root, root / "calib" / "up") + ["--calibration-data", root / "calib"]


INSIDE = [
    ("convert_checkpoint", _conv_holding_its_checkpoint, "conv contains --checkpoint"),
    ("upcycle", lambda root: _upcycle(root, root / "dense" / "up"), "up lies inside --checkpoint"),
    ("upcycle", _calibration_inside, "up lies inside --calibration-data"),
    ("export_pipeline", lambda root: _export(root, root / "model" / "export"), "export lies inside --model"),
    ("export_pipeline", _export_holding_its_metrics, "export contains --metrics"),
    ("train_classifier", lambda root: _train_classifier(root, root / "data" / "clf"), "clf lies inside --data-dir"),
    ("demo", _demo_holding_its_weights, "contains --inception-weights"),
    ("upcycle_demo", _upcycle_demo_holding_its_weights, "contains --inception-weights"),
]


@pytest.mark.parametrize("script, build, match", INSIDE, ids=[f"{s}-{m}" for s, _, m in INSIDE])
def test_outputs_never_inside_inputs(script, build, match, tmp_path, refuses):
    root = tmp_path / "inputs"
    root.mkdir()
    refuses(script, [str(a) for a in build(root)], rf"--output-dir .*{match}")


@pytest.mark.parametrize("script", ["convert_checkpoint", "upcycle", "export_pipeline", "train_classifier"])
def test_a_full_disk_is_one_line_naming_the_output(script, tmp_path, monkeypatch, load_script, capsys):
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError(DISK_FULL)

    _, recipe = WRITERS[script]
    out = tmp_path / "out"
    argv = _argv(recipe, tmp_path, out)
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    monkeypatch.setattr(clf, "save_file", full)
    assert load_script(script).cli(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"No space left on device while writing {out}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs"]  # nothing half-written left


def test_a_full_disk_while_drawing_the_demo_dataset(tmp_path, monkeypatch, load_script, capsys):
    from PIL import Image

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Image.Image, "save", full)
    out = tmp_path / "shapes"
    assert load_script("make_demo_dataset").cli(_argv(_make_demo_dataset, tmp_path, out)) == 1
    err = capsys.readouterr().err
    assert f"No space left on device while writing {out}" in err and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["inputs"]


def test_train_classifier_names_its_output_flag(tmp_path, load_script, capsys):
    """The messages name --output-dir, the flag the help shows (--output is its older spelling)."""
    script = load_script("train_classifier")
    argv = _argv(_train_classifier, tmp_path, tmp_path / "user")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    for spelling in ("--output-dir", "--output"):
        argv[argv.index("--output-dir" if "--output-dir" in argv else "--output")] = spelling
        assert script.cli(argv) == 1
        err = capsys.readouterr().err
        assert "--output-dir" in err and "--overwrite" in err and "output_dir" not in err
    assert script.cli(argv + ["--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "classifier.json" in err and "--output-dir" in err and "output_dir" not in err
    assert (tmp_path / "user" / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------------------
# Classifier folders and --classifier-weights files that were edited or damaged
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("classifier")
    make_demo_dataset(root / "data", images_per_class=3, image_size=16)
    clf.train_classifier(root / "data", root / "clf", image_size=16, epochs=1, width=2, batch_size=8, log=None)
    return root / "clf"


def _edited(folder: Path, tmp_path: Path, **fields) -> Path:
    copy = tmp_path / "clf"
    copy.mkdir()
    for file in folder.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    meta = json.loads((copy / "classifier.json").read_text())
    meta.update(fields)
    (copy / "classifier.json").write_text(json.dumps(meta))
    return copy


@pytest.mark.parametrize("fields, match", [
    # Reproductions: a width of 1e5 tried to allocate 360 GB; a wrong class count gave a
    # state-dict size-mismatch traceback.
    ({"width": 100_000}, r"classifier\.json .*width 100000.*\[1, 4096\]"),
    ({"num_classes": 5}, r"classifier\.json .*5 distinct class names"),
    ({"num_classes": 0}, r"num_classes 0.*\[1, 100000\]"),
    ({"width": "16"}, r"width '16'"),
    ({"width": 4}, r"model\.safetensors .*features\.0\.bias \(2,\) instead of \(4,\)"),
    ({"image_size": -1}, r"image_size -1.*\[8, 4096\]"),
    ({"in_channels": 1}, r"in_channels 1.*\[3, 3\]"),
    ({"classes": ["a"] * 12}, r"12 distinct class names"),
    ({"held_out": {"accuracy": 3}}, r"held_out accuracy 3"),
])
def test_an_edited_classifier_json_is_refused_naming_it(classifier_folder, tmp_path, fields, match, monkeypatch):
    folder = _edited(classifier_folder, tmp_path, **fields)
    monkeypatch.setattr(clf, "SmallCNN", _no_allocation(clf.SmallCNN))
    with pytest.raises((DamagedFile, InvalidInput), match=match) as error:
        clf.load_classifier(folder)
    assert error.value.parameters == ("classifier",) and str(folder) in str(error.value)


def _no_allocation(cls):
    """SmallCNN that may only be built on the meta device (shapes, no memory) until the checks pass."""
    def build(*args, **kwargs):
        assert torch.empty(0).device.type == "meta", "the model was allocated before its sizes were checked"
        return cls(*args, **kwargs)

    return build


def test_damaged_classifier_files_are_refused_naming_them(classifier_folder, tmp_path):
    folder = _edited(classifier_folder, tmp_path)
    (folder / "class_index.json").write_text(json.dumps({"x": 0}))
    with pytest.raises(DamagedFile, match=r"class_index\.json .*1 classes.*12 classes"):
        clf.load_classifier(folder)
    (folder / "class_index.json").write_bytes((classifier_folder / "class_index.json").read_bytes())
    (folder / "classifier.json").write_text("{")
    with pytest.raises(DamagedFile, match=r"classifier\.json .*JSONDecodeError"):
        clf.load_classifier(folder)
    (folder / "classifier.json").write_bytes((classifier_folder / "classifier.json").read_bytes())
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(DamagedFile, match=r"model\.safetensors .*readable"):
        clf.load_classifier(folder)
    assert clf.load_classifier(classifier_folder).num_classes == 12


@pytest.mark.parametrize("content, match", [
    (b"garbage", r"readable torch state dict"),
    ({"a": torch.zeros(3)}, r"missing .*; unexpected a"),
    ([1, 2], r"holds a list"),
    ("resnet18-head", r"fc\.weight \(5, 512\) instead of \(1000, 512\)"),
])
def test_classifier_weights_that_do_not_fit_the_model_are_refused(tmp_path, content, match):
    """``--classifier-weights`` in one line naming the file (it raised IndexError, RuntimeError
    size-mismatch and unpickling tracebacks)."""
    import torchvision

    file = tmp_path / "garbage.pth"
    if content == "resnet18-head":
        state = torchvision.models.resnet18(num_classes=5).state_dict()
        file = tmp_path / "head.safetensors"
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, file)
    elif isinstance(content, bytes):
        file.write_bytes(content)
    else:
        torch.save(content, file)
    with pytest.raises((DamagedFile, InvalidInput), match=match) as error:
        clf.load_classifier("torchvision:resnet18", file)
    assert error.value.parameters == ("classifier_weights",) and str(file) in str(error.value)
