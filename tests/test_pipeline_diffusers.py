"""MoHDiTPipeline where users step onto diffusers' extension points: the pipeline state a step
callback reads and writes (``guidance_scale``, ``do_classifier_free_guidance``, ``num_timesteps``,
``interrupt``), nested class labels as DiTPipeline takes them, DDIM with clipping as IDDPM's, LoRA
loading the diffusers way, and the two files an exported folder carries loading without moh-dit."""

import pytest
import torch

from moh_dit.diffusion import create_diffusion, make_scheduler

STEPS = 3


def record_model_calls(pipe):
    """Each transformer call's batch size and (cond, uncond) eps halves (uncond None when unguided),
    and each scheduler step's model output."""
    calls, steps = [], []

    def hook(module, args, kwargs, output):
        eps = output.sample[:, :3].detach().clone()
        calls.append((eps.shape[0], *(eps.chunk(2) if kwargs["class_labels"][-1] == 10 else (eps, None))))

    pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    original = pipe.scheduler.step

    def step(model_output, t, sample, **kwargs):
        steps.append(model_output[:, :3].clone())
        return original(model_output, t, sample, **kwargs)

    pipe.scheduler.step = step
    return calls, steps


# ---------------------------------------------------------------- pipeline state and callbacks


def test_a_callback_reads_and_sets_the_guidance_scale(tiny_pipe):
    """diffusers' ``test_callback_cfg``: a callback sees the call's state and adding 1 to
    ``pipe._guidance_scale`` after every step leaves ``start + num_timesteps``; every step guides
    with the scale of that moment, ``uncond + s (cond - uncond)``; a scale of 1 or less drops the
    unconditional half from the next step (diffusers' CFG cut-off), a scale above 1 adds it."""
    pipe = tiny_pipe()
    calls, steps = record_model_calls(pipe)
    seen = []

    def increase(p, i, t, callback_kwargs):
        seen.append((p.guidance_scale, p.do_classifier_free_guidance, p.num_timesteps, p.interrupt))
        p._guidance_scale += 1.0
        return callback_kwargs

    kwargs = dict(num_inference_steps=STEPS, seeds=[0, 1], output_type="latent")
    plain = pipe([1, 2], guidance_scale=2.0, **kwargs).images
    calls.clear(), steps.clear()
    raised = pipe([1, 2], guidance_scale=2.0, callback_on_step_end=increase, **kwargs).images
    assert seen == [(2.0 + i, True, STEPS, False) for i in range(STEPS)] and pipe.guidance_scale == 2.0 + STEPS
    for scale, (_, cond, uncond), eps in zip([2.0, 3.0, 4.0], calls, steps):
        torch.testing.assert_close(eps, uncond + scale * (cond - uncond))
    assert (raised - plain).abs().max() > 1e-3
    for start, scale, batches in ((2.0, 0.0, [4, 2, 2]), (1.0, 3.0, [2, 4, 4])):
        calls.clear(), steps.clear()
        pipe([1, 2], guidance_scale=start, callback_on_step_end=lambda p, i, t, k: setattr(p, "_guidance_scale", scale)
             or k, **kwargs)
        assert [batch for batch, _, _ in calls] == batches
    torch.testing.assert_close(steps[0], calls[0][1])  # unguided: the conditional eps alone


def test_interrupt_stops_the_loop_and_returns_the_latents_so_far(tiny_pipe):
    """``pipe._interrupt = True`` in a callback skips the remaining steps (diffusers' ``continue``);
    the output is the latents after the last step that ran, decoded like any output, and the
    per-step records cover the steps that ran."""
    pipe = tiny_pipe()
    calls, _ = record_model_calls(pipe)
    kept = []

    def stop_after_two(p, i, t, callback_kwargs):
        kept.append(callback_kwargs["latents"].clone())
        p._interrupt = i == 1
        return callback_kwargs

    kwargs = dict(guidance_scale=1.5, num_inference_steps=4, seeds=[0], callback_on_step_end=stop_after_two)
    out = pipe([3], output_type="latent", **kwargs)
    assert len(calls) == 2 and len(kept) == 2 and pipe.interrupt and pipe.num_timesteps == 4
    torch.testing.assert_close(out.images, kept[1], rtol=0, atol=0)
    assert len(out.head_activation_ratios) == 2
    images = pipe([3], output_type="pt", **kwargs).images
    torch.testing.assert_close(images, (kept[-1] / 2 + 0.5).clamp(0, 1), rtol=0, atol=0)
    assert not pipe([3], output_type="latent", **{**kwargs, "callback_on_step_end": None}).images.equal(out.images)
    assert not pipe.interrupt  # every call starts uninterrupted


# ---------------------------------------------------------------- nested labels


