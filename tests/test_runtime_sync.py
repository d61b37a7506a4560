"""Gradient communication controls: ``no_sync``, ``register_comm_hook``, forward prefetch, and
training after a step that raised. Each is run side by side with the single-process reference and
torch FSDP1 (golden values in ``tests/golden/runtime_sync.json`` once torch drops FSDP1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.examples import Block, GPTConfig
from fsdp_compat.testing import distributed_test
from tests import differential as diff

GOLDEN = "runtime_sync"
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
MICRO_BATCHES = 3


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _hybrid_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(diff.device().type, (2, dist.get_world_size() // 2),
                            mesh_dim_names=("replicate", "shard"))


def _build(wrapper_class, strategy: str = "FULL_SHARD", **kwargs) -> nn.Module:
    """TinyGPT wrapped per block, ``use_orig_params=True`` (FSDP1's gradients are then readable)."""
    is_fsdp1 = wrapper_class is diff.TorchFSDP
    if strategy in HYBRID:
        kwargs.setdefault("device_mesh", _hybrid_mesh())
    kwargs.setdefault("use_orig_params", True)
    policy = diff.block_policy_torch() if is_fsdp1 else fsdp_compat.wrap.ModuleWrapPolicy({Block})
    return wrapper_class(diff.make_model(), sharding_strategy=fsdp_compat.ShardingStrategy[strategy],
                         auto_wrap_policy=policy, **(diff.fsdp1_kwargs() if is_fsdp1 else {}), **kwargs)


def _gradient_collectives(comm: CommDebugMode) -> int:
    """How many reduce-scatters / all-reduces (gradient reductions) ``comm`` saw."""
    return sum(count for op, count in comm.get_comm_counts().items() if "reduce" in str(op))


def _global_mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def _concatenated_batch(step: int, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    batches = [diff.synthetic_batch(step * micro_batches + m, diff.GLOBAL_BATCH, GPTConfig(), diff.device())
               for m in range(micro_batches)]
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def _reference_accumulation(steps: int, micro_batches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One ordinary step per concatenated batch of ``micro_batches`` global batches."""
    model = diff.make_model()
    optimizer = diff.make_optimizer("sgd", model.parameters())
    losses = []
    for step in range(steps):
        loss = diff.loss_fn(model, *_concatenated_batch(step, micro_batches))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def _accumulate(model: nn.Module, steps: int, micro_batches: int,
                contexts: Callable[[nn.Module, int], contextlib.AbstractContextManager]) -> tuple[list[float], list[int]]:
    """Each step: ``micro_batches`` backwards, micro-batch ``m`` inside ``contexts(model, m)``, then
    one optimizer step. Returns per-step global losses and the gradient collectives of each backward."""
    optimizer = diff.make_optimizer("sgd", model.parameters())
    losses, reductions = [], []
    for step in range(steps):
        total = torch.zeros(())
        for micro in range(micro_batches):
            tokens, targets = diff.local_batch(step * micro_batches + micro)
            with contexts(model, micro), CommDebugMode() as comm:
                loss = diff.loss_fn(model, tokens, targets) / micro_batches
                loss.backward()
            reductions.append(_gradient_collectives(comm))
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_global_mean(total))
    return losses, reductions


def _all_but_last_unsynced(model: nn.Module, micro: int) -> contextlib.AbstractContextManager:
    return model.no_sync() if micro < MICRO_BATCHES - 1 else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# no_sync
# ---------------------------------------------------------------------------------------------


def check_no_sync(strategy: str, cpu_offload: bool) -> None:
    diff.quiet()
    extra = {"cpu_offload": fsdp_compat.CPUOffload(offload_params=True)} if cpu_offload else {}
    model = _build(FSDP, strategy, **extra)
    losses, reductions = _accumulate(model, 2, MICRO_BATCHES, _all_but_last_unsynced)
    unsynced = [r for i, r in enumerate(reductions) if i % MICRO_BATCHES < MICRO_BATCHES - 1]
    synced = reductions[MICRO_BATCHES - 1::MICRO_BATCHES]
    assert unsynced and all(r == 0 for r in unsynced), f"gradient collectives inside no_sync: {reductions}"
    assert all(r > 0 for r in synced), f"the backward after no_sync did not reduce: {reductions}"

    reference_losses, reference_params = _reference_accumulation(2, MICRO_BATCHES)
    diff.assert_close_lists(losses, reference_losses, rtol=1e-6, what="losses vs reference")
    diff.assert_close_dicts(diff.full_parameters(model), reference_params, rtol=1e-6, what="params vs reference")
    if not cpu_offload:  # FSDP1 cannot offload parameters on a CPU-only machine
        def fsdp1() -> list[float]:
            theirs = _build(diff.TorchFSDP, strategy)
            their_losses, their_reductions = _accumulate(theirs, 2, MICRO_BATCHES, _all_but_last_unsynced)
            assert their_reductions == reductions, (their_reductions, reductions)
            return their_losses
        diff.check_against_fsdp1(GOLDEN, diff.golden_key("no_sync", strategy), losses, fsdp1)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("cpu_offload", [False, True])
@distributed_test(world_size=2)
def test_no_sync_issues_no_gradient_collective_and_matches_one_big_step(strategy, cpu_offload):
    check_no_sync(strategy, cpu_offload)


@pytest.mark.parametrize("strategy", HYBRID)
@distributed_test(world_size=4)
def test_no_sync_hybrid(strategy):
    check_no_sync(strategy, cpu_offload=False)


def _nested_no_sync_step(model: nn.Module) -> tuple[list[float], list[int]]:
    """One step of 4 micro-batches: the first inside no_sync, the second inside a nested no_sync,
    the third after the inner one exited (still inside the outer one), the last outside."""
    optimizer = diff.make_optimizer("sgd", model.parameters())
    reductions: list[int] = []

    def micro_batch(index: int) -> torch.Tensor:
        with CommDebugMode() as comm:
            loss = diff.loss_fn(model, *diff.local_batch(index)) / 4
            loss.backward()
        reductions.append(_gradient_collectives(comm))
        return loss.detach()

    with model.no_sync():
        total = micro_batch(0)
        with model.no_sync():
            total += micro_batch(1)
        total += micro_batch(2)
    total += micro_batch(3)
    optimizer.step()
    return [_global_mean(total)], reductions


@distributed_test(world_size=2)
def test_nested_no_sync_keeps_syncing_off_until_the_outermost_exit():
    diff.quiet()
    model = _build(FSDP)
    losses, reductions = _nested_no_sync_step(model)
    assert reductions[:3] == [0, 0, 0] and reductions[3] > 0, reductions
    reference_losses, reference_params = _reference_accumulation(1, 4)
    diff.assert_close_lists(losses, reference_losses, rtol=1e-6)
    diff.assert_close_dicts(diff.full_parameters(model), reference_params, rtol=1e-6)
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("nested_no_sync"), losses, lambda: _nested_no_sync_step(_build(diff.TorchFSDP))[0])


@distributed_test(world_size=2)
def test_no_sync_on_an_inner_wrapper_raises_like_fsdp1():
    diff.quiet()
    wrappers = [_build(FSDP)] + ([_build(diff.TorchFSDP)] if diff.HAVE_FSDP1 else [])
    for model in wrappers:
        # After a step: before one, FSDP1's lazy init would make the inner wrapper a root.
        diff.loss_fn(model, *diff.local_batch(0)).backward()
        with pytest.raises(RuntimeError, match="root"):
            with model.blocks[0].no_sync():
                pass


# ---------------------------------------------------------------------------------------------
# Communication hooks
# ---------------------------------------------------------------------------------------------


def _cpu_safe_decompress(state, grad):
    """torch's ``_decompress`` without ``record_stream``, which CPU tensors lack (FSDP1 fails there
    the same way); the tests patch it in on CPU so the real compress hooks run on both wrappers."""
    grad.data = grad.data.to(state.parameter_type)


@contextlib.contextmanager
def _compress_hooks_usable_here():
    if diff.device().type != "cpu":
        yield
        return
    original = default_hooks._decompress
    default_hooks._decompress = _cpu_safe_decompress
    try:
        yield
    finally:
        default_hooks._decompress = original


HOOKS = {
    "reduce_scatter": (default_hooks.reduce_scatter_hook, default_hooks.DefaultState),
    "allreduce": (default_hooks.allreduce_hook, default_hooks.DefaultState),
    "fp16_compress": (default_hooks.fp16_compress_hook, default_hooks.LowPrecisionState),
    "bf16_compress": (default_hooks.bf16_compress_hook, default_hooks.LowPrecisionState),
}


def _train_with_hook(wrapper_class, strategy: str, hook_name: str) -> list[float]:
    model = _build(wrapper_class, strategy)
    hook, state_class = HOOKS[hook_name]
    model.register_comm_hook(state_class(model.process_group), hook)
    with _compress_hooks_usable_here():
        return diff.train(model, diff.make_optimizer("adamw", model.parameters()), 3)


@pytest.mark.parametrize("strategy,hook_name", [
    ("FULL_SHARD", "reduce_scatter"), ("SHARD_GRAD_OP", "reduce_scatter"), ("NO_SHARD", "allreduce"),
    ("FULL_SHARD", "fp16_compress"), ("FULL_SHARD", "bf16_compress"),
    ("NO_SHARD", "fp16_compress"), ("NO_SHARD", "bf16_compress"),
])
@distributed_test(world_size=2)
def test_torch_default_hooks_train_like_fsdp1(strategy, hook_name):
    diff.quiet()
    losses = _train_with_hook(FSDP, strategy, hook_name)
    reference_losses, _ = diff.reference_run("adamw", 3)
    compressed = "compress" in hook_name  # 16-bit gradients: close to the reference, not equal
    diff.assert_close_lists(losses, reference_losses, rtol=1e-3 if compressed else 1e-5, what="vs reference")
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("hook", strategy, hook_name), losses,
                 lambda: _train_with_hook(diff.TorchFSDP, strategy, hook_name))


class _SummingHook:
    """Sums gradients without averaging (so its effect is visible) and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, group, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
        self.calls += 1
        if output is None:
            dist.all_reduce(grad, group=group)
        else:
            dist.reduce_scatter_tensor(output, grad, group=group)


def _hook_effect(wrapper_class, strategy: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Calls per backward for 2 backwards (one inside no_sync) and the resulting full gradients."""
    model = _build(wrapper_class, strategy)
    hook = _SummingHook()
    model.register_comm_hook(model.process_group, hook)
    calls = []
    for micro, context in enumerate([model.no_sync(), contextlib.nullcontext()]):
        with context:
            diff.loss_fn(model, *diff.local_batch(micro)).backward()
        calls.append(float(hook.calls))
    return calls, diff.full_gradients(model)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@distributed_test(world_size=2)
def test_comm_hook_gets_the_gradient_once_per_unit_and_decides_what_reaches_it(strategy):
    _check_hook_effect(strategy)


@distributed_test(world_size=1)
def test_comm_hook_at_world_size_one_is_still_the_units_communication():
    """At one rank fsdp_compat makes no all-reduce of its own (there is no other rank): a registered hook
    still gets each unit's gradient once per synced backward, as in FSDP1, and decides what reaches it."""
    _check_hook_effect("NO_SHARD")


def _check_hook_effect(strategy: str) -> None:
    diff.quiet()
    calls, grads = _hook_effect(FSDP, strategy)
    assert calls == [0.0, 3.0], f"expected no call inside no_sync, then one per unit (3): {calls}"
    # A summing hook gives world_size x the averaged gradient of the two micro-batches.
    reference = diff.make_model()
    for micro in range(2):
        diff.loss_fn(reference, *diff.synthetic_batch(micro, diff.GLOBAL_BATCH, GPTConfig(), diff.device())).backward()
    expected = {name: p.grad * dist.get_world_size() for name, p in reference.named_parameters()}
    diff.assert_close_dicts(grads, expected, rtol=1e-5, what="hooked grads vs reference")
    if diff.HAVE_FSDP1:
        their_calls, their_grads = _hook_effect(diff.TorchFSDP, strategy)
        assert their_calls == calls
        diff.assert_close_dicts(grads, their_grads, rtol=1e-5, what="hooked grads vs FSDP1")


def _hook_misuse(case: str) -> Callable[[nn.Module], None]:
    state, hook = default_hooks.DefaultState(dist.group.WORLD), default_hooks.reduce_scatter_hook
    return {
        "twice": lambda m: (m.register_comm_hook(state, hook), m.register_comm_hook(state, hook)),
        "non-root": lambda m: m.blocks[0].register_comm_hook(state, hook),
        "not callable": lambda m: m.register_comm_hook(state, 3),
    }[case]


@pytest.mark.parametrize("case,error", [("twice", AssertionError), ("non-root", AssertionError),
                                        ("not callable", ValueError)])
@distributed_test(world_size=2)
def test_register_comm_hook_misuse_raises_like_fsdp1(case, error):
    diff.quiet()
    for wrapper_class in [FSDP] + ([diff.TorchFSDP] if diff.HAVE_FSDP1 else []):
        model = _build(wrapper_class)
        if case == "non-root":  # before a forward, FSDP1's lazy init would make the inner one a root
            diff.loss_fn(model, *diff.local_batch(0)).backward()
        with pytest.raises(error):
            _hook_misuse(case)(model)


@distributed_test(world_size=4)
def test_register_comm_hook_with_hybrid_sharding_raises_like_fsdp1():
    diff.quiet()
    for wrapper_class in [FSDP] + ([diff.TorchFSDP] if diff.HAVE_FSDP1 else []):
        model = _build(wrapper_class, "HYBRID_SHARD")
        with pytest.raises(AssertionError, match="hybrid"):
            model.register_comm_hook(default_hooks.DefaultState(model.process_group),
                                     default_hooks.reduce_scatter_hook)


# ---------------------------------------------------------------------------------------------
# Forward prefetch
# ---------------------------------------------------------------------------------------------




def _forward_events(model: nn.Module) -> list[str]:
    """The order of all-gathers and block computations in one forward, up to block 1."""
    events: list[str] = []
    handles = [block.attn.register_forward_pre_hook(lambda *_, i=i: events.append(f"block {i}"))
               for i, block in enumerate(model.blocks)]
    try:
        with diff.AllGatherLog(events):
            diff.loss_fn(model, *diff.local_batch(9)).backward()
    finally:
        for handle in handles:
            handle.remove()
    return events[:events.index("block 1") + 1]


@distributed_test(world_size=2)
def test_forward_prefetch_gathers_the_next_unit_early_and_keeps_results():
    diff.quiet()
    runs = {}
    for prefetch in (False, True):
        model = _build(FSDP, forward_prefetch=prefetch)
        losses = diff.train(model, diff.make_optimizer("adamw", model.parameters()), 3)
        runs[prefetch] = (losses, _forward_events(model))
    # Without prefetch block 1's all-gather waits for block 1; with it, block 0 issues it.
    gathers_before_block_0 = {p: events.index("block 0") for p, (_, events) in runs.items()}
    assert gathers_before_block_0 == {False: 2, True: 3}, runs
    reference_losses, _ = diff.reference_run("adamw", 3)
    for losses, _ in runs.values():
        diff.assert_close_lists(losses, reference_losses)
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("forward_prefetch"), runs[True][0],
                 lambda: diff.train(m := _build(diff.TorchFSDP, forward_prefetch=True),
                                    diff.make_optimizer("adamw", m.parameters()), 3))


# ---------------------------------------------------------------------------------------------
# A step that raised
# ---------------------------------------------------------------------------------------------


class _Boom(Exception):
    pass


def _raise(*_):
    raise _Boom


def _failing_step(model: nn.Module, where: str) -> None:
    """A step whose forward or backward raises midway, on every rank."""
    module = model.blocks[1].attn if where == "forward" else model.blocks[0].mlp
    handle = (module.register_forward_pre_hook(_raise) if where == "forward"
              else module.register_full_backward_hook(_raise))
    try:
        with pytest.raises(_Boom):
            diff.loss_fn(model, *diff.local_batch(1)).backward()
    finally:
        handle.remove()


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@distributed_test(world_size=2)
def test_training_resumes_after_a_step_that_raised(where, strategy):
    """No call needed from the user beyond the usual zero_grad(); FSDP1 cannot do this (its state
    stays mid-iteration), so the comparison is with the reference that never failed."""
    diff.quiet()
    model = _build(FSDP, strategy)
    optimizer = diff.make_optimizer("adamw", model.parameters())
    losses = diff.train(model, optimizer, 1)
    _failing_step(model, where)
    optimizer.zero_grad()
    losses += diff.train(model, optimizer, 3, first_step=1)
    reference_losses, reference_params = diff.reference_run("adamw", 4)
    diff.assert_close_lists(losses, reference_losses)
    diff.assert_close_dicts(diff.full_parameters(model), reference_params)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@distributed_test(world_size=2)
def test_flat_parameters_train_on_after_a_backward_that_raised(strategy):
    """``use_orig_params=False``: the gradients the raised backward left in the engine for some units (none
    reached the flat parameters) are dropped, so the next steps are the reference's."""
    diff.quiet()
    model = _build(FSDP, strategy, use_orig_params=False)
    optimizer = diff.make_optimizer("adamw", model.parameters())
    losses = diff.train(model, optimizer, 1)
    _failing_step(model, "backward")
    optimizer.zero_grad()
    losses += diff.train(model, optimizer, 3, first_step=1)
    reference_losses, reference_params = diff.reference_run("adamw", 4)
    diff.assert_close_lists(losses, reference_losses)
    diff.assert_close_dicts(diff.full_parameters(model), reference_params)
