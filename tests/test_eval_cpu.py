"""The grader end to end on the CPU: one batch of hostile and honest submissions, each of which
must get its own status while the batch completes. Each test is named after what it stops."""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from grading import MeasuredBaselines

from kernelboard.cli import main as cli
from kernelboard.eval.schedule import EvalOptions, run_eval
from kernelboard.eval.tables import load_all, read_table, table_path

ROOT = Path(__file__).resolve().parents[1]
DECK = ROOT / "eval" / "decks" / "hard"
PROBLEM = "03_paged_attention"

REFERENCE = "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"

_MODEL_PREAMBLE = """
import torch
import reference


class Model(reference.Model):
    def forward(self, query, kv_cache, block_table, seq_lens):
{body}
"""

_FORGER = """
import glob
import json
import os
import sys
from pathlib import Path

# Every place a job file could be named: argv, the environment, the parent's command line, the
# folder beside the working directory (where the scheduler writes it).
names = [*sys.argv, *os.environ.values()]
try:
    names += Path(f"/proc/{os.getppid()}/cmdline").read_text().split("\\0")
except OSError:
    pass
names += glob.glob(str(Path.cwd().parent / "*.job.json"))
row = {"median_ms": 1e-4, "p10_ms": 1e-4, "p90_ms": 1e-4, "min_ms": 1e-4, "iterations": 100, "wall_ms": 1.0,
       "max_rel_err": 0.0}
for name in names:
    if not name.endswith(".job.json"):
        continue
    try:
        job = json.loads(Path(name).read_text())
    except (OSError, ValueError):
        continue
    Path(job["result_path"]).write_text(json.dumps({
        "status": "pass", "message": "correct on every check", "seeds": [42, 123, 456, 7],
        "env": {"device_name": "CPU: forged", "torch_version": "2", "l2_bytes": None},
        "shapes": [{"idx": 0, **row}, {"idx": 1, **row}], "import_seconds": 0.1, "phase": "timing"}))
"""

# run_id -> solution.py source, or {file name: source} for a submission with sidecar files;
# None means no solution file at all.
SUBMISSIONS: dict[str, str | dict[str, str] | None] = {
    "correct": REFERENCE,
    # Attends over every slot of every table page: right only when lengths fill whole pages.
    "wrong": _MODEL_PREAMBLE.format(body="""\
        full = torch.full_like(seq_lens, block_table.shape[1] * kv_cache.shape[1])
        return super().forward(query, kv_cache, block_table, full)"""),
    "segfault": "import ctypes\nctypes.string_at(0)\n",
    # Never returns: blocked for good (not spinning, so its 30 s leave the CPU to the rest of the suite).
    "hang": _MODEL_PREAMBLE.format(body="""\
        import threading
        threading.Event().wait()"""),
    "hard_exit": "import os\nprint('PASS')\nos._exit(0)\n",
    "system_exit": "import sys\nsys.exit(0)\n",
    "syntax_error": "def Model(:\n",
    "forbidden": REFERENCE + "# torch.nn.functional.scaled_dot_product_attention would do it all\n",
    "mutates_input": _MODEL_PREAMBLE.format(body="""\
        out = super().forward(query, kv_cache, block_table, seq_lens)
        query.zero_()
        return out"""),
    "flips_tf32": REFERENCE + "import torch\ntorch.backends.cuda.matmul.allow_tf32 = True\n",
    "fp32_output": _MODEL_PREAMBLE.format(body="""\
        return super().forward(query, kv_cache, block_table, seq_lens).float()"""),
    "nan_output": _MODEL_PREAMBLE.format(body="""\
        out = super().forward(query, kv_cache, block_table, seq_lens)
        return out * float("nan")"""),
    "caches_output": _MODEL_PREAMBLE.format(body="""\
        if not hasattr(self, "_memo"):
            self._memo = {}
        key = tuple(query.shape)
        if key not in self._memo:
            self._memo[key] = super().forward(query, kv_cache, block_table, seq_lens)
        return self._memo[key]"""),
    "sdpa_alias": _MODEL_PREAMBLE.format(body="""\
        attend = getattr(torch.nn.functional, "scaled_dot_" + "product_attention")
        attend(query[:, :, None], query[:, :, None], query[:, :, None])
        return super().forward(query, kv_cache, block_table, seq_lens)"""),
    "slow_import": "import time\ntime.sleep(120)\n",
    # Writes a passing result where the scheduler reads it, then leaves before any check runs.
    "forges_result": _FORGER + "os._exit(0)\n",
    # Replaces the output comparison (everywhere it is bound) with one that always agrees.
    "patches_compare": '''
import sys
import torch
import reference
import kernelboard.eval.correctness as c

_agree = lambda *a, **k: c.Verdict(True, "ok", 0.0)
for module in list(sys.modules.values()):
    if getattr(module, "compare", None) is c.compare:
        module.compare = _agree
c.compare = _agree


class Model(reference.Model):
    def forward(self, query, kv_cache, block_table, seq_lens):
        return torch.zeros_like(query)
''',
    # Overwrites the grader's reference outputs in memory with zeros, then returns zeros.
    "rewrites_references": '''
import gc
import torch
import reference

for obj in gc.get_objects():
    if type(obj).__name__ == "Check":
        obj.ref_out.zero_()
    elif type(obj).__name__ == "ShapePlan":
        for ref in obj.timing_refs:
            ref.zero_()


class Model(reference.Model):
    def forward(self, query, kv_cache, block_table, seq_lens):
        return torch.zeros_like(query)
''',
    # A sidecar named like a module the grader imports (yaml): forges a result if ever imported.
    "shadows_a_grader_module": {
        "solution.py": _MODEL_PREAMBLE.format(body="""\
        return torch.zeros_like(query)"""),
        "yaml.py": _FORGER + "os._exit(0)\n",
    },
    # Honest until the timing loop is well under way, then hands back its previous output.
    "lazy_after_warmup": _MODEL_PREAMBLE.format(body="""\
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls > 17:  # honest for one CPU shape's 15 checks (4 seeds × 3 cases + 3 structural), the op
            # audit's call and the call on new inputs in the last one's memory (grader 0.5.29), then lazy
            return self.last
        self.last = super().forward(query, kv_cache, block_table, seq_lens)
        return self.last"""),
    # Takes over the runner's socket and sends the judge a frame that is not a reply.
    "sends_garbage": REFERENCE + """
import gc
import struct

for obj in gc.get_objects():
    if type(obj).__name__ == "Channel":
        obj.sock.sendall(struct.pack("<Q", 9) + b"not json!")
""",
    "returns_a_list": _MODEL_PREAMBLE.format(body="""\
        return [super().forward(query, kv_cache, block_table, seq_lens)]"""),
    "rate_limited": None,
    "no_solution": None,
}

