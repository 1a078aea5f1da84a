"""Which launched kernels are the candidate's own, told by where they come from (origins.own_kernels,
collected in the runner) rather than by name, and the own-kernel rule that reads it
(audit.kernel_problems). CPU only: the profiler's kernel names are written out as an H200 reports
them, the Triton functions are defined but never launched, and the shared object is a tiny one
compiled here with gcc."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from kernelboard.eval import origins
from kernelboard.eval.audit import kernel_problems
from kernelboard.eval.deck import Problem, load_problem
from kernelboard.eval.origins import (
    KernelOrigins,
    OwnCode,
    candidate_folders,
    demangle_all,
    is_own,
    mangled_base,
    own_kernels,
)
from kernelboard.eval.plan import import_file

HARD = Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard"

#: Mangled names a candidate's extension holds (host stubs, registration strings) and how the
#: profiler names the kernels they launch.
OWN_PLAIN = ("_Z14gemv_w4_kernelPKjPf", "gemv_w4_kernel(unsigned int const*, float*)")
OWN_CUTLASS = ("_ZN7cutlass13device_kernelIN4mine4GemmEEEvNT_6ParamsE",
               "void cutlass::device_kernel<mine::Gemm>(mine::Gemm::Params)")
OWN_ANONYMOUS = ("_ZN12_GLOBAL__N_16reduceILi4EEEvPf", "void (anonymous namespace)::reduce<4>(float*)")
#: Kernels of PyTorch and cuBLAS, as named on an H200 (torch 2.11).
CUBLAS_GEMV = ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, "
               "false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, "
               "cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, "
               "float> >(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, "
               "cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, "
               "float>, float, float)")
NVJET = "nvjet_tst_128x256_64x4_2x1_v_bz_TNT"
TORCH_CUTLASS = "void cutlass::device_kernel<at::cuda::detail::Gemm>(at::cuda::detail::Gemm::Params)"
TORCH_FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
              "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)")
LIBRARY = [CUBLAS_GEMV, NVJET, TORCH_CUTLASS, TORCH_FILL, "Memcpy DtoD (Device -> Device)"]


def _code(*mangled: str) -> OwnCode:
    code = OwnCode()
    symbols = list(mangled)
    done, _ = demangle_all(symbols)
    origins._add_symbols(code, symbols, done)
    return code


# ------------------------------------------------------------------------------ matching


def test_profiler_names_match_demangled_symbols_in_template_and_plain_forms() -> None:
    code = _code(OWN_PLAIN[0], OWN_CUTLASS[0], OWN_ANONYMOUS[0])
    for name in (OWN_PLAIN[1], OWN_CUTLASS[1], OWN_ANONYMOUS[1],
                 "void cutlass::device_kernel<mine::Gemm>",  # a name recorded without its parameters
                 "void cutlass::device_kernel< mine::Gemm >( mine::Gemm::Params )",  # spacing differs
                 "gemv_w4_kernel"):  # the plain name alone
        assert is_own(name, code), name


def test_a_kernel_the_profiler_leaves_mangled_matches_its_symbol_where_the_demangler_does_not_fail() -> None:
    """The profiler names a CUTLASS 3 instantiation of a candidate's extension by its mangled symbol
    (H100 SXM, 2026-12-07: `_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIN4cute5tuple…`,
    deepseek-v4-flash 01 190837), where c++filt demangles the same symbol in the candidate's binary:
    it is its own by the mangled form; another instantiation's mangled name is not."""
    code = _code(OWN_PLAIN[0], OWN_CUTLASS[0])
    assert OWN_CUTLASS[0] in demangle_all([OWN_CUTLASS[0]])[0]  # the binary's symbol demangles
    assert is_own(OWN_CUTLASS[0], code)
    assert is_own(OWN_PLAIN[0], code)
    assert not is_own("_ZN7cutlass13device_kernelIN2at4cuda6detail4GemmEEEvNT_6ParamsE", code)  # torch's


def test_a_candidate_kernel_named_like_a_library_is_its_own_and_the_library_is_not() -> None:
    code = _code(OWN_PLAIN[0], OWN_CUTLASS[0])
    assert is_own(OWN_PLAIN[1], code)  # `gemv…`: a cuBLAS prefix, but built from its code
    assert is_own(OWN_CUTLASS[1], code)  # its own CUTLASS instantiation
    for name in LIBRARY:  # torch's CUTLASS kernel shares the template, not the instantiation
        assert not is_own(name, code), name


