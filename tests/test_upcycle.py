"""Upcycling a dense DiT into MoH-DiT: layouts, head importance, weight transfer, the first
forward against the dense model with unselected heads removed, the script."""

import argparse
import json

import numpy as np
import pytest
import torch
from PIL import Image

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.errors import InvalidInput
from moh_dit.hub.convert import model_to_release_state_dict
from moh_dit.models.presets import PRESETS, UPCYCLED_PRESETS, head_activation_ratio_of_config
from moh_dit.utils.output_folders import OUTPUT_MARKER
from moh_dit.hub.upcycle import (REPORT_FILE, choose_heads, dense_forward_with_head_mask, first_forward_gap,
                             head_importance, resolve_layout, routing_head_masks, transfer_weights, upcycle)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def dense(randomize):
    return randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8), seed=3).eval()


def _batches(n=2, batch=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 8, 8, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
            for _ in range(n)]


def _inputs(seed=5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 3, 8, 8, generator=gen), torch.tensor([999, 400, 3]), torch.tensor([1, 7, 10])


def _image_folder(root, classes=3, per_class=4, size=8):
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / f"c{c}" / f"{i}.png")
    return root


def test_upcycled_presets_keep_dense_heads_and_their_activation():
    expected = {"MoH-DiT-XL/2-up75": 0.75, "MoH-DiT-XL/2-up90": 403 / 448, "MoH-DiT-Tiny-up75": 0.75,
                "MoH-DiT-Tiny-up90": 22 / 24, "MoH-DiT-Tiny/2-up75": 0.75}
    assert set(UPCYCLED_PRESETS) == set(expected)
    for name, ratio in expected.items():
        cfg, dense = PRESETS[name], PRESETS[UPCYCLED_PRESETS[name][0]]
        assert cfg["num_attention_heads"] == [dense["num_attention_heads"]] * dense["num_layers"]
        assert head_activation_ratio_of_config(cfg) == pytest.approx(ratio, abs=1e-12)
        for key in ("hidden_size", "num_layers", "attention_head_dim", "patch_size", "sample_size", "num_classes"):
            assert cfg[key] == dense[key]
    assert PRESETS["MoH-DiT-Tiny-up75"]["num_shared_heads"] == PRESETS["MoH-DiT-Tiny"]["num_shared_heads"]


def test_first_forward_is_the_dense_model_with_unselected_heads_removed(dense):
    """Zero routers: every kept head's gate is exactly 1 (shared, routed and the two-stage mix),
    each token keeps hs + K heads, and the output is the dense model's with the others removed."""
    moh, report = upcycle(dense, 0.75, calibration=_batches(), progress=False)
    assert report.preset == "MoH-DiT-Tiny-up75" and moh.layer_heads == [4] * 6
    assert any(c.order != sorted(c.order) for c in report.layers)  # heads were really reordered
    x, t, y = _inputs()
    sample, gates = routing_head_masks(moh, x, t, y, report.layers)
    for c, g in zip(report.layers, gates):
        kept = g != 0
        assert torch.all(kept.sum(-1) == len(c.shared) + c.top_k)
        assert torch.all(kept[..., c.shared])
        assert torch.equal(g[kept], torch.ones_like(g[kept]))  # exactly the dense scale
    masked = dense_forward_with_head_mask(dense, x, t, y, gates)
    assert (sample - masked).abs().max() <= 1e-5
    assert (dense(x, t, y).sample - masked).abs().max() > 1e-3  # heads really were removed
    # the check can fail: a router that moves the gates off 1 is caught
    with torch.no_grad():
        moh.transformer_blocks[1].attn1.router_mix.weight.normal_(0, 0.5)
    gap, _ = first_forward_gap(dense, moh, report.layers, x, t, y)
    assert gap > 1e-3


