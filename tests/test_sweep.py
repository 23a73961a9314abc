"""The head-activation sweep: rows merged by realised ratio, FLOPs from the model's account, the
same images at every ratio, schedules, the bootstrap and Wilson intervals, the written files and
plot, errors before any sampling, and the command's flags."""

import csv
import json

import numpy as np
import PIL.Image
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.commands import build_parser, sweep_head_ratio as command
from moh_dit.models.flops import model_attention_flops
from moh_dit.sampling import load_pipeline, png_path, to_uint8
from moh_dit.sampling.sweep import plot_sweep, sweep, table, wilson_interval

pytestmark = pytest.mark.usefixtures("one_thread")
SIZE = 16  # 16x16 RGB, patch 4: 16 tokens
# Small, with uneven batches (3 + 2) so that the last partial batch is exercised.
FAST = dict(num_samples=5, batch_size=3, num_inference_steps=2, guidance_scale=1.5, seed=5, use_cache=False,
            progress=False)


class ConvFeatures(nn.Module):
    """A fixed random conv + pooling standing in for Inception: uint8 NCHW -> pool/logits/spatial."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 12, 3, padding=1)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=generator) * 0.5)
            self.conv.bias.zero_()

    def forward(self, images):
        h = F.relu(self.conv(images.float() / 127.5 - 1.0))  # (N, 12, H, W)
        return {"pool": h.mean(dim=(2, 3)), "logits": h.amax(dim=(2, 3)),
                "spatial": F.adaptive_avg_pool2d(h, 2).flatten(1)}


def _model(randomize, preset, path):
    randomize(MoHDiTTransformer2DModel.from_preset(preset, sample_size=SIZE), std=0.1, seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, randomize):
    return _model(randomize, "MoH-DiT-Tiny", tmp_path_factory.mktemp("moh") / "transformer")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory, randomize):
    return _model(randomize, "DiT-Tiny", tmp_path_factory.mktemp("dense") / "transformer")


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """An image folder of 8 smooth 16x16 images, two classes of 4."""
    root = tmp_path_factory.mktemp("reference")
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    for i in range(8):
        image = np.stack([(xx * 9 + 31 * i) % 256, (yy * 13 + 17 * i) % 256, (xx * yy + 50 * i) % 256], axis=-1)
        (root / f"class_{i // 4}").mkdir(exist_ok=True)
        PIL.Image.fromarray(image.astype(np.uint8)).save(root / f"class_{i // 4}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def swept(model_dir, reference_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "out"
    result = sweep(model_dir, ["trained", 1.0, 0.75, "min", "linear:0.5:1.0"], reference=reference_dir,
                   extractor=ConvFeatures(), output_dir=out, save_samples=True, **FAST)
    return result, out


def _pngs(folder, n=5):
    return np.stack([np.asarray(PIL.Image.open(png_path(folder, i))) for i in range(n)])


@pytest.mark.slow
def test_rows_merge_requests_and_count_the_models_flops(swept, model_dir):
    result, _ = swept
    rows = {row["ratio"]: row for row in result["rows"]}
    assert list(rows) == ["1.0", "trained/0.75", "min", "linear:0.5:1.0"]  # highest first, schedules last
    model = MoHDiTTransformer2DModel.from_pretrained(model_dir)
    for label, ratio in (("1.0", 1.0), ("trained/0.75", 0.75), ("min", model.head_activation_range[0])):
        row = rows[label]
        assert row["realised_ratio"] == model.set_head_activation_ratio(ratio)
        sparse, dense = model_attention_flops(model)
        assert row["top_k_per_layer"] == model.top_k_per_layer
        assert (row["attention_flops_per_image"], row["dense_attention_flops_per_image"]) == (sparse * 4, dense * 4)
        assert all(np.isfinite(row[k]) for k in ("fid", "sfid", "inception_score", "precision", "recall"))
    linear = rows["linear:0.5:1.0"]  # two DDPM steps: 0.5, then 1.0
    assert linear["head_activation_ratios"] == [0.5, 1.0] and linear["realised_ratio"] == 0.75
    per_step = [model.set_head_activation_ratio(r) and model_attention_flops(model)[0] for r in (0.5, 1.0)]
    assert linear["mean_attention_flops"] == pytest.approx(sum(per_step) / 2)
    assert rows["1.0"]["attention_flop_ratio"] == 1.0 > rows["trained/0.75"]["attention_flop_ratio"]
    assert len({r["fid"] for r in result["rows"][:3]}) == 3  # the ratio changes the images
    settings = result["settings"]
    assert settings["transformer_calls_per_image"] == 4 and settings["comparable_to_published"] is False
    assert "NOT comparable" in table(result)


def test_the_same_images_at_every_ratio_are_the_pipelines(swept, model_dir, reference_dir):
    result, out = swept
    rows = {row["ratio"]: row for row in result["rows"]}
    pipe = load_pipeline(model_dir)
    for label, ratio in (("trained/0.75", 0.75), ("linear:0.5:1.0", "linear:0.5:1.0")):
        latents = pipe([0, 1, 2, 3], guidance_scale=1.5, num_inference_steps=2, head_activation_ratio=ratio,
                       guidance_channels="dit", seeds=[5, 6, 7, 8], output_type="latent").images
        np.testing.assert_array_equal(to_uint8(latents), _pngs(rows[label]["samples_dir"])[:4])
    assert not np.array_equal(_pngs(rows["1.0"]["samples_dir"]), _pngs(rows["min"]["samples_dir"]))
    # Seeds and labels do not depend on what else is swept: ratio 1.0 alone gives the same numbers.
    again = sweep(model_dir, [1.0], reference=reference_dir, extractor=ConvFeatures(), **FAST)["rows"][0]
    assert (again["fid"], again["sfid"], again["fid_low"]) == (rows["1.0"]["fid"], rows["1.0"]["sfid"],
                                                             rows["1.0"]["fid_low"])


def test_the_written_files(swept):
    result, out = swept
    assert sorted(p.name for p in out.iterdir()) == [
        ".moh-dit-output.json", "fid_vs_ratio.png", "ratio_0.5000", "ratio_0.7500", "ratio_1.0000",
        "ratio_linear_0.5_1.0", "sweep.csv", "sweep.json"]
    assert json.loads((out / "sweep.json").read_text()) == json.loads(json.dumps(result))
    table_rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [float(r["realised_ratio"]) for r in table_rows] == [1.0, 0.75, 0.5, 0.75]
    assert float(table_rows[1]["fid"]) == pytest.approx(result["rows"][1]["fid"])
    assert table_rows[3]["top_k_per_layer"] == ""  # a schedule's top-K changes per step
    assert table_rows[2]["top_k_per_layer"] == " ".join(map(str, result["rows"][2]["top_k_per_layer"]))
    assert json.loads((out / ".moh-dit-output.json").read_text())["written_by"] == "moh-dit sweep"
    with PIL.Image.open(out / "fid_vs_ratio.png") as plot:
        assert plot.size == (900, 520)


def test_the_plot_shows_the_rows_with_their_intervals(swept):
    result, _ = swept
    figure = plot_sweep(result)
    (ax,) = figure.axes
    constant, star, schedule = ax.containers
    rows = sorted((r for r in result["rows"] if r["head_activation_ratios"] is None),
                  key=lambda r: r["attention_flop_ratio"])
    xs, ys = constant.lines[0].get_data()
    assert list(xs) == [r["attention_flop_ratio"] for r in rows] and list(ys) == [r["fid"] for r in rows]
    segments = sorted((s[0][0], s[0][1], s[1][1]) for s in constant.lines[2][0].get_segments())
    np.testing.assert_allclose(segments, [(r["attention_flop_ratio"], r["fid_low"], r["fid_high"]) for r in rows])
    assert star.get_label() == "trained ratio" and schedule.get_label() == "linear:0.5:1.0"
    assert ax.get_ylim()[0] == 0.0 and ax.get_ylabel() == "FID"


def test_intervals(swept, model_dir, reference_dir):
    result, _ = swept
    for row in result["rows"]:
        assert row["fid_low"] < row["fid"] < row["fid_high"] and row["fid_bootstrap_bias"] > 0
    assert result["settings"]["bootstrap_resamples"] == 200
    other = sweep(model_dir, [1.0], reference=reference_dir, extractor=ConvFeatures(), bootstrap_seed=1,
                  **FAST)["rows"][0]
    assert other["fid"] == result["rows"][0]["fid"] and other["fid_low"] != result["rows"][0]["fid_low"]
    none = sweep(model_dir, [1.0], reference=reference_dir, extractor=ConvFeatures(), bootstrap=0, **FAST)["rows"][0]
    assert "fid_low" not in none
    # Wilson: hand values (p = 0.95 at n = 120; the ends).
    assert wilson_interval(114, 120) == pytest.approx((0.89520, 0.97689), abs=1e-5)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert wilson_interval(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-5)


@pytest.mark.slow
def test_class_accuracy_of_each_ratio(model_dir, reference_dir, tmp_path):
    from moh_dit.evaluation import SampleClassifier, SmallCNN, class_accuracy

    torch.manual_seed(0)
    classifier = SampleClassifier(SmallCNN(10, width=4), lambda x: x * 2 - 1, [f"c{i}" for i in range(10)], "test-cnn")
    result = sweep(model_dir, ["trained", 1.0], reference=reference_dir, extractor=ConvFeatures(), save_samples=True,
                   output_dir=tmp_path / "out", classifier=classifier, **{**FAST, "num_samples": 10})
    for row in result["rows"]:
        expected = class_accuracy(classifier, _pngs(row["samples_dir"], 10), [i % 10 for i in range(10)])
        assert row["class_accuracy"] == pytest.approx(expected["class_accuracy"])
        correct = round(row["class_accuracy"] * 10)
        assert (row["class_accuracy_low"], row["class_accuracy_high"]) == wilson_interval(correct, 10)
    assert [ax.get_ylabel() for ax in plot_sweep(result).axes] == ["FID", "class accuracy"]


def test_errors_before_any_sampling_leave_nothing(model_dir, dense_dir, reference_dir, tmp_path):
    for model, ratios, match in ((model_dir, [1.0, 0.4], "0.4"), (dense_dir, [1.0, 0.9], "0.9")):
        with pytest.raises(ValueError, match=match):
            sweep(model, ratios, reference=reference_dir, extractor=ConvFeatures(), output_dir=tmp_path / "out", **FAST)
    with pytest.raises(FileNotFoundError):
        sweep(model_dir, [1.0], reference=tmp_path / "nope", extractor=ConvFeatures(), output_dir=tmp_path / "out",
              **FAST)
    assert list(tmp_path.iterdir()) == []
    dense = sweep(dense_dir, ["trained", 1.0, "min"], reference=reference_dir, extractor=ConvFeatures(), **FAST)
    assert [r["ratio"] for r in dense["rows"]] == ["trained/1.0/min"] and dense["rows"][0]["attention_flop_ratio"] == 1


def test_the_output_is_only_ever_a_sweeps(model_dir, reference_dir, tmp_path, swept):
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("the user's")
    for out, overwrite, error in ((tmp_path / "user", True, FileExistsError), (swept[1], False, FileExistsError),
                                  (model_dir / "sweep", False, ValueError), (reference_dir, False, ValueError)):
        with pytest.raises(error):
            sweep(model_dir, [1.0], reference=reference_dir, extractor=ConvFeatures(), output_dir=out,
                  overwrite=overwrite, **FAST)
    assert sorted(p.name for p in (tmp_path / "user").iterdir()) == ["notes.txt"]


def test_the_commands_flags(capsys):
    parser = build_parser("sweep")
    args = parser.parse_args(["--model", "m", "--ref", "r", "--ratios", "trained, 1.0,0.6,min,linear:0.5:1",
                              "--output", "o"])
    assert args.ratios == ["trained", 1.0, 0.6, "min", "linear:0.5:1"] and args.output_dir == "o"
    assert parser.parse_args(["--model", "m", "--ref", "r"]).ratios == ["trained", 1.0, 0.9, 0.75, 0.6, "min"]
    for bad in (["--ratios", "1.5"], ["--ratios", "half"], ["--ratios", ","], ["--num-samples", "3"],
                ["--bootstrap", "-1"], ["--attention", "flash"], ["--random-inception-seed", "-1"],
                ["--random-inception-seed", "0", "--inception-weights", "w.pth"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "m", "--ref", "r", *bad])
        assert "error:" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_loads_the_pipeline_once_and_draws_the_head_usage(model_dir, reference_dir, tmp_path, capsys,
                                                                       monkeypatch):
    import moh_dit.sampling.sweep as library
    from moh_dit.head_usage import measure_head_usage

    parser = build_parser("sweep")
    argv = ["--model", model_dir, "--ref", reference_dir, "--ratios", "1.0,min", "--num-samples", "4",
            "--num-inference-steps", "1", "--guidance-scale", "1", "--random-inception-seed", "0", "--no-cache",
            "--device", "cpu", "--head-usage-images", "1", "--output", tmp_path / "out"]
    loads = []
    monkeypatch.setattr(library, "load_pipeline", lambda *a, **k: loads.append(a) or load_pipeline(*a, **k))
    command.main(parser.parse_args([str(a) for a in argv]))
    assert len(loads) == 1 and "NOT comparable" in capsys.readouterr().out
    data = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [r["realised_ratio"] for r in data["rows"]] == [1.0, 0.5] and "RANDOM" in data["settings"]["extractor"]
    usage = json.loads((tmp_path / "out" / "head_usage" / "head_usage.json").read_text())
    direct = measure_head_usage(load_pipeline(model_dir), images_per_class=1, num_inference_steps=1, progress=False)
    np.testing.assert_allclose(usage["overall"], direct.overall)
    command.main(parser.parse_args([str(a) for a in argv + ["--overwrite", "--ratios", "1.0"]]))  # its own folder
    assert len(json.loads((tmp_path / "out" / "sweep.json").read_text())["rows"]) == 1
