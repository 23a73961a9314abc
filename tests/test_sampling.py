"""Sampling at scale: labels, index ownership, DiT quantisation, the streamed ADM .npz,
determinism across batch sizes and process counts, resume, and scripts/sample.py."""

import functools
import json

import numpy as np
import PIL.Image
import pytest
import torch

from moh_dit import MoHDiTPipeline, MoHDiTTransformer2DModel
from moh_dit.errors import InvalidInput
from moh_dit.pipelines.pipeline_moh_dit import make_scheduler
from moh_dit.sampling.sample import (
    SETTINGS_FILE,
    SampleSettings,
    check_settings,
    class_labels_for,
    head_activation,
    indices_for_rank,
    png_path,
    preview_head_activation,
    quantize_dit,
    sample_images,
    save_png_atomic,
    write_adm_npz,
)

@pytest.fixture
def sampling_pipe(tiny_pipe):
    # float64: CPU matmuls then give bit-identical per-image results for any batch size
    # (float32 ones differ by ~1e-6, which can flip a uint8 level).
    return functools.partial(tiny_pipe, seed=4, dtype=torch.float64, clip_sample=True)


def read_pngs(folder, n):
    return np.stack([np.asarray(PIL.Image.open(png_path(folder, i))) for i in range(n)])


SETTINGS = SampleSettings(num_samples=4, guidance_scale=1.5, num_inference_steps=2, class_labels="uniform", seed=7)


def test_head_activation_sets_and_restores_the_ratio():
    """The one way to run at another ratio for a while: restored exactly on exit, also on error,
    also a non-trained setting made before; nothing changes for an unreachable ratio."""
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8)
    model.set_head_activation_ratio(0.875)
    before = model.top_k_per_layer
    with head_activation(model, 0.5) as realised:
        assert realised == 0.5 == model.head_activation_ratio and model.top_k_per_layer != before
        with head_activation(model, 1.0):
            assert model.head_activation_ratio == 1.0
        assert model.head_activation_ratio == 0.5
    assert model.top_k_per_layer == before
    with pytest.raises(RuntimeError, match="inside"):
        with head_activation(model, 1.0):
            raise RuntimeError("inside")
    assert model.top_k_per_layer == before
    with head_activation(model, None) as realised:
        assert realised == 0.875
    with pytest.raises(ValueError, match="reachable range"):
        with head_activation(model, 0.1):
            pass
    assert model.top_k_per_layer == before
    assert preview_head_activation(model, 1.0) == (1.0, [0, 2, 2, 3, 2, 4]) and model.top_k_per_layer == before
    dense = MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8)
    with head_activation(dense, 1.0) as realised:
        assert realised == 1.0
    assert preview_head_activation(dense, None) == (1.0, [0] * 6)


def test_class_labels_balanced_and_per_index():
    labels = class_labels_for(range(50_000), 1000, "balanced")
    assert np.bincount(labels, minlength=1000).tolist() == [50] * 1000
    assert np.bincount(labels[:5000], minlength=1000).tolist() == [5] * 1000  # every IS split balanced
    uniform = class_labels_for(range(2000), 10, "uniform", seed=3)
    assert class_labels_for([1500, 7], 10, "uniform", seed=3) == [uniform[1500], uniform[7]]
    assert uniform != class_labels_for(range(2000), 10, "uniform", seed=4)
    assert 150 < min(np.bincount(uniform, minlength=10))
    with pytest.raises(ValueError, match="class label mode 'random'"):
        class_labels_for([0], 10, "random")


def test_indices_for_rank_partition():
    parts = [indices_for_rank(11, rank, 3) for rank in range(3)]
    assert sorted(sum(parts, [])) == list(range(11)) and parts[1] == [1, 4, 7, 10]
    with pytest.raises(ValueError, match="rank 3 is outside"):
        indices_for_rank(11, 3, 3)


