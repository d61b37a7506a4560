"""One benchmark run on one rank: wrap, train, count collectives, state dicts, DCP.

Each (model, strategy, engine, repeat) is a fresh process group in fresh processes, so peak RSS
and allocator state do not carry over from one engine to the next. Every measurement is guarded:
one that raises is recorded as ``"error: ..."`` and the run goes on. Each rank writes its record
to ``<run_dir>/rank<r>.json``; the parent merges them.
"""

from __future__ import annotations

import contextlib
import cProfile
import ctypes
import datetime
import json
import pstats
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from _checkpoints import measure_paths, unit_full_mb
from _comm import CollectiveCounter
from _comm import CopyCounter
from _engines import (CONFIGS, MODELS, QUICK_MODELS, Engine, ModelSpec, RunContext, build_meta_model,
                      config_model, make_engine, parameter_count)
from fsdp_compat._common import exit_without_finalizing
from fsdp_compat.examples import Block
from _memory import AllocatorPeak, PeakMemory
from fsdp_compat.examples import synthetic_batch

_MB = 1024 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


@dataclass(frozen=True)
class RunSpec:
    """Everything one run needs; pickled to the ranks."""

    model: str
    strategy: str
    engine: str
    repeat: int
    world_size: int
    steps: int
    warmup: int
    hybrid_mesh: tuple[int, int]
    backend: str
    run_dir: str
    quick: bool = False
    timeout_s: float = 300.0
    threads: int = 1
    profile: str = ""  # "", "cprofile" or "torch": profile the timed steps (rank 0)
    fixed_malloc: bool = True  # see _fixed_malloc_threshold
    foreach: bool | None = None  # AdamW(foreach=...): None is torch's default (per-tensor on CPU)
    count_collectives: bool = True  # collectives are deterministic: counted in the first repeat only
    checkpoints: bool = False  # the checkpoint-path suite (_checkpoints) instead of training steps
    checkpoint_calls: int = 3  # timed calls per checkpoint path (median)
    use_orig_params: bool = False  # FSDP1-style engines (FSDP1's default is False)
    config: bool = False  # ``--configs``: ``model`` names one of issue 35's configurations (_engines.CONFIGS)
    scale: str = "cpu"  # --configs: the configuration's model at gpu, cpu or quick scale

    @property
    def model_spec(self) -> ModelSpec:
        if self.config:
            return config_model(self.model, "quick" if self.quick else self.scale)
        return (QUICK_MODELS if self.quick else MODELS)[self.model]


