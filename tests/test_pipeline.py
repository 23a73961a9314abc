"""MoHDiTPipeline on tiny models: outputs, determinism, DiT's samplers, head activation,
save/load (pixel space and with a VAE), labels, bad input, CPU offload, and the diffusers
conventions (schedulers swapped with from_config, step callbacks, from_pipe, DiffusionPipeline loading)."""

import inspect

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import (AutoencoderKL, DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler,
                       EulerAncestralDiscreteScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler,
                       HeunDiscreteScheduler, PNDMScheduler, UniPCMultistepScheduler)
from diffusers.callbacks import PipelineCallback

from moh_dit import MoHDiTPipeline, MoHDiTPipelineOutput, MoHDiTTransformer2DModel
from moh_dit.errors import InvalidInput
from moh_dit.models.head_schedule import plan_head_activation
from moh_dit.diffusion.gaussian_diffusion import create_diffusion, space_timesteps
from moh_dit.pipelines.pipeline_moh_dit import imagenet_id2label, make_scheduler

STEPS = 3
NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship, boat", "truck"]


def count_forward(model):
    calls = []
    original = model.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.forward = counted
    return calls


def test_output_types_and_shapes(tiny_pipe):
    pipe = tiny_pipe()
    out = pipe([1, 2, 3], guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1, 2], output_type="np")
    assert isinstance(out, MoHDiTPipelineOutput)
    assert out.images.shape == (3, 8, 8, 3) and out.images.min() >= 0 and out.images.max() <= 1
    assert out.images.std() > 0.01  # random weights: a non-trivial image
    assert [u.shape for u in out.head_usage] == [(4,)] * 6
    assert out.head_activation_ratio == pytest.approx(0.75)
    pil = pipe([1], guidance_scale=1.0, num_inference_steps=STEPS, seeds=[0]).images
    assert isinstance(pil[0], PIL.Image.Image) and pil[0].size == (8, 8)
    pt = pipe([1], num_inference_steps=STEPS, seeds=[0], output_type="pt").images
    assert pt.shape == (1, 3, 8, 8)
    # return_dict=False: (images,) like every diffusers pipeline; head usage and ratio live on the output object.
    (latent,) = pipe([1], num_inference_steps=STEPS, seeds=[0], output_type="latent", return_dict=False)
    torch.testing.assert_close(pt, (latent / 2 + 0.5).clamp(0, 1))


def test_generator_determinism(tiny_pipe):
    pipe = tiny_pipe()
    run = lambda seed: pipe([4, 5], guidance_scale=2.0, num_inference_steps=STEPS, output_type="pt",
                            generator=torch.Generator().manual_seed(seed)).images
    a, b, c = run(0), run(0), run(1)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - c).abs().max() > 1e-3


def test_image_independent_of_batch(tiny_pipe):
    """Image i comes out the same alone or in a batch: its own initial noise *and* its own
    DDPM step noise (the scheduler's single-generator draw would mix the batch). A float64
    model makes it exact; in float32 CPU matmuls differ by ~1e-6 between batch sizes, which
    the 1/sqrt(alpha_bar) of the x0 prediction amplifies (see the float32 check)."""
    pipe = tiny_pipe()
    kwargs = dict(guidance_scale=1.5, num_inference_steps=STEPS, output_type="latent")
    batch = pipe([3, 7, 1], seeds=[10, 11, 12], **kwargs).images
    alone = pipe([7], seeds=[11], **kwargs).images
    torch.testing.assert_close(alone[0], batch[1], rtol=1e-2, atol=1e-2)
    pipe.transformer.to(torch.float64)
    batch = pipe([3, 7, 1], seeds=[10, 11, 12], **kwargs).images
    alone = pipe([7], seeds=[11], **kwargs).images
    torch.testing.assert_close(alone[0], batch[1], rtol=0, atol=0)
    mixed = pipe([3, 7, 1], generator=torch.Generator().manual_seed(11), **kwargs).images
    assert (mixed[1] - alone[0]).abs().max() > 1e-2


def dit_reference_sample(model, label, seed, steps, scale, clip):
    """DiT's sampler: IDDPM's respaced p_sample_loop with DiT's forward_with_cfg (guides
    the first three eps channels; the rest and the variance from the conditional half)."""
    diffusion = create_diffusion(sampling_steps=steps)
    steps = diffusion.num_timesteps
    size, channels = model.config.sample_size, model.config.in_channels
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((1, channels, size, size), generator=gen)
    null = model.config.num_classes
    with torch.no_grad():
        for index in reversed(range(steps)):
            t = diffusion.timestep_map[index].reshape(1)
            out = model(torch.cat([x, x]), t.expand(2), torch.tensor([label, null])).sample
            eps, rest = out[:, :3], out[:, 3:]
            cond, uncond = eps.chunk(2)
            guided = uncond + scale * (cond - uncond)
            model_out = torch.cat([guided, rest[:1]], dim=1)
            noise = torch.randn(x.shape, generator=gen) if index > 0 else torch.zeros_like(x)
            x = diffusion.p_sample(model_out, x, torch.tensor([index]), noise=noise, clip_denoised=clip)["sample"]
    return x


