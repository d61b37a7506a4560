"""``clip_grad_norm_``: the total norm over all shards, against ``torch.nn.utils.clip_grad_norm_`` on
the unsharded single-process model (1e-6) and torch FSDP1 run side by side (golden values in
``tests/golden/runtime_clip.json`` once torch drops FSDP1).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.examples import Block, GPTConfig
from fsdp_compat.testing import distributed_test
from tests import differential as diff

GOLDEN = "runtime_clip"
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
MAX_NORM = 0.5  # below every total norm here, so clipping really scales


def _hybrid_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(diff.device().type, (2, dist.get_world_size() // 2),
                            mesh_dim_names=("replicate", "shard"))


def _build(wrapper_class, strategy: str = "FULL_SHARD", model: nn.Module | None = None,
           policy: bool = True, **kwargs) -> nn.Module:
    is_fsdp1 = wrapper_class is diff.TorchFSDP
    if strategy in HYBRID:
        kwargs.setdefault("device_mesh", _hybrid_mesh())
    if policy:
        kwargs["auto_wrap_policy"] = (diff.block_policy_torch() if is_fsdp1
                                      else fsdp_compat.wrap.ModuleWrapPolicy({Block}))
    return wrapper_class(model if model is not None else diff.make_model(),
                         sharding_strategy=fsdp_compat.ShardingStrategy[strategy],
                         **{"use_orig_params": True, **(diff.fsdp1_kwargs() if is_fsdp1 else {}), **kwargs})


def _clip_after_backward(model: nn.Module, batch, norm_type: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    diff.loss_fn(model, *batch).backward()
    total = model.clip_grad_norm_(MAX_NORM, norm_type)
    return total, diff.full_gradients(model)


def _reference_clip(norm_type: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = diff.make_model()
    diff.loss_fn(model, *diff.synthetic_batch(0, diff.GLOBAL_BATCH, GPTConfig(), diff.device())).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
    return total, {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters()}


def check_against_reference_and_fsdp1(strategy: str, norm_type: float, **kwargs) -> None:
    diff.quiet()
    total, grads = _clip_after_backward(_build(FSDP, strategy, **kwargs), diff.local_batch(0), norm_type)
    expected_total, expected_grads = _reference_clip(norm_type)
    assert total.dtype == torch.float32 and total.item() > MAX_NORM
    torch.testing.assert_close(total.cpu(), expected_total.cpu(), rtol=1e-6, atol=0)
    diff.assert_close_dicts(grads, expected_grads, rtol=1e-6, what="clipped grads vs reference")

    def fsdp1() -> list[float]:
        their_total, their_grads = _clip_after_backward(_build(diff.TorchFSDP, strategy), diff.local_batch(0), norm_type)
        assert their_total.dtype == total.dtype
        diff.assert_close_dicts(grads, their_grads, rtol=1e-6, what="clipped grads vs FSDP1")
        return [their_total.item()]
    if not kwargs:  # FSDP1 cannot offload parameters on a CPU-only machine
        diff.check_against_fsdp1(GOLDEN, diff.golden_key(strategy, norm_type), [total.item()], fsdp1, rtol=1e-6)


NORM_TYPES = [1.0, 2.0, 3.5, math.inf]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@distributed_test(world_size=2)
def test_total_norm_and_clipped_grads_match_reference_and_fsdp1(strategy, norm_type):
    check_against_reference_and_fsdp1(strategy, norm_type)


@pytest.mark.parametrize("strategy", HYBRID)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@distributed_test(world_size=4)
def test_hybrid_counts_each_shard_once(strategy, norm_type):
    check_against_reference_and_fsdp1(strategy, norm_type)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@distributed_test(world_size=2)
def test_clip_with_cpu_offload(norm_type):
    check_against_reference_and_fsdp1("FULL_SHARD", norm_type,
                                      cpu_offload=fsdp_compat.CPUOffload(offload_params=True))


class _Skinny(nn.Module):
    """``out`` has one output row: rank 1 holds empty shards of it. ``side`` is ignored."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.side = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.body(x) + self.side(x))).square().mean()


