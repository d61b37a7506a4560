"""The optimizer state-dict family over FSDP1's plain parameters (``dtensor_params=False``).

With plain local-shard parameters an optimizer holds 1-D views (``use_orig_params=True``) or one flat
parameter per unit (``False``), and plain 1-D state. The family (``_optim_state``) names and cuts state by
the engine's parameters: each view stands for one, a flat parameter for its pieces. :func:`translation_of`
maps the optimizer's parameters onto them without registering or installing anything (the model and the
optimizer stay as the user sees them), and :class:`Translation` converts what crosses: a plain
``optim.state_dict()`` in (its per-element state wrapped, without a copy, in its engine parameter's layout
for the gathers of a FULL save and the values of a SHARDED one), a state to load out (plain local tensors,
keyed by the optimizer's own positions; a full tensor's piece is cut straight into it). Only torch's
``get_state_dict`` / ``set_state_dict`` (DCP), which read the engine's DTensors from the model and the
optimizer themselves, get both shown in the engine's layout for the call (:func:`engine_layout`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

from . import _engine, _engine_flat, _orig_params

Piece = tuple[nn.Parameter, Any, int, int]  # (view, sharded DTensor, offset in the flat param, numel)


@dataclasses.dataclass
class Translation:
    """How the optimizer's parameters map onto the engine's: ``pieces[i]`` for its ``i``-th parameter."""

    params: list[nn.Parameter]  # the optimizer's parameters, in position order (before)
    pieces: list[list[Piece] | None]  # each one's engine pieces (``None``: stays itself)
    flat: list[bool]  # whether it is a flat parameter (several pieces, sliced state)
    walk: _engine_flat.EngineParamWalk  # the model's parameters named as in the engine's layout

    @property
    def active(self) -> bool:
        return any(pieces is not None for pieces in self.pieces)

    def engine_params(self, params: Iterable[Any]) -> list[Any]:
        """``params`` with every view or flat parameter replaced by its engine pieces."""
        index = {id(p): i for i, p in enumerate(self.params)}
        out: list[Any] = []
        for param in params:
            pieces = self.pieces[index[id(param)]] if id(param) in index else _pieces_of(param, self.walk)
            out += [piece[1] for piece in pieces] if pieces is not None else [param]
        return out

    def plain_params(self, engine_params: Iterable[Any]) -> list[Any]:
        """The reverse of :meth:`engine_params`: each engine piece as the view or flat parameter it is
        part of (a flat parameter once, where its first piece is)."""
        owner = {id(piece[1]): param for param, pieces in zip(self.params, self.pieces) for piece in pieces or []}
        out: list[Any] = []
        seen: set[int] = set()
        for param in engine_params:
            plain = owner.get(id(param), param)
            if id(plain) not in seen:
                seen.add(id(plain))
                out.append(plain)
        return out

    def new_positions(self) -> list[list[int]]:
        """For each old position, its positions among the engine's parameters."""
        positions, counter = [], 0
        for pieces in self.pieces:
            count = len(pieces) if pieces is not None else 1
            positions.append(list(range(counter, counter + count)))
            counter += count
        return positions

    def engine_state(self, param_state: Mapping[str, Any], old: int) -> list[dict[str, Any]]:
        """One old parameter's state as its pieces' states (per-element tensors sliced and wrapped)."""
        pieces = self.pieces[old]
        if pieces is None:
            return [dict(param_state)]
        flat_shape = self.params[old].shape
        states = []
        for view, sharded, offset, numel in pieces:
            state = {}
            for name, value in param_state.items():
                if self.flat[old] and torch.is_tensor(value) and value.dim() > 0 and value.shape == flat_shape:
                    value = value[offset:offset + numel]
                state[name] = _engine_flat.as_engine_value(value, view, sharded)
            states.append(state)
        return states

    def engine_source(self, source: Mapping[str, Any]) -> Mapping[str, Any]:
        """A user-taken ``optim.state_dict()`` (keyed by position) in the engine's layout and positions."""
        positions = self.new_positions()
        state: dict[Any, Any] = {}
        for key, param_state in source["state"].items():
            if not isinstance(key, int) or key >= len(self.params):
                state[key] = param_state
                continue
            state.update(zip(positions[key], self.engine_state(param_state, key)))
        groups = [{**group, "params": [new for old in group["params"] for new in positions[old]]}
                  for group in source.get("param_groups", [])]
        return {**source, "state": state, **({"param_groups": groups} if "param_groups" in source else {})}

    def plain_result(self, result: dict[str, Any]) -> dict[str, Any]:
        """A state to load (keyed by engine positions, DTensor values) keyed by the optimizer's own
        positions, with plain 1-D local values (a flat parameter's assembled from its pieces).
        Consumes ``result``'s parameter entries."""
        if any(isinstance(key, str) for key in result["state"]) or not any(self.flat):
            # Keyed by names (``is_named_optimizer``), or views one-to-one with the engine's parameters:
            # the same keys; only the values change layout. (Named keys of flat parameters stay per piece.)
            return self._plain_values(result)
        positions = self.new_positions()
        old_of = {new: old for old, news in enumerate(positions) for new in news}
        state: dict[Any, Any] = {}
        for old, news in enumerate(positions):
            # Taken out of ``result`` as they are converted: a flat parameter's state is a copy of its
            # pieces', and holding every unit's pieces until the end would double the peak.
            # (Shallow copies: a piece's dict may be the caller's own, which must keep its entries.)
            taken = [dict(found) if (found := result["state"].pop(new, None)) is not None else None for new in news]
            if all(piece_state is None for piece_state in taken):
                continue
            if not self.flat[old]:
                found = next(piece_state for piece_state in taken if piece_state is not None)
                state[old] = {name: _engine_flat.as_plain_value(v) for name, v in found.items()}
                continue
            state[old] = self._flat_state(old, list(zip(self.pieces[old] or [], taken)), consume=True)
        for key, value in result["state"].items():  # entries of no parameter pass through
            if key not in old_of:
                state[key] = value
        if "param_groups" not in result:  # a saved dict without them converts alone, as in FSDP1
            return {"state": state}
        groups = [{**group, "params": sorted({old_of[new] for new in group["params"]})}
                  for group in result["param_groups"]]
        return {"state": state, "param_groups": groups}

    @staticmethod
    def _plain_values(result: dict[str, Any]) -> dict[str, Any]:
        state = {key: {name: _engine_flat.as_plain_value(value) for name, value in param_state.items()}
                 if isinstance(param_state, dict) else param_state for key, param_state in result["state"].items()}
        return {**result, "state": state}

    def restore_state(self, optim: torch.optim.Optimizer, saved: Mapping[Any, Any],
                      installed: Mapping[int, dict[str, Any]]) -> None:
        """``optim.state`` (in the engine's layout) re-keyed by the optimizer's own parameters, plain.
        A parameter whose pieces' states are still those ``installed`` (views of its ``saved`` state,
        edited in place at most) gets its ``saved`` state back: re-assembling a flat parameter's would
        copy it."""
        current = dict(optim.state)
        optim.state.clear()
        for old, (param, pieces) in enumerate(zip(self.params, self.pieces)):
            if pieces is None:
                if param in current:
                    optim.state[param] = current.pop(param)
                continue
            states = [(piece, current.pop(piece[1], None)) for piece in pieces]
            if all(state is None for _, state in states):
                continue
            if param in saved and all(_same_entries(state, installed.get(id(piece[1]))) for piece, state in states):
                optim.state[param] = saved[param]
            elif self.flat[old]:
                optim.state[param] = self._flat_state(old, states)
            else:
                optim.state[param] = {name: _engine_flat.as_plain_value(value)
                                      for name, value in (states[0][1] or {}).items()}
        optim.state.update(current)  # entries of no parameter

    def _flat_state(self, old: int, pieces: list[tuple[Piece, Any]], consume: bool = False) -> dict[str, Any]:
        """A flat parameter's state from its pieces': per-element ones concatenated in its layout (its
        padding zeros), others (``step``) the first piece's. ``consume``: each piece's entry is dropped
        once copied (a low peak), for pieces' states nobody else holds (an optimizer's own may be in a
        state dict its caller keeps: torch's ``Optimizer.state_dict`` shares them)."""
        flat = self.params[old]
        state: dict[str, Any] = {}
        names = list(dict.fromkeys(name for _, piece_state in pieces for name in (piece_state or {})))
        for name in names:  # one state at a time, each piece's dropped once copied: a low peak
            filled: list[tuple[int, int]] = []  # (offset, numel) written; the rest (padding) is zeroed
            for (_, _, offset, numel), piece_state in pieces:
                if not piece_state or name not in piece_state:
                    continue
                plain = _engine_flat.as_plain_value(piece_state.pop(name) if consume else piece_state[name])
                if torch.is_tensor(plain) and plain.dim() > 0:
                    if name not in state:  # uninitialised: each element is written once (copy or zero)
                        state[name] = torch.empty(flat.numel(), dtype=plain.dtype, device=plain.device)
                    state[name][offset:offset + numel].copy_(plain.reshape(-1))
                    filled.append((offset, numel))
                else:
                    state.setdefault(name, plain)
            if name in state and filled:
                _zero_outside(state[name], filled)
        return state


