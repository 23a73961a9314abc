"""The data: ImageNet-style image folders, the latent cache, and the CPU demo's shapes dataset."""

from .datasets import (IMG_EXTENSIONS, CorruptImageError, ImageFolderDataset, ResumableSampler, center_crop_arr,
                       collate_skip_corrupt, find_image_folder, flip_for, image_to_tensor, item_rng, load_class_index,
                       load_image, read_image_size, scan_image_files, to_rgb, write_class_index)

__all__ = ["IMG_EXTENSIONS", "CorruptImageError", "ImageFolderDataset", "ResumableSampler", "center_crop_arr",
           "collate_skip_corrupt", "find_image_folder", "flip_for", "item_rng", "load_class_index", "load_image",
           "image_to_tensor", "read_image_size", "scan_image_files", "to_rgb", "write_class_index"]
