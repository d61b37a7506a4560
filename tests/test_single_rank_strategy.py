"""A shard group of one rank: FSDP1 switches every strategy to ``NO_SHARD``, with a warning per wrapper.

FSDP1 decides on the size of the group it shards over (the process group; for hybrid strategies the
intra-node one), not the world size. Each case is compared with torch FSDP1 run now, or with its
golden values (``tests/golden/single_rank_strategy.json``) once torch no longer ships it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat import ShardingStrategy
from fsdp_compat import wrap as our_wrap
from fsdp_compat.testing import distributed_test
from tests import differential as diff

GOLDEN = "single_rank_strategy"
SWITCHED = "since the world size is 1"
HYBRID = {"HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(diff.device())


def _wrap(wrapper_class: Any, strategy: str | None, *, nested: bool = False, mesh_shape: tuple[int, ...] | None = None,
          own_group: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Wrap the model; what FSDP1 lets one see: each wrapper's strategy and world size, and the
    warnings about ``NO_SHARD`` (text, category, file that issued them), in order."""
    kwargs: dict[str, Any] = dict(extra or {})
    if strategy is not None:
        kwargs["sharding_strategy"] = getattr(diff.torch_fsdp.ShardingStrategy, strategy)
    if nested:
        wrap_module = our_wrap if wrapper_class is FSDP else diff.torch_wrap
        kwargs["auto_wrap_policy"] = wrap_module.ModuleWrapPolicy({nn.Linear})
    if mesh_shape is not None:
        kwargs["device_mesh"] = init_device_mesh(diff.device().type, mesh_shape)
    if own_group:  # a one-rank process group on every rank, within the larger world
        groups = [dist.new_group([rank]) for rank in range(dist.get_world_size())]
        kwargs["process_group"] = groups[dist.get_rank()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = wrapper_class(_model(), **kwargs)
    return {
        "strategies": [str(unit.sharding_strategy) for unit in wrapper_class.fsdp_modules(model)],
        "world_sizes": [unit.world_size for unit in wrapper_class.fsdp_modules(model)],
        "warnings": [[str(w.message), w.category.__name__, os.path.basename(w.filename)]
                     for w in caught if "NO_SHARD" in str(w.message)],
    }


def _fsdp1(key: str, **kwargs: Any) -> dict[str, Any]:
    return diff.fsdp1_value(GOLDEN, diff.golden_key(key), lambda: _wrap(diff.TorchFSDP, extra=diff.fsdp1_kwargs(),
                                                                        **kwargs))


@pytest.mark.parametrize("strategy", [None, "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
@distributed_test(world_size=1)
def test_world_of_one_switches_to_no_shard_with_fsdp1s_warning(strategy):
    mesh_shape = (1, 1) if strategy in HYBRID else None  # FSDP1 wants a group or mesh for manual hybrid
    ours = _wrap(FSDP, strategy, mesh_shape=mesh_shape)
    assert ours["strategies"] == ["ShardingStrategy.NO_SHARD"]
    assert len(ours["warnings"]) == 1 and SWITCHED in ours["warnings"][0][0]
    assert ours == _fsdp1(f"manual-{strategy}", strategy=strategy, mesh_shape=mesh_shape)


@distributed_test(world_size=1)
def test_world_of_one_no_shard_is_silent():
    ours = _wrap(FSDP, "NO_SHARD")
    assert ours == {"strategies": ["ShardingStrategy.NO_SHARD"], "world_sizes": [1], "warnings": []}
    assert ours == _fsdp1("manual-NO_SHARD", strategy="NO_SHARD")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
@distributed_test(world_size=1)
def test_world_of_one_every_auto_wrapped_unit_switches_and_warns(strategy):
    ours = _wrap(FSDP, strategy, nested=True)
    assert ours["strategies"] == ["ShardingStrategy.NO_SHARD"] * 3
    assert len(ours["warnings"]) == 3
    assert ours == _fsdp1(f"nested-{strategy}", strategy=strategy, nested=True)


@distributed_test(world_size=1)
def test_world_of_one_trains_like_the_unwrapped_model():
    reference = _model()
    model = FSDP(_model(), auto_wrap_policy=our_wrap.ModuleWrapPolicy({nn.Linear}))
    batch = torch.randn(3, 4, device=diff.device())
    for module in (reference, model):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(2):
            module(batch).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    diff.assert_close_dicts(diff.full_parameters(model), diff.full_parameters(reference), rtol=1e-6)


@distributed_test(world_size=2)
def test_one_rank_process_group_in_a_larger_world_switches():
    ours = _wrap(FSDP, "FULL_SHARD", own_group=True)
    assert ours["strategies"] == ["ShardingStrategy.NO_SHARD"] and ours["world_sizes"] == [1]
    assert ours == _fsdp1("own-group-FULL_SHARD", strategy="FULL_SHARD", own_group=True)


@distributed_test(world_size=2)
def test_hybrid_with_one_rank_shard_groups_switches():
    ours = _wrap(FSDP, "HYBRID_SHARD", mesh_shape=(2, 1))
    assert ours["strategies"] == ["ShardingStrategy.NO_SHARD"] and ours["world_sizes"] == [1]
    assert ours == _fsdp1("mesh-2x1-HYBRID_SHARD", strategy="HYBRID_SHARD", mesh_shape=(2, 1))


@distributed_test(world_size=2)
def test_no_shard_over_several_ranks_warns_that_it_is_deprecated():
    ours = _wrap(FSDP, "NO_SHARD")
    assert ours["strategies"] == ["ShardingStrategy.NO_SHARD"] and ours["world_sizes"] == [2]
    assert [category for _, category, _ in ours["warnings"]] == ["FutureWarning"]
    assert ours == _fsdp1("manual-NO_SHARD", strategy="NO_SHARD")


@distributed_test(world_size=2)
def test_no_shard_over_several_ranks_warns_once_per_wrapper():
    """FSDP1 warns from where each wrapper is built: for auto-wrapped units, inside its wrapping code."""
    ours = _wrap(FSDP, "NO_SHARD", nested=True)
    fsdp1 = _fsdp1("nested-NO_SHARD", strategy="NO_SHARD", nested=True)
    assert ours["strategies"] == fsdp1["strategies"] == ["ShardingStrategy.NO_SHARD"] * 3
    assert [w[:2] for w in ours["warnings"]] == [w[:2] for w in fsdp1["warnings"]]
    assert len(ours["warnings"]) == 3


@distributed_test(world_size=2)
def test_hybrid_with_one_node_of_two_ranks_keeps_its_strategy():
    ours = _wrap(FSDP, "HYBRID_SHARD", mesh_shape=(1, 2))
    assert ours == {"strategies": ["ShardingStrategy.HYBRID_SHARD"], "world_sizes": [2], "warnings": []}
    assert ours == _fsdp1("mesh-1x2-HYBRID_SHARD", strategy="HYBRID_SHARD", mesh_shape=(1, 2))


@distributed_test(world_size=2)
def test_hybrid_switched_to_no_shard_still_averages_gradients_over_replicas():
    """Unlike FSDP1, which then all-reduces over the one-rank group only (README, "Differences")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(_model(), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                     device_mesh=init_device_mesh(diff.device().type, (2, 1)))
    reference = _model()
    batches = [torch.full((2, 4), float(rank + 1), device=diff.device()) for rank in range(2)]
    model(batches[dist.get_rank()]).sum().backward()
    for batch in batches:
        (reference(batch).sum() / len(batches)).backward()
    diff.assert_close_dicts(diff.full_gradients(model), diff.full_gradients(reference), rtol=1e-6)
