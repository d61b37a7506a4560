"""Optimizer state dicts: FSDP1's whole family, keyed and shaped exactly as FSDP1's.

State is named and cut by the engine's parameters: with its sharded ``DTensor`` parameters the optimizer
holds them and DTensor state; with FSDP1's plain parameters (the default) it holds views or flat parameters
and plain local state, which ``_optim_views`` maps onto the engine's parameters without showing them
(its ``Translation``: no copy on the way out, each piece cut straight into place on the way in). FSDP1's
formats are keyed by clean parameter names: FULL holds each state tensor unsharded (optionally on rank 0
only); SHARDED this rank's shard as FSDP1's ``ShardedTensor`` (``DTensor`` where FSDP1 gives one; loading
takes both). Saving is ``_export``; loading, ``_import``, validates the whole input first, so bad input
raises before anything is touched. Key order, ``param_groups`` and scalar state (Adam's ``step``) follow
FSDP1's output.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from . import _engine, _engine_flat, _optim_views, _orig_params, _state_dict
from ._collectives import all_ranks_agree, broadcast_object, communication_device, same_on_all_ranks
from ._common import clean_name
from ._tensor_layout import (CollectiveBuffer, TensorSpec, as_sharded_tensor, broadcast_tensor, copy_to, full_tensors,
                             is_replicated_only, is_sharded_tensor, local_copy, local_piece, scatter_like, scatterable,
                             to_full, to_layout_of)
from ._unit_state import UnitState, state_of, units_in
from .api import OptimStateKeyType, StateDictType

ParamKey = int | str
OptimInput = list[dict[str, Any]] | Iterable[nn.Parameter] | None


# Deprecation warnings, worded as FSDP1's (users filter on the text).

def _warn_legacy(current: str, replacement: str) -> None:
    warnings.warn(f"``FullyShardedDataParallel.{current}``is being deprecated and is "
                  f"replaced by ``FullyShardedDataParallel.{replacement}``. "
                  f"``FullyShardedDataParallel.{current}`` may be removed after PyTorch 2.2.",
                  FutureWarning, stacklevel=3)  # the caller of the public method


def _warn_optim_input(optim_input: OptimInput) -> None:
    if optim_input is not None:
        warnings.warn("The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. "
                      "You may remove it from your code without changing its functionality.",
                      FutureWarning, stacklevel=3)


# Which parameter is which: optimizer keys, clean names, owning units.

@dataclasses.dataclass
class _ParamIndex:
    """The parameters an optimizer was built on, under every name the formats use."""

    groups: list[list[nn.Parameter]]        # the optimizer's groups (or ``optim_input``'s)
    key_of: dict[nn.Parameter, ParamKey]    # the optimizer's key: id, or name for named optimizers
    param_of_key: dict[ParamKey, nn.Parameter]
    fqn_of: dict[nn.Parameter, str]         # clean FQN; a tied parameter's first name, as FSDP1
    param_of_fqn: dict[str, nn.Parameter]
    flat_order: bool                        # FSDP1 ``use_orig_params=False`` ordering of names
    flat_params: bool                       # the optimizer steps FSDP1 flat parameters (one scalar state a unit)
    unit_of: dict[nn.Parameter, int]        # pre-order index of the owning unit (managed only)
    flat_position: dict[nn.Parameter, int]  # place in FSDP1's flat-parameter traversal
    plain_units: set[int] = dataclasses.field(default_factory=set)  # units showing FSDP1's plain shards
    _replicated: dict[int, bool] = dataclasses.field(default_factory=dict)  # see replicated

    def replicated(self, param: nn.Parameter) -> bool:
        """:func:`_replicated`, found once per parameter and call."""
        found = self._replicated.get(id(param))
        if found is None:
            found = self._replicated[id(param)] = _replicated(param)
        return found

    def in_flat_order(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """Grouped by flat parameter as FSDP1 ``use_orig_params=False`` lists them; else as given (stable)."""
        return sorted(params, key=lambda param: self.flat_position.get(param, -1))


def _flat_positions(model: nn.Module, units: list[UnitState], unit_of: dict[nn.Parameter, int],
                    walk: _engine_flat.EngineParamWalk | None) -> dict[nn.Parameter, int]:
    """Positions in ``model.parameters()`` of an FSDP1 ``use_orig_params=False`` model: a unit's
    parameters sit together (its ``FlatParameter``) where its wrapper is; others stay in place."""
    unit_params: dict[int, list[nn.Parameter]] = {}  # by ``id`` of the unit's wrapper
    for param, unit in unit_of.items():
        unit_params.setdefault(id(units[unit].wrapper), []).append(param)
    for unit_state in units:
        # FSDP1 flattens a unit's parameters in ``named_parameters()`` order (a module's own before its
        # children's); the engine's order puts children first.
        in_unit = ([param for _, param in walk.named_parameters(unit_state.module)] if walk is not None
                   else list(unit_state.module.parameters()))
        order = {param: place for place, param in enumerate(in_unit)}
        params = unit_params.get(id(unit_state.wrapper))
        if params is not None:
            params.sort(key=lambda param: order.get(param, len(order)))
    position: dict[nn.Parameter, int] = {}
    for module in model.modules():
        own = [param for _, param in walk.own(module)] if walk is not None else module.parameters(recurse=False)
        for param in [*unit_params.get(id(module), []), *own]:
            position.setdefault(param, len(position))
    return position


def _param_index(model: nn.Module, optim: Any = None, optim_input: OptimInput = None,
                 named_keys: bool = False, walk: _engine_flat.EngineParamWalk | None = None) -> _ParamIndex:
    """Index the optimizer's parameters; ``KeyError`` if one is not a parameter of ``model``. ``walk``: the
    model's parameters as the engine's (the parameters of ``optim_input``, which is then given)."""
    if isinstance(optim, torch.optim.Optimizer):
        _orig_params.rebind_optimizer(optim)  # built before wrapping: now on the model's parameters
    named = walk.named_parameters(model) if walk is not None else list(model.named_parameters())
    raw_name_of = {param: name for name, param in named}  # tied: first name only
    fqn_of = {param: clean_name(name) for param, name in raw_name_of.items()}
    # Groups in id order: ``optim_input``'s (deprecated), else the optimizer's, else ``model.parameters()``.
    if optim_input is None:
        optim_input = optim.param_groups if optim is not None else [param for _, param in named]
    given: list[Any] = list(optim_input)
    groups = [list(group["params"]) for group in given] if given and isinstance(given[0], dict) else [given]
    ordered = [param for group in groups for param in group]
    strangers = [tuple(param.shape) for param in ordered if param not in fqn_of]
    if strangers:
        raise KeyError(f"The optimizer holds {len(strangers)} parameter(s) (shapes {strangers[:5]}) "
                       "that are not parameters of the model passed in; pass the model whose "
                       "parameters the optimizer was built on")
    key_of = {param: (raw_name_of[param] if named_keys else position)
              for position, param in enumerate(ordered)}
    units = units_in(model) if walk is None else [unit for _, module in walk.named_modules
                                                  if (unit := state_of(module)) is not None]
    if len({unit.use_orig_params for unit in units}) > 1:  # as FSDP1 checks
        raise AssertionError("Not all FSDP modules have the same _use_orig_params value")
    flat_order = bool(units) and not units[0].use_orig_params
    unit_of = {cast(nn.Parameter, param): number for number, unit in enumerate(units)
               for param in _engine.sharded_params(unit.module)}
    return _ParamIndex(groups=groups, key_of=key_of, param_of_key={key: param for param, key in key_of.items()},
                       fqn_of=fqn_of, param_of_fqn={fqn: param for param, fqn in fqn_of.items()},
                       flat_order=flat_order, flat_params=flat_order and not units[0].dtensor_params,
                       unit_of=unit_of,
                       # Only FSDP1's ``use_orig_params=False`` orders read it: a walk of the model saved otherwise.
                       flat_position=_flat_positions(model, units, unit_of, walk) if flat_order else {},
                       plain_units={number for number, unit in enumerate(units)
                                    if _engine_flat.local_shards(unit.module) is not None})


def _state_order(index: _ParamIndex, with_state: list[nn.Parameter]) -> list[nn.Parameter]:
    """FSDP1's order of ``state`` keys: flat-parameter order with ``use_orig_params=False``; with
    ``True`` sorted names, unmanaged (ignored) first, each unit's together, units by first name."""
    if index.flat_order:
        return index.in_flat_order(with_state)
    by_name = sorted(with_state, key=lambda param: index.fqn_of[param])
    units = dict.fromkeys(index.unit_of[param] for param in by_name if param in index.unit_of)
    unit_rank = {unit: rank for rank, unit in enumerate(units)}
    return sorted(by_name, key=lambda param: unit_rank[index.unit_of[param]] if param in index.unit_of else -1)


