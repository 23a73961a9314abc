"""Class accuracy of samples: a classifier trained on real images, the metric on cases whose answer
is known by construction, and its place in moh-dit evaluate and train-classifier."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moh_dit import evaluation as ev
from moh_dit.evaluation import classes as clf
from moh_dit.data import find_image_folder
from moh_dit.evaluation import inception

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """The demo's shapes (12 classes, 10 images each), a classifier trained on them briefly, and its
    held-out real images with their labels."""
    from moh_dit.data import load_image
    from moh_dit.data.demo_data import make_demo_dataset

    root = tmp_path_factory.mktemp("shapes")
    data = make_demo_dataset(root / "data", images_per_class=10, image_size=16, seed=0)
    record = ev.train_classifier(data, root / "clf", image_size=16, epochs=2, width=4, seed=0)
    classes, _, samples = find_image_folder(data)
    _, held = clf._split(samples, len(classes), 0.1, 0)
    images = np.stack([np.asarray(load_image(path)) for path, _ in held])
    return dict(data=data, path=root / "clf", record=record, classes=classes, images=images,
                labels=np.array([label for _, label in held]))


def test_the_classifier_folder_and_its_record(shapes):
    assert sorted(p.name for p in shapes["path"].iterdir()) == [".moh-dit-output.json", "classifier.json",
                                                                 "model.safetensors"]
    record = json.loads((shapes["path"] / "classifier.json").read_text())
    assert record == shapes["record"] and record["classes"] == shapes["classes"] == sorted(shapes["classes"])
    assert record["held_out"]["count"] == len(shapes["labels"]) == 12 * 1


def test_real_images_of_their_class_score_the_classifiers_held_out_accuracy(shapes):
    """Known by construction: the held-out real images with their true labels give exactly the
    accuracy the classifier recorded on them."""
    loaded = ev.load_classifier(shapes["path"])
    result = ev.class_accuracy(loaded, shapes["images"], shapes["labels"])
    assert result["class_accuracy"] == pytest.approx(shapes["record"]["held_out"]["accuracy"], abs=1e-6)
    assert result["class_accuracy_per_class"] == pytest.approx(shapes["record"]["held_out"]["per_class"], abs=1e-6)
    assert result["classifier_held_out_accuracy"] == shapes["record"]["held_out"]["accuracy"]


@pytest.mark.slow
def test_a_trained_classifier_is_far_above_chance_and_shuffled_labels_score_about_chance(tmp_path):
    from moh_dit.data import load_image
    from moh_dit.data.demo_data import make_demo_dataset

    data = make_demo_dataset(tmp_path / "data", images_per_class=40, seed=0)
    record = ev.train_classifier(data, tmp_path / "clf", epochs=8, batch_size=32, seed=0)
    assert record["held_out"]["accuracy"] > 0.5  # the shapes are easy: chance is 1/12
    classes, _, samples = find_image_folder(data)
    _, held = clf._split(samples, len(classes), 0.1, 0)
    loaded = ev.load_classifier(tmp_path / "clf")
    images = np.concatenate([np.stack([np.asarray(load_image(path)) for path, _ in held])] * 5)
    true = np.concatenate([np.array([label for _, label in held])] * 5)
    shuffled = np.random.default_rng(0).permutation(true)
    chance = float(np.mean(shuffled == true))  # labels the shuffle kept by accident
    assert ev.class_accuracy(loaded, images, shuffled)["class_accuracy"] <= chance + 0.1 \
        < ev.class_accuracy(loaded, images, true)["class_accuracy"]


def test_the_meter_needs_one_label_per_sample_and_known_classes(shapes):
    loaded = ev.load_classifier(shapes["path"])
    images = torch.from_numpy(shapes["images"])
    meter = ev.ClassAccuracyMeter(loaded, shapes["labels"])
    for part in images.split(7):
        meter.update(part)
    assert meter.result() == ev.class_accuracy(loaded, images, shapes["labels"])
    with pytest.raises(ValueError):
        ev.ClassAccuracyMeter(loaded, shapes["labels"][:5], count=len(images))
    short = ev.ClassAccuracyMeter(loaded, shapes["labels"])
    short.update(images[:3])
    with pytest.raises(ValueError):
        short.result()
    with pytest.raises(ValueError):
        ev.ClassAccuracyMeter(loaded, [12])  # 12 classes: no class 12 without a class map
    assert ev.ClassAccuracyMeter(loaded, [12], class_map={12: 3}).targets.tolist() == [3]


def test_class_map_by_index_name_and_keras_format(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"0": 2, "1": "n01", "2": ["n02", "tench"]}))
    assert ev.read_class_map(tmp_path / "a.json", ["n01", "n02", "n03"]) == {0: 2, 1: 0, 2: 1}
    (tmp_path / "b.json").write_text(json.dumps({"0": "cat"}))
    with pytest.raises(ValueError, match="b.json"):
        ev.read_class_map(tmp_path / "b.json", ["n01", "n02", "n03"])


def test_labels_from_arr_1_or_a_npy(tmp_path):
    images = np.zeros((3, 8, 8, 3), np.uint8)
    np.savez(tmp_path / "with.npz", images, np.array([2, 0, 1]))
    np.savez(tmp_path / "without.npz", images)
    np.save(tmp_path / "labels.npy", np.array([1, 1, 0]))
    np.save(tmp_path / "float.npy", np.array([0.5]))
    assert ev.read_sample_labels(tmp_path / "with.npz").tolist() == [2, 0, 1]
    assert ev.read_sample_labels(tmp_path / "without.npz", tmp_path / "labels.npy").tolist() == [1, 1, 0]
    for samples, labels in (("without.npz", None), ("without.npz", "float.npy"), (".", None)):
        with pytest.raises(ValueError):
            ev.read_sample_labels(tmp_path / samples, None if labels is None else tmp_path / labels)
    with pytest.raises(FileNotFoundError):
        ev.read_sample_labels(tmp_path / "without.npz", tmp_path / "none.npy")


def test_a_torchvision_classifier_from_a_local_file(tmp_path, monkeypatch):
    import torchvision

    torch.manual_seed(0)
    torch.save(torchvision.models.mobilenet_v3_small(weights=None).state_dict(), tmp_path / "mnv3.pth")
    loaded = ev.load_classifier("torchvision:mobilenet_v3_small", tmp_path / "mnv3.pth")
    assert len(loaded.classes) == 1000 and loaded.classes[0] == "tench"
    assert loaded.predict(torch.zeros(2, 32, 32, 3, dtype=torch.uint8)).shape == (2,)

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(OSError):
        ev.load_classifier("torchvision:mobilenet_v3_small")


def test_one_image_per_class_trains_with_no_held_out_images(tmp_path):
    from moh_dit.data.demo_data import make_demo_dataset

    data = make_demo_dataset(tmp_path / "data", images_per_class=1, image_size=12)
    record = ev.train_classifier(data, tmp_path / "clf", image_size=12, epochs=1, width=2, batch_size=4)
    assert record["held_out"] == {"count": 0, "accuracy": None, "per_class": {}}
    assert ev.load_classifier(tmp_path / "clf").held_out_accuracy is None


# ----- the commands ---------------------------------------------------------------------------

class Tiny(torch.nn.Module):
    def forward(self, images):
        pooled = torch.nn.functional.adaptive_avg_pool2d(images.float() / 255.0, 4).flatten(1)  # (N, 48)
        return {"pool": pooled, "logits": pooled[:, :10], "spatial": pooled[:, :6]}


def test_evaluate_writes_class_accuracy(shapes, tmp_path, monkeypatch, load_script):
    monkeypatch.setattr(inception, "build_random_inception", lambda seed: Tiny())
    np.savez(tmp_path / "samples.npz", shapes["images"], shapes["labels"])
    common = ["--samples", tmp_path / "samples.npz", "--ref", shapes["data"], "--random-inception-seed", 0,
              "--classifier", shapes["path"], "--no-cache", "--device", "cpu", "--num-workers", 0]
    assert load_script("evaluate").cli([*common, "--output", tmp_path / "m.json"]) == 0
    result = json.loads((tmp_path / "m.json").read_text())
    assert result["class_accuracy"] == pytest.approx(shapes["record"]["held_out"]["accuracy"], abs=1e-6)
    assert set(result["class_accuracy_per_class"]) == set(shapes["classes"]) and result["fid"] is not None
    reversed_map = tmp_path / "map.json"  # label i is the classifier's class 11 - i
    reversed_map.write_text(json.dumps({str(i): name for i, name in enumerate(shapes["classes"][::-1])}))
    assert load_script("evaluate").cli([*common, "--class-index", reversed_map, "--output", tmp_path / "r.json"]) == 0
    expected = ev.class_accuracy(ev.load_classifier(shapes["path"]), shapes["images"], shapes["labels"],
                                 class_map={i: 11 - i for i in range(12)})
    assert json.loads((tmp_path / "r.json").read_text())["class_accuracy"] == expected["class_accuracy"]


def test_evaluate_refuses_bad_class_accuracy_input(shapes, tmp_path, refuses):
    np.savez(tmp_path / "no_labels.npz", shapes["images"])
    np.savez(tmp_path / "samples.npz", shapes["images"], shapes["labels"])
    np.save(tmp_path / "short.npy", shapes["labels"][:3])
    for argv, match in [
        (["--samples", tmp_path / "no_labels.npz", "--classifier", shapes["path"]], "arr_1"),
        (["--samples", tmp_path / "samples.npz", "--classifier", shapes["path"], "--labels", tmp_path / "short.npy"],
         "3 labels"),
        (["--samples", tmp_path / "samples.npz", "--classifier", tmp_path / "nope"], "nope"),
        (["--samples", tmp_path / "samples.npz", "--classifier", shapes["path"], "--class-index", tmp_path / "x.json"],
         "x.json"),
    ]:
        refuses("evaluate", [*argv, "--ref", shapes["data"], "--no-download", "--device", "cpu"], match)


@pytest.mark.parametrize("change, match", [
    (["--data-dir", "{tmp}/none"], "none"),
    (["--epochs", "0"], "--epochs"),
    (["--learning-rate", "nan"], "--learning-rate"),
    (["--held-out-fraction", "1"], "--held-out-fraction"),
    (["--image-size", "4"], "--image-size"),
    (["--output", "{tmp}/file"], "file"),
    (["--output", "{tmp}"], "exists"),
    (["--output", "{tmp}", "--overwrite"], "not written by moh-dit"),
    (["--output", "{data}/clf"], "data"),
])
def test_train_classifier_refuses_bad_flags_writing_nothing(shapes, tmp_path, refuses, change, match):
    (tmp_path / "file").write_text("x")
    argv = ["--data-dir", shapes["data"], "--output", tmp_path / "clf"]
    refuses("train-classifier", argv + [part.format(tmp=tmp_path, data=shapes["data"]) for part in change], match)
    assert not (shapes["data"] / "clf").exists()
