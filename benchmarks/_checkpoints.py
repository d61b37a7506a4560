"""Every checkpoint path a user takes, save and load, for each engine (``--checkpoints``).

A path is what user code calls: FSDP1's API for ``fsdp_compat`` and torch FSDP1 (the same
program, only the import differs), and the nearest call of ``torch.distributed.checkpoint.state_dict``
for raw ``fully_shard``. Each is timed between barriers over a few calls (median), after one
untimed call that also counts its collectives; the peak memory of a call is the rise of the
per-phase high-water mark (RSS on CPU, allocator peak on GPU) over the level before it, so it
includes what the call returns.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from _comm import CollectiveCounter
from _engines import Engine, FSDP1StyleEngine, RawFSDP2Engine
from _memory import PeakMemory

Save = Callable[[nn.Module, torch.optim.Optimizer], Any]
Load = Callable[[nn.Module, torch.optim.Optimizer, Any], None]


@dataclass(frozen=True)
class PathSpec:
    """One user path: its name (metric keys), what it is, and what raw FSDP2 runs for it."""

    name: str
    label: str
    raw: str  # the torch.distributed.checkpoint.state_dict call used for raw fully_shard


PATHS = (
    PathSpec("model_full", "FULL model state_dict / load_state_dict",
             "get/set_model_state_dict(full_state_dict=True)"),
    PathSpec("model_full_rank0", "FULL model state_dict, rank0_only",
             "get_model_state_dict(full_state_dict=True) (torch has no rank0_only without cpu_offload)"),
    PathSpec("model_full_offload", "FULL model state_dict, offload_to_cpu",
             "get_model_state_dict(full_state_dict=True, cpu_offload=True) (rank 0 keeps it)"),
    PathSpec("model_full_offload_rank0", "FULL model state_dict, offload_to_cpu + rank0_only",
             "get_model_state_dict(full_state_dict=True, cpu_offload=True)"),
    PathSpec("model_sharded", "SHARDED model state_dict / load_state_dict",
             "get/set_model_state_dict()"),
    PathSpec("optim_full", "FULL optim_state_dict / optim_state_dict_to_load + load",
             "get/set_optimizer_state_dict(full_state_dict=True)"),
    PathSpec("optim_full_rank0", "FULL optim_state_dict / _to_load, rank0_only",
             "get_optimizer_state_dict(full, cpu_offload) / set_(full, broadcast_from_rank0)"),
    PathSpec("optim_sharded", "SHARDED optim_state_dict / optim_state_dict_to_load + load",
             "get/set_optimizer_state_dict()"),
    PathSpec("legacy_full_scatter", "full_optim_state_dict / scatter_full_optim_state_dict + load",
             "get_optimizer_state_dict(full, cpu_offload) / set_(full, broadcast_from_rank0)"),
    PathSpec("legacy_full_shard", "full_optim_state_dict(rank0_only=False) / shard_full_optim_state_dict + load",
             "get/set_optimizer_state_dict(full_state_dict=True)"),
    PathSpec("model_local", "LOCAL model state_dict / load_state_dict",
             "get/set_model_state_dict() (torch has no LOCAL type)"),
    PathSpec("optim_local", "LOCAL optim_state_dict / optim_state_dict_to_load + load",
             "get/set_optimizer_state_dict() (torch has no LOCAL type)"),
    PathSpec("legacy_sharded_flatten", "sharded_optim_state_dict / flatten_sharded_optim_state_dict + load",
             "get/set_optimizer_state_dict()"),
    PathSpec("dcp", "DCP: get_state_dict + dcp.save / dcp.load + set_state_dict",
             "the same calls"),
)


def _fsdp1_style(engine: FSDP1StyleEngine) -> dict[str, tuple[Save, Load | None]]:
    fsdp, api = engine.fsdp, engine.api
    full, sharded = api.StateDictType.FULL_STATE_DICT, api.StateDictType.SHARDED_STATE_DICT
    local = api.StateDictType.LOCAL_STATE_DICT

    def model_save(kind: Any, config: Any = None) -> Save:
        def save(model: nn.Module, optim: Any) -> Any:
            with fsdp.state_dict_type(model, kind, config):
                return model.state_dict()
        return save

    def model_load(kind: Any) -> Load:
        def load(model: nn.Module, optim: Any, state: Any) -> None:
            with fsdp.state_dict_type(model, kind):
                model.load_state_dict(state)
        return load

    def optim_save(kind: Any, config: Any = None) -> Save:
        def save(model: nn.Module, optim: Any) -> Any:
            with fsdp.state_dict_type(model, kind, None, config):
                return fsdp.optim_state_dict(model, optim)
        return save

    def optim_load(kind: Any, config: Any = None) -> Load:
        def load(model: nn.Module, optim: Any, state: Any) -> None:
            with fsdp.state_dict_type(model, kind, None, config):
                optim.load_state_dict(fsdp.optim_state_dict_to_load(model, optim, state))
        return load

    def full_config(offload: bool, rank0: bool) -> Any:
        return api.FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0)

    rank0_optim = api.FullOptimStateDictConfig(rank0_only=True)
    return {
        "model_full": (model_save(full, full_config(False, False)), model_load(full)),
        "model_full_rank0": (model_save(full, full_config(False, True)), None),
        "model_full_offload": (model_save(full, full_config(True, False)), None),
        "model_full_offload_rank0": (model_save(full, full_config(True, True)), None),
        "model_sharded": (model_save(sharded), model_load(sharded)),
        "optim_full": (optim_save(full), optim_load(full)),
        "optim_full_rank0": (optim_save(full, rank0_optim), optim_load(full, rank0_optim)),
        "optim_sharded": (optim_save(sharded), optim_load(sharded)),
        "legacy_full_scatter": (
            lambda model, optim: fsdp.full_optim_state_dict(model, optim),
            lambda model, optim, state: optim.load_state_dict(
                fsdp.scatter_full_optim_state_dict(state, model, optim=optim))),
        "legacy_full_shard": (
            lambda model, optim: fsdp.full_optim_state_dict(model, optim, rank0_only=False),
            lambda model, optim, state: optim.load_state_dict(
                fsdp.shard_full_optim_state_dict(state, model, optim=optim))),
        "model_local": (model_save(local), model_load(local)),
        "optim_local": (optim_save(local), optim_load(local)),
        "legacy_sharded_flatten": (
            lambda model, optim: _sharded_legacy(fsdp, api, model, optim),
            lambda model, optim, state: optim.load_state_dict(
                fsdp.flatten_sharded_optim_state_dict(state, model, optim))),
    }


def _sharded_legacy(fsdp: Any, api: Any, model: nn.Module, optim: Any) -> Any:
    """``sharded_optim_state_dict``, under SHARDED as FSDP1 needs it for its ShardedTensors."""
    with fsdp.state_dict_type(model, api.StateDictType.SHARDED_STATE_DICT):
        return fsdp.sharded_optim_state_dict(model, optim)


def _raw() -> dict[str, tuple[Save, Load | None]]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sharded = StateDictOptions()

    def model_full(model: nn.Module, optim: Any) -> Any:
        return get_model_state_dict(model, options=full)

    def optim_offload(model: nn.Module, optim: Any) -> Any:
        return get_optimizer_state_dict(model, optim, options=offload)

    def optim_from_rank0(model: nn.Module, optim: Any, state: Any) -> None:
        set_optimizer_state_dict(model, optim, state, options=from_rank0)

    return {
        "model_full": (model_full, lambda m, o, s: set_model_state_dict(m, s, options=full)),
        "model_full_rank0": (model_full, None),
        "model_full_offload": (lambda m, o: get_model_state_dict(m, options=offload), None),
        "model_full_offload_rank0": (lambda m, o: get_model_state_dict(m, options=offload), None),
        "model_sharded": (lambda m, o: get_model_state_dict(m, options=sharded),
                          lambda m, o, s: set_model_state_dict(m, s, options=sharded)),
        "optim_full": (lambda m, o: get_optimizer_state_dict(m, o, options=full),
                       lambda m, o, s: set_optimizer_state_dict(m, o, s, options=full)),
        "optim_full_rank0": (optim_offload, optim_from_rank0),
        "optim_sharded": (lambda m, o: get_optimizer_state_dict(m, o, options=sharded),
                          lambda m, o, s: set_optimizer_state_dict(m, o, s, options=sharded)),
        "legacy_full_scatter": (optim_offload, optim_from_rank0),
        "legacy_full_shard": (lambda m, o: get_optimizer_state_dict(m, o, options=full),
                              lambda m, o, s: set_optimizer_state_dict(m, o, s, options=full)),
        "model_local": (lambda m, o: get_model_state_dict(m, options=sharded),
                        lambda m, o, s: set_model_state_dict(m, s, options=sharded)),
        "optim_local": (lambda m, o: get_optimizer_state_dict(m, o, options=sharded),
                        lambda m, o, s: set_optimizer_state_dict(m, o, s, options=sharded)),
        "legacy_sharded_flatten": (lambda m, o: get_optimizer_state_dict(m, o, options=sharded),
                                   lambda m, o, s: set_optimizer_state_dict(m, o, s, options=sharded)),
    }


def _dcp(run_dir: str) -> tuple[Save, Load]:
    """torch's recommended checkpoint for every engine: ``get_state_dict`` + ``dcp.save``, then a
    template from ``get_state_dict``, ``dcp.load`` into it and ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = str(Path(run_dir) / "ckpt_paths_dcp")

    def save(model: nn.Module, optim: Any) -> Any:
        model_state, optim_state = get_state_dict(model, optim)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        return path

    def load(model: nn.Module, optim: Any, saved: Any) -> None:
        model_state, optim_state = get_state_dict(model, optim)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=saved)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    return save, load


