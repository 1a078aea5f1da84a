"""`kernelboard eval compile-ahead`: Triton kernels compiled here for the grading GPU, carried as an archive.

Run on a published kernel no one here wrote (kimi-k2.7's 07), beside one that builds a torch extension at
import and one with no kernel of its own: only the Triton caches travel, under each solution's hash, as
the grader's cache root holds them."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from kernelboard.cli import main as cli
from kernelboard.eval.submission import discover

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "data" / "submissions" / "hard" / "20260618_064723_kimi-claude_kimi-k2.7-code_07_w4a16_gemm"

BUILDS_AT_IMPORT = """\
import triton
from torch.utils.cpp_extension import load_inline

_ext = load_inline("never_here", cpp_sources="int f() { return 1; }", functions=["f"])


@triton.jit
def _unused(x):
    pass
"""
REFERENCE = "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"


def test_only_triton_caches_travel_under_each_solutions_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "12.0")  # this shell's own: --arch wins, and is restored after
    cache_root = os.environ.get("KERNELBOARD_CACHE")
    subs = tmp_path / "subs"
    shutil.copytree(PUBLISHED, subs / PUBLISHED.name)
    for name, source in (("b_builds_at_import", BUILDS_AT_IMPORT), ("c_reference", REFERENCE)):
        (subs / name).mkdir()
        (subs / name / "solution.py").write_text(source)
        (subs / name / "run.yaml").write_text("problem: 07_w4a16_gemm\nmodel: test\nharness: pytest\n"
                                              "agent_outcome: completed\n")
    out = tmp_path / "ahead" / "triton.tgz"
    result = CliRunner().invoke(cli, ["eval", "compile-ahead", "--deck", str(ROOT / "eval" / "decks" / "hard"),
                                      "--submissions", str(subs), "--jobs", "2", "--limit", "120", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 of 3 selected submissions define Triton kernels" in result.output
    assert "not built here" in result.output  # the extension's build was refused, and said so
    with tarfile.open(out) as tar:
        names = tar.getnames()
        metadata = [json.load(tar.extractfile(n)) for n in names  # type: ignore[arg-type]
                    if n.endswith(".json") and not n.split("/")[-1].startswith("__grp__")]
    sha = {s.run_id: s.solution_sha256() for s in discover(subs)[0]}
    assert {n.split("/")[0] for n in names} == {sha[PUBLISHED.name]}  # nothing of the other two
    assert all(n.split("/")[1] == "triton" for n in names)
    assert sum(n.endswith(".cubin") for n in names) >= 3, names
    assert metadata and {m["target"]["arch"] for m in metadata} == {90}
    assert not list(out.parent.glob(".*.part"))
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "12.0" and os.environ.get("KERNELBOARD_CACHE") == cache_root
