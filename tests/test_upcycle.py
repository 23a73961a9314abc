"""Upcycling a dense DiT into a MoH-DiT: the layout rule, head importance, the weight transfer, the
first forward against the dense model with the unselected heads removed, the command."""

import json
from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.hub.convert import model_to_release_state_dict
from moh_dit.hub.upcycle import (REPORT_FILE, choose_heads, first_forward_gap, head_importance, resolve_layout,
                                 save_upcycled, upcycle, upcycle_layout)
from moh_dit.models import PRESETS, HeadLayout

pytestmark = pytest.mark.usefixtures("one_thread")


def moh_dit(*argv) -> int:
    from moh_dit.commands import main

    return main([str(a) for a in argv])


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


# ----- the layout rule ---------------------------------------------------------------------------

SHAPES = {"S": [6] * 12, "B": [12] * 12, "L": [16] * 24, "XL": [16] * 28, "5x3": [3] * 5, "Tiny": [4] * 6,
          "mixed": [2, 4, 1, 3, 5]}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ratio", (0.5, 0.6, 0.75, 0.9))
def test_the_rule_realises_the_nearest_ratio_with_valid_layers(shape, ratio):
    heads = SHAPES[shape]
    shared, top_k = upcycle_layout(heads, ratio)
    HeadLayout.parse(len(heads), heads, shared, top_k)  # raises on an invalid layout
    active, exact = sum(s + k for s, k in zip(shared, top_k)), Fraction(str(ratio)) * sum(heads)
    assert abs(active - exact) <= Fraction(1, 2) and active - exact != -Fraction(1, 2)  # nearest, ties up
    drops = [h - s - k for h, s, k in zip(heads, shared, top_k)]
    assert all(s == h if k == 0 else h - s >= k + 1 for h, s, k in zip(heads, shared, top_k))  # routers choose
    if len(set(heads)) == 1:  # the paper's shape: early layers keep every head, later ones drop more
        assert drops == sorted(drops) and max(drops) - min(d for d in drops if d) <= 1


def test_the_rule_in_numbers():
    """docs/upcycling.md's worked examples and its table of active heads at 0.5, 0.6, 0.75 and 0.9."""
    assert upcycle_layout([6] * 12, 0.75) == ([6] * 4 + [3] * 6 + [1] * 2, [0] * 4 + [1] * 6 + [2] * 2)
    assert upcycle_layout([6] * 12, 0.6) == ([6, 6, 3] + [1] * 9, [0, 0, 1] + [2] * 9)
    assert upcycle_layout([3] * 5, 0.5) == ([1, 1, 1, 0, 0], [1] * 5)  # 8 of 15 active, not 7
    assert upcycle_layout([16] * 28, 0.9) == ([16] * 9 + [13] * 12 + [11] * 7, [0] * 9 + [1] * 12 + [2] * 7)
    table = {"S": (36, 43, 54, 65), "B": (72, 86, 108, 130), "L": (192, 230, 288, 346), "XL": (224, 269, 336, 403),
             "5x3": (8, 9, 11, 14)}
    for shape, counts in table.items():
        assert tuple(sum(map(sum, upcycle_layout(SHAPES[shape], r))) for r in (0.5, 0.6, 0.75, 0.9)) == counts
    for heads in ([3] * 5, [2, 4, 1, 3, 5]):  # every reachable head count is realised
        for active in range(len(heads), sum(heads) + 1):
            assert sum(map(sum, upcycle_layout(heads, active / sum(heads)))) == active
    for ratio in (0.19, 0.0, 1.01, float("nan")):
        with pytest.raises(ValueError, match=r"\[0\.2000, 1\.0\]"):
            upcycle_layout([5] * 5, ratio)


@pytest.mark.slow
def test_presets_keep_their_layouts_and_other_ratios_take_the_rule():
    with torch.device("meta"):
        xl2, xl4, tiny = (MoHDiTTransformer2DModel.from_preset(n) for n in ("DiT-XL/2", "DiT-XL/4", "DiT-Tiny"))
    for model, ratio, name in ((xl2, 0.75, "MoH-DiT-XL/2-up75"), (xl2, 0.9, "MoH-DiT-XL/2-up90"),
                               (tiny, 0.75, "MoH-DiT-Tiny-up75"), (tiny, 0.9, "MoH-DiT-Tiny-up90")):
        assert resolve_layout(model, ratio) == (name, PRESETS[name]["num_shared_heads"], PRESETS[name]["top_k"])
        with torch.device("meta"):  # every dense key moves over with its shape
            src, dst = model.state_dict(), MoHDiTTransformer2DModel.from_preset(name).state_dict()
        assert all(src[k].shape == dst[k].shape for k in src) and all("router" in k for k in set(dst) - set(src))
    for model, ratio in ((xl2, 0.6), (xl4, 0.75), (tiny, 0.76)):
        assert resolve_layout(model, ratio) == (None, *upcycle_layout([16] * 28 if model is not tiny else [4] * 6,
                                                                      ratio))


