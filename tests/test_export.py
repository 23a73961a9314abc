"""Exported pipeline folders: diffusers loads them without moh-dit, with the same images.

A tiny latent MoH-DiT with a tiny VAE is saved as a training run (``final/``, a pipeline folder
with the run's VAE, and ``train_config.json``) and exported without ``vae``. A subprocess in which ``import moh_dit`` raises loads the
export with ``DiffusionPipeline.from_pretrained(DIR, trust_remote_code=True)`` and samples; its
images must equal, bit for bit, those of the in-process ``MoHDiTPipeline`` it was made from.
Since the folder's module files are generated from the package's source at export time, this
also proves that they stay in sync with it.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import safetensors.torch
import torch
from huggingface_hub import ModelCard

from moh_dit import MoHDiTPipeline, MoHDiTTransformer2DModel
from moh_dit.hub.bundle import BundleError, bundle_module
from moh_dit.evaluation.head_usage import HeadUsage, write_head_usage
from moh_dit.hub.export import HubPushError, INFO_FILE, export_pipeline, is_export, push_folder
from moh_dit.sampling.sample import load_pipeline
from moh_dit.sampling.sweep_results import SweepResult, SweepRow, write_sweep
from moh_dit.utils.output_folders import OUTPUT_MARKER, write_output_marker

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = ["red circle", "green square", "blue triangle", "cyan star", "magenta ring", "yellow cross", "white dot",
           "black bar", "orange arc", "violet wave"]
LABELS = [0, "blue triangle", 7]
SEEDS = [3, 11, 5]
STEPS = 4
RECORD = {"preset": "MoH-DiT-Tiny", "max_steps": 1234, "global_batch_size": 32, "learning_rate": 0.0005,
          "ema_decay": 0.995, "class_dropout": 0.1, "lb_coeff": 0.01, "data_dir": "demo_output/data"}
METRICS = {"fid": 12.5, "sfid": 7.25, "inception_score": 3.5, "precision": 0.625, "recall": 0.5, "num_samples": 480,
           "extractor": "random Inception (seed 0)", "comparable_to_published": False, "reference": "ref.npz"}


def _sample(pipe, **kwargs):
    return pipe(LABELS, num_inference_steps=STEPS, seeds=SEEDS, output_type="np", **kwargs).images


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_pipe, tiny_vae):
    """A training run folder of a latent MoH-DiT-Tiny (final/ as training writes it: a pipeline
    folder with the VAE), its VAE folder, and the in-process pipeline."""
    root = tmp_path_factory.mktemp("source")
    pipe = tiny_pipe(vae=tiny_vae(std=0.05), in_channels=4, class_names=CLASSES)
    pipe.save_pretrained(root / "run" / "final")
    (root / "run" / "train_config.json").write_text(json.dumps(RECORD))
    pipe.vae.save_pretrained(root / "vae")
    return root, pipe


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return tmp_path_factory.mktemp("results")


@pytest.fixture(scope="module")
def exported(source, results, tmp_path_factory):
    """The run exported with bf16 variant weights, metrics, a sweep and head usage for its card."""
    root, _ = source
    (results / "metrics.json").write_text(json.dumps(METRICS))
    rows = [SweepRow(ratio=r, realised_ratio=float(r), top_k_per_layer=[0, 1, 1, 2, 1, 2], fid=f, sfid=None,
                     inception_score=2.0, precision=0.5, recall=0.25, attention_flops_per_image=100,
                     dense_attention_flops_per_image=120, attention_flop_ratio=0.833, sampling_seconds=2.0,
                     num_samples=8, evaluation_seconds=1.0) for r, f in (("0.75", 40.25), ("0.5", 61.5))]
    write_sweep(SweepResult(rows=rows, settings={"num_samples": 8, "num_inference_steps": 10, "guidance_scale": 1.0,
                                                  "comparable_to_published": False}),
                results / "sweep")
    write_head_usage(HEAD_USAGE, results / "usage", "head usage")
    out = tmp_path_factory.mktemp("exports") / "moh-dit-tiny"
    export_pipeline(root / "run", out, variant="bf16", metrics=results / "metrics.json",
                    sweep=results / "sweep", head_usage=results / "usage", progress=False)
    return out


# What `moh-dit plot-head-usage` would have measured (any consistent numbers will do for the card).
HEAD_USAGE = HeadUsage(overall=[[1.0] * 4, [1.0, 1.0, 0.2, 0.8], [1.0, 0.5, 0.25, 0.25]] + [[1.0, 0.5, 0.5, 0.5]] * 2
                       + [[0.5] * 4], per_class={}, per_timestep=[], shared_heads=[4, 2, 2, 1, 2, 0],
                       top_k=[0, 1, 1, 2, 1, 2])


@pytest.mark.slow
def test_a_sweeps_head_usage_goes_into_the_card_without_the_flag(source, results, exported, tmp_path):
    root, _ = source  # `exported` wrote the sweep folder
    write_head_usage(HEAD_USAGE, results / "sweep" / "head_usage", "head usage")
    out = export_pipeline(root / "run", tmp_path / "export", sweep=results / "sweep",
                          progress=False)
    assert (out / "head_usage.png").is_file() and "## Head usage" in (out / "README.md").read_text()


def test_the_head_usage_figure_travels_with_the_export(exported, results):
    assert (exported / "head_usage.png").read_bytes() == (results / "usage" / "head_usage.png").read_bytes()
    card = (exported / "README.md").read_text()
    assert "## Head usage" in card and "(head_usage.png)" in card and "| 1 | 2 | 2 | 1 | 0.500 | 0.200-0.800 |" in card


BLOCKER = '''
import sys

class _NoMohDit:
    """moh-dit is not installed here: importing it (or the repository's pipelines/) fails."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("moh_dit", "pipelines"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, _NoMohDit())
'''

CHILD = '''
import sys, numpy as np, torch
torch.set_num_threads(1)
try:
    import moh_dit
    raise SystemExit("moh_dit was importable")
except ImportError:
    pass
from diffusers import DiffusionPipeline
folder, out = sys.argv[1], sys.argv[2]
pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
assert type(pipe).__module__.startswith("diffusers_modules"), type(pipe)
assert type(pipe.transformer).__module__.startswith("diffusers_modules"), type(pipe.transformer)
kw = dict(num_inference_steps={steps}, output_type="np")
arrays = dict(
    seeds=pipe({labels!r}, seeds={seeds!r}, **kw).images,
    generators=pipe({labels!r}, generator=[torch.Generator().manual_seed(s) for s in {seeds!r}], **kw).images,
    ratio=pipe({labels!r}, seeds={seeds!r}, head_activation_ratio=0.5, **kw).images,
)
half = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True, variant="bf16", dtype=torch.bfloat16)
assert half.transformer.dtype == torch.bfloat16 and half.vae.dtype == torch.bfloat16
arrays["bf16"] = half({labels!r}, seeds={seeds!r}, **kw).images
assert not any(name.split(".")[0] == "moh_dit" for name in sys.modules)
np.savez(out, **arrays)
'''


@pytest.mark.slow
def test_diffusers_loads_the_export_without_moh_dit(exported, source, tmp_path):
    _, pipe = source
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD.format(steps=STEPS, labels=LABELS, seeds=SEEDS)))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "blocker"), "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(exported), str(tmp_path / "out.npz")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Expected types" not in done.stderr, done.stderr  # the components match the pipeline's annotations
    got = np.load(tmp_path / "out.npz")
    expected = _sample(pipe)
    assert np.array_equal(got["seeds"], expected)
    assert np.array_equal(got["generators"], expected)  # seeds = one generator per image
    assert np.array_equal(got["ratio"], _sample(pipe, head_activation_ratio=0.5))
    assert not np.array_equal(got["ratio"], expected)
    half = MoHDiTPipeline.from_pretrained(exported, torch_dtype=torch.bfloat16, variant="bf16")
    assert np.array_equal(got["bf16"], _sample(half))


def test_installed_package_loads_the_export_with_its_own_classes(exported, source):
    _, pipe = source
    expected = _sample(pipe)
    loaded = MoHDiTPipeline.from_pretrained(exported)
    assert type(loaded) is MoHDiTPipeline and type(loaded.transformer) is MoHDiTTransformer2DModel
    assert loaded.id2label == dict(enumerate(CLASSES))
    assert np.array_equal(_sample(loaded), expected)
    assert np.array_equal(_sample(load_pipeline(exported, scheduler="saved")), expected)
    assert np.array_equal(_sample(load_pipeline(exported)), expected)  # its DDPM scheduler is the default one
    with pytest.raises(TypeError, match="device_map"):
        MoHDiTPipeline.from_pretrained(exported, device_map="auto")


def test_folder_layout_and_code_match_the_package(exported):
    index = json.loads((exported / "model_index.json").read_text())
    assert index["_class_name"] == ["pipeline_moh_dit", "MoHDiTPipeline"]
    assert index["transformer"] == ["transformer_moh_dit", "MoHDiTTransformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKL"] and "_name_or_path" not in index
    info = json.loads((exported / INFO_FILE).read_text())
    assert is_export(exported) and info["variant"] == "bf16" and info["training_record"] == "train_config.json"
    for file, entry in (("pipeline_moh_dit.py", "moh_dit.pipelines.pipeline_moh_dit"),
                        ("transformer/transformer_moh_dit.py", "moh_dit.models.transformer_moh_dit")):
        bundle = bundle_module(entry, info["moh_dit_version"])
        assert (exported / file).read_text() == bundle.source
        assert info["bundled_modules"][file] == list(bundle.modules) and bundle.modules[-1] == entry
    weights = sorted(p.relative_to(exported).as_posix() for p in exported.rglob("*")
                     if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl"))
    assert weights == [f"{m}/diffusion_pytorch_model{v}.safetensors" for m in ("transformer", "vae")
                       for v in (".bf16", "")]


def test_variant_weights_are_the_weights_in_half_precision(exported, source, tmp_path):
    _, pipe = source
    for name in ("transformer", "vae"):
        full = safetensors.torch.load_file(exported / name / "diffusion_pytorch_model.safetensors")
        half = safetensors.torch.load_file(exported / name / "diffusion_pytorch_model.bf16.safetensors")
        assert full.keys() == half.keys()
        assert all(t.dtype == torch.float32 for t in full.values())
        assert all(torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)
    state = pipe.transformer.state_dict()
    full = safetensors.torch.load_file(exported / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(full[k], state[k]) for k in state)
    out = export_pipeline(exported, tmp_path / "fp16", variant="fp16", progress=False)  # an export exports again
    half = safetensors.torch.load_file(out / "transformer" / "diffusion_pytorch_model.fp16.safetensors")
    assert all(t.dtype == torch.float16 for t in half.values())
    assert MoHDiTPipeline.from_pretrained(out, torch_dtype=torch.float16, variant="fp16").transformer.dtype == torch.float16


def test_torch_dtype_on_loading(exported):
    pipe = MoHDiTPipeline.from_pretrained(exported, torch_dtype=torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.vae.dtype == torch.bfloat16
    images = _sample(pipe)
    assert images.dtype == np.float32 and np.isfinite(images).all()
    assert load_pipeline(exported, dtype="bfloat16").transformer.dtype == torch.bfloat16


def test_model_card(exported):
    card = ModelCard.load(exported / "README.md")
    assert card.data.library_name == "diffusers"
    assert card.data.pipeline_tag == "unconditional-image-generation" and card.data.license == "apache-2.0"
    assert {"moh-dit", "mixture-of-head-attention", "class-conditional-image-generation"} <= set(card.data.tags)
    text = card.text
    assert "MoH-DiT-Tiny" in text and "| 3 | 4 | 1 | 3 | 2 | 0.750 |" in text and "| 5 | 4 | 0 | 4 | 2 | 0.500 |" in text
    assert "**18/24 = 0.7500**" in text and "**[0.5000, 1.0000]**" in text
    for value in ("`1234`", "`32`", "`0.0005`", "`0.995`", "`demo_output/data`"):  # the training record
        assert value in text
    assert "| 12.5 | 7.25 | 3.5 | 0.625 | 0.5 |" in text and "480 samples" in text  # --metrics
    assert "| 0.75 | 0.75 | 40.25 | - | 2 | 0.5 | 0.25 | 0.833 | 0.25 |" in text and "8 samples per ratio" in text
    assert text.count("**Not comparable to published numbers**") == 2
    assert "DiffusionPipeline.from_pretrained(" in text and "trust_remote_code=True" in text
    assert "'red circle', 'green square'" in text and 'variant="bf16"' in text
    assert "MoH: Multi-Head Attention as Mixture-of-Head Attention" in text and "ICML" in text
    assert "arXiv:2410.11842" in text and "Jin, Peng" in text
    assert "transformer/transformer_moh_dit.py" in text


def test_model_card_shows_class_accuracy_when_measured():
    from moh_dit.hub import model_card

    row = dict(ratio="trained", realised_ratio=0.75, fid=1.0, sfid=2.0, inception_score=None, precision=0.5,
               recall=0.25, attention_flop_ratio=0.85, sampling_seconds=4.0, num_samples=8)
    without = "\n".join(model_card._sweep_section({"settings": {}, "rows": [row]}))
    with_accuracy = "\n".join(model_card._sweep_section({"settings": {}, "rows": [dict(row, class_accuracy=0.95)]}))
    assert "class accuracy" not in without and "class accuracy" in with_accuracy and "| 0.95 |" in with_accuracy
    metrics = dict(fid=1.0, sfid=2.0, inception_score=3.0, precision=0.5, recall=0.25, class_accuracy=0.9)
    assert "class accuracy" in "\n".join(model_card._metrics_section(metrics))


@pytest.mark.slow
def test_overwrite_replaces_only_an_export(exported, tmp_path):
    out = export_pipeline(exported, tmp_path / "again", variant="bf16", progress=False)
    assert (out / "vae" / "diffusion_pytorch_model.bf16.safetensors").is_file()
    export_pipeline(exported, out, overwrite=True, progress=False)  # without a variant now
    assert not list(out.rglob("*.bf16.safetensors")) and is_export(out)
    empty = tmp_path / "empty"
    empty.mkdir()
    export_pipeline(exported, empty, progress=False)  # an empty folder needs no --overwrite
    assert is_export(empty)


def test_bundling_refuses_what_one_file_cannot_hold(tmp_path, monkeypatch):
    pkg = tmp_path / "moh_dit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from __future__ import annotations\n\ndef helper():\n    return 1\n")
    (pkg / "b.py").write_text("from .a import helper as other\n\ndef helper():\n    return other()\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("import math\n\ndef f():\n    from .a import helper\n    return helper()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "moh_dit" or n.startswith("moh_dit.")]:
        monkeypatch.delitem(sys.modules, name)  # put back after the test; the fake ones are dropped below
    try:
        _check_fake_package_bundles()
    finally:
        for name in [n for n in sys.modules if n == "moh_dit" or n.startswith("moh_dit.")]:
            del sys.modules[name]


def _check_fake_package_bundles():
    with pytest.raises(BundleError, match="both define the top-level name 'helper'"):
        bundle_module("moh_dit.b")
    with pytest.raises(BundleError, match="importing from the package moh_dit itself"):
        bundle_module("moh_dit.c")
    bundle = bundle_module("moh_dit.d")  # an import inside a function becomes `pass`
    assert bundle.modules == ("moh_dit.a", "moh_dit.d") and "    pass\n    return helper()" in bundle.source
    namespace = {}
    exec(compile(bundle.source, "bundle", "exec"), namespace)
    assert namespace["f"]() == 1


def test_push_offline_names_the_problem_and_keeps_the_export(exported, tmp_path, monkeypatch, load_script, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "pushed"
    code = load_script("export_pipeline").cli(["--model", str(exported), "--output", str(out),
                                                "--push-to-hub", "someone/moh-dit-tiny"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in err and f"the export is complete in {out}" in err
    assert is_export(out) and MoHDiTPipeline.from_pretrained(out).transformer is not None


class _FakeHub:
    """Records the calls push_folder makes; ``fail`` makes upload_folder raise a network error."""

    def __init__(self, exists: bool, fail: bool):
        self.exists, self.fail, self.calls = exists, fail, []

    def repo_exists(self, repo_id):
        self.calls.append(("repo_exists", repo_id))
        return self.exists

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id))

    def upload_folder(self, repo_id, folder_path, commit_message, ignore_patterns=None):
        from huggingface_hub.errors import HTTPError

        self.calls.append(("upload_folder", repo_id, str(folder_path)))
        self.ignored = ignore_patterns
        if self.fail:
            raise HTTPError("connection reset by peer")
        return "https://huggingface.co/someone/m/commit/abc"

    def delete_repo(self, repo_id, missing_ok=False):
        self.calls.append(("delete_repo", repo_id))


def test_push_is_one_upload_and_a_failed_one_leaves_no_new_repo(exported):
    hub = _FakeHub(exists=False, fail=False)
    assert push_folder(exported, "someone/m", api=hub).endswith("/commit/abc")
    assert hub.calls == [("repo_exists", "someone/m"), ("create_repo", "someone/m"),
                         ("upload_folder", "someone/m", str(exported))]
    assert hub.ignored == [OUTPUT_MARKER]  # the local output marker is never pushed
    hub = _FakeHub(exists=False, fail=True)
    with pytest.raises(HubPushError, match="cannot reach the Hugging Face Hub .*connection reset by peer"):
        push_folder(exported, "someone/m", api=hub)
    assert hub.calls[-1] == ("delete_repo", "someone/m")
    hub = _FakeHub(exists=True, fail=True)  # someone's existing repository is never deleted
    with pytest.raises(HubPushError):
        push_folder(exported, "someone/m", api=hub)
    assert [c[0] for c in hub.calls] == ["repo_exists", "upload_folder"]


def _bad_inputs(tmp_path):
    """Inputs for the bad-flag table, all under tmp_path."""
    model = tmp_path / "model"
    MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8).save_pretrained(model)
    MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, in_channels=4).save_pretrained(tmp_path / "latent")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_config.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / INFO_FILE).write_text(json.dumps({"exported_by": "moh_dit.hub.export"}))
    (tmp_path / "done" / "metrics.json").write_text(json.dumps(METRICS))
    (tmp_path / "trained" / "checkpoints").mkdir(parents=True)  # another command's output
    write_output_marker(tmp_path / "trained", "train")
    (tmp_path / "no_metrics.json").write_text(json.dumps({"accuracy": 1.0}))
    (tmp_path / "sweep").mkdir()
    (tmp_path / "usage").mkdir()
    (tmp_path / "usage" / "head_usage.json").write_text(json.dumps({"overall": "not a table"}))
    return model


BAD_FLAGS = [
    (["--model", "{tmp}/missing"], "--model .*missing does not exist"),
    (["--model", "{tmp}/file"], "--model .*file is a file"),
    (["--model", "{tmp}/run"], "training run without final/"),
    (["--model", "{tmp}/latent"], "--model .*latent .*--vae"),
    (["--model", "{tmp}/model", "--vae", "{tmp}/novae"], "--vae .*novae does not exist"),
    (["--model", "{tmp}/model", "--variant", "fp8"], "invalid choice: 'fp8'"),
    (["--model", "{tmp}/model", "--metrics", "{tmp}/none.json"], "--metrics .*none.json does not exist"),
    (["--model", "{tmp}/model", "--metrics", "{tmp}/no_metrics.json"], "--metrics .*no_metrics.json .*fid"),
    (["--model", "{tmp}/model", "--metrics", "{tmp}/file"], "--metrics .*file: .*JSON"),
    (["--model", "{tmp}/model", "--sweep", "{tmp}/sweep"], "--sweep .*sweep.json does not exist"),
    (["--model", "{tmp}/model", "--head-usage", "{tmp}/sweep"], "--head-usage .*head_usage.json does not exist"),
    (["--model", "{tmp}/model", "--head-usage", "{tmp}/usage"], "--head-usage .*usage.*head-usage record"),
    (["--model", "{tmp}/model", "--push-to-hub", "a/b/c"], "--push-to-hub 'a/b/c'"),
    (["--model", "{tmp}/model", "--push-to-hub", "bad name!"], "--push-to-hub 'bad name!'"),
    (["--model", "{tmp}/model", "--license", ""], "--license ''"),
    (["--model", "{tmp}/model", "--output", "{tmp}/file"], "file' exists and is not a folder.*--output-dir"),
    (["--model", "{tmp}/model", "--output", "{tmp}/done"], "done' already exists.*--overwrite"),
    (["--model", "{tmp}/model", "--output", "{tmp}/theirs", "--overwrite"], "theirs'.*not an export"),
    (["--model", "{tmp}/model", "--output", "{tmp}/model/sub"], "--output-dir .*sub lies inside --model"),
    (["--model", "{tmp}/model", "--output", "{tmp}/trained", "--overwrite"], "trained'.*moh-dit train wrote"),
    (["--model", "{tmp}/model", "--output", "{tmp}/done", "--metrics", "{tmp}/done/metrics.json", "--overwrite"],
     "--output-dir .*done contains --metrics"),
    (["--model", "{tmp}/model", "--output", "{tmp}/file/sub"], "is a file"),
]


@pytest.mark.parametrize("argv, match", BAD_FLAGS, ids=[m for _, m in BAD_FLAGS])
def test_bad_flags_are_refused_before_any_work(argv, match, refuses, tmp_path):
    _bad_inputs(tmp_path)
    argv = [a.format(tmp=tmp_path) for a in argv]
    if "--output" not in argv:
        argv += ["--output", str(tmp_path / "out")]
    refuses("export_pipeline", argv, match)
