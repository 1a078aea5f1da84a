"""Print the CUDA kernels one call of the deck's reference launches, per shape (GPU only).

Used to keep `eval/audit.py`'s LIBRARY_KERNEL pattern true to what PyTorch and cuBLAS launch:

    python bench/kernel_names.py
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernelboard.eval.audit import LIBRARY_KERNEL, timed_kernels
from kernelboard.eval.deck import load_problem
from kernelboard.eval.plan import apply_shape, build_model, draw_inputs, import_file, install_shapes_module

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    problem = load_problem(ROOT / "eval" / "decks" / "hard" / "03_paged_attention")
    reference = import_file("reference", problem.reference_path)
    install_shapes_module(problem.shapes)
    for shape in problem.shapes[:3]:
        apply_shape(reference, problem, shape)
        model = build_model(reference, list(reference.get_init_inputs()), "cuda")
        for name in timed_kernels(model, draw_inputs(reference, 1, "cuda")):
            print(f"shape {shape.idx} {'library' if LIBRARY_KERNEL.search(name) else 'OWN    '} {name[:150]}")
        del model
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
