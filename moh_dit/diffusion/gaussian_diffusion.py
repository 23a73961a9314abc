"""Gaussian diffusion for MoH-DiT training: schedule, q-sampling, posteriors, losses, VB term.

The model is a function of ``(x_t, t, y)`` and knows nothing about noise; everything about
the diffusion process lives here. The training loop calls the model itself and hands its
output to :meth:`GaussianDiffusion.training_losses`::

    diffusion = create_diffusion()                       # 1000 steps, linear betas
    t = diffusion.sample_timesteps(x0.shape[0], device=x0.device)
    noise = torch.randn_like(x0)
    x_t = diffusion.q_sample(x0, t, noise)
    out = model(x_t, t, class_labels=y)                 # sample has 2C channels
    terms = diffusion.training_losses(out.sample, x0, x_t, t, noise)
    loss = terms["loss"].mean() + 0.01 * out.load_balance_loss

References: Ho et al. 2020 "Denoising Diffusion Probabilistic Models" (DDPM); Nichol &
Dhariwal 2021 "Improved Denoising Diffusion Probabilistic Models" (IDDPM); Peebles & Xie
2023 "Scalable Diffusion Models with Transformers" (DiT), whose training objective this
module reproduces: DiT's ``create_diffusion`` defaults to learned-range variance with
``LossType.MSE`` (``rescale_learned_sigmas=False``), i.e. ``loss = MSE(eps) + VB`` with
the VB term *not* rescaled. (IDDPM's ``RESCALED_MSE`` multiplies VB by T / 1000, which is
1 for the 1000-step training schedule anyway; :meth:`training_losses` exposes it as
``vb_scale`` for experiments.)

Conventions: timesteps are 0-based indices ``t in [0, T)``; index ``t`` is the paper's
step ``t + 1``, so ``t = 0`` is the last denoising step, whose VB term is the decoder NLL.
Schedule tables are computed in float64 once; the math runs in float32 (float64 when the
inputs are float64), never in half precision, whatever dtype the model produced.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import torch

__all__ = [
    "GaussianDiffusion",
    "create_diffusion",
    "linear_beta_schedule",
    "space_timesteps",
    "normal_kl",
    "approx_standard_normal_cdf",
    "discretized_gaussian_log_likelihood",
    "mean_flat",
]

_LOG2 = math.log(2.0)


# --------------------------------------------------------------------------------------
# Elementwise helpers
# --------------------------------------------------------------------------------------


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    """Mean over every dimension but the batch one: (B, ...) -> (B,)."""
    return x.mean(dim=tuple(range(1, x.ndim)))


def normal_kl(
    mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor, logvar2: torch.Tensor
) -> torch.Tensor:
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) elementwise, in nats.

    Closed form for two univariate Gaussians:
    ``0.5 * (logvar2 - logvar1 + e^(logvar1 - logvar2) + (mean1 - mean2)^2 e^-logvar2 - 1)``.
    Working with log variances keeps it finite where a variance underflows.
    """
    return 0.5 * (
        -1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2)
    )


def approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """Standard normal CDF, tanh approximation (Page 1977), as IDDPM / ADM / DiT use it.

    ``Phi(x) ~= 0.5 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``; absolute error below 2e-4.
    Kept instead of the exact ``erf`` so that the t = 0 loss matches DiT's numbers.
    """
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(
    x: torch.Tensor, means: torch.Tensor, log_scales: torch.Tensor, exact: bool = False
) -> torch.Tensor:
    """Log-likelihood of data on a 256-level grid in [-1, 1] under N(means, e^(2 log_scales)).

    The decoder term L_0 of Ho et al. 2020 (Eq. 13): each value x owns the bin
    ``[x - 1/255, x + 1/255]`` (bins are 2/255 wide on [-1, 1]) and its probability is the
    Gaussian mass of that bin, ``Phi((x + 1/255 - mu) / s) - Phi((x - 1/255 - mu) / s)``.
    The two edge bins are open: below ``-0.999`` the mass is ``Phi(upper)`` (the whole left
    tail), above ``0.999`` it is ``1 - Phi(lower)``. Probabilities are clamped at 1e-12
    before the log, as in IDDPM.

    ``exact=False`` uses the tanh CDF approximation of IDDPM / DiT; ``exact=True`` uses
    ``torch.special.ndtr``. Returns natural-log values of ``x``'s shape.

    Note: DiT applies this term to VAE latents (scaled by 0.18215), which are neither in
    [-1, 1] nor on a 256-level grid; it is then only a surrogate for the t = 0 loss, kept
    as is because it is what the released models were trained with.
    """
    if not (x.shape == means.shape == log_scales.shape):
        raise ValueError(
            f"x, means and log_scales must have one shape, got {tuple(x.shape)}, "
            f"{tuple(means.shape)}, {tuple(log_scales.shape)}"
        )
    cdf = torch.special.ndtr if exact else approx_standard_normal_cdf
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


