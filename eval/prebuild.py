"""Compile a solution's extensions on the CPU while the GPU grades another submission.

`python -m kernelboard.eval.prebuild PROBLEM_PATH SOLUTION_DIR` imports solution.py once with no
GPU visible (`CUDA_VISIBLE_DEVICES=""`), in the same per-solution caches (TORCH_EXTENSIONS_DIR,
TRITON_CACHE_DIR) and with the same TORCH_CUDA_ARCH_LIST the grading worker will use, so that a
`load_inline` / CUDA-source build done at import is already cached when the worker imports it.
Best effort: whatever happens here is ignored; the worker's own import decides the verdict. The
candidate code runs as hostile as anywhere: own process group, scratch copy, killed at the build
timeout by the scheduler.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m kernelboard.eval.prebuild PROBLEM_PATH SOLUTION_DIR", file=sys.stderr)
        return 2
    from .deck import load_problem
    from .plan import import_file

    problem = load_problem(Path(argv[0]))
    solution_dir = Path(argv[1])
    import_file("reference", problem.reference_path)
    sys.path.insert(0, str(solution_dir))
    start = time.perf_counter()
    try:
        import_file("solution", solution_dir / "solution.py")
    except BaseException as exc:  # the worker will report it properly
        print(f"[prebuild] import failed after {time.perf_counter() - start:.1f} s: {type(exc).__name__}: {exc}")
        return 0
    print(f"[prebuild] imported in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
