"""MoHDiTPipeline on tiny models: DiT's samplers (DDPM, DDIM, clipped, respaced), images that do not
depend on their batch, the head activation ratio per call and per step, head usage, labels, the
one check of the inputs, schedulers swapped the diffusers way, save/load and CPU offload."""

import math

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import (AutoencoderKL, DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler,
                       EulerAncestralDiscreteScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler,
                       HeunDiscreteScheduler, PNDMScheduler, UniPCMultistepScheduler)

from moh_dit.diffusion import create_diffusion, space_timesteps
from moh_dit.models import MoHDiTTransformer2DModel
from moh_dit.pipelines import MoHDiTPipeline, MoHDiTPipelineOutput, make_scheduler

STEPS = 3
NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship, boat", "truck"]


def test_output_types_and_shapes(tiny_pipe):
    pipe = tiny_pipe()
    out = pipe([1, 2, 3], guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1, 2], output_type="np")
    assert isinstance(out, MoHDiTPipelineOutput)
    assert out.images.shape == (3, 8, 8, 3) and out.images.min() >= 0 and out.images.max() <= 1
    assert out.images.std() > 0.01  # random weights: a non-trivial image
    assert [u.shape for u in out.head_usage] == [(4,)] * 6
    assert out.head_activation_ratio == pytest.approx(0.75) and out.head_activation_ratios == [0.75] * STEPS
    batches = []
    pipe.transformer.register_forward_pre_hook(lambda module, args, kwargs: batches.append(args[0].shape[0]),
                                               with_kwargs=True)
    pil = pipe([1], 1.0, None, STEPS, seeds=[0]).images  # DiTPipeline's positional order; guidance off
    assert batches == [1] * STEPS  # no unconditional half without guidance
    assert isinstance(pil[0], PIL.Image.Image) and pil[0].size == (8, 8)
    pt = pipe([1], num_inference_steps=STEPS, seeds=[0], output_type="pt").images
    assert pt.shape == (1, 3, 8, 8)
    (latent,) = pipe([1], num_inference_steps=STEPS, seeds=[0], output_type="latent", return_dict=False)
    torch.testing.assert_close(pt, (latent / 2 + 0.5).clamp(0, 1))


def test_defaults_and_positional_order_are_dit_pipelines():
    import inspect

    from diffusers import DiTPipeline

    ours, theirs = (inspect.signature(c.__call__).parameters for c in (MoHDiTPipeline, DiTPipeline))
    assert list(ours)[:7] == list(theirs)[:7]  # self, class_labels, guidance_scale, generator, steps, output, return_dict
    assert all(ours[n].default == theirs[n].default for n in list(theirs)[2:7])
    assert all(p.kind is p.KEYWORD_ONLY for p in list(ours.values())[7:])


def count_forward(model):
    calls = []
    original = model.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.forward = counted
    return calls



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
    assert (mixed[1] - alone[0]).abs().max() > 1e-2  # one generator for the batch mixes it...
    again = pipe([3, 7, 1], generator=torch.Generator().manual_seed(11), **kwargs).images
    torch.testing.assert_close(again, mixed, rtol=0, atol=0)  # ...deterministically


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



# ---------------------------------------------------------------- head activation
def run(pipe, ratio, **kwargs):
    """The output and the model's per-layer top-K at every transformer call."""
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda module, args: calls.append(module.top_k_per_layer))
    try:
        out = pipe([0, 1], guidance_scale=1.5, num_inference_steps=4, head_activation_ratio=ratio, seeds=[3, 4],
                   output_type="np", **kwargs)
    finally:
        handle.remove()
    return out, calls


def test_head_activation_ratio_per_call(tiny_pipe):
    pipe = tiny_pipe()
    model = pipe.transformer
    model.set_head_activation_ratio(0.875)  # a non-trained setting the call must give back
    before = model.top_k_per_layer
    low, low_calls = run(pipe, 0.5)
    assert model.top_k_per_layer == before and low_calls == [model.layout.top_k_for_ratio(0.5)] * 4
    default, _ = run(pipe, None)
    assert low.head_activation_ratio == pytest.approx(0.5) and default.head_activation_ratio == pytest.approx(0.875)
    # Head-weighted usage of the run equals the realised ratio (every token uses hs + K heads).
    for out in (low, default):
        used = sum(u.sum() for u in out.head_usage) / 24
        assert used.item() == pytest.approx(out.head_activation_ratio, abs=1e-6)
    assert np.abs(low.images - default.images).max() > 1e-4


