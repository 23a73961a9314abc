"""Head-activation schedules: the spec syntax, what a schedule asks for at each step, what it
realises on a model, and the pipeline running it (the model's top-K really changes at the right
steps, is restored afterwards, and a constant schedule gives the float ratio's images)."""

import math

import numpy as np
import pytest
import torch

from moh_dit.errors import InvalidInput
from moh_dit.models.flops import model_attention_flops
from moh_dit.models.head_schedule import (
    HeadActivationSchedule,
    as_schedule,
    parse_schedule,
    plan_head_activation,
    schedule_setting,
    split_ratio_list,
    trajectory_fraction,
)

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = [750, 500, 250, 0]  # a trajectory of 4 steps
PIPE_STEPS = [999, 666, 333, 0]  # the paper's DDPM (make_scheduler("ddpm")) in 4 steps


# --------------------------------------------------------------------------------------
# The syntax and the rules
# --------------------------------------------------------------------------------------


def test_parse_and_canonical_spec():
    for text, spec, ratios in [
        ("0.75", "0.75", [0.75] * 4),
        ("linear:0.5:1.0", "linear:0.5:1", [0.5, 0.5 + 0.5 / 3, 1.0 - 0.5 / 3, 1.0]),
        (" LINEAR : 1 : 0.5 ", "linear:1:0.5", [1.0, 1.0 - 0.5 / 3, 0.5 + 0.5 / 3, 0.5]),
        ("cosine:0.5:1", "cosine:0.5:1", [0.5, 0.625, 0.875, 1.0]),
        ("step:0.5@t>500,1.0", "step:0.5@t>500,1", [0.5, 1.0, 1.0, 1.0]),
        ("step:1@t>700, 0.75 @ t > 300,0.5", "step:1@t>700,0.75@t>300,0.5", [1.0, 0.75, 0.5, 0.5]),
    ]:
        schedule = parse_schedule(text)
        assert schedule.spec == spec and parse_schedule(spec) == schedule
        assert schedule.ratios(STEPS) == pytest.approx(ratios, abs=1e-12), text
    # first and last steps are exactly the ends
    assert parse_schedule("cosine:0.6:0.9").ratios(STEPS)[::3] == [0.6, 0.9]
    assert parse_schedule("linear:0.5:1").ratio_at(0, 999, 1) == 0.5  # one step: the first ratio


@pytest.mark.parametrize("text, match", [
    ("half", r"schedule 'half': neither a number nor a schedule"),
    ("linear:0.5", r"linear takes two ratios, linear:FIRST:LAST"),
    ("linear:0.5:1:2", r"linear takes two ratios"),
    ("cosine:a:1", r"cosine's ratios must be numbers"),
    ("linear:0:1", r"ratios must be numbers in \(0, 1\]; got 0\.0"),
    ("linear:0.5:nan", r"ratios must be numbers in \(0, 1\]"),
    ("step:0.5", r"at least one R@t>T piece"),
    ("step:0.5@t>500", r"ends with the ratio for the remaining steps"),
    ("step:0.5@t>x,1", r"'0\.5@t>x' is not RATIO@t>TIMESTEP"),
    ("step:0.5@t<500,1", r"is not RATIO@t>TIMESTEP"),
    ("step:1.5@t>500,1", r"ratios must be numbers in \(0, 1\]; got 1\.5"),
    ("quadratic:0.5:1", r"unknown schedule kind 'quadratic'"),
])
def test_bad_specs_are_one_line(text, match):
    with pytest.raises(InvalidInput, match=match) as caught:
        parse_schedule(text)
    message = str(caught.value)
    assert "\n" not in message and repr(text) in message and "e.g. 0.75, linear:0.5:1.0" in message


def test_split_ratio_list_and_settings():
    assert split_ratio_list("1.0,step:0.5@t>500,1.0,min") == ["1.0", "step:0.5@t>500,1.0", "min"]
    assert split_ratio_list("step:1@t>700,0.75@t>300,0.5,linear:0.5:1") == ["step:1@t>700,0.75@t>300,0.5",
                                                                            "linear:0.5:1"]
    assert split_ratio_list("0.5,0.6") == ["0.5", "0.6"]
    # A command line's value: a float for a number (as a float ratio always was), else the canonical spec.
    assert schedule_setting("0.9") == 0.9 and isinstance(schedule_setting("0.9"), float)
    assert schedule_setting("linear:0.50:1.00") == "linear:0.5:1" == schedule_setting("linear:0.5:1")


