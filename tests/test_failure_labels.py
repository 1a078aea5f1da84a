"""A failed build or run whose cause is outside the kernel's reach on this GPU gets a status that is no
score (eval/reproducible.py), and the site names it (CPU only, no torch)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from kernelboard.eval import reproducible
from kernelboard.eval.cutlass_headers import Cutlass, find_cutlass, from_folder
from kernelboard.eval.reproducible import NEEDS_OTHER_ARCH, NOT_REPRODUCIBLE, classify, newer_arch_hits
from kernelboard.eval.schema import STATUSES, UNSCORED_STATUSES
from kernelboard.sitegen import board
from kernelboard.sitegen.load import Result, Run

H200 = "9.0"


def _sub(tmp_path: Path, files: dict[str, str]) -> Path:
    folder = tmp_path / "sub"
    for name, text in {"run.yaml": "problem: x\n", **files}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


PLAIN = "import torch\nclass Model(torch.nn.Module):\n    pass\n"

TCGEN05_KERNEL = '''
from torch.utils.cpp_extension import load_inline
SRC = r"""
__global__ void k(float* out) {
    // allocate tensor memory
    asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], 128;" :: "r"(0));
}
"""
ext = load_inline("k", cpp_sources="", cuda_sources=SRC, extra_cuda_cflags=["-O3"])
'''

PTXAS_TCGEN05 = (
    "Error building extension 'k': [1/2] /usr/local/cuda/bin/nvcc --generate-dependencies-with-compile "
    "-gencode=arch=compute_90,code=sm_90 -O3 -c main.cu -o main.cuda.o\nFAILED: main.cuda.o\n"
    "ptxas /tmp/tmpxft_0001_00000000-6_main.ptx, line 41; error   : Instruction 'tcgen05.alloc' not "
    "supported on .target 'sm_90'\nptxas fatal   : Ptx assembly aborted due to errors\n"
    "ninja: build stopped: subcommand failed.\n"
)


def test_a_ptxas_tcgen05_error_is_needs_other_arch(tmp_path: Path) -> None:
    folder = _sub(tmp_path, {"solution.py": TCGEN05_KERNEL})
    status, message = classify("build_error", "importing solution.py: RuntimeError: Error building extension 'k'",
                               PTXAS_TCGEN05, folder, H200)
    assert status == NEEDS_OTHER_ARCH
    assert message.startswith("needs sm_100a:") and "tcgen05.alloc" in message and "capability 9.0" in message
    assert "solution.py:" in message  # the file and line of the evidence


def test_the_toolchain_naming_the_target_suffices_without_file_evidence(tmp_path: Path) -> None:
    folder = _sub(tmp_path, {"solution.py": PLAIN})
    text = "ptxas error   : Feature '.cta_group::1' requires .target sm_100a or higher"
    status, message = classify("build_error", "importing solution.py: RuntimeError: x", text, folder, H200)
    assert (status, message.split(":")[0]) == (NEEDS_OTHER_ARCH, "needs sm_100a")
    text = "nvcc fatal   : Unsupported gpu architecture 'compute_120a'"
    assert classify("build_error", "m", text, folder, H200)[1].startswith("needs sm_120a")


def test_an_sm100_build_flag_in_code_is_needs_other_arch_when_it_fails(tmp_path: Path) -> None:
    source = ('load_inline("k", cuda_sources=SRC,\n'
              '            extra_cuda_cflags=["-O3", "-gencode=arch=compute_100a,code=sm_100a"])\n')
    folder = _sub(tmp_path, {"solution.py": source})
    runtime = "CUDA error: no kernel image is available for execution on the device"
    status, message = classify("runtime_error", f"calling forward: RuntimeError: {runtime}", "", folder, H200)
    assert status == NEEDS_OTHER_ARCH and message.startswith("needs sm_100a")
    # the file alone decides a failed build (the compiler's words may have been cut off)
    assert classify("build_error", "importing solution.py: RuntimeError: Error building extension 'k'", "",
                    folder, H200)[0] == NEEDS_OTHER_ARCH
    # ... but never on a GPU that runs it, and never when the kernel passed
    assert classify("build_error", "m", "", folder, "10.0") is None
    assert classify("pass", "correct", "", folder, H200) is None
    assert classify("wrong", "shape 0: mismatch", "", folder, H200) is None


def test_a_comment_about_sm100_does_not_excuse_an_unrelated_failure(tmp_path: Path) -> None:
    source = ('# On B200 this would use tcgen05 and -arch=sm_100a; here it is plain CUDA for sm_90.\n'
              'def f():\n    """Faster on sm_100 (tcgen05), see notes."""\n'
              'SRC = r"""\n// tcgen05 would be nicer\n__global__ void k() { undefined_thing(); }\n"""\n')
    folder = _sub(tmp_path, {"solution.py": source, "NOTES.md": "Tried sm_100a first.\n"})
    hits, _ = newer_arch_hits(folder, 90)
    assert hits and not any(h.code for h in hits)  # all in comments, docstrings or prose
    compile_error = ("Error building extension 'k': main.cu(2): error: identifier \"undefined_thing\" is undefined\n"
                     "1 error detected in the compilation of \"main.cu\".")
    assert classify("build_error", "importing solution.py: RuntimeError: Error building extension 'k'",
                    compile_error, folder, H200) is None
    assert classify("runtime_error", "calling forward: IndexError: list index out of range", "", folder, H200) is None


