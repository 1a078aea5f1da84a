"""The data contract: the parquet tables the grader writes and the site reads (pyarrow only, no torch).

Five tables live under `data/results/<gpu>/`: runs, results, shapes, baselines, hardware.
Every row carries `schema_version`; `data/README.md` documents each column. The rules that tie
rows together (a pass has a score, a DNF is never a failure) live in `eval/tables.py`.

This module is the one place the columns and their types are written: the grader writes through
`TABLES`, `eval/tables.py` validates against it, and the site's typed records (`sitegen/load.py`)
are checked against it when they are defined (`record_mismatches`), so a column cannot be added,
renamed or retyped on one side only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import pyarrow as pa

SCHEMA_VERSION = 1

#: The GPU key (results folder, `gpu` column) of rows graded with `--device cpu`; it has no hardware row.
CPU_KEY = "cpu"

#: How `measured_by` ends on rows an importer read from another grader ("KernelBench-Hard (imported)").
IMPORTED_SUFFIX = "(imported)"

#: The model name of kernels written by the kernelboard maintainers (reference points, not AI models).
HOUSE_MODEL = "kernelboard-house"

#: The harness of every run made by the maintainers rather than an agent: the house kernel and
#: calibration rows (the reference submitted as a solution, a deliberately wrong kernel).
HOUSE_HARNESS = "house"

#: How an agent attempt ended, before any grading. Only `completed` runs can have a solution.
AGENT_OUTCOMES = (
    "completed",
    "rate_limited",
    "provider_error",
    "credits_exhausted",
    "agent_timeout",
    "early_stop",
    "no_solution",
    "harness_error",
    "provider_unavailable",
    "solution_unrecoverable",
)

#: Outcomes that are the infrastructure's fault, not the model's: shown as DNF, never scored 0.
DNF_OUTCOMES = frozenset(
    {"rate_limited", "provider_error", "provider_unavailable", "credits_exhausted", "harness_error"}
)

#: Grading verdicts. `pass` alone carries a score; `dnf` only for runs whose outcome is a DNF.
#: `needs_other_arch` (the kernel targets a newer GPU architecture than the one grading it) and
#: `not_reproducible` (it fails for want of a file the published submission lacks) are told apart
#: from build and runtime errors by `eval/reproducible.py`.
STATUSES = (
    "pass",
    "wrong",
    "build_error",
    "runtime_error",
    "timeout",
    "oom",
    "forbidden",
    "integrity_violation",
    "not_graded",
    "dnf",
    "needs_other_arch",
    "not_reproducible",
)

#: Verdicts that are not a score: never a 0, never ranked (a DNF is left out of a row's mean too).
UNSCORED_STATUSES = frozenset({"needs_other_arch", "not_reproducible"})

REGIMES = ("compute", "memory")

#: The precisions a GPU's datasheet dense peak is recorded for (`peak_column`); `eval/hardware.py` keys by them.
PRECISIONS = ("fp8", "bf16", "fp16", "tf32", "fp32")

#: Timers the grader knows; CPU timings are labelled as such and never compared with GPU ones.
TIMERS = ("cuda_event", "cpu_wall")
TIMING_METHODS = ("covered", "synchronised")

_ts = pa.timestamp("us", tz="UTC")


def _schema(*fields: pa.Field) -> pa.Schema:
    return pa.schema([pa.field("schema_version", pa.int16(), nullable=False), *fields])


def _f(name: str, type_: pa.DataType, nullable: bool = True) -> pa.Field:
    return pa.field(name, type_, nullable=nullable)


#: The times (ms) of a timing's statistics, in shapes and baselines rows: positive and finite when set.
TIMES_MS = ("median_ms", "p10_ms", "p90_ms", "min_ms")

#: Every statistic of a timing: its times and how many calls were timed.
TIME_STATS = (*TIMES_MS, "iterations")

def peak_column(precision: str) -> str:
    """The hardware column of a precision's datasheet dense peak (TFLOP/s), one per `PRECISIONS`."""
    return f"peak_tflop_s_{precision}"


_TIME_STATS = (*(_f(name, pa.float64()) for name in TIMES_MS), _f("iterations", pa.int32()))

