"""FSDP1's parameters at every moment user code runs: after an evaluation forward (no backward), after
freezing, inside and after ``no_sync``, after a module attribute is replaced, around
``summon_full_params(rank0_only=True)``.

Each test runs one user pattern three ways: the single-process unsharded model, torch FSDP1 (golden values
in ``tests/golden/param_transitions.json`` once torch drops it) and ours. Where FSDP1 is right, ours must
equal it; where FSDP1 computes with a stale unsharded buffer (pytorch#144289: a unit it keeps unsharded
after a forward without backward, the root or every unit under ``SHARD_GRAD_OP``, ignores what the user
wrote to its shards meanwhile), ours must equal the unsharded model (README, "What a parameter is").
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import distributed_test
from tests import differential as diff

GOLDEN = "param_transitions"
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
STEPS = 4


def _model(kind: str, strategy: str = "FULL_SHARD", use_orig_params: bool = True) -> nn.Module:
    """The seeded test model: unsharded (``ref``), torch FSDP1 (``fsdp1``) or ours, wrapped per block."""
    diff.quiet()
    model = diff.make_model(0)
    if kind == "ref":
        return model
    sharding = getattr(diff.torch_fsdp.ShardingStrategy, strategy)
    if kind == "fsdp1":
        return diff.TorchFSDP(model, auto_wrap_policy=diff.block_policy_torch(), use_orig_params=use_orig_params,
                              sharding_strategy=sharding, **diff.fsdp1_kwargs())
    return FSDP(model, auto_wrap_policy=diff.block_policy_torch(), use_orig_params=use_orig_params,
                sharding_strategy=sharding)


def _batch(step: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch; the whole batch for the unsharded model."""
    if kind == "ref":
        return diff.synthetic_batch(step, diff.GLOBAL_BATCH, diff.GPTConfig(), diff.device())
    return diff.local_batch(step)


def _mean(loss: torch.Tensor, kind: str) -> float:
    """The global mean of a per-rank loss (the loss itself for the unsharded model)."""
    value = loss.detach().clone()
    if kind != "ref":
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, kind: str) -> float:
    tokens, targets = _batch(step, kind)
    loss = diff.loss_fn(model, tokens, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return _mean(loss, kind)


def _eval_loss(model: nn.Module, step: int, kind: str) -> float:
    """An evaluation forward, without autograd (no backward follows)."""
    model.eval()
    with torch.no_grad():
        tokens, targets = _batch(1000 + step, kind)
        loss = _mean(diff.loss_fn(model, tokens, targets), kind)
    model.train()
    return loss


def _check(name: str, kind_losses: Any, strategy: str, *key: Any, fsdp1_right: bool) -> None:
    """Ours equals the unsharded model, and FSDP1 where it is right (``fsdp1_right``)."""
    ours, reference = kind_losses("ours"), kind_losses("ref")
    diff.assert_close_lists(ours, reference, rtol=1e-5, what=f"{name} vs the unsharded model")
    if fsdp1_right:
        diff.check_against_fsdp1(GOLDEN, diff.golden_key(name, strategy, *key), ours,
                                 lambda: kind_losses("fsdp1"))


# ---- item: a forward without backward (evaluation) -------------------------------------------------


def _ema_losses(kind: str, strategy: str, use_orig_params: bool) -> list[float]:
    """Train; after each step update an EMA of the weights, swap it in with ``p.data.copy_``, evaluate,
    swap the trained weights back (timm's / Lightning callbacks' pattern)."""
    model = _model(kind, strategy, use_orig_params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = [param.detach().clone() for param in model.parameters()]
    losses = []
    for step in range(STEPS):
        losses.append(_train_step(model, optimizer, step, kind))
        with torch.no_grad():
            for average, param in zip(ema, model.parameters()):
                average.mul_(0.5).add_(param.detach(), alpha=0.5)
        backup = [param.detach().clone() for param in model.parameters()]
        for param, average in zip(model.parameters(), ema):
            param.data.copy_(average)
        losses.append(_eval_loss(model, step, kind))
        for param, saved in zip(model.parameters(), backup):
            param.data.copy_(saved)
    return losses


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_an_ema_swapped_in_for_evaluation_and_back_is_lossless(strategy, use_orig_params):
    _check("ema", lambda kind: _ema_losses(kind, strategy, use_orig_params), strategy, use_orig_params,
           fsdp1_right=strategy == "NO_SHARD")


class _ScheduleFreeSGD(torch.optim.Optimizer):
    """Schedule-free SGD's parameter handling (``schedulefree.SGDScheduleFree``): the parameters hold
    ``y`` while training and ``x`` after ``eval()``; ``eval()`` and ``train()`` rewrite ``p.data`` in place."""

    def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})
        self.steps, self.training = 0, True
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param] = {"z": param.detach().clone(), "x": param.detach().clone()}

    @torch.no_grad()
    def eval(self) -> None:  # p <- x
        for group in self.param_groups:
            for param in group["params"]:
                param.data.copy_(self.state[param]["x"])
        self.training = False

    @torch.no_grad()
    def train(self) -> None:  # p <- y = (1 - beta) z + beta x
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                param.data.copy_(torch.lerp(state["z"], state["x"], group["beta"]))
        self.training = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.steps += 1
        weight = 1.0 / self.steps
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                state["z"].add_(param.grad, alpha=-group["lr"])
                state["x"].lerp_(state["z"], weight)
                param.lerp_(torch.lerp(state["z"], state["x"], group["beta"]), 1.0)  # p <- y, in place


