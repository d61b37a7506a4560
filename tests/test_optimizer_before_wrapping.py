"""An optimizer built on the unwrapped model keeps training it after wrapping.

Lightning Fabric's ``setup(model, optimizer)``, accelerate's ``prepare(model, optimizer)`` and much
hand-written FSDP1 code build the optimizer first and wrap afterwards. The oracle is the same run
with the optimizer built after wrapping: both must give bit-identical losses and parameters, and
the parameters must have changed (the silent failure was an optimizer updating tensors the model
no longer held). The wrapper's own parameter objects must also stay the same through everything
that reloads or re-types them, or an optimizer built after wrapping would go stale the same way.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import fsdp_compat
import fsdp_compat.fully_sharded_data_parallel as fsdp_module
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.examples import Block
from fsdp_compat.testing import distributed_test
from fsdp_compat.wrap import ModuleWrapPolicy
from tests import differential as diff
from tests.test_mixed_precision import wrapper_kwargs
from tests.test_optim_state_resume import shared_directory

STEPS = 3
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]


def wrap(model: nn.Module, strategy: str, nesting: str, use_orig_params: bool, **kwargs) -> FSDP:
    """``model`` wrapped by an auto-wrap policy or by manually nested wrappers."""
    options = dict(wrapper_kwargs(True, strategy), use_orig_params=use_orig_params, **kwargs)
    if nesting == "auto":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **options)
    for index, block in enumerate(model.blocks):
        model.blocks[index] = FSDP(block, **options)
    return FSDP(model, **options)


def run(strategy: str, nesting: str, use_orig_params: bool, optimizer_first: bool,
        **kwargs) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses, initial and final full parameters of a short AdamW run."""
    model = diff.make_model(0)
    optimizer = diff.make_optimizer("adamw", model.parameters()) if optimizer_first else None
    model = wrap(model, strategy, nesting, use_orig_params, **kwargs)
    initial = diff.full_parameters(model)
    if optimizer is None:
        optimizer = diff.make_optimizer("adamw", model.parameters())
    losses = diff.train(model, optimizer, STEPS)
    return losses, initial, diff.full_parameters(model)


def assert_trains_like_optimizer_built_after(strategy: str, nesting: str, use_orig_params: bool,
                                             **kwargs) -> None:
    losses, initial, final = run(strategy, nesting, use_orig_params, True, **kwargs)
    expected_losses, _, expected = run(strategy, nesting, use_orig_params, False, **kwargs)
    what = f"{strategy}, {nesting} nesting, use_orig_params={use_orig_params}"
    assert losses == expected_losses, what
    for name in expected:
        assert not torch.equal(final[name], initial[name]), f"{name} did not train ({what})"
        assert torch.equal(final[name], expected[name]), f"{name} differs ({what})"


def _plain_flat_mode(use_orig_params: bool) -> bool:
    """FSDP1's flat parameters (plain mode, ``use_orig_params=False``): the optimizer is not re-pointed."""
    return not use_orig_params and not fsdp_module.DTENSOR_PARAMS


@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2)
def test_optimizer_built_before_wrapping_trains_like_one_built_after(use_orig_params):
    diff.quiet()
    if _plain_flat_mode(use_orig_params):
        pytest.skip("flat parameters: see test_flat_parameters_leave_an_optimizer_built_before_wrapping_idle")
    for strategy in STRATEGIES:
        for nesting in ("auto", "manual"):
            assert_trains_like_optimizer_built_after(strategy, nesting, use_orig_params)


def _idle_optimizer_run(wrapper_class: type) -> dict[str, bool]:
    """One step of an SGD built on the unwrapped model, then wrapped with flat parameters."""
    model = diff.make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = diff.fsdp1_kwargs() if wrapper_class is diff.TorchFSDP else {"dtensor_params": False}
    policy = diff.block_policy_torch() if wrapper_class is diff.TorchFSDP else ModuleWrapPolicy({Block})
    model = wrapper_class(model, auto_wrap_policy=policy, use_orig_params=False, **kwargs)
    initial = diff.full_parameters(model)
    diff.train(model, optimizer, 1)
    after = diff.full_parameters(model)
    return {"unchanged": all(torch.equal(initial[name], after[name]) for name in initial),
            "no grads on its parameters": all(p.grad is None for g in optimizer.param_groups for p in g["params"])}


@distributed_test(world_size=2)
def test_flat_parameters_leave_an_optimizer_built_before_wrapping_idle():
    """FSDP1's flat parameters (``dtensor_params=False``, ``use_orig_params=False``) replace the
    originals: an optimizer built on them before wrapping gets no gradients and steps nothing, as
    with FSDP1 (README, limits). Build it after wrapping, or use ``use_orig_params=True``."""
    diff.quiet()
    ours = _idle_optimizer_run(FSDP)
    assert ours == {"unchanged": True, "no grads on its parameters": True}
    if diff.HAVE_FSDP1:
        assert _idle_optimizer_run(diff.TorchFSDP) == ours


