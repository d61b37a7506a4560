#!/usr/bin/env python
"""fsdp_compat against torch FSDP1 and raw FSDP2 (``fully_shard``), side by side.

    python benchmarks/bench.py                      # ~5M and ~50M GPT, all strategies, 2 ranks
    python benchmarks/bench.py --quick              # tiny models, one repeat (smoke run)
    python benchmarks/bench.py --models small --strategies FULL_SHARD,NO_SHARD --repeats 5 \\
        --json results.json --plot results.png

Every (model, strategy, engine) runs ``--repeats`` times in a fresh process group (its own
processes, so peak memory is per engine), interleaved: repeat 1 of every configuration, then
repeat 2, with the engine order rotated each repeat, so load drifting on the machine spreads over
all engines. Ranks are launched here with ``torch.multiprocessing`` (gloo on CPU; NCCL with one
GPU per rank when there are enough GPUs). Each run measures: median step time (AdamW, one
forward/backward/step), peak memory over the process's baseline (RSS high-water mark on CPU,
allocator peak on GPU), resident parameter + gradient + optimizer bytes, collectives of one step
by type with their traffic against the theoretical minimum, wrap time of a meta-device model,
FULL state-dict time, and DCP save/load time (model; model + optimizer). A measurement that
raises is reported as ``error: ...`` and the run goes on. The table shows medians over repeats
and the ratios fsdp_compat / FSDP1 and fsdp_compat / raw FSDP2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the helpers beside this file, the package from a checkout

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import _report  # noqa: E402
from _engines import CONFIGS, MODELS, STRATEGIES, fsdp1_available, make_engine  # noqa: E402
from _worker import RunSpec, error_text, run_rank  # noqa: E402

ENGINES = ("fsdp_compat", "fsdp1", "fully_shard", "fully_shard_ws1")
# Engines that only make sense for some strategies: fully_shard on a (world, 1) mesh is the
# alternative way to run NO_SHARD on the engine, measured against its replicate.
_ONLY_FOR = {"fully_shard_ws1": ("NO_SHARD",)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch (default 2)")
    parser.add_argument("--models", default="small,large",
                        help=f"comma list of {', '.join(MODELS)} (default small,large)")
    parser.add_argument("--strategies", default=None,
                        help=f"comma list of {', '.join(STRATEGIES)} (default: all; FULL_SHARD with "
                             "--checkpoints)")
    parser.add_argument("--engines", default=None,
                        help="comma list of fsdp_compat, fsdp1, fully_shard, fully_shard_ws1 (NO_SHARD "
                             "only: fully_shard on a (world, 1) mesh); default: all (the first three "
                             "with --checkpoints)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 3; --quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1; --quick 1)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per configuration (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps: a smoke run")
    parser.add_argument("--hybrid-mesh", default=None,
                        help="R,S (replicate x shard) for HYBRID_SHARD; default (2, ws/2) for an even "
                             "world size of 4 or more, (1, ws) otherwise")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: CPU cores / nproc, at least 1)")
    parser.add_argument("--start-method", choices=("fork", "spawn"), default=None,
                        help="how ranks are started (default: fork on Linux CPU runs, spawn otherwise)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is abandoned")
    parser.add_argument("--json", metavar="PATH", help="write every run, the medians and the ratios as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the comparison (needs matplotlib)")
    parser.add_argument("--foreach", action="store_true",
                        help="AdamW(foreach=True) (torch's default on CPU is the per-tensor loop)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc's adaptive mmap threshold in the ranks (default: a fixed 128 KiB "
                             "threshold, so that RSS follows live tensor memory)")
    parser.add_argument("--profile", choices=("cprofile", "torch"), default=None,
                        help="profile the timed steps on rank 0 of every run")
    parser.add_argument("--profile-dir", default="bench_profiles", help="where profiles go (with --profile)")
    parser.add_argument("--checkpoints", action="store_true",
                        help="time every checkpoint path (save and load) instead of training steps; "
                             "default strategies FULL_SHARD, engines fsdp_compat,fsdp1,fully_shard")
    parser.add_argument("--checkpoint-calls", type=int, default=3,
                        help="timed calls per checkpoint path, after one untimed (default 3)")
    parser.add_argument("--configs", nargs="?", const=",".join(CONFIGS), default=None,
                        help="issue 35's training configurations instead of --models/--strategies: comma list of "
                             f"{', '.join(CONFIGS)} (default all); FULL_SHARD, AdamW, clip_grad_norm_ every step, "
                             "copies per step, a FULL rank0_only state dict (offload_to_cpu on a GPU)")
    parser.add_argument("--scale", choices=("gpu", "cpu"), default=None,
                        help="--configs: the issue's model sizes (gpu; default with NCCL) or the CPU fallback "
                             "(cpu; 5.3M-parameter GPT for every configuration)")
    parser.add_argument("--use-orig-params", choices=("true", "false"), default=None,
                        help="use_orig_params of fsdp_compat and FSDP1 (default: false, FSDP1's default; "
                             "true with --checkpoints, what Lightning and accelerate use)")
    args = parser.parse_args(argv)
    if args.configs is not None and args.checkpoints:
        parser.error("--configs and --checkpoints are separate suites")
    if args.strategies is None:
        args.strategies = "FULL_SHARD" if args.checkpoints or args.configs else ",".join(STRATEGIES)
    if args.engines is None:
        args.engines = ("fsdp_compat,fsdp1,fully_shard" if args.checkpoints or args.configs is not None
                        else ",".join(ENGINES))
    if args.use_orig_params is None:
        args.use_orig_params = "true" if args.checkpoints else "false"
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else 1
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    return args


def _split(text: str, allowed: tuple[str, ...] | list[str], what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise SystemExit(f"--{what}: unknown {unknown or 'empty list'}; choose from {', '.join(allowed)}")
    return items


def hybrid_mesh(world_size: int, text: str | None) -> tuple[int, int]:
    """The (replicate, shard) mesh for HYBRID_SHARD. FSDP1 turns a one-rank shard group into
    NO_SHARD over that group (its gradients are then never averaged across replicas), so the
    default at world size 2 is (1, 2), not (2, 1)."""
    if text:
        replicas, shard = (int(v) for v in text.split(","))
    elif world_size >= 4 and world_size % 2 == 0:
        replicas, shard = 2, world_size // 2
    else:
        replicas, shard = 1, world_size
    if replicas * shard != world_size:
        raise SystemExit(f"--hybrid-mesh {replicas},{shard} does not multiply to --nproc {world_size}")
    return replicas, shard


def choose_backend(requested: str, nproc: int) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"


def plan_runs(args: argparse.Namespace, engines: list[str], backend: str, mesh: tuple[int, int]) -> list[RunSpec]:
    """Repeat-major order, engines rotated each repeat: interleaved repeats."""
    configs = args.configs is not None
    models = _split(args.configs, list(CONFIGS), "configs") if configs else _split(args.models, list(MODELS), "models")
    strategies = _split(args.strategies, list(STRATEGIES), "strategies")
    scale = args.scale or ("gpu" if backend == "nccl" else "cpu")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    runs = []
    for repeat in range(args.repeats):
        shift = repeat % len(engines)
        order = engines[shift:] + engines[:shift]
        for model in models:
            for strategy in strategies:
                for engine in order:
                    if strategy not in _ONLY_FOR.get(engine, (strategy,)):
                        continue
                    runs.append(RunSpec(model=model, strategy=strategy, engine=engine, repeat=repeat,
                                        world_size=args.nproc, steps=args.steps, warmup=args.warmup,
                                        hybrid_mesh=mesh, backend=backend, run_dir="", quick=args.quick,
                                        timeout_s=args.timeout, threads=threads,
                                        profile=args.profile or "",
                                        fixed_malloc=not args.default_malloc,
                                        foreach=True if args.foreach else None,
                                        count_collectives=repeat == 0,
                                        checkpoints=args.checkpoints,
                                        checkpoint_calls=args.checkpoint_calls,
                                        use_orig_params=args.use_orig_params == "true",
                                        config=configs, scale=scale))
    return runs


def start_method(requested: str | None, backend: str) -> str:
    """fork is cheap (torch is already imported) and safe here: this process starts no threads
    or process group. CUDA needs spawn: ranks on GPUs, and also gloo ranks on a machine with
    fewer GPUs than ranks, since this process reads the GPUs' names (CUDA then fails in a fork)."""
    if requested:
        return requested
    forkable = backend != "nccl" and not torch.cuda.is_available() and sys.platform.startswith("linux")
    return "fork" if forkable else "spawn"