def _schedule_free_losses(kind: str, strategy: str, use_orig_params: bool) -> list[float]:
    model = _model(kind, strategy, use_orig_params)
    optimizer = _ScheduleFreeSGD(model.parameters())
    losses = []
    for step in range(STEPS):
        losses.append(_train_step(model, optimizer, step, kind))
        optimizer.eval()
        losses.append(_eval_loss(model, step, kind))
        optimizer.train()
    return losses


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_schedule_free_in_place_rewrites_between_eval_and_train_train_as_unsharded(strategy, use_orig_params):
    _check("schedule_free", lambda kind: _schedule_free_losses(kind, strategy, use_orig_params), strategy,
           use_orig_params, fsdp1_right=strategy == "NO_SHARD")


@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_after_an_evaluation_forward_the_parameters_are_the_optimizer_s(strategy):
    model = _model("ours", strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, optimizer, 0, "ours")
    before = [(name, param) for name, param in model.named_parameters()]
    _eval_loss(model, 0, "ours")
    after = [(name, param) for name, param in model.named_parameters()]
    assert [(name, id(param)) for name, param in after] == [(name, id(param)) for name, param in before]
    optimizer_state = FSDP.optim_state_dict(model, optimizer)  # every parameter is the optimizer's
    assert set(optimizer_state["state"]) == {diff.clean_name(name) for name, _ in before}


@distributed_test(world_size=2)
def test_after_an_evaluation_forward_under_mixed_precision_the_parameters_are_the_fp32_views():
    diff.quiet()
    model = FSDP(diff.make_model(0), auto_wrap_policy=diff.block_policy_torch(), use_orig_params=True,
                 mixed_precision=diff.torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16))
    before = {name: param for name, param in model.named_parameters()}
    with torch.no_grad():
        model(_batch(0, "ours")[0])
    after = dict(model.named_parameters())
    assert all(after[name] is param for name, param in before.items())
    assert all(param.dtype == torch.float32 and param.dim() == 1 for param in after.values())


