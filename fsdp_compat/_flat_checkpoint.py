"""torch FSDP1's LOCAL_STATE_DICT format (one flat parameter per unit): written, and read per parameter.

FSDP1's LOCAL state dict holds, per unit with parameters, a ``ShardedTensor`` keyed
``<unit path>._flat_param`` with this rank's slice of the unit's 1-D ``FlatParameter``. The engine
has none, so the layout is rebuilt from the module by the rules of FSDP1's ``_flat_param.py``:

* Order: the unit's parameters in a pre-order walk of its modules, each at its first registration
  (a tied weight is flattened once). Parameters of nested units and ignored ones are not in it.
* ``use_orig_params=True`` pads before each parameter up to a multiple of 16 bytes of the unit's
  compute dtype (``MixedPrecision.param_dtype``, else the parameter's), then pads the total to a
  multiple of the world size. ``use_orig_params=False`` pads neither.
* Rank ``r`` of the unit's (shard) group owns elements ``[r*c, (r+1)*c)`` of the total ``N``,
  ``c = ceil(N / world size)``; the ``ShardedTensor`` has global size ``N`` and holds the owned
  elements below ``N`` (no local shard when there are none).
* ``NO_SHARD`` units have no flat parameter in FSDP1's LOCAL state dicts (FSDP1 gives FULL ones).
* ``use_orig_params=True`` also saves each parameter's part of this rank's slice under its name:
  views of the same elements; the flat parameter is read instead.

The padding is read off the checkpoint's size: this wrapper's own settings first, then the other
``use_orig_params`` and compute dtypes (users moving off FSDP1 often change them). A size matching
none means another world size or wrapping, which no local reading can fix.

fsdp_compat's own LOCAL state dicts are written in this format too (:func:`local_flat_params`), so that
FSDP1 resumes them. The engine shards each parameter on its own, so this rank's FSDP1 slice holds
elements of other ranks: writing costs one all-gather per unit, reading one as well.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _engine
from ._collectives import communication_device, ranks_where
from ._engine import local_tensor, new_sharded_tensor
from ._state_dict_entries import Entry
from ._tensor_layout import CollectiveBuffer, gather_full_tensors, shard_like
from ._unit_state import UnitState, units_with_paths
from .api import ShardingStrategy

FLAT_PARAM = "_flat_param"
_ALIGNMENT_BYTES = 16  # FSDP1's address alignment under use_orig_params=True (for TorchInductor)
_PADDING_VALUE = 42  # what FSDP1 fills padding with when it flattens (never read; kept by training without decay)


@dataclasses.dataclass
class _FlatUnit:
    """One unit's flat parameter in a checkpoint, and where its parameters lie in it."""

    unit: UnitState
    params: list[DTensor]  # the engine's sharded parameters, in FSDP1's order
    offsets: list[int]  # each one's first element in the flat parameter
    value: Any  # the checkpoint's ShardedTensor


def flat_unit_paths(state_dict: Mapping[str, Any]) -> dict[str, str]:
    """The FSDP1 flat parameters in ``state_dict``: key -> the unit's module path."""
    return {key: key[:-len(FLAT_PARAM)].rstrip(".") for key in state_dict
            if key == FLAT_PARAM or key.endswith("." + FLAT_PARAM)}


def unflatten_if_flat(root: UnitState, state_dict: Mapping[str, Any], entries: list[Entry]) -> Mapping[str, Any]:
    """``state_dict`` with FSDP1's flat parameters, if any rank's has some, replaced by per-parameter
    DTensors laid out as the engine's; if they do not fit this model on some rank, ``ValueError`` on
    all of them, nothing loaded. Collectives over the root's mesh."""
    groups = root.device_mesh.get_all_groups()
    if not ranks_where(bool(flat_unit_paths(state_dict)), groups):
        return state_dict
    units, errors = _plan(root, state_dict)
    failed = ranks_where(bool(errors), groups)
    if failed:
        raise ValueError(_misfit_message(errors, failed))
    return _unflatten(units, state_dict, entries)


def _plan(root: UnitState, state_dict: Mapping[str, Any]) -> tuple[list[_FlatUnit], list[str]]:
    """Each sharded unit's flat parameter matched to FSDP1's layout at this world size; the misfits. No collective."""
    units: list[_FlatUnit] = []
    errors: list[str] = []
    unmatched = flat_unit_paths(state_dict)
    for path, unit in units_with_paths(root.wrapper):
        slots = _engine.unit_param_slots(unit.module)
        if not slots or unit.sharding_strategy == ShardingStrategy.NO_SHARD:
            continue  # NO_SHARD: FSDP1 saved the parameters one by one, in full (the usual path)
        key = f"{path}.{FLAT_PARAM}" if path else FLAT_PARAM
        if unmatched.pop(key, None) is None:
            errors.append(f"{_unit_name(path)} holds parameters here, but the checkpoint has "
                          f"no flat parameter {key!r} for it")
            continue
        matched = _match(unit, _in_fsdp1_order(unit, slots), path, key, state_dict[key])
        if isinstance(matched, str):
            errors.append(matched)
        else:
            units.append(matched)
    errors += [f"the checkpoint has a flat parameter {key!r}, but there is no sharded "
               f"{_unit_name(path)} with parameters here" for key, path in unmatched.items()]
    return units, errors


