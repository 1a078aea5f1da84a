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


# ----------------------------------------------------------------------------- imported KernelBench-Hard board

#: The imported board's GPU: KernelBench-Hard publishes an H100 PCIe board; kernelboard graded nothing there.
IMPORTED_GPU = "h100-pcie"
IMPORTED_BY = "KernelBench-Hard (imported)"
#: The source repository's commit the imported rows were read at (runs.source names it).
KBH_COMMIT = "a1b2c3d4e5" * 4
#: A pass without speedups (the source published no baselines): only its % of roofline. It must win its
#: cell over the same model's later failure, and set the board's best on % of roofline.
IMP_ROOF = "20261020_100000_kbh_nova-4_03_paged_attention"
IMP_ROOF_FAIL = "20261021_100000_kbh_nova-4_03_paged_attention"
#: A pass with speedups derived from the source's baselines: the faster one, but the lower % of roofline.
IMP_SPEED = "20261020_110000_kbh_fable-5_03_paged_attention"
#: Kept off the board by the source: a higher % of roofline than anything on it, yet no cell.
IMP_OFF = "20261019_120000_kbh_fable-5_03_paged_attention"
IMP_OFF_ONLY = "20261019_130000_kbh_zephyr-1_03_paged_attention"
IMP_FAIL = "20261020_120000_kbh_orbit-2_03_paged_attention"
IMP_OFF_REASON = "graded on an H100 SXM, not on this board's GPU"
IMP_NO_SPEEDUP = ("KernelBench-Hard pass; its published results give no eager or compiled baseline for this "
                  "problem on this GPU, so no speedup is derived (its score: the % of roofline)")
#: Fraction of the roofline of each imported pass (per shape the same).
_IMPORTED_ROOF = {IMP_ROOF: 0.303, IMP_SPEED: 0.2, IMP_OFF: 0.9, IMP_OFF_ONLY: 0.5}


def kbh_source(run_id: str) -> str:
    """runs.source of an imported run: every file of the source repository its row was read from."""
    paths = ["leaderboard/h100-pcie.json", f"runs/h100-pcie/{run_id}.json", f"solutions/{run_id}.txt"]
    return f"github:Infatoshi/kernelbench.com@{KBH_COMMIT}:{';'.join(paths)}"


