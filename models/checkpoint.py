"""Checkpoints: weights plus everything needed to trust them (config, preprocessing, splits, command, accuracy)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.data import DataSource, PreprocessSpec
from models.registry import create_model

FORMAT_VERSION = 1
DEFAULT_CHECKPOINT = Path(__file__).parent / "checkpoints" / "resnet_exits_fmnist.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, malformed, or does not match the data it claims."""


@dataclass
class Checkpoint:
    model_name: str
    model_config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    preprocess: PreprocessSpec
    class_names: list[str]
    data_source: str
    splits: dict[str, str]  # split name -> fingerprint
    command: str
    accuracy: dict[str, list[float]]  # split name -> per-exit top-1
    train_images: int = 0  # how many images of the train split it saw (the first N)
    train_seconds: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)

    def build_model(self) -> Any:  # the registered family's network (nn.Module), e.g. ResNetExits
        """The network in eval mode with these weights (strict: every tensor must match).

        It is made on the meta device, so its random initialisation, which the weights replace at once, costs
        nothing (torchvision's DenseNet took 1.7 s to initialise here, twice in a build with nothing to do);
        a family whose module keeps tensors outside its state dict is made the ordinary way."""
        with torch.device("meta"):
            model = create_model(self.model_name, **self.model_config)
        model.load_state_dict({k: v.clone() for k, v in self.state_dict.items()}, strict=True, assign=True)
        if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
            model = create_model(self.model_name, **self.model_config)
            model.load_state_dict(self.state_dict, strict=True)
        return model.eval()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "format_version": FORMAT_VERSION,
            "model_name": self.model_name,
            "model_config": self.model_config,
            "state_dict": {k: v.detach().cpu().contiguous() for k, v in self.state_dict.items()},
            "preprocess": self.preprocess.to_dict(),
            "class_names": self.class_names,
            "data_source": self.data_source,
            "splits": self.splits,
            "command": self.command,
            "accuracy": self.accuracy,
            "train_images": self.train_images,
            "train_seconds": self.train_seconds,
            "versions": self.versions,
        }
        torch.save(record, path)


_REQUIRED = {
    "format_version": int,
    "model_name": str,
    "model_config": dict,
    "state_dict": dict,
    "preprocess": dict,
    "class_names": list,
    "data_source": str,
    "splits": dict,
    "command": str,
    "accuracy": dict,
    "train_images": int,
}


def load_checkpoint(path: Path, source: DataSource | None = None) -> Checkpoint:
    """Load and check a checkpoint. With `source`, its split fingerprints must match the recorded ones."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        # weights_only: a checkpoint is plain data and tensors; never unpickle arbitrary objects.
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint: {first_line}") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: not a checkpoint record")
    for key, kind in _REQUIRED.items():
        if not isinstance(record.get(key), kind):
            raise CheckpointError(f"{path}: field {key!r} missing or not a {kind.__name__}")
    if record["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {record['format_version']}, this code reads {FORMAT_VERSION}")
    try:
        ckpt = Checkpoint(
            model_name=record["model_name"],
            model_config=record["model_config"],
            state_dict=record["state_dict"],
            preprocess=PreprocessSpec.from_dict(record["preprocess"]),
            class_names=list(record["class_names"]),
            data_source=record["data_source"],
            splits=dict(record["splits"]),
            command=record["command"],
            accuracy={k: [float(a) for a in v] for k, v in record["accuracy"].items()},
            train_images=record["train_images"],
            train_seconds=float(record.get("train_seconds", 0.0)),
            versions=dict(record.get("versions", {})),
        )
        model = ckpt.build_model()
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: does not build its model: {e}") from None
    _check_consistency(path, ckpt, model)
    if source is not None:
        check_splits(ckpt, source)
    return ckpt


def _check_consistency(path: Path, ckpt: Checkpoint, model: nn.Module) -> None:
    num_exits = getattr(model, "num_stages", 1)
    for split, accs in ckpt.accuracy.items():
        if len(accs) != num_exits:
            raise CheckpointError(f"{path}: {len(accs)} {split} accuracies for {num_exits} exits")
    cfg = ckpt.model_config
    if cfg.get("in_channels", ckpt.preprocess.input_shape[0]) != ckpt.preprocess.input_shape[0]:
        raise CheckpointError(
            f"{path}: preprocessing gives {ckpt.preprocess.input_shape[0]} channels, "
            f"the model takes {cfg['in_channels']}"
        )
    if len(ckpt.class_names) != cfg.get("num_classes", len(ckpt.class_names)):
        raise CheckpointError(f"{path}: {len(ckpt.class_names)} class names for {cfg['num_classes']} classes")
    if not ckpt.command.strip():
        raise CheckpointError(f"{path}: no training command recorded")


def check_splits(ckpt: Checkpoint, source: DataSource) -> None:
    """The data at hand must be cut exactly as it was when the checkpoint was trained."""
    for name, recorded in ckpt.splits.items():
        split = source.split(name)
        actual = (split.head(ckpt.train_images) if name == "train" else split).fingerprint
        if actual != recorded:
            raise CheckpointError(
                f"split {name!r} differs from the one this checkpoint was trained with "
                f"(fingerprint {actual[:12]} vs recorded {recorded[:12]}): different data or split seed"
            )