def test_other_kinds_of_schedules():
    assert trajectory_fraction(0, 4) == 0.0 and trajectory_fraction(3, 4) == 1.0 and trajectory_fraction(0, 1) == 0.0
    per_step = as_schedule([0.5, 0.6, 0.7, 0.8])
    assert per_step.ratios(STEPS) == [0.5, 0.6, 0.7, 0.8]
    with pytest.raises(InvalidInput, match="4 per-step ratios for 2 denoising steps"):
        per_step.ratios([500, 0])
    of_t = as_schedule(lambda t: 1.0 if t > 400 else 0.5)
    assert of_t.ratios(STEPS) == [1.0, 1.0, 0.5, 0.5] and of_t.spec.startswith("timestep-function:")
    of_f = HeadActivationSchedule.of_fraction(lambda f: 0.5 + 0.5 * f, name="mine")
    assert of_f.ratios(STEPS) == pytest.approx([0.5, 2 / 3, 5 / 6, 1.0]) and of_f.spec == "mine"
    assert as_schedule(torch.tensor([0.5, 1.0])).ratios([500, 0]) == [0.5, 1.0]
    assert as_schedule(lambda t: torch.tensor(0.75)).ratios([3]) == [0.75]  # one-element tensors are numbers
    with pytest.raises(InvalidInput) as caught:
        as_schedule(lambda t: "x").ratios(STEPS)
    assert all(fact in str(caught.value) for fact in ("'x'", "step 0", "timestep 750"))
    with pytest.raises(InvalidInput, match=r"\{'ratio': 0\.5\}"):
        as_schedule({"ratio": 0.5})


def test_plan_realises_and_checks_every_step(randomize):
    from moh_dit import MoHDiTTransformer2DModel

    model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8)).eval()
    model.set_head_activation_ratio(None, overrides={1: 2})  # a non-trained setting, to be left alone
    before = model.top_k_per_layer
    plan = plan_head_activation(model, parse_schedule("linear:0.5:0.6"), STEPS)
    # 24 heads: 12, 12.8, 13.6, 14.4 active round to 12, 13, 14, 14 (the model's top-K rule).
    assert [round(r * 24) for r in plan.realised] == [12, 13, 14, 14] and plan.mean_ratio == 53 / 96
    probe = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8))
    for requested, top_k, flops in zip(plan.requested, plan.top_k, plan.attention_flops):
        probe.set_head_activation_ratio(requested)
        assert top_k == probe.top_k_per_layer and flops == model_attention_flops(probe)[0]
    assert plan.dense_attention_flops == model_attention_flops(probe)[1]
    assert plan.mean_attention_flop_ratio == sum(plan.attention_flops) / 4 / plan.dense_attention_flops
    assert not plan.is_constant and plan_head_activation(model, parse_schedule("0.75"), STEPS).is_constant
    assert model.top_k_per_layer == before
    with pytest.raises(InvalidInput) as caught:  # the first step out of range, by index and timestep
        plan_head_activation(model, parse_schedule("step:1@t>600,0.3"), STEPS)
    assert all(fact in str(caught.value) for fact in ("'step:1@t>600,0.3'", "0.3000", "step 1", "timestep 500",
                                                      "[0.5000, 1.0000]"))
    assert model.top_k_per_layer == before


# --------------------------------------------------------------------------------------
# The pipeline runs a schedule
# --------------------------------------------------------------------------------------


@pytest.fixture
def pipe(tiny_pipe):
    pipe = tiny_pipe(seed=2)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe, ratio, **kwargs):
    """The output and the model's per-layer top-K at every transformer call (a forward hook)."""
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda module, args: calls.append(module.top_k_per_layer))
    try:
        out = pipe([0, 1], guidance_scale=1.5, num_inference_steps=4, head_activation_ratio=ratio, seeds=[3, 4],
                   output_type="np", **kwargs)
    finally:
        handle.remove()
    return out, calls


