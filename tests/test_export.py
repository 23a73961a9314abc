"""Exported pipeline folders: the package's code files copied as they are, the weights, the model card;
moh-dit and diffusers alone load them and sample the same images."""

import json
import re
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from huggingface_hub import ModelCard

from moh_dit import MoHDiTPipeline, MoHDiTTransformer2DModel
from moh_dit.hub.export import export_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = ["red circle", "green square", "blue triangle", "cyan star", "magenta ring", "yellow cross", "white dot",
           "black bar", "orange arc", "violet wave"]
LABELS, SEEDS, STEPS = [0, 2, 7], [3, 11, 5], 4
RECORD = {"preset": "MoH-DiT-Tiny", "max_train_steps": 1234, "learning_rate": 0.0005, "data_dir": "demo_output/data"}
METRICS = {"fid": 12.5, "sfid": 7.25, "inception_score": 3.5, "precision": 0.625, "recall": 0.5}
SWEEP = {"settings": {}, "rows": [{"ratio": "0.75", "realised_ratio": 0.75, "fid": 40.25},
                                  {"ratio": "0.5", "realised_ratio": 0.5, "fid": 61.5}]}


def moh_dit(*argv) -> int:
    from moh_dit.commands import main

    return main([str(a) for a in argv])


def _sample(pipe, **kwargs):
    pipe.set_progress_bar_config(disable=True)
    return pipe(LABELS, num_inference_steps=STEPS, seeds=SEEDS, output_type="np", **kwargs).images


def _code_file(cls) -> Path:
    return Path(sys.modules[cls.__module__].__file__)


def _self_contained() -> bool:
    """Whether the model and pipeline files load without moh-dit: no relative imports, no moh_dit at the top."""
    imports = re.compile(r"^\s*from\s+\.|^(from|import)\s+moh_dit", re.M)
    return not any(imports.search(_code_file(c).read_text()) for c in (MoHDiTPipeline, MoHDiTTransformer2DModel))


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_pipe, tiny_vae):
    """A training run of a latent MoH-DiT-Tiny (final/ with the VAE, train_config.json), the card's
    inputs, and the in-process pipeline."""
    root = tmp_path_factory.mktemp("source")
    pipe = tiny_pipe(vae=tiny_vae(std=0.05), in_channels=4, class_names=CLASSES)
    pipe.save_pretrained(root / "run" / "final")
    (root / "run" / "train_config.json").write_text(json.dumps(RECORD))
    (root / "metrics.json").write_text(json.dumps(METRICS))
    (root / "sweep").mkdir()
    (root / "sweep" / "sweep.json").write_text(json.dumps(SWEEP))
    (root / "usage").mkdir()
    (root / "usage" / "head_usage.png").write_bytes(b"\x89PNG figure")
    return root, pipe


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    root, _ = source
    out = tmp_path_factory.mktemp("exports") / "moh-dit-tiny"
    assert moh_dit("export", "--model", root / "run", "--output-dir", out, "--variant", "bf16", "--metrics",
                   root / "metrics.json", "--sweep", root / "sweep", "--head-usage", root / "usage") == 0
    return out


