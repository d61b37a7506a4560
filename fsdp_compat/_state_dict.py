"""Model state dicts: FSDP1's three types (FULL / LOCAL / SHARDED) on engine-sharded parameters.

Keys are FSDP1's: clean FQNs (no ``_fsdp_wrapped_module.``), in ``nn.Module.state_dict()`` order of
the unwrapped model, buffers and ignored modules' states included, a tied weight under each name.
Parameter values are copies, never views of engine or module memory, so that filling a returned dict
(``torch.distributed.checkpoint.load``) cannot half-change the model's parameters; the one exception
is FSDP1's: an ignored parameter is given as itself (detached, same storage), so loading into the dict
in place changes that parameter. Buffers are given as FSDP1 gives them, for every type: the buffer itself
(detached; the tensor under ``keep_vars``), so loading into the dict in place changes the buffers, as
with FSDP1; the exception, also FSDP1's, is FULL and SHARDED under ``buffer_dtype``: every buffer of such
a unit (ignored modules', nested units' included, excepted) is a copy in its original dtype.
``offload_to_cpu`` copies only what is not already on the CPU.

* FULL: plain full tensors (each unit gathered in one collective, in full precision).
  ``rank0_only``: other ranks get only ignored modules' parameters (as FSDP1).
* SHARDED: engine-sharded parameters as FSDP1's ``ShardedTensor`` (``DTensor`` under
  ``ShardedStateDictConfig(_use_dtensor=True)`` or for a unit built with a device mesh, as FSDP1),
  buffers as plain tensors. Either is what ``torch.distributed.checkpoint`` reshards across world sizes.
* LOCAL: FSDP1's format, so that FSDP1 resumes it (``_flat_checkpoint``): per sharded unit, this rank's
  slice of the unit's flat parameter as a ``ShardedTensor`` (which carries its sharding: a plain per-rank
  tensor would be taken as replicated by ``torch.distributed.checkpoint`` and saved once, half the data
  lost), with ``use_orig_params=True`` also each parameter's part of it; buffers as plain tensors. One
  all-gather per unit: the engine's layout is not FSDP1's.
* ``NO_SHARD`` units give full tensors for every type, as FSDP1.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import _flat_checkpoint, _mixed_precision
from ._common import clean_module_path
from ._state_dict_entries import (Entry, check_not_in_iteration, collecting, effective_settings, entries_of,
                                  entry_settings)
from ._state_dict_load import load_state_dict
from ._tensor_layout import CollectiveBuffer, as_sharded_tensor, gather_full_tensors, local_copy, shard_like
from ._unit_state import UnitState, units_in
from .api import (FullOptimStateDictConfig, FullStateDictConfig, LocalOptimStateDictConfig, LocalStateDictConfig,
                  OptimStateDictConfig, ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictConfig,
                  StateDictSettings, StateDictType, coerce_config, coerce_enum)

__all__ = ["collecting_entries", "get_state_dict_type", "load_state_dict", "restore_state_dict_type",
           "set_state_dict_type_on", "state_dict"]

_CONFIG_CLASSES: dict[StateDictType, tuple[type, type]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


def set_state_dict_type_on(units: list[UnitState], state_dict_type: Any, state_dict_config: Any = None,
                           optim_state_dict_config: Any = None) -> StateDictSettings:
    """``FullyShardedDataParallel.set_state_dict_type`` on ``units`` (the ``state_dict_type`` context
    restores the same ones: one walk of the model instead of two per checkpoint call)."""
    if state_dict_type is None and not units:
        return StateDictSettings(None, None, None)  # type: ignore[arg-type]
    # No collective, as FSDP1's: code enters it rank by rank (a LOCAL load one rank at a time). Bad
    # arguments raise on the ranks given them, before any wrapper changes there.
    state_dict_type = coerce_enum(state_dict_type, StateDictType, "state_dict_type")
    config_class, optim_config_class = _CONFIG_CLASSES[state_dict_type]
    state_dict_config = _exact_config(state_dict_config, StateDictConfig, config_class, "state_dict_config")
    optim_state_dict_config = _exact_config(optim_state_dict_config, OptimStateDictConfig,
                                            optim_config_class, "optim_state_dict_config")
    previous = _previous_settings(units)
    restore_state_dict_type(units, StateDictSettings(state_dict_type, state_dict_config, optim_state_dict_config))
    return previous


def restore_state_dict_type(units: list[UnitState], settings: StateDictSettings) -> None:
    """Put ``settings`` on ``units``, no collective: a rank leaving the context by an exception waits for none."""
    if settings.state_dict_type is None:
        return
    for unit in units:
        unit.state_dict_type = settings.state_dict_type
        unit.state_dict_config = settings.state_dict_config
        unit.optim_state_dict_config = settings.optim_state_dict_config


def _exact_config(config: Any, base: type, expected: type, argument: str) -> Any:
    """``config`` as ours (torch's accepted), ``expected()`` for ``None``; FSDP1's ``RuntimeError`` if not that."""
    if config is None:
        return expected()
    try:
        coerced: Any = coerce_config(config, base, argument)
    except TypeError as error:
        raise RuntimeError(str(error)) from None
    if type(coerced) is not expected:
        raise RuntimeError(f"Expected {argument} of type {expected.__name__} but got "
                           f"{type(config).__name__}; pass a {expected.__name__} for this state_dict_type")
    return coerced


def _previous_settings(units: list[UnitState]) -> StateDictSettings:
    """The first wrapper's settings; FSDP1 checks the others agree in type and config classes."""
    if not units:
        return StateDictSettings(None, None, None)  # type: ignore[arg-type]
    first = units[0]
    for other in units[1:]:
        if other.state_dict_type != first.state_dict_type:
            raise AssertionError("All FSDP modules should have the same state_dict_type.")
        for config in ("state_dict_config", "optim_state_dict_config"):
            if not isinstance(getattr(other, config), type(getattr(first, config))):
                raise AssertionError(f"All FSDP modules must have the same type of {config}.")
    return StateDictSettings(first.state_dict_type, first.state_dict_config, first.optim_state_dict_config)


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings shared by every wrapper in ``module`` (``None`` without wrappers, as FSDP1);
    ``AssertionError`` if they differ."""
    settings = None
    for unit in units_in(module):
        # A tuple compares its items by identity first: units set together compare cheaply.
        current = (unit.state_dict_type, unit.state_dict_config, unit.optim_state_dict_config)
        if settings is None:
            settings = current
        elif current != settings:
            raise AssertionError(f"All FSDP modules must have the same state dict settings. "
                                 f"Got {StateDictSettings(*current)} and {StateDictSettings(*settings)}.")
    return StateDictSettings(*settings) if settings is not None else None  # type: ignore[return-value]


def collecting_entries() -> bool:
    """Whether a wrapper's ``state_dict()`` runs inside an enclosing wrapper's walk over its module tree
    (:func:`state_dict` then hands back ``nn.Module``'s raw states for the enclosing call to convert)."""
    return collecting.get()


def state_dict(root: UnitState, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False,
               unit_paths: list[tuple[str, UnitState]] | None = None) -> dict[str, Any]:
    """The state dict of the wrapper in its state-dict type (see the module docstring). ``unit_paths``:
    :func:`units_with_paths` of the wrapper, where the caller walked its tree already."""
    if collecting.get():
        return nn.Module.state_dict(root.wrapper, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)
    if args:  # nn.Module.state_dict's deprecated positional form (destination, prefix, keep_vars)
        if len(args) > 3:
            raise TypeError(f"state_dict() takes at most 3 positional arguments, got {len(args)}")
        warnings.warn("Positional args are being deprecated, use kwargs instead. Refer to "
                      "https://pytorch.org/docs/main/generated/torch.nn.Module.html"
                      "#torch.nn.Module.state_dict for details.", FutureWarning, stacklevel=2)
        given: tuple[Any, ...] = (*args, *(destination, prefix, keep_vars)[len(args):])
        destination, prefix, keep_vars = given
    check_not_in_iteration(root, "state_dict()")
    requested, config = effective_settings(root)
    entries, metadata = entries_of(root, None if unit_paths is None else [unit for _, unit in unit_paths])
    plans = [(entry, *entry_settings(entry, requested, config)) for entry in entries]
    full = _gather_full_parameters(plans, root.rank)
    restore_dtypes = _mixed_precision.original_buffer_dtypes(root.wrapper, unit_paths)

    if destination is None:
        destination = OrderedDict()
        destination._metadata = OrderedDict()
    if hasattr(destination, "_metadata"):
        # The wrapped module's version follows (and wins over) its wrapper's, as both map to one path.
        for path, module_metadata in metadata.items():
            path = clean_module_path(path)
            destination._metadata[(prefix + path) if path else prefix[:-1]] = module_metadata
    # LOCAL: FSDP1's format, one flat parameter per sharded unit (``_flat_checkpoint``), so that FSDP1
    # resumes it; a collective, as FSDP1's LOCAL state_dict() is (its ShardedTensors gather metadata).
    flat = (_flat_checkpoint.local_flat_params(root, entries, config.offload_to_cpu)
            if requested == StateDictType.LOCAL_STATE_DICT else [])
    flat_of = {param: unit for unit in flat for param in unit.views}
    for item in _in_fsdp1_local_order(plans, flat):
        if isinstance(item, _flat_checkpoint.LocalFlatParam):
            destination[prefix + item.key] = item.value
            continue
        entry, entry_type, entry_config = item
        if entry.sharded is not None and id(entry.sharded) in flat_of:
            flat_unit = flat_of[id(entry.sharded)]
            if flat_unit.use_orig_params:
                # FSDP1 keeps each parameter's part of the slice: a plain view (with ``keep_vars``, the
                # parameter itself, requiring grad as it does).
                view = flat_unit.views[id(entry.sharded)]
                if keep_vars:
                    view.requires_grad_(entry.sharded.requires_grad)
                destination[prefix + entry.key] = view
            continue
        if _only_rank0_keeps(entry_config, root.rank) and not entry.is_plain_param:
            continue  # FSDP1: under rank0_only, other ranks keep only ignored parameters
        value = _entry_value(entry, entry_type, full, restore_dtypes, keep_vars)
        if value is None:
            continue
        if entry_config.offload_to_cpu and isinstance(value, torch.Tensor):
            value = value.cpu()
        if isinstance(value, DTensor) and not _gives_dtensor(entry, entry_type, entry_config):
            value = as_sharded_tensor(value)
        destination[prefix + entry.key] = value
    return destination


def _in_fsdp1_local_order(plans: list[tuple[Entry, StateDictType, StateDictConfig]],
                          flat: list[_flat_checkpoint.LocalFlatParam]) -> Iterator[Any]:
    """``plans`` with each unit's flat parameter where FSDP1's LOCAL state dict has it: with
    ``use_orig_params=False`` it is the unit module's only parameter, first in the unit's tree; with
    ``True`` FSDP1's hook adds it once the unit's tree is written (inner units first)."""
    pending = list(flat)  # pre-order
    for index, plan in enumerate(plans):
        key = plan[0].key
        for unit in [unit for unit in pending if not unit.use_orig_params and unit.holds(key)]:
            pending.remove(unit)
            yield unit
        yield plan
        following = plans[index + 1][0].key if index + 1 < len(plans) else None
        for unit in [unit for unit in reversed(pending) if unit.use_orig_params and unit.holds(key)
                     and (following is None or not unit.holds(following))]:
            pending.remove(unit)
            yield unit
    yield from reversed(pending)  # none: every unit with parameters has entries


def _gives_dtensor(entry: Entry, state_dict_type: StateDictType, config: StateDictConfig) -> bool:
    """FSDP1's rule for a sharded parameter's type: ``DTensor`` under SHARDED when asked for
    (``ShardedStateDictConfig(_use_dtensor=True)``) or when the unit was built with a device mesh;
    otherwise (LOCAL too) ``ShardedTensor``."""
    return state_dict_type == StateDictType.SHARDED_STATE_DICT and (
        getattr(config, "_use_dtensor", False) or entry.unit.device_mesh_given)


def _only_rank0_keeps(config: StateDictConfig, rank: int) -> bool:  # other ranks keep nothing
    return getattr(config, "rank0_only", False) and rank != 0


def _gather_full_parameters(plans: list[tuple[Entry, StateDictType, StateDictConfig]],
                            rank: int) -> dict[int, torch.Tensor]:
    """id(sharded parameter) -> full copy for FULL entries, one collective per unit, each offloaded or
    dropped (``rank0_only``) before the next: one unit's full parameters on the device at a time.
    Summoned units are skipped: their full values are on the modules (under ``rank0_only``, on some
    ranks only: no collective could match)."""
    by_unit: dict[int, tuple[UnitState, StateDictConfig, dict[int, DTensor]]] = {}
    for entry, entry_type, config in plans:
        if entry_type != StateDictType.FULL_STATE_DICT or entry.sharded is None or entry.summoned:
            continue
        _, _, tensors = by_unit.setdefault(id(entry.unit), (entry.unit, config, {}))
        tensors.setdefault(id(entry.sharded), entry.sharded)
    full: dict[int, torch.Tensor] = {}
    buffer = CollectiveBuffer()  # one for all units: a fresh one each costs as much as the copy
    for unit, config, tensors in by_unit.values():
        gathered = gather_full_tensors(list(tensors.values()), unit.compute_device,
                                       out_device=torch.device("cpu") if config.offload_to_cpu else None,
                                       keep=not _only_rank0_keeps(config, rank), buffer=buffer)
        full.update(zip(tensors.keys(), gathered))
    buffer.release()
    return full


def _entry_value(entry: Entry, state_dict_type: StateDictType, full: dict[int, torch.Tensor],
                 restore_dtypes: dict[str, torch.dtype], keep_vars: bool) -> Any:
    """The entry's value for the type; ``None`` to leave it out (summoned shards, see FULL). Every branch
    but the sharded one copies only detached tensors or none; that one alone switches autograd off (a
    switch per entry, 2 µs each, was what a world-size-1 FULL state dict spent above FSDP1's)."""
    sharded = entry.sharded
    if sharded is None:
        if not isinstance(entry.value, torch.Tensor):
            return entry.value  # extra state
        if entry.is_plain_param:  # FSDP1 hands out an ignored parameter itself (detached), never a copy
            return entry.value if keep_vars else entry.value.detach()
        if state_dict_type != StateDictType.LOCAL_STATE_DICT and entry.key in restore_dtypes:
            # A unit's buffers under ``buffer_dtype`` (any dtype, as FSDP1): copies in their original dtypes.
            return entry.value.detach().to(restore_dtypes[entry.key], copy=True)
        return entry.value if keep_vars else entry.value.detach()  # the buffer itself, as FSDP1
    if state_dict_type == StateDictType.FULL_STATE_DICT:
        if not entry.summoned:
            return full[id(sharded)]
        # Inside summon_full_params: the full values the user sees. Ranks that kept their shards
        # (rank0_only) have no full value to give.
        return entry.value.detach().clone() if entry.full_visible else None
    with torch.no_grad():
        return shard_like(entry.value, sharded) if entry.full_visible else local_copy(sharded)