def test_quantize_dit():
    x = torch.tensor([-2.0, -1.0, -0.999, 0.0, 0.5, 0.99, 1.0, 3.0]).reshape(1, 1, 1, 8).expand(1, 3, 1, 8)
    q = quantize_dit(x)
    assert q.shape == (1, 1, 8, 3) and q.dtype == np.uint8
    assert q[0, 0, :, 0].tolist() == [0, 0, 0, 128, 191, 254, 255, 255]  # floor(clamp(127.5 x + 128))


def test_adm_npz_streams_pngs(tmp_path):
    (tmp_path / "samples").mkdir()
    images = np.random.default_rng(0).integers(0, 256, size=(4, 6, 5, 3), dtype=np.uint8)
    for i, image in enumerate(images):
        save_png_atomic(png_path(tmp_path, i), image)
    path = write_adm_npz(tmp_path, 4)
    with np.load(path) as data:
        assert list(data.keys()) == ["arr_0"]
        np.testing.assert_array_equal(data["arr_0"], images)
    assert not list(tmp_path.glob("*.tmp"))
    labelled = write_adm_npz(tmp_path, 4, tmp_path / "labelled.npz", labels=[3, 0, 2, 1])
    with np.load(labelled) as data:
        assert list(data.keys()) == ["arr_0", "arr_1"]
        np.testing.assert_array_equal(data["arr_0"], images)
        assert data["arr_1"].dtype == np.int64 and data["arr_1"].tolist() == [3, 0, 2, 1]
    with pytest.raises(ValueError, match="3 labels for 4 images"):
        write_adm_npz(tmp_path, 4, tmp_path / "bad.npz", labels=[0, 1, 2])
    with pytest.raises(FileNotFoundError, match=r"1 of 5 PNGs are missing.*000004\.png"):
        write_adm_npz(tmp_path, 5, tmp_path / "five.npz")
    save_png_atomic(png_path(tmp_path, 4), images[0, :3])
    with pytest.raises(ValueError, match="mixes runs"):
        write_adm_npz(tmp_path, 5, tmp_path / "five.npz")
    assert not (tmp_path / "five.npz").exists() and not list(tmp_path.glob("*.tmp"))


def test_same_images_for_any_batch_size_and_process_count(tmp_path, sampling_pipe):
    pipe = sampling_pipe()
    assert sample_images(pipe, tmp_path / "a", SETTINGS, batch_size=1, progress=False) == 4
    for rank in range(2):
        sample_images(pipe, tmp_path / "b", SETTINGS, batch_size=3, rank=rank, world_size=2, progress=False)
    a, b = read_pngs(tmp_path / "a", 4), read_pngs(tmp_path / "b", 4)
    np.testing.assert_array_equal(a, b)
    assert a.std() > 10 and len({img.tobytes() for img in a}) == 4
    # Image 3 alone through the pipeline: class label and seed follow the index.
    label = class_labels_for([3], 10, "uniform", seed=7)
    latents = pipe(label, guidance_scale=1.5, num_inference_steps=2, seeds=[7 + 3], output_type="latent").images
    np.testing.assert_array_equal(quantize_dit(latents)[0], a[3])


def test_sampling_at_scale_computes_no_head_usage(tmp_path, sampling_pipe):
    """FID-scale runs never ask the transformer for head usage: nothing reports it."""
    pipe = sampling_pipe()
    asked, original = [], pipe.transformer.forward
    pipe.transformer.forward = lambda *a, **k: (asked.append(k.get("output_head_usage", False)), original(*a, **k))[1]
    assert sample_images(pipe, tmp_path / "run", SETTINGS, batch_size=3, progress=False) == 4
    assert len(asked) == 2 * SETTINGS.num_inference_steps and not any(asked)  # two batches, every step


