"""The parent-side sandbox: one grader per GPU at a time, in a lock folder tests choose, saying whom it waits for."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kernelboard.eval.locks import LockWaitWarning
from kernelboard.eval.sandbox import gpu_lock


@pytest.fixture(autouse=True)
def _private_locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KERNELBOARD_LOCK_DIR", str(tmp_path))


def test_two_graders_on_one_gpu_queue_instead_of_overlapping(tmp_path: Path) -> None:
    spans: list[tuple[str, float, float]] = []

    def grader(name: str) -> None:
        with gpu_lock("test-gpu"):
            start = time.monotonic()
            time.sleep(0.3)
            spans.append((name, start, time.monotonic()))

    with pytest.warns(LockWaitWarning, match=r"waiting for kernelboard eval grading on test-gpu \(device 0\)"):
        threads = [threading.Thread(target=grader, args=(n,)) for n in ("a", "b")]
        threads[0].start()
        lock = next(iter(tmp_path.glob("kernelboard-test-gpu-*.lock")), None)
        deadline = time.monotonic() + 5
        while (lock is None or not lock.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.01)  # b must find a holder that has said who it is
            lock = next(iter(tmp_path.glob("kernelboard-test-gpu-*.lock")), None)
        threads[1].start()
        for t in threads:
            t.join()
    (_, _, a1), (_, b0, _) = sorted(spans, key=lambda s: s[1])
    assert b0 >= a1  # the second began only after the first let go
    assert list(tmp_path.glob("kernelboard-test-gpu-*.lock"))  # in KERNELBOARD_LOCK_DIR


def test_different_gpus_do_not_wait_for_each_other() -> None:
    with gpu_lock("gpu-one"), gpu_lock("gpu-two"):
        pass


def test_the_lock_is_keyed_by_the_visible_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with gpu_lock("h200"):
        assert (tmp_path / "kernelboard-h200-3.lock").is_file()
