import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from scipy import integrate
from scipy.stats import norm

from moh_dit.diffusion import GaussianDiffusion, create_diffusion, make_scheduler, space_timesteps
from moh_dit.diffusion.gaussian_diffusion import discretized_gaussian_log_likelihood, normal_kl


@pytest.fixture(scope="module")
def diffusion():
    return create_diffusion()


def _ddpm_scheduler():
    return DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02,
                         variance_type="learned_range", clip_sample=False)


def test_schedule_matches_diffusers_ddpm_scheduler(diffusion):
    sched = _ddpm_scheduler()
    # diffusers builds its tables in float32; ours are float64, so they agree to float32 precision.
    torch.testing.assert_close(diffusion.betas.float(), sched.betas, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(diffusion.alphas_cumprod.float(), sched.alphas_cumprod, rtol=2e-5, atol=1e-7)
    assert diffusion.betas.dtype == torch.float64
    assert diffusion.num_timesteps == 1000
    assert diffusion.betas[0].item() == pytest.approx(1e-4) and diffusion.betas[-1].item() == pytest.approx(0.02)

    x0 = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0, 500, 999])
    torch.testing.assert_close(diffusion.q_sample(x0, t, noise), sched.add_noise(x0, noise, t), rtol=1e-5, atol=1e-5)


def test_posterior_matches_brute_force_density_product(diffusion):
    """q(x_{t-1} | x_t, x_0) ∝ q(x_t | x_{t-1}) q(x_{t-1} | x_0), evaluated on a dense grid."""
    betas = diffusion.betas.numpy()
    abar = np.cumprod(1 - betas)
    x0, xt = 0.7, -0.4
    for t in (1, 10, 500, 999):
        grid = np.linspace(-8, 8, 400001)
        log_p = norm.logpdf(xt, loc=np.sqrt(1 - betas[t]) * grid, scale=np.sqrt(betas[t]))
        log_p += norm.logpdf(grid, loc=np.sqrt(abar[t - 1]) * x0, scale=np.sqrt(1 - abar[t - 1]))
        w = np.exp(log_p - log_p.max())
        w /= w.sum()
        mean_bf = (w * grid).sum()
        var_bf = (w * (grid - mean_bf) ** 2).sum()
        tt = torch.tensor([t])
        mean, var, log_var = diffusion.q_posterior_mean_variance(
            torch.tensor([[x0]], dtype=torch.float64), torch.tensor([[xt]], dtype=torch.float64), tt
        )
        assert mean.item() == pytest.approx(mean_bf, abs=1e-6)
        assert var.item() == pytest.approx(var_bf, rel=1e-4)
        assert log_var.item() == pytest.approx(math.log(var_bf), abs=1e-4)
    # First step: the posterior is a point mass at x_0; its log variance is clipped to the next step's.
    mean, var, log_var = diffusion.q_posterior_mean_variance(
        torch.tensor([[x0]], dtype=torch.float64), torch.tensor([[xt]], dtype=torch.float64), torch.tensor([0])
    )
    assert mean.item() == pytest.approx(x0, abs=1e-12) and var.item() == 0.0
    assert log_var.item() == pytest.approx(math.log(diffusion.table("posterior_variance")[1].item()))


def test_learned_range_endpoints(diffusion):
    """IDDPM's Eq. 15: v = 1 gives log beta_t, v = -1 the clipped log beta~_t, v = 0 their mean."""
    t = torch.tensor([0, 1, 250, 999])
    post = diffusion.table("posterior_variance")
    lo = diffusion.table("posterior_log_variance_clipped")[t]
    for v, expected in ((1.0, diffusion.betas[t].log()), (-1.0, torch.cat([post[1:2], post[t[1:]]]).log()),
                        (0.0, 0.5 * (diffusion.betas[t].log() + lo))):
        out = torch.cat([torch.zeros(4, 3, 2, 2), torch.full((4, 3, 2, 2), v)], 1).double()
        log_var = diffusion.p_mean_variance(out, torch.zeros(4, 3, 2, 2, dtype=torch.float64), t)["log_variance"]
        torch.testing.assert_close(log_var, expected.reshape(4, 1, 1, 1).expand(4, 3, 2, 2))