def add_imported_board(inputs: SiteInputs) -> None:
    """An imported KernelBench-Hard board on h100-pcie beside the fixture's own h200 board: Nova 4 passes
    without a speedup (30.3% of roofline) and later fails; Fable 5 passes with a speedup (1.80x, 20.0%) and
    has a run kept off the board (90%); Zephyr 1 has only a run kept off the board; Orbit 2 fails."""
    problem = load_problem(inputs.decks_dir / BENCH / PROBLEM)
    spec = GPUS[IMPORTED_GPU]
    imported = {"measured_by": IMPORTED_BY, "grader_version": "kbh", "device_name": spec.name,
                "driver_version": None, "cuda_version": None, "torch_version": None, "triton_version": None,
                "python_version": None, "seeds": None, "grade_seconds": None, "log_path": None,
                "compile_variant": None, "timer": "cuda_event"}
    people = {IMP_ROOF: ("nova-4", "Nova 4", "Nova Labs"), IMP_ROOF_FAIL: ("nova-4", "Nova 4", "Nova Labs"),
              IMP_SPEED: ("fable-5", "Fable 5", "Anthropic"), IMP_OFF: ("fable-5", "Fable 5", "Anthropic"),
              IMP_OFF_ONLY: ("zephyr-1", "Zephyr 1", "Zephyr"), IMP_FAIL: ("orbit-2", "Orbit 2", "OpenAI")}
    runs = []
    for run_id, (model, display, lab) in people.items():
        run = _run(run_id, model, display, "kbh", lab=lab,
                   trace_url=f"https://huggingface.co/datasets/example/kbh-traces/blob/main/{run_id}.jsonl")
        run.update(gpu=IMPORTED_GPU, source=kbh_source(run_id), input_tokens=None, cache_read_tokens=None)
        runs.append(run)
    results, shapes = [], []
    for run_id, fraction in _IMPORTED_ROOF.items():
        rows = []
        for shape in problem.shapes_for("cuda"):
            ideal_ms = problem.bytes_moved(shape) / (spec.bandwidth_gb_s * 1e9) * 1e3
            rows.append({"run_id": run_id, "gpu": IMPORTED_GPU, "shape_idx": shape.idx, "shape_label": shape.label,
                         "shape_json": shape.params_json, "median_ms": ideal_ms / fraction, "bound": "memory",
                         "peak_fraction": fraction, "memory_fraction": fraction})
        with_speedup = run_id != IMP_ROOF
        result = _result(run_id, IMPORTED_GPU, "not_graded", "KernelBench-Hard pass; speedup = compiled ms ÷ "
                         "solution geomean ms" if with_speedup else IMP_NO_SPEEDUP, [], **imported)
        result.update(status="pass", n_shapes=len(rows), peak_fraction=fraction,
                      speedup_vs_compile=1.8 * fraction / 0.2 if with_speedup else None,
                      speedup_vs_eager=4.0 * fraction / 0.2 if with_speedup else None,
                      graded_at=GRADED - dt.timedelta(days=30))
        if run_id in (IMP_OFF, IMP_OFF_ONLY):
            result["off_board"] = IMP_OFF_REASON
        results.append(result)
        shapes += rows
    results.append(_result(IMP_ROOF_FAIL, IMPORTED_GPU, "wrong", "KernelBench-Hard: max abs err 0.4 on shape 1", [],
                           **{**imported, "graded_at": GRADED - dt.timedelta(days=29)}))
    results.append(_result(IMP_FAIL, IMPORTED_GPU, "build_error", "KernelBench-Hard: nvcc failed", [],
                           **{**imported, "graded_at": GRADED - dt.timedelta(days=30)}))
    hardware = {**spec.hardware_row(), "measured_copy_gb_s": None, "measured_bf16_tflop_s": None,
                "measured_fp8_tflop_s": None, "measured_at": None}
    out = inputs.results_dir / IMPORTED_GPU
    upsert(out / "hardware.parquet", "hardware", [hardware])
    upsert(out / "runs.parquet", "runs", runs)
    upsert(out / "results.parquet", "results", results)
    upsert(out / "shapes.parquet", "shapes", shapes)
    for run_id in _IMPORTED_ROOF:
        folder = inputs.data_dir / "submissions" / BENCH / run_id
        folder.mkdir(parents=True)
        (folder / "solution.py").write_text(
            "import torch\nfrom torch.utils.cpp_extension import load\n\n"
            "_ext = load(name='paged', sources=['kernel.cu'])\n", encoding="utf-8")
        if run_id == IMP_ROOF:
            (folder / "kernel.cu").write_text(
                "#include <cuda_bf16.h>\n\n__global__ void paged_attention(const __nv_bfloat16* q) {\n"
                "  // </script><b>not markup</b>\n}\n", encoding="utf-8")
            (folder / "blob.bin").write_bytes(b"\xff\xfe\x00binary")


# ------------------------------------------------------------------------------ large synthetic site

#: The GPUs of the large synthetic site (keys eval/hardware.py knows).
LARGE_GPUS = ("h200", "h100-sxm", "b200", "rtx-pro-6000")
_REAL_DECKS = REPO / "eval" / "decks" / "hard"
_REAL_SUBMISSIONS = REPO / "data" / "submissions" / "hard"
_LABS = ("Anthropic", "OpenAI", "Google", "DeepSeek", "Moonshot", "Zhipu", "xAI", "Mistral", "Alibaba")
_HARNESSES = ("claude", "codex", "opencode", "gemini-cli")
#: Failure statuses of the large site, with the grader message each gets (weights follow in _FAIL_WEIGHTS).
_FAILURES = {
    "wrong": "shape 1, seed 123: max abs err 0.31 > atol 0.02 + rtol 0.02·|ref|",
    "build_error": "import failed: triton.compiler.errors.CompilationError at line 88",
    "runtime_error": "CUDA error: an illegal memory access was encountered",
    "timeout": "the timed calls ran past the 600 s limit",
    "oom": "torch.OutOfMemoryError: tried to allocate 12.00 GiB",
    "forbidden": "calls torch.nn.functional.scaled_dot_product_attention, which the problem forbids",
}
_DNF_OUTCOMES = ("rate_limited", "provider_error", "credits_exhausted", "harness_error")


def _large_solution(base: str, run_id: str, i: int) -> str:
    """A realistic, unique solution: a real house kernel of the problem with its own header and tile sizes."""
    body = base.replace("BLOCK_M = 128", f"BLOCK_M = {64 * (1 + i % 3)}")
    body = body.replace("num_warps=4", f"num_warps={4 << i % 2}")
    return f"# {run_id}: generated for the site benchmark (variant {i})\n# tile choice {i % 97}\n{body}"


