"""Shared pieces of the integration tests: the switch around a flow, and comparisons.

Each flow runs under ``fsdp_compat.torch_patched()`` (the public switch: torch's FSDP1 names resolve
to fsdp_compat's class) on the rank pool (``fsdp_compat.testing``), 2 ranks on gloo. torch's own FSDP1
cannot run these flows on a CPU-only machine (each test module says why), so the oracles are the
unsharded model and the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compat


def run_flow(flow: Callable[..., Any], *args: Any, ours: bool, **kwargs: Any) -> Any:
    """Run ``flow`` with fsdp_compat switched in (``ours``) or with torch's FSDP1; seeds fixed."""
    torch.manual_seed(0)
    switch = fsdp_compat.torch_patched() if ours else contextlib.nullcontext()
    with switch:
        return flow(*args, **kwargs)


def assert_close(ours: Any, reference: Any, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    """Equal structure, tensors within tolerance (floats compared as tensors)."""
    if reference is None:
        return
    if isinstance(ours, dict):
        assert list(ours) == list(reference), (list(ours), list(reference))
        for key in ours:
            assert_close(ours[key], reference[key], atol, rtol)
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(reference)
        for a, b in zip(ours, reference):
            assert_close(a, b, atol, rtol)
    elif isinstance(ours, (torch.Tensor, float)):
        torch.testing.assert_close(torch.as_tensor(ours).float(), torch.as_tensor(reference).float(),
                                   atol=atol, rtol=rtol)
    else:
        assert ours == reference


@contextlib.contextmanager
def shared_tmpdir() -> Iterator[str]:
    """One temporary directory for all ranks (rank 0 creates it and tells the others)."""
    holder = [tempfile.mkdtemp(prefix="fsdp_compat_it_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    try:
        yield holder[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            import shutil
            shutil.rmtree(holder[0], ignore_errors=True)


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's full state on every rank, through the FSDP1 API of whichever class
    wrapped it (torch's names resolve to ours under the switch)."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=False)):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def small_model() -> nn.Module:
    """The flows' model: a few ``nn.Linear`` units, the same on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def rank_batches(n: int, rank: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (input, target) batches of ``rank`` (default: this rank), the same in every run."""
    g = torch.Generator().manual_seed(1 + (dist.get_rank() if rank is None else rank))
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def unsharded_reference(n: int, accumulate: int, loss_divisor: float = 1.0
                        ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsharded model trained on both ranks' batches (AdamW, clipping at 0.5, ``accumulate``
    micro-batches a step): this rank's losses as the flow logs them (divided by ``loss_divisor``)
    and the final state."""
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mine, other = rank_batches(n), rank_batches(n, 1 - dist.get_rank())
    losses = []
    for i, ((x, y), (x2, y2)) in enumerate(zip(mine, other)):
        with torch.no_grad():
            losses.append(nn.functional.mse_loss(model(x), y).item() / loss_divisor)
        (nn.functional.mse_loss(model(torch.cat([x, x2])), torch.cat([y, y2])) / accumulate).backward()
        if (i + 1) % accumulate == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    return losses, model.state_dict()