# FSDP1 on a CPU-only machine: offload_to_cpu=True in a FULL state dict segfaults the process
# (the "copy" to CPU is a no-op and the storage is then freed; shared/FSDP1-CONTRACT.md), which
# would lose the whole run. Those paths are reported as errors without being run.
_FSDP1_CRASHES_ON_CPU = ("model_full_offload", "model_full_offload_rank0")


def _not_run(model: nn.Module, optim: Any) -> Any:
    raise RuntimeError("not run: torch FSDP1 segfaults with offload_to_cpu=True on a CPU-only machine")


def engine_paths(engine: Engine, run_dir: str, device: torch.device) -> dict[str, tuple[Save, Load | None]]:
    paths = _raw() if isinstance(engine, RawFSDP2Engine) else _fsdp1_style(engine)  # type: ignore[arg-type]
    paths["dcp"] = _dcp(run_dir)
    if engine.name == "fsdp1" and device.type == "cpu":
        for name in _FSDP1_CRASHES_ON_CPU:
            paths[name] = (_not_run, None)
    return paths


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(call: Callable[[], Any], device: torch.device,
             memory: PeakMemory) -> tuple[Any, float, float, float]:
    """One call between barriers: its result, wall time (slowest rank sets it, as everyone waits
    at the second barrier), this rank's CPU time (robust when other processes share the cores;
    waiting in a collective costs none) and peak memory over the level before it."""
    dist.barrier()
    _sync(device)
    before = memory.current_mb()
    memory.reset()
    start, cpu_start = time.perf_counter(), time.process_time()
    result = call()
    _sync(device)
    cpu = time.process_time() - cpu_start
    dist.barrier()
    elapsed = time.perf_counter() - start
    return result, elapsed, cpu, memory.peak_mb() - before


