"""Behaviours whose mutation leaves results identical or nearly so, pinned by what they change:
all-gather counts (resharding after forward), which rank's weights every rank ends with
(``sync_module_states`` on a 2-D mesh), and the clip coefficient's ``+ 1e-6``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.examples import Block
from fsdp_compat.testing import distributed_test
from tests import differential as diff

N_BLOCKS = len(diff.make_model(on_device=False).blocks)


def _hybrid_mesh():
    return init_device_mesh(diff.device().type, (2, dist.get_world_size() // 2),
                            mesh_dim_names=("replicate", "shard"))


def _all_gathers_in_one_step(strategy: str) -> int:
    """All-gathers of one training step (forward, backward, optimizer) after a warm-up step."""
    kwargs = {"device_mesh": _hybrid_mesh()} if "HYBRID" in strategy else {}
    model = FSDP(diff.make_model(), sharding_strategy=fsdp_compat.ShardingStrategy[strategy],
                 auto_wrap_policy=fsdp_compat.wrap.ModuleWrapPolicy({Block}), use_orig_params=True, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    diff.train(model, optimizer, 1)
    with CommDebugMode() as comm:
        diff.train(model, optimizer, 1, first_step=1)
    counts = comm.get_comm_counts()
    return sum(count for op, count in counts.items() if "all_gather" in str(op) or "allgather" in str(op))


# One unit per block plus the root. Resharding after forward gathers each non-root unit again in
# backward; the root is kept unsharded after forward by every strategy (FSDP1 does the same).
RESHARDED = 2 * N_BLOCKS + 1
NOT_RESHARDED = N_BLOCKS + 1


@pytest.mark.parametrize("strategy, gathers", [("SHARD_GRAD_OP", NOT_RESHARDED), ("FULL_SHARD", RESHARDED)])
@distributed_test(world_size=2)
def test_shard_grad_op_keeps_parameters_gathered_from_forward_to_backward(strategy, gathers):
    diff.quiet()
    assert _all_gathers_in_one_step(strategy) == gathers


@pytest.mark.parametrize("strategy, gathers", [("_HYBRID_SHARD_ZERO2", NOT_RESHARDED), ("HYBRID_SHARD", RESHARDED)])
@distributed_test(world_size=4)
def test_hybrid_zero2_keeps_parameters_gathered_from_forward_to_backward(strategy, gathers):
    diff.quiet()
    assert _all_gathers_in_one_step(strategy) == gathers


@distributed_test(world_size=4)
def test_sync_module_states_on_a_hybrid_mesh_gives_every_rank_rank0_values():
    diff.quiet()
    model = FSDP(diff.make_model(seed=dist.get_rank()), sharding_strategy=fsdp_compat.ShardingStrategy.HYBRID_SHARD,
                 device_mesh=_hybrid_mesh(), auto_wrap_policy=fsdp_compat.wrap.ModuleWrapPolicy({Block}),
                 sync_module_states=True)
    diff.assert_close_dicts(diff.full_parameters(model), diff.full_parameters(diff.make_model(seed=0)), rtol=0)


def _backward(model: nn.Module, loss_scale: float) -> None:
    torch.manual_seed(0)
    inputs = torch.randn(4, 8, device=diff.device())
    (model(inputs).sum() * loss_scale).backward()


@distributed_test(world_size=2)
def test_clip_coefficient_adds_1e_minus_6_to_the_total_norm():
    torch.manual_seed(0)
    reference = nn.Linear(8, 8, device=diff.device())
    torch.manual_seed(0)
    model = FSDP(nn.Linear(8, 8, device=diff.device()), use_orig_params=True)
    _backward(reference, 1.0)
    unit_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    reference.zero_grad()
    # Total norm 1e-5 clipped to 1e-6: the coefficient is 1/11 with ``+ 1e-6``, 1/10 without.
    loss_scale = 1e-5 / unit_norm
    _backward(reference, loss_scale)
    _backward(model, loss_scale)
    max_norm = 1e-6
    total = model.clip_grad_norm_(max_norm)
    expected_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    torch.testing.assert_close(total.cpu(), expected_total.cpu(), rtol=1e-5, atol=0)
    expected = {name: p.grad.detach().cpu() for name, p in reference.named_parameters()}
    diff.assert_close_dicts(diff.full_gradients(model), expected, rtol=1e-4, what="clipped grads")
