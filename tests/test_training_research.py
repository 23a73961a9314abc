"""Research workflows of training: label dropout drawn by the trainer (so a compiled forward draws
nothing and follows eager training; compiled runs are in test_compile.py), and a saved model of a
layout no preset names trained with --init-from and router warm-up, then resumed without a preset."""

import json

import pytest
import torch
from diffusers.models.embeddings import LabelEmbedding
from safetensors.torch import load_file

import moh_dit.training.trainer as trainer
from moh_dit import MoHDiTTransformer2DModel
from moh_dit.models.presets import PRESETS
from moh_dit.training import train
from test_training import cli, cli_args, config, log_steps, make_image_folder

pytestmark = pytest.mark.usefixtures("one_thread")
LAYOUT = dict(num_shared_heads=[3, 3, 2, 1, 1, 0], top_k=[1, 1, 1, 1, 1, 2])  # no preset's


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data") / "images", per_class=4, size=16)


@pytest.fixture(scope="module")
def custom(tmp_path_factory, randomize):
    """A randomized MoH-DiT-Tiny of its own layout for the 16 px, 3-class data, saved."""
    model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=16, num_classes=3,
                                                            class_names=["blue", "green", "red"], **LAYOUT), seed=3)
    assert not any(p.get("num_shared_heads") == LAYOUT["num_shared_heads"] for p in PRESETS.values())
    path = tmp_path_factory.mktemp("custom") / "model"
    model.save_pretrained(path)
    return path


def test_the_trainer_draws_label_dropout_and_the_model_draws_nothing(tmp_path, data, monkeypatch):
    """Every training forward gets the trainer's mask and diffusers' own draw (token_drop, which a
    compiled forward would take from the compiler's generator) never runs."""
    monkeypatch.setattr(LabelEmbedding, "token_drop", lambda *a, **k: pytest.fail("the model drew label dropout"))
    masks, given = [], []
    real_mask, real_forward = trainer.label_drop_mask, MoHDiTTransformer2DModel.forward
    monkeypatch.setattr(trainer, "label_drop_mask", lambda y, p: masks.append(real_mask(y, p)) or masks[-1])

    def forward(self, *args, **kwargs):
        if self.training:
            given.append(kwargs.get("force_drop_ids"))
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(MoHDiTTransformer2DModel, "forward", forward)
    train(config(tmp_path, data, max_steps=4, class_dropout=0.5, checkpoint_every=4))
    assert len(masks) == len(given) == 4 and all(g is m for g, m in zip(given, masks))
    assert all(m.dtype == torch.bool and m.shape == (4,) for m in masks) and 0 < int(sum(m.sum() for m in masks)) < 16


def test_the_trainers_draw_is_the_one_the_model_made():
    """From the same generator state the trainer's mask is diffusers' label embedder's (eager runs
    keep their losses), and without dropout nothing is drawn."""
    labels = torch.arange(7) % 3
    embedder = LabelEmbedding(3, 8, 0.3).train()
    for seed in range(5):
        torch.manual_seed(seed)
        theirs = embedder.token_drop(labels) == 3
        torch.manual_seed(seed)
        assert torch.equal(trainer.label_drop_mask(labels, 0.3), theirs)
    state = torch.get_rng_state()
    assert not trainer.label_drop_mask(labels, 0.0).any() and torch.equal(torch.get_rng_state(), state)


@pytest.mark.slow
def test_router_warmup_from_init_from_trains_only_routers_then_everything(tmp_path, data, custom):
    """Steps 1-2 move only the routers (every other weight and the EMA's stay the saved ones, bit
    for bit); steps 3-4 move everything. The architecture is the folder's: no preset."""
    init = load_file(custom / "diffusion_pytorch_model.safetensors")
    train(config(tmp_path, data, preset=None, init_from=str(custom), router_warmup_steps=2, learning_rate=1e-3))
    ckpts = tmp_path / "run" / "checkpoints"
    two, four = load_file(ckpts / "step-0000002/model.safetensors"), load_file(ckpts / "step-0000004/model.safetensors")
    routers = [k for k in init if "router" in k]
    assert routers and sum(not torch.equal(two[k], init[k]) for k in routers) > len(routers) // 2
    assert all(torch.equal(two[k], init[k]) for k in init if k not in routers)
    assert all(not torch.equal(four[k], init[k]) for k in init if k.endswith("to_q.weight"))
    ema = load_file(ckpts / "step-0000002/ema.safetensors")
    assert all(torch.allclose(ema[k], init[k], rtol=1e-6, atol=1e-7) for k in init if k not in routers)
    record = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert record["preset"] is None and record["init_from"] == str(custom)
    assert [record["model_config"][k] for k in LAYOUT] == list(LAYOUT.values())


def test_init_from_is_checked_against_the_preset_and_the_data(tmp_path, data, custom):
    for kw, facts in ((dict(preset="MoH-DiT-Tiny"), ("num_shared_heads",)), (dict(preset=None, image_size=8),
                                                                            ("sample_size 16 there, 8 here",))):
        with pytest.raises(ValueError, match="init_from") as error:
            train(config(tmp_path, data, init_from=str(custom), **kw))
        assert all(fact in str(error.value) for fact in facts)
    dense = tmp_path / "dense"
    MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=16, num_classes=3).save_pretrained(dense)
    with pytest.raises(ValueError, match="router_warmup_steps"):
        train(config(tmp_path, data, preset=None, init_from=str(dense), router_warmup_steps=2))
    with pytest.raises(ValueError, match="preset"):  # nothing to resume, nothing to build
        train(config(tmp_path, data, preset=None, resume="latest"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


@pytest.mark.slow
def test_a_run_from_init_from_resumes_exactly_without_a_preset(tmp_path, data, custom, monkeypatch):
    """4 steps straight == 1 step inside the warm-up, then ``--resume latest`` (no preset, no data
    flag: the run's settings) across the warm-up's end; and a run that died before its first
    checkpoint (its sample grid kept the folder) restarts from the saved weights, not at random,
    and its sample grids draw nothing from the training's random stream."""
    kw = ["--init-from", custom, "--router-warmup-steps", 2, "--checkpoint-every", 1]
    cli(*cli_args(tmp_path / "one", data), *kw, "--max-steps", 4)
    cli(*cli_args(tmp_path / "two", data), *kw, "--max-steps", 1)
    cli("--output-dir", tmp_path / "two", "--resume", "latest", "--max-steps", 4)
    for name in ("model", "ema", "optimizer"):
        assert (tmp_path / f"one/checkpoints/step-0000004/{name}.safetensors").read_bytes() == \
            (tmp_path / f"two/checkpoints/step-0000004/{name}.safetensors").read_bytes(), name
    assert log_steps(tmp_path / "two") == [1, 2, 3, 4]

    real, calls = trainer.update_ema, []
    monkeypatch.setattr(trainer, "update_ema", lambda *a: calls.append(1) or (real(*a) if len(calls) < 2 else 1 / 0))
    with pytest.raises(ZeroDivisionError):  # dies in step 2, after the grid of step 1
        cli(*cli_args(tmp_path / "three", data), *kw, "--max-steps", 4, "--checkpoint-every", 4, "--sample-every", 1,
            "--sample-steps", 2)
    assert [p.name for p in (tmp_path / "three" / "samples").iterdir()] == ["step-0000001.png"]
    monkeypatch.undo()
    cli("--output-dir", tmp_path / "three", "--resume", "latest")
    assert (tmp_path / "three/checkpoints/step-0000004/model.safetensors").read_bytes() == \
        (tmp_path / "one/checkpoints/step-0000004/model.safetensors").read_bytes()
