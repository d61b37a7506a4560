"""Loading a model state dict: all of it on every rank, or (raising) nothing anywhere.

Every key, shape and value (tensor-like, castable: one element is trial-copied) is checked, and
the ranks agree on the outcome, before anything is written. Values are then converted to what the
module holds and ``nn.Module.load_state_dict`` copies them, hooks and extra state included.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import _engine, _engine_flat, _flat_checkpoint
from ._collectives import all_ranks_agree
from ._engine import IncompatibleKeys, dtensor_like
from ._common import FSDP_WRAPPED_MODULE, TrainingState, clean_module_path, clean_name
from ._state_dict_entries import Entry, check_not_in_iteration, effective_settings, entries_of
from ._tensor_layout import converts_locally, is_sharded_tensor, to_full, to_layout_of
from ._unit_state import UnitState, state_of, units_in
from .api import ShardingStrategy, StateDictType

# Set while ``load_state_dict`` lets ``nn.Module`` copy into a wrapper: its hooks stand aside.
_loading: contextvars.ContextVar[bool] = contextvars.ContextVar("fsdp_compat_loading", default=False)


def load_state_dict(root: UnitState, state_dict: Mapping[str, Any],
                    strict: bool = True, assign: bool = False) -> IncompatibleKeys:
    """Load ``state_dict`` into the wrapper. Accepted values, whatever the type: plain tensors
    (full ones; this rank's pieces under LOCAL), ``DTensor`` and ``ShardedTensor`` (any layout)."""
    state_dict_type, _ = effective_settings(root)
    # FSDP1 loads a LOCAL state dict without communicating (OLMo-style code loads rank by rank): so do we,
    # where this rank's pieces convert alone; each rank then checks its own input, as FSDP1's.
    local = _loads_locally(root, state_dict, state_dict_type)
    with _agreement(root, local):  # input given on one rank only must not leave the others waiting
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
        check_not_in_iteration(root, "load_state_dict()")
    metadata = getattr(state_dict, "_metadata", None)
    units = units_in(root.wrapper)
    for unit in units:
        # The root keeps full parameters after a no-grad forward: register the shards, so that
        # loading writes them and no stale full copy is used afterwards. Summoned units keep their
        # full parameters: loading writes those, and summon's writeback takes it from there.
        if unit.training_state != TrainingState.SUMMON_FULL_PARAMS:
            cast(_engine.FSDPModule, unit.module).reshard()
    entries, _ = entries_of(root)
    state_dict = _as_given_by_distributed_checkpoint(state_dict, entries)
    if state_dict_type == StateDictType.LOCAL_STATE_DICT and not local:  # local: no flat parameter here
        state_dict = _flat_checkpoint.unflatten_if_flat(root, state_dict, entries)
    incoming = [(entry, _as_tensor_if_tensor_like(state_dict[entry.key]))
                for entry in entries if entry.key in state_dict]
    missing = [entry.key for entry in entries if entry.key not in state_dict]
    expected = {entry.key for entry in entries}
    unexpected = [key for key in state_dict if key not in expected]
    errors = _key_errors(missing, unexpected) if strict else []
    errors += [error for entry, value in incoming for error in _value_errors(entry, value, state_dict_type)]
    with _agreement(root, local):  # no rank copies while another one raises
        if errors:
            raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
                type(root.wrapper).__name__, "\n\t".join(errors)))
    with torch.no_grad():  # collectives run here: every rank has the same keys
        raw = OrderedDict((entry.raw_key, _as_target_form(entry, value, state_dict_type))
                          for entry, value in incoming if not entry.full_visible)
    raw._metadata = _raw_metadata(root.wrapper, metadata)  # type: ignore[attr-defined]
    with _nn_module_loading(units):
        nn.Module.load_state_dict(root.wrapper, raw, strict=False, assign=assign)
    with torch.no_grad():
        for entry, value in incoming:
            if entry.full_visible:  # inside summon_full_params the full parameters are loaded
                entry.value.copy_(to_full(value))  # (FSDP1); summon's writeback shards them
    return IncompatibleKeys(missing, unexpected)


def register_load_hooks(wrapper: nn.Module) -> None:
    """Let a plain module holding the wrapper load it (``DDP(FSDP(model))``), as FSDP1 does."""
    wrapper.register_load_state_dict_pre_hook(_load_inside_plain_module)
    wrapper.register_load_state_dict_post_hook(_forget_wrapped_missing_keys)


def _root_loaded_from_outside(wrapper: nn.Module) -> UnitState | None:
    root = state_of(wrapper)
    return root if root is not None and root.is_root and not _loading.get() else None