# ----- the weights and the first forward ---------------------------------------------------------

def test_the_first_forward_is_the_dense_model_with_unselected_heads_removed(dense):
    """Zero routers: each token keeps hs + K heads, each at exactly the dense scale."""
    moh, report = upcycle(dense, 0.75, calibration=_batches(), progress=False)
    assert report.preset == "MoH-DiT-Tiny-up75" and any(c.order != sorted(c.order) for c in report.layers)
    x, t, y = _inputs()
    gap, used = first_forward_gap(dense, moh, report.layers, x, t, y)
    assert gap <= 1e-5 and report.first_forward_max_abs_diff <= 1e-5
    for c, u in zip(report.layers, used):
        assert torch.all(u.sum(-1) == len(c.shared) + c.top_k) and torch.all(u[..., c.shared] == 1)
    with torch.no_grad():
        assert (dense(x, t, y).sample - moh(x, t, y).sample).abs().max() > 1e-3  # heads really were removed
        moh.transformer_blocks[1].attn1.router_mix.weight.normal_(0, 0.5)  # gates off 1: the check fails
    assert first_forward_gap(dense, moh, report.layers, x, t, y)[0] > 1e-3


def test_every_dense_weight_is_kept(dense):
    moh, report = upcycle(dense, shared_heads=2, top_k=1, calibration=_batches(1), progress=False)
    d, src, dst = 32, dense.state_dict(), moh.state_dict()
    assert {k for k in dst if "router" not in k} == set(src)
    assert all(torch.count_nonzero(v) == 0 for k, v in dst.items() if "router" in k)
    for c in report.layers:
        for pos, head in enumerate(c.order):
            for p in "qkv":
                key = f"transformer_blocks.{c.layer}.attn1.to_{p}.weight"
                assert torch.equal(dst[key][pos * d:(pos + 1) * d], src[key][head * d:(head + 1) * d])
            key = f"transformer_blocks.{c.layer}.attn1.to_out.0.weight"
            assert torch.equal(dst[key][:, pos * d:(pos + 1) * d], src[key][:, head * d:(head + 1) * d])
    assert all(torch.equal(src[k], dst[k]) for k in src if ".attn1." not in k)


@pytest.mark.slow
def test_importance_finds_a_silenced_and_a_loud_head(dense):
    with torch.no_grad():
        w = dense.transformer_blocks[2].attn1.to_out[0].weight
        w[:, 32:64] *= 1e-4  # head 1 of layer 2 hardly contributes
        w[:, 96:128] *= 5.0  # head 3 contributes a lot
    layer = head_importance(dense, _batches(), progress=False)[2]
    assert min(layer) == layer[1] < 1e-6 and max(layer) == layer[3]
    choices = choose_heads([4] * 6, [2] * 6, [1] * 6, head_importance(dense, _batches(), progress=False))
    assert choices[2].shared[0] == 3 and choices[2].routed[-1] == 1
    assert all(c.shared == [0, 1] and c.routed == [2, 3] for c in choose_heads([4] * 6, [2] * 6, [1] * 6, None))


def test_an_odd_model_and_ratio_one(randomize):
    """5 layers of 3 heads at 0.5 (layers without a shared head), and 1.0: the dense function."""
    dense = randomize(MoHDiTTransformer2DModel.from_preset(
        "DiT-Tiny", num_layers=5, num_attention_heads=3, hidden_size=96, attention_head_dim=32, sample_size=8),
        seed=1).eval()
    moh, report = upcycle(dense, 0.5, calibration=[(torch.randn(4, 3, 8, 8), torch.tensor([0, 3, 5, 9]))],
                          progress=False)
    assert report.activation == pytest.approx(8 / 15) and report.first_forward_max_abs_diff <= 1e-5
    assert all(c.importance[s] >= c.importance[r] for c in report.layers for s in c.shared for r in c.routed)
    assert "requested 0.5, realised 8/15 = 0.5333" in report.table()
    moh, report = upcycle(dense, 1.0, progress=False)
    x, t, y = torch.randn(2, 3, 8, 8), torch.tensor([999, 10]), torch.tensor([1, 10])
    with torch.no_grad():
        assert report.preset is None and (moh(x, t, y).sample - dense(x, t, y).sample).abs().max() <= 1e-5


