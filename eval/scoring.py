"""Turn a worker's raw timings into result and shape rows: speedups, roofline, geomeans (no torch).

This runs in the trusted parent. The worker reports only times and verdicts; every derived
number on the site is computed here, from the times, the cached baselines and the hardware table.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from .deck import Problem
from .hardware import GpuSpec
from .roofline import geomean, roofline, speedup
from .settings import HEADLINE_COMPILE_VARIANTS, PEAK_FRACTION_LIMIT


def best_compile(baselines: Mapping[str, Mapping[str, Any]]) -> tuple[str, float] | None:
    """The fastest torch.compile variant among a shape's baselines, as (variant, median ms)."""
    timed = [(v, row["median_ms"]) for v, row in baselines.items()
             if v in HEADLINE_COMPILE_VARIANTS and row.get("status") == "ok"]
    return min(timed, key=lambda item: item[1]) if timed else None


def measured_peak(problem: Problem, hardware: Mapping[str, Any] | None) -> float | None:
    """The machine's measured peak for the problem's regime (GB/s or TFLOP/s), if calibrated."""
    if not hardware:
        return None
    if problem.regime == "memory":
        return hardware.get("measured_copy_gb_s")
    return hardware.get(f"measured_{problem.peak_tflops_key}_tflop_s")


