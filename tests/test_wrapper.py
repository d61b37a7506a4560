"""The wrapper's construction surface, compared with torch FSDP1: names, wrapping, arguments, errors."""

from __future__ import annotations

import dataclasses
import enum
import functools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compat
import fsdp_compat.fully_sharded_data_parallel as fsdp_module
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat import wrap as our_wrap
from fsdp_compat.examples import Block, GPTConfig, TinyGPT
from fsdp_compat.testing import distributed_test
from tests import differential as diff

needs_fsdp1 = pytest.mark.skipif(not diff.HAVE_FSDP1, reason="torch no longer ships FSDP1")


# ---------------------------------------------------------------------------------------------
# Exports and drop-in use
# ---------------------------------------------------------------------------------------------

PUBLIC_NAMES = [
    "FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload",
    "StateDictType", "StateDictSettings", "StateDictConfig", "FullStateDictConfig", "LocalStateDictConfig",
    "ShardedStateDictConfig", "OptimStateDictConfig", "FullOptimStateDictConfig", "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig", "OptimStateKeyType",
]
WRAP_NAMES = ["ModuleWrapPolicy", "CustomPolicy", "transformer_auto_wrap_policy", "size_based_auto_wrap_policy",
              "lambda_auto_wrap_policy", "always_wrap_policy", "wrap", "enable_wrap"]


def test_exports_every_public_fsdp1_name():
    assert isinstance(fsdp_compat.__version__, str)
    for name in PUBLIC_NAMES:
        assert hasattr(fsdp_compat, name), name
    for name in WRAP_NAMES:
        assert hasattr(fsdp_compat.wrap, name), name


@pytest.mark.skipif(diff.torch_fsdp is fsdp_compat, reason="this torch no longer ships FSDP1's enums")
def test_enums_interoperate_with_torchs():
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy, StateDictType as TorchType

    assert fsdp_compat.StateDictType.FULL_STATE_DICT == TorchType.FULL_STATE_DICT
    assert TorchType.FULL_STATE_DICT == fsdp_compat.StateDictType.FULL_STATE_DICT
    assert fsdp_compat.ShardingStrategy.NO_SHARD != TorchStrategy.FULL_SHARD
    assert {TorchStrategy.NO_SHARD: 1}[fsdp_compat.ShardingStrategy.NO_SHARD] == 1


@pytest.mark.skipif(diff.torch_fsdp is fsdp_compat, reason="this torch no longer ships FSDP1's configs")
def test_configs_equal_torchs_with_equal_fields():
    """As FSDP1's attributes hold the config objects the user passed, ``wrapper.mixed_precision ==
    torch's MixedPrecision(...)`` must hold for ours (which converts torch's objects to its own classes)."""
    torch_policy = diff.torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16)
    assert fsdp_compat.MixedPrecision(param_dtype=torch.bfloat16) == torch_policy
    assert torch_policy == fsdp_compat.MixedPrecision(param_dtype=torch.bfloat16)
    assert fsdp_compat.MixedPrecision() != torch_policy
    assert fsdp_compat.CPUOffload(offload_params=True) == diff.torch_fsdp.CPUOffload(offload_params=True)
    assert fsdp_compat.FullStateDictConfig(rank0_only=True) != diff.torch_fsdp.ShardedStateDictConfig()


