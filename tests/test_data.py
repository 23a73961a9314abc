"""Image folders as DiT reads them: labels from sorted class folders, ADM's centre crop, flips
drawn from (seed, epoch, index), the resumable sampler, and images decoded keeping their values."""

import itertools
import os

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms

import moh_dit.data.datasets as data_mod
from moh_dit.data.datasets import (CorruptImageError, ImageFolderDataset, ResumableSampler, center_crop_arr,
                                   collate_skip_corrupt, flip_for, image_to_tensor, load_image, scan_image_files,
                                   to_rgb)


def _write_png(path, size=(40, 30), seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr).save(path)


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "data"
    # Class names out of order; a nested folder; a hidden folder and a non-image file are ignored.
    for i, (cls, name) in enumerate(
        [("zebra", "a.png"), ("apple", "b.png"), ("apple", "c.jpg"), ("mango", "sub/d.png"), ("mango", "e.PNG")]
    ):
        _write_png(root / cls / name, seed=i)
    (root / "mango" / "notes.txt").write_text("not an image")
    _write_png(root / ".cache" / "x.png")
    return root


def test_labels_from_sorted_class_folders(folder):
    ds = ImageFolderDataset(folder, 16, random_flip=False)
    assert ds.classes == ["apple", "mango", "zebra"] and ds.class_to_idx == {"apple": 0, "mango": 1, "zebra": 2}
    assert [os.path.relpath(p, folder) for p, _ in ds.samples] == ["apple/b.png", "apple/c.jpg", "mango/e.PNG",
                                                                   "mango/sub/d.png", "zebra/a.png"]
    assert ds.targets == [0, 0, 1, 1, 2]
    image, label = ds[4]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32 and label == 2


def test_center_crop_matches_adm_steps():
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (400, 600, 3), dtype=np.uint8))
    # By hand: 600x400 -> box-halve twice -> 150x100, bicubic to short side 64 -> 96x64, centre columns 16..80.
    ref = img.resize((300, 200), Image.BOX).resize((150, 100), Image.BOX).resize((96, 64), Image.BICUBIC)
    np.testing.assert_array_equal(np.asarray(center_crop_arr(img, 64)), np.asarray(ref)[:, 16:80])
    assert center_crop_arr(Image.fromarray(rng.integers(0, 256, (30, 20, 3), dtype=np.uint8)), 32).size == (32, 32)
    exact = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    np.testing.assert_array_equal(np.asarray(center_crop_arr(exact, 32)), np.asarray(exact))


def test_normalisation_matches_torchvision():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8))
    ref = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])(img)
    assert torch.equal(image_to_tensor(img), ref)


def test_flip_is_deterministic_per_seed_epoch_index(folder):
    flips = [flip_for(0, 0, i) for i in range(2000)]
    assert 0.45 < np.mean(flips) < 0.55
    assert flips != [flip_for(0, 1, i) for i in range(2000)] and flips != [flip_for(1, 0, i) for i in range(2000)]
    ds, plain = ImageFolderDataset(folder, 16, seed=3), ImageFolderDataset(folder, 16, random_flip=False)
    for epoch, index in itertools.product(range(3), range(len(ds))):
        expected = plain[index][0]
        assert torch.equal(ds[(index, epoch)][0], expected.flip(-1) if flip_for(3, epoch, index) else expected)


def test_corrupt_images_error_or_skip(folder):
    bad = folder / "apple" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\nthis is not a png")
    (folder / "zebra" / "truncated.png").write_bytes((folder / "zebra" / "a.png").read_bytes()[:200])
    ds = ImageFolderDataset(folder, 16)
    paths = [p for p, _ in ds.samples]
    for name in ("broken.png", "truncated.png"):
        with pytest.raises(CorruptImageError, match=name):
            ds[next(i for i, p in enumerate(paths) if p.endswith(name))]
    skip = ImageFolderDataset(folder, 16, on_corrupt="skip")
    with pytest.warns(UserWarning, match="broken.png"):
        batch = collate_skip_corrupt([skip[i] for i in range(len(skip))])
    assert batch[0].shape == (len(skip) - 2, 3, 16, 16)


