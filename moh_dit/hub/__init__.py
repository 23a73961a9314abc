"""Models in and out: release and diffusers checkpoint conversion, upcycling a dense DiT,
self-contained pipeline exports (with their bundled code and model card)."""