def _zero_outside(flat: torch.Tensor, filled: list[tuple[int, int]]) -> None:
    """Zero every element of ``flat`` outside the ``(offset, numel)`` runs ``filled`` (padding, pieces
    without state)."""
    end = 0
    for offset, numel in sorted(filled):
        if offset > end:
            flat[end:offset].zero_()
        end = max(end, offset + numel)
    if end < flat.numel():
        flat[end:].zero_()


def _pieces_of(param: Any, walk: _engine_flat.EngineParamWalk) -> list[Piece] | None:
    flat = _engine_flat.flat_pieces(param)
    if flat is not None:
        return flat
    sharded = walk.sharded_of(param)
    return [(param, sharded, 0, param.numel())] if sharded is not None else None


def translation_of(model: nn.Module, optim: Any, optim_input: Any = None) -> Translation | None:
    """The :class:`Translation` (``None``: DTensor parameters) of the optimizer's parameters, else of
    ``optim_input``'s (a list), else of ``model.parameters()``. Nothing is registered or installed: the
    optimizer state-dict family works from it on the plain state, the model and the optimizer as the user
    sees them."""
    walk = _engine_flat.EngineParamWalk(model)
    if not walk.shards:
        return None
    if isinstance(optim, torch.optim.Optimizer):
        _orig_params.rebind_optimizer(optim)  # built before wrapping: first onto the views
        params = [p for group in optim.param_groups for p in group["params"]]
    elif optim_input is not None:
        params = [p for item in optim_input for p in (item["params"] if isinstance(item, dict) else [item])]
    elif optim is not None and hasattr(optim, "param_groups"):  # optimizer-like (mmengine's OptimWrapper)
        params = [p for group in optim.param_groups for p in group["params"]]
    else:
        params = list(model.parameters())
    pieces = [_pieces_of(param, walk) for param in params]
    return Translation(params, pieces, [_engine_flat.flat_pieces(p) is not None for p in params], walk)