@distributed_test(world_size=2)
def test_drop_in_script_with_torch_config_objects():
    """A typical FSDP1 script: every config name from torch, only the class from fsdp_compat.
    (Without FSDP1's ``wrap`` module, the policy function is ours; the enums and configs stay torch's.)"""
    diff.quiet()
    BackwardPrefetch, CPUOffload, FullStateDictConfig, ShardingStrategy, StateDictType = (
        diff.torch_fsdp.BackwardPrefetch, diff.torch_fsdp.CPUOffload, diff.torch_fsdp.FullStateDictConfig,
        diff.torch_fsdp.ShardingStrategy, diff.torch_fsdp.StateDictType)
    transformer_auto_wrap_policy = (diff.torch_wrap or our_wrap).transformer_auto_wrap_policy

    def script(wrapper_class, offload_to_cpu):
        model = wrapper_class(
            diff.make_model(),
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            cpu_offload=CPUOffload(offload_params=False),
            device_id=diff.device(),
            use_orig_params=True,
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = diff.train(model, optimizer, 3)
        with wrapper_class.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                           FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=False)):
            state = model.state_dict()
        return losses, state

    ours_losses, ours_state = script(FSDP, offload_to_cpu=True)
    reference_losses, _ = diff.reference_run("adamw", 3)
    diff.assert_close_lists(ours_losses, reference_losses)
    if diff.HAVE_FSDP1:
        # FSDP1 crashes with offload_to_cpu=True on a CPU-only machine (FSDP1-CONTRACT.md).
        fsdp1_losses, fsdp1_state = script(diff.TorchFSDP, offload_to_cpu=diff.device().type != "cpu")
        diff.assert_close_lists(ours_losses, fsdp1_losses)
        assert list(ours_state) == list(fsdp1_state)
        diff.assert_close_dicts(ours_state, dict(fsdp1_state), what="FULL state dict")


# ---------------------------------------------------------------------------------------------
# The public attributes FSDP1's constructor sets, on every unit
# ---------------------------------------------------------------------------------------------

# What torch FSDP1's constructor (``_init_utils``: process group, core state, runtime state, parameter
# handle) and ``nn.Module`` set on an instance without a leading underscore.
CONSTRUCTOR_ATTRIBUTES = ["backward_prefetch", "compute_device", "cpu_offload", "forward_prefetch",
                          "limit_all_gathers", "mixed_precision", "params", "process_group", "rank",
                          "sharding_strategy", "training", "training_state", "world_size"]


def _constructor_configs() -> dict[str, dict[str, Any]]:
    """Constructor arguments as a drop-in user passes them (torch's enums and configs)."""
    from torch.distributed.device_mesh import init_device_mesh

    api = diff.torch_fsdp
    return {
        "defaults": {},
        "mixed_precision": {"mixed_precision": api.MixedPrecision(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32,
                                                                  buffer_dtype=torch.bfloat16)},
        "cpu_offload": {"cpu_offload": api.CPUOffload(offload_params=True)},
        "SHARD_GRAD_OP": {"sharding_strategy": api.ShardingStrategy.SHARD_GRAD_OP},
        "NO_SHARD": {"sharding_strategy": api.ShardingStrategy.NO_SHARD},
        "HYBRID_SHARD": {"sharding_strategy": api.ShardingStrategy.HYBRID_SHARD,
                         "device_mesh": init_device_mesh(diff.device().type, (1, dist.get_world_size()))},
        "prefetch_limits_orig_params": {"backward_prefetch": None, "forward_prefetch": True,
                                        "limit_all_gathers": False, "use_orig_params": True},
        "backward_post": {"backward_prefetch": api.BackwardPrefetch.BACKWARD_POST},
    }


def _described(value: Any) -> list[Any]:
    """``[type name, value]`` of an attribute, JSON-able and comparable across implementations: our enums
    and configs are our own classes of torch's names (they outlive FSDP1), compared by name and fields."""
    if isinstance(value, enum.Enum):
        return [type(value).__name__, value.name]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {}
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            fields[field.name] = ([cls.__name__ for cls in item] if isinstance(item, (list, tuple))
                                  else str(item) if isinstance(item, torch.dtype) else item)
        return [type(value).__name__, fields]
    if isinstance(value, dist.ProcessGroup):
        return ["ProcessGroup", dist.get_process_group_ranks(value), value is dist.group.WORLD]
    if isinstance(value, torch.device):
        return ["device", str(value)]
    if isinstance(value, list):  # ``params``: FSDP1's flat parameters (ours: plain ones marked as such)
        return ["list", [[isinstance(p, nn.Parameter), bool(getattr(p, "_is_flat_param", False)), p.dim(),
                          str(p.dtype), p.requires_grad, str(p.device)] for p in value]]
    return [type(value).__name__, value]


