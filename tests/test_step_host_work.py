"""A training step at world size 1 makes no more data-copy calls than FSDP1's (issue 35, step CPU time).

At world size 1 (FSDP1's ``NO_SHARD``) with a ``param_dtype``, each unshard casts the stored parameters into
their low-precision copies: FSDP1 with one copy of its flat parameter per unit, fsdp_compat, whose units hold
one tensor per parameter, with one batched copy per unit. A copy call per parameter costs host time per
parameter on small units (the step CPU time the issue measures), the bytes being the same. Counted, not timed:
the data-copy ops dispatched over one step (``copy_`` but onto itself, ``_foreach_copy_``, ``_to_copy``), the
same on every run. Compared with torch FSDP1 run now, or with its golden values (``tests/golden/step_host_work.json``).
Also the host work of ours a step runs (Python calls into fsdp_compat, counted) is not raised by a re-layout.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat import wrap as our_wrap
from fsdp_compat.testing import distributed_test
from tests import differential as diff
from _comm import CollectiveCounter, CopyCounter  # noqa: E402  (the benchmarks' counter: tests.differential puts benchmarks/ on the path)

GOLDEN = "step_host_work"
_COPY_OPS = ("copy_", "_foreach_copy_", "_to_copy")
_WIDTH, _LAYERS = 32, 4  # four units of Linear(32, 32): two parameters each


def _training_step(wrapper_class: Any, wrap_module: Any, use_orig_params: bool,
                   **precision: torch.dtype) -> Callable[[], float]:
    """One unit per ``Linear`` at world size 1 with a ``MixedPrecision(**precision)``; its SGD step (the loss)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(_WIDTH, _WIDTH) for _ in range(_LAYERS)]).to(diff.device())
    model = wrapper_class(model, auto_wrap_policy=wrap_module.ModuleWrapPolicy({nn.Linear}),
                          mixed_precision=diff.torch_fsdp.MixedPrecision(**precision),
                          use_orig_params=use_orig_params, **diff.fsdp1_kwargs())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(8, _WIDTH, device=diff.device())

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch).float().square().sum()
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def _copy_calls(wrapper_class: Any, wrap_module: Any, use_orig_params: bool) -> int:
    step = _training_step(wrapper_class, wrap_module, use_orig_params, param_dtype=torch.bfloat16)
    step()  # lazy initialisation done, for both
    with CopyCounter() as counter:
        step()
    return sum(counter.by_op[name][0] for name in _COPY_OPS)


def _collectives_and_losses(wrapper_class: Any, wrap_module: Any, use_orig_params: bool) -> tuple[int, list[float]]:
    """The collective calls of a step after the first, and the losses of three steps."""
    step = _training_step(wrapper_class, wrap_module, use_orig_params, param_dtype=torch.bfloat16,
                          reduce_dtype=torch.bfloat16)
    losses = [step()]
    with CollectiveCounter() as counter:
        losses.append(step())
    losses.append(step())
    return counter.stats.as_dict()["count"], losses


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed_test(world_size=1)
def test_world_of_one_mixed_precision_step_casts_each_unit_in_one_call(use_orig_params: bool) -> None:
    ours = _copy_calls(FSDP, our_wrap, use_orig_params)
    fsdp1 = diff.fsdp1_value(GOLDEN, diff.golden_key(f"orig{use_orig_params}"),
                             lambda: _copy_calls(diff.TorchFSDP, diff.torch_wrap, use_orig_params))
    assert ours <= fsdp1, f"{ours} data-copy calls in a step against FSDP1's {fsdp1}"


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed_test(world_size=1)
def test_world_of_one_step_reduces_gradients_without_a_collective(use_orig_params: bool) -> None:
    """At one rank there is no other rank to reduce with: FSDP1 still all-reduces each unit's flat gradient over
    its one-rank group (a hand-off to the backend and back per unit); fsdp_compat makes no collective call,
    and trains the same (bf16 ``param_dtype`` and ``reduce_dtype``: the gradients cast after the reduction)."""
    collectives, losses = _collectives_and_losses(FSDP, our_wrap, use_orig_params)
    fsdp1 = diff.fsdp1_value(GOLDEN, diff.golden_key(f"collectives-orig{use_orig_params}"),
                             lambda: _collectives_and_losses(diff.TorchFSDP, diff.torch_wrap, use_orig_params))
    assert collectives == 0, f"{collectives} collective calls in a one-rank step"
    assert fsdp1[0] >= _LAYERS, fsdp1  # (FSDP1's: one all-reduce per unit)
    diff.assert_close_lists(losses, fsdp1[1], rtol=0, what="losses vs torch FSDP1")


def _calls_into_fsdp_compat(step: Callable[[], float]) -> int:
    """Python calls into fsdp_compat's own code during one ``step()`` (deterministic, unlike its time)."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and "/fsdp_compat/" in frame.f_code.co_filename:
            calls += 1

    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed_test(world_size=1)
def test_a_step_after_a_re_layout_costs_what_it_did_before(use_orig_params: bool) -> None:
    """``model.double().float()`` re-lays every unit's storage out (the views follow it): the steps after it
    run the same host work of ours as before it. (Before, the engine's registrations kept updating the
    previous layout's bookkeeping, and every forward re-registered each parameter.)"""
    diff.quiet()
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(*[nn.Linear(_WIDTH, _WIDTH) for _ in range(_LAYERS)]).to(diff.device()),
                 auto_wrap_policy=our_wrap.ModuleWrapPolicy({nn.Linear}), use_orig_params=use_orig_params)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(8, _WIDTH, device=diff.device())

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch).square().sum()
        loss.backward()
        optimizer.step()
        return loss.item()

    step(), step()
    before = _calls_into_fsdp_compat(step)
    model.double().float()
    step(), step()
    assert _calls_into_fsdp_compat(step) == before