# --------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------


def linear_beta_schedule(num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02) -> np.ndarray:
    """Ho et al. 2020's linear betas, float64. The paper's setting is 1000 steps, 1e-4..0.02."""
    if num_timesteps < 1:
        raise ValueError(f"num_timesteps must be >= 1, got {num_timesteps}")
    if not (0.0 < beta_start <= beta_end < 1.0):
        raise ValueError(f"need 0 < beta_start <= beta_end < 1, got beta_start={beta_start}, beta_end={beta_end}")
    return np.linspace(beta_start, beta_end, num_timesteps, dtype=np.float64)


def space_timesteps(num_timesteps: int, section_counts: int | str | Sequence[int]) -> list[int]:
    """The timesteps ADM / DiT keep when sampling with fewer steps ("timestep respacing").

    ``section_counts`` splits ``[0, num_timesteps)`` into equal sections (the first ones one
    longer when it does not divide) and takes that many evenly strided steps from each,
    both ends included, rounding each position to the nearest integer. ``250`` over 1000
    steps gives 0, 4, 8, ..., 995, 999 -- not diffusers' ``"leading"`` spacing
    (0, 4, ..., 996), so a diffusers scheduler that must reproduce DiT's 250-step sampler
    should be given these timesteps explicitly. Returns them sorted ascending.
    """
    if isinstance(section_counts, str):
        section_counts = [int(part) for part in section_counts.split(",")]
    elif isinstance(section_counts, int):
        section_counts = [section_counts]
    counts = list(section_counts)
    base, extra = divmod(num_timesteps, len(counts))
    steps: list[int] = []
    start = 0
    for i, count in enumerate(counts):
        size = base + (1 if i < extra else 0)
        if not 1 <= count <= size:
            raise ValueError(
                f"cannot take {count} steps from a section of {size} steps "
                f"(num_timesteps={num_timesteps}, section_counts={counts}); use 1..{size}"
            )
        stride = 1.0 if count == 1 else (size - 1) / (count - 1)
        # Accumulate the float position step by step (rather than i * stride) so that the
        # rounding of every position is the same as in ADM's reference implementation.
        position = 0.0
        for _ in range(count):
            steps.append(start + round(position))
            position += stride
        start += size
    return sorted(set(steps))


# --------------------------------------------------------------------------------------
# The diffusion process
# --------------------------------------------------------------------------------------


