"""ShardedGradScaler: fp16 training where every rank sees only its gradient shards.

The property that matters: an inf/NaN found on any rank makes *every* rank skip that step and
back off its scale, so the replicas never diverge. We also train fp16 side by side with torch
FSDP1 + torch's FSDP1 ``ShardedGradScaler`` (same losses, same scale history), and record that
torch's scaler, unchanged, also works on our DTensor gradients (``test_torch_scaler_*``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compat
import fsdp_compat.fully_sharded_data_parallel as fsdp_module
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.sharded_grad_scaler import ShardedGradScaler
from fsdp_compat.testing import distributed_test
from tests import differential as diff
from tests.test_mixed_precision import api, assert_losses_close, fsdp1_or_golden, global_mean, wrapper_kwargs

try:  # torch's FSDP1 scaler: only ever an oracle / a documented alternative, never used by the library
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler
except ImportError:  # pragma: no cover - depends on the torch version
    TorchShardedGradScaler = None

FP16 = dict(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)
INIT_SCALE = 2.0**10
SCALE_EXP = 19  # the first steps overflow, later ones train and grow the scale, then one overflows again


def scaler_class(kind: str):
    if kind == "torch":
        if TorchShardedGradScaler is None:
            pytest.skip("this torch has no FSDP1 ShardedGradScaler")
        return TorchShardedGradScaler
    return ShardedGradScaler


def fp16_model(ours: bool = True, **kwargs) -> nn.Module:
    return (FSDP if ours else diff.TorchFSDP)(
        diff.make_model(), mixed_precision=api(ours).MixedPrecision(**FP16),
        auto_wrap_policy=diff.block_policy_torch(), **wrapper_kwargs(ours), **kwargs)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard: a DTensor's local tensor, a plain (local-shard) tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def scaled_step(model, optimizer, scaler, step: int, poison_rank: int | None = None) -> float:
    """One fp16 step; ``poison_rank`` puts an inf into its own local shard of one gradient."""
    tokens, targets = diff.local_batch(step)
    loss = diff.loss_fn(model, tokens, targets)
    scaler.scale(loss).backward()
    if poison_rank == dist.get_rank():
        grad = next(p.grad for p in model.parameters() if p.grad is not None and local(p.grad).numel())
        local(grad).view(-1)[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return global_mean(loss)


def same_on_all_ranks(value) -> bool:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def local_shards(model: nn.Module) -> list[torch.Tensor]:
    return [local(p).detach().clone() for p in model.parameters()]


def check_inf_on_one_rank(kind: str) -> None:
    model = fp16_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = scaler_class(kind)(diff.device().type, init_scale=INIT_SCALE, growth_interval=100)
    scaled_step(model, optimizer, scaler, 0)
    assert scaler.get_scale() == INIT_SCALE

    before = local_shards(model)
    scaled_step(model, optimizer, scaler, 1, poison_rank=1)  # only rank 1 sees the inf
    after = local_shards(model)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a rank stepped despite the inf"
    assert scaler.get_scale() == INIT_SCALE / 2
    assert same_on_all_ranks(scaler.get_scale())

    scaled_step(model, optimizer, scaler, 2)  # a clean step steps again, everywhere
    assert not all(torch.equal(a, b) for a, b in zip(after, local_shards(model)))
    assert scaler.get_scale() == INIT_SCALE / 2


@distributed_test(world_size=2)
def test_inf_on_one_rank_skips_on_every_rank():
    diff.quiet()
    check_inf_on_one_rank("ours")


@distributed_test(world_size=2)
def test_torch_scaler_works_unchanged_with_dtensor_grads():
    """torch's FSDP1 scaler finds the inf through DTensor's own found-inf reduction (MAX over the
    gradient's mesh), then all-reduces its flags again: it works on our gradients as they are."""
    diff.quiet()
    check_inf_on_one_rank("torch")


def fp16_training(ours: bool, steps: int = 8) -> dict:
    """fp16 training from a scale so large that the first steps overflow and are skipped."""
    model = fp16_model(ours)
    optimizer = diff.make_optimizer("adamw", model.parameters())
    scaler = (ShardedGradScaler if ours else TorchShardedGradScaler)(diff.device().type, init_scale=2.0**SCALE_EXP, growth_interval=3)
    losses, scales = [], []
    for step in range(steps):
        losses.append(scaled_step(model, optimizer, scaler, step))
        scales.append(scaler.get_scale())
    return {"losses": losses, "scales": scales}


@distributed_test(world_size=2)
def test_fp16_training_matches_fsdp1():
    diff.quiet()
    ours = fp16_training(True)
    expected = fsdp1_or_golden("fp16-grad-scaler", lambda: fp16_training(False))
    assert ours["scales"] == expected["scales"]
    scales = [2.0**SCALE_EXP] + ours["scales"]
    assert any(b < a for a, b in zip(scales, scales[1:])), "no step overflowed: nothing was tested"
    assert any(b > a for a, b in zip(scales, scales[1:])), "the scale never grew: no step trained"
    assert_losses_close(ours["losses"], expected["losses"], torch.float16, "losses")
    assert same_on_all_ranks(ours["scales"])


@distributed_test(world_size=2)
def test_scale_grows_identically_on_every_rank():
    diff.quiet()
    model = fp16_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ShardedGradScaler(diff.device().type, init_scale=8.0, growth_interval=2)
    scales = [scaled_step(model, optimizer, scaler, step) and scaler.get_scale() for step in range(4)]
    assert scales == [8.0, 16.0, 16.0, 32.0]
    assert same_on_all_ranks(scales)


@distributed_test(world_size=2)
def test_plain_and_sharded_grads_together():
    """Ignored parameters keep plain-tensor gradients next to the managed ones (DTensors, or plain
    local shards with ``dtensor_params=False``); an inf in an ignored gradient on one rank still
    makes every rank skip."""
    diff.quiet()
    model = diff.make_model()
    ignored = model.blocks[0].mlp.half()  # not managed, so not cast: it must already compute in fp16
    wrapped = FSDP(model, ignored_states=[ignored], mixed_precision=fsdp_compat.MixedPrecision(**FP16))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    scaler = ShardedGradScaler(diff.device().type, init_scale=INIT_SCALE)
    tokens, targets = diff.local_batch(0)
    scaler.scale(diff.loss_fn(wrapped, tokens, targets)).backward()
    kinds = {(type(p.grad).__name__, p.grad.dtype) for p in wrapped.parameters() if p.grad is not None}
    managed = "DTensor" if fsdp_module.DTENSOR_PARAMS else "Tensor"
    assert kinds == {(managed, torch.float32), ("Tensor", torch.float16)}
    if dist.get_rank() == 0:
        ignored.fc.weight.grad.view(-1)[0] = float("nan")
    before = [p.detach().clone() for p in wrapped.parameters()]
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, wrapped.parameters()))
    assert scaler.get_scale() == INIT_SCALE / 2


@distributed_test(world_size=2)
def test_rank_without_gradients_still_agrees():
    """A rank with no gradient at all still takes part in the agreement (one collective always)."""
    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = ShardedGradScaler(diff.device().type, init_scale=4.0)
    scaler.scale(torch.ones(()))  # initialise the scale, as scale(loss) does
    if dist.get_rank() == 1:
        param.grad = torch.tensor([1.0, float("inf"), 1.0])
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(param.detach(), torch.ones(3))
    assert scaler.get_scale() == 2.0


def test_scale_keeps_the_loss_dtype():
    scaler = ShardedGradScaler(diff.device().type, init_scale=4.0)
    loss = torch.tensor(1.5, dtype=torch.float16)
    assert scaler.scale(loss).dtype == torch.float16
    assert scaler.scale(loss).item() == 6.0
    assert [t.dtype for t in scaler.scale([loss, loss.float()])] == [torch.float16, torch.float32]
    assert ShardedGradScaler(diff.device().type, enabled=False).scale(loss) is loss