def _misfit_message(errors: list[str], failed_ranks: list[int]) -> str:
    """The ``ValueError`` message for a checkpoint that does not fit (``errors``: this rank's)."""
    if not errors:
        return ("Cannot load this FSDP1 LOCAL_STATE_DICT checkpoint: it does not match this model "
                f"on rank(s) {failed_ranks} (see the error raised there). Nothing was loaded on any rank.")
    return ("Cannot load this FSDP1 LOCAL_STATE_DICT checkpoint: its flat parameters do not match "
            "this model's units, so it was written with another world size or wrapping "
            "(auto_wrap_policy, ignored modules, sharding strategy):\n\t- " + "\n\t- ".join(errors)
            + "\nLoad it with the world size and wrapping it was written with, save it as FULL_STATE_DICT "
            "or SHARDED_STATE_DICT (which load at any world size) and load that; `python -m fsdp_compat.convert` "
            "does this without FSDP1. Nothing was loaded on any rank.")


def _unit_name(path: str) -> str:
    return f"unit {path!r}" if path else "the root unit"


def _match(unit: UnitState, params: list[DTensor], path: str, key: str, value: Any) -> _FlatUnit | str:
    """The unit's layout that the checkpoint's flat parameter has, or why none fits."""
    if not (hasattr(value, "local_shards") and hasattr(value, "metadata")):  # ShardedTensor's API
        return (f"{key!r} is a {type(value).__name__}; FSDP1's LOCAL_STATE_DICT holds a "
                "ShardedTensor there (each rank's file, loaded with torch.load)")
    total = int(math.prod(value.metadata().size))
    layouts = [_layout([param.numel() for param in params], alignment, unit.world_size)
               for alignment in _alignments(unit, params)]
    offsets = next((offsets for offsets, layout_total in layouts if layout_total == total), None)
    # Described against the layout found, else that of the wrapper's own setting (the first).
    ours = total if offsets is not None else layouts[0][1]
    written_shard = max((int(math.prod(s.shard_sizes)) for s in value.metadata().shards_metadata), default=0)
    mismatch = (f"{_unit_name(path)} ({key!r}): the checkpoint's flat size is {total} in shards of "
                f"{written_shard}; this model's unit lays out {ours} in shards of "
                f"{math.ceil(ours / unit.world_size)} at world size {unit.world_size}")
    if offsets is None:
        return mismatch
    shard_numel = math.ceil(total / unit.world_size)
    start = unit.rank * shard_numel  # this rank's slice is FSDP1's [start, start + valid)
    valid = max(0, min(shard_numel, total - start))
    expected = [([start], valid)] if valid else []
    found = [(list(s.metadata.shard_offsets), s.tensor.numel()) for s in value.local_shards() if s.tensor.numel()]
    if found != expected:
        return (f"{mismatch}; this rank (rank {unit.rank} of the unit's group) holds shards (offset, "
                f"elements) {found} instead of {expected}")
    return _FlatUnit(unit, params, offsets, value)


def _in_fsdp1_order(unit: UnitState, slots: list[tuple[DTensor, list[_engine.ParamSlot]]]) -> list[DTensor]:
    """The unit's sharded parameters in FSDP1's flattening order: pre-order over its modules, each at its first slot."""
    by_slot = {(id(module), name): sharded for sharded, owners in slots for module, name in owners}
    walk = [by_slot.get((id(module), name)) for module in unit.module.modules()
            for name, _ in module.named_parameters(recurse=False, remove_duplicate=False)]
    return list({id(sharded): sharded for sharded in walk if sharded is not None}.values())


def _alignments(unit: UnitState, params: list[DTensor]) -> list[int]:
    """Candidate alignment paddings (elements; 0: none), this wrapper's own setting first."""
    compute_dtype = getattr(unit.mixed_precision, "param_dtype", None) or params[0].dtype
    aligned = [_ALIGNMENT_BYTES // size for size in (compute_dtype.itemsize, 2, 4, 1, 8)]
    candidates = [aligned[0], 0] if unit.use_orig_params else [0, aligned[0]]
    return list(dict.fromkeys(candidates + aligned[1:]))


def _layout(sizes: list[int], alignment: int, world_size: int) -> tuple[list[int], int]:
    """Each parameter's offset and the total, as FSDP1 flattens (``alignment`` 0: no padding)."""
    offsets, total = [], 0
    for size in sizes:
        if alignment:
            total += -total % alignment
        offsets.append(total)
        total += size
    if alignment:
        total += -total % world_size
    return offsets, total


@torch.no_grad()
def _unflatten(units: list[_FlatUnit], state_dict: Mapping[str, Any], entries: list[Entry]) -> dict[str, Any]:
    """``state_dict`` with each flat parameter replaced by its parameters as the engine's DTensors, under every
    key naming one (tied weights too). One gather of the whole flat parameter per unit, over its shard group:
    this rank's slice is its ``torch.chunk`` piece (``_match`` checked), the engine's layout."""
    values: dict[int, DTensor] = {}
    for flat_unit in units:
        like, metadata = flat_unit.params[0], flat_unit.value.metadata()  # laid out as its parameters
        device = communication_device(flat_unit.unit.process_group)
        pieces = [shard.tensor.reshape(-1) for shard in flat_unit.value.local_shards() if shard.tensor.numel()]
        local = pieces[0].to(device) if pieces else torch.empty(0, dtype=metadata.tensor_properties.dtype,
                                                                 device=device)
        flat = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=torch.Size(metadata.size), stride=(1,))
        full = gather_full_tensors([flat], device)[0]
        for param, offset in zip(flat_unit.params, flat_unit.offsets):
            values[id(param)] = shard_like(full[offset:offset + param.numel()].view(param.shape), param)
    flat_keys = flat_unit_paths(state_dict)  # each matched to a unit, else _plan found an error
    result = {key: value for key, value in state_dict.items() if key not in flat_keys}
    result.update((entry.key, values[id(entry.sharded)]) for entry in entries if id(entry.sharded) in values)
    return result