def test_a_kernel_that_also_targets_this_gpu_is_not_excused_by_its_files(tmp_path: Path) -> None:
    source = 'FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_100a,code=sm_100a"]\n'
    folder = _sub(tmp_path, {"solution.py": source})
    assert classify("build_error", "importing solution.py: RuntimeError: Error building extension 'k'",
                    "main.cu(3): error: expected a \";\"", folder, H200) is None


def test_a_genuine_compile_error_stays_a_build_error(tmp_path: Path) -> None:
    folder = _sub(tmp_path, {"solution.py": PLAIN})
    text = ("Error building extension 'k': [1/2] nvcc -gencode=arch=compute_90a,code=sm_90a -c main.cu\n"
            "main.cu(12): error: identifier \"foo\" is undefined\n1 error detected\nninja: build stopped")
    assert classify("build_error", "importing solution.py: RuntimeError: Error building extension 'k'", text,
                    folder, H200) is None
    # a missing system header is the build's own problem, not a missing published file
    text = "main.cu:1:10: fatal error: cuda_bf16.h: No such file or directory"
    assert classify("build_error", "m", text, folder, H200) is None


def test_a_missing_cutlass_header(tmp_path: Path) -> None:
    folder = _sub(tmp_path, {"solution.py": PLAIN})
    text = ("Error building extension 'g': [1/2] nvcc -c gemm.cu\nFAILED: gemm.cuda.o\n"
            "gemm.cu:3:10: fatal error: cutlass/gemm/device/gemm_universal_adapter.h: No such file or directory\n"
            "compilation terminated.\n")
    status, message = classify("build_error", "importing solution.py: RuntimeError: Error building extension 'g'",
                               text, folder, H200, cutlass=None)
    assert status == "not_graded" and "nvidia-cutlass" in message  # the grader's lack, not the kernel's
    have = Cutlass(tmp_path / "c", (tmp_path / "c" / "include",), "4.2.0", "test")
    status, message = classify("build_error", "m", text, folder, H200, cutlass=have)
    assert status == NOT_REPRODUCIBLE and "cutlass/gemm/device/gemm_universal_adapter.h" in message
    assert message.startswith("not reproducible from the published files")


def test_a_missing_vendored_header_and_one_that_is_there(tmp_path: Path) -> None:
    folder = _sub(tmp_path, {"solution.py": PLAIN, "kernels/common.cuh": "// here\n"})
    text = 'gemm.cu:2:10: fatal error: my_vendored/tile_config.cuh: No such file or directory'
    status, message = classify("build_error", "m", text, folder, H200)
    assert status == NOT_REPRODUCIBLE and "my_vendored/tile_config.cuh" in message
    text = 'gemm.cu:2:10: fatal error: common.cuh: No such file or directory'  # shipped: an include path bug
    assert classify("build_error", "m", text, folder, H200) is None


