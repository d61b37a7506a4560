"""Model state dicts, loading side: atomic loads under bad input, strict=False, accepted value
kinds (plain, DTensor, FSDP1's ShardedTensor), and loads at odd moments.

Atomicity is checked the strong way: the full value of every parameter and buffer on every rank
is compared before and after a failed load (FSDP1 itself copies the valid entries first).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import distributed_test
from tests import differential as diff
from tests.test_state_dict import FULL, LOCAL, SHARDED, build, plain_reference, state_dict_of

needs_fsdp1 = pytest.mark.skipif(not diff.HAVE_FSDP1, reason="runs torch FSDP1 side by side")

STEPS_MORE = 4


def shifted(state_dict: dict) -> dict:
    """The same state dict with every floating-point value changed (so a copy would show); a
    ShardedTensor's local shards are changed in place (state dict values are copies)."""
    def shift(value):
        if type(value).__name__ == "ShardedTensor":
            for shard in value.local_shards():
                shard.tensor.add_(1.0)
            return value
        return value + 1.0 if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    return {k: shift(v) for k, v in state_dict.items()}


def _quantized(value: torch.Tensor) -> torch.Tensor:
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.zeros(value.shape), 0.1, 0, torch.quint8)


# fault name -> (how to corrupt the dict on the ranks that corrupt it, key the error names)
FAULTS = {
    "missing_key": (lambda sd: sd.pop("ln_f.bias"), "ln_f.bias"),
    "unexpected_key": (lambda sd: sd.__setitem__("extra.weight", torch.zeros(2)), "extra.weight"),
    "wrong_shape": (lambda sd: sd.__setitem__("blocks.1.mlp.fc.weight", torch.zeros(3, 3)), "blocks.1.mlp.fc.weight"),
    "wrong_buffer_shape": (lambda sd: sd.__setitem__("logit_scale", torch.zeros(3)), "logit_scale"),
    "not_a_tensor": (lambda sd: sd.__setitem__("ln_f.bias", "abc"), "ln_f.bias"),
    "meta_tensor": (lambda sd: sd.__setitem__("blocks.0.ln1.weight", torch.empty(32, device="meta")),
                    "blocks.0.ln1.weight"),
    "uncastable_dtype": (lambda sd: sd.__setitem__("ln_f.weight", _quantized(sd["ln_f.weight"])), "ln_f.weight"),
    "fsdp1_local_format": (lambda sd: sd.__setitem__("blocks.0._flat_param", torch.zeros(4)), "_flat_param"),
}


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("bad_ranks", ["all", "rank1"])
@distributed_test(world_size=2)
def test_bad_input_raises_and_changes_nothing_anywhere(state_dict_type, fault, bad_ranks):
    state_dict_type = getattr(fsdp_compat.StateDictType, state_dict_type)
    model = build(FSDP)
    incoming = shifted(state_dict_of(model, state_dict_type))
    corrupt, named_key = FAULTS[fault]
    if bad_ranks == "all" or dist.get_rank() == 1:
        corrupt(incoming)
    before = diff.model_state(model)
    with FSDP.state_dict_type(model, state_dict_type):
        with pytest.raises(RuntimeError) as raised:
            model.load_state_dict(incoming)
    message = str(raised.value)
    if bad_ranks == "all" or dist.get_rank() == 1:
        assert named_key in message, message
    else:
        assert "rank(s) [1]" in message and "nothing was loaded" in message, message
    after = diff.model_state(model)
    for key in before:
        assert torch.equal(before[key], after[key]), f"{key} changed by a failed load"
    # And the model still loads and trains.
    with FSDP.state_dict_type(model, state_dict_type):
        model.load_state_dict(shifted(state_dict_of(model, state_dict_type)))
    diff.train(model, torch.optim.SGD(model.parameters(), lr=0.05), 1)


@distributed_test(world_size=4)
def test_bad_input_on_one_rank_world_4():
    model = build(FSDP, "HYBRID_SHARD")
    incoming = shifted(state_dict_of(model, SHARDED))
    if dist.get_rank() == 3:
        incoming.pop("tok_emb.weight")
    before = diff.model_state(model)
    with FSDP.state_dict_type(model, SHARDED), pytest.raises(RuntimeError, match="tok_emb.weight|rank"):
        model.load_state_dict(incoming)
    after = diff.model_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@needs_fsdp1
