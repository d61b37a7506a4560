"""Bad input on one rank only: every rank raises, nothing changes anywhere, nothing hangs.

Each test wraps the model over its own process group with a short timeout, so that a rank left
waiting in a collective fails the test in seconds instead of stalling it. "Nothing changes" is
checked the strong way: every parameter, buffer and optimizer state value on every rank is
compared bit for bit before and after.
"""

from __future__ import annotations

import copy
import dataclasses
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


def raises_everywhere(call, error_type: type, words: str, bad_rank: int = 1) -> str:
    """Run ``call``; it must raise ``error_type`` on every rank: the bad rank with ``words``, the
    others saying the bad rank's input was invalid (and repeating its message). Returns the message."""
    with pytest.raises(error_type) as raised:
        call()
    message = str(raised.value)
    assert words in message, message
    if dist.get_rank() != bad_rank:
        assert f"invalid on rank(s) [{bad_rank}]" in message, message
    return message


def full_optim_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    with FSDP.state_dict_type(model, fsdp_compat.StateDictType.FULL_STATE_DICT,
                              optim_state_dict_config=fsdp_compat.FullOptimStateDictConfig(rank0_only=False)):
        return FSDP.optim_state_dict(model, optim)


def on_rank1(good: Any, bad: Any) -> Any:
    return bad if dist.get_rank() == 1 else good


def on_rank(bad_rank: int, good: Any, bad: Any) -> Any:
    return bad if dist.get_rank() == bad_rank else good


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
def test_set_state_dict_type_with_a_bad_config_on_one_rank_raises_there_alone_and_changes_nothing_there():
    """FSDP1's ``set_state_dict_type`` is local (no collective): the rank given a bad config raises with its
    settings unchanged, the others take theirs."""
    model, optim = build()
    bad_config = on_rank1(fsdp_compat.FullStateDictConfig(), fsdp_compat.ShardedStateDictConfig())
    FSDP.set_state_dict_type(model, fsdp_compat.StateDictType.LOCAL_STATE_DICT)
    call = lambda: FSDP.set_state_dict_type(model, fsdp_compat.StateDictType.FULL_STATE_DICT,  # noqa: E731
                                            bad_config)
    if dist.get_rank() == 1:
        with pytest.raises(RuntimeError, match="FullStateDictConfig"):
            call()
        assert FSDP.get_state_dict_type(model).state_dict_type == fsdp_compat.StateDictType.LOCAL_STATE_DICT
    else:
        call()
        assert FSDP.get_state_dict_type(model).state_dict_type == fsdp_compat.StateDictType.FULL_STATE_DICT
    FSDP.set_state_dict_type(model, fsdp_compat.StateDictType.FULL_STATE_DICT)
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
    grads = diff.full_gradients(model)
    max_norm, norm_type = {"negative_max_norm": (-1.0, 2.0), "bad_norm_type": (1.0, -2.0),
                           "not_a_number": ("x", 2.0)}[bad]
    raises_everywhere(lambda: model.clip_grad_norm_(on_rank1(1.0, max_norm), on_rank1(2.0, norm_type)),
                      ValueError, "max_norm" if bad != "bad_norm_type" else "norm_type")
    after = diff.full_gradients(model)
    assert after.keys() == grads.keys()
    for name, grad in after.items():
        assert torch.equal(grad, grads[name]), f"gradient of {name} changed"
    model.clip_grad_norm_(1.0)  # every rank still in step


@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_summon_full_params_with_bad_arguments_on_one_rank_raises_everywhere():
    model, optim = build()
    before = snapshot(model, optim)

    def summon() -> None:
        with FSDP.summon_full_params(model, writeback=True, rank0_only=on_rank1(False, True)):
            pass

    raises_everywhere(summon, NotImplementedError, "rank0_only")
    assert_unchanged(before, model, optim)
    with FSDP.summon_full_params(model):  # every rank still in step
        pass


@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_saving_optimizer_state_with_a_foreign_optimizer_on_one_rank_raises_everywhere():
    model, optim = build()
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(3, device=diff.device()))], lr=0.1)
    raises_everywhere(lambda: full_optim_state(model, on_rank1(optim, stranger)), KeyError,
                      "not parameters of the model")
    full_optim_state(model, optim)  # every rank still in step


