"""The head-usage figures: what is measured equals what the transformer reports, what is drawn
equals what was measured (read back from the figure's artists), the training log, the command
and the model card section."""

import io
import json
import math

import numpy as np
import PIL.Image
import pytest
import torch

from moh_dit.evaluation.head_usage import (JSON_FILE, PLOT_FILE, TIMESTEP, TRAINING_STEP, HeadUsage, figure_png,
                                           head_usage_figure_for_tracker, head_usage_from_log, measure_head_usage,
                                           plot_head_usage, write_head_usage)
from moh_dit.models.head_activation import head_activation

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES, IMAGES, STEPS, BINS, RATIO = [0, 3], 2, 5, 3, 0.875


def _record_inputs(transformer, calls):
    """A forward hook of the test's own: every call's inputs (latents, timesteps, labels), to run them again."""

    def hook(module, args, kwargs, output):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        calls.append((x.clone(), kwargs["timestep"].clone(), kwargs["class_labels"].clone()))

    return transformer.register_forward_hook(hook, with_kwargs=True)


@pytest.fixture(scope="module")
def measured(one_thread, tiny_pipe):
    """A randomized MoH-DiT-Tiny, its measured usage, and the usage of every transformer call
    computed again here: (timestep, class id, per-layer usage as float64 arrays)."""
    pipe = tiny_pipe(seed=3)
    inputs = []
    handle = _record_inputs(pipe.transformer, inputs)
    try:
        usage = measure_head_usage(pipe, CLASSES, images_per_class=IMAGES, num_inference_steps=STEPS,
                                   head_activation_ratio=RATIO, seed=7, timestep_bins=BINS, progress=False)
    finally:
        handle.remove()
    calls = []
    with torch.no_grad(), head_activation(pipe.transformer, RATIO):
        pipe.transformer.eval()
        for x, t, y in inputs:
            out = pipe.transformer(x, timestep=t, class_labels=y, output_head_usage=True)
            calls.append((float(t[0]), int(y[0]), [u.double().numpy() for u in out.head_usage]))
    return pipe, usage, calls


def _mean(usages):
    return [np.mean([u[layer] for u in usages], axis=0) for layer in range(len(usages[0]))]


def _close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a, dtype=np.float64), e, atol=1e-6)


def test_measured_usage_is_the_transformers_own(measured):
    pipe, usage, calls = measured
    assert len(calls) == len(CLASSES) * STEPS
    _close(usage.overall, _mean([u for _, _, u in calls]))
    assert list(usage.per_class) == [str(c) for c in CLASSES]  # no class names: the ids
    for c in CLASSES:
        _close(usage.per_class[str(c)], _mean([u for _, y, u in calls if y == c]))
    # Timestep ranges: a third of the 1000 training steps each, noisiest first.
    edges = [0, 1000 / 3, 2000 / 3, 1000]
    expected = []
    for i in reversed(range(BINS)):
        inside = [u for t, _, u in calls if edges[i] <= t < edges[i + 1]]
        if inside:
            expected.append((math.ceil(edges[i]), math.ceil(edges[i + 1]) - 1, _mean(inside)))
    assert [(lo, hi) for lo, hi, _ in usage.per_timestep] == [(lo, hi) for lo, hi, _ in expected]
    for (_, _, got), (_, _, want) in zip(usage.per_timestep, expected):
        _close(got, want)
    assert usage.ranges_of == TIMESTEP and usage.shared_heads == [4, 2, 2, 1, 2, 0]
    assert usage.top_k == pipe.transformer.layout.top_k_for_ratio(RATIO) != list(pipe.transformer.trained_top_k)
    # Each layer's loads add up to shared + top-K: every token uses exactly that many heads.
    for loads, s, k in zip(usage.overall, usage.shared_heads, usage.top_k):
        assert sum(loads) == pytest.approx(s + k, abs=1e-5)
    assert usage.settings["head_activation_ratio"] == pytest.approx(RATIO)


