"""Evaluate samples against a reference with ADM's metrics: FID, sFID, Inception Score, precision, recall.

    python scripts/evaluate.py --samples samples.npz --ref VIRTUAL_imagenet256_labeled.npz \
        --inception-weights weights-inception-2015-12-05-6726825d.pth --output results.json

``--samples``: an ``.npz`` with ``arr_0`` uint8 (N, H, W, 3) (as DiT's sample script writes it;
streamed, never loaded whole) or a folder of images. ``--ref``: ADM's reference batch
(``mu``, ``sigma``, ``mu_s``, ``sigma_s``, ``arr_0``) or a folder / ``.npz`` of real images, whose
statistics are computed once and cached (in ``$MOH_DIT_CACHE/reference_stats``, else
``$XDG_CACHE_HOME/moh-dit/reference_stats``, else ``~/.cache/moh-dit/reference_stats``; ``--cache-dir``
elsewhere, ``--no-cache`` not at all). The numbers match ADM's TensorFlow evaluator when the
published Inception weights are used; the JSON says whether they were. Offline, without the
weights, ``--random-inception-seed N`` uses a randomly initialised Inception: a smoke test of the
whole path whose numbers the JSON and the log mark as NOT comparable to published ones. Samples and reference
of different resolutions are refused unless ``--allow-resolution-mismatch`` is given (then the
JSON records ``"allow_resolution_mismatch": true`` with both resolutions).

Class consistency of class-conditional samples (``class_accuracy``, ``class_accuracy_per_class``
in the JSON): the fraction of samples a classifier assigns to the class they were generated for::

    python scripts/evaluate.py --samples samples.npz --ref REF --classifier CLF_DIR --output m.json
    python scripts/evaluate.py --samples samples.npz --ref REF --classifier torchvision:resnet50 ...

``--classifier`` is a folder from ``scripts/train_classifier.py`` or ``torchvision:NAME`` (ImageNet
weights from the torch hub cache, a download, or ``--classifier-weights FILE``). The labels are
``arr_1`` of the samples ``.npz`` (``scripts/sample.py`` writes it) or ``--labels L.npy``;
``--class-index FILE`` maps labels to the classifier's classes when they differ.
All the work is done by :func:`moh_dit.evaluation.evaluate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, command, run_cli
from moh_dit.evaluation.classifier import load_classifier
from moh_dit.evaluation import (
    ADM_SPLIT_SIZE,
    CACHE_ENV,
    INCEPTION_WEIGHTS_ENV,
    EvaluationResult,
    check_class_names,
    evaluate,
    read_class_map,
    read_sample_labels,
    reference_cache_dir,
    sample_class_names,
)
from moh_dit.utils.output_folders import check_outside_inputs
from moh_dit.utils.io import write_json_atomic
from moh_dit.utils.logging import get_logger, info_enabled

logger = get_logger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", required=True, help="sample .npz (arr_0, uint8 NHWC) or image folder")
    parser.add_argument("--ref", dest="reference", metavar="REF", required=True,
                        help="ADM reference batch .npz, or image .npz/folder of real images")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument(
        "--inception-weights",
        default=None,
        help=f"InceptionV3 weights file (default: ${INCEPTION_WEIGHTS_ENV}, then the torch hub cache, then a download)",
    )
    weights.add_argument("--random-inception-seed", type=int, default=None,
                         help="use a random Inception with this seed (offline smoke tests only: NOT comparable to "
                              "published numbers)")
    parser.add_argument("--output", default=None, help="write the results to this file as JSON (atomically)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per Inception forward pass")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--num-workers", type=int, default=4, help="image decoding workers for folders")
    parser.add_argument(
        "--cache-dir", default=None,
        help=f"reference statistics cache folder (default: ${CACHE_ENV}/reference_stats, else "
             "$XDG_CACHE_HOME/moh-dit/reference_stats, else ~/.cache/moh-dit/reference_stats)",
    )
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the reference statistics cache")
    parser.add_argument("--no-download", action="store_true", help="never try to download the Inception weights")
    parser.add_argument(
        "--split-size", type=int, default=ADM_SPLIT_SIZE, help="Inception Score split size (ADM: 5000; keep it to compare)"
    )
    parser.add_argument(
        "--allow-resolution-mismatch",
        action="store_true",
        help="evaluate samples whose resolution differs from the reference's (refused by default; recorded in the JSON)",
    )
    parser.add_argument("--classifier", default=None,
                        help="measure class accuracy with this classifier: a scripts/train_classifier.py folder "
                             "or torchvision:NAME (e.g. torchvision:resnet50)")
    parser.add_argument("--classifier-weights", default=None,
                        help="local state-dict file for a torchvision:NAME classifier (offline)")
    parser.add_argument("--labels", default=None, help="the samples' class labels as .npy (default: arr_1 of --samples)")
    parser.add_argument("--class-index", dest="class_map", metavar="CLASS_INDEX", default=None,
                        help="JSON map from sample label to the classifier's class (index or name); default: same index")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """What only the command takes (--device, --output, --cache-dir, the flags of class accuracy),
    before the Inception network is loaded or any image is read; evaluate() checks the rest."""
    try:
        torch.device(args.device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}") from None
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device} but CUDA is not available; use --device cpu")
    if args.output is not None:
        output = Path(args.output)
        if output.is_dir():
            raise ValueError(f"--output {args.output} is a folder; give a file name such as {output / 'results.json'}")
        if not output.resolve().parent.is_dir():
            raise FileNotFoundError(f"--output folder does not exist: {output.resolve().parent}")
    if args.cache_dir is not None and not args.no_cache and Path(args.cache_dir).exists():
        if not Path(args.cache_dir).is_dir():
            raise ValueError(f"--cache-dir {args.cache_dir} is a file, not a folder")
    if args.classifier is None:
        for flag, value in (("--labels", args.labels), ("--class-index", args.class_map),
                            ("--classifier-weights", args.classifier_weights)):
            if value is not None:
                raise ValueError(f"{flag} is for class accuracy, which needs --classifier CLF_DIR|torchvision:NAME")
    check_outputs(args)


def check_outputs(args: argparse.Namespace) -> None:
    """What evaluate writes (the --output JSON, the reference cache) is never what it reads, and
    an existing --output is replaced only when it is an earlier result of this command."""
    classifier = None if args.classifier is None or args.classifier.startswith("torchvision:") else args.classifier
    inputs = {name: None if value is None else Path(value).expanduser() for name, value in (
        ("samples", args.samples), ("reference", args.reference), ("labels", args.labels), ("class_map", args.class_map),
        ("classifier", classifier), ("classifier_weights", args.classifier_weights),
        ("inception_weights", args.inception_weights))}
    if args.output is not None:
        check_outside_inputs(Path(args.output).expanduser(), inputs, "output")
        if Path(args.output).is_file() and not is_evaluation_result(args.output):
            raise FileExistsError(f"--output {args.output} exists and is not a moh-dit evaluate result; choose "
                                  "another --output, or delete the file yourself")
    if not args.no_cache:
        cache = Path(args.cache_dir).expanduser() if args.cache_dir is not None else reference_cache_dir()
        check_outside_inputs(cache, {"samples": inputs["samples"], "reference": inputs["reference"]}, "cache_dir")


def is_evaluation_result(path: str | Path) -> bool:
    """Whether ``path`` holds a JSON result this command wrote (the fields of EvaluationResult)."""
    try:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    fields = {field.name for field in dataclasses.fields(EvaluationResult)}
    return isinstance(payload, dict) and fields <= set(payload)


def class_accuracy_inputs(args: argparse.Namespace) -> dict:
    """The classifier, labels and class map, loaded before the Inception network (cheap checks first)."""
    if args.classifier is None:
        return {}
    labels = read_sample_labels(args.samples, args.labels)
    classifier = load_classifier(args.classifier, args.classifier_weights, device=args.device)
    class_map = None if args.class_map is None else read_class_map(args.class_map, classifier.classes)
    if class_map is None:
        # The samples' classes, as moh-dit sample recorded them, against the classifier's (the sweep's check).
        check_class_names(classifier, sample_class_names(args.samples))
    return dict(classifier=classifier, labels=labels, class_map=class_map)


@command
def main(args: argparse.Namespace) -> dict:
    check_args(args)
    consistency = class_accuracy_inputs(args)
    if args.random_inception_seed is not None:
        logger.warning(f"random InceptionV3 (seed {args.random_inception_seed}) instead of the published weights: "
                       "an offline smoke test; its FID, sFID, IS, precision and recall are NOT comparable to "
                       "published numbers")
    result = evaluate(
        args.samples,
        args.reference,
        inception_weights=args.inception_weights,
        random_inception_seed=args.random_inception_seed,
        download=not args.no_download,
        device=args.device,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        cache_dir=args.cache_dir,
        use_cache=not args.no_cache,
        split_size=args.split_size,
        progress=info_enabled(),
        allow_resolution_mismatch=args.allow_resolution_mismatch,
        **consistency,
    )
    payload = result.to_dict()
    logger.info(json.dumps(payload, indent=2))
    if args.output is not None:
        write_json_atomic(args.output, payload)
    return payload


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    sys.exit(cli())
