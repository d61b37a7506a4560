"""Model state dicts, saving side: settings, FULL / SHARDED / LOCAL against torch FSDP1.

Differential: the same seeded TinyGPT (uneven vocabulary, tied head, persistent and non-persistent
buffers) trained two steps under torch FSDP1 and under fsdp_compat must give state dicts with the
same keys in the same order and the same values; where FSDP1 cannot run (CPU offload, offload_to_cpu
on CPU), the single-process model is the reference.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import distributed_test
from tests import differential as diff

needs_fsdp1 = pytest.mark.skipif(not diff.HAVE_FSDP1, reason="runs torch FSDP1 side by side")

FULL = fsdp_compat.StateDictType.FULL_STATE_DICT
SHARDED = fsdp_compat.StateDictType.SHARDED_STATE_DICT
LOCAL = fsdp_compat.StateDictType.LOCAL_STATE_DICT
STEPS = 2


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def build(wrapper_class, strategy: str = "FULL_SHARD", auto_wrap: bool = True, use_orig_params: bool = True,
          steps: int = STEPS, **kwargs):
    """The seeded model wrapped by ``wrapper_class`` and trained ``steps`` SGD steps."""
    diff.quiet()
    model = diff.make_model()
    kwargs["sharding_strategy"] = getattr(diff.torch_fsdp.ShardingStrategy, strategy)
    if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") and "device_mesh" not in kwargs:
        from torch.distributed.device_mesh import init_device_mesh
        kwargs["device_mesh"] = init_device_mesh(diff.device().type, (2, dist.get_world_size() // 2))
    if auto_wrap:
        kwargs["auto_wrap_policy"] = diff.block_policy_torch()
    if wrapper_class is diff.TorchFSDP:
        kwargs.update(diff.fsdp1_kwargs())
    wrapped = wrapper_class(model, use_orig_params=use_orig_params, **kwargs)
    if steps:
        diff.train(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.05), steps)
    return wrapped


def state_dict_of(model, state_dict_type=FULL, config=None):
    """``model.state_dict()`` under ``state_dict_type`` (torch's enums for FSDP1, ours otherwise)."""
    wrapper_class = type(model)
    if wrapper_class is diff.TorchFSDP:
        state_dict_type = getattr(diff.torch_fsdp.StateDictType, state_dict_type.name)
    with wrapper_class.state_dict_type(model, state_dict_type, config):
        return model.state_dict()


def local_part(value: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a state-dict value (a DTensor's or ShardedTensor's local shard), or the value."""
    if isinstance(value, DTensor):
        return value.to_local()
    if type(value).__name__ == "ShardedTensor":
        shards = value.local_shards()
        return shards[0].tensor if shards else torch.empty(0, dtype=value.dtype)
    return value


def full_value(value: torch.Tensor) -> torch.Tensor:
    """A state-dict value as a full tensor (ShardedTensor / DTensor gathered on every rank)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if type(value).__name__ == "ShardedTensor":
        full = torch.zeros(value.size(), dtype=value.dtype) if dist.get_rank() == 0 else None
        value.gather(0, full)
        dist.broadcast_object_list(box := [full], src=0)
        return box[0]
    return value


def assert_same_state_dict(ours: dict, theirs: dict, what: str, exact: bool = False) -> None:
    """Same keys in the same order, same value kinds, dtypes, shapes and values."""
    assert list(ours) == list(theirs), f"{what}: keys/order differ\nours  {list(ours)}\ntheirs {list(theirs)}"
    for key in theirs:
        a, b = ours[key], theirs[key]
        assert isinstance(a, torch.Tensor) == isinstance(b, torch.Tensor), f"{what} {key}: kinds differ"
        # The same kind: plain tensors where FSDP1 has them, ShardedTensor or DTensor where it has those.
        assert type(a).__name__ == type(b).__name__, f"{what} {key}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{what} {key}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        a, b = full_value(a), full_value(b)
        if exact:
            assert torch.equal(a, b), f"{what} {key}: values differ"
        else:
            assert diff.relative_error(a, b) <= 1e-5, f"{what} {key}: values differ"


def plain_reference(steps: int = STEPS) -> nn.Module:
    """The single-process model trained like the wrapped ones (whole batch, same steps)."""
    model = diff.make_model()
    diff.train(model, torch.optim.SGD(model.parameters(), lr=0.05), steps, sharded=False)
    return model


# ---------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------


def check_settings(wrapper_class) -> dict:
    """What ``set/get_state_dict_type`` do, as comparable plain data."""
    fsdp_api = diff.torch_fsdp if wrapper_class is diff.TorchFSDP else fsdp_compat
    model = build(wrapper_class, steps=0)
    seen = {"default": repr(wrapper_class.get_state_dict_type(model))}
    previous = wrapper_class.set_state_dict_type(model, fsdp_api.StateDictType.SHARDED_STATE_DICT)
    seen["previous"] = repr(previous)
    seen["now"] = repr(wrapper_class.get_state_dict_type(model))
    with wrapper_class.state_dict_type(model, fsdp_api.StateDictType.FULL_STATE_DICT,
                                       fsdp_api.FullStateDictConfig(rank0_only=True)):
        seen["inside"] = repr(wrapper_class.get_state_dict_type(model))
    seen["restored"] = repr(wrapper_class.get_state_dict_type(model))
    for name, config in (("wrong_config", fsdp_api.FullStateDictConfig()),
                         ("wrong_optim_config", fsdp_api.FullOptimStateDictConfig())):
        try:
            kwargs = {"state_dict_config" if name == "wrong_config" else "optim_state_dict_config": config}
            wrapper_class.set_state_dict_type(model, fsdp_api.StateDictType.SHARDED_STATE_DICT, **kwargs)
            seen[name] = "no error"
        except Exception as error:  # noqa: BLE001 - the type is what we compare
            seen[name] = type(error).__name__
    seen["plain_get"] = repr(wrapper_class.get_state_dict_type(nn.Linear(2, 2)))
    seen["plain_set"] = repr(wrapper_class.set_state_dict_type(nn.Linear(2, 2), fsdp_api.StateDictType.FULL_STATE_DICT))
    wrapper_class.set_state_dict_type(model.blocks[0], fsdp_api.StateDictType.SHARDED_STATE_DICT)
    try:
        wrapper_class.get_state_dict_type(model)
        seen["disagree"] = "no error"
    except Exception as error:  # noqa: BLE001
        seen["disagree"] = type(error).__name__
    return seen


@needs_fsdp1
@distributed_test(world_size=2)
def test_state_dict_settings_match_fsdp1():
    ours, theirs = check_settings(FSDP), check_settings(diff.TorchFSDP)
    # Reprs name the classes' modules; what must match is everything else.
    assert {k: v.replace("torch.distributed.fsdp.api.", "") for k, v in theirs.items()} == ours
    # torch's config objects are accepted as ours.
    model = build(FSDP, steps=0)
    FSDP.set_state_dict_type(model, diff.torch_fsdp.StateDictType.SHARDED_STATE_DICT,
                             diff.torch_fsdp.ShardedStateDictConfig(offload_to_cpu=True))
    settings = FSDP.get_state_dict_type(model)
    assert settings.state_dict_type == SHARDED
    assert settings.state_dict_config == fsdp_compat.ShardedStateDictConfig(offload_to_cpu=True)


# ---------------------------------------------------------------------------------------------
# FULL
# ---------------------------------------------------------------------------------------------

FLAT_VARIANTS = list(itertools.product(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"], [True, False], [True, False]))


@needs_fsdp1
@pytest.mark.parametrize("strategy,auto_wrap,use_orig_params", FLAT_VARIANTS)
@distributed_test(world_size=2)
def test_full_state_dict_matches_fsdp1(strategy, auto_wrap, use_orig_params):
    ours = build(FSDP, strategy, auto_wrap, use_orig_params)
    theirs = build(diff.TorchFSDP, strategy, auto_wrap, use_orig_params)
    ours_sd, theirs_sd = state_dict_of(ours), state_dict_of(theirs)
    assert_same_state_dict(ours_sd, theirs_sd, "FULL")
    # Keys are the unwrapped model's, in its order; values plain tensors equal to the model's.
    assert list(ours_sd) == list(diff.make_model().state_dict())
    assert all(type(v) is torch.Tensor for v in ours_sd.values())
    expected = diff.model_state(ours)  # (lists a tied weight once, non-persistent buffers too)
    for key, value in ours_sd.items():
        assert torch.equal(value, expected.get(key, expected["tok_emb.weight"])), key
    assert torch.equal(ours_sd["head.weight"], ours_sd["tok_emb.weight"])


@needs_fsdp1
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
@distributed_test(world_size=4)
def test_full_state_dict_matches_fsdp1_world_4(strategy):
    ours, theirs = build(FSDP, strategy), build(diff.TorchFSDP, strategy)
    assert_same_state_dict(state_dict_of(ours), state_dict_of(theirs), "FULL")
    config = fsdp_compat.FullStateDictConfig(rank0_only=True)
    ours_sd = state_dict_of(ours, FULL, config)
    theirs_sd = state_dict_of(theirs, FULL, diff.torch_fsdp.FullStateDictConfig(rank0_only=True))
    assert list(ours_sd) == list(theirs_sd)


@needs_fsdp1
@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2)
def test_full_rank0_only_and_ignored_modules_match_fsdp1(use_orig_params):
    # rank0_only: rank 0 has everything, other ranks what FSDP1 gives them (nothing here).
    ours = build(FSDP, use_orig_params=use_orig_params)
    theirs = build(diff.TorchFSDP, use_orig_params=use_orig_params)
    ours_sd = state_dict_of(ours, FULL, fsdp_compat.FullStateDictConfig(rank0_only=True))
    theirs_sd = state_dict_of(theirs, FULL, diff.torch_fsdp.FullStateDictConfig(rank0_only=True))
    assert_same_state_dict(ours_sd, theirs_sd, "FULL rank0_only")
    assert bool(ours_sd) == (dist.get_rank() == 0)

    # Ignored modules: their parameters and buffers are in the state dict; under rank0_only,
    # FSDP1 gives other ranks their parameters (only).
    def with_ignored(wrapper_class):
        model = diff.make_model()
        kwargs = diff.fsdp1_kwargs() if wrapper_class is diff.TorchFSDP else {}
        return wrapper_class(model, auto_wrap_policy=diff.block_policy_torch(), use_orig_params=use_orig_params,
                             ignored_modules=[model.ln_f, model.blocks[1].mlp], **kwargs)

    ours, theirs = with_ignored(FSDP), with_ignored(diff.TorchFSDP)
    assert_same_state_dict(state_dict_of(ours), state_dict_of(theirs), "FULL ignored", exact=True)
    ours_sd = state_dict_of(ours, FULL, fsdp_compat.FullStateDictConfig(rank0_only=True))
    theirs_sd = state_dict_of(theirs, FULL, diff.torch_fsdp.FullStateDictConfig(rank0_only=True))
    assert_same_state_dict(ours_sd, theirs_sd, "FULL ignored rank0_only", exact=True)
    if dist.get_rank() != 0:
        assert ours_sd and all(k.startswith(("ln_f.", "blocks.1.mlp.")) for k in ours_sd)


@distributed_test(world_size=2)
def test_full_offload_to_cpu_and_cpu_offload_params():
    # FSDP1 fails on a CPU-only machine with either option; the plain model is the reference.
    reference = plain_reference().state_dict()
    for kwargs in ({}, {"cpu_offload": fsdp_compat.CPUOffload(offload_params=True)}):
        model = build(FSDP, **kwargs)
        for config in (fsdp_compat.FullStateDictConfig(offload_to_cpu=True),
                       fsdp_compat.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            sd = state_dict_of(model, FULL, config)
            if config.rank0_only and dist.get_rank() != 0:
                assert sd == {}
                continue
            assert list(sd) == list(reference)
            for key, value in sd.items():
                assert value.device.type == "cpu"
                assert diff.relative_error(value, reference[key]) <= 1e-5, key


@needs_fsdp1
@distributed_test(world_size=2)
def test_full_state_dict_mixed_precision_keeps_original_dtypes():
    """Parameters in full precision (the sharded masters), buffers in their original dtype,
    even after a no-grad forward left the root's low-precision parameters unsharded."""
    policy = dict(param_dtype=torch.float16, buffer_dtype=torch.float16)
    ours = build(FSDP, mixed_precision=fsdp_compat.MixedPrecision(**policy))
    theirs = build(diff.TorchFSDP, mixed_precision=diff.torch_fsdp.MixedPrecision(**policy))
    for model in (ours, theirs):
        with torch.no_grad():
            model(diff.local_batch(0)[0])
    assert ours.logit_scale.dtype == torch.float16  # the live buffer is in buffer_dtype
    for state_dict_type in (FULL, SHARDED):
        ours_sd, theirs_sd = state_dict_of(ours, state_dict_type), state_dict_of(theirs, state_dict_type)
        assert ours_sd["logit_scale"].dtype == torch.float32
        assert_same_state_dict(ours_sd, theirs_sd, f"{state_dict_type.name} mixed precision")


@distributed_test(world_size=2)
def test_state_dict_values_are_copies():
    """Parameter values are copies: an in-place change of a returned dict leaves the parameters alone.
    Buffers are the model's own, as in FSDP1 (``test_buffers_are_given_as_fsdp1_gives_them``): each of the
    three dicts adds one to them. Changed without grad, as ``torch.distributed.checkpoint.load`` writes: a
    LOCAL flat parameter's shard requires grad, as FSDP1's."""
    model = build(FSDP)
    before = diff.model_state(model)
    for state_dict_type in (FULL, SHARDED, LOCAL):
        for value in state_dict_of(model, state_dict_type).values():
            with torch.no_grad():
                local_part(value).add_(1.0)
    after = diff.model_state(model)
    buffers = {diff.clean_name(name) for name, _ in model.named_buffers()}
    for key in before:
        if key in buffers and key in state_dict_of(model, FULL):  # a non-persistent buffer is in none
            assert torch.equal(before[key] + 3, after[key]), key
        else:
            assert torch.equal(before[key], after[key]), key


def _autograd_flags(wrapper_class, use_orig_params: bool, state_dict_type) -> dict[str, list[str]]:
    """The state-dict keys (with and without ``keep_vars``) whose value, this rank's piece of it, requires
    grad, and those whose value carries autograd history."""
    model = build(wrapper_class, use_orig_params=use_orig_params)
    if wrapper_class is diff.TorchFSDP:
        state_dict_type = getattr(diff.torch_fsdp.StateDictType, state_dict_type.name)
    flags: dict[str, list[str]] = {"requires grad": [], "with history": []}
    for keep_vars in (False, True):
        with wrapper_class.state_dict_type(model, state_dict_type):
            state = model.state_dict(keep_vars=keep_vars)
        for key, value in state.items():
            piece = local_part(value) if isinstance(value, torch.Tensor) else None
            if piece is not None and piece.requires_grad:
                flags["requires grad"].append(f"{key} keep_vars={keep_vars}")
            if piece is not None and piece.grad_fn is not None:
                flags["with history"].append(f"{key} keep_vars={keep_vars}")
    return flags


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("state_dict_type", [FULL, SHARDED, LOCAL])
@distributed_test(world_size=2)
def test_state_dict_values_require_grad_and_carry_history_as_fsdp1s(state_dict_type, use_orig_params):
    """Whether each value requires grad, and that none carries autograd history (a value built from a
    parameter under grad mode would, and ``torch.save`` of it would then refuse or keep the graph), as in
    FSDP1's state dicts, with and without ``keep_vars``."""
    ours = _autograd_flags(FSDP, use_orig_params, state_dict_type)
    expected = diff.fsdp1_value("state_dict_fsdp1", diff.golden_key("autograd-flags", state_dict_type.name,
                                                                    use_orig_params),
                                lambda: _autograd_flags(diff.TorchFSDP, use_orig_params, state_dict_type))
    assert ours == expected
    assert not ours["with history"]


def _ignored_parameter_values(wrapper_class, state_dict_type, keep_vars: bool) -> dict[str, str]:
    """How each ignored parameter's state-dict value relates to the live parameter: ``"itself"``,
    ``"detached, same storage"`` or ``"copy"`` (``ln_f`` and ``blocks.1.mlp`` ignored)."""
    model = diff.make_model()
    kwargs = diff.fsdp1_kwargs() if wrapper_class is diff.TorchFSDP else {}
    wrapped = wrapper_class(model, auto_wrap_policy=diff.block_policy_torch(), use_orig_params=True,
                            ignored_modules=[model.ln_f, model.blocks[1].mlp], **kwargs)
    if wrapper_class is diff.TorchFSDP:
        state_dict_type = getattr(diff.torch_fsdp.StateDictType, state_dict_type.name)
    with wrapper_class.state_dict_type(wrapped, state_dict_type):
        state = wrapped.state_dict(keep_vars=keep_vars)
    kinds = {}
    for name, param in model.named_parameters():
        key = diff.clean_name(name)
        if key.startswith(("ln_f.", "blocks.1.mlp.")):
            value = state[key]
            kinds[key] = ("itself" if value is param else "detached, same storage"
                          if value.data_ptr() == param.data_ptr() and not value.requires_grad else "copy")
    return kinds


@pytest.mark.parametrize("keep_vars", [False, True])
@pytest.mark.parametrize("state_dict_type", [FULL, SHARDED, LOCAL])
@distributed_test(world_size=2)
def test_ignored_parameters_are_given_as_themselves_like_fsdp1(state_dict_type, keep_vars):
    """FSDP1 never copies an ignored parameter: the state dict holds the parameter itself (detached
    unless ``keep_vars``), so loading into that dict in place changes the parameter."""
    diff.quiet()
    ours = _ignored_parameter_values(FSDP, state_dict_type, keep_vars)
    expected = diff.fsdp1_value("state_dict_fsdp1", diff.golden_key("ignored-values", state_dict_type.name, keep_vars),
                                lambda: _ignored_parameter_values(diff.TorchFSDP, state_dict_type, keep_vars))
    assert ours == expected
    assert set(ours.values()) == {"itself" if keep_vars else "detached, same storage"}


class _Inner(nn.Module):
    """A unit holding a float and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("stat", torch.arange(4.0))
        self.register_buffer("count", torch.tensor(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.stat


class _Outer(nn.Module):
    """A root with a buffer of its own around an :class:`_Inner` unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.head = nn.Linear(4, 2)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x)) * self.scale


def _buffer_values(wrapper_class, state_dict_type, use_orig_params: bool, buffer_dtype: bool, strategy: str,
                   keep_vars: bool, **config) -> dict[str, str]:
    """How each buffer's state-dict value relates to the live buffer after a step: ``"itself"``, ``"detached,
    same storage"``, ``"copy"`` (with its dtype) or ``"missing"``."""
    torch.manual_seed(0)
    kwargs = dict(use_orig_params=use_orig_params,
                  sharding_strategy=getattr(diff.torch_fsdp.ShardingStrategy, strategy),
                  auto_wrap_policy=(diff.torch_wrap or fsdp_compat.wrap).ModuleWrapPolicy({_Inner}))
    if buffer_dtype:
        kwargs["mixed_precision"] = diff.torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16,
                                                                   buffer_dtype=torch.bfloat16)
    if wrapper_class is diff.TorchFSDP:
        kwargs.update(diff.fsdp1_kwargs())
    model = wrapper_class(_Outer().to(diff.device()), **kwargs)
    # A step first: FSDP1 casts the buffers to buffer_dtype at its first forward.
    model(torch.randn(2, 4, device=diff.device())).sum().backward()
    config_class = {FULL: diff.torch_fsdp.FullStateDictConfig, SHARDED: diff.torch_fsdp.ShardedStateDictConfig,
                    LOCAL: diff.torch_fsdp.LocalStateDictConfig}[state_dict_type]
    with wrapper_class.state_dict_type(model, getattr(diff.torch_fsdp.StateDictType, state_dict_type.name),
                                       config_class(**config)):
        state = model.state_dict(keep_vars=keep_vars)
    kinds = {}
    for name, buffer in model.named_buffers():
        key = diff.clean_name(name)
        value = state.get(key)
        kinds[key] = ("missing" if value is None else "itself" if value is buffer else "detached, same storage"
                      if value.data_ptr() == buffer.data_ptr() and value.dtype == buffer.dtype
                      else f"copy, {value.dtype}")
    return kinds


def _buffer_cases(state_dict_type) -> list[tuple[bool, bool, str, bool, dict[str, bool]]]:
    """(use_orig_params, buffer_dtype, strategy, keep_vars, config) to compare. Not FULL with
    ``offload_to_cpu``: FSDP1 crashes there on a CPU-only machine (SIGSEGV in its unshard); ours gives
    what its code does (``.to("cpu")``: the buffer itself when already on the CPU)."""
    configs: list[dict[str, bool]] = ([{"rank0_only": False}, {"rank0_only": True}] if state_dict_type == FULL
                                      else [{"offload_to_cpu": False}, {"offload_to_cpu": True}])
    return list(itertools.product([True, False], [False, True], ["FULL_SHARD", "NO_SHARD"], [False, True], configs))


@pytest.mark.parametrize("state_dict_type", [FULL, SHARDED, LOCAL])
@distributed_test(world_size=2)
def test_buffers_are_given_as_fsdp1_gives_them(state_dict_type):
    """FSDP1 gives each buffer itself (detached unless ``keep_vars``), for every type, strategy and config,
    except FULL and SHARDED under ``buffer_dtype``: copies in the original dtypes (integer buffers too),
    as does ``NO_SHARD`` (its state dicts are FULL) even when LOCAL is asked for. Every rank's answers
    (``rank0_only`` leaves other ranks without buffers) against FSDP1's."""
    diff.quiet()

    def every_rank(wrapper_class) -> list[list[dict[str, str]]]:
        mine = [_buffer_values(wrapper_class, state_dict_type, *case[:4], **case[4])
                for case in _buffer_cases(state_dict_type)]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return gathered

    ours = every_rank(FSDP)
    expected = diff.fsdp1_value("state_dict_fsdp1", diff.golden_key("buffer-values", state_dict_type.name),
                                lambda: every_rank(diff.TorchFSDP))
    for rank, (ours_rank, expected_rank) in enumerate(zip(ours, expected)):
        for case, ours_case, expected_case in zip(_buffer_cases(state_dict_type), ours_rank, expected_rank):
            assert ours_case == expected_case, f"rank {rank}, {case}"
    assert "detached, same storage" in str(ours) and "copy" in str(ours)  # both kinds compared


class _Stats(nn.Module):
    """A module to ignore: a parameter and a float buffer, used in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.register_buffer("run", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w.to(x.dtype) + self.run.to(x.dtype)


class _Block(nn.Module):
    """A unit with a buffer of its own and a :class:`_Stats` inside."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.stats = _Stats()
        self.register_buffer("stat", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stats(self.lin(x)) + self.stat.to(x.dtype)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block0, self.block1, self.stats = _Block(), _Block(), _Stats()
        self.head = nn.Linear(4, 2)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stats(self.block1(self.block0(x)))) * self.scale


def _nested_ignored_buffer_values(wrapper_class, layout: str) -> dict[str, dict[str, str]]:
    """Per state-dict type, how each buffer's value relates to the live buffer (whose dtype after the first
    forward is given too) when ignored modules sit at two levels under ``buffer_dtype``: ``block0.stats`` is
    ignored by a manually nested unit, or by the root whose policy then wraps ``block0``; ``stats`` by the root."""
    torch.manual_seed(0)
    kwargs: dict = {"mixed_precision": diff.torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16,
                                                                      buffer_dtype=torch.bfloat16)}
    if wrapper_class is diff.TorchFSDP:
        kwargs.update(diff.fsdp1_kwargs())
    net = _Net().to(diff.device())
    if layout == "manual":
        net.block0 = wrapper_class(net.block0, ignored_modules=[net.block0.stats], **kwargs)
        net.block1 = wrapper_class(net.block1, **kwargs)
        model = wrapper_class(net, ignored_modules=[net.stats], **kwargs)
    else:
        model = wrapper_class(net, ignored_modules=[net.stats, net.block0.stats],
                              auto_wrap_policy=(diff.torch_wrap or fsdp_compat.wrap).ModuleWrapPolicy({_Block}),
                              **kwargs)
    model(torch.randn(2, 4, device=diff.device())).sum().backward()  # FSDP1 casts the buffers here
    values = {}
    for state_dict_type in (FULL, SHARDED, LOCAL):
        with wrapper_class.state_dict_type(model, getattr(diff.torch_fsdp.StateDictType, state_dict_type.name)):
            state = model.state_dict()
        for name, buffer in model.named_buffers():
            value = state[diff.clean_name(name)]
            values.setdefault(diff.clean_name(name), {})[state_dict_type.name] = (
                f"{buffer.dtype}: " + ("detached, same storage" if value.data_ptr() == buffer.data_ptr()
                                       and value.dtype == buffer.dtype else f"copy, {value.dtype}"))
    return values