def test_every_dense_weight_is_kept(dense):
    moh, report = upcycle(dense, shared_heads=2, top_k=1)
    d = dense.config.attention_head_dim
    src, dst = dense.state_dict(), moh.state_dict()
    assert {k for k in dst if ".router_" not in k} == set(src)
    assert all(torch.count_nonzero(v) == 0 for k, v in dst.items() if ".router_" in k)
    for c in report.layers:
        for pos, head in enumerate(c.order):
            for p in "qkv":
                key = f"transformer_blocks.{c.layer}.attn1.to_{p}.weight"
                assert torch.equal(dst[key][pos * d:(pos + 1) * d], src[key][head * d:(head + 1) * d])
            key = f"transformer_blocks.{c.layer}.attn1.to_out.0.weight"
            assert torch.equal(dst[key][:, pos * d:(pos + 1) * d], src[key][:, head * d:(head + 1) * d])
    assert all(torch.equal(src[k], dst[k]) for k in src if ".attn1." not in k)


def test_importance_finds_a_silenced_and_a_loud_head(dense):
    with torch.no_grad():
        w = dense.transformer_blocks[2].attn1.to_out[0].weight
        w[:, 32:64] *= 1e-4  # head 1 of layer 2 hardly contributes
        w[:, 96:128] *= 5.0  # head 3 contributes a lot
    importance = head_importance(dense, _batches(), progress=False)
    layer = importance[2]
    assert min(layer) == layer[1] and max(layer) == layer[3] and layer[1] < 1e-6
    choices = choose_heads(dense.layer_heads, [2] * 6, [1] * 6, importance)
    assert choices[2].shared[0] == 3 and choices[2].routed[-1] == 1
    default = choose_heads(dense.layer_heads, [2] * 6, [1] * 6, None)
    assert all(c.shared == [0, 1] and c.routed == [2, 3] and c.importance is None for c in default)


def test_xl_layouts_fit_dense_xl_weights():
    """At DiT-XL/2 shape (on the meta device: no memory): both upcycled presets are found, and
    every dense key moves over with its shape."""
    with torch.device("meta"):
        dense = MoHDiTTransformer2DModel.from_preset("DiT-XL/2")
    for activation, name in ((0.75, "MoH-DiT-XL/2-up75"), (0.9, "MoH-DiT-XL/2-up90")):
        preset, shared, k = resolve_layout(dense, activation)
        assert preset == name and shared == PRESETS[name]["num_shared_heads"] and k == PRESETS[name]["top_k"]
        with torch.device("meta"):
            moh = MoHDiTTransformer2DModel.from_preset(name)
        src, dst = dense.state_dict(), moh.state_dict()
        assert all(src[key].shape == dst[key].shape for key in src) and set(src) <= set(dst)
        assert all(".router_" in key for key in set(dst) - set(src))


@pytest.mark.slow
def test_xl_width_first_forward(randomize):
    """DiT-XL/2's width (16 heads of 72, hidden 1152), two layers, measured importance: the
    first forward is still the dense model with the unselected heads removed."""
    dense = randomize(MoHDiTTransformer2DModel.from_preset("DiT-XL/2", num_layers=2, sample_size=8), std=0.02).eval()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([3, 999]))]
    moh, report = upcycle(dense, shared_heads=[10, 6], top_k=[2, 2], calibration=batches, progress=False)
    assert moh.layer_heads == [16, 16] and [len(c.routed) for c in report.layers] == [6, 10]
    assert all(len(c.importance) == 16 for c in report.layers)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    t, y = torch.tensor([10, 900]), torch.tensor([1, 1000])
    gap, gates = first_forward_gap(dense, moh, report.layers, x, t, y)
    scale = dense(x, t, y).sample.abs().max().item()
    assert gap <= 1e-5 * max(1.0, scale)
    assert all(torch.equal(g[g != 0], torch.ones_like(g[g != 0])) for g in gates)


