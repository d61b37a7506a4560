"""FULL state dicts stay within FSDP1's memory promise: while gathering, a rank holds at most one
unit's full parameters beyond what it held and what it returns (one unit at all on ranks that
keep nothing under ``rank0_only``; the same with ``offload_to_cpu``, whose values go straight to
the CPU).

Measured by counting bytes, not by timing or RSS: a ``TorchDispatchMode`` sees every tensor an
op allocates during the call and follows each with a weakref until it dies, so the high-water
mark of live new tensor memory is exact and the same on every run. The model has many equal
units, so holding two units' worth at once (a gather buffer plus a padded or concatenated copy
of the inputs, a second copy of the gathered unit...) is far outside the margin.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compat import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
from fsdp_compat import fully_sharded_data_parallel as fsdp_module
from fsdp_compat.testing import distributed_test
from fsdp_compat.wrap import ModuleWrapPolicy

_UNITS = 12
_WIDTH = 96  # a unit: Linear(96, 96), 37 KB of full parameters


class _LiveTensorBytes(TorchDispatchMode):
    """High-water mark of the bytes of plain tensors allocated inside the mode and still alive
    (a tensor whose storage was freed, ``resize_(0)``, counts for nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.tracked: list[weakref.ref[torch.Tensor]] = []
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _plain_tensors((args, kwargs))}
        for tensor in _plain_tensors(out):
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in inputs:  # new memory, not a view
                self.tracked.append(weakref.ref(tensor))
                self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        alive = [ref() for ref in self.tracked]
        return sum(t.untyped_storage().nbytes() for t in alive if t is not None)


def _plain_tensors(value: Any) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(value)
    return [leaf for leaf in leaves if type(leaf) is torch.Tensor or type(leaf) is nn.Parameter]


def _many_unit_model() -> FSDP:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(_WIDTH, _WIDTH) for _ in range(_UNITS)])
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


@pytest.mark.parametrize("offload_to_cpu", [False, True])
@pytest.mark.parametrize("rank0_only", [False, True])
@distributed_test(world_size=2)
def test_full_state_dict_holds_at_most_one_unit_beyond_its_output(rank0_only: bool, offload_to_cpu: bool) -> None:
    model = _many_unit_model()
    unit_bytes = (_WIDTH * _WIDTH + _WIDTH) * 4
    config = FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=rank0_only)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        counter = _LiveTensorBytes()
        with counter:
            state = model.state_dict()
    returned = sum(value.untyped_storage().nbytes() for value in state.values())
    expected = _UNITS * unit_bytes if not rank0_only or torch.distributed.get_rank() == 0 else 0
    assert returned == expected  # every value its own storage, nothing larger than itself
    # One unit of gather buffer beyond the output; 10% of a unit covers the padding rows.
    assert counter.peak <= returned + 1.1 * unit_bytes, (counter.peak, returned, unit_bytes)


@distributed_test(world_size=2)
def test_rank0_only_optimizer_load_holds_little_beyond_the_shards_it_returns() -> None:
    model = _many_unit_model()
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, _WIDTH)).sum().backward()
    optim.step()
    full = FSDP.full_optim_state_dict(model, optim)  # on rank 0 only
    counter = _LiveTensorBytes()
    with counter:
        loaded = FSDP.scatter_full_optim_state_dict(full if torch.distributed.get_rank() == 0 else None,
                                                    model, optim=optim)
    returned = sum(_local(value).untyped_storage().nbytes() for state in loaded["state"].values()
                   for value in state.values() if torch.is_tensor(value))
    weight_bytes = _WIDTH * _WIDTH * 4
    assert returned >= _UNITS * weight_bytes  # exp_avg and exp_avg_sq: half of each weight, each
    # Each rank receives its own rows only (one scatter per tensor): beyond its output it holds
    # the small structure rank 0 broadcasts, never a whole full state tensor (one weight's worth).
    # FSDP1's flat parameters (plain mode, use_orig_params=False) add one unit's received pieces while
    # its flat state tensors are assembled from them: half a weight per state, here Adam's two.
    flat_pieces = 0.0 if fsdp_module.DTENSOR_PARAMS else 1.0
    assert counter.peak <= returned + (0.5 + flat_pieces) * weight_bytes, (counter.peak, returned, weight_bytes)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, torch.distributed.tensor.DTensor) else value
