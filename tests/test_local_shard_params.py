"""FSDP1's parameter model (``dtensor_params=False``, the default): outside forward and backward every
parameter is a plain 1-D tensor holding this rank's shard (under ``NO_SHARD``: the whole tensor, in its own
shape), and its ``.grad`` a plain local gradient of the same shape, as in FSDP1.

Code written for FSDP1 does its own distributed arithmetic on these tensors (OLMo's clipping, hand-written
optimizers, ``num_params()``); the oracle is torch FSDP1 running the same code (golden values in
``tests/golden/local_shard_params.json`` once torch drops it), and the engine's DTensor parameters
(``dtensor_params=True``) training bit-identically.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import distributed_test
from fsdp_compat.wrap import ModuleWrapPolicy
from tests import differential as diff

GOLDEN = "local_shard_params"
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP"]
STEPS = 3
LR = 0.05


def _wrap(strategy: str, fsdp1: bool = False, **kwargs) -> nn.Module:
    """The test model, auto-wrapped per block, ``use_orig_params=True``; ours unless ``fsdp1``."""
    model = diff.make_model(0)
    if fsdp1:
        return diff.TorchFSDP(model, auto_wrap_policy=diff.block_policy_torch(), use_orig_params=True,
                              sharding_strategy=getattr(diff.torch_fsdp.ShardingStrategy, strategy),
                              **diff.fsdp1_kwargs())
    kwargs.setdefault("dtensor_params", False)
    return FSDP(model, auto_wrap_policy=diff.block_policy_torch(), use_orig_params=True,
                sharding_strategy=getattr(diff.torch_fsdp.ShardingStrategy, strategy), **kwargs)


def _full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model):
        return {name: param.detach().clone() for name, param in model.named_parameters()}


def _olmo_grad_norm(model: nn.Module) -> float:
    """OLMo's clipping norm: local squared norms of the gradient shards, summed over ranks."""
    total = torch.zeros((), dtype=torch.float32)
    for param in model.parameters():
        if param.grad is not None:
            total += torch.linalg.vector_norm(param.grad, 2.0, dtype=torch.float32) ** 2
    dist.all_reduce(total)
    return total.sqrt().item()


def _sgd_by_hand(model: nn.Module, accumulate: str = "none") -> list[float]:
    """Plain-tensor SGD on ``p.data`` / ``p.grad`` (no torch optimizer), ``p.grad = None`` to zero;
    ``accumulate``: two micro-batches per step, the first under ``no_sync`` or not."""
    losses = []
    for step in range(STEPS):
        tokens, targets = diff.local_batch(step)
        if accumulate == "none":
            loss = diff.loss_fn(model, tokens, targets)
            loss.backward()
        else:
            half = tokens.size(0) // 2
            context = model.no_sync() if accumulate == "no_sync" else torch.enable_grad()
            with context:
                (diff.loss_fn(model, tokens[:half], targets[:half]) / 2).backward()
            loss = diff.loss_fn(model, tokens[half:], targets[half:]) / 2
            loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.data.add_(param.grad, alpha=-LR)
                param.grad = None
        losses.append(diff.mean_over_ranks(loss))
    return losses


@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_parameters_are_plain_local_shards_whose_numels_sum_to_the_model_size(strategy):
    diff.quiet()
    model = _wrap(strategy)
    params = list(model.parameters())
    assert not any(isinstance(param, DTensor) for param in params)
    assert all(param.dim() == 1 for param in params)
    local = torch.tensor(sum(param.numel() for param in params))
    dist.all_reduce(local)
    assert local.item() == sum(param.numel() for param in diff.make_model(0).parameters())


def _shapes_after_backward(model: nn.Module) -> dict[str, Any]:
    """Each parameter's and gradient's shape after one backward, and whether any is a DTensor."""
    diff.loss_fn(model, *diff.local_batch(0)).backward()
    named = [(diff.clean_name(name), param) for name, param in model.named_parameters()]
    return {"params": {name: list(param.shape) for name, param in named},
            "grads": {name: list(param.grad.shape) for name, param in named if param.grad is not None},
            "dtensor": any(isinstance(param, DTensor) or isinstance(param.grad, DTensor) for _, param in named)}