def test_resume_after_interruption(tmp_path, sampling_pipe):
    pipe = sampling_pipe()
    sample_images(pipe, tmp_path / "full", SETTINGS, batch_size=4, progress=False)

    def crash(batch):
        raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        sample_images(pipe, tmp_path / "run", SETTINGS, batch_size=2, progress=False, on_batch=crash)
    done = sorted(p.name for p in (tmp_path / "run" / "samples").glob("*.png"))
    assert done == ["000000.png", "000001.png"]
    (tmp_path / "run" / "samples" / "000002.png.tmp").write_bytes(b"half-written")  # a crash mid-write
    made = []
    assert sample_images(pipe, tmp_path / "run", SETTINGS, batch_size=2, progress=False, on_batch=made.extend) == 2
    assert made == [2, 3]
    np.testing.assert_array_equal(read_pngs(tmp_path / "run", 4), read_pngs(tmp_path / "full", 4))
    assert sample_images(pipe, tmp_path / "run", SETTINGS, batch_size=2, progress=False) == 0


def test_script_end_to_end_and_resume_checks(tmp_path, load_script, sampling_pipe):
    script = load_script("sample")
    model_dir, out = tmp_path / "model", tmp_path / "out"
    sampling_pipe(dtype=torch.float32).transformer.save_pretrained(model_dir)
    argv = ["--model", str(model_dir), "--output", str(out), "--num-samples", "4", "--per-device-batch-size", "3",
            "--num-inference-steps", "2", "--guidance-scale", "1.5", "--head-activation-ratio", "0.6"]
    assert script.main(script.parse_args(argv)) == 0
    with np.load(out / "samples.npz") as data:
        arr, labels = data["arr_0"], data["arr_1"]
    assert arr.shape == (4, 8, 8, 3) and arr.dtype == np.uint8
    # ADM's class-conditional convention: arr_1 holds each image's class label (balanced: i mod classes).
    assert labels.tolist() == class_labels_for(range(4), 10) == [0, 1, 2, 3]
    np.testing.assert_array_equal(arr, read_pngs(out, 4))
    saved = json.loads((out / SETTINGS_FILE).read_text())
    identity, run = saved["identity"], saved["run"]
    assert identity["guidance_scale"] == 1.5 and identity["head_activation_ratio"] == 0.6
    assert identity["scheduler"]["variance_type"] == "learned_range" and identity["scheduler"]["clip_sample"] is True
    assert run["realised_head_activation_ratio"] == pytest.approx(14 / 24) and run["num_processes"] == 1

    # A resumed run must use the same settings; nothing is written when it does not.
    before = (out / SETTINGS_FILE).read_text()
    with pytest.raises(ValueError, match="different settings.*guidance_scale"):
        script.main(script.parse_args(argv[:-4] + ["--guidance-scale", "2.0", "--head-activation-ratio", "0.6"]))
    assert (out / SETTINGS_FILE).read_text() == before
    # Growing the set keeps the first images and makes only the new ones.
    grown = argv[:5] + ["6"] + argv[6:]
    assert script.main(script.parse_args(grown)) == 0
    with np.load(out / "samples.npz") as data:
        np.testing.assert_array_equal(data["arr_0"][:4], arr)
        assert data["arr_0"].shape[0] == 6


def test_script_rejects_bad_ratio_before_writing(tmp_path, load_script, sampling_pipe):
    script = load_script("sample")
    sampling_pipe(dtype=torch.float32).transformer.save_pretrained(tmp_path / "model")
    args = script.parse_args(["--model", str(tmp_path / "model"), "--output", str(tmp_path / "out"),
                              "--head-activation-ratio", "0.2"])
    with pytest.raises(InvalidInput) as caught:
        script.main(args)
    assert caught.value.parameters == ("head_activation_ratio",) and "0.2" in str(caught.value)
    assert "[0.5000, 1.0000]" in str(caught.value)  # the model's reachable range
    assert not (tmp_path / "out").exists()


