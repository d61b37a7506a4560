"""Model state dicts: FSDP1's three types (FULL / LOCAL / SHARDED) on engine-sharded parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.nn as nn

from .api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    coerce_config,
    coerce_enum,
)

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel

_CONFIG_CLASSES: dict[StateDictType, tuple[type, type]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


def init_state_dict_settings(wrapper: FullyShardedDataParallel) -> None:
    """FSDP1's defaults: FULL state dicts, ``FullStateDictConfig()``, ``FullOptimStateDictConfig()``."""
    wrapper._state_dict_type = StateDictType.FULL_STATE_DICT
    wrapper._state_dict_config = FullStateDictConfig()
    wrapper._optim_state_dict_config = FullOptimStateDictConfig()


def _wrappers(module: nn.Module) -> list[FullyShardedDataParallel]:
    from .fully_sharded_data_parallel import FullyShardedDataParallel

    return FullyShardedDataParallel.fsdp_modules(module)


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: Any,
    state_dict_config: Any = None,
    optim_state_dict_config: Any = None,
) -> StateDictSettings:
    """Set the type and configs on every wrapper in ``module``; return the previous settings."""
    state_dict_type = coerce_enum(state_dict_type, StateDictType, "state_dict_type")
    config_class, optim_config_class = _CONFIG_CLASSES[state_dict_type]
    if state_dict_config is None:
        state_dict_config = config_class()
    else:
        state_dict_config = _coerce_exact(state_dict_config, StateDictConfig, config_class)
    if optim_state_dict_config is None:
        optim_state_dict_config = optim_config_class()
    else:
        optim_state_dict_config = _coerce_exact(optim_state_dict_config, OptimStateDictConfig,
                                                optim_config_class)
    wrappers = _wrappers(module)
    if not wrappers:
        raise ValueError("set_state_dict_type found no FullyShardedDataParallel instance in module")
    previous = get_state_dict_type(module)
    for wrapper in wrappers:
        wrapper._state_dict_type = state_dict_type
        wrapper._state_dict_config = state_dict_config
        wrapper._optim_state_dict_config = optim_state_dict_config
    return previous


def _coerce_exact(config: Any, base: type, expected: type) -> Any:
    """FSDP1 raises ``RuntimeError`` when the config class does not belong to the type."""
    try:
        coerced = coerce_config(config, base, "config")
    except TypeError as error:
        raise RuntimeError(str(error)) from None
    if type(coerced) is not expected:
        raise RuntimeError(f"Expected state_dict_config of type {expected.__name__} but got "
                           f"{type(config).__name__}; pass a {expected.__name__} for this type")
    return coerced


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings shared by every wrapper in ``module``; ``AssertionError`` if they differ."""
    settings: StateDictSettings | None = None
    for wrapper in _wrappers(module):
        current = StateDictSettings(wrapper._state_dict_type, wrapper._state_dict_config,
                                    wrapper._optim_state_dict_config)
        if settings is None:
            settings = current
        elif settings != current:
            raise AssertionError(f"All FSDP modules must have the same state dict settings; got "
                                 f"{settings} and {current}")
    if settings is None:
        raise ValueError("get_state_dict_type found no FullyShardedDataParallel instance in module")
    return settings


def state_dict(wrapper: FullyShardedDataParallel, *args: Any, destination: Any = None,
               prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
    """The state dict of ``wrapper`` in its current type (implemented with the state-dict issue)."""
    raise NotImplementedError("state_dict is being implemented")


def load_state_dict(wrapper: FullyShardedDataParallel, state_dict: Any, strict: bool = True,
                    assign: bool = False) -> Any:
    """Load ``state_dict`` into ``wrapper`` atomically (implemented with the state-dict issue)."""
    raise NotImplementedError("load_state_dict is being implemented")
