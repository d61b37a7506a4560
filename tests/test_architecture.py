"""The package's shape: torch internals only in the engine adapter, FSDP1's code never used.

Every torch-private name (a module path or attribute with a leading underscore) lives in
``fsdp_compat/_engine*``, so a torch upgrade that moves internals breaks that file only. The
library must never run on FSDP1's code, only recognise FSDP1 objects a user passes.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pathlib

import pytest

import fsdp_compat

PACKAGE = pathlib.Path(fsdp_compat.__file__).parent
LIBRARY = sorted(PACKAGE.rglob("*.py"))


def _in_adapter(path: pathlib.Path) -> bool:
    """``fsdp_compat/_engine.py`` or anything in an ``fsdp_compat/_engine/`` package."""
    return path.relative_to(PACKAGE).parts[0].startswith("_engine")


OUTSIDE_ADAPTER = [path for path in LIBRARY if not _in_adapter(path)]
# The demo's ``--compare-fsdp1`` runs torch's FSDP1 side by side on purpose; the library never does.
RUNS_ON_OUR_CODE = [path for path in LIBRARY if path.name != "demo.py"]

# FSDP1's modules. ``torch.distributed.fsdp._fully_shard`` is FSDP2 (the engine), for the adapter.
FSDP1_MODULES = ("torch.distributed.fsdp.fully_sharded_data_parallel", "torch.distributed.fsdp.wrap",
                 "torch.distributed.fsdp.sharded_grad_scaler", "torch.distributed.fsdp.api")
FSDP1_NAMES = {"FullyShardedDataParallel", "ShardingStrategy", "StateDictType", "BackwardPrefetch",
               "MixedPrecision", "CPUOffload", "ShardedGradScaler", "FullStateDictConfig",
               "ShardedStateDictConfig", "LocalStateDictConfig", "FullOptimStateDictConfig",
               "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig", "StateDictSettings"}


ENUM_NAMES = {"_name_", "_value_", "_missing_", "_ignore_", "_order_", "_generate_next_value_"}


def _private(name: str) -> bool:
    """``_x`` is private; dunders and enum's ``_name_``/``_value_``... are Python's, not torch's."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) \
        and name not in ENUM_NAMES


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imports(tree: ast.Module) -> list[tuple[int, str, str | None]]:
    """``(line, module, imported name or None)`` for every import statement."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


def _names_bound_to_torch(tree: ast.Module) -> set[str]:
    """Local names an import binds to a torch module or object (``torch``, ``dist``, ``nn``...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _names_bound_to_other_modules(tree: ast.Module) -> set[str]:
    """Local names bound to non-torch modules (``os``, ``sys``): their private names are not torch's."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "torch":
                    names.add(alias.asname or alias.name.split(".")[0])
    return names


@functools.cache  # the whole package parsed once, not once per file checked
def _names_the_library_defines() -> frozenset[str]:
    """Every private name the package itself defines (functions, classes, attributes it assigns):
    a private attribute outside this set belongs to someone else, i.e. torch."""
    names = set()
    for path in LIBRARY:
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)  # setattr/getattr by name, __slots__
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return frozenset(names)


def _chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    """``a.b.c`` -> ("a", ["b", "c"]); the root is ``None`` when it is not a plain name."""
    parts = []
    current: ast.AST = node
    while isinstance(current, ast.Attribute):
        parts.append(current.attr)
        current = current.value
    return (current.id if isinstance(current, ast.Name) else None), parts[::-1]


def _location(path: pathlib.Path, line: int) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{line}"


@pytest.mark.parametrize("path", OUTSIDE_ADAPTER, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_torch_import_outside_the_adapter(path: pathlib.Path) -> None:
    offending = [
        f"{_location(path, line)} imports {module}{'.' + name if name else ''}"
        for line, module, name in _imports(_tree(path))
        if module.split(".")[0] == "torch"
        and (any(_private(part) for part in module.split(".")) or (name is not None and _private(name)))
    ]
    assert not offending, "torch-private imports belong in fsdp_compat/_engine.py:\n" + "\n".join(offending)


@pytest.mark.parametrize("path", OUTSIDE_ADAPTER, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_torch_attribute_outside_the_adapter(path: pathlib.Path) -> None:
    tree = _tree(path)
    torch_names = _names_bound_to_torch(tree)
    other_modules = _names_bound_to_other_modules(tree) - torch_names
    ours = _names_the_library_defines()
    offending = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
            continue
        root, parts = _chain(node)
        if root in torch_names and any(_private(part) for part in parts):
            offending.append(f"{_location(path, node.lineno)} uses {ast.unparse(node)}")
        elif root not in other_modules and _private(node.attr) and node.attr not in ours:
            offending.append(f"{_location(path, node.lineno)} uses {ast.unparse(node)} "
                             f"(a private attribute the package does not define: torch's)")
    assert not offending, "torch-private attributes belong in fsdp_compat/_engine.py:\n" + "\n".join(
        sorted(set(offending)))


def _library_classes() -> list[type]:
    classes = []
    for path in OUTSIDE_ADAPTER:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        classes += [value for _, value in inspect.getmembers(module, inspect.isclass)
                    if value.__module__ == module.__name__]
    return classes


@pytest.mark.parametrize("cls", _library_classes(), ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_no_torch_private_method_overridden_outside_the_adapter(cls: type) -> None:
    torch_bases = [base for base in cls.__mro__[1:] if base.__module__.split(".")[0] == "torch"]
    overridden = [name for name in vars(cls) if _private(name)
                  and any(name in vars(base) for base in torch_bases)]
    assert not overridden, (f"{cls.__qualname__} overrides torch-private {overridden}: "
                            "only fsdp_compat/_engine.py may depend on torch internals")


@pytest.mark.parametrize("path", RUNS_ON_OUR_CODE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_library_never_imports_fsdp1(path: pathlib.Path) -> None:
    offending = []
    for line, module, name in _imports(_tree(path)):
        full = f"{module}.{name}" if name else module
        fsdp1_module = any(full == m or full.startswith(m + ".") for m in FSDP1_MODULES)
        fsdp1_name = module == "torch.distributed.fsdp" and name in FSDP1_NAMES
        private_fsdp = (full.startswith("torch.distributed.fsdp._")
                        and not (_in_adapter(path)
                                 and full.startswith("torch.distributed.fsdp._fully_shard")))
        if fsdp1_module or fsdp1_name or private_fsdp:
            offending.append(f"{_location(path, line)} imports {full}")
    assert not offending, "the library must not run on FSDP1's code:\n" + "\n".join(offending)


# The user-facing entry points built on the class; every other module is a feature the class uses.
ABOVE_THE_CLASS = {"__init__", "fully_sharded_data_parallel", "patch", "convert", "run", "testing", "demo", "examples"}


def _module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


MODULES = {_module_name(path): path for path in LIBRARY}


def _package_imports(path: pathlib.Path) -> dict[str, int]:
    """The package modules ``path`` imports -> first line: top-level, ``TYPE_CHECKING`` and
    function-local imports alike (``from . import a`` names module ``a``, else the package)."""
    found: dict[str, int] = {}
    package = _module_name(path).split(".")[:-1]
    for node in ast.walk(_tree(path)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name.removeprefix("fsdp_compat").lstrip(".") or "__init__"
                       for alias in node.names if alias.name.split(".")[0] == "fsdp_compat"]
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fsdp_compat")):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = (node.module or "").removeprefix("fsdp_compat").lstrip(".") if not node.level else node.module
            prefix = ".".join(base + ([module] if module else []))
            candidates = [f"{prefix}.{alias.name}" if prefix else alias.name for alias in node.names]
            targets = [c for c in candidates if c in MODULES] or [prefix or "__init__"]
        for target in targets:
            found.setdefault(target if target in MODULES else target + ".__init__", node.lineno)
    return found


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle in ``graph`` (depth-first search), or ``None``."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for imported in graph.get(module, {}):
            if state.get(imported) == "open":
                return stack[stack.index(imported):] + [imported]
            if imported not in state and (found := visit(imported)):
                return found
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_package_has_no_import_cycles() -> None:
    graph = {name: _package_imports(path) for name, path in MODULES.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


@pytest.mark.parametrize("name", sorted(set(MODULES) - ABOVE_THE_CLASS))
def test_feature_module_never_imports_the_wrapper_class(name: str) -> None:
    """Features take a unit's state (``_unit_state``), so the class module sits on top of them."""
    line = _package_imports(MODULES[name]).get("fully_sharded_data_parallel")
    assert line is None, (f"fsdp_compat/{name}.py:{line} imports fully_sharded_data_parallel; take a "
                          "UnitState (fsdp_compat/_unit_state.py) and ask state_of() instead")
