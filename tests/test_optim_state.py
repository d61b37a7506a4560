"""Optimizer state dicts: formats side by side with torch FSDP1, rekeying, warnings, bad input.

Each format test builds the same seeded TinyGPT (uneven vocabulary, tied head) under torch FSDP1
and under fsdp_compat, trains both 2 steps with the same optimizer, and compares what every API
returns on every rank: the key type and order of ``state``, the state names and their order,
tensor vs scalar values (shape, dtype, device, Adam's ``step``), the ``param_groups``, and what
ranks other than 0 receive. Values are compared with a single-process run of the same model and
optimizer (FSDP1's own FULL values are corrupt on CPU with ``use_orig_params=True``). The
descriptions are kept in ``tests/golden/optim_state_formats.json`` so the tests keep their
meaning once torch no longer ships FSDP1 (``FSDP_COMPAT_WITHOUT_FSDP1=1`` runs them that way).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compat
from fsdp_compat import FullOptimStateDictConfig, OptimStateKeyType, ShardedOptimStateDictConfig, StateDictType
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat._common import clean_name
from fsdp_compat.examples import Block, GPTConfig
from fsdp_compat._tensor_layout import is_sharded_tensor, shard_like, to_full
from fsdp_compat.testing import distributed_test
from tests import differential as diff

GOLDEN = "optim_state_formats"
TRAIN_STEPS = 2


# ---------------------------------------------------------------------------------------------
# Shared helpers (also used by test_optim_state_resume.py)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setup:
    """One model + optimizer configuration, buildable under either engine."""

    optimizer: str = "adamw"           # sgd | adamw | adam_groups
    use_orig_params: bool = True
    strategy: str = "FULL_SHARD"
    model: str = "plain"               # plain | frozen | unused | ignored
    hybrid: bool = False               # 2-D mesh (replicate, shard) over all ranks
    tiny: bool = False                 # a ~2k-parameter TinyGPT (golden checkpoints stay small)
    cpu_offload: bool = False          # CPUOffload(offload_params=True) (fsdp_compat only on CPU)
    mixed_precision: bool = False      # bf16 compute, fp32 reduction
    dtensor_params: bool | None = None  # fsdp_compat's parameter model (None: the default, FSDP1's plain views)

    @property
    def name(self) -> str:
        return (f"ws{dist.get_world_size()}-{self.strategy}-{self.model}-orig{int(self.use_orig_params)}"
                f"-{self.optimizer}{'-tiny' if self.tiny else ''}")


def decays(name: str) -> bool:
    """Weight decay only on matrices: not on biases or LayerNorm weights (a usual recipe)."""
    parts = clean_name(name).split(".")
    return parts[-1] == "weight" and not parts[-2].startswith("ln")


def make_optimizer(kind: str, named_params: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    if kind == "adam_groups":
        groups = [{"params": [p for n, p in named_params if decays(n)], "weight_decay": 0.1},
                  {"params": [p for n, p in named_params if not decays(n)], "weight_decay": 0.0}]
        return torch.optim.Adam(groups, lr=1e-2)
    return diff.make_optimizer(kind, [p for _, p in named_params])


def build_model(setup: Setup) -> nn.Module:
    """The unwrapped model of ``setup`` (seeded: every call gives the same values)."""
    model = diff.make_model(config=GPTConfig(n_embd=8, n_layer=1, n_head=2) if setup.tiny else None)
    if setup.model == "frozen":
        model.pos_emb.weight.requires_grad_(False)  # never gets a gradient, so never state
    if setup.model == "unused":
        model.unused = nn.Linear(4, 3)              # not used in forward: no gradient, no state
    return model


def api_of(wrapper_class: type) -> Any:
    """Where a program using ``wrapper_class`` takes its enums and configs from: torch's for
    FSDP1 (it checks their types), ours otherwise (so these tests outlive FSDP1 in torch)."""
    return diff.torch_fsdp if diff.HAVE_FSDP1 and wrapper_class is diff.TorchFSDP else fsdp_compat


def wrap(wrapper_class: type, model: nn.Module, setup: Setup, group: Any = None) -> nn.Module:
    api = api_of(wrapper_class)
    policy = diff.block_policy_torch() if api is not fsdp_compat else fsdp_compat.wrap.ModuleWrapPolicy({Block})
    kwargs: dict[str, Any] = dict(
        auto_wrap_policy=policy,
        use_orig_params=setup.use_orig_params,
        sharding_strategy=getattr(api.ShardingStrategy, setup.strategy),
    )
    if api is fsdp_compat and setup.dtensor_params is not None:
        kwargs["dtensor_params"] = setup.dtensor_params
    if setup.model == "ignored":
        kwargs["ignored_modules"] = [model.blocks[1].mlp]
    if setup.hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        kwargs["device_mesh"] = init_device_mesh(diff.device().type, (2, dist.get_world_size() // 2),
                                                 mesh_dim_names=("replicate", "shard"))
    if group is not None:
        kwargs["process_group"] = group
    if setup.cpu_offload:
        kwargs["cpu_offload"] = api.CPUOffload(offload_params=True)
    if setup.mixed_precision:
        kwargs["mixed_precision"] = api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if diff.HAVE_FSDP1 and wrapper_class is diff.TorchFSDP:
        kwargs.update(diff.fsdp1_kwargs())
    return wrapper_class(model, **kwargs)


def build(wrapper_class: type, setup: Setup, group: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = wrap(wrapper_class, build_model(setup), setup, group)
    return model, make_optimizer(setup.optimizer, list(model.named_parameters()))


@torch.no_grad()
def load_full_params(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full parameter values into ``model`` (its shards when wrapped)."""
    for name, param in model.named_parameters():
        value = full[clean_name(name)]
        if isinstance(param, DTensor):
            param.to_local().copy_(shard_like(value, param).to_local())
        else:
            param.copy_(value)


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The full optimizer state on every rank (through our FULL ``optim_state_dict``)."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              optim_state_dict_config=FullOptimStateDictConfig(rank0_only=False)):
        return FSDP.optim_state_dict(model, optim)