def _units(wrapper_class: type, kwargs: dict[str, Any]) -> list[nn.Module]:
    """The units of the test model built with ``kwargs``, in ``fsdp_modules`` order."""
    diff.quiet()
    kwargs = dict(kwargs, auto_wrap_policy=diff.block_policy_torch())
    if wrapper_class is not FSDP:
        kwargs.update(diff.fsdp1_kwargs())
    units = wrapper_class.fsdp_modules(wrapper_class(diff.make_model(), **kwargs))
    if wrapper_class is not FSDP:  # the list is FSDP1's, complete
        assert sorted(name for name in vars(units[0]) if not name.startswith("_")) == CONSTRUCTOR_ATTRIBUTES
    return units


def _described_units(units: list[nn.Module]) -> list[dict[str, list[Any]]]:
    """Every unit's attributes described, the same on every rank: ``rank`` as every rank's value."""
    described = [{name: _described(getattr(unit, name)) for name in CONSTRUCTOR_ATTRIBUTES} for unit in units]
    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, described)
    for index, unit in enumerate(described):
        unit["rank"] = ["int", [each[index]["rank"][1] for each in every_rank]]
        others = [{**each[index], "rank": unit["rank"]} for each in every_rank]
        assert all(other == unit for other in others), "only the rank differs between ranks"
    return described


@pytest.mark.parametrize("config", ["defaults", "mixed_precision", "cpu_offload", "SHARD_GRAD_OP", "NO_SHARD",
                                    "HYBRID_SHARD", "prefetch_limits_orig_params", "backward_post"])
@distributed_test(world_size=2)
def test_public_constructor_attributes_are_fsdp1s(config):
    """Each public attribute FSDP1's constructor sets, on every unit: FSDP1's value, of FSDP1's type (by
    name: ``MixedPrecision()`` without mixed precision, not ``None``), and with FSDP1 at hand equal to its
    values themselves (our enums and configs equal torch's) and the same process group object. ``params``:
    the unit's flat parameters, plain ``nn.Parameter``s marked ``_is_flat_param`` (torch's ``FlatParameter``
    ``isinstance`` check accepts them; README, "Differences")."""
    kwargs = _constructor_configs()[config]
    ours = _units(FSDP, kwargs)
    theirs = _units(diff.TorchFSDP, kwargs) if diff.HAVE_FSDP1 else []
    expected = diff.fsdp1_value("wrapper_names", diff.golden_key("constructor-attributes", config),
                                lambda: _described_units(theirs))
    described = _described_units(ours)
    assert len(described) == len(expected)
    for index, (mine, fsdp1) in enumerate(zip(described, expected)):
        for name in CONSTRUCTOR_ATTRIBUTES:
            assert mine[name] == fsdp1[name], f"unit {index}: {name} is {mine[name]}, FSDP1's {fsdp1[name]}"
    for mine, fsdp1 in zip(ours, theirs):
        for name in ("sharding_strategy", "backward_prefetch", "mixed_precision", "cpu_offload", "training_state"):
            assert getattr(mine, name) == getattr(fsdp1, name) and getattr(fsdp1, name) == getattr(mine, name), name
        assert mine.process_group is fsdp1.process_group


# ---------------------------------------------------------------------------------------------
# Names, nesting and the module surface
# ---------------------------------------------------------------------------------------------

@distributed_test(world_size=2)
def test_parameter_names_match_fsdp1_with_orig_params():
    diff.quiet()
    ours = FSDP(diff.make_model(), auto_wrap_policy=diff.block_policy_torch(), use_orig_params=True)

    def fsdp1_names():
        theirs = diff.TorchFSDP(diff.make_model(), auto_wrap_policy=diff.block_policy_torch(),
                                use_orig_params=True, **diff.fsdp1_kwargs())
        return {kind: [n for n, _ in getattr(theirs, f"named_{kind}")()]
                for kind in ("parameters", "buffers", "modules")}

    expected = diff.fsdp1_value("wrapper_names", diff.golden_key("block-policy"), fsdp1_names)
    for kind in ("parameters", "buffers", "modules"):
        assert [n for n, _ in getattr(ours, f"named_{kind}")()] == expected[kind], kind
    # The parameters under those names: sharded DTensors by default, FSDP1's plain local shards otherwise.
    assert all(isinstance(p, DTensor) == fsdp_module.DTENSOR_PARAMS for p in ours.parameters())


