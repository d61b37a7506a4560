"""The calls torch FSDP1 makes without communicating complete when one rank calls them alone.

OLMo's ``FullCheckpointer`` loads the optimizer state one local rank at a time while the other ranks
wait in ``dist.barrier()``; FSDP1 completes there, because these calls issue no collective (the table
"Which calls communicate" in the FSDP1 contract). Each test calls an API on rank 0 while rank 1 waits
at a barrier, then the other way round, over a process group whose collectives time out in seconds (a
regression fails fast rather than hangs). The result must be what FSDP1 gives: FSDP1 is run the same
way where torch ships it (its completing is recorded in ``tests/golden/optim_state_rank_by_rank.json``),
and every loaded state is gathered afterwards and compared with what was saved. Validation is per rank,
as FSDP1's: a rank whose input is bad raises alone and changes nothing; the other rank loads.
"""

from __future__ import annotations

import copy
import datetime
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.examples import Block
from fsdp_compat.testing import distributed_test
from tests import differential as diff
from tests import earlier_local_golden as earlier_local
from tests import fsdp1_local_golden as golden_local
from tests.test_optim_state import api_of, assert_states_equal, full_state

GOLDEN = "optim_state_rank_by_rank"
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=10)  # a collective waiting for the other rank fails by then
POOL_TIMEOUT = 240
_groups: list[Any] = []


def short_timeout_group() -> Any:
    if not _groups:
        _groups.append(dist.new_group(timeout=COLLECTIVE_TIMEOUT))
    return _groups[0]


def build(wrapper_class: type, use_orig_params: bool, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The seeded TinyGPT wrapped per block over the short-timeout group, trained ``steps`` AdamW steps
    (every rank together)."""
    diff.quiet()
    api = api_of(wrapper_class)
    policy = diff.block_policy_torch() if api is not fsdp_compat else fsdp_compat.wrap.ModuleWrapPolicy({Block})
    kwargs: dict[str, Any] = dict(auto_wrap_policy=policy, use_orig_params=use_orig_params,
                                  process_group=short_timeout_group())
    if wrapper_class is not FSDP:
        kwargs.update(diff.fsdp1_kwargs())
    model = wrapper_class(diff.make_model(), **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    diff.train(model, optim, steps)
    return model, optim


def rank_by_rank(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``call()`` on each rank in turn, the others waiting in ``dist.barrier()`` (on the default group, whose
    timeout outlasts the model's): this rank's result, or what it raised."""
    result: Any = None
    error: BaseException | None = None
    for turn in range(dist.get_world_size()):
        if dist.get_rank() == turn:
            try:
                result = call()
            except Exception as caught:  # noqa: BLE001 - reported by the caller
                error = caught
        dist.barrier()
    return result, error


def completes(call: Callable[[], Any]) -> Any:
    result, error = rank_by_rank(call)
    assert error is None, "called rank by rank, the call failed:\n" + "".join(traceback.format_exception(error))
    return result


def fsdp1_completes(key: str, prepare_fsdp1: Callable[[], Callable[[], Any]]) -> None:
    """FSDP1 completes the same call rank by rank (run where torch ships it; else its golden record).
    ``prepare_fsdp1()`` runs on every rank together (building a model communicates) and returns the call."""
    golden = diff.load_golden(GOLDEN) or {}
    if diff.HAVE_FSDP1:
        _, error = rank_by_rank(prepare_fsdp1())
        outcomes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
        golden[key] = {"completes": all(outcome is None for outcome in outcomes)}
        diff.save_golden(GOLDEN, golden)
    assert key in golden, f"no FSDP1 and no golden record for {key}"
    assert golden[key]["completes"], f"{key}: FSDP1 itself does not complete rank by rank"


def _full_config(wrapper_class: type) -> dict[str, Any]:
    api = api_of(wrapper_class)
    return dict(state_dict_type=api.StateDictType.FULL_STATE_DICT,
                optim_state_dict_config=api.FullOptimStateDictConfig(rank0_only=False))


def saved_full(wrapper_class: type, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    with wrapper_class.state_dict_type(model, **_full_config(wrapper_class)):
        return wrapper_class.optim_state_dict(model, optim)


# ---------------------------------------------------------------------------------------------
# The loads
# ---------------------------------------------------------------------------------------------

def _load_full(wrapper_class: type, model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any]) -> Any:
    return wrapper_class.optim_state_dict_to_load(model, optim, osd)  # under FULL_STATE_DICT, rank0_only=False


def _shard_full(wrapper_class: type, model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any]) -> Any:
    return wrapper_class.shard_full_optim_state_dict(osd, model, optim=optim)


LOADS = {"optim_state_dict_to_load_full": _load_full, "shard_full_optim_state_dict": _shard_full}


