"""Head usage: what is measured is what the transformer reports, what is drawn is what was measured
(read back from the figure's artists), the training log, and the command's output rules."""

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import torch

from moh_dit.commands import build_parser, plot_head_usage as command
from moh_dit.head_usage import (JSON_FILE, PLOT_FILE, TIMESTEP, TRAINING_STEP, HeadUsage, head_usage_from_log,
                                measure_head_usage, plot_head_usage, write_head_usage)

pytestmark = pytest.mark.usefixtures("one_thread")
CLASSES, IMAGES, STEPS, BINS, RATIO = [0, 3], 2, 5, 3, 0.875


@pytest.fixture(scope="module")
def measured(one_thread, tiny_pipe):
    """A randomized MoH-DiT-Tiny, its measured usage, and every transformer call run again here:
    (timestep, class id, per-layer usage as float64 arrays)."""
    pipe = tiny_pipe(seed=3)
    inputs = []

    def record(module, args, kwargs, output):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        inputs.append((x.clone(), kwargs["timestep"].clone(), kwargs["class_labels"].clone()))

    handle = pipe.transformer.register_forward_hook(record, with_kwargs=True)
    usage = measure_head_usage(pipe, CLASSES, images_per_class=IMAGES, num_inference_steps=STEPS,
                               head_activation_ratio=RATIO, seed=7, timestep_bins=BINS, progress=False)
    handle.remove()
    calls = []
    pipe.transformer.set_head_activation_ratio(RATIO)
    with torch.no_grad():
        for x, t, y in inputs:
            out = pipe.transformer(x, timestep=t, class_labels=y, output_head_usage=True)
            calls.append((float(t[0]), int(y[0]), [u.double().numpy() for u in out.head_usage]))
    pipe.transformer.set_head_activation_ratio(None)  # the trained ratio
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
    edges, expected = [0, 1000 / 3, 2000 / 3, 1000], []  # a third of the training steps each, noisiest first
    for i in reversed(range(BINS)):
        inside = [u for t, _, u in calls if edges[i] <= t < edges[i + 1]]
        if inside:
            expected.append((math.ceil(edges[i]), math.ceil(edges[i + 1]) - 1, _mean(inside)))
    assert [(lo, hi) for lo, hi, _ in usage.per_timestep] == [(lo, hi) for lo, hi, _ in expected]
    for (_, _, got), (_, _, want) in zip(usage.per_timestep, expected):
        _close(got, want)
    assert usage.ranges_of == TIMESTEP and usage.shared_heads == [4, 2, 2, 1, 2, 0]
    # Each layer's loads add up to shared + top-K: every token uses exactly that many heads.
    for loads, s, k in zip(usage.overall, usage.shared_heads, usage.top_k):
        assert sum(loads) == pytest.approx(s + k, abs=1e-5)
    assert usage.settings["head_activation_ratio"] == pytest.approx(RATIO)
    # The per-class usage is what the pipeline reports for those images, and the ratio was put back.
    assert pipe.transformer.head_activation_ratio == 0.75  # measuring put the trained ratio back
    out = pipe([3] * IMAGES, guidance_scale=1.0, num_inference_steps=STEPS, head_activation_ratio=RATIO,
               seeds=[7, 8], output_type="latent")
    _close(usage.per_class["3"], [u.double().numpy() for u in out.head_usage])


def test_guided_usage_counts_the_unconditional_half(tiny_pipe):
    pipe = tiny_pipe(seed=1)
    guided = measure_head_usage(pipe, [2], images_per_class=2, num_inference_steps=3, guidance_scale=3.0,
                                progress=False)
    out = pipe([2, 2], guidance_scale=3.0, num_inference_steps=3, seeds=[0, 1], output_type="latent")
    _close(guided.per_class["2"], [u.double().numpy() for u in out.head_usage])
    plain = measure_head_usage(pipe, [2], images_per_class=2, num_inference_steps=3, progress=False)
    assert not np.allclose(np.concatenate(plain.overall), np.concatenate(guided.overall))
    with pytest.raises(ValueError, match="dense"):
        measure_head_usage(SimpleNamespace(transformer=SimpleNamespace(is_moh=False)), [1])