def launch(spec: RunSpec, profile_dir: str, method: str) -> dict[str, Any]:
    """Run one configuration on fresh ranks; returns the merged run (never raises)."""
    run_dir = tempfile.mkdtemp(prefix="fsdp_compat_bench_")
    spec = replace(spec, run_dir=run_dir)
    failure = None
    started = time.monotonic()
    context = mp.start_processes(run_rank, args=(spec,), nprocs=spec.world_size, join=False,
                                 start_method=method)
    deadline = time.monotonic() + spec.timeout_s + 60
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                failure = f"timeout after {spec.timeout_s:.0f} s"
                _stop(context.processes)
                break
    except Exception as error:  # a rank died: report it, keep what the others wrote
        failure = error_text(error)
        _stop(context.processes)
    ranks = [json.loads(path.read_text()) for path in sorted(Path(run_dir).glob("rank*.json"))]
    _keep_profile(Path(run_dir), spec, profile_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    run = _report.merge_ranks(_public_spec(spec), ranks, failure)
    run["wall_s"] = round(time.monotonic() - started, 2)
    return run


def _stop(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(10)
        if process.is_alive():
            process.kill()


def _keep_profile(run_dir: Path, spec: RunSpec, profile_dir: str) -> None:
    for source in sorted(run_dir.glob("profile*.txt")) + sorted(run_dir.glob("profile*.pstats")):
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        what = source.stem[len("profile"):]  # "" for training steps, "_<path>_<side>" for checkpoints
        name = f"{spec.model}_{spec.strategy}_{spec.engine}_r{spec.repeat}_{spec.profile}{what}{source.suffix}"
        shutil.copy(source, Path(profile_dir) / name)


def _public_spec(spec: RunSpec) -> dict[str, Any]:
    fields = ("model", "strategy", "engine", "repeat", "world_size", "steps", "warmup", "backend",
              "quick", "threads", "fixed_malloc", "foreach", "checkpoints", "checkpoint_calls",
              "use_orig_params", "config", "scale")
    result = {name: getattr(spec, name) for name in fields}
    result["hybrid_mesh"] = list(spec.hybrid_mesh)
    return result


def machine_info() -> dict[str, Any]:
    memory = ""
    try:
        with open("/proc/meminfo") as meminfo:
            memory = meminfo.readline().split(":", 1)[1].strip()
    except OSError:
        pass
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "memory_total": memory, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = [round(v, 2) for v in os.getloadavg()]
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _progress(index: int, total: int, run: dict[str, Any]) -> str:
    spec, metrics = run["spec"], run["metrics"]
    if spec.get("checkpoints"):
        failed = [key for key, value in metrics.items() if key.startswith("ckpt:") and not _report.is_number(value)]
        text = f"{len(failed)} path(s) failed" if failed else "all paths measured"
        return (f"[{index}/{total}] {spec['model']:5} {spec['strategy']:13} {spec['engine']:15} "
                f"repeat {spec['repeat']}: {run.get('failure') or text} ({run['wall_s']:.1f} s)")
    step = metrics.get("step_time_s")
    step_text = f"{step:.4f} s/step" if _report.is_number(step) else str(step or run.get("failure"))[:80]
    return (f"[{index}/{total}] {spec['model']:5} {spec['strategy']:13} {spec['engine']:15} "
            f"repeat {spec['repeat']}: {step_text} ({run['wall_s']:.1f} s)")


def _models_meta(args: argparse.Namespace, runs: list[RunSpec]) -> dict[str, Any]:
    """Each benchmarked model's sizes (with --configs: each configuration's, and how it trains)."""
    meta: dict[str, Any] = {}
    for spec in runs:
        model = spec.model_spec
        meta[spec.model] = vars(model.config) | {"batch_per_rank": model.batch_per_rank}
        if spec.config:
            meta[spec.model] |= {"train": vars(CONFIGS[spec.model]), "scale": "quick" if spec.quick else spec.scale}
    return meta


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = _split(args.engines, list(ENGINES), "engines")
    if "fsdp1" in engines and not fsdp1_available():
        print("torch FSDP1 is not importable in this torch; its column is left out", flush=True)
        engines.remove("fsdp1")
    for engine in engines:
        make_engine(engine)  # fail now, with the import error, rather than in every run
    backend = choose_backend(args.backend, args.nproc)
    mesh = hybrid_mesh(args.nproc, args.hybrid_mesh)
    runs = plan_runs(args, engines, backend, mesh)
    method = start_method(args.start_method, backend)
    meta = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "world_size": args.nproc, "backend": backend, "hybrid_mesh": list(mesh),
            "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
            "engines": engines, "quick": args.quick, "start_method": method,
            "checkpoints": args.checkpoints, "checkpoint_calls": args.checkpoint_calls,
            "use_orig_params": args.use_orig_params == "true",
            "optimizer": f"AdamW(lr=1e-4, foreach={True if args.foreach else None})",
            "malloc": "glibc default" if args.default_malloc else "fixed 128 KiB mmap threshold",
            **machine_info(),
            "models": _models_meta(args, runs)}
    print(f"{len(runs)} runs: {args.nproc} ranks, {backend}, {args.repeats} repeats of "
          f"{args.warmup}+{args.steps} steps", flush=True)
    started = time.monotonic()
    results = []
    for index, spec in enumerate(runs, 1):
        results.append(launch(spec, args.profile_dir, method))
        print(_progress(index, len(runs), results[-1]), flush=True)
    meta["wall_s"] = round(time.monotonic() - started, 1)
    if hasattr(os, "getloadavg"):
        meta["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]

    labels = {engine: make_engine(engine).label for engine in engines}
    if args.checkpoints:
        return _finish_checkpoints(args, results, engines, labels, meta)
    summary = _report.summarize(results)
    checks = _report.target_checks(summary)
    print(_report.render_table(summary, engines, labels, meta))
    print()
    print(_report.render_targets(checks))
    print(f"\nwall time {meta['wall_s']} s; load average at start {meta.get('loadavg_start')}, "
          f"at end {meta.get('loadavg_end')}")
    if args.json:
        ratios = {model: {strategy: {f"{key}/{reference}": _report.ratio(cell, key, reference)
                                     for key, _, _ in _report.METRICS for reference in _report.REFERENCE_ENGINES}
                          for strategy, cell in strategies.items()}
                  for model, strategies in summary.items()}
        Path(args.json).write_text(json.dumps(
            {"meta": meta, "summary": summary, "ratios": ratios, "targets": checks, "runs": results},
            indent=1, default=str))
        print(f"JSON written to {args.json}")
    if args.plot:
        print(_report.plot(summary, engines, labels, args.plot))
    failed = [run for run in results if run.get("failure")]
    if failed:
        print(f"{len(failed)} run(s) failed; see the JSON 'runs' entries", flush=True)
    return 0


def _finish_checkpoints(args: argparse.Namespace, results: list[dict[str, Any]], engines: list[str],
                        labels: dict[str, str], meta: dict[str, Any]) -> int:
    summary = _report.summarize_checkpoints(results)
    print(_report.render_checkpoints(summary, engines, labels, meta))
    print(f"\nwall time {meta['wall_s']} s; load average at start {meta.get('loadavg_start')}, "
          f"at end {meta.get('loadavg_end')}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"meta": meta, "summary": summary, "ratios": _report.checkpoint_ratios(summary), "runs": results},
            indent=1, default=str))
        print(f"JSON written to {args.json}")
    failed = [run for run in results if run.get("failure")]
    if failed:
        print(f"{len(failed)} run(s) failed; see the JSON 'runs' entries", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