@distributed_test(world_size=2)
def test_no_shard_parameters_and_gradients_keep_their_shapes_as_fsdp1():
    """Under ``NO_SHARD`` FSDP1 shows every parameter whole, in its own shape (plain, not 1-D), and so
    its gradient and the optimizer state built from it; so do we."""
    diff.quiet()
    ours = _shapes_after_backward(_wrap("NO_SHARD"))
    full = {name: list(param.shape) for name, param in diff.make_model(0).named_parameters()}
    assert ours["params"] == full and ours["grads"] == full and not ours["dtensor"]
    expected = diff.fsdp1_value(GOLDEN, "no-shard-shapes",
                                lambda: _shapes_after_backward(_wrap("NO_SHARD", fsdp1=True)))
    assert ours == expected


@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_gradients_are_plain_local_shards_after_backward(strategy):
    diff.quiet()
    model = _wrap(strategy)
    diff.loss_fn(model, *diff.local_batch(0)).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert not isinstance(param.grad, DTensor), name
        assert param.grad.shape == param.shape, name


@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_olmo_style_clipping_norm_equals_fsdp1_clip_grad_norm(strategy):
    diff.quiet()
    model = _wrap(strategy)
    diff.loss_fn(model, *diff.local_batch(0)).backward()
    ours = _olmo_grad_norm(model)

    def fsdp1() -> list[float]:
        theirs = _wrap(strategy, fsdp1=True)
        diff.loss_fn(theirs, *diff.local_batch(0)).backward()
        return [theirs.clip_grad_norm_(1e9).item()]

    diff.check_against_fsdp1(GOLDEN, diff.golden_key("olmo-norm", strategy), [ours], fsdp1, rtol=1e-5)
    assert model.clip_grad_norm_(1e9).item() == pytest.approx(ours, rel=1e-6)


@distributed_test(world_size=2)
def test_clip_grad_norm_scales_the_plain_gradients():
    diff.quiet()
    model = _wrap("FULL_SHARD")
    diff.loss_fn(model, *diff.local_batch(0)).backward()
    total = model.clip_grad_norm_(0.5).item()
    assert total > 0.5
    assert _olmo_grad_norm(model) == pytest.approx(0.5, rel=1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_hand_written_sgd_on_data_and_grad_trains_like_fsdp1(strategy):
    diff.quiet()
    ours = _sgd_by_hand(_wrap(strategy))
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("sgd-by-hand", strategy), ours,
                             lambda: _sgd_by_hand(_wrap(strategy, fsdp1=True)))


@pytest.mark.parametrize("accumulate", ["no_sync", "synced"])
@distributed_test(world_size=2)
def test_gradient_accumulation_trains_like_fsdp1(accumulate):
    diff.quiet()
    ours = _sgd_by_hand(_wrap("FULL_SHARD"), accumulate)
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("accumulate", accumulate), ours,
                             lambda: _sgd_by_hand(_wrap("FULL_SHARD", fsdp1=True), accumulate))