# ---------------------------------------------------------------------------------------------
# Optimizer-state loads: every path, every rank, all raise or none
# ---------------------------------------------------------------------------------------------

FIRST = "tok_emb.weight"


def _set(name: str, value_of):
    def corrupt(osd: dict[str, Any]) -> None:
        osd["state"][FIRST][name] = value_of(osd["state"][FIRST])
    return corrupt


# case -> (corruption of a valid state dict, exception type, words of the message)
CORRUPTIONS = {
    "wrong_shape_exp_avg": (_set("exp_avg", lambda state: torch.zeros(3, 3)), ValueError, "shape"),
    "zero_dim_exp_avg": (_set("exp_avg", lambda state: torch.tensor(0.5)), ValueError, "'exp_avg'"),
    "none_exp_avg": (_set("exp_avg", lambda state: None), ValueError, "'exp_avg'"),
    "no_step": (lambda osd: osd["state"][FIRST].pop("step"), KeyError, "'step'"),
    "no_exp_avg": (lambda osd: osd["state"][FIRST].pop("exp_avg"), KeyError, "'exp_avg'"),
    # A state AdamW does not keep is carried through, but one no parameter's shard can be cut from is not.
    "wrong_shape_unknown_state": (_set("extra", lambda state: torch.zeros(3, 3)), ValueError, "shape"),
    "sgd_state_into_adamw": (lambda osd: osd["state"].__setitem__(
        FIRST, {"momentum_buffer": osd["state"][FIRST]["exp_avg"]}), KeyError, "momentum_buffer"),
    "not_a_dict": (lambda osd: osd.__setitem__("state", [osd["state"]]), ValueError, "state"),
}

# path -> (state-dict type the model is in, the rank whose input is read badly, the call)
LOAD_PATHS = {
    "full": ("full", 1, lambda model, optim, osd: FSDP.optim_state_dict_to_load(model, optim, osd,
                                                                                load_directly=True)),
    "full_rank0_only": ("full_rank0_only", 0, lambda model, optim, osd: FSDP.optim_state_dict_to_load(
        model, optim, osd, load_directly=True)),
    "sharded": ("sharded", 1, lambda model, optim, osd: FSDP.optim_state_dict_to_load(
        model, optim, osd, load_directly=True)),
    "shard_full": ("full", 1, lambda model, optim, osd: FSDP.shard_full_optim_state_dict(osd, model, optim=optim)),
    "scatter_full": ("full", 0, lambda model, optim, osd: FSDP.scatter_full_optim_state_dict(
        osd, model, optim=optim)),
    "flatten_sharded": ("sharded", 1, lambda model, optim, osd: FSDP.flatten_sharded_optim_state_dict(
        osd, model, optim)),
}


def _settings(kind: str) -> tuple[Any, Any]:
    if kind == "sharded":
        return fsdp_compat.StateDictType.SHARDED_STATE_DICT, None
    return (fsdp_compat.StateDictType.FULL_STATE_DICT,
            fsdp_compat.FullOptimStateDictConfig(rank0_only=kind == "full_rank0_only"))


def _saved(model: nn.Module, optim: torch.optim.Optimizer, kind: str) -> dict[str, Any]:
    """What this rank would load: the FULL (every rank) or SHARDED optimizer state dict."""
    if kind == "sharded":
        with FSDP.state_dict_type(model, fsdp_compat.StateDictType.SHARDED_STATE_DICT):
            return FSDP.optim_state_dict(model, optim)
    return full_optim_state(model, optim)