def _state_name_order(index: _ParamIndex, param: nn.Parameter, state: Mapping[str, Any]) -> list[str]:
    """FSDP1's order of one parameter's state names. It rebuilds a managed parameter's dict from
    sorted pieces: tensors, scalar tensors, other values with ``use_orig_params=False``; the
    reverse with ``True`` when it gathers (split over 2+ ranks). Else the optimizer's order."""
    if param not in index.unit_of or (not index.flat_order and index.replicated(param)):
        return list(state)

    def kind(name: str) -> int:  # 0: tensor, 1: scalar tensor, 2: other
        value = state[name]
        return 2 if not torch.is_tensor(value) else int(value.dim() == 0)

    sign = 1 if index.flat_order else -1
    return sorted(state, key=lambda name: (sign * kind(name), name))


def _replicated(param: nn.Parameter) -> bool:
    """Not split over 2+ ranks (``NO_SHARD``, or a shard group of one rank): FSDP1 would not gather its state."""
    if not isinstance(param, DTensor):
        return True
    return math.prod(param.device_mesh.size(dim) for dim, placement in enumerate(param.placements)
                     if not isinstance(placement, Replicate)) == 1


def _model_group(model: nn.Module, group: Any) -> Any:
    """The group spanning every rank of the model: ``group`` if given, else the root mesh's."""
    if group is not None:
        return group
    # The model is usually the root wrapper itself: its mesh, without walking the model.
    root = state_of(model) or next(iter(units_in(model)), None)
    return dist.group.WORLD if root is None else _engine.flatten_mesh(root.device_mesh).get_group()


def _hyper_parameters(saved_group: Mapping[str, Any]) -> dict[str, Any]:  # as new memory
    return copy.deepcopy({key: value for key, value in saved_group.items() if key != "params"})


# Saving: optimizer ids and engine shards -> FSDP1 names, FULL or SHARDED.

def _export_value(value: Any, *, sharded: bool, offload: bool, dtensor: bool, param: Any = None) -> Any:
    """One state value in the saved layout, as new memory (a sharded one as ``DTensor`` if ``dtensor``,
    else as FSDP1's ``ShardedTensor``)."""
    device = "cpu" if offload else None
    if isinstance(value, DTensor):
        if sharded and not is_replicated_only(value):
            shard = local_copy(value, device, like=param)
            return shard if dtensor else as_sharded_tensor(shard)
        # FULL, or NO_SHARD's replicated state (FSDP1's SHARDED form holds full tensors there).
        return full_tensors([value], device)[0]
    if torch.is_tensor(value):
        return copy_to(value, device)
    return copy.deepcopy(value)


def _export_states(index: _ParamIndex, states: dict[nn.Parameter, Mapping[str, Any]], *,
                   sharded: bool, offload: bool, keep: bool, dtensor: bool) -> dict[str, dict[str, Any]]:
    """Each parameter's state in the saved layout, in FSDP1's order, as new memory (``keep=False``:
    gather, keep nothing). FULL gathers per unit and state name, as FSDP1 per FlatParameter and
    state: few all-gathers, and a gather buffer of one unit's parameters beside the output."""
    batches: dict[tuple[int | None, str], list[tuple[nn.Parameter, str]]] = {}
    for param, state in states.items():
        for name, value in state.items():
            if isinstance(value, DTensor) and not sharded:
                batches.setdefault((index.unit_of.get(param), name), []).append((param, name))
    gathered: dict[tuple[nn.Parameter, str], torch.Tensor] = {}
    buffer = CollectiveBuffer()
    for keys in batches.values():  # offloaded values go from the gather buffer straight to the CPU
        fulls = full_tensors([states[param][name] for param, name in keys],
                             "cpu" if offload else None, keep=keep, buffer=buffer)
        gathered.update(zip(keys, fulls))
    buffer.release()
    if not keep:
        return {}
    return {index.fqn_of[param]: {
                name: gathered[param, name] if (param, name) in gathered
                else _export_value(state[name], sharded=sharded, offload=offload, dtensor=dtensor, param=param)
                for name in _state_name_order(index, param, state)}
            for param, state in states.items()}


