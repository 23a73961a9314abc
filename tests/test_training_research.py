"""Research workflows of ``moh-dit train``: label dropout drawn by the trainer (so that a
compiled forward draws nothing and follows eager training; the compiled runs themselves are
in test_compile.py), and continuing a saved model of a layout no preset names
(``--init-from DIR`` without ``--preset``, then ``--resume latest``)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.models.embeddings import LabelEmbedding
from PIL import Image
from safetensors.torch import load_file

import moh_dit.training.trainer as trainer
from moh_dit import MoHDiTTransformer2DModel
from moh_dit.errors import InvalidInput
from moh_dit.models.presets import PRESETS
from moh_dit.training import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")


def make_image_folder(root: Path, classes=("blue", "red", "green"), per_class=4, size=16) -> Path:
    rng = np.random.default_rng(0)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            arr = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
            arr[..., c] += 180
            Image.fromarray(arr).save(root / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data") / "images")


def config(out: Path, data: Path, **kw) -> TrainConfig:
    base = dict(preset="MoH-DiT-Tiny", output_dir=str(out), data_dir=str(data), vae="none", image_size=16,
                max_steps=2, global_batch_size=4, checkpoint_every=2, num_workers=0, report_to="none", log_every=1,
                ema_decay=0.9)
    base.update(kw)
    return TrainConfig(**base)


def refused(root: Path, call, *parameters, mentions=()):
    """``call()`` raises InvalidInput naming ``parameters`` (its ``parameters``) and ``mentions``
    (in its message), with nothing under ``root`` written or changed."""
    before = {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}
    with pytest.raises(InvalidInput) as raised:
        call()
    assert set(parameters) <= set(raised.value.parameters), (raised.value.parameters, str(raised.value))
    assert all(str(fact) in str(raised.value) for fact in mentions), str(raised.value)
    assert {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))} == before


def cli_args(out, data, *extra):
    return ["--data-dir", str(data), "--vae", "none", "--image-size", "16", "--output-dir", str(out),
            "--max-steps", "2", "--global-batch-size", "4", "--checkpoint-every", "2", "--num-workers", "0",
            "--report-to", "none", "--log-every", "1", "--ema-decay", "0.9", *map(str, extra)]


# ------------------------------------------------------------------ label dropout outside the model
def test_the_trainer_draws_label_dropout_and_the_model_draws_nothing(tmp_path, data, monkeypatch):
    """Every training forward gets the trainer's drop mask, and the label embedder's own draw
    (diffusers' token_drop, which a compiled forward would take from the compiler's generator)
    never runs; the run drops labels (class dropout 0.5 over 4 steps of 4)."""

    def no_draw(self, labels, force_drop_ids=None):
        raise AssertionError("the model drew label dropout itself")

    monkeypatch.setattr(LabelEmbedding, "token_drop", no_draw)
    masks, given = [], []
    real_mask, real_forward = trainer.label_drop_mask, MoHDiTTransformer2DModel.forward
    monkeypatch.setattr(trainer, "label_drop_mask", lambda y, p: masks.append(real_mask(y, p)) or masks[-1])

    def forward(self, *args, **kwargs):
        given.append(kwargs.get("force_drop_ids"))
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(MoHDiTTransformer2DModel, "forward", forward)
    train(config(tmp_path / "run", data, max_steps=4, class_dropout=0.5, checkpoint_every=4))
    # the EMA's sample grids are off here: every forward is a training forward
    assert len(masks) == len(given) == 4 and all(g is m for g, m in zip(given, masks))
    assert all(m.dtype == torch.bool and m.shape == (4,) for m in masks)
    assert 0 < int(sum(m.sum() for m in masks)) < 16


def test_the_trainers_draw_is_the_one_the_model_made(monkeypatch):
    """From the same state of torch's generator the trainer's mask is the one diffusers' label
    embedder would have drawn (so eager runs keep their losses), and without dropout it draws
    nothing at all."""
    labels = torch.arange(7) % 3
    embedder = LabelEmbedding(3, 8, 0.3).train()
    for seed in range(5):
        torch.manual_seed(seed)
        theirs = embedder.token_drop(labels) == 3
        torch.manual_seed(seed)
        ours = trainer.label_drop_mask(labels, 0.3)
        assert torch.equal(ours, theirs)
    state = torch.get_rng_state()
    assert not trainer.label_drop_mask(labels, 0.0).any()
    assert torch.equal(torch.get_rng_state(), state)


def test_the_models_drop_argument_replaces_its_own_draw(randomize):
    """With ``force_drop_ids`` a training forward is deterministic and equals the forward with the
    null class where the mask is set; without it, the model still drops labels itself in
    training (diffusers' behaviour), and never in eval."""
    model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, class_dropout_prob=1.0))
    x, t, y = torch.randn(4, 3, 8, 8), torch.tensor([3, 500, 10, 999]), torch.tensor([0, 1, 2, 3])
    mask = torch.tensor([True, False, True, False])
    null = torch.where(mask, model.config.num_classes, y)
    with torch.no_grad():
        reference = model.eval()(x, t, null).sample
        eval_masked = model(x, t, y, force_drop_ids=mask).sample
        model.train()
        first = model(x, t, y, force_drop_ids=mask).sample
        torch.manual_seed(123)
        second = model(x, t, y, force_drop_ids=mask.long()).sample  # 0/1 ids as diffusers' callers give
        dropped_by_itself = model(x, t, y).sample  # class_dropout_prob 1.0: every label dropped
        all_null = model.eval()(x, t, torch.full_like(y, model.config.num_classes)).sample
        kept = model(x, t, y).sample
        conditioned = model(x, t, y, force_drop_ids=torch.zeros(4, dtype=torch.bool)).sample
    assert torch.equal(first, second) and torch.allclose(first, reference, atol=1e-6)
    assert torch.allclose(eval_masked, reference, atol=1e-6)
    assert not torch.allclose(first, kept, atol=1e-3)  # the mask did drop labels
    assert torch.allclose(dropped_by_itself, all_null, atol=1e-6) and torch.allclose(conditioned, kept, atol=1e-6)
    with pytest.raises(ValueError, match="force_drop_ids must have the shape of class_labels"):
        model(x, t, y, force_drop_ids=mask[:2])


