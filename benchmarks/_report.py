"""Merging rank records into runs, runs into medians, and medians into a table, JSON and a plot."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from _comm import theoretical_min_traffic

_MB = 1024 * 1024
REFERENCE_ENGINES = ("fsdp1", "fully_shard")  # ratio denominators, in column order
SUBJECT_ENGINE = "fsdp_compat"

# (metric key, row label, format). Lower is better for all of them.
METRICS = (
    ("step_time_s", "step time (s, median)", "{:.4f}"),
    ("step_cpu_s", "step CPU time (s, median)", "{:.4f}"),
    ("peak_mb", "peak memory over baseline (MB/rank)", "{:.1f}"),
    ("step_tensor_peak_mb", "  tensors made in the step, peak (CPU)", "{:.2f}"),
    ("state_mb", "params+grads+optim state (MB/rank)", "{:.2f}"),
    ("comm_count", "collectives per step", "{:.0f}"),
    ("comm_by_type", "  by type", "{}"),
    ("comm_traffic_mb", "comm traffic per step (MB/rank)", "{:.2f}"),
    ("comm_vs_min", "  / theoretical minimum", "{:.3f}"),
    ("copies_per_step", "data copies per step (casts, copy-in/out)", "{:.0f}"),
    ("copy_mb_per_step", "  MB they write", "{:.1f}"),
    ("full_sd_rank0_s", "FULL state dict, rank0_only (+offload on GPU) (s)", "{:.4f}"),
    ("full_sd_rank0_peak_mb", "  its peak (MB)", "{:.1f}"),
    ("wrap_time_s", "wrap time, meta-device model (s)", "{:.3f}"),
    ("wrap_peak_mb", "wrap peak memory (MB/rank)", "{:.1f}"),
    ("full_sd_time_s", "FULL state dict (s)", "{:.3f}"),
    ("full_sd_collectives", "  collectives", "{:.0f}"),
    ("dcp_save_s", "DCP save, model (s)", "{:.3f}"),
    ("dcp_load_s", "DCP load, model (s)", "{:.3f}"),
    ("dcp_optim_save_s", "DCP save, model+optim (s)", "{:.3f}"),
    ("dcp_optim_load_s", "DCP load, model+optim (s)", "{:.3f}"),
)
# Targets of the issue: (metric, reference engine, maximum ratio of fsdp_compat to it).
TARGETS = (
    ("step_time_s", "fully_shard", 1.02),
    ("step_time_s", "fsdp1", 1.00),
    ("step_cpu_s", "fully_shard", 1.02),
    ("step_cpu_s", "fsdp1", 1.00),
    ("peak_mb", "fsdp1", 1.00),
    ("step_tensor_peak_mb", "fsdp1", 1.00),
    ("full_sd_rank0_s", "fsdp1", 1.00),
    ("comm_vs_min", None, 1.01),
)
_ABBREVIATIONS = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------
# Ranks -> run
# ---------------------------------------------------------------------------------------------


def merge_ranks(spec: dict[str, Any], ranks: list[dict[str, Any]], failure: str | None) -> dict[str, Any]:
    """One run's result: the slowest rank's times, the largest rank's memory, rank 0's counts."""
    run: dict[str, Any] = {"spec": spec, "metrics": {}, "per_rank": {}, "comm": {}, "errors": {}}
    if not ranks:
        run["failure"] = failure or "no rank wrote a result"
        return run
    keys = sorted({key for record in ranks for key in record["metrics"]})
    for key in keys:
        values = [record["metrics"].get(key, "error: missing on a rank") for record in ranks]
        errors = [v for v in values if not is_number(v)]
        run["per_rank"][key] = values
        run["metrics"][key] = errors[0] if errors else max(values)
    step_lists = [record.get("step_times_s") for record in ranks]
    if all(step_lists):
        per_step_max = [max(times) for times in zip(*step_lists)]
        run["metrics"]["step_time_s"] = statistics.median(per_step_max)
        run["step_times_s"] = per_step_max
    first = min(ranks, key=lambda record: record["rank"])
    run["comm"] = first.get("comm", {})
    run["param_count"] = first.get("param_count")
    run["sizes_mb"] = first.get("sizes_mb")
    run["state_bytes"] = first.get("state_bytes")
    run["memory_method"] = first.get("memory_method")
    run["phase_wall_s"] = first.get("phase_wall_s", {})
    run["tracebacks"] = {k: v for record in ranks for k, v in record.get("tracebacks", {}).items()}
    if "profile" in first:
        run["profile"] = first["profile"]
    if failure:
        run["failure"] = failure
    _add_derived(run)
    return run


def _add_derived(run: dict[str, Any]) -> None:
    spec, metrics = run["spec"], run["metrics"]
    step_comm = run["comm"].get("train_step")
    if step_comm:
        metrics["comm_by_type"] = " ".join(
            f"{_ABBREVIATIONS.get(kind, kind)}{entry['count']}" for kind, entry in step_comm["by_type"].items())
    if is_number(metrics.get("comm_traffic_mb")) and run.get("param_count"):
        minimum = theoretical_min_traffic(spec["strategy"], run["param_count"] * 4, spec["world_size"],
                                          tuple(spec["hybrid_mesh"]))
        run["theoretical_min_mb"] = minimum / _MB
        metrics["comm_vs_min"] = (metrics["comm_traffic_mb"] / (minimum / _MB)) if minimum else 0.0


# ---------------------------------------------------------------------------------------------
# Runs -> medians over repeats
# ---------------------------------------------------------------------------------------------


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """``summary[model][strategy][engine][metric]``: the median over repeats (or an error)."""
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        spec = run["spec"]
        grouped[(spec["model"], spec["strategy"], spec["engine"])].append(run)
    summary: dict[str, dict[str, dict[str, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for (model, strategy, engine), group in grouped.items():
        cell: dict[str, Any] = {}
        for key, _, _ in METRICS:
            values = [run["metrics"].get(key) for run in group]
            numbers = [v for v in values if is_number(v)]
            if numbers:
                cell[key] = statistics.median(numbers)
            else:
                texts = [v for v in values if isinstance(v, str)]
                failures = [run["failure"] for run in group if run.get("failure")]
                cell[key] = (texts[0] if texts else
                             f"error: {failures[0]}"[:160] if failures else None)
        cell["repeats"] = len(group)
        cell["param_count"] = next((run.get("param_count") for run in group if run.get("param_count")), None)
        summary[model][strategy][engine] = cell
    return {model: dict(strategies) for model, strategies in summary.items()}


def ratio(summary_cell: dict[str, dict[str, Any]], key: str, reference: str) -> float | None:
    subject = summary_cell.get(SUBJECT_ENGINE, {}).get(key)
    base = summary_cell.get(reference, {}).get(key)
    if is_number(subject) and is_number(base) and base:
        return subject / base
    return None


def target_checks(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue for each (model, strategy): the ratio and whether it is met."""
    checks = []
    for model, strategies in summary.items():
        for strategy, cell in strategies.items():
            for key, reference, limit in TARGETS:
                value = (cell.get(SUBJECT_ENGINE, {}).get(key) if reference is None
                         else ratio(cell, key, reference))
                if not is_number(value):
                    continue
                checks.append({"model": model, "strategy": strategy, "metric": key,
                               "against": reference or "theoretical minimum", "ratio": round(value, 4),
                               "target": limit, "met": value <= limit})
    return checks


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _cell_text(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if is_number(value):
        return fmt.format(value)
    return str(value)


def render_table(summary: dict[str, Any], engines: list[str], labels: dict[str, str], meta: dict[str, Any]) -> str:
    """The comparison as fixed-width text: one block per (model, strategy)."""
    references = [e for e in REFERENCE_ENGINES if e in engines and e != SUBJECT_ENGINE]
    ratio_headers = [f"compat/{'FSDP1' if e == 'fsdp1' else 'raw'}" for e in references]
    headers = ["metric", *[labels[e] for e in engines], *ratio_headers]
    lines = []
    for model, strategies in summary.items():
        params = next((c.get("param_count") for s in strategies.values() for c in s.values()
                       if c.get("param_count")), None)
        size = f"{params / 1e6:.2f}M parameters" if params else "size unknown"
        lines.append(f"\n== model {model} ({size}), world size {meta['world_size']}, "
                     f"{meta['backend']}, medians of {meta['repeats']} repeats ==")
        for strategy, cell in strategies.items():
            title = strategy
            if strategy == "HYBRID_SHARD":
                title += f" (mesh replicate x shard = {meta['hybrid_mesh'][0]} x {meta['hybrid_mesh'][1]})"
            if strategy == "NO_SHARD" and "fully_shard" in engines:
                title += " (raw fully_shard column = the engine's replicate)"
            rows = [headers]
            for key, label, fmt in METRICS:
                row = [label] + [_cell_text(cell.get(engine, {}).get(key), fmt) for engine in engines]
                for reference in references:
                    value = ratio(cell, key, reference) if key != "comm_by_type" else None
                    row.append(f"{value:.3f}" if value is not None else "")
                rows.append(row)
            lines.append(f"-- {title}")
            lines.extend(_format_rows(rows))
    return "\n".join(lines)


def _format_rows(rows: list[list[str]]) -> list[str]:
    limit = 44  # long error cells are cut in the table; the JSON has them whole
    rows = [[text if len(text) <= limit else text[:limit - 1] + "~" for text in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(text.ljust(widths[i]) if i == 0 else text.rjust(widths[i])
                      for i, text in enumerate(row)) for row in rows]


def render_targets(checks: list[dict[str, Any]]) -> str:
    if not checks:
        return "targets: nothing to check (missing measurements)"
    lines = ["targets (fsdp_compat; reported, not asserted):"]
    for check in checks:
        against = check["against"]
        lines.append(f"  {check['model']:6} {check['strategy']:14} {check['metric']:15} vs {against:20} "
                     f"{check['ratio']:.3f} (target <= {check['target']:.2f}) "
                     f"{'met' if check['met'] else 'MISSED'}")
    return "\n".join(lines)


_PLOTTED = (
    ("step_time_s", "step time"),
    ("step_cpu_s", "step CPU time"),
    ("peak_mb", "peak memory"),
    ("state_mb", "param+grad+optim"),
    ("comm_traffic_mb", "comm traffic / step"),
    ("wrap_time_s", "wrap time (meta)"),
    ("full_sd_time_s", "FULL state dict"),
    ("dcp_save_s", "DCP save (model)"),
    ("dcp_load_s", "DCP load (model)"),
)


def plot(summary: dict[str, Any], engines: list[str], labels: dict[str, str], path: str) -> str:
    """Bar charts of each metric relative to torch FSDP1 (or raw FSDP2 without it); returns a note.

    matplotlib is an optional extra (``pip install fsdp_compat[plot]``), imported only here.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot {path}: skipped, matplotlib is not installed (pip install matplotlib)"
    reference = next((e for e in ("fsdp1", "fully_shard") if e in engines), engines[0])
    groups = [(model, strategy) for model, strategies in summary.items() for strategy in strategies]
    figure, axes = plt.subplots(len(_PLOTTED), 1, figsize=(max(8, 1.6 * len(groups)), 2.6 * len(_PLOTTED)),
                                squeeze=False)
    width = 0.8 / len(engines)
    for axis, (key, title) in zip(axes[:, 0], _PLOTTED):
        for index, engine in enumerate(engines):
            heights = []
            for model, strategy in groups:
                cell = summary[model][strategy]
                value, base = cell.get(engine, {}).get(key), cell.get(reference, {}).get(key)
                heights.append(value / base if is_number(value) and is_number(base) and base else 0.0)
            positions = [g + (index - (len(engines) - 1) / 2) * width for g in range(len(groups))]
            axis.bar(positions, heights, width, label=labels[engine])
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(f"{title} (relative to {labels[reference]}; 0 = not measured)", fontsize=9)
        axis.set_xticks(range(len(groups)))
        axis.set_xticklabels([f"{m}\n{s}" for m, s in groups], fontsize=7)
    axes[0, 0].legend(fontsize=7, ncol=len(engines))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot written to {path}"


# ---------------------------------------------------------------------------------------------
# Checkpoint paths (--checkpoints)
# ---------------------------------------------------------------------------------------------

_CKPT = "ckpt:"


def _checkpoint_sides(runs_or_cells: list[dict[str, Any]]) -> list[str]:
    """``<path>:save`` / ``<path>:load`` in the order the runs measured them."""
    from _checkpoints import PATHS

    sides = []
    for spec in PATHS:
        for side in ("save", "load"):
            key = f"{spec.name}:{side}"
            if any(f"{_CKPT}{key}_s" in cell for cell in runs_or_cells):
                sides.append(key)
    return sides


def summarize_checkpoints(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary[model][strategy][engine]``: per path side, the median over repeats of its time,
    peak and collectives (or the error text); plus the unit and model sizes."""
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        spec = run["spec"]
        grouped[(spec["model"], spec["strategy"], spec["engine"])].append(run)
    summary: dict[str, Any] = defaultdict(lambda: defaultdict(dict))
    for (model, strategy, engine), group in grouped.items():
        keys = sorted({key for run in group for key in run["metrics"] if key.startswith(_CKPT)})
        cell: dict[str, Any] = {}
        for key in keys:
            values = [run["metrics"].get(key) for run in group]
            numbers = [v for v in values if is_number(v)]
            texts = [v for v in values if isinstance(v, str)]
            cell[key] = statistics.median(numbers) if numbers else (texts[0] if texts else None)
        cell["repeats"] = len(group)
        cell["param_count"] = next((r.get("param_count") for r in group if r.get("param_count")), None)
        cell["sizes_mb"] = next((r.get("sizes_mb") for r in group if r.get("sizes_mb")), None)
        failures = [run["failure"] for run in group if run.get("failure")]
        if failures:
            cell["failure"] = failures[0]
        summary[model][strategy][engine] = cell
    return {model: dict(strategies) for model, strategies in summary.items()}


def _side_error(cell: dict[str, Any], side: str) -> str | None:
    """The error of a side: its own, or its path's save error (a load needs what save made)."""
    value = cell.get(f"{_CKPT}{side}_s")
    if isinstance(value, str):
        return value
    name = side.split(":")[0]
    for key in (f"{_CKPT}{name}:save_s", f"{_CKPT}{name}:load_s"):
        if isinstance(cell.get(key), str):
            return cell[key]
    return None


def checkpoint_reference(cell: dict[str, Any], side: str) -> str | None:
    """The engine fsdp_compat is held to on a path: FSDP1 where it ran, raw fully_shard otherwise."""
    for engine in REFERENCE_ENGINES:
        if is_number(cell.get(engine, {}).get(f"{_CKPT}{side}_s")):
            return engine
    return None


def checkpoint_ratios(summary: dict[str, Any]) -> dict[str, Any]:
    """``ratios[model][strategy][side]``: fsdp_compat's time over its reference's, and which."""
    result: dict[str, Any] = {}
    for model, strategies in summary.items():
        for strategy, cell in strategies.items():
            sides = _checkpoint_sides(list(cell.values()))
            for side in sides:
                reference = checkpoint_reference(cell, side)
                result.setdefault(model, {}).setdefault(strategy, {})[side] = {
                    "against": reference,
                    "ratio": ratio(cell, f"{_CKPT}{side}_s", reference) if reference else None,
                    "cpu_ratio": ratio(cell, f"{_CKPT}{side}_cpu_s", reference) if reference else None,
                    "ratio_vs_raw": ratio(cell, f"{_CKPT}{side}_s", "fully_shard"),
                    "cpu_ratio_vs_raw": ratio(cell, f"{_CKPT}{side}_cpu_s", "fully_shard")}
    return result


def render_checkpoints(summary: dict[str, Any], engines: list[str], labels: dict[str, str],
                       meta: dict[str, Any]) -> str:
    """One table per (model, strategy): each path side's time, collectives and peak per engine,
    and fsdp_compat's time ratio against FSDP1 (raw fully_shard where FSDP1 cannot run: ``*``)."""
    short = {"fsdp_compat": "compat", "fsdp1": "FSDP1", "fully_shard": "raw", "fully_shard_ws1": "raw1"}
    lines = []
    ratios = checkpoint_ratios(summary)
    for model, strategies in summary.items():
        for strategy, cell in strategies.items():
            sizes = next((c.get("sizes_mb") for c in cell.values() if c.get("sizes_mb")), None) or {}
            params = next((c.get("param_count") for c in cell.values() if c.get("param_count")), None)
            lines.append(f"\n== checkpoints: model {model} ({(params or 0) / 1e6:.2f}M parameters, "
                         f"largest unit {sizes.get('unit_max_mb', 0):.1f} MB full), {strategy}, "
                         f"world size {meta['world_size']}, {meta['backend']}, medians of "
                         f"{meta['repeats']} runs x {meta.get('checkpoint_calls', '?')} calls ==")
            names = [short.get(e, e) for e in engines]
            rows = [["path", *[f"s {n}" for n in names], "ratio", *[f"cpu {n}" for n in names], "cpu ratio",
                     *[f"coll {n}" for n in names], *[f"peak MB {n}" for n in names]]]
            for side in _checkpoint_sides(list(cell.values())):
                times, cpu_times, counts, peaks = [], [], [], []
                for engine in engines:
                    engine_cell = cell.get(engine, {})
                    error = _side_error(engine_cell, side)
                    times.append("error" if error else _cell_text(engine_cell.get(f"{_CKPT}{side}_s"), "{:.4f}"))
                    cpu_times.append("error" if error else
                                     _cell_text(engine_cell.get(f"{_CKPT}{side}_cpu_s"), "{:.4f}"))
                    counts.append(_cell_text(engine_cell.get(f"{_CKPT}{side}_collectives"), "{:.0f}"))
                    peaks.append(_cell_text(engine_cell.get(f"{_CKPT}{side}_peak_mb"), "{:.1f}"))
                entry = ratios.get(model, {}).get(strategy, {}).get(side, {})
                mark = "*" if entry.get("against") == "fully_shard" else ""
                wall, cpu = entry.get("ratio"), entry.get("cpu_ratio")
                rows.append([side, *times, "" if wall is None else f"{wall:.2f}{mark}", *cpu_times,
                             "" if cpu is None else f"{cpu:.2f}{mark}", *counts, *peaks])
            lines.append(f"-- {strategy}")
            lines.extend(_format_rows(rows))
            errors = {(engine, side): _side_error(cell.get(engine, {}), side)
                      for engine in engines for side in _checkpoint_sides(list(cell.values()))}
            for (engine, side), error in errors.items():
                if error and side.endswith(":save") or (error and not errors.get((engine, side.split(":")[0] + ":save"))):
                    lines.append(f"   {short.get(engine, engine)} {side}: {error}")
    lines.append("\nratio = fsdp_compat / torch FSDP1 (* = / raw fully_shard, where FSDP1 cannot run the path); "
                 "s = wall time of the slowest rank, cpu = the largest rank's own CPU time")
    return "\n".join(lines)