def _export_engine(model: nn.Module, optim: Any, source: Mapping[str, Any] | None, *, sharded: bool,
                   rank0_only: bool = False, offload: bool = True, group: Any = None,
                   optim_input: OptimInput = None, dtensor: bool = False,
                   walk: _engine_flat.EngineParamWalk | None = None) -> dict[str, Any]:
    """``source`` (default ``optim.state_dict()``) keyed by clean names, FULL or SHARDED (``ShardedTensor``
    values, ``DTensor`` ones if ``dtensor``). Every rank must call (gathers); with ``rank0_only`` other
    ranks get ``{}``."""
    if isinstance(optim, torch.optim.Optimizer):
        _orig_params.rebind_optimizer(optim)  # built before wrapping: its state on the model's parameters
    source = optim.state_dict() if source is None else source
    group = _model_group(model, group)
    # An optimizer over other parameters (or a bad ``optim_state_dict``) on one rank only must not
    # leave the others waiting in the gathers.
    with all_ranks_agree([group] if dist.is_initialized() else [], "The optimizer or its state",
                         "nothing was saved on any rank"):
        state_in = source["state"]
        named = bool(state_in) and all(isinstance(key, str) for key in state_in)
        index = _param_index(model, optim, optim_input, named_keys=named, walk=walk)
    ordered = _state_order(index, [param for param, key in index.key_of.items() if key in state_in])
    signature = [(index.fqn_of[param], list(state_in[index.key_of[param]])) for param in _held_alike(index, ordered)]
    if dist.is_initialized() and not same_on_all_ranks(signature, group):  # or the gathers would not pair up
        raise RuntimeError(_divergent_state_message(index, signature, group))
    to_save = not rank0_only or not dist.is_initialized() or dist.get_rank(group) == 0
    state_out = _export_states(index, {param: state_in[index.key_of[param]] for param in ordered},
                               sharded=sharded, offload=offload, keep=to_save, dtensor=dtensor)
    if not to_save:
        return {}
    for key in state_in:
        if key not in index.param_of_key:  # FSDP1 copies such entries through, with this warning
            warnings.warn(f"Found a optim state, {key}, that FSDP cannot process. FSDP will directly copy "
                          "everything to the returned state_dict. In most cases, this is a user-defined "
                          "state that is not associated with any particular parameter.", stacklevel=3)
            state_out[key] = _export_value(state_in[key], sharded=sharded, offload=offload, dtensor=dtensor)
    result: dict[str, Any] = {"state": state_out}
    if "param_groups" in source:
        result["param_groups"] = [_named_group(saved, index) for saved in source["param_groups"]]
    return result


def _held_alike(index: _ParamIndex, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters whose state every rank must hold under the same names: with
    ``use_orig_params=True`` those of FSDP units only (their state is gathered), as FSDP1 merges
    every rank's names; parameters outside every unit (TorchRec's, ``ignored_states``) may differ by
    rank, each rank saving its own. FSDP1 ``use_orig_params=False`` requires rank 0's on every rank."""
    return params if index.flat_order else [param for param in params if param in index.unit_of]


def _divergent_state_message(index: _ParamIndex, signature: list[tuple[str, list[str]]], group: Any) -> str:
    """The same text on every rank (a failure path: one gather of every rank's signature): FSDP1's
    where a rank lacks state that rank 0 has, naming the parameters as FSDP1's keys do (a
    ``use_orig_params=False`` unit's names together, its FlatParameter's)."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, signature, group=group)
    ours = "every rank must step the same optimizer over the same model"
    missing = {rank: [fqn for fqn, _ in everyone[0] if fqn not in dict(theirs)] for rank, theirs in enumerate(everyone)}
    if not any(missing.values()):
        return f"Ranks hold optimizer state for different parameters or state names; {ours}"
    message = ("FSDP currently requires each rank to have at least the optimizer states needed by rank 0's "
               "optimizer but some ranks are missing some of those states")
    for rank, names in missing.items():
        if names:
            keys = list(dict.fromkeys(_fsdp1_key(index, index.param_of_fqn[name]) if name in index.param_of_fqn
                                      else (name,) for name in names))  # rank 0's own name (TorchRec)
            message += f"\nRank {rank} is missing states for the parameters: {keys}"
    return f"{message}\n({ours})"


def _fsdp1_key(index: _ParamIndex, param: nn.Parameter) -> tuple[str, ...]:
    """FSDP1's names for ``param``'s optimizer-state key: its unit's, in order, with ``use_orig_params=False``."""
    unit = index.unit_of.get(param)
    if not index.flat_order or unit is None:
        return (index.fqn_of[param],)
    return tuple(index.fqn_of[p] for p in index.in_flat_order(p for p, u in index.unit_of.items() if u == unit))


def _named_group(saved: Mapping[str, Any], index: _ParamIndex) -> dict[str, Any]:
    """A saved param group with ``params`` named in FSDP1's order."""
    params = index.in_flat_order(index.param_of_key[key] for key in saved["params"])
    return {**_hyper_parameters(saved), "params": [index.fqn_of[param] for param in params]}


# Loading: FSDP1 names (FULL / SHARDED / ShardedTensor) -> optimizer ids and engine shards.

def _validate_for_load(osd: Any, index: _ParamIndex, optim: Any, load_directly: bool = False) -> None:
    """Everything that can be wrong with ``osd``, before any work. Exception types are FSDP1's, or
    where FSDP1 only fails later (``optim.load_state_dict``, the next step) the type raised there."""
    if not isinstance(osd, Mapping) or "state" not in osd:
        raise ValueError('`optim_state_dict` must have the keys "state" and "param_groups" to be a '
                         "valid optimizer state dict; pass what FSDP.optim_state_dict (or "
                         f"full_optim_state_dict) returned, not {type(osd).__name__}")
    if "param_groups" not in osd and load_directly:  # FSDP1: the same KeyError, from optim.load_state_dict
        raise KeyError("The optimizer state dict has no 'param_groups', which optim.load_state_dict needs; "
                       "pass the whole dict that FSDP.optim_state_dict returned, or load_directly=False and "
                       "add the optimizer's param_groups to the result before loading it")
    state, saved_groups = osd["state"], osd.get("param_groups")
    if state and all(isinstance(key, int) for key in state):
        raise ValueError("This optimizer state dict is keyed by parameter ids (an optimizer's own state_dict()), "
                         "but FSDP's loaders take parameter names; convert it first with "
                         "FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model, optim=optim)")
    if not all(isinstance(key, str) for key in state):
        raise ValueError(f"Invalid parameter keys: {list(state)}; the state must be keyed by parameter names only")
    known = {index.fqn_of[param] for param in index.key_of}
    unknown = [name for name in state if name not in known]
    unknown += [name for group in saved_groups or [] for name in group["params"] if name not in known]
    if unknown:
        raise KeyError(f"The optimizer state dict names parameters this model's optimizer does not "
                       f"hold: {sorted(set(unknown))[:10]}; is it the state of another model?")
    if index.flat_params:  # per-parameter optimizers (DTensor parameters) keep a step each
        _check_flat_scalar_states(state, index)  # first: FSDP1 raises it, also when the groups differ too
    if saved_groups is not None:  # FSDP1 converts the state alone, and returns no param_groups
        _validate_groups(saved_groups, index)
    _validate_states(state, index, optim, saved_groups)