PUBLISHED = Path(__file__).resolve().parents[1] / "data" / "submissions" / "hard"
#: LongCat-2.0 06 082519's row on the H100 under grader 0.5.17 (2026-12-06), its message's start: the judge ran out of
#: memory beside a runner of 38.5 GB (fixed in 0.5.18).
LONGCAT_JUDGE_OOM = ("grader error in phase correctness: OutOfMemoryError: CUDA out of memory. Tried to allocate "
                     "1024.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 40.56 MiB is free.")
STOCK = Cutlass(Path("/opt/cutlass"), (Path("/opt/cutlass/include"),), "4.2.0", "test")

VENDORING = '''
import os
from pathlib import Path
from torch.utils.cpp_extension import load
{comment}
def ext():
    root = Path(__file__).resolve().parent
    inc = os.path.join(str(root), "cutlass", "include")
    return load(name="w4", sources=[str(root / "k.cu")], extra_include_paths=[inc, str(root / "util")])
'''
CUTLASS_CU = '#include "cutlass/cutlass.h"\n#include "cute/tensor.hpp"\n'


def test_a_published_kernel_built_against_the_graders_cutlass_in_place_of_its_customized_one() -> None:
    """gpt-5.6-sol's 07 (2026-07-21) adds cutlass/include beside itself, unpublished, and says its CUTLASS's
    zero-point transform was customized; with stock CUTLASS 4.2.0 every output of shape 1 was off (H100)."""
    folder = PUBLISHED / "20260721_150450_codex_gpt-5.6-sol_07_w4a16_gemm"
    wrong = "shape 1 (small prefill) seed 42 case nominal: 393039 of 393216 elements out of tolerance"
    status, message = classify("wrong", wrong, "", folder, H200, cutlass=STOCK)
    assert status == NOT_REPRODUCIBLE
    assert "cutlass/include beside solution.py" in message and "solution.py:50" in message
    assert "CUTLASS 4.2.0" in message and "customized CUTLASS" in message and message.endswith(wrong)
    assert classify("wrong", wrong, "", folder, H200, cutlass=None) is None  # no stand-in: its own failure


def test_a_missing_cutlass_folder_alone_does_not_excuse_a_wrong_output() -> None:
    """claude-fable-5's 07 (2026-07-03) also names an unpublished cutlass/include, for large M only; it
    fails at M = 1 on its own mma.sync path, and its files do not call their CUTLASS changed."""
    folder = PUBLISHED / "20260703_200159_claude_claude-fable-5_07_w4a16_gemm"
    assert reproducible.vendored_cutlass_missing(folder) is not None
    assert classify("wrong", "shape 0 (decode) seed 42 case small_scales: …", "", folder, H200, cutlass=STOCK) is None


def test_a_vendored_cutlass_folder_that_was_published_excuses_nothing(tmp_path: Path) -> None:
    folder = _sub(tmp_path, {"solution.py": VENDORING.format(comment="# our customized CUTLASS epilogue"),
                             "k.cu": CUTLASS_CU, "cutlass/include/cutlass/cutlass.h": "// vendored\n"})
    assert reproducible.vendored_cutlass_missing(folder) is None
    assert classify("wrong", "m", "", folder, H200, cutlass=STOCK) is None