@distributed_test(world_size=2)
def test_module_surface():
    diff.quiet()
    inner = diff.make_model()
    model = FSDP(inner, auto_wrap_policy=our_wrap.ModuleWrapPolicy({Block}))
    assert model.module is inner and model._fsdp_wrapped_module is inner
    assert model.config is inner.config  # attribute forwarding
    units = FSDP.fsdp_modules(model)
    assert units[0] is model and len(units) == 1 + GPTConfig().n_layer
    assert FSDP.fsdp_modules(model, root_only=True) == [model]
    assert model.check_is_root() and not units[1].check_is_root()
    assert isinstance(inner.blocks[0], FSDP)
    sequential = FSDP(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert isinstance(sequential[0], nn.Linear)  # __getitem__ forwarding


def _shared_unit_tree(wrapper_class) -> nn.Module:
    """A root over a unit registered in two places (met once), an empty child slot, and a unit nested
    in another: the module tree shapes a walk over the units must not double, skip or reorder."""
    torch.manual_seed(0)
    shared = wrapper_class(nn.Sequential(nn.Linear(4, 4), wrapper_class(nn.Linear(4, 4), **diff.fsdp1_kwargs())),
                           **diff.fsdp1_kwargs())
    tree = nn.Module()
    tree.first = wrapper_class(nn.Linear(4, 4), **diff.fsdp1_kwargs())
    tree.shared = shared
    tree.register_module("empty", None)
    tree.tail = nn.Sequential(nn.ReLU(), shared, wrapper_class(nn.Linear(4, 4), **diff.fsdp1_kwargs()))
    return wrapper_class(tree, **diff.fsdp1_kwargs())


def _units_by_first_path(model: nn.Module, wrapper_class) -> list[str]:
    first_path = {id(module): diff.clean_name(name) for name, module in model.named_modules()}
    return [first_path[id(unit)] for unit in wrapper_class.fsdp_modules(model)]


@distributed_test(world_size=1)
def test_fsdp_modules_lists_each_unit_once_in_pre_order_like_fsdp1():
    diff.quiet()
    expected = diff.fsdp1_value("wrapper_names", "units-shared-and-empty-slots",
                                lambda: _units_by_first_path(_shared_unit_tree(diff.TorchFSDP), diff.TorchFSDP))
    assert expected == ["", "first", "shared", "shared.1", "tail.2"]
    assert _units_by_first_path(_shared_unit_tree(FSDP), FSDP) == expected


@distributed_test(world_size=2)
def test_manual_nesting_and_enable_wrap_match_auto_wrap():
    diff.quiet()
    auto = FSDP(diff.make_model(), auto_wrap_policy=our_wrap.ModuleWrapPolicy({Block}))

    manual_inner = diff.make_model()
    for index, block in enumerate(manual_inner.blocks):
        manual_inner.blocks[index] = FSDP(block)
    manual = FSDP(manual_inner)

    context_inner = diff.make_model()
    with our_wrap.enable_wrap(wrapper_cls=FSDP, sharding_strategy=fsdp_compat.ShardingStrategy.FULL_SHARD):
        for index, block in enumerate(context_inner.blocks):
            context_inner.blocks[index] = our_wrap.wrap(block)
        context = our_wrap.wrap(context_inner)

    names = [n for n, _ in auto.named_parameters()]
    reference_losses, reference_params = diff.reference_run("sgd", 3)
    for model in (manual, context):
        assert [n for n, _ in model.named_parameters()] == names
        assert len(FSDP.fsdp_modules(model)) == len(FSDP.fsdp_modules(auto))
        losses = diff.train(model, diff.make_optimizer("sgd", model.parameters()), 3)
        diff.assert_close_lists(losses, reference_losses)
        diff.assert_close_dicts(diff.full_parameters(model), reference_params)


# ---------------------------------------------------------------------------------------------
# Auto-wrap policies: the same units as FSDP1 for every kind of policy, ours and torch's
# ---------------------------------------------------------------------------------------------

def _policies(wrap_module):
    return {
        "module": wrap_module.ModuleWrapPolicy({Block, nn.LayerNorm}),
        "custom": wrap_module.CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features > 40),
        "transformer": functools.partial(wrap_module.transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        "size": functools.partial(wrap_module.size_based_auto_wrap_policy, min_num_params=3000),
        "lambda": functools.partial(wrap_module.lambda_auto_wrap_policy,
                                    lambda_fn=lambda m: isinstance(m, nn.Embedding)),
        "always": wrap_module.always_wrap_policy,
    }


def _unit_names(model: nn.Module, wrapper_class) -> list[str]:
    return [diff.clean_name(name) for name, module in model.named_modules() if isinstance(module, wrapper_class)]


@pytest.mark.parametrize("policy_name", ["module", "custom", "transformer", "size", "lambda", "always"])
@distributed_test(world_size=1)
def test_wrapped_units_match_fsdp1(policy_name):
    diff.quiet()
    expected = diff.fsdp1_value("wrapper_names", f"units-{policy_name}", lambda: _unit_names(
        diff.TorchFSDP(diff.make_model(), auto_wrap_policy=_policies(diff.torch_wrap)[policy_name],
                       **diff.fsdp1_kwargs()), diff.TorchFSDP))
    policies = [_policies(our_wrap)[policy_name]]
    if diff.torch_wrap is not None:
        policies.append(_policies(diff.torch_wrap)[policy_name])
    for policy in policies:
        assert _unit_names(FSDP(diff.make_model(), auto_wrap_policy=policy), FSDP) == expected


# ---------------------------------------------------------------------------------------------
# Arguments: meta init, sync_module_states, ignored states, device_id, hybrid layouts, checkpointing
# ---------------------------------------------------------------------------------------------

@distributed_test(world_size=2)
def test_meta_device_model_gets_eager_values():
    diff.quiet()
    eager = diff.full_parameters(diff.make_model(seed=3))
    with torch.device("meta"):
        meta_model = TinyGPT()
    torch.manual_seed(3)
    model = FSDP(meta_model, auto_wrap_policy=our_wrap.ModuleWrapPolicy({Block}), device_id=diff.device())
    diff.assert_close_dicts(diff.full_parameters(model), eager, rtol=0)
    assert model.module.head.weight is model.module.tok_emb.weight
    assert model.module.logit_scale.item() == 0.5


def _meta_model_with_recording_init(wrapper_class, extra: dict):
    with torch.device("meta"):
        meta_model = TinyGPT()
    seen = []

    def init(module: nn.Module) -> None:  # the usual FSDP1 recipe: this module's own states only
        seen.append(type(module).__name__)
        module.to_empty(device=diff.device(), recurse=False)
        with torch.no_grad():
            for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                tensor.fill_(0.25)

    model = wrapper_class(meta_model, param_init_fn=init, auto_wrap_policy=diff.block_policy_torch(), **extra)
    return seen, model


@distributed_test(world_size=2)
def test_param_init_fn_is_called_like_fsdp1():
    """FSDP1 calls ``param_init_fn`` on every module of each unit, units bottom-up, breadth-first."""
    diff.quiet()
    seen, model = _meta_model_with_recording_init(FSDP, {})
    assert all(torch.all(value == 0.25) for value in diff.full_parameters(model).values())
    assert model.module.logit_scale.item() == 0.25
    if diff.HAVE_FSDP1:
        fsdp1_seen, _ = _meta_model_with_recording_init(diff.TorchFSDP, diff.fsdp1_kwargs())
        assert seen == fsdp1_seen


@distributed_test(world_size=2)
def test_meta_model_is_sharded_unit_by_unit():
    """While block k is materialised, blocks before it are already sharded (bounded peak memory)."""
    diff.quiet()
    with torch.device("meta"):
        meta_model = TinyGPT(GPTConfig(n_layer=3))
    sharded_when_initialised = []
    for index, block in enumerate(meta_model.blocks):
        def record(module, index=index, original=block.ln1.reset_parameters):
            earlier = meta_model.blocks[:index]
            sharded_when_initialised.append(all(isinstance(p, DTensor) for b in earlier for p in b.parameters()))
            original()
        block.ln1.reset_parameters = functools.partial(record, block.ln1)
    FSDP(meta_model, auto_wrap_policy=our_wrap.ModuleWrapPolicy({Block}))
    assert sharded_when_initialised == [True, True, True]


@distributed_test(world_size=2)
def test_sync_module_states_gives_rank0_values():
    diff.quiet()
    model = FSDP(diff.make_model(seed=dist.get_rank()), auto_wrap_policy=our_wrap.ModuleWrapPolicy({Block}),
                 sync_module_states=True)
    diff.assert_close_dicts(diff.full_parameters(model), diff.full_parameters(diff.make_model(seed=0)), rtol=0)


@pytest.mark.parametrize("how", ["ignored_modules", "ignored_states_modules", "ignored_states_params",
                                 "ignored_params_inside_a_unit"])
@distributed_test(world_size=2)
def test_ignored_states_train_like_fsdp1(how):
    diff.quiet()

    def build(wrapper_class, extra):
        inner = diff.make_model()
        ignored = {"ignored_modules": {"ignored_modules": [inner.ln_f]},
                   "ignored_states_modules": {"ignored_states": [inner.ln_f]},
                   "ignored_states_params": {"ignored_states": list(inner.ln_f.parameters())},
                   "ignored_params_inside_a_unit": {"ignored_states": [inner.blocks[0].mlp.fc.weight]}}[how]
        model = wrapper_class(inner, auto_wrap_policy=diff.block_policy_torch(), use_orig_params=True,
                              **ignored, **extra)
        return model, inner

    model, inner = build(FSDP, {})
    ignored = inner.blocks[0].mlp.fc.weight if how == "ignored_params_inside_a_unit" else inner.ln_f.weight
    assert not isinstance(ignored, DTensor)
    assert ignored.shape == diff.make_model().get_parameter(
        "blocks.0.mlp.fc.weight" if how == "ignored_params_inside_a_unit" else "ln_f.weight").shape
    losses = diff.train(model, diff.make_optimizer("adamw", model.parameters()), 3)
    if diff.HAVE_FSDP1:
        theirs, _ = build(diff.TorchFSDP, diff.fsdp1_kwargs())
        fsdp1_losses = diff.train(theirs, diff.make_optimizer("adamw", theirs.parameters()), 3)
        diff.assert_close_lists(losses, fsdp1_losses)
        ours_params = diff.full_parameters(model)
        with diff.TorchFSDP.summon_full_params(theirs):
            theirs_params = {diff.clean_name(n): p.detach().clone() for n, p in theirs.named_parameters()}
        diff.assert_close_dicts(ours_params, theirs_params)


def _fsdp1_classes() -> list[type]:
    return [diff.TorchFSDP] if diff.HAVE_FSDP1 else []


def _ignoring_the_wrapped_module(wrapper_class) -> dict:
    """Wrap TinyGPT ignoring TinyGPT itself, with a block policy, and train it two steps."""
    inner = diff.make_model()
    kwargs = diff.fsdp1_kwargs() if wrapper_class is diff.TorchFSDP else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = wrapper_class(inner, ignored_modules=[inner], auto_wrap_policy=diff.block_policy_torch(),
                              use_orig_params=True, **kwargs)
    return {"warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)
                         and "top-level" in str(w.message)],
            "units": len(wrapper_class.fsdp_modules(model)),
            "every parameter whole": all(type(p) is nn.Parameter and p.shape == inner.get_parameter(
                diff.clean_name(name)).shape for name, p in model.named_parameters()),
            "losses": diff.train(model, diff.make_optimizer("sgd", model.parameters()), 2)}