def test_normal_kl_closed_form_and_quadrature():
    # Hand case: KL(N(0, 1) || N(1, 4)) = ln 2 + (1 + 1) / 8 - 1/2.
    kl = normal_kl(torch.tensor(0.0), torch.tensor(0.0), torch.tensor(1.0), torch.tensor(math.log(4.0)))
    assert kl.item() == pytest.approx(math.log(2) + 0.25 - 0.5, abs=1e-7)
    m1, s1, m2, s2 = 0.3, 0.5, -0.2, 1.3
    num, _ = integrate.quad(lambda x: norm.pdf(x, m1, s1) * (norm.logpdf(x, m1, s1) - norm.logpdf(x, m2, s2)), -20, 20)
    kl = normal_kl(*(torch.tensor(v, dtype=torch.float64) for v in (m1, 2 * math.log(s1), m2, 2 * math.log(s2))))
    assert kl.item() == pytest.approx(num, abs=1e-9)


def test_discretized_log_likelihood_against_scipy():
    # Grid values, including both edge bins, and means/scales from narrow to wide; index 5
    # has a bin mass of ~4e-22, which the implementation clamps to 1e-12 as IDDPM does.
    x = torch.tensor([-1.0, -1.0, -0.5, 0.0, 2 / 255 - 1 + 4 / 255, 0.6, 1.0, 1.0], dtype=torch.float64)
    means = torch.tensor([-0.9, 0.2, -0.45, 0.01, -0.95, 0.7, 0.9, -0.3], dtype=torch.float64)
    log_scales = torch.log(torch.tensor([0.05, 0.5, 0.02, 0.3, 0.1, 0.01, 0.2, 1.0], dtype=torch.float64))
    s = log_scales.exp().numpy()
    xn, mn = x.numpy(), means.numpy()
    upper = norm.cdf((xn + 1 / 255 - mn) / s)
    lower = norm.cdf((xn - 1 / 255 - mn) / s)
    expected = np.log(np.maximum(np.where(xn < -0.999, upper, np.where(xn > 0.999, 1 - lower, upper - lower)), 1e-12))
    # DiT's tanh CDF approximation: CDF errors < 2e-4, so compare probabilities, not logs.
    approx = discretized_gaussian_log_likelihood(x, means, log_scales)
    np.testing.assert_allclose(approx.exp().numpy(), np.exp(expected), atol=5e-4)


def _direct_vb_bits(diffusion, eps, v, x0, xt, t):
    """The VB term written out in float64 numpy from the schedule, one sample."""
    b = diffusion.betas.numpy()
    abar = np.cumprod(1 - b)
    abar_prev = np.append(1.0, abar[:-1])
    post_var = b * (1 - abar_prev) / (1 - abar)
    min_log = np.log(post_var[1]) if t == 0 else np.log(post_var[t])
    log_var = (v + 1) / 2 * np.log(b[t]) + (1 - v) / 2 * min_log
    pred_x0 = (xt - np.sqrt(1 - abar[t]) * eps) / np.sqrt(abar[t])

    def post_mean(a):
        return (np.sqrt(abar_prev[t]) * b[t] * a + np.sqrt(1 - b[t]) * (1 - abar_prev[t]) * xt) / (1 - abar[t])

    mu_model = post_mean(pred_x0)
    if t > 0:
        var_q = post_var[t]
        kl = np.log(np.sqrt(np.exp(log_var)) / np.sqrt(var_q)) + (var_q + (post_mean(x0) - mu_model) ** 2) / (
            2 * np.exp(log_var)
        ) - 0.5
        return kl.mean() / np.log(2)
    sd = np.exp(0.5 * log_var)
    up, lo = norm.cdf((x0 + 1 / 255 - mu_model) / sd), norm.cdf((x0 - 1 / 255 - mu_model) / sd)
    p = np.where(x0 < -0.999, up, np.where(x0 > 0.999, 1 - lo, up - lo))
    return -np.log(p).mean() / np.log(2)


def test_vb_terms_against_direct_computation(diffusion):
    gen = torch.Generator().manual_seed(3)
    C = 2
    x0 = (torch.randint(0, 256, (4, C, 3, 3), generator=gen).double() / 127.5 - 1.0)
    noise = torch.randn(4, C, 3, 3, generator=gen, dtype=torch.float64)
    t = torch.tensor([0, 1, 300, 999])
    xt = diffusion.q_sample(x0, t, noise)
    eps = noise + 0.1 * torch.randn(4, C, 3, 3, generator=gen, dtype=torch.float64)
    v = torch.rand(4, C, 3, 3, generator=gen, dtype=torch.float64) * 2 - 1
    vb = diffusion.vb_terms_bpd(torch.cat([eps, v], 1), x0, xt, t)
    assert vb.shape == (4,) and vb.dtype == torch.float64
    for i in range(4):
        expected = _direct_vb_bits(diffusion, eps[i].numpy(), v[i].numpy(), x0[i].numpy(), xt[i].numpy(), int(t[i]))
        # t = 0 uses the tanh CDF (as DiT); the direct value uses the exact CDF.
        tol = 5e-3 if t[i] == 0 else 1e-9
        assert vb[i].item() == pytest.approx(expected, rel=tol, abs=tol)