def test_the_models_top_k_changes_at_the_right_steps(pipe):
    model = pipe.transformer
    full, low = model.layout.top_k_for_ratio(1.0), model.layout.top_k_for_ratio(0.5)
    out, calls = _run(pipe, "step:1.0@t>400,0.5")
    assert calls == [full, full, low, low]  # timesteps 999, 666 (> 400), then 333, 0; guided: one call per step
    assert out.head_activation_ratios == [1.0, 1.0, 0.5, 0.5] and out.head_activation_ratio == 0.75
    flops = [model_attention_flops(model, k) for k in calls]
    assert out.mean_attention_flops == sum(f[0] for f in flops) / 4
    assert out.mean_attention_flop_ratio == out.mean_attention_flops / flops[0][1]
    assert model.top_k_per_layer == model.trained_top_k  # restored
    _, reversed_calls = _run(pipe, "step:0.5@t>400,1.0")
    assert reversed_calls == [low, low, full, full]


def test_a_constant_schedule_is_the_float_and_a_varying_one_is_not(pipe):
    float_out, float_calls = _run(pipe, 0.75)
    assert float_out.head_activation_ratios == [0.75] * 4 and float_out.head_activation_ratio == 0.75
    assert float_out.mean_attention_flops == model_attention_flops(pipe.transformer, float_calls[0])[0]
    for constant in ("0.75", [0.75] * 4, HeadActivationSchedule.constant(0.75), lambda t: 0.75, "linear:0.75:0.75"):
        out, calls = _run(pipe, constant)
        np.testing.assert_array_equal(out.images, float_out.images)
        assert calls == float_calls and out.head_activation_ratios == float_out.head_activation_ratios
    varying, _ = _run(pipe, "linear:0.5:1.0")
    assert varying.head_activation_ratio == pytest.approx(0.75)
    assert np.abs(varying.images - float_out.images).max() > 1e-3  # same mean ratio, other images
    fraction, _ = _run(pipe, HeadActivationSchedule.of_fraction(lambda f: 0.5 + 0.5 * f))
    np.testing.assert_array_equal(fraction.images, varying.images)


def test_bad_schedules_are_refused_before_any_compute(pipe):
    """The call and check_inputs refuse a bad schedule alike, naming head_activation_ratio and
    the step (index and timestep) or what is wrong with the schedule."""
    for ratio, facts in [
        ("linear:0.3:1", ["0.3000", "step 0", "timestep 999", "[0.5000, 1.0000]"]),
        ([0.75] * 3, ["3 per-step ratios", "4 denoising steps"]),
        ([0.75, 0.75, 1.5, 0.75], ["1.5000", "step 2", "timestep 333"]),
        (lambda t: math.nan, ["nan", "step 0"]),
        ("linear:0.5", ["'linear:0.5'", "two ratios"]),
    ]:
        for call in (lambda: _run(pipe, ratio), lambda: pipe.check_inputs([0], 1.5, 4, head_activation_ratio=ratio)):
            calls = []
            handle = pipe.transformer.register_forward_pre_hook(lambda module, args: calls.append(1))
            with pytest.raises(InvalidInput) as caught:
                call()
            handle.remove()
            assert caught.value.parameters == ("head_activation_ratio",)
            assert all(fact in str(caught.value) for fact in facts), caught.value
            assert not calls and pipe.transformer.top_k_per_layer == pipe.transformer.trained_top_k


def test_the_model_is_restored_when_a_step_fails(pipe):
    model = pipe.transformer
    model.set_head_activation_ratio(None, overrides={1: 2})
    before = model.top_k_per_layer

    def fail(pipe_, index, t, kwargs):
        if index == 1:
            raise RuntimeError("stop")
        return kwargs

    with pytest.raises(RuntimeError, match="stop"):
        _run(pipe, "linear:0.5:1", callback_on_step_end=fail)
    assert model.top_k_per_layer == before
    plan = pipe.head_activation_plan("cosine:1:0.5", num_inference_steps=4)
    assert plan.timesteps == PIPE_STEPS and plan.realised[0] == 1.0 and model.top_k_per_layer == before


def test_a_dense_model_takes_only_ratio_one(tiny_pipe):
    pipe = tiny_pipe(seed=1, num_shared_heads=None, top_k=None)
    pipe.set_progress_bar_config(disable=True)
    out = pipe([0], guidance_scale=1.0, num_inference_steps=2, head_activation_ratio="linear:1:1", seeds=[0],
               output_type="np")
    assert out.head_activation_ratios == [1.0, 1.0] and out.mean_attention_flop_ratio == 1.0
    with pytest.raises(InvalidInput) as caught:
        pipe([0], num_inference_steps=2, head_activation_ratio="linear:0.5:1", seeds=[0])
    assert caught.value.parameters == ("head_activation_ratio",) and "[1.0000, 1.0000]" in str(caught.value)