def _forward_with_autograd_then_edit_losses(kind: str, strategy: str) -> list[float]:
    """A forward with autograd but no backward (a validation loss computed outside ``no_grad``), then
    the weights edited in place, then training: the next forward must see the edit."""
    model = _model(kind, strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        tokens, targets = _batch(500 + step, kind)
        losses.append(_mean(diff.loss_fn(model, tokens, targets), kind))
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(0.99)
        losses.append(_train_step(model, optimizer, step, kind))
    return losses


@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_a_forward_with_autograd_but_no_backward_then_edits_trains_as_unsharded(strategy):
    _check("forward_without_backward", lambda kind: _forward_with_autograd_then_edit_losses(kind, strategy),
           strategy, fsdp1_right=strategy == "NO_SHARD")


# ---- item: freezing after wrapping ------------------------------------------------------------------


def _frozen_block_run(kind: str, strategy: str, use_orig_params: bool) -> tuple[list[float], dict[str, Any]]:
    """Freeze block 0 after wrapping (``requires_grad_(False)`` on what its ``parameters()`` yields: the
    flat parameter with ``use_orig_params=False``, as torch's own freezing tests do), train with weight
    decay; the losses and block 0's full weights before and after."""
    model = _model(kind, strategy, use_orig_params)
    block = model.blocks[0] if kind == "ref" else model.module.blocks[0]
    for param in block.parameters():
        param.requires_grad_(False)
    before = _block_weights(model, kind)
    optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=1e-2,
                                  weight_decay=0.1)
    losses = [_train_step(model, optimizer, step, kind) for step in range(STEPS)]
    return losses, {"before": before, "after": _block_weights(model, kind)}


def _block_weights(model: nn.Module, kind: str) -> dict[str, torch.Tensor]:
    full = diff.full_parameters(model) if kind != "ref" else {
        name: param.detach().clone() for name, param in model.named_parameters()}
    return {name: value for name, value in full.items() if name.startswith("blocks.0.")}


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_parameters_frozen_after_wrapping_stay_bit_identical(strategy, use_orig_params):
    losses, weights = _frozen_block_run("ours", strategy, use_orig_params)
    assert weights["before"], "block 0 has parameters"
    for name, value in weights["before"].items():
        assert torch.equal(weights["after"][name], value), f"{name} trained although frozen"
    reference, _ = _frozen_block_run("ref", strategy, use_orig_params)
    diff.assert_close_lists(losses, reference, rtol=1e-5, what="frozen block vs the unsharded model")
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("frozen_block", strategy, use_orig_params), losses,
                             lambda: _frozen_block_run("fsdp1", strategy, use_orig_params)[0])


# ---- item: gradients inside no_sync ------------------------------------------------------------------


def _all_ranks(values: list[float]) -> list[float]:
    """Every rank's ``values``, concatenated in rank order (the same list on every rank, for goldens)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return [value for part in gathered for value in part]


def _unreduced_grad_norms(kind: str, use_orig_params: bool) -> list[float]:
    """The norm of every ``p.grad`` after two backwards inside ``no_sync`` (this rank's accumulation)."""
    model = _model(kind, "FULL_SHARD", use_orig_params)
    with model.no_sync():
        for step in range(2):
            diff.loss_fn(model, *_batch(step, kind)).backward()
    return _all_ranks([param.grad.norm().item() for param in model.parameters() if param.grad is not None])


@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2)
def test_gradients_after_no_sync_are_the_unreduced_local_accumulation(use_orig_params):
    model = _model("ours", "FULL_SHARD", use_orig_params)
    with model.no_sync():
        for step in range(2):
            diff.loss_fn(model, *_batch(step, "ours")).backward()
    grads = [param.grad for param in model.parameters()]
    assert all(grad is not None for grad in grads)
    if use_orig_params:  # each in its parameter's full shape; averaged over ranks: the unsharded model's
        reference = _model("ref")
        for step in range(2):
            diff.loss_fn(reference, *_batch(step, "ref")).backward()
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            average = param.grad.detach().clone()
            dist.all_reduce(average)
            average /= dist.get_world_size()
            assert diff.relative_error(average, expected.grad) < 1e-5, name
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("no_sync_grads", use_orig_params),
                             _unreduced_grad_norms("ours", use_orig_params),
                             lambda: _unreduced_grad_norms("fsdp1", use_orig_params))