def full_type(wrapper_class: type, model: nn.Module) -> Any:
    """The FULL state-dict type, entered by every rank together (as OLMo does, around its rank-by-rank loop)."""
    return wrapper_class.state_dict_type(model, **_full_config(wrapper_class))


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("load", sorted(LOADS))
@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_full_optimizer_state_loads_rank_by_rank(load, use_orig_params):
    convert = LOADS[load]

    def fsdp1() -> Callable[[], Any]:
        model, optim = build(diff.TorchFSDP, use_orig_params)
        osd = saved_full(diff.TorchFSDP, model, optim)

        def load() -> None:
            with full_type(diff.TorchFSDP, model):  # FSDP1 sets the type locally
                optim.load_state_dict(convert(diff.TorchFSDP, model, optim, osd))
        return load

    fsdp1_completes(f"{load}-orig{int(use_orig_params)}", fsdp1)
    model, optim = build(FSDP, use_orig_params)
    saved = saved_full(FSDP, model, optim)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    with full_type(FSDP, model):
        fresh.load_state_dict(completes(lambda: convert(FSDP, model, fresh, saved)))
    assert_states_equal(full_state(model, fresh), saved)


@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_bad_full_optimizer_state_on_one_rank_fails_there_alone(use_orig_params):
    """Per rank, as FSDP1: rank 1's bad dict raises there and changes nothing; rank 0 loads its good one."""
    model, optim = build(FSDP, use_orig_params)
    good = saved_full(FSDP, model, optim)
    bad = copy.deepcopy(good)
    bad["state"]["tok_emb.weight"]["exp_avg"] = torch.zeros(3, 3)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)

    def load() -> None:
        FSDP.optim_state_dict_to_load(model, fresh, bad if dist.get_rank() == 1 else good, load_directly=True)

    with FSDP.state_dict_type(model, **_full_config(FSDP)):
        _, error = rank_by_rank(load)
    if dist.get_rank() == 1:
        assert isinstance(error, ValueError) and "shape" in str(error), error
        assert not fresh.state, "the rank that raised changed its optimizer"
    else:
        assert error is None, error
        assert fresh.state, "the rank with good input did not load"


@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_local_model_state_dict_loads_rank_by_rank():
    """``use_orig_params=False``: FSDP1 loads its LOCAL state dict (each unit's flat shard) without
    communicating. Ours loads its earlier per-parameter LOCAL files so; its LOCAL files now being FSDP1's
    flat format, reading those gathers each unit (README, "Which calls communicate")."""
    def local_round_trip(wrapper_class: type) -> tuple[nn.Module, Any]:
        model, _ = build(wrapper_class, False)
        api = api_of(wrapper_class)
        with wrapper_class.state_dict_type(model, api.StateDictType.LOCAL_STATE_DICT):
            saved = model.state_dict()
            return model, saved

    def fsdp1() -> Callable[[], Any]:
        model, saved = local_round_trip(diff.TorchFSDP)

        def load() -> None:
            with diff.TorchFSDP.state_dict_type(model, api_of(diff.TorchFSDP).StateDictType.LOCAL_STATE_DICT):
                model.load_state_dict(saved)
        return load

    fsdp1_completes("load_state_dict_local-orig0", fsdp1)
    model = golden_local.make_model(seed=1).to(diff.device())
    model = FSDP(model, auto_wrap_policy=fsdp_compat.wrap.ModuleWrapPolicy(set(golden_local.UNIT_CLASSES)),
                 ignored_modules=[model.side], process_group=short_timeout_group())
    saved = golden_local.load_local_file(earlier_local.rank_path(dist.get_rank()))
    with FSDP.state_dict_type(model, fsdp_compat.StateDictType.LOCAL_STATE_DICT):
        completes(lambda: model.load_state_dict(saved))
    after = diff.model_state(model)
    for name, value in earlier_local.expected_values().items():
        assert torch.equal(after[name], value), name


def _local_calls(wrapper_class: type, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Callable[[], Any]]:
    api = api_of(wrapper_class)
    return {
        "rekey_optim_state_dict": lambda: wrapper_class.rekey_optim_state_dict(
            optim.state_dict(), api.OptimStateKeyType.PARAM_NAME, model, optim=optim),
        "named_parameters": lambda: [name for name, _ in model.named_parameters()],
        "parameters": lambda: [tuple(p.shape) for p in model.parameters()],
        "fsdp_modules": lambda: len(wrapper_class.fsdp_modules(model)),
        "state_dict_type": lambda: _entered_state_dict_type(wrapper_class, api, model),
    }


def _entered_state_dict_type(wrapper_class: type, api: Any, model: nn.Module) -> str:
    with wrapper_class.state_dict_type(model, api.StateDictType.LOCAL_STATE_DICT):
        return wrapper_class.get_state_dict_type(model).state_dict_type.name


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("call", ["rekey_optim_state_dict", "named_parameters", "parameters", "fsdp_modules",
                                  "state_dict_type"])
@distributed_test(world_size=2, timeout=POOL_TIMEOUT)
def test_local_queries_complete_rank_by_rank(call, use_orig_params):
    if call == "rekey_optim_state_dict" and not use_orig_params:
        pytest.skip("FSDP1 keys a use_orig_params=False optimizer by FlatParameter ids")

    def fsdp1() -> Callable[[], Any]:
        model, optim = build(diff.TorchFSDP, use_orig_params, steps=1)
        return _local_calls(diff.TorchFSDP, model, optim)[call]

    fsdp1_completes(f"{call}-orig{int(use_orig_params)}", fsdp1)
    model, optim = build(FSDP, use_orig_params, steps=1)
    expected = _local_calls(FSDP, model, optim)[call]()  # called together
    assert completes(_local_calls(FSDP, model, optim)[call]) == expected
