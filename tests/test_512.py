"""512 px on tiny models: 64 x 64 latents (the SD VAE's factor 8). Conversion of facebookresearch's
DiT-XL-2-512x512.pt and diffusers' facebook/DiT-XL-2-512 layouts (at DiT-S/2 size: the same keys and
1024-token positional table as XL at 512 px), and sampling with a tiny VAE of factor 8."""

import argparse

import numpy as np
import pytest
import torch
from diffusers import DiTTransformer2DModel
from PIL import Image

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.hub.convert import model_to_release_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
def test_release_512_checkpoint_converts_at_64x64_latents(tmp_path, randomize, load_script, capsys):
    """A DiT-XL-2-512x512.pt-style pickle: pos_embed of 32 x 32 = 1024 tokens, 4-channel latents."""
    dense = randomize(MoHDiTTransformer2DModel.from_preset("DiT-S/2", sample_size=64), seed=1).eval()
    sd = model_to_release_state_dict(dense)
    assert sd["pos_embed"].shape == (1, 1024, 384)
    torch.save({"ema": sd, "args": argparse.Namespace(model="DiT-S/2", image_size=512)}, tmp_path / "dit-512.pt")
    convert = load_script("convert_checkpoint")
    for flags, out in (([], "read"), (["--sample-size", "64"], "given")):
        assert convert.cli(["--checkpoint", str(tmp_path / "dit-512.pt"), "--preset", "DiT-S/2",
                            "--output", str(tmp_path / out), *flags]) == 0
        model = MoHDiTTransformer2DModel.from_pretrained(tmp_path / out)
        assert model.config.sample_size == 64 and _same_weights(model, dense)
    capsys.readouterr()
    assert convert.cli(["--checkpoint", str(tmp_path / "dit-512.pt"), "--preset", "DiT-S/2", "--output",
                        str(tmp_path / "wrong"), "--sample-size", "32"]) == 1
    err = capsys.readouterr().err
    assert "pos_embed" in err and "1024" in err
    assert not (tmp_path / "wrong").exists()


@pytest.mark.slow
def test_diffusers_512_pipeline_folder_converts(tmp_path, randomize):
    """A facebook/DiT-XL-2-512-style DiTPipeline folder (config sample_size 64)."""
    from moh_dit.hub.convert import convert_checkpoint

    dit = DiTTransformer2DModel(num_attention_heads=6, attention_head_dim=64, in_channels=4, out_channels=8,
                                num_layers=12, sample_size=64, patch_size=2, num_embeds_ada_norm=1000)
    randomize(dit, seed=2)
    emb0 = dit.transformer_blocks[0].norm1.emb.state_dict()
    for block in dit.transformer_blocks[1:]:
        block.norm1.emb.load_state_dict(emb0)
    dit.save_pretrained(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text('{"_class_name": "DiTPipeline"}')
    model = convert_checkpoint(tmp_path / "pipe", "DiT-S/2", output_dir=tmp_path / "out", sample_size=64)
    assert model.config.sample_size == 64 and model.pos_embed.pos_embed.shape == (1, 1024, 384)
    inferred = convert_checkpoint(tmp_path / "pipe", "DiT-S/2")
    assert inferred.config.sample_size == 64 and _same_weights(model, inferred)
    ours = model.state_dict()
    assert torch.equal(ours["transformer_blocks.11.attn1.to_q.weight"], dit.transformer_blocks[11].attn1.to_q.weight)
    assert torch.equal(ours["time_class_embed.class_embedder.embedding_table.weight"],
                       emb0["class_embedder.embedding_table.weight"])


@pytest.fixture(scope="module")
def model_512(tmp_path_factory, randomize, tiny_vae):
    """A randomized MoH-DiT-Tiny on 64 x 64 x 4 latents and a tiny VAE of factor 8 (512 px)."""
    root = tmp_path_factory.mktemp("m512")
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=64, in_channels=4)
    randomize(model, std=0.05).save_pretrained(root / "model")
    tiny_vae(levels=4, sample_size=512).save_pretrained(root / "vae")
    return root


@pytest.mark.slow
def test_sample_script_at_512_px(model_512, tmp_path, load_script):
    out = tmp_path / "samples"
    code = load_script("sample").cli(["--model", str(model_512 / "model"), "--vae", str(model_512 / "vae"),
                                      "--output", str(out), "--num-samples", "2", "--per-device-batch-size", "2",
                                      "--num-inference-steps", "2", "--head-activation-ratio", "0.6"])
    assert code == 0
    images = np.load(out / "samples.npz")["arr_0"]
    assert images.shape == (2, 512, 512, 3) and images.dtype == np.uint8
    assert Image.open(sorted((out / "samples").glob("*.png"))[0]).size == (512, 512)