def test_empty_or_wrong_folders_fail_early(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        ImageFolderDataset(tmp_path / "missing", 16)
    assert error.value.filename == str(tmp_path / "missing")
    _write_png(tmp_path / "flat" / "a.png")
    with pytest.raises(ValueError, match="flat"):  # no class folders
        ImageFolderDataset(tmp_path / "flat", 16)
    _write_png(tmp_path / "partly" / "cat" / "a.png")
    (tmp_path / "partly" / "dog").mkdir()
    with pytest.raises(ValueError, match="dog"):  # a class without images
        ImageFolderDataset(tmp_path / "partly", 16)


def _take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def test_sampler_epochs_are_seeded_permutations_and_ranks_partition_them():
    items = _take(ResumableSampler(10, seed=5), 30)
    for epoch in range(3):
        chunk = items[epoch * 10 : (epoch + 1) * 10]
        assert sorted(i for i, _ in chunk) == list(range(10)) and {e for _, e in chunk} == {epoch}
    assert [i for i, _ in items[:10]] != [i for i, _ in items[10:20]]
    assert items != _take(ResumableSampler(10, seed=6), 30)
    assert [i for i, _ in _take(ResumableSampler(4, shuffle=False), 6)] == [0, 1, 2, 3, 0, 1]
    stream = _take(ResumableSampler(7, seed=1), 21)
    ranks = [_take(ResumableSampler(7, num_replicas=3, rank=r, seed=1), 7) for r in range(3)]
    assert [ranks[p % 3][p // 3] for p in range(21)] == stream


def test_sampler_resume_continues_exactly_with_any_process_count():
    uninterrupted = _take(ResumableSampler(10, seed=2), 40)
    first = ResumableSampler(10, seed=2)
    it = iter(first)
    consumed = []
    for _ in range(3):  # 3 steps of 4; the DataLoader would prefetch beyond, which must not matter
        consumed += [next(it) for _ in range(4)]
        first.advance(4)
    _ = [next(it) for _ in range(5)]
    state = first.state_dict()
    assert (state["epoch"], state["offset"], state["position"]) == (1, 2, 12)
    resumed = ResumableSampler(10, seed=2)
    resumed.load_state_dict(state)
    assert consumed + _take(resumed, 28) == uninterrupted
    halves = []
    for r in range(2):
        s = ResumableSampler(10, num_replicas=2, rank=r, seed=2)
        s.load_state_dict(state)
        halves.append(_take(s, 4))
    assert [halves[p % 2][p // 2] for p in range(8)] == uninterrupted[12:20]
    with pytest.raises(ValueError, match="num_samples"):
        ResumableSampler(11, seed=2).load_state_dict(state)


def test_dataloader_with_workers_matches_direct_access(folder):
    ds = ImageFolderDataset(folder, 16, seed=1)
    loader = DataLoader(ds, batch_size=3, sampler=ResumableSampler(ds, seed=4), num_workers=2)
    images, labels = next(iter(loader))
    for j, key in enumerate(_take(ResumableSampler(ds, seed=4), 3)):
        image, label = ds[key]
        assert torch.equal(images[j], image) and labels[j] == label


def _png_16bit(path, values, colour_type):
    """A 16-bit PNG written by hand (Pillow cannot write 16-bit RGB): grey 0, RGB 2, grey+alpha 4, RGBA 6."""
    import struct
    import zlib

    values = np.asarray(values, dtype=">u2")
    h, w = values.shape[:2]
    raw = b"".join(b"\x00" + values[y].tobytes() for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return path


GREY_16 = np.array([[0, 32768], [65535, 257 * 100]], dtype=np.uint16)  # -> 0, 128, 255, 100


def _grey_of(path):
    image = load_image(path)
    assert image.mode == "RGB"
    arr = np.asarray(image).astype(int)
    assert (arr == arr[..., :1]).all()  # grey stays grey
    return arr[..., 0]


def test_16bit_grey_png_keeps_its_values(tmp_path):
    # convert("RGB") clips every value above 255: 3 of these 4 pixels would be white.
    path = tmp_path / "grey16.png"
    Image.fromarray(GREY_16).save(path)
    with Image.open(path) as img:
        assert img.mode in ("I;16", "I")
    grey = _grey_of(path)
    assert abs(grey[0, 1] - 128) <= 1 and grey[0, 0] == 0 and grey[1, 0] == 255 and grey[1, 1] == 100
    # written by another encoder (the hand-made one): the same values
    np.testing.assert_array_equal(_grey_of(_png_16bit(tmp_path / "hand.png", GREY_16, 0)), grey)


def test_training_on_16bit_images_is_not_white(tmp_path):
    """Reproduction: a mid-grey 16-bit PNG dataset trained as pure white (+1.0 everywhere)."""
    for cls in ("a", "b"):
        (tmp_path / "data" / cls).mkdir(parents=True)
        Image.fromarray(np.full((16, 16), 32768, np.uint16)).save(tmp_path / "data" / cls / "x.png")
    ds = ImageFolderDataset(tmp_path / "data", 8, random_flip=False)
    image, _ = ds[0]
    expected = 128 / 255 * 2 - 1  # 0.0039: mid-grey
    assert torch.allclose(image, torch.full_like(image, expected), atol=2.5 / 255)


@pytest.mark.parametrize(
    "mode, values, expected",
    [
        ("I;16B", GREY_16, [[0, 128], [255, 100]]),
        ("I;16", GREY_16, [[0, 128], [255, 100]]),
        ("I", GREY_16.astype(np.int32), [[0, 128], [255, 100]]),  # 32-bit int within [0, 65535]: 16-bit
        ("I", np.array([[0, 2**30], [2**31 - 1, -5]], np.int32), [[0, 128], [255, 0]]),  # beyond: int32 range
        ("F", np.array([[0.0, 0.5], [1.0, -0.2]], np.float32), [[0, 128], [255, 0]]),  # max <= 1: [0, 1]
        ("F", np.array([[0.0, 32768.0], [65535.0, 1e9]], np.float32), [[0, 128], [255, 255]]),  # else 16-bit
        ("F", np.array([[np.nan, 0.5], [1.0, 0.0]], np.float32), [[0, 128], [255, 0]]),  # NaN -> 0
    ],
)
def test_high_bit_depth_modes_scale_by_their_type_range(tmp_path, mode, values, expected):
    path = tmp_path / "image.tif"
    if mode == "I;16B":
        img = Image.frombytes("I;16B", values.shape[::-1], values.astype(">u2").tobytes())
    else:
        img = Image.fromarray(values)
    img.save(path)
    with Image.open(path) as reopened:
        assert reopened.mode == mode
    np.testing.assert_array_equal(_grey_of(path), expected)


def test_mode_I_png_uses_the_png_bit_depth(tmp_path, monkeypatch):
    """Older Pillow opens 16-bit grey PNGs as mode "I"; the PNG header says they are 16-bit."""
    path = tmp_path / "grey16.png"
    Image.fromarray(np.array([[300, 32768]], np.uint16)).save(path)  # 300 alone would look 8-bit-ish
    real_open = Image.open

    def open_as_mode_i(fp, *args, **kwargs):
        img = real_open(fp, *args, **kwargs)
        as_i = img.convert("I")
        as_i.format = img.format
        return as_i

    monkeypatch.setattr(data_mod.Image, "open", open_as_mode_i)
    np.testing.assert_array_equal(_grey_of(path), [[1, 128]])


def test_16bit_colour_pngs_are_read_as_8bit_by_pillow(tmp_path):
    rgb = np.zeros((1, 2, 3), np.uint16)
    rgb[0, 0] = (32768, 0, 65535)
    rgb[0, 1] = (257 * 10, 257 * 20, 257 * 30)
    np.testing.assert_array_equal(np.asarray(load_image(_png_16bit(tmp_path / "rgb.png", rgb, 2))), [[[128, 0, 255], [10, 20, 30]]])
    rgba = np.concatenate([rgb, np.zeros((1, 2, 1), np.uint16)], axis=-1)  # fully transparent
    np.testing.assert_array_equal(np.asarray(load_image(_png_16bit(tmp_path / "rgba.png", rgba, 6))), [[[128, 0, 255], [10, 20, 30]]])


def test_8bit_modes_match_convert_rgb_and_alpha_is_dropped(tmp_path):
    """8-bit images give exactly DiT's/ADM's Image.open(...).convert("RGB") pixels (so FID stays comparable):
    alpha dropped with the stored colour kept, palette colours, CMYK converted, bilevel and L grey."""
    palette = Image.new("P", (2, 1))
    palette.putpalette([200, 10, 20, 5, 6, 7])
    palette.putpixel((1, 0), 1)
    transparent_palette = palette.copy()
    transparent_palette.info["transparency"] = 0
    pa = Image.new("PA", (2, 1))
    pa.putpalette([30, 40, 50] * 256)
    cases = {
        "rgba.png": (Image.new("RGBA", (2, 1), (200, 100, 50, 0)), [200, 100, 50]),
        "la.png": (Image.new("LA", (2, 1), (90, 10)), [90, 90, 90]),
        "p.png": (palette, [200, 10, 20]),
        "p_transparent.png": (transparent_palette, [200, 10, 20]),
        "pa.webp": (pa, [30, 40, 50]),
        "cmyk.jpg": (Image.new("CMYK", (2, 1), (0, 255, 255, 0)), None),
        "one.png": (Image.new("1", (2, 1), 1), [255, 255, 255]),
        "l.png": (Image.new("L", (2, 1), 77), [77, 77, 77]),
    }
    for name, (img, first_pixel) in cases.items():
        path = tmp_path / name
        if name.endswith(".webp"):  # PA cannot be saved as such; keep the PA image in memory
            loaded = to_rgb(img)
            assert np.asarray(loaded)[0, 0].tolist() == first_pixel
            continue
        img.save(path, **({"quality": 100} if name.endswith(".jpg") else {}))
        loaded = load_image(path)
        with Image.open(path) as reference:
            np.testing.assert_array_equal(np.asarray(loaded), np.asarray(reference.convert("RGB")), err_msg=name)
        assert loaded.mode == "RGB" and loaded.size == (2, 1)
        if first_pixel is not None:
            assert np.asarray(loaded)[0, 0].tolist() == first_pixel, name
    cmyk = np.asarray(load_image(tmp_path / "cmyk.jpg"))[0, 0]
    assert cmyk[0] > 200 and cmyk[1] < 60 and cmyk[2] < 60  # CMYK (0, 255, 255, 0) is red


# --------------------------------------------------------------------------------------
# Folder scans: links to folders followed, no folder entered twice
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "link, target",
    [
        ("a/self", "."),  # the reported loop: every image was listed once per loop turn (~40 times)
        ("a/sub/up", ".."),  # a link to an ancestor
        ("a/twin", "sub"),  # a second path to a folder already in the tree
    ],
)
def test_folder_links_never_list_an_image_twice(tmp_path, link, target):
    root = tmp_path / "data"
    _write_png(root / "a" / "x.png")
    _write_png(root / "a" / "sub" / "y.png")
    _write_png(root / "b" / "z.png")
    (root / link).symlink_to(target, target_is_directory=True)
    ds = ImageFolderDataset(root, 8)
    assert [os.path.relpath(p, root) for p, _ in ds.samples] == ["a/sub/y.png", "a/x.png", "b/z.png"]
    assert ds.targets == [0, 0, 1]


@pytest.mark.parametrize("link, target", [("b/up", ".."), ("b/deep/root", "../.."), ("b/top", "/")])
def test_a_link_from_a_class_folder_to_the_data_folder_or_above_is_skipped(tmp_path, link, target):
    """``up -> ..`` in a class folder leads back to the data folder: following it would list
    every other class's images again under this class's label."""
    root = tmp_path / "data"
    _write_png(root / "a" / "x.png")
    _write_png(root / "b" / "deep" / "y.png")
    _write_png(root / "c" / "z.png")
    (root / link).symlink_to(target, target_is_directory=True)
    ds = ImageFolderDataset(root, 8)
    assert [os.path.relpath(p, root) for p, _ in ds.samples] == ["a/x.png", "b/deep/y.png", "c/z.png"]
    assert ds.targets == [0, 1, 2]
    assert [os.path.relpath(p, root) for p in scan_image_files(root / "b")] == ["b/deep/y.png"]


def test_links_to_folders_outside_the_tree_are_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _write_png(elsewhere / "e1.png")
    _write_png(elsewhere / "deeper" / "e2.png")
    root = tmp_path / "data"
    _write_png(root / "cat" / "c.png")
    (root / "dog").mkdir(parents=True)
    (root / "dog" / "linked").symlink_to(elsewhere, target_is_directory=True)
    (root / "dog" / "linked_again").symlink_to(elsewhere, target_is_directory=True)
    (root / "dog" / "dangling").symlink_to(tmp_path / "nowhere", target_is_directory=True)

    ds = ImageFolderDataset(root, 8)
    assert [os.path.relpath(p, root) for p, _ in ds.samples] == [
        "cat/c.png", "dog/linked/deeper/e2.png", "dog/linked/e1.png"
    ]
    assert [os.path.relpath(p, root / "dog") for p in scan_image_files(root / "dog")] == [
        "linked/deeper/e2.png", "linked/e1.png"
    ]