def test_script_pipeline_folder_and_dry_run(tmp_path, capsys, load_script, sampling_pipe):
    script = load_script("sample")
    pipe = sampling_pipe(dtype=torch.float32)
    pipe.scheduler = make_scheduler("ddim")
    pipe.save_pretrained(tmp_path / "pipe")
    args = script.parse_args(["--model", str(tmp_path / "pipe"), "--output", str(tmp_path / "out"),
                              "--scheduler", "saved", "--dry-run", "--class-labels", "uniform"])
    assert script.main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["identity"]["scheduler"]["_class_name"] == "DDIMScheduler"
    assert printed["identity"]["class_labels"] == "uniform" and printed["identity"]["guidance_channels"] == "dit"
    assert not (tmp_path / "out").exists()


def test_load_pipeline_gives_from_pretrained_images(tmp_path, capsys, sampling_pipe):
    """One way to load gives one result: load_pipeline keeps the saved scheduler (it used to put
    a clipping DDPM in its place), and says so when it is told to replace it."""
    from moh_dit.sampling.sample import load_pipeline
    from moh_dit.utils.logging import verbosity

    pipe = sampling_pipe(dtype=torch.float32, clip_sample=False)
    pipe.save_pretrained(tmp_path / "pipe")
    kwargs = dict(guidance_scale=1.5, num_inference_steps=2, seeds=[0, 1], output_type="np")
    ours = load_pipeline(tmp_path / "pipe")
    assert ours.scheduler.config == MoHDiTPipeline.from_pretrained(tmp_path / "pipe").scheduler.config
    np.testing.assert_array_equal(ours([1, 2], **kwargs).images,
                                  MoHDiTPipeline.from_pretrained(tmp_path / "pipe")([1, 2], **kwargs).images)
    capsys.readouterr()
    with verbosity("info"):
        ddim = load_pipeline(tmp_path / "pipe", scheduler="ddim")
    assert type(ddim.scheduler).__name__ == "DDIMScheduler"
    assert "scheduler: make_scheduler('ddim', clip_sample=True) instead of the saved DDPMScheduler" in capsys.readouterr().out
    with pytest.raises(InvalidInput) as caught:
        load_pipeline(tmp_path / "pipe", clip_sample=True)
    assert caught.value.parameters == ("clip_sample", "scheduler")


def test_script_says_and_records_its_sampler(tmp_path, capsys, load_script, sampling_pipe):
    """The command's scheduler and guidance, where they are not what pipe() would use on the same
    folder, are in its output and in sample_config.json."""
    from moh_dit.utils.logging import verbosity

    script = load_script("sample")
    sampling_pipe(dtype=torch.float32).save_pretrained(tmp_path / "pipe")
    base = ["--model", str(tmp_path / "pipe"), "--num-samples", "1", "--num-inference-steps", "1", "--no-npz"]
    with verbosity("info"):
        assert script.main(script.parse_args(base + ["--output", str(tmp_path / "kept")])) == 0
        out = capsys.readouterr().out
        assert "scheduler: the pipeline folder's own DDPMScheduler; guidance_scale 1.5 on 'dit' eps channels (pipe() " \
               "defaults to 4.0 on 'all'" in out
        assert script.main(script.parse_args(base + ["--output", str(tmp_path / "ddim"), "--scheduler", "ddim"])) == 0
    assert "scheduler: make_scheduler('ddim', clip_sample=True) instead of the saved DDPMScheduler" in capsys.readouterr().out
    with pytest.raises(InvalidInput) as caught:  # the saved scheduler keeps its own clipping
        script.main(script.parse_args(base + ["--output", str(tmp_path / "clip"), "--clip-sample", "yes"]))
    assert caught.value.parameters == ("clip_sample", "scheduler")
    assert not (tmp_path / "clip").exists()
    for folder, scheduler in (("kept", "the pipeline folder's own DDPMScheduler"),
                              ("ddim", "DDIMScheduler from make_scheduler('ddim') (not a saved scheduler)")):
        run = json.loads((tmp_path / folder / SETTINGS_FILE).read_text())["run"]
        assert run["sampler"]["scheduler"] == scheduler and "pipe() defaults to 4.0" in run["sampler"]["guidance"]


