"""DiT's Gaussian diffusion for training: schedule, q-sampling, the loss with its VB term,
respacing, and the ancestral step (DiT's sampler, the reference the pipeline is tested against).

The model knows nothing about noise; the training loop calls it and hands its output here::

    diffusion = create_diffusion()                       # 1000 steps, linear betas
    t = diffusion.sample_timesteps(x0.shape[0], device=x0.device)
    noise = torch.randn_like(x0)
    x_t = diffusion.q_sample(x0, t, noise)
    out = model(x_t, t, class_labels=y)                 # sample has 2C channels: eps, variance values
    loss = diffusion.training_losses(out.sample, x0, x_t, t, noise)["loss"].mean()

References: Ho et al. 2020 (DDPM), Nichol & Dhariwal 2021 (IDDPM), Peebles & Xie 2023 (DiT), whose
objective this is: learned-range variance and ``loss = MSE(eps) + VB``, the VB term not rescaled
(DiT's ``LossType.MSE``). Timesteps are 0-based, ``t = 0`` is the last denoising step, whose VB term
is the decoder NLL. Tables are float64; the math runs in float32 or wider whatever the model's dtype.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

__all__ = ["GaussianDiffusion", "create_diffusion", "space_timesteps", "normal_kl",
           "discretized_gaussian_log_likelihood", "mean_flat"]


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    """Mean over every dimension but the batch one: (B, ...) -> (B,)."""
    return x.mean(dim=tuple(range(1, x.ndim)))


def normal_kl(mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor, logvar2: torch.Tensor) -> torch.Tensor:
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def _approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """IDDPM's / DiT's tanh approximation of the normal CDF (Page 1977; error below 2e-4), kept so
    that the t = 0 loss is DiT's."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(x: torch.Tensor, means: torch.Tensor, log_scales: torch.Tensor) -> torch.Tensor:
    """log-likelihood of data on a 256-level grid in [-1, 1] (Ho et al. 2020, Eq. 13): the Gaussian
    mass of the bin ``x +- 1/255``, the edge bins open; probabilities clamped at 1e-12 as in IDDPM.
    DiT applies it to VAE latents, where it is only a surrogate for the t = 0 loss."""
    centered, inv_std = x - means, torch.exp(-log_scales)
    cdf_plus = _approx_standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = _approx_standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def space_timesteps(num_timesteps: int, section_counts: int | str | Sequence[int]) -> list[int]:
    """The timesteps ADM / DiT keep when sampling with fewer steps, ascending: ``[0, T)`` split
    into equal sections (the first ones one longer when it does not divide), from each that many
    evenly strided steps, both ends included. 250 of 1000 gives 0, 4, 8, ..., 995, 999."""
    if isinstance(section_counts, str):
        section_counts = [int(part) for part in section_counts.split(",")]
    counts = [section_counts] if isinstance(section_counts, int) else list(section_counts)
    base, extra = divmod(num_timesteps, len(counts))
    steps, start = [], 0
    for i, count in enumerate(counts):
        size = base + (1 if i < extra else 0)
        if not 1 <= count <= size:
            raise ValueError(f"cannot take {count} steps from a section of {size} steps; use 1..{size}.")
        stride = 1.0 if count == 1 else (size - 1) / (count - 1)
        position = 0.0  # accumulated, not i * stride: ADM's rounding
        for _ in range(count):
            steps.append(start + round(position))
            position += stride
        start += size
    return sorted(set(steps))


