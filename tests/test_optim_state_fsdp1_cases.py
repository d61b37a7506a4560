"""Optimizer-state dicts in the cases torch's own FSDP1 tests cover beyond plain training: each
behaviour side by side with torch FSDP1 (or its golden record in
``tests/golden/optim_state_fsdp1_cases.json`` once torch no longer ships it).

- Parameters outside every FSDP unit whose state differs by rank (TorchRec's model-parallel
  parameters, ``ignored_states``): each rank saves and loads its own.
- A state dict without ``param_groups``: the state is converted alone.
- An optimizer parameter outside every unit that the saved dict lacks: skipped.
- State entries the optimizer class does not keep (a float, ``None``, a 0-d or parameter-shaped
  tensor): carried through saving and loading, and the optimizer still steps.
"""

from __future__ import annotations

import bisect
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat._common import clean_name
from fsdp_compat.testing import distributed_test
from tests import differential as diff
from tests.test_optim_state import describe

GOLDEN = "optim_state_fsdp1_cases"
LOCAL_SIZE = 3


def _api(wrapper_class: type) -> Any:
    return diff.torch_fsdp if diff.HAVE_FSDP1 and wrapper_class is diff.TorchFSDP else fsdp_compat


def _unit(wrapper_class: type, module: nn.Module, use_orig_params: bool) -> nn.Module:
    extra = diff.fsdp1_kwargs() if wrapper_class is not FSDP else {}
    return wrapper_class(module, use_orig_params=use_orig_params, **extra)


def _full_on_every_rank(wrapper_class: type, model: nn.Module) -> Any:
    """The FULL state-dict type, optimizer state on every rank."""
    api = _api(wrapper_class)
    return wrapper_class.state_dict_type(model, api.StateDictType.FULL_STATE_DICT,
                                         optim_state_dict_config=api.FullOptimStateDictConfig(rank0_only=False))


def fsdp1_per_rank(key: str, compute: Any) -> Any:
    """FSDP1's result for ``key`` on this rank (every rank's is recorded), or its golden record."""
    def everyones() -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, compute())
        return gathered

    return diff.fsdp1_value(GOLDEN, diff.golden_key(key), everyones)[dist.get_rank()]


def _formats(wrapper_class: type, model: nn.Module, optim: torch.optim.Optimizer,
             source: dict[str, Any] | None = None) -> dict[str, Any]:
    """``describe`` of ``optim_state_dict`` under FULL, FULL ``rank0_only`` and SHARDED."""
    api = _api(wrapper_class)
    configs = {"full": (api.StateDictType.FULL_STATE_DICT, api.FullOptimStateDictConfig()),
               "full_rank0_only": (api.StateDictType.FULL_STATE_DICT, api.FullOptimStateDictConfig(rank0_only=True)),
               "sharded": (api.StateDictType.SHARDED_STATE_DICT, api.ShardedOptimStateDictConfig())}
    out = {}
    for name, (kind, config) in configs.items():
        with wrapper_class.state_dict_type(model, kind, optim_state_dict_config=config):
            out[name] = describe(wrapper_class.optim_state_dict(model, optim, optim_state_dict=copy.deepcopy(source)))
    return out


# ---- parameters outside every unit, with state that differs by rank ------------------------------

