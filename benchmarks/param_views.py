"""The optimizer step plus ``clip_grad_norm_`` over each parameter model, side by side in one run.

Issue 24's cost question: the user's AdamW step and ``clip_grad_norm_`` on the engine's ``DTensor``
parameters against FSDP1's plain local shards. Columns, one process group on 2 ranks (gloo, CPU), the same
model and gradients: ``fsdp1`` (torch FSDP1, ``use_orig_params`` as given), ``dtensor`` (fsdp_compat,
``dtensor_params=True``), ``plain`` (fsdp_compat, ``dtensor_params=False``). CPU time per rank, median of
``--calls``, engines interleaved; ratios against FSDP1. ``stepped``: the tensors the optimizer steps on this
rank (those with a gradient) and their elements.

Issue 30's control, ``fsdp1 sizes`` / ``plain sizes``: the same optimizer stepping standalone tensors (no
wrapper, no views, no hooks of ours) of exactly the sizes ``fsdp1`` / ``plain`` step on this rank, timed in
the same rotation. Where ``plain sizes / fsdp1 sizes`` matches ``plain / fsdp1``, the step's difference is the
layout's (how many tensors each rank holds a piece of), not the views'.

    python benchmarks/param_views.py --models small --calls 21 [--flat] [--foreach | --fused]
    python benchmarks/param_views.py --models small --counts 2,4,8   # tensors stepped per rank, counted
    # --flat: use_orig_params=False; --foreach / --fused: AdamW's implementation (default: torch's choice,
    # the for-loop on CPU)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from fsdp_compat.examples import Block, GPTConfig, TinyGPT  # noqa: E402
from fsdp_compat.testing import run_on_ranks  # noqa: E402

SIZES = {"small": dict(n_layer=6, n_head=8, n_embd=256), "medium": dict(n_layer=8, n_head=8, n_embd=512)}
ENGINES = ("fsdp1", "dtensor", "plain")


def _setup(engine: str, size: str, use_orig_params: bool, optim_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    import fsdp_compat
    from fsdp_compat.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=2053, block_size=64, **SIZES[size]))
    if engine == "fsdp1":
        import torch.distributed.fsdp as torch_fsdp
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

        wrapped = torch_fsdp.FullyShardedDataParallel(model, auto_wrap_policy=TorchPolicy({Block}),
                                                      use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    else:
        wrapped = fsdp_compat.FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                                       use_orig_params=use_orig_params,
                                                       dtensor_params=engine == "dtensor")
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, **optim_kwargs)
    wrapped(torch.randint(0, 2053, (2, 64))).float().sum().backward()
    optim.step()  # state allocated: the timed steps measure steady state
    return wrapped, optim


def _stepped(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optim.param_groups for param in group["params"] if param.grad is not None]


def _local_numel(param: torch.Tensor) -> int:
    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def _same_sizes(optim: torch.optim.Optimizer, optim_kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """An AdamW over standalone tensors of the sizes ``optim`` steps (gradients copied), state allocated."""
    params = []
    for param in _stepped(optim):
        standalone = torch.nn.Parameter(param.detach().clone())  # the plain views' and FSDP1's: plain tensors
        standalone.grad = cast(torch.Tensor, param.grad).detach().clone()
        params.append(standalone)
    same = torch.optim.AdamW(params, lr=1e-3, **optim_kwargs)
    same.step()
    return same


def _measure(size: str, calls: int, use_orig_params: bool,
             optim_kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    setups = {engine: _setup(engine, size, use_orig_params, optim_kwargs) for engine in ENGINES}
    controls = {f"{engine} sizes": _same_sizes(setups[engine][1], optim_kwargs) for engine in ("fsdp1", "plain")}
    names = [*ENGINES, *controls]
    times: dict[str, dict[str, list[float]]] = {name: {"optimizer.step": []} for name in names}
    for engine in ENGINES:
        times[engine]["clip_grad_norm_"] = []
    for call in range(calls):
        order = names[call % len(names):] + names[:call % len(names)]  # rotated: drifting load spreads over all
        for name in order:
            optim = controls[name] if name in controls else setups[name][1]
            dist.barrier()
            start = time.process_time()
            optim.step()
            middle = time.process_time()
            times[name]["optimizer.step"].append(middle - start)
            if name in setups:
                setups[name][0].clip_grad_norm_(1.0)
                times[name]["clip_grad_norm_"].append(time.process_time() - middle)
    medians = {name: {part: statistics.median(values) * 1e3 for part, values in parts.items()}
               for name, parts in times.items()}
    result: dict[str, dict[str, Any]] = {}
    for name, parts in medians.items():
        reference = "fsdp1 sizes" if name in controls else "fsdp1"
        stepped = _stepped(controls[name] if name in controls else setups[name][1])
        result[name] = {**{part: round(ms, 2) for part, ms in parts.items()},
                        **{f"{part} / {reference}": round(ms / medians[reference][part], 2)
                           for part, ms in parts.items()},
                        "stepped": f"{len(stepped)} tensors, {sum(_local_numel(p) for p in stepped)} elements"}
    return result


def _unit_shapes(size: str) -> list[list[torch.Size]]:
    """The parameter shapes of each unit ``ModuleWrapPolicy({Block})`` makes (each block, then the root's
    own), in module order, a tied weight once."""
    model = TinyGPT(GPTConfig(vocab_size=2053, block_size=64, **SIZES[size]))
    blocks = [module for module in model.modules() if isinstance(module, Block)]
    inside = {id(param) for block in blocks for param in block.parameters()}
    return [*([param.shape for param in block.parameters()] for block in blocks),
            [param.shape for param in model.parameters() if id(param) not in inside]]


def _stepped_per_rank(size: str, world: int) -> dict[str, list[int]]:
    """How many parameters each rank holds a non-empty piece of (so steps), counted from the shapes: FSDP1
    splits each unit's concatenation evenly (alignment padding ignored), the engine each parameter's dim 0."""
    fsdp1, engine = [0] * world, [0] * world
    for shapes in _unit_shapes(size):
        numels = [math.prod(shape) for shape in shapes]
        chunk = -(-sum(numels) // world)
        start = 0
        for shape, numel in zip(shapes, numels):
            rows = shape[0] if shape else 1
            for rank in range(world):
                fsdp1[rank] += start < (rank + 1) * chunk and start + numel > rank * chunk
                engine[rank] += rank * -(-rows // world) < rows
            start += numel
    return {"fsdp1": fsdp1, "plain": engine}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small")
    parser.add_argument("--calls", type=int, default=21)
    parser.add_argument("--flat", action="store_true", help="use_orig_params=False (flat parameters)")
    implementation = parser.add_mutually_exclusive_group()
    implementation.add_argument("--foreach", action="store_true", help="AdamW(foreach=True)")
    implementation.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    parser.add_argument("--counts", default="", help="only count the tensors each rank steps at these "
                        "world sizes (comma-separated), from the shapes, without running")
    args = parser.parse_args()
    if args.counts:
        for size in args.models.split(","):
            for world in map(int, args.counts.split(",")):
                counts = _stepped_per_rank(size, world)
                print(f"{size} world {world}: tensors stepped per rank {counts}", flush=True)
        return
    optim_kwargs = {"foreach": True} if args.foreach else {"fused": True} if args.fused else {}
    for size in args.models.split(","):
        results = run_on_ranks(_measure, 2, size, args.calls, not args.flat, optim_kwargs)
        for rank, result in enumerate(results):
            print(f"{size} use_orig_params={not args.flat} AdamW{optim_kwargs or ''} rank {rank} "
                  f"(CPU ms, median of {args.calls}):", flush=True)
            for name, values in result.items():
                print(f"  {name:12s} {values}", flush=True)


if __name__ == "__main__":
    main()
