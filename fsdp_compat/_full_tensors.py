"""Engine-sharded ``DTensor`` parameters to full tensors, without per-parameter collectives.

The engine shards each parameter on dim 0 in ``torch.chunk`` pieces (``Shard(0)`` on the last mesh
dimension, ``Replicate()`` on a hybrid mesh's replicate dimension), so a whole unit gathers in one
all-gather (``DTensor.full_tensor()`` issues one per parameter, several times slower on real
models). On CPU it is one in-place broadcast per rank's slot: gloo's all-gather stages through a
fresh copy of the whole output (4x the CPU time, measured on 48 MB). We gather the sharded master
parameters, not through the engine's ``unshard()``, which gathers in ``MixedPrecision.param_dtype``
while FSDP1's state dicts hold full precision.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

# torch 2.13 renamed ``all_gather_into_tensor`` (now deprecated, with a warning on every call)
# to ``all_gather_single``; older torch has only the first.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GatherBuffer:
    """One gather buffer for every unit of a call (the largest unit's size), freed by ``release``:
    a fresh buffer per unit pays a page fault per 4 KiB each time, as much as the copy out."""

    def __init__(self) -> None:
        self._bytes: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._bytes is None or self._bytes.numel() < nbytes or self._bytes.device != device:
            self.release()  # first: never two buffers at once
            self._bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._bytes[:nbytes].view(dtype)

    def release(self) -> None:  # now, whoever still refers to it (a collective may keep one)
        if self._bytes is not None:
            self._bytes.untyped_storage().resize_(0)
            self._bytes = None


def gather_full_tensors(tensors: Sequence[DTensor], device: torch.device, *,
                        out_device: torch.device | None = None, keep: bool = True,
                        buffer: GatherBuffer | None = None) -> list[torch.Tensor]:
    """Full (unsharded) copies of ``tensors``, with one all-gather per process group and dtype.

    Every rank of the tensors' meshes calls this with the same tensors in the same order.
    ``device``: where the collective runs. ``out_device``: where the copies go (default: ``device``;
    a replicated value stays with its local tensor); with the CPU there, each value goes from the
    gathered buffer straight to the CPU, so the accelerator never holds more than that buffer.
    ``keep=False`` takes part in the collectives and returns ``[]`` (other ranks under
    ``rank0_only``), allocating nothing beyond the buffer. ``buffer``: the caller's, reused across
    calls and released by the caller; default: one freed on return.
    """
    results: list[torch.Tensor | None] = [None] * len(tensors)
    batches: dict[tuple[dist.ProcessGroup, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        shard_dim = _engine_shard_mesh_dim(tensor)
        if shard_dim is None or shard_dim < 0:  # replicated (the local tensor is full), or not the
            # engine's layout (DTensor works it out)
            full = (tensor.to_local() if shard_dim is None else tensor.full_tensor()).detach()
            results[index] = full.to(out_device or full.device, copy=True) if keep else None
        else:
            batches.setdefault((tensor.device_mesh.get_group(shard_dim), tensor.dtype), []).append(index)
    own_buffer = buffer or GatherBuffer()
    for (group, _), indices in batches.items():
        fulls = _all_gather_batch([tensors[i] for i in indices], group, device, out_device or device, keep,
                                  own_buffer)
        for i, full in zip(indices, fulls):
            results[i] = full
    if buffer is None:
        own_buffer.release()
    return results if keep else []  # type: ignore[return-value]


def _engine_shard_mesh_dim(tensor: DTensor) -> int | None:
    """The mesh dim of the engine's ``Shard(0)``; ``None`` if replicated; ``-1`` otherwise."""
    # Placement methods and an exact type test: ``isinstance`` and ``==`` on placements cost
    # several times as much, once per state tensor. ``_StridedShard`` (a TP layout) is not ours.
    placements = tensor.placements
    shard_dims = [dim for dim, placement in enumerate(placements) if not placement.is_replicate()]
    if not shard_dims:
        return None
    placement = placements[shard_dims[0]]
    if len(shard_dims) == 1 and type(placement) is Shard and placement.dim == 0 and tensor.dim() > 0:
        return shard_dims[0]
    return -1


def _all_gather_batch(batch: list[DTensor], group: dist.ProcessGroup, device: torch.device,
                      out_device: torch.device, keep: bool, buffer: GatherBuffer) -> list[torch.Tensor]:
    """One in-place all-gather of the batch: each rank writes its (padded) pieces straight into
    its own slot of the buffer, so no padded copy or concatenation of the inputs exists, then
    each full value is copied out of the buffer (rank-major layout) once."""
    world_size, rank = group.size(), dist.get_rank(group)
    rows = [math.ceil(t.shape[0] / world_size) for t in batch]
    numels = [r * math.prod(t.shape[1:]) for t, r in zip(batch, rows)]
    flat_output = buffer.take(world_size * sum(numels), batch[0].dtype, device)
    by_rank = flat_output.view(world_size, sum(numels))
    for tensor, r, flat_piece in zip(batch, rows, by_rank[rank].split(numels)):
        local = tensor.to_local().detach()
        piece = flat_piece.view(r, *tensor.shape[1:])
        piece[:local.shape[0]].copy_(local)
        if local.shape[0] < r:
            piece[local.shape[0]:].zero_()  # padding rows (never read back; keeps the buffer defined)
    if device.type == "cpu":  # gloo: in place, no staging (module docstring)
        for owner in range(world_size):
            dist.broadcast(by_rank[owner], group_src=owner, group=group)
    else:
        _ALL_GATHER(flat_output, by_rank[rank], group=group)
    if not keep:
        return []
    return [_copy_out(source.view(world_size, r, *tensor.shape[1:]), tensor.shape, out_device)
            for tensor, r, source in zip(batch, rows, by_rank.split(numels, dim=1))]


def _copy_out(source: torch.Tensor, shape: torch.Size, out_device: torch.device) -> torch.Tensor:
    """``source`` (``[world, rows, ...]``: each rank's padded piece) as one new full tensor of
    ``shape``. ``torch.chunk`` pieces are all whole but the last non-empty one: two copies at most."""
    full = torch.empty(shape, dtype=source.dtype, device=out_device)
    rows = source.shape[1]
    whole, rest = divmod(shape[0], rows) if rows else (0, 0)
    full[:whole * rows].view(whole, rows, *shape[1:]).copy_(source[:whole])
    if rest:
        full[whole * rows:].copy_(source[whole, :rest])
    return full


def sharded_tensor_local_piece(value: torch.Tensor, like: DTensor) -> torch.Tensor | None:
    """This rank's piece of ``like``'s layout read straight from a ``ShardedTensor``'s local shard,
    when the two layouts agree (FSDP1's SHARDED checkpoints at the same world size, whose
    ``torch.chunk`` pieces are the engine's); else ``None`` (the caller gathers instead)."""
    local = like.to_local()
    rows = engine_local_rows(like, local) if local.dim() else None
    for shard in value.local_shards():  # type: ignore[attr-defined]
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if list(sizes) == list(local.shape) and offsets[0] == (rows[0] if rows else 0) and not any(offsets[1:]):
            return shard.tensor
    return local.new_empty(local.shape) if local.numel() == 0 else None


def engine_local_rows(like: DTensor, local: torch.Tensor) -> tuple[int, int] | None:
    """``(first row, row count)`` of this rank's piece ``local`` of ``like`` when it is laid out
    as the engine lays out parameters (dim-0 ``torch.chunk`` pieces, or replicated); else ``None``.
    Cheaper than DTensor's general local-shape computation, which matters per state tensor."""
    shard_dim = _engine_shard_mesh_dim(like)
    if shard_dim is None:
        return 0, local.shape[0]
    if shard_dim < 0:
        return None
    rank = like.device_mesh.get_coordinate()[shard_dim]  # type: ignore[index]  # cached, unlike get_local_rank
    return rank * math.ceil(like.shape[0] / like.device_mesh.size(shard_dim)), local.shape[0]


def engine_rows_of_ranks(like: DTensor, group: dist.ProcessGroup) -> list[tuple[int, int]] | None:
    """``(first row, row count)`` of every rank of ``group`` (by group rank) in ``like``'s
    engine layout; ``None`` if ``like`` is replicated, laid out otherwise, or not on them all."""
    shard_dim = _engine_shard_mesh_dim(like)
    if shard_dim is None or shard_dim < 0:
        return None
    coordinates = _shard_coordinates(like.device_mesh, shard_dim, group)
    if coordinates is None:
        return None
    rows = math.ceil(like.shape[0] / like.device_mesh.size(shard_dim))
    return [(c * rows, max(0, min(rows, like.shape[0] - c * rows))) for c in coordinates]


@functools.lru_cache(maxsize=64)
def _shard_coordinates(mesh: DeviceMesh, shard_dim: int, group: dist.ProcessGroup) -> tuple[int, ...] | None:
    """Each rank of ``group``'s coordinate on ``mesh``'s ``shard_dim`` (``None`` if one is not on
    it): found once per mesh and group, not once per state tensor."""
    coordinates = []
    for group_rank in range(group.size()):
        where = (mesh.mesh == dist.get_global_rank(group, group_rank)).nonzero()
        if len(where) == 0:
            return None
        coordinates.append(int(where[0][shard_dim]))
    return tuple(coordinates)
