"""ADM-comparable evaluation of samples: :mod:`.inception` (the feature network), :mod:`.adm` (FID, sFID,
Inception Score, precision/recall as ADM's evaluator), :mod:`.classes` (class accuracy of samples).

    >>> from moh_dit.evaluation import evaluate
    >>> evaluate("samples.npz", "VIRTUAL_imagenet256_labeled.npz", device="cuda")["fid"]
"""

from .adm import (ADM_K, ADM_SPLIT_SIZE, CACHE_ENV, Features, FeatureStatistics, Images, Reference,  # noqa: F401
                  check_statistics, class_accuracy, compute_metrics, compute_statistics, evaluate, extract_features,
                  extractor_identity, fid_from_features, frechet_distance, frechet_distance_from_features,
                  inception_score, load_reference, manifold_radii_squared, open_images, precision_recall,
                  reference_cache_dir)
from .classes import (ClassAccuracyMeter, SampleClassifier, SmallCNN, load_classifier,  # noqa: F401
                      read_class_map, read_sample_labels, train_classifier)
from .inception import (INCEPTION_WEIGHTS_ENV, INCEPTION_WEIGHTS_NAME, INCEPTION_WEIGHTS_SHA256_PREFIX,  # noqa: F401
                        INCEPTION_WEIGHTS_URL, TFInceptionV3Features, build_random_inception, load_inception,
                        random_inception_state_dict, resolve_inception_weights, save_random_inception_weights,
                        tf32_disabled)