def test_a_failure_is_the_stand_in_cutlass_only_where_the_evidence_names_cutlass(tmp_path: Path) -> None:
    folder = _sub(tmp_path, {"solution.py": VENDORING.format(comment=""), "k.cu": CUTLASS_CU})
    found = reproducible.vendored_cutlass_missing(folder)
    assert found is not None and found.folder == "cutlass/include" and found.changed is None
    cutlass_error = ("[1/2] nvcc -I/tmp/w/cutlass/include -c k.cu\nFAILED: k.cuda.o\n"
                     "k.cu(40): error: namespace \"cutlass::gemm\" has no member \"KernelTmaWarpSpecialized\"")
    status, message = classify("build_error", "Error building extension 'w4'", cutlass_error, folder, H200,
                               cutlass=STOCK)
    assert status == NOT_REPRODUCIBLE and "cutlass/include" in message
    own_error = "[1/2] nvcc -I/tmp/w/cutlass/include -c k.cu\nFAILED: k.cuda.o\nk.cu(12): error: identifier \"acc\""
    assert classify("build_error", "Error building extension 'w4'", own_error, folder, H200,
                    cutlass=STOCK) is None  # its own code's error (the command line's -I names cutlass)
    assert classify("wrong", "m", "", folder, H200, cutlass=STOCK) is None  # no word of a changed CUTLASS
    plain = _sub(tmp_path / "p", {"solution.py": VENDORING.format(comment="# customized CUTLASS mainloop"),
                                  "k.cu": "__global__ void k() {}\n"})
    assert reproducible.vendored_cutlass_missing(plain) is None  # no CUTLASS header: the folder was not used


def test_a_missing_sidecar_module(tmp_path: Path) -> None:
    folder = _sub(tmp_path, {"solution.py": "from gemm_backend_v3 import ext\n"})
    status, message = classify("build_error", "importing solution.py: ModuleNotFoundError: No module named "
                               "'gemm_backend_v3'", "No module named 'gemm_backend_v3'", folder, H200)
    assert status == NOT_REPRODUCIBLE and "gemm_backend_v3" in message
    # a library the grader lacks is not a file the submission should have carried
    assert classify("build_error", "importing solution.py: ModuleNotFoundError: No module named 'flashinfer'",
                    "No module named 'flashinfer'", folder, H200) is None
    # nor is a module the submission ships
    (folder / "gemm_backend_v3.py").write_text("ext = None\n")
    assert classify("build_error", "m", "No module named 'gemm_backend_v3'", folder, H200) is None


def test_a_helper_of_the_original_reference(tmp_path: Path) -> None:
    """deepseek-v4-pro's published Mega kernel reads `_rmsnorm` from KernelBench-Mega's reference.py;
    the deck's reference is written from the problem's definition and has no such helper."""
    run = "20260618_150605_deepseek-claude_deepseek-v4-pro_02_kimi_linear_decode"
    folder = Path(__file__).parents[1] / "data" / "submissions" / "mega" / run
    error = "AttributeError: module 'reference' has no attribute '_rmsnorm'. Did you mean: 'rmsnorm'?"
    status, message = classify("build_error", f"importing solution.py: {error}", error, folder, H200)
    assert status == NOT_REPRODUCIBLE and "reference._rmsnorm" in message
    # the name must be the solution's own use, not only the error text's (a forged message proves nothing)
    plain = _sub(tmp_path, {"solution.py": PLAIN})
    assert classify("build_error", f"importing solution.py: {error}", error, plain, H200) is None
    # nor does it excuse another module's missing name
    other = error.replace("'reference'", "'torch'")
    assert classify("build_error", f"importing solution.py: {other}", other, folder, H200) is None


def test_a_file_expected_beside_the_solution(tmp_path: Path) -> None:
    folder = _sub(tmp_path, {"solution.py": 'load(sources=[os.path.join(HERE, "fp8_gemm.cu")])\n'})
    ran_in = tmp_path / "scratch" / "run1"
    text = f"[Errno 2] No such file or directory: '{ran_in}/fp8_gemm.cu'"
    status, message = classify("build_error", f"importing solution.py: FileNotFoundError: {text}", text, folder,
                               H200, ran_in=ran_in)
    assert status == NOT_REPRODUCIBLE and "fp8_gemm.cu" in message