def _validate_groups(saved_groups: list[Mapping[str, Any]], index: _ParamIndex) -> None:
    """The saved groups are the optimizer's, but for parameters outside every FSDP unit that the
    optimizer holds and the dict does not name (FSDP1 skips them: model-parallel parameters managed
    apart from FSDP, loaded by their own code)."""
    if len(saved_groups) != len(index.groups):
        raise ValueError(f"loaded state dict has a different number of parameter groups "
                         f"({len(saved_groups)}) than the optimizer ({len(index.groups)}); build the "
                         "optimizer with the same parameter groups as the one that was saved")
    for number, (saved, current) in enumerate(zip(saved_groups, index.groups)):
        names = {index.fqn_of[param] for param in current if param in index.unit_of or
                 index.fqn_of[param] in saved["params"]}
        if sorted(saved["params"]) != sorted(names):
            raise ValueError(f"Parameter group {number} of the loaded state dict holds other "
                             f"parameters than the optimizer's group {number}; build the optimizer "
                             "with the same parameter groups as the one that was saved")


def _check_flat_scalar_states(state: Mapping[str, Any], index: _ParamIndex) -> None:
    """FSDP1's ``ValueError`` (and text) for flat parameters (``use_orig_params=False`` with FSDP1's
    parameter model): a unit's parameters form one flat parameter, with one value of each scalar state
    (Adam's ``step``), so those that have a scalar state must agree on its value and dtype. With the
    engine's DTensor parameters each parameter keeps its own (a parameter unused on some steps lags)."""
    units: dict[int, list[nn.Parameter]] = {}
    for param, unit in index.unit_of.items():
        units.setdefault(unit, []).append(param)
    for params in units.values():
        names = [index.fqn_of[param] for param in index.in_flat_order(params)]
        states = [state[name] for name in names if isinstance(state.get(name), Mapping)]
        # A parameter missing from the dict while others of its unit have state: FSDP1 takes its value as None.
        absent = [None] * (len(names) - len(states)) if states else []
        for state_name in dict.fromkeys(key for param_state in states for key in param_state):
            values = [param_state[state_name] for param_state in states if state_name in param_state]
            if all(torch.is_tensor(value) and value.dim() == 0 for value in values):
                tensors = [value.to_local() if isinstance(value, DTensor) else value for value in values]
                numbers = _distinct([*(t.item() for t in tensors), *absent])
                dtypes = _distinct([*(t.dtype for t in tensors), *absent])
                found = f"values {_as_set(numbers)} and dtypes {_as_set(dtypes)} for state {state_name} and "
            elif not any(torch.is_tensor(value) for value in values):
                numbers, dtypes = _distinct([*values, *absent]), []
                found = f"values {_as_set(numbers)} for state {state_name} and  "  # FSDP1's two spaces
            else:
                continue  # tensors of the parameter's shape, or mixed kinds: checked per parameter
            if len(numbers) > 1 or len(dtypes) > 1:
                raise ValueError(
                    "All unflattened parameters comprising a single flat parameter must have scalar state with "
                    f"the same value and dtype but got {found}unflattened parameter names {names}. (With "
                    "use_orig_params=False a unit's parameters share one FlatParameter in FSDP1, stepped "
                    "together: give them one value, or load with use_orig_params=True.)")


def _distinct(values: Iterable[Any]) -> list[Any]:
    distinct: list[Any] = []
    for value in values:
        if not any(_same_value(value, seen) for seen in distinct):
            distinct.append(value)
    return distinct


def _same_value(first: Any, second: Any) -> bool:
    """Equal values, tensors compared whole, also inside lists, tuples and dicts (SOAP keeps lists of
    tensors as state, where ``==`` would compare element-wise)."""
    if torch.is_tensor(first) or torch.is_tensor(second):
        return torch.is_tensor(first) and torch.is_tensor(second) and torch.equal(first, second)
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        return type(first) is type(second) and len(first) == len(second) and all(
            _same_value(a, b) for a, b in zip(first, second))
    if isinstance(first, Mapping) and isinstance(second, Mapping):
        return first.keys() == second.keys() and all(_same_value(first[key], second[key]) for key in first)
    return bool(first == second)


def _as_set(values: list[Any]) -> Any:
    """``values`` printed as FSDP1 prints them: a set (a list when they cannot be hashed)."""
    try:
        return set(values)
    except TypeError:
        return values


