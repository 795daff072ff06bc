"""The dataset interface: labelled image splits from Fashion-MNIST (IDX files) or a folder of images.

Splits: `train`, `calib` and `val` are disjoint slices of the source's training set cut with a fixed,
recorded seed; `test` is the source's own test set, used only for reported accuracy. Every split has a
fingerprint (sha256 of its indices and the source's identity) recorded wherever it is used.
"""

from __future__ import annotations

import gzip
import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np

from models.preprocess import PreprocessSpec

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

SPLITS = ("train", "calib", "val", "test")
DEFAULT_SEED = 20261122
DEFAULT_CALIB = 2000
DEFAULT_VAL = 5000


class DataError(RuntimeError):
    """Missing or corrupt data; the message says how to fix it."""


@dataclass(frozen=True)
class Split:
    """One split: uint8 images (N, H, W), int64 labels, and the indices it was cut from."""

    name: str
    images: np.ndarray
    labels: np.ndarray
    indices: np.ndarray
    source_id: str

    def __len__(self) -> int:
        return len(self.labels)

    @cached_property
    def fingerprint(self) -> str:
        h = hashlib.sha256(f"{self.source_id}:{self.name}:".encode())
        h.update(np.ascontiguousarray(self.indices, dtype="<i8").tobytes())
        return h.hexdigest()

    def head(self, n: int) -> Split:
        """The first n items, as a split of its own (its fingerprint covers exactly those)."""
        return Split(self.name, self.images[:n], self.labels[:n], self.indices[:n], self.source_id)

    def batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for i in range(0, len(self), batch_size):
            yield self.images[i : i + batch_size], self.labels[i : i + batch_size]


