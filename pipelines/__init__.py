"""Diffusers pipelines of moh-dit (installed as ``moh_dit.pipelines``)."""