def _validate_states(state: Mapping[str, Any], index: _ParamIndex, optim: Any,
                     saved_groups: list[Mapping[str, Any]] | None) -> None:
    """Each parameter's state must fit its shape and hold what ``optim``'s class needs with the
    saved hyper-parameters (which the load installs; without saved groups, the optimizer's own),
    so the result can be stepped."""
    hyper_parameters = saved_groups if saved_groups is not None else getattr(optim, "param_groups", [])
    group_of = {param: number for number, group in enumerate(index.groups) for param in group}
    learned: dict[tuple[Any, ...], _StateKinds | None] = {}  # per group and dimensionality
    for name, param_state in state.items():
        param = index.param_of_fqn[name]
        if not isinstance(param_state, Mapping):
            raise ValueError(f"The state of {name!r} must be a dict of state names to values, "
                             f"not {type(param_state).__name__}")
        replicated = index.replicated(param)
        for state_name, value in param_state.items():
            # A replicated parameter's state is carried whole, whatever its shape (AdaFactor's factored
            # rows / columns under NO_SHARD), as FSDP1's; a sharded one's is cut as the parameter.
            if torch.is_tensor(value) and len(value.shape) > 0 and tuple(value.shape) != tuple(param.shape) \
                    and not replicated:
                raise ValueError(f"State {state_name!r} of {name!r} has shape {tuple(value.shape)} but "
                                 f"the parameter has shape {tuple(param.shape)}; the checkpoint does "
                                 "not belong to this model")
        if optim is None:  # optim_input given instead: the class is unknown
            continue
        local = _engine.local_tensor(param) if isinstance(param, DTensor) else param.detach()
        if not replicated and index.unit_of.get(param, -1) in index.plain_units:
            local = local.reshape(-1)  # the optimizer steps FSDP1's 1-D shard (AdaFactor: unfactored)
        key = (group_of[param], local.dim(), local.dtype, local.device)
        if key not in learned:
            learned[key] = _learn_state_kinds(optim, hyper_parameters[group_of[param]], local)
        if (expected := learned[key]) is not None:
            _check_state_kinds(name, param_state, tuple(param.shape), expected, type(optim).__name__)


def _import_value(value: Any, param: nn.Parameter) -> Any:
    """One saved state value in the layout of ``param``'s state, as new memory. Tensors inside lists,
    tuples or dicts (SOAP's) are taken whole, as FSDP1 does (gathered where saved sharded)."""
    if isinstance(value, (list, tuple, Mapping)):
        return _import_value_whole(value)
    if not torch.is_tensor(value):
        return copy.deepcopy(value)
    if len(value.shape) == 0:  # scalar state (``step``): the optimizer places it itself
        return copy_to(value.to_local() if isinstance(value, DTensor) else value)
    if tuple(value.shape) != tuple(param.shape):  # a replicated parameter's state of another shape
        return copy_to(to_full(value))
    return to_layout_of(value, param)


def _plain_piece(value: Any, param: nn.Parameter, replicated: bool, copy: bool) -> torch.Tensor | None:
    """This rank's piece of ``value``, a full plain tensor of ``param``'s shape, as the optimizer holds FSDP1's
    plain shard (1-D where sharded); a view of ``value`` unless ``copy``. ``None`` for any other value. No
    ``DTensor`` is made."""
    if not (isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.shape
            and len(value.shape) > 0 and not (isinstance(value, DTensor) or is_sharded_tensor(value))):
        return None
    piece = local_piece(value.detach(), param, copy=copy)
    return piece if replicated else piece.reshape(-1)


def _import_value_whole(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_import_value_whole(item) for item in value)
    if isinstance(value, Mapping):
        return {key: _import_value_whole(item) for key, item in value.items()}
    if torch.is_tensor(value):
        return copy_to(to_full(value))
    return copy.deepcopy(value)


def _skeleton(osd: Mapping[str, Any]) -> dict[str, Any]:
    """``osd`` with every tensor but scalars replaced by a placeholder (cheap to pickle)."""
    def strip(value: Any) -> Any:
        if not torch.is_tensor(value):
            return value
        return TensorSpec.of(value) if value.dim() > 0 else value.cpu()

    skeleton = {"state": {name: {state_name: strip(value) for state_name, value in param_state.items()}
                          for name, param_state in osd["state"].items()}}
    return {**skeleton, **({"param_groups": osd["param_groups"]} if "param_groups" in osd else {})}


def _from_rank0(osd: Any, index: _ParamIndex, group: Any) -> tuple[Mapping[str, Any], dict[tuple[str, str], Any]]:
    """Rank 0's (validated) ``osd`` on every rank (elsewhere its skeleton), and its non-scalar tensors in this
    rank's layout, keyed ``(name, state name)``: a sharded parameter's in one scatter per unit, state name and dtype
    (each rank gets its rows alone, as FSDP1 batches per flat parameter), others broadcast, each cut as it arrives."""
    is_rank0 = dist.get_rank(group) == 0
    skeleton = broadcast_object(_skeleton(osd) if is_rank0 else None, group)
    batches: dict[tuple[Any, ...], list[tuple[str, str]]] = {}
    received: dict[tuple[str, str], Any] = {}
    for name, param_state in skeleton["state"].items():
        param = index.param_of_fqn[name]
        scatter = scatterable(param, group)  # decided once per parameter, alike on every rank
        for state_name, spec in param_state.items():
            if not isinstance(spec, TensorSpec):
                continue
            if scatter:
                batches.setdefault((index.unit_of.get(param), state_name, spec.dtype), []).append((name, state_name))
            else:
                value = osd["state"][name][state_name] if is_rank0 else spec
                received[name, state_name] = _import_value(
                    broadcast_tensor(value, group, communication_device(group)), param)
    for (_, _, dtype), keys in batches.items():
        likes = [cast(DTensor, index.param_of_fqn[name]) for name, _ in keys]
        fulls = [osd["state"][name][state_name] for name, state_name in keys] if is_rank0 else None
        received.update(zip(keys, scatter_like(fulls, likes, dtype, group)))
    return (osd if is_rank0 else skeleton), received


