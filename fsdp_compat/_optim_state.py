"""Optimizer state dicts: FSDP1's whole family, keyed and shaped exactly as FSDP1's."""

from __future__ import annotations

from typing import Any


def full_optim_state_dict(model: Any, optim: Any, optim_input: Any = None, rank0_only: bool = True,
                          group: Any = None) -> dict[str, Any]:
    raise NotImplementedError


def sharded_optim_state_dict(model: Any, optim: Any, group: Any = None) -> dict[str, Any]:
    raise NotImplementedError


def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: Any, optim_input: Any = None,
                                optim: Any = None) -> dict[str, Any]:
    raise NotImplementedError


def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict[str, Any], model: Any,
                                     optim: Any) -> dict[str, Any]:
    raise NotImplementedError


def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None, model: Any,
                                  optim_input: Any = None, optim: Any = None,
                                  group: Any = None) -> dict[str, Any]:
    raise NotImplementedError


def rekey_optim_state_dict(optim_state_dict: dict[str, Any], optim_state_key_type: Any, model: Any,
                           optim_input: Any = None, optim: Any = None) -> dict[str, Any]:
    raise NotImplementedError


def optim_state_dict(model: Any, optim: Any, optim_state_dict: dict[str, Any] | None = None,
                     group: Any = None) -> dict[str, Any]:
    raise NotImplementedError


def optim_state_dict_to_load(model: Any, optim: Any, optim_state_dict: dict[str, Any],
                             is_named_optimizer: bool = False, load_directly: bool = False,
                             group: Any = None) -> dict[str, Any]:
    raise NotImplementedError