def error_text(error: BaseException) -> str:
    """``error: <Type>: <first line>``, short enough for a table cell."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"error: {type(error).__name__}: {message}"[:160]


class Record:
    """A rank's results: ``metrics`` (numbers, or ``"error: ..."`` strings) and details."""

    def __init__(self, rank: int, spec: RunSpec) -> None:
        self.data: dict[str, Any] = {"rank": rank, "spec": asdict(spec), "metrics": {}, "comm": {},
                                     "tracebacks": {}}

    def set(self, key: str, value: Any) -> None:
        self.data["metrics"][key] = value

    @contextlib.contextmanager
    def guard(self, *keys: str) -> Iterator[None]:
        """Record an exception in the block as the value of ``keys`` instead of raising it."""
        try:
            yield
        except Exception as error:  # the benchmark reports a failed measurement, then goes on
            for key in keys:
                self.data["metrics"][key] = error_text(error)
            self.data["tracebacks"][keys[0]] = traceback.format_exc()[-4000:]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Wall time of a phase of the run (where a run's time goes), in ``phase_wall_s``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.data.setdefault("phase_wall_s", {})[name] = round(time.perf_counter() - start, 3)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.data, indent=1, default=str))


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` between barriers (all ranks start together; the slowest rank sets the time)."""
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    return result, time.perf_counter() - start


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def resident_state_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards)."""
    params = {id(p): p for p in model.parameters()}.values()
    optim_bytes = sum(_local_bytes(v) for state in optim.state.values() for v in state.values()
                      if isinstance(v, torch.Tensor))
    return {
        "param_bytes": sum(_local_bytes(p) for p in params),
        "grad_bytes": sum(_local_bytes(p.grad) for p in params),
        "optim_bytes": optim_bytes,
    }


class Trainer:
    """Training steps on this rank's slice of deterministic synthetic batches."""

    def __init__(self, model: nn.Module, spec: ModelSpec, device: torch.device, rank: int, world_size: int,
                 foreach: bool | None = None, fused: bool | None = None,
                 clip: Callable[[], Any] | None = None) -> None:
        self.model = model
        self.optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach, fused=fused)
        self.clip = clip  # clip_grad_norm_ between backward and step (issue 35's configurations)
        per_rank, config = spec.batch_per_rank, spec.config
        # Built once, outside the timed steps.
        self.batches = []
        for step in range(4):
            tokens, targets = synthetic_batch(step, per_rank * world_size, config, device)
            rows = slice(rank * per_rank, (rank + 1) * per_rank)
            self.batches.append((tokens[rows], targets[rows]))
        self.step_index = 0

    def step(self) -> None:
        tokens, targets = self.batches[self.step_index % len(self.batches)]
        self.step_index += 1
        self.optim.zero_grad(set_to_none=True)
        logits = self.model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        if self.clip is not None:
            self.clip()
        self.optim.step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fixed_malloc_threshold() -> bool:
    """Make glibc return every freed block of 128 KiB or more to the system at once.

    By default glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed,
    after which blocks of that size come from heap arenas and stay resident when freed: the RSS
    peak then depends on the allocation history of the run more than on the tensors the engine
    holds. A fixed threshold makes RSS follow live tensor memory, for every engine alike.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024))


def _setup(rank: int, spec: RunSpec) -> torch.device:
    warnings.filterwarnings("ignore")  # FSDP1 deprecation chatter
    if spec.backend != "nccl" and spec.fixed_malloc:
        _fixed_malloc_threshold()
    torch.set_num_threads(spec.threads)
    # Subnormal floats cost 10-100x on CPUs: whether an engine's weights and gradients drift into them
    # (it depends on the initialisation path: FSDP1's param_init_fn and our meta init did, raw FSDP2's
    # did not) would decide its step time, not the engine. Flushed to zero for every engine alike.
    torch.set_flush_denormal(True)
    if spec.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    store = Path(spec.run_dir) / "store"
    dist.init_process_group(spec.backend, init_method=f"file://{store}", rank=rank,
                            world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=spec.timeout_s))
    return device


def run_rank(rank: int, spec: RunSpec) -> None:
    """Entry point of each rank (``torch.multiprocessing.start_processes``)."""
    device = _setup(rank, spec)
    record = Record(rank, spec)
    try:
        _measure(rank, spec, device, record)
    finally:
        record.write(Path(spec.run_dir) / f"rank{rank}.json")
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    exit_without_finalizing()  # spawned ranks would shut the interpreter down; forked ones already don't


def _measure(rank: int, spec: RunSpec, device: torch.device, record: Record) -> None:
    memory = PeakMemory(device)
    record.data["memory_method"] = memory.method
    engine = make_engine(spec.engine)
    train = CONFIGS[spec.model] if spec.config else None
    ctx = RunContext(spec.strategy, device, spec.world_size, spec.hybrid_mesh,
                     use_orig_params=train.use_orig_params if train is not None else spec.use_orig_params,
                     train=train)
    if spec.strategy == "HYBRID_SHARD" or spec.engine == "fully_shard_ws1":
        ctx.mesh(spec.hybrid_mesh if spec.strategy == "HYBRID_SHARD" else (spec.world_size, 1))
    dist.barrier()
    baseline_mb = memory.current_mb()
    record.set("baseline_rss_mb" if device.type == "cpu" else "baseline_mb", baseline_mb)

    torch.manual_seed(0)
    model = build_meta_model(spec.model_spec)
    record.data["param_count"] = parameter_count(model)
    record.data["sizes_mb"] = unit_full_mb(model, Block)
    memory.reset()
    wrapped = None
    with record.guard("wrap_time_s", "step_time_s"), record.phase("wrap"):
        wrapped, record.data["metrics"]["wrap_time_s"] = _timed(lambda: engine.wrap(model, ctx))
        record.set("wrap_peak_mb", memory.peak_mb() - baseline_mb)
    if wrapped is None:
        return  # nothing to train; the error is recorded
    if spec.checkpoints:
        _checkpoint_suite(spec, engine, wrapped, device, memory, record)
        return
    with record.guard("step_time_s", "step_cpu_s"):
        _train(spec, engine, wrapped, device, memory, baseline_mb, record)


def _checkpoint_suite(spec: RunSpec, engine: Engine, model: nn.Module, device: torch.device,
                      memory: PeakMemory, record: Record) -> None:
    """A few training steps (so the optimizer has state), then every checkpoint path."""
    trainer = Trainer(model, spec.model_spec, device, dist.get_rank(), spec.world_size, spec.foreach)
    with record.phase("warmup"):
        for _ in range(max(1, spec.warmup)):
            trainer.step()
    _sync(device)
    profiles = _PathProfiles(spec.profile if dist.get_rank() == 0 else "", Path(spec.run_dir))
    measure_paths(engine, model, trainer.optim, device, memory, record, spec.run_dir,
                  spec.checkpoint_calls, spec.count_collectives, profiles.around)
    profiles.write()


class _PathProfiles:
    """cProfile of each checkpoint path's timed calls (rank 0), one text file per path."""

    def __init__(self, kind: str, run_dir: Path) -> None:
        self.kind, self.run_dir = kind, run_dir
        self.profiles: dict[str, cProfile.Profile] = {}

    @contextlib.contextmanager
    def around(self, key: str) -> Iterator[None]:
        if self.kind != "cprofile":
            yield
            return
        profile = self.profiles.setdefault(key, cProfile.Profile())
        profile.enable()
        try:
            yield
        finally:
            profile.disable()

    def write(self) -> None:
        for key, profile in self.profiles.items():
            name = key.replace(":", "_")
            profile.dump_stats(str(self.run_dir / f"profile_{name}.pstats"))
            with open(self.run_dir / f"profile_{name}.txt", "w") as out:
                pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(50)
                pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)


def _train(spec: RunSpec, engine: Engine, model: nn.Module, device: torch.device,
           memory: PeakMemory, baseline_mb: float, record: Record) -> None:
    rank = dist.get_rank()
    train = CONFIGS[spec.model] if spec.config else None
    if train is None:
        trainer = Trainer(model, spec.model_spec, device, rank, spec.world_size, spec.foreach)
    else:  # fused AdamW only where the parameters live on the compute device, as the issue ran it
        fused = True if train.fused_adamw and not train.cpu_offload and device.type == "cuda" else None
        trainer = Trainer(model, spec.model_spec, device, rank, spec.world_size, spec.foreach, fused=fused,
                          clip=lambda: engine.clip_grad_norm_(model, 1.0))
    with record.phase("warmup"):
        for _ in range(spec.warmup):
            trainer.step()
    _sync(device)
    dist.barrier()
    memory.reset()
    step_times, cpu_times = [], []
    profiler = _profiler(spec.profile if rank == 0 else "")
    with record.phase("timed_steps"), profiler as active:
        for _ in range(spec.steps):
            start, cpu_start = time.perf_counter(), time.process_time()
            trainer.step()
            _sync(device)
            step_times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    _save_profile(active, spec, record)
    record.data["step_times_s"] = step_times
    record.data["step_cpu_times_s"] = cpu_times
    record.set("step_time_s", statistics.median(step_times))
    record.set("step_cpu_s", statistics.median(cpu_times))
    record.set("peak_mb", memory.peak_mb() - baseline_mb)
    record.set("peak_abs_mb", memory.peak_mb())
    state = resident_state_bytes(model, trainer.optim)
    record.data["state_bytes"] = state
    record.set("state_mb", sum(state.values()) / _MB)

    if spec.count_collectives:
        with record.guard("comm_traffic_mb"), record.phase("count_collectives"):
            dist.barrier()
            with CollectiveCounter() as counter:
                trainer.step()
            record.data["comm"]["train_step"] = counter.stats.as_dict()
            record.set("comm_traffic_mb", counter.stats.as_dict()["traffic_bytes"] / _MB)
            record.set("comm_count", counter.stats.as_dict()["count"])
        if device.type == "cpu":
            with record.guard("step_tensor_peak_mb"), record.phase("tensor_peak"):
                with AllocatorPeak() as tensor_peak:
                    trainer.step()
                record.set("step_tensor_peak_mb", tensor_peak.peak / _MB)
        with record.guard("copies_per_step", "copy_mb_per_step"), record.phase("count_copies"):
            with CopyCounter() as copies:
                trainer.step()
            record.data["copies"] = copies.as_dict()
            record.set("copies_per_step", copies.count)
            record.set("copy_mb_per_step", copies.bytes / _MB)
    if spec.config:
        _full_state_dict_rank0(spec, engine, model, device, memory, record)
        return
    _state_dict_phases(spec, engine, model, trainer.optim, record)


def _full_state_dict_rank0(spec: RunSpec, engine: Engine, model: nn.Module, device: torch.device,
                           memory: PeakMemory, record: Record) -> None:
    """Issue 35's checkpoint figure: a FULL model state dict with ``offload_to_cpu=True, rank0_only=True``
    (torch FSDP1 crashes in that path on a machine without a GPU, so a CPU run passes ``offload_to_cpu=False``,
    also to the other engines; the JSON's ``full_sd_offload`` says which). Median of three calls."""
    offload = device.type == "cuda"
    record.data["full_sd_offload"] = offload
    with record.guard("full_sd_rank0_s", "full_sd_rank0_peak_mb"), record.phase("full_state_dict_rank0"):
        engine.full_state_dict_offloaded(model, offload)  # anything lazy happens here, untimed
        _sync(device)
        memory.reset()
        before = memory.current_mb()
        times = []
        for _ in range(3):
            state, seconds = _timed(lambda: engine.full_state_dict_offloaded(model, offload))
            del state
            times.append(seconds)
        record.set("full_sd_rank0_s", statistics.median(times))
        record.set("full_sd_rank0_peak_mb", memory.peak_mb() - before)


def _state_dict_phases(spec: RunSpec, engine: Engine, model: nn.Module, optim: torch.optim.Optimizer,
                       record: Record) -> None:
    with record.guard("full_sd_time_s"), record.phase("full_state_dict"):
        _, record.data["metrics"]["full_sd_time_s"] = _timed(lambda: engine.full_state_dict(model))
        if spec.count_collectives:
            with CollectiveCounter() as counter:
                engine.full_state_dict(model)
            record.data["comm"]["full_state_dict"] = counter.stats.as_dict()
            record.set("full_sd_collectives", counter.stats.as_dict()["count"])
    _dcp_roundtrip("dcp", spec, record, lambda: {"model": engine.model_state(model)},
                   lambda state: engine.load_model_state(model, state["model"]))
    _dcp_roundtrip(
        "dcp_optim", spec, record,
        lambda: {"model": engine.model_state(model), "optim": engine.optim_state(model, optim)},
        lambda state: (engine.load_model_state(model, state["model"]),
                       engine.load_optim_state(model, optim, state["optim"])),
    )


def _dcp_roundtrip(name: str, spec: RunSpec, record: Record, get_state: Callable[[], dict[str, Any]],
                   apply_state: Callable[[dict[str, Any]], Any]) -> None:
    """Time save (state dict + ``dcp.save``) and load (template + ``dcp.load`` + load into the
    model/optimizer), as a user's checkpoint code does them."""
    import torch.distributed.checkpoint as dcp

    path = str(Path(spec.run_dir) / f"ckpt_{name}")
    with record.guard(f"{name}_save_s", f"{name}_load_s"), record.phase(name):
        _, record.data["metrics"][f"{name}_save_s"] = _timed(
            lambda: dcp.save(get_state(), checkpoint_id=path))

        def load() -> None:
            state = get_state()
            dcp.load(state, checkpoint_id=path)
            apply_state(state)

        _, record.data["metrics"][f"{name}_load_s"] = _timed(load)


@contextlib.contextmanager
def _profiler(kind: str) -> Iterator[Any]:
    if kind == "cprofile":
        profile = cProfile.Profile()
        profile.enable()
        try:
            yield profile
        finally:
            profile.disable()
    elif kind == "torch":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield prof
    else:
        yield None


def _save_profile(profile: Any, spec: RunSpec, record: Record) -> None:
    if profile is None:
        return
    path = Path(spec.run_dir) / "profile.txt"
    if isinstance(profile, cProfile.Profile):
        profile.dump_stats(str(path.with_suffix(".pstats")))  # for pstats / snakeviz
        with open(path, "w") as out:
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(60)
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(40)
    else:
        table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
        path.write_text(table)
        record.data["profile_op_counts"] = {
            event.key: event.count for event in profile.key_averages() if event.count >= spec.steps}
    record.data["profile"] = str(path)