def assert_states_equal(actual: dict[str, Any], expected: dict[str, Any], exact: bool = True,
                        what: str = "", inner_order: bool = True) -> None:
    """Same keys (in the same order), same param_groups, equal (or close) values.

    ``inner_order=False`` ignores the order of one parameter's state names (a checkpoint loaded
    through ``torch.distributed.checkpoint`` comes back in the checkpoint's order)."""
    assert list(actual["state"]) == list(expected["state"]), what
    assert actual["param_groups"] == expected["param_groups"], what
    for name, state in expected["state"].items():
        names, expected_names = list(actual["state"][name]), list(state)
        if not inner_order:
            names, expected_names = sorted(names), sorted(expected_names)
        assert names == expected_names, f"{what} {name}: {names} != {expected_names}"
        for key, value in state.items():
            mine = actual["state"][name][key]
            if not torch.is_tensor(value):
                assert mine == value, f"{what} {name}.{key}"
            elif exact:
                assert torch.equal(mine, value), f"{what} {name}.{key} differs"
            else:
                torch.testing.assert_close(mine, value, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name, k=key: f"{what} {n}.{k}: {m}")


def describe(osd: dict[str, Any]) -> Any:
    """The format of an optimizer state dict, without tensor values: compact, JSON-comparable,
    order kept. One line per parameter: ``name: state=kind[shape]dtype@device(=scalar), ...``."""
    if not osd:
        return {"empty": repr(osd)}

    def value(v: Any) -> str:
        if isinstance(v, DTensor) or is_sharded_tensor(v):
            return f"sharded{list(v.shape)}{v.dtype}"
        if torch.is_tensor(v):
            scalar = f"={v.item()}" if v.dim() == 0 else ""
            return f"tensor{list(v.shape)}{v.dtype}@{v.device.type}{scalar}"
        return f"value {v!r}"

    described = {
        "state": [f"{key!r}: " + ", ".join(f"{name}={value(v)}" for name, v in state.items())
                  for key, state in osd["state"].items()],
        "param_groups": osd.get("param_groups", "MISSING"),
        "other_keys": sorted(k for k in osd if k not in ("state", "param_groups")),
    }
    return json.loads(json.dumps(described))  # tuples -> lists, as the golden file holds them


def first_difference(actual: Any, expected: Any, path: str = "") -> str:
    """Where two JSON-like values first differ, for readable failures."""
    if type(actual) is not type(expected):
        return f"{path}: {actual!r} != {expected!r}"
    if isinstance(actual, dict):
        for key in list(expected) + [k for k in actual if k not in expected]:
            if actual.get(key) != expected.get(key):
                return first_difference(actual.get(key), expected.get(key), f"{path}.{key}")
    if isinstance(actual, list):
        for index, (a, e) in enumerate(zip(actual, expected)):
            if a != e:
                return first_difference(a, e, f"{path}[{index}]")
        if len(actual) != len(expected):
            return f"{path}: length {len(actual)} != {len(expected)}"
    return f"{path}: {actual!r} != {expected!r}"


