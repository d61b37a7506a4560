"""The optimizer state-dict family works on the plain state: the model and the optimizer stay as the user sees them.

In FSDP1 a parameter is a plain tensor holding this rank's shard at every moment user code runs, also while
``FSDP.optim_state_dict`` and its family run (a module's hooks, a custom ``__setattr__``, another thread see
nothing else). Ours read the state of the plain views or flat parameters directly and cut a loaded full
state straight into their layout: no module is given the engine's ``DTensor`` parameters during a call and
no optimizer is given other parameters or state. The modules here record every ``DTensor`` assigned to them
(torch routes parameter registration through a custom ``__setattr__``); the optimizer's groups and state must
be the very same objects afterwards. Only torch's own ``get_state_dict`` family (DCP), which reads the
engine's parameters from the model itself, sees them, for the duration of its call.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat import OptimStateKeyType, StateDictType
from fsdp_compat.testing import distributed_test

assigned: list[str] = []  # names of DTensors assigned to a RecordingLinear


class RecordingLinear(nn.Linear):
    """A linear layer that records every ``DTensor`` set on it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, DTensor):
            assigned.append(name)
        super().__setattr__(name, value)


def build(use_orig_params: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(RecordingLinear(8, 16), nn.ReLU(), RecordingLinear(16, 5))
    wrapped = FSDP(model, auto_wrap_policy=fsdp_compat.wrap.ModuleWrapPolicy({RecordingLinear}),
                   use_orig_params=use_orig_params)
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    wrapped(torch.randn(4, 8)).sum().backward()
    optim.step()
    return wrapped, optim


def every_call(model: nn.Module, optim: torch.optim.Optimizer, use_orig_params: bool) -> None:
    """Each save and load of the family, as FSDP1 users call them."""
    for kind in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT):
        with FSDP.state_dict_type(model, kind):
            saved = FSDP.optim_state_dict(model, optim)
            FSDP.optim_state_dict_to_load(model, optim, saved)
    full = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    FSDP.shard_full_optim_state_dict(full, model, optim=optim)
    FSDP.scatter_full_optim_state_dict(full, model, optim=optim)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        FSDP.flatten_sharded_optim_state_dict(FSDP.sharded_optim_state_dict(model, optim), model, optim)
    if use_orig_params:  # FSDP1 keys flat parameters otherwise
        FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, model, optim=optim)


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.filterwarnings("ignore::FutureWarning")  # the legacy calls
@distributed_test
def test_the_family_never_shows_the_engines_parameters(use_orig_params):
    model, optim = build(use_orig_params)
    params = [list(group["params"]) for group in optim.param_groups]
    state = {param: dict(param_state) for param, param_state in optim.state.items()}
    assigned.clear()

    every_call(model, optim, use_orig_params)

    assert assigned == []
    assert all(not isinstance(param, DTensor) for param in model.parameters())
    assert [list(group["params"]) for group in optim.param_groups] == params
    assert all(a is b for group, before in zip(optim.param_groups, params) for a, b in zip(group["params"], before))
    assert optim.state.keys() == state.keys()
    for param, before in state.items():
        assert optim.state[param].keys() == before.keys()
        assert all(optim.state[param][name] is value for name, value in before.items())