@contextlib.contextmanager
def engine_layout(model: nn.Module, optim: Any, optim_input: Any = None) -> Iterator[Translation | None]:
    """For the duration: ``model`` shows the engine's DTensors and ``optim`` holds them, its state as
    DTensors over the same memory; yields the :class:`Translation` (see :func:`translation_of`). For
    torch's ``get_state_dict`` / ``set_state_dict`` (DCP), which read the engine's DTensors from the
    model and the optimizer, and for optimizers whose ``state_dict()`` is not keyed by position."""
    translation = translation_of(model, optim, optim_input)
    if translation is None:
        yield None
        return
    params, pieces = translation.params, translation.pieces
    with _engine_flat.engine_params(model.modules()):
        if not isinstance(optim, torch.optim.Optimizer) or not translation.active:
            yield translation
            return
        saved_state = dict(optim.state)
        position = {id(p): i for i, p in enumerate(params)}
        for group in _engine.optimizer_param_groups(optim):
            group["params"] = translation.engine_params(group["params"])
        optim.state.clear()
        installed: dict[int, dict[str, Any]] = {}  # id(engine parameter) -> the state put in for it
        for param, param_state in saved_state.items():
            old = position.get(id(param))
            if old is None or pieces[old] is None:
                optim.state[param] = param_state
                continue
            for piece, state in zip(pieces[old] or [], translation.engine_state(param_state, old)):
                optim.state[piece[1]] = state
                installed[id(piece[1])] = dict(state)
        try:
            yield translation
        finally:
            # Every group the optimizer steps now (new dicts too, when a load replaced them meanwhile).
            for group in _engine.optimizer_param_groups(optim):
                group["params"] = translation.plain_params(group["params"])
            # What the optimizer holds now (also a state loaded meanwhile, torch's ``set_state_dict``), back
            # in the views' plain layout; a state left as it was put in is the one saved (no copy).
            translation.restore_state(optim, saved_state, installed)



def _same_entries(state: Mapping[str, Any] | None, installed: Mapping[str, Any] | None) -> bool:
    """Whether ``state`` holds exactly the objects ``installed`` did (none replaced, added or removed)."""
    return state is not None and installed is not None and state.keys() == installed.keys() and all(
        state[name] is value for name, value in installed.items())


_engine.set_dcp_optimizer_layout(engine_layout)  # torch's get_state_dict / set_state_dict: the same layout
