"""Peak memory of one phase of a run: CUDA allocator peak on GPU, process RSS on CPU.

On CPU the peak is the kernel's resident-set high-water mark (``VmHWM`` in
``/proc/self/status``), which writing ``5`` to ``/proc/self/clear_refs`` resets to the current
RSS, so each phase gets its own peak with no sampling thread to perturb the timings. Where that
file cannot be written, ``getrusage``'s ``ru_maxrss`` (a high-water mark since the process
started) is used instead, which is still comparable between engines because every
(engine, configuration) run is a fresh process group.
"""

from __future__ import annotations

import resource

import torch

_MB = 1024 * 1024


def _status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """``reset()`` starts a phase, ``peak_mb()`` is its peak, ``current_mb()`` the level now."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method = "cuda_max_allocated" if device.type == "cuda" else "rss_hwm"
        if self.method == "rss_hwm" and not self._clear_refs():
            self.method = "ru_maxrss"

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            return _status_kb("VmHWM") is not None
        except OSError:
            return False

    def reset(self) -> None:
        if self.method == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.method == "rss_hwm":
            self._clear_refs()

    def current_mb(self) -> float:
        if self.method == "cuda_max_allocated":
            return torch.cuda.memory_allocated(self.device) / _MB
        rss = _status_kb("VmRSS")
        if rss is None:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return rss / 1024

    def peak_mb(self) -> float:
        if self.method == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / _MB
        if self.method == "rss_hwm":
            return (_status_kb("VmHWM") or 0) / 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class AllocatorPeak:
    """Peak of the live bytes of the tensors allocated inside a ``with`` block, from the profiler's allocation
    events (every allocation and free the CPU and CUDA allocators report, in order). Memory allocated before
    the block stays counted as held even where the block frees it: the profiler reports such a free only when
    an earlier profiling session in the process happened to see an allocation at the same address, so counting
    it would make the figure depend on what ran before. On a CPU the nearest to what
    ``max_memory_allocated`` is on a GPU: tensors only, exact and the same on every run, where the RSS also
    holds the interpreter's objects, imported code and freed heap memory not yet returned to the system. It
    also sees what a dispatch-level count misses, such as a storage re-grown by ``resize_``."""

    def __init__(self) -> None:
        self.peak = 0
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> AllocatorPeak:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._profile.__exit__(*exc)
        from torch._C._profiler import _EventType

        events, nodes = [], list(self._profile.profiler.kineto_results.experimental_event_tree())
        while nodes:
            node = nodes.pop()
            nodes.extend(node.children)
            if node.tag == _EventType.Allocation:
                fields = node.extra_fields
                events.append((node.start_time_ns, fields.device.type, fields.ptr, fields.alloc_size))
        live, held = 0, set()  # held: the blocks allocated inside this block and not yet freed
        for _, device_type, pointer, size in sorted(events, key=lambda event: event[0]):
            block = (device_type, pointer)
            if size > 0:
                held.add(block)
            elif block in held:
                held.remove(block)
            else:
                continue  # a free of memory allocated before the block: see the docstring
            live += size
            self.peak = max(self.peak, live)