def test_training_losses_shapes_dtypes_and_mse(diffusion):
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(5, 4, 8, 8, generator=gen)
    noise = torch.randn_like(x0)
    t = diffusion.sample_timesteps(5, generator=gen)
    assert t.shape == (5,) and t.dtype == torch.long and int(t.min()) >= 0 and int(t.max()) < 1000
    xt = diffusion.q_sample(x0, t, noise)
    out = torch.randn(5, 8, 8, 8, generator=gen).to(torch.bfloat16)
    terms = diffusion.training_losses(out, x0, xt, t, noise)
    assert set(terms) == {"mse", "vb", "loss"}
    for value in terms.values():
        assert value.shape == (5,) and value.dtype == torch.float32 and torch.isfinite(value).all()
    torch.testing.assert_close(terms["mse"], ((noise - out[:, :4].float()) ** 2).mean(dim=(1, 2, 3)))
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["vb"])


def test_vb_gives_no_gradient_to_eps_half(diffusion):
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(3, 2, 4, 4, generator=gen)
    noise = torch.randn_like(x0)
    t = torch.tensor([0, 10, 700])
    xt = diffusion.q_sample(x0, t, noise)
    out = torch.randn(3, 4, 4, 4, generator=gen).requires_grad_(True)
    terms = diffusion.training_losses(out, x0, xt, t, noise)
    (grad_vb,) = torch.autograd.grad(terms["vb"].sum(), out, retain_graph=True)
    assert grad_vb[:, :2].abs().max() == 0 and grad_vb[:, 2:].abs().max() > 0
    (grad_mse,) = torch.autograd.grad(terms["mse"].sum(), out)
    assert grad_mse[:, 2:].abs().max() == 0 and grad_mse[:, :2].abs().max() > 0


def test_perfect_model_has_small_vb_and_zero_mse(diffusion):
    # A model that predicts the true noise and the posterior variance (v = -1) makes
    # p(x_{t-1}|x_t) equal to q(x_{t-1}|x_t,x_0): KL = 0 for t > 0.
    x0 = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    noise = torch.randn_like(x0)
    t = torch.tensor([5, 900])
    xt = diffusion.q_sample(x0, t, noise)
    terms = diffusion.training_losses(torch.cat([noise, -torch.ones_like(noise)], 1), x0, xt, t, noise)
    assert terms["mse"].abs().max() < 1e-20
    assert terms["vb"].abs().max() < 1e-9


def test_space_timesteps_and_respace(diffusion):
    steps = space_timesteps(1000, 250)
    assert len(steps) == 250 and steps[:3] == [0, 4, 8] and steps[-2:] == [995, 999]
    assert space_timesteps(1000, "1000") == list(range(1000))
    assert space_timesteps(10, "2,3") == [0, 4, 5, 7, 9]
    with pytest.raises(ValueError, match="cannot take"):
        space_timesteps(10, 11)
    spaced = diffusion.respace(250)
    assert spaced.num_timesteps == 250 and spaced.timestep_map.tolist() == steps
    # Respacing keeps the marginals q(x_t | x_0) at the kept steps.
    torch.testing.assert_close(spaced.alphas_cumprod, diffusion.alphas_cumprod[steps], rtol=1e-12, atol=0)
    assert create_diffusion(sampling_steps=1000).num_timesteps == 1000


def test_p_sample_matches_diffusers_ddpm_learned_range(diffusion):
    """Our respaced ancestral step equals diffusers' DDPMScheduler step on the same timesteps."""
    steps = space_timesteps(1000, 25)
    spaced = diffusion.respace(steps)
    sched = _ddpm_scheduler()
    sched.set_timesteps(timesteps=steps[::-1])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 4, 4, generator=gen)
    for i in (24, 12, 1, 0):
        k = steps[i]
        out = torch.randn(2, 8, 4, 4, generator=gen)
        out[:, 4:] = out[:, 4:].clamp(-1, 1)
        ours = spaced.p_sample(out, x, torch.full((2,), i), noise=torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(i)))
        theirs = sched.step(out, k, x, generator=torch.Generator().manual_seed(i)).prev_sample
        torch.testing.assert_close(ours["sample"], theirs, rtol=1e-4, atol=1e-4)
        assert int(spaced.timestep_map[i]) == k