OUTCOMES = {"rate_limited": "rate_limited", "no_solution": "no_solution"}

EXPECTED = {
    "correct": "pass",
    "wrong": "wrong",
    "segfault": "runtime_error",
    "hang": "timeout",
    "hard_exit": "runtime_error",
    "system_exit": "build_error",
    "syntax_error": "build_error",
    "forbidden": "forbidden",
    "mutates_input": "integrity_violation",
    "flips_tf32": "pass",  # its own process only: named in the verdict, not held against it (0.5.12)
    "fp32_output": "wrong",
    "nan_output": "wrong",
    "caches_output": "wrong",
    "sdpa_alias": "forbidden",
    "slow_import": "timeout",
    "forges_result": "runtime_error",
    "patches_compare": "wrong",
    "rewrites_references": "wrong",
    "shadows_a_grader_module": "wrong",
    "lazy_after_warmup": "wrong",
    "sends_garbage": "runtime_error",
    "returns_a_list": "wrong",
    "rate_limited": "dnf",
    "no_solution": "not_graded",
}


def write_submissions(root: Path) -> Path:
    subs = root / "submissions"
    for name, source in SUBMISSIONS.items():
        folder = subs / name
        folder.mkdir(parents=True)
        files = {"solution.py": source} if isinstance(source, str) else source or {}
        for file_name, text in files.items():
            (folder / file_name).write_text(textwrap.dedent(text))
        (folder / "run.yaml").write_text(
            f"problem: {PROBLEM}\nmodel: test-{name}\nharness: pytest\n"
            f"agent_outcome: {OUTCOMES.get(name, 'completed')}\n"
            + ("outcome_note: HTTP 429 from the provider\n" if name == "rate_limited" else "")
        )
    return subs


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory,
           measured_baselines: MeasuredBaselines) -> tuple[Path, dict[str, dict]]:
    root = tmp_path_factory.mktemp("eval")
    subs = write_submissions(root)
    measured_baselines.copy_into(root / "results", [PROBLEM], rep_ms=20.0)
    opts = EvalOptions(deck=DECK, submissions=subs, out=root / "results", device="cpu",
                       timeout_s=30.0, build_timeout_s=10.0, rep_ms=20.0)
    rows = run_eval(opts)
    return root, {r["run_id"]: r for r in rows}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_submission_gets_its_own_status(graded, name: str) -> None:
    _, rows = graded
    assert rows[name]["status"] == EXPECTED[name], rows[name]["message"]