@pytest.mark.parametrize("fault", ["missing_key", "unexpected_key", "wrong_shape", "not_a_tensor"])
@distributed_test(world_size=2)
def test_bad_input_error_type_matches_fsdp1(fault):
    corrupt, _ = FAULTS[fault]
    for wrapper_class in (FSDP, diff.TorchFSDP):
        model = build(wrapper_class, steps=0)
        incoming = dict(model.state_dict())
        corrupt(incoming)
        with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
            model.load_state_dict(incoming)


def strict_false_result(wrapper_class) -> tuple[_IncompatibleKeys, dict]:
    model = build(wrapper_class)
    incoming = shifted(state_dict_of(model, FULL))
    incoming.pop("ln_f.bias")
    incoming.pop("blocks.0.attn.qkv.weight")
    incoming["extra.weight"] = torch.zeros(2)
    result = model.load_state_dict(incoming, strict=False)
    return result, state_dict_of(model, FULL)


@needs_fsdp1
@distributed_test(world_size=2)
def test_strict_false_reports_keys_as_fsdp1():
    (ours_keys, ours_sd), (theirs_keys, theirs_sd) = strict_false_result(FSDP), strict_false_result(diff.TorchFSDP)
    assert ours_keys == theirs_keys
    assert ours_keys.missing_keys == ["blocks.0.attn.qkv.weight", "ln_f.bias"]
    assert ours_keys.unexpected_keys == ["extra.weight"]
    for key in theirs_sd:  # present keys loaded, missing ones kept
        assert diff.relative_error(ours_sd[key], theirs_sd[key]) <= 1e-5, key


@distributed_test(world_size=2)
def test_full_state_dict_loads_into_the_unwrapped_module_and_back():
    model = build(FSDP)
    full = state_dict_of(model, FULL)
    plain = diff.make_model(seed=5)
    assert plain.load_state_dict(full, strict=True) == _IncompatibleKeys([], [])
    reference = plain_reference()
    for key, value in plain.state_dict().items():
        assert diff.relative_error(value, reference.state_dict()[key]) <= 1e-5, key
    # And the unwrapped module's own state dict loads into a wrapped one, strictly.
    other = build(FSDP, steps=0)
    assert other.load_state_dict(plain.state_dict()) == _IncompatibleKeys([], [])
    after = state_dict_of(other, FULL)
    for key in full:
        assert torch.equal(after[key], full[key]), key