def _load_inside_plain_module(wrapper: nn.Module, state_dict: dict[str, Any], prefix: str,
                              local_metadata: Any, strict: bool, missing_keys: list[str],
                              unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """A plain module's ``load_state_dict`` reaches a root wrapper with FSDP1's clean keys: load
    them here and hand nn.Module none. Hooks are not told whether the outer load is strict, so
    missing and unexpected keys go to nn.Module, which raises (if strict) after copying the rest."""
    root = _root_loaded_from_outside(wrapper)
    if root is None:
        return
    ours = {key[len(prefix):]: state_dict.pop(key) for key in list(state_dict) if key.startswith(prefix)}
    with _engine_flat.engine_params(unit.module for unit in units_in(wrapper)):  # plain views: the DTensors
        result = load_state_dict(root, ours, strict=False)
    missing_keys.extend(prefix + key for key in result.missing_keys)
    unexpected_keys.extend(prefix + key for key in result.unexpected_keys)


def _forget_wrapped_missing_keys(wrapper: nn.Module, incompatible_keys: IncompatibleKeys) -> None:
    """Drop the wrapper-prefixed keys nn.Module reports missing: the pre-hook loaded them under clean names."""
    if _root_loaded_from_outside(wrapper) is not None:
        incompatible_keys.missing_keys[:] = [key for key in incompatible_keys.missing_keys
                                             if FSDP_WRAPPED_MODULE not in key.split(".")]


@contextlib.contextmanager
def _nn_module_loading(units: list[UnitState]) -> Iterator[None]:
    """While ``nn.Module`` copies into the wrapper: our load hooks stand aside (``_loading``), and summoned
    units' shards stand in for the full parameters they show (the engine's post-load hooks re-read each
    parameter's registration and expect its shard)."""
    swapped = [(slots, sharded, getattr(*slots[0])) for unit in units
               if unit.training_state == TrainingState.SUMMON_FULL_PARAMS
               for sharded, slots in _engine.unit_param_slots(unit.module) if getattr(*slots[0]) is not sharded]
    for slots, sharded, _ in swapped:
        _engine.register_param(slots, sharded)
    token = _loading.set(True)
    try:
        yield
    finally:
        _loading.reset(token)
        for slots, _, shown in swapped:
            _engine.register_param(slots, shown)


def _as_tensor_if_tensor_like(value: Any) -> Any:
    """A ``__torch_function__`` tensor-like (Lightning's lazily loaded FULL checkpoint tensors) as the
    tensor it stands for, loaded by a torch function as ``nn.Module``'s ``copy_`` would."""
    if isinstance(value, torch.Tensor) or not torch.overrides.is_tensor_like(value):
        return value
    return torch.detach(value)


def _as_given_by_distributed_checkpoint(state_dict: Mapping[str, Any], entries: list[Entry]) -> Mapping[str, Any]:
    """``torch.distributed.checkpoint.set_state_dict`` (``full_state_dict``, ``broadcast_from_rank0``) adds
    the model's own tensors under their wrapper-prefixed ``named_parameters`` names next to the clean keys:
    dropped, as writing a tensor onto itself is a no-op (under ``broadcast_from_rank0`` torch, taking
    our modules for FSDP1's, has already broadcast rank 0's values into them)."""
    if _engine.distributed_checkpoint_request() is None:
        return state_dict
    own = {entry.raw_key: entry.value for entry in entries}
    return {key: value for key, value in state_dict.items()
            if not (key in own and own[key] is value and key != clean_name(key))}


def _key_errors(missing: list[str], unexpected: list[str]) -> list[str]:
    errors = ["{} key(s) in state_dict: {}. ".format(kind, ", ".join(f'"{k}"' for k in keys))
              for kind, keys in (("Missing", missing), ("Unexpected", unexpected)) if keys]
    if any(key.endswith(_flat_checkpoint.FLAT_PARAM) for key in unexpected):
        errors.append("This looks like a LOCAL_STATE_DICT (FSDP1's flat parameters, as torch FSDP1 and fsdp_compat "
                      "write it): load it under StateDictType.LOCAL_STATE_DICT, with the world size and wrapping it "
                      "was written with.")
    return errors


def _value_errors(entry: Entry, value: Any, state_dict_type: StateDictType) -> list[str]:
    """nn.Module's checks (type, shape, the copy itself), done before anything is copied."""
    if not isinstance(entry.value, torch.Tensor):
        return []  # extra state: the module's set_extra_state judges it
    if not torch.overrides.is_tensor_like(value):
        return [f'While copying the parameter named "{entry.key}", expected torch.Tensor or '
                f"Tensor-like object from checkpoint but received {type(value)}"]
    sharded = entry.sharded if not entry.full_visible else None
    target = sharded.to_local() if sharded is not None else entry.value  # what the load writes
    if _is_local_piece(entry, value, state_dict_type):
        shape, described = target.shape, "this rank's LOCAL_STATE_DICT piece of the model has shape"
    else:
        shape, described = (entry.value if sharded is None else sharded).shape, "the shape in current model is"
    if value.shape != shape and not (len(shape) == 0 and value.shape == (1,)):  # nn.Module takes [1] for []
        return [f"size mismatch for {entry.key}: copying a param with shape {value.shape} from "
                f"checkpoint, {described} {shape}."]
    try:  # one element copied the way the load will: catches values that cannot be cast (meta...)
        _trial_copy(value, target)
    except Exception as error:  # noqa: BLE001 - reported as nn.Module reports copy failures
        return [f'While copying the parameter named "{entry.key}", whose dimensions in the model '
                f"are {shape} and whose dimensions in the checkpoint are {value.shape}, an "
                f"exception occurred : {error.args}."]
    return []


def _trial_copy(value: torch.Tensor, target: torch.Tensor) -> None:
    if isinstance(value, DTensor):
        value = value.to_local()
    elif is_sharded_tensor(value):
        shards = value.local_shards()  # type: ignore[attr-defined]
        value = shards[0].tensor if shards else torch.empty(0, dtype=value.dtype)
    source = value if value.numel() else torch.empty(1, dtype=value.dtype, device=value.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. complex -> real: the real copy warns once
        torch.empty(1, dtype=target.dtype, device=target.device).copy_(source.reshape(-1)[:1])


def _agreement(root: UnitState, local: bool = False) -> contextlib.AbstractContextManager[None]:
    """Checks that raise on any rank of the wrapper's mesh raise on all of them (``local``: on this rank alone)."""
    return all_ranks_agree([] if local else root.device_mesh.get_all_groups(), "The state dict",
                           "nothing was loaded on any rank")


def _loads_locally(root: UnitState, state_dict: Any, state_dict_type: StateDictType) -> bool:
    """A LOCAL load in fsdp_compat's earlier per-parameter format, every value of which converts on this rank
    alone: no FSDP1 flat parameter (read by gathering), some parameter of this model under its own name, and
    pieces cut as this model's (a plain piece, or a ShardedTensor / DTensor in its layout). Any other input
    (an empty or foreign dict on one rank) joins the collective load that FSDP1's format, the one written
    now, takes on the other ranks, so that they raise with it rather than wait."""
    if state_dict_type != StateDictType.LOCAL_STATE_DICT or not isinstance(state_dict, Mapping) \
            or _flat_checkpoint.flat_unit_paths(state_dict):
        return False
    entries, _ = entries_of(root)
    return any(entry.sharded is not None and entry.key in state_dict for entry in entries) and all(
        converts_locally(state_dict[entry.key], None if entry.sharded is None or entry.full_visible
                         else entry.sharded)
        for entry in entries if entry.key in state_dict and isinstance(entry.value, torch.Tensor))


def _as_target_form(entry: Entry, value: Any, state_dict_type: StateDictType) -> Any:
    """``value`` as what the module holds: a DTensor laid out as the engine's parameter (this
    rank's piece taken without communication where the layouts allow), else a plain full tensor."""
    if not isinstance(entry.value, torch.Tensor):
        return value
    sharded = entry.sharded
    if sharded is None or entry.full_visible:
        return to_full(value)
    if _is_local_piece(entry, value, state_dict_type):  # a plain piece: earlier fsdp_compat LOCAL dicts
        return dtensor_like(value.to(sharded.to_local().device), sharded)
    return to_layout_of(value, sharded, copy=False)


def _is_local_piece(entry: Entry, value: Any, state_dict_type: StateDictType) -> bool:
    """Whether ``value`` is this rank's piece of a sharded parameter (a plain tensor under LOCAL), not a full one."""
    return (state_dict_type == StateDictType.LOCAL_STATE_DICT and entry.sharded is not None
            and not entry.full_visible and entry.unit.sharding_strategy != ShardingStrategy.NO_SHARD
            and not (isinstance(value, DTensor) or is_sharded_tensor(value)))


def _raw_metadata(wrapper: nn.Module, metadata: Mapping[str, Any] | None) -> OrderedDict[str, Any]:
    """``_metadata`` (module versions) re-keyed from clean module paths to the wrapped tree's."""
    result: OrderedDict[str, Any] = OrderedDict()
    if not metadata:
        return result
    for path, _ in wrapper.named_modules():
        clean = clean_module_path(path)
        if clean in metadata or path in metadata:
            result[path] = metadata[clean if clean in metadata else path]
    return result