class _ModelParallel(nn.Module):
    """An FSDP unit and, beside it, a parameter of this rank alone (TorchRec's pattern): same name
    on every rank (``"local"``) or a name of its own (``"sparse<rank>"``), values differing by rank."""

    def __init__(self, wrapper_class: type, use_orig_params: bool, own_names: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = _unit(wrapper_class, nn.Linear(4, 4), use_orig_params)
        torch.manual_seed(10 + dist.get_rank())
        name = f"sparse{dist.get_rank()}" if own_names else "local"
        self.register_parameter(name, nn.Parameter(torch.randn(LOCAL_SIZE)))
        self.name = name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        local = getattr(self, self.name)
        return self.dense(inputs).sum() + (local * local).sum()  # the local gradient differs by rank


def _trained_model_parallel(wrapper_class: type, use_orig_params: bool,
                            own_names: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _ModelParallel(wrapper_class, use_orig_params, own_names)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(2, 4, device=diff.device())).backward()
        optim.step()
        optim.zero_grad()
    return model, optim


@pytest.mark.parametrize("use_orig_params, own_names", [(True, False), (True, True), (False, False)])
@distributed_test(world_size=2)
def test_state_outside_every_unit_is_each_ranks_own(use_orig_params, own_names):
    diff.quiet()
    model, optim = _trained_model_parallel(FSDP, use_orig_params, own_names)
    formats = _formats(FSDP, model, optim)
    key = f"model_parallel-orig{int(use_orig_params)}-own_names{int(own_names)}"
    assert formats == fsdp1_per_rank(key, lambda: _formats(diff.TorchFSDP, *_trained_model_parallel(
        diff.TorchFSDP, use_orig_params, own_names)))
    local = getattr(model, model.name)
    mine = optim.state[local]["exp_avg"]
    everyones = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyones, mine)
    assert not torch.equal(everyones[0], everyones[1]), "the test needs state that differs by rank"
    for kind in ("full", "sharded"):  # saved as this rank's own, and loaded back as it
        with FSDP.state_dict_type(model, getattr(fsdp_compat.StateDictType, f"{kind.upper()}_STATE_DICT")):
            saved = FSDP.optim_state_dict(model, optim)
            assert torch.equal(saved["state"][model.name]["exp_avg"], mine)
            loadable = FSDP.optim_state_dict_to_load(model, optim, saved)
        assert torch.equal(loadable["state"][_key_of(optim, local)]["exp_avg"], mine)
        optim.load_state_dict(loadable)
        assert torch.equal(optim.state[local]["exp_avg"], mine)


def _key_of(optim: torch.optim.Optimizer, param: nn.Parameter) -> int:
    """``param``'s key in ``optim.state_dict()`` (its position in the optimizer's groups)."""
    return [id(held) for group in optim.param_groups for held in group["params"]].index(id(param))


@distributed_test(world_size=2)
def test_own_names_outside_every_unit_need_use_orig_params_as_in_fsdp1():
    """FSDP1 ``use_orig_params=False`` requires every rank to hold rank 0's parameters' state."""
    diff.quiet()
    model, optim = _trained_model_parallel(FSDP, use_orig_params=False, own_names=True)
    with pytest.raises(RuntimeError):
        FSDP.optim_state_dict(model, optim)

    def fsdp1_error() -> str | None:
        theirs, their_optim = _trained_model_parallel(diff.TorchFSDP, use_orig_params=False, own_names=True)
        try:
            diff.TorchFSDP.optim_state_dict(theirs, their_optim)
        except Exception as error:  # noqa: BLE001 - recording which type
            return type(error).__name__
        return None

    assert fsdp1_per_rank("model_parallel-orig0-own_names1-error", fsdp1_error) == "RuntimeError"


# ---- a state dict without param_groups --------------------------------------------------------

def _trained_pair(wrapper_class: type, use_orig_params: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _unit(wrapper_class, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), use_orig_params)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4, device=diff.device())).sum().backward()
    optim.step()
    return model, optim