def _edited_no_sync_losses(kind: str, use_orig_params: bool) -> list[float]:
    """Two micro-batches per step, the first inside ``no_sync``; its gradient halved in between
    (``p.grad.mul_``), then the synced backward and an SGD step."""
    model = _model(kind, "FULL_SHARD", use_orig_params)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        context = model.no_sync() if kind != "ref" else torch.enable_grad()
        with context:
            diff.loss_fn(model, *_batch(2 * step, kind)).backward()
        for param in model.parameters():
            param.grad.mul_(0.5)
        loss = diff.loss_fn(model, *_batch(2 * step + 1, kind))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean(loss, kind))
    return losses


@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2)
def test_edits_to_gradients_inside_no_sync_reach_the_reduction(use_orig_params):
    _check("no_sync_edit", lambda kind: _edited_no_sync_losses(kind, use_orig_params), "FULL_SHARD",
           use_orig_params, fsdp1_right=True)


# ---- item: summon_full_params(rank0_only=True) -------------------------------------------------------


def _rank0_summon_losses(kind: str, use_orig_params: bool) -> list[float]:
    """Each step, rank 0 reads the full parameters (``rank0_only=True``, a checkpoint or a log), then
    everyone trains on."""
    model = _model(kind, "FULL_SHARD", use_orig_params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        if kind != "ref":
            with type(model).summon_full_params(model, rank0_only=True, writeback=False):
                if dist.get_rank() == 0:
                    assert all(param.dim() > 0 for param in model.parameters())
        losses.append(_train_step(model, optimizer, step, kind))
    return losses


@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2)
def test_training_after_a_rank0_only_summon_is_unchanged(use_orig_params):
    _check("rank0_only_summon", lambda kind: _rank0_summon_losses(kind, use_orig_params), "FULL_SHARD",
           use_orig_params, fsdp1_right=True)


# ---- item: a parameter replaced as a module attribute -------------------------------------------------


def _fc(model: nn.Module, kind: str) -> nn.Module:
    return model.blocks[0].mlp.fc if kind == "ref" else model.module.blocks[0].mlp.fc


def _replaced_weight_losses(kind: str) -> list[float]:
    """``fc.weight = nn.Parameter(...)`` (of the local shard's shape, all 0.01), then training: the new
    object is the parameter, its value is the model's, and it trains."""
    model = _model(kind)
    fc = _fc(model, kind)
    new = nn.Parameter(torch.full_like(fc.weight, 0.01))
    fc.weight = new
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert any(param is new for param in model.parameters())
    losses = [_train_step(model, optimizer, step, kind) for step in range(STEPS)]
    assert _fc(model, kind).weight is new
    return losses


@distributed_test(world_size=2)
def test_a_parameter_assigned_as_a_module_attribute_is_written_back():
    _check("replaced_parameter", _replaced_weight_losses, "FULL_SHARD", fsdp1_right=True)


@distributed_test(world_size=2)
def test_a_parameter_of_another_shape_assigned_as_a_module_attribute_raises_and_changes_nothing():
    model = _model("ours")
    before = diff.full_parameters(model)
    fc = _fc(model, "ours")
    old = fc.weight
    fc.weight = nn.Parameter(torch.zeros(128, 32))  # the full shape, not the local shard's
    with pytest.raises(RuntimeError, match="Cannot writeback when the parameter shape changes"):
        diff.loss_fn(model, *_batch(0, "ours"))
    fc.weight = old
    diff.assert_close_dicts(diff.full_parameters(model), before, rtol=0, what="after the refused replacement")


# ---- the backward after views came back: activation-checkpoint recompute reads the module slots --------


def _checkpointed_losses(kind: str, strategy: str) -> list[float]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    diff.quiet()
    model = diff.make_model(0)
    for index, block in enumerate(model.blocks):
        model.blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if kind == "ours":
        model = FSDP(model, auto_wrap_policy=diff.block_policy_torch(), use_orig_params=True,
                     sharding_strategy=getattr(diff.torch_fsdp.ShardingStrategy, strategy))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return [_train_step(model, optimizer, step, kind) for step in range(STEPS)]