@dataclasses.dataclass
class _BadLoad:
    """A trained model and optimizer, what ``path`` saves (``good``), a copy corrupted as ``case`` (``bad``,
    given on ``bad_rank``), what loading it must raise, and a snapshot of both before any load."""

    model: nn.Module
    optim: torch.optim.Optimizer
    load: Any
    good: dict[str, Any]
    bad: dict[str, Any]
    bad_rank: int
    error_type: type[BaseException]
    words: str
    before: Any
    state_dict_type: Any
    optim_config: Any

    @classmethod
    def of(cls, case: str, path: str) -> _BadLoad:
        model, optim = build(steps=2)
        kind, bad_rank, load = LOAD_PATHS[path]
        good = _saved(model, optim, kind)
        bad = copy.deepcopy(good)
        corrupt, error_type, words = CORRUPTIONS[case]
        corrupt(bad)
        return cls(model, optim, load, good, bad, bad_rank, error_type, words, snapshot(model, optim),
                   *_settings(kind))

    def settings(self) -> Any:
        return FSDP.state_dict_type(self.model, self.state_dict_type, optim_state_dict_config=self.optim_config)

    def convert(self, osd: dict[str, Any]) -> Any:
        return self.load(self.model, self.optim, osd)

    def resume(self) -> None:
        """Load the good dict and train a step (the ranks are still in step)."""
        with self.settings():
            loadable = self.convert(self.good)
        self.optim.load_state_dict(loadable)
        diff.train(self.model, self.optim, 1)


# The loads FSDP1 makes without communicating (a FULL load on every rank, shard_full_optim_state_dict):
# each rank validates its own input, as FSDP1's, so a bad dict raises on its rank alone (issue 30).
LOCAL_LOAD_PATHS = {"full", "shard_full"}


@pytest.mark.parametrize("path", sorted(set(LOAD_PATHS) - LOCAL_LOAD_PATHS))
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_bad_optimizer_state_on_one_rank_raises_everywhere_and_loads_nowhere(case, path):
    setup = _BadLoad.of(case, path)
    with setup.settings():
        raises_everywhere(lambda: setup.convert(on_rank(setup.bad_rank, setup.good, setup.bad)),
                          setup.error_type, setup.words, setup.bad_rank)
        assert_unchanged(setup.before, setup.model, setup.optim)
    setup.resume()


@pytest.mark.parametrize("path", sorted(LOCAL_LOAD_PATHS))
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_bad_optimizer_state_on_one_rank_raises_there_alone_and_changes_nothing_there(case, path):
    setup = _BadLoad.of(case, path)
    with setup.settings():
        if dist.get_rank() == setup.bad_rank:
            with pytest.raises(setup.error_type) as raised:
                setup.convert(setup.bad)
            assert setup.words in str(raised.value), str(raised.value)
        else:  # no collective: the good rank converts its dict, whatever the other's input
            setup.optim.load_state_dict(setup.convert(setup.good))  # (the values it had: nothing changes)
        assert_unchanged(setup.before, setup.model, setup.optim)
    setup.resume()


@pytest.mark.parametrize("case", ["zero_dim_exp_avg", "none_exp_avg", "no_step", "no_exp_avg", "sgd_state_into_adamw"])
@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_state_the_optimizer_could_not_step_is_refused_naming_parameter_and_state(case):
    """Without the check, ``optim.load_state_dict`` or the next step fails after the state was
    replaced (torch's ``KeyError: 'step'``, a broadcast-shape or ``NoneType`` error)."""
    model, optim = build(steps=2)
    bad = full_optim_state(model, optim)
    corrupt, error_type, words = CORRUPTIONS[case]
    corrupt(bad)
    before = snapshot(model, optim)
    with pytest.raises(error_type) as raised:
        FSDP.optim_state_dict_to_load(model, optim, bad, load_directly=True)
    assert FIRST in str(raised.value) and words in str(raised.value), str(raised.value)
    assert_unchanged(before, model, optim)


@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_state_from_other_hyper_parameters_is_refused():
    """AdamW's state loaded with ``amsgrad=True`` groups: the step would need ``max_exp_avg_sq``."""
    model, optim = build(steps=1)
    saved = full_optim_state(model, optim)
    for group in saved["param_groups"]:
        group["amsgrad"] = True
    with pytest.raises(KeyError, match="max_exp_avg_sq"):
        FSDP.optim_state_dict_to_load(model, optim, saved)


@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_fresh_optimizer_and_other_classes_still_load():
    """The kinds are learned for the optimizer's class and the saved hyper-parameters: a fresh
    optimizer (no state yet) takes AdamW's state, SGD takes SGD's, and both step."""
    for name in ("adamw", "sgd"):
        model, optim = build(name, steps=2)
        saved = full_optim_state(model, optim)
        fresh = type(optim)(model.parameters(), lr=0.01)
        fresh.load_state_dict(FSDP.optim_state_dict_to_load(model, fresh, saved))
        diff.train(model, fresh, 1)
