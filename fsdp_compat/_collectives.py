"""Object collectives built on tensor collectives.

torch's ``*_object`` collectives turn received CPU tensors back into bytes through numpy, which
fsdp_compat does not depend on; these pickle into a byte tensor and decode without it.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import torch
import torch.distributed as dist


def communication_device(group: Any = None) -> torch.device:
    """Where tensors must live to be sent over ``group`` (its backend's device)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(value: Any, group: Any = None, source_group_rank: int = 0) -> Any:
    """``value`` from the rank ``source_group_rank`` of ``group`` on every rank of ``group``."""
    device = communication_device(group)
    is_source = dist.get_rank(group) == source_group_rank
    payload = _to_bytes(value, device) if is_source else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    source = dist.get_global_rank(group, source_group_rank) if group is not None else source_group_rank
    dist.broadcast(size, src=source, group=group)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=source, group=group)
    return value if is_source else pickle.loads(bytes(payload.cpu().tolist()))


def same_on_all_ranks(value: Any, group: Any = None) -> bool:
    """Whether every rank of ``group`` holds an equal (pickled-identical) ``value``: compares digests."""
    device = communication_device(group)
    digest = torch.tensor(list(hashlib.sha256(pickle.dumps(value)).digest()), dtype=torch.uint8,
                          device=device)
    everyone = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, digest, group=group)
    return all(torch.equal(other, digest) for other in everyone)


def _to_bytes(value: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