class GaussianDiffusion:
    """Discrete-time Gaussian diffusion for an eps-predicting, learned-range-variance model.

    ``betas`` (float64, default the paper's 1000 linear 1e-4..0.02); ``timestep_map[i]`` is the
    timestep the model is called with at index ``i`` (set by :meth:`respace`).
    """

    def __init__(self, betas: Sequence[float] | None = None, timestep_map: Sequence[int] | None = None):
        betas = np.linspace(1e-4, 0.02, 1000, dtype=np.float64) if betas is None else np.asarray(betas, np.float64)
        self.num_timesteps = len(betas)
        self.timestep_map = torch.as_tensor(list(range(len(betas)) if timestep_map is None else timestep_map))
        alphas_cumprod = np.cumprod(1.0 - betas)
        alphas_cumprod_prev = np.append(1.0, alphas_cumprod[:-1])
        # q(x_{t-1} | x_t, x_0) = N(coef1 x_0 + coef2 x_t, beta~_t) (Ho et al. 2020, Eq. 6-7).
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        tables = {
            "betas": betas,
            "log_betas": np.log(betas),
            "alphas_cumprod": alphas_cumprod,
            "alphas_cumprod_prev": alphas_cumprod_prev,
            "sqrt_alphas_cumprod": np.sqrt(alphas_cumprod),
            "sqrt_one_minus_alphas_cumprod": np.sqrt(1.0 - alphas_cumprod),
            "sqrt_recip_alphas_cumprod": np.sqrt(1.0 / alphas_cumprod),
            "sqrt_recipm1_alphas_cumprod": np.sqrt(1.0 / alphas_cumprod - 1.0),
            "posterior_variance": posterior_variance,
            # beta~_0 = 0: its log is clipped to the next step's value, as IDDPM does; also the
            # lower end of the learned range at t = 0.
            "posterior_log_variance_clipped": np.log(np.append(posterior_variance[1], posterior_variance[1:])),
            "posterior_mean_coef1": betas * np.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod),
            "posterior_mean_coef2": (1.0 - alphas_cumprod_prev) * np.sqrt(1.0 - betas) / (1.0 - alphas_cumprod),
        }
        self._tables = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in tables.items()}
        self._cache: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def table(self, name: str) -> torch.Tensor:
        """One float64 per-timestep table on the CPU, e.g. ``table("alphas_cumprod")``."""
        return self._tables[name]

    @property
    def betas(self) -> torch.Tensor:
        return self._tables["betas"]

    @property
    def alphas_cumprod(self) -> torch.Tensor:
        return self._tables["alphas_cumprod"]

    def _extract(self, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Table values at ``t`` as (B, 1, ..., 1). The table is cast to ``like``'s device and dtype
        once and cached (no host-to-device copy per step); cast-then-gather equals DiT's
        gather-then-cast."""
        key = (name, like.device, like.dtype)
        if key not in self._cache:
            self._cache[key] = self._tables[name].to(device=like.device, dtype=like.dtype)
        return self._cache[key][t.to(like.device)].reshape(t.shape[0], *([1] * (like.ndim - 1)))

    @staticmethod
    def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
        dtype = torch.float32  # half-precision log variances and bin masses lose too much
        for x in tensors:
            dtype = torch.promote_types(dtype, x.dtype)
        return dtype

    def sample_timesteps(self, batch_size: int, device: torch.device | str | None = None,
                         generator: torch.Generator | None = None) -> torch.Tensor:
        """Uniform training timesteps in [0, T), (batch_size,), as DiT draws them."""
        gen_device = generator.device if generator is not None else device
        t = torch.randint(0, self.num_timesteps, (batch_size,), generator=generator, device=gen_device)
        return t.to(device) if device is not None else t

    def q_sample(self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps (Ho et al. 2020, Eq. 4)."""
        return (self._extract("sqrt_alphas_cumprod", t, x_start) * x_start
                + self._extract("sqrt_one_minus_alphas_cumprod", t, x_start) * noise)

    def q_posterior_mean_variance(self, x_start: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor):
        """Mean (x_t's shape), variance and clipped log variance ((B, 1, ..., 1)) of q(x_{t-1} | x_t, x_0)."""
        coef1, coef2 = self._extract("posterior_mean_coef1", t, x_t), self._extract("posterior_mean_coef2", t, x_t)
        variance = self._extract("posterior_variance", t, x_t)
        return coef1 * x_start + coef2 * x_t, variance, self._extract("posterior_log_variance_clipped", t, x_t)

    def p_mean_variance(self, model_output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                        clip_denoised: bool = False) -> dict[str, torch.Tensor]:
        """p(x_{t-1} | x_t) from the model's (B, 2C, ...) output: ``mean`` (the posterior mean at the
        predicted x_0), ``variance``, ``log_variance`` (IDDPM's learned range, Eq. 15: v = 1 gives
        beta_t, v = -1 beta~_t, not clamped) and ``pred_xstart`` (clamped to [-1, 1] with
        ``clip_denoised``; DiT samples latents and leaves it off)."""
        dtype = self._compute_dtype(model_output, x_t)
        model_output, x_t = model_output.to(dtype), x_t.to(dtype)
        eps, var_values = model_output.split(x_t.shape[1], dim=1)
        frac = (var_values + 1.0) / 2.0
        log_variance = (frac * self._extract("log_betas", t, var_values)
                        + (1.0 - frac) * self._extract("posterior_log_variance_clipped", t, var_values))
        pred_xstart = (self._extract("sqrt_recip_alphas_cumprod", t, x_t) * x_t
                       - self._extract("sqrt_recipm1_alphas_cumprod", t, x_t) * eps)  # inverse of Eq. 4
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1.0, 1.0)
        mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x_t, t)
        return {"mean": mean, "variance": torch.exp(log_variance), "log_variance": log_variance,
                "pred_xstart": pred_xstart}

    def p_sample(self, model_output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                 noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
                 clip_denoised: bool = False) -> dict[str, torch.Tensor]:
        """One ancestral step x_t -> x_{t-1} = mean + exp(0.5 log_var) z, no noise at t = 0: DiT's
        sampler step. With a respaced diffusion the model is called at ``timestep_map[t]``."""
        out = self.p_mean_variance(model_output, x_t, t, clip_denoised=clip_denoised)
        mean = out["mean"]
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        nonzero = (t != 0).to(mean.dtype).reshape(-1, *([1] * (mean.ndim - 1)))
        sample = mean + nonzero * torch.exp(0.5 * out["log_variance"]) * noise.to(mean.dtype)
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    def vb_terms_bpd(self, model_output: torch.Tensor, x_start: torch.Tensor, x_t: torch.Tensor,
                     t: torch.Tensor) -> torch.Tensor:
        """The variational bound term of one timestep in bits per dimension, (B,): for t > 0
        KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) (Ho et al. 2020, Eq. 5), for t = 0 the
        decoder NLL (Eq. 13)."""
        dtype = self._compute_dtype(model_output, x_start, x_t)
        x_start, x_t = x_start.to(dtype), x_t.to(dtype)
        true_mean, _, true_log_var = self.q_posterior_mean_variance(x_start, x_t, t)
        out = self.p_mean_variance(model_output, x_t, t)
        kl = mean_flat(normal_kl(true_mean, true_log_var, out["mean"], out["log_variance"])) / math.log(2.0)
        log_scales = 0.5 * out["log_variance"].expand_as(x_start)
        nll = -mean_flat(discretized_gaussian_log_likelihood(x_start, out["mean"], log_scales)) / math.log(2.0)
        return torch.where(t.to(kl.device) == 0, nll, kl)

    def training_losses(self, model_output: torch.Tensor, x_start: torch.Tensor, x_t: torch.Tensor,
                        t: torch.Tensor, noise: torch.Tensor) -> dict[str, torch.Tensor]:
        """DiT's loss per sample, ``{"mse", "vb", "loss"}`` of shape (B,): the eps MSE (Ho et al.
        2020, Eq. 14) plus the VB term on the output with the eps half *detached*, so that the
        variance learns from the bound and the mean from the MSE only (IDDPM's L_hybrid, Sec. 3.1,
        whose lambda = 0.001 the bits-per-dim scale realises). The load-balance loss is the
        training loop's."""
        eps, var_values = model_output.split(x_t.shape[1], dim=1)
        dtype = self._compute_dtype(model_output, noise)
        mse = mean_flat((noise.to(dtype) - eps.to(dtype)) ** 2)
        vb = self.vb_terms_bpd(torch.cat([eps.detach(), var_values], dim=1), x_start, x_t, t)
        return {"mse": mse, "vb": vb, "loss": mse + vb}

    def respace(self, timesteps: int | str | Sequence[int]) -> "GaussianDiffusion":
        """The diffusion over a subset of the steps (ADM's respacing): a count or section string
        for :func:`space_timesteps`, or the kept timesteps. ``beta'_i = 1 - abar_{k_i} / abar_{k_{i-1}}``
        keeps the marginals q(x_t | x_0) at the kept steps."""
        kept = space_timesteps(self.num_timesteps, timesteps) if isinstance(timesteps, (int, str)) else \
            sorted(set(int(k) for k in timesteps))
        abar, prev, betas = self.alphas_cumprod.numpy(), 1.0, []
        for k in kept:
            betas.append(1.0 - abar[k] / prev)
            prev = abar[k]
        return GaussianDiffusion(betas, timestep_map=[int(self.timestep_map[k]) for k in kept])


def create_diffusion(sampling_steps: int | str | Sequence[int] | None = None) -> GaussianDiffusion:
    """The paper's diffusion (1000 linear steps, 1e-4..0.02), respaced for sampling when asked."""
    diffusion = GaussianDiffusion()
    return diffusion if sampling_steps in (None, "", 1000) else diffusion.respace(sampling_steps)