def test_per_class_usage_is_what_the_pipeline_reports(measured):
    pipe, usage, _ = measured
    out = pipe([3] * IMAGES, guidance_scale=1.0, num_inference_steps=STEPS, head_activation_ratio=RATIO,
               seeds=[7, 8], output_type="latent")
    _close(usage.per_class["3"], [u.double().numpy() for u in out.head_usage])
    assert pipe.transformer.top_k_per_layer == list(pipe.transformer.trained_top_k)  # the ratio was put back


def test_guided_usage_counts_the_unconditional_half(tiny_pipe):
    pipe = tiny_pipe(seed=1)
    guided = measure_head_usage(pipe, [2], images_per_class=2, num_inference_steps=3, guidance_scale=3.0,
                                progress=False)
    out = pipe([2, 2], guidance_scale=3.0, num_inference_steps=3, seeds=[0, 1], output_type="latent")
    _close(guided.per_class["2"], [u.double().numpy() for u in out.head_usage])
    plain = measure_head_usage(pipe, [2], images_per_class=2, num_inference_steps=3, progress=False)
    assert not np.allclose(np.concatenate(plain.overall), np.concatenate(guided.overall))


def _images(figure):
    return {image.get_gid(): image for ax in figure.axes for image in ax.images}


def _expected_matrix(loads, width):
    out = np.full((len(loads), width), np.nan)
    for layer, row in enumerate(loads):
        out[layer, :len(row)] = row
    return out


def _plotted(image):
    return np.ma.filled(np.ma.asarray(image.get_array(), dtype=np.float64), np.nan)


def test_the_figure_draws_the_measured_values(measured):
    _, usage, calls = measured
    figure = plot_head_usage(usage, "tiny")
    images = _images(figure)
    assert set(images) == {"overall", "class:0", "class:3", *(f"range:{i}" for i in range(len(usage.per_timestep)))}
    np.testing.assert_allclose(_plotted(images["overall"]), np.stack(_mean([u for _, _, u in calls])), atol=1e-6)
    for c in CLASSES:
        np.testing.assert_allclose(_plotted(images[f"class:{c}"]), np.stack(_mean([u for _, y, u in calls if y == c])),
                                   atol=1e-6)
    for i, (_, _, loads) in enumerate(usage.per_timestep):
        np.testing.assert_allclose(_plotted(images[f"range:{i}"]), np.array(loads), atol=1e-6)
    for image in images.values():
        assert image.get_clim() == (0.0, 1.0)  # one colour scale for every panel
    # Shared heads: hatched over exactly the first `shared` heads of each layer, a line where routing starts.
    ax = images["overall"].axes
    hatched = sorted((round(p.get_y() + 0.5), p.get_width()) for p in ax.patches if p.get_hatch())
    assert hatched == [(layer, s) for layer, s in enumerate(usage.shared_heads) if s]
    lines = sorted((round(np.mean(line.get_ydata())), line.get_xdata()[0] + 0.5) for line in ax.lines)
    assert lines == [(layer, s) for layer, (s, h) in enumerate(zip(usage.shared_heads, usage.heads)) if 0 < s < h]
    texts = [t.get_text() for t in ax.texts]
    assert f"{usage.overall[3][1]:.2f}" in texts and len(texts) == sum(usage.heads)
    png = PIL.Image.open(io.BytesIO(figure_png(figure)))
    assert png.size == tuple(round(v) for v in figure.get_size_inches() * figure.dpi) and png.mode == "RGB"


