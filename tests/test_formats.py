"""Foreign deck formats: KernelBench-Hard folders and ScalingIntelligence KernelBench level files,
detected, loaded into the same Problem as kernelboard's own, and graded end to end on the CPU."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kernelboard.errors import DeckError
from kernelboard.eval.deck import load_deck, load_problem
from kernelboard.eval.formats import KB_HARD, NATIVE, SI_KB, detect_format, load_deck_any, load_problem_any
from kernelboard.eval.schedule import EvalOptions, run_eval

ROOT = Path(__file__).resolve().parents[1]

# A KernelBench-Hard problem as the original lays it out (hard-deck-interface.md §A.1): shape
# globals are placeholders the harness sets per shape, so an unapplied shape cannot pass.
KB_HARD_FILES = {
    "reference.py": """
        import torch
        import torch.nn as nn

        OP_TYPE = "gemm"
        M = N = K = None  # set per shape from shapes.py

        class Model(nn.Module):
            def __init__(self, M: int, N: int, K: int):
                super().__init__()
                self.M, self.N, self.K = M, N, K
                self.register_buffer("weight", torch.randn(N, K) * 0.1)

            def forward(self, x):
                return x @ self.weight.T

        def get_inputs():
            return [torch.randn(M, K)]

        def get_init_inputs():
            return [M, N, K]
        """,
    "shapes.py": """
        \"\"\"Shape sweep.\"\"\"

        SHAPES = [
            {"M": 4096, "N": 4096, "K": 4096},  # square aligned — the headline
            {"M": 32, "N": 8192, "K": 8192},
        ]
        """,
    "problem.yaml": """
        name: 01_small_gemm
        display_name: "Small GEMM"
        precision: fp32
        regime: compute
        flops_formula: "2 * M * N * K"
        bytes_formula: "(M*K + K*N + M*N) * 4"
        hardware: [H100]
        peak_tflops_key: fp32
        peak_bandwidth_key: dram
        tolerance:
          float32: "5e-4"         # a string, as PyYAML reads un-dotted sci-notation
          torch.float32: 0.002
          bfloat16: {atol: 0.05}  # rtol missing: 0
        forbidden:
          - "torch.nn.functional.linear"
        sota: {name: "cuBLAS"}
        num_correct_trials: 3
        num_perf_trials: 30
        # kernelboard's additions
        cpu_shapes:
          - label: cpu tiny
            params: {M: 8, N: 16, K: 4}
        numeric_stress:
          - name: small_x
            scale: {0: 1.0e-3}
            tolerance: {float32: {atol: 1.0e-6, rtol: 1.0e-3}, bfloat16: {atol: 1.0e-3, rtol: 1.0e-2}}
          - name: large_x
            scale: {0: 8.0}
            tolerance: {torch.float32: {atol: 1.0e-2, rtol: 1.0e-2}}
        """,
    "check.py": "raise SystemExit('kernelboard never runs check.py')\n",
    "benchmark.py": "raise SystemExit('kernelboard never runs benchmark.py')\n",
    "PROMPT.txt": "Write a fast GEMM.\n",
}

SI_KB_FILES = {
    "19_ReLU.py": """
        import torch
        import torch.nn as nn

        class Model(nn.Module):
            \"\"\"Simple model that performs a ReLU activation.\"\"\"
            def __init__(self):
                super(Model, self).__init__()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.relu(x)

        batch_size = 16
        dim = 1024 * 4

        def get_inputs():
            x = torch.randn(batch_size, dim)
            return [x]

        def get_init_inputs():
            return []  # No special initialization inputs needed
        """,
    "19_ReLU.yaml": """
        shape_globals: {batch_size: batch_size, dim: dim}
        cpu_shapes:
          - label: cpu small
            params: {batch_size: 4, dim: 256}
        """,
    "12_Linear_ReLU.py": """
        import torch
        import torch.nn as nn

        class Model(nn.Module):
            def __init__(self, in_features, out_features):
                super().__init__()
                self.linear = nn.Linear(in_features, out_features)

            def forward(self, x):
                return torch.relu(self.linear(x))

        batch_size, in_features, out_features = 8, 32, 16

        def get_inputs():
            return [torch.randn(batch_size, in_features)]

        def get_init_inputs():
            return [in_features, out_features]
        """,
    "12_Linear_ReLU.yaml": """
        cpu_shapes:  # the file's own sizes are small enough
          - {label: default, params: {}}
        """,
}


def write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text).lstrip("\n"))
    return folder


@pytest.fixture
def kb_hard(tmp_path: Path) -> Path:
    """A KernelBench-Hard deck folder as the original names it, holding one problem."""
    return write(tmp_path / "problems-h100" / "01_small_gemm", KB_HARD_FILES)


@pytest.fixture
def si_kb(tmp_path: Path) -> Path:
    """A ScalingIntelligence KernelBench level folder with two problems."""
    return write(tmp_path / "level1", SI_KB_FILES)


# ------------------------------------------------------------------------------ detection


def test_each_format_is_detected(kb_hard: Path, si_kb: Path) -> None:
    assert detect_format(ROOT / "eval" / "decks" / "hard" / "03_paged_attention") == NATIVE
    assert detect_format(kb_hard) == KB_HARD
    assert detect_format(si_kb / "19_ReLU.py") == SI_KB
    assert detect_format(si_kb / "19_ReLU") == SI_KB  # deck/<stem>, as the site addresses problems


def test_a_folder_matching_no_format_says_what_each_format_needs(tmp_path: Path) -> None:
    folder = write(tmp_path / "deck" / "01_x", {"reference.py": "M = 1\n", "problem.yaml": "name: 01_x\n"})
    with pytest.raises(DeckError, match=r"matches no deck format.*'shapes'.*no shapes.py"):
        detect_format(folder)
    with pytest.raises(DeckError, match="matches no deck format"):
        load_deck(tmp_path / "deck")


def test_kernelboard_shapes_beside_a_shapes_py_is_ambiguous(kb_hard: Path) -> None:
    (kb_hard / "problem.yaml").write_text((kb_hard / "problem.yaml").read_text() + "shapes: []\n")
    with pytest.raises(DeckError, match=r"key 'shapes' is kernelboard's format but shapes\.py"):
        detect_format(kb_hard)


def test_a_problem_folder_passed_as_a_deck_is_refused(kb_hard: Path) -> None:
    with pytest.raises(DeckError, match="this is a problem folder, not a deck"):
        load_deck(kb_hard)


def test_the_native_deck_loads_as_before() -> None:
    deck = load_deck(ROOT / "eval" / "decks" / "hard")
    problem = deck["03_paged_attention"]
    assert problem.reference_path == problem.folder / "reference.py"
    assert problem.solution_class == "Model" and problem.weight_transfer == "state_dict"


# ------------------------------------------------------------------------------ KernelBench-Hard


def test_kb_hard_shapes_globals_and_metadata(kb_hard: Path) -> None:
    deck = load_deck(kb_hard.parent)
    problem = deck["01_small_gemm"]
    assert problem == load_problem_any(kb_hard) == load_problem(kb_hard)
    assert problem.bench == "hard"  # problems-h100 is KernelBench-Hard's deck
    assert problem.display_name == "Small GEMM"
    assert problem.shape_globals == {"M": "M", "N": "N", "K": "K"}
    assert [s.params for s in problem.shapes] == [{"M": 4096, "N": 4096, "K": 4096}, {"M": 32, "N": 8192, "K": 8192}]
    assert [s.label for s in problem.shapes] == ["square aligned — the headline", "M=32, N=8192, K=8192"]
    assert [s.params for s in problem.cpu_shapes] == [{"M": 8, "N": 16, "K": 4}]
    assert problem.seeds == (42, 123, 456)
    assert problem.forbidden == ("torch.nn.functional.linear",)
    assert problem.flops(problem.shapes[0]) == 2 * 4096**3
    assert (problem.regime, problem.precision, problem.peak_tflops_key) == ("compute", "fp32", "fp32")
    assert (problem.solution_class, problem.weight_transfer) == ("Model", "state_dict")
    assert problem.reference_path == kb_hard / "reference.py"


def test_kb_hard_lower_case_keys_set_upper_case_globals_else_their_own(kb_hard: Path) -> None:
    ref = (kb_hard / "reference.py").read_text()
    (kb_hard / "reference.py").write_text(ref.replace("M = N = K = None", "BATCH = None\nn = None\nK = k = None"))
    (kb_hard / "shapes.py").write_text('SHAPES = [{"batch": 2, "n": 8, "k": 4}]\n')
    text = (kb_hard / "problem.yaml").read_text()
    (kb_hard / "problem.yaml").write_text(text[:text.index("# kernelboard")].replace("M * N * K", "batch * n * k")
                                          .replace("(M*K + K*N + M*N) * 4", "n"))
    problem = load_problem(kb_hard)
    assert problem.shape_globals == {"batch": "BATCH", "n": "n", "k": "K"}  # K before k: upper case wins
    assert problem.cpu_shapes == () and problem.numeric_stress == ()


def test_kb_hard_torch_prefixed_tolerance_beats_the_plain_one(kb_hard: Path) -> None:
    problem = load_problem(kb_hard)
    small, large = problem.numeric_stress
    assert problem.tolerance_for("float32") == (0.002, 0.002)  # not the "5e-4" spelled without torch.
    assert problem.tolerance_for("bfloat16") == (0.05, 0.0)
    assert problem.tolerance_for("float16") == (1e-2, 1e-2)  # KernelBench-Hard's default table
    # A case's plain key is shadowed by the problem's torch.-prefixed one (the 02_kda_cutlass quirk) …
    assert problem.tolerance_for("float32", small) == (0.002, 0.002)
    assert problem.tolerance_for("bfloat16", small) == (1e-3, 1e-2)  # … unless the problem spells it plainly too
    # … and a case's own torch.-prefixed key overwrites it.
    assert problem.tolerance_for("float32", large) == (1e-2, 1e-2)


def test_kb_hard_shapes_that_are_not_a_literal_name_shapes_py(kb_hard: Path) -> None:
    (kb_hard / "shapes.py").write_text('BASE = 64\nSHAPES = [{"M": BASE, "N": 8, "K": 8}]\n')
    with pytest.raises(DeckError, match=r"shapes.py: line 2: SHAPES is not a literal"):
        load_problem(kb_hard)
    (kb_hard / "shapes.py").write_text('SHAPES = [dict(M=1, N=2, K=3) for _ in range(2)]\n')
    with pytest.raises(DeckError, match=r"shapes.py: line 1: SHAPES is not a literal"):
        load_problem(kb_hard)
    (kb_hard / "shapes.py").write_text("SIZES = []\n")
    with pytest.raises(DeckError, match=r"shapes.py: no top-level `SHAPES = \[...\]`"):
        load_problem(kb_hard)


def test_kb_hard_shape_key_without_a_global_names_the_key(kb_hard: Path) -> None:
    (kb_hard / "shapes.py").write_text('SHAPES = [{"M": 8, "N": 8, "K": 8, "extreme": False}]\n')
    with pytest.raises(DeckError, match=r"shapes.py: shape key 'extreme': reference.py assigns no top-level "
                                        r"EXTREME nor extreme"):
        load_problem(kb_hard)


@pytest.mark.parametrize(("shapes", "message"), [
    ('[{"M": 8, "N": 8, "K": 0}]', r"SHAPES\[0\]\['K'\]: expected a positive integer, got 0"),
    ('[{"M": 8, "N": 8, "K": True}]', r"SHAPES\[0\]\['K'\]: expected a positive integer, got True"),
    ('[{"M": 8, "N": 8, "K": 8}, {"M": 8, "N": 8}]', r"SHAPES\[1\]: expected the keys of SHAPES\[0\]"),
    ("[]", "expected a non-empty list of dicts"),
])
def test_kb_hard_bad_shapes_name_entry_and_key(kb_hard: Path, shapes: str, message: str) -> None:
    (kb_hard / "shapes.py").write_text(f"SHAPES = {shapes}\n")
    with pytest.raises(DeckError, match=message):
        load_problem(kb_hard)


@pytest.mark.parametrize(("old", "new", "message"), [
    ("regime: compute", "regime: vibes", r"problem.yaml: key 'regime': expected one of compute, memory"),
    ("peak_tflops_key: fp32", "peak_tflops_key: fp4", r"key 'peak_tflops_key': expected one of fp8"),
    ('float32: "5e-4"', 'float32: "tight"', r"tolerance.float32: expected a non-negative number, got 'tight'"),
    ("name: 01_small_gemm", "name: small_gemm", r"key 'name': expected the folder name '01_small_gemm'"),
    ("num_perf_trials: 30", "seeds: [1, 2]", r"key 'seeds' is kernelboard's and means nothing"),
    ('"2 * M * N * K"', '"2 * M * N * L"', r"shape 'square aligned — the headline': .*unknown name 'L'"),
])
def test_kb_hard_bad_problem_yaml_names_file_and_key(kb_hard: Path, old: str, new: str, message: str) -> None:
    path = kb_hard / "problem.yaml"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))
    with pytest.raises(DeckError, match=message):
        load_problem(kb_hard)


def test_kb_hard_explicit_shape_globals_override_the_inference(kb_hard: Path) -> None:
    path = kb_hard / "problem.yaml"
    path.write_text(path.read_text() + "shape_globals: {M: M, N: N, K: OP_TYPE}\n")
    assert load_problem(kb_hard).shape_globals == {"M": "M", "N": "N", "K": "OP_TYPE"}
    path.write_text(path.read_text().replace("K: OP_TYPE", "K: KK"))
    with pytest.raises(DeckError, match=r"shape_globals.K: reference.py assigns no top-level 'KK'"):
        load_problem(kb_hard)


def test_a_deck_lists_every_bad_problem_in_one_error(kb_hard: Path) -> None:
    write(kb_hard.parent / "02_other", {**KB_HARD_FILES, "shapes.py": "SHAPES = None + 1\n"})
    (kb_hard / "shapes.py").write_text("SHAPES = [{}]\n")
    with pytest.raises(DeckError, match=r"2 problems in the deck(.|\n)*01_small_gemm(.|\n)*02_other"):
        load_deck_any(kb_hard.parent)


# ------------------------------------------------------------------------------ ScalingIntelligence KernelBench


def test_si_kb_files_become_problems_with_model_new_and_seeded_weights(si_kb: Path) -> None:
    deck = load_deck(si_kb)
    assert list(deck) == ["12_Linear_ReLU", "19_ReLU"]
    relu = deck["19_ReLU"]
    assert relu == load_problem(si_kb / "19_ReLU.py") == load_problem(si_kb / "19_ReLU")
    assert relu == load_problem(relu.folder.resolve())  # what a grading worker reloads from
    assert (relu.solution_class, relu.weight_transfer) == ("ModelNew", "seed")
    assert relu.reference_path == si_kb / "19_ReLU.py"
    assert (relu.bench, relu.name, relu.display_name) == ("level1", "19_ReLU", "ReLU")
    assert relu.shape_globals == {"batch_size": "batch_size", "dim": "dim"}
    assert [(s.label, s.params) for s in relu.shapes] == [("default", {"batch_size": 16, "dim": 4096})]
    assert [s.params for s in relu.cpu_shapes] == [{"batch_size": 4, "dim": 256}]
    assert relu.flops_formula is None and relu.bytes_formula is None and relu.flops(relu.shapes[0]) is None
    assert relu.tolerance_for("float32") == (1e-4, 1e-4) and relu.tolerance_for("bfloat16") == (1e-2, 1e-2)
    assert (relu.regime, relu.precision, relu.peak_tflops_key) == ("compute", "fp32", "fp32")
    linear = deck["12_Linear_ReLU"]
    assert linear.shape_globals == {} and [(s.label, s.params) for s in linear.shapes] == [("default", {})]
    assert linear.cpu_shapes == linear.shapes


def test_si_kb_without_an_overlay_has_no_cpu_shapes(si_kb: Path) -> None:
    (si_kb / "19_ReLU.yaml").unlink()
    relu = load_problem(si_kb / "19_ReLU.py")
    assert relu.cpu_shapes == () and relu.shape_globals == {} and relu.shapes[0].params == {}


def test_si_kb_bad_files_and_overlays_are_named(si_kb: Path) -> None:
    (si_kb / "20_Broken.py").write_text("import torch\n\nclass Model:\n    pass\n")
    with pytest.raises(DeckError, match=r"20_Broken.py: not a KernelBench problem: no top-level get_inputs, "
                                        r"get_init_inputs"):
        load_deck(si_kb)
    (si_kb / "20_Broken.py").unlink()
    (si_kb / "19_ReLU.yaml").write_text("solution_class: Model\n")
    with pytest.raises(DeckError, match=r"19_ReLU.yaml: unknown keys \['solution_class'\]"):
        load_deck(si_kb)
    (si_kb / "19_ReLU.yaml").write_text("shape_globals: {n: size}\n")
    with pytest.raises(DeckError, match=r"shape_globals.n: 19_ReLU.py assigns no top-level 'size'"):
        load_deck(si_kb)
    (si_kb / "19_ReLU.yaml").unlink()
    (si_kb / "21_Gone.yaml").write_text("cpu_shapes: []\n")
    with pytest.raises(DeckError, match=r"21_Gone.yaml: an overlay for 21_Gone.py, which is not in the deck"):
        load_deck(si_kb)


def test_an_empty_deck_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DeckError, match="no problem folders"):
        load_deck(tmp_path)


# ------------------------------------------------------------------------------ end to end on the CPU

KB_HARD_SOLUTIONS = {
    "kbh_correct": "import torch\nimport reference\n\n\nclass Model(reference.Model):\n"
                   "    def forward(self, x):\n        return torch.mm(x, self.weight.t())\n",
    "kbh_wrong": "import torch\nimport reference\n\n\nclass Model(reference.Model):\n"
                 "    def forward(self, x):\n        out = torch.mm(x, self.weight.t())\n"
                 "        out[:, -1] = 0\n        return out\n",
}
SI_KB_SOLUTIONS = {
    "relu_correct": ("19_ReLU", "import torch\n\n\nclass ModelNew(torch.nn.Module):\n"
                                "    def forward(self, x):\n        return torch.clamp_min(x, 0.0)\n"),
    "relu_wrong": ("19_ReLU", "import torch\n\n\nclass ModelNew(torch.nn.Module):\n"  # leaky, not ReLU
                              "    def forward(self, x):\n        return torch.where(x > 0, x, 0.01 * x)\n"),
    "linear_correct": ("12_Linear_ReLU", "import torch\n\n\nclass ModelNew(torch.nn.Module):\n"
                                         "    def __init__(self, in_features, out_features):\n"
                                         "        super().__init__()\n"
                                         "        self.linear = torch.nn.Linear(in_features, out_features)\n\n"
                                         "    def forward(self, x):\n"
                                         "        w, b = self.linear.weight, self.linear.bias\n"
                                         "        return torch.relu(torch.addmm(b, x, w.t()))\n"),
}


def _submissions(root: Path, runs: dict[str, tuple[str, str]]) -> Path:
    for run_id, (problem, source) in runs.items():
        run_yaml = f"problem: {problem}\nmodel: test\nharness: pytest\nagent_outcome: completed\n"
        write(root / run_id, {"solution.py": source, "run.yaml": run_yaml})
    return root


@pytest.mark.slow  # a foreign deck graded end to end, its baselines measured
def test_kb_hard_grades_end_to_end_on_the_cpu(kb_hard: Path, tmp_path: Path) -> None:
    subs = _submissions(tmp_path / "subs", {k: ("01_small_gemm", v) for k, v in KB_HARD_SOLUTIONS.items()})
    rows = run_eval(EvalOptions(deck=kb_hard.parent, submissions=subs, out=tmp_path / "out", device="cpu",
                                rep_ms=20.0, timeout_s=120.0))
    status = {r["run_id"]: (r["status"], r["message"]) for r in rows}
    assert status["kbh_correct"][0] == "pass", status
    assert status["kbh_wrong"][0] == "wrong", status
    assert "out of tolerance (atol=0.002," in status["kbh_wrong"][1]  # torch.float32's, not float32's


@pytest.mark.slow  # a foreign deck graded end to end, its baselines measured
def test_si_kb_grades_end_to_end_on_the_cpu(si_kb: Path, tmp_path: Path) -> None:
    subs = _submissions(tmp_path / "subs", SI_KB_SOLUTIONS)
    rows = run_eval(EvalOptions(deck=si_kb, submissions=subs, out=tmp_path / "out", device="cpu",
                                rep_ms=20.0, timeout_s=120.0))
    status = {r["run_id"]: (r["status"], r["message"]) for r in rows}
    assert status["relu_correct"][0] == "pass", status
    assert status["linear_correct"][0] == "pass", status  # same seed, same nn.Linear weights
    assert status["relu_wrong"][0] == "wrong", status
    assert "out of tolerance (atol=0.0001," in status["relu_wrong"][1]
