"""The parent-side sandbox: one grader per GPU at a time."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kernelboard.eval.sandbox import gpu_lock


def test_two_graders_on_one_gpu_queue_instead_of_overlapping(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    spans: list[tuple[str, float, float]] = []

    def grader(name: str) -> None:
        with gpu_lock("test-gpu"):
            start = time.monotonic()
            time.sleep(0.3)
            spans.append((name, start, time.monotonic()))

    threads = [threading.Thread(target=grader, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (_, _, a1), (_, b0, _) = sorted(spans, key=lambda s: s[1])
    assert b0 >= a1  # the second began only after the first let go
    assert list(tmp_path.glob("kernelboard-test-gpu-*.lock"))


def test_different_gpus_do_not_wait_for_each_other(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    with gpu_lock("gpu-one"), gpu_lock("gpu-two"):
        pass
