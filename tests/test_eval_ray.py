"""`kernelboard eval --ray`: a local Ray cluster on the CPU advertising two fake GPUs (`gpu_cpu: 2`), a
small batch graded end to end, one grading child killed mid-run (Ray runs its task again), then a
`--resume` that finds nothing left to do. The GPU path is the same code with `gpu_<key>` resources."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from grading import REEXPORT, copy_deck, write_submission

from kernelboard.eval.cluster import gpu_models, resource
from kernelboard.eval.tables import load_all

TOPK, W4 = "05_topk_bitonic", "07_w4a16_gemm"
RAY = Path(sys.executable).with_name("ray")
#: A cluster of this test's own, on this host: without Ray's token authentication (a real cluster keeps
#: it on, and its drivers set RAY_AUTH_MODE=token; the README says how).
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


def test_gpu_models_are_read_from_the_nodes_resources() -> None:
    advertised = {"CPU": 32.0, "GPU": 6.0, "gpu_h200": 4.0, "gpu_b200": 2.0, "gpu_cpu": 2.0, "memory": 1e9}
    assert gpu_models(advertised, "cuda") == {"b200": 2, "h200": 4}
    assert gpu_models(advertised, "cpu") == {"cpu": 2}
    assert resource("h200") == "gpu_h200"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A head node of two CPUs advertising two fake GPUs; stopped after the module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = subprocess.run([str(RAY), "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
                              "--resources", json.dumps({resource("cpu"): 2}), "--include-dashboard=false",
                              "--disable-usage-stats", "--object-store-memory=100000000"],
                             capture_output=True, text=True, timeout=180, env=ENV)
    assert started.returncode == 0, started.stderr[-2000:]
    yield f"127.0.0.1:{port}"
    subprocess.run([str(RAY), "stop", "--force"], capture_output=True, timeout=120, env=ENV)


def _kill_once(victim: str, killed: list[int], stop: threading.Event) -> None:
    """SIGKILL the grading child of `victim` (not a baselines child) once it has run for 1 s."""
    seen: dict[int, float] = {}
    while not stop.is_set() and not killed:
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                args = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [a.decode(errors="replace") for a in args]
            line = " ".join(words)
            if "kernelboard.cli" in words and "eval" in words and f"--only {victim}" in line \
                    and "--baselines-only" not in words and "kernelboard-ray-" in line:
                first = seen.setdefault(int(proc.name), time.monotonic())
                if time.monotonic() - first > 1.0:
                    os.kill(int(proc.name), signal.SIGKILL)
                    killed.append(int(proc.name))
                    return
        time.sleep(0.2)


def _eval(cluster: str, tmp_path: Path, deck: Path, *more: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kernelboard.cli", "eval", "--device", "cpu", "--ray", cluster, "--deck", str(deck),
           "--submissions", str(tmp_path / "subs"), "--out", str(tmp_path / "results"),
           "--skip-baseline", "compile:max-autotune", *more]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=ENV)


@pytest.mark.slow  # a Ray cluster and three gradings in its tasks
def test_a_batch_is_graded_on_two_fake_gpus_through_a_killed_task(cluster: str, tmp_path: Path) -> None:
    deck = copy_deck(tmp_path, (TOPK, W4))
    runs = {f"20261201_000000_t_a_{TOPK}": TOPK, f"20261201_000000_t_b_{W4}": W4,
            f"20261201_000100_t_c_{W4}": W4}
    for run_id, problem in runs.items():
        write_submission(tmp_path / "subs" / run_id, problem, REEXPORT)
    victim = f"20261201_000100_t_c_{W4}"
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_once, args=(victim, killed, stop), daemon=True)
    killer.start()
    try:
        done = _eval(cluster, tmp_path, deck)
    finally:
        stop.set()
        killer.join()
    assert done.returncode == 0, done.stderr[-3000:]
    assert killed, f"the victim's grading child was never seen running: {done.stderr[-3000:]}"
    assert "Ray cluster: 2 × cpu" in done.stderr
    out = tmp_path / "results"
    tables = load_all(out)
    graded = Counter(r["run_id"] for r in tables["results"].to_pylist())
    assert graded == Counter(list(runs)), graded  # every row present once, the killed one included
    statuses = {r["run_id"]: (r["status"], r["message"]) for r in tables["results"].to_pylist()}
    assert statuses[f"20261201_000000_t_b_{W4}"][0] == statuses[victim][0] == "pass", statuses  # as without Ray
    assert {r["problem"] for r in tables["baselines"].to_pylist()} == {TOPK, W4}
    for problem in (TOPK, W4):  # measured once, in phase 1, never again by a grading task
        log = next((out / "cpu" / "logs").glob(f"baselines-*{problem}.log")).read_text()
        assert log.count("\n=== ") + log.startswith("=== ") == 1, log
    assert all((out / "cpu" / "logs" / f"{run_id}.log").exists() for run_id in runs)

    again = _eval(cluster, tmp_path, deck, "--resume")  # nothing left: no task at all
    assert again.returncode == 0, again.stderr[-3000:]
    assert "measuring baselines on cpu" not in again.stderr and "grading on cpu" not in again.stderr, again.stderr
    assert load_all(out)["results"].num_rows == len(runs)


@pytest.mark.slow  # the Ray cluster of the test above
def test_a_cluster_without_the_devices_resource_is_one_line(cluster: str, tmp_path: Path) -> None:
    deck = copy_deck(tmp_path, (W4,))
    write_submission(tmp_path / "subs" / f"20261201_000000_t_a_{W4}", W4, REEXPORT)
    cmd = [sys.executable, "-m", "kernelboard.cli", "eval", "--device", "cuda", "--ray", cluster, "--deck", str(deck),
           "--submissions", str(tmp_path / "subs"), "--out", str(tmp_path / "results")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode != 0
    assert "no node of the Ray cluster advertises a gpu_<gpu> resource for --device cuda" in done.stderr
    assert "Traceback" not in done.stderr
