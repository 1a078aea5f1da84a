"""Grader mechanisms that only a GPU can show. Deselected by default; on a CUDA machine run
`pytest -m gpu tests/test_eval_gpu.py`. Outcomes are recorded in the issue notes."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
import yaml

from kernelboard.eval.schedule import EvalOptions, run_eval
from kernelboard.eval.tables import load_all

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
HOUSE = ROOT / "data" / "submissions" / "hard" / "20261129_190000_house_kernelboard-house_03_paged_attention"

SOURCES = {
    "reference": "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n",
    # The real work (made long: GPU time far above host time) runs on a private stream that the
    # timed stream never waits for.
    "side_stream": """
import torch
import reference

class Model(reference.Model):
    def forward(self, query, kv_cache, block_table, seq_lens):
        if not hasattr(self, "side"):
            self.side = torch.cuda.Stream()
            self.big = torch.randn(4096, 4096, device=query.device)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            out = super().forward(query, kv_cache, block_table, seq_lens)
            for _ in range(10):
                torch.mm(self.big, self.big)
            out.record_stream(self.side)
        return out
""",
    # An out-of-bounds read: a sticky CUDA error that must end this worker, not the batch.
    "illegal_access": """
import torch
import triton
import triton.language as tl
import reference

@triton.jit
def _oob(x_ptr, y_ptr):
    tl.store(y_ptr, tl.load(x_ptr + (1 << 40)))

class Model(reference.Model):
    def forward(self, query, kv_cache, block_table, seq_lens):
        y = torch.empty(1, device=query.device, dtype=query.dtype)
        _oob[(1,)](query, y)
        return super().forward(query, kv_cache, block_table, seq_lens)
""",
}

EXPECTED = {"house": "pass", "illegal_access": "runtime_error", "reference": "forbidden",
            "side_stream": "integrity_violation", "z_house_after": "pass"}


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    root = tmp_path_factory.mktemp("gpu")
    deck = root / "deck" / "03_paged_attention"
    shutil.copytree(ROOT / "eval" / "decks" / "hard" / "03_paged_attention", deck)
    spec = yaml.safe_load((deck / "problem.yaml").read_text())
    spec["shapes"] = spec["shapes"][:2]  # two shapes keep the test short
    (deck / "problem.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    subs = root / "subs"
    for name in ("house", "z_house_after"):
        shutil.copytree(HOUSE, subs / name)
    for name, source in SOURCES.items():
        (subs / name).mkdir(parents=True)
        (subs / name / "solution.py").write_text(textwrap.dedent(source))
        (subs / name / "run.yaml").write_text("problem: 03_paged_attention\nmodel: t\nharness: pytest\n"
                                              "agent_outcome: completed\n")
    rows = run_eval(EvalOptions(deck=root / "deck", submissions=subs, out=root / "out", device="cuda",
                                timeout_s=300.0, rep_ms=100.0))
    return root, {r["run_id"]: r for r in rows}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_status(graded, name: str) -> None:
    _, rows = graded
    assert rows[name]["status"] == EXPECTED[name], rows[name]["message"]


def test_messages_name_the_mechanism(graded) -> None:
    _, rows = graded
    assert "escaped the timed stream" in rows["side_stream"]["message"]
    assert "no kernel of its own ran" in rows["reference"]["message"]
    assert "illegal memory access" in rows["illegal_access"]["message"].lower() or \
        "CUDA" in rows["illegal_access"]["message"]


def test_house_shapes_record_kernels_graph_and_host_times(graded) -> None:
    root, _ = graded
    shapes = [s for s in load_all(root / "out")["shapes"].to_pylist() if s["run_id"] == "house"]
    assert len(shapes) == 2
    for s in shapes:
        assert any("paged" in k for k in s["kernels"]), s["kernels"]
        assert s["host_ms"] > 0
        if s["median_ms"] < 0.2:
            assert s["graph_ms"] is not None and s["graph_ms"] < s["median_ms"]
