"""The ensemble member families: the training surface, config round trip, and the committed checkpoints."""

from __future__ import annotations

import pytest
import torch

from models import create_model
from models.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from models.data import FashionMNIST

MEMBERS = {
    "densenet.fmnist": "densenet_fmnist.pt",
    "mobilenetv2.fmnist": "mobilenetv2_fmnist.pt",
    "vgg.fmnist": "vgg_fmnist.pt",
}


@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_member_family_has_the_training_surface(name: str) -> None:
    model = create_model(name).eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.inference_mode():
        outs = model.forward_all(x)
        assert model.num_stages == 1 and len(outs) == 1 and outs[0].shape == (3, 10)
        assert torch.equal(outs[0], model(x))
    again = create_model(name, **model.config.to_dict())  # what a checkpoint records rebuilds the same net
    assert again.config == model.config


@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_committed_member_checkpoint_loads_and_matches_the_data(name: str, fmnist: FashionMNIST) -> None:
    ckpt = load_checkpoint(DEFAULT_CHECKPOINT.parent / MEMBERS[name], fmnist)
    main = load_checkpoint(DEFAULT_CHECKPOINT, fmnist)
    assert ckpt.model_name == name and ckpt.preprocess == main.preprocess
    assert ckpt.command.startswith(f"anytime train --model {name}") and ckpt.accuracy["test"][0] > 0.88


def test_bad_member_config_is_refused() -> None:
    with pytest.raises(ValueError):
        create_model("vgg", widths=(32, 64), blocks=(1,))
    with pytest.raises(ValueError):
        create_model("mobilenetv2", setting=((6, 24, 2),))
    with pytest.raises(ValueError):
        create_model("densenet", block_config=(4, 0))


def test_evaluate_reports_a_member_checkpoint(fmnist: FashionMNIST) -> None:
    from models.evaluate import evaluate_checkpoint

    ckpt = load_checkpoint(DEFAULT_CHECKPOINT.parent / MEMBERS["vgg.fmnist"], fmnist)
    report = evaluate_checkpoint(ckpt, fmnist, runs=3, limit=1000)  # the whole split: 14 s of the quick loop
    (row,) = report["exits"]
    assert row["test_accuracy"] == pytest.approx(ckpt.accuracy["test[:1000]"][0], abs=1e-4)
    assert report["test_fingerprint"] == fmnist.split("test").head(1000).fingerprint
    assert row["params"] == sum(p.numel() for p in ckpt.build_model().parameters()) and row["macs"] > 0