class GaussianDiffusion:
    """Discrete-time Gaussian diffusion with an eps-predicting, learned-range-variance model.

    Args:
        num_timesteps: number of diffusion steps T (1000 in DiT / MoH-DiT).
        beta_start, beta_end: the linear beta schedule's end points.

    Use :meth:`from_betas` for another schedule and :meth:`respace` for a sampler that
    skips steps. Model outputs have ``2C`` channels: ``eps`` then the variance values
    ``v in [-1, 1]`` of IDDPM's learned range (Nichol & Dhariwal 2021, Eq. 15).
    """

    # Names of the per-timestep float64 tables, built in _setup.
    _TABLES = (
        "betas",
        "log_betas",
        "alphas_cumprod",
        "alphas_cumprod_prev",
        "sqrt_alphas_cumprod",
        "sqrt_one_minus_alphas_cumprod",
        "sqrt_recip_alphas_cumprod",
        "sqrt_recipm1_alphas_cumprod",
        "posterior_variance",
        "posterior_log_variance_clipped",
        "posterior_mean_coef1",
        "posterior_mean_coef2",
    )

    def __init__(self, num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02):
        self._setup(linear_beta_schedule(num_timesteps, beta_start, beta_end), timestep_map=None)

    @classmethod
    def from_betas(cls, betas: Iterable[float], timestep_map: Sequence[int] | None = None) -> "GaussianDiffusion":
        """A diffusion over an arbitrary beta schedule.

        ``timestep_map[i]`` is the timestep the *model* is called with at index ``i`` (set
        by :meth:`respace`; identity when None).
        """
        obj = cls.__new__(cls)
        obj._setup(np.asarray(list(betas), dtype=np.float64), timestep_map)
        return obj

    def _setup(self, betas: np.ndarray, timestep_map: Sequence[int] | None) -> None:
        if betas.ndim != 1 or betas.size < 2:
            raise ValueError(f"betas must be a 1-D schedule of at least 2 steps, got shape {betas.shape}")
        if not ((betas > 0).all() and (betas <= 1).all()):
            raise ValueError(f"betas must lie in (0, 1], got min {betas.min()} max {betas.max()}")
        T = betas.size
        self.num_timesteps = T
        if timestep_map is None:
            timestep_map = range(T)
        self.timestep_map = torch.as_tensor(list(timestep_map), dtype=torch.long)
        if self.timestep_map.shape != (T,):
            raise ValueError(f"timestep_map needs {T} entries, got {tuple(self.timestep_map.shape)}")

        alphas = 1.0 - betas
        alphas_cumprod = np.cumprod(alphas)
        alphas_cumprod_prev = np.append(1.0, alphas_cumprod[:-1])
        # Posterior q(x_{t-1} | x_t, x_0) = N(coef1 x_0 + coef2 x_t, beta~_t), Ho et al. 2020
        # Eq. 6-7: beta~_t = beta_t (1 - abar_{t-1}) / (1 - abar_t),
        # mu~_t = sqrt(abar_{t-1}) beta_t / (1 - abar_t) x_0 + sqrt(alpha_t) (1 - abar_{t-1}) / (1 - abar_t) x_t.
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
            # beta~ is 0 at the first step (abar_{-1} = 1), so its log is clipped by reusing
            # the next step's value, as IDDPM does; this is also the lower end of the
            # learned range at t = 0.
            "posterior_log_variance_clipped": np.log(np.append(posterior_variance[1], posterior_variance[1:])),
            "posterior_mean_coef1": betas * np.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod),
            "posterior_mean_coef2": (1.0 - alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - alphas_cumprod),
        }
        self._tables = {name: torch.from_numpy(np.ascontiguousarray(tables[name])) for name in self._TABLES}
        self._cache: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    # ---- table access ----------------------------------------------------------------

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
        """Table values at ``t`` shaped (B, 1, ..., 1) to broadcast against ``like``.

        Tables are cast to ``like``'s device and dtype once and cached, so that training
        does no host-to-device copy (and no sync) per step; the cast before the gather
        gives the same values as DiT's gather-then-cast.
        """
        key = (name, like.device, like.dtype)
        table = self._cache.get(key)
        if table is None:
            table = self._tables[name].to(device=like.device, dtype=like.dtype)
            self._cache[key] = table
        out = table[t.to(like.device)]
        return out.reshape(t.shape[0], *([1] * (like.ndim - 1)))

    @staticmethod
    def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
        # Half-precision log-variances and bin probabilities lose too much; compute in at
        # least float32 (float64 stays float64 for reference computations).
        dtype = torch.float32
        for x in tensors:
            dtype = torch.promote_types(dtype, x.dtype)
        return dtype

    def _check_t(self, t: torch.Tensor, batch: int) -> None:
        if t.shape != (batch,):
            raise ValueError(f"t must have shape ({batch},) (one timestep per sample), got {tuple(t.shape)}")

    # ---- forward process -------------------------------------------------------------

    def sample_timesteps(
        self, batch_size: int, device: torch.device | str | None = None, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Uniform training timesteps in [0, T), shape (batch_size,), as DiT draws them."""
        gen_device = generator.device if generator is not None else device
        t = torch.randint(0, self.num_timesteps, (batch_size,), generator=generator, device=gen_device)
        return t.to(device) if device is not None else t

    def q_sample(self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps (Ho et al. 2020, Eq. 4), in x_start's dtype."""
        if noise.shape != x_start.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != x_start shape {tuple(x_start.shape)}")
        self._check_t(t, x_start.shape[0])
        return (
            self._extract("sqrt_alphas_cumprod", t, x_start) * x_start
            + self._extract("sqrt_one_minus_alphas_cumprod", t, x_start) * noise
        )

    def q_posterior_mean_variance(
        self, x_start: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mean, variance and clipped log variance of q(x_{t-1} | x_t, x_0) (Ho et al. 2020, Eq. 6-7).

        Mean has x_t's shape; variance and log variance are (B, 1, ..., 1).
        """
        self._check_t(t, x_t.shape[0])
        mean = self._extract("posterior_mean_coef1", t, x_t) * x_start + self._extract("posterior_mean_coef2", t, x_t) * x_t
        return mean, self._extract("posterior_variance", t, x_t), self._extract("posterior_log_variance_clipped", t, x_t)

    def predict_xstart_from_eps(self, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """x_0 = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t), the inverse of Eq. 4."""
        return self._extract("sqrt_recip_alphas_cumprod", t, x_t) * x_t - self._extract(
            "sqrt_recipm1_alphas_cumprod", t, x_t
        ) * eps

    # ---- reverse process -------------------------------------------------------------

    def learned_range_log_variance(self, var_values: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """log Sigma_theta = frac log beta_t + (1 - frac) log beta~_t, frac = (v + 1) / 2.

        Nichol & Dhariwal 2021, Eq. 15, with the model's ``v in [-1, 1]`` mapped to the
        interpolation weight: v = 1 gives beta_t, v = -1 gives beta~_t (clipped at t = 0).
        ``v`` is not clamped, as in IDDPM: values outside [-1, 1] extrapolate.
        """
        self._check_t(t, var_values.shape[0])
        max_log = self._extract("log_betas", t, var_values)
        min_log = self._extract("posterior_log_variance_clipped", t, var_values)
        frac = (var_values + 1.0) / 2.0
        return frac * max_log + (1.0 - frac) * min_log

    def _split_output(self, model_output: torch.Tensor, x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, C = x_t.shape[:2]
        if model_output.shape != (B, 2 * C, *x_t.shape[2:]):
            raise ValueError(
                f"model output must have shape {(B, 2 * C, *x_t.shape[2:])} (eps and variance values "
                f"for a {C}-channel input; was the model built with learn_sigma / out_channels=2C?), "
                f"got {tuple(model_output.shape)}"
            )
        eps, var_values = model_output.split(C, dim=1)
        return eps, var_values

    def p_mean_variance(
        self, model_output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, clip_denoised: bool = False
    ) -> dict[str, torch.Tensor]:
        """p(x_{t-1} | x_t) from the model's output: mean, variance, log_variance, pred_xstart.

        The mean is the posterior mean (Eq. 7) at the predicted x_0. ``clip_denoised``
        clamps x_0 to [-1, 1]; DiT works on latents and leaves it off. Computed in float32
        or wider; ``t`` indexes this diffusion's (possibly respaced) steps.
        """
        dtype = self._compute_dtype(model_output, x_t)
        model_output, x_t = model_output.to(dtype), x_t.to(dtype)
        eps, var_values = self._split_output(model_output, x_t)
        log_variance = self.learned_range_log_variance(var_values, t)
        pred_xstart = self.predict_xstart_from_eps(x_t, t, eps)
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1.0, 1.0)
        mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x_t, t)
        return {
            "mean": mean,
            "variance": torch.exp(log_variance),
            "log_variance": log_variance,
            "pred_xstart": pred_xstart,
        }

    def p_sample(
        self,
        model_output: torch.Tensor,
        x_t: torch.Tensor,
        t: torch.Tensor,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        clip_denoised: bool = False,
    ) -> dict[str, torch.Tensor]:
        """One ancestral DDPM step x_t -> x_{t-1} = mean + exp(0.5 log_var) z; no noise at t = 0.

        Reference implementation for tests; the pipeline uses diffusers' schedulers. Returns
        ``{"sample", "pred_xstart"}`` in float32 (or wider). With a respaced diffusion the
        *model* must be called at ``timestep_map[t]``.
        """
        out = self.p_mean_variance(model_output, x_t, t, clip_denoised=clip_denoised)
        mean = out["mean"]
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        nonzero = (t != 0).to(mean.dtype).reshape(-1, *([1] * (mean.ndim - 1)))
        sample = mean + nonzero * torch.exp(0.5 * out["log_variance"]) * noise.to(mean.dtype)
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    # ---- losses ----------------------------------------------------------------------

    def vb_terms_bpd(
        self, model_output: torch.Tensor, x_start: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """The variational bound term L_{t} of one timestep, in bits per dimension, shape (B,).

        For t > 0: KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) (Ho et al. 2020, Eq. 5);
        for t = 0: the decoder NLL -log p(x_0 | x_1) on the discretised grid (Eq. 13).
        Both are means over dimensions of natural-log values, divided by ln 2, as in IDDPM.
        """
        dtype = self._compute_dtype(model_output, x_start, x_t)
        x_start, x_t = x_start.to(dtype), x_t.to(dtype)
        true_mean, _, true_log_var = self.q_posterior_mean_variance(x_start, x_t, t)
        out = self.p_mean_variance(model_output, x_t, t, clip_denoised=False)
        kl = mean_flat(normal_kl(true_mean, true_log_var, out["mean"], out["log_variance"])) / _LOG2
        log_scales = 0.5 * out["log_variance"].expand_as(x_start)
        nll = -mean_flat(discretized_gaussian_log_likelihood(x_start, out["mean"], log_scales)) / _LOG2
        return torch.where(t.to(kl.device) == 0, nll, kl)

    def training_losses(
        self,
        model_output: torch.Tensor,
        x_start: torch.Tensor,
        x_t: torch.Tensor,
        t: torch.Tensor,
        noise: torch.Tensor,
        vb_scale: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        """DiT's training loss per sample: ``{"mse", "vb", "loss"}``, each of shape (B,).

        ``mse`` is the eps-prediction error (Ho et al. 2020's L_simple, Eq. 14) averaged over
        dimensions. ``vb`` is :meth:`vb_terms_bpd` on the output with the eps half
        *detached*: the variance half learns from the bound while the mean learns from the
        MSE only (Nichol & Dhariwal 2021, Sec. 3.1, L_hybrid; there lambda = 0.001 is
        realised by the bits-per-dim scale rather than an explicit factor). ``loss = mse +
        vb_scale * vb``; DiT's default (LossType.MSE) is ``vb_scale = 1``; IDDPM's
        RESCALED_MSE would be ``num_timesteps / 1000``, also 1 for T = 1000.

        The model's load-balance loss is not included; the training loop adds it.
        """
        eps, var_values = self._split_output(model_output, x_t)
        if noise.shape != eps.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != x_t shape {tuple(x_t.shape)}")
        self._check_t(t, x_t.shape[0])
        dtype = self._compute_dtype(model_output, noise)
        mse = mean_flat((noise.to(dtype) - eps.to(dtype)) ** 2)
        frozen = torch.cat([eps.detach(), var_values], dim=1)
        vb = self.vb_terms_bpd(frozen, x_start, x_t, t)
        return {"mse": mse, "vb": vb, "loss": mse + vb_scale * vb}

    # ---- respacing -------------------------------------------------------------------

    def respace(self, timesteps: int | str | Sequence[int]) -> "GaussianDiffusion":
        """A diffusion over a subset of this one's steps (ADM's timestep respacing).

        ``timesteps`` is a step count / section string for :func:`space_timesteps`, or an
        explicit list of kept timesteps. The new betas keep the marginals q(x_t | x_0) at the
        kept steps: ``beta'_i = 1 - abar_{k_i} / abar_{k_{i-1}}``; ``timestep_map`` of the
        result gives the original timestep to call the model with.
        """
        if isinstance(timesteps, (int, str)):
            kept = space_timesteps(self.num_timesteps, timesteps)
        else:
            kept = sorted(set(int(k) for k in timesteps))
        if not kept or kept[0] < 0 or kept[-1] >= self.num_timesteps:
            raise ValueError(f"kept timesteps must lie in [0, {self.num_timesteps}), got {kept[:3]}...{kept[-3:]}")
        abar = self.alphas_cumprod.numpy()
        prev = 1.0
        new_betas = []
        for k in kept:
            new_betas.append(1.0 - abar[k] / prev)
            prev = abar[k]
        base_map = self.timestep_map.tolist()
        return GaussianDiffusion.from_betas(new_betas, timestep_map=[base_map[k] for k in kept])


def create_diffusion(
    num_timesteps: int = 1000,
    beta_start: float = 1e-4,
    beta_end: float = 0.02,
    sampling_steps: int | str | Sequence[int] | None = None,
) -> GaussianDiffusion:
    """The paper's diffusion (1000 linear steps, 1e-4..0.02), optionally respaced for sampling."""
    diffusion = GaussianDiffusion(num_timesteps, beta_start, beta_end)
    if sampling_steps is None or sampling_steps == "" or sampling_steps == num_timesteps:
        return diffusion
    return diffusion.respace(sampling_steps)
