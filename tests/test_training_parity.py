"""Training parity: fsdp_compat == single-process reference == torch FSDP1, for every strategy.

The same seeded TinyGPT (uneven vocabulary, tied head, buffers) trains 3 steps; every rank takes
its slice of one global batch. Per-step losses and final full parameters must equal the
single-process reference within 1e-5 relative, and torch FSDP1's (or its golden values when torch
no longer ships FSDP1).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import distributed_test
from tests import differential as diff

STEPS = 3  # the first uses no optimizer state, the next ones SGD's momentum and AdamW's moments
FLAT_STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
HYBRID_STRATEGIES = ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
VARIANTS = list(itertools.product([True, False], [True, False], ["sgd", "adamw"]))  # wrap, orig, optim


def _hybrid_mesh_kwargs() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(diff.device().type, (2, dist.get_world_size() // 2),
                            mesh_dim_names=("replicate", "shard"))
    return {"device_mesh": mesh}


def _run(wrapper_class, strategy: str, auto_wrap: bool, use_orig_params: bool, optimizer_name: str,
         extra: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = diff.make_model()
    kwargs = dict(sharding_strategy=getattr(diff.torch_fsdp.ShardingStrategy, strategy),
                  use_orig_params=use_orig_params, **extra)
    if auto_wrap:
        kwargs["auto_wrap_policy"] = diff.block_policy_torch()
    wrapped = wrapper_class(model, **kwargs)
    optimizer = diff.make_optimizer(optimizer_name, wrapped.parameters())
    losses = diff.train(wrapped, optimizer, STEPS)
    return losses, diff.full_parameters(wrapped)


def check_parity(strategy: str, auto_wrap: bool, use_orig_params: bool, optimizer_name: str) -> None:
    diff.quiet()
    extra = _hybrid_mesh_kwargs() if strategy in HYBRID_STRATEGIES else {}
    ours_losses, ours_params = _run(FSDP, strategy, auto_wrap, use_orig_params, optimizer_name, extra)
    reference_losses, reference_params = diff.reference_run(optimizer_name, STEPS)
    diff.assert_close_lists(ours_losses, reference_losses, what="losses vs reference")
    diff.assert_close_dicts(ours_params, reference_params, what="params vs reference")

    key = diff.golden_key(strategy, f"wrap{int(auto_wrap)}", f"orig{int(use_orig_params)}", optimizer_name)
    diff.check_against_fsdp1(
        "training_parity", key, ours_losses,
        lambda: _run(diff.TorchFSDP, strategy, auto_wrap, use_orig_params, optimizer_name,
                     {**extra, **diff.fsdp1_kwargs()})[0])


@pytest.mark.parametrize("strategy", FLAT_STRATEGIES)
@pytest.mark.parametrize("auto_wrap,use_orig_params,optimizer_name", VARIANTS)
@distributed_test(world_size=1)
def test_parity_world_1(strategy, auto_wrap, use_orig_params, optimizer_name):
    check_parity(strategy, auto_wrap, use_orig_params, optimizer_name)


@pytest.mark.parametrize("strategy", FLAT_STRATEGIES)
@pytest.mark.parametrize("auto_wrap,use_orig_params,optimizer_name", VARIANTS)
@distributed_test(world_size=2)
def test_parity_world_2(strategy, auto_wrap, use_orig_params, optimizer_name):
    check_parity(strategy, auto_wrap, use_orig_params, optimizer_name)


@pytest.mark.parametrize("strategy", FLAT_STRATEGIES + HYBRID_STRATEGIES)
@pytest.mark.parametrize("auto_wrap,use_orig_params,optimizer_name", VARIANTS)
@distributed_test(world_size=4)
def test_parity_world_4(strategy, auto_wrap, use_orig_params, optimizer_name):
    check_parity(strategy, auto_wrap, use_orig_params, optimizer_name)
