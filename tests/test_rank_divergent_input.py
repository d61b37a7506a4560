"""Bad input on one rank only: every rank raises, nothing changes anywhere, nothing hangs.

Each test wraps the model over its own process group with a short timeout, so that a rank left
waiting in a collective fails the test in seconds instead of stalling it. "Nothing changes" is
checked the strong way: every parameter, buffer and optimizer state value on every rank is
compared bit for bit before and after.
"""

from __future__ import annotations

import copy
import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.examples import Block
from fsdp_compat.testing import distributed_test
from fsdp_compat.wrap import ModuleWrapPolicy
from tests import differential as diff

# A rank left waiting fails after this long (the pool's own timeout is the backstop).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=20)
POOL_TIMEOUT = 180
_short_group: list[Any] = []


def short_timeout_group() -> Any:
    """A group over every rank whose collectives time out quickly (made once per worker)."""
    if not _short_group:
        _short_group.append(dist.new_group(timeout=COLLECTIVE_TIMEOUT))
    return _short_group[0]


def build(optimizer: str = "adamw", steps: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    diff.quiet()
    model = FSDP(diff.make_model(), process_group=short_timeout_group(),
                 auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
    if optimizer == "sgd":
        optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diff.train(model, optim, steps)
    return model, optim


def snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and buffer (full values) and every optimizer state value, as copies."""
    state = {}
    for param, param_state in optim.state.items():
        for name, value in param_state.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            state[(id(param), name)] = value.detach().clone() if torch.is_tensor(value) else copy.deepcopy(value)
    return {"model": diff.model_state(model), "optim": state,
            "groups": [{k: v for k, v in group.items() if k != "params"} for group in optim.param_groups]}


def assert_unchanged(before: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer) -> None:
    after = snapshot(model, optim)
    assert before["model"].keys() == after["model"].keys()
    for key, value in before["model"].items():
        assert torch.equal(value, after["model"][key]), f"parameter/buffer {key} changed"
    assert before["optim"].keys() == after["optim"].keys(), "optimizer state entries changed"
    for key, value in before["optim"].items():
        mine = after["optim"][key]
        same = torch.equal(value, mine) if torch.is_tensor(value) else value == mine
        assert same, f"optimizer state {key[1]} changed"
    assert before["groups"] == after["groups"], "optimizer param_groups changed"


def raises_everywhere(call, error_type: type, words: str) -> str:
    """Run ``call``; it must raise ``error_type`` on every rank: the bad rank (1) with ``words``,
    the others saying rank 1's input was invalid. Returns the message."""
    with pytest.raises(error_type) as raised:
        call()
    message = str(raised.value)
    if dist.get_rank() == 1:
        assert words in message, message
    else:
        assert "invalid on rank(s) [1]" in message, message
    return message


def full_optim_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    with FSDP.state_dict_type(model, fsdp_compat.StateDictType.FULL_STATE_DICT,
                              optim_state_dict_config=fsdp_compat.FullOptimStateDictConfig(rank0_only=False)):
        return FSDP.optim_state_dict(model, optim)


def on_rank1(good: Any, bad: Any) -> Any:
    return bad if dist.get_rank() == 1 else good


# ---------------------------------------------------------------------------------------------
# Model state dicts and settings
# ---------------------------------------------------------------------------------------------

@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_load_state_dict_of_a_non_dict_on_one_rank_raises_everywhere():
    model, optim = build()
    good = model.state_dict()
    before = snapshot(model, optim)
    raises_everywhere(lambda: model.load_state_dict(on_rank1(good, [good])), TypeError, "dict-like")
    assert_unchanged(before, model, optim)
    model.load_state_dict(good)  # and the group is still in step


@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_set_state_dict_type_with_a_bad_config_on_one_rank_raises_everywhere():
    model, optim = build()
    bad_config = on_rank1(fsdp_compat.FullStateDictConfig(), fsdp_compat.ShardedStateDictConfig())
    raises_everywhere(lambda: FSDP.set_state_dict_type(model, fsdp_compat.StateDictType.FULL_STATE_DICT,
                                                       bad_config),
                      RuntimeError, "FullStateDictConfig")
    assert FSDP.get_state_dict_type(model).state_dict_type == fsdp_compat.StateDictType.FULL_STATE_DICT
    model.state_dict()  # a collective: every rank still takes part


@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_register_comm_hook_not_callable_on_one_rank_raises_everywhere():
    model, optim = build()
    from torch.distributed.algorithms._comm_hooks import default_hooks
    hook = on_rank1(default_hooks.reduce_scatter_hook, "not a hook")
    state = default_hooks.DefaultState(short_timeout_group())
    raises_everywhere(lambda: model.register_comm_hook(state, hook), ValueError, "callable")
    assert all(unit._comm_hook is None for unit in FSDP.fsdp_modules(model))
    diff.train(model, optim, 1)  # default communication on every rank


@pytest.mark.parametrize("bad", ["negative_max_norm", "bad_norm_type", "not_a_number"])
@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_clip_grad_norm_with_bad_arguments_on_one_rank_raises_everywhere(bad):
    model, optim = build()
    tokens, targets = diff.local_batch(5)
    diff.loss_fn(model, tokens, targets).backward()
    grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters() if p.grad is not None}
    max_norm, norm_type = {"negative_max_norm": (-1.0, 2.0), "bad_norm_type": (1.0, -2.0),
                           "not_a_number": ("x", 2.0)}[bad]
    raises_everywhere(lambda: model.clip_grad_norm_(on_rank1(1.0, max_norm), on_rank1(2.0, norm_type)),
                      ValueError, "max_norm" if bad != "bad_norm_type" else "norm_type")
    for name, param in model.named_parameters():
        if param.grad is not None:
            assert torch.equal(param.grad.full_tensor(), grads[name]), f"gradient of {name} changed"
    model.clip_grad_norm_(1.0)  # every rank still in step