def _images(figure):
    return {image.get_gid(): image for ax in figure.axes for image in ax.images}


def _plotted(image):
    return np.ma.filled(np.ma.asarray(image.get_array(), dtype=np.float64), np.nan)


@pytest.mark.slow
def test_the_figure_draws_the_measured_values(measured, tmp_path):
    _, usage, calls = measured
    figure = plot_head_usage(usage, "tiny")
    images = _images(figure)
    assert set(images) == {"overall", "class:0", "class:3", *(f"range:{i}" for i in range(len(usage.per_timestep)))}
    np.testing.assert_allclose(_plotted(images["overall"]), np.stack(_mean([u for _, _, u in calls])), atol=1e-6)
    for c in CLASSES:
        np.testing.assert_allclose(_plotted(images[f"class:{c}"]),
                                   np.stack(_mean([u for _, y, u in calls if y == c])), atol=1e-6)
    for i, (_, _, loads) in enumerate(usage.per_timestep):
        np.testing.assert_allclose(_plotted(images[f"range:{i}"]), np.array(loads), atol=1e-6)
    assert all(image.get_clim() == (0.0, 1.0) for image in images.values())  # one colour scale
    # Shared heads: hatched over exactly the first `shared` heads of each layer, a line where routing starts.
    ax = images["overall"].axes
    hatched = sorted((round(p.get_y() + 0.5), p.get_width()) for p in ax.patches if p.get_hatch())
    assert hatched == [(layer, s) for layer, s in enumerate(usage.shared_heads) if s]
    lines = sorted((round(np.mean(line.get_ydata())), line.get_xdata()[0] + 0.5) for line in ax.lines)
    assert lines == [(layer, s) for layer, (s, h) in enumerate(zip(usage.shared_heads, map(len, usage.overall)))
                     if 0 < s < h]
    assert f"{usage.overall[3][1]:.2f}" in [t.get_text() for t in ax.texts]
    paths = write_head_usage(usage, tmp_path, "tiny")
    assert paths == {"png": tmp_path / PLOT_FILE, "json": tmp_path / JSON_FILE}
    written = HeadUsage.from_dict(json.loads(paths["json"].read_text()))
    assert written.to_dict() == json.loads(json.dumps(usage.to_dict()))
    assert PIL.Image.open(paths["png"]).format == "PNG" and sorted(os.listdir(tmp_path)) == [JSON_FILE, PLOT_FILE]


def test_uneven_layers_leave_empty_cells():
    usage = HeadUsage(overall=[[1.0, 0.25, 0.75], [0.5, 0.5]], per_class={"a": [[1.0, 0.5, 0.5], [0.0, 1.0]]},
                      per_timestep=[(500, 999, [[1.0, 0.0, 1.0], [1.0, 0.0]])], shared_heads=[1, 0], top_k=[1, 1])
    images = _images(plot_head_usage(usage, "uneven"))
    np.testing.assert_array_equal(_plotted(images["overall"]), [[1.0, 0.25, 0.75], [0.5, 0.5, np.nan]])
    np.testing.assert_array_equal(_plotted(images["class:a"]), [[1.0, 0.5, 0.5], [0.0, 1.0, np.nan]])


def _log_usage(step):
    """A two-layer log line: layer 0 has 1 shared + top-1 of 2, layer 1 top-2 of 3."""
    a = (step % 7) / 10
    return [[1.0, a, 1 - a], [0.5 + a / 2, 0.9 - a / 2, 0.6]]


def _write_log(path, steps, tail=""):
    path.write_text("".join(json.dumps({"step": s, "usage": _log_usage(s)}) + "\n" for s in steps) + tail)
    return path


