import itertools

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms

from moh_dit.data import (
    CorruptImageError,
    ImageFolderDataset,
    ResumableSampler,
    center_crop_arr,
    collate_skip_corrupt,
    flip_for,
    image_to_tensor,
    load_class_index,
)


def _write_png(path, size=(40, 30), seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr).save(path)


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "data"
    # Class names out of order on purpose; one class has a nested folder; a hidden folder and
    # a non-image file must be ignored.
    for i, (cls, name) in enumerate(
        [("zebra", "a.png"), ("apple", "b.png"), ("apple", "c.jpg"), ("mango", "sub/d.png"), ("mango", "e.PNG")]
    ):
        _write_png(root / cls / name, seed=i)
    (root / "mango" / "notes.txt").write_text("not an image")
    _write_png(root / ".cache" / "x.png")
    return root


def test_labels_from_sorted_class_folders(folder, tmp_path):
    ds = ImageFolderDataset(folder, 16, random_flip=False)
    assert ds.classes == ["apple", "mango", "zebra"]
    assert ds.class_to_idx == {"apple": 0, "mango": 1, "zebra": 2}
    assert [p.split("data/")[1] for p, _ in ds.samples] == ["apple/b.png", "apple/c.jpg", "mango/e.PNG", "mango/sub/d.png", "zebra/a.png"]
    assert ds.targets == [0, 0, 1, 1, 2]
    image, label = ds[4]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32 and label == 2
    ds.write_class_index(tmp_path / "classes.json")
    assert load_class_index(tmp_path / "classes.json") == ds.class_to_idx


def test_center_crop_matches_adm_steps():
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (400, 600, 3), dtype=np.uint8))
    out = center_crop_arr(img, 64)
    # By hand: 600x400 -> box-halve twice (min side 400 >= 128, 200 >= 128) -> 150x100, then
    # bicubic to short side 64 -> 96x64, then centre crop columns 16..80.
    ref = img.resize((300, 200), Image.BOX).resize((150, 100), Image.BOX).resize((96, 64), Image.BICUBIC)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref)[:, 16:80])
    assert out.size == (64, 64)
    # Small images are upscaled; tall images are cropped vertically.
    small = center_crop_arr(Image.fromarray(rng.integers(0, 256, (30, 20, 3), dtype=np.uint8)), 32)
    assert small.size == (32, 32)
    # An image already at the target size is unchanged.
    exact = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    np.testing.assert_array_equal(np.asarray(center_crop_arr(exact, 32)), np.asarray(exact))


def test_normalisation_matches_torchvision():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8))
    ref = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])(img)
    assert torch.equal(image_to_tensor(img), ref)
    ends = image_to_tensor(Image.fromarray(np.array([[[0, 255, 0]]], dtype=np.uint8)))
    assert ends.flatten().tolist() == [-1.0, 1.0, -1.0]


def test_flip_is_deterministic_per_seed_epoch_index(folder):
    flips = [flip_for(0, 0, i) for i in range(2000)]
    assert flips == [flip_for(0, 0, i) for i in range(2000)]
    assert 0.45 < np.mean(flips) < 0.55
    assert flips != [flip_for(0, 1, i) for i in range(2000)]
    assert flips != [flip_for(1, 0, i) for i in range(2000)]
    ds = ImageFolderDataset(folder, 16, seed=3)
    plain = ImageFolderDataset(folder, 16, random_flip=False)
    for epoch, index in itertools.product(range(3), range(len(ds))):
        image, _ = ds[(index, epoch)]
        expected = plain[index][0]
        if flip_for(3, epoch, index):
            expected = expected.flip(-1)
        assert torch.equal(image, expected)
    ds.set_epoch(2)
    assert torch.equal(ds[1][0], ds[(1, 2)][0])


def test_corrupt_images_error_or_skip(folder):
    bad = folder / "apple" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\nthis is not a png")
    good = folder / "zebra" / "a.png"
    truncated = folder / "zebra" / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:200])
    ds = ImageFolderDataset(folder, 16)
    bad_index = [p for p, _ in ds.samples].index(str(bad))
    with pytest.raises(CorruptImageError, match="broken.png"):
        ds[bad_index]
    trunc_index = [p for p, _ in ds.samples].index(str(truncated))
    with pytest.raises(CorruptImageError, match="truncated.png"):
        ds[trunc_index]
    skip = ImageFolderDataset(folder, 16, on_corrupt="skip")
    with pytest.warns(UserWarning, match="broken.png"):
        assert skip[bad_index] is None
    assert skip.num_skipped == 1
    with pytest.warns(UserWarning):
        batch = collate_skip_corrupt([skip[i] for i in range(len(skip))])
    assert batch[0].shape == (len(skip) - 2, 3, 16, 16)
    with pytest.raises(ValueError, match="on_corrupt"):
        ImageFolderDataset(folder, 16, on_corrupt="ignore")