def test_the_folder_holds_the_package_code_as_it_is(exported):
    index = json.loads((exported / "model_index.json").read_text())
    assert index["_class_name"] == ["pipeline_moh_dit", "MoHDiTPipeline"]
    assert index["transformer"] == ["transformer_moh_dit", "MoHDiTTransformer2DModel"]
    config = json.loads((exported / "transformer" / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "transformer_moh_dit.MoHDiTTransformer2DModel"}
    assert not [p for p in exported.rglob("*.json") if "_name_or_path" in json.loads(p.read_text())]
    assert (exported / "pipeline_moh_dit.py").read_bytes() == _code_file(MoHDiTPipeline).read_bytes()
    assert (exported / "transformer" / "transformer_moh_dit.py").read_bytes() == \
        _code_file(MoHDiTTransformer2DModel).read_bytes()
    weights = sorted(p.relative_to(exported).as_posix() for p in exported.rglob("*")
                     if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl"))
    assert weights == [f"{m}/diffusion_pytorch_model{v}.safetensors" for m in ("transformer", "vae")
                       for v in (".bf16", "")]
    for name in ("transformer", "vae"):
        full = safetensors.torch.load_file(exported / name / "diffusion_pytorch_model.safetensors")
        half = safetensors.torch.load_file(exported / name / "diffusion_pytorch_model.bf16.safetensors")
        assert full.keys() == half.keys() and all(torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)
    assert (exported / "head_usage.png").read_bytes() == b"\x89PNG figure"


@pytest.mark.slow
def test_moh_dit_loads_the_export_and_samples_the_same_images(exported, source, tmp_path):
    _, pipe = source
    loaded = MoHDiTPipeline.from_pretrained(exported)
    assert type(loaded) is MoHDiTPipeline and type(loaded.transformer) is MoHDiTTransformer2DModel
    assert np.array_equal(_sample(loaded), _sample(pipe))
    half = MoHDiTPipeline.from_pretrained(exported, torch_dtype=torch.bfloat16, variant="bf16")
    assert half.transformer.dtype == torch.bfloat16 and np.isfinite(_sample(half)).all()
    again = export_pipeline(exported, tmp_path / "again")  # an export exports again
    assert np.array_equal(_sample(MoHDiTPipeline.from_pretrained(again)), _sample(pipe))


def test_the_model_card(exported):
    assert (exported / "README.md").read_text().startswith("---\n")
    card = ModelCard.load(exported / "README.md")
    assert (card.data.library_name, card.data.license) == ("diffusers", "apache-2.0")
    assert {"moh-dit", "mixture-of-head-attention", "class-conditional-image-generation"} <= set(card.data.tags)
    text = card.text
    assert "MoH-DiT-Tiny" in text and "| 3 | 4 | 1 | 3 | 2 |" in text and "| 5 | 4 | 0 | 4 | 2 |" in text
    assert "`1234`" in text and "`demo_output/data`" in text  # the training record
    assert "| 12.5 | 7.25 | 3.5 | 0.625 | 0.5 |" in text and "| 0.75 | 0.75 | 40.25 |" in text
    assert "(head_usage.png)" in text and "trust_remote_code=True" in text and 'variant="bf16"' in text
    assert "arXiv:2410.11842" in text and "sdk:" not in text


CHILD = '''
import sys, numpy as np, torch
sys.modules["moh_dit"] = None  # as where moh-dit is not installed
torch.set_num_threads(1)
from diffusers import AutoModel, DiffusionPipeline
folder, out = sys.argv[1], sys.argv[2]
pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
pipe.set_progress_bar_config(disable=True)
assert type(pipe).__module__.startswith("diffusers_modules"), type(pipe)
model = AutoModel.from_pretrained(folder, subfolder="transformer", trust_remote_code=True)
assert type(model).__name__ == "MoHDiTTransformer2DModel" and type(model).__module__.startswith("diffusers_modules")
kw = dict(num_inference_steps={steps}, output_type="np")
np.savez(out, seeds=pipe({labels!r}, seeds={seeds!r}, **kw).images,
         ratio=pipe({labels!r}, seeds={seeds!r}, head_activation_ratio=0.5, **kw).images)
'''


@pytest.mark.slow
@pytest.mark.skipif(not _self_contained(), reason="the model and pipeline files still import moh_dit")
def test_diffusers_alone_loads_the_export(exported, source, tmp_path):
    _, pipe = source
    (tmp_path / "child.py").write_text(textwrap.dedent(CHILD.format(steps=STEPS, labels=LABELS, seeds=SEEDS)))
    env = {"PATH": "/usr/bin:/bin", "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(exported), str(tmp_path / "out.npz")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    assert np.array_equal(got["seeds"], _sample(pipe))
    assert np.array_equal(got["ratio"], _sample(pipe, head_activation_ratio=0.5))


def test_an_export_for_a_space(tiny_pipe, tmp_path):
    tiny_pipe().save_pretrained(tmp_path / "model")
    out = export_pipeline(tmp_path / "model", tmp_path / "space", app=True)
    header = (out / "README.md").read_text().split("---\n")[1]
    assert "sdk: gradio" in header and "app_file: app.py" in header
    app = (out / "app.py").read_text()
    compile(app, "app.py", "exec")
    assert "from moh_dit.app import build_app" in app and "'space'" in app
    assert "moh-dit" in (out / "requirements.txt").read_text().split()


@pytest.mark.slow
def test_the_space_app_builds_its_page(tiny_pipe, tmp_path):
    pytest.importorskip("gradio")
    tiny_pipe().save_pretrained(tmp_path / "model")
    page = runpy.run_path(str(export_pipeline(tmp_path / "model", tmp_path / "space", app=True) / "app.py"))
    assert type(page["pipe"]) is MoHDiTPipeline and page["demo"] is not None


def test_the_output_rules(source, tmp_path, monkeypatch):
    root, _ = source
    with pytest.raises(FileNotFoundError, match="none.json"):
        export_pipeline(root / "run", tmp_path / "out", metrics=tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json"):
        export_pipeline(root / "run", tmp_path / "out", sweep=tmp_path / "bad.json")
    with pytest.raises(ValueError):  # never inside an input
        export_pipeline(root / "run", root / "run" / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"] and not (root / "run" / "export").exists()
    out = export_pipeline(root / "run", tmp_path / "out", variant="fp16")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        export_pipeline(root / "run", out, overwrite=True)
    (out / "notes.txt").unlink()
    export_pipeline(root / "run", out, overwrite=True)  # its own output: replaced, now without fp16
    assert not list(out.rglob("*.fp16.safetensors"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match=str(tmp_path / "pushed")):
        export_pipeline(root / "run", tmp_path / "pushed", push_to_hub="someone/moh-dit-tiny")
    assert (tmp_path / "pushed" / "README.md").is_file()  # complete on disk, to push later
