"""Any optimizer's state survives save / load / continue, as in torch FSDP1.

Third-party optimizers keep state torch's do not: tensors in ``param_groups`` changed in place by
``step`` (Prodigy), factored second moments shaped unlike the parameter (AdaFactor), lists of tensors
(SOAP), per-tensor trust ratios (Lamb), float bookkeeping in the groups (schedule-free); and some
trainers hand FSDP an optimizer-like wrapper (mmengine's ``OptimWrapper``). ``tests/standin_optimizers.py``
has small stand-ins with those shapes. Each test trains 3 steps, saves model and optimizer state,
loads both into a fresh model and optimizer, and trains 2 more: the result must equal the
uninterrupted 5-step run bit for bit, the caller's saved dict must be left exactly as it was, and
the losses must be FSDP1's over the same 5 steps (recorded in ``tests/golden/optim_state_any_optimizer.json``;
within 1e-5, or 2e-2 for the optimizers whose step depends on how a parameter is cut into shards:
Lamb's trust ratio over a flat shard differs by 0.8% after 5 steps).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import distributed_test
from tests import differential as diff
from tests import standin_optimizers as standin
from tests.test_optim_state import Setup, api_of, build_model, wrap
from tests.test_optim_state_resume import load_checkpoint, save_checkpoint, shared_directory

GOLDEN = "optim_state_any_optimizer"
FIRST, SECOND = 3, 2
# Their step reads a whole tensor (a norm, a few leading elements): FSDP1 cuts parameters into shards otherwise.
LAYOUT_DEPENDENT = {"lamb", "soap"}


def build(wrapper_class: type, name: str, setup: Setup) -> tuple[nn.Module, Any]:
    model = wrap(wrapper_class, build_model(setup), setup)
    return model, standin.make(name, model.parameters())


def _full_settings(wrapper_class: type) -> dict[str, Any]:
    api = api_of(wrapper_class)
    return dict(state_dict_type=api.StateDictType.FULL_STATE_DICT,
                state_dict_config=api.FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
                optim_state_dict_config=api.FullOptimStateDictConfig(rank0_only=False))


def _snapshot(value: Any) -> Any:
    """A deep copy whose tensors are clones (to check later that nothing changed the original)."""
    return copy.deepcopy(value)


def _assert_same(actual: Any, expected: Any, path: str = "") -> None:
    """The same structure and values, tensors bit for bit."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if torch.is_tensor(expected):
        assert torch.equal(actual, expected), f"{path} changed"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key, value in expected.items():
            _assert_same(actual[key], value, f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for index, (mine, theirs) in enumerate(zip(actual, expected)):
            _assert_same(mine, theirs, f"{path}[{index}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def save_load_full(wrapper_class: type, model: nn.Module, optim: Any, fresh: nn.Module, fresh_optim: Any) -> None:
    """FULL model and optimizer state on every rank, loaded into ``fresh``; the saved dict must stay as it was."""
    with wrapper_class.state_dict_type(model, **_full_settings(wrapper_class)):
        model_state, optim_state = model.state_dict(), wrapper_class.optim_state_dict(model, optim)
    before = _snapshot(optim_state)
    with wrapper_class.state_dict_type(fresh, **_full_settings(wrapper_class)):
        fresh.load_state_dict(model_state)
        fresh_optim.load_state_dict(wrapper_class.optim_state_dict_to_load(fresh, fresh_optim, optim_state))
    _assert_same(optim_state, before, "the saved optimizer state dict")


def resumed_run(wrapper_class: type, name: str, setup: Setup, path: str) -> list[float]:
    model, optim = build(wrapper_class, name, setup)
    losses = diff.train(model, optim, FIRST)
    fresh, fresh_optim = build(wrapper_class, name, setup)
    if path == "full":
        save_load_full(wrapper_class, model, optim, fresh, fresh_optim)
    else:
        with shared_directory() as directory:
            save_checkpoint(wrapper_class, "osd_sharded_dcp", model, optim, directory)
            load_checkpoint(wrapper_class, "osd_sharded_dcp", fresh, fresh_optim, directory)
    del model, optim
    losses += diff.train(fresh, fresh_optim, SECOND, first_step=FIRST)
    if wrapper_class is FSDP:
        resumed_run.parameters = diff.full_parameters(fresh)  # type: ignore[attr-defined]
    return losses


def fsdp1_losses(name: str, setup: Setup) -> list[float]:
    """FSDP1's losses over the same 5 steps, uninterrupted: its own FULL optimizer state is corrupt on a
    CPU-only machine with ``use_orig_params=True`` (the contract: every state of a parameter aliases one
    gather buffer), so its resumed run is no oracle there."""
    model, optim = build(diff.TorchFSDP, name, setup)
    return diff.train(model, optim, FIRST + SECOND)


def check_resume(name: str, setup: Setup, path: str) -> None:
    diff.quiet()
    model, optim = build(FSDP, name, setup)
    uninterrupted = diff.train(model, optim, FIRST + SECOND)
    expected_parameters = diff.full_parameters(model)
    del model, optim
    losses = resumed_run(FSDP, name, setup, path)
    assert losses == uninterrupted, f"resumed {losses} != uninterrupted {uninterrupted}"
    for key, value in expected_parameters.items():
        assert torch.equal(resumed_run.parameters[key], value), f"{key} differs from the uninterrupted run"  # type: ignore[attr-defined]
    key = diff.golden_key(name, setup.strategy, f"orig{int(setup.use_orig_params)}", path)
    fsdp1 = diff.fsdp1_value(GOLDEN, key, lambda: fsdp1_losses(name, setup))
    diff.assert_close_lists(losses, fsdp1, rtol=2e-2 if name in LAYOUT_DEPENDENT else 1e-5,
                            what=f"{name}: losses against FSDP1's")


OPTIMIZERS = ["adamw", "sgd", "lion", "prodigy", "adafactor", "soap", "lamb", "schedule_free", "wrapper"]


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("name", OPTIMIZERS)
@distributed_test(world_size=2)
def test_full_state_of_any_optimizer_resumes_as_in_fsdp1(name, use_orig_params):
    check_resume(name, Setup(use_orig_params=use_orig_params), "full")


@pytest.mark.parametrize("name", ["adafactor", "soap", "prodigy", "schedule_free", "wrapper"])
@distributed_test(world_size=2)
def test_sharded_state_of_any_optimizer_resumes_as_in_fsdp1(name):
    check_resume(name, Setup(use_orig_params=True), "sharded")


@pytest.mark.parametrize("name", ["adafactor", "soap"])
@distributed_test(world_size=2)
def test_no_shard_state_shaped_unlike_the_parameter_resumes_as_in_fsdp1(name):
    """NO_SHARD parameters keep their shapes: AdaFactor's row / column moments are shaped unlike them."""
    check_resume(name, Setup(use_orig_params=True, strategy="NO_SHARD"), "full")


@distributed_test(world_size=2)
def test_loading_leaves_tensors_in_the_callers_param_groups_unchanged():
    """Prodigy's ``d_numerator`` lives in ``param_groups``: validating the load must not step it in place."""
    diff.quiet()
    model, optim = build(FSDP, "prodigy", Setup())
    diff.train(model, optim, 2)
    with FSDP.state_dict_type(model, **_full_settings(FSDP)):
        saved = FSDP.optim_state_dict(model, optim)
        before = _snapshot(saved)
        fresh = standin.make("prodigy", model.parameters())
        FSDP.optim_state_dict_to_load(model, fresh, saved)
    _assert_same(saved, before, "the saved optimizer state dict")
    assert fsdp_compat is not None and dist.is_initialized()