def test_empty_or_wrong_folders_fail_early(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ImageFolderDataset(tmp_path / "missing", 16)
    flat = tmp_path / "flat"
    _write_png(flat / "a.png")
    with pytest.raises(ValueError, match="no class subfolders"):
        ImageFolderDataset(flat, 16)
    partly = tmp_path / "partly"
    _write_png(partly / "cat" / "a.png")
    (partly / "dog").mkdir()
    (partly / "dog" / "readme.txt").write_text("x")
    with pytest.raises(ValueError, match="'dog'"):
        ImageFolderDataset(partly, 16)


def _take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def test_sampler_epochs_are_seeded_permutations():
    s = ResumableSampler(10, num_replicas=1, rank=0, seed=5)
    items = _take(s, 30)
    for epoch in range(3):
        chunk = items[epoch * 10 : (epoch + 1) * 10]
        assert sorted(i for i, _ in chunk) == list(range(10)) and {e for _, e in chunk} == {epoch}
    assert [i for i, _ in items[:10]] != [i for i, _ in items[10:20]]
    assert items == _take(ResumableSampler(10, num_replicas=1, rank=0, seed=5), 30)
    assert items != _take(ResumableSampler(10, num_replicas=1, rank=0, seed=6), 30)
    assert [i for i, _ in _take(ResumableSampler(4, num_replicas=1, rank=0, shuffle=False), 6)] == [0, 1, 2, 3, 0, 1]


def test_sampler_ranks_partition_the_global_stream():
    stream = _take(ResumableSampler(7, num_replicas=1, rank=0, seed=1), 21)
    ranks = [_take(ResumableSampler(7, num_replicas=3, rank=r, seed=1), 7) for r in range(3)]
    assert [ranks[p % 3][p // 3] for p in range(21)] == stream


def test_sampler_resume_continues_exactly():
    batch = 4
    uninterrupted = _take(ResumableSampler(10, num_replicas=1, rank=0, seed=2), 40)
    first = ResumableSampler(10, num_replicas=1, rank=0, seed=2)
    it = iter(first)
    consumed = []
    for _ in range(3):  # 3 steps; the DataLoader would prefetch beyond, which must not matter
        consumed += [next(it) for _ in range(batch)]
        first.advance(batch)
    _ = [next(it) for _ in range(5)]
    state = first.state_dict()
    assert (state["epoch"], state["offset"], state["position"]) == (1, 2, 12)
    resumed = ResumableSampler(10, num_replicas=1, rank=0, seed=2)
    resumed.load_state_dict(state)
    assert consumed + _take(resumed, 28) == uninterrupted
    # Resuming with two processes continues the same global order.
    halves = []
    for r in range(2):
        s = ResumableSampler(10, num_replicas=2, rank=r, seed=2)
        s.load_state_dict(state)
        halves.append(_take(s, 4))
    assert [halves[p % 2][p // 2] for p in range(8)] == uninterrupted[12:20]
    other = ResumableSampler(11, num_replicas=1, rank=0, seed=2)
    with pytest.raises(ValueError, match="num_samples"):
        other.load_state_dict(state)
    s = ResumableSampler(10, num_replicas=1, rank=0, seed=2)
    s.set_position(2, 3)
    assert _take(s, 3) == uninterrupted[23:26]


def test_dataloader_with_workers_matches_direct_access(folder):
    ds = ImageFolderDataset(folder, 16, seed=1)
    sampler = ResumableSampler(ds, num_replicas=1, rank=0, seed=4)
    loader = DataLoader(ds, batch_size=3, sampler=sampler, num_workers=2, persistent_workers=True)
    images, labels = next(iter(loader))
    keys = _take(ResumableSampler(ds, num_replicas=1, rank=0, seed=4), 3)
    for j, key in enumerate(keys):
        image, label = ds[key]
        assert torch.equal(images[j], image) and labels[j] == label