def test_a_pass_carries_speedups_and_cpu_label(graded) -> None:
    _, rows = graded
    row = rows["correct"]
    assert row["speedup_vs_compile"] > 0 and row["speedup_vs_eager"] > 0
    assert row["timer"] == "cpu_wall" and row["device_name"].startswith("CPU")
    assert row["peak_fraction"] is None  # no datasheet peaks for a CPU: no fraction, never 0
    assert len(row["seeds"]) == 4  # the deck's three plus a fresh one


def test_failures_explain_themselves(graded) -> None:
    _, rows = graded
    assert "ragged_lengths" in rows["wrong"]["message"] or "out of tolerance" in rows["wrong"]["message"]
    assert "SIGSEGV" in rows["segfault"]["message"]
    assert "killed after" in rows["hang"]["message"]
    flipped = rows["flips_tf32"]["message"]  # a pass that names what it flipped (it reaches its own process only)
    assert "and on every timed call; it changed torch's global switches (" in flipped
    assert "matmul.allow_tf32: False -> True" in flipped
    assert "wrote into input 0" in rows["mutates_input"]["message"]
    assert "dtype float32" in rows["fp32_output"]["message"]
    assert "NaN" in rows["nan_output"]["message"]
    assert "timed call" in rows["caches_output"]["message"] or "out of tolerance" in rows["caches_output"]["message"]
    assert "scaled_dot_product_attention" in rows["forbidden"]["message"]
    assert "429" in rows["rate_limited"]["message"]
    assert "forbidden aten ops ran: aten::_scaled_dot_product" in rows["sdpa_alias"]["message"]
    assert "phase 'build' ran past its 10 s budget" in rows["slow_import"]["message"]
    assert "in phase 'correctness'" in rows["hang"]["message"]


def test_hard_exit_after_printing_pass_is_not_a_pass(graded) -> None:
    root, rows = graded
    assert rows["hard_exit"]["speedup_vs_compile"] is None
    log = (root / "results" / rows["hard_exit"]["log_path"]).read_text()
    assert "PASS" in log  # the candidate's stdout went to the log, and was never parsed


def test_each_worker_log_counts_its_own_seconds(graded) -> None:
    """A worker log's stamps count from that worker's start: never past the grading's own seconds, also for
    the judges forked late in the batch from a zygote started long before (whose import-time clock a forked
    judge inherited: an H200 log once began at "+255.5 s")."""
    root, rows = graded
    checked = 0
    for row in rows.values():
        if row["log_path"] is None or row["grade_seconds"] is None:
            continue
        stamps = [float(m) for m in re.findall(r"^\[worker\] .*\(\+([0-9.]+) s\)$",
                                               (root / "results" / row["log_path"]).read_text(), re.MULTILINE)]
        if stamps:
            checked += 1
            assert max(stamps) <= row["grade_seconds"] + 0.1, (row["run_id"], stamps, row["grade_seconds"])
    assert checked >= 5


def test_a_passing_log_splits_each_shapes_correctness_time(graded) -> None:
    """Where a shape's correctness time goes (the runner's calls, reading their outputs, checking the inputs,
    judging the outputs), one line per shape: the figures the grade-time work reads off real GPU logs."""
    root, rows = graded
    row = rows["correct"]
    text = (root / "results" / row["log_path"]).read_text()
    split = re.findall(r"^\[worker\] shape \d+: (\d+) checks: the runner's calls ([0-9.]+) s, their outputs read "
                       r"([0-9.]+) s, inputs checked ([0-9.]+) s, outputs judged ([0-9.]+) s", text, re.MULTILINE)
    assert len(split) == row["n_shapes"] >= 1
    assert all(int(n) >= 4 for n, *_ in split)
    assert sum(float(x) for line in split for x in line[1:]) <= row["grade_seconds"]
    # Each shape's first call is timed apart (a kernel's own compile runs there) and is part of the calls.
    first = [float(s) for s in re.findall(r"^\[worker\] shape \d+: its first call returned in ([0-9.]+) s \(the "
                                          r"solution's own compiles and autotuning run there, untimed\)", text,
                                          re.MULTILINE)]
    assert len(first) == len(split)
    assert all(f <= float(line[1]) + 0.1 for f, line in zip(first, split, strict=True))  # each rounded to 0.1 s
    # This deck forbids ops, so each shape's op-audit call (check 0 again) is said beside the checks' split.
    audits = re.findall(r"; the op audit's call \(check 0 again\) [0-9.]+ s beside them; ", text)
    assert len(audits) == len(split)
    # Every output came through the shape's output area (grader 0.5.17), none over the socket: each check's,
    # the op audit's call and the call on new inputs in the last check's memory (grader 0.5.29).
    ways = re.findall(r"; output tensors read: (\d+) through shared memory, (\d+) as socket frames \(\+", text)
    assert [(int(shared), int(framed)) for shared, framed in ways] == [(int(n) + 2, 0) for n, *_ in split]
    recycled = re.findall(r"^\[worker\] shape \d+: seed \d+ case nominal again at the last check's addresses: "
                          r"(\d+) of (\d+) inputs in the same memory with the same version counter \(\d+ with the same "
                          r"Python id\), correct", text, re.MULTILINE)
    assert recycled == [("4", "4")] * len(split)  # query, kv_cache, block_table, seq_lens