def _skinny_clip(wrapper_class, norm_type: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every rank sees the same batch, so the ignored (never reduced) gradients agree across ranks."""
    torch.manual_seed(0)
    inner = _Skinny()
    model = inner if wrapper_class is None else _build(wrapper_class, "FULL_SHARD", model=inner, policy=False,
                                                       ignored_modules=[inner.side])
    model(torch.randn(6, 8, generator=torch.Generator().manual_seed(1))).backward()
    if wrapper_class is None:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type)
    else:
        total = model.clip_grad_norm_(0.01, norm_type)
    return total, diff.full_gradients(model)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
@distributed_test(world_size=2)
def test_ignored_parameters_and_empty_shards_are_counted_once(norm_type):
    diff.quiet()
    total, grads = _skinny_clip(FSDP, norm_type)
    expected_total, expected_grads = _skinny_clip(None, norm_type)
    torch.testing.assert_close(total, expected_total, rtol=1e-6, atol=0)
    diff.assert_close_dicts(grads, expected_grads, rtol=1e-6)
    diff.check_against_fsdp1(GOLDEN, f"skinny-{norm_type}", [total.item()],
                             lambda: [_skinny_clip(diff.TorchFSDP, norm_type)[0].item()], rtol=1e-6)


# The total norm's distance from FSDP1's where units shard (README, "Runtime controls"): the same float32
# rule, summed over other per-rank element sets (measured for TinyGPT's 2-norm: at most 2e-7 relative).
SHARDED_NORM_RTOL = 1e-6
BF16_CASES = {  # case: (strategy, use_orig_params, where bf16 comes in)
    "NO_SHARD-bf16 model": ("NO_SHARD", True, "model"),
    "NO_SHARD-mixed precision": ("NO_SHARD", True, "param_dtype"),
    "NO_SHARD-low precision grads": ("NO_SHARD", False, "keep_low_precision_grads"),
    "FULL_SHARD-mixed precision": ("FULL_SHARD", True, "param_dtype"),
    "FULL_SHARD-low precision grads": ("FULL_SHARD", False, "keep_low_precision_grads"),
}


def _bf16_clipped_run(wrapper_class, case: str, steps: int = 4) -> dict[str, list[float]]:
    """Total norms and global losses of ``steps`` SGD steps clipped to ``MAX_NORM`` (every step clips)."""
    strategy, use_orig_params, bf16 = BF16_CASES[case]
    api = diff.torch_fsdp if wrapper_class is diff.TorchFSDP else fsdp_compat
    kwargs: dict = {"use_orig_params": use_orig_params}
    if bf16 != "model":
        kwargs["mixed_precision"] = api.MixedPrecision(param_dtype=torch.bfloat16,
                                                       keep_low_precision_grads=bf16 == "keep_low_precision_grads")
    model = _build(wrapper_class, strategy, model=diff.make_model().to(torch.bfloat16) if bf16 == "model" else None,
                   **kwargs)
    optimizer = diff.make_optimizer("sgd", model.parameters())
    norms, losses = [], []
    for step in range(steps):
        loss = diff.loss_fn(model, *diff.local_batch(step))
        loss.backward()
        norms.append(model.clip_grad_norm_(MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach())
        losses.append(loss.item())
    assert min(norms) > MAX_NORM
    return {"norms": norms, "losses": losses}


@pytest.mark.parametrize("case", list(BF16_CASES))
@distributed_test(world_size=2)
def test_bf16_clipping_like_fsdp1(case):
    """Where no unit shards (``NO_SHARD``, one rank), FSDP1 clips with ``torch.nn.utils.clip_grad_norm_``
    (norms in the gradients' dtype, the coefficient unrounded): the same norms and losses, to the bit. Where
    units shard, FSDP1's float32 rule: the norms within ``SHARDED_NORM_RTOL``, the losses of these steps too."""
    diff.quiet()
    ours = _bf16_clipped_run(FSDP, case)
    expected = diff.fsdp1_value(GOLDEN, diff.golden_key("bf16-clipped", case),
                                lambda: _bf16_clipped_run(diff.TorchFSDP, case))
    if case.startswith("NO_SHARD"):
        assert ours == expected
        return
    for what in ("norms", "losses"):
        diff.assert_close_lists(ours[what], expected[what], rtol=SHARDED_NORM_RTOL, what=f"{case}: {what} vs FSDP1")


def _dtypes(wrapper_class) -> dict[str, str]:
    """The returned norm's dtype: no gradients (FP32, with a warning), FP32 gradients under
    mixed precision, BF16 gradients of a BF16 model."""
    result = {}
    with pytest.warns(UserWarning, match="no gradients"):
        result["no grads"] = str(_build(wrapper_class).clip_grad_norm_(1.0).dtype)
    mixed = {"mixed_precision": (diff.torch_fsdp if wrapper_class is diff.TorchFSDP else fsdp_compat)
             .MixedPrecision(param_dtype=torch.bfloat16)}
    for name, model in [("mixed precision", _build(wrapper_class, **mixed)),
                        ("bf16 model", _build(wrapper_class, model=diff.make_model().to(torch.bfloat16)))]:
        diff.loss_fn(model, *diff.local_batch(0)).backward()
        result[name] = str(model.clip_grad_norm_(1.0).dtype)
    return result


@distributed_test(world_size=2)
def test_returned_dtype_like_fsdp1():
    diff.quiet()
    ours = _dtypes(FSDP)
    assert ours == {"no grads": "torch.float32", "mixed precision": "torch.float32", "bf16 model": "torch.bfloat16"}
    if diff.HAVE_FSDP1:
        assert _dtypes(diff.TorchFSDP) == ours


MISUSE = {  # case: (call, error, whether FSDP1 raises it too)
    "non-root": (lambda m: m.blocks[0].clip_grad_norm_(1.0), RuntimeError, True),
    "norm_type 'abc'": (lambda m: m.clip_grad_norm_(1.0, "abc"), ValueError, True),
    "max_norm None": (lambda m: m.clip_grad_norm_(None), TypeError, True),
    "negative max_norm": (lambda m: m.clip_grad_norm_(-1.0), ValueError, False),
    "zero norm_type": (lambda m: m.clip_grad_norm_(1.0, 0), ValueError, False),
    "negative norm_type": (lambda m: m.clip_grad_norm_(1.0, -2.0), ValueError, False),
}


@pytest.mark.parametrize("case", list(MISUSE))
@distributed_test(world_size=2)
def test_bad_calls_raise_clear_errors(case):
    """FSDP1 silently flips gradients for a negative ``max_norm``; fsdp_compat refuses it."""
    diff.quiet()
    call, error, fsdp1_raises = MISUSE[case]
    model = _build(FSDP)
    diff.loss_fn(model, *diff.local_batch(0)).backward()
    before = diff.full_gradients(model)
    with pytest.raises(error, match="root" if case == "non-root" else "norm"):
        call(model)
    diff.assert_close_dicts(diff.full_gradients(model), before, rtol=0, what="grads after a refused call")
    if fsdp1_raises and diff.HAVE_FSDP1:
        theirs = _build(diff.TorchFSDP)
        diff.loss_fn(theirs, *diff.local_batch(0)).backward()  # settles FSDP1's lazy root choice
        with pytest.raises(error):
            call(theirs)


@distributed_test(world_size=2)
def test_no_shard_clipping_communicates_nothing_so_one_rank_may_call_it_alone():
    """Under ``NO_SHARD`` every gradient is whole on every rank and FSDP1 clips with
    ``torch.nn.utils.clip_grad_norm_``, without a collective: rank 0 clips while rank 1 waits at a barrier
    (a collective would time out), then rank 1; both get the norm and gradients of a call made together."""
    import datetime

    diff.quiet()
    group = dist.new_group(timeout=datetime.timedelta(seconds=10))
    batch = diff.local_batch(0)
    together = _build(FSDP, "NO_SHARD", process_group=group)
    expected_total, expected_grads = _clip_after_backward(together, batch, 2.0)
    model = _build(FSDP, "NO_SHARD", process_group=group)
    diff.loss_fn(model, *batch).backward()
    for turn in range(dist.get_world_size()):
        if dist.get_rank() == turn:
            total = model.clip_grad_norm_(MAX_NORM, 2.0)
        dist.barrier()
    assert torch.equal(total, expected_total)
    diff.assert_close_dicts(diff.full_gradients(model), expected_grads, rtol=0, what="clipped rank by rank")


def _replace_grads_clip_and_step(wrapper_class, use_orig_params: bool) -> list[float]:
    """``NO_SHARD``: after backward the user replaces one gradient by a new tensor and drops another,
    clips, steps SGD, and trains one more step: the summed parameters after each step."""
    model = _build(wrapper_class, "NO_SHARD", use_orig_params=use_orig_params)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sums = []
    for step in range(2):
        diff.loss_fn(model, *diff.local_batch(step)).backward()
        if step == 0:
            with_grads = [param for param in model.parameters() if param.grad is not None]
            with_grads[0].grad = with_grads[0].grad * 3  # a new tensor, not the engine's
            with_grads[-1].grad = None
        model.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        sums.append(sum(value.double().sum().item() for value in diff.full_parameters(model).values()))
    return sums


@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2)
def test_no_shard_clipping_scales_gradients_the_user_replaced(use_orig_params):
    """A gradient replaced (or dropped) by the user before a ``NO_SHARD`` clip is what is clipped and
    stepped, as in FSDP1, whose ``clip_grad_norm_`` reads the parameters' ``.grad`` as they are."""
    diff.quiet()
    ours = _replace_grads_clip_and_step(FSDP, use_orig_params)
    expected = diff.fsdp1_value(GOLDEN, diff.golden_key("replaced-grads-clipped", use_orig_params),
                                lambda: _replace_grads_clip_and_step(diff.TorchFSDP, use_orig_params))
    diff.assert_close_lists(ours, expected, rtol=1e-6, what="parameter sums vs FSDP1")