@pytest.mark.parametrize("layout", ["manual", "auto_wrap"])
@distributed_test(world_size=2)
def test_nested_units_ignored_buffers_are_given_as_fsdp1_gives_them(layout):
    """FSDP1 leaves alone the buffers of every ignored module in a unit, nested units' included: not cast to
    ``buffer_dtype``, the buffer itself in every state dict. Its auto-wrap policy passes the children only the
    ignored parameters, so there a child casts and copies the buffers of the ignored modules inside it."""
    diff.quiet()
    ours = _nested_ignored_buffer_values(FSDP, layout)
    expected = diff.fsdp1_value("state_dict_fsdp1", diff.golden_key("nested-ignored-buffer-values", layout),
                                lambda: _nested_ignored_buffer_values(diff.TorchFSDP, layout))
    assert ours == expected


# ---------------------------------------------------------------------------------------------
# SHARDED and LOCAL
# ---------------------------------------------------------------------------------------------


@needs_fsdp1
@pytest.mark.parametrize("strategy,auto_wrap,use_orig_params", FLAT_VARIANTS)
@distributed_test(world_size=2)
def test_sharded_state_dict_matches_fsdp1(strategy, auto_wrap, use_orig_params):
    ours = build(FSDP, strategy, auto_wrap, use_orig_params)
    theirs = build(diff.TorchFSDP, strategy, auto_wrap, use_orig_params)
    ours_sd, theirs_sd = state_dict_of(ours, SHARDED), state_dict_of(theirs, SHARDED)
    assert_same_state_dict(ours_sd, theirs_sd, "SHARDED")
    for key, value in ours_sd.items():
        theirs_value = theirs_sd[key]
        if strategy == "NO_SHARD" or "logit_scale" in key:  # full tensors, as FSDP1
            assert type(value) is torch.Tensor, key
            continue
        # FSDP1's ShardedTensor, with its torch.chunk pieces: same metadata, same local shards.
        assert type(value).__name__ == type(theirs_value).__name__ == "ShardedTensor", key
        assert value.metadata() == theirs_value.metadata(), key
        assert [s.metadata for s in value.local_shards()] == [s.metadata for s in theirs_value.local_shards()], key
        assert diff.relative_error(local_part(value), local_part(theirs_value)) <= 1e-5, key