def test_a_hard_coded_nvcc_that_this_machine_lacks(tmp_path: Path) -> None:
    nvcc = "/usr/bin/nvcc-kernelboard-test-absent"
    source = f'import os\nos.environ["PYTORCH_NVCC"] = "{nvcc}"\nfrom torch.utils.cpp_extension import load_inline\n'
    folder = _sub(tmp_path, {"solution.py": source})
    text = f"[Errno 2] No such file or directory: '{nvcc}'"
    status, message = classify("build_error", f"importing solution.py: FileNotFoundError: {text}", text, folder, H200)
    assert status == NOT_REPRODUCIBLE and nvcc in message
    ninja = f"Error building extension 'k': [1/2] {nvcc} -c k.cu\nFAILED: k.cuda.o\n/bin/sh: 1: {nvcc}: not found\n"
    assert classify("build_error", "m", ninja, folder, H200)[0] == NOT_REPRODUCIBLE
    # the shell's complaint cut off with the error text: the assignment in the source still says it
    assert classify("build_error", "m", "Error building extension 'k': [1/2] " + "x" * 300, folder, H200)[0] \
        == NOT_REPRODUCIBLE


def test_the_submission_scan_reads_every_text_file(tmp_path: Path) -> None:
    folder = _sub(tmp_path, {
        "solution.py": PLAIN,
        "csrc/gemm.cu": ("// plain\n#if __CUDA_ARCH__ >= 1000\n"
                         "  asm(\"tcgen05.mma.cta_group::1.kind::f16 ...\");\n#endif\n"),
        "build.sh": "nvcc -arch=sm_120a gemm.cu\n",
        "blob.bin": "",
    })
    (folder / "blob.bin").write_bytes(b"\0sm_100a\0")
    (folder / "run.yaml").write_text("notes: sm_100a\n")
    hits, targets_own = newer_arch_hits(folder, 90)
    found = {(h.file, h.arch, h.code) for h in hits}
    assert ("csrc/gemm.cu", "sm_100", True) in found  # the __CUDA_ARCH__ gate
    assert ("csrc/gemm.cu", "sm_100a", True) in found  # tcgen05 / cta_group::
    assert ("build.sh", "sm_120a", True) in found
    assert not any(h.file in ("blob.bin", "run.yaml") for h in hits) and not targets_own
    assert not newer_arch_hits(folder, 100)[0] or all(h.arch == "sm_120a" for h in newer_arch_hits(folder, 100)[0])


@pytest.mark.parametrize(("arch", "own", "family", "ok"), [
    ("sm_100", 90, False, False), ("sm_90", 100, False, True), ("sm_100a", 100, False, True),
    ("sm_100a", 103, False, False), ("sm_100f", 103, False, True), ("sm_100a", 120, True, False),
    ("sm_100a", 103, True, True),
])
def test_which_targets_run_where(arch: str, own: int, family: bool, ok: bool) -> None:
    assert reproducible.runs_on(arch, own, family) is ok


# ------------------------------------------------------------------------------ CUTLASS headers


def _wheel(root: Path) -> Path:
    inc = root / "cutlass_library" / "source" / "include"
    (inc / "cutlass").mkdir(parents=True)
    (inc / "cute").mkdir()
    (inc / "cutlass" / "cutlass.h").write_text("// header\n")
    (inc / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n"
                                               "#define CUTLASS_PATCH 0\n")
    (root / "cutlass_library" / "source" / "tools" / "util" / "include" / "cutlass" / "util").mkdir(parents=True)
    return inc