def shape_rows(problem: Problem, spec: GpuSpec | None, run_id: str, gpu: str,
               worker_shapes: list[dict[str, Any]],
               baselines: Mapping[int, Mapping[str, Mapping[str, Any]]],
               hardware: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """One shapes-table row per timed shape; `baselines[shape_idx][variant]` are baseline rows;
    `hardware` is the GPU's hardware-table row (for the fraction of the measured peak)."""
    measured = measured_peak(problem, hardware)
    shapes = {s.idx: s for s in problem.shapes_for("cpu" if gpu == "cpu" else "cuda")}
    rows = []
    for ws in worker_shapes:
        shape = shapes[ws["idx"]]
        ms = ws["median_ms"]
        base = baselines.get(shape.idx, {})
        eager = base.get("eager")
        eager_ms = eager["median_ms"] if eager and eager.get("status") == "ok" else None
        comp = best_compile(base)
        own = base.get(problem.headline_baseline) if problem.headline_baseline else None
        own_ms = own["median_ms"] if own and own.get("status") == "ok" and own.get("median_ms") else None
        row: dict[str, Any] = {
            "run_id": run_id, "gpu": gpu, "shape_idx": shape.idx, "shape_label": shape.label,
            "shape_json": shape.params_json,
            **{k: ws[k] for k in ("median_ms", "p10_ms", "p90_ms", "min_ms", "iterations")},
            "eager_ms": eager_ms, "compile_ms": comp[1] if comp else None,
            "speedup_vs_eager": speedup(eager_ms, ms) if eager_ms else None,
            "speedup_vs_compile": speedup(comp[1], ms) if comp else None,
            "max_rel_err": ws.get("max_rel_err"),
            "host_ms": ws.get("host_ms"), "graph_ms": ws.get("graph_ms"), "kernels": ws.get("kernels"),
            "launches": ws.get("launches"), "top_kernel_share": ws.get("top_kernel_share"),
            "timing_method": ws.get("timing_method"), "gpu_span_ms": ws.get("gpu_span_ms"),
            "baseline_ms": own_ms, "speedup_vs_baseline": speedup(own_ms, ms) if own_ms else None,
            "note": ws.get("graph_note"),
            "bound": problem.regime,
        }
        flops, nbytes = problem.flops(shape), problem.bytes_moved(shape)
        row["tflop_s"] = flops / (ms * 1e-3) / 1e12 if flops else None
        row["gb_s"] = nbytes / (ms * 1e-3) / 1e9 if nbytes else None
        if spec is not None and flops and nbytes:
            r = roofline(flops, nbytes, ms, spec.peak(problem.peak_tflops_key), spec.bandwidth_gb_s,
                         problem.regime)
            row.update(compute_fraction=r.compute_fraction, memory_fraction=r.memory_fraction,
                       peak_fraction=r.peak_fraction)
        else:
            row.update(compute_fraction=None, memory_fraction=None, peak_fraction=None)
        achieved = row["gb_s"] if problem.regime == "memory" else row["tflop_s"]
        row["measured_fraction"] = achieved / measured if achieved and measured else None
        rows.append(row)
    return rows


def beyond_hardware(problem: Problem, spec: GpuSpec | None, shapes: list[dict[str, Any]]) -> str | None:
    """Why a pass's times cannot be its computation's: the shape whose median implies the largest fraction of
    the GPU's datasheet peak for the problem's regime, where that is above PEAK_FRACTION_LIMIT; else None.

    A timed call starts from a flushed L2, so no honest kernel beats the peak (settings.PEAK_FRACTION_LIMIT):
    a time beyond it is an output served without the work, or a clock that lies, and the judge's clock alone
    does not refuse either where they hide inside the timed loop. Only the regime's own fraction is held:
    the other one rests on a formula that may count work a kernel can skip (a MoE's idle experts' bytes)."""
    fractions = [s for s in shapes if s.get("peak_fraction") is not None]
    if spec is None or not fractions:
        return None
    worst = max(fractions, key=lambda s: s["peak_fraction"])
    if worst["peak_fraction"] <= PEAK_FRACTION_LIMIT:
        return None
    if problem.regime == "memory":
        rate = f"{worst['gb_s']:,.0f} GB/s, {worst['peak_fraction']:.2f}× its {spec.bandwidth_gb_s:,.0f} GB/s"
    else:
        peak = spec.peak(problem.peak_tflops_key)
        rate = (f"{worst['tflop_s']:,.0f} TFLOP/s, {worst['peak_fraction']:.2f}× its dense "
                f"{problem.peak_tflops_key} peak of {peak:,.0f}")
    return (f"shape {worst['shape_idx']} ({worst['shape_label']}) timed at a median of {worst['median_ms']:.4f} ms: "
            f"{rate}, faster than the {spec.name} can do the work from a flushed L2 — its time is not the "
            f"computation's (an output served without the work, or a clock that lies)")


def result_row(*, run_id: str, gpu: str, status: str, message: str, shapes: list[dict[str, Any]],
               env: Mapping[str, Any], timer: str, seeds: list[int] | None, grader_version: str,
               grade_seconds: float | None, log_path: str | None, driver_version: str | None,
               graded_at: dt.datetime) -> dict[str, Any]:
    """The results-table row; a pass whose baselines are missing cannot be scored, so it is
    reported as not graded rather than as a pass without a score."""
    row: dict[str, Any] = {
        "run_id": run_id, "gpu": gpu, "status": status, "message": message,
        "speedup_vs_compile": None, "speedup_vs_eager": None, "peak_fraction": None,
        "peak_fraction_measured": None,
        "compile_variant": None, "speedup_vs_baseline": None, "baseline_variant": None,
        "n_shapes": len(shapes), "timer": timer,
        "device_name": env.get("device_name") or "unknown", "driver_version": driver_version,
        "cuda_version": env.get("cuda_version"), "torch_version": env.get("torch_version"),
        "triton_version": env.get("triton_version"), "python_version": env.get("python_version"),
        "graded_at": graded_at, "grader_version": grader_version, "measured_by": f"kernelboard {grader_version}",
        "seeds": seeds,
        "grade_seconds": grade_seconds, "log_path": log_path, "sandbox": None,
    }
    if status != "pass":
        return row
    missing = [s["shape_idx"] for s in shapes if s["speedup_vs_compile"] is None or s["speedup_vs_eager"] is None]
    if missing or not shapes:
        row.update(status="not_graded", message=f"correct, but baselines are missing for shapes {missing}")
        return row
    row["speedup_vs_compile"] = geomean(s["speedup_vs_compile"] for s in shapes)
    if all(s.get("speedup_vs_baseline") is not None for s in shapes):
        row["speedup_vs_baseline"] = geomean(s["speedup_vs_baseline"] for s in shapes)
    row["speedup_vs_eager"] = geomean(s["speedup_vs_eager"] for s in shapes)
    for column, source in (("peak_fraction", "peak_fraction"), ("peak_fraction_measured", "measured_fraction")):
        if all(s[source] is not None for s in shapes):
            row[column] = geomean(s[source] for s in shapes)
    return row