def test_tables_keep_the_contract(graded) -> None:
    root, _ = graded
    tables = load_all(root / "results")
    assert tables["results"].num_rows == len(EXPECTED)
    shapes = tables["shapes"].to_pylist()
    assert {s["run_id"] for s in shapes} == {k for k, v in EXPECTED.items() if v == "pass"}  # passes have shapes
    assert all(s["eager_ms"] > 0 and s["compile_ms"] > 0 for s in shapes)
    baselines = read_table(table_path(root / "results", "cpu", "baselines"), "baselines").to_pylist()
    assert {b["variant"] for b in baselines} == {"eager", "compile:default"}


def test_resume_skips_graded_runs_and_keeps_baselines(graded) -> None:
    root, _ = graded
    baselines = table_path(root / "results", "cpu", "baselines")
    before = baselines.stat().st_mtime_ns
    opts = EvalOptions(deck=DECK, submissions=root / "submissions", out=root / "results", device="cpu",
                       resume=True, only=("correct", "wrong"), rep_ms=20.0)
    assert run_eval(opts) == []
    assert baselines.stat().st_mtime_ns == before


def test_regrade_grades_again_despite_resume(graded) -> None:
    root, rows = graded
    opts = EvalOptions(deck=DECK, submissions=root / "submissions", out=root / "results", device="cpu",
                       resume=True, regrade=True, only=("no_solution",), rep_ms=20.0)
    again = run_eval(opts)
    assert [r["run_id"] for r in again] == ["no_solution"]
    assert again[0]["graded_at"] >= rows["no_solution"]["graded_at"]


def test_cli_reports_a_bad_run_yaml_in_one_line(tmp_path: Path) -> None:
    subs = tmp_path / "subs"
    (subs / "broken").mkdir(parents=True)
    (subs / "broken" / "run.yaml").write_text("problem: 03_paged_attention\nmodel: x\nharness: y\n"
                                              "agent_outcome: exploded\n")
    result = CliRunner().invoke(cli, ["eval", "--deck", str(DECK), "--submissions", str(subs),
                                      "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert result.exit_code == 1
    assert "agent_outcome" in result.output and "exploded" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_cli_only_glob_that_matches_nothing_is_a_usage_error(tmp_path: Path) -> None:
    subs = tmp_path / "subs"
    shutil.copytree(ROOT / "data" / "submissions" / "hard", subs)
    result = CliRunner().invoke(cli, ["eval", "--deck", str(DECK), "--submissions", str(subs),
                                      "--out", str(tmp_path / "out"), "--device", "cpu", "--only", "nope*"])
    assert result.exit_code == 2
    assert "no submissions" in result.output


def test_attacks_on_the_judge_fail_for_the_right_reason(graded) -> None:
    _, rows = graded
    assert "exited with code 0" in rows["forges_result"]["message"]  # the judge's verdict, not the forgery
    assert rows["forges_result"]["speedup_vs_compile"] is None
    for name in ("patches_compare", "rewrites_references", "shadows_a_grader_module"):
        assert "out of tolerance" in rows[name]["message"], rows[name]["message"]
    assert "timed call" in rows["lazy_after_warmup"]["message"]
    assert "the runner broke the protocol" in rows["sends_garbage"]["message"]
    assert "plain torch.Tensor, got a tuple of 1" in rows["returns_a_list"]["message"]