@distributed_test(world_size=2)
def test_ignoring_the_wrapped_module_itself_warns_and_ignores_every_parameter_like_fsdp1():
    """FSDP1 warns and goes on: nothing is sharded or wrapped, each rank trains its own replica."""
    diff.quiet()
    ours = _ignoring_the_wrapped_module(FSDP)
    expected = diff.fsdp1_value("wrapper_names", diff.golden_key("ignore-wrapped-module"),
                                lambda: _ignoring_the_wrapped_module(diff.TorchFSDP))
    assert len(ours["warnings"]) == 1
    assert ours["warnings"][0].startswith("Trying to ignore the top-level module passed into the FSDP "
                                          "constructor itself will result in all parameters being ignored")
    diff.assert_close_lists(ours.pop("losses"), expected.pop("losses"), what="losses vs FSDP1")
    assert ours == expected
    assert ours["units"] == 1 and ours["every parameter whole"]


def _local_numel(model: nn.Module) -> int:
    """Parameter elements held, summed over ranks: the model's numel when every parameter is
    sharded (FSDP1's 1-D views, our DTensors), more where some are kept whole on every rank."""
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    total = torch.tensor(held)
    dist.all_reduce(total)
    return int(total)


def _ignoring_states_outside(wrapper_class, how: str) -> dict:
    """TinyGPT wrapped with ignored states that lie outside the module (some of) its wrappers wrap."""
    inner, outsider = diff.make_model(), nn.Linear(3, 2)
    kwargs = diff.fsdp1_kwargs() if wrapper_class is diff.TorchFSDP else {}
    if how == "same list for sibling units":  # manual wrapping, one ignore list for every unit
        ignored = [block.mlp for block in inner.blocks]
        for index, block in enumerate(inner.blocks):
            inner.blocks[index] = wrapper_class(block, ignored_modules=ignored, use_orig_params=True, **kwargs)
        model = wrapper_class(inner, ignored_modules=ignored, use_orig_params=True, **kwargs)
    else:
        ignored_states = {"module": [outsider], "parameter": [outsider.weight]}[how]
        model = wrapper_class(inner, ignored_states=ignored_states, auto_wrap_policy=diff.block_policy_torch(),
                              use_orig_params=True, **kwargs)
    return {"parameter elements held": _local_numel(model), "outsider whole": type(outsider.weight) is nn.Parameter,
            "losses": diff.train(model, diff.make_optimizer("sgd", model.parameters()), 2)}