def test_the_training_log_over_step_ranges(tmp_path):
    steps = list(range(10, 110, 10))
    log = _write_log(tmp_path / "head_usage.jsonl", steps, tail='{"step": 200, "us')  # a line being written
    # A resumed run logged step 30 again: its later line counts, the earlier one not.
    log.write_text(json.dumps({"step": 30, "usage": [[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]}) + "\n" + log.read_text())
    usage = head_usage_from_log(log, bins=3)
    assert usage.ranges_of == TRAINING_STEP and usage.per_class == {}
    assert usage.shared_heads == [1, 0] and usage.top_k == [1, 2]  # read from the loads: no run config here
    _close(usage.overall, _mean([[np.array(r) for r in _log_usage(s)] for s in steps]))
    assert [(lo, hi) for lo, hi, _ in usage.per_timestep] == [(10, 40), (50, 70), (80, 100)]
    _close(usage.per_timestep[1][2], _mean([[np.array(r) for r in _log_usage(s)] for s in (50, 60, 70)]))
    assert usage.settings["logged_steps"] == 10 and usage.settings["last_step"] == 100
    # The run's train_config.json gives the layout; the run folder works too.
    (tmp_path / "train_config.json").write_text(json.dumps({"model_config": {
        "num_layers": 2, "num_attention_heads": 3, "num_shared_heads": [0, 0], "top_k": [2, 2]}}))
    recorded = head_usage_from_log(tmp_path)
    assert recorded.shared_heads == [0, 0] and recorded.top_k == [2, 2]
    (tmp_path / "head_usage.jsonl").write_text('{"step": 1, "usage": [[1.0, 0.5]]}\n{broken\n')
    with pytest.raises(ValueError, match="line 2"):
        head_usage_from_log(tmp_path)


# ----- the command ----------------------------------------------------------------------------

def run(*argv):
    command.main(build_parser("plot-head-usage").parse_args([str(a) for a in argv]))


@pytest.mark.slow
def test_a_log_in_the_current_folder_plots_below_it_never_into_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_log(tmp_path / "head_usage.jsonl", [1, 2, 3, 4])
    run("--log", "head_usage.jsonl", "--output-dir", "figures")
    written = HeadUsage.from_dict(json.loads((tmp_path / "figures" / JSON_FILE).read_text()))
    assert written.overall == head_usage_from_log(tmp_path).overall
    with pytest.raises(ValueError, match="overlap"):  # the log's own folder would hold the output
        run("--log", "head_usage.jsonl", "--output-dir", ".", "--overwrite")
    run("--log", tmp_path / "head_usage.jsonl", "--output-dir", "figures", "--overwrite", "--step-bins", "1")
    assert len(json.loads((tmp_path / "figures" / JSON_FILE).read_text())["per_timestep"]) == 1


def test_overwrite_never_replaces_a_folder_another_command_wrote(tmp_path):
    from moh_dit.outputs import write_marker

    _write_log(tmp_path / "head_usage.jsonl", [1, 2])
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    (run_folder / "notes.txt").write_text("the user's")
    write_marker(run_folder, "train", finished=True)
    for overwrite in ([], ["--overwrite"]):
        with pytest.raises(FileExistsError):
            run("--log", tmp_path / "head_usage.jsonl", "--output-dir", run_folder, *overwrite)
    assert sorted(os.listdir(run_folder)) == [".moh-dit-output.json", "notes.txt"]


@pytest.mark.slow
def test_the_command_samples_a_model(tmp_path, tiny_pipe):
    tiny_pipe(seed=5).transformer.save_pretrained(tmp_path / "moh")
    argv = ["--model", tmp_path / "moh", "--output", tmp_path / "out", "--classes", "1", "4", "--images-per-class",
            "2", "--num-inference-steps", "3", "--timestep-bins", "2", "--seed", "11", "--device", "cpu"]
    run(*argv)
    from moh_dit.sampling import load_pipeline

    written = HeadUsage.from_dict(json.loads((tmp_path / "out" / JSON_FILE).read_text()))
    direct = measure_head_usage(load_pipeline(tmp_path / "moh"), [1, 4], images_per_class=2, num_inference_steps=3,
                                seed=11, timestep_bins=2, progress=False)
    assert written.settings == json.loads(json.dumps(direct.settings)) and written.per_class == direct.per_class
    with pytest.raises(ValueError, match="overlap"):
        run("--model", tmp_path / "moh", "--output", tmp_path / "moh" / "figures")
