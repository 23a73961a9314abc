"""The head-activation sweep: ratio planning, the FLOP formula, same images at every ratio,
the written table / plot, errors before any sampling, and scripts/sweep_head_ratio.py."""

import csv
import dataclasses
import io
import json
import shutil
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moh_dit import MoHDiTTransformer2DModel
from moh_dit import evaluation as ev
from moh_dit.errors import InputNotFound, InvalidInput
from moh_dit.sampling.sample import SampleSettings, load_pipeline, png_path, quantize_dit
from moh_dit.utils.output_folders import hold_output_folder
from moh_dit.sampling.sweep_results import CONSTANT_LABEL, X_LABEL
from moh_dit.sampling.sweep import (
    PLOT_PANELS,
    SweepRow,
    SweepSettings,
    attention_flops,
    figure_png,
    layer_attention_flops,
    parse_ratios,
    plan_ratios,
    plot_fid_vs_ratio,
    run_sweep,
    sweep_head_activation,
    transformer_calls_per_image,
    write_sweep,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE = 16  # 16x16 RGB, patch 4: 16 tokens
# Small and fast, and uneven batches (4 + 2) so the last partial batch is exercised.
SWEEP = dict(num_samples=6, batch_size=4, num_inference_steps=2, guidance_scale=1.5, seed=5,
             use_cache=False, progress=False, log=None)


class ConvFeatures(nn.Module):
    """A fixed random conv + pooling standing in for Inception: uint8 NCHW -> pool/logits/spatial."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 12, 3, padding=1)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=generator) * 0.5)
            self.conv.bias.zero_()

    def forward(self, images: torch.Tensor) -> dict:
        h = F.relu(self.conv(images.float() / 127.5 - 1.0))  # (N, 12, H, W)
        return {"pool": h.mean(dim=(2, 3)), "logits": h.amax(dim=(2, 3)), "spatial": F.adaptive_avg_pool2d(h, 2).flatten(1)}


def _random_model(randomize, preset: str, seed: int) -> MoHDiTTransformer2DModel:
    return randomize(MoHDiTTransformer2DModel.from_preset(preset, sample_size=SIZE), std=0.1, seed=seed).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, randomize) -> Path:
    path = tmp_path_factory.mktemp("moh") / "transformer"
    _random_model(randomize, "MoH-DiT-Tiny", seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory, randomize) -> Path:
    path = tmp_path_factory.mktemp("dense") / "transformer"
    _random_model(randomize, "DiT-Tiny", seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    """An ImageFolder of 8 smooth 16x16 images, two classes of 4."""
    root = tmp_path_factory.mktemp("reference")
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    for i in range(8):
        image = np.stack([(xx * 9 + 31 * i) % 256, (yy * 13 + 17 * i) % 256, (xx * yy + 50 * i) % 256], axis=-1)
        folder = root / f"class_{i // 4}"
        folder.mkdir(exist_ok=True)
        PIL.Image.fromarray(image.astype(np.uint8)).save(folder / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def sweep(model_dir, reference_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "out"
    result = run_sweep(model_dir, ("trained", 1.0, 0.75, "min"), reference=reference_dir, extractor=ConvFeatures(),
                       output_dir=out, save_samples=True, **SWEEP)
    return result, write_sweep(result, out), out


# --------------------------------------------------------------------------------------
# FLOPs and ratio planning (no sampling)
# --------------------------------------------------------------------------------------


def test_layer_attention_flops_hand_case():
    # N=4 tokens, D=8, h=2 heads of d=4 (D_in=8), one head active (r=1/2):
    # dense = 2*4*8*8*4 + 4*16*8 = 2048 + 512; sparse = 2*4*8*8*(2 + 1) + 4*0.5*16*8 = 1536 + 256.
    assert layer_attention_flops(4, 8, 2, 4, 1) == (1792, 2560)
    assert layer_attention_flops(4, 8, 2, 4, 2) == (2560, 2560)
    assert layer_attention_flops(4, 8, 2, 4, 0) == (1024, 2560)  # K and V projections only
    with pytest.raises(ValueError, match="active_heads=3"):
        layer_attention_flops(4, 8, 2, 4, 3)


def test_attention_flops_of_models(randomize):
    moh = _random_model(randomize, "MoH-DiT-Tiny", seed=0)
    n, hidden, d = 16, 128, 32
    active = [s + k for s, k in zip(moh.layer_shared, moh.trained_top_k)]  # [4, 3, 3, 3, 3, 2]
    expected = sum(2 * n * hidden * 4 * d * (2 + 2 * a / 4) + 4 * (a / 4) * n * n * 4 * d for a in active)
    sparse, dense = attention_flops(moh)
    assert sparse == pytest.approx(expected, rel=1e-12)
    assert dense == 6 * (2 * n * hidden * 4 * d * 4 + 4 * n * n * 4 * d)
    assert attention_flops(moh, [0, 2, 2, 3, 2, 4]) == (dense, dense)  # every head active
    assert attention_flops(_random_model(randomize, "DiT-Tiny", seed=0)) == (dense, dense)
    assert transformer_calls_per_image(250, 1.5) == 500 and transformer_calls_per_image(250, 1.0) == 250


def test_plan_ratios_realises_the_models_layouts(randomize):
    model = _random_model(randomize, "MoH-DiT-Tiny", seed=0)
    plans = plan_ratios(model, parse_ratios("trained,1.0,0.9,0.75,0.6,min"))
    assert [p.label for p in plans] == ["1.0", "0.9", "trained/0.75", "0.6", "min"]  # highest first, duplicates merged
    probe = _random_model(randomize, "MoH-DiT-Tiny", seed=0)
    for plan, ratio in zip(plans, [1.0, 0.9, 0.75, 0.6, model.head_activation_range[0]]):
        assert plan.realised_ratio == probe.set_head_activation_ratio(ratio)
        assert plan.top_k_per_layer == probe.top_k_per_layer
    assert plans[-1].realised_ratio == 0.5 and plans[2].top_k_per_layer == model.trained_top_k
    assert model.top_k_per_layer == model.trained_top_k  # planning leaves the model alone
    dense = _random_model(randomize, "DiT-Tiny", seed=0)
    assert [p.label for p in plan_ratios(dense, ["trained", 1.0, "min"])] == ["trained/1.0/min"]
    for call, facts in [(lambda: plan_ratios(model, [1.0, 0.3]), ["0.3", "[0.5000, 1.0000]"]),
                        (lambda: parse_ratios("1.0,half"), ["'half'"]),
                        (lambda: parse_ratios("1.5"), ["1.5", "(0, 1]"]),
                        (lambda: parse_ratios(","), ["','"]),
                        (lambda: plan_ratios(dense, [1.0, 0.9]), ["0.9", "dense DiT"])]:
        with pytest.raises(InvalidInput) as caught:
            call()
        assert caught.value.parameters == ("ratios",) and all(fact in str(caught.value) for fact in facts)
        assert "--" not in str(caught.value)


# --------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------


def test_sweep_rows(sweep, model_dir):
    result, _, _ = sweep
    rows = result.rows
    assert [r.ratio for r in rows] == ["1.0", "trained/0.75", "min"]
    model = MoHDiTTransformer2DModel.from_pretrained(model_dir)
    for row, ratio in zip(rows, [1.0, 0.75, "min"]):
        target = model.head_activation_range[0] if ratio == "min" else ratio
        assert row.realised_ratio == model.set_head_activation_ratio(target)
        assert row.top_k_per_layer == model.top_k_per_layer
        sparse, dense = attention_flops(model)
        assert (row.attention_flops_per_image, row.dense_attention_flops_per_image) == (sparse * 4, dense * 4)  # 2 steps x cfg
        assert row.num_samples == 6 and row.sampling_seconds > 0
        assert all(np.isfinite(v) for v in (row.fid, row.sfid, row.inception_score, row.precision, row.recall))
    flops = [r.attention_flops_per_image for r in rows]
    assert flops[0] > flops[1] > flops[2] and rows[0].attention_flop_ratio == 1.0
    assert len({r.fid for r in rows}) == 3  # the ratio changes the images
    assert result.settings["transformer_calls_per_image"] == 4 and result.settings["comparable_to_published"] is False
    assert result.settings["extractor"] == ev.extractor_identity(ConvFeatures())


def test_same_images_at_every_ratio(sweep, model_dir, reference_dir):
    result, _, out = sweep
    images = {r.ratio: np.stack([np.asarray(PIL.Image.open(png_path(r.samples_dir, i))) for i in range(6)])
              for r in result.rows}
    assert images["1.0"].shape == (6, SIZE, SIZE, 3)
    assert not np.array_equal(images["1.0"], images["min"])
    # Image i is class i mod 10 with seed seed + i, exactly what the pipeline gives alone.
    pipe = load_pipeline(model_dir)
    pipe.set_progress_bar_config(disable=True)
    latents = pipe([0, 1, 2, 3], guidance_scale=1.5, num_inference_steps=2, head_activation_ratio=0.75,
                   guidance_channels="dit", seeds=[5, 6, 7, 8], output_type="latent").images
    np.testing.assert_array_equal(quantize_dit(latents), images["trained/0.75"][:4])
    # Same seeds and labels whatever else is swept: ratio 1.0 alone gives the same FID.
    again = run_sweep(model_dir, [1.0], reference=reference_dir, extractor=ConvFeatures(), **SWEEP)
    assert again.rows[0].fid == result.rows[0].fid and again.rows[0].sfid == result.rows[0].sfid


def test_written_files(sweep):
    result, paths, out = sweep
    data = json.loads(paths["json"].read_text())
    assert [r["ratio"] for r in data["rows"]] == ["1.0", "trained/0.75", "min"]
    settings = data["settings"]
    for key in ("model", "num_inference_steps", "guidance_scale", "num_samples", "seed", "reference", "extractor",
                "comparable_to_published", "transformer_calls_per_image"):
        assert key in settings, key
    assert settings["num_samples"] == 6 and settings["seed"] == 5 and settings["num_inference_steps"] == 2
    with open(paths["csv"], newline="") as f:
        table = list(csv.DictReader(f))
    assert [float(r["realised_ratio"]) for r in table] == [1.0, 0.75, 0.5]
    assert float(table[1]["fid"]) == pytest.approx(result.rows[1].fid)
    assert table[2]["top_k_per_layer"] == "0 0 0 0 0 1"
    with PIL.Image.open(paths["plot"]) as plot:
        plot.load()
        assert plot.size == (900, 520) and plot.mode == "RGB"
        assert len(np.unique(np.asarray(plot).reshape(-1, 3), axis=0)) > 10  # something was drawn
    assert sorted(p.name for p in out.iterdir()) == [
        ".moh-dit-output.json", "fid_vs_ratio.png", "ratio_0.5000", "ratio_0.7500", "ratio_1.0000", "sweep.csv",
        "sweep.json"]
    assert json.loads((out / ".moh-dit-output.json").read_text())["written_by"] == "moh-dit sweep"
    assert not [p for p in out.rglob(".*") if ".part-" in p.name or ".tmp-" in p.name]  # no scratch left
    assert "NOT comparable" in result.table()


def test_plot_shows_the_written_numbers(sweep):
    """Each panel of fid_vs_ratio.png plots its column of sweep.json against the mean relative
    attention FLOPs, with the rows' 95% intervals as error bars, on an axis from 0."""
    result, paths, _ = sweep
    data = json.loads(paths["json"].read_text())
    figure = plot_fid_vs_ratio([SweepRow(**row) for row in data["rows"]], "title", "subtitle", comparable=False)
    # Without a classifier the class-accuracy panel has no values and is left out.
    assert [ax.get_ylabel() for ax in figure.axes] == [PLOT_PANELS[0][1]] == ["FID"]
    ax = figure.axes[0]
    expected = sorted((row["attention_flop_ratio"], row["fid"], row["fid_low"], row["fid_high"]) for row in data["rows"])
    (constant,) = [c for c in ax.containers if c.get_label() == CONSTANT_LABEL]  # an errorbar container
    xs, ys = constant.lines[0].get_data()
    assert list(xs) == [e[0] for e in expected] and list(ys) == [e[1] for e in expected]
    assert xs[-1] == 1.0 and len(set(xs)) == 3
    # Error bars: one vertical segment per row, from fid_low to fid_high.
    (bars,) = constant.lines[2]
    segments = sorted((seg[0][0], seg[0][1], seg[1][1]) for seg in bars.get_segments())
    np.testing.assert_allclose(segments, [(x, low, high) for x, _, low, high in expected], rtol=1e-12)
    assert all(low < y < high for _, y, low, high in expected)
    # The trained ratio is marked, no number is printed on the points, the axis starts at 0.
    (star,) = [line for line in ax.lines if line.get_label() == "trained ratio"]
    trained = next(row for row in data["rows"] if "trained" in row["requested"])
    assert list(star.get_xdata()) == [trained["attention_flop_ratio"]] and list(star.get_ydata()) == [trained["fid"]]
    assert not ax.texts and ax.get_ylim()[0] == 0.0 and ax.get_ylim()[1] > max(e[3] for e in expected)
    assert ax.get_xlabel() == X_LABEL
    # The top axis reads the constant rows' head activation ratio off the FLOPs axis, continued
    # linearly beyond the end rows (not held at them, which piled every tick at the edge).
    from moh_dit.sampling.sweep_results import _interpolate

    (top,) = ax.child_axes
    assert top.get_xlabel() == "head activation ratio (constant)"
    flop, ratio = np.array([0.7, 0.85, 1.0]), np.array([0.5, 0.75, 1.0])
    np.testing.assert_allclose(_interpolate([0.64, 0.7, 0.775, 1.0, 1.06], flop, ratio), [0.4, 0.5, 0.625, 1.0, 1.1])
    subtitle = [text for text in figure.texts if text.get_text() == "subtitle"][0]
    assert subtitle.get_color() == "#be1e1e"  # red: not comparable to published numbers
    with PIL.Image.open(io.BytesIO(figure_png(figure))) as image:
        assert image.size == (900, 520) and image.mode == "RGB"


def test_plot_without_values(sweep):
    result, _, _ = sweep
    empty = plot_fid_vs_ratio([dataclasses.replace(row, fid=None) for row in result.rows], "t", "s", comparable=True)
    assert not empty.axes[0].lines and [t.get_text() for t in empty.axes[0].texts] == ["no FID values"]


def test_settings_types_give_the_same_sweep(sweep, model_dir, reference_dir):
    """sweep_head_activation with SampleSettings + SweepSettings is what run_sweep's keywords make."""
    result, _, _ = sweep
    images = SampleSettings(num_samples=6, guidance_scale=1.5, num_inference_steps=2, seed=5)
    settings = SweepSettings(batch_size=4, use_cache=False, progress=False)
    again = sweep_head_activation(model_dir, [1.0], reference_dir, images, settings, extractor=ConvFeatures(), log=None)
    assert (again.rows[0].fid, again.rows[0].sfid) == (result.rows[0].fid, result.rows[0].sfid)
    assert again.rows[0].attention_flops_per_image == result.rows[0].attention_flops_per_image


@pytest.mark.parametrize("changes, parameters, fact", [
    (dict(batch_size=0), ("batch_size",), "0"),
    (dict(eval_batch_size=-1), ("eval_batch_size",), "-1"),
    (dict(attention="flash"), ("attention",), "'flash'"),
    (dict(save_samples=True), ("save_samples", "output_dir"), "output_dir"),
    (dict(device="gpu0"), ("device",), "'gpu0'"),
    (dict(bootstrap=1), ("bootstrap",), "1"),
    (dict(bootstrap_seed=-1), ("bootstrap_seed",), "-1"),
    (dict(output_dir=__file__), ("output_dir",), __file__),
])
def test_sweep_settings_refuse_bad_values(changes, parameters, fact):
    with pytest.raises(InvalidInput) as caught:
        SweepSettings(**changes)
    assert caught.value.parameters == parameters and fact in str(caught.value) and "--" not in str(caught.value)


def test_errors_before_any_sampling_leave_nothing(model_dir, dense_dir, reference_dir, tmp_path, monkeypatch):
    pipe = load_pipeline(model_dir)
    calls = []
    pipe.transformer.register_forward_hook(lambda *args: calls.append(1))
    out = tmp_path / "out"
    for kwargs, parameter, fact in [
        (dict(ratios=[1.0, 0.4]), "ratios", "[0.5000, 1.0000]"),
        (dict(model=dense_dir, ratios=[1.0, 0.9]), "ratios", "dense DiT"),
        (dict(num_samples=3), "num_samples", ">= 4"),
        (dict(num_inference_steps=1001), "num_inference_steps", "1..1000"),
        (dict(guidance_scale=0.5), "guidance_scale", "0.5"),
    ]:
        with pytest.raises(InvalidInput) as caught:
            run_sweep(kwargs.pop("model", pipe), kwargs.pop("ratios", [1.0]), reference=reference_dir,
                      extractor=ConvFeatures(), output_dir=out, **{**SWEEP, **kwargs})
        assert parameter in caught.value.parameters and fact in str(caught.value), caught.value
    with pytest.raises(InputNotFound) as caught:
        run_sweep(pipe, [1.0], reference=tmp_path / "nope", extractor=ConvFeatures(), output_dir=out, **SWEEP)
    assert str(tmp_path / "nope") in str(caught.value)
    with pytest.raises(ValueError, match="at most one of"):
        run_sweep(pipe, [1.0], reference=reference_dir, extractor=ConvFeatures(), random_inception_seed=0, **SWEEP)
    # No weights anywhere and no download: the evaluation's error, never a silent random Inception.
    monkeypatch.delenv(ev.INCEPTION_WEIGHTS_ENV, raising=False)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with pytest.raises(ev.InceptionWeightsNotFoundError, match=r"weights-inception-2015-12-05-6726825d\.pth"):
        run_sweep(pipe, [1.0], reference=reference_dir, download=False, output_dir=out, **SWEEP)
    assert not calls and not out.exists()


def test_class_accuracy_column_and_panel(model_dir, reference_dir, tmp_path):
    """With a classifier each row gets the class accuracy of its images (the same number as
    classifying the saved PNGs with their labels, class i mod num_classes), a table column,
    a CSV value and a second plot panel."""
    from moh_dit.evaluation.classifier import SampleClassifier, SmallCNN
    from moh_dit.evaluation import class_accuracy

    torch.manual_seed(0)
    classes = [f"c{i}" for i in range(10)]  # MoH-DiT-Tiny's 10 classes, no names in the model
    classifier = SampleClassifier(SmallCNN(10, width=4), lambda x: x * 2 - 1, classes, identity="test-cnn")
    out = tmp_path / "out"
    result = run_sweep(model_dir, ("trained", 1.0), reference=reference_dir, extractor=ConvFeatures(),
                       output_dir=out, save_samples=True, classifier=classifier, **{**SWEEP, "num_samples": 10})
    labels = [i % 10 for i in range(10)]
    for row in result.rows:
        pngs = np.stack([np.asarray(PIL.Image.open(png_path(row.samples_dir, i))) for i in range(10)])
        expected = class_accuracy(classifier, pngs, labels)
        assert row.class_accuracy == pytest.approx(expected.overall)
        assert row.class_accuracy_per_class == pytest.approx(expected.per_class)
    assert "class acc" in result.table().splitlines()[0]
    paths = write_sweep(result, out)
    table = list(csv.DictReader(paths["csv"].open()))
    assert [float(r["class_accuracy"]) for r in table] == pytest.approx([r.class_accuracy for r in result.rows])
    figure = plot_fid_vs_ratio(result.rows, "t", "s", comparable=False)
    assert [ax.get_ylabel() for ax in figure.axes] == [label for _, label in PLOT_PANELS]


def test_dense_model_single_point(dense_dir, reference_dir, tmp_path):
    result = run_sweep(dense_dir, ["trained", 1.0, "min"], reference=reference_dir, extractor=ConvFeatures(),
                       **{**SWEEP, "num_samples": 4, "num_inference_steps": 1, "guidance_scale": 1.0})
    assert [r.ratio for r in result.rows] == ["trained/1.0/min"] and result.rows[0].attention_flop_ratio == 1.0
    paths = write_sweep(result, tmp_path / "dense")
    with PIL.Image.open(paths["plot"]) as plot:
        assert plot.size == (900, 520)


@pytest.mark.slow
def test_script_with_random_inception(model_dir, dense_dir, reference_dir, tmp_path, capsys, load_script,
                                      monkeypatch):
    script = load_script("sweep_head_ratio")
    out = tmp_path / "cli"
    argv = ["--model", str(model_dir), "--ref", str(reference_dir / "class_0"), "--ratios", "1.0,min",
            "--num-samples", "4", "--batch-size", "4", "--num-inference-steps", "1", "--guidance-scale", "1",
            "--random-inception-seed", "0", "--no-cache", "--device", "cpu", "--output", str(out)]
    loads = []
    monkeypatch.setattr(script, "load_pipeline", lambda *a, **k: loads.append(a) or load_pipeline(*a, **k))
    result = script.main(script.parse_args(argv))
    monkeypatch.undo()
    assert len(loads) == 1  # one pipeline for the sweep and its head-usage figure
    printed = capsys.readouterr().out
    assert "realised" in printed and "NOT comparable" in printed
    data = json.loads((out / "sweep.json").read_text())
    assert [r["realised_ratio"] for r in data["rows"]] == [1.0, 0.5] == [r.realised_ratio for r in result.rows]
    assert data["settings"]["model"] == str(model_dir.resolve())  # named by its folder, as a folder given to the sweep
    assert data["settings"]["comparable_to_published"] is False
    assert "RANDOM" in data["settings"]["extractor"] and data["settings"]["transformer_calls_per_image"] == 1
    assert (out / "sweep.csv").is_file() and (out / "fid_vs_ratio.png").is_file()
    # The head-usage figure at the trained ratio: what measure_head_usage gives for the same
    # model, classes, steps and seed (2 images per class by default).
    from moh_dit.evaluation.head_usage import measure_head_usage

    usage = json.loads((out / "head_usage" / "head_usage.json").read_text())
    direct = measure_head_usage(load_pipeline(model_dir), images_per_class=2, num_inference_steps=1, seed=0,
                                progress=False)
    assert np.allclose(np.array(usage["overall"]), np.array(direct.overall))
    assert usage["settings"]["images_per_class"] == 2
    assert (out / "head_usage" / "head_usage.png").is_file()
    # A dense model with a MoH ratio: a one-line error, exit status 1, nothing written.
    bad = tmp_path / "bad"
    argv = ["--model", str(dense_dir), "--ref", str(reference_dir), "--ratios", "1.0,0.9", "--output", str(bad),
            "--random-inception-seed", "0"]
    assert script.cli(argv) == 1
    assert "dense DiT" in capsys.readouterr().err and not bad.exists()


# --------------------------------------------------------------------------------------
# Schedules, FLOP matching and intervals
# --------------------------------------------------------------------------------------


def test_parse_ratios_keeps_a_step_schedules_commas():
    assert parse_ratios("1.0,step:0.5@t>500,1.0,min,linear:0.5:1.0, cosine:1:0.5") == [
        1.0, "step:0.5@t>500,1", "min", "linear:0.5:1", "cosine:1:0.5"]
    assert parse_ratios("step:1@t>700,0.75@t>300,0.5,trained") == ["step:1@t>700,0.75@t>300,0.5", "trained"]
    assert parse_ratios(["linear:0.50:1.00", 0.75]) == ["linear:0.5:1", 0.75]


def test_plan_ratios_with_schedules(randomize):
    model = _random_model(randomize, "MoH-DiT-Tiny", seed=0)
    steps = [750, 500, 250, 0]
    plans = plan_ratios(model, parse_ratios("trained,linear:0.75:0.75,linear:0.5:1.0,min"), steps)
    # A schedule that runs one top-K at every step is that constant's row.
    assert [p.label for p in plans] == ["trained/linear:0.75:0.75", "linear:0.5:1", "min"]
    schedule = plans[1].schedule
    probe = _random_model(randomize, "MoH-DiT-Tiny", seed=0)
    for ratio, realised, top_k, flops in zip([0.5, 2 / 3, 5 / 6, 1.0], schedule.realised, schedule.top_k,
                                             schedule.attention_flops):
        assert realised == probe.set_head_activation_ratio(ratio) and top_k == probe.top_k_per_layer
        assert flops == attention_flops(probe)[0]
    assert plans[1].realised_ratio == sum(schedule.realised) / 4 and plans[1].top_k_per_layer == []
    assert plans[1].setting == "linear:0.5:1" and plans[0].setting == 0.75
    assert model.top_k_per_layer == model.trained_top_k  # planning leaves the model alone
    # FLOP matching: 12, 13, 14, 14 active heads of 24 average 13.25; the closest constant is 13 heads.
    matched = plan_ratios(model, ["linear:0.5:0.6"], steps, match_flops=True)
    assert [p.label for p in matched] == ["linear:0.5:0.6", "0.5417"]  # mean ratio 13.25/24 first
    scheduled, constant = matched
    assert scheduled.matched is constant and constant.realised_ratio == 13 / 24
    assert [sum(probe.set_head_activation_ratio(r) * 24 for r in [0.5, 0.5 + 0.1 / 3, 0.6 - 0.1 / 3, 0.6])] == [53]
    # The schedule's FLOPs sit between the constants of 13 and 14 heads, nearer 13.
    assert attention_flops(model, constant.top_k_per_layer)[0] < scheduled.attention_flops(model)[0] / 4 \
        < attention_flops(model, model.layout.top_k_for_ratio(14 / 24))[0]
    # An equal-FLOP constant that was requested is reused, not added.
    again = plan_ratios(model, ["trained", "linear:0.5:1"], [500, 0], match_flops=True)
    assert [p.label for p in again] == ["trained", "linear:0.5:1"] and again[1].matched is again[0]
    with pytest.raises(InvalidInput) as caught:  # the first step out of range, by its index and timestep
        plan_ratios(model, ["step:0.3@t>400,1"], steps)
    assert all(fact in str(caught.value) for fact in ("'step:0.3@t>400,1'", "0.3000", "step 0", "750", "[0.5000, 1.0000]"))
    with pytest.raises(InvalidInput) as caught:
        plan_ratios(model, ["linear:0.5:1"])
    assert caught.value.parameters == ("timesteps",)


@pytest.fixture(scope="module")
def schedule_sweep(model_dir, reference_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("schedule_sweep") / "out"
    result = run_sweep(model_dir, ("trained", 1.0, "linear:0.5:1.0", "step:1.0@t>250,0.5"), reference=reference_dir,
                       extractor=ConvFeatures(), output_dir=out, save_samples=True, match_flops=True, **SWEEP)
    return result, write_sweep(result, out), out


def test_schedule_rows(schedule_sweep, model_dir):
    result, paths, _ = schedule_sweep
    assert [r.ratio for r in result.rows] == ["1.0", "trained", "linear:0.5:1", "step:1@t>250,0.5"]
    trained, linear, step = result.rows[1:]
    model = MoHDiTTransformer2DModel.from_pretrained(model_dir)
    # Two DDPM steps (timesteps 500, 0): linear runs 0.5 then 1.0, the step schedule 1.0 then 0.5.
    assert linear.head_activation_ratios == [0.5, 1.0] and step.head_activation_ratios == [1.0, 0.5]
    assert linear.schedule == "linear:0.5:1" and trained.schedule is None and linear.top_k_per_layer == []
    per_step = [attention_flops(model, k)[0] for k in linear.top_k_per_step]
    assert linear.top_k_per_step == [model.layout.top_k_for_ratio(0.5), [0, 2, 2, 3, 2, 4]]
    assert linear.attention_flops_per_image == 2 * sum(per_step)  # guided: two calls per step
    assert linear.mean_attention_flops == sum(per_step) / 2 and linear.realised_ratio == 0.75
    # 12 and 24 active heads average the trained 18: equal FLOPs, and the trained row is the match.
    assert linear.attention_flop_ratio == trained.attention_flop_ratio and linear.matched_constant == "trained"
    assert len({r.fid for r in result.rows}) == 4  # every schedule makes other images
    assert "linear:0.5:1 vs the constant ratio of closest attention FLOPs, trained (0.7500): FLOPs x1.0000" \
        in result.table()
    table = list(csv.DictReader(paths["csv"].open()))
    assert [r["schedule"] for r in table] == ["", "", "linear:0.5:1", "step:1@t>250,0.5"]
    assert [r["matched_constant"] for r in table][2:] == ["trained"] * 2
    assert json.loads(paths["json"].read_text())["rows"][2]["top_k_per_step"] == linear.top_k_per_step


def test_schedule_rows_are_the_pipelines_images(schedule_sweep, model_dir):
    result, _, out = schedule_sweep
    linear = result.rows[2]
    assert Path(linear.samples_dir).name == "ratio_0.7500_linear_0.5_1"  # apart from the trained ratio's
    images = np.stack([np.asarray(PIL.Image.open(png_path(linear.samples_dir, i))) for i in range(4)])
    pipe = load_pipeline(model_dir)
    pipe.set_progress_bar_config(disable=True)
    latents = pipe([0, 1, 2, 3], guidance_scale=1.5, num_inference_steps=2, head_activation_ratio="linear:0.5:1.0",
                   guidance_channels="dit", seeds=[5, 6, 7, 8], output_type="latent").images
    np.testing.assert_array_equal(quantize_dit(latents), images)
    trained = np.stack([np.asarray(PIL.Image.open(png_path(result.rows[1].samples_dir, i))) for i in range(4)])
    assert not np.array_equal(images, trained)
    # A folder holding only what a sweep writes, schedule folders included, is a sweep's.
    from moh_dit.sampling.sweep import is_sweep_folder

    copy = out.parent / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("sweep.json", ".moh-dit-output.json"))
    assert is_sweep_folder(copy)


def test_intervals(schedule_sweep, model_dir, reference_dir):
    from moh_dit.sampling.sweep_intervals import PoolFeatureRecorder, bootstrap_fid, fid_of_features, wilson_interval

    result, _, _ = schedule_sweep
    for row in result.rows:
        assert row.fid_low < row.fid < row.fid_high and row.fid_bootstrap_bias is not None
        assert row.class_accuracy_low is None  # no classifier
    assert result.settings["bootstrap_resamples"] == 200 and "Wilson" in result.settings["interval_note"]
    # The recorded features are exactly the evaluated ones: FID recomputed from them is the row's.
    extractor = ConvFeatures()
    pipe = load_pipeline(model_dir)
    images = np.stack([np.asarray(PIL.Image.open(png_path(result.rows[0].samples_dir, i))) for i in range(6)])
    reference = ev.load_reference(reference_dir, extractor, use_cache=False)
    with PoolFeatureRecorder(extractor) as recorder:
        measured = ev.evaluate(images, reference, extractor=extractor)
    assert recorder.features.shape == (6, 12) and len(extractor._forward_hooks) == 0
    assert fid_of_features(recorder.features, reference) == measured.fid == result.rows[0].fid
    first = bootstrap_fid(recorder.features, reference, measured.fid, resamples=50, seed=1)
    assert first == bootstrap_fid(recorder.features, reference, measured.fid, resamples=50, seed=1)
    assert first != bootstrap_fid(recorder.features, reference, measured.fid, resamples=50, seed=2)
    assert first.bias > 0  # repeated images alone raise FID; the interval is shifted back by that
    with pytest.raises(ValueError, match="resamples must be >= 2"):
        bootstrap_fid(recorder.features, reference, measured.fid, resamples=1)
    # Wilson: hand values (p = 0.95 at n = 120; the ends).
    assert wilson_interval(114, 120) == pytest.approx((0.89520, 0.97689), abs=1e-5)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert wilson_interval(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-5)
    assert wilson_interval(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)
    without = run_sweep(model_dir, [1.0], reference=reference_dir, extractor=ConvFeatures(), bootstrap=0, **SWEEP)
    assert without.rows[0].fid_low is None and without.rows[0].fid == result.rows[0].fid


def test_plot_of_schedules_and_accuracy(schedule_sweep):
    """Schedules are markers of their own; the class-accuracy axis is [0, 1], whatever the values."""
    result, _, _ = schedule_sweep
    rows = [dataclasses.replace(row, class_accuracy=0.94 + 0.001 * i, class_accuracy_low=0.9, class_accuracy_high=0.97)
            for i, row in enumerate(result.rows)]
    figure = plot_fid_vs_ratio(rows, "t", "s", comparable=False)
    fid_ax, accuracy_ax = figure.axes
    assert accuracy_ax.get_ylim() == (0.0, 1.02) and fid_ax.get_ylim()[0] == 0.0
    labels = [c.get_label() for c in fid_ax.containers]
    assert labels == [CONSTANT_LABEL, "linear:0.5:1", "step:1@t>250,0.5"]
    markers = {c.get_label(): c.lines[0].get_marker() for c in fid_ax.containers}
    assert len(set(markers.values())) == 3
    # Both schedules cost what the trained ratio costs: drawn beside it, in FLOP order of drawing.
    trained_x = result.rows[1].attention_flop_ratio
    xs = [c.lines[0].get_xdata()[0] for c in fid_ax.containers[1:]]
    assert trained_x < xs[0] < xs[1] < trained_x + 0.05
    assert [t.get_text() for t in fid_ax.get_legend().get_texts()] == ["trained ratio", CONSTANT_LABEL, "linear:0.5:1",
                                                                       "step:1@t>250,0.5"]


def test_model_name_and_title(tmp_path):
    from moh_dit.sampling.sweep_results import _plot_titles, model_name

    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    assert model_name(final) == "run/final"
    (tmp_path / "run" / "train_config.json").write_text(json.dumps({"preset": "MoH-DiT-Tiny/2"}))
    assert model_name(final) == "MoH-DiT-Tiny/2 (run/final)"
    (final / "README.md").write_text("---\nlicense: mit\n---\n\n# MoH-DiT demo\n")
    assert model_name(final) == "MoH-DiT demo (run/final)"
    assert model_name(tmp_path / "my-model") == "my-model"
    title, _ = _plot_titles({"model": str(final), "num_samples": 6, "num_inference_steps": 2, "guidance_scale": 1.5})
    assert title.startswith("MoH-DiT demo (run/final): 6 samples")


def test_script_dry_run_with_schedules(model_dir, reference_dir, tmp_path, capsys, load_script):
    script = load_script("sweep_head_ratio")
    argv = ["--model", str(model_dir), "--ref", str(reference_dir), "--ratios", "1.0,linear:0.5:0.6",
            "--num-inference-steps", "4", "--num-samples", "4", "--random-inception-seed", "0", "--no-cache",
            "--device", "cpu", "--output-dir", str(tmp_path / "out"), "--match-flops", "--dry-run"]
    report = script.main(script.parse_args(argv))
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{"):]) == json.loads(json.dumps(report))
    plans = {plan["ratio"]: plan for plan in report["plans"]}
    assert list(plans) == ["1.0", "linear:0.5:0.6", "0.5417"]
    assert plans["linear:0.5:0.6"]["matched_constant"] == "0.5417"
    assert len(plans["linear:0.5:0.6"]["head_activation_ratios"]) == 4 and "schedule" not in plans["1.0"]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------
# scripts/sweep_head_ratio.py refuses bad flags before any work
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_inputs(tmp_path_factory, model_dir):
    """Files the bad-flag table points at, outside each test's tmp_path."""
    root = tmp_path_factory.mktemp("sweep_inputs")
    shutil.copytree(model_dir, root / "zero_size")
    config = json.loads((model_dir / "config.json").read_text())
    (root / "zero_size" / "config.json").write_text(json.dumps({**config, "sample_size": 0}))
    (root / "notes.txt").write_text("not an npz")
    np.savez(root / "other.npz", something=np.zeros(3))
    (root / "empty").mkdir()
    (root / "folder").mkdir()
    return root


REMOVE = None  # a row's value that drops the base command's flag


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"--num-samples": "3"}, r"--num-samples .*>= 4 \(precision/recall use k=3\), got 3"),
        ({"--num-samples": "0"}, r"--num-samples .*got 0"),
        ({"--num-samples": "-1"}, r"--num-samples .*got -1"),
        ({"--num-samples": "many"}, r"--num-samples: invalid int value"),
        ({"--batch-size": "0"}, r"--batch-size .*got 0"),
        ({"--batch-size": "-2"}, r"--batch-size .*got -2"),
        ({"--eval-batch-size": "0"}, r"--eval-batch-size .*got 0"),
        ({"--num-inference-steps": "0"}, r"--num-inference-steps .*got 0"),
        ({"--num-inference-steps": "-1"}, r"--num-inference-steps .*got -1"),
        ({"--num-inference-steps": "1001"}, r"--num-inference-steps=1001 .*1\.\.1000"),
        ({"--guidance-scale": "0.5"}, r"--guidance-scale=0\.5 .*>= 1"),
        ({"--guidance-scale": "nan"}, r"--guidance-scale=nan "),
        ({"--guidance-scale": "inf"}, r"--guidance-scale=inf "),
        ({"--guidance-channels": "first3"}, r"--guidance-channels: invalid choice"),
        ({"--seed": "-1"}, r"--seed .*got -1"),
        ({"--seed": str(2**64 - 2)}, r"--seed 18446744073709551614 \+ --num-samples 4 - 1 exceeds"),
        ({"--ratios": "1.5"}, r"head activation ratio 1\.5 .*must be in \(0, 1\]"),
        ({"--ratios": "0"}, r"head activation ratio 0\.0 .*must be in \(0, 1\]"),
        ({"--ratios": "nan"}, r"head activation ratio nan .*must be in \(0, 1\]"),
        ({"--ratios": "-0.5,1.0"}, r"head activation ratio -0\.5 .*must be in \(0, 1\]"),
        ({"--ratios": "1.0,half"}, r"ratio 'half' is neither a number, one of .*, nor a schedule"),
        ({"--ratios": "1.0,linear:0.5"}, r"schedule 'linear:0\.5': linear takes two ratios"),
        ({"--ratios": "step:0.5@t>x,1.0"}, r"'0\.5@t>x' is not RATIO@t>TIMESTEP"),
        ({"--ratios": "cosine:0.5:2"}, r"ratios must be numbers in \(0, 1\]"),
        ({"--ratios": "1.0,linear:0.3:1"}, r"schedule 'linear:0\.3:1' asks for 0\.3000 at step 0 \(timestep \d+\), "
                                           r"outside this model's reachable range \[0\.5000, 1\.0000\]"),
        ({"--bootstrap": "1"}, r"--bootstrap .*got 1"),
        ({"--ratios": ","}, r"no --ratios given"),
        ({"--ratios": "1.0,0.3"}, r"ratio 0\.3 is outside this model's reachable range \[0\.5000, 1\.0000\]"),
        ({"--model": "{dense}", "--ratios": "1.0,0.9"}, r"dense DiT"),
        ({"--random-inception-seed": "-1"}, r"--random-inception-seed must be in \[0, "),
        ({"--random-inception-seed": REMOVE, "--inception-weights": "{tmp}/missing.pth"},
         r"--inception-weights .*missing\.pth does not exist"),
        ({"--random-inception-seed": REMOVE, "--inception-weights": "{in}/folder"}, r"--inception-weights .*folder is a folder"),
        ({"--inception-weights": "{in}/notes.txt"}, r"not allowed with argument --random-inception-seed"),
        ({"--device": "gpu0"}, r"--device 'gpu0' "),
        ({"--device": "cuda:99"}, r"--device 'cuda:99'"),
        ({"--device": "meta"}, r"--device 'meta' is not available here"),
        ({"--vae": "missing-vae"}, r"--vae missing-vae does not exist"),
        ({"--vae": "{in}/notes.txt"}, r"--vae .*notes\.txt is not a folder"),
        ({"--scheduler": "euler"}, r"--scheduler: invalid choice"),
        ({"--scheduler": "saved"}, r"--scheduler 'saved' .*transformer folder"),
        ({"--dtype": "float8"}, r"--dtype: invalid choice"),
        ({"--attention": "flash"}, r"--attention: invalid choice"),
        ({"--model": "{tmp}/missing"}, r"--model .*missing does not exist"),
        ({"--model": "{in}/notes.txt"}, r"--model .*notes\.txt is a file"),
        ({"--model": "{in}/empty"}, r"neither a pipeline folder \(model_index\.json\) nor a transformer folder"),
        ({"--model": "{in}/zero_size"}, r"zero_size/config\.json: sample_size must be a positive integer, got 0"),
        ({"--model": "{in}/zero_size", "--dry-run": ""}, r"zero_size/config\.json: sample_size must be a positive"),
        ({"--ref": "{tmp}/missing"}, r"--ref .*missing does not exist"),
        ({"--ref": "{in}/notes.txt"}, r"--ref .*notes\.txt is not an \.npz file"),
        ({"--ref": "{in}/other.npz"}, r"other\.npz is neither an ADM reference batch"),
        ({"--output": "{tmp}/file.txt"}, r"--output-dir .*file\.txt is a file; give a folder"),
        ({"--output": "{tmp}/file.txt/out"}, r"--output-dir .*out lies under .*file\.txt, which is a file"),
        ({"--output": "{tmp}/done", "--save-samples": ""}, r"ratio_1\.0000/samples already holds samples; .*--output-dir"),
        ({"--no-cache": REMOVE, "--cache-dir": "{tmp}/file.txt"}, r"--cache-dir .*file\.txt is a file"),
        # What the sweep writes never is, lies in or holds what it reads.
        ({"--output": "{model}/sweep"}, r"--output-dir .*transformer/sweep lies inside --model"),
        ({"--output": "{ref}"}, r"--output-dir .*class_0 is --ref"),
        ({"--output": "{model}/.."}, r"--output-dir .* contains --model"),
        ({"--no-cache": REMOVE, "--cache-dir": "{ref}/cache"}, r"--cache-dir .*cache lies inside --ref"),
        ({"--output": "{tmp}/user"}, r"--output-dir .*user already holds files that moh-dit sweep did not write "
                                     r"\(notes\.txt\)"),
        # Every image's features are kept for the metrics: a count that cannot fit is refused first.
        ({"--num-samples": str(10**9)}, r"--num-samples 1000000000 needs about .* of memory, more than the .* "
                                        r"available on this machine; use a smaller --num-samples"),
    ],
)
def test_script_refuses_bad_flags(changes, match, model_dir, dense_dir, reference_dir, sweep_inputs, tmp_path, refuses):
    (tmp_path / "file.txt").write_text("mine")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("the user's")
    (tmp_path / "done" / "ratio_1.0000" / "samples").mkdir(parents=True)
    (tmp_path / "done" / "ratio_1.0000" / "samples" / "000000.png").write_bytes(b"an earlier sweep's image")
    base = {"--model": str(model_dir), "--ref": str(reference_dir / "class_0"), "--ratios": "1.0,min",
            "--num-samples": "4", "--batch-size": "4", "--num-inference-steps": "1", "--guidance-scale": "1",
            "--random-inception-seed": "0", "--no-cache": "", "--no-download": "", "--device": "cpu",
            "--output": str(tmp_path / "out")}
    fill = lambda v: (v.replace("{tmp}", str(tmp_path)).replace("{in}", str(sweep_inputs))
                      .replace("{dense}", str(dense_dir)).replace("{model}", str(model_dir))
                      .replace("{ref}", str(reference_dir / "class_0")))
    for flag, value in changes.items():
        if value is REMOVE:
            base.pop(flag)
        else:
            base[flag] = fill(value)
    argv = [f"{flag}={value}" if value else flag for flag, value in base.items()]  # --ratios=-0.5 is a value
    refuses("sweep_head_ratio", argv, match)


@pytest.mark.slow
def test_a_second_sweep_into_the_same_folder_stops_at_once(model_dir, reference_dir, tmp_path, refuses, load_script):
    out = tmp_path / "out"
    argv = ["--model", model_dir, "--ref", reference_dir / "class_0", "--ratios", "1.0", "--num-samples", "4",
            "--num-inference-steps", "1", "--random-inception-seed", "0", "--no-cache", "--device", "cpu",
            "--output-dir", out]
    with hold_output_folder(out, "sweep"):
        refuses("sweep_head_ratio", argv, r"--output-dir .*out is being written by another command \(moh-dit sweep, "
                                          r"pid \d+")
    assert not out.exists()
    script = load_script("sweep_head_ratio")
    for _ in range(2):  # free once the holder is done; a sweep's own folder is written again
        assert script.cli([str(a) for a in argv]) == 0
    assert json.loads((out / ".moh-dit-output.json").read_text())["written_by"] == "moh-dit sweep"
    assert not (tmp_path / ".out.lock").exists()