# --------------------------------------------------------------------------------------
# scripts/sample.py refuses bad flags before writing anything
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """A tiny MoH transformer folder, a non-learned-sigma one, and a non-model folder, outside
    each test's tmp_path (which `refuses` watches)."""
    root = tmp_path_factory.mktemp("models")
    for name, overrides in (("moh", {}), ("fixed", {"learn_sigma": False}), ("latent", {"in_channels": 4})):
        model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, **overrides)
        generator = torch.Generator().manual_seed(4)
        with torch.no_grad():  # random weights: DiT's init would make every block the identity
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        model.save_pretrained(root / name)
    (root / "empty").mkdir()
    (root / "weights.pt").write_bytes(b"not a folder")
    return root


def _sample_argv(models, out, *extra):
    return ["--model", models / "moh", "--output", out, "--num-samples", "2", "--per-device-batch-size", "2",
            "--num-inference-steps", "1", *extra]


@pytest.mark.parametrize(
    "extra, match",
    [
        # Reproduction: --guidance-scale 0.5 used to fail only after writing sample_config.json.
        (["--guidance-scale", "0.5"], r"--guidance-scale=0\.5 .*>= 1"),
        (["--guidance-scale", "nan"], r"--guidance-scale=nan "),
        (["--guidance-scale", "inf"], r"--guidance-scale=inf "),
        (["--guidance-scale", "-2"], r"--guidance-scale=-2\.0 "),
        (["--guidance-scale", "x"], r"--guidance-scale: invalid float value"),
        (["--num-inference-steps", "0"], r"--num-inference-steps .*got 0"),
        (["--num-inference-steps", "-5"], r"--num-inference-steps .*got -5"),
        (["--num-inference-steps", "1001"], r"--num-inference-steps=1001 .*1\.\.1000"),
        (["--num-inference-steps", "2.5"], r"--num-inference-steps: invalid int value"),
        (["--num-samples", "0"], r"--num-samples .*>= 1, got 0"),
        (["--num-samples", "-1"], r"--num-samples .*got -1"),
        (["--per-device-batch-size", "0"], r"--per-device-batch-size .*got 0"),
        (["--per-device-batch-size", "-4"], r"--per-device-batch-size .*got -4"),
        (["--head-activation-ratio", "0.2"], r"--head-activation-ratio=0\.2 .*\[0\.5000, 1\.0000\]"),
        (["--head-activation-ratio", "0"], r"--head-activation-ratio=0\.0 "),
        (["--head-activation-ratio", "-0.5"], r"--head-activation-ratio=-0\.5 "),
        (["--head-activation-ratio", "1.5"], r"--head-activation-ratio=1\.5 "),
        (["--head-activation-ratio", "nan"], r"--head-activation-ratio=nan "),
        (["--head-activation-ratio", "inf"], r"--head-activation-ratio=inf "),
        (["--head-activation-ratio", "linear:0.2:1"], r"--head-activation-ratio: .*'linear:0\.2:1' .*0\.2000 at step 0"),
        (["--head-activation-ratio", "linear:0.5"], r"--head-activation-ratio: .*'linear:0\.5'"),
        (["--head-activation-ratio", "half"], r"--head-activation-ratio: .*'half'"),
        (["--seed", "-1"], r"--seed .*got -1"),
        (["--seed", str(2**64 - 1)], r"--seed 18446744073709551615 \+ --num-samples 2 - 1 exceeds"),
        (["--scheduler", "euler"], r"--scheduler: invalid choice"),
        (["--scheduler", "saved"], r"--scheduler 'saved' .*transformer folder"),
        (["--scheduler", "dpm", "--clip-sample", "yes"], r"--clip-sample yes .*--scheduler dpm"),
        (["--scheduler", "saved", "--clip-sample", "no"], r"--scheduler 'saved' .*transformer folder"),
        (["--clip-sample", "maybe"], r"--clip-sample: invalid choice"),
        (["--guidance-channels", "first3"], r"--guidance-channels: invalid choice"),
        (["--class-labels", "random"], r"--class-labels: invalid choice"),
        (["--dtype", "float8"], r"--dtype: invalid choice"),
        (["--vae", "missing-vae"], r"--vae missing-vae does not exist"),
        (["--vae", "./vae"], r"--vae \./vae does not exist"),
        (["--vae", "{models}/weights.pt"], r"--vae .*weights\.pt is not a folder"),
        (["--model", "{models}/nope"], r"--model .*nope does not exist"),
        (["--model", "{models}/weights.pt"], r"--model .*weights\.pt is a file"),
        (["--model", "{models}/empty"], r"empty is neither a pipeline folder .* nor a transformer folder"),
        # A learned-variance DDPM with a model that does not learn sigma: refused before writing.
        (["--model", "{models}/fixed"], r"does not learn sigma"),
        (["--model", "{models}/latent"], r"latent .*\(4-channel inputs\): pass its VAE as --vae"),
        (["--output", "{tmp}/file.txt"], r"--output-dir .*file\.txt is a file"),
        (["--output", "{tmp}/file.txt/out"], r"--output-dir .*out lies under .*file\.txt, which is a file"),
    ],
)
def test_script_refuses_bad_flags_before_writing(extra, match, saved_models, tmp_path, refuses):
    (tmp_path / "file.txt").write_text("mine")
    fill = lambda a: str(a).replace("{models}", str(saved_models)).replace("{tmp}", str(tmp_path))
    argv = [fill(a) for a in _sample_argv(saved_models, tmp_path / "out")]
    extra = [fill(a) for a in extra]
    # A later --model / --output overrides the base one (argparse keeps the last).
    refuses("sample", argv + extra, match)


