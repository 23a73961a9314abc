"""Upcycling at any reachable ratio: the layout rule (moh_dit.models.layout.upcycle_layout) on the
dense shapes of DiT and odd ones, its reachable range and refusals, and the command on a DiT-S/2
checkpoint whose upcycled model samples differently at other head activations."""

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.hub.convert import model_to_release_state_dict
from moh_dit.hub.upcycle import REPORT_FILE, first_forward_gap, resolve_layout, upcycle
from moh_dit.models.layout import HeadLayout, upcycle_layout, upcycle_reachable_range
from moh_dit.models.presets import PRESETS

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = {"S": [6] * 12, "B": [12] * 12, "L": [16] * 24, "XL": [16] * 28, "5x3": [3] * 5, "Tiny": [4] * 6,
          "mixed": [2, 4, 1, 3, 5]}
RATIOS = (0.5, 0.6, 0.75, 0.9)


def _check_rule(heads, ratio):
    """The layout for ``ratio``: valid, at the nearest whole number of active heads (ties up),
    every routed layer with K >= 1 and a routed pool E >= K + 1; returns (shared, top_k, drops)."""
    shared, top_k = upcycle_layout(heads, ratio)
    layout = HeadLayout.parse(len(heads), heads, shared, top_k)  # raises on an invalid layout
    total = sum(heads)
    active = sum(s + k for s, k in zip(shared, top_k))
    exact = Fraction(str(ratio)) * total
    assert abs(active - exact) <= Fraction(1, 2)  # the nearest whole number of heads ...
    assert active - exact != -Fraction(1, 2)  # ... and of two equally near, the larger
    assert abs(layout.activation_ratio() - ratio) <= 1 / (2 * total) + 1e-12
    drops = []
    for h, s, k in zip(heads, shared, top_k):
        routed = h - s
        drops.append(routed - k)
        if k == 0:
            assert s == h  # a layer without routing keeps every head shared
        else:
            assert k >= 1 and routed >= k + 1  # the router has a choice
    return shared, top_k, drops


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_the_rule_realises_the_nearest_ratio_with_valid_layers(shape, ratio):
    heads = SHAPES[shape]
    shared, top_k, drops = _check_rule(heads, ratio)
    if len(set(heads)) == 1:  # the paper's shape: early layers keep every head, later ones drop more
        assert drops == sorted(drops)
        assert max(drops) - min(d for d in drops if d) <= 1  # the drop is spread evenly over routed layers
        half = heads[0] // 2
        if sum(drops) <= half * (len(heads) - len(heads) // 3):
            assert not any(drops[:len(heads) // 3])  # the first third stays dense while the rest can absorb it
            assert max(drops) <= half


def test_the_rule_in_numbers():
    """Worked examples of docs/upcycling.md: DiT-S/2 at 0.75, 0.6 and 0.9, the 5 x 3 model at 0.5
    (7.5 heads: ties go up), and DiT-XL/2 at 0.9 (45 heads dropped over layers 9-27)."""
    assert upcycle_layout([6] * 12, 0.75) == ([6] * 4 + [3] * 6 + [1] * 2, [0] * 4 + [1] * 6 + [2] * 2)
    assert upcycle_layout([6] * 12, 0.6) == ([6, 6, 3] + [1] * 9, [0, 0, 1] + [2] * 9)
    assert upcycle_layout([6] * 12, 0.9) == ([6] * 5 + [4] * 7, [0] * 5 + [1] * 7)
    assert upcycle_layout([3] * 5, 0.5) == ([1, 1, 1, 0, 0], [1] * 5)  # 8 of 15 active, not 7
    assert upcycle_layout([3] * 5, 0.9) == ([3, 3, 3, 3, 1], [0, 0, 0, 0, 1])  # 13.5 -> 14
    shared, top_k = upcycle_layout([16] * 28, 0.9)
    assert sum(s + k for s, k in zip(shared, top_k)) == 403  # 403.2 -> 403 of 448
    assert shared == [16] * 9 + [13] * 12 + [11] * 7 and top_k == [0] * 9 + [1] * 12 + [2] * 7


# The table of docs/upcycling.md: active heads at R = 0.5, 0.6, 0.75, 0.9.
DOC_TABLE = {"S": (36, 43, 54, 65), "B": (72, 86, 108, 130), "L": (192, 230, 288, 346), "XL": (224, 269, 336, 403),
             "5x3": (8, 9, 11, 14)}


@pytest.mark.parametrize("shape", DOC_TABLE)
def test_the_documented_table(shape):
    heads = SHAPES[shape]
    assert tuple(sum(s + k for s, k in zip(*upcycle_layout(heads, r))) for r in RATIOS) == DOC_TABLE[shape]


@pytest.mark.parametrize("heads", [[3] * 5, [4] * 6, [2, 4, 1, 3, 5]])
def test_every_reachable_head_count_is_realised(heads):
    total = sum(heads)
    low, high = upcycle_reachable_range(heads)
    assert (low, high) == (len(heads) / total, 1.0)
    for active in range(len(heads), total + 1):
        shared, top_k, _ = _check_rule(heads, active / total)
        assert sum(s + k for s, k in zip(shared, top_k)) == active
    shared, top_k = upcycle_layout(heads, 1.0)
    assert shared == heads and top_k == [0] * len(heads)  # 1.0: every head shared
    if 1 in heads:
        assert top_k[heads.index(1)] == 0  # a one-head layer cannot route


@pytest.mark.parametrize("ratio", [0.19, 0.0, -0.5, 1.01, float("nan"), float("inf")])
def test_unreachable_ratios_are_refused_naming_the_range(ratio):
    with pytest.raises(ValueError, match=r"outside the reachable range \[0\.2000, 1\.0\] .*5 layers, 25 heads"):
        upcycle_layout([5] * 5, ratio)


def test_presets_keep_their_layouts_and_other_ratios_take_the_rule():
    """An upcycled preset that fits the model at the asked ratio is used exactly; any other ratio
    (or a model no preset fits, DiT-XL/4) takes the rule."""
    with torch.device("meta"):
        xl2 = MoHDiTTransformer2DModel.from_preset("DiT-XL/2")
        xl4 = MoHDiTTransformer2DModel.from_preset("DiT-XL/4")
        tiny = MoHDiTTransformer2DModel.from_preset("DiT-Tiny")
    for model, ratio, name in ((xl2, 0.75, "MoH-DiT-XL/2-up75"), (xl2, 0.9, "MoH-DiT-XL/2-up90"),
                               (tiny, 0.75, "MoH-DiT-Tiny-up75"), (tiny, 0.9, "MoH-DiT-Tiny-up90")):
        assert resolve_layout(model, ratio) == (name, PRESETS[name]["num_shared_heads"], PRESETS[name]["top_k"])
    for model, ratio in ((xl2, 0.6), (xl4, 0.75), (tiny, 0.76), (tiny, 0.5)):
        assert resolve_layout(model, ratio) == (None, *upcycle_layout(model.layer_heads, ratio))


def test_ratio_one_is_the_dense_function_with_every_head_shared(randomize):
    dense = randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8), seed=2).eval()
    moh, report = upcycle(dense, 1.0, progress=False)
    assert report.preset is None and moh.layer_shared == [4] * 6 and moh.trained_top_k == [0] * 6
    assert moh.head_activation_range == (1.0, 1.0)
    gen = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(2, 3, 8, 8, generator=gen), torch.tensor([999, 10]), torch.tensor([1, 10])
    with torch.no_grad():
        assert (moh(x, t, y).sample - dense(x, t, y).sample).abs().max() <= 1e-5


def test_an_odd_model_upcycles_with_measured_importance(randomize):
    """5 layers of 3 heads at 0.5 (layers with no shared head): importance is measured and the
    first forward is still the dense model with each token's unselected heads removed."""
    dense = randomize(MoHDiTTransformer2DModel.from_preset(
        "DiT-Tiny", num_layers=5, num_attention_heads=3, hidden_size=96, attention_head_dim=32, sample_size=8),
        seed=1).eval()
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 3, 8, 8, generator=gen), torch.tensor([0, 3, 5, 9]))]
    moh, report = upcycle(dense, 0.5, calibration=batches, progress=False)
    assert moh.layer_shared == [1, 1, 1, 0, 0] and moh.trained_top_k == [1] * 5
    assert report.requested_activation == 0.5 and report.activation == pytest.approx(8 / 15)
    assert "requested 0.5, realised 8/15 = 0.5333" in report.table()
    for c in report.layers:  # the shared head is the most important one of its layer
        assert all(c.importance[s] >= c.importance[r] for s in c.shared for r in c.routed)
    x, t, y = torch.randn(2, 3, 8, 8, generator=gen), torch.tensor([900, 20]), torch.tensor([2, 10])
    gap, gates = first_forward_gap(dense, moh, report.layers, x, t, y)
    assert gap <= 1e-5
    assert all(torch.all((g != 0).sum(-1) == len(c.shared) + c.top_k) for c, g in zip(report.layers, gates))