def test_a_ratio_per_step(tiny_pipe):
    """``linear:A:B`` from the first (noisiest) step to the last, a list, a function of the timestep:
    the model's top-K changes at every step as asked, and a constant schedule is the number."""
    pipe = tiny_pipe(seed=2)
    model = pipe.transformer
    out, calls = run(pipe, "linear:0.5:1.0")
    requested = [0.5, 2 / 3, 5 / 6, 1.0]  # timesteps 999, 666, 333, 0
    assert calls == [model.layout.top_k_for_ratio(r) for r in requested]
    assert out.head_activation_ratios == [model.layout.activation_ratio(k) for k in calls]
    assert out.head_activation_ratio == pytest.approx(sum(out.head_activation_ratios) / 4)
    for same in ([0.5, 2 / 3, 5 / 6, 1.0], lambda t: 0.5 + 0.5 * (999 - t) / 999):
        np.testing.assert_array_equal(run(pipe, same)[0].images, out.images)
    constant, _ = run(pipe, 0.75)
    for schedule in ("linear:0.75:0.75", [0.75] * 4, lambda t: 0.75):
        np.testing.assert_array_equal(run(pipe, schedule)[0].images, constant.images)
    assert np.abs(out.images - constant.images).max() > 1e-3  # about the same mean ratio, other images
    assert model.top_k_per_layer == list(model.layout.top_k)  # restored


def test_head_usage_only_when_asked(tiny_pipe):
    """``output_head_usage=False``: no transformer call computes routing statistics, the output has
    no usage, and the images are the same as with it."""
    pipe = tiny_pipe()
    asked, original = [], pipe.transformer.forward
    pipe.transformer.forward = lambda *a, **k: asked.append(k.get("output_head_usage")) or original(*a, **k)
    kwargs = dict(guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1], head_activation_ratio=0.5,
                  output_type="latent")
    with_usage = pipe([1, 2], **kwargs)
    assert asked == [True] * STEPS and len(with_usage.head_usage) == 6
    asked.clear()
    without = pipe([1, 2], output_head_usage=False, **kwargs)
    assert asked == [False] * STEPS and without.head_usage is None
    torch.testing.assert_close(without.images, with_usage.images, rtol=0, atol=0)


def test_ratio_and_train_mode_restored_on_error(tiny_pipe):
    """Label dropout never acts while sampling (eval mode), and the model's mode and top-K are given
    back, also when a step fails."""
    pipe = tiny_pipe(class_dropout_prob=0.9)
    kwargs = dict(guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1], output_type="latent")
    ref = pipe([1, 2], **kwargs).images
    model = pipe.transformer.train()
    torch.testing.assert_close(pipe([1, 2], **kwargs).images, ref)
    before = model.top_k_per_layer

    def fail(pipe_, index, t, callback_kwargs):
        raise RuntimeError("stop")

    for ratio in (1.0, "linear:0.5:1"):
        with pytest.raises(RuntimeError, match="stop"):
            pipe([1], head_activation_ratio=ratio, num_inference_steps=STEPS, seeds=[0], callback_on_step_end=fail)
        assert model.top_k_per_layer == before and model.training


# ---------------------------------------------------------------- labels and inputs
def test_label_names(tiny_pipe):
    pipe = tiny_pipe(class_names=NAMES)
    assert pipe.get_label_ids(["Cat", " DOG ", "ship", "boat", 0, np.int64(4), torch.tensor(7)]) == [3, 5, 8, 8, 0, 4, 7]
    assert pipe.get_label_ids("truck") == [9] and pipe.get_label_ids(10) == [10]  # 10: the null class
    assert pipe.labels["boat"] == 8 and pipe.id2label[8] == "ship, boat"
    other = MoHDiTPipeline(transformer=pipe.transformer, scheduler=pipe.scheduler,
                           id2label={264: "Cardigan", 474: "cardigan"})
    assert other.get_label_ids(["Cardigan", "cardigan"]) == [264, 474]
    for bad in ("CARDIGAN", "kat"):  # ambiguous, unknown
        with pytest.raises(ValueError):
            other.get_label_ids(bad)
    with pytest.raises(ValueError):
        tiny_pipe().get_label_ids("cat")  # no names


