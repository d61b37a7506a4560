"""What a wrapper's state dict is made of, for saving and loading alike.

``nn.Module.state_dict`` over the wrapped tree lists the entries (so module hooks, extra state and
key order stay torch's); each is resolved to the module holding it, its innermost wrapper and,
for an engine-managed parameter, the engine's sharded ``DTensor``. Also here: which type and
config apply (the wrapper's, or what ``torch.distributed.checkpoint.state_dict`` asks for).
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections import OrderedDict
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import _engine
from ._common import CHECKPOINT_WRAPPED_MODULE, TrainingState, clean_name, warn_once
from ._unit_state import UnitState, state_of, units_in
from .api import FullStateDictConfig, ShardedStateDictConfig, ShardingStrategy, StateDictConfig, StateDictType


# Set while a wrapper runs ``nn.Module.state_dict`` over its tree: nested wrappers reached by that
# recursion then contribute their raw entries instead of producing a state dict of their own.
collecting: contextvars.ContextVar[bool] = contextvars.ContextVar("fsdp_compat_collecting", default=False)


@dataclasses.dataclass
class Entry:
    key: str  # clean key, relative to the wrapper whose state dict this is
    raw_key: str  # nn.Module's key (wrapper prefixes included), relative likewise
    value: Any  # what the module holds under that key (tensor or extra state)
    unit: UnitState  # of the innermost wrapper holding it
    sharded: DTensor | None = None  # the engine-sharded parameter, for a managed parameter
    summoned: bool = False  # the unit is inside summon_full_params
    is_plain_param: bool = False  # a parameter the engine does not manage (ignored)

    @property
    def full_visible(self) -> bool:
        """A summoned parameter whose full value is what the module shows (edits included)."""
        return self.summoned and self.sharded is not None and not isinstance(self.value, DTensor)


def entries_of(root: UnitState, units: list[UnitState] | None = None) -> tuple[list[Entry], Any]:
    """The wrapper's state entries in ``nn.Module.state_dict`` order, and its ``_metadata``. ``units``: the
    units in the wrapper's tree, where the caller has them (:func:`units_in`)."""
    token = collecting.set(True)
    try:
        raw = nn.Module.state_dict(root.wrapper, keep_vars=True)
    finally:
        collecting.reset(token)
    sharded_by_slot = {(id(module), name): sharded for unit in (units if units is not None else units_in(root.wrapper))
                       for sharded, slots in _engine.unit_param_slots(unit.module) for module, name in slots}
    entries = []
    located: dict[str, tuple[nn.Module | None, UnitState]] = {}  # module path -> its module and unit, walked once
    for raw_key, value in raw.items():
        owner, attr, unit = _locate(root, raw_key, located)
        entry = Entry(clean_name(raw_key), raw_key, value, unit,
                      summoned=unit.training_state == TrainingState.SUMMON_FULL_PARAMS)
        if owner is not None:
            entry.sharded = sharded_by_slot.get((id(owner), attr))
            entry.is_plain_param = entry.sharded is None and attr in _own_names(owner.named_parameters)
        if entry.sharded is not None and isinstance(value, DTensor):
            entry.sharded = value  # the registered parameter wins if the user swapped one in
        entries.append(entry)
    return entries, getattr(raw, "_metadata", OrderedDict())


def _locate(root: UnitState, raw_key: str,
            located: dict[str, tuple[nn.Module | None, UnitState]]) -> tuple[nn.Module | None, str, UnitState]:
    """The module owning ``raw_key``'s tensor, the attribute name, and the innermost unit. ``located``
    remembers each module path's walk for the call's other keys (a module's states share its path)."""
    path, _, attr = raw_key.rpartition(".")
    module, unit = _walk(root, path, located)
    return (None if module is None else _inside_checkpoint_wrappers(module, attr)), attr, unit


def _walk(root: UnitState, path: str,
          located: dict[str, tuple[nn.Module | None, UnitState]]) -> tuple[nn.Module | None, UnitState]:
    """The module at ``path`` (``None``: a key renamed by a module's own state-dict hook) and the
    innermost unit on the way; one step from its parent's walk, which ``located`` keeps."""
    if path in located:
        return located[path]
    if not path:
        found: tuple[nn.Module | None, UnitState] = (root.wrapper, root)
    else:
        parent_path, _, segment = path.rpartition(".")
        parent, unit = _walk(root, parent_path, located)
        child = None if parent is None else _engine.registered_child(
            _inside_checkpoint_wrappers(parent, segment), segment)
        found = (None, unit) if child is None else (child, state_of(child) or unit)
    located[path] = found
    return found


def _inside_checkpoint_wrappers(module: nn.Module, name: str) -> nn.Module:
    """Activation-checkpoint wrappers drop their own name from state-dict keys (a hook of theirs):
    the module that really has ``name`` may be inside them."""
    # Looked for the wrapper first: most modules are none, and their own names are not walked then.
    while (inner := _engine.registered_child(module, CHECKPOINT_WRAPPED_MODULE)) is not None and not (
            _engine.registered_child(module, name) is not None or name in _own_names(module.named_parameters)
            or name in _own_names(module.named_buffers)):
        module = inner
    return module


def _own_names(named_members: Any) -> set[str]:
    """The names of a module's own (not its children's) parameters or buffers, tied ones included."""
    return {name for name, _ in named_members(recurse=False, remove_duplicate=False)}


def check_not_in_iteration(unit: UnitState, what: str) -> None:
    if unit.training_state == TrainingState.FORWARD_BACKWARD or _engine.iteration_in_progress(unit.module):
        raise AssertionError(f"{what} was called while a forward or backward pass is running "
                             "(FSDP1 raises here too); call it between training steps")


def effective_settings(unit: UnitState) -> tuple[StateDictType, StateDictConfig]:
    """The wrapper's type and config, or what ``torch.distributed.checkpoint.state_dict`` asks for: torch
    sets FSDP1 modules' type from a ``get_state_dict`` / ``set_state_dict`` call's options; not knowing our
    class, it has the adapter publish them while it runs the model's ``state_dict`` / ``load_state_dict``."""
    options = _engine.distributed_checkpoint_request()
    if options is None:
        return unit.state_dict_type, unit.state_dict_config
    # The same mapping torch applies to FSDP1 modules in ``_verify_options``.
    if options.full_state_dict:
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig(
            offload_to_cpu=options.cpu_offload, rank0_only=options.cpu_offload)
    return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=options.cpu_offload)


def entry_settings(entry: Entry, requested: StateDictType,
                   config: StateDictConfig) -> tuple[StateDictType, StateDictConfig]:
    """FSDP1 gives a ``NO_SHARD`` unit's states as FULL with the default config, whatever was set."""
    if entry.unit.sharding_strategy != ShardingStrategy.NO_SHARD:
        return requested, config
    if requested != StateDictType.FULL_STATE_DICT:
        warn_once("no_shard_state_dict", "When using NO_SHARD for ShardingStrategy, full_state_dict "
                  "will be returned.")
    return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