@pytest.fixture(scope="module")
def dit_s2(tmp_path_factory, randomize):
    """A randomized dense DiT-S/2 at 8 x 8 latents, saved as a release-format state dict and as a
    save_pretrained folder."""
    root = tmp_path_factory.mktemp("dit-s2")
    dense = randomize(MoHDiTTransformer2DModel.from_preset("DiT-S/2", sample_size=8), std=0.05, seed=7).eval()
    torch.save(model_to_release_state_dict(dense), root / "dit-s2.pt")
    dense.save_pretrained(root / "folder")
    return root


@pytest.mark.slow
def test_command_upcycles_dit_s2_at_075_and_the_knob_changes_samples(dit_s2, tmp_path, load_script, capsys,
                                                                        tiny_vae):
    from moh_dit import MoHDiTPipeline
    from moh_dit.pipelines.pipeline_moh_dit import make_scheduler

    out = tmp_path / "up"
    code = load_script("upcycle").cli(["--checkpoint", str(dit_s2 / "dit-s2.pt"), "--preset", "DiT-S/2",
                                       "--output-dir", str(out), "--activation", "0.75"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "the upcycling rule's layout (head activation requested 0.75, realised 54/72 = 0.7500)" in printed
    assert printed.count("layer ") == 12
    config = json.loads((out / "config.json").read_text())  # the layout travels with the model
    shared, top_k = upcycle_layout([6] * 12, 0.75)
    assert (config["num_attention_heads"], config["num_shared_heads"], config["top_k"]) == ([6] * 12, shared, top_k)
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["preset"] is None and report["requested_activation"] == 0.75 and report["activation"] == 0.75
    assert report["first_forward_max_abs_diff"] <= 1e-5
    model = MoHDiTTransformer2DModel.from_pretrained(out).eval()
    assert model.trained_head_activation_ratio == 0.75 and model.head_activation_range[0] == pytest.approx(44 / 72)
    pipe = MoHDiTPipeline(transformer=model, scheduler=make_scheduler("ddpm"), vae=tiny_vae(std=0.1))
    pipe.set_progress_bar_config(disable=True)
    images = {ratio: pipe([1, 500], num_inference_steps=2, seeds=[0, 1], output_type="np",
                          head_activation_ratio=ratio).images for ratio in (0.65, None, 1.0)}
    assert all(np.isfinite(v).all() and v.shape == (2, 16, 16, 3) for v in images.values())
    for a, b in ((0.65, None), (None, 1.0), (0.65, 1.0)):
        assert np.abs(images[a] - images[b]).max() > 1e-4, (a, b)


def test_a_saved_folder_upcycles_at_another_ratio(dit_s2, tmp_path):
    moh, report = upcycle(dit_s2 / "folder", 0.6, progress=False)
    assert report.preset is None and moh.layer_heads == [6] * 12
    assert report.activation == pytest.approx(43 / 72) and abs(report.activation - 0.6) <= 1 / 144


@pytest.mark.parametrize("argv, match", [
    (["--checkpoint", "{t}/dit-s2.pt", "--preset", "DiT-S/2", "--activation", "0.16"],
     r"--activation 0\.16 .*\[0\.1667, 1\.0\] .*\(12 layers, 72"),
    (["--checkpoint", "{t}/folder", "--activation", "0.1"], r"\[0\.1667, 1\.0\]"),
    (["--checkpoint", "{t}/folder", "--activation", "1.2"], r"--activation .*got 1\.2"),
    (["--checkpoint", "{t}/folder", "--activation", "0.6", "--shared-heads", "3", "--top-k", "1"],
     "--activation.*--shared-heads.*--top-k"),
])
def test_command_refuses_an_unreachable_ratio(argv, match, dit_s2, tmp_path, refuses):
    err = refuses("upcycle", [a.format(t=dit_s2) for a in argv] + ["--output-dir", str(tmp_path / "out")], match)
    assert len(err.strip().splitlines()) == 1
