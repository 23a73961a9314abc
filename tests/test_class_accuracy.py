"""The class-consistency metric: a classifier trained on real images, the metric on cases whose
answer is known by construction, its place in evaluate.py, the sweep and sample.py's labels."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moh_dit.evaluation import classifier as clf
from moh_dit.data.datasets import find_image_folder, load_image
from moh_dit.data.demo_data import make_demo_dataset
from moh_dit.errors import InvalidInput
from moh_dit.evaluation import ClassAccuracyMeter, class_accuracy, read_class_map, read_sample_labels

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """A small demo dataset, a classifier trained on it, and its held-out real images with labels."""
    root = tmp_path_factory.mktemp("shapes")
    data = make_demo_dataset(root / "data", images_per_class=40, seed=0)
    trained = clf.train_classifier(data, root / "clf", epochs=8, batch_size=32, seed=0, log=None)
    classes, _, samples = find_image_folder(data)
    _, held = clf._split(samples, len(classes), 0.1, 0)
    images = np.stack([np.asarray(load_image(path)) for path, _ in held])
    labels = np.array([label for _, label in held])
    return dict(root=root, data=data, trained=trained, classes=classes, images=images, labels=labels)


@pytest.mark.slow
def test_classifier_folder_layout_and_record(shapes):
    folder = shapes["trained"].path
    assert sorted(p.name for p in folder.iterdir()) == [".moh-dit-output.json", "class_index.json", "classifier.json",
                                                          "model.safetensors"]
    meta = json.loads((folder / "classifier.json").read_text())
    assert meta["classes"] == shapes["classes"] == sorted(shapes["classes"])
    assert json.loads((folder / "class_index.json").read_text()) == {c: i for i, c in enumerate(shapes["classes"])}
    assert meta["held_out"]["count"] == len(shapes["labels"]) == 12 * 4
    assert meta["held_out"]["accuracy"] == pytest.approx(shapes["trained"].held_out_accuracy)
    assert shapes["trained"].held_out_accuracy > 0.5  # the shapes are easy; far above chance (1/12)


def test_real_images_of_their_class_score_the_classifiers_held_out_accuracy(shapes):
    """Known by construction: 'samples' that are the held-out real images, with their true labels,
    give exactly the accuracy the classifier recorded on those images."""
    loaded = clf.load_classifier(shapes["trained"].path)
    result = class_accuracy(loaded, shapes["images"], shapes["labels"], class_names=shapes["classes"])
    assert result.overall == pytest.approx(shapes["trained"].held_out_accuracy, abs=1e-6)
    assert result.per_class == pytest.approx(shapes["trained"].held_out_per_class, abs=1e-6)
    assert set(result.counts.values()) == {4}


def test_shuffled_labels_score_about_chance(shapes):
    loaded = clf.load_classifier(shapes["trained"].path)
    rng = np.random.default_rng(0)
    images = np.concatenate([shapes["images"]] * 5)
    true = np.concatenate([shapes["labels"]] * 5)
    shuffled = rng.permutation(true)
    right = class_accuracy(loaded, images, true).overall
    wrong = class_accuracy(loaded, images, shuffled).overall
    chance = float(np.mean(shuffled == true))  # the shuffle keeps this many labels by accident
    assert wrong <= chance + 0.1 < right


def test_meter_streams_batches_and_refuses_missing_or_extra_labels(shapes):
    loaded = clf.load_classifier(shapes["trained"].path)
    images = torch.from_numpy(shapes["images"])
    meter = ClassAccuracyMeter(loaded, shapes["labels"])
    for part in images.split(7):
        meter.update(part)
    assert meter.result().overall == pytest.approx(class_accuracy(loaded, images, shapes["labels"]).overall)
    short = ClassAccuracyMeter(loaded, shapes["labels"][:5])
    with pytest.raises(ValueError, match="has no label"):
        short.update(images[:6])
    extra = ClassAccuracyMeter(loaded, shapes["labels"])
    extra.update(images[:3])
    with pytest.raises(ValueError, match="labels but 3 samples"):
        extra.result()
    with pytest.raises(InvalidInput, match="12 classes") as error:
        ClassAccuracyMeter(loaded, [12])
    assert error.value.parameters == ("class_map",)
    with pytest.raises(ValueError, match="not the classifier's"):
        ClassAccuracyMeter(loaded, [0], class_names=list(reversed(shapes["classes"])))


def test_class_map_by_index_name_and_keras_format(tmp_path):
    classes = ["n01", "n02", "n03"]
    (tmp_path / "a.json").write_text(json.dumps({"0": 2, "1": "n01", "2": ["n02", "tench"]}))
    assert read_class_map(tmp_path / "a.json", classes) == {0: 2, 1: 0, 2: 1}
    (tmp_path / "b.json").write_text(json.dumps({"0": "cat"}))
    with pytest.raises(InvalidInput, match="'cat'.*3 classes") as error:
        read_class_map(tmp_path / "b.json", classes)
    assert error.value.parameters == ("class_map",) and str(tmp_path / "b.json") in str(error.value)


def test_labels_from_arr_1_or_npy(tmp_path):
    images = np.zeros((3, 8, 8, 3), np.uint8)
    np.savez(tmp_path / "with.npz", images, np.array([2, 0, 1]))
    np.savez(tmp_path / "without.npz", images)
    np.save(tmp_path / "labels.npy", np.array([1, 1, 0]))
    np.save(tmp_path / "float.npy", np.array([0.5]))
    assert read_sample_labels(tmp_path / "with.npz", None).tolist() == [2, 0, 1]
    assert read_sample_labels(tmp_path / "without.npz", tmp_path / "labels.npy").tolist() == [1, 1, 0]
    with pytest.raises(InvalidInput, match="arr_1") as error:
        read_sample_labels(tmp_path / "without.npz", None)
    assert "samples" in error.value.parameters and str(tmp_path / "without.npz") in str(error.value)
    with pytest.raises(InvalidInput, match="1-D integer") as error:
        read_sample_labels(tmp_path / "without.npz", tmp_path / "float.npy")
    assert error.value.parameters == ("labels",)
    with pytest.raises(FileNotFoundError) as error:
        read_sample_labels(tmp_path / "without.npz", tmp_path / "none.npy")
    assert error.value.parameters == ("labels",)


def test_torchvision_classifier_from_a_local_file_and_a_clear_error_offline(tmp_path, monkeypatch):
    import torchvision

    torch.manual_seed(0)
    weights = tmp_path / "mnv3.pth"
    torch.save(torchvision.models.mobilenet_v3_small(weights=None).state_dict(), weights)
    loaded = clf.load_classifier("torchvision:mobilenet_v3_small", weights)
    assert loaded.num_classes == 1000 and loaded.classes[0] == "tench"
    assert loaded.predict(torch.zeros(2, 32, 32, 3, dtype=torch.uint8)).shape == (2,)

    import urllib.error

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(clf.ClassifierNotFoundError, match="mobilenet_v3_small") as error:
        clf.load_classifier("torchvision:mobilenet_v3_small")
    assert "classifier_weights" in error.value.parameters  # what to give instead
    with pytest.raises(InvalidInput, match="no_such_net") as error:
        clf.load_classifier("torchvision:no_such_net", weights)
    assert error.value.parameters == ("classifier",)


@pytest.fixture(scope="module")
def random_weights(tmp_path_factory):
    from moh_dit.evaluation import save_random_inception_weights

    return save_random_inception_weights(tmp_path_factory.mktemp("inception") / "random.pth", seed=0)


@pytest.mark.slow
def test_evaluate_script_writes_class_accuracy(shapes, random_weights, load_script, tmp_path):
    np.savez(tmp_path / "samples.npz", shapes["images"], shapes["labels"])
    out = tmp_path / "m.json"
    argv = ["--samples", tmp_path / "samples.npz", "--ref", shapes["data"], "--inception-weights", random_weights,
            "--classifier", shapes["trained"].path, "--output", out, "--no-cache", "--device", "cpu",
            "--num-workers", "0"]
    assert load_script("evaluate").cli([str(a) for a in argv]) == 0
    result = json.loads(out.read_text())
    assert result["class_accuracy"] == pytest.approx(shapes["trained"].held_out_accuracy, abs=1e-6)
    assert set(result["class_accuracy_per_class"]) == set(shapes["classes"])
    assert result["classifier_held_out_accuracy"] == pytest.approx(shapes["trained"].held_out_accuracy)
    assert result["fid"] is not None


def test_evaluate_script_refuses_bad_class_accuracy_input(shapes, refuses, tmp_path):
    np.savez(tmp_path / "no_labels.npz", shapes["images"])
    np.savez(tmp_path / "samples.npz", shapes["images"], shapes["labels"])
    np.save(tmp_path / "short.npy", shapes["labels"][:3])
    ref, clf_dir = shapes["data"], shapes["trained"].path
    for argv, match in [
        (["--samples", tmp_path / "no_labels.npz", "--classifier", clf_dir], r"--samples .*no_labels\.npz .*arr_1"),
        (["--samples", tmp_path / "samples.npz", "--classifier", clf_dir, "--labels", tmp_path / "short.npy"],
         "--labels .*3 .*48"),
        (["--samples", tmp_path / "samples.npz", "--labels", tmp_path / "short.npy"], "--labels .*--classifier"),
        (["--samples", tmp_path / "samples.npz", "--classifier", tmp_path / "nope"], "--classifier .*nope"),
        (["--samples", tmp_path / "samples.npz", "--classifier", tmp_path], r"--classifier .*classifier\.json"),
        (["--samples", tmp_path / "samples.npz", "--classifier", clf_dir, "--class-index", tmp_path / "x.json"],
         r"--class-index .*x\.json"),
    ]:
        refuses("evaluate", [*argv, "--ref", ref, "--no-download", "--device", "cpu"], match)


def _sample_config(folder, class_names):
    """What moh-dit sample records about the model beside its samples (the part evaluate reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sample_config.json").write_text(json.dumps(
        {"identity": {"transformer_config": {"class_names": class_names}}, "run": {}}))