def test_ddpm_matches_dit_sampler(tiny_pipe, tiny_vae):
    """Default DDPM (learned range, linspace spacing) + guidance_channels="dit" is DiT's
    sampler; on a 4-channel latent model "all" guides the 4th eps channel too."""
    pipe = tiny_pipe(seed=2, in_channels=4, vae=tiny_vae(seed=5, std=0.1))
    steps = 6
    assert pipe.scheduler.config.timestep_spacing == "linspace"
    pipe.scheduler.set_timesteps(steps)
    assert pipe.scheduler.timesteps.tolist() == space_timesteps(1000, steps)[::-1]
    ref = dit_reference_sample(pipe.transformer, label=6, seed=3, steps=steps, scale=3.0, clip=False)
    kwargs = dict(guidance_scale=3.0, num_inference_steps=steps, seeds=[3], output_type="latent")
    dit = pipe([6], guidance_channels="dit", **kwargs).images
    torch.testing.assert_close(dit, ref, rtol=1e-4, atol=1e-4)
    every = pipe([6], guidance_channels="all", **kwargs).images
    assert (every - dit).abs().max() > 1e-3


def test_clip_sample_and_custom_timesteps_match_dit(tiny_pipe):
    """clip_sample=True is IDDPM's clip_denoised; explicit ADM section respacing ("3,2":
    3 steps from [0, 500), 2 from [500, 1000)) through ``timesteps=``."""
    pipe = tiny_pipe()
    pipe.scheduler = make_scheduler("ddpm", clip_sample=True)
    kept = space_timesteps(1000, "3,2")
    ours = pipe([2], guidance_scale=2.0, timesteps=kept[::-1], seeds=[1], output_type="latent").images
    ref = dit_reference_sample(pipe.transformer, label=2, seed=1, steps="3,2", scale=2.0, clip=True)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_no_unconditional_half_without_guidance(tiny_pipe):
    pipe = tiny_pipe()
    seen = []
    original = pipe.transformer.forward
    pipe.transformer.forward = lambda x, *a, **k: (seen.append(x.shape[0]), original(x, *a, **k))[1]
    pipe([1, 2], guidance_scale=1.0, num_inference_steps=2, seeds=[0, 1], output_type="latent")
    pipe([1, 2], guidance_scale=1.5, num_inference_steps=2, seeds=[0, 1], output_type="latent")
    assert seen == [2, 2, 4, 4]


def test_head_activation_ratio_per_call(tiny_pipe):
    pipe = tiny_pipe()
    model = pipe.transformer
    model.set_head_activation_ratio(0.875)  # a non-trained setting the call must give back
    before = model.top_k_per_layer
    kwargs = dict(guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1], output_type="latent")
    low = pipe([1, 2], head_activation_ratio=0.5, **kwargs)
    assert model.top_k_per_layer == before
    default = pipe([1, 2], **kwargs)
    assert low.head_activation_ratio == pytest.approx(0.5)
    assert default.head_activation_ratio == pytest.approx(0.875)
    heads = torch.tensor([4.0] * 6)
    # Head-weighted usage of the run equals the realised ratio (every token uses hs + K heads).
    for out in (low, default):
        used = sum(u.sum() for u in out.head_usage) / heads.sum()
        assert used.item() == pytest.approx(out.head_activation_ratio, abs=1e-6)
    assert (low.images - default.images).abs().max() > 1e-4


def record_head_usage_requests(model):
    """Wrap ``model.forward``: the ``output_head_usage`` of each call."""
    asked, original = [], model.forward

    def forward(*args, **kwargs):
        asked.append(kwargs.get("output_head_usage", False))
        return original(*args, **kwargs)

    model.forward = forward
    return asked


def test_head_usage_only_when_asked(tiny_pipe):
    """``output_head_usage=False``: no transformer call computes routing statistics, the output
    has no usage, and the images are the same as with it."""
    pipe = tiny_pipe()
    asked = record_head_usage_requests(pipe.transformer)
    kwargs = dict(guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1], head_activation_ratio=0.5,
                  output_type="latent")
    with_usage = pipe([1, 2], **kwargs)
    assert asked == [True] * STEPS and len(with_usage.head_usage) == 6  # the default keeps the usage
    asked.clear()
    without = pipe([1, 2], output_head_usage=False, **kwargs)
    assert asked == [False] * STEPS
    assert without.head_usage is None and without.head_activation_ratio == with_usage.head_activation_ratio
    torch.testing.assert_close(without.images, with_usage.images, rtol=0, atol=0)
    (images,) = pipe([1, 2], output_head_usage=False, return_dict=False, **kwargs)
    torch.testing.assert_close(images, with_usage.images, rtol=0, atol=0)


