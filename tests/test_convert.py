"""Checkpoint conversion: the release's pickles, bare state dicts, diffusers DiT folders, URLs, the command."""

import argparse
import os

import pytest
import torch
from diffusers import DiTTransformer2DModel
from diffusers.models.embeddings import Timesteps

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.hub.convert import _is_hub_id, convert_checkpoint, model_to_release_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")


def moh_dit(*argv) -> int:
    from moh_dit.commands import main

    return main([str(a) for a in argv])


def _inputs(model):
    gen = torch.Generator().manual_seed(0)
    s = model.config.sample_size
    return (torch.randn(2, model.config.in_channels, s, s, generator=gen), torch.tensor([3, 700]),
            torch.tensor([1, model.config.num_classes]))


def _same(a, b) -> bool:
    x, t, y = _inputs(a)
    with torch.no_grad():
        return torch.equal(a(x, t, y).sample, b(x, t, y).sample)


@pytest.fixture
def release(tmp_path, randomize):
    """A release-format training checkpoint (model, ema, opt, args) of a randomized MoH-DiT-Tiny."""
    ema = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8), seed=1).eval()
    raw = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8), seed=2).eval()
    torch.save({"model": model_to_release_state_dict(raw), "ema": model_to_release_state_dict(ema),
                "opt": {"state": {}}, "args": argparse.Namespace(model="DiT-XL/2", image_size=256)},
               tmp_path / "0000100.pt")
    return tmp_path / "0000100.pt", ema, raw


def test_the_release_pickle_converts_exactly(release, tmp_path):
    path, ema, raw = release
    assert moh_dit("convert", "--checkpoint", path, "--preset", "MoH-DiT-Tiny", "--output-dir", tmp_path / "out") == 0
    model = MoHDiTTransformer2DModel.from_pretrained(tmp_path / "out").eval()
    assert (model.config.sample_size, model.config.num_classes) == (8, 10)  # read from the checkpoint
    assert _same(model, ema)
    assert _same(convert_checkpoint(path, "MoH-DiT-Tiny", weights="model"), raw)


def test_a_bare_state_dict_with_a_ddp_prefix(tmp_path, randomize):
    model = randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8)).eval()
    torch.save({f"module.{k}": v for k, v in model_to_release_state_dict(model).items()}, tmp_path / "dit.pt")
    assert _same(convert_checkpoint(tmp_path / "dit.pt", "DiT-Tiny"), model)


def test_every_key_and_shape_is_checked(release, tmp_path, randomize):
    path, _, _ = release
    with pytest.raises(ValueError, match=r"unexpected.*blocks\.1\.attn\.wg\.weight"):
        convert_checkpoint(path, "DiT-Tiny")  # a MoH checkpoint is not a dense DiT
    with pytest.raises(ValueError, match="y_embedder"):
        convert_checkpoint(path, "MoH-DiT-Tiny", num_classes=5)
    state = model_to_release_state_dict(randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8)))
    del state["blocks.2.attn.wg_0.weight"]
    state["blocks.3.mlp.fc1.weight"] = state["blocks.3.mlp.fc1.weight"][:10]
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"missing.*blocks\.2\.attn\.wg_0\.weight.*wrong shape.*blocks\.3\.mlp\.fc1"):
        convert_checkpoint(tmp_path / "bad.pt", "MoH-DiT-Tiny")
    dense = model_to_release_state_dict(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8))
    dense["pos_embed"] = dense["pos_embed"].flip(1)
    torch.save(dense, tmp_path / "pos.pt")
    with pytest.raises(ValueError, match="pos_embed"):
        convert_checkpoint(tmp_path / "pos.pt", "DiT-Tiny")
    torch.save({"model": dense}, tmp_path / "no_ema.pt")
    with pytest.raises(ValueError, match="'ema'"):
        convert_checkpoint(tmp_path / "no_ema.pt", "DiT-Tiny")


def _diffusers_dit(randomize):
    dit = DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=32, in_channels=3, out_channels=6,
                                num_layers=6, sample_size=8, patch_size=4, num_embeds_ada_norm=10)
    randomize(dit)
    for block in dit.transformer_blocks[1:]:  # a converted DiT holds identical copies
        block.norm1.emb.load_state_dict(dit.transformer_blocks[0].norm1.emb.state_dict())
    return dit.eval()


