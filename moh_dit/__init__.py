"""MoH-DiT: Mixture-of-Head attention for Diffusion Transformers on diffusers."""