class _LazyTensor:
    """A tensor-like checkpoint value that is not a tensor (Lightning loads FULL checkpoints as such):
    torch functions receive the tensor it stands for; it has no tensor methods of its own."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.shape, self.dtype = tensor.shape, tensor.dtype

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        loaded = [a._tensor if isinstance(a, _LazyTensor) else a for a in args]
        return func(*loaded, **(kwargs or {}))


@distributed_test(world_size=2)
def test_full_state_dict_of_tensor_like_values_loads_as_into_a_plain_module():
    full = state_dict_of(build(FSDP), FULL)
    lazy = {key: _LazyTensor(value) for key, value in full.items()}
    plain = diff.make_model(seed=5)
    plain.load_state_dict(lazy)  # nn.Module reaches them through torch functions
    other = build(FSDP, steps=0)
    assert other.load_state_dict(lazy) == _IncompatibleKeys([], [])
    after = state_dict_of(other, FULL)
    for key in full:
        assert torch.equal(after[key], full[key]), key
        assert torch.equal(after[key], plain.state_dict()[key]), key


@needs_fsdp1
@distributed_test(world_size=2)
def test_load_accepts_sharded_tensor_and_dtensor_whatever_the_type():
    """FSDP1's SHARDED values (ShardedTensor by default, DTensor with a device mesh) and ours
    (DTensor) load under any state-dict type; a plain full tensor loads under FULL and SHARDED."""
    from torch.distributed.device_mesh import init_device_mesh

    expected = state_dict_of(build(diff.TorchFSDP), FULL)
    fsdp1_sharded = state_dict_of(build(diff.TorchFSDP), SHARDED)
    fsdp1_dtensor = state_dict_of(build(diff.TorchFSDP, device_mesh=init_device_mesh(diff.device().type, (2,))), SHARDED)
    assert type(fsdp1_sharded["tok_emb.weight"]).__name__ == "ShardedTensor"
    assert isinstance(fsdp1_dtensor["tok_emb.weight"], DTensor)
    ours_sharded = state_dict_of(build(FSDP), SHARDED)
    for incoming in (fsdp1_sharded, fsdp1_dtensor, ours_sharded, expected):
        for state_dict_type in (FULL, SHARDED, LOCAL):
            if state_dict_type == LOCAL and incoming is expected:
                continue  # plain values under LOCAL are this rank's pieces
            model = build(FSDP, steps=0)
            with FSDP.state_dict_type(model, state_dict_type):
                model.load_state_dict(incoming)
            after = state_dict_of(model, FULL)
            for key in expected:
                assert diff.relative_error(after[key], expected[key]) <= 1e-5, (state_dict_type, key)


@needs_fsdp1
@distributed_test(world_size=2)
def test_load_after_no_grad_forward_is_used_by_the_next_forward():
    """A no-grad forward leaves the root's (low-precision) parameters unsharded; a load then
    writes the shards and the next forward uses the loaded values."""
    policy = fsdp_compat.MixedPrecision(param_dtype=torch.float16, buffer_dtype=torch.float16)
    model = build(FSDP, steps=0, mixed_precision=policy)
    theirs = build(diff.TorchFSDP, steps=0, mixed_precision=diff.torch_fsdp.MixedPrecision(
        param_dtype=torch.float16, buffer_dtype=torch.float16))
    tokens = diff.local_batch(0)[0]
    incoming = shifted(state_dict_of(model, FULL))
    outputs = []
    for wrapped in (model, theirs):
        with torch.no_grad():
            wrapped(tokens)
            wrapped.load_state_dict(incoming)
            outputs.append(wrapped(tokens).float())
    assert model.logit_scale.dtype == torch.float16
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-3, atol=1e-3)
    after = state_dict_of(model, FULL)
    for key, value in incoming.items():
        assert torch.equal(after[key], value), key


@needs_fsdp1
@distributed_test(world_size=2)
def test_load_inside_summon_full_params_is_written_back_as_fsdp1():
    results = []
    for wrapper_class in (FSDP, diff.TorchFSDP):
        model = build(wrapper_class)
        incoming = shifted(state_dict_of(model, FULL))
        with wrapper_class.summon_full_params(model):
            model.load_state_dict(incoming)
        results.append(state_dict_of(model, FULL))
    for key in results[1]:
        assert diff.relative_error(results[0][key], results[1][key]) <= 1e-5, key


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
@distributed_test(world_size=2)
def test_load_with_cpu_offload_and_assign(state_dict_type):
    state_dict_type = getattr(fsdp_compat.StateDictType, state_dict_type)
    source = build(FSDP, steps=STEPS_MORE)
    incoming = state_dict_of(source, state_dict_type)
    expected = state_dict_of(source, FULL)
    for kwargs, assign in (({"cpu_offload": fsdp_compat.CPUOffload(offload_params=True)}, False), ({}, True)):
        model = build(FSDP, **kwargs)
        with FSDP.state_dict_type(model, state_dict_type):
            model.load_state_dict(incoming, assign=assign)
        after = state_dict_of(model, FULL)
        for key in expected:
            assert torch.equal(after[key], expected[key]), key
        diff.train(model, torch.optim.SGD(model.parameters(), lr=0.05), 1)  # still trains



def nested_load(wrapper_class) -> tuple[_IncompatibleKeys, dict]:
    outer = nn.Sequential(build(wrapper_class, steps=STEPS_MORE))
    incoming = shifted(outer.state_dict())
    target = nn.Sequential(build(wrapper_class))
    assert target.load_state_dict(incoming) == _IncompatibleKeys([], [])
    loaded = target.state_dict()
    incoming.pop("0.ln_f.bias")
    incoming["0.extra.weight"] = torch.zeros(1)
    result = target.load_state_dict(incoming, strict=False)
    return result, loaded


@needs_fsdp1
@distributed_test(world_size=2)
def test_load_through_a_plain_module_holding_the_root():
    """``DDP(FSDP(model))``-style nesting: the plain module's load_state_dict reaches the wrapper
    with clean keys, as in FSDP1."""
    (ours_result, ours_loaded), (theirs_result, theirs_loaded) = nested_load(FSDP), nested_load(diff.TorchFSDP)
    assert ours_result == theirs_result == _IncompatibleKeys(["0.ln_f.bias"], ["0.extra.weight"])
    assert list(ours_loaded) == list(theirs_loaded)
    for key in theirs_loaded:
        assert diff.relative_error(ours_loaded[key], theirs_loaded[key]) <= 1e-5, key
    # A strict failure there leaves the wrapped model as it was.
    target = nn.Sequential(build(FSDP))
    before = diff.model_state(target)
    incoming = shifted(target.state_dict())
    incoming["0.blocks.0.ln1.weight"] = torch.zeros(5)
    with pytest.raises(RuntimeError, match="blocks.0.ln1.weight"):
        target.load_state_dict(incoming)
    after = diff.model_state(target)
    assert all(torch.equal(before[k], after[k]) for k in before)