# ------------------------------------------------------------------ --init-from without a preset
LAYOUT = dict(num_shared_heads=[3, 3, 2, 1, 1, 0], top_k=[1, 1, 1, 1, 1, 2])  # no preset's


@pytest.fixture(scope="module")
def custom(tmp_path_factory, randomize):
    """A randomized dense DiT-Tiny for the 16 px, 3-class data, upcycled to a layout of its own."""
    from moh_dit.hub.upcycle import save_upcycled, upcycle

    dense = randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=16, num_classes=3,
                                                            class_names=["blue", "green", "red"]), seed=3)
    moh, report = upcycle(dense, shared_heads=LAYOUT["num_shared_heads"], top_k=LAYOUT["top_k"], progress=False)
    return save_upcycled(moh, report, tmp_path_factory.mktemp("custom") / "model")


@pytest.mark.slow
def test_a_layout_of_its_own_trains_from_init_from_without_a_preset_and_resumes(tmp_path, data, custom, load_script):
    saved = json.loads((custom / "config.json").read_text())
    assert (saved["num_shared_heads"], saved["top_k"]) == (LAYOUT["num_shared_heads"], LAYOUT["top_k"])
    assert not any(p.get("num_shared_heads") == LAYOUT["num_shared_heads"] and p.get("top_k") == LAYOUT["top_k"]
                   for p in PRESETS.values())
    run = tmp_path / "run"
    # a preset that is not the folder's layout: refused, naming what differs
    refused(tmp_path, lambda: train(config(run, data, init_from=str(custom))), "init_from", "preset",
            mentions=(custom, "MoH-DiT-Tiny", "num_shared_heads"))
    refused(tmp_path, lambda: train(config(run, data, preset=None, init_from=str(custom), image_size=8)), "init_from",
            mentions=(custom, "sample_size 16 there, 8 here"))
    refused(tmp_path, lambda: train(config(run, data, preset=None)), "preset", "init_from")

    script = load_script("train")
    assert script.cli([str(a) for a in cli_args(run, data, "--init-from", custom, "--router-warmup-steps", 1)]) == 0
    record = json.loads((run / "train_config.json").read_text())
    assert record["preset"] is None and record["init_from"] == str(custom)
    assert (record["model_config"]["num_shared_heads"], record["model_config"]["top_k"]) == \
        (LAYOUT["num_shared_heads"], LAYOUT["top_k"])
    init = load_file(custom / "diffusion_pytorch_model.safetensors")
    two = load_file(run / "checkpoints" / "step-0000002" / "model.safetensors")
    assert set(two) == set(init) and any(not torch.equal(two[k], init[k]) for k in init if ".to_q." in k)
    final = MoHDiTTransformer2DModel.from_pretrained(run / "final", subfolder="transformer")
    assert (final.layer_shared, final.trained_top_k) == (LAYOUT["num_shared_heads"], LAYOUT["top_k"])

    # the resume takes the run's recorded model: no --preset, no --init-from; a preset or an
    # image size that is not the run's is refused against the checkpoint's model
    def resumed(**kw):
        return lambda: train(config(run, data, resume="latest", max_steps=4, router_warmup_steps=1, **kw))

    refused(tmp_path, resumed(), "preset", mentions=(run / "checkpoints", "num_shared_heads"))
    refused(tmp_path, resumed(preset=None, image_size=8), "image_size",
            mentions=(run / "checkpoints", "sample_size 16 there, 8 now"))
    assert script.cli([str(a) for a in cli_args(run, data, "--resume", "latest", "--max-steps", 4,
                                                "--router-warmup-steps", 1)]) == 0
    assert [json.loads(line)["step"] for line in (run / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    record = json.loads((run / "train_config.json").read_text())
    assert record["preset"] is None and record["model_config"]["top_k"] == LAYOUT["top_k"]


@pytest.mark.slow
def test_the_resume_without_a_preset_is_exact_and_a_dense_layout_refuses_router_warmup(tmp_path, data, custom):
    """4 steps straight == 2 steps from --init-from, then --resume latest (no preset) to 4; and
    router warm-up of a folder holding a dense DiT is refused before anything is written."""
    train(config(tmp_path / "one", data, preset=None, init_from=str(custom), max_steps=4))
    train(config(tmp_path / "two", data, preset=None, init_from=str(custom), max_steps=2))
    train(config(tmp_path / "two", data, preset=None, resume="latest", max_steps=4))
    for name in ("model.safetensors", "ema.safetensors", "optimizer.safetensors"):
        assert ((tmp_path / "one" / "checkpoints" / "step-0000004" / name).read_bytes()
                == (tmp_path / "two" / "checkpoints" / "step-0000004" / name).read_bytes()), name

    dense = MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=16, num_classes=3)
    dense.save_pretrained(tmp_path / "dense")
    refused(tmp_path, lambda: train(config(tmp_path / "dense_run", data, preset=None, init_from=str(tmp_path / "dense"),
                                           router_warmup_steps=2)),
            "router_warmup_steps", "init_from", mentions=(tmp_path / "dense", "dense DiT"))
    # a resume into a folder without a run needs a preset to start one
    refused(tmp_path, lambda: train(config(tmp_path / "empty", data, preset=None, resume="latest")), "preset",
            mentions=(tmp_path / "empty",))


# ------------------------------------------------------------------ the head-usage figure at sample steps
class _RecordingTracker:
    """An accelerate tracker (GeneralTracker's interface) that keeps the images it is given."""

    name, requires_logging_directory, main_process_only = "recording", False, True

    def __init__(self):
        self.images = []

    @property
    def tracker(self):
        return self

    def start(self):
        pass

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        pass

    def log_images(self, values, step=None, **kwargs):
        self.images.append((step, {k: v.clone() for k, v in values.items()}))

    def finish(self):
        pass


def _recording(monkeypatch):
    from accelerate.tracking import GeneralTracker

    import moh_dit.evaluation.head_usage as head_usage
    import moh_dit.training.tracking as tracking

    recording = type("Recording", (_RecordingTracker, GeneralTracker), {})()
    monkeypatch.setattr(tracking, "available_trackers", lambda: {"tensorboard"})
    monkeypatch.setattr(trainer, "log_with", lambda report_to: [recording])
    plotted, real_plot = [], head_usage.plot_head_usage
    monkeypatch.setattr(head_usage, "plot_head_usage", lambda usage, *a, **k: plotted.append(usage) or real_plot(
        usage, *a, **k))
    return recording, plotted


@pytest.mark.slow
def test_sample_steps_log_the_head_usage_figure_beside_the_grid(tmp_path, data, monkeypatch):
    """At each sample step of a MoH run: samples/head_usage_step-N.png and the same image in the
    trackers (``head_usage``), drawn from the usage logged last (here at that step, every 2 steps
    of 4), with the model's shared heads and top-K; a dense run has no such figure."""
    recording, plotted = _recording(monkeypatch)
    run = tmp_path / "run"
    train(config(run, data, report_to="tensorboard", max_steps=4, log_every=2, sample_every=2, sample_steps=2,
                 checkpoint_every=4))
    logged = [json.loads(line) for line in (run / "head_usage.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged] == [2, 4] and len(plotted) == 2
    for entry, usage in zip(logged, plotted):
        assert usage.overall == entry["usage"] and usage.settings["step"] == entry["step"]
        assert usage.shared_heads == PRESETS["MoH-DiT-Tiny"]["num_shared_heads"]
        assert usage.top_k == PRESETS["MoH-DiT-Tiny"]["top_k"]
    figures = [(step, images["head_usage"]) for step, images in recording.images if "head_usage" in images]
    assert [step for step, _ in figures] == [2, 4]
    assert sorted(p.name for p in (run / "samples").iterdir()) == [
        "head_usage_step-0000002.png", "head_usage_step-0000004.png", "step-0000002.png", "step-0000004.png"]
    for step, image in figures:
        png = np.asarray(Image.open(run / "samples" / f"head_usage_step-{step:07d}.png").convert("RGB"))
        assert image.shape == (1, 3, *png.shape[:2]) and 0 <= image.min() and image.max() <= 1
        assert np.abs(png.astype(np.float32) / 255 - image[0].permute(1, 2, 0).numpy()).max() < 1 / 255 + 1e-6
        assert image.std() > 0.05  # a drawn figure, not a blank canvas

    recording.images.clear()
    train(config(tmp_path / "dense", data, preset="DiT-Tiny", report_to="tensorboard", max_steps=2, log_every=2,
                 sample_every=2, sample_steps=2))
    assert [list(images) for _, images in recording.images] == [["samples"]]
    assert [p.name for p in (tmp_path / "dense" / "samples").iterdir()] == ["step-0000002.png"]


@pytest.mark.slow
def test_a_resumed_run_draws_the_usage_it_logged_last_until_it_logs_again(tmp_path, data, monkeypatch):
    """A resume whose first sample step comes before its first log step draws the last line of
    head_usage.jsonl (the checkpoint's step), not nothing."""
    recording, plotted = _recording(monkeypatch)
    run = tmp_path / "run"
    train(config(run, data, report_to="tensorboard", max_steps=2, log_every=2, checkpoint_every=2))
    train(config(run, data, report_to="tensorboard", max_steps=4, log_every=4, sample_every=3, sample_steps=2,
                 checkpoint_every=2, resume="latest"))
    last = json.loads((run / "head_usage.jsonl").read_text().splitlines()[0])
    assert last["step"] == 2 and len(plotted) == 1 and plotted[0].settings["step"] == 2
    assert plotted[0].overall == last["usage"]
    assert (run / "samples" / "head_usage_step-0000003.png").is_file()
