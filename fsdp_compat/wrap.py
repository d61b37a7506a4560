"""Auto-wrap policies and manual wrapping (``wrap`` / ``enable_wrap``), as in torch FSDP1.

Every policy, ours or torch's (translated, so torch's FSDP1 wrap code never runs), is reduced by
:func:`plan_wrapping` to *which submodules become their own unit, with which keyword overrides*;
the wrapper then replaces those modules bottom-up.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch.nn as nn

from . import _engine

__all__ = ["always_wrap_policy", "lambda_auto_wrap_policy", "transformer_auto_wrap_policy",
           "size_based_auto_wrap_policy", "enable_wrap", "wrap", "CustomPolicy", "ModuleWrapPolicy"]

# A callable policy answers (module, recurse, nonwrapped_numel) -> bool, as in FSDP1.
CallablePolicy = Callable[..., bool]


class _Policy:
    """Base of the object policies: ``_lambda_fn(module)`` is whether to wrap ``module``, or a dict of
    constructor keyword overrides for it."""

    _lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]


class ModuleWrapPolicy(_Policy):
    """Wrap every submodule that is an instance of one of ``module_classes``."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self._module_classes = set(module_classes)

    def _lambda_fn(self, module: nn.Module) -> bool:  # type: ignore[override]
        return isinstance(module, tuple(self._module_classes))

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return _wrap_module_cls_individually(module, self._module_classes, recurse)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._module_classes})"


class CustomPolicy(_Policy):
    """Wrap the modules for which ``lambda_fn(module)`` is truthy: ``True``/``False``, or a dict of
    constructor keyword overrides (e.g. ``{"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}``)."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]):
        self._lambda_fn = lambda_fn  # type: ignore[assignment]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every submodule."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true (use with ``functools.partial``)."""
    return recurse or bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type[nn.Module]]) -> bool:
    """Wrap every instance of ``transformer_layer_cls`` (use with ``functools.partial``)."""
    return _wrap_module_cls_individually(module, transformer_layer_cls, recurse)