@pytest.mark.parametrize("strategy", STRATEGIES)
@distributed_test(world_size=2)
def test_activation_checkpoint_recompute_after_the_views_came_back_trains_as_unsharded(strategy):
    diff.assert_close_lists(_checkpointed_losses("ours", strategy), _checkpointed_losses("ref", strategy),
                            rtol=1e-5, what="activation checkpointing")


# ---- activation-checkpoint recompute over units that are separate roots, or nested ones ---------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 9), nn.Linear(9, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` around ``inner`` (which may hold several units, or roots)."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


# Where the checkpointed regions lie: ``roots`` wraps each block as its own root (no unit over the model).
RECOMPUTE_LAYOUTS = {
    "roots_in_one_region": lambda wrap, ckpt, blocks: ckpt(nn.Sequential(*map(wrap, blocks))),
    "two_roots_in_a_region_then_a_root": lambda wrap, ckpt, blocks: nn.Sequential(
        ckpt(nn.Sequential(wrap(blocks[0]), wrap(blocks[1]))), wrap(blocks[2])),
    "a_region_per_root": lambda wrap, ckpt, blocks: nn.Sequential(*(ckpt(wrap(block)) for block in blocks)),
    "region_inside_each_root": lambda wrap, ckpt, blocks: nn.Sequential(*(wrap(ckpt(block)) for block in blocks)),
    "nested_units_two_in_a_region": lambda wrap, ckpt, blocks: wrap(nn.Sequential(
        ckpt(nn.Sequential(wrap(blocks[0]), wrap(blocks[1]))), wrap(blocks[2]))),
    "region_around_a_root_with_nested_units": lambda wrap, ckpt, blocks: ckpt(wrap(nn.Sequential(*map(wrap, blocks)))),
}


def _checkpointed_model(kind: str, layout: str, reentrant: bool, strategy: str,
                        use_orig_params: bool = True) -> nn.Module:
    diff.quiet()
    torch.manual_seed(0)
    blocks = [_Block().to(diff.device()) for _ in range(3)]
    sharding = getattr(diff.torch_fsdp.ShardingStrategy, strategy)
    if kind == "ref":
        def wrap(module: nn.Module) -> nn.Module:
            return module
    elif kind == "fsdp1":
        def wrap(module: nn.Module) -> nn.Module:
            return diff.TorchFSDP(module, use_orig_params=use_orig_params, sharding_strategy=sharding,
                                  **diff.fsdp1_kwargs())
    else:
        def wrap(module: nn.Module) -> nn.Module:
            return FSDP(module, use_orig_params=use_orig_params, sharding_strategy=sharding)
    return RECOMPUTE_LAYOUTS[layout](wrap, lambda inner: _Checkpointed(inner, reentrant), blocks)


def _recompute_inputs(step: int, reentrant: bool) -> torch.Tensor:
    """The same batch on every rank: the ranks' averaged gradient is the unsharded model's. A reentrant
    checkpoint needs an input that requires grad."""
    torch.manual_seed(100 + step)
    return torch.randn(4, 8, device=diff.device()).requires_grad_(reentrant)


def _checkpointed_run(kind: str, layout: str, reentrant: bool, use_orig_params: bool) -> list[float]:
    """The losses of 3 SGD steps, then each step's all-gather count."""
    model = _checkpointed_model(kind, layout, reentrant, "FULL_SHARD", use_orig_params)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, gathers = [], []
    for step in range(3):
        events: list[str] = []
        with diff.AllGatherLog(events):
            loss = model(_recompute_inputs(step, reentrant)).pow(2).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        gathers.append(float(len(events)))
    return losses + gathers


# Every layout with FSDP1's plain views; the separate and nested roots also with flat parameters.
RECOMPUTE_CASES = [(layout, reentrant, True) for layout in RECOMPUTE_LAYOUTS for reentrant in (False, True)]
RECOMPUTE_CASES += [(layout, reentrant, False) for layout in ("roots_in_one_region", "nested_units_two_in_a_region")
                    for reentrant in (False, True)]


