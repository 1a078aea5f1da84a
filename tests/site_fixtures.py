"""A tiny but realistic site input, generated into a temporary folder (never into data/).

One GPU (`h200`, hardware row from `eval/hardware.py`) plus CPU test timings, one problem
(`hard/03_paged_attention`, the repository's real deck, copied) and five runs that cover every
kind of cell: a house kernel that passes, reference.py submitted as a solution (a calibration
row, harness 'house': a pass slower than torch.compile), an AI model that passes, one whose
kernel is wrong, and a DNF (rate limited).
The numbers are invented for tests and live only under pytest's tmp_path.
"""

from __future__ import annotations

import datetime as dt
import shutil
from dataclasses import dataclass
from pathlib import Path

from kernelboard.eval.deck import Problem, load_problem
from kernelboard.eval.hardware import GPUS
from kernelboard.eval.roofline import geomean, roofline, speedup
from kernelboard.eval.tables import upsert

REPO = Path(__file__).resolve().parents[1]
REAL_DECK = REPO / "eval" / "decks" / "hard" / "03_paged_attention"

BENCH, PROBLEM, GPU = "hard", "03_paged_attention", "h200"
COMPILE = "compile(max-autotune-no-cudagraphs)"
GRADED = dt.datetime(2026, 11, 29, 19, 30, tzinfo=dt.UTC)

HOUSE = "20261129_190000_house_kernelboard-house_03_paged_attention"
REFERENCE = "20261129_190100_house_reference_03_paged_attention"
PASS = "20261128_101500_claude_fable-5_03_paged_attention"
WRONG = "20261128_111500_codex_orbit-2_03_paged_attention"
DNF = "20261128_121500_opencode_kinetic-k3_03_paged_attention"

#: Fraction of the bandwidth each solution reaches (per shape the same, for simplicity).
_SOLUTION_BW = {HOUSE: 0.71, REFERENCE: 0.14, PASS: 0.52}
_COMPILE_BW, _EAGER_BW = 0.28, 0.12


@dataclass(frozen=True)
class SiteInputs:
    data_dir: Path
    decks_dir: Path

    @property
    def results_dir(self) -> Path:
        return self.data_dir / "results"


def _run(run_id: str, model: str, display: str, harness: str, outcome: str = "completed", **extra) -> dict:
    return {
        "run_id": run_id, "bench": BENCH, "problem": PROBLEM, "gpu": GPU, "model": model,
        "model_display": display, "lab": extra.pop("lab", None), "harness": harness,
        "effort": extra.pop("effort", None),
        "started_at": dt.datetime.strptime(run_id[:15], "%Y%m%d_%H%M%S").replace(tzinfo=dt.UTC),
        "agent_seconds": 2712.0, "input_tokens": 1_843_002, "output_tokens": 61_340,
        "cache_read_tokens": 1_502_118, "cost_usd": 4.12, "agent_outcome": outcome,
        "outcome_note": extra.pop("outcome_note", None), "trace_url": extra.pop("trace_url", None),
        "solution_sha256": None if outcome != "completed" else "ab" * 32, "source": "test-fixture",
        **extra,
    }


def _result(run_id: str, gpu: str, status: str, message: str, shapes: list[dict], **extra) -> dict:
    passed = status == "pass"
    return {
        "run_id": run_id, "gpu": gpu, "status": status, "message": message,
        "speedup_vs_compile": geomean(s["speedup_vs_compile"] for s in shapes) if passed else None,
        "speedup_vs_eager": geomean(s["speedup_vs_eager"] for s in shapes) if passed else None,
        "peak_fraction": geomean(s["peak_fraction"] for s in shapes) if passed and gpu != "cpu" else None,
        "compile_variant": COMPILE, "n_shapes": len(shapes) if passed else 0,
        "timer": "cpu_wall" if gpu == "cpu" else "cuda_event",
        "device_name": "x86_64 CPU" if gpu == "cpu" else "NVIDIA H200",
        "driver_version": None if gpu == "cpu" else "580.95.05",
        "cuda_version": None if gpu == "cpu" else "12.8", "torch_version": "2.11.0",
        "triton_version": "3.5.0", "python_version": "3.11.14", "graded_at": GRADED,
        "grader_version": "0.1.0", "measured_by": "kernelboard 0.1.0", "seeds": [42, 123, 456], "grade_seconds": 48.5,
        "log_path": f"data/results/{gpu}/logs/{run_id}.log", **extra,
    }


