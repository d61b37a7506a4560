"""The optimizer step plus ``clip_grad_norm_`` over each parameter model, side by side in one run.

Issue 24's cost question: the user's AdamW step and ``clip_grad_norm_`` on the engine's ``DTensor``
parameters against FSDP1's plain local shards. Columns, one process group on 2 ranks (gloo, CPU), the same
model and gradients: ``fsdp1`` (torch FSDP1, ``use_orig_params`` as given), ``dtensor`` (fsdp_compat,
``dtensor_params=True``), ``plain`` (fsdp_compat, ``dtensor_params=False``). CPU time per rank, median of
``--calls``, engines interleaved; ratios against FSDP1.

    python benchmarks/param_views.py --models small --calls 21 [--flat]   # --flat: use_orig_params=False
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_compat.examples import Block, GPTConfig, TinyGPT  # noqa: E402
from fsdp_compat.testing import run_on_ranks  # noqa: E402

SIZES = {"small": dict(n_layer=6, n_head=8, n_embd=256), "medium": dict(n_layer=8, n_head=8, n_embd=512)}
ENGINES = ("fsdp1", "dtensor", "plain")


def _setup(engine: str, size: str, use_orig_params: bool) -> tuple[Any, Any]:
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    import fsdp_compat
    from fsdp_compat.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=2053, block_size=64, **SIZES[size]))
    if engine == "fsdp1":
        wrapped = torch_fsdp.FullyShardedDataParallel(model, auto_wrap_policy=TorchPolicy({Block}),
                                                      use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    else:
        wrapped = fsdp_compat.FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                                       use_orig_params=use_orig_params,
                                                       dtensor_params=engine == "dtensor")
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    wrapped(torch.randint(0, 2053, (2, 64))).float().sum().backward()
    optim.step()  # state allocated: the timed steps measure steady state
    return wrapped, optim


def _measure(size: str, calls: int, use_orig_params: bool) -> dict[str, dict[str, float]]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    setups = {engine: _setup(engine, size, use_orig_params) for engine in ENGINES}
    times: dict[str, dict[str, list[float]]] = {e: {"optimizer.step": [], "clip_grad_norm_": []} for e in setups}
    for call in range(calls):
        order = ENGINES[call % 3:] + ENGINES[:call % 3]  # rotated: drifting load spreads over all engines
        for engine in order:
            wrapped, optim = setups[engine]
            dist.barrier()
            start = time.process_time()
            optim.step()
            middle = time.process_time()
            wrapped.clip_grad_norm_(1.0)
            times[engine]["optimizer.step"].append(middle - start)
            times[engine]["clip_grad_norm_"].append(time.process_time() - middle)
    medians = {engine: {part: statistics.median(values) * 1e3 for part, values in parts.items()}
               for engine, parts in times.items()}
    return {engine: {**{part: round(ms, 2) for part, ms in parts.items()},
                     **{f"{part} / fsdp1": round(ms / medians["fsdp1"][part], 2) for part, ms in parts.items()}}
            for engine, parts in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small")
    parser.add_argument("--calls", type=int, default=21)
    parser.add_argument("--flat", action="store_true", help="use_orig_params=False (flat parameters)")
    args = parser.parse_args()
    for size in args.models.split(","):
        results = run_on_ranks(_measure, 2, size, args.calls, not args.flat)
        for rank, result in enumerate(results):
            print(f"{size} use_orig_params={not args.flat} rank {rank} (CPU ms, median of {args.calls}):", flush=True)
            for engine, values in result.items():
                print(f"  {engine:8s} {values}", flush=True)


if __name__ == "__main__":
    main()