def test_ratio_and_train_mode_restored_on_error(tiny_pipe):
    pipe = tiny_pipe()
    model = pipe.transformer.train()
    before = model.top_k_per_layer

    def boom(*args, **kwargs):
        raise RuntimeError("scheduler failed")

    pipe.scheduler.step = boom
    with pytest.raises(RuntimeError, match="scheduler failed"):
        pipe([1], head_activation_ratio=1.0, num_inference_steps=STEPS, seeds=[0])
    assert model.top_k_per_layer == before and model.training


def test_train_mode_model_samples_like_eval(tiny_pipe):
    """Label dropout must not act while sampling; the model's mode is given back."""
    pipe = tiny_pipe(class_dropout_prob=0.9)
    kwargs = dict(guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1], output_type="latent")
    ref = pipe([1, 2], **kwargs).images
    pipe.transformer.train()
    torch.testing.assert_close(pipe([1, 2], **kwargs).images, ref)
    assert pipe.transformer.training


def test_save_load_roundtrip_pixel_space(tmp_path, tiny_pipe):
    pipe = tiny_pipe(class_names=NAMES)
    pipe.scheduler = make_scheduler("ddpm", clip_sample=True)
    kwargs = dict(guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1], output_type="pt")
    ref = pipe(["cat", "boat"], **kwargs).images
    pipe.save_pretrained(tmp_path)
    loaded = MoHDiTPipeline.from_pretrained(tmp_path)
    assert loaded.vae is None and isinstance(loaded.scheduler, DDPMScheduler)
    assert loaded.scheduler.config.clip_sample is True
    assert loaded.id2label == dict(enumerate(NAMES)) and loaded.config.id2label == pipe.config.id2label
    torch.testing.assert_close(loaded(["cat", "boat"], **kwargs).images, ref, rtol=0, atol=0)


def test_custom_id2label_saved(tmp_path, tiny_pipe):
    pipe = MoHDiTPipeline(transformer=tiny_pipe().transformer, scheduler=make_scheduler("ddim"),
                          id2label={0: "zero", "9": "nine"})
    pipe.save_pretrained(tmp_path)
    loaded = MoHDiTPipeline.from_pretrained(tmp_path)
    assert loaded.id2label == {0: "zero", 9: "nine"} and isinstance(loaded.scheduler, DDIMScheduler)
    assert loaded.get_label_ids(["Nine", 3]) == [9, 3]


def test_vae_pipeline_and_roundtrip(tmp_path, tiny_pipe, tiny_vae):
    pipe = tiny_pipe(seed=2, in_channels=4, vae=tiny_vae(seed=5, std=0.1))
    kwargs = dict(guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1], output_type="pt")
    out = pipe([1, 9], **kwargs)
    assert out.images.shape == (2, 3, 16, 16)  # 8x8x4 latents, VAE downsampling 2
    latents = pipe([1, 9], **{**kwargs, "output_type": "latent"}).images
    with torch.no_grad():
        decoded = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
    torch.testing.assert_close(out.images, (decoded / 2 + 0.5).clamp(0, 1))
    pipe.save_pretrained(tmp_path)
    loaded = MoHDiTPipeline.from_pretrained(tmp_path)
    assert isinstance(loaded.vae, AutoencoderKL)
    torch.testing.assert_close(loaded([1, 9], **kwargs).images, out.images, rtol=0, atol=0)


def test_model_cpu_offload(tiny_pipe, tiny_vae):
    """Offload hooks run on a CPU-only machine with device="cpu" (on a GPU machine the
    default accelerator is used); the output must not change and the models end on the CPU."""
    pipe = tiny_pipe(seed=2, in_channels=4, vae=tiny_vae(seed=5, std=0.1))
    kwargs = dict(guidance_scale=1.5, num_inference_steps=2, seeds=[0], output_type="pt")
    ref = pipe([3], **kwargs).images
    pipe.enable_model_cpu_offload(device="cpu")
    torch.testing.assert_close(pipe([3], **kwargs).images, ref)
    assert pipe._execution_device.type == "cpu"
    assert next(pipe.transformer.parameters()).device.type == "cpu"