def test_uneven_layers_leave_empty_cells(tmp_path):
    usage = HeadUsage(overall=[[1.0, 0.25, 0.75], [0.5, 0.5]], per_class={"a": [[1.0, 0.5, 0.5], [0.0, 1.0]]},
                      per_timestep=[(500, 999, [[1.0, 0.0, 1.0], [1.0, 0.0]])], shared_heads=[1, 0], top_k=[1, 1])
    images = _images(plot_head_usage(usage, "uneven"))
    np.testing.assert_array_equal(_plotted(images["overall"]), [[1.0, 0.25, 0.75], [0.5, 0.5, np.nan]])
    np.testing.assert_array_equal(_plotted(images["class:a"]), [[1.0, 0.5, 0.5], [0.0, 1.0, np.nan]])
    paths = write_head_usage(usage, tmp_path, "uneven")
    assert paths == {"png": tmp_path / PLOT_FILE, "json": tmp_path / JSON_FILE}
    assert HeadUsage.from_dict(json.loads(paths["json"].read_text())) == usage
    assert PIL.Image.open(paths["png"]).format == "PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([PLOT_FILE, JSON_FILE])  # no temporary files left


@pytest.mark.parametrize("change, match", [
    (dict(overall=[[1.0, 1.5]]), "outside"),
    (dict(per_class={"a": [[1.0, 0.5, 0.5]]}), "heads per layer"),
    (dict(shared_heads=[3]), "do not fit"),
    (dict(top_k=[1, 1]), "one int per layer"),
    (dict(per_timestep=[(0, 9, [[1.0]])]), "heads per layer"),
    (dict(ranges_of="epoch"), "ranges_of"),
])
def test_inconsistent_usage_is_refused(change, match):
    base = dict(overall=[[1.0, 0.5]], per_class={}, per_timestep=[], shared_heads=[1], top_k=[1])
    with pytest.raises(ValueError, match=match):
        HeadUsage(**{**base, **change})
    with pytest.raises(ValueError, match="lacks top_k"):
        HeadUsage.from_dict({"overall": [[1.0]], "shared_heads": [1]})


# --------------------------------------------------------------------------------------
# The training log
# --------------------------------------------------------------------------------------


def _log_usage(step):
    """A two-layer log line: layer 0 has 1 shared + top-1 of 2, layer 1 top-2 of 3."""
    a = (step % 7) / 10
    return [[1.0, a, 1 - a], [0.5 + a / 2, 0.9 - a / 2, 0.6]]


def _write_log(path, steps, tail=""):
    path.write_text("".join(json.dumps({"step": s, "usage": _log_usage(s)}) + "\n" for s in steps) + tail)
    return path