def _holds_sharded_values(osd: Any) -> bool:
    """Whether ``osd`` holds a ``DTensor`` or ``ShardedTensor`` state value, also inside a list (SOAP's):
    its conversion may communicate."""
    def sharded(value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return any(sharded(item) for item in value)
        if isinstance(value, Mapping):
            return any(sharded(item) for item in value.values())
        return isinstance(value, DTensor) or is_sharded_tensor(value)

    state = osd.get("state") if isinstance(osd, Mapping) else None
    return isinstance(state, Mapping) and any(
        sharded(value) for param_state in state.values() if isinstance(param_state, Mapping)
        for value in param_state.values())


def _import_engine(model: nn.Module, optim: Any, osd: Any, *, optim_input: OptimInput = None,
                   rank0_only: bool = False, group: Any = None, named_keys: bool = False,
                   load_directly: bool = False, local: bool = False,
                   walk: _engine_flat.EngineParamWalk | None = None) -> dict[str, Any]:
    """``osd`` (keyed by names; full, DTensor or ShardedTensor values) as ``optim.load_state_dict``
    takes it, as new memory. Every rank validates what it reads (only rank 0 under ``rank0_only``)
    and all agree on the outcome before anything is converted: all raise, or none. ``local``: a
    call FSDP1 makes without communicating (a FULL load on every rank, ``shard_full_optim_state_dict``):
    no collective at all when ``osd`` holds plain tensors only (each rank slices its own piece), so a
    rank may call it alone (OLMo loads rank by rank); each rank validates its own input and a rank that
    raises changes nothing, as in FSDP1."""
    local = local and not rank0_only and not _holds_sharded_values(osd)
    groups = [_model_group(model, group)] if dist.is_initialized() and not local else []
    reads_input = not (rank0_only and groups) or dist.get_rank(groups[0]) == 0
    with all_ranks_agree(groups, "The optimizer state dict",
                         "no optimizer state was converted or loaded on any rank"):
        index = _param_index(model, optim, optim_input, named_keys=named_keys, walk=walk)
        if reads_input:
            _validate_for_load(osd, index, optim, load_directly)
            values = [value for param_state in osd["state"].values() for value in param_state.values()]
            if rank0_only and any(isinstance(value, DTensor) or is_sharded_tensor(value) for value in values):
                raise ValueError("A full optimizer state dict holds plain tensors; pass "
                                 "what full_optim_state_dict / FULL optim_state_dict returned")
    received: dict[tuple[str, str], Any] = {}
    if rank0_only and groups:
        osd, received = _from_rank0(osd, index, groups[0])
    state: dict[ParamKey, Any] = {}
    # A full tensor of a parameter the optimizer steps as FSDP1's plain shard is cut straight into that layout,
    # copied once: flat parameters keyed by position copy each piece into their flat state next (``plain_result``).
    into_flat = index.flat_params and not named_keys
    for name, param_state in osd["state"].items():
        param = index.param_of_fqn[name]
        plain = index.unit_of.get(param, -1) in index.plain_units
        converted: dict[str, Any] = {}
        for state_name, value in param_state.items():
            if (name, state_name) in received:
                converted[state_name] = received[name, state_name]
            elif plain and (piece := _plain_piece(value, param, index.replicated(param), copy=not into_flat)) \
                    is not None:
                converted[state_name] = piece
            else:
                converted[state_name] = _import_value(value, param)
        state[index.key_of[param]] = converted
    if "param_groups" not in osd:
        return {"state": state}
    return {"state": state, "param_groups": [_keyed_group(saved, index) for saved in osd["param_groups"]]}


def _keyed_group(saved: Mapping[str, Any], index: _ParamIndex) -> dict[str, Any]:
    """A saved param group with ``params`` the optimizer's keys of its names, sorted as FSDP1 writes them."""
    return {**_hyper_parameters(saved), "params": sorted(index.key_of[index.param_of_fqn[name]]
                                                         for name in saved["params"])}


def _engine_input(optim_input: OptimInput, translation: _optim_views.Translation | None) -> OptimInput:
    """``optim_input`` (parameters or parameter groups) in the engine's parameters."""
    if optim_input is None or translation is None:
        return optim_input
    given: list[Any] = list(optim_input)
    if given and isinstance(given[0], dict):
        return [{**group, "params": translation.engine_params(group["params"])} for group in given]
    return translation.engine_params(given)


def _export(model: nn.Module, optim: Any, source: Mapping[str, Any] | None, *,
            optim_input: OptimInput = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`_export_engine` over the plain state: ``source`` (default ``optim.state_dict()``, plain 1-D
    local tensors keyed by position) read through the :class:`_optim_views.Translation`, its per-element
    state wrapped, without a copy, in the layout of the engine's parameters it belongs to. The model and
    the optimizer stay as the user sees them."""
    optim_input = cast(OptimInput, list(optim_input)) if optim_input is not None else None  # read twice
    translation = _optim_views.translation_of(model, optim, optim_input)
    if translation is None:  # DTensor parameters: the engine's layout already
        return _export_engine(model, optim, source, optim_input=optim_input, **kwargs)
    plain_source = optim.state_dict() if source is None else source
    if not _keyed_by_position(plain_source):
        # A named optimizer's (``_NamedOptimizer``): its names are the engine's parameters' only when shown.
        return _export_shown(model, optim, plain_source if _optimizer_like(optim) else source,
                             optim_input=optim_input, **kwargs)
    source = translation.engine_source(plain_source) if translation.active else plain_source
    given = optim_input if optim_input is not None else getattr(optim, "param_groups", None)
    return _export_engine(model, optim, source, optim_input=_engine_input(given, translation),
                          walk=translation.walk, **kwargs)


def _keyed_by_position(source: Mapping[str, Any]) -> bool:
    return all(isinstance(key, int) for key in source.get("state", {}))


def _export_shown(model: nn.Module, optim: Any, source: Mapping[str, Any] | None, *,
                  optim_input: OptimInput = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`_export` for an optimizer whose ``state_dict()`` is keyed by its own names: taken with the
    model and the optimizer shown in the engine's layout (``_optim_views.engine_layout``). ``source``:
    ``None`` for a torch optimizer's own (taken again, shown); an optimizer-like object's is given (plain)."""
    wrapper = _optimizer_like(optim)
    with _optim_views.engine_layout(model, optim, optim_input) as translation:
        if translation is not None and translation.active and source is not None:
            source = translation.engine_source(source)
        engine_input = _engine_input(optim_input if optim_input is not None or not wrapper
                                     else cast(OptimInput, optim.param_groups), translation)
        return _export_engine(model, optim, source, optim_input=engine_input, **kwargs)


def _optimizer_like(optim: Any) -> bool:
    """An optimizer that is not a ``torch.optim.Optimizer`` (mmengine's ``OptimWrapper``): it has
    ``param_groups`` and ``state_dict()``, as FSDP1 asks of one, but maybe no ``state`` to show in the
    engine's layout, so its ``state_dict()`` is translated instead."""
    return (optim is not None and not isinstance(optim, torch.optim.Optimizer) and hasattr(optim, "param_groups")
            and callable(getattr(optim, "state_dict", None)))


def _import(model: nn.Module, optim: Any, osd: Any, *, optim_input: OptimInput = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`_import_engine` over the plain state (names and layouts read through the
    :class:`_optim_views.Translation`, nothing registered or installed); the result keyed and laid out as
    ``optim`` holds it (without an optimizer: as ``optim_input``, else ``model.parameters()``, orders them)."""
    optim_input = cast(OptimInput, list(optim_input)) if optim_input is not None else None
    # The optimizer's state is not read: only its groups, given in the engine's parameters.
    translation = _optim_views.translation_of(model, optim, optim_input)
    if translation is None:  # DTensor parameters: the engine's layout already
        return _import_engine(model, optim, osd, optim_input=optim_input, **kwargs)
    engine_input = _engine_input(optim_input, translation)
    if engine_input is None and hasattr(optim, "param_groups"):
        engine_input = _engine_input(cast(OptimInput, optim.param_groups), translation)
    elif engine_input is None:
        engine_input = translation.engine_params(translation.params)  # model.parameters()'s order
    result = _import_engine(model, optim, osd, optim_input=engine_input, walk=translation.walk, **kwargs)
    return translation.plain_result(result) if translation.active else result


# State kinds: what an optimizer keeps per parameter, so that a loaded state can always be stepped.
# ``optim.load_state_dict`` takes any per-parameter dict and fails only later (``Adam.__setstate__``
# raises ``KeyError: 'step'`` after the state was replaced; a ``None`` or 0-d ``exp_avg`` fails at the
# next step). What is kept depends on the class and hyper-parameters (``amsgrad`` adds
# ``max_exp_avg_sq``; ``momentum=0`` keeps nothing), so it is learned by stepping a throw-away instance
# with the saved ``param_groups`` (which the load installs) on a tiny zero-gradient tensor of each
# dimensionality (0.3-0.7 ms each for SGD / AdamW on CPU): the optimizer's own state may come from
# other hyper-parameters, or not exist yet (a fresh optimizer before resuming).

_StateKinds = dict[str, str]  # state name -> its kind (see _kind), described in _DESCRIPTIONS
_TINY_SIZES = (2, 3, 4, 5, 6, 7, 8, 9)  # distinct sizes: a parameter-shaped state is recognisable
_DESCRIPTIONS = {"param": "a tensor of the parameter's shape {shape}", "scalar": "a 0-d tensor",
                 "tensor": "a tensor", "value": "a plain (non-tensor) value"}
_PLAIN = (bool, int, float, str, type(None), torch.dtype)
_learned: dict[tuple[Any, ...], _StateKinds | None] = {}  # see _learn_state_kinds
_LEARNED_MAX = 256


def _learn_state_kinds(optim: Any, hyper_parameters: Mapping[str, Any], like: torch.Tensor) -> _StateKinds | None:
    """What ``type(optim)`` with ``hyper_parameters`` keeps for a parameter like ``like`` (its
    dimensionality, dtype and device), or ``None`` where a throw-away instance cannot be built or
    stepped this way (a custom constructor, a closure or sparse gradients needed). Remembered per
    class and plain hyper-parameter values: a resumed run loads the same optimizer again and again,
    and stepping the throw-away costs more than converting a small model's state."""
    key = _memo_key(optim, hyper_parameters, like)
    if key in _learned:  # ``None`` (nothing to remember) is never a key
        return _learned[key]
    tiny = torch.zeros(_TINY_SIZES[:like.dim()], dtype=like.dtype, device=like.device, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # Copies: a hyper-parameter may be a tensor the step changes in place (Prodigy's ``d_numerator``).
            own = {key: copy.deepcopy(value) for key, value in hyper_parameters.items() if key != "params"}
            throwaway = type(optim)([{**own, "params": [tiny]}])
            tiny.grad = torch.zeros_like(tiny)
            throwaway.step()
        kinds: _StateKinds | None = {name: _kind(value, tuple(tiny.shape))
                                     for name, value in throwaway.state.get(tiny, {}).items()}
    except Exception:  # noqa: BLE001 - nothing learned; the structural checks still apply
        kinds = None
    if key is not None:
        if len(_learned) >= _LEARNED_MAX:
            _learned.clear()
        _learned[key] = kinds
    return kinds


def _memo_key(optim: Any, hyper_parameters: Mapping[str, Any], like: torch.Tensor) -> tuple[Any, ...] | None:
    """``None`` when a hyper-parameter is not a plain value (a tensor learning rate, a callable)."""
    items = []
    for name, value in sorted(hyper_parameters.items()):  # names are unique: values never compared
        if name == "params":
            continue
        if isinstance(value, (tuple, list)) and all(isinstance(part, _PLAIN) for part in value):
            value = (type(value), *value)
        elif not isinstance(value, _PLAIN):
            return None
        items.append((name, value))
    return (type(optim), like.dim(), like.dtype, like.device, *items)


def _check_state_kinds(fqn: str, param_state: Mapping[str, Any], shape: tuple[int, ...],
                       expected: _StateKinds, optim_name: str) -> None:
    """``KeyError`` for a missing state, ``ValueError`` for a value of the wrong kind. Other entries
    (a float, ``None``, a tensor the class does not keep) are carried through, as FSDP1 does:
    ``optim.load_state_dict`` keeps them and the step ignores them."""
    missing = [name for name in expected if name not in param_state]
    if missing:
        raise KeyError(f"The state of {fqn!r} has no {missing[0]!r}, which {optim_name} keeps for every "
                       f"parameter it stepped (it has {sorted(param_state)}; {optim_name} keeps "
                       f"{sorted(expected)}). Was the checkpoint saved from another optimizer class or "
                       "other hyper-parameters? Load it into the optimizer it was saved from.")
    for name, kind in expected.items():
        value = param_state[name]
        found = _kind(value, shape)
        if found != kind and not (kind == "tensor" and found == "param"):
            described = (f"{value!r} ({type(value).__name__})" if found == "value"
                         else f"a tensor of shape {tuple(value.shape)}")
            raise ValueError(f"State {name!r} of {fqn!r} is {described}, but {optim_name} keeps "
                             f"{_DESCRIPTIONS[kind].format(shape=shape)} there: it could not be stepped. "
                             "Pass the state dict the optimizer saved, unchanged.")


def _kind(value: Any, shape: tuple[int, ...]) -> str:
    if not torch.is_tensor(value):
        return "value"
    if len(value.shape) == 0:
        return "scalar"
    return "param" if tuple(value.shape) == shape else "tensor"


# Public API (bound as static methods of FullyShardedDataParallel).

def _configured(model: nn.Module) -> tuple[bool, bool, bool, bool]:
    """FULL?, rank0_only, offload_to_cpu, and whether SHARDED values are ``DTensor``s (FSDP1: when its
    config says ``_use_dtensor`` or the model was built with a device mesh; else ``ShardedTensor``s,
    under LOCAL too): as the model's state-dict type and optimizer config set."""
    settings = _state_dict.get_state_dict_type(model)
    config = settings.optim_state_dict_config
    full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
    units = units_in(model)
    dtensor = settings.state_dict_type == StateDictType.SHARDED_STATE_DICT and (
        getattr(config, "_use_dtensor", False) or bool(units and units[0].device_mesh_given))
    return full, full and getattr(config, "rank0_only", False), getattr(config, "offload_to_cpu", True), dtensor


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: OptimInput = None,
                          rank0_only: bool = True, group: Any = None) -> dict[str, Any]:
    """The full (unsharded) optimizer state keyed by parameter names, on CPU (deprecated by FSDP1
    in favour of :func:`optim_state_dict`). With ``rank0_only`` other ranks get ``{}``."""
    _warn_legacy("full_optim_state_dict", "optim_state_dict")
    _warn_optim_input(optim_input)
    return _export(model, optim, None, sharded=False, rank0_only=rank0_only, group=group, optim_input=optim_input)


def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, group: Any = None) -> dict[str, Any]:
    """This rank's shards of the optimizer state (FSDP1's ``ShardedTensor``s, on CPU) keyed by parameter names."""
    _warn_legacy("sharded_optim_state_dict", "optim_state_dict")
    return _export(model, optim, None, sharded=True, group=group)


def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: nn.Module,
                                optim_input: OptimInput = None,
                                optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """A full optimizer state dict (every rank holds it) cut to this rank's shards, keyed by
    the optimizer's ids: ready for ``optim.load_state_dict``. No communication."""
    _warn_legacy("shard_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    return _import(model, optim, full_optim_state_dict, optim_input=optim_input, local=True)


def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict[str, Any], model: nn.Module,
                                     optim: torch.optim.Optimizer) -> dict[str, Any]:
    """A sharded optimizer state dict (DTensor or FSDP1 ShardedTensor values, any world size)
    in this rank's shards, keyed by the optimizer's ids: ready for ``optim.load_state_dict``."""
    _warn_legacy("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    return _import(model, optim, sharded_optim_state_dict)


def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None, model: nn.Module,
                                  optim_input: OptimInput = None, optim: torch.optim.Optimizer | None = None,
                                  group: Any = None) -> dict[str, Any]:
    """Like :func:`shard_full_optim_state_dict`, with the full dict on rank 0 only (ignored
    elsewhere): rank 0 validates it and sends each rank what it needs."""
    _warn_legacy("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    return _import(model, optim, full_optim_state_dict, optim_input=optim_input, rank0_only=True, group=group)


def rekey_optim_state_dict(optim_state_dict: dict[str, Any], optim_state_key_type: OptimStateKeyType,
                           model: nn.Module, optim_input: OptimInput = None,
                           optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Re-key ``state`` and ``param_groups`` by parameter names or by the optimizer's ids.

    Returns ``optim_state_dict`` itself when it already has the requested key type; ``params``
    lists come out sorted, as FSDP1 writes them. The output of ``PARAM_ID`` loads into an
    optimizer over the unwrapped model built the same way.
    """
    _warn_optim_input(optim_input)
    if optim_state_key_type not in (OptimStateKeyType.PARAM_NAME, OptimStateKeyType.PARAM_ID):
        raise AssertionError(f"Expected optim_state_key_type to be PARAM_NAME or PARAM_ID, got "
                             f"{optim_state_key_type}; pass OptimStateKeyType.PARAM_NAME or PARAM_ID")
    key_kinds = {(isinstance(key, str), isinstance(key, int)) for key in optim_state_dict["state"]}
    if len(key_kinds) > 1:
        raise ValueError(f"Invalid parameter keys: {optim_state_dict['state'].keys()}; a state "
                         "dict is keyed by parameter names only or by parameter ids only")
    to_names = optim_state_key_type == OptimStateKeyType.PARAM_NAME
    if key_kinds <= {(to_names, not to_names)}:  # keyed as requested already (or empty)
        return optim_state_dict
    index = _param_index(model, optim, optim_input)
    name_of: dict[ParamKey, ParamKey] = {key: index.fqn_of[param] for param, key in index.key_of.items()}
    mapping = name_of if to_names else {name: key for key, name in name_of.items()}
    used = list(optim_state_dict["state"]) + [key for group in optim_state_dict["param_groups"]
                                              for key in group["params"]]
    unknown = sorted({str(key) for key in used if key not in mapping})
    if unknown:
        raise KeyError(f"Parameter keys {unknown[:10]} name no parameter of this model's optimizer; "
                       "is the state dict from another model, or the optimizer built differently?")
    param_groups = copy.deepcopy(optim_state_dict["param_groups"])
    for group in param_groups:
        group["params"] = sorted(mapping[key] for key in group["params"])
    return {"state": {mapping[key]: value for key, value in optim_state_dict["state"].items()},
            "param_groups": param_groups}


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any] | None = None,
                     group: Any = None) -> dict[str, Any]:
    """The optimizer state in the model's current state-dict type, keyed by parameter names.

    FULL (``FullOptimStateDictConfig(offload_to_cpu, rank0_only)``): unsharded tensors, ``{}`` on
    ranks other than 0 under ``rank0_only``. SHARDED (and LOCAL, as FSDP1): this rank's shards as
    FSDP1's ``ShardedTensor`` (``DTensor`` as FSDP1 gives them, see ``_configured``), loadable with
    ``torch.distributed.checkpoint`` at any world size.
    """
    full, rank0_only, offload, dtensor = _configured(model)
    return _export(model, optim, optim_state_dict, sharded=not full, rank0_only=rank0_only,
                   offload=offload, group=group, dtensor=dtensor)


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                             optim_state_dict: dict[str, Any], is_named_optimizer: bool = False,
                             load_directly: bool = False, group: Any = None) -> dict[str, Any]:
    """``optim_state_dict`` (from :func:`optim_state_dict`, ours or FSDP1's) as what
    ``optim.load_state_dict`` takes; loads it too with ``load_directly``.

    Under FULL with ``rank0_only``, only rank 0's input is read. The input is validated whole
    before anything is converted, so on error the optimizer is untouched.
    """
    full, rank0_only = _configured(model)[:2]
    result = _import(model, optim, optim_state_dict, rank0_only=rank0_only, group=group,
                     named_keys=is_named_optimizer, load_directly=load_directly, local=full)
    if load_directly:
        optim.load_state_dict(result)
    return result