@pytest.mark.parametrize("set_to_none", [True, False])
@distributed_test(world_size=2)
def test_optimizer_zero_grad_both_forms_train_like_fsdp1(set_to_none):
    diff.quiet()

    def train(model: nn.Module) -> list[float]:
        optimizer = diff.make_optimizer("sgd", model.parameters())
        losses = []
        for step in range(STEPS):
            loss = diff.loss_fn(model, *diff.local_batch(step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
            # (FSDP1 leaves .grad None where this rank holds no element of the parameter.)
            assert all((param.grad is None) == set_to_none for param in model.parameters() if param.numel())
            losses.append(diff.mean_over_ranks(loss))
        return losses

    ours = train(_wrap("FULL_SHARD"))
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("zero-grad", set_to_none), ours,
                             lambda: train(_wrap("FULL_SHARD", fsdp1=True)))


@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_plain_views_train_bit_identically_to_dtensor_parameters(strategy):
    diff.quiet()
    results = []
    for dtensor_params in (True, False):
        model = _wrap(strategy, dtensor_params=dtensor_params)
        losses = diff.train(model, diff.make_optimizer("adamw", model.parameters()), STEPS)
        results.append((losses, _full_parameters(model)))
    assert results[0][0] == results[1][0]
    for name, value in results[0][1].items():
        assert torch.equal(value, results[1][1][name]), name


@distributed_test(world_size=2)
def test_in_place_edits_on_views_reach_the_engine():
    diff.quiet()
    model = _wrap("FULL_SHARD")
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(0.5)
    with FSDP.summon_full_params(model):
        assert all(torch.all(param == 0.5) for param in model.parameters())


@distributed_test(world_size=2)
def test_replaced_data_is_written_back_to_the_engine():
    diff.quiet()
    model = _wrap("FULL_SHARD")
    for param in model.parameters():
        param.data = torch.full_like(param.data, 0.25)
    with FSDP.summon_full_params(model):
        assert all(torch.all(param == 0.25) for param in model.parameters())
    assert all(torch.all(param == 0.25) for param in model.parameters())


@distributed_test(world_size=2)
def test_assigned_gradients_reach_the_engine():
    diff.quiet()
    model = _wrap("FULL_SHARD")
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    local = sum(param.numel() for param in model.parameters())
    total = torch.tensor(float(local))
    dist.all_reduce(total)
    assert model.clip_grad_norm_(1e9).item() == pytest.approx(total.sqrt().item(), rel=1e-6)


@pytest.mark.parametrize("flat", [False, True])
@distributed_test(world_size=2)
def test_views_keep_their_identity_and_follow_a_dtype_change(flat):
    """``model.double()`` re-lays the storage out: the parameters (views, or flat parameters with
    ``use_orig_params=False``) keep their identity, become float64 and train; writes to them reach the model.
    The second step runs on what the first left shown after the re-layout."""
    diff.quiet()
    model = _wrap_flat() if flat else _wrap("FULL_SHARD")
    before = list(model.parameters())
    model.double()
    after = list(model.parameters())
    assert all(a is b for a, b in zip(before, after, strict=True))
    assert all(param.dtype == torch.float64 for param in after)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        diff.loss_fn(model, *diff.local_batch(step)).backward()
        assert all(param.grad is not None and param.grad.dtype == torch.float64 for param in after)
        optimizer.step()
    with torch.no_grad():
        for param in after:
            param.fill_(1.0)
    with FSDP.summon_full_params(model):
        assert all(torch.all(param == 1.0) for param in model.parameters())


def _olmo_restore(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """OLMo's checkpointer: each unit's flat parameters filled from a full state dict through
    ``_fqns`` / ``_shard_param_infos``."""
    paths = {id(sub): name for name, sub in model.named_modules()}
    with torch.no_grad():
        for unit in FSDP.fsdp_modules(model):
            prefix = ".".join(part for part in paths[id(unit)].split(".") if part and part != "_fsdp_wrapped_module")
            for flat in unit.params:
                for fqn, info in zip(flat._fqns, flat._shard_param_infos):
                    if not info.in_shard:
                        continue
                    key = f"{prefix}.{fqn}" if prefix else fqn
                    flat[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard].copy_(
                        full[key].flatten()[info.intra_param_start_idx:info.intra_param_end_idx + 1])


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_restoring_a_full_state_dict_through_shard_param_infos_loads_every_parameter(strategy, use_orig_params):
    diff.quiet()
    model = FSDP(diff.make_model(0), auto_wrap_policy=diff.block_policy_torch(), use_orig_params=use_orig_params,
                 sharding_strategy=getattr(diff.torch_fsdp.ShardingStrategy, strategy), dtensor_params=False)
    source = diff.make_model(1)
    full = {name: param.detach() for name, param in source.named_parameters()}
    _olmo_restore(model, full)
    restored = _full_parameters(model)
    expected = {name: param.detach().cpu() for name, param in source.named_parameters()}
    assert {diff.clean_name(name) for name in restored} == set(expected)
    for name, value in restored.items():
        assert torch.equal(value, expected[diff.clean_name(name)]), name


@distributed_test(world_size=2)
def test_flat_parameter_is_the_unit_flat_shard_and_its_grad_the_flat_gradient():
    diff.quiet()
    model = _wrap("FULL_SHARD")
    unit = FSDP.fsdp_modules(model)[1]
    flat = unit._flat_param
    assert flat is unit._handle.flat_param and flat is unit.params[0]
    assert flat._is_flat_param and not isinstance(flat, DTensor) and flat.dim() == 1
    assert sum(info.numel_in_shard or 0 for info in flat._shard_param_infos) == sum(
        param.numel() for param in flat._params)
    assert len(flat._fqns) == len(flat._numels) == len(flat._shapes) == len(flat._params)
    diff.loss_fn(model, *diff.local_batch(0)).backward()
    flat = unit._flat_param
    for param, info in zip(flat._params, flat._shard_param_infos):
        if info.in_shard:
            start = info.offset_in_shard
            assert torch.equal(flat.grad[start:start + info.numel_in_shard], param.grad)
            assert torch.equal(flat[start:start + info.numel_in_shard], param)


def assert_same_local_values(mine: Any, value: Any, what: Any) -> None:
    """Same kind (plain, DTensor or ShardedTensor), same layout, and this rank's values equal."""
    assert type(mine) is type(value), what
    if isinstance(value, DTensor):
        assert mine.placements == value.placements and torch.equal(mine.to_local(), value.to_local()), what
    elif type(value).__name__ == "ShardedTensor":
        assert mine.metadata() == value.metadata(), what
        assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(mine.local_shards(), value.local_shards())), what
    else:
        assert torch.equal(mine, value), what


def _adamw_state_after_training(dtensor_params: bool, state_dict_type: str) -> tuple[FSDP, torch.optim.Optimizer,
                                                                                   dict]:
    model = _wrap("FULL_SHARD", dtensor_params=dtensor_params)
    optimizer = diff.make_optimizer("adamw", model.parameters())
    diff.train(model, optimizer, 2)
    FSDP.set_state_dict_type(model, getattr(diff.torch_fsdp.StateDictType, state_dict_type))
    return model, optimizer, FSDP.optim_state_dict(model, optimizer)


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
@distributed_test(world_size=2)
def test_optimizer_state_is_plain_and_saves_as_with_dtensor_parameters(state_dict_type):
    diff.quiet()
    model, optimizer, ours = _adamw_state_after_training(False, state_dict_type)
    for param in model.parameters():
        for value in optimizer.state[param].values():
            assert not isinstance(value, DTensor)
            assert value.dim() == 0 or value.shape == param.shape
    _, _, expected = _adamw_state_after_training(True, state_dict_type)
    assert ours["param_groups"] == expected["param_groups"]
    assert list(ours["state"]) == list(expected["state"])
    for name, state in expected["state"].items():
        for key, value in state.items():
            assert_same_local_values(ours["state"][name][key], value, (name, key))


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
@distributed_test(world_size=2)
def test_optimizer_state_round_trip_resumes_training_exactly(state_dict_type):
    diff.quiet()
    model, optimizer, saved = _adamw_state_after_training(False, state_dict_type)
    model_state = model.state_dict()
    expected = diff.train(model, optimizer, 2, first_step=2)
    resumed = _wrap("FULL_SHARD")
    FSDP.set_state_dict_type(resumed, getattr(diff.torch_fsdp.StateDictType, state_dict_type))
    resumed.load_state_dict(model_state)
    new_optimizer = diff.make_optimizer("adamw", resumed.parameters())
    new_optimizer.load_state_dict(FSDP.optim_state_dict_to_load(resumed, new_optimizer, saved))
    assert diff.train(resumed, new_optimizer, 2, first_step=2) == expected


@distributed_test(world_size=2)
def test_ranks_keeping_their_shards_under_rank0_only_see_their_plain_views():
    diff.quiet()
    model = _wrap("FULL_SHARD")
    before = list(model.parameters())
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        inside = list(model.parameters())
        assert not any(isinstance(param, DTensor) for param in inside)
        if dist.get_rank() != 0:
            assert all(a is b for a, b in zip(inside, before, strict=True))
    assert all(a is b for a, b in zip(model.parameters(), before, strict=True))


def _wrap_flat(fsdp1: bool = False) -> nn.Module:
    """The test model, auto-wrapped per block, ``use_orig_params=False``; ours unless ``fsdp1``."""
    kwargs = diff.fsdp1_kwargs() if fsdp1 else {"dtensor_params": False}
    return (diff.TorchFSDP if fsdp1 else FSDP)(diff.make_model(0), auto_wrap_policy=diff.block_policy_torch(),
                                               use_orig_params=False, **kwargs)


@distributed_test(world_size=2)
def test_use_orig_params_false_parameters_are_one_flat_parameter_per_unit_named_as_fsdp1():
    diff.quiet()
    model = _wrap_flat()
    names = [name for name, _ in model.named_parameters()]
    assert names == diff.fsdp1_value(GOLDEN, diff.golden_key("flat-names"),
                                     lambda: [name for name, _ in _wrap_flat(fsdp1=True).named_parameters()])
    params = list(model.parameters())
    assert all(param._is_flat_param and param.dim() == 1 and not isinstance(param, DTensor) for param in params)
    assert [param for unit in FSDP.fsdp_modules(model) for param in unit.params] == params
    local = torch.tensor(sum(param.numel() for param in params))
    dist.all_reduce(local)
    padding = sum(sum(info.numel_in_shard or 0 for info in param._shard_param_infos) for param in params)
    assert local.item() >= sum(param.numel() for param in diff.make_model(0).parameters())
    assert padding <= sum(param.numel() for param in params)


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
@distributed_test(world_size=2)
def test_optimizer_over_flat_parameters_trains_like_fsdp1(optimizer_name):
    diff.quiet()

    def train(model: nn.Module) -> list[float]:
        return diff.train(model, diff.make_optimizer(optimizer_name, model.parameters()), STEPS)

    ours = train(_wrap_flat())
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("flat-train", optimizer_name), ours,
                             lambda: train(_wrap_flat(fsdp1=True)))