def test_cutlass_from_an_environment_variable_reaches_the_build_and_the_sandbox(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelboard.eval import jail, sandbox

    inc = _wheel(tmp_path / "unpacked")
    monkeypatch.setenv("KERNELBOARD_CUTLASS", str(tmp_path / "unpacked"))
    monkeypatch.setenv("CPATH", "/opt/other")
    found = find_cutlass()
    assert found is not None and found.includes[0] == inc.resolve() and found.version == "4.2.0"
    assert found.includes[1].name == "include" and "util" in str(found.includes[1])
    env = sandbox.worker_env("key")
    assert env["CPATH"].split(":") == [str(inc.resolve()), str(found.includes[1]), "/opt/other"]
    assert env["CPLUS_INCLUDE_PATH"].split(":")[0] == str(inc.resolve())
    assert env["CUTLASS_PATH"] == str(inc.resolve().parent)
    assert "CPATH" in jail.JAIL_ENV and "4.2.0" in sandbox.cutlass_line()
    monkeypatch.setattr(jail, "find_bwrap", lambda: ("/usr/bin/bwrap", "0.8.0"))
    cell = jail.make_jail(sandboxed=True, device="cpu", hide=[])
    assert str(found.root) in cell.readonly  # outside what the sandbox shows: bound read-only
    argv = jail.bwrap_argv(cell, writable=[tmp_path / "w"], cwd=tmp_path / "w")
    assert ["--ro-bind-try", str(found.root), str(found.root)] == argv[argv.index(str(found.root)) - 1:][:3]


def test_cutlass_folder_layouts(tmp_path: Path) -> None:
    inc = _wheel(tmp_path / "site")
    for folder in (tmp_path / "site", tmp_path / "site" / "cutlass_library",
                   tmp_path / "site" / "cutlass_library" / "source", inc):
        found = from_folder(folder, "t")
        assert found is not None and found.includes[0] == inc.resolve()
    assert from_folder(tmp_path / "nothing", "t") is None


# ------------------------------------------------------------------------------ the site


def _result(status: str, message: str) -> Result:
    return Result(run_id="r", gpu="h200", status=status, message=message, speedup_vs_compile=None,
                  speedup_vs_eager=None, peak_fraction=None, peak_fraction_measured=None, compile_variant=None,
                  n_shapes=0, timer="cuda_event", device_name="NVIDIA H200", driver_version=None, cuda_version=None,
                  torch_version=None, triton_version=None, python_version=None,
                  graded_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), grader_version="0",
                  measured_by="kernelboard 0", seeds=None, grade_seconds=None, log_path=None)


def test_every_status_has_a_label_help_and_tone() -> None:
    assert {"needs_other_arch", "not_reproducible"} <= set(STATUSES)
    assert set(STATUSES) >= UNSCORED_STATUSES
    for table in (board.STATUS_LABELS, board.STATUS_HELP, board.STATUS_TONES):
        assert set(table) == set(STATUSES)
    assert board.STATUS_LABELS["not_reproducible"] == "not reproducible from the published files"
    assert board.STATUS_TONES["needs_other_arch"] == board.STATUS_TONES["not_graded"]


def test_the_label_names_the_architecture_found() -> None:
    assert board.status_label(_result("needs_other_arch", "needs sm_100a: x — y")) == "needs sm_100a"
    assert board.status_label(_result("needs_other_arch", "needs sm_120: x")) == "needs sm_120"
    assert board.status_label(_result("needs_other_arch", "odd message")) == "needs sm_100"
    assert board.status_label(_result("not_reproducible", "n")) == "not reproducible from the published files"
    assert board.status_label(_result("build_error", "needs sm_100a")) == "build error"


def _cell(status: str, share: float | None = None) -> board.Cell:
    run = Run.__new__(Run)
    return board.Cell(run, _result(status, "needs sm_100a: t" if status == "needs_other_arch" else "m"), share,
                      False)


def test_unscored_cells_are_never_a_zero_and_never_ranked() -> None:
    cells = [_cell("pass", 1.0), _cell("needs_other_arch"), _cell("not_reproducible"), _cell("build_error")]
    score, passes, counted = board.score(cells)
    assert (score, passes, counted) == (0.5, 1, 2)  # the pass and the build error count; the others do not
    assert cells[1].label == "needs sm_100a" and cells[1].unscored and not cells[3].unscored
    assert board.score([_cell("needs_other_arch"), _cell("not_reproducible"), _cell("dnf")]) == (None, 0, 0)