def _shape_rows(problem: Problem, run_id: str, gpu: str, bw_fraction: float) -> tuple[list[dict], list[dict]]:
    """(shape rows of one solution, baseline rows) on `gpu`, from the deck's formulas."""
    spec = GPUS["h200"]
    shapes, baselines = [], []
    deck_shapes = problem.shapes_for("cpu" if gpu == "cpu" else "cuda")
    for shape in deck_shapes:
        nbytes, flops = problem.bytes_moved(shape), problem.flops(shape)
        ideal_ms = nbytes / (spec.bandwidth_gb_s * 1e9) * 1e3
        scale = 40.0 if gpu == "cpu" else 1.0
        sol_ms, comp_ms, eager_ms = (scale * ideal_ms / f for f in (bw_fraction, _COMPILE_BW, _EAGER_BW))
        roof = roofline(flops, nbytes, sol_ms, spec.peak("bf16"), spec.bandwidth_gb_s, "memory")
        # A CPU has no datasheet peak here: its fractions are left empty.
        compute, memory = (None, None) if gpu == "cpu" else (roof.compute_fraction, roof.memory_fraction)
        common = {"gpu": gpu, "shape_idx": shape.idx, "shape_label": shape.label,
                  "shape_json": shape.params_json}
        shapes.append({
            "run_id": run_id, **common, "median_ms": sol_ms, "p10_ms": sol_ms * 0.98,
            "p90_ms": sol_ms * 1.03, "min_ms": sol_ms * 0.97, "iterations": 30,
            "tflop_s": roof.tflop_s, "gb_s": roof.gb_s, "compute_fraction": compute,
            "memory_fraction": memory, "bound": "memory", "peak_fraction": memory,
            "eager_ms": eager_ms, "compile_ms": comp_ms, "speedup_vs_eager": speedup(eager_ms, sol_ms),
            "speedup_vs_compile": speedup(comp_ms, sol_ms), "max_rel_err": 3.1e-3,
        })
        for variant, ms in (("eager", eager_ms), (COMPILE, comp_ms)):
            baselines.append({
                "bench": BENCH, "problem": PROBLEM, **common, "variant": variant, "status": "ok",
                "message": "", "median_ms": ms, "p10_ms": ms * 0.99, "p90_ms": ms * 1.02, "min_ms": ms * 0.98,
                "iterations": 30, "timer": "cpu_wall" if gpu == "cpu" else "cuda_event",
                "device_name": "x86_64 CPU" if gpu == "cpu" else "NVIDIA H200", "torch_version": "2.11.0",
                "triton_version": "3.5.0", "cuda_version": None if gpu == "cpu" else "12.8",
                "grader_version": "0.1.0",
                "measured_at": GRADED - dt.timedelta(hours=1),
            })
    return shapes, baselines