def record_steps(scheduler):
    """Wrap ``scheduler.step``: each call's (model_output, t, sample, prev_sample)."""
    seen, original = [], scheduler.step

    def step(model_output, t, sample, **kwargs):
        out = original(model_output, t, sample, **kwargs)
        seen.append((model_output.clone(), int(t), sample.clone(), out.prev_sample.clone()))
        return out

    scheduler.step = step
    return seen


def test_other_schedulers_use_eps_half(tiny_pipe):
    """DDIM, DPM-Solver++ and fixed-variance DDPM get the eps half only, on the paper's schedule
    (1000 linear betas 1e-4..0.02) respaced as hand-computed below, and their last step
    lands on the x0 prediction ``(x - sqrt(1 - abar_t) eps) / sqrt(abar_t)``, abar from those betas."""
    pipe = tiny_pipe()
    abar = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000, dtype=np.float64))
    # DDPM: "linspace" spacing of 3 steps over 0..999, round(linspace(0, 999, 3)) reversed; DPM-Solver
    # takes round(linspace(0, 999, 4)) reversed without its last entry; DDIM strides by 1000 // 3.
    kept = {DDIMScheduler: [666, 333, 0], DPMSolverMultistepScheduler: [999, 666, 333], DDPMScheduler: [999, 500, 0]}
    for scheduler in (make_scheduler("ddim"), make_scheduler("dpm"),
                      DDPMScheduler.from_config(make_scheduler("ddpm").config, variance_type="fixed_small")):
        pipe.scheduler = scheduler
        torch.testing.assert_close(scheduler.betas, torch.linspace(1e-4, 0.02, 1000), rtol=0, atol=0)
        seen = record_steps(scheduler)
        out = pipe([1, 2], guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1], output_type="latent")
        assert out.images.shape == (2, 3, 8, 8) and torch.isfinite(out.images).all()
        assert [t for _, t, _, _ in seen] == kept[type(scheduler)]
        assert all(eps.shape == (2, 3, 8, 8) for eps, _, _, _ in seen)  # the eps half of the 6 channels
        eps, t, x, prev = seen[-1]
        x0 = (x.double() - np.sqrt(1 - abar[t]) * eps.double()) / np.sqrt(abar[t])
        torch.testing.assert_close(prev.double(), x0, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(out.images, prev, rtol=0, atol=0)


def test_label_names(tiny_pipe):
    pipe = tiny_pipe(class_names=NAMES)
    assert pipe.get_label_ids(["Cat", " DOG ", "ship", "boat", 0, np.int64(4), torch.tensor(7)]) == [3, 5, 8, 8, 0, 4, 7]
    assert pipe.get_label_ids("truck") == [9]
    assert pipe.get_label_ids(10) == [10]  # the null class: an unconditional sample
    assert pipe.labels["boat"] == 8


def test_imagenet_names_by_default(randomize, tiny_pipe):
    model = randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8, num_classes=1000)).eval()
    pipe = MoHDiTPipeline(transformer=model, scheduler=make_scheduler("ddpm"))
    assert pipe.id2label == imagenet_id2label() and len(pipe.id2label) == 1000
    assert pipe.get_label_ids(["golden retriever", "Tench", "Cardigan", "cardigan"]) == [207, 0, 264, 474]
    with pytest.raises(ValueError, match=r"ambiguous: 264 \('Cardigan'\), 474 \('cardigan'\)"):
        pipe.get_label_ids("CARDIGAN")
    out = pipe(["tench", 1000], guidance_scale=1.5, num_inference_steps=2, seeds=[0, 1], output_type="latent")
    assert out.head_activation_ratio == 1.0 and all((u == 1).all() for u in out.head_usage)
    # No names for a 10-class model without class_names.
    with pytest.raises(ValueError, match="no class names"):
        tiny_pipe().get_label_ids("cat")