def test_make_scheduler_is_the_training_schedule():
    for kind in ("ddpm", "ddim", "dpm"):
        np.testing.assert_allclose(make_scheduler(kind).betas.double().numpy(), GaussianDiffusion().betas, rtol=1e-6)
    custom = GaussianDiffusion(np.linspace(1e-4, 0.02, 1000))
    torch.testing.assert_close(custom.alphas_cumprod, GaussianDiffusion().alphas_cumprod, rtol=0, atol=0)
    with pytest.raises(ValueError):
        make_scheduler("euler")


def _dit_ddim_timesteps(count: int) -> list[int]:
    """IDDPM's / DiT's "ddim{count}" respacing: the smallest integer stride giving exactly
    ``count`` steps over 1000 (``space_timesteps``'s ddim branch), descending."""
    stride = next(i for i in range(1, 1000) if len(range(0, 1000, i)) == count)
    return list(range(0, 1000, stride))[::-1]


def _toy_eps(x: torch.Tensor, t: int) -> torch.Tensor:
    """A stand-in for the model: depends on x and t, cheap, deterministic."""
    return torch.tanh(x * (1 + t / 1000)) + 0.1 * math.sin(t)


def _ddim_reference(x: torch.Tensor, timesteps: list[int]) -> torch.Tensor:
    """DDIM with eta 0 written from its formula (Song et al. 2021, Eq. 12):
    x_{t_prev} = sqrt(a_prev) x0_pred + sqrt(1 - a_prev) eps, x0_pred = (x - sqrt(1 - a) eps) / sqrt(a),
    a_prev of the next kept timestep and 1 after the last (IDDPM's alphas_cumprod_prev)."""
    abar = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000, dtype=np.float64))
    x = x.double()
    for i, t in enumerate(timesteps):
        eps = _toy_eps(x, t)
        a, a_prev = abar[t], abar[timesteps[i + 1]] if i + 1 < len(timesteps) else 1.0
        x0 = (x - math.sqrt(1 - a) * eps) / math.sqrt(a)
        x = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps
    return x


@pytest.mark.parametrize("count", [50, 25, 7])
def test_ddim_is_dits_ddim(count):
    """make_scheduler("ddim") steps DiT's strided timesteps ("ddim50": 980, 960, ..., 0; "ddim25":
    960, ..., 0; a linspace spacing would take 999, 979, ... and DDIM would then step each t to
    t - T // n, off the list) and equals the independent DDIM above. At 7 steps IDDPM's rule takes
    stride 143 but diffusers' DDIM can only step by 1000 // 7 = 142: the same sampler on that stride."""
    scheduler = make_scheduler("ddim")
    scheduler.set_timesteps(count)
    timesteps = scheduler.timesteps.tolist()
    expected = _dit_ddim_timesteps(count) if 1000 % count == 0 else list(range(0, 1000, 1000 // count))[:count][::-1]
    assert timesteps == expected
    if count == 7:
        assert _dit_ddim_timesteps(7)[0] == 858 and timesteps[0] == 852
    x = torch.randn((2, 3, 4, 4), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ours = x.clone()
    for t in timesteps:
        ours = scheduler.step(_toy_eps(ours, t), t, ours).prev_sample
    torch.testing.assert_close(ours, _ddim_reference(x, timesteps), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["ddpm", "ddim", "dpm"])
@pytest.mark.parametrize("count", [7, 30, 50, 250])
def test_make_scheduler_steps_through_its_own_timesteps(kind, count):
    """Each step of every make_scheduler sampler lands on the next timestep of its list: given the
    exact eps of x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps, a deterministic step reaches x at the next
    kept timestep (x0 after the last); DDPM's previous timestep is the next one in its list."""
    scheduler = make_scheduler(kind)
    scheduler.set_timesteps(count)
    timesteps = scheduler.timesteps.tolist()
    assert len(timesteps) == count and timesteps == sorted(set(timesteps), reverse=True)
    if kind == "ddpm":
        assert [int(scheduler.previous_timestep(t)) for t in timesteps] == timesteps[1:] + [-1]
        return
    abar = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000, dtype=np.float64))
    x0 = torch.randn((1, 3, 4, 4), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    eps = torch.randn((1, 3, 4, 4), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    noisy = lambda t: math.sqrt(abar[t]) * x0 + math.sqrt(1 - abar[t]) * eps
    for i, t in enumerate(timesteps):
        prev = scheduler.step(eps, t, noisy(t)).prev_sample
        target = noisy(timesteps[i + 1]) if i + 1 < count else x0
        torch.testing.assert_close(prev, target, rtol=1e-5, atol=1e-5, msg=f"{kind}, step {i} from t={t}")