RUNS = _schema(
    _f("run_id", pa.string(), False),
    _f("bench", pa.string(), False),
    _f("problem", pa.string(), False),
    _f("gpu", pa.string()),
    _f("model", pa.string(), False),
    _f("model_display", pa.string(), False),
    _f("lab", pa.string()),
    _f("harness", pa.string(), False),
    _f("effort", pa.string()),
    _f("started_at", _ts),
    _f("agent_seconds", pa.float64()),
    _f("input_tokens", pa.int64()),
    _f("output_tokens", pa.int64()),
    _f("cache_read_tokens", pa.int64()),
    _f("cost_usd", pa.float64()),
    _f("agent_outcome", pa.string(), False),
    _f("outcome_note", pa.string()),
    _f("trace_url", pa.string()),
    _f("solution_sha256", pa.string()),
    _f("source", pa.string(), False),
)

RESULTS = _schema(
    _f("run_id", pa.string(), False),
    _f("gpu", pa.string(), False),
    _f("status", pa.string(), False),
    _f("message", pa.string(), False),
    _f("speedup_vs_compile", pa.float64()),
    _f("speedup_vs_eager", pa.float64()),
    _f("peak_fraction", pa.float64()),
    _f("peak_fraction_measured", pa.float64()),
    _f("compile_variant", pa.string()),
    # A deck's own headline baseline (Mega's baseline.py; problem.yaml `headline_baseline`): which line
    # it is and the pass's geomean speedup over it; null where the deck names none (Hard).
    _f("speedup_vs_baseline", pa.float64()),
    _f("baseline_variant", pa.string()),
    _f("n_shapes", pa.int32(), False),
    _f("timer", pa.string(), False),
    _f("device_name", pa.string(), False),
    _f("driver_version", pa.string()),
    _f("cuda_version", pa.string()),
    _f("torch_version", pa.string()),
    _f("triton_version", pa.string()),
    _f("python_version", pa.string()),
    _f("graded_at", _ts, False),  # when grading ended (after the worker returned), not when it started
    _f("grader_version", pa.string(), False),
    _f("measured_by", pa.string(), False),
    _f("seeds", pa.list_(pa.int64())),
    _f("grade_seconds", pa.float64()),  # the worker's wall time plus its own prebuild's (the CPU compile)
    _f("log_path", pa.string()),
    # Why a graded run takes no board cell (None: it competes). Only an importer sets it, to mirror
    # another grader's curation (a run that grader graded but keeps off its board, with its reason).
    _f("off_board", pa.string()),
    # What confined the candidate's code while it was graded (eval/jail.py), or "unsandboxed (…)";
    # null for rows graded before the sandbox existed and for rows no grader of ours measured.
    _f("sandbox", pa.string()),
)

SHAPES = _schema(
    _f("run_id", pa.string(), False),
    _f("gpu", pa.string(), False),
    _f("shape_idx", pa.int32(), False),
    _f("shape_label", pa.string(), False),
    _f("shape_json", pa.string(), False),
    *_TIME_STATS,
    _f("tflop_s", pa.float64()),
    _f("gb_s", pa.float64()),
    _f("compute_fraction", pa.float64()),
    _f("memory_fraction", pa.float64()),
    _f("bound", pa.string()),
    _f("peak_fraction", pa.float64()),
    _f("measured_fraction", pa.float64()),
    _f("eager_ms", pa.float64()),
    _f("compile_ms", pa.float64()),
    _f("speedup_vs_eager", pa.float64()),
    _f("speedup_vs_compile", pa.float64()),
    _f("max_rel_err", pa.float64()),
    _f("host_ms", pa.float64()),
    _f("graph_ms", pa.float64()),
    _f("kernels", pa.list_(pa.string())),
    _f("note", pa.string()),
    # Kernel launches of one profiled warm call (each node of a CUDA-graph replay counted; copies and
    # memsets not) and the largest launch's share of their time (eval/launches.py); null off the GPU.
    _f("launches", pa.int32()),
    _f("top_kernel_share", pa.float64()),
    # How the GPU samples were taken (eval/timing.py): "covered" (dispatch covered by a GPU sleep;
    # since grader 0.4.0) or "synchronised" (the GPU idle before each call); null before 0.4.0 and
    # off the GPU.
    _f("timing_method", pa.string()),
    # A covered loop's median GPU span of a call (its start and end events, the dispatch hidden behind a
    # GPU sleep): the GPU's own time, which a host-bound call's timed median exceeds (since grader 0.4.8).
    _f("gpu_span_ms", pa.float64()),
    _f("baseline_ms", pa.float64()),  # the deck's headline baseline line on this shape (results.baseline_variant)
    _f("speedup_vs_baseline", pa.float64()),
)

