"""Engine-sharded ``DTensor`` parameters to full tensors and back, without per-parameter collectives.

(Single-tensor layout conversions live in ``_tensor_layout``.)

The engine shards each parameter on dim 0 in ``torch.chunk`` pieces (``Shard(0)`` on the last
mesh dimension, ``Replicate()`` on the replicate dimension of a hybrid mesh). Gathering a whole
unit therefore needs one all-gather: pad every local piece to the chunk size, concatenate, gather,
and cut each parameter back out. ``DTensor.full_tensor()`` would issue one collective per
parameter, which is several times slower on real models.

We gather from the sharded master parameters, not through the engine's ``unshard()``: that one
all-gathers in ``MixedPrecision.param_dtype``, while FSDP1's state dicts hold full precision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["gather_full_tensors", "sharded_tensor_local_piece"]


def gather_full_tensors(tensors: Sequence[DTensor], device: torch.device) -> list[torch.Tensor]:
    """Full (unsharded) copies of ``tensors``, with one all-gather per process group and dtype.

    Every rank of the tensors' meshes must call this with the same tensors in the same order.
    ``device`` is where the collective runs (local pieces offloaded to the CPU are moved there).
    """
    results: list[torch.Tensor | None] = [None] * len(tensors)
    batches: dict[tuple[int, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        shard_dim = _engine_shard_mesh_dim(tensor)
        if shard_dim is None:  # replicated everywhere: the local tensor is the full one
            results[index] = tensor.to_local().detach().clone()
        elif shard_dim < 0:  # a layout the engine does not produce: let DTensor work it out
            results[index] = tensor.full_tensor().detach().clone()
        else:
            group = tensor.device_mesh.get_group(shard_dim)
            batches.setdefault((id(group), tensor.dtype), []).append(index)
    for indices in batches.values():
        batch = [tensors[i] for i in indices]
        group = batch[0].device_mesh.get_group(_engine_shard_mesh_dim(batch[0]))
        for i, full in zip(indices, _all_gather_batch(batch, group, device)):
            results[i] = full
    return results  # type: ignore[return-value]


def _engine_shard_mesh_dim(tensor: DTensor) -> int | None:
    """The mesh dim of the engine's ``Shard(0)``; ``None`` if replicated; ``-1`` otherwise."""
    shard_dims = [dim for dim, placement in enumerate(tensor.placements) if not isinstance(placement, Replicate)]
    if not shard_dims:
        return None
    if len(shard_dims) == 1 and tensor.placements[shard_dims[0]] == Shard(0) and tensor.dim() > 0:
        return shard_dims[0]
    return -1


def _all_gather_batch(batch: list[DTensor], group: dist.ProcessGroup, device: torch.device) -> list[torch.Tensor]:
    world_size = group.size()
    rows = [math.ceil(t.shape[0] / world_size) for t in batch]
    row_numels = [math.prod(t.shape[1:]) for t in batch]
    padded = [_padded_local(t, r, device) for t, r in zip(batch, rows)]
    flat_input = torch.cat([p.reshape(-1) for p in padded])
    flat_output = torch.empty(world_size * flat_input.numel(), dtype=flat_input.dtype, device=device)
    dist.all_gather_into_tensor(flat_output, flat_input, group=group)
    by_rank = flat_output.view(world_size, -1)
    results, offset = [], 0
    for tensor, r, row_numel in zip(batch, rows, row_numels):
        numel = r * row_numel
        full = by_rank[:, offset:offset + numel].reshape(world_size * r, *tensor.shape[1:])
        results.append(full[:tensor.shape[0]].contiguous())
        offset += numel
    return results


def _padded_local(tensor: DTensor, rows: int, device: torch.device) -> torch.Tensor:
    local = tensor.to_local().detach()
    padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=device)
    padded[:local.shape[0]].copy_(local)
    return padded


def sharded_tensor_local_piece(value: torch.Tensor, like: DTensor) -> torch.Tensor | None:
    """This rank's piece of ``like``'s layout read straight from a ``ShardedTensor``'s local shard,
    when the two layouts agree (FSDP1's SHARDED checkpoints at the same world size, whose
    ``torch.chunk`` pieces are the engine's); else ``None`` (the caller gathers instead)."""
    local = like.to_local()
    expected_offset = _local_dim0_offset(like)
    for shard in value.local_shards():  # type: ignore[attr-defined]
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if list(sizes) == list(local.shape) and offsets[0] == expected_offset and not any(offsets[1:]):
            return shard.tensor
    if local.numel() == 0:
        return local.new_empty(local.shape)
    return None


def _local_dim0_offset(like: DTensor) -> int:
    """Row offset of this rank's piece of an engine-sharded DTensor."""
    shard_dim = _engine_shard_mesh_dim(like)
    if shard_dim is None or shard_dim < 0:
        return 0
    rank = like.device_mesh.get_local_rank(shard_dim)
    return rank * math.ceil(like.shape[0] / like.device_mesh.size(shard_dim))