def test_without_a_demangler_the_bare_name_of_a_plain_kernel_still_matches() -> None:
    assert mangled_base(OWN_PLAIN[0]) == ("gemv_w4_kernel", False)
    assert mangled_base(OWN_CUTLASS[0]) == ("cutlass::device_kernel", True)
    assert mangled_base(OWN_ANONYMOUS[0]) == ("(anonymous namespace)::reduce", True)
    assert mangled_base("_Zjunk") is None
    code = OwnCode()
    origins._add_symbols(code, [OWN_PLAIN[0], OWN_CUTLASS[0]], {})
    assert is_own(OWN_PLAIN[1], code)
    assert not is_own(TORCH_CUTLASS, code)  # a template is never matched by its bare name


def test_both_demanglers_agree_with_the_profilers_spelling() -> None:
    symbols = [OWN_PLAIN[0], OWN_CUTLASS[0], "not_mangled"]
    done, tool = demangle_all(symbols)
    assert done == {OWN_PLAIN[0]: OWN_PLAIN[1], OWN_CUTLASS[0]: OWN_CUTLASS[1]}
    assert tool == ("c++filt" if shutil.which("c++filt") else "__cxa_demangle")
    demangle = origins._cxa_demangle()
    assert demangle is not None and demangle(OWN_CUTLASS[0]) == OWN_CUTLASS[1] and demangle("junk") is None


# ------------------------------------------------------------------------------ collecting


def _solution(tmp_path: Path, files: dict[str, str]) -> Path:
    folder = tmp_path / "solution"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text))
    return folder


def test_triton_functions_defined_in_its_files_are_its_own(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    folder = _solution(tmp_path, {
        "sidecar.py": """\
            import triton
            import triton.language as tl


            @triton.autotune(configs=[triton.Config({"BLOCK": 64})], key=["n"])
            @triton.jit
            def gemv_w4_triton(x, n, BLOCK: tl.constexpr):  # a cuBLAS-like name, its own kernel
                pass
            """,
        "solution.py": """\
            import triton
            import triton.language as tl
            from sidecar import gemv_w4_triton  # noqa: F401


            def make():
                @triton.heuristics({"BLOCK": lambda args: 64})
                @triton.jit
                def _inner_made_later(x, BLOCK: tl.constexpr):
                    pass
                return _inner_made_later


            KEEP = make()
            """})
    monkeypatch.syspath_prepend(str(folder))
    for name in ("sidecar", "solution"):  # put back (or removed) after the test
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        del sys.modules[name]
    import_file("solution", folder / "solution.py")
    import triton

    @triton.jit
    def not_its_own(x):  # defined in this test file: not under any of the candidate's folders
        pass

    code = KernelOrigins(folder).code()
    assert code is not None
    assert {"gemv_w4_triton", "_inner_made_later"} <= code.identifiers
    assert "not_its_own" not in code.identifiers
    own, origin = own_kernels(["gemv_w4_triton", "_inner_made_later", "not_its_own", NVJET], KernelOrigins(folder))
    assert own == ["gemv_w4_triton", "_inner_made_later"] and "Triton functions" in origin


def test_global_names_and_identifiers_of_its_sources_are_its_own(tmp_path: Path) -> None:
    folder = _solution(tmp_path, {"solution.py": '''\
        SOURCE = r"""
        template <int BM> __global__ void __launch_bounds__(256) tiled_w4(const float* x) {}
        extern "C" {
        #define DEFK(BM, name) __global__ void __launch_bounds__(256) name(const float* x) { tiled_w4<BM>(x); }
        DEFK(16, k4_bm16)
        }
        """
        '''})
    own, _ = own_kernels(["void tiled_w4<16>(float const*)", "k4_bm16", "void at::native::tiled_w4<16>(float const*)",
                          NVJET], KernelOrigins(folder))
    assert own == ["void tiled_w4<16>(float const*)", "k4_bm16"]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_symbols_of_a_shared_object_built_from_its_code_and_mapped_are_its_own(tmp_path: Path) -> None:
    folder = _solution(tmp_path, {"names.c": f"""\
        const char *kernel_names[] = {{"{OWN_PLAIN[0]}", "{OWN_CUTLASS[0]}"}};
        int names_count(void) {{ return 2; }}
        """})
    library = folder / "build" / "libnames.so"
    library.parent.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(folder / "names.c")], check=True)
    (folder / "names.c").unlink()  # no source left to read: only the mapped binary can say
    origins = KernelOrigins(folder)
    assert own_kernels([OWN_PLAIN[1], OWN_CUTLASS[1]], origins)[0] == []  # built but not loaded
    lib = ctypes.CDLL(str(library))
    assert lib.names_count() == 2
    own, origin = own_kernels([OWN_PLAIN[1], OWN_CUTLASS[1], *LIBRARY], origins)
    assert own == [OWN_PLAIN[1], OWN_CUTLASS[1]]
    assert "1 libraries built from its code mapped (libnames.so)" in origin
    assert own_kernels([OWN_PLAIN[1]], origins)[0] == [OWN_PLAIN[1]]  # read once, from the cache
    assert len(origins._binaries) == 1