def test_bad_layouts_are_refused(dense):
    def refused(parameters, call, *args, **kwargs):
        with pytest.raises(InvalidInput) as error:
            call(*args, **kwargs)
        assert set(parameters) <= set(error.value.parameters) and "--" not in str(error.value)

    refused(["activation", "shared_heads", "top_k"], upcycle, dense)
    with pytest.raises(ValueError, match=r"\[0\.2500, 1\.0\] .*6 layers, 24 heads"):  # the reachable range
        upcycle(dense, 0.2)
    refused(["activation"], upcycle, dense, 1.5)
    refused(["shared_heads", "top_k"], resolve_layout, dense, None, shared_heads=2)
    with pytest.raises(ValueError, match="Layer 0: top_k=3"):
        upcycle(dense, shared_heads=2, top_k=[3, 1, 1, 1, 1, 1])
    refused(["shared_heads"], upcycle, dense, shared_heads=[2, 2], top_k=1)
    moh = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8)
    with pytest.raises(ValueError, match="MoH"):  # upcycling starts from a dense DiT
        upcycle(moh, 0.75)
    # a model no upcycled preset fits takes the upcycling rule's layout (tests/test_upcycle_layout.py)
    small = MoHDiTTransformer2DModel.from_preset("DiT-S/2", num_layers=2, sample_size=4)
    moh, report = upcycle(small, 0.75)
    assert report.preset is None and moh.trained_head_activation_ratio == pytest.approx(0.75)


def test_upcycled_model_saves_loads_and_samples_at_any_ratio(dense, tmp_path, tiny_pipe):
    from moh_dit import MoHDiTPipeline
    from moh_dit.pipelines.pipeline_moh_dit import make_scheduler
    from moh_dit.hub.upcycle import save_upcycled

    moh, report = upcycle(dense, 0.75)
    save_upcycled(moh, report, tmp_path / "up")
    loaded = MoHDiTTransformer2DModel.from_pretrained(tmp_path / "up").eval()
    x, t, y = _inputs()
    assert torch.equal(loaded(x, t, y).sample, moh(x, t, y).sample)
    assert json.loads((tmp_path / "up" / REPORT_FILE).read_text())["preset"] == "MoH-DiT-Tiny-up75"
    with pytest.raises(FileExistsError, match="already exists.*overwrite"):
        save_upcycled(moh, report, tmp_path / "up")
    # a pipeline folder holding a dense transformer is a source too
    dense.save_pretrained(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text('{"_class_name": "MoHDiTPipeline"}')
    again, _ = upcycle(tmp_path / "pipe", 0.75)
    assert torch.equal(again(x, t, y).sample, moh(x, t, y).sample)
    pipe = MoHDiTPipeline(transformer=loaded, scheduler=make_scheduler("ddpm"))
    pipe.set_progress_bar_config(disable=True)
    for ratio in (1.0, 0.75, 0.6):
        out = pipe([1, 2], num_inference_steps=2, seeds=[0, 1], output_type="np", head_activation_ratio=ratio)
        assert out.images.shape == (2, 8, 8, 3) and np.isfinite(out.images).all()
        assert out.head_activation_ratio == pytest.approx(ratio, abs=1 / 24)


def test_cli_upcycles_a_release_checkpoint(tmp_path, randomize, load_script, capsys):
    dense = randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8), seed=4).eval()
    torch.save({"model": model_to_release_state_dict(dense), "ema": model_to_release_state_dict(dense),
                "args": argparse.Namespace(model="DiT-Tiny")}, tmp_path / "dense.pt")
    data = _image_folder(tmp_path / "calib")
    code = load_script("upcycle").cli(["--checkpoint", str(tmp_path / "dense.pt"), "--preset", "DiT-Tiny",
                                       "--output", str(tmp_path / "up"), "--activation", "0.9",
                                       "--calibration-data", str(data), "--calibration-batches", "2",
                                       "--batch-size", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "MoH-DiT-Tiny-up90" in out and "importance measured on 8 calibration inputs" in out
    assert out.count("layer ") == 6 and "importance 0:" in out
    report = json.loads((tmp_path / "up" / REPORT_FILE).read_text())
    assert [len(layer["importance"]) for layer in report["layers"]] == [4] * 6
    assert report["first_forward_max_abs_diff"] <= 1e-5
    model = MoHDiTTransformer2DModel.from_pretrained(tmp_path / "up")
    assert model.layer_shared == PRESETS["MoH-DiT-Tiny-up90"]["num_shared_heads"]


@pytest.fixture
def inputs(tmp_path, randomize):
    dense = randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8)).eval()
    dense.save_pretrained(tmp_path / "dense")
    torch.save(model_to_release_state_dict(dense), tmp_path / "dense.pt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    (tmp_path / "file").write_text("a file")
    _image_folder(tmp_path / "calib")
    return tmp_path


BAD = [
    (["--output", "{t}/out", "--activation", "0.75"], "required: --checkpoint"),
    # Reproduction: the refusal told to pass --overwrite, which upcycle did not have; now it has it,
    # and it replaces only an earlier upcycled model.
    (["--checkpoint", "{t}/dense", "--output", "{t}/full", "--activation", "0.75"], "full' already exists.*--overwrite"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/full", "--activation", "0.75", "--overwrite"],
     "--overwrite would replace .*full', which is not an upcycled model"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/dense", "--activation", "0.75", "--overwrite"],
     "not an upcycled model"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/file", "--activation", "0.75"], "is a file"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out"], "--activation.*--shared-heads.*--top-k"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out", "--activation", "0.2"],
     r"outside the reachable range \[0\.2500, 1\.0\]"),
    (["--checkpoint", "{t}/dense.pt", "--preset", "DiT-Tiny", "--output", "{t}/out", "--activation", "0.2"],
     r"outside the reachable range \[0\.2500, 1\.0\]"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out", "--activation", "0"], r"--activation .*got 0"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out", "--activation", "nan"], r"--activation .*got nan"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out", "--activation", "0.75", "--shared-heads", "2", "--top-k", "1"],
     "--activation.*--shared-heads.*--top-k"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out", "--shared-heads", "2"], "--shared-heads and --top-k"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out", "--shared-heads", "2,x", "--top-k", "1"], "not an integer"),
    (["--checkpoint", "{t}/dense.pt", "--output", "{t}/out", "--activation", "0.75"], r"dense\.pt needs --preset"),
    (["--checkpoint", "{t}/dense.pt", "--preset", "MoH-DiT-Tiny", "--output", "{t}/out", "--activation", "0.75"],
     "--preset 'MoH-DiT-Tiny'"),
    (["--checkpoint", "{t}/nope.pt", "--preset", "DiT-Tiny", "--output", "{t}/out", "--activation", "0.75"],
     "does not exist"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out", "--activation", "0.75", "--calibration-data", "{t}/none"],
     "--calibration-data .*none: no such folder"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out", "--activation", "0.75", "--vae", "x"], "--vae only"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out", "--activation", "0.75", "--calibration-data", "{t}/calib",
      "--calibration-batches", "0"], "--calibration-batches .*got 0"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out", "--activation", "0.75", "--seed", "-1"], "--seed"),
    (["--checkpoint", "{t}/dense", "--output", "{t}/out", "--activation", "0.75", "--device", "tpu:x"], "--device"),
]