def _train_handling_flat_gradients(model: nn.Module) -> list[float]:
    """Steps that touch the flat parameters' ``.grad`` the ways trainers do: zeroed in place, accumulated over
    two backwards, replaced by a new tensor, cleared between forward and backward (Lightning's closure)."""
    optimizer = diff.make_optimizer("sgd", model.parameters())
    losses = []

    def backward(step: int) -> None:
        loss = diff.loss_fn(model, *diff.local_batch(step))
        loss.backward()
        losses.append(diff.mean_over_ranks(loss))

    backward(0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # zeroed in place: the next backward accumulates into it
    backward(1)
    backward(2)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    backward(3)
    for param in model.parameters():
        param.grad = param.grad * 0.5  # a new tensor: the optimizer must step with its values
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = diff.loss_fn(model, *diff.local_batch(4))
    optimizer.zero_grad(set_to_none=True)  # between forward and backward: nothing to clear, nothing stale
    loss.backward()
    optimizer.step()
    backward(5)
    return losses


def _check_flat_training_against_fsdp1(key: str, train: Callable[[nn.Module], list[float]]) -> None:
    """``train`` on our flat-parameter model gives FSDP1's losses (or their golden copy)."""
    diff.quiet()
    diff.check_against_fsdp1(GOLDEN, diff.golden_key(key), train(_wrap_flat()),
                             lambda: train(_wrap_flat(fsdp1=True)))


@distributed_test(world_size=2)
def test_flat_gradients_zeroed_accumulated_replaced_or_cleared_train_as_fsdp1():
    _check_flat_training_against_fsdp1("flat-grad-handling", _train_handling_flat_gradients)


def _train_changing_flat_parameters_between_forward_and_backward(model: nn.Module) -> list[float]:
    """Steps whose flat parameters change where no backward follows at once: their gradients replaced, or
    given new storage, between a forward and its backward; a flat parameter frozen and unfrozen between steps;
    evaluation forwards between steps. Each change must reach the backward and optimizer step that follow."""
    optimizer = diff.make_optimizer("sgd", model.parameters())
    params = list(model.parameters())
    losses = []

    def step(index: int, between: Callable[[], None] = lambda: None) -> None:
        loss = diff.loss_fn(model, *diff.local_batch(index))
        between()
        loss.backward()
        optimizer.step()
        losses.append(diff.mean_over_ranks(loss))

    def halve_gradients() -> None:
        for param in params:
            param.grad = param.grad * 0.5  # a new tensor: the backward accumulates into it

    def gradients_on_new_storage() -> None:
        for param in params:
            param.grad.data = torch.full_like(param.grad, 1e-3)  # the same object over new memory

    step(0)  # gradients kept: the next backward accumulates
    step(1, halve_gradients)
    step(2, gradients_on_new_storage)
    optimizer.zero_grad(set_to_none=True)
    params[1].requires_grad_(False)
    step(3)
    with torch.no_grad():
        for index in (4, 5):
            losses.append(diff.mean_over_ranks(diff.loss_fn(model, *diff.local_batch(index))))
    params[1].requires_grad_(True)
    optimizer.zero_grad(set_to_none=True)
    step(6)
    with torch.no_grad():  # the last step's update, seen through the model
        losses.append(diff.mean_over_ranks(diff.loss_fn(model, *diff.local_batch(7))))
    return losses


@distributed_test(world_size=2)
def test_flat_parameters_changed_between_forward_and_backward_or_between_steps_train_as_fsdp1():
    _check_flat_training_against_fsdp1("flat-changes-between",
                                       _train_changing_flat_parameters_between_forward_and_backward)


@distributed_test(world_size=2)
def test_flat_gradient_after_backward_holds_every_piece_gradient():
    diff.quiet()
    model = _wrap_flat()
    diff.loss_fn(model, *diff.local_batch(0)).backward()
    for param in model.parameters():
        assert param.grad is not None and param.grad.shape == param.shape
    ours = _olmo_grad_norm(model)
    reference = _wrap("FULL_SHARD")
    diff.loss_fn(reference, *diff.local_batch(0)).backward()
    assert ours == pytest.approx(_olmo_grad_norm(reference), rel=1e-6)


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
@distributed_test(world_size=2)
def test_flat_parameter_optimizer_state_saves_as_with_dtensor_parameters_and_resumes(state_dict_type):
    diff.quiet()
    kind = getattr(diff.torch_fsdp.StateDictType, state_dict_type)
    saved = {}
    for dtensor_params in (True, False):
        model = FSDP(diff.make_model(0), auto_wrap_policy=diff.block_policy_torch(), use_orig_params=False,
                     dtensor_params=dtensor_params)
        optimizer = diff.make_optimizer("adamw", model.parameters())
        diff.train(model, optimizer, 2)
        FSDP.set_state_dict_type(model, kind)
        saved[dtensor_params] = (FSDP.optim_state_dict(model, optimizer), model.state_dict())
    ours, expected = saved[False][0], saved[True][0]
    assert list(ours["state"]) == list(expected["state"])
    for name, state in expected["state"].items():
        for key, value in state.items():
            assert_same_local_values(ours["state"][name][key], value, (name, key))
    expected_losses = diff.train(model, optimizer, 2, first_step=2)  # the last (plain) run, uninterrupted
    resumed = _wrap_flat()
    FSDP.set_state_dict_type(resumed, kind)
    resumed.load_state_dict(saved[False][1])
    new_optimizer = diff.make_optimizer("adamw", resumed.parameters())
    new_optimizer.load_state_dict(FSDP.optim_state_dict_to_load(resumed, new_optimizer, ours))
    assert diff.train(resumed, new_optimizer, 2, first_step=2) == expected_losses


@distributed_test(world_size=2)
def test_the_engine_still_has_the_storage_names_the_views_rely_on():
    """A torch upgrade that renames these makes the views silently stale: fail here, by name."""
    from fsdp_compat import _engine, _engine_flat

    model = _wrap("FULL_SHARD", dtensor_params=True)
    for owner, names in _engine_flat.ENGINE_NAMES.items():
        for name in names:
            assert callable(getattr(owner, name, None)), f"{owner.__qualname__}.{name}"
    fsdp_param = _engine.managed_params(model.module)[0]
    for name in ("_sharded_param_data", "padded_sharded_param_size", "sharded_size", "sharded_state",
                 "_module_info", "fsdp_placement", "mesh_info"):
        assert hasattr(fsdp_param, name), f"FSDPParam.{name}"
    assert hasattr(fsdp_param.sharded_param, "_local_tensor")
    assert hasattr(_engine.engine_state(model.module)._state_ctx, "all_states")
    # The transitions around forward and in no_sync (views back after an evaluation forward, gradients in no_sync).
    state = _engine.engine_state(model.module)
    assert hasattr(state, "_fsdp_param_groups") and hasattr(state._state_ctx, "iter_forward_root")
    for name in ("unsharded_param", "_unsharded_param", "unsharded_accumulated_grad",
                 "_sharded_post_forward_param", "_param_fqn"):
        # Some are set only at the first all-gather: the class's annotations name them.
        known = set(dir(type(fsdp_param))) | set(type(fsdp_param).__annotations__) | set(vars(fsdp_param))
        assert name in known, f"FSDPParam.{name}"
    assert all(hasattr(group, "is_unsharded") and callable(getattr(group, "reshard", None))
               for group in _engine.param_groups(model.module))
    assert callable(getattr(torch._C, "_current_graph_task_id", None))
    # Adopting the reduce-scatter output as the flat gradient is unsafe while the engine keeps it.
    assert all(hasattr(group, "_partial_reduce_output") for group in _engine.param_groups(model.module))
    # FSDP_USE_FULL_PREC_IN_EVAL switches a unit's precision with its own buffers per precision.
    assert all(hasattr(fsdp_param, name) for name in ("all_gather_outputs", "_unsharded_inner_tensors", "mp_policy"))
    # (torch 2.13's groups also hold the policy, 2.15's read it from each parameter: both are set)
    assert all(hasattr(group, "_all_gather_result") and callable(group.unshard) and callable(group._init_mp_dtypes)
               for group in _engine.param_groups(model.module))
    assert hasattr(state, "_mp_policy")
    # The one-rank all-reduce buffer's release records it on this stream: a GPU-only path (set at lazy init).
    assert all("self.all_reduce_stream" in inspect.getsource(type(group.comm_ctx)) and
               hasattr(group, "_all_reduce_state") for group in _engine.param_groups(model.module))
    # A replicate group over one rank reduces as a one-rank fully_shard group (no all-reduce) unless one of
    # these asks for the all-reduce; its reduce buffer is then the last reduce-scatter state's input.
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import ReduceScatterState
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    assert "reduce_scatter_input" in ReduceScatterState._fields
    assert "shard_mesh_dim" in inspect.signature(FSDPMeshInfo).parameters
    assert all(hasattr(group, "_all_reduce_hook") and group.all_reduce_grads is True and  # (states: set at lazy init)
               "self.reduce_scatter_states" in inspect.getsource(type(group.comm_ctx))
               for group in _engine.param_groups(model.module))


@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_optimizer_built_before_wrapping_trains_the_plain_views(strategy):
    diff.quiet()
    results = []
    for before in (True, False):
        model = diff.make_model(0)
        optimizer = diff.make_optimizer("adamw", model.parameters()) if before else None
        model = FSDP(model, auto_wrap_policy=diff.block_policy_torch(), use_orig_params=True, dtensor_params=False,
                     sharding_strategy=getattr(diff.torch_fsdp.ShardingStrategy, strategy))
        optimizer = optimizer or diff.make_optimizer("adamw", model.parameters())
        results.append((diff.train(model, optimizer, STEPS), _full_parameters(model)))
        if before:
            assert all(not isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])
    assert results[0][0] == results[1][0]
    for name, value in results[1][1].items():
        assert torch.equal(results[0][1][name], value), name