def test_nested_class_labels_are_flattened(tiny_pipe):
    """As DiTPipeline (``torch.tensor(class_labels).reshape(-1)``): ``[[1], [2]]`` is ``[1, 2]``;
    names and ids mix at any depth."""
    pipe = tiny_pipe(class_names=["airplane", "automobile", "bird", "cat"] + [f"c{i}" for i in range(4, 10)])
    kwargs = dict(guidance_scale=1.5, num_inference_steps=2, seeds=[0, 1, 2], output_type="latent")
    flat = pipe([1, 2, 3], **kwargs).images
    torch.testing.assert_close(pipe(class_labels=[[1], [2], [3]], **kwargs).images, flat, rtol=0, atol=0)
    torch.testing.assert_close(pipe([(1, "bird"), ["cat"]], **kwargs).images, flat, rtol=0, atol=0)
    assert pipe.get_label_ids([[torch.tensor(4)], [[5, "airplane"]]]) == [4, 5, 0]


# ---------------------------------------------------------------- DDIM with clipping


def iddpm_clipped_ddim(model, label, seed, steps, scale):
    """IDDPM's ``ddim_sample_loop`` (eta 0) with ``clip_denoised=True`` on the ``"ddim{steps}"``
    respacing (stride 1000 // steps when it divides 1000: 0, 200, ..., 800 for 5): x0 from the
    diffusion's ``p_mean_variance`` (clamped to [-1, 1]), eps re-derived from that clipped x0,
    x_prev = sqrt(abar_prev) x0 + sqrt(1 - abar_prev) eps (Song et al. 2021, Eq. 12)."""
    diffusion = create_diffusion(sampling_steps=list(range(0, 1000, 1000 // steps)))
    abar, abar_prev = diffusion.table("alphas_cumprod"), diffusion.table("alphas_cumprod_prev")
    size, null = model.config.sample_size, model.config.num_classes
    x = torch.randn((1, 3, size, size), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for index in reversed(range(diffusion.num_timesteps)):
            t = diffusion.timestep_map[index].reshape(1)
            out = model(torch.cat([x, x]), t.expand(2), torch.tensor([label, null])).sample
            cond, uncond = out[:, :3].chunk(2)
            model_out = torch.cat([uncond + scale * (cond - uncond), out[:1, 3:]], dim=1)
            i = torch.tensor([index])
            x0 = diffusion.p_mean_variance(model_out, x, i, clip_denoised=True)["pred_xstart"]
            a, a_prev = abar[index].float(), abar_prev[index].float()
            eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    return x


def test_clipped_ddim_is_iddpm_clipped_ddim(tiny_pipe):
    """``make_scheduler("ddim", clip_sample=True)`` on a pixel model re-derives eps from the clipped
    x0, as IDDPM's DDIM does; without that re-derivation the images differ."""
    pipe = tiny_pipe()
    pipe.scheduler = make_scheduler("ddim", clip_sample=True)
    ours = pipe([6], guidance_scale=2.0, num_inference_steps=5, seeds=[3], output_type="latent").images
    ref = iddpm_clipped_ddim(pipe.transformer, label=6, seed=3, steps=5, scale=2.0)
    assert ref.abs().max() <= 1.0 + 1e-6 and ref.abs().max() > 0.5
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    original = pipe.scheduler.step
    pipe.scheduler.step = lambda *a, **k: original(*a, **{**k, "use_clipped_model_output": False})
    unclipped_eps = pipe([6], guidance_scale=2.0, num_inference_steps=5, seeds=[3], output_type="latent").images
    assert (unclipped_eps - ref).abs().max() > 1e-3


# ---------------------------------------------------------------- LoRA


def add_lora(pipe, seed=7):
    """A LoRA on the attention projections with non-zero weights (peft starts lora_B at zero);
    lora_alpha != r, so a lost alpha would show."""
    from peft import LoraConfig

    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pipe.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return pipe


@pytest.mark.slow
def test_lora_weights_load_into_the_pipeline_the_diffusers_way(tmp_path, tiny_pipe):
    """What the pipeline's ``save_lora_weights`` or the transformer's ``save_lora_adapter`` wrote,
    ``load_lora_weights`` puts into a fresh pipeline (its images equal the adapter-carrying
    pipeline's); ``unload_lora_weights`` gives the base images back; ``set_adapters`` scales and
    ``fuse_lora`` / ``unfuse_lora`` merge and unmerge."""
    pytest.importorskip("peft")
    from peft.utils import get_peft_model_state_dict

    from moh_dit import MoHDiTPipeline

    kwargs = dict(guidance_scale=1.5, num_inference_steps=2, seeds=[0, 1], output_type="latent")
    base = tiny_pipe()([1, 2], **kwargs).images
    pipe = add_lora(tiny_pipe())
    lora = pipe([1, 2], **kwargs).images
    assert (lora - base).abs().max() > 1e-2
    layers = get_peft_model_state_dict(pipe.transformer)
    MoHDiTPipeline.save_lora_weights(tmp_path / "pipeline", transformer_lora_layers=layers,
                                     transformer_lora_adapter_metadata=pipe.transformer.peft_config["default"].to_dict())
    pipe.transformer.save_lora_adapter(tmp_path / "transformer")  # keys without the "transformer." prefix
    for folder in ("pipeline", "transformer"):
        fresh = tiny_pipe()
        fresh.load_lora_weights(tmp_path / folder, adapter_name="style")
        assert fresh.get_active_adapters() == ["style"]
        torch.testing.assert_close(fresh([1, 2], **kwargs).images, lora, rtol=0, atol=0)
        fresh.unload_lora_weights()
        torch.testing.assert_close(fresh([1, 2], **kwargs).images, base, rtol=0, atol=0)
    # A state dict without metadata loads with alpha = r: set_adapters' weight 2 gives alpha / r = 8 / 4 back.
    fresh = tiny_pipe()
    fresh.load_lora_weights({f"transformer.{k}": v for k, v in layers.items()}, adapter_name="style")
    fresh.set_adapters("style", adapter_weights=2.0)
    torch.testing.assert_close(fresh([1, 2], **kwargs).images, lora, rtol=0, atol=0)
    fresh.fuse_lora()  # merged weights round differently; two guided steps carry that to about 1e-4
    torch.testing.assert_close(fresh([1, 2], **kwargs).images, lora, rtol=1e-3, atol=1e-3)
    assert fresh.num_fused_loras == 1
    fresh.unfuse_lora()
    fresh.unload_lora_weights()
    torch.testing.assert_close(fresh([1, 2], **kwargs).images, base, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- loading in a fresh process, and without moh-dit


@pytest.mark.slow
def test_saved_and_exported_folders_load(tmp_path, tiny_pipe):
    """A fresh process loads a save_pretrained folder with MoHDiTPipeline.from_pretrained; a folder laid
    out as an export (the pipeline file at its root, the model file in transformer/, model_index.json
    naming them) loads through MoHDiTPipeline with moh-dit's classes, running none of the folder's
    code, and, where importing moh_dit fails, with DiffusionPipeline(trust_remote_code=True): the
    same images from the two files alone."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import moh_dit.models.transformer_moh_dit as model_file
    import moh_dit.pipelines.pipeline_moh_dit as pipeline_file

    pipe = tiny_pipe(class_names=[f"c{i}" for i in range(10)])
    kwargs = dict(num_inference_steps=2, seeds=[0, 1], output_type="latent")
    torch.save(pipe(["c3", 4], **kwargs).images, tmp_path / "ref.pt")
    pipe.save_pretrained(tmp_path / "saved")
    shutil.copytree(tmp_path / "saved", tmp_path / "export")
    shutil.copy(pipeline_file.__file__, tmp_path / "export")
    shutil.copy(model_file.__file__, tmp_path / "export" / "transformer")
    index = json.loads((tmp_path / "export" / "model_index.json").read_text())
    index.update(_class_name=["pipeline_moh_dit", "MoHDiTPipeline"],
                 transformer=["transformer_moh_dit", "MoHDiTTransformer2DModel"])
    (tmp_path / "export" / "model_index.json").write_text(json.dumps(index))
    (tmp_path / "export" / "transformer" / "transformer_moh_dit.py").write_text(
        Path(model_file.__file__).read_text() + "\nraise SystemExit('ran')\n")  # must not run here
    check = ("import torch\nref = torch.load('ref.pt')\n"
             "out = pipe(['c3', 4], num_inference_steps=2, seeds=[0, 1], output_type='latent').images\n"
             "assert torch.equal(out, ref) and type(pipe).__module__.startswith(PREFIX), type(pipe).__module__\n")
    installed = ("from moh_dit.pipelines import MoHDiTPipeline\nPREFIX = 'moh_dit'\n"
                 "for folder in ('saved', 'export'):\n    pipe = MoHDiTPipeline.from_pretrained(folder)\n"
                 + "".join("    " + line + "\n" for line in check.splitlines()))
    run = lambda code: subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                                      env={**__import__("os").environ, "HF_MODULES_CACHE": str(tmp_path / "modules")})
    result = run(installed)
    assert result.returncode == 0, result.stderr
    (tmp_path / "export" / "transformer" / "transformer_moh_dit.py").write_text(Path(model_file.__file__).read_text())
    alone = ("import sys\nsys.modules['moh_dit'] = None\nfrom diffusers import DiffusionPipeline\n"
             "pipe = DiffusionPipeline.from_pretrained('export', trust_remote_code=True)\nPREFIX = 'diffusers_modules'\n"
             + check)
    result = run(alone)
    assert result.returncode == 0, result.stderr