def _without_groups(wrapper_class: type, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """What each loading path returns for a saved dict without ``param_groups`` (its keys), and
    what ``load_directly=True`` raises."""
    api = _api(wrapper_class)
    full = wrapper_class.full_optim_state_dict(model, optim, rank0_only=False)
    full.pop("param_groups")
    with wrapper_class.state_dict_type(model, api.StateDictType.SHARDED_STATE_DICT):
        sharded = wrapper_class.optim_state_dict(model, optim)
    sharded.pop("param_groups")
    out = {"full": wrapper_class.optim_state_dict_to_load(model, optim, copy.deepcopy(full)),
           "shard_full": wrapper_class.shard_full_optim_state_dict(copy.deepcopy(full), model, optim=optim),
           "scatter_full": wrapper_class.scatter_full_optim_state_dict(
               copy.deepcopy(full) if dist.get_rank() == 0 else None, model, optim=optim)}
    with wrapper_class.state_dict_type(model, api.StateDictType.SHARDED_STATE_DICT):
        out["sharded"] = wrapper_class.optim_state_dict_to_load(model, optim, sharded)
    with wrapper_class.state_dict_type(model, api.StateDictType.FULL_STATE_DICT,
                                       optim_state_dict_config=api.FullOptimStateDictConfig(rank0_only=True)):
        out["full_rank0_only"] = wrapper_class.optim_state_dict_to_load(model, optim, copy.deepcopy(full))
    result: dict[str, Any] = {path: sorted(converted) for path, converted in out.items()}
    try:
        wrapper_class.optim_state_dict_to_load(model, optim, full, load_directly=True)
    except Exception as error:  # noqa: BLE001 - recording which type
        result["load_directly"] = type(error).__name__
    return result


@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2)
def test_state_without_param_groups_is_converted_alone(use_orig_params):
    """The result has no ``param_groups`` either (the program adds its own before loading, as
    FSDP1's tests do); ``load_directly=True`` raises ``KeyError`` on every rank, loading nothing."""
    diff.quiet()
    model, optim = _trained_pair(FSDP, use_orig_params)
    before = optim.state_dict()
    ours = _without_groups(FSDP, model, optim)
    assert ours == fsdp1_per_rank(f"without_param_groups-orig{int(use_orig_params)}", lambda: _without_groups(
        diff.TorchFSDP, *_trained_pair(diff.TorchFSDP, use_orig_params)))
    assert ours["full"] == ["state"] and ours["load_directly"] == "KeyError"
    full = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    expected = FSDP.optim_state_dict_to_load(model, optim, full)
    full.pop("param_groups")
    alone = FSDP.optim_state_dict_to_load(model, optim, full)
    optim.load_state_dict({**alone, "param_groups": before["param_groups"]})
    _assert_same_state(optim.state_dict(), before)
    _assert_same_state(alone, expected)


def _assert_same_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Same parameters and state names (in any order: a load keeps the loaded dict's), equal values."""
    assert sorted(actual["state"]) == sorted(expected["state"])
    for key, state in expected["state"].items():
        assert sorted(actual["state"][key]) == sorted(state)
        for name, value in state.items():
            mine = actual["state"][key][name]
            assert torch.equal(_local(mine), _local(value)) if torch.is_tensor(value) else mine == value, (key, name)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


# ---- an optimizer parameter outside every unit that the saved dict lacks ----------------------

class _TwoUnits(nn.Module):
    def __init__(self, wrapper_class: type, use_orig_params: bool, unmanaged: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = _unit(wrapper_class, nn.Linear(4, 4), use_orig_params)
        self.second = _unit(wrapper_class, nn.Linear(4, 2), use_orig_params)
        if unmanaged:  # a root parameter no unit manages
            self.unmanaged = nn.Parameter(torch.ones(5))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out = self.second(self.first(inputs)).sum()
        return out + self.unmanaged.sum() if hasattr(self, "unmanaged") else out


def _load_into_larger(wrapper_class: type, use_orig_params: bool, kind: str) -> tuple[dict[str, Any], Any]:
    """Saved without the unmanaged parameter, converted for a model and optimizer that hold it."""
    api = _api(wrapper_class)
    state_dict_type = getattr(api.StateDictType, f"{kind.upper()}_STATE_DICT")
    model = _TwoUnits(wrapper_class, use_orig_params, unmanaged=False)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4, device=diff.device())).backward()
    optim.step()
    with wrapper_class.state_dict_type(model, state_dict_type):
        saved = wrapper_class.optim_state_dict(model, optim)
    larger = _TwoUnits(wrapper_class, use_orig_params, unmanaged=True)
    larger_optim = torch.optim.Adam(larger.parameters(), lr=0.1)
    with wrapper_class.state_dict_type(larger, state_dict_type):
        converted = wrapper_class.optim_state_dict_to_load(larger, larger_optim, saved)
    return converted, (larger, larger_optim)


