"""A training step at world size 1 makes no more data-copy calls than FSDP1's (issue 35, step CPU time).

At world size 1 (FSDP1's ``NO_SHARD``) with a ``param_dtype``, each unshard casts the stored parameters into
their low-precision copies: FSDP1 with one copy of its flat parameter per unit, fsdp_compat, whose units hold
one tensor per parameter, with one batched copy per unit. A copy call per parameter costs host time per
parameter on small units (the step CPU time the issue measures), the bytes being the same. Counted, not timed:
the data-copy ops dispatched over one step (``copy_`` but onto itself, ``_foreach_copy_``, ``_to_copy``), the
same on every run. Compared with torch FSDP1 run now, or with its golden values (``tests/golden/step_host_work.json``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat import wrap as our_wrap
from fsdp_compat.testing import distributed_test
from tests import differential as diff
from _comm import CopyCounter  # noqa: E402  (the benchmarks' counter: tests.differential puts benchmarks/ on the path)

GOLDEN = "step_host_work"
_COPY_OPS = ("copy_", "_foreach_copy_", "_to_copy")
_WIDTH, _LAYERS = 32, 4  # four units of Linear(32, 32): two parameters each


def _copy_calls(wrapper_class: Any, wrap_module: Any, use_orig_params: bool) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(_WIDTH, _WIDTH) for _ in range(_LAYERS)]).to(diff.device())
    model = wrapper_class(model, auto_wrap_policy=wrap_module.ModuleWrapPolicy({nn.Linear}),
                          mixed_precision=diff.torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16),
                          use_orig_params=use_orig_params, **diff.fsdp1_kwargs())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(8, _WIDTH, device=diff.device())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(batch).float().square().sum().backward()
        optimizer.step()

    step()  # lazy initialisation done, for both
    with CopyCounter() as counter:
        step()
    return sum(counter.by_op[name][0] for name in _COPY_OPS)


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed_test(world_size=1)
def test_world_of_one_mixed_precision_step_casts_each_unit_in_one_call(use_orig_params: bool) -> None:
    ours = _copy_calls(FSDP, our_wrap, use_orig_params)
    fsdp1 = diff.fsdp1_value(GOLDEN, diff.golden_key(f"orig{use_orig_params}"),
                             lambda: _copy_calls(diff.TorchFSDP, diff.torch_wrap, use_orig_params))
    assert ours <= fsdp1, f"{ours} data-copy calls in a step against FSDP1's {fsdp1}"
