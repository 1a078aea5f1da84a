"""The grader end to end on the CPU: one batch of hostile and honest submissions, each of which
must get its own status while the batch completes. Each test is named after what it stops."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

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

# run_id -> solution.py source; None means no solution file at all.
SUBMISSIONS: dict[str, str | None] = {
    "correct": REFERENCE,
    # Attends over every slot of every table page: right only when lengths fill whole pages.
    "wrong": _MODEL_PREAMBLE.format(body="""\
        full = torch.full_like(seq_lens, block_table.shape[1] * kv_cache.shape[1])
        return super().forward(query, kv_cache, block_table, full)"""),
    "segfault": "import ctypes\nctypes.string_at(0)\n",
    "hang": _MODEL_PREAMBLE.format(body="""\
        while True:
            pass"""),
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
    "flips_tf32": "integrity_violation",
    "fp32_output": "wrong",
    "nan_output": "wrong",
    "caches_output": "wrong",
    "sdpa_alias": "forbidden",
    "slow_import": "timeout",
    "rate_limited": "dnf",
    "no_solution": "not_graded",
}


def write_submissions(root: Path) -> Path:
    subs = root / "submissions"
    for name, source in SUBMISSIONS.items():
        folder = subs / name
        folder.mkdir(parents=True)
        if source is not None:
            (folder / "solution.py").write_text(textwrap.dedent(source))
        (folder / "run.yaml").write_text(
            f"problem: {PROBLEM}\nmodel: test-{name}\nharness: pytest\n"
            f"agent_outcome: {OUTCOMES.get(name, 'completed')}\n"
            + ("outcome_note: HTTP 429 from the provider\n" if name == "rate_limited" else "")
        )
    return subs


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    root = tmp_path_factory.mktemp("eval")
    subs = write_submissions(root)
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
    assert "allow_tf32" in rows["flips_tf32"]["message"]
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


def test_tables_keep_the_contract(graded) -> None:
    root, _ = graded
    tables = load_all(root / "results")
    assert tables["results"].num_rows == len(EXPECTED)
    shapes = tables["shapes"].to_pylist()
    assert {s["run_id"] for s in shapes} == {"correct"}
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