def make_site_inputs(root: Path) -> SiteInputs:
    """Write decks/ and data/ under `root` and return where they are."""
    decks_dir, data_dir = root / "decks", root / "data"
    deck = decks_dir / BENCH / PROBLEM
    shutil.copytree(REAL_DECK, deck)
    problem = load_problem(deck)

    runs = [
        _run(HOUSE, "kernelboard-house", "kernelboard house", "house", lab="kernelboard"),
        _run(REFERENCE, "reference-eager", "Reference (eager PyTorch)", "house", lab="kernelboard",
             outcome_note="reference.py submitted unchanged: the sanity check of the pipeline"),
        _run(PASS, "fable-5", "Fable 5", "claude", lab="Anthropic", effort="high",
             trace_url="https://huggingface.co/datasets/example/traces/viewer?run=fable-5"),
        _run(WRONG, "orbit-2", "Orbit 2", "codex", lab="OpenAI", effort="xhigh",
             trace_url="javascript:alert(1)"),
        _run(DNF, "kinetic-k3", "Kinetic K3 <beta>", "opencode", "rate_limited",
             outcome_note="HTTP 429 from the provider after 3 retries"),
    ]
    results, shape_rows, baseline_rows = {GPU: [], "cpu": []}, {GPU: [], "cpu": []}, {GPU: [], "cpu": []}
    for gpu in (GPU, "cpu"):
        graded = (HOUSE, REFERENCE, PASS) if gpu == GPU else (HOUSE,)
        for run_id in graded:
            shapes, baselines = _shape_rows(problem, run_id, gpu, _SOLUTION_BW[run_id])
            message = "passed every shape, seed and stress case"
            results[gpu].append(_result(run_id, gpu, "pass", message, shapes))
            shape_rows[gpu] += shapes
            baseline_rows[gpu] = baselines  # the same for every run: measured once per shape
    results[GPU].append(_result(WRONG, GPU, "wrong", "shape 2 (GQA 8:1, long), seed 123: max abs err 0.31 > "
                                "atol 0.02 + rtol 0.02·|ref|", []))
    results[GPU].append(_result(DNF, GPU, "dnf", "the agent run was rate limited; nothing to grade", []))

    hardware = {**GPUS[GPU].hardware_row(), "measured_copy_gb_s": None, "measured_bf16_tflop_s": None,
                "measured_fp8_tflop_s": None, "measured_at": None}
    out = data_dir / "results"
    upsert(out / GPU / "hardware.parquet", "hardware", [hardware])
    for gpu in (GPU, "cpu"):
        graded_ids = {r["run_id"] for r in results[gpu]}
        upsert(out / gpu / "runs.parquet", "runs", [r for r in runs if r["run_id"] in graded_ids])
        upsert(out / gpu / "results.parquet", "results", results[gpu])
        upsert(out / gpu / "shapes.parquet", "shapes", shape_rows[gpu])
        upsert(out / gpu / "baselines.parquet", "baselines", baseline_rows[gpu])

    for run_id, source in ((HOUSE, "triton"), (REFERENCE, "reference"), (PASS, "triton"), (WRONG, "cuda")):
        folder = data_dir / "submissions" / BENCH / run_id
        folder.mkdir(parents=True)
        (folder / "solution.py").write_text(
            f'"""{source} solution for {PROBLEM} (test fixture)."""\n\nimport torch\n\n\n'
            "class Model(torch.nn.Module):\n    def forward(self, query, kv_cache, block_table, seq_lens):\n"
            "        return query  # </script><b>not markup</b>\n",
            encoding="utf-8",
        )
    return SiteInputs(data_dir, decks_dir)


def scale_site_inputs(inputs: SiteInputs, n_models: int) -> int:
    """Add `n_models` synthetic passing AI-model runs on h200 (for bench/site_build.py).

    Returns the number of runs the data then holds. Tmp only, like everything in this module.
    """
    problem = load_problem(inputs.decks_dir / BENCH / PROBLEM)
    runs, results, shapes = [], [], []
    for i in range(n_models):
        run_id = f"20261127_{i // 3600:02d}{i // 60 % 60:02d}{i % 60:02d}_bench_model-{i}_{PROBLEM}"
        runs.append(_run(run_id, f"model-{i}", f"Model {i}", "bench", lab="Bench"))
        rows, _ = _shape_rows(problem, run_id, GPU, 0.2 + 0.5 * i / max(n_models, 1))
        results.append(_result(run_id, GPU, "pass", "passed every shape, seed and stress case", rows))
        shapes += rows
    out = inputs.results_dir / GPU
    upsert(out / "runs.parquet", "runs", runs)
    upsert(out / "results.parquet", "results", results)
    upsert(out / "shapes.parquet", "shapes", shapes)
    return 5 + n_models