@pytest.mark.parametrize("kwargs", [
    dict(class_labels=[11]), dict(class_labels=[-1]), dict(class_labels=[]), dict(class_labels=[[]]),
    dict(class_labels=[1.5]), dict(head_activation_ratio=0.1), dict(head_activation_ratio=float("nan")),
    dict(head_activation_ratio="linear:0.1:1"), dict(head_activation_ratio="cosine:1:0.5"),
    dict(head_activation_ratio=[1.0, 0.5]), dict(head_activation_ratio=[0.75, 0.75, 1.5]),
    dict(head_activation_ratio=lambda t: 0.2), dict(guidance_scale=0.5), dict(guidance_scale=float("inf")),
    dict(guidance_scale=float("nan")), dict(guidance_scale="2"), dict(num_inference_steps=0),
    dict(num_inference_steps=1001), dict(num_inference_steps=2.0),
    dict(timesteps=[500, 999], num_inference_steps=None), dict(timesteps=[1000, 5], num_inference_steps=None),
    dict(timesteps=[], num_inference_steps=None), dict(eta=float("nan")), dict(eta=1.5),
    dict(guidance_channels="first3"), dict(class_labels=[1, 2], seeds=[0]),
    dict(seeds=[0], generator=torch.Generator()), dict(class_labels=[1, 2], generator=[torch.Generator()]),
    dict(output_type="jpg"), dict(latents=torch.zeros(1, 3, 4, 4)), dict(callback_on_step_end_tensor_inputs=["noise"]),
    dict(timesteps=[999, 500, 0], num_inference_steps=None, scheduler="ddim"),
])
def test_bad_input_is_refused_before_any_compute(kwargs, tiny_pipe):
    """check_inputs, the call's first act, refuses every bad argument with a ValueError and leaves
    the model as it was."""
    pipe = tiny_pipe(class_names=NAMES)
    if kwargs.pop("scheduler", None):  # custom timesteps: DDPM takes them, DDIM does not
        pipe.scheduler = make_scheduler("ddim")
    calls = count_forward(pipe.transformer)
    before = pipe.transformer.top_k_per_layer
    with pytest.raises(ValueError):
        pipe(**{"class_labels": [1], "num_inference_steps": STEPS, **kwargs})
    assert not calls and pipe.transformer.top_k_per_layer == before


def test_check_inputs_is_callable_alone(tiny_pipe):
    pipe = tiny_pipe()
    calls = count_forward(pipe.transformer)
    assert pipe.check_inputs([1, 2], 1.5, 250, head_activation_ratio=0.6, seeds=[0, 1]) is None  # one ratio
    assert pipe.check_inputs([1], 1.5, 4, head_activation_ratio="linear:0.5:1.0") == pytest.approx([0.5, 2 / 3, 5 / 6, 1])
    assert pipe.check_inputs([1], 1.5, None, head_activation_ratio=lambda t: t / 1000, timesteps=[999, 500]) == \
        [0.999, 0.5]
    with pytest.raises(ValueError):
        pipe.check_inputs([1], float("inf"), 2)
    assert not calls


def test_a_latent_model_needs_its_vae_or_latent_output(randomize):
    model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, in_channels=4)).eval()
    pipe = MoHDiTPipeline(transformer=model, scheduler=make_scheduler())
    with pytest.raises(ValueError):
        pipe([1], num_inference_steps=2)
    assert pipe([1], num_inference_steps=2, output_type="latent").images.shape == (1, 4, 8, 8)