def _two_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _adamw_losses(model: nn.Module, zero_grad_after_forward: bool, sharded: bool) -> list[float]:
    """AdamW steps on the same global batch per step (each rank its half when ``sharded``); with
    ``zero_grad_after_forward`` the gradients are cleared between forward and backward, as Lightning's
    training closure does."""
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        inputs, targets = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
        if sharded:
            rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
            inputs, targets = inputs[rows], targets[rows]
        if not zero_grad_after_forward:
            optim.zero_grad()
        loss = nn.functional.mse_loss(model(inputs.to(diff.device())), targets.to(diff.device()))
        if zero_grad_after_forward:
            optim.zero_grad()
        loss.backward()
        optim.step()
        value = loss.detach().clone()
        if sharded:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses


@pytest.mark.parametrize("zero_grad_after_forward", [False, True])
@distributed_test(world_size=2)
def test_a_root_without_parameters_of_its_own_trains_like_the_unsharded_model(zero_grad_after_forward):
    """Every parameter in nested units, none in the root (Lightning's module around ``nn.Linear`` units):
    the gradients still reach the plain views after backward, and a ``zero_grad()`` between forward and
    backward clears them (the engine does not accumulate into the cleared gradients)."""
    diff.quiet()
    model = FSDP(_two_linears().to(diff.device()), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                 use_orig_params=True, dtensor_params=False)
    assert not list(model.module.parameters(recurse=False))
    ours = _adamw_losses(model, zero_grad_after_forward, sharded=True)
    reference = _adamw_losses(_two_linears().to(diff.device()), zero_grad_after_forward, sharded=False)
    diff.assert_close_lists(ours, reference, rtol=1e-5, what="losses vs the unsharded model")