@distributed_test(world_size=2)
def test_optimizer_built_before_wrapping_trains_with_cpu_offload():
    diff.quiet()
    assert_trains_like_optimizer_built_after("FULL_SHARD", "auto", True,
                                             cpu_offload=fsdp_compat.CPUOffload(offload_params=True))


@distributed_test(world_size=2)
def test_tied_weight_is_one_parameter_of_an_optimizer_built_before_wrapping():
    diff.quiet()
    model = diff.make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    assert model.head.weight is model.tok_emb.weight
    model = wrap(model, "FULL_SHARD", "auto", True)
    diff.train(model, optimizer, 1)
    (params,) = [group["params"] for group in optimizer.param_groups]
    assert len(params) == len(list(model.parameters()))
    assert {id(p) for p in params} == {id(p) for p in model.parameters()}
    inner = model.module
    assert inner.head.weight is inner.tok_emb.weight


@distributed_test(world_size=2)
def test_ignored_parameters_stay_the_same_objects_and_train():
    diff.quiet()
    model = diff.make_model(0)
    ignored = model.ln_f.weight
    before = ignored.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), ignored_states=[ignored],
                 use_orig_params=True)
    assert model.module.ln_f.weight is ignored
    diff.train(model, optimizer, 1)
    assert model.module.ln_f.weight is ignored
    assert not torch.equal(ignored.detach(), before)


@distributed_test(world_size=2)
def test_meta_device_model_with_optimizer_built_before_wrapping_trains_like_one_built_after():
    diff.quiet()

    def run_meta(optimizer_first: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = diff.make_model(0, on_device=False)
        optimizer = diff.make_optimizer("adamw", model.parameters()) if optimizer_first else None
        torch.manual_seed(0)
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                     device_id=diff.device())
        if optimizer is None:
            optimizer = diff.make_optimizer("adamw", model.parameters())
        diff.train(model, optimizer, STEPS)
        return diff.full_parameters(model)

    before, after = run_meta(True), run_meta(False)
    for name in after:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2)
def test_optimizer_state_dict_family_accepts_an_optimizer_built_before_wrapping(use_orig_params):
    diff.quiet()
    if _plain_flat_mode(use_orig_params):
        pytest.skip("flat parameters: see test_flat_parameters_leave_an_optimizer_built_before_wrapping_idle")
    states = []
    for optimizer_first in (True, False):
        model = diff.make_model(0)
        optimizer = diff.make_optimizer("adamw", model.parameters()) if optimizer_first else None
        model = wrap(model, "FULL_SHARD", "auto", use_orig_params)
        optimizer = optimizer or diff.make_optimizer("adamw", model.parameters())
        # Before the first step too: FSDP1 code may checkpoint right after setup.
        untrained = FSDP.optim_state_dict(model, optimizer)
        diff.train(model, optimizer, 1)
        with FSDP.state_dict_type(model, fsdp_compat.StateDictType.FULL_STATE_DICT):
            full = FSDP.optim_state_dict(model, optimizer)
        loaded = FSDP.optim_state_dict_to_load(model, optimizer, full)
        optimizer.load_state_dict(loaded)
        states.append((untrained, full, FSDP.full_optim_state_dict(model, optimizer)))
    for before, after in zip(states[0], states[1]):
        if not after:  # full_optim_state_dict is rank 0's only
            assert before == after
            continue
        assert before.keys() == after.keys() and before["param_groups"] == after["param_groups"]
        assert before["state"].keys() == after["state"].keys()
        for name, state in after["state"].items():
            for key, value in state.items():
                assert torch.equal(before["state"][name][key], value), (name, key)


def parameter_ids(model: nn.Module) -> list[int]:
    return [id(p) for p in model.parameters()]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@distributed_test(world_size=2)
def test_parameter_objects_survive_reloads_and_edits(strategy):
    diff.quiet()
    model = wrap(diff.make_model(0), strategy, "auto", True)
    optimizer = diff.make_optimizer("sgd", model.parameters())
    ids = parameter_ids(model)
    diff.train(model, optimizer, 1)
    for state_dict_type in (fsdp_compat.StateDictType.FULL_STATE_DICT,
                            fsdp_compat.StateDictType.SHARDED_STATE_DICT):
        with FSDP.state_dict_type(model, state_dict_type):
            model.load_state_dict(model.state_dict())
        assert parameter_ids(model) == ids, f"load_state_dict ({state_dict_type})"
    with FSDP.summon_full_params(model, writeback=True):
        model.module.ln_f.weight.data.add_(1.0)
    assert parameter_ids(model) == ids, "summon_full_params(writeback=True)"
    model.apply(lambda module: None)
    assert parameter_ids(model) == ids, "apply"
    with FSDP.state_dict_type(model, fsdp_compat.StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        with shared_directory() as path:
            dcp.save(state, checkpoint_id=path)
            dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
    assert parameter_ids(model) == ids, "torch.distributed.checkpoint load"
    before = diff.full_parameters(model)
    diff.train(model, optimizer, 1)
    after = diff.full_parameters(model)
    assert all(not torch.equal(before[name], after[name]) for name in after), "stopped training"