@pytest.mark.parametrize("argv, match", BAD)
def test_script_refuses_bad_input(argv, match, inputs, refuses):
    refuses("upcycle", [a.format(t=inputs) for a in argv], match)


def test_overwrite_replaces_an_earlier_upcycled_model_only(inputs, load_script, capsys):
    """--overwrite exists (the refusal names it) and replaces upcycle's own output: one it marked,
    or one from before the marker (a saved model with upcycle_report.json and nothing else)."""
    script = load_script("upcycle")
    out = inputs / "up"
    argv = ["--checkpoint", str(inputs / "dense"), "--output", str(out), "--activation", "0.75"]
    assert script.cli(argv) == 0
    assert json.loads((out / OUTPUT_MARKER).read_text())["written_by"] == "moh-dit upcycle"
    assert script.cli(argv) == 1 and "pass --overwrite" in capsys.readouterr().err
    assert script.cli(argv + ["--overwrite", "--activation", "0.9"]) == 0
    assert json.loads((out / REPORT_FILE).read_text())["preset"] == "MoH-DiT-Tiny-up90"
    (out / OUTPUT_MARKER).unlink()  # as upcycle wrote it before the marker: still recognised
    assert script.cli(argv + ["--overwrite"]) == 0
    (out / "notes.txt").write_text("mine")
    (out / OUTPUT_MARKER).unlink()
    assert script.cli(argv + ["--overwrite"]) == 1 and "not an upcycled model" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"