@pytest.mark.parametrize(
    "kwargs, parameter, fact",
    [
        (dict(class_labels=["kat"]), "class_labels", "'cat'"),  # the close name is suggested
        (dict(class_labels=[11]), "class_labels", "0..9"),
        (dict(class_labels=[-1]), "class_labels", "-1"),
        (dict(class_labels=[]), "class_labels", "empty"),
        (dict(class_labels=[1.5]), "class_labels", "1.5"),
        (dict(class_labels=[1], head_activation_ratio=0.1), "head_activation_ratio", "[0.5000, 1.0000]"),
        (dict(class_labels=[1], head_activation_ratio=float("nan")), "head_activation_ratio", "nan"),
        (dict(class_labels=[1], head_activation_ratio="linear:0.1:1"), "head_activation_ratio", "0.1000 at step 0"),
        (dict(class_labels=[1], head_activation_ratio=[1.0, 0.5]), "head_activation_ratio", "2 per-step ratios"),
        (dict(class_labels=[1], guidance_scale=0.5), "guidance_scale", "0.5"),
        # inf used to sample to all-NaN latents, returned as black images.
        (dict(class_labels=[1], guidance_scale=float("inf")), "guidance_scale", "inf"),
        (dict(class_labels=[1], guidance_scale=float("nan")), "guidance_scale", "nan"),
        (dict(class_labels=[1], guidance_scale="2"), "guidance_scale", "'2'"),
        (dict(class_labels=[1], num_inference_steps=0), "num_inference_steps", "got 0"),
        (dict(class_labels=[1], num_inference_steps=1001), "num_inference_steps", "1..1000"),
        (dict(class_labels=[1], num_inference_steps=2.0), "num_inference_steps", "2.0"),
        (dict(class_labels=[1], timesteps=[500, 999], num_inference_steps=None), "timesteps", "[500, 999]"),
        (dict(class_labels=[1], timesteps=[1000, 5], num_inference_steps=None), "timesteps", "[0, 999]"),
        (dict(class_labels=[1], timesteps=[], num_inference_steps=None), "timesteps", "[]"),
        (dict(class_labels=[1], eta=float("nan")), "eta", "nan"),
        (dict(class_labels=[1], eta=1.5), "eta", "1.5"),
        (dict(class_labels=[1], seeds=[1.5]), "seeds", "1.5"),
        (dict(class_labels=[1], seeds=[2**64]), "seeds", str(2**64)),
        (dict(class_labels=[1], latents=torch.full((1, 3, 8, 8), float("nan"))), "latents", "NaN"),
        (dict(class_labels=[1], guidance_channels="first3"), "guidance_channels", "'first3'"),
        (dict(class_labels=[1, 2], seeds=[0]), "seeds", "2 class labels"),
        (dict(class_labels=[1], seeds=[0], generator=torch.Generator()), "generator", "seeds"),
        (dict(class_labels=[1, 2], generator=[torch.Generator()]), "generator", "2 class labels"),
        (dict(class_labels=[1], output_type="jpg"), "output_type", "'jpg'"),
        (dict(class_labels=[1], latents=torch.zeros(1, 3, 4, 4)), "latents", "(1, 3, 8, 8)"),
        (dict(class_labels=[1], timesteps=[999, 500, 0], num_inference_steps=None), "timesteps", "DDIMScheduler"),
    ],
)
def test_bad_input_raises_before_compute(kwargs, parameter, fact, tiny_pipe):
    """Every bad argument is refused by check_inputs before any compute: an InvalidInput (a
    ValueError) whose ``parameters`` name it, and whose message holds the value or limit."""
    pipe = tiny_pipe(class_names=NAMES)
    if fact == "DDIMScheduler":  # custom timesteps: fine for DDPM, refused by DDIM
        pipe.scheduler = make_scheduler("ddim")
    calls = count_forward(pipe.transformer)
    before = pipe.transformer.top_k_per_layer
    with pytest.raises(InvalidInput) as caught:
        pipe(**{"num_inference_steps": STEPS, **kwargs})
    assert parameter in caught.value.parameters and fact in str(caught.value), (caught.value.parameters, caught.value)
    assert not calls and pipe.transformer.top_k_per_layer == before