def test_resume_grades_again_a_failure_the_stand_in_rule_now_relabels(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The committed H100 SXM rows, with gpt-5.6-sol 07 150450's row as grader 0.5.9 wrote it (a `wrong`;
    0.5.13 graded it again on 2026-12-06: `not_reproducible`): that `wrong` is not current under 0.5.10 (its
    run goes back to the GPU), and the row that replaced it is; claude-fable-5 07 200159's `wrong`, the same
    folder missing, stays."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kernelboard.eval import schedule

    sol = "20260721_150450_codex_gpt-5.6-sol_07_w4a16_gemm"
    out = tmp_path / "out"
    shutil.copytree(PUBLISHED.parents[1] / "results" / "h100-sxm", out / "h100-sxm",
                    ignore=shutil.ignore_patterns("logs"))
    opts = schedule.EvalOptions(deck=Path("eval/decks/hard"), submissions=PUBLISHED, out=out)
    monkeypatch.setattr(schedule, "find_cutlass", lambda: STOCK)
    assert sol in schedule._graded_solutions(opts, "h100-sxm")  # today's not_reproducible is current
    path = out / "h100-sxm" / "results.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    row = next(r for r in rows if r["run_id"] == sol)
    assert row["status"] == "not_reproducible" and row["grader_version"] == "0.5.13"
    row.update(status="wrong", grader_version="0.5.9", measured_by="kernelboard 0.5.9",
               message="shape 1 (small prefill) seed 42 case nominal: 393039 of 393216 elements out of tolerance "
                       "(atol=0.1, rtol=0.1); max abs diff 1319, max rel diff 7.955e+07, worst at (6, 4481): got "
                       "1320, expected 1.13281; ‖d‖/‖ref‖=305")  # as 0.5.9 wrote it (commit 220a975)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    monkeypatch.setattr(schedule, "find_cutlass", lambda: None)  # no CUTLASS: none stood in, nothing moves
    before = schedule._graded_solutions(opts, "h100-sxm")
    monkeypatch.setattr(schedule, "find_cutlass", lambda: STOCK)
    graded = schedule._graded_solutions(opts, "h100-sxm")
    assert set(before) - set(graded) == {sol}
    assert "20260703_200159_claude_claude-fable-5_07_w4a16_gemm" in graded


def test_resume_grades_again_a_run_the_grader_failed_to_grade(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """06 on the H100 (data/results): LongCat-2.0 082519 was `not_graded` under grader 0.5.17 by the judge's own
    out-of-memory error (its row as recorded then, put back in a copy of the board) and goes back to the GPU, as
    it did on 2026-12-06 (a pass under 0.5.22); claude-fable-5 155728's (no solution.py) is the submission's and
    stands, as every verdict does."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kernelboard.eval import schedule

    board = tmp_path / "results"
    shutil.copytree(PUBLISHED.parents[1] / "results" / "h100-sxm", board / "h100-sxm")
    failed = "20260707_082519_longcat-claude_LongCat-2.0_06_sonic_moe_swiglu"
    table = pq.read_table(board / "h100-sxm" / "results.parquet")
    rows = table.to_pylist()
    for row in rows:
        if row["run_id"] == failed:
            row.update(status="not_graded", grader_version="0.5.17", message=LONGCAT_JUDGE_OOM,
                       **dict.fromkeys(("speedup_vs_compile", "speedup_vs_eager", "speedup_vs_baseline",
                                        "peak_fraction", "peak_fraction_measured")))
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), board / "h100-sxm" / "results.parquet")
    opts = schedule.EvalOptions(deck=Path("eval/decks/hard"), submissions=PUBLISHED, out=board)
    monkeypatch.setattr(schedule, "find_cutlass", lambda: None)
    graded = schedule._graded_solutions(opts, "h100-sxm")
    by_run = {r["run_id"]: r for r in rows}
    assert {run for run in by_run if run.endswith("_06_sonic_moe_swiglu")} - set(graded) == {failed}
    no_solution = "20260702_155728_claude_claude-fable-5_06_sonic_moe_swiglu"
    assert by_run[no_solution]["status"] == "not_graded" and no_solution in graded
    assert schedule.gives_verdict("not_graded", "06_sonic_moe_swiglu has no shapes for --device cpu")
    assert not schedule.gives_verdict("not_graded", "could not start the runner's sandbox: OSError: bwrap")
