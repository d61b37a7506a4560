"""Public enums and configuration dataclasses, field-for-field FSDP1's but our own (to outlive FSDP1):
torch's objects are coerced wherever passed, and our enum members equal (and hash like) torch's."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, TypeVar

import torch

from ._common import InteroperableEnum
from ._engine import BatchNormBase

__all__ = ["ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload", "StateDictType", "StateDictConfig",
           "FullStateDictConfig", "LocalStateDictConfig", "ShardedStateDictConfig", "OptimStateDictConfig",
           "FullOptimStateDictConfig", "LocalOptimStateDictConfig", "ShardedOptimStateDictConfig", "StateDictSettings",
           "OptimStateKeyType"]


class _InteroperableConfig:
    """A config dataclass equal to torch FSDP1's equally named one with equal fields (as our enums equal
    torch's members): ``model.mixed_precision == torch's MixedPrecision(...)`` holds as with FSDP1,
    whichever package's object the wrapper was given."""

    def __eq__(self, other: object) -> bool:
        if not (dataclasses.is_dataclass(other) and not isinstance(other, type)
                and type(other).__name__ == type(self).__name__):
            return NotImplemented
        missing = object()
        return all(getattr(self, field.name) == getattr(other, field.name, missing)
                   for field in dataclasses.fields(self))  # type: ignore[arg-type]

    __hash__ = None  # type: ignore[assignment]  # mutable, as FSDP1's (a dataclass with eq)


class ShardingStrategy(InteroperableEnum):
    """How parameters, gradients and optimizer state are sharded; ``HYBRID_SHARD`` and
    ``_HYBRID_SHARD_ZERO2`` shard inside a node and replicate across nodes (see FSDP1's docs)."""

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(InteroperableEnum):
    """When the next unit's parameters are all-gathered in backward."""

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


class StateDictType(InteroperableEnum):
    """Which of the three state-dict formats ``state_dict()`` produces."""

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


class OptimStateKeyType(InteroperableEnum):
    """Key type of an optimizer state dict's ``state``: parameter names or integer ids."""

    PARAM_NAME = auto()
    PARAM_ID = auto()


@dataclass(eq=False)
class MixedPrecision(_InteroperableConfig):
    """Mixed-precision settings, with FSDP1's fields and defaults."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[torch.nn.Module]] = (BatchNormBase,)


@dataclass(eq=False)
class CPUOffload(_InteroperableConfig):
    """``offload_params=True`` keeps sharded parameters and gradients on the CPU between steps."""

    offload_params: bool = False


@dataclass(eq=False)
class StateDictConfig(_InteroperableConfig):
    """Base class of the model state-dict configs."""

    offload_to_cpu: bool = False


@dataclass(eq=False)
class FullStateDictConfig(StateDictConfig):
    """FULL_STATE_DICT settings; ``rank0_only=True`` gives other ranks an empty dict."""

    rank0_only: bool = False


@dataclass(eq=False)
class LocalStateDictConfig(StateDictConfig):
    """LOCAL_STATE_DICT settings."""


@dataclass(eq=False)
class ShardedStateDictConfig(StateDictConfig):
    """SHARDED_STATE_DICT settings. ``_use_dtensor`` is accepted; values are always DTensors."""

    _use_dtensor: bool = False


@dataclass(eq=False)
class OptimStateDictConfig(_InteroperableConfig):
    """Base class of the optimizer state-dict configs."""

    offload_to_cpu: bool = True


@dataclass(eq=False)
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Full optimizer state; ``rank0_only=True`` gives other ranks an empty dict."""

    rank0_only: bool = False


@dataclass(eq=False)
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Local optimizer state settings."""

    offload_to_cpu: bool = False


@dataclass(eq=False)
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Sharded optimizer state settings. ``_use_dtensor`` is accepted; values are DTensors."""

    _use_dtensor: bool = False


@dataclass(eq=False)
class StateDictSettings(_InteroperableConfig):
    """What ``get_state_dict_type`` / ``set_state_dict_type`` report."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


# ---- Coercion of torch's FSDP1 objects into ours (by class name: FSDP1 is never imported) ----

_EnumT = TypeVar("_EnumT", bound=Enum)
_ConfigT = TypeVar("_ConfigT")

# Every dataclass above, by name: torch's equally named classes convert to these.
_CONFIG_CLASSES: dict[str, Any] = {name: value for name, value in list(globals().items())
                                    if isinstance(value, type) and dataclasses.is_dataclass(value)}


def coerce_enum(value: Any, enum_class: type[_EnumT], argument: str) -> _EnumT:
    """Return ``value`` as a member of our ``enum_class``, accepting torch's equally named enum."""
    if isinstance(value, enum_class):
        return value
    if isinstance(value, Enum) and type(value).__name__ == enum_class.__name__ and value.name in enum_class.__members__:
        return enum_class[value.name]
    choices = ", ".join(f"{enum_class.__name__}.{name}" for name in enum_class.__members__)
    raise ValueError(f"{argument} must be one of {choices}; got {value!r}")


def coerce_config(value: Any, expected: type[_ConfigT], argument: str) -> _ConfigT:
    """Return ``value`` as an instance of our dataclass, converting torch's equally named class
    (subclasses are kept: a ``FullStateDictConfig`` passed as a ``StateDictConfig`` stays one)."""
    if isinstance(value, expected):
        return value
    ours = _CONFIG_CLASSES.get(type(value).__name__) if dataclasses.is_dataclass(value) else None
    if ours is not None and issubclass(ours, expected):
        fields = {field.name: getattr(value, field.name) for field in dataclasses.fields(ours)
                  if hasattr(value, field.name)}
        return ours(**fields)
    raise TypeError(f"{argument} must be a {expected.__name__} (from fsdp_compat or torch.distributed.fsdp); "
                    f"got {type(value).__name__}")
