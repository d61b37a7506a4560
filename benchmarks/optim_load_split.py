"""Split a collective-free FULL optimizer-state load into its two halves, fsdp_compat beside FSDP1.

``benchmarks/README.md`` ("Where fsdp_compat is above 1.00") quotes this: the conversion
(``shard_full_optim_state_dict``) and torch's own ``optimizer.load_state_dict`` of its result, timed
separately in one process group on 2 ranks (gloo), both engines interleaved, CPU time per rank.

    python benchmarks/optim_load_split.py --models small,medium --calls 11
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


def _setup(engine: str, size: str) -> tuple[Any, Any, Any, Any]:
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    import fsdp_compat
    from fsdp_compat.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=2053, block_size=64, **SIZES[size]))
    if engine == "fsdp_compat":
        wrapper = fsdp_compat.FullyShardedDataParallel
        wrapped = wrapper(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
    else:
        wrapper = torch_fsdp.FullyShardedDataParallel
        wrapped = wrapper(model, auto_wrap_policy=TorchPolicy({Block}), use_orig_params=True,
                          device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    wrapped(torch.randint(0, 2053, (2, 64))).float().sum().backward()
    optim.step()
    return wrapper, wrapped, optim, wrapper.full_optim_state_dict(wrapped, optim, rank0_only=False)


def _measure(size: str, calls: int) -> dict[str, dict[str, float]]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    setups = {engine: _setup(engine, size) for engine in ("fsdp_compat", "fsdp1")}
    times: dict[str, dict[str, list[float]]] = {e: {"conversion": [], "optimizer.load_state_dict": []} for e in setups}
    for call in range(calls):
        for engine in (("fsdp_compat", "fsdp1") if call % 2 else ("fsdp1", "fsdp_compat")):
            wrapper, wrapped, optim, full = setups[engine]
            dist.barrier()
            start = time.process_time()
            converted = wrapper.shard_full_optim_state_dict(full, wrapped, optim=optim)
            middle = time.process_time()
            optim.load_state_dict(converted)
            times[engine]["conversion"].append(middle - start)
            times[engine]["optimizer.load_state_dict"].append(time.process_time() - middle)
            del converted
    return {engine: {part: round(statistics.median(values) * 1e3, 2) for part, values in parts.items()}
            for engine, parts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small,medium")
    parser.add_argument("--calls", type=int, default=11)
    args = parser.parse_args()
    for size in args.models.split(","):
        for rank, result in enumerate(run_on_ranks(_measure, 2, size, args.calls)):
            print(f"{size} rank {rank} (CPU ms, median of {args.calls}): {result}", flush=True)


if __name__ == "__main__":
    main()
