from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.data import FASHION_MNIST_DIR, DataError, FashionMNIST, ImageFolderSource, cut_training_set, open_source


def test_idx_reader_counts_and_first_labels(fmnist: FashionMNIST) -> None:
    train_images, train_labels = fmnist._load("train")
    test_images, test_labels = fmnist._load("test")
    assert train_images.shape == (60000, 28, 28) and train_images.dtype == np.uint8
    assert test_images.shape == (10000, 28, 28)
    assert np.bincount(train_labels).tolist() == [6000] * 10
    assert np.bincount(test_labels).tolist() == [1000] * 10
    assert train_labels[:5].tolist() == [9, 0, 0, 3, 0]  # ankle boot, T-shirt, T-shirt, dress, T-shirt
    assert test_labels[:5].tolist() == [9, 2, 1, 1, 6]


def test_splits_disjoint_and_complete(fmnist: FashionMNIST) -> None:
    parts = {n: set(fmnist.split(n).indices.tolist()) for n in ("train", "calib", "val")}
    assert len(parts["calib"]) == 2000 and len(parts["val"]) == 5000 and len(parts["train"]) == 53000
    assert (
        not parts["train"] & parts["calib"] and not parts["train"] & parts["val"] and not parts["calib"] & parts["val"]
    )
    assert parts["train"] | parts["calib"] | parts["val"] == set(range(60000))
    assert len(fmnist.split("test")) == 10000


def test_splits_deterministic_and_fingerprints_stable(fmnist: FashionMNIST) -> None:
    again = FashionMNIST()
    for name in ("train", "calib", "val", "test"):
        assert np.array_equal(fmnist.split(name).indices, again.split(name).indices)
        assert fmnist.split(name).fingerprint == again.split(name).fingerprint
    # Pinned: the default checkpoint and ladder record these; a change to the split logic must show here.
    assert fmnist.split("calib").fingerprint.startswith("b9f63129c4e9")
    assert fmnist.split("val").fingerprint.startswith("ea6fe6fa76b3")
    assert fmnist.split("test").fingerprint.startswith("a4a4bd61ca63")


def test_other_seed_other_splits() -> None:
    a, b = cut_training_set(1000, 1, 100, 200), cut_training_set(1000, 2, 100, 200)
    assert not np.array_equal(a["val"], b["val"])


def test_missing_files_name_the_package(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="dataset-fashion-mnist"):
        FashionMNIST(tmp_path).split("test")


def test_corrupt_files_name_the_package(tmp_path: Path) -> None:
    for f in FASHION_MNIST_DIR.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"corrupt.*dataset-fashion-mnist"):
        FashionMNIST(tmp_path).split("test")
    truncated = gzip.decompress((FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz").read_bytes())[:-10]
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    shutil.copy(FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz", tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(truncated))
    with pytest.raises(DataError, match="expected 10000 bytes"):
        FashionMNIST(tmp_path).split("test")


def test_preprocess_spec_measured_on_train(fmnist: FashionMNIST) -> None:
    spec = fmnist.preprocess()
    assert spec.input_shape == (1, 28, 28)
    x = spec.normalize(fmnist.split("train").images[:5000])
    assert x.shape == (5000, 1, 28, 28) and x.dtype == np.float32
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05


def test_image_folder_source(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for part, count in (("train", 30), ("test", 4)):
        for cls in ("cat", "dog"):
            (tmp_path / part / cls).mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(
                    tmp_path / part / cls / f"{i}.png"
                )
    source = ImageFolderSource(tmp_path, size=28, n_calib=10, n_val=10)
    assert source.class_names == ("cat", "dog")
    assert len(source.split("train")) == 40 and len(source.split("test")) == 8
    assert source.split("val").images.shape == (10, 28, 28)
    assert open_source(f"folder:{tmp_path}").source_id != source.source_id  # size/seed are part of the identity


def test_unknown_source_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown data source"):
        open_source("imagenet")
