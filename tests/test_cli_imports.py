"""`kernelboard eval` must start on a GPU machine that has torch but not the site's libraries."""

from __future__ import annotations

import subprocess
import sys

SITE_ONLY = ("plotly", "jinja2", "markdown_it", "pygments", "pandas", "datasets")


def test_eval_cli_loads_without_the_site_stack() -> None:
    script = (
        "import sys\n"
        f"for name in {SITE_ONLY!r}: sys.modules[name] = None\n"
        "from kernelboard.cli import main\n"
        "main(['eval', '--help'], standalone_mode=False)\n"
        "main(['import', '--help'], standalone_mode=False)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--regrade" in proc.stdout
    assert "traces" in proc.stdout