@pytest.mark.parametrize("layout,reentrant,use_orig_params", RECOMPUTE_CASES)
@distributed_test(world_size=2)
def test_activation_checkpoint_recompute_over_units_trains_as_fsdp1_without_more_all_gathers(layout, reentrant,
                                                                                            use_orig_params):
    """A checkpointed region recomputes every unit in it at the first backward step that needs it, before
    their own pre-backward: the modules must hold the unsharded parameters again (FSDP1's are there), and
    that must cost no all-gather FSDP1 does not make."""
    ours = _checkpointed_run("ours", layout, reentrant, use_orig_params)
    reference = _checkpointed_run("ref", layout, reentrant, use_orig_params)
    diff.assert_close_lists(ours[:3], reference[:3], rtol=1e-5, what=f"{layout} vs the unsharded model")
    key = diff.golden_key("recompute", layout, reentrant, *(() if use_orig_params else ("flat",)))
    fsdp1 = diff.fsdp1_value(GOLDEN, key, lambda: _checkpointed_run("fsdp1", layout, reentrant, use_orig_params))
    diff.assert_close_lists(ours[:3], fsdp1[:3], rtol=1e-5, what=f"{layout} vs torch FSDP1")
    assert all(mine <= theirs for mine, theirs in zip(ours[3:], fsdp1[3:])), \
        f"all-gathers per step: ours {ours[3:]}, FSDP1 {fsdp1[3:]}"


def _roots(model: nn.Module, kind: str) -> list[nn.Module]:
    return (diff.TorchFSDP if kind == "fsdp1" else FSDP).fsdp_modules(model, root_only=True)


def _checkpointed_run_through_transitions(kind: str, layout: str, reentrant: bool, strategy: str) -> list[float]:
    """Each step passes every transition of the views before a backward recomputes: an evaluation forward
    (no autograd), a micro-batch inside ``no_sync``, ``state_dict()`` between the forward and its backward,
    then ``summon_full_params`` and ``.to()`` after the optimizer step; the losses."""
    model = _checkpointed_model(kind, layout, reentrant, strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        inputs = _recompute_inputs(step, reentrant)
        with torch.no_grad():
            model(inputs.detach())
        roots = _roots(model, kind) if kind != "ref" else []
        with contextlib.ExitStack() as unsynced:
            for root in roots:
                unsynced.enter_context(root.no_sync())
            model(_recompute_inputs(10 + step, reentrant)).pow(2).mean().backward()
        loss = model(inputs).pow(2).mean()
        for root in roots:
            root.state_dict()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for root in roots:
            with type(root).summon_full_params(root, writeback=False):
                pass
        model.to(diff.device())
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("layout", ["roots_in_one_region", "nested_units_two_in_a_region"])
@distributed_test(world_size=2)
def test_activation_checkpoint_recompute_after_every_view_transition_trains_as_unsharded(layout, reentrant,
                                                                                        strategy):
    _check("recompute_transitions",
           lambda kind: _checkpointed_run_through_transitions(kind, layout, reentrant, strategy), strategy,
           layout, reentrant, fsdp1_right=True)



@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@distributed_test(world_size=2)
def test_training_goes_on_in_the_new_dtype_after_double_mid_training(strategy, use_orig_params):
    """``model.double()`` after the first steps, with a step's gradients still held: the parameters and
    gradients become float64 and training goes on as the unsharded model's. FSDP1 is no oracle here: it
    raises at its next forward (its gather buffers and low-precision copies keep float32) or, with flat
    parameters under ``NO_SHARD``, trains on a stale buffer (torch 2.13); the engine derives its dtypes at
    its first forward only, and raised at the next backward before fsdp_compat derived them again."""

    def run(kind: str) -> list[float]:
        model = _model(kind, strategy, use_orig_params)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = diff.train(model, optimizer, 2, sharded=kind != "ref")
        diff.loss_fn(model, *_batch(2, kind)).backward()
        model.double()
        assert all(param.dtype == torch.float64 and param.grad is not None and param.grad.dtype == torch.float64
                   for param in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        return losses + diff.train(model, optimizer, 2, first_step=3, sharded=kind != "ref")

    diff.assert_close_lists(run("ours"), run("ref"), rtol=1e-5, what="ours vs the unsharded model")
