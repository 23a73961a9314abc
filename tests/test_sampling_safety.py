"""What `moh-dit sample` promises about its output folder: one writer, never inside what it reads,
only its own folder resumed or replaced, and a run that fails before its first image or midway
leaves nothing that blocks or spoils the rerun."""

import errno

import numpy as np
import pytest

from moh_dit.outputs import hold_lock
from moh_dit.sampling import CONFIG_FILE, png_path, sample

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = dict(num_samples=2, batch_size=2, num_inference_steps=1, guidance_scale=1.0, progress=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_pipe):
    path = tmp_path_factory.mktemp("models") / "model"
    tiny_pipe(seed=4).transformer.save_pretrained(path)
    return path


def test_a_second_sample_into_the_same_folder_stops_at_once(model_dir, tmp_path):
    with hold_lock(tmp_path / "out", "sample"):
        with pytest.raises(FileExistsError) as caught:
            sample(model_dir, tmp_path / "out", **FAST)
    assert caught.value.errno == errno.EBUSY and not (tmp_path / "out").exists()
    sample(model_dir, tmp_path / "out", **FAST)  # free once the holder is done
    assert not (tmp_path / ".out.lock").exists()


@pytest.mark.parametrize("where", ["model", "model/samples", "."])
def test_the_output_is_never_in_what_it_reads(where, tmp_path, model_dir):
    import shutil

    shutil.copytree(model_dir, tmp_path / "model")
    with pytest.raises(ValueError, match="overlap the input model"):
        sample(tmp_path / "model", tmp_path / where, **FAST)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_only_its_own_folder_is_resumed_or_replaced(model_dir, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError) as caught:
            sample(model_dir, mine, overwrite=overwrite, **FAST)
        assert caught.value.filename == str(mine)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    sample(model_dir, tmp_path / "out", **FAST)
    sample(model_dir, tmp_path / "out", **FAST)  # resumed
    (tmp_path / "out" / "notes.txt").write_text("added by the user")
    with pytest.raises(FileExistsError) as caught:  # replaced only when every file is its own
        sample(model_dir, tmp_path / "out", overwrite=True, **{**FAST, "seed": 3})
    assert caught.value.filename == str(tmp_path / "out" / "notes.txt")
    (tmp_path / "out" / "notes.txt").unlink()
    sample(model_dir, tmp_path / "out", overwrite=True, **{**FAST, "seed": 3})
    assert (tmp_path / "out" / CONFIG_FILE).read_text().count('"seed": 3') == 1


def test_a_run_refused_by_the_model_leaves_nothing(model_dir, tmp_path):
    with pytest.raises(ValueError, match="reachable range"):
        sample(model_dir, tmp_path / "out", head_activation_ratio=0.1, **FAST)
    assert list(tmp_path.iterdir()) == []
    sample(model_dir, tmp_path / "out", head_activation_ratio=0.75, **FAST)  # the corrected command runs


def test_a_failure_midway_leaves_complete_pngs_and_the_rerun_finishes(model_dir, tmp_path, monkeypatch):
    import PIL.Image

    reference = tmp_path / "reference"
    sample(model_dir, reference, **{**FAST, "num_samples": 4})
    saves, save = [], PIL.Image.Image.save

    def disk_full_at_the_third(self, fp, *args, **kwargs):
        saves.append(1)
        if len(saves) == 3:
            fp.write(b"\x89PNG half")
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, fp, *args, **kwargs)

    monkeypatch.setattr(PIL.Image.Image, "save", disk_full_at_the_third)
    with pytest.raises(OSError):
        sample(model_dir, tmp_path / "out", **{**FAST, "num_samples": 4})
    monkeypatch.undo()
    names = sorted(p.name for p in (tmp_path / "out" / "samples").iterdir())
    assert names == ["000000.png", "000001.png"]  # the third never appeared under its name
    sample(model_dir, tmp_path / "out", **{**FAST, "num_samples": 4})
    for i in range(4):
        assert png_path(tmp_path / "out", i).read_bytes() == png_path(reference, i).read_bytes()
    with np.load(tmp_path / "out" / "samples.npz") as data, np.load(reference / "samples.npz") as expected:
        np.testing.assert_array_equal(data["arr_0"], expected["arr_0"])
    assert not [p for p in (tmp_path / "out").rglob("*") if p.name.startswith(".moh-dit-tmp-")]


def test_a_vae_folder_is_an_input_too(tmp_path, tiny_vae, model_dir):
    tiny_vae().save_pretrained(tmp_path / "vae")
    with pytest.raises(ValueError, match="overlap the input vae"):
        sample(model_dir, tmp_path / "vae" / "out", vae=str(tmp_path / "vae"), **FAST)
    assert not (tmp_path / "vae" / "out").exists()


@pytest.mark.parametrize("extra, match", [
    (["--num-samples", "0"], "--num-samples"), (["--head-activation-ratio", "half"], "--head-activation-ratio"),
    (["--seed", "-1"], "--seed"), (["--scheduler", "euler"], "--scheduler"),
    (["--head-activation-ratio", "0.1"], r"0\.1"),  # the model's reachable range, checked by the model
    (["--model", "{tmp}/nope"], "nope"), (["--output", "{model}/samples"], "overlap"),
])
def test_the_command_refuses_in_one_line_before_writing(extra, match, model_dir, tmp_path, refuses):
    fill = lambda a: str(a).replace("{tmp}", str(tmp_path)).replace("{model}", str(model_dir))  # noqa: E731
    argv = ["--model", model_dir, "--output", tmp_path / "out", "--num-samples", "2", "--num-inference-steps", "1"]
    refuses("sample", argv + [fill(a) for a in extra], match)
    assert not (model_dir / "samples").exists()