def measure_paths(engine: Engine, model: nn.Module, optim: torch.optim.Optimizer, device: torch.device,
                  memory: PeakMemory, record: Any, run_dir: str, calls: int, count: bool,
                  profiler: Callable[[str], Any]) -> None:
    """Time, count and measure every path's save and load; results go to ``record``."""
    for spec in PATHS:
        save, load = engine_paths(engine, run_dir, device)[spec.name]
        saved = None
        with record.guard(f"ckpt:{spec.name}:save_s"), record.phase(f"ckpt_{spec.name}"):
            saved = _one_side(f"{spec.name}:save", lambda: save(model, optim), device, memory, record,
                              calls, count, profiler)
        if load is None or saved is None:
            continue
        with record.guard(f"ckpt:{spec.name}:load_s"), record.phase(f"ckpt_{spec.name}_load"):
            _one_side(f"{spec.name}:load", lambda: load(model, optim, saved), device, memory, record,
                      calls, count, profiler)
        del saved


def _one_side(key: str, call: Callable[[], Any], device: torch.device, memory: PeakMemory, record: Any,
              calls: int, count: bool, profiler: Callable[[str], Any]) -> Any:
    dist.barrier()
    if count:  # untimed first call: counts collectives, warms up whatever is lazy
        with CollectiveCounter() as counter:
            result = call()
        stats = counter.stats.as_dict()
        record.data["comm"][f"ckpt:{key}"] = stats
        record.set(f"ckpt:{key}_collectives", stats["count"])
        record.set(f"ckpt:{key}_comm_mb", stats["traffic_bytes"] / 2**20)
    else:
        result = call()
    times, cpu_times, peaks = [], [], []
    for _ in range(calls):
        del result  # the previous output is freed before the next call, as a user's loop would
        with profiler(key):
            result, elapsed, cpu, peak = _measure(call, device, memory)
        times.append(elapsed)
        cpu_times.append(cpu)
        peaks.append(peak)
    record.set(f"ckpt:{key}_s", statistics.median(times))
    record.set(f"ckpt:{key}_cpu_s", statistics.median(cpu_times))
    record.set(f"ckpt:{key}_peak_mb", statistics.median(peaks))
    record.data.setdefault("ckpt_times_s", {})[key] = times
    return result


def unit_full_mb(model: nn.Module, unit_class: type) -> dict[str, float]:
    """Full parameter MB of the largest unit (a block, or the root's own parameters) and of the
    model: the yardsticks of the memory bound."""
    def size(params: Any) -> float:
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values()) / 2**20

    inner = {id(p) for m in model.modules() if isinstance(m, unit_class) for p in m.parameters()}
    units = [size(m.parameters()) for m in model.modules() if isinstance(m, unit_class)]
    units.append(size(p for p in model.parameters() if id(p) not in inner))
    return {"unit_max_mb": max(units), "model_mb": size(model.parameters())}