def test_evaluate_refuses_a_classifier_whose_classes_are_not_the_samples(shapes, refuses, tmp_path):
    """Reproduction: evaluate took a classifier of other classes than the ones sample_config.json
    names, without a word; the sweep refused it. Now both use one check."""
    classes = list(shapes["classes"])
    run = tmp_path / "run"
    _sample_config(run, classes[::-1])
    np.savez(run / "samples.npz", shapes["images"], shapes["labels"])
    argv = ["--samples", run / "samples.npz", "--ref", shapes["data"], "--classifier", shapes["trained"].path,
            "--no-download", "--device", "cpu"]
    refuses("evaluate", argv, r"\(" + classes[-1] + r", .*\(" + classes[0] + r", ")  # the two orders
    # The samples' own image folder finds the same settings file.
    (run / "samples").mkdir()
    assert clf.load_classifier(shapes["trained"].path).classes == classes
    from moh_dit.evaluation import sample_class_names

    assert sample_class_names(run / "samples") == sample_class_names(run / "samples.npz") == classes[::-1]
    assert sample_class_names(tmp_path) is None


def test_evaluate_accepts_the_samples_classes_or_a_class_map(shapes, refuses, tmp_path, no_inception):
    classes = list(shapes["classes"])
    base = ["--ref", shapes["data"], "--classifier", shapes["trained"].path, "--no-download", "--device", "cpu",
            "--no-cache"]
    same, mapped = tmp_path / "same", tmp_path / "mapped"
    _sample_config(same, classes)
    _sample_config(mapped, classes[::-1])
    (mapped / "map.json").write_text(json.dumps({str(i): name for i, name in enumerate(classes[::-1])}))
    for folder, extra in ((same, []), (mapped, ["--class-index", mapped / "map.json"])):
        np.savez(folder / "samples.npz", shapes["images"], shapes["labels"])
        # past the class check: it stops only at the missing Inception weights
        refuses("evaluate", ["--samples", folder / "samples.npz", *base, *extra], no_inception)