def test_a_diffusers_folder_folds_its_embedders(tmp_path, randomize):
    dit = _diffusers_dit(randomize)
    dit.save_pretrained(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text('{"_class_name": "DiTPipeline"}')
    model = convert_checkpoint(tmp_path / "pipe", "DiT-Tiny")
    assert model.config.num_classes == 10
    x, t, y = _inputs(model)
    with torch.no_grad():
        # different by design: diffusers' timestep frequencies (shift 1) and norm eps 1e-5 ...
        assert (model(x, t, y).sample - dit(x, t, y).sample).abs().max() > 1e-6
        for block in dit.transformer_blocks:  # ... with DiT's, folding is exact
            block.norm1.emb.time_proj = Timesteps(256, True, 0)
            block.norm3.eps = 1e-6
        assert (model(x, t, y).sample - dit(x, t, y).sample).abs().max() <= 1e-5


def test_diverging_embedders_are_refused_unless_allowed(tmp_path, randomize):
    dit = _diffusers_dit(randomize)
    with torch.no_grad():
        dit.transformer_blocks[3].norm1.emb.class_embedder.embedding_table.weight.add_(0.01)
    dit.save_pretrained(tmp_path / "t")
    with pytest.raises(ValueError, match="allow_divergent_embeddings"):
        convert_checkpoint(tmp_path / "t", "DiT-Tiny")
    convert_checkpoint(tmp_path / "t", "DiT-Tiny", allow_divergent_embeddings=True)
    with pytest.raises(ValueError, match="dense"):
        convert_checkpoint(tmp_path / "t", "MoH-DiT-Tiny")


def test_a_url_is_cached_by_the_whole_url(tmp_path, randomize, monkeypatch):
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    models = []
    for seed in (1, 2):  # two URLs ending in the same file name
        models.append(randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8), seed=seed).eval())
        (tmp_path / str(seed)).mkdir()
        torch.save(model_to_release_state_dict(models[-1]), tmp_path / str(seed) / "model.pt")
    urls = [(tmp_path / str(seed) / "model.pt").as_uri() for seed in (1, 2)]
    assert _same(convert_checkpoint(urls[0], "DiT-Tiny"), models[0])
    assert _same(convert_checkpoint(urls[1], "DiT-Tiny"), models[1])
    os.remove(tmp_path / "1" / "model.pt")
    assert _same(convert_checkpoint(urls[0], "DiT-Tiny"), models[0])  # from the cache
    assert len(list((tmp_path / "hub" / "checkpoints").iterdir())) == 2


class _Planted:
    """A pickle that would create a folder when unpickled."""

    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        return os.mkdir, (str(self.flag),)


@pytest.mark.parametrize("name", ["truncated.pt", "text.pt", "bad.safetensors", "planted.pt", "missing.pt"])
def test_an_unreadable_checkpoint_is_one_line_naming_it(name, release, tmp_path, capsys):
    path, _, _ = release
    data = path.read_bytes()
    files = {"truncated.pt": data[: len(data) // 2], "text.pt": b"hello\n", "bad.safetensors": b"garbage"}
    if name in files:
        (tmp_path / name).write_bytes(files[name])
    if name == "planted.pt":
        torch.save({"ema": torch.load(path, weights_only=False)["ema"], "x": _Planted(tmp_path / "ran")},
                   tmp_path / name)
    capsys.readouterr()
    assert moh_dit("convert", "--checkpoint", tmp_path / name, "--preset", "MoH-DiT-Tiny",
                   "--output-dir", tmp_path / "out") != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and name in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ran").exists()  # nothing written, nothing run


def test_sizes_are_bounded_by_the_parser(release, tmp_path):
    path, _, _ = release
    for flag, value in (("--sample-size", 1_000_000), ("--sample-size", 0), ("--num-classes", 10**9)):
        with pytest.raises(SystemExit):
            moh_dit("convert", "--checkpoint", path, "--preset", "MoH-DiT-Tiny", "--output-dir", tmp_path / "o",
                    flag, value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000100.pt"]


def test_the_output_rules(release, tmp_path, randomize):
    path, ema, _ = release
    out = tmp_path / "out"
    convert_checkpoint(path, "MoH-DiT-Tiny", out)  # beside the checkpoint file: fine
    with pytest.raises(FileExistsError):
        convert_checkpoint(path, "MoH-DiT-Tiny", out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        convert_checkpoint(path, "MoH-DiT-Tiny", out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    convert_checkpoint(path, "MoH-DiT-Tiny", out, overwrite=True)  # an earlier conversion is replaced
    with pytest.raises(ValueError):  # never a folder that contains the checkpoint
        convert_checkpoint(path, "MoH-DiT-Tiny", tmp_path, overwrite=True)
    _diffusers_dit(randomize).save_pretrained(tmp_path / "dit")
    with pytest.raises(ValueError):  # never inside a checkpoint folder
        convert_checkpoint(tmp_path / "dit", "DiT-Tiny", tmp_path / "dit" / "converted")
    assert not (tmp_path / "dit" / "converted").exists() and _same(MoHDiTTransformer2DModel.from_pretrained(out), ema)


def test_hub_ids_are_only_org_name():
    assert _is_hub_id("facebook/DiT-XL-2-256")
    for path in ("checkpoints/7000000.pt", "./a/b", "a/b/c", "/abs/x", "~/x/y", "x", "a/b.safetensors"):
        assert not _is_hub_id(path), path
