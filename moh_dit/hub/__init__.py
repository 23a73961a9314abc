"""Models in and out: checkpoint conversion (convert), upcycling a dense DiT (upcycle), pipeline folders
that carry their own code (export)."""
