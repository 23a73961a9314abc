"""Diffusers pipelines of moh-dit (installed as ``moh_dit.pipelines``)."""

from .pipeline_moh_dit import MoHDiTPipeline, MoHDiTPipelineOutput, make_scheduler

__all__ = ["MoHDiTPipeline", "MoHDiTPipelineOutput", "make_scheduler"]
