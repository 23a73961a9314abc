"""``moh-dit evaluate --samples samples.npz --ref VIRTUAL_imagenet256_labeled.npz --output metrics.json``"""

from __future__ import annotations

import argparse
import os

from . import int_range

DESCRIPTION = "FID, sFID, IS, precision/recall and class accuracy of samples"


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", required=True, help="sample .npz (arr_0 uint8 NHWC, streamed) or image folder")
    parser.add_argument("--ref", dest="reference", metavar="REF", required=True,
                        help="ADM reference batch .npz, statistics .npz (mu, sigma), or image .npz / folder")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--inception-weights", help="torch-fidelity's weights-inception-2015-12-05-6726825d.pth "
                         "(default: $MOH_DIT_INCEPTION_WEIGHTS, the torch hub cache, else a download)")
    weights.add_argument("--random-inception-seed", type=int_range(0, 2**64 - 1),
                         help="a random Inception with this seed: offline smoke tests, NOT comparable to published")
    parser.add_argument("--no-download", action="store_true", help="never download the Inception weights")
    parser.add_argument("--output", help="write the results to this JSON file")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when there is one)")
    parser.add_argument("--batch-size", type=int_range(1, 4096), default=64, help="images per Inception pass")
    parser.add_argument("--num-workers", type=int_range(0, os.cpu_count() or 1), default=4,
                        help="image decoding processes for folders")
    parser.add_argument("--cache-dir", help="reference statistics cache (default: $MOH_DIT_CACHE/reference_stats, "
                        "else ~/.cache/moh-dit/reference_stats)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the reference cache")
    parser.add_argument("--split-size", type=int_range(1), default=5000, help="Inception Score split (ADM: 5000)")
    parser.add_argument("--allow-resolution-mismatch", action="store_true",
                        help="evaluate samples whose resolution is not the reference's (recorded in the JSON)")
    parser.add_argument("--classifier", help="class accuracy with a train-classifier folder or torchvision:NAME")
    parser.add_argument("--classifier-weights", help="local state dict for a torchvision:NAME classifier")
    parser.add_argument("--labels", help="the samples' class labels as .npy (default: arr_1 of --samples)")
    parser.add_argument("--class-index", dest="class_map",
                        help="JSON map from sample label to the classifier's class (index or name)")


def main(args: argparse.Namespace) -> None:
    import contextlib
    import errno
    import json
    import logging
    from pathlib import Path

    import torch

    from moh_dit import evaluation
    from moh_dit.outputs import check_outside_inputs, read_json, write_json

    classifier_folder = None if (args.classifier or "torchvision:").startswith("torchvision:") else args.classifier
    inputs = {"--samples": args.samples, "--ref": args.reference, "--labels": args.labels,
              "--class-index": args.class_map, "--classifier": classifier_folder,
              "--classifier-weights": args.classifier_weights, "--inception-weights": args.inception_weights}
    if args.output is not None:
        check_outside_inputs(args.output, inputs)
        earlier = {}
        with contextlib.suppress(OSError, ValueError):
            earlier = read_json(args.output)
        if Path(args.output).exists() and not (isinstance(earlier, dict) and "fid" in earlier):
            raise FileExistsError(errno.EEXIST, "not an earlier result of moh-dit evaluate; choose another --output",
                                  args.output)
    if not args.no_cache:
        check_outside_inputs(args.cache_dir or evaluation.reference_cache_dir(),
                             {"--samples": args.samples, "--ref": args.reference})
    run_on = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    classifier = labels = class_map = None
    if args.classifier is not None:
        classifier = evaluation.load_classifier(args.classifier, args.classifier_weights, device=run_on)
        labels = evaluation.read_sample_labels(args.samples, args.labels)
        class_map = None if args.class_map is None else evaluation.read_class_map(args.class_map, classifier.classes)
    elif args.labels or args.class_map or args.classifier_weights:
        raise ValueError("--labels, --class-index and --classifier-weights are for class accuracy: give --classifier")
    if args.random_inception_seed is not None:
        logging.getLogger(__name__).warning(f"a random InceptionV3 (seed {args.random_inception_seed}): a smoke test "
                                            "whose numbers are NOT comparable to published ones")
    result = evaluation.evaluate(
        args.samples, args.reference, inception_weights=args.inception_weights,
        random_inception_seed=args.random_inception_seed, download=not args.no_download, device=run_on,
        batch_size=args.batch_size, num_workers=args.num_workers, cache_dir=args.cache_dir,
        use_cache=not args.no_cache, split_size=args.split_size,
        allow_resolution_mismatch=args.allow_resolution_mismatch, classifier=classifier, labels=labels,
        class_map=class_map)
    print(json.dumps(result, indent=2))
    if args.output is not None:
        write_json(args.output, result)
