"""Optimizer-state errors that callers match by FSDP1's text: same exception type, FSDP1's message
first (ours may add an explanation after it), raised on every rank, nothing changed.

* Saving while a rank lacks optimizer state that rank 0 has: FSDP1's ``RuntimeError`` ("FSDP
  currently requires each rank to have at least the optimizer states needed by rank 0's optimizer
  ..."), naming each rank's missing parameters as FSDP1's keys do.
* Loading, into a ``use_orig_params=False`` model, a state whose parameters of one unit (one
  FlatParameter in FSDP1) disagree on a scalar state such as Adam's ``step``: FSDP1's ``ValueError``
  ("All unflattened parameters comprising a single flat parameter must have scalar state with the
  same value and dtype ..."). With ``use_orig_params=True`` FSDP1 loads it, and so do we.

FSDP1's results are kept in ``tests/golden/optim_state_errors.json``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import distributed_test
from tests import differential as diff
from tests.test_optim_state import Setup, api_of, assert_states_equal, build, full_state

GOLDEN = "optim_state_errors"
MISSING_STATES = ("FSDP currently requires each rank to have at least the optimizer states needed by rank 0's "
                  "optimizer but some ranks are missing some of those states")
SCALAR_STATE = ("All unflattened parameters comprising a single flat parameter must have scalar state with the "
                "same value and dtype")
IN_ONE_UNIT = "blocks.0.ln1.weight"  # its step is changed; its unit (block 0) has other parameters


def _raised(call: Any) -> dict[str, str]:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type and text are what is compared
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": "no error", "message": ""}


def _local_state(optim: torch.optim.Optimizer) -> dict[tuple[int, str], Any]:
    """This rank's optimizer state, as copies of the local values."""
    return {(key, name): (value.to_local() if isinstance(value, DTensor) else value).clone()
            if torch.is_tensor(value) else copy.deepcopy(value)
            for key, state in optim.state_dict()["state"].items() for name, value in state.items()}


def _same_on_all_ranks(value: Any) -> bool:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return all(other == value for other in everyone)


# ---------------------------------------------------------------------------------------------
# Saving: a rank lacks state that rank 0 has
# ---------------------------------------------------------------------------------------------

def _save(wrapper_class: type, model: nn.Module, optim: torch.optim.Optimizer, api: str) -> Any:
    if api == "full_optim_state_dict":
        return wrapper_class.full_optim_state_dict(model, optim, rank0_only=False)
    fsdp = api_of(wrapper_class)
    state_dict_type, config = ((fsdp.StateDictType.FULL_STATE_DICT, fsdp.FullOptimStateDictConfig(rank0_only=False))
                               if api == "FULL" else (fsdp.StateDictType.SHARDED_STATE_DICT, None))
    with wrapper_class.state_dict_type(model, state_dict_type, optim_state_dict_config=config):
        return wrapper_class.optim_state_dict(model, optim)


