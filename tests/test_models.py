from __future__ import annotations

import pytest
import torch

from models import create_model, list_models
from models.resnet_exits import BasicBlock, ResNetExits


@pytest.fixture
def net() -> ResNetExits:
    torch.manual_seed(0)
    model = create_model("resnet_exits", widths=(8, 16, 32), blocks=(2, 2, 2))
    # Non-trivial BN statistics and residual weights, so cuts and stages really change numbers.
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    return model.eval()


def test_registry_lists_and_refuses_unknown() -> None:
    assert {"resnet_exits", "resnet_exits.small", "resnet_exits.fmnist"} <= set(list_models())
    with pytest.raises(KeyError, match="unknown model 'nope'"):
        create_model("nope")


@torch.inference_mode()
def test_staged_execution_equals_forward_exit(net: ResNetExits) -> None:
    x = torch.randn(4, 1, 28, 28)
    feats = x
    for k in range(1, net.num_stages + 1):
        feats = net.forward_stage(k, feats)
        assert torch.equal(net.forward_exit(k, feats), net(x, exit=k))
    assert torch.equal(net(x), net(x, exit=net.num_stages))
    for k, logits in enumerate(net.forward_all(x), 1):
        assert torch.equal(logits, net(x, exit=k))


def test_cuttable_blocks_are_the_identity_ones(net: ResNetExits) -> None:
    assert net.cuttable_blocks() == ["stage1.block1", "stage1.block2", "stage2.block2", "stage3.block2"]


@torch.inference_mode()
def test_cut_removes_exactly_the_named_blocks(net: ResNetExits) -> None:
    calls: list[str] = []
    for s, stage in enumerate(net.stages):
        for b, block in enumerate(stage):
            block.register_forward_hook(lambda *_, name=f"stage{s + 1}.block{b + 1}": calls.append(name))
    x = torch.randn(2, 1, 28, 28)
    full = net(x)
    assert calls == net.block_names()
    calls.clear()
    cut = net(x, cut=["stage1.block2", "stage3.block2"])
    assert calls == [n for n in net.block_names() if n not in ("stage1.block2", "stage3.block2")]
    assert not torch.allclose(full, cut)


def test_cutting_a_non_identity_block_is_refused(net: ResNetExits) -> None:
    with pytest.raises(ValueError, match=r"cannot cut stage2\.block1.*stage1\.block1, stage1\.block2"):
        net(torch.randn(1, 1, 28, 28), cut=["stage2.block1"])
    with pytest.raises(ValueError, match=r"cannot cut stage9\.block1"):
        net.check_cut(["stage9.block1"])
    with pytest.raises(ValueError, match="out of range"):
        net(torch.randn(1, 1, 28, 28), exit=4)


def test_block_identity_flag() -> None:
    assert BasicBlock(8, 8, 1).identity and not BasicBlock(8, 16, 1).identity and not BasicBlock(8, 8, 2).identity
