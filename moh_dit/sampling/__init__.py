"""Sampling at scale (sample folders, ADM ``.npz`` files, any number of processes) and the
FID-versus-head-activation-ratio sweep."""

from .sample import (CLASS_LABEL_MODES, DTYPES, ClassLabels, SampleSettings, check_folder_path, check_model_flags,
                     check_or_write_settings, check_settings, class_labels_for, generate_batch,
                     head_activation, indices_for_rank, load_pipeline, missing_indices, png_path,
                     preview_head_activation, quantize_dit, run_identity, sample_images, save_png_atomic,
                     write_adm_npz)

__all__ = ["CLASS_LABEL_MODES", "DTYPES", "ClassLabels", "SampleSettings", "class_labels_for", "indices_for_rank",
           "png_path", "missing_indices", "quantize_dit", "save_png_atomic", "write_adm_npz", "load_pipeline", "head_activation",
           "preview_head_activation", "run_identity", "check_or_write_settings", "check_settings",
           "check_folder_path", "check_model_flags", "sample_images", "generate_batch"]