def test_refused_run_does_not_block_the_corrected_one(saved_models, tmp_path, refuses, load_script, capsys):
    """Reproduction: `--guidance-scale 0.5` wrote sample_config.json and failed; the corrected
    command was then refused ("holds samples made with different settings") from a folder
    holding none. Now the bad run writes nothing, and a settings file left with zero samples
    (by an older version, or a run that failed at its first batch) gives way, with a note."""
    out = tmp_path / "out"
    refuses("sample", _sample_argv(saved_models, out, "--guidance-scale", "0.5"), "--guidance-scale")
    assert not out.exists()
    # What the old code left behind: settings of the refused run, an empty samples/ folder.
    (out / "samples").mkdir(parents=True)
    (out / SETTINGS_FILE).write_text(json.dumps({"identity": {"guidance_scale": 0.5}, "run": {}}))
    script = load_script("sample")
    assert script.cli([str(a) for a in _sample_argv(saved_models, out, "--guidance-scale", "1.5")]) == 0
    assert "no samples" in capsys.readouterr().out
    assert json.loads((out / SETTINGS_FILE).read_text())["identity"]["guidance_scale"] == 1.5
    assert len(list((out / "samples").glob("*.png"))) == 2
    # Once the folder holds samples, other settings are refused as before.
    refuses("sample", _sample_argv(saved_models, out, "--guidance-scale", "2.0"), "different settings.*guidance_scale")


