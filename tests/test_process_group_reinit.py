"""A new default process group in the same processes (``destroy_process_group``, then
``init_process_group``): wrapping builds its meshes on the new groups, never on cached ones of the
destroyed group, and trains like the single-process reference (and torch FSDP1, for the explicit
``(intra_node, inter_node)`` pair FSDP1 takes for hybrid sharding without an auto-wrap policy);
a ``NO_SHARD`` comm hook trains there too.

Each test re-creates the rank pool's default group (same backend, ranks and world size, a fresh
port) and leaves it in place, so later tests run on it as on the original. A failing test tears the
pool down and the next test starts a fresh one, so a failure here cannot break other tests.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import distributed_test
from tests import differential as diff

GOLDEN = "process_group_reinit"
NODES, RANKS_PER_NODE = 2, 2  # a real 2 x 2 hybrid layout on 4 ranks


def _recreate_default_group() -> None:
    """Destroy the default group and join a new one like it (same backend, rank and world size)."""
    backend, rank, world_size = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    port = [_free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)  # agreed over the old group, before it goes
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])  # what a torchrun-style relaunch would see
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank, world_size=world_size)
    # torch names a new default group's subgroups "1", "2"... again: one more here, so that a mesh
    # left on the destroyed groups cannot resolve by chance to new groups of the same ranks.
    dist.new_group(list(range(world_size)))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _nodes_of(ranks_per_node: int) -> Iterator[None]:
    """``LOCAL_WORLD_SIZE`` as torchrun sets it on nodes of ``ranks_per_node`` ranks (the default
    hybrid layout reads it)."""
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    try:
        yield
    finally:
        if before is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


def _node_groups() -> tuple[Any, Any]:
    """New ``(intra_node, inter_node)`` groups of this rank (every rank creates every group)."""
    rank, intra, inter = dist.get_rank(), None, None
    for node in range(NODES):
        group = dist.new_group([node * RANKS_PER_NODE + local for local in range(RANKS_PER_NODE)])
        intra = group if rank // RANKS_PER_NODE == node else intra
    for local in range(RANKS_PER_NODE):
        group = dist.new_group([node * RANKS_PER_NODE + local for node in range(NODES)])
        inter = group if rank % RANKS_PER_NODE == local else inter
    return intra, inter


def _hybrid_kwargs(layout: str) -> dict[str, Any]:
    """How a program states its hybrid layout: not at all (the default, which FSDP1 builds only for an
    auto-wrapped tree), as FSDP1's group pair, or as a 2-D mesh without dimension names (which the wrapper names)."""
    if layout == "group_pair":
        return {"process_group": _node_groups()}
    if layout == "unnamed_mesh":
        ranks = [[node * RANKS_PER_NODE + local for local in range(RANKS_PER_NODE)] for node in range(NODES)]
        return {"device_mesh": DeviceMesh(diff.device().type, ranks)}
    return {"auto_wrap_policy": fsdp_compat.wrap.ModuleWrapPolicy({diff.Block})}


def _train_hybrid(wrapper_class: type, layout: str, steps: int = 1) -> tuple[list[float], dict[str, Any]]:
    api = fsdp_compat if wrapper_class is FSDP else diff.torch_fsdp
    extra = {} if wrapper_class is FSDP else diff.fsdp1_kwargs()
    model = wrapper_class(diff.make_model(), sharding_strategy=api.ShardingStrategy.HYBRID_SHARD,
                          use_orig_params=True, **_hybrid_kwargs(layout), **extra)
    optimizer = diff.make_optimizer("sgd", model.parameters())
    return diff.train(model, optimizer, steps), diff.full_parameters(model)


@pytest.mark.parametrize("layout", ["default", "group_pair", "unnamed_mesh"])
@distributed_test(world_size=NODES * RANKS_PER_NODE)
def test_hybrid_shard_trains_on_a_re_created_default_group(layout):
    diff.quiet()
    with _nodes_of(RANKS_PER_NODE):
        _train_hybrid(FSDP, layout)  # meshes built (and cached) under the first default group
        _recreate_default_group()
        losses, params = _train_hybrid(FSDP, layout)
    reference_losses, reference_params = diff.reference_run("sgd", 1)
    diff.assert_close_lists(losses, reference_losses, what="losses vs reference")
    diff.assert_close_dicts(params, reference_params, what="params vs reference")
    if layout == "group_pair":  # the one layout FSDP1 takes without an auto-wrap policy
        diff.check_against_fsdp1(GOLDEN, diff.golden_key("HYBRID_SHARD", layout), losses,
                                 lambda: _fsdp1_losses_after_re_creation(layout))


def _train_with_comm_hook(wrapper_class: type) -> tuple[list[float], dict[str, Any]]:
    """``NO_SHARD`` with torch's all-reduce hook: the hook's all-reduce replaces the engine's, which
    goes to a one-rank group the wrapper makes once per default group."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    api = fsdp_compat if wrapper_class is FSDP else diff.torch_fsdp
    extra = {} if wrapper_class is FSDP else diff.fsdp1_kwargs()
    model = wrapper_class(diff.make_model(), sharding_strategy=api.ShardingStrategy.NO_SHARD, **extra)
    model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), default_hooks.allreduce_hook)
    optimizer = diff.make_optimizer("sgd", model.parameters())
    return diff.train(model, optimizer, 1), diff.full_parameters(model)


@distributed_test(world_size=2)
def test_comm_hook_trains_on_a_re_created_default_group():
    diff.quiet()
    _train_with_comm_hook(FSDP)
    _recreate_default_group()
    losses, params = _train_with_comm_hook(FSDP)
    reference_losses, reference_params = diff.reference_run("sgd", 1)
    diff.assert_close_lists(losses, reference_losses, what="losses vs reference")
    diff.assert_close_dicts(params, reference_params, what="params vs reference")

    def fsdp1_losses() -> list[float]:
        _train_with_comm_hook(diff.TorchFSDP)
        _recreate_default_group()
        return _train_with_comm_hook(diff.TorchFSDP)[0]

    diff.check_against_fsdp1(GOLDEN, diff.golden_key("NO_SHARD", "comm_hook"), losses, fsdp1_losses)


def _fsdp1_losses_after_re_creation(layout: str) -> list[float]:
    _train_hybrid(diff.TorchFSDP, layout)
    _recreate_default_group()
    return _train_hybrid(diff.TorchFSDP, layout)[0]
