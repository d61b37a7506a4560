"""FSDP1's ``process_group`` (``(intra_node, inter_node)`` for hybrid strategies) or ``device_mesh``
as the engine's 1-D (shard) or 2-D ``(replicate, shard)`` mesh, cached so that auto-wrapping many
units creates the process groups once."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import _engine
from ._collectives import communication_device
from .api import ShardingStrategy

HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
MESH_DIM_NAMES_2D = ("replicate", "shard")

# Keys hold the groups and meshes themselves (not ids). That alone does not keep an entry from
# outliving its groups: the default hybrid mesh is keyed by sizes, and a ``DeviceMesh`` key compares
# by layout, not by groups. Every cached mesh is built under one default group, so a new default
# group (``destroy_process_group`` then ``init_process_group`` in the same process) empties the cache.
_mesh_cache: dict[tuple[Any, ...], DeviceMesh] = {}
_cached_under: weakref.ref[Any] | None = None  # the default group the cached meshes were built under


def _cached(key: tuple[Any, ...], build: Callable[[], DeviceMesh]) -> DeviceMesh:
    if key not in _mesh_cache:
        _mesh_cache[key] = build()
    return _mesh_cache[key]


def _forget_layouts_of_a_former_default_group() -> None:
    """After a new default group, drop our meshes and DTensor's layouts: both may hold its groups."""
    global _cached_under
    world = dist.group.WORLD
    if _cached_under is not None and _cached_under() is world:
        return
    _mesh_cache.clear()
    _engine.forget_dtensor_layout_caches()
    _cached_under = None if world is None else weakref.ref(world)


def resolve_device(device_id: int | torch.device | None, process_group: Any) -> torch.device:
    """The compute device: ``device_id`` if given, else what the process group's backend drives."""
    if device_id is not None:
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if not dist.is_initialized():
        return torch.device("cpu")
    return communication_device(process_group[0] if isinstance(process_group, tuple) else process_group)


def check_hybrid_layout_given(strategy: ShardingStrategy, process_group: Any, device_mesh: DeviceMesh | None,
                              auto_wrap_policy: Any) -> None:
    """FSDP1's refusal: a manually wrapped hybrid unit needs its layout; only with an auto-wrap policy
    does FSDP1 build the default one (sharding within a node) for the whole tree."""
    if strategy in HYBRID_STRATEGIES and process_group is None and device_mesh is None and auto_wrap_policy is None:
        raise ValueError(f"Manual wrapping with {strategy} requires explicit specification of process group or "
                         "device_mesh. (Pass process_group=(intra_node_group, inter_node_group), a 2-D device_mesh "
                         "(replicate, shard), or an auto_wrap_policy to shard within each node.)")


def build_mesh(strategy: ShardingStrategy, process_group: Any, device_mesh: DeviceMesh | None,
               device: torch.device) -> DeviceMesh:
    """The engine mesh for ``strategy``: 2-D ``(replicate, shard)`` for hybrid strategies, else 1-D."""
    _forget_layouts_of_a_former_default_group()
    hybrid = strategy in HYBRID_STRATEGIES
    if device_mesh is not None:
        return _check_given_mesh(device_mesh, hybrid)
    if hybrid:
        if process_group is None:
            return _default_hybrid_mesh(device.type)
        if not (isinstance(process_group, tuple) and len(process_group) == 2):
            raise ValueError("Expected process_group to be passed in as either None or "
                             f"Tuple[dist.ProcessGroup, dist.ProcessGroup] but got {type(process_group)}; pass "
                             "(intra_node_group, inter_node_group) or a 2-D device_mesh for hybrid sharding")
        return _mesh_from_group_pair(process_group[0], process_group[1], device.type)
    if isinstance(process_group, tuple):
        raise ValueError(f"A (intra_node, inter_node) process_group tuple is only valid for hybrid strategies, "
                         f"not {strategy}; pass a single process group")
    group = cast(dist.ProcessGroup, process_group if process_group is not None else dist.group.WORLD)
    return _cached(("1d", group, device.type), lambda: DeviceMesh.from_group(group, device.type))


def _check_given_mesh(mesh: DeviceMesh, hybrid: bool) -> DeviceMesh:
    if mesh.ndim != (2 if hybrid else 1):
        hint = ("hybrid sharding needs a 2-D mesh (replicate, shard), e.g. init_device_mesh(device, (num_nodes, "
                "ranks_per_node), mesh_dim_names=('replicate', 'shard'))" if hybrid else
                "only hybrid strategies take a 2-D mesh")
        raise ValueError(f"Expected device_mesh to have ndim={2 if hybrid else 1} but got {mesh.ndim}; {hint}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        return _cached(("named", mesh), lambda: DeviceMesh(mesh.device_type, mesh.mesh,
                                                           mesh_dim_names=MESH_DIM_NAMES_2D))
    return mesh


def _default_hybrid_mesh(device_type: str) -> DeviceMesh:
    """Shard within a node (``LOCAL_WORLD_SIZE`` ranks, else one per GPU), replicate across nodes."""
    world_size = dist.get_world_size()
    shard_size = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if shard_size <= 0 and torch.cuda.is_available():
        shard_size = torch.cuda.device_count()
    if shard_size <= 0 or world_size % shard_size != 0:
        shard_size = world_size  # one node: hybrid degenerates to full sharding within it
    return _cached(("hybrid", world_size, shard_size, device_type), lambda: init_device_mesh(
        device_type, (world_size // shard_size, shard_size), mesh_dim_names=MESH_DIM_NAMES_2D))


def _mesh_from_group_pair(intra_node: Any, inter_node: Any, device_type: str) -> DeviceMesh:
    def build() -> DeviceMesh:
        # The (nodes, ranks per node) table of global ranks, from every rank's intra-node group.
        everyones: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyones, dist.get_process_group_ranks(intra_node))
        layout = torch.tensor(sorted({tuple(ranks) for ranks in everyones}), dtype=torch.int)
        return DeviceMesh.from_group([inter_node, intra_node], device_type, mesh=layout,
                                     mesh_dim_names=MESH_DIM_NAMES_2D)

    return _cached(("pair", intra_node, inter_node, device_type), build)