def test_bad_layouts_are_refused(dense):
    for kwargs in ({}, {"shared_heads": 2}, {"activation": 0.75, "shared_heads": 2, "top_k": 1}):
        with pytest.raises(ValueError, match="activation"):
            upcycle(dense, **kwargs)
    with pytest.raises(ValueError, match=r"\[0\.2500, 1\.0\]"):
        upcycle(dense, 0.2)
    with pytest.raises(ValueError, match="top_k"):
        upcycle(dense, shared_heads=2, top_k=[3, 1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="MoH"):
        upcycle(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8), 0.75)


# ----- saving, sources and the command -----------------------------------------------------------

def test_the_upcycled_model_saves_loads_and_samples_at_any_ratio(dense, tmp_path):
    from moh_dit import MoHDiTPipeline
    from moh_dit.diffusion import make_scheduler

    moh, report = upcycle(dense, 0.75, progress=False)
    assert save_upcycled(moh, report, tmp_path / "up") == tmp_path / "up"
    loaded = MoHDiTTransformer2DModel.from_pretrained(tmp_path / "up").eval()
    x, t, y = _inputs()
    with torch.no_grad():
        assert torch.equal(loaded(x, t, y).sample, moh(x, t, y).sample)
    assert json.loads((tmp_path / "up" / REPORT_FILE).read_text())["preset"] == "MoH-DiT-Tiny-up75"
    dense.save_pretrained(tmp_path / "pipe" / "transformer")  # a pipeline folder is a source too
    (tmp_path / "pipe" / "model_index.json").write_text('{"_class_name": "MoHDiTPipeline"}')
    with torch.no_grad():
        assert torch.equal(upcycle(tmp_path / "pipe", 0.75, progress=False)[0](x, t, y).sample, moh(x, t, y).sample)
    pipe = MoHDiTPipeline(transformer=loaded, scheduler=make_scheduler("ddpm"))
    pipe.set_progress_bar_config(disable=True)
    for ratio in (1.0, 0.75, 0.6):
        out = pipe([1, 2], num_inference_steps=2, seeds=[0, 1], output_type="np", head_activation_ratio=ratio)
        assert np.isfinite(out.images).all() and out.head_activation_ratio == pytest.approx(ratio, abs=1 / 24)


def _image_folder(root, classes=3, per_class=4, size=8):
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / f"c{c}" / f"{i}.png")
    return root


@pytest.mark.slow
def test_the_command_upcycles_a_release_checkpoint(tmp_path, randomize, capsys):
    dense = randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8), seed=4).eval()
    torch.save({"ema": model_to_release_state_dict(dense)}, tmp_path / "dense.pt")
    argv = ["upcycle", "--checkpoint", tmp_path / "dense.pt", "--preset", "DiT-Tiny", "--output-dir", tmp_path / "up",
            "--activation", "0.9", "--calibration-data", _image_folder(tmp_path / "calib"), "--calibration-batches",
            "2", "--batch-size", "4"]
    assert moh_dit(*argv) == 0
    out = capsys.readouterr().out
    assert "MoH-DiT-Tiny-up90" in out and "importance measured on 8 calibration inputs" in out
    report = json.loads((tmp_path / "up" / REPORT_FILE).read_text())
    assert [len(layer["importance"]) for layer in report["layers"]] == [4] * 6
    assert MoHDiTTransformer2DModel.from_pretrained(tmp_path / "up").config.num_shared_heads == \
        PRESETS["MoH-DiT-Tiny-up90"]["num_shared_heads"]
    (tmp_path / "up" / "notes.txt").write_text("mine")
    assert moh_dit(*argv, "--overwrite") != 0 and (tmp_path / "up" / "notes.txt").read_text() == "mine"
    assert moh_dit(*argv[:5], "--output-dir", tmp_path / "calib" / "up", *argv[7:]) != 0  # never inside an input
    assert "Traceback" not in capsys.readouterr().err and not (tmp_path / "calib" / "up").exists()


@pytest.mark.parametrize("flags", [["--activation", "0"], ["--activation", "nan"], ["--activation", "1.5"],
                                   ["--activation", "0.75", "--calibration-batches", "0"],
                                   ["--activation", "0.75", "--seed", "-1"], ["--shared-heads", "2,x", "--top-k", "1"]])
def test_the_parser_refuses_bad_values(flags, tmp_path):
    with pytest.raises(SystemExit):
        moh_dit("upcycle", "--checkpoint", tmp_path, "--output-dir", tmp_path / "out", *flags)
    assert not (tmp_path / "out").exists()