def _group_names(converted: dict[str, Any], holders: tuple[nn.Module, torch.optim.Optimizer]) -> list[list[str]]:
    """``converted``'s ``param_groups`` as the names of the parameters their keys stand for (FSDP1
    and we may number a model's parameters differently). Its ``state`` is not compared: FSDP1
    ``use_orig_params=True`` leaves out the parameters of which a rank holds no element."""
    model, optim = holders
    name_of = {id(param): clean_name(name) for name, param in model.named_parameters()}
    held = [name_of[id(param)] for group in optim.param_groups for param in group["params"]]
    return [[held[key] for key in group["params"]] for group in converted["param_groups"]]


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2)
def test_unmanaged_parameter_missing_from_the_dict_is_skipped(use_orig_params, kind):
    """No state and no place in ``param_groups`` for it, as FSDP1: its own code supplies them
    (here as FSDP1's tests do) before ``optim.load_state_dict``."""
    diff.quiet()
    converted, (model, optim) = _load_into_larger(FSDP, use_orig_params, kind)
    unmanaged_id = _key_of(optim, model.unmanaged)
    assert unmanaged_id not in converted["state"]
    assert unmanaged_id not in converted["param_groups"][0]["params"]
    if use_orig_params:  # FSDP1 ``use_orig_params=False`` numbers its flat parameters instead
        assert _group_names(converted, (model, optim)) == fsdp1_per_rank(f"unmanaged_skipped-{kind}", lambda: (
            _group_names(*_load_into_larger(diff.TorchFSDP, use_orig_params, kind))))
    converted["state"][unmanaged_id] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(5),
                                        "exp_avg_sq": torch.zeros(5)}
    bisect.insort(converted["param_groups"][0]["params"], unmanaged_id)
    optim.load_state_dict(converted)
    model(torch.ones(2, 4, device=diff.device())).backward()
    optim.step()


# ---- state entries the optimizer class does not keep -------------------------------------------

EXTRA = {"value1": 2.74, "value2": None, "zerod": torch.tensor(7.0)}


def _with_extra_entries(optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's own state dict plus entries its class does not keep: a float, ``None``, a
    0-d tensor and a tensor of the parameter's shape (``extra_t``, all 3)."""
    raw = copy.deepcopy(optim.state_dict())
    for state in raw["state"].values():
        like = next(value for value in state.values() if torch.is_tensor(value) and value.dim() > 0)
        state.update(copy.deepcopy(EXTRA), extra_t=torch.full_like(like, 3.0))
    return raw


def _trained_with(wrapper_class: type, optimizer: str, use_orig_params: bool) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = _unit(wrapper_class, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), use_orig_params)
    optim = (torch.optim.Adam(model.parameters(), lr=0.1) if optimizer == "adam"
             else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(torch.ones(2, 4, device=diff.device())).sum().backward()
    optim.step()
    return model, optim


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2)
def test_state_entries_the_optimizer_does_not_keep_are_carried_through(use_orig_params, optimizer):
    diff.quiet()
    model, optim = _trained_with(FSDP, optimizer, use_orig_params)
    raw = _with_extra_entries(optim)
    formats = _formats(FSDP, model, optim, raw)

    def fsdp1_formats() -> dict[str, Any]:
        theirs, their_optim = _trained_with(diff.TorchFSDP, optimizer, use_orig_params)
        return _formats(diff.TorchFSDP, theirs, their_optim, _with_extra_entries(their_optim))

    assert formats == fsdp1_per_rank(f"extra_entries-orig{int(use_orig_params)}-{optimizer}", fsdp1_formats)
    for kind in ("FULL", "SHARDED"):
        with FSDP.state_dict_type(model, getattr(fsdp_compat.StateDictType, f"{kind}_STATE_DICT")):
            saved = FSDP.optim_state_dict(model, optim, optim_state_dict=copy.deepcopy(raw))
            loadable = FSDP.optim_state_dict_to_load(model, optim, saved)
        for key, state in loadable["state"].items():
            param = optim.param_groups[0]["params"][key]
            assert {name: state[name] for name in ("value1", "value2")} == {"value1": 2.74, "value2": None}
            assert torch.equal(state["zerod"], EXTRA["zerod"])
            extra = state["extra_t"]
            assert isinstance(extra, DTensor) == isinstance(param, DTensor) and extra.shape == param.shape
            assert torch.equal(extra.full_tensor() if isinstance(extra, DTensor) else extra,
                               torch.full(param.shape, 3.0))
        optim.load_state_dict(loadable)
        model(torch.ones(2, 4, device=diff.device())).sum().backward()
        optim.step()  # the class ignores the entries it does not keep


