"""A parameter shared between two separately wrapped roots is refused up front, clearly.

FSDP1 shards such a parameter twice; the engine cannot (it would take the first root's sharded
``DTensor`` for a tensor-parallel one and fail deep inside). A parameter tied inside one root works.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import distributed_test
from tests import differential as diff


def two_towers() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    first = nn.Sequential(nn.Linear(8, 8), shared).to(diff.device())
    second = nn.Sequential(shared, nn.Linear(8, 4)).to(diff.device())
    return first, second


@distributed_test(world_size=2)
def test_parameter_shared_with_another_root_raises_before_touching_anything():
    first, second = two_towers()
    first = FSDP(first, use_orig_params=True)
    before = {name: param for name, param in second.named_parameters()}
    own_before = {name: param.detach().clone() for name, param in second.named_parameters()
                  if not isinstance(param, DTensor)}
    with pytest.raises(ValueError, match=r"'0\.weight' is already sharded by another .*common parent"):
        FSDP(second, use_orig_params=True)
    assert {name: param for name, param in second.named_parameters()} == before  # same objects
    for name, value in own_before.items():
        assert torch.equal(dict(second.named_parameters())[name], value)
    x = torch.randn(2, 8, device=diff.device())
    first(x).sum().backward()  # the first root still trains


@distributed_test(world_size=2)
def test_parameter_tied_inside_one_root_is_accepted():
    first, second = two_towers()
    both = FSDP(nn.Sequential(first, second), use_orig_params=True)
    x = torch.randn(2, 8, device=diff.device())
    both(x).sum().backward()
