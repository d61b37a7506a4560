"""``torch.compile`` of a wrapped model, as FSDP1 allows (on CPU too, either ``use_orig_params``).

Everything fsdp_compat runs around the engine's hooks (the root's pre-forward bookkeeping and input casting,
the views' writeback, the mixed-precision hooks of ``_module_classes_to_ignore``, the backward callbacks)
stays out of the compiled graph, as the engine's own hooks do: compiled training then gives the losses of
eager training and of torch FSDP1 compiled the same way (golden values in ``tests/golden/compile.json``
once torch drops FSDP1). Kept cheap: a three-layer model, three steps (compiling is slow on a busy CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compat.wrap
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import distributed_test
from tests import differential as diff

GOLDEN = "compile"
STEPS = 3
GLOBAL_BATCH = 8


class _Net(nn.Module):
    """Two linear units around a batch norm (FSDP1 wraps it on its own, in full precision, under
    mixed precision with an auto-wrap policy: fsdp_compat's forward hooks on it run inside the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)
        # Whether dynamo traced a forward. Only ever written, never read, in forward: dynamo guards on what a
        # forward reads (a list appended to each call is read, so every call recompiled, until dynamo's
        # recompile limit left the rest of the run eager).
        self.traced = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            self.traced = True
        return self.out(torch.relu(self.norm(self.inp(x))))


def _wrap(cls: type, use_orig_params: bool, mixed_precision: bool) -> nn.Module:
    torch.manual_seed(0)
    kwargs = dict(use_orig_params=use_orig_params,
                  auto_wrap_policy=(diff.torch_wrap or fsdp_compat.wrap).ModuleWrapPolicy({nn.Linear}))
    if mixed_precision:
        kwargs["mixed_precision"] = diff.torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16)
    if cls is not FSDP:
        kwargs.update(diff.fsdp1_kwargs())
    return cls(_Net().to(diff.device()), **kwargs)


def _train(model: nn.Module, compiled: bool, between: bool = False) -> list[float]:
    """``STEPS`` SGD steps on this rank's slice of a seeded global batch; the mean loss over ranks per step.
    ``between``: before each step's own forward, an evaluation forward (no backward) and a micro-batch
    accumulated under ``no_sync``, the transitions FSDP1 code runs between steps."""
    torch.compiler.reset()  # no graph or guard left over from another model in this rank process
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = torch.compile(model) if compiled else model
    per_rank = GLOBAL_BATCH // dist.get_world_size()
    losses = []
    for step in range(STEPS):
        batch = torch.randn(GLOBAL_BATCH, 8, generator=torch.Generator().manual_seed(step)).to(diff.device())
        inputs = batch[dist.get_rank() * per_rank:(dist.get_rank() + 1) * per_rank]
        if between:
            with torch.no_grad():
                run(inputs)
            with model.no_sync():
                run(inputs[:2]).float().square().mean().backward()
        loss = run(inputs).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    return losses


def _assert_traced(model: nn.Module, compiled: bool) -> None:
    """The wrapped module's forward was traced by dynamo when compiled (not left to run eagerly), only then.
    (FSDP1 with ``use_orig_params=False`` is run eagerly by dynamo: not checked on it.)"""
    net = next(module for module in model.modules() if isinstance(module, _Net))
    assert net.traced == compiled, "the wrapped module's forward must be compiled, and only when asked"


@pytest.mark.parametrize("use_orig_params, mixed_precision, between",
                         [(True, False, False), (False, False, False), (True, True, False), (False, False, True)])
@distributed_test(2, timeout=600)
def test_compiled_training_matches_eager_and_fsdp1(use_orig_params: bool, mixed_precision: bool,
                                                   between: bool) -> None:
    diff.quiet()
    model = _wrap(FSDP, use_orig_params, mixed_precision)
    compiled = _train(model, compiled=True, between=between)
    _assert_traced(model, compiled=True)
    model = _wrap(FSDP, use_orig_params, mixed_precision)
    eager = _train(model, compiled=False, between=between)
    _assert_traced(model, compiled=False)
    diff.assert_close_lists(compiled, eager, what="compiled vs eager")
    key = diff.golden_key("orig" if use_orig_params else "flat", "bf16" if mixed_precision else "fp32",
                          *(["eval-no_sync"] if between else []))
    diff.check_against_fsdp1(GOLDEN, key, compiled, lambda: _train(
        _wrap(diff.TorchFSDP, use_orig_params, mixed_precision), compiled=True, between=between))