@pytest.mark.parametrize("how", ["module", "parameter", "same list for sibling units"])
@distributed_test(world_size=2)
def test_ignored_states_outside_the_wrapped_module_are_accepted_like_fsdp1(how):
    """FSDP1 accepts them and they change nothing: the module's other parameters are sharded as usual."""
    diff.quiet()
    ours = _ignoring_states_outside(FSDP, how)
    expected = diff.fsdp1_value("wrapper_names", diff.golden_key("ignore-outside", how),
                                lambda: _ignoring_states_outside(diff.TorchFSDP, how))
    diff.assert_close_lists(ours.pop("losses"), expected.pop("losses"), what="losses vs FSDP1")
    assert ours == expected


@distributed_test(world_size=2)
def test_device_id_cpu_and_device_placement():
    if diff.device().type != "cpu":
        pytest.skip("device_id=cpu needs a CPU backend (gloo); this pool runs on GPUs")
    diff.quiet()
    model = FSDP(diff.make_model(), device_id=torch.device("cpu"))
    assert model.compute_device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("layout", ["process_group_tuple", "automatic"])
@distributed_test(world_size=4)
def test_hybrid_layouts_train_like_reference(layout):
    diff.quiet()
    if layout == "process_group_tuple":
        ranks = list(range(4))
        intra_groups = [dist.new_group(ranks[:2]), dist.new_group(ranks[2:])]
        inter_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        rank = dist.get_rank()
        extra = {"process_group": (intra_groups[rank // 2], inter_groups[rank % 2])}
    else:
        extra = {}
    model = FSDP(diff.make_model(), sharding_strategy=fsdp_compat.ShardingStrategy.HYBRID_SHARD,
                 auto_wrap_policy=our_wrap.ModuleWrapPolicy({Block}), **extra)
    assert model._device_mesh.ndim == 2
    if layout == "process_group_tuple":
        assert model._device_mesh.shape == (2, 2)
    losses = diff.train(model, diff.make_optimizer("adamw", model.parameters()), 3)
    reference_losses, reference_params = diff.reference_run("adamw", 3)
    diff.assert_close_lists(losses, reference_losses)
    diff.assert_close_dicts(diff.full_parameters(model), reference_params)


@needs_fsdp1  # torch's apply_activation_checkpointing runs FSDP1's wrap module
@pytest.mark.parametrize("when", ["before", "after"])
@distributed_test(world_size=2)
def test_activation_checkpointing_before_or_after_wrapping(when):
    diff.quiet()
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

    wrapper_fn = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    inner = diff.make_model()
    if when == "before":
        apply_activation_checkpointing(inner, checkpoint_wrapper_fn=wrapper_fn,
                                       check_fn=lambda m: isinstance(m, Block))
        model = FSDP(inner, auto_wrap_policy=our_wrap.ModuleWrapPolicy({Block}))
    else:
        model = FSDP(inner, auto_wrap_policy=our_wrap.ModuleWrapPolicy({Block}))
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper_fn,
                                       check_fn=lambda m: isinstance(m, Block))
    assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())
    losses = diff.train(model, diff.make_optimizer("sgd", model.parameters()), 3)
    reference_losses, reference_params = diff.reference_run("sgd", 3)
    diff.assert_close_lists(losses, reference_losses)
    diff.assert_close_dicts(diff.full_parameters(model), reference_params)
    assert set(model.state_dict()) == set(diff.make_model().state_dict())


@distributed_test(world_size=2)
def test_moot_options_warn_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(nn.Linear(4, 4), limit_all_gathers=False)
        FSDP(nn.Linear(4, 4), limit_all_gathers=False)
    assert sum("limit_all_gathers" in str(w.message) for w in caught) == 1


# ---------------------------------------------------------------------------------------------
# Bad input: FSDP1's exception types, clear messages
# ---------------------------------------------------------------------------------------------

def _bad_calls():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(diff.device().type, (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    return {
        "process_group and device_mesh": (lambda cls, kw: cls(nn.Linear(2, 2), process_group=dist.group.WORLD,
                                                                device_mesh=mesh, **kw), ValueError),
        "ignored_modules and ignored_states": (lambda cls, kw: cls(model, ignored_modules=[model[0]],
                                                                     ignored_states=[model[0].weight], **kw), ValueError),
        "mixed ignored_states": (lambda cls, kw: cls(model, ignored_states=[model[0], model[1].weight], **kw), ValueError),
        "not a module": (lambda cls, kw: cls("model", **kw), AttributeError),
        "hybrid with 1-D mesh": (lambda cls, kw: cls(nn.Linear(2, 2), device_mesh=mesh,
                                                     sharding_strategy=fsdp_compat.ShardingStrategy.HYBRID_SHARD, **kw),
                                 ValueError),
        "hybrid with one group": (lambda cls, kw: cls(nn.Linear(2, 2), process_group=dist.group.WORLD,
                                                      sharding_strategy=fsdp_compat.ShardingStrategy.HYBRID_SHARD, **kw),
                                  ValueError),
    }


@pytest.mark.parametrize("case", ["process group and device_mesh", "ignored_modules and ignored_states",
                                  "mixed ignored_states", "not a module", "hybrid with 1-D mesh",
                                  "hybrid with one group"])
@distributed_test(world_size=2)
def test_bad_arguments_raise_fsdp1_exception_type(case):
    diff.quiet()
    call, expected = _bad_calls()[case.replace("process group", "process_group")]
    with pytest.raises(expected) as ours:
        call(FSDP, {})
    assert len(str(ours.value)) > 20
    if diff.HAVE_FSDP1:
        with pytest.raises(expected):
            call(diff.TorchFSDP, diff.fsdp1_kwargs())


@distributed_test(world_size=1)
def test_unknown_strategy_fsdp1_accepts_silently_raises_value_error():
    with pytest.raises(ValueError, match="must|not"):
        FSDP(nn.Sequential(nn.Linear(4, 4)), sharding_strategy="FULL_SHARD")


@distributed_test(world_size=2)
def test_parameters_passed_as_ignored_modules_raise_fsdp1_value_error():
    """FSDP1 takes parameters only as ``ignored_states``; its text is what callers match on."""
    diff.quiet()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for wrapper_class, kwargs in [(FSDP, {}), *[(cls, diff.fsdp1_kwargs()) for cls in _fsdp1_classes()]]:
        with pytest.raises(ValueError, match=r"^ignored_modules expects nn\.Module list elements but got types "
                                             r"\[<class 'torch\.nn\.parameter\.Parameter'>\]"):
            wrapper_class(model, ignored_modules=[model[0].weight], **kwargs)
    assert all(type(p) is nn.Parameter and torch.equal(p, before[n]) for n, p in model.named_parameters())
