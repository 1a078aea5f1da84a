"""`make eval`'s virtualenv sees the packages of the Python it is made from, also when that Python is
itself a virtualenv (the H200 image's python3 is one; --system-site-packages alone misses its torch)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _purelib(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


@pytest.mark.parametrize("parent_is_venv", [True, False], ids=["a-venv-with-a-marker", "the-test-runners-python"])
def test_the_eval_venv_sees_the_parents_packages(tmp_path: Path, parent_is_venv: bool) -> None:
    if parent_is_venv:
        parent = tmp_path / "parent"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(parent)], check=True)
        python = parent / "bin" / "python"
        marker = _purelib(python) / "kb_marker_pkg"
        marker.mkdir(parents=True)
        (marker / "__init__.py").write_text("")
        module = "kb_marker_pkg"
    else:  # the Python running the tests: whatever it can import, the eval venv can
        python, module = Path(sys.executable), "pytest"
    venv = tmp_path / "eval-venv"
    subprocess.run(["make", "-s", "-C", str(REPO), f"{venv}/bin/python", f"EVAL_VENV={venv}", f"PYTHON={python}"],
                   check=True, capture_output=True, text=True)
    seen = subprocess.run([str(venv / "bin" / "python"), "-c", f"import {module}"], capture_output=True, text=True)
    assert seen.returncode == 0, seen.stderr