def value_kinds(wrapper_class, state_dict_type: str, use_dtensor: bool, with_device_mesh: bool,
                hybrid: bool = False) -> dict[str, list[str]]:
    """The kinds (class names) of a trained model's state-dict values and of its AdamW state under
    ``state_dict_type``: model, ``optim_state_dict`` and the legacy ``sharded_optim_state_dict``."""
    from torch.distributed.device_mesh import init_device_mesh
    diff.quiet()
    kwargs = {"device_id": diff.device()} if wrapper_class is diff.TorchFSDP else {}
    world = dist.get_world_size()
    if hybrid:  # FSDP1's (intra-node, inter-node) groups: 2 nodes of world/2 ranks
        kwargs["sharding_strategy"] = diff.torch_fsdp.ShardingStrategy.HYBRID_SHARD
        mesh = init_device_mesh(diff.device().type, (2, world // 2))
        kwargs["process_group"] = (mesh.get_group(1), mesh.get_group(0))
    if with_device_mesh:
        kwargs["device_mesh"] = init_device_mesh(diff.device().type, (world,))
    model = wrapper_class(diff.make_model(), auto_wrap_policy=diff.block_policy_torch(), use_orig_params=True,
                          **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    diff.train(model, optimizer, 1)
    api = diff.torch_fsdp if wrapper_class is diff.TorchFSDP else fsdp_compat
    config = (api.ShardedStateDictConfig(_use_dtensor=use_dtensor), api.ShardedOptimStateDictConfig(
        _use_dtensor=use_dtensor)) if state_dict_type == "SHARDED_STATE_DICT" else (None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with wrapper_class.state_dict_type(model, getattr(api.StateDictType, state_dict_type), *config):
            model_state = model.state_dict()
            optim_state = wrapper_class.optim_state_dict(model, optimizer)
        legacy = wrapper_class.sharded_optim_state_dict(model, optimizer)

    def kinds(values):
        return sorted({type(value).__name__ for value in values if value.dim() > 0})

    return {"model": kinds(model_state.values()),
            "optim": kinds(v for state in optim_state["state"].values() for v in state.values()),
            "legacy": kinds(v for state in legacy["state"].values() for v in state.values())}


# Where FSDP1 runs: the default is ShardedTensor (SHARDED and LOCAL alike, model and optimizer);
# DTensor under SHARDED for a model built with a device mesh, with or without ``_use_dtensor``.
VALUE_KIND_CASES = {"sharded": ("SHARDED_STATE_DICT", False, False), "local": ("LOCAL_STATE_DICT", False, False),
                    "sharded-device-mesh": ("SHARDED_STATE_DICT", False, True),
                    "sharded-use-dtensor-device-mesh": ("SHARDED_STATE_DICT", True, True)}


@pytest.mark.parametrize("case", sorted(VALUE_KIND_CASES))
@distributed_test(world_size=2)
def test_sharded_and_local_value_kinds_match_fsdp1(case):
    expected = diff.fsdp1_value("state_dict_value_kinds", diff.golden_key(case),
                                lambda: value_kinds(diff.TorchFSDP, *VALUE_KIND_CASES[case]))
    assert value_kinds(FSDP, *VALUE_KIND_CASES[case]) == expected


@distributed_test(world_size=4)
def test_hybrid_sharded_values_are_sharded_tensors_over_the_shard_group_as_fsdp1():
    expected = diff.fsdp1_value("state_dict_value_kinds", diff.golden_key("hybrid-process-groups"),
                                lambda: value_kinds(diff.TorchFSDP, "SHARDED_STATE_DICT", False, False, hybrid=True))
    assert value_kinds(FSDP, "SHARDED_STATE_DICT", False, False, hybrid=True) == expected


@distributed_test(world_size=2)
def test_use_dtensor_without_device_mesh_gives_dtensors():
    """FSDP1 fails there (its ``_use_dtensor`` path needs a device mesh); we give what was asked for."""
    assert value_kinds(FSDP, "SHARDED_STATE_DICT", True, False) == {
        "model": ["DTensor"], "optim": ["DTensor"], "legacy": ["ShardedTensor"]}


@needs_fsdp1
@distributed_test(world_size=4)
def test_sharded_state_dict_world_4_hybrid():
    ours, theirs = build(FSDP, "HYBRID_SHARD"), build(diff.TorchFSDP, "HYBRID_SHARD")
    ours_sd, theirs_sd = state_dict_of(ours, SHARDED), state_dict_of(theirs, SHARDED)
    assert_same_state_dict(ours_sd, theirs_sd, "SHARDED hybrid")
    # Built with a device mesh: DTensors over it, as FSDP1's.
    assert isinstance(ours_sd["tok_emb.weight"], DTensor)
    assert ours_sd["tok_emb.weight"].device_mesh.ndim == 2
    # Both load back into a differently trained hybrid model (FSDP1's over its own mesh).
    expected = state_dict_of(ours, FULL)
    for incoming in (ours_sd, theirs_sd):
        model = build(FSDP, "HYBRID_SHARD", steps=STEPS + 2)
        with FSDP.state_dict_type(model, SHARDED):
            model.load_state_dict(incoming)
        after = state_dict_of(model, FULL)
        for key in expected:
            assert diff.relative_error(after[key], expected[key]) <= 1e-5, key


@needs_fsdp1
@distributed_test(world_size=2)
def test_activation_checkpoint_wrappers_leave_keys_clean():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from fsdp_compat.examples import Block

    def checkpointed(wrapper_class):
        model = build(wrapper_class, steps=0)
        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
        diff.train(model, torch.optim.SGD(model.parameters(), lr=0.05), STEPS)
        return model

    ours, theirs = checkpointed(FSDP), checkpointed(diff.TorchFSDP)
    assert any("_checkpoint_wrapped_module" in name for name, _ in ours.named_parameters())
    for state_dict_type in (FULL, SHARDED):
        ours_sd = state_dict_of(ours, state_dict_type)
        assert_same_state_dict(ours_sd, state_dict_of(theirs, state_dict_type), f"{state_dict_type.name} checkpointed")
        with FSDP.state_dict_type(ours, state_dict_type):
            assert ours.load_state_dict(ours_sd) == nn.modules.module._IncompatibleKeys([], [])


@distributed_test(world_size=2)
def test_sharded_offload_to_cpu():
    model = build(FSDP, cpu_offload=fsdp_compat.CPUOffload(offload_params=True))
    reference = plain_reference().state_dict()
    sd = state_dict_of(model, SHARDED, fsdp_compat.ShardedStateDictConfig(offload_to_cpu=True))
    assert list(sd) == list(reference)
    for key, value in sd.items():
        assert local_part(value).device.type == "cpu"
        assert diff.relative_error(full_value(value), reference[key]) <= 1e-5, key


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@distributed_test(world_size=2)
def test_local_state_dict_round_trip(strategy):
    """LOCAL loads back at the same world size into a differently trained model, every value bit for bit
    (its format is FSDP1's: ``test_fsdp1_local_checkpoint.py``); ``NO_SHARD`` gives FSDP1's FULL values."""
    model = build(FSDP, strategy)
    full = state_dict_of(model, FULL)
    local = state_dict_of(model, LOCAL)
    if strategy == "NO_SHARD":
        assert list(local) == list(full)
        for key, value in local.items():
            assert type(value) is torch.Tensor and torch.equal(value, full[key]), key
    other = build(FSDP, strategy, steps=STEPS + 2)
    with FSDP.state_dict_type(other, LOCAL):
        assert other.load_state_dict(local) == nn.modules.module._IncompatibleKeys([], [])
    after = state_dict_of(other, FULL)
    for key in full:
        assert torch.equal(after[key], full[key]), key


# ---------------------------------------------------------------------------------------------
# state_dict() at odd moments and in odd places, as FSDP1
# ---------------------------------------------------------------------------------------------


def summoned_state_dicts(wrapper_class):
    """FULL and SHARDED state dicts taken inside summon_full_params after editing a weight."""
    model = build(wrapper_class, use_orig_params=True)
    with wrapper_class.summon_full_params(model):
        with torch.no_grad():
            model.tok_emb.weight.add_(1.0)
        full = state_dict_of(model, FULL)
        sharded = {k: full_value(v) for k, v in state_dict_of(model, SHARDED).items()}
    return full, sharded


@needs_fsdp1
@distributed_test(world_size=2)
def test_state_dict_inside_summon_full_params_matches_fsdp1():
    ours, theirs = summoned_state_dicts(FSDP), summoned_state_dicts(diff.TorchFSDP)
    for ours_sd, theirs_sd in zip(ours, theirs):
        assert list(ours_sd) == list(theirs_sd)
        for key in theirs_sd:
            assert diff.relative_error(ours_sd[key], theirs_sd[key]) <= 1e-5, key


def state_dict_during_forward(wrapper_class) -> str:
    model = build(wrapper_class, steps=0)
    seen = {}

    def hook(module, inputs, output):
        try:
            model.state_dict()
            seen["error"] = "no error"
        except Exception as error:  # noqa: BLE001 - the type is what we compare
            seen["error"] = type(error).__name__

    model.blocks[1].register_forward_hook(hook)
    model(diff.local_batch(0)[0]).sum().backward()
    return seen["error"]


@needs_fsdp1
@distributed_test(world_size=2)
def test_state_dict_during_forward_raises_as_fsdp1():
    assert state_dict_during_forward(FSDP) == state_dict_during_forward(diff.TorchFSDP) == "AssertionError"
    model = build(FSDP)  # and the model is usable afterwards
    diff.train(model, torch.optim.SGD(model.parameters(), lr=0.05), 1)


@needs_fsdp1
@distributed_test(world_size=2)
def test_non_root_prefix_and_nested_in_plain_module():
    # (FSDP1 cannot be used as a root after a non-root state_dict(): a fresh model each time.)
    ours, theirs = build(FSDP, steps=0), build(diff.TorchFSDP, steps=0)
    assert_same_state_dict(ours.blocks[0].state_dict(), theirs.blocks[0].state_dict(), "non-root", exact=True)
    theirs = build(diff.TorchFSDP, steps=0)
    assert_same_state_dict(ours.state_dict(prefix="model."), theirs.state_dict(prefix="model."), "prefix", exact=True)
    outer_ours, outer_theirs = nn.Sequential(build(FSDP, steps=0)), nn.Sequential(build(diff.TorchFSDP, steps=0))
    assert_same_state_dict(outer_ours.state_dict(), outer_theirs.state_dict(), "nested", exact=True)
    assert list(outer_ours.state_dict())[1] == "0.tok_emb.weight"


def _state_dicts_after_edits_through_the_views(wrapper_class, strategy: str) -> dict:
    """``use_orig_params=True``: between steps the user replaces one parameter's ``.data`` (the local
    shard's shape), assigns another as a new module attribute, and writes a third in place; then each
    state-dict type, taken right away."""
    model = build(wrapper_class, strategy)
    block = model.module.blocks[0] if wrapper_class is diff.TorchFSDP else model.blocks[0]
    fc, proj = block.mlp.fc, block.mlp.proj
    with torch.no_grad():
        fc.weight.data = torch.full_like(fc.weight, 0.25)
        proj.weight = nn.Parameter(torch.full_like(proj.weight, -0.5))
        fc.bias.add_(1.0)
    return {state_dict_type: state_dict_of(model, state_dict_type) for state_dict_type in (FULL, SHARDED)}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@distributed_test(world_size=2)
def test_edits_through_the_views_are_in_the_state_dict_taken_next(strategy):
    """With ``use_orig_params=True`` the parameters the user edits are what FULL and SHARDED state dicts
    give right after, also where the wrapper leaves the user's parameters registered while it reads the
    module tree (fsdp_compat), and whether the edit replaced ``.data``, the parameter, or its values."""
    ours = _state_dicts_after_edits_through_the_views(FSDP, strategy)
    full = {key: full_value(value) for key, value in ours[FULL].items()}
    assert bool((full["blocks.0.mlp.fc.weight"] == 0.25).all())
    assert bool((full["blocks.0.mlp.proj.weight"] == -0.5).all())
    expected = diff.fsdp1_value("state_dict_edits", diff.golden_key(strategy), lambda: {
        key: full_value(value).double().sum().item()
        for key, value in _state_dicts_after_edits_through_the_views(diff.TorchFSDP, strategy)[FULL].items()})
    for state_dict_type in (FULL, SHARDED):
        sums = {key: full_value(value).double().sum().item() for key, value in ours[state_dict_type].items()}
        assert set(sums) == set(expected), state_dict_type
        diff.assert_close_lists([sums[key] for key in expected], list(expected.values()), rtol=1e-6,
                                what=f"{state_dict_type.name} after edits vs FSDP1")
