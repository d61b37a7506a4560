"""Moving tensors between layouts: full, sharded like an engine parameter (DTensor), FSDP1's ShardedTensor.

One gather (``gather_full_tensors``, ``full_tensors`` on top of it), one shard (``shard_like``/``scatter_like``),
one broadcast. Every conversion returns new memory: a state dict aliasing the live optimizer state would
change at the next step (FSDP1's gather hands out aliases of one reused buffer).

The engine shards each parameter on dim 0 in ``torch.chunk`` pieces (``Shard(0)`` on the last mesh dim,
``Replicate()`` on a hybrid mesh's other), so a whole unit gathers in one all-gather (``DTensor.full_tensor()``
issues one per parameter, several times slower). On CPU, one in-place broadcast per rank's slot: gloo's
all-gather stages through a copy of the whole output (4x the CPU time on 48 MB). We gather the sharded master
parameters, not by the engine's ``unshard()`` (in ``param_dtype``; FSDP1's state dicts hold full precision).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._collectives import communication_device
from ._engine import (ShardedTensor, dtensor_like, local_shape_and_offset, local_tensor, new_sharded_tensor,
                      sharded_tensor_group)

# torch 2.13 renamed ``all_gather_into_tensor`` (now deprecated, with a warning on every call)
# to ``all_gather_single``; older torch has only the first.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveBuffer:
    """A collective's staging buffer (a gather's output, a scatter's input), freed by ``release`` at once:
    gloo's worker thread keeps a reference to it a moment after the collective returns. A gather reuses
    one for every unit of a call (the largest unit's size): a fresh buffer per unit pays a page fault per
    4 KiB each time, as much as the copy out."""

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
                        buffer: CollectiveBuffer | None = None) -> list[torch.Tensor]:
    """Full (unsharded) copies of ``tensors``, with one all-gather per process group and dtype; every
    rank of the tensors' meshes calls this with the same tensors in the same order. ``device``: where the
    collective runs. ``out_device``: where the copies go (default: ``device``; a replicated value stays
    with its local tensor); with the CPU there, each value goes from the gathered buffer straight to the
    CPU, so the accelerator never holds more than that buffer. ``keep=False`` takes part in the collectives
    and returns ``[]`` (other ranks under ``rank0_only``), allocating nothing beyond the buffer. ``buffer``:
    the caller's, reused across calls and released by the caller; default: one freed on return."""
    results: list[torch.Tensor | None] = [None] * len(tensors)
    batches: dict[tuple[dist.ProcessGroup, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        shard_dim = _engine_shard_mesh_dim(tensor)
        if shard_dim is None or shard_dim < 0:  # replicated (the local tensor is full), or not the
            # engine's layout (DTensor works it out)
            # ``local_tensor``, not ``to_local()``: the latter builds an autograd node per tensor, the
            # largest cost of a one-rank FULL state dict after the copy itself.
            full = (local_tensor(tensor) if shard_dim is None else tensor.full_tensor()).detach()
            results[index] = full.to(out_device or full.device, copy=True) if keep else None
        else:
            batches.setdefault((tensor.device_mesh.get_group(shard_dim), tensor.dtype), []).append(index)
    own_buffer = buffer or CollectiveBuffer()
    for (group, _), indices in batches.items():
        fulls = _all_gather_batch([tensors[i] for i in indices], group, device, out_device or device, keep, own_buffer)
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
                      out_device: torch.device, keep: bool, buffer: CollectiveBuffer) -> list[torch.Tensor]:
    """One in-place all-gather of the batch: each rank writes its (padded) pieces straight into
    its own slot of the buffer, so no padded copy or concatenation of the inputs exists, then
    each full value is copied out of the buffer (rank-major layout) once."""
    world_size, rank = group.size(), dist.get_rank(group)
    rows = [math.ceil(t.shape[0] / world_size) for t in batch]
    numels = [r * math.prod(t.shape[1:]) for t, r in zip(batch, rows)]
    flat_output = buffer.take(world_size * sum(numels), batch[0].dtype, device)
    by_rank = flat_output.view(world_size, sum(numels))
    for tensor, r, flat_piece in zip(batch, rows, by_rank[rank].split(numels)):
        local = local_tensor(tensor).detach()
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


def _engine_pieces(like: DTensor) -> tuple[dist.ProcessGroup, list[_Piece]] | None:
    """The shard group of ``like`` and the ``(offsets, sizes, global rank)`` of every rank's non-empty piece
    of it there: FSDP1's ``ShardedTensor`` metadata for the same ``torch.chunk`` pieces. ``None`` if
    ``like`` is replicated or laid out otherwise."""
    shard_dim = _engine_shard_mesh_dim(like)
    if shard_dim is None or shard_dim < 0:
        return None
    group = like.device_mesh.get_group(shard_dim)
    rows = engine_rows_of_ranks(like, group)
    if rows is None:
        return None
    tail = tuple(like.shape[1:])
    ranks = dist.get_process_group_ranks(group)
    return group, [((start,) + (0,) * len(tail), (count,) + tail, rank)
                   for rank, (start, count) in zip(ranks, rows) if count > 0]


_Piece = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, global rank of the holder


def as_sharded_tensor(value: DTensor) -> torch.Tensor:
    """``value`` (laid out as an engine parameter) as FSDP1's ``ShardedTensor`` over its shard group,
    which is how FSDP1's SHARDED and LOCAL state dicts carry their sharding (``torch.distributed.checkpoint``
    saves every rank's piece; a plain per-rank tensor would be taken as replicated and saved once). Shares
    ``value``'s local piece; no collective. ``value`` itself where this torch has no ``ShardedTensor`` or
    the layout is not the engine's (replicated: every rank holds all of it)."""
    found = _engine_pieces(value) if ShardedTensor is not None else None
    if found is None:
        return value
    group, pieces = found
    return new_sharded_tensor(local_tensor(value), value.shape, pieces, group)


def _sharded_tensor_piece(value: torch.Tensor, like: DTensor) -> torch.Tensor | None:
    """This rank's piece of ``like``'s layout read straight from the ``ShardedTensor`` ``value``'s local
    shard, when ``value`` is cut into exactly ``like``'s pieces (FSDP1's SHARDED and our SHARDED and LOCAL
    checkpoints at the same world size); else ``None``. Decided from the global metadata, so alike on
    every rank: the other answer costs collectives."""
    found = _engine_pieces(like)
    metadata = value.metadata()  # type: ignore[attr-defined]
    theirs = {(tuple(shard.shard_offsets), tuple(shard.shard_sizes), shard.placement.rank())
              for shard in metadata.shards_metadata if 0 not in shard.shard_sizes}
    if found is None or tuple(metadata.size) != tuple(like.shape) or theirs != set(found[1]):
        return None
    local = local_tensor(like)
    shards = [shard.tensor for shard in value.local_shards() if shard.tensor.numel()]  # type: ignore[attr-defined]
    return shards[0] if shards else local.new_empty(local.shape)


def _local_rows(like: DTensor, local: torch.Tensor) -> tuple[int, int] | None:
    """``(first row, row count)`` of this rank's piece ``local`` of ``like`` in the engine's layout
    (dim-0 ``torch.chunk`` pieces, or replicated), else ``None``: without DTensor's general
    local-shape computation, which costs several times more, once per state tensor."""
    shard_dim = _engine_shard_mesh_dim(like)
    if shard_dim is None:
        return (0, local.shape[0]) if local.dim() else None
    if shard_dim < 0:
        return None
    rank = like.device_mesh.get_coordinate()[shard_dim]  # type: ignore[index]  # cached, unlike get_local_rank
    return rank * math.ceil(like.shape[0] / like.device_mesh.size(shard_dim)), local.shape[0]


def _local_box(like: DTensor, local: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global offset and shape of this rank's piece ``local`` of ``like``."""
    rows = _local_rows(like, local)
    if rows is None:
        local_shape, offset = local_shape_and_offset(like)
        return tuple(offset), tuple(local_shape)
    return (rows[0],) + (0,) * (local.dim() - 1), tuple(local.shape)


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
    where = [(mesh.mesh == rank).nonzero() for rank in dist.get_process_group_ranks(group)]
    return None if any(len(found) == 0 for found in where) else tuple(int(found[0][shard_dim]) for found in where)


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
                 keep: bool = True, buffer: CollectiveBuffer | None = None) -> list[torch.Tensor]:
    """The unsharded values of ``values`` (one unit's: one device) as new memory each, on ``device``
    (default: where their local shards are); ``keep`` and ``buffer`` as in ``gather_full_tensors``."""
    if not values:
        return []
    # The group's own device ("cuda:N", not "cuda"), so that a reused buffer is found equal.
    mesh_device = communication_device(values[0].device_mesh.get_group(0))
    out_device = torch.device(device) if device is not None else local_tensor(values[0]).device
    return gather_full_tensors(values, mesh_device, out_device=out_device, keep=keep, buffer=buffer)


def local_copy(value: DTensor, device: torch.device | str | None = None, like: Any = None) -> DTensor:
    """``value`` with its local shard copied (optionally to ``device``); same layout, over ``like``'s mesh
    (its parameter's) where that is an equal mesh of another group: a DTensor op (the optimizer's
    ``zeros_like``) takes its output mesh from DTensor's cache, keyed by meshes that compare by ranks."""
    mesh = like.device_mesh if isinstance(like, DTensor) else value.device_mesh
    if mesh is not value.device_mesh and mesh == value.device_mesh:
        return DTensor.from_local(copy_to(value.to_local(), device), mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    return dtensor_like(copy_to(value.to_local(), device), value)


def shard_like(full: torch.Tensor, like: DTensor, *, copy: bool = True) -> DTensor:
    """This rank's part of ``full`` (held by every rank) laid out as ``like``, as new memory (``copy=False``:
    a view of ``full`` where it can be one, for a caller that copies it into place); no communication."""
    return dtensor_like(local_piece(full, like, copy=copy), like)


def local_piece(full: torch.Tensor, like: DTensor, *, copy: bool = True) -> torch.Tensor:
    """:func:`shard_like`'s local tensor alone (a plain copy of this rank's piece, or a view: ``copy``)."""
    local = local_tensor(like)
    rows = _local_rows(like, local)
    if rows is not None:  # the engine's layout: a run of rows (the common case, kept cheap)
        piece = full[rows[0]:rows[0] + rows[1]]
    else:
        piece = full[tuple(slice(begin, begin + size) for begin, size in zip(*_local_box(like, local)))]
    return piece.to(local.device, copy=copy, memory_format=torch.contiguous_format)


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
    pieces, sending = None, CollectiveBuffer()
    if fulls is not None:
        pieces = list(sending.take(group.size() * sum(slots), dtype, device).split(sum(slots)))
        for rank, piece in enumerate(pieces):
            for full, ranks, slot in zip(fulls, rows, piece.split(slots)):
                start, count = ranks[rank]
                _first_rows(slot, count, full.shape).copy_(full[start:start + count])
    received = torch.empty(sum(slots), dtype=dtype, device=device)
    dist.scatter(received, pieces, group_src=0, group=group)
    sending.release()
    me = dist.get_rank(group)
    return [dtensor_like(_first_rows(slot, ranks[me][1], like.shape).to(local_tensor(like).device), like)
            for like, ranks, slot in zip(likes, rows, received.split(slots))]


def _first_rows(flat: torch.Tensor, count: int, shape: torch.Size) -> torch.Tensor:
    """The start of ``flat`` as ``count`` rows of a tensor of ``shape``."""
    return flat[:count * math.prod(shape[1:])].view(count, *shape[1:])


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor left out of an object rank 0 broadcasts; :func:`broadcast_tensor` sends its values."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)


def broadcast_tensor(value: torch.Tensor | TensorSpec, group: Any, device: torch.device) -> torch.Tensor:
    """Rank 0's tensor (``value`` there, in any layout; its :class:`TensorSpec` elsewhere) in full on
    every rank of ``group`` (``None``: the default group), as new memory on ``device``."""
    tensor = (torch.empty(value.shape, dtype=value.dtype, device=device) if isinstance(value, TensorSpec)
              else to_full(value).detach().to(device, copy=True))
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
    mine = {tuple(shard.metadata.shard_offsets): shard.tensor
            for shard in value.local_shards()}  # type: ignore[attr-defined]
    full = torch.empty(tuple(metadata.size), dtype=dtype, device=device)
    for shard in metadata.shards_metadata:
        if 0 in shard.shard_sizes:
            continue
        offsets = tuple(shard.shard_offsets)
        owner = shard.placement.rank()  # a global rank (of the ShardedTensor's group)
        buffer = (mine[offsets].to(device, copy=True) if owner == dist.get_rank()
                  else torch.empty(shard.shard_sizes, dtype=dtype, device=device))
        dist.broadcast(buffer, src=owner, group=group)
        full[tuple(slice(start, start + size) for start, size in zip(offsets, shard.shard_sizes))] = buffer
    return full


def converts_locally(value: Any, like: torch.Tensor | None) -> bool:
    """Whether :func:`to_layout_of` (``like`` a tensor) or :func:`to_full` (``like`` ``None``) turns ``value``
    into its target without communication: a plain tensor, or a DTensor / ``ShardedTensor`` already cut as
    ``like`` (decided from global metadata: alike on every rank)."""
    if not (isinstance(value, DTensor) or is_sharded_tensor(value)):
        return True
    if not isinstance(like, DTensor):
        return False
    if is_sharded_tensor(value):
        return _sharded_tensor_piece(value, like) is not None
    return (value.shape, value.device_mesh, tuple(value.placements)) == (
        like.shape, like.device_mesh, tuple(like.placements))


def to_layout_of(value: torch.Tensor, like: torch.Tensor, *, copy: bool = True) -> torch.Tensor:
    """``value`` (any layout, global shape of ``like``) in ``like``'s layout, on its device; without
    communication when ``value`` is a DTensor or ``ShardedTensor`` sharded exactly as ``like`` (a
    decision every rank makes alike). ``copy=False`` may return views of ``value``'s memory (for a
    load, which copies them)."""
    if not isinstance(like, DTensor):
        return to_full(value).detach().to(like.device, copy=copy)
    if is_sharded_tensor(value) and (piece := _sharded_tensor_piece(value, like)) is not None:
        return dtensor_like(piece.detach().to(local_tensor(like).device, copy=copy), like)
    layout = (like.shape, like.device_mesh, tuple(like.placements))
    if not (isinstance(value, DTensor) and (value.shape, value.device_mesh, tuple(value.placements)) == layout):
        return shard_like(to_full(value), like, copy=copy)  # ``copy=False``: a view of the full tensor
    # ``value`` lends its spec (its dtype: the cheap construction, see dtensor_like).
    return dtensor_like(value.to_local().detach().to(local_tensor(like).device, copy=copy), value)