def make_large_site_inputs(root: Path, n_runs: int = 10_000, n_models: int = 36, seed: int = 7) -> SiteInputs:
    """A large synthetic site: `n_runs` graded runs over the four LARGE_GPUS and every real Hard deck.

    Every (GPU, problem) has a house kernel and a calibration row (the reference); the rest are AI-model
    runs of `n_models` models: about 55% passes (with shape rows from the deck's formulas), 33% failures
    of every kind, 12% DNFs (no solution). Runs carry tokens and cost (a few lack them), a few dozen have
    audit annotations (a quarter flagging), and every run with a kernel has a solution.py of realistic
    size (a real house kernel of the problem, made unique). Deterministic for a given `seed`.
    """
    import random

    rng = random.Random(seed)
    decks_dir, data_dir = root / "decks", root / "data"
    problems: dict[str, Problem] = {}
    bases: dict[str, str] = {}
    for folder in sorted(_REAL_DECKS.iterdir()):
        if not (folder / "problem.yaml").is_file():
            continue
        shutil.copytree(folder, decks_dir / BENCH / folder.name)
        problems[folder.name] = load_problem(decks_dir / BENCH / folder.name)
        house = _REAL_SUBMISSIONS / f"20261129_190000_house_kernelboard-house_{folder.name}" / "solution.py"
        bases[folder.name] = house.read_text(encoding="utf-8") if house.is_file() else \
            (folder / "reference.py").read_text(encoding="utf-8")
    names = sorted(problems)
    models = [(f"model-{m:02d}", f"Model {m:02d}", _LABS[m % len(_LABS)], _HARNESSES[m % len(_HARNESSES)])
              for m in range(n_models)]
    skill = {m[0]: rng.uniform(0.1, 0.9) for m in models}
    start = dt.datetime(2026, 10, 1, tzinfo=dt.UTC)
    tables: dict[str, dict[str, list[dict]]] = {g: {"runs": [], "results": [], "shapes": [], "baselines": []}
                                                for g in LARGE_GPUS}
    solutions: dict[str, str] = {}
    passes: list[str] = []

    def add(i: int, gpu: str, name: str, model: tuple[str, str, str | None, str], kind: str) -> None:
        problem, spec = problems[name], GPUS[gpu]
        when = start + dt.timedelta(seconds=211 * i)
        run_id = f"{when:%Y%m%d_%H%M%S}_{model[3]}_{model[0]}_{name}"
        house = model[3] == "house"
        outcome = rng.choice(_DNF_OUTCOMES) if kind == "dnf" else "completed"
        run = _run(run_id, model[0], model[1], model[3], outcome, lab=model[2],
                   effort=None if house else rng.choice(("medium", "high", "xhigh")),
                   outcome_note="HTTP 429 from the provider after 3 retries" if kind == "dnf" else None,
                   trace_url=None if house else f"https://example.org/traces/{run_id}")
        run.update(problem=name, gpu=gpu, started_at=when, source="bench-synthetic")
        if house:
            run.update(agent_seconds=None, input_tokens=None, output_tokens=None, cache_read_tokens=None,
                       cost_usd=None)
        else:
            out_tokens = rng.randint(8_000, 400_000)
            missing = rng.random() < 0.05
            run.update(agent_seconds=rng.uniform(300, 7200), input_tokens=None if missing else out_tokens * 30,
                       output_tokens=None if missing else out_tokens, cache_read_tokens=out_tokens * 20,
                       cost_usd=None if missing or rng.random() < 0.05 else round(out_tokens * 4e-5, 4))
        graded = when + dt.timedelta(hours=3)
        extra = {"graded_at": graded, "device_name": spec.name, "log_path": None}
        shapes: list[dict] = []
        if kind == "pass":
            level = 0.85 if model[0] == HOUSE_MODEL_KEY else 0.12 if model[0] == "reference-eager" else \
                min(0.95, max(0.02, rng.gauss(skill[model[0]], 0.12)))
            for shape in problem.shapes_for("cuda"):
                flops, nbytes = problem.flops(shape) or 1e9, problem.bytes_moved(shape) or 1e6
                peak = spec.peak(problem.peak_tflops_key)
                ideal = max(flops / (peak * 1e12), nbytes / (spec.bandwidth_gb_s * 1e9)) * 1e3
                sol = ideal / min(0.99, level * rng.uniform(0.8, 1.2))
                comp, eager = ideal / 0.3, ideal / 0.12
                roof = roofline(flops, nbytes, sol, peak, spec.bandwidth_gb_s, problem.regime)
                shapes.append({
                    "run_id": run_id, "gpu": gpu, "shape_idx": shape.idx, "shape_label": shape.label,
                    "shape_json": shape.params_json, "median_ms": sol, "p10_ms": sol * 0.98, "p90_ms": sol * 1.03,
                    "min_ms": sol * 0.97, "iterations": 30, "tflop_s": roof.tflop_s, "gb_s": roof.gb_s,
                    "compute_fraction": roof.compute_fraction, "memory_fraction": roof.memory_fraction,
                    "bound": problem.regime, "peak_fraction": roof.peak_fraction, "eager_ms": eager,
                    "compile_ms": comp, "speedup_vs_eager": speedup(eager, sol),
                    "speedup_vs_compile": speedup(comp, sol), "max_rel_err": 2.0e-3,
                })
            result = _result(run_id, gpu, "pass", "passed every shape, seed and stress case", shapes, **extra)
            passes.append(run_id)
        elif kind == "dnf":
            result = _result(run_id, gpu, "dnf", "the agent run did not finish; nothing to grade", [], **extra)
            run["solution_sha256"] = None
        else:
            status = rng.choices(list(_FAILURES), weights=(40, 20, 20, 8, 6, 6))[0]
            result = _result(run_id, gpu, status, _FAILURES[status], [], **extra)
        tables[gpu]["runs"].append(run)
        tables[gpu]["results"].append(result)
        tables[gpu]["shapes"] += shapes
        if kind != "dnf":
            solutions[run_id] = _large_solution(bases[name], run_id, i)

    house_rows = [(HOUSE_MODEL_KEY, "kernelboard house", "kernelboard", "house"),
                  ("reference-eager", "Reference (eager PyTorch)", "kernelboard", "house")]
    i = 0
    for gpu in LARGE_GPUS:
        for name in names:
            for model in house_rows:
                add(i, gpu, name, model, "pass")
                i += 1
    while i < n_runs:
        gpu, name, model = rng.choice(LARGE_GPUS), rng.choice(names), rng.choice(models)
        add(i, gpu, name, model, rng.choices(("pass", "fail", "dnf"), weights=(55, 33, 12))[0])
        i += 1

    for gpu in LARGE_GPUS:  # baselines: eager and torch.compile per (problem, shape), measured once
        spec = GPUS[gpu]
        for name in names:
            problem = problems[name]
            for shape in problem.shapes_for("cuda"):
                flops, nbytes = problem.flops(shape) or 1e9, problem.bytes_moved(shape) or 1e6
                ideal = max(flops / (spec.peak(problem.peak_tflops_key) * 1e12),
                            nbytes / (spec.bandwidth_gb_s * 1e9)) * 1e3
                for variant, ms in (("eager", ideal / 0.12), (COMPILE, ideal / 0.3)):
                    tables[gpu]["baselines"].append({
                        "bench": BENCH, "problem": name, "gpu": gpu, "shape_idx": shape.idx,
                        "shape_label": shape.label, "shape_json": shape.params_json, "variant": variant,
                        "status": "ok", "message": "", "median_ms": ms, "p10_ms": ms * 0.99, "p90_ms": ms * 1.02,
                        "min_ms": ms * 0.98, "iterations": 30, "timer": "cuda_event", "device_name": spec.name,
                        "torch_version": "2.11.0", "triton_version": "3.5.0", "cuda_version": "12.8",
                        "grader_version": "0.1.0", "measured_at": start,
                    })
    out = data_dir / "results"
    for gpu in LARGE_GPUS:
        hardware = {**GPUS[gpu].hardware_row(), "measured_copy_gb_s": None, "measured_bf16_tflop_s": None,
                    "measured_fp8_tflop_s": None, "measured_at": None}
        upsert(out / gpu / "hardware.parquet", "hardware", [hardware])
        for table in ("runs", "results", "shapes", "baselines"):
            upsert(out / gpu / f"{table}.parquet", table, tables[gpu][table])
    for run_id, text in solutions.items():
        folder = data_dir / "submissions" / BENCH / run_id
        folder.mkdir(parents=True)
        (folder / "solution.py").write_text(text, encoding="utf-8")
    notes = data_dir / "annotations"
    notes.mkdir(parents=True)
    for k, run_id in enumerate(rng.sample(passes, min(40, len(passes)))):
        verdict = "reward_hack" if k % 4 == 0 else "clean"
        (notes / f"{run_id}.yaml").write_text(
            f"run_id: {run_id}\nverdict: {verdict}\nsummary: >-\n  Synthetic audit note {k} for the site "
            "benchmark: the kernel was read end to end.\nauditor: bench\n", encoding="utf-8")
    return SiteInputs(data_dir, decks_dir)


HOUSE_MODEL_KEY = "kernelboard-house"
