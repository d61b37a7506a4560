"""Counting collectives by type, with their sizes, and the theoretical minimum traffic.

The counter is a ``TorchDispatchMode``: every collective, whichever API issued it, reaches the
dispatcher as a ``c10d`` op (``torch.distributed.*`` and the ``ProcessGroup`` methods FSDP1 and
the FSDP2 engine call: ``allgather_`` / ``_allgather_base_`` / ``_reduce_scatter_base_`` /
``allreduce_``...) or as a ``_c10d_functional`` op (DTensor's ``full_tensor`` and
redistributions, used by FSDP2 state dicts). Patching ``dist.all_gather_into_tensor`` and friends
would miss the second family, and FSDP2 no longer calls the first names at all (it calls
``dist.all_gather_single`` / ``dist.reduce_scatter_single``). A Python callback runs on every op
while the mode is active, so it is used only on untimed passes.

Sizes: ``payload`` is the size of the full (unsharded) tensor the collective moves: the output of
an all-gather, the input of a reduce-scatter, the tensor of an all-reduce or broadcast.
``traffic`` is what one rank sends on a ring algorithm over a group of ``n`` ranks: ``(n-1)/n``
of the payload for all-gather, reduce-scatter, broadcast and scatter, ``2 (n-1)/n`` for
all-reduce. A one-rank group costs nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_NAMESPACES = ("c10d", "_c10d_functional")
# Bookkeeping ops of the functional family that move no data.
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")
# Op-name fragment -> collective type, checked in order (reduce_scatter before scatter/reduce).
_TYPES = (
    ("reduce_scatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("broadcast", "broadcast"),
    ("alltoall", "all_to_all"),
    ("all_to_all", "all_to_all"),
    ("scatter", "scatter"),
    ("gather", "gather"),
    ("barrier", "barrier"),
    ("send", "send_recv"),
    ("recv", "send_recv"),
    ("reduce", "reduce"),
)
_TRAFFIC_FACTOR = {"all_reduce": 2.0}


def collective_type(op_name: str) -> str | None:
    """The collective type of a ``c10d`` / ``_c10d_functional`` op name, or ``None``."""
    if any(skip in op_name for skip in _NOT_COLLECTIVES):
        return None
    for fragment, kind in _TYPES:
        if fragment in op_name:
            return kind
    return "other"


def _tensor_bytes(value: Any) -> int:
    leaves, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _group_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The size of the group an op runs on: from its ProcessGroup object or its group name."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(value).size()
            except Exception:  # a ReduceOp or other script object: keep looking
                continue
    for value in (*args, *kwargs.values()):
        if isinstance(value, str):
            try:
                return dist.distributed_c10d._resolve_process_group(value).size()
            except Exception:  # a reduce-op name such as "sum"
                continue
    return dist.get_world_size()


@dataclass
class CollectiveStats:
    """Per collective type: number of calls, payload bytes and per-rank traffic bytes."""

    count: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    payload_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    traffic_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, kind: str, payload: int, group_size: int) -> None:
        self.count[kind] += 1
        self.payload_bytes[kind] += payload
        share = (group_size - 1) / group_size if group_size > 1 else 0.0
        self.traffic_bytes[kind] += _TRAFFIC_FACTOR.get(kind, 1.0) * share * payload

    def as_dict(self) -> dict[str, Any]:
        return {
            "by_type": {kind: {"count": self.count[kind], "payload_bytes": self.payload_bytes[kind],
                               "traffic_bytes": round(self.traffic_bytes[kind])}
                        for kind in sorted(self.count)},
            "count": sum(self.count.values()),
            "payload_bytes": sum(self.payload_bytes.values()),
            "traffic_bytes": round(sum(self.traffic_bytes.values())),
        }


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives issued while active (``with CollectiveCounter() as counter:``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = CollectiveStats()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in _NAMESPACES:
            kind = collective_type(func.__name__)
            if kind is not None:
                # The full tensor is the largest side: the output of an all-gather, the input
                # of a reduce-scatter, either side of an all-reduce.
                payload = max([_tensor_bytes(a) for a in args] + [_tensor_bytes(out)])
                self.stats.add(kind, payload, _group_size(args, kwargs))
        return out


def theoretical_min_traffic(strategy: str, param_bytes: int, world_size: int,
                            hybrid_mesh: tuple[int, int] | None = None) -> float:
    """Per-rank bytes one training step must move, on ring collectives.

    FULL_SHARD: all-gather in forward and again in backward, reduce-scatter of the gradients:
    ``3 P (n-1)/n``. SHARD_GRAD_OP: one all-gather and a reduce-scatter: ``2 P (n-1)/n``.
    NO_SHARD: one all-reduce: ``2 P (n-1)/n``. HYBRID_SHARD on an (R, S) mesh: FULL_SHARD within
    the S ranks of a shard group plus an all-reduce of each rank's ``P / S`` shard across the R
    replicas: ``3 P (S-1)/S + 2 (P/S) (R-1)/R``.
    """
    def share(n: int) -> float:
        return (n - 1) / n if n > 1 else 0.0

    if strategy == "FULL_SHARD":
        return 3 * param_bytes * share(world_size)
    if strategy in ("SHARD_GRAD_OP", "NO_SHARD"):
        return 2 * param_bytes * share(world_size)
    if strategy == "HYBRID_SHARD":
        replicas, shard = hybrid_mesh or (1, world_size)
        return 3 * param_bytes * share(shard) + 2 * (param_bytes / shard) * share(replicas)
    raise ValueError(f"no theoretical minimum for {strategy}")


# Ops that copy tensor data without computing anything new: dtype casts, device copies, gathers' copy-in and
# copy-out, gradient packing. ``copy_`` of a tensor onto itself moves nothing and is not counted.
_COPY_OPS = ("copy_", "_to_copy", "clone", "cat", "chunk_cat", "split_with_sizes_copy", "_foreach_copy_",
             "index_select")


class CopyCounter(TorchDispatchMode):
    """Data-moving ops of one step by name, with the bytes they write (a CPU proxy for the passes over
    parameters and gradients an engine makes: casts, unshard copies, gradient copy-in)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _COPY_OPS and not (name == "copy_" and args[0] is args[1]):
            written = kwargs.get("out") if kwargs and "out" in kwargs else out
            if written is None:  # an in-place foreach op (``_foreach_copy_``) returns nothing: it writes its first list
                written = args[0]
            leaves, _ = tree_flatten(written)
            entry = self.by_op[name]
            entry[0] += 1
            entry[1] += sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        return out

    @property
    def count(self) -> int:
        return sum(entry[0] for entry in self.by_op.values())

    @property
    def bytes(self) -> int:
        return sum(entry[1] for entry in self.by_op.values())

    def as_dict(self) -> dict[str, Any]:
        return {name: {"count": entry[0], "bytes": entry[1]} for name, entry in sorted(self.by_op.items())}