def test_the_training_log_over_step_ranges(tmp_path):
    steps = list(range(10, 110, 10))
    log = _write_log(tmp_path / "head_usage.jsonl", steps, tail='{"step": 200, "us')
    # A resumed run logged step 30 again: its later line counts, the earlier one not.
    log.write_text(json.dumps({"step": 30, "usage": [[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]}) + "\n" + log.read_text())
    usage = head_usage_from_log(log, bins=3)
    assert usage.ranges_of == TRAINING_STEP and usage.per_class == {}
    assert usage.shared_heads == [1, 0] and usage.top_k == [1, 2]  # read from the loads: no run record here
    _close(usage.overall, _mean([[np.array(r) for r in _log_usage(s)] for s in steps]))
    assert [(lo, hi) for lo, hi, _ in usage.per_timestep] == [(10, 40), (50, 70), (80, 100)]
    _close(usage.per_timestep[1][2], _mean([[np.array(r) for r in _log_usage(s)] for s in (50, 60, 70)]))
    assert usage.settings["logged_steps"] == 10 and usage.settings["last_step"] == 100
    images = _images(plot_head_usage(usage, "run"))
    assert set(images) == {"overall", "range:0", "range:1", "range:2"}
    np.testing.assert_allclose(_plotted(images["range:2"]),
                               np.stack(_mean([[np.array(r) for r in _log_usage(s)] for s in (80, 90, 100)])), atol=1e-9)
    # The run record's layout wins over what the loads suggest; the run folder works too.
    (tmp_path / "train_config.json").write_text(json.dumps({"model_config": {
        "num_layers": 2, "num_attention_heads": 3, "num_shared_heads": [0, 0], "top_k": [2, 2]}}))
    recorded = head_usage_from_log(tmp_path)
    assert recorded.shared_heads == [0, 0] and recorded.top_k == [2, 2]


def test_a_damaged_log_is_named(tmp_path):
    log = _write_log(tmp_path / "head_usage.jsonl", [1, 2], tail="{broken\n")
    with pytest.raises(ValueError, match=r"head_usage.jsonl, line 3: not JSON"):
        head_usage_from_log(log)
    (tmp_path / "head_usage.jsonl").write_text(json.dumps({"step": 1, "usage": [[1.0, 0.5]]}) + "\n"
                                               + json.dumps({"step": 2, "usage": [[1.0, 0.5, 0.5]]}) + "\n")
    with pytest.raises(ValueError, match="line 2 has"):
        head_usage_from_log(log)


def test_the_tracker_figure(tmp_path):
    assert head_usage_figure_for_tracker(tmp_path) is None  # nothing logged yet
    (tmp_path / "head_usage.jsonl").write_text("")
    assert head_usage_figure_for_tracker(tmp_path) is None
    _write_log(tmp_path / "head_usage.jsonl", [5, 10])
    image = head_usage_figure_for_tracker(tmp_path / "head_usage.jsonl", title="run")
    figure = plot_head_usage(head_usage_from_log(tmp_path), "run")
    width, height = (round(v) for v in figure.get_size_inches() * figure.dpi)
    assert image.shape == (1, 3, height, width) and image.dtype == torch.float32
    assert 0 <= image.min() < image.max() <= 1


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, one_thread, tiny_pipe):
    folder = tmp_path_factory.mktemp("models")
    tiny_pipe(seed=5).transformer.save_pretrained(folder / "moh")
    from moh_dit import MoHDiTTransformer2DModel

    MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8).save_pretrained(folder / "dense")
    return folder


@pytest.mark.slow
def test_the_command_writes_the_figure_and_its_numbers(model_folder, tmp_path, load_script):
    from moh_dit.sampling.sample import load_pipeline
    from moh_dit.utils.output_folders import is_package_output

    out = tmp_path / "figures"
    argv = ["--model", model_folder / "moh", "--output", out, "--classes", "1", "4", "--images-per-class", "2",
            "--num-inference-steps", "3", "--timestep-bins", "2", "--seed", "11", "-q"]
    assert load_script("plot_head_usage").cli([str(a) for a in argv]) == 0
    written = HeadUsage.from_dict(json.loads((out / JSON_FILE).read_text()))
    direct = measure_head_usage(load_pipeline(model_folder / "moh"), [1, 4], images_per_class=2, num_inference_steps=3,
                                seed=11, timestep_bins=2, progress=False)
    assert written.per_class.keys() == direct.per_class.keys() and written.settings == direct.settings
    for key in direct.per_class:
        _close(written.per_class[key], [np.array(r) for r in direct.per_class[key]])
    assert PIL.Image.open(out / PLOT_FILE).format == "PNG" and is_package_output(out)
    # Again with --overwrite (its own folder), then from a training log.
    assert load_script("plot_head_usage").cli([str(a) for a in argv + ["--overwrite", "--timestep-bins", "1"]]) == 0
    assert len(json.loads((out / JSON_FILE).read_text())["per_timestep"]) == 1
    run = tmp_path / "run"
    run.mkdir()
    _write_log(run / "head_usage.jsonl", [1, 2, 3, 4])
    assert load_script("plot_head_usage").cli(["--log", str(run), "--output", str(tmp_path / "log"), "-q"]) == 0
    assert HeadUsage.from_dict(json.loads((tmp_path / "log" / JSON_FILE).read_text())) == head_usage_from_log(run)


