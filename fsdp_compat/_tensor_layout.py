"""One tensor in three layouts: full, sharded like an engine parameter (DTensor), FSDP1's ShardedTensor.

Checkpoints move optimizer state (and parameters) between these layouts. Every conversion here
returns new memory: a state dict that aliased the live optimizer state would change under the
user's feet at the next step (FSDP1's own gather reuses one buffer and hands out aliases of it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ._collectives import communication_device
from ._engine import ShardedTensor, dtensor_like, local_shape_and_offset, local_tensor, sharded_tensor_group
from ._full_tensors import GatherBuffer, engine_local_rows, engine_rows_of_ranks, gather_full_tensors


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is FSDP1's (deprecated) ``ShardedTensor``."""
    return ShardedTensor is not None and isinstance(value, ShardedTensor)


def is_replicated_only(value: DTensor) -> bool:
    """Whether every rank holds the whole of ``value`` (``NO_SHARD``'s layout)."""
    return all(isinstance(placement, Replicate) for placement in value.placements)


def copy_to(tensor: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A detached copy of a plain tensor, on ``device`` (default: where it is)."""
    return tensor.detach().to(device if device is not None else tensor.device, copy=True)


def full_tensors(values: list[DTensor], device: torch.device | str | None = None, *,
                 keep: bool = True, buffer: GatherBuffer | None = None) -> list[torch.Tensor]:
    """The unsharded values of ``values`` as new memory each, on ``device`` (default: where each
    local shard is); ``keep`` and ``buffer`` as in ``gather_full_tensors``, whose collective this is."""
    if not values:
        return []
    mesh_device = torch.device(values[0].device_mesh.device_type)
    local_devices = {value.to_local().device for value in values}
    out_device = (torch.device(device) if device is not None
                  else local_devices.pop() if len(local_devices) == 1 else None)
    fulls = gather_full_tensors(values, mesh_device, out_device=out_device, keep=keep, buffer=buffer)
    if out_device is None and keep:  # shards on several devices: each full value goes to its shard's
        fulls = [full.to(value.to_local().device) for value, full in zip(values, fulls)]
    return fulls


def local_copy(value: DTensor, device: torch.device | str | None = None) -> DTensor:
    """``value`` with its local shard copied (optionally to ``device``); same layout."""
    return dtensor_like(copy_to(value.to_local(), device), value)


def same_layout(value: DTensor, like: DTensor) -> bool:
    """Whether ``value`` is sharded exactly as ``like`` (so its local shard is ours as is)."""
    return (value.shape == like.shape and value.device_mesh == like.device_mesh
            and tuple(value.placements) == tuple(like.placements))


def shard_like(full: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's part of ``full`` (held by every rank) laid out as ``like``, as new memory;
    no communication."""
    local_like = local_tensor(like)
    rows = engine_local_rows(like, local_like)
    if rows is not None:  # the engine's layout: a run of rows, found without DTensor's general math
        piece = full[rows[0]:rows[0] + rows[1]]
    else:
        local_shape, offset = local_shape_and_offset(like)
        piece = full[tuple(slice(begin, begin + size) for begin, size in zip(offset, local_shape))]
    return dtensor_like(piece.to(local_like.device, copy=True, memory_format=torch.contiguous_format), like)


def scatterable(like: torch.Tensor, group: Any) -> bool:
    """Whether :func:`scatter_like` can lay a full tensor out as ``like``: the engine's sharded
    layout over the ranks of ``group`` (every rank decides alike)."""
    return isinstance(like, DTensor) and engine_rows_of_ranks(like, group) is not None


def scatter_like(fulls: list[torch.Tensor] | None, likes: list[DTensor], dtype: torch.dtype,
                 group: Any) -> list[DTensor]:
    """``fulls`` (given on rank 0 of ``group``, ``None`` elsewhere) laid out as ``likes`` (each
    :func:`scatterable`), every rank receiving only its own rows of them all in one scatter: a
    broadcast would send everyone all of it, and one collective per tensor costs more than the
    bytes on small tensors. The received pieces are views of one new buffer. A collective."""
    rows = [cast(list[tuple[int, int]], engine_rows_of_ranks(like, group)) for like in likes]
    # gloo scatters equal sizes: each tensor gets a slot of its longest piece on every rank.
    slots = [max(count for _, count in ranks) * math.prod(like.shape[1:]) for ranks, like in zip(rows, likes)]
    device = communication_device(group)
    pieces = None
    if fulls is not None:
        pieces = [torch.empty(sum(slots), dtype=dtype, device=device) for _ in range(group.size())]
        for rank, piece in enumerate(pieces):
            for full, ranks, slot in zip(fulls, rows, piece.split(slots)):
                start, count = ranks[rank]
                _first_rows(slot, count, full.shape).copy_(full[start:start + count])
    received = torch.empty(sum(slots), dtype=dtype, device=device)
    dist.scatter(received, pieces, group_src=0, group=group)
    me = dist.get_rank(group)
    return [dtensor_like(_first_rows(slot, ranks[me][1], like.shape).to(local_tensor(like).device), like)
            for like, ranks, slot in zip(likes, rows, received.split(slots))]


def _first_rows(flat: torch.Tensor, count: int, shape: torch.Size) -> torch.Tensor:
    """The start of ``flat`` as ``count`` rows of a tensor of ``shape``."""
    return flat[:count * math.prod(shape[1:])].view(count, *shape[1:])


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor left out of an object rank 0 broadcasts (cheap to pickle); :func:`broadcast_tensor`
    sends its values after."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)


def broadcast_tensor(value: torch.Tensor | TensorSpec, group: Any, device: torch.device) -> torch.Tensor:
    """Rank 0's tensor (``value`` there, in any layout; its :class:`TensorSpec` elsewhere) in full on
    every rank of ``group`` (``None``: the default group), as new memory on ``device``."""
    if isinstance(value, TensorSpec):
        tensor = torch.empty(value.shape, dtype=value.dtype, device=device)
    else:
        tensor = to_full(value).detach().to(device, copy=True)
    dist.broadcast(tensor, group_src=0, group=group)
    return tensor


def to_full(value: torch.Tensor) -> torch.Tensor:
    """Any of the three layouts as a full tensor (collective for DTensor and ShardedTensor: each
    of a ShardedTensor's shards is broadcast by its owner)."""
    if isinstance(value, DTensor):
        return full_tensors([value])[0]
    if not is_sharded_tensor(value):
        return value
    metadata = value.metadata()  # type: ignore[attr-defined]
    group = sharded_tensor_group(value)
    device = communication_device(group)
    dtype = metadata.tensor_properties.dtype
    local_shards = value.local_shards()  # type: ignore[attr-defined]
    mine = {tuple(shard.metadata.shard_offsets): shard.tensor for shard in local_shards}
    full = torch.empty(tuple(metadata.size), dtype=dtype, device=device)
    for shard in metadata.shards_metadata:
        if 0 in shard.shard_sizes:
            continue
        offsets = tuple(shard.shard_offsets)
        owner = shard.placement.rank()  # a rank of the ShardedTensor's group
        piece = mine.get(offsets) if owner == dist.get_rank(group) else None
        buffer = (piece.to(device, copy=True) if piece is not None
                  else torch.empty(shard.shard_sizes, dtype=dtype, device=device))
        dist.broadcast(buffer, group_src=owner, group=group)
        full[tuple(slice(start, start + size) for start, size in zip(offsets, shard.shard_sizes))] = buffer
    return full


def to_layout_of(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (any layout, global shape of ``like``) in ``like``'s layout, as new memory;
    without communication when ``value`` is already sharded as ``like``."""
    if isinstance(like, DTensor):
        if isinstance(value, DTensor) and same_layout(value, like):
            return local_copy(value, local_tensor(like).device)
        return shard_like(to_full(value), like)
    return copy_to(to_full(value), like.device)