@dataclasses.dataclass
class LocalFlatParam:
    """One unit's part of an FSDP1 LOCAL state dict as this rank writes it."""

    path: str  # the unit's clean module path ("": the root)
    key: str  # ``<path>._flat_param``
    value: Any  # this rank's slice of the flat parameter, as FSDP1's ShardedTensor
    views: dict[int, torch.Tensor]  # id(sharded parameter) -> its elements in the slice (use_orig_params=True)
    use_orig_params: bool

    def holds(self, key: str) -> bool:
        """Whether the state-dict ``key`` lies in this unit's module tree."""
        return not self.path or key.startswith(self.path + ".")


@torch.no_grad()
def local_flat_params(root: UnitState, entries: list[Entry], offload_to_cpu: bool) -> list[LocalFlatParam]:
    """FSDP1's LOCAL flat parameter of every sharded unit with parameters under ``root``, pre-order: a
    ``ShardedTensor`` of global size FSDP1's flat size (``_layout``), holding this rank's ``torch.chunk``
    slice of it (none if empty), with FSDP1's metadata; padding as FSDP1 flattens it. One all-gather of the unit's
    parameters per unit (over its shard group), one unit's full parameters held at a time. Inside
    ``summon_full_params`` the values shown (edits included) are written where this rank shows them."""
    shown = {id(entry.sharded): entry.value for entry in entries if entry.full_visible}
    result = []
    buffer = CollectiveBuffer()
    for path, unit in units_with_paths(root.wrapper):
        slots = _engine.unit_param_slots(unit.module)
        if not slots or unit.sharding_strategy == ShardingStrategy.NO_SHARD:
            continue  # FSDP1 gives NO_SHARD units' states as FULL ones
        params = _in_fsdp1_order(unit, slots)
        offsets, total = _layout([param.numel() for param in params], _alignments(unit, params)[0],
                                 unit.world_size)
        shard_numel = math.ceil(total / unit.world_size)
        start = unit.rank * shard_numel
        out_device = torch.device("cpu") if offload_to_cpu else local_tensor(params[0]).device
        # Gathered on every rank alike (the shown values may be on some ranks only: rank0_only).
        fulls = gather_full_tensors(params, communication_device(unit.process_group), out_device=out_device,
                                    buffer=buffer)
        local = torch.full((max(0, min(shard_numel, total - start)),), _PADDING_VALUE, dtype=params[0].dtype,
                           device=out_device)
        views = {}
        for param, offset, full in zip(params, offsets, fulls):
            full = shown.get(id(param), full)
            begin, end = max(offset, start), min(offset + param.numel(), start + local.numel())
            if begin < end:
                local[begin - start:end - start].copy_(full.reshape(-1)[begin - offset:end - offset])
            views[id(param)] = local[begin - start:max(begin, end) - start]
        del fulls
        key = f"{path}.{FLAT_PARAM}" if path else FLAT_PARAM
        result.append(LocalFlatParam(path, key, _flat_sharded_tensor(unit, local, total, shard_numel), views,
                                     unit.use_orig_params))
    buffer.release()
    return result


def _flat_sharded_tensor(unit: UnitState, local: torch.Tensor, total: int, shard_numel: int) -> Any:
    """FSDP1's ``ShardedTensor`` of the flat parameter: every rank of the unit's group with elements holds
    ``[r * shard_numel, ...)`` of ``total`` (placements by global rank, as FSDP1's on its group). Its local
    shard requires grad, as FSDP1's (a slice of the parameter); the per-parameter views do not (FSDP1's are
    detached by ``nn.Module.state_dict``), so they are taken of ``local``, which shares the memory."""
    local = local.detach().requires_grad_(True)
    ranks = dist.get_process_group_ranks(unit.process_group)
    pieces: list[tuple[tuple[int, ...], tuple[int, ...], int]] = [
        ((r * shard_numel,), (min(shard_numel, total - r * shard_numel),), ranks[r])
        for r in range(unit.world_size) if r * shard_numel < total]
    return new_sharded_tensor(local, torch.Size([total]), pieces, unit.process_group, requires_grad=True)
