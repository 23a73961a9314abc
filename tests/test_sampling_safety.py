"""moh-dit sample writes only its own folder: one writer at a time, never into what it reads,
never over files it did not write; a nonsensical config.json, a count the disk cannot hold, a
full disk and a damaged PNG each end in one line (or, for its own damaged PNG, in a repair)."""

from __future__ import annotations

import errno
import json
import os
import tracemalloc

import numpy as np
import PIL.Image
import pytest

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.errors import DamagedFile
from moh_dit.sampling.sample import (ClassLabels, DamagedSampleError, SampleSettings, class_labels_for, png_path,
                                     sample_images, save_png_atomic, write_adm_npz)
from moh_dit.utils.output_folders import OUTPUT_MARKER, hold_output_folder

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, randomize):
    """A tiny MoH transformer folder outside each test's tmp_path (which `refuses` watches)."""
    folder = tmp_path_factory.mktemp("model") / "moh"
    randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8), seed=4).save_pretrained(folder)
    return folder


def _argv(model, out, *extra):
    return ["--model", model, "--output-dir", out, "--num-samples", "4", "--per-device-batch-size", "2",
            "--num-inference-steps", "1", *extra]


def _run(load_script, argv) -> int:
    return load_script("sample").cli([str(a) for a in argv])


def test_a_second_sample_into_the_same_folder_stops_at_once(model_dir, tmp_path, refuses, load_script):
    """Reproduction: two runs with other settings into one new folder both 'succeeded', and the
    first's images were the second's. Now the second stops, naming the first, and writes nothing."""
    out = tmp_path / "out"
    with hold_output_folder(out, "sample"):
        refuses("sample", _argv(model_dir, out, "--guidance-scale", "4"),
                r"--output-dir .*out is being written by another command \(moh-dit sample, pid \d+")
    assert not out.exists()
    assert _run(load_script, _argv(model_dir, out)) == 0  # free again once the holder is done
    assert json.loads((out / OUTPUT_MARKER).read_text())["written_by"] == "moh-dit sample"
    assert not (tmp_path / ".out.lock").exists()


@pytest.mark.parametrize("where, word", [("model", "is"), ("model/samples", "lies inside"), (".", "contains")])
def test_output_never_in_what_it_reads(where, word, tmp_path, model_dir, refuses):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    refuses("sample", _argv(model, tmp_path / where), rf"--output-dir .* {word} --model .*model")


def test_vae_folder_is_an_input_too(tmp_path, model_dir, tiny_vae, refuses):
    tiny_vae().save_pretrained(tmp_path / "vae")
    refuses("sample", _argv(model_dir, tmp_path / "vae" / "out", "--vae", tmp_path / "vae"), r"lies inside --vae")


def test_a_folder_of_someone_else_is_refused_and_an_own_one_resumed(tmp_path, model_dir, refuses, load_script):
    user = tmp_path / "user"
    user.mkdir()
    (user / "samples.npz").write_bytes(b"the user's own samples")
    refuses("sample", _argv(model_dir, user), r"--output-dir .*user already holds files that moh-dit sample did not "
                                              r"write \(samples\.npz\)")
    (tmp_path / "empty").mkdir()
    assert _run(load_script, _argv(model_dir, tmp_path / "empty")) == 0
    assert _run(load_script, _argv(model_dir, tmp_path / "empty", "--num-samples", "5")) == 0  # its own: resumed
    assert len(list((tmp_path / "empty" / "samples").glob("*.png"))) == 5


@pytest.fixture(scope="module")
def bad_configs(tmp_path_factory, model_dir):
    """Copies of the model folder whose config.json has one bad field each."""
    import shutil

    root = tmp_path_factory.mktemp("bad_configs")
    config = json.loads((model_dir / "config.json").read_text())
    for name, field, value in [("negative", "sample_size", -16), ("zero", "sample_size", 0),
                               ("patch", "patch_size", 3), ("heads", "num_attention_heads", 0),
                               ("hidden", "hidden_size", 130), ("layers", "num_layers", -1),
                               ("huge", "hidden_size", 2**24)]:
        shutil.copytree(model_dir, root / name)
        (root / name / "config.json").write_text(json.dumps({**config, field: value}))
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    return root