BASELINES = _schema(
    _f("bench", pa.string(), False),
    _f("problem", pa.string(), False),
    _f("gpu", pa.string(), False),
    _f("shape_idx", pa.int32(), False),
    _f("shape_label", pa.string(), False),
    _f("shape_json", pa.string(), False),
    _f("variant", pa.string(), False),
    _f("status", pa.string(), False),
    _f("message", pa.string(), False),
    *_TIME_STATS,
    _f("timer", pa.string(), False),
    _f("timing_method", pa.string()),  # as in SHAPES
    _f("device_name", pa.string(), False),
    _f("torch_version", pa.string()),
    _f("triton_version", pa.string()),
    _f("cuda_version", pa.string()),
    _f("grader_version", pa.string(), False),
    _f("measured_at", _ts, False),
)

HARDWARE = _schema(
    _f("gpu", pa.string(), False),
    _f("name", pa.string(), False),
    _f("sm", pa.string()),
    _f("memory_gb", pa.float64()),
    _f("l2_mb", pa.float64()),
    _f("bandwidth_gb_s", pa.float64()),
    *(_f(peak_column(p), pa.float64()) for p in PRECISIONS),
    _f("source", pa.string(), False),
    _f("measured_copy_gb_s", pa.float64()),
    _f("measured_bf16_tflop_s", pa.float64()),
    _f("measured_fp8_tflop_s", pa.float64()),
    _f("measured_at", _ts),
)

#: Nullable columns added to schema version 1 after files were written: a file without one reads as
#: all nulls (the column's meaning for rows written before it existed).
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {"results": ("off_board", "sandbox", "speedup_vs_baseline",
                                                         "baseline_variant"),
                                             "shapes": ("launches", "top_kernel_share", "timing_method",
                                                        "baseline_ms", "speedup_vs_baseline", "gpu_span_ms"),
                                             "baselines": ("timing_method",)}

#: Table name -> (schema, key columns). A key identifies a row; rewriting a key replaces the row.
TABLES: dict[str, tuple[pa.Schema, tuple[str, ...]]] = {
    "runs": (RUNS, ("run_id",)),
    "results": (RESULTS, ("run_id", "gpu")),
    "shapes": (SHAPES, ("run_id", "gpu", "shape_idx")),
    "baselines": (BASELINES, ("bench", "problem", "gpu", "shape_idx", "variant")),
    "hardware": (HARDWARE, ("gpu",)),
}

#: Enumerated columns, checked on load.
ENUMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("runs", "agent_outcome"): AGENT_OUTCOMES,
    ("results", "status"): STATUSES,
    ("results", "timer"): TIMERS,
    ("baselines", "timer"): TIMERS,
    ("baselines", "status"): ("ok", "error", "wrong"),
    ("shapes", "bound"): REGIMES,
    ("shapes", "timing_method"): TIMING_METHODS,
    ("baselines", "timing_method"): TIMING_METHODS,
}


def python_type(field: pa.Field) -> str:
    """The annotation, as written in a `from __future__ import annotations` module, of the value a
    row of `field` reads as through pyarrow's `to_pylist` (e.g. 'int | None' for a nullable int32)."""
    t = field.type
    if pa.types.is_list(t):
        base = f"list[{python_type(pa.field('item', t.value_type, nullable=False))}]"
    elif pa.types.is_string(t):
        base = "str"
    elif pa.types.is_integer(t):
        base = "int"
    elif pa.types.is_floating(t):
        base = "float"
    elif pa.types.is_boolean(t):
        base = "bool"
    elif pa.types.is_timestamp(t):
        base = "datetime"
    else:
        raise TypeError(f"column '{field.name}': no Python type for {t}")
    return f"{base} | None" if field.nullable else base


def record_mismatches(table: str, annotations: Mapping[str, object], *, extra: Collection[str] = (),
                      folded: Collection[str] = ()) -> list[str]:
    """How a typed record of `table`'s rows (field name -> annotation string, a dataclass's
    `__annotations__`) differs from the contract: one line per column missing, surplus or typed
    differently. `extra` fields are the record's own (joined rows, derived values), not columns;
    `folded` columns are read into one of those instead of a field each. `schema_version` is the
    file's, not the record's."""
    schema, _ = TABLES[table]
    columns = {f.name: f for f in schema if f.name != "schema_version" and f.name not in folded}
    bad = [f"{table}: column '{name}' ({python_type(columns[name])}) has no field"
           for name in columns if name not in annotations]
    for name, annotation in annotations.items():
        if name in extra:
            continue
        if name not in columns:
            bad.append(f"{table}: field '{name}' is no column of the table")
        elif annotation != python_type(columns[name]):
            bad.append(f"{table}: field '{name}' is {annotation}, the column reads as {python_type(columns[name])}")
    return bad