def _rank1_never_stepped(wrapper_class: type, use_orig_params: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Both ranks run forward and backward; only rank 0's optimizer steps (rank 1 has no state)."""
    model, optim = build(wrapper_class, Setup(use_orig_params=use_orig_params))
    diff.loss_fn(model, *diff.local_batch(0)).backward()
    if dist.get_rank() == 0:
        optim.step()
    optim.zero_grad()
    return model, optim


def _save_error(wrapper_class: type, use_orig_params: bool, api: str) -> dict[str, str]:
    model, optim = _rank1_never_stepped(wrapper_class, use_orig_params)
    return _raised(lambda: _save(wrapper_class, model, optim, api))


@pytest.mark.parametrize("api", ["full_optim_state_dict", "FULL", "SHARDED"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed_test(world_size=2)
def test_saving_while_a_rank_lacks_rank0s_state_raises_fsdp1_error_everywhere(use_orig_params, api):
    """FSDP1's ``RuntimeError`` and, with ``use_orig_params=False``, its whole message (the missing
    parameters named per FlatParameter); with ``True`` FSDP1 words it otherwise ("... is not in the
    optimizer state"), we keep the rank-0 text. Every rank raises the same; nothing changes."""
    diff.quiet()
    model, optim = _rank1_never_stepped(FSDP, use_orig_params)
    before = _local_state(optim)
    ours = _raised(lambda: _save(FSDP, model, optim, api))
    expected = diff.fsdp1_value(GOLDEN, diff.golden_key("save-missing", use_orig_params, api),
                                lambda: _save_error(diff.TorchFSDP, use_orig_params, api))
    assert ours["type"] == expected["type"] == "RuntimeError"
    assert ours["message"].startswith(expected["message"] if not use_orig_params else MISSING_STATES), ours
    assert _same_on_all_ranks(ours["message"])
    after = _local_state(optim)
    assert after.keys() == before.keys() and all(
        torch.equal(value, after[key]) if torch.is_tensor(value) else value == after[key]
        for key, value in before.items())
    diff.train(model, optim, 1)  # rank 1 now has state too (a step behind): saving works, the ranks in step
    assert _save(FSDP, model, optim, api)["state"]


# ---------------------------------------------------------------------------------------------
# Loading: one unit's parameters disagree on a scalar state
# ---------------------------------------------------------------------------------------------

LOADS = {
    "optim_state_dict_to_load FULL": ("FULL", lambda cls, model, optim, osd: cls.optim_state_dict_to_load(
        model, optim, osd)),
    "optim_state_dict_to_load SHARDED": ("SHARDED", lambda cls, model, optim, osd: cls.optim_state_dict_to_load(
        model, optim, osd)),
    "shard_full_optim_state_dict": ("FULL", lambda cls, model, optim, osd: cls.shard_full_optim_state_dict(
        osd, model, optim=optim)),
    "scatter_full_optim_state_dict": ("FULL", lambda cls, model, optim, osd: cls.scatter_full_optim_state_dict(
        osd if dist.get_rank() == 0 else None, model, optim=optim)),
}


def _with_changed_step(osd: dict[str, Any]) -> dict[str, Any]:
    changed = copy.deepcopy(osd)
    changed["state"][IN_ONE_UNIT]["step"] = changed["state"][IN_ONE_UNIT]["step"] + 1
    return changed


def _load_error(wrapper_class: type, use_orig_params: bool, load: str, dtensor_params: bool = False) -> dict[str, str]:
    """What loading a state with one unit's ``step``s differing raises; fsdp_compat with FSDP1's flat
    parameters unless ``dtensor_params`` (FSDP1 ignores it)."""
    model, optim = build(wrapper_class, Setup(use_orig_params=use_orig_params, dtensor_params=dtensor_params))
    diff.train(model, optim, 2)
    kind, call = LOADS[load]
    changed = _with_changed_step(_save(wrapper_class, model, optim, kind))
    fsdp = api_of(wrapper_class)
    state_dict_type = getattr(fsdp.StateDictType, f"{kind}_STATE_DICT")
    config = fsdp.FullOptimStateDictConfig(rank0_only=False) if kind == "FULL" else None
    with wrapper_class.state_dict_type(model, state_dict_type, optim_state_dict_config=config):
        return _raised(lambda: call(wrapper_class, model, optim, changed))


@pytest.mark.parametrize("load", list(LOADS))
@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed_test(world_size=2)
def test_one_units_parameters_with_differing_steps_load_as_in_fsdp1(use_orig_params, load):
    """``use_orig_params=False`` (flat parameters, ``dtensor_params=False``): FSDP1's ``ValueError`` and
    message; ``True``: loaded, as FSDP1."""
    diff.quiet()
    ours = _load_error(FSDP, use_orig_params, load)
    expected = diff.fsdp1_value(GOLDEN, diff.golden_key("load-scalar-state", use_orig_params, load),
                                lambda: _load_error(diff.TorchFSDP, use_orig_params, load))
    assert ours["type"] == expected["type"] == ("ValueError" if not use_orig_params else "no error")
    if load.startswith("scatter") and dist.get_rank() != 0:  # only rank 0 reads the dict; the others repeat it
        assert not expected["message"] or ("invalid on rank(s) [0]" in ours["message"]
                                           and expected["message"] in ours["message"]), ours["message"]
    else:
        assert ours["message"].startswith(expected["message"]), (ours["message"], expected["message"])
    if not use_orig_params:
        assert SCALAR_STATE in ours["message"]


@pytest.mark.parametrize("load", list(LOADS))
@distributed_test(world_size=2)
def test_differing_steps_load_per_parameter_with_dtensor_parameters(load):
    """With the engine's DTensor parameters every parameter keeps its own ``step`` (one unused on some
    steps lags behind its unit's, in our own checkpoints too), so such a state loads (README)."""
    diff.quiet()
    assert _load_error(FSDP, False, load, dtensor_params=True)["type"] == "no error"


@distributed_test(world_size=2)
def test_differing_steps_on_one_rank_only_raise_there_and_load_nowhere_there():
    """Rank 1's dict alone has the inconsistent unit: a FULL load on every rank communicates in FSDP1
    no more than ours (OLMo loads rank by rank), so rank 1 alone raises ``ValueError`` with FSDP1's
    text and its optimizer is unchanged; rank 0 loads its good dict."""
    diff.quiet()
    model, optim = build(FSDP, Setup(use_orig_params=False, dtensor_params=False))
    diff.train(model, optim, 2)
    good = full_state(model, optim)
    bad = _with_changed_step(good) if dist.get_rank() == 1 else good
    with FSDP.state_dict_type(model, fsdp_compat.StateDictType.FULL_STATE_DICT,
                              optim_state_dict_config=fsdp_compat.FullOptimStateDictConfig(rank0_only=False)):
        before = _local_state(optim)
        if dist.get_rank() == 1:
            with pytest.raises(ValueError) as raised:
                FSDP.optim_state_dict_to_load(model, optim, bad, load_directly=True)
            assert SCALAR_STATE in str(raised.value)
            after = _local_state(optim)
            assert before.keys() == after.keys() and all(
                torch.equal(value, after[key]) if torch.is_tensor(value) else value == after[key]
                for key, value in before.items()), "the rank that raised changed its optimizer"
        else:
            FSDP.optim_state_dict_to_load(model, optim, bad, load_directly=True)
        if dist.get_rank() == 1:  # now the good dict: every rank holds it
            FSDP.optim_state_dict_to_load(model, optim, good, load_directly=True)
    assert_states_equal(full_state(model, optim), good)