def test_torch_and_site_packages_never_count(tmp_path: Path) -> None:
    import torch

    ours, library = candidate_folders(tmp_path)
    assert str(tmp_path.resolve()) in ours
    torch_dir = str(Path(torch.__file__).resolve().parent)
    assert torch_dir in library and origins._under(str(Path(torch_dir, "lib", "libtorch_cuda.so")), library)
    mapped = origins._mapped_files()
    assert mapped is not None and any("libtorch" in Path(p).name for p in mapped)
    assert not [p for p in mapped if "libtorch" in p and origins._ours(origins._real(p), ours, library)]


def test_nothing_traced_with_an_in_memory_kernel_compiler_loaded_is_undecided(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _solution(tmp_path, {"solution.py": "import torch\n"})
    assert own_kernels([NVJET], KernelOrigins(folder))[0] == []
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    own, origin = own_kernels([NVJET], KernelOrigins(folder))
    assert own is None and "cupy" in origin


def test_a_broken_collector_leaves_the_decision_to_the_names(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("no maps")

    origins = KernelOrigins(tmp_path)
    monkeypatch.setattr(origins, "code", broken)
    assert own_kernels([NVJET], origins) == (None, "origins undecided: RuntimeError: no maps")


# ------------------------------------------------------------------------------ the rule


@pytest.fixture(scope="module")
def w4() -> Problem:
    problem = load_problem(HARD / "07_w4a16_gemm")
    assert problem.require_own_kernel
    return problem


def test_the_rule_passes_a_call_that_ran_one_kernel_of_its_own(w4: Problem) -> None:
    kernels = [TORCH_FILL, OWN_PLAIN[1]]
    assert kernel_problems(w4, kernels, [OWN_PLAIN[1]], "by origin: …") == []


def test_the_rule_fails_a_call_that_ran_only_library_kernels_whatever_their_names(w4: Problem) -> None:
    found = kernel_problems(w4, [CUBLAS_GEMV, TORCH_FILL], [], "by origin: 0 Triton functions")
    assert len(found) == 1 and found[0].startswith("no kernel of its own ran: none of the 2 kernels")
    assert "by origin: 0 Triton functions" in found[0] and "by name alone" not in found[0]
    odd = kernel_problems(w4, [TORCH_FILL, "some_dsl_kernel_0"], [], "by origin")
    assert "by name alone 1 would pass (some_dsl_kernel_0)" in odd[0]


def test_an_own_list_naming_no_launched_kernel_counts_for_nothing(w4: Problem) -> None:
    assert kernel_problems(w4, [NVJET], ["something_else"], "")[0].startswith("no kernel of its own ran")


def test_without_origins_the_names_decide(w4: Problem) -> None:
    assert kernel_problems(w4, [OWN_PLAIN[1]], None) == []  # `gemv_w4_kernel` is no cuBLAS family
    found = kernel_problems(w4, [CUBLAS_GEMV, NVJET], None, "origins undecided: cupy")
    assert len(found) == 1 and found[0].startswith("no kernel of its own ran: all 2 kernels are PyTorch or library")
    assert "by name: the runner could not tell where they came from: origins undecided: cupy" in found[0]


def test_forbidden_kernels_are_refused_whatever_their_origin() -> None:
    problem = load_problem(HARD / "06_sonic_moe_swiglu")
    assert not problem.require_own_kernel
    found = kernel_problems(problem, [NVJET, OWN_PLAIN[1]], [NVJET])
    assert found == [f"forbidden kernel {NVJET!r}"]


def test_the_innermost_folder_decides_whose_a_file_is() -> None:
    """A solution's scratch copy inside a folder that never counts (a checkout under /tmp) is the
    candidate's; torch.compile's cache inside the temp folder, or the grader's checkout there, is not."""
    ours, library = ["/tmp", "/tmp/repo/scratch/sol"], ["/tmp/repo", "/tmp/torchinductor_root"]
    assert origins._ours("/tmp/repo/scratch/sol/solution.py", ours, library)
    assert not origins._ours("/tmp/repo/tests/test_x.py", ours, library)
    assert not origins._ours("/tmp/torchinductor_root/ab/kernel.py", ours, library)
    assert origins._ours("/tmp/other/ext.so", ours, library)
    assert not origins._ours("/usr/lib/libcublas.so", ours, library)