TINY_DEMO = ["--dense-steps", "2", "--continue-steps", "2", "--router-warmup-steps", "1", "--images-per-class", "2",
             "--reference-per-class", "1", "--eval-samples", "4", "--sample-steps", "1", "--classifier-epochs", "1",
             "--calibration-batches", "1"]


@pytest.mark.slow
def test_upcycle_demo_smoke(tmp_path, load_script, capsys):
    """The whole demo at tiny counts: five models, one table, same seeds; a rerun with other
    settings into the same folder is refused."""
    out = tmp_path / "demo"
    assert load_script("upcycle_demo").cli(["--output-dir", str(out), *TINY_DEMO]) == 0
    result = json.loads((out / "upcycle_demo.json").read_text())
    assert [r["training_steps"] for r in result["rows"]] == [2, 4, 2, 4, 4]
    assert [r["head_activation"] for r in result["rows"]] == [1.0, 1.0, 0.75, 0.75, 0.75]
    metrics = ("fid", "sfid", "precision", "recall", "class_accuracy")
    assert all(np.isfinite([r[k] for k in metrics]).all() for r in result["rows"])
    assert 0 <= result["classifier_held_out_accuracy"] <= 1
    assert "random InceptionV3" in result["features"]
    table = (out / "upcycle_demo.md").read_text()
    assert table.count("\n| ") == 6 and "NOT comparable" in table
    record = json.loads((out / "upcycled_run" / "train_config.json").read_text())
    assert record["init_from"] == str(out / "upcycled") and record["router_warmup_steps"] == 1
    assert json.loads((out / "dense_continued" / "train_config.json").read_text())["init_from"] == str(
        out / "dense" / "final")
    assert (out / "upcycled" / REPORT_FILE).is_file()
    capsys.readouterr()
    argv = ["--output-dir", str(out), *TINY_DEMO[:-2], "--calibration-batches", "2"]
    assert load_script("upcycle_demo").cli(argv) == 1
    assert "other settings (calibration_batches)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--dense-steps", "0"], "--dense-steps must be >= 1"),
    (["--continue-steps", "2", "--router-warmup-steps", "3"], "more than --continue-steps"),
    (["--eval-samples", "3"], "--eval-samples must be >= 4"),
    (["--classifier-epochs", "0"], "--classifier-epochs must be >= 1"),
    (["--sample-steps", "1001"], "at most 1000"),
    (["--learning-rate", "nan"], "--learning-rate"),
    (["--ema-decay", "1"], "--ema-decay"),
    (["--inception-weights", "{t}/none.pth"], "no such file"),
    (["--output-dir", "{t}/file"], "is a file"),
    (["--output-dir", "{t}/full"], "not an upcycling demo"),
])
def test_upcycle_demo_refuses_bad_flags(argv, match, tmp_path, refuses):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    argv = [a.format(t=tmp_path) for a in argv]
    if "--output-dir" not in argv:
        argv = ["--output-dir", str(tmp_path / "demo"), *argv]
    refuses("upcycle_demo", argv, match)


def test_upcycle_demo_continues_whatever_it_prints(tmp_path, load_script):
    """How much a rerun prints (-q, -v) is not a setting of the demo: the rerun continues it."""
    demo = load_script("upcycle_demo")
    out = tmp_path / "demo"
    demo._claim(demo.parse_args(["--output-dir", str(out), *TINY_DEMO]), out)
    demo._claim(demo.parse_args(["--output-dir", str(out), *TINY_DEMO, "-q"]), out)
    demo._claim(demo.parse_args(["--output_dir", str(out), *TINY_DEMO, "--verbose"]), out)
    with pytest.raises(FileExistsError, match=r"other settings \(seed\)"):
        demo._claim(demo.parse_args(["--output-dir", str(out), *TINY_DEMO, "--seed", "1"]), out)