def fsdp1_or_golden(key: str, compute: Any, on_other_ranks: Any = None) -> Any:
    """FSDP1's result for ``key`` (recorded as golden), or the golden record without FSDP1.

    ``on_other_ranks`` derives the other ranks' result from rank 0's; with FSDP1 present that
    rule is checked, and only rank 0's result is recorded.
    """
    golden = diff.load_golden(GOLDEN) or {}
    if diff.HAVE_FSDP1:
        value = compute()
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, value)
        record = {"rank 0": everyone[0]}
        if on_other_ranks is not None:
            assert all(other == on_other_ranks(everyone[0]) for other in everyone[1:]), key
        else:
            assert all(other == everyone[-1] for other in everyone[1:]), f"{key}: ranks 1.. disagree"
            record["other ranks"] = everyone[-1]
        golden[key] = record
        diff.save_golden(GOLDEN, golden)
        return value
    assert key in golden, f"no FSDP1 and no golden record for {key}"
    record = golden[key]
    if dist.get_rank() == 0:
        return record["rank 0"]
    return on_other_ranks(record["rank 0"]) if on_other_ranks is not None else record["other ranks"]


def _all_apis(wrapper_class: type, model: nn.Module, optim: torch.optim.Optimizer,
              use_orig_params: bool, hybrid: bool) -> dict[str, dict[str, Any]]:
    """What every saving API returns on this rank, as FSDP1 users call them."""
    out = {
        "full_optim_state_dict": wrapper_class.full_optim_state_dict(model, optim),
        "full_optim_state_dict_all_ranks": wrapper_class.full_optim_state_dict(model, optim, rank0_only=False),
        "sharded_optim_state_dict": wrapper_class.sharded_optim_state_dict(model, optim),
        "optim_state_dict_default": wrapper_class.optim_state_dict(model, optim),
    }
    api = api_of(wrapper_class)
    with wrapper_class.state_dict_type(model, api.StateDictType.FULL_STATE_DICT,
                                       optim_state_dict_config=api.FullOptimStateDictConfig(rank0_only=True)):
        out["optim_state_dict_full_rank0"] = wrapper_class.optim_state_dict(model, optim)
    with wrapper_class.state_dict_type(model, api.StateDictType.SHARDED_STATE_DICT,
                                       optim_state_dict_config=api.ShardedOptimStateDictConfig()):
        out["optim_state_dict_sharded"] = wrapper_class.optim_state_dict(model, optim)
    if not hybrid:  # FSDP1 refuses LOCAL_STATE_DICT on a device mesh
        with wrapper_class.state_dict_type(model, api.StateDictType.LOCAL_STATE_DICT):
            out["optim_state_dict_local"] = wrapper_class.optim_state_dict(model, optim)
    if use_orig_params:  # FSDP1 maps names to its FlatParameter ids otherwise
        out["rekey_param_id"] = wrapper_class.rekey_optim_state_dict(
            out["full_optim_state_dict_all_ranks"], api.OptimStateKeyType.PARAM_ID, model, optim=optim)
    return out


def _train_and_save(wrapper_class: type, setup: Setup) -> tuple[dict[str, Any], dict[str, Any]]:
    model, optim = build(wrapper_class, setup)
    diff.train(model, optim, TRAIN_STEPS)
    return _all_apis(wrapper_class, model, optim, setup.use_orig_params, setup.hybrid), diff.full_parameters(model)


def reference_state(setup: Setup, steps: int = TRAIN_STEPS) -> dict[str, dict[str, Any]]:
    """The single-process optimizer state (whole batch), keyed by parameter name."""
    model = build_model(setup)
    optim = make_optimizer(setup.optimizer, list(model.named_parameters()))
    diff.train(model, optim, steps, sharded=False)
    return {name: optim.state[param] for name, param in model.named_parameters() if param in optim.state}


def assert_state_values_close(actual: dict[str, Any], expected: dict[str, dict[str, Any]], what: str = "") -> None:
    assert set(actual) == set(expected), f"{what}: {set(actual) ^ set(expected)}"
    for name, state in expected.items():
        for key, value in state.items():
            mine = actual[name][key]
            mine = to_full(mine) if isinstance(mine, DTensor) or is_sharded_tensor(mine) else mine
            torch.testing.assert_close(mine.float(), value.float(), rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name, k=key: f"{what} {n}.{k}: {m}")


