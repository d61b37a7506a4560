"""Two models over two process groups of the same ranks in one program (a second model, a
``dist.new_group`` with its own timeout): each model's state dicts are over its own group, as FSDP1's,
which builds every ``ShardedTensor`` over the unit's ``process_group``.

DTensor gives an operator's output (``nn.Parameter(dtensor)`` and ``.to()`` included) the layout it
cached for an equal input, and meshes over the same ranks compare equal whatever their groups: without
care the second model's parameters, state dicts and gradients would carry the first model's group.
Each test builds both models itself, so it fails on its own, whatever ran before it in the worker.
"""

from __future__ import annotations

import copy
import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat._engine import ShardedTensor, sharded_tensor_group
from fsdp_compat.examples import Block
from fsdp_compat.testing import distributed_test
from fsdp_compat.wrap import ModuleWrapPolicy
from tests import differential as diff

SHARDED = fsdp_compat.StateDictType.SHARDED_STATE_DICT
LOCAL = fsdp_compat.StateDictType.LOCAL_STATE_DICT
# A rank left waiting fails after this long (a test's groups, as users make them: with a timeout).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=20)


def build(group: Any, use_orig_params: bool = True, steps: int = 1,
          dtensor_params: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The seeded model wrapped per block over ``group``, trained ``steps`` AdamW steps."""
    diff.quiet()
    model = FSDP(diff.make_model(), process_group=group, auto_wrap_policy=ModuleWrapPolicy({Block}),
                 use_orig_params=use_orig_params, dtensor_params=dtensor_params)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diff.train(model, optim, steps)
    return model, optim


def two_models(**options: Any) -> list[tuple[Any, nn.Module, torch.optim.Optimizer]]:
    """``(group, model, optimizer)`` for two groups over every rank, the second built after the first."""
    built = []
    for _ in range(2):
        group = dist.new_group(timeout=COLLECTIVE_TIMEOUT)
        built.append((group, *build(group, **options)))
    return built


def parameter_keys() -> int:
    """How many of the model's state-dict entries are parameters (a tied one under each name): those sharded."""
    model = diff.make_model()
    buffers = {name for name, _ in model.named_buffers()}
    return sum(key not in buffers for key in model.state_dict())


def groups_of(state: dict[str, Any]) -> dict[str, Any]:
    """The process group of every ``ShardedTensor`` / ``DTensor`` in a (nested) state dict, by key path."""
    found = {}
    for key, value in state.items():
        if isinstance(value, dict):
            found.update({f"{key}.{inner}": group for inner, group in groups_of(value).items()})
        elif ShardedTensor is not None and isinstance(value, ShardedTensor):
            found[str(key)] = sharded_tensor_group(value)
        elif isinstance(value, DTensor):
            found[str(key)] = value.device_mesh.get_group()
    return found


def assert_over(group: Any, state: dict[str, Any], expected_count: int, what: str) -> None:
    found = groups_of(state)
    assert len(found) == expected_count, f"{what}: {len(found)} sharded values, not {expected_count}"
    others = sorted(key for key, value in found.items() if value is not group)
    assert not others, f"{what}: {len(others)} of {len(found)} values over another group, e.g. {others[:3]}"


def sharded_optim_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    with FSDP.state_dict_type(model, SHARDED):
        return FSDP.optim_state_dict(model, optim)


@pytest.mark.skipif(ShardedTensor is None, reason="this torch has no ShardedTensor")
@pytest.mark.parametrize("use_orig_params,dtensor_params", [(True, False), (False, False), (True, True)],
                         ids=["orig_params", "flat_params", "dtensor_params"])
@distributed_test(world_size=2)
def test_sharded_optimizer_state_dict_of_each_model_is_over_its_own_group(use_orig_params, dtensor_params):
    # With the engine's DTensor parameters the optimizer's own ops (AdamW's ``zeros_like``) make its state.
    models = two_models(use_orig_params=use_orig_params, dtensor_params=dtensor_params)
    for group, model, optim in models + models[:1]:  # the first model again, after the second
        saved = sharded_optim_state(model, optim)
        sharded = sum(torch.is_tensor(value) and value.dim() > 0 for state in saved["state"].values()
                      for value in state.values())
        assert_over(group, saved["state"], sharded, "SHARDED optimizer state dict")
        # What failed with values over two groups: torch refuses ops mixing ShardedTensors of two groups.
        again = FSDP.optim_state_dict_to_load(model, optim, copy.deepcopy(saved))
        optim.load_state_dict(again)
        diff.train(model, optim, 1)


@pytest.mark.skipif(ShardedTensor is None, reason="this torch has no ShardedTensor")
@pytest.mark.parametrize("kind", ["sharded", "local", "sharded_dtensor"])
@distributed_test(world_size=2)
def test_model_state_dict_of_each_model_is_over_its_own_group(kind):
    models = two_models()
    config = fsdp_compat.ShardedStateDictConfig(_use_dtensor=True) if kind == "sharded_dtensor" else None
    for group, model, _ in models + models[:1]:
        with FSDP.state_dict_type(model, LOCAL if kind == "local" else SHARDED, config):
            state = model.state_dict()
        # LOCAL is FSDP1's: one flat parameter per unit.
        expected = len(FSDP.fsdp_modules(model)) if kind == "local" else parameter_keys()
        assert_over(group, state, expected, f"{kind} model state dict")


@pytest.mark.skipif(ShardedTensor is None, reason="this torch has no ShardedTensor")
@distributed_test(world_size=2)
def test_a_model_cast_after_wrapping_stays_on_its_own_group():
    """``model.double()`` replaces the engine's parameters (``nn.Module._apply``): still its group."""
    models = two_models(steps=0)
    for _, model, _ in models:
        model.double()
    for group, model, _ in models:
        with FSDP.state_dict_type(model, SHARDED):
            state = model.state_dict()
        assert_over(group, state, parameter_keys(), "SHARDED after .double()")
        assert all(value.local_tensor().dtype == torch.float64 for value in state.values()
                   if isinstance(value, ShardedTensor))