def _wrap_module_cls_individually(module: nn.Module, module_classes: Iterable[type], recurse: bool,
                                  *args: Any, **kwargs: Any) -> bool:
    """The class-based policies' rule (FSDP1's name and signature): wrap instances of ``module_classes``."""
    return recurse or isinstance(module, tuple(module_classes))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8), force_leaf_modules: set[type[nn.Module]] | None = None,
                                exclude_wrap_modules: set[type[nn.Module]] | None = None) -> bool:
    """Wrap a module once its not-yet-wrapped parameters reach ``min_num_params`` elements."""
    # Recursing, the force-leaf classes are not entered; deciding, the excluded classes are not wrapped.
    excluded = force_leaf_modules if recurse else exclude_wrap_modules
    if excluded is None:
        excluded = getattr(size_based_auto_wrap_policy, "FORCE_LEAF_MODULES" if recurse else "EXCLUDE_WRAP_MODULES")
    return nonwrapped_numel >= min_num_params and not isinstance(module, tuple(excluded))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, policies: list) -> bool:
    return any(p(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for p in policies)


# ---- Translating torch's policies into ours (so that FSDP1's wrap module is never called) ----

_TORCH_WRAP_MODULE = "torch.distributed.fsdp.wrap"
_POLICY_FUNCTIONS: dict[str, Callable[..., bool]] = {function.__name__: function for function in (
    always_wrap_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy,
    size_based_auto_wrap_policy, _or_policy, _wrap_module_cls_individually)}
_POLICY_CLASSES: dict[str, Callable[[Any], _Policy]] = {cls.__name__: cls for cls in (ModuleWrapPolicy, CustomPolicy)}


def translate_policy(policy: Any) -> _Policy | CallablePolicy | None:
    """Return ``policy`` with any torch FSDP1 policy object or function replaced by ours."""
    if policy is None or isinstance(policy, _Policy):
        return policy
    if isinstance(policy, functools.partial):
        keywords = dict(policy.keywords)
        if "policies" in keywords:
            keywords["policies"] = [translate_policy(p) for p in keywords["policies"]]
        function: Any = translate_policy(policy.func)
        return functools.partial(function, *policy.args, **keywords)
    if getattr(policy, "__module__", None) == _TORCH_WRAP_MODULE:  # a torch function or object
        name = getattr(policy, "__name__", type(policy).__name__)
        if name in _POLICY_CLASSES:  # torch's objects are rebuilt from their FSDP1 attributes
            return _POLICY_CLASSES[name](_engine.torch_wrap_policy_argument(policy))
        if name not in _POLICY_FUNCTIONS:
            raise TypeError(f"torch's wrap policy {name} has no fsdp_compat counterpart; pass one of "
                            f"ModuleWrapPolicy, CustomPolicy, {', '.join(_POLICY_FUNCTIONS)} instead")
        return _POLICY_FUNCTIONS[name]
    if not callable(policy):
        raise TypeError("auto_wrap_policy must be a policy object (ModuleWrapPolicy, CustomPolicy) or a callable "
                        f"(module, recurse, nonwrapped_numel) -> bool; got {type(policy).__name__}")
    return policy


# ---- Planning: which modules to wrap, one mechanism for every kind of policy ----

def plan_wrapping(root_module: nn.Module, policy: Any, ignored_modules: set[nn.Module],
                  ignored_params: set[nn.Parameter], root_kwargs: dict[str, Any],
                  individually_wrapped_classes: tuple[type[nn.Module], ...] = ()) -> dict[nn.Module, dict[str, Any]]:
    """``{module: constructor kwargs}`` for every submodule (never the root) to wrap, and every
    ``individually_wrapped_classes`` instance with ``mixed_precision=None`` (FSDP1's handling of
    mixed precision's ``_module_classes_to_ignore``)."""
    policy = translate_policy(policy)
    targets: dict[nn.Module, dict[str, Any]] = {}
    if isinstance(policy, _Policy):
        for module in root_module.modules():
            if module in ignored_modules:
                continue
            decision = policy._lambda_fn(module)
            if not isinstance(decision, (dict, bool)):
                raise ValueError("The lambda_fn passed to CustomPolicy should return False/True or a kwarg "
                                 f"dict, but it returned {decision}")
            if decision:
                targets[module] = {**root_kwargs, **(decision if isinstance(decision, dict) else {})}
    else:
        if individually_wrapped_classes:
            # As FSDP1: OR the policy with one that wraps those classes, so that the traversal
            # reaches them and counts their parameters as wrapped when sizing their parents.
            policy = functools.partial(_or_policy, policies=[policy, functools.partial(
                _wrap_module_cls_individually, module_classes=individually_wrapped_classes)])
        chosen: list[nn.Module] = []
        _plan_recursive(root_module, policy, ignored_modules, ignored_params, chosen, is_root=True)
        targets.update((module, dict(root_kwargs)) for module in chosen)
    for module in root_module.modules():
        if isinstance(module, individually_wrapped_classes) and module not in ignored_modules:
            targets.setdefault(module, dict(root_kwargs))["mixed_precision"] = None
    targets.pop(root_module, None)
    return targets


def _plan_recursive(module: nn.Module, policy: CallablePolicy, ignored_modules: set[nn.Module],
                    ignored_params: set[nn.Parameter], chosen: list[nn.Module], is_root: bool = False) -> int:
    """FSDP1's ``_recursive_wrap`` without the wrapping: returns the numel this subtree wraps."""
    nonwrapped_numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
        return 0
    wrapped_numel = sum(_plan_recursive(child, policy, ignored_modules, ignored_params, chosen)
                        for child in module.children() if child not in ignored_modules)
    remainder = nonwrapped_numel - wrapped_numel
    if not is_root and policy(module=module, recurse=False, nonwrapped_numel=remainder):
        chosen.append(module)
        return nonwrapped_numel
    return wrapped_numel


def apply_wrapping(root_module: nn.Module, targets: dict[nn.Module, dict[str, Any]],
                   wrap_function: Callable[..., nn.Module],
                   before_visit: Callable[[nn.Module], None]) -> None:
    """Replace each target submodule, children before parents, by ``wrap_function(module, **kw)``;
    ``before_visit`` sees every module in pre-order before anything below it is wrapped."""
    visited: set[nn.Module] = {root_module}

    def visit(module: nn.Module) -> None:
        before_visit(module)
        for name, child in list(module.named_children()):
            if child in visited:
                continue
            visited.add(child)
            visit(child)
            if child in targets:
                setattr(module, name, wrap_function(child, **targets[child]))

    visit(root_module)


# ---- Manual wrapping: ``with enable_wrap(wrapper_cls=FSDP, **kwargs): layer = wrap(layer)`` ----

# ``enable_wrap``'s ``(wrapper_cls, kwargs)`` while its context is open.
_manual_wrap: tuple[Callable[..., nn.Module], dict[str, Any]] | None = None


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Within this context, :func:`wrap` wraps modules with ``wrapper_cls(module, **wrapper_kwargs)``."""
    global _manual_wrap
    if _manual_wrap is not None:
        raise RuntimeError("enable_wrap contexts cannot be nested; exit the outer one first")
    _manual_wrap = (wrapper_cls, wrapper_kwargs)
    try:
        yield
    finally:
        _manual_wrap = None


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` if inside :func:`enable_wrap`, with per-call overrides; else return it as is."""
    if _manual_wrap is None:
        return module
    wrapper_cls, kwargs = _manual_wrap
    return wrapper_cls(module, **{**kwargs, **wrap_overrides, **getattr(module, "_wrap_overrides", {})})
