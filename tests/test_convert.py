"""Checkpoint conversion: release pickles, bare state dicts, diffusers DiT folders, the CLI."""

import argparse
import fractions
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import DiTTransformer2DModel
from diffusers.models.embeddings import Timesteps

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.hub.convert import ConversionError, convert_checkpoint, model_to_release_state_dict

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "convert_checkpoint.py"


def _inputs(model, batch=2):
    gen = torch.Generator().manual_seed(0)
    s = model.config.sample_size
    return (torch.randn(batch, model.config.in_channels, s, s, generator=gen), torch.tensor([3, 700]),
            torch.tensor([1, model.config.num_classes]))


def _release_checkpoint(path, randomize, preset="MoH-DiT-Tiny", **overrides):
    ema = randomize(MoHDiTTransformer2DModel.from_preset(preset, **overrides), seed=1).eval()
    raw = randomize(MoHDiTTransformer2DModel.from_preset(preset, **overrides), seed=2).eval()
    torch.save({"model": model_to_release_state_dict(raw), "ema": model_to_release_state_dict(ema),
                "opt": {"state": {}}, "args": argparse.Namespace(model="DiT-XL/2", image_size=256)}, path)
    return ema, raw


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


@pytest.mark.slow
def test_cli_converts_release_pickle(tmp_path, randomize):
    ema, raw = _release_checkpoint(tmp_path / "0000100.pt", randomize, sample_size=8)
    res = _run("--checkpoint", tmp_path / "0000100.pt", "--preset", "MoH-DiT-Tiny", "--output", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    model = MoHDiTTransformer2DModel.from_pretrained(tmp_path / "out").eval()
    assert model.config.sample_size == 8 and model.config.num_classes == 10  # read from the checkpoint
    x, t, y = _inputs(model)
    assert torch.equal(model(x, t, y).sample, ema(x, t, y).sample)
    other = convert_checkpoint(tmp_path / "0000100.pt", "MoH-DiT-Tiny", weights="model")
    assert torch.equal(other(x, t, y).sample, raw(x, t, y).sample)


def test_bare_state_dict_with_ddp_prefix(tmp_path, randomize):
    model = randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8)).eval()
    torch.save({f"module.{k}": v for k, v in model_to_release_state_dict(model).items()}, tmp_path / "dit.pt")
    converted = convert_checkpoint(tmp_path / "dit.pt", "DiT-Tiny")
    x, t, y = _inputs(model)
    assert torch.equal(converted(x, t, y).sample, model(x, t, y).sample)


@pytest.mark.slow
def test_wrong_preset_is_refused_and_nothing_written(tmp_path, randomize):
    _release_checkpoint(tmp_path / "ckpt.pt", randomize, sample_size=8)
    res = _run("--checkpoint", tmp_path / "ckpt.pt", "--preset", "DiT-Tiny", "--output", tmp_path / "out")
    assert res.returncode != 0
    assert "unexpected" in res.stderr and "blocks.1.attn.wg.weight" in res.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    with pytest.raises(ConversionError, match="wrong shape"):
        convert_checkpoint(tmp_path / "ckpt.pt", "MoH-DiT-Tiny", num_classes=5)


def test_missing_and_misshaped_keys_are_named(tmp_path, randomize):
    model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8))
    sd = model_to_release_state_dict(model)
    del sd["blocks.2.attn.wg_0.weight"]
    sd["blocks.3.mlp.fc1.weight"] = sd["blocks.3.mlp.fc1.weight"][:10]
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(ConversionError) as err:
        convert_checkpoint(tmp_path / "bad.pt", "MoH-DiT-Tiny")
    assert "blocks.2.attn.wg_0.weight" in str(err.value) and "blocks.3.mlp.fc1.weight" in str(err.value)


def test_pos_embed_mismatch_refused(tmp_path, randomize):
    model = randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8))
    sd = model_to_release_state_dict(model)
    sd["pos_embed"] = sd["pos_embed"].flip(1)
    torch.save(sd, tmp_path / "p.pt")
    with pytest.raises(ConversionError, match="positional embedding"):
        convert_checkpoint(tmp_path / "p.pt", "DiT-Tiny")