def test_a_python_caller_reads_parameters_and_a_command_its_flags(tiny_pipe, load_script, tmp_path, capsys):
    """The library names the parameter (never a flag); moh-dit sample shows the same check of the
    same value with its flag."""
    pipe = tiny_pipe()
    for kwargs, parameter in ((dict(num_inference_steps=5000), "num_inference_steps"),
                              (dict(head_activation_ratio=0.2), "head_activation_ratio")):
        with pytest.raises(InvalidInput) as caught:
            pipe([1], **kwargs)
        assert parameter in str(caught.value) and "--" not in str(caught.value)
    pipe.transformer.save_pretrained(tmp_path / "model")
    base = ["--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "out"), "--num-samples", "1"]
    for flag, value, parameter in (("--num-inference-steps", "5000", "num_inference_steps"),
                                   ("--head-activation-ratio", "0.2", "head_activation_ratio")):
        assert load_script("sample").cli(base + [flag, value]) == 1
        err = capsys.readouterr().err
        assert f"{flag}={value}" in err and parameter not in err, err
    assert not (tmp_path / "out").exists()


def test_check_inputs_is_callable_alone_and_its_plan_is_the_calls(tiny_pipe, monkeypatch):
    """check_inputs runs nothing; for a schedule it returns the plan, and a call plans (and
    copies the scheduler) once, in its check."""
    import moh_dit.pipelines.pipeline_moh_dit as module

    pipe = tiny_pipe()
    calls = count_forward(pipe.transformer)
    assert pipe.check_inputs([1, 2], 1.5, 250, head_activation_ratio=0.6, seeds=[0, 1]) is None  # valid, one ratio
    plan = pipe.check_inputs([1], 1.5, 4, head_activation_ratio="linear:0.5:1.0")
    assert plan.requested == pytest.approx([0.5, 2 / 3, 5 / 6, 1.0]) and plan.timesteps == [999, 666, 333, 0]
    with pytest.raises(InvalidInput) as caught:
        pipe.check_inputs([1], float("inf"), 2)
    assert caught.value.parameters == ("guidance_scale",)
    assert not calls
    planned, copied = [], []
    monkeypatch.setattr(module, "plan_head_activation",
                        lambda *a: planned.append(1) or plan_head_activation(*a))
    deepcopy = module.copy.deepcopy
    monkeypatch.setattr(module.copy, "deepcopy", lambda x, *a: copied.append(type(x).__name__) or deepcopy(x, *a))
    out = pipe([1], guidance_scale=1.5, num_inference_steps=4, head_activation_ratio="linear:0.5:1.0", seeds=[0],
               output_type="latent")
    assert len(planned) == 1 and [name for name in copied if name.endswith("Scheduler")] == ["DDPMScheduler"]
    assert out.head_activation_ratios == plan.realised


def test_non_finite_latents_name_the_step(tiny_pipe):
    """A NaN that appears mid-run is an error naming the step, not a black image."""
    pipe = tiny_pipe()
    calls = []

    def poison(module, args, output):  # NaN out of the third transformer call (step index 2)
        calls.append(1)
        if len(calls) == 3:
            output.sample.fill_(float("nan"))
        return output

    handle = pipe.transformer.register_forward_hook(poison)
    pipe.scheduler.set_timesteps(5)
    timestep = int(pipe.scheduler.timesteps[2])
    with pytest.raises(ValueError, match=rf"NaN/inf latents at step 3 of 5 \(step index 2, timestep {timestep}\)"):
        pipe([1], guidance_scale=1.5, num_inference_steps=5, seeds=[0])
    assert len(calls) == 3  # on the CPU the run stops at the bad step
    handle.remove()
    # A finite but huge guidance scale overflows float32 at the first step.
    with pytest.raises(ValueError, match=r"step 1 of 2 .*guidance_scale=1e\+300"):
        pipe([1], guidance_scale=1e300, num_inference_steps=2, seeds=[0])
    assert pipe.transformer.top_k_per_layer == pipe.transformer.trained_top_k  # state restored


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_non_finite_latents_on_cuda_are_found_after_the_loop(tiny_pipe):
    """On CUDA the check makes no per-step host sync: the run goes on to the end, and the error
    still names the first bad step."""
    pipe = tiny_pipe().to("cuda")
    calls = []

    def poison(module, args, output):
        calls.append(1)
        if len(calls) == 2:
            output.sample.fill_(float("nan"))
        return output

    pipe.transformer.register_forward_hook(poison)
    with pytest.raises(ValueError, match=r"at step 2 of 4 \(step index 1, "):
        pipe([1], guidance_scale=1.5, num_inference_steps=4, seeds=[0])
    assert len(calls) == 4


def test_deferred_finite_watch_names_first_bad_step():
    """The accelerator path (no per-step host sync) keeps the first bad step on the device."""
    from moh_dit.pipelines.finite_watch import FiniteWatch

    watch = FiniteWatch(torch.device("cpu"), 6, eager=False)
    good, bad = torch.zeros(2, 3), torch.tensor([[0.0, float("inf"), 0.0]])
    for index, x in enumerate([good, good, good, bad, good, bad]):
        assert watch.update(index, x) is False  # never asks to stop: that would need a sync
    assert torch.is_tensor(watch.first_bad) and watch.first_bad_step() == 3
    clean = FiniteWatch(torch.device("cpu"), 3, eager=False)
    for index in range(3):
        clean.update(index, good)
    assert clean.first_bad_step() is None


def test_scheduler_model_mismatch_rejected(randomize):
    fixed = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, learn_sigma=False)).eval()
    pipe = MoHDiTPipeline(transformer=fixed, scheduler=make_scheduler("ddpm"))
    with pytest.raises(ValueError, match="does not learn sigma"):
        pipe([1], num_inference_steps=2)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)  # eps only: fine without variance channels
    assert pipe([1], num_inference_steps=2, seeds=[0], output_type="latent").images.shape == (1, 3, 8, 8)


