"""ADM-comparable evaluation of samples: FID, sFID, Inception Score, precision, recall, class accuracy.

    >>> from moh_dit.evaluation import evaluate
    >>> result = evaluate("samples.npz", "VIRTUAL_imagenet256_labeled.npz", device="cuda")
    >>> result["fid"], result["sfid"], result["inception_score"], result["precision"], result["recall"]

:mod:`.inception` is the feature network (torch-fidelity's TF-compatible InceptionV3),
:mod:`.adm` ADM's evaluator on its features, :mod:`.classes` the class accuracy of samples.
"""

from .adm import (ADM_K, ADM_SPLIT_SIZE, CACHE_ENV, Features, FeatureStatistics, Images, Reference, check_statistics,
                  compute_metrics, compute_statistics, evaluate, extract_features, extractor_identity,
                  fid_from_features, frechet_distance, frechet_distance_from_features, inception_score,
                  load_reference, manifold_radii_squared, open_images, precision_recall, reference_cache_dir)
from .classes import (ClassAccuracyMeter, SampleClassifier, SmallCNN, class_accuracy, load_classifier,
                      read_class_map, read_sample_labels, train_classifier)
from .inception import (INCEPTION_WEIGHTS_ENV, INCEPTION_WEIGHTS_NAME, INCEPTION_WEIGHTS_SHA256_PREFIX,
                        INCEPTION_WEIGHTS_URL, TFInceptionV3Features, build_random_inception, load_inception,
                        random_inception_state_dict, resolve_inception_weights, save_random_inception_weights,
                        tf32_disabled)

__all__ = [
    "ADM_K", "ADM_SPLIT_SIZE", "CACHE_ENV", "INCEPTION_WEIGHTS_ENV", "INCEPTION_WEIGHTS_NAME",
    "INCEPTION_WEIGHTS_SHA256_PREFIX", "INCEPTION_WEIGHTS_URL", "ClassAccuracyMeter", "FeatureStatistics", "Features",
    "Images", "Reference", "SampleClassifier", "SmallCNN", "TFInceptionV3Features", "build_random_inception",
    "check_statistics", "class_accuracy", "compute_metrics", "compute_statistics", "evaluate", "extract_features",
    "extractor_identity", "fid_from_features", "frechet_distance", "frechet_distance_from_features",
    "inception_score", "load_classifier", "load_inception", "load_reference", "manifold_radii_squared",
    "open_images", "precision_recall", "random_inception_state_dict", "read_class_map", "read_sample_labels",
    "reference_cache_dir", "resolve_inception_weights", "save_random_inception_weights", "tf32_disabled",
    "train_classifier",
]