@pytest.mark.slow
def test_missing_ema_and_missing_file(tmp_path, randomize):
    model = randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8))
    torch.save({"model": model_to_release_state_dict(model)}, tmp_path / "c.pt")
    with pytest.raises(ConversionError, match="'ema'") as err:
        convert_checkpoint(tmp_path / "c.pt", "DiT-Tiny")
    assert err.value.parameters == ("weights",)
    res = _run("--checkpoint", tmp_path / "nope.pt", "--preset", "DiT-Tiny", "--output", tmp_path / "o")
    assert res.returncode != 0 and "does not exist" in res.stderr


def _diffusers_dit(randomize):
    dit = DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=32, in_channels=3, out_channels=6,
                                num_layers=6, sample_size=8, patch_size=4, num_embeds_ada_norm=10)
    randomize(dit)
    emb0 = dit.transformer_blocks[0].norm1.emb.state_dict()
    for block in dit.transformer_blocks[1:]:
        block.norm1.emb.load_state_dict(emb0)  # a converted DiT holds identical copies
    return dit.eval()


def test_diffusers_dit_folder_folds_embedders(tmp_path, randomize):
    dit = _diffusers_dit(randomize)
    dit.save_pretrained(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text('{"_class_name": "DiTPipeline"}')
    model = convert_checkpoint(tmp_path / "pipe", "DiT-Tiny", output_dir=tmp_path / "out")
    assert MoHDiTTransformer2DModel.from_pretrained(tmp_path / "out").config.num_classes == 10
    x, t, y = _inputs(model)
    ours = model(x, t, y).sample
    theirs = dit(x, t, y).sample
    # Different by design: diffusers' timestep frequencies (shift 1) and norm eps 1e-5.
    assert (ours - theirs).abs().max() > 1e-6
    # With diffusers' embedding and eps set to the original DiT's, folding is exact.
    for block in dit.transformer_blocks:
        block.norm1.emb.time_proj = Timesteps(256, True, 0)
        block.norm3.eps = 1e-6
    assert (model(x, t, y).sample - dit(x, t, y).sample).abs().max() <= 1e-5


def test_diffusers_divergent_embedders_refused(tmp_path, randomize):
    dit = _diffusers_dit(randomize)
    with torch.no_grad():
        dit.transformer_blocks[3].norm1.emb.class_embedder.embedding_table.weight.add_(0.01)
    dit.save_pretrained(tmp_path / "t")
    with pytest.raises(ConversionError, match="differ between blocks"):
        convert_checkpoint(tmp_path / "t", "DiT-Tiny")
    convert_checkpoint(tmp_path / "t", "DiT-Tiny", allow_divergent_embeddings=True)
    with pytest.raises(ConversionError, match="MoH-DiT-Tiny"):
        convert_checkpoint(tmp_path / "t", "MoH-DiT-Tiny")


def test_existing_output_is_not_clobbered(tmp_path, randomize):
    _release_checkpoint(tmp_path / "ckpt.pt", randomize, sample_size=8)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        convert_checkpoint(tmp_path / "ckpt.pt", "MoH-DiT-Tiny", output_dir=tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").exists()


# --------------------------------------------------------------------------------------
# scripts/convert_checkpoint.py refuses bad input in one line, before writing anything
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny release checkpoint and broken files beside it, outside each test's tmp_path."""
    root = tmp_path_factory.mktemp("convert_inputs")
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8)
    state = model_to_release_state_dict(model)
    torch.save({"ema": state, "args": argparse.Namespace(model="DiT-XL/2")}, root / "ckpt.pt")
    data = (root / "ckpt.pt").read_bytes()
    (root / "truncated.pt").write_bytes(data[: len(data) // 2])
    (root / "text.pt").write_text("hello, I am a text file\n")
    (root / "empty.pt").write_bytes(b"")
    (root / "bad.safetensors").write_bytes(b"garbage")
    (root / "notes.txt").write_text("not a checkpoint")
    torch.save({"ema": state, "extra": fractions.Fraction(1, 3)}, root / "foreign.pt")  # a class torch does not allow
    (root / "folder").mkdir()
    (root / "other").mkdir()
    (root / "other" / "config.json").write_text('{"_class_name": "UNet2DModel"}')
    (root / "brokenjson").mkdir()
    (root / "brokenjson" / "config.json").write_text("{")
    return root


FORMATS = r"\.safetensors.*Hub id"  # what a checkpoint may be, in every refusal of an unreadable one


@pytest.mark.parametrize(
    "argv, match",
    [
        # Reproductions: text, empty and truncated files gave KeyError / EOFError / RuntimeError tracebacks.
        (["--checkpoint", "{in}/text.pt"], rf"text\.pt .*readable.*{FORMATS}"),
        (["--checkpoint", "{in}/empty.pt"], rf"empty\.pt .*0 bytes.*{FORMATS}"),
        (["--checkpoint", "{in}/truncated.pt"], rf"truncated\.pt .*truncated.*{FORMATS}"),
        (["--checkpoint", "{in}/bad.safetensors"], rf"bad\.safetensors .*readable.*{FORMATS}"),
        (["--checkpoint", "{in}/notes.txt"], rf"notes\.txt .*readable.*{FORMATS}"),
        (["--checkpoint", "{in}/folder"], rf"folder .*config\.json.*{FORMATS}"),
        (["--checkpoint", "{in}/other"], r"UNet2DModel"),
        (["--checkpoint", "{in}/brokenjson"], r"config\.json .*JSON"),
        # Missing paths are missing files, never Hub ids (the relative one used to be tried on the Hub).
        (["--checkpoint", "checkpoints/missing-7000000.pt"], r"checkpoints/missing-7000000\.pt does not exist"),
        (["--checkpoint", "./missing"], r"\./missing does not exist"),
        (["--checkpoint", "missing.pt"], r"missing\.pt does not exist"),
        (["--checkpoint", "{tmp}/a/b/missing"], r"a/b/missing does not exist"),
        # Only an org/name shape is tried on the Hub (offline in tests).
        (["--checkpoint", "no-such-org/no-such-model"], r"no-such-org/no-such-model.*Hub"),
        (["--preset", "DiT-Huge/2"], r"--preset: invalid choice"),
        (["--preset", "DiT-Tiny"], r"(?s)--preset.*unexpected"),
        (["--checkpoint", "{in}/foreign.pt"], r"foreign\.pt .*fractions\.Fraction"),
        (["--weights", "best"], r"--weights: invalid choice"),
        (["--weights", "model"], r"'model'.*--weights"),
        (["--sample-size", "0"], r"--sample-size .*got 0"),
        (["--sample-size", "-8"], r"--sample-size .*got -8"),
        (["--sample-size", "10"], r"--sample-size 10 .*patch size 4"),
        (["--sample-size", "16"], r"wrong shape.*pos_embed"),
        (["--sample-size", "nan"], r"--sample-size: invalid int value"),
        (["--num-classes", "0"], r"--num-classes .*got 0"),
        (["--num-classes", "-3"], r"--num-classes .*got -3"),
        (["--num-classes", "5"], r"wrong shape.*y_embedder"),
        # --output-dir (here by its old name, --output): a file, a path under a file, a non-empty
        # folder without --overwrite.
        (["--output", "{tmp}/file.txt"], r"--output-dir .*file\.txt is a file"),
        (["--output", "{tmp}/file.txt", "--overwrite"], r"file\.txt is a file"),
        (["--output", "{tmp}/file.txt/model"], r"lies under .*file\.txt"),
        (["--output", "{tmp}/full"], r"full' already exists.*--overwrite"),
        # Reproduction: --overwrite deleted a user's folder that no conversion wrote.
        (["--output", "{tmp}/full", "--overwrite"], r"--overwrite would replace .*full'.*--output-dir"),
        # A folder another command wrote (here a training run, by its marker) is not convert's to replace.
        (["--output", "{tmp}/run", "--overwrite"], r"--overwrite would replace .*run'.*moh-dit train"),
        # The output never contains the checkpoint it reads.
        (["--checkpoint", "{tmp}/conv/ckpt.pt", "--output", "{tmp}/conv", "--overwrite"],
         r"--output-dir .*conv contains --checkpoint .*ckpt\.pt"),
        (["--checkpoint", "{tmp}/diffusers", "--output", "{tmp}/diffusers/converted"],
         r"--output-dir .*converted lies inside --checkpoint"),
    ],
)
def test_script_refuses_bad_input(argv, match, inputs, tmp_path, refuses):
    from moh_dit.utils.output_folders import write_output_marker

    (tmp_path / "file.txt").write_text("mine")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "run").mkdir()
    write_output_marker(tmp_path / "run", "train")
    if "{tmp}/conv/ckpt.pt" in argv:  # a folder convert may replace, holding the checkpoint it reads
        (tmp_path / "conv").mkdir()
        write_output_marker(tmp_path / "conv", "convert")
        (tmp_path / "conv" / "ckpt.pt").write_bytes((inputs / "ckpt.pt").read_bytes())
    if "{tmp}/diffusers" in argv:
        (tmp_path / "diffusers").mkdir()
        (tmp_path / "diffusers" / "config.json").write_text('{"_class_name": "DiTTransformer2DModel"}')
    base = {"--checkpoint": "{in}/ckpt.pt", "--preset": "MoH-DiT-Tiny", "--output": "{tmp}/out"}
    for flag in base:
        if flag in argv:
            base[flag] = argv[argv.index(flag) + 1]
    rest = [a for i, a in enumerate(argv) if a not in base and (i == 0 or argv[i - 1] not in base)]
    full = [x for flag, value in base.items() for x in (flag, value)] + rest
    fill = lambda a: a.replace("{in}", str(inputs)).replace("{tmp}", str(tmp_path))
    refuses("convert_checkpoint", [fill(a) for a in full], match)


def test_valid_conversion_through_the_cli_in_process(inputs, tmp_path, load_script, capsys):
    # The table's base command is valid: only the flag under test makes it fail.
    script = load_script("convert_checkpoint")
    argv = ["--checkpoint", str(inputs / "ckpt.pt"), "--preset", "MoH-DiT-Tiny", "--output", str(tmp_path / "out")]
    assert script.cli(argv) == 0
    assert (tmp_path / "out" / "config.json").is_file()
    assert script.cli(argv) == 1 and "--overwrite" in capsys.readouterr().err
    assert script.cli(argv + ["--overwrite"]) == 0


def test_overwrite_replaces_only_an_earlier_conversion(inputs, tmp_path, load_script, capsys):
    """An earlier conversion from before the output marker (a saved model folder and nothing else)
    is replaced; a training run's final/, a pipeline's transformer/ and a folder with other files
    are not, and nothing in them changes."""
    from moh_dit.utils.output_folders import OUTPUT_MARKER

    script = load_script("convert_checkpoint")
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8)
    base = ["--checkpoint", str(inputs / "ckpt.pt"), "--preset", "MoH-DiT-Tiny", "--overwrite", "--output-dir"]
    model.save_pretrained(tmp_path / "earlier")
    assert script.cli(base + [str(tmp_path / "earlier")]) == 0
    assert (tmp_path / "earlier" / OUTPUT_MARKER).is_file()
    for folder, beside in (("run/final", "train_config.json"), ("pipe/transformer", "model_index.json")):
        model.save_pretrained(tmp_path / folder)
        (tmp_path / folder).parent.joinpath(beside).write_text("{}")
    model.save_pretrained(tmp_path / "mine")
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    for folder in ("run/final", "pipe/transformer", "mine"):
        before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / folder).iterdir())
        assert script.cli(base + [str(tmp_path / folder)]) == 1
        assert "which is not an earlier conversion" in capsys.readouterr().err
        assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / folder).iterdir()) == before


def test_hub_ids_are_only_org_name():
    from moh_dit.hub.convert import _is_hub_id

    assert _is_hub_id("facebook/DiT-XL-2-256")
    for path in ("checkpoints/7000000.pt", "./a/b", "a/b/c", "/abs/x", "~/x/y", "x", "a/b.safetensors", "/x"):
        assert not _is_hub_id(path), path