def test_constructor_checks(randomize, tiny_pipe):
    latent_model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, in_channels=4))
    with pytest.raises(InvalidInput) as caught:  # a latent model without its VAE
        MoHDiTPipeline(transformer=latent_model, scheduler=make_scheduler())
    assert caught.value.parameters == ("vae",) and "4-channel" in str(caught.value)
    with pytest.raises(InvalidInput) as caught:
        tiny_pipe().__class__(transformer=tiny_pipe().transformer, scheduler=make_scheduler(),
                                       id2label={10: "x"})
    assert caught.value.parameters == ("id2label",) and "id 10" in str(caught.value)


# ---------------------------------------------------------------- diffusers conventions

SWAPPED = [
    (DDPMScheduler, {}),
    (DDIMScheduler, {}),
    (DPMSolverMultistepScheduler, {}),  # DPM-Solver++ (the DDPM config's algorithm_type default)
    # Plain DPM-Solver (deprecated in diffusers) cannot end on sigma 0.
    (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver", "final_sigmas_type": "sigma_min"}),
    (EulerDiscreteScheduler, {}),
    (EulerAncestralDiscreteScheduler, {}),
    (HeunDiscreteScheduler, {}),
    (UniPCMultistepScheduler, {}),
    (PNDMScheduler, {}),
]


@pytest.mark.filterwarnings("ignore:.*algorithm_type dpmsolver is deprecated:FutureWarning")
@pytest.mark.parametrize("scheduler_cls, overrides", SWAPPED, ids=lambda v: getattr(v, "__name__", str(v)))
def test_any_scheduler_swapped_the_diffusers_way(scheduler_cls, overrides, tiny_pipe, tiny_vae):
    """``X.from_config(pipe.scheduler.config)`` samples: DDPM's step gets the learned-range variance
    channels, every other scheduler the whole eps half, whatever variance_type the DDPM config
    carried over (DPM-Solver would otherwise cut a 4-channel latent eps to 3 channels)."""
    pipe = tiny_pipe(seed=2, in_channels=4, vae=tiny_vae(seed=5, std=0.1))
    pipe.scheduler = scheduler_cls.from_config(pipe.scheduler.config, **overrides)
    assert pipe.scheduler.config.variance_type == "learned_range"  # the stale key is there
    seen = record_steps(pipe.scheduler)
    steps = 4 if scheduler_cls is PNDMScheduler else 3  # PNDM's Runge-Kutta warm-up needs 4 steps
    out = pipe([1, 9], guidance_scale=1.0, num_inference_steps=steps, seeds=[0, 1], output_type="np")
    assert out.images.shape == (2, 16, 16, 3) and np.isfinite(out.images).all()
    assert {eps.shape[1] for eps, _, _, _ in seen} == {8 if scheduler_cls is DDPMScheduler else 4}
    assert pipe.scheduler.config.variance_type == "learned_range"  # given back after the call


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda config: FlowMatchEulerDiscreteScheduler.from_config(config),
         r"FlowMatchEulerDiscreteScheduler is not a DDPM-family scheduler .* use DDPMScheduler, DDIMScheduler"),
        (lambda config: DDIMScheduler.from_config(config, prediction_type="v_prediction"),
         r"DDIMScheduler has prediction_type='v_prediction'.*prediction_type='epsilon'"),
        (lambda config: DDPMScheduler.from_config(config, prediction_type="sample"),
         r"DDPMScheduler has prediction_type='sample'"),
        (lambda config: DDPMScheduler.from_config(config, variance_type="learned"),
         r"variance_type='learned_range'"),
    ],
)
def test_scheduler_that_cannot_serve_the_model_is_refused(make, message, tiny_pipe):
    pipe = tiny_pipe()
    pipe.scheduler = make(pipe.scheduler.config)
    calls = count_forward(pipe.transformer)
    with pytest.raises(ValueError, match=message):
        pipe([1], num_inference_steps=2, seeds=[0])
    assert not calls


def test_default_steps_and_guidance_are_dit_pipelines():
    from diffusers import DiTPipeline

    ours, theirs = (inspect.signature(c.__call__).parameters for c in (MoHDiTPipeline, DiTPipeline))
    for name in ("num_inference_steps", "guidance_scale", "output_type", "return_dict"):
        assert ours[name].default == theirs[name].default, name