class DataSource(Protocol):
    """Anything that yields labelled images for the four splits."""

    @property
    def source_id(self) -> str: ...

    @property
    def class_names(self) -> tuple[str, ...]: ...

    def split(self, name: str) -> Split: ...

    def preprocess(self) -> PreprocessSpec: ...


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzip'ed) of unsigned bytes into an array."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise DataError(
            f"missing {path}: install Debian's package {FASHION_MNIST_PACKAGE} "
            f"(apt-get install {FASHION_MNIST_PACKAGE})"
        ) from None
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"corrupt {path} ({e}): reinstall {FASHION_MNIST_PACKAGE}") from None
    if len(raw) < 4:
        raise DataError(f"corrupt {path}: too short; reinstall {FASHION_MNIST_PACKAGE}")
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08 or ndim == 0:
        raise DataError(f"corrupt {path}: not an IDX file of unsigned bytes; reinstall {FASHION_MNIST_PACKAGE}")
    header = 4 + 4 * ndim
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    count = int(np.prod(dims))
    if len(raw) != header + count:
        raise DataError(
            f"corrupt {path}: expected {count} bytes of data, found {len(raw) - header}; "
            f"reinstall {FASHION_MNIST_PACKAGE}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def cut_training_set(n: int, seed: int, n_calib: int, n_val: int) -> dict[str, np.ndarray]:
    """Disjoint train/calib/val index sets from a seeded permutation of range(n); each sorted."""
    if n_calib + n_val >= n:
        raise ValueError(f"calib ({n_calib}) + val ({n_val}) leave no training data out of {n}")
    perm = np.random.default_rng(seed).permutation(n)
    calib, val, train = perm[:n_calib], perm[n_calib : n_calib + n_val], perm[n_calib + n_val :]
    return {"train": np.sort(train), "calib": np.sort(calib), "val": np.sort(val)}


class _SplitSource(ABC):
    """Shared split logic: subclasses provide the full train and test arrays."""

    source_id: str
    class_names: tuple[str, ...]

    def __init__(self, seed: int, n_calib: int, n_val: int) -> None:
        self.seed, self.n_calib, self.n_val = seed, n_calib, n_val
        self._cache: dict[str, Split] = {}

    @abstractmethod
    def _load(self, part: str) -> tuple[np.ndarray, np.ndarray]:
        """All images (N, H, W) uint8 and labels of `part` ("train" or "test")."""

    def preprocess(self) -> PreprocessSpec:
        """Input spec with mean/std measured on the train split (rounded, so it is stable)."""
        pixels = self.split("train").images.astype(np.float32) / 255.0
        h, w = pixels.shape[1:]
        return PreprocessSpec((1, h, w), "float32", (round(float(pixels.mean()), 4),), (round(float(pixels.std()), 4),))

    def split(self, name: str) -> Split:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; splits: {', '.join(SPLITS)}")
        if name not in self._cache:
            if name == "test":
                images, labels = self._load("test")
                indices = np.arange(len(labels))
            else:
                images, labels = self._load("train")
                indices = cut_training_set(len(labels), self.seed, self.n_calib, self.n_val)[name]
                images, labels = images[indices], labels[indices]
            self._cache[name] = Split(name, images, labels.astype(np.int64), indices, self.source_id)
        return self._cache[name]

    def fingerprints(self, names: tuple[str, ...] = SPLITS) -> dict[str, str]:
        return {n: self.split(n).fingerprint for n in names}


class FashionMNIST(_SplitSource):
    """Fashion-MNIST from Debian's dataset-fashion-mnist (IDX files); nothing is downloaded."""

    class_names = FASHION_MNIST_CLASSES

    def __init__(
        self,
        root: Path = FASHION_MNIST_DIR,
        seed: int = DEFAULT_SEED,
        n_calib: int = DEFAULT_CALIB,
        n_val: int = DEFAULT_VAL,
    ) -> None:
        super().__init__(seed, n_calib, n_val)
        self.root = Path(root)
        self.source_id = f"fashion-mnist:seed={seed}:calib={n_calib}:val={n_val}"
        self._raw: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def _load(self, part: str) -> tuple[np.ndarray, np.ndarray]:
        if part not in self._raw:
            prefix = "train" if part == "train" else "t10k"
            images = read_idx(self.root / f"{prefix}-images-idx3-ubyte.gz")
            labels = read_idx(self.root / f"{prefix}-labels-idx1-ubyte.gz")
            if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
                raise DataError(f"corrupt Fashion-MNIST {part} files under {self.root}: image/label counts differ")
            self._raw[part] = images, labels
        return self._raw[part]


class ImageFolderSource(_SplitSource):
    """Your own data: `root/train/<class>/*` and `root/test/<class>/*` (torchvision ImageFolder layout),
    converted to greyscale and resized to `size` x `size`."""

    def __init__(
        self,
        root: Path,
        size: int = 28,
        seed: int = DEFAULT_SEED,
        n_calib: int = DEFAULT_CALIB,
        n_val: int = DEFAULT_VAL,
    ) -> None:
        super().__init__(seed, n_calib, n_val)
        self.root, self.size = Path(root), size
        self.source_id = f"folder:{self.root.resolve()}:size={size}:seed={seed}:calib={n_calib}:val={n_val}"
        self.class_names = tuple(self._folder("train").classes)

    def _folder(self, part: str):  # type: ignore[no-untyped-def]
        from torchvision.datasets import ImageFolder

        path = self.root / part
        if not path.is_dir():
            raise DataError(f"missing {path}: an image folder needs train/<class>/ and test/<class>/ subfolders")
        return ImageFolder(str(path))

    def _load(self, part: str) -> tuple[np.ndarray, np.ndarray]:
        from PIL import Image

        folder = self._folder(part)
        if tuple(folder.classes) != self.class_names:
            raise DataError(f"{self.root}/{part} has classes {folder.classes}, train has {list(self.class_names)}")
        images = np.empty((len(folder.samples), self.size, self.size), np.uint8)
        for i, (path, _) in enumerate(folder.samples):
            with Image.open(path) as img:
                images[i] = np.asarray(img.convert("L").resize((self.size, self.size), Image.Resampling.BILINEAR))
        return images, np.asarray(folder.targets, np.int64)


def open_source(spec: str = "fashion-mnist") -> FashionMNIST | ImageFolderSource:
    """`fashion-mnist` (Debian's files), `fashion-mnist:DIR`, or `folder:DIR` for your own images."""
    kind, _, arg = spec.partition(":")
    if kind == "fashion-mnist":
        return FashionMNIST(Path(arg)) if arg else FashionMNIST()
    if kind == "folder" and arg:
        return ImageFolderSource(Path(arg))
    raise ValueError(f"unknown data source {spec!r}: use fashion-mnist, fashion-mnist:DIR or folder:DIR")