def test_sample_settings_validate(sampling_pipe):
    """SampleSettings checks what is its own when made; what it passes to the pipeline the pipeline
    checks against the model (check_settings). Both raise InvalidInput naming the field."""
    for kwargs, parameters, fact in [
        (dict(num_samples=0), ("num_samples",), "0"),
        (dict(seed=-1), ("seed",), "-1"),
        (dict(seed=2**64 - 1, num_samples=2), ("seed", "num_samples"), str(2**64 - 1)),
        (dict(class_labels="random"), ("class_labels",), "'random'"),
        (dict(head_activation_ratio="linear:0.5"), ("head_activation_ratio",), "'linear:0.5'"),
    ]:
        with pytest.raises(InvalidInput) as caught:
            SampleSettings(**kwargs)
        assert caught.value.parameters == parameters and fact in str(caught.value), caught.value
    pipe = sampling_pipe()
    for kwargs, parameter, fact in [
        (dict(guidance_scale=float("inf")), "guidance_scale", "inf"),
        (dict(guidance_scale=0.5), "guidance_scale", "0.5"),
        (dict(guidance_channels="first3"), "guidance_channels", "'first3'"),
        (dict(num_inference_steps=0), "num_inference_steps", "got 0"),
        (dict(num_inference_steps=1001), "num_inference_steps", "1..1000"),
        (dict(head_activation_ratio=1.5), "head_activation_ratio", "1.5"),
        (dict(head_activation_ratio=float("nan")), "head_activation_ratio", "nan"),
        (dict(head_activation_ratio="1.5"), "head_activation_ratio", "1.5"),
        (dict(head_activation_ratio="linear:0.2:1"), "head_activation_ratio", "0.2000 at step 0"),
    ]:
        settings = SampleSettings(**kwargs)  # not the settings' own rules: accepted when made
        with pytest.raises(InvalidInput) as caught:
            check_settings(pipe, settings)
        assert caught.value.parameters == (parameter,) and fact in str(caught.value), caught.value
    # A schedule is kept in its canonical spelling (what the resume check compares); a number as text is a float.
    assert SampleSettings(head_activation_ratio="step:1.0@t>500, 0.50").head_activation_ratio == "step:1@t>500,0.5"
    assert SampleSettings(head_activation_ratio="0.75").head_activation_ratio == 0.75
    plan = check_settings(pipe, SampleSettings(num_inference_steps=2, head_activation_ratio="step:1.0@t>500,0.5"))
    assert plan.realised == [1.0, 0.5] and check_settings(pipe, SampleSettings(num_inference_steps=2)) is None


def test_script_with_a_schedule_records_it_and_refuses_another_on_resume(tmp_path, load_script, sampling_pipe):
    script = load_script("sample")
    model_dir, out = tmp_path / "model", tmp_path / "out"
    sampling_pipe(dtype=torch.float32).transformer.save_pretrained(model_dir)
    argv = ["--model", str(model_dir), "--output", str(out), "--num-samples", "3", "--per-device-batch-size", "2",
            "--num-inference-steps", "2", "--guidance-scale", "1.5", "--no-npz"]
    assert script.main(script.parse_args(argv + ["--head-activation-ratio", "step:1.0@t>500,0.5"])) == 0
    saved = json.loads((out / SETTINGS_FILE).read_text())
    identity, run = saved["identity"], saved["run"]
    assert identity["head_activation_ratio"] == "step:1@t>500,0.5"
    assert run["head_activation_schedule"] == "step:1@t>500,0.5" and run["head_activation_ratios"] == [1.0, 0.5]
    assert run["realised_head_activation_ratio"] == 0.75 and run["top_k_per_layer"] is None
    assert len(run["top_k_per_step"]) == 2 and run["mean_attention_flop_ratio"] < 1.0
    # The images are the pipeline's with that schedule (image i: class i, seed i).
    from moh_dit.sampling.sample import load_pipeline

    pipe = load_pipeline(model_dir)
    pipe.set_progress_bar_config(disable=True)
    latents = pipe([0, 1, 2], guidance_scale=1.5, num_inference_steps=2, head_activation_ratio="step:1@t>500,0.5",
                   guidance_channels="dit", seeds=[0, 1, 2], output_type="latent").images
    np.testing.assert_array_equal(read_pngs(out, 3), quantize_dit(latents))
    # Resuming with another schedule (or a float) is refused; the same one, spelt otherwise, resumes.
    for other in ("step:1@t>400,0.5", "0.75"):
        with pytest.raises(ValueError, match="different settings.*head_activation_ratio"):
            script.main(script.parse_args(argv + ["--head-activation-ratio", other]))
    assert script.main(script.parse_args(argv + ["--head-activation-ratio", "step:1@t > 500, 0.50"])) == 0