@pytest.fixture
def no_inception(tmp_path, monkeypatch):
    """No Inception weights anywhere (evaluate then stops, naming where it looked); the pattern."""
    from moh_dit.evaluation import INCEPTION_WEIGHTS_ENV

    monkeypatch.delenv(INCEPTION_WEIGHTS_ENV, raising=False)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "no_hub"))
    return "InceptionV3 weights"


def test_train_classifier_script_refuses_bad_flags(shapes, refuses, tmp_path):
    (tmp_path / "file").write_text("x")
    data = shapes["data"]
    for argv, match in [
        (["--data-dir", tmp_path / "none", "--output", tmp_path / "o"], "none' does not exist"),
        (["--data-dir", data, "--output", tmp_path / "o", "--epochs", "0"], "--epochs .*0"),
        (["--data-dir", data, "--output", tmp_path / "o", "--learning-rate", "nan"], "--learning-rate .*nan"),
        (["--data-dir", data, "--output", tmp_path / "o", "--held-out-fraction", "1"], "--held-out-fraction .*1"),
        (["--data-dir", data, "--output", tmp_path / "o", "--image-size", "4"], "--image-size .*4"),
        (["--data-dir", data, "--output", tmp_path / "file"], "not a folder"),
        (["--data-dir", data, "--output", tmp_path], "already exists"),
        (["--data-dir", data, "--output", tmp_path, "--overwrite"], "not a classifier folder"),
    ]:
        refuses("train_classifier", argv, match)


def test_one_image_per_class_trains_with_no_held_out_images(tmp_path):
    """With one image per class nothing can be held out: the classifier trains on all of them
    and records its held-out accuracy as unknown (it used to crash stacking an empty list)."""
    data = make_demo_dataset(tmp_path / "data", images_per_class=1, image_size=12)
    trained = clf.train_classifier(data, tmp_path / "clf", image_size=12, epochs=1, width=2, batch_size=4)
    record = json.loads((tmp_path / "clf" / "classifier.json").read_text())
    assert trained.num_held_out == 0 and record["held_out"]["count"] == 0
    assert np.isnan(trained.held_out_accuracy) and trained.num_train == len(trained.classes)