def test_callback_on_step_end(tiny_pipe):
    """diffusers' semantics: called after each step with (pipe, step_index, timestep, kwargs); the
    returned ``latents`` replace the latents; names outside ``_callback_tensor_inputs`` are refused."""
    pipe = tiny_pipe()
    kwargs = dict(guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1], output_type="latent")
    seen = record_steps(pipe.scheduler)
    calls = []

    def callback(p, step_index, timestep, callback_kwargs):
        calls.append((p, step_index, int(timestep), callback_kwargs["latents"].clone()))
        return {"latents": callback_kwargs["latents"] * 0 if step_index == STEPS - 1 else callback_kwargs["latents"]}

    out = pipe([1, 2], callback_on_step_end=callback, **kwargs)
    assert [(p, i, t) for p, i, t, _ in calls] == [(pipe, i, t) for i, (_, t, _, _) in enumerate(seen)]
    for (_, _, _, latents), (_, _, _, prev) in zip(calls, seen):
        torch.testing.assert_close(latents, prev, rtol=0, atol=0)  # after the step
    assert (out.images == 0).all()  # the last replacement is the output

    class Zero(PipelineCallback):
        tensor_inputs = ["latents"]

        def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
            return {"latents": torch.zeros_like(callback_kwargs["latents"])}

    assert (pipe([1, 2], callback_on_step_end=Zero(), **kwargs).images == 0).all()
    forward = count_forward(pipe.transformer)
    with pytest.raises(InvalidInput) as caught:
        pipe([1, 2], callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["latents", "noise"], **kwargs)
    assert caught.value.parameters == ("callback_on_step_end_tensor_inputs",) and "'noise'" in str(caught.value)
    assert not forward


def test_from_pipe(tiny_pipe):
    pipe = tiny_pipe(class_names=NAMES)
    other = MoHDiTPipeline.from_pipe(pipe)
    assert other.transformer is pipe.transformer and other.scheduler is pipe.scheduler
    assert other.id2label == pipe.id2label
    kwargs = dict(guidance_scale=1.5, num_inference_steps=2, seeds=[0], output_type="latent")
    torch.testing.assert_close(other(["cat"], **kwargs).images, pipe(["cat"], **kwargs).images, rtol=0, atol=0)


def test_save_pretrained_loads_with_diffusion_pipeline(tmp_path, tiny_pipe, monkeypatch):
    """``DiffusionPipeline.from_pretrained`` of a ``save_pretrained`` folder: refused with diffusers'
    "pass trust_remote_code=True" line, then the same pipeline class and images with it; the folder's
    module file only imports the installed package."""
    import diffusers.utils.dynamic_modules_utils as dynamic
    from diffusers import DiffusionPipeline

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # diffusers copies the file there
    pipe = tiny_pipe(class_names=NAMES)
    pipe.save_pretrained(tmp_path / "saved")
    kwargs = dict(guidance_scale=1.5, num_inference_steps=2, seeds=[0, 1], output_type="latent")
    with pytest.raises(ValueError, match=r"Pass `trust_remote_code=True`"):
        DiffusionPipeline.from_pretrained(tmp_path / "saved")
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "saved", trust_remote_code=True)
    assert type(loaded) is MoHDiTPipeline and loaded.id2label == pipe.id2label
    torch.testing.assert_close(loaded(["cat", 3], **kwargs).images, pipe(["cat", 3], **kwargs).images, rtol=0, atol=0)
    again = MoHDiTPipeline.from_pretrained(tmp_path / "saved")  # no trust_remote_code: the folder's file is not run
    torch.testing.assert_close(again(["cat", 3], **kwargs).images, pipe(["cat", 3], **kwargs).images, rtol=0, atol=0)
    # ... and through diffusers' own loader, which takes all of its usual arguments
    again = MoHDiTPipeline.from_pretrained(tmp_path / "saved", low_cpu_mem_usage=True, local_files_only=True)
    assert type(again) is MoHDiTPipeline
    torch.testing.assert_close(again(["cat", 3], **kwargs).images, pipe(["cat", 3], **kwargs).images, rtol=0, atol=0)


def test_ddim_is_dit_ddim(tiny_pipe):
    """make_scheduler("ddim") through the pipeline equals DDIM (eta 0) written from its formula,
    x_prev = sqrt(a_prev) x0_pred + sqrt(1 - a_prev) eps, on DiT's strided timesteps ("ddim10":
    0, 100, ..., 900; a linspace spacing would take 999, 888, ...)."""
    pipe = tiny_pipe()
    pipe.scheduler = make_scheduler("ddim")
    model, steps = pipe.transformer, 10
    abar = torch.from_numpy(np.cumprod(1 - np.linspace(1e-4, 0.02, 1000)))
    x = torch.randn((1, 3, 8, 8), generator=torch.Generator().manual_seed(4)).double()
    timesteps = list(range(0, 1000, 100))[::-1]
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            eps = model(x.float(), torch.tensor([t]), torch.tensor([3])).sample[:, :3].double()
            a, a_prev = abar[t], abar[timesteps[i + 1]] if i + 1 < steps else torch.tensor(1.0, dtype=torch.float64)
            x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    ours = pipe([3], guidance_scale=1.0, num_inference_steps=steps, seeds=[4], output_type="latent").images
    torch.testing.assert_close(ours.double(), x, rtol=1e-4, atol=1e-4)