def _bad_inputs(tmp_path, model_folder):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    (tmp_path / "broken").mkdir(exist_ok=True)  # the log's folder, which the output stays out of
    _write_log(tmp_path / "broken" / "head_usage.jsonl", [1], tail="{broken\n")
    moh, out = str(model_folder / "moh"), str(tmp_path / "out")
    return [
        (["--log", tmp_path / "broken" / "head_usage.jsonl", "--output", out, "--seed", "3"],
         "--seed applies to --model only"),
        (["--model", moh, "--output", out, "--images-per-class", "0"], "--images-per-class must be >= 1"),
        (["--model", moh, "--output", out, "--guidance-scale", "0.5"], "--guidance-scale must be"),
        (["--model", moh, "--output", out, "--seed", "-1"], "--seed must be in"),
        (["--model", tmp_path / "nothing", "--output", out], "does not exist"),
        (["--log", tmp_path / "nothing.jsonl", "--output", out], "--log .* does not exist"),
        (["--log", tmp_path / "broken" / "head_usage.jsonl", "--output", out], "line 2: not JSON"),
        (["--log", tmp_path / "broken" / "head_usage.jsonl", "--output", tmp_path / "broken" / "figures"],
         "lies inside --log"),
        (["--model", moh, "--output", tmp_path / "mine"], "already exists"),
        (["--model", moh, "--output", tmp_path / "mine", "--overwrite"], "not a folder moh-dit plot-head-usage wrote"),
        (["--model", moh, "--output", model_folder / "moh" / "figures"], "never writes into what it reads"),
        (["--model", moh, "--output", out, "--classes", "0", "zebra"], "--classes: .*zebra"),
        (["--model", moh, "--output", out, "--classes", "1", "1"], "names a class twice"),
        (["--model", moh, "--output", out, "--head-activation-ratio", "0.1"], "--head-activation-ratio: .*reachable"),
        (["--model", moh, "--output", out, "--num-inference-steps", "5000"], "exceeds the 1000 diffusion steps"),
        (["--model", model_folder / "dense", "--output", out], "dense DiT"),
    ]


def test_bad_input_is_refused_before_any_work(model_folder, tmp_path, refuses):
    for argv, match in _bad_inputs(tmp_path, model_folder):
        refuses("plot_head_usage", argv, match)
    assert not (model_folder / "moh" / "figures").exists()


# --------------------------------------------------------------------------------------
# The model card
# --------------------------------------------------------------------------------------


def test_the_model_card_shows_the_figure_and_the_balance(tiny_pipe):
    from moh_dit.hub.model_card import model_card

    pipe = tiny_pipe()
    usage = HeadUsage(overall=[[1.0] * 4, [1.0, 1.0, 0.2, 0.8], [1.0, 0.5, 0.25, 0.25]] + [[1.0, 0.5, 0.5, 0.5]] * 2
                      + [[0.5] * 4], per_class={}, per_timestep=[], shared_heads=[4, 2, 2, 1, 2, 0],
                      top_k=[0, 1, 1, 2, 1, 2])
    plain = model_card(pipe, title="t", repo="r")
    assert "## Head usage" not in plain and PLOT_FILE not in plain
    card = model_card(pipe, title="t", repo="r", files=["README.md", PLOT_FILE], head_usage=usage.to_dict())
    assert f"![Head usage per layer and head: overall, per class and per timestep range]({PLOT_FILE})" in card
    cv = np.std([0.2, 0.8], ddof=1) / 0.5
    assert f"| 1 | 2 | 2 | 1 | 0.500 | 0.200-0.800 | {cv:.3f} |" in card
    assert "| 0 | 4 | 0 | 0 | - | - | - |" in card and "| 5 | 0 | 4 | 2 | 0.500 | 0.500-0.500 | 0.000 |" in card
    only_figure = model_card(pipe, title="t", repo="r", files=[PLOT_FILE])
    assert f"({PLOT_FILE})" in only_figure and "| layer | shared | routed |" not in only_figure
    assert card.index("## Head usage") < card.index("## Use it")
