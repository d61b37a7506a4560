"""What an optimizer keeps per parameter, so that a loaded state can always be stepped.

``optim.load_state_dict`` takes any per-parameter dict and fails only later (``Adam.__setstate__``
raises ``KeyError: 'step'`` after the state was replaced; a ``None`` or 0-d ``exp_avg`` fails at the
next step). What is kept depends on the class and hyper-parameters (``amsgrad`` adds
``max_exp_avg_sq``; ``momentum=0`` keeps nothing), so it is learned by stepping a throw-away instance
with the saved ``param_groups`` (which the load installs) on a tiny zero-gradient tensor of each
dimensionality (0.3-0.7 ms each for SGD / AdamW on CPU): the optimizer's own state may come from
other hyper-parameters, or not exist yet (a fresh optimizer before resuming).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ._tensor_layout import is_sharded_tensor

# name -> "param" (tensor of the parameter's shape), "scalar" (0-d tensor), "tensor" (another
# shape) or "value" (not a tensor)
StateKinds = dict[str, str]

_TINY_SIZES = (2, 3, 4, 5, 6, 7, 8, 9)  # distinct sizes: a parameter-shaped state is recognisable
_DESCRIPTIONS = {"param": "a tensor of the parameter's shape {shape}", "scalar": "a 0-d tensor",
                 "tensor": "a tensor", "value": "a plain (non-tensor) value"}
_PLAIN = (bool, int, float, str, type(None), torch.dtype)
_learned: dict[tuple[Any, ...], StateKinds | None] = {}  # see learn_state_kinds
_LEARNED_MAX = 256


def learn_state_kinds(optim: Any, hyper_parameters: Mapping[str, Any], like: torch.Tensor) -> StateKinds | None:
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
            throwaway = type(optim)([{**hyper_parameters, "params": [tiny]}])
            tiny.grad = torch.zeros_like(tiny)
            throwaway.step()
        kinds: StateKinds | None = {name: _kind(value, tuple(tiny.shape))
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


def check_state_kinds(fqn: str, param_state: Mapping[str, Any], shape: tuple[int, ...],
                      expected: StateKinds, optim_name: str) -> None:
    """``KeyError`` for a missing state, ``ValueError`` for an unknown one or a value of the wrong kind."""
    missing = [name for name in expected if name not in param_state]
    if missing:
        raise KeyError(f"The state of {fqn!r} has no {missing[0]!r}, which {optim_name} keeps for every "
                       f"parameter it stepped (it has {sorted(param_state)}; {optim_name} keeps "
                       f"{sorted(expected)}). Was the checkpoint saved from another optimizer class or "
                       "other hyper-parameters? Load it into the optimizer it was saved from.")
    unknown = [name for name in param_state if name not in expected]
    if unknown:
        raise ValueError(f"The state of {fqn!r} holds {unknown[0]!r}, which {optim_name} with these "
                         f"param_groups does not keep (it keeps {sorted(expected)}): the checkpoint was "
                         "saved from another optimizer class or other hyper-parameters. Load it into the "
                         "optimizer it was saved from, or remove that state from the dict.")
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
    if not is_tensor_like(value):
        return "value"
    if len(value.shape) == 0:
        return "scalar"
    return "param" if tuple(value.shape) == shape else "tensor"


def is_tensor_like(value: Any) -> bool:
    return torch.is_tensor(value) or is_sharded_tensor(value)