@pytest.mark.parametrize("name, match", [
    ("negative", r"negative/config\.json: sample_size must be a positive integer, got -16"),
    ("zero", r"zero/config\.json: sample_size must be a positive integer, got 0"),
    ("patch", r"patch/config\.json: sample_size=8 is not divisible by patch_size=3"),
    ("heads", r"heads/config\.json: num_attention_heads must be a positive integer"),
    ("hidden", r"hidden/config\.json: hidden_size=130 must be divisible by 4"),
    ("layers", r"layers/config\.json: num_layers must be a positive integer, got -1"),
    ("huge", r"huge/config\.json: the transformer .* needs about .* of memory, more than"),
    ("broken", r"broken/config\.json is not valid JSON"),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_nonsensical_config_is_one_line_before_anything_is_written(name, match, dry_run, bad_configs, tmp_path,
                                                                      refuses):
    """Reproduction: sample_size -16 passed --dry-run and wrote sample_config.json before a
    RuntimeError; sample_size 0 was a ZeroDivisionError traceback."""
    refuses("sample", _argv(bad_configs / name, tmp_path / "out", *(["--dry-run"] if dry_run else [])), match)


def test_a_sample_count_the_disk_cannot_hold_is_refused_first(model_dir, tmp_path, refuses):
    refuses("sample", _argv(model_dir, tmp_path / "out", "--num-samples", str(10**15)),
            r"--num-samples 1000000000000000 .*samples\.npz.* free on the disk of .*out.*--no-npz")


class _Stop(Exception):
    pass


def test_memory_does_not_grow_with_the_sample_count(tmp_path, tiny_pipe):
    """Reproduction: --num-samples 100000000 grew ~29 bytes per sample (index lists, one stat
    per index, a label list) before the first image. Now the first batch comes at once."""
    pipe = tiny_pipe(seed=4)
    settings = SampleSettings(num_samples=10**7, guidance_scale=1.0, num_inference_steps=1)

    def stop(batch):
        raise _Stop

    tracemalloc.start()
    try:
        with pytest.raises(_Stop):
            sample_images(pipe, tmp_path / "out", settings, batch_size=2, progress=False, on_batch=stop)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, peak
    labels = ClassLabels(10**12, 10)
    assert len(labels) == 10**12 and labels[10**12 - 1] == 9 and labels[5:8] == [5, 6, 7]
    uniform = ClassLabels(50, 10, "uniform", seed=3)
    assert uniform[0:50] == class_labels_for(range(50), 10, "uniform", seed=3) and uniform[-1] == uniform[49]


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_writing_a_png_is_one_line_naming_it(model_dir, tmp_path, load_script, monkeypatch, capsys):
    monkeypatch.setattr(PIL.Image.Image, "save", _full_disk)
    assert _run(load_script, _argv(model_dir, tmp_path / "out", "--quiet")) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "000000.png" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not [p for p in (tmp_path / "out" / "samples").iterdir()]  # no half-written file left


def test_a_full_disk_while_writing_the_npz_is_one_line_naming_it(model_dir, tmp_path, load_script, monkeypatch,
                                                                 capsys):
    monkeypatch.setattr(np.lib.format, "write_array_header_1_0", _full_disk)
    assert _run(load_script, _argv(model_dir, tmp_path / "out")) == 1
    err = capsys.readouterr().err
    assert f"while writing {tmp_path / 'out' / 'samples.npz'}" in err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [OUTPUT_MARKER, "sample_config.json", "samples"]
    monkeypatch.undo()
    assert _run(load_script, _argv(model_dir, tmp_path / "out")) == 0  # the rerun finishes the job


def _cut_short(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _scramble_middle(path):
    data = bytearray(path.read_bytes())
    for i in range(40, 60):  # inside the image data; the file still ends with its IEND chunk
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_rerun_makes_damaged_pngs_again(model_dir, tmp_path, load_script, capsys):
    """Reproduction: a truncated PNG left by a crash made every rerun fail with 'image file is
    truncated', naming no file. Now the rerun makes it again, saying which, and finishes."""
    out = tmp_path / "out"
    assert _run(load_script, _argv(model_dir, out)) == 0
    with np.load(out / "samples.npz") as data:
        expected, labels = data["arr_0"], data["arr_1"]
    _cut_short(png_path(out, 1))
    _scramble_middle(png_path(out, 2))
    capsys.readouterr()
    assert _run(load_script, _argv(model_dir, out)) == 0
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert f"{png_path(out, 1)} is damaged (cut short); making image 1 again" in text
    assert f"{png_path(out, 2)} is damaged (it cannot be decoded); making image 2 again" in text
    with np.load(out / "samples.npz") as data:
        np.testing.assert_array_equal(data["arr_0"], expected)
        np.testing.assert_array_equal(data["arr_1"], labels)


def test_the_npz_writer_names_a_damaged_png(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, size=(3, 4, 4, 3), dtype=np.uint8)
    for i, image in enumerate(images):
        save_png_atomic(png_path(tmp_path, i), image)
    _cut_short(png_path(tmp_path, 1))
    with pytest.raises(DamagedFile) as caught:
        write_adm_npz(tmp_path, 3)
    assert isinstance(caught.value, DamagedSampleError) and isinstance(caught.value, ValueError)
    assert (caught.value.path, caught.value.index) == (png_path(tmp_path, 1), 1)
    assert str(png_path(tmp_path, 1)) in str(caught.value) and "--" not in str(caught.value)
    assert not (tmp_path / "samples.npz").exists() and not list(tmp_path.glob(".*tmp"))
    remade = []
    path = write_adm_npz(tmp_path, 3, on_damaged=lambda i, p: (remade.append(i), save_png_atomic(p, images[i])))
    assert remade == [1]
    with np.load(path) as data:
        np.testing.assert_array_equal(data["arr_0"], images)


@pytest.mark.slow
def test_evaluate_names_a_damaged_sample_and_how_to_continue(model_dir, tmp_path, load_script, refuses):
    out = tmp_path / "out"
    assert _run(load_script, _argv(model_dir, out, "--no-npz")) == 0
    _cut_short(png_path(out, 3))
    np.savez(tmp_path / "ref.npz", arr_0=np.zeros((4, 8, 8, 3), dtype=np.uint8))
    refuses("evaluate", ["--samples", out / "samples", "--ref", tmp_path / "ref.npz", "--random-inception-seed", "0",
                         "--no-cache", "--device", "cpu", "--num-workers", "1", "--batch-size", "2"],
            r"cannot read image .*000003\.png: .*truncated.*moh-dit sample again .*out.*then evaluate again")

