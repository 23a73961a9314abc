"""Diffusers pipelines of moh-dit (installed as ``moh_dit.pipelines``)."""

# diffusers loads a pipeline component from a module only once that module is imported: this makes
# MoHDiTPipeline.from_pretrained find the transformer class named in a saved model_index.json.
from ..models import transformer_moh_dit  # noqa: F401
from .pipeline_moh_dit import MoHDiTPipeline, MoHDiTPipelineOutput, make_scheduler

__all__ = ["MoHDiTPipeline", "MoHDiTPipelineOutput", "make_scheduler"]