# ---- FSDP1's parameter order under use_orig_params=False -------------------------------------------

class _OwnAndChildParams(nn.Module):
    """A unit whose module has a parameter of its own, registered after a child's (FSDP1 flattens a
    module's own parameters before its children's: ``named_parameters()`` order)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.lin(x)) * self.scale


def _saved_order(wrapper_class: type) -> dict[str, list[str]]:
    module = _OwnAndChildParams()
    module.inner = _unit(wrapper_class, module.inner, False)
    model = _unit(wrapper_class, module, False)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    with _full_on_every_rank(wrapper_class, model):
        saved = wrapper_class.optim_state_dict(model, optim)
    return {"state": list(saved["state"]), "params": saved["param_groups"][0]["params"]}


@distributed_test(world_size=2)
def test_full_state_parameter_order_with_flat_parameters_is_fsdp1s():
    """``use_orig_params=False``: a unit's names in its FlatParameter's order (the module's own first)."""
    diff.quiet()
    assert _saved_order(FSDP) == fsdp1_per_rank("flat-parameter-order", lambda: _saved_order(diff.TorchFSDP))


# ---- torch's _NamedOptimizer (TorchRec): reloaded, then saved again ---------------------------------

def _named_optimizer_round_trip(wrapper_class: type) -> dict[str, Any]:
    """Train with a ``_NamedOptimizer``, convert its state with ``is_named_optimizer=True``, load it back
    and save again (torch's ``test_compatible_with_trec``, extended by the reload)."""
    from torch.distributed.optim import _NamedOptimizer

    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    torch.manual_seed(0)
    for param in module.parameters():
        nn.init.normal_(param)
    model = _unit(wrapper_class, module, True)
    optim = _NamedOptimizer(model.named_parameters(), torch.optim.Adam, [{"params": model.parameters()}],
                            model, lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    with _full_on_every_rank(wrapper_class, model):
        saved = wrapper_class.optim_state_dict(model, optim)
        converted = wrapper_class.optim_state_dict_to_load(model, optim, saved, is_named_optimizer=True)
        # FSDP1's _NamedOptimizer converts a dict itself in load_state_dict (it recognises torch's FSDP
        # class); with fsdp_compat the user loads the converted one.
        optim.load_state_dict(converted if wrapper_class is FSDP else saved)
        again = wrapper_class.optim_state_dict(model, optim)
    return {"keys": list(again["state"]), "params": again["param_groups"][0]["params"],
            # Keyed by the model's own names, as the _NamedOptimizer holds them (FSDP1 leaves out the
            # parameters with no elements on this rank: a layout difference, not compared).
            "converted_keys_known": set(converted["state"]) <= {name for name, _ in model.named_parameters()},
            "same": all(torch.equal(again["state"][name][key], value) for name, state in saved["state"].items()
                        for key, value in state.items())}


@pytest.mark.skipif(not diff.HAVE_FSDP1, reason="torch's _NamedOptimizer imports FSDP1")
@distributed_test(world_size=2)
def test_named_optimizer_reloaded_saves_again_as_in_fsdp1():
    diff.quiet()
    ours = _named_optimizer_round_trip(FSDP)
    assert ours["same"], "the state saved after the reload differs from the one loaded"
    expected = fsdp1_per_rank("named-optimizer-reload", lambda: _named_optimizer_round_trip(diff.TorchFSDP))
    assert ours == expected, (ours, expected)