def check_formats(setup: Setup) -> None:
    diff.quiet()
    ours, _ = _train_and_save(FSDP, setup)

    def fsdp1_formats() -> dict[str, Any]:
        apis, _ = _train_and_save(diff.TorchFSDP, setup)
        return _deduplicated({api: describe(osd) for api, osd in apis.items()})

    expected = _expanded(fsdp1_or_golden(setup.name, fsdp1_formats, on_other_ranks=_as_other_ranks_get))
    for api, osd in ours.items():
        mine = describe(osd)
        assert mine == expected[api], \
            f"{api}: format differs from torch FSDP1's at {first_difference(mine, expected[api])}"
    _check_no_aliasing(ours["full_optim_state_dict_all_ranks"])
    if setup.model != "ignored":  # ignored parameters train on each rank's own data
        reference = reference_state(setup)
        for api in ("full_optim_state_dict_all_ranks", "optim_state_dict_sharded"):
            assert_state_values_close(ours[api]["state"], reference, what=api)


def _deduplicated(formats: dict[str, Any]) -> dict[str, Any]:
    """Several APIs share one format: keep each format once (the golden file stays small)."""
    distinct: list[Any] = []
    for described in formats.values():
        if described not in distinct:
            distinct.append(described)
    return {"formats": distinct, "api": {api: distinct.index(f) for api, f in formats.items()}}


RANK0_ONLY_APIS = ("full_optim_state_dict", "optim_state_dict_full_rank0")


def _as_other_ranks_get(record: dict[str, Any]) -> dict[str, Any]:
    """Ranks other than 0 get what rank 0 gets, except ``{}`` from the rank0_only calls."""
    formats = _expanded(record)
    formats.update({api: {"empty": "{}"} for api in RANK0_ONLY_APIS})
    return _deduplicated(formats)


def _expanded(record: dict[str, Any]) -> dict[str, Any]:
    return {api: record["formats"][index] for api, index in record["api"].items()}


def _check_no_aliasing(full: dict[str, Any]) -> None:
    """FSDP1 hands out one reused gather buffer for every state of a parameter; we copy."""
    pointers = [v.untyped_storage().data_ptr() for state in full["state"].values()
                for v in state.values() if torch.is_tensor(v) and v.numel() > 0]
    assert len(pointers) == len(set(pointers)), "state tensors share memory"


FORMAT_SETUPS = [
    Setup(optimizer="adamw", use_orig_params=True),
    Setup(optimizer="adamw", use_orig_params=False),
    Setup(optimizer="sgd", use_orig_params=True),
    Setup(optimizer="sgd", use_orig_params=False),
    Setup(optimizer="adam_groups", use_orig_params=True),
    Setup(optimizer="adam_groups", model="frozen", use_orig_params=True),
    Setup(optimizer="adamw", model="ignored", use_orig_params=True),
    Setup(optimizer="adamw", model="ignored", use_orig_params=False),
    Setup(optimizer="adamw", strategy="NO_SHARD"),
]


@pytest.mark.parametrize("setup", FORMAT_SETUPS, ids=lambda s: f"{s.strategy}-{s.model}-orig{int(s.use_orig_params)}-{s.optimizer}")
@distributed_test(world_size=2)
def test_formats_match_fsdp1(setup):
    check_formats(setup)


@distributed_test(world_size=4)
def test_formats_match_fsdp1_hybrid():
    check_formats(Setup(optimizer="adam_groups", strategy="HYBRID_SHARD", hybrid=True))


@distributed_test(world_size=2)
def test_unused_params_have_no_state():
    """A parameter forward never uses gets no gradient, so no optimizer state, as in a plain
    module. (FSDP1 differs: its FlatParameter's gradient covers the unused parameter with zeros,
    so its optimizer creates state, and AdamW decays the weights. Formats are otherwise equal.)"""
    diff.quiet()
    setup = Setup(optimizer="adamw", model="unused")
    ours, _ = _train_and_save(FSDP, setup)
    full = ours["full_optim_state_dict_all_ranks"]
    assert not any(name.startswith("unused.") for name in full["state"])
    assert full["param_groups"][0]["params"][-2:] == ["unused.weight", "unused.bias"]
    assert_state_values_close(full["state"], reference_state(setup))
    assert_state_values_close(ours["optim_state_dict_sharded"]["state"], reference_state(setup))


# ---------------------------------------------------------------------------------------------
# Copies, not aliases; configs; deprecated names and arguments
# ---------------------------------------------------------------------------------------------

@distributed_test(world_size=2)
def test_saved_state_is_a_snapshot():
    """Outputs share no memory with the optimizer (FSDP1's FULL output on CPU aliases one gather
    buffer: ``exp_avg`` and ``exp_avg_sq`` come out equal); training on leaves them as they were."""
    diff.quiet()
    model, optim = build(FSDP, Setup())
    diff.train(model, optim, TRAIN_STEPS)
    full = full_state(model, optim)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = FSDP.optim_state_dict(model, optim)
    frozen_full, frozen_sharded = copy.deepcopy(full), copy.deepcopy(sharded)
    for state in full["state"].values():
        assert not torch.equal(state["exp_avg"], state["exp_avg_sq"])
    diff.train(model, optim, 1, first_step=TRAIN_STEPS)
    assert_states_equal(full, frozen_full, what="FULL after another step")
    for name, state in sharded["state"].items():
        for key, value in state.items():
            assert torch.equal(to_full(value), to_full(frozen_sharded["state"][name][key])), (name, key)