# ---------------------------------------------------------------- schedulers
SWAPPED = [
    (DDPMScheduler, {}), (DDIMScheduler, {}), (DPMSolverMultistepScheduler, {}),
    # Plain DPM-Solver (deprecated in diffusers) cannot end on sigma 0.
    (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver", "final_sigmas_type": "sigma_min"}),
    (EulerDiscreteScheduler, {}), (EulerAncestralDiscreteScheduler, {}), (HeunDiscreteScheduler, {}),
    (UniPCMultistepScheduler, {}), (PNDMScheduler, {}),
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


@pytest.mark.parametrize("make", [
    lambda config: FlowMatchEulerDiscreteScheduler.from_config(config),
    lambda config: DDIMScheduler.from_config(config, prediction_type="v_prediction"),
    lambda config: DDPMScheduler.from_config(config, variance_type="learned"),
    lambda config: DDPMScheduler.from_config(config),  # learned range, on a model without variance channels
])
def test_a_scheduler_that_cannot_serve_the_model_is_refused(make, randomize):
    model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, learn_sigma=False)).eval()
    pipe = MoHDiTPipeline(transformer=model, scheduler=make(make_scheduler("ddpm").config))
    calls = count_forward(pipe.transformer)
    with pytest.raises(ValueError):
        pipe([1], num_inference_steps=2, seeds=[0])
    assert not calls
    pipe.scheduler = DDPMScheduler.from_config(pipe.scheduler.config, variance_type="fixed_small", prediction_type="epsilon")
    assert pipe([1], num_inference_steps=2, seeds=[0], output_type="latent").images.shape == (1, 3, 8, 8)


# ---------------------------------------------------------------- save, load, offload
def test_save_load_roundtrip_pixel_space(tmp_path, tiny_pipe):
    pipe = tiny_pipe(class_names=NAMES)
    pipe.scheduler = make_scheduler("ddpm", clip_sample=True)
    kwargs = dict(guidance_scale=1.5, num_inference_steps=STEPS, seeds=[0, 1], output_type="pt")
    ref = pipe(["cat", "boat"], **kwargs).images
    pipe.save_pretrained(tmp_path)
    loaded = MoHDiTPipeline.from_pretrained(tmp_path)
    assert loaded.vae is None and isinstance(loaded.scheduler, DDPMScheduler) and loaded.scheduler.config.clip_sample
    assert loaded.id2label == dict(enumerate(NAMES)) and loaded.config.id2label == pipe.config.id2label
    torch.testing.assert_close(loaded(["cat", "boat"], **kwargs).images, ref, rtol=0, atol=0)
    custom = MoHDiTPipeline(transformer=pipe.transformer, scheduler=make_scheduler("ddim"), id2label={0: "zero", "9": "nine"})
    custom.save_pretrained(tmp_path / "custom")
    loaded = MoHDiTPipeline.from_pretrained(tmp_path / "custom")
    assert loaded.id2label == {0: "zero", 9: "nine"} and isinstance(loaded.scheduler, DDIMScheduler)


def test_vae_pipeline_roundtrip_and_cpu_offload(tmp_path, tiny_pipe, tiny_vae):
    pipe = tiny_pipe(seed=2, in_channels=4, vae=tiny_vae(seed=5, std=0.1))
    kwargs = dict(guidance_scale=1.5, num_inference_steps=2, seeds=[0, 1], output_type="pt")
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
    loaded.enable_model_cpu_offload(device="cpu")  # hooks run on a CPU-only machine too
    torch.testing.assert_close(loaded([1, 9], **kwargs).images, out.images)
    assert next(loaded.transformer.parameters()).device.type == "cpu"


def test_a_training_run_folder_names_its_pipeline(tmp_path, tiny_pipe):
    """A run folder holds its pipeline in ``final/``: loading the run folder itself says so."""
    tiny_pipe().save_pretrained(tmp_path / "run" / "final")
    with pytest.raises(FileNotFoundError, match="final"):
        MoHDiTPipeline.from_pretrained(tmp_path / "run")
    assert isinstance(MoHDiTPipeline.from_pretrained(tmp_path / "run" / "final"), MoHDiTPipeline)


def test_from_pipe(tiny_pipe):
    pipe = tiny_pipe(class_names=NAMES)
    other = MoHDiTPipeline.from_pipe(pipe)
    assert other.transformer is pipe.transformer and other.scheduler is pipe.scheduler
    assert other.id2label == pipe.id2label
    kwargs = dict(guidance_scale=1.5, num_inference_steps=2, seeds=[0], output_type="latent")
    torch.testing.assert_close(other(["cat"], **kwargs).images, pipe(["cat"], **kwargs).images, rtol=0, atol=0)
