"""Where a deck's submissions start their extension builds: at import, in the prebuild's warm call, or
where no CPU-side call reaches them — measured on the CPU, no GPU and no compiler needed.

Each submission runs `python -m kernelboard.eval.prebuild` (the grader's own prebuild: import, then the
warm call on meta tensors) in the grader's sandbox, with torch's `load_inline` and `load` replaced by a
probe that prints one line and raises: the line's place in the log (before or after "[prebuild]
imported") says which phase reached the build. The GPU grading then finds a build of either phase in
its cache; one that neither reaches is built on the GPU's time (about 50 s each for a 05 extension on
the H200's host). Triton kernels compile in the warm call for sm_90 (TORCH_CUDA_ARCH_LIST 9.0) with no
GPU, each shape's launches compiled and none run: the census counts the submissions whose warm call
compiled at least one (`triton` in the JSON: variants compiled, seconds), and those it compiled none of.

    python bench/warm_call_reach.py --deck eval/decks/hard --submissions data/submissions/hard [--jobs 2]
        [--only GLOB ...] [--json reach.json]
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from kernelboard.eval.deck import load_deck
from kernelboard.eval.jail import make_jail, problem_copy, problem_root, start
from kernelboard.eval.prebuild import GRADING_GPU_ENV
from kernelboard.eval.settings import PREBUILD_WARM_CALL_S
from kernelboard.eval.submission import Submission, discover
from kernelboard.eval.triton_compile_only import Compiled

# The GPU the census's prebuilds answer `torch.cuda.get_device_properties` for: an H200 (132 SMs; sm_90, as
# TORCH_CUDA_ARCH_LIST says; its memory and L2 from its datasheet, where the grader passes the probe's bytes).
GRADING_GPU = {"device_name": "NVIDIA H200", "sm_count": 132, "memory_bytes": 141_000_000_000, "l2_bytes": 52_428_800}

# Runs the prebuild with torch's two JIT build entry points replaced by a probe.
PROBE = """
import sys, torch.utils.cpp_extension as ext
def _probe(*args, **kwargs):
    print("[probe] build reached", flush=True)
    raise RuntimeError("probe: the build stops here")
ext.load_inline = ext.load = _probe
from kernelboard.eval.prebuild import main
sys.exit(main(sys.argv[1:]))
"""



def reach(sub: Submission, problem_dir: Path, scratch: Path, jail: object) -> tuple[str, str, list[float]]:
    """(phase, the log's last line, [Triton variants compiled, seconds]): phase is import, warm call (on
    meta), fake CUDA (the warm call again on fake CUDA tensors, after the one on meta stopped), none
    (an extension source that no phase reached), triton (Triton only, some compiled in the warm call),
    triton-none (Triton only, none compiled) or plain (neither)."""
    folder = scratch / sub.run_id
    shutil.copytree(sub.folder, folder, ignore=shutil.ignore_patterns("run.yaml", "__pycache__"))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TORCH_CUDA_ARCH_LIST": "9.0", "HOME": str(folder),
           GRADING_GPU_ENV: json.dumps(GRADING_GPU),
           "TORCH_EXTENSIONS_DIR": str(folder / "_ext"), "TRITON_CACHE_DIR": str(folder / "_triton"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    problem = problem_copy(problem_dir, folder)  # the decks stay hidden, as in a grading
    command = [sys.executable, "-c", PROBE, str(problem), str(folder), str(PREBUILD_WARM_CALL_S)]
    proc = start(jail, command, writable=[folder], readable=[problem_root(folder)], cwd=folder,  # type: ignore[arg-type]
                 env=env, device="cpu", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                 stdin=subprocess.DEVNULL).proc
    try:
        out, _ = proc.communicate(timeout=PREBUILD_WARM_CALL_S + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    lines = out.decode(errors="replace").splitlines()
    ends = [line for line in lines if line.startswith("[prebuild] warm call ") and "Model built" not in line]
    last = ends[0] if ends else next((line for line in reversed(lines) if line.startswith("[prebuild]")),
                                     lines[-1] if lines else "")
    triton = next(([float(m[1]), float(m[2])] for line in lines
                   if (m := Compiled.SUMMARY.search(line)) is not None), [0.0, 0.0])
    if "[probe] build reached" in lines:
        at = lines.index("[probe] build reached")
        imported = next((i for i, line in enumerate(lines) if line.startswith("[prebuild] imported")), len(lines))
        fake = next((i for i, line in enumerate(lines) if "on fake CUDA tensors" in line), len(lines))
        return ("import" if at < imported else "warm call" if at < fake else "fake CUDA"), last, triton
    source = "\n".join(p.read_text(errors="replace") for p in folder.rglob("*.py"))
    if "load_inline" in source or "cpp_extension" in source:
        return "none", last, triton
    if "triton.jit" in source:
        return ("triton" if triton[0] else "triton-none"), last, triton
    return "plain", last, triton


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--deck", type=click.Path(path_type=Path), default=Path("eval/decks/hard"), show_default=True)
@click.option("--submissions", type=click.Path(path_type=Path), default=Path("data/submissions/hard"),
              show_default=True)
@click.option("--only", multiple=True, default=("*",), show_default=True, help="run_id glob (repeatable)")
@click.option("--jobs", type=int, default=2, show_default=True)
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="write every submission's phase here")
def main(deck: Path, submissions: Path, only: tuple[str, ...], jobs: int, json_out: Path | None) -> None:
    console = Console()
    problems = load_deck(deck)
    subs = [s for s in discover(submissions)[0]
            if any(fnmatch.fnmatch(s.run_id, g) for g in only) and s.problem in problems and s.has_solution]
    jail = make_jail(sandboxed=True, device="cpu", hide=[deck.resolve(), submissions.resolve()])
    console.print(f"{len(subs)} submissions, {jobs} at a time (each imports torch: a few seconds) …")
    found: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="warm-reach-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(reach, s, problems[s.problem].folder.resolve(), Path(tmp), jail): s for s in subs}
        for future in concurrent.futures.as_completed(futures):
            sub = futures[future]
            phase, last, triton = future.result()
            found[sub.run_id] = {"problem": sub.problem, "phase": phase, "last": last, "triton": triton}
            if phase == "none":
                console.print(f"  {sub.run_id}: no phase reached its build — {last}", markup=False)
    table = Table("problem", "at import", "warm call", "fake CUDA call", "not reached", "Triton: compiled",
                  "Triton: none", "neither", "all", "Triton variants", "Triton s")
    for name in sorted({v["problem"] for v in found.values()}):
        rows = [v for v in found.values() if v["problem"] == name]
        counts = Counter(v["phase"] for v in rows)
        phases = ("import", "warm call", "fake CUDA", "none", "triton", "triton-none", "plain")
        table.add_row(name, *(str(counts[p]) for p in phases),
                      str(len(rows)), str(int(sum(v["triton"][0] for v in rows))),
                      f"{sum(v['triton'][1] for v in rows):.0f}")
    console.print(table)
    if json_out is not None:
        json_out.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