@distributed_test(world_size=2)
def test_configs_follow_state_dict_type():
    """``optim_state_dict`` follows ``state_dict_type``: FULL on every rank by default, ``{}`` on
    other ranks with ``rank0_only``, FSDP1's ShardedTensors (DTensors with ``_use_dtensor``) under SHARDED, and
    device placement by ``offload_to_cpu``."""
    diff.quiet()
    model, optim = build(FSDP, Setup())
    diff.train(model, optim, TRAIN_STEPS)
    settings = FSDP.get_state_dict_type(model)
    config = settings.optim_state_dict_config
    assert type(config).__name__ == "FullOptimStateDictConfig"
    assert (config.offload_to_cpu, config.rank0_only) == (True, False)
    default = FSDP.optim_state_dict(model, optim)
    assert default["state"] and all(type(v) is torch.Tensor for s in default["state"].values() for v in s.values())
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)):
        rank0 = FSDP.optim_state_dict(model, optim)
    assert (rank0 == {}) == (dist.get_rank() != 0)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = FSDP.optim_state_dict(model, optim)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                              optim_state_dict_config=ShardedOptimStateDictConfig(_use_dtensor=True)):
        dtensors = FSDP.optim_state_dict(model, optim)
    full_shapes = {name: param.shape for name, param in build_model(Setup()).named_parameters()}
    # This rank's piece of each parameter: a DTensor's local tensor, or a plain view (its elements, 1-D).
    local_numels = {clean_name(n): (p.to_local() if isinstance(p, DTensor) else p).numel()
                    for n, p in model.named_parameters()}
    for name, state in sharded["state"].items():
        assert type(state["step"]) is torch.Tensor and state["step"].dim() == 0
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            # FSDP1's ShardedTensor by default: this rank's dim-0 piece as its one local shard (if any)
            assert is_sharded_tensor(value) and value.shape == full_shapes[name]
            local = [shard.tensor for shard in value.local_shards()]
            assert [t.numel() for t in local] == ([local_numels[name]] if local_numels[name] else [])
            assert all(t.device.type == "cpu" for t in local)
            value = dtensors["state"][name][key]  # DTensor when asked for, dim-0 sharded as the engine's
            assert isinstance(value, DTensor) and value.shape == full_shapes[name]
            assert value.to_local().numel() == local_numels[name]
            assert value.to_local().device.type == "cpu"


def _warning_calls(wrapper_class: type, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Each deprecated (or not) call FSDP1 users make, as a thunk."""
    full = wrapper_class.full_optim_state_dict(model, optim, rank0_only=False)
    sharded = wrapper_class.sharded_optim_state_dict(model, optim)
    params = list(model.parameters())
    root = dist.get_rank() == 0
    OptimStateKeyType = api_of(wrapper_class).OptimStateKeyType  # noqa: N806 - the user's spelling
    return {
        "full_optim_state_dict": lambda: wrapper_class.full_optim_state_dict(model, optim),
        "full_optim_state_dict+optim_input": lambda: wrapper_class.full_optim_state_dict(model, optim, optim_input=params),
        "sharded_optim_state_dict": lambda: wrapper_class.sharded_optim_state_dict(model, optim),
        "shard_full_optim_state_dict": lambda: wrapper_class.shard_full_optim_state_dict(full, model, optim=optim),
        "shard_full_optim_state_dict+optim_input": lambda: wrapper_class.shard_full_optim_state_dict(full, model, optim_input=params),
        "scatter_full_optim_state_dict": lambda: wrapper_class.scatter_full_optim_state_dict(full if root else None, model, optim=optim),
        "flatten_sharded_optim_state_dict": lambda: wrapper_class.flatten_sharded_optim_state_dict(sharded, model, optim),
        "rekey_optim_state_dict": lambda: wrapper_class.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, model, optim=optim),
        "rekey_optim_state_dict+optim_input": lambda: wrapper_class.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, model, optim_input=params),
        "optim_state_dict": lambda: wrapper_class.optim_state_dict(model, optim),
        "optim_state_dict_to_load": lambda: wrapper_class.optim_state_dict_to_load(model, optim, full),
    }


def _is_fsdp_api_warning(message: str) -> bool:
    """FSDP1's deprecations of its own API (not, e.g., ShardedTensor's chatter inside FSDP1)."""
    return "FullyShardedDataParallel." in message or "`optim_input`" in message


def _future_warnings(call: Any, check_location: bool = True) -> list[tuple[str, str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    found = [(w.category.__name__, str(w.message), w.filename) for w in caught
             if issubclass(w.category, FutureWarning) and _is_fsdp_api_warning(str(w.message))]
    for _, message, filename in found if check_location else ():
        assert filename == __file__, f"warning {message!r} points at {filename}, not the caller"
    return [(category, message) for category, message, _ in found]


@distributed_test(world_size=2)
def test_deprecation_warnings_match_fsdp1():
    """Deprecated methods and the ``optim_input`` argument warn (``FutureWarning``, FSDP1's text,
    pointing at the caller) and still work; the current API does not warn."""
    diff.quiet()
    model, optim = build(FSDP, Setup())
    diff.train(model, optim, TRAIN_STEPS)
    ours = {name: _future_warnings(call) for name, call in _warning_calls(FSDP, model, optim).items()}

    def fsdp1_warnings() -> dict[str, Any]:
        model1, optim1 = build(diff.TorchFSDP, Setup())
        diff.train(model1, optim1, TRAIN_STEPS)
        calls = _warning_calls(diff.TorchFSDP, model1, optim1)
        # (FSDP1's own warnings sometimes point inside FSDP1; ours point at the caller.)
        return {name: [list(w) for w in _future_warnings(call, check_location=False)]
                for name, call in calls.items()}

    expected = fsdp1_or_golden("deprecation_warnings", fsdp1_warnings)
    mine = {name: [list(w) for w in found] for name, found in ours.items()}
    assert mine == expected, first_difference(mine, expected)
    assert ours["optim_state_dict"] == [] and ours["optim_state_dict_to_load"] == []


# ---------------------------------------------------------------------------------------------
# Rekeying between parameter names and ids
# ---------------------------------------------------------------------------------------------

@distributed_test(world_size=2)
def test_rekey_round_trip_and_plain_model():
    """names -> ids -> names round-trips; the ids version loads into a plain (unwrapped) model's
    optimizer, and a plain optimizer's own state dict, rekeyed to names, loads into the wrapped
    model (FSDP1's documented recipes). Outputs match FSDP1's rekeying of the same input."""
    diff.quiet()
    setup = Setup(optimizer="adam_groups")
    model, optim = build(FSDP, setup)
    diff.train(model, optim, TRAIN_STEPS)
    full = full_state(model, optim)
    assert FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_NAME, model, optim=optim) is full

    by_id = FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, model, optim=optim)
    assert sorted(by_id["state"]) == sorted(optim.state_dict()["state"])
    assert [g["params"] for g in by_id["param_groups"]] == [g["params"] for g in optim.state_dict()["param_groups"]]
    back = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model, optim=optim)
    assert back["state"] == full["state"]  # the same value objects, re-keyed
    assert [g["params"] for g in back["param_groups"]] == [sorted(g["params"]) for g in full["param_groups"]]

    # Into a plain model's optimizer: the same state, and the same next step.
    plain = build_model(setup)
    load_full_params(plain, diff.full_parameters(model))
    plain_optim = make_optimizer(setup.optimizer, list(plain.named_parameters()))
    plain_optim.load_state_dict(by_id)
    plain_named = {name: plain_optim.state[param] for name, param in plain.named_parameters() if param in plain_optim.state}
    assert_state_values_close(full["state"], plain_named)

    # And back from the plain optimizer's own (id-keyed) state dict into a fresh wrapped model.
    # (``optim=``: without it ids follow ``model.parameters()``, FSDP1's default, which is not
    # this optimizer's order once parameters are split into groups.)
    plain_by_name = FSDP.rekey_optim_state_dict(plain_optim.state_dict(), OptimStateKeyType.PARAM_NAME,
                                                plain, optim=plain_optim)
    fresh, fresh_optim = build(FSDP, setup)
    fresh_optim.load_state_dict(FSDP.shard_full_optim_state_dict(plain_by_name, fresh, optim=fresh_optim))
    restored = full_state(fresh, fresh_optim)
    assert_state_values_close(restored["state"], {n: s for n, s in full["state"].items()})
    assert [sorted(g["params"]) for g in restored["param_groups"]] == \
        [sorted(g["params"]) for g in full["param_groups"]]

    if diff.HAVE_FSDP1:  # FSDP1's rekeying of the very same inputs
        torch_key_type = diff.torch_fsdp.OptimStateKeyType
        theirs = diff.TorchFSDP.rekey_optim_state_dict(plain_optim.state_dict(), torch_key_type.PARAM_NAME,
                                                       plain, optim=plain_optim)
        assert describe(plain_by_name) == describe(theirs)
        theirs_ids = diff.TorchFSDP.rekey_optim_state_dict(plain_by_name, torch_key_type.PARAM_ID, plain,
                                                           optim=plain_optim)
        ours_ids = FSDP.rekey_optim_state_dict(plain_by_name, OptimStateKeyType.PARAM_ID, plain, optim=plain_optim)
        assert describe(ours_ids) == describe(theirs_ids)


# ---------------------------------------------------------------------------------------------
# Bad input: FSDP1's exception types, clear messages, the optimizer untouched
# ---------------------------------------------------------------------------------------------

def _renamed(osd: dict[str, Any], prefix: str, state: bool = True, groups: bool = True) -> dict[str, Any]:
    out = copy.deepcopy(osd)
    if state:
        out["state"] = {prefix + name: value for name, value in out["state"].items()}
    if groups:
        for group in out["param_groups"]:
            group["params"] = [prefix + name for name in group["params"]]
    return out


def _bad_inputs(full: dict[str, Any], optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Case name -> a state dict that must be refused."""
    mixed = copy.deepcopy(full)
    first = next(iter(mixed["state"]))
    mixed["state"][0] = mixed["state"].pop(first)
    two_groups = copy.deepcopy(full)
    two_groups["param_groups"].append({**two_groups["param_groups"][0], "params": []})
    swapped = copy.deepcopy(full)
    swapped["param_groups"][0]["params"][0], swapped["param_groups"][1]["params"][0] = \
        swapped["param_groups"][1]["params"][0], swapped["param_groups"][0]["params"][0]
    wrong_shape = copy.deepcopy(full)
    wrong_shape["state"]["pos_emb.weight"]["exp_avg"] = torch.zeros(3, 3)
    return {
        "another_model": _renamed(full, "encoder."),
        "another_model_state_only": _renamed(full, "encoder.", groups=False),
        "mixed_keys": mixed,
        "id_keys": optim.state_dict(),
        "missing_state": {"param_groups": copy.deepcopy(full["param_groups"])},
        "missing_param_groups": {"state": copy.deepcopy(full["state"])},
        "group_count": two_groups,
        "group_members": swapped,
        "wrong_shape": wrong_shape,
        "not_a_dict": [full],
    }


# What FSDP1 raises (at conversion or at optim.load_state_dict) and what we raise, up front.
BAD_INPUT_ERRORS = {
    "another_model": (KeyError, "another model"),            # FSDP1: KeyError
    "another_model_state_only": (KeyError, "another model"),  # FSDP1: loads nothing, silently
    "mixed_keys": (ValueError, "Invalid parameter keys"),   # FSDP1: AttributeError (rekey: ValueError)
    "id_keys": (ValueError, "rekey_optim_state_dict"),      # FSDP1: AttributeError
    "missing_state": (ValueError, '"state"'),               # FSDP1: ValueError
    "missing_param_groups": (KeyError, "param_groups"),     # FSDP1: KeyError in load_state_dict (load_directly)
    "group_count": (ValueError, "number of parameter groups"),  # FSDP1: ValueError in load_state_dict
    "group_members": (ValueError, "other parameters"),      # FSDP1: loads states onto wrong params
    "wrong_shape": (ValueError, "shape"),                   # FSDP1: loads it
    "not_a_dict": (ValueError, '"state"'),                  # FSDP1: ValueError
}
FSDP1_RAISES_SAME = ("another_model", "missing_state", "missing_param_groups", "group_count", "not_a_dict")
# Refused only when loaded: converted alone, the state needs no param_groups (as in FSDP1; see
# tests/test_optim_state_fsdp1_cases.py).
REFUSED_WHEN_LOADED_ONLY = ("missing_param_groups",)


def _fsdp1_error_type(case: str) -> type | None:
    """FSDP1's exception for ``case`` through optim_state_dict_to_load + optim.load_state_dict."""
    model, optim = build(diff.TorchFSDP, Setup(optimizer="adam_groups"))
    diff.train(model, optim, 1)
    bad = _bad_inputs(diff.TorchFSDP.optim_state_dict(model, optim), optim)[case]
    try:
        optim.load_state_dict(diff.TorchFSDP.optim_state_dict_to_load(model, optim, bad))
    except Exception as error:  # noqa: BLE001 - recording which type
        return type(error)
    return None


@pytest.mark.parametrize("case", sorted(BAD_INPUT_ERRORS))
@distributed_test(world_size=2)
def test_bad_input_raises_and_leaves_optimizer_unchanged(case):
    diff.quiet()
    model, optim = build(FSDP, Setup(optimizer="adam_groups"))
    diff.train(model, optim, TRAIN_STEPS)
    before = full_state(model, optim)
    bad = _bad_inputs(before, optim)[case]
    error_type, words = BAD_INPUT_ERRORS[case]
    with pytest.raises(error_type, match=words):
        FSDP.optim_state_dict_to_load(model, optim, bad, load_directly=True)
    if case not in REFUSED_WHEN_LOADED_ONLY:
        with pytest.raises(error_type, match=words):  # rank 0's bad dict: every rank raises, none hangs
            FSDP.scatter_full_optim_state_dict(bad if dist.get_rank() == 0 else None, model, optim=optim)
    assert_states_equal(full_state(model, optim), before, what="after the failed load")
    if case in FSDP1_RAISES_SAME:
        expected = fsdp1_or_golden(f"bad_input_{case}", lambda: getattr(_fsdp1_error_type(case), "__name__", None))
        assert error_type.__name__ == expected


@distributed_test(world_size=2)
def test_rekey_bad_input_matches_fsdp1():
    """FSDP1's types: a str key type -> AssertionError, mixed int/str keys -> ValueError; names
    of another model -> KeyError."""
    diff.quiet()
    model, optim = build(FSDP, Setup(optimizer="adam_groups"))
    diff.train(model, optim, 1)
    full = full_state(model, optim)
    bad = _bad_inputs(full, optim)
    with pytest.raises(AssertionError, match="PARAM_NAME or PARAM_ID"):
        FSDP.rekey_optim_state_dict(full, "PARAM_ID", model, optim=optim)
    with pytest.raises(ValueError, match="Invalid parameter keys"):
        FSDP.rekey_optim_state_dict(bad["mixed_keys"], OptimStateKeyType.PARAM_ID, model, optim=optim)
    with pytest.raises(KeyError, match="another model"):
        FSDP.rekey_optim_state_dict(bad["another_model"], OptimStateKeyType.PARAM_ID, model, optim=optim)


@distributed_test(world_size=2)
def test_ignored_modules_round_trip():
    """Ignored parameters are plain tensors trained by each rank alone: their state is saved as
    plain tensors (this rank's, as FSDP1) and comes back as plain tensors."""
    diff.quiet()
    # DTensor parameters: the ignored ones are the plain tensors among them.
    model, optim = build(FSDP, Setup(model="ignored", dtensor_params=True))
    diff.train(model, optim, TRAIN_STEPS)
    before = full_state(model, optim)
    ignored = {clean_name(n) for n, p in model.named_parameters() if not isinstance(p, DTensor)}
    assert ignored == {"blocks.1.mlp.fc.weight", "blocks.1.mlp.fc.bias", "blocks.1.mlp.proj.weight",
                       "blocks.1.mlp.proj.bias"}
    fresh, fresh_optim = build(FSDP, Setup(model="ignored", dtensor_params=True))
    loadable = FSDP.shard_full_optim_state_dict(before, fresh, optim=fresh_optim)
    params = {clean_name(n): p for n, p in fresh.named_parameters()}
    for key, state in loadable["state"].items():
        param = fresh_optim.param_groups[0]["params"][key]
        assert isinstance(state["exp_avg"], DTensor) == isinstance(param, DTensor)
    fresh_optim.load_state_dict(loadable)
    assert_states_equal(full_state(fresh, fresh_optim), before, what="ignored modules")
    assert set(params) >= ignored


@distributed_test(world_size=2)
def test_named_optimizer_keys():
    """``is_named_optimizer=True`` keys the result by the model's own parameter names (with the
    wrapper prefixes, as ``named_parameters()`` gives them), as FSDP1 does."""
    diff.quiet()
    model, optim = build(FSDP, Setup())
    diff.train(model, optim, 1)
    full = full_state(model, optim)
    named = FSDP.optim_state_dict_to_load(model, optim, full, is_named_optimizer=True)
    raw = [name for name, _ in model.named_parameters()]
    assert sorted(named["state"]) == sorted(raw)
    assert named["param_groups"][0]["params"] == sorted(raw)

    def fsdp1_params() -> list[str]:
        theirs, their_optim = build(diff.TorchFSDP, Setup())
        diff.train(theirs, their_optim, 1)
        converted = diff.TorchFSDP.optim_state_dict_to_load(
            theirs, their_optim, diff.TorchFSDP.optim_state_dict(theirs, their_optim), is_named_optimizer=True)
        return converted["param_groups"][0]["params"]

    assert named["param_groups"][0]["params"] == fsdp1_or_golden("named_optimizer_params", fsdp1_params)
