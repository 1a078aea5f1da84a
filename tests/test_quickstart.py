"""The README's quick start on a fresh clone: a new user's commands finish, print no warning and
install nothing without first saying what and why (issue 18).

The commands are read from the README's "The two commands" block, so the test follows the README.
`make test` is this suite, so instead of recursing into it the test runs what it does before pytest:
its install step (`make .venv/.dev`; its apt-get step only runs where Chromium or bubblewrap is
missing, and on CI the outer `make test` has already done it). The clone is of HEAD, as CI clones
the pushed commit: uncommitted changes are not in it. Both commands create the clone's own .venv
from PyPI through pip's cache (about 1 min in all with the cache warm), no GPU.

Two rules, applied line by line to what the commands print (stdout and stderr together):

- no warning: no line matches `warn` or `deprecat`, whatever the case. The one exception is pip
  saying that a package index or links folder *configured on this machine* (pip.conf, PIP_*
  variables) lacks a package: that is the machine's configuration speaking, not our project, and it
  is shown in the test's output instead.
- no unannounced install: apt-get/dpkg output only after a sentence saying "installing … with
  apt-get" (the Makefile's, which also says why); pip's install output only after the command line
  or a sentence that says it installs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: `make test`'s steps before the suite, which the test runs instead of `make test` itself (no recursion).
MAKE_TEST_SETUP = "make .venv/.dev"

_WARNING = re.compile(r"warn|deprecat", re.IGNORECASE)
_PIP_IGNORED_LOCATION = re.compile(r"^WARNING: Location '(?P<location>[^']+)' is ignored: "
                                   r"it is neither a file nor a directory\.$")
_APT_OUTPUT = re.compile(r"^(Get:\d+ |Hit:\d+ |Ign:\d+ |Reading package lists|Building dependency tree|"
                         r"Reading state information|The following (additional |NEW )?packages will be installed|"
                         r"\d+ upgraded, \d+ newly installed|Selecting previously unselected package|"
                         r"Preparing to unpack|Unpacking |Setting up |Processing triggers for )")
_APT_ANNOUNCEMENT = re.compile(r"\binstalling\b.*\bapt-get\b", re.IGNORECASE)
_PIP_OUTPUT = re.compile(r"^(Collecting |Downloading |Installing collected packages|Successfully installed |"
                         r"Building wheels? for |Building editable for )")
_PIP_ANNOUNCEMENT = re.compile(r"\bpip3? install\b|\binstalling\b", re.IGNORECASE)
_PIP_LOCATION_KEY = re.compile(r"^[^=]*\.(index-url|extra-index-url|find-links)='(?P<value>.*)'$")

pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None,
                                reason="needs make and git")


def quickstart_commands(readme: str) -> list[str]:
    """The commands of the README's first ```sh block under "## The two commands", comments dropped."""
    section = readme.split("\n## The two commands", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def problems(output: str, machine_locations: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """(`output`'s lines that break a rule, each with the rule; pip's notes about `machine_locations`).

    `machine_locations` are the index and links locations configured outside the project (`pip config
    list`); pip's "Location '<location>/<package>/' is ignored" about one of them is not ours to fix.
    """
    broken: list[str] = []
    machine_notes: list[str] = []
    apt_announced = pip_announced = False
    for line in output.splitlines():
        text = line.strip()
        ignored = _PIP_IGNORED_LOCATION.match(text)
        if ignored and any(ignored["location"].startswith(loc.rstrip("/") + "/") for loc in machine_locations):
            machine_notes.append(text)
            continue
        if _WARNING.search(text):
            broken.append(f"a warning: {text}")
        if _APT_OUTPUT.match(text):
            if not apt_announced:
                broken.append(f"apt-get output before any line says what it installs and why: {text}")
        elif _APT_ANNOUNCEMENT.search(text):
            apt_announced = True
        if _PIP_OUTPUT.match(text):
            if not pip_announced:
                broken.append(f"pip output before any line says it installs: {text}")
        elif _PIP_ANNOUNCEMENT.search(text):
            pip_announced = True
    return broken, machine_notes


def machine_pip_locations(pip: Path) -> frozenset[str]:
    """Index and links locations from pip's configuration files and PIP_* variables (not our project's)."""
    listed = subprocess.run([str(pip), "config", "list"], capture_output=True, text=True, check=True).stdout
    locations: set[str] = set()
    for line in listed.splitlines():
        if match := _PIP_LOCATION_KEY.match(line.strip()):
            locations.update(match["value"].split())
    return frozenset(locations)


@dataclass(frozen=True)
class _Ran:
    command: str
    returncode: int
    output: str
    seconds: float


def _user_environment() -> dict[str, str]:
    """This process's environment as a user's shell would have it: not inside our .venv, not inside make."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL",
                        "MAKEOVERRIDES"}}
    ours = {Path(sys.prefix) / "bin", Path(sys.executable).parent}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if Path(p) not in ours)
    return env


def _run(command: str, cwd: Path, env: dict[str, str]) -> _Ran:
    start = time.monotonic()
    done = subprocess.run(command, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=1200)
    return _Ran(command, done.returncode, done.stdout, time.monotonic() - start)


def test_the_readme_lists_the_commands_this_test_runs() -> None:
    assert quickstart_commands((REPO / "README.md").read_text(encoding="utf-8")) == ["make site", "make test"]


@pytest.mark.slow  # a fresh clone, two pip installs into new virtualenvs
def test_quick_start_on_a_fresh_clone(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, capture_output=True)
    env = _user_environment()
    commands = [MAKE_TEST_SETUP if c == "make test" else c
                for c in quickstart_commands((REPO / "README.md").read_text(encoding="utf-8"))]
    ran = [_run(command, clone, env) for command in commands]

    for r in ran:
        print(f"$ {r.command}  ({r.seconds:.0f} s, exit {r.returncode})\n{r.output}")
    assert [r.returncode for r in ran] == [0] * len(ran), "a quick-start command failed (output above)"
    assert (clone / "dist" / "index.html").is_file()
    machine = machine_pip_locations(clone / ".venv" / "bin" / "pip")
    broken = {r.command: problems(r.output, machine)[0] for r in ran}
    assert broken == {r.command: [] for r in ran}


# The rules themselves, on output the commands really printed (a fresh clone, 2026-12-01).

_EDITABLE_NOTICE = """\
.venv/bin/pip install -q -e .
  /tmp/pip-build-env-418otjjn/overlay/lib/python3.11/site-packages/setuptools/command/editable_wheel.py:354: \
BuildBackendWarning: Editable installation.
  !!
          Please be careful with folders in your working directory with the same
          name as your package as they may take precedence during imports.
  !!
    with strategy, WheelFile(wheel_path, "w") as wheel_obj:
touch .venv/.site
"""
_LICENSE_TABLE = """\
  /tmp/pip-build-env-gefo_kyk/overlay/lib/python3.11/site-packages/setuptools/config/_apply_pyprojecttoml.py:82: \
BuildBackendWarning: `project.license` as a TOML table is deprecated
          By 2027-Feb-18, you need to update your project and remove deprecated calls
"""
_MACHINE_INDEX = ("WARNING: Location 'file:///opt/pypi-more/simple/jinja2/' is ignored: "
                  "it is neither a file nor a directory.")
_APT = """\
Reading package lists...
The following NEW packages will be installed:
  chromium
Setting up chromium (120.0) ...
"""
_ANNOUNCED_APT = ("make test: installing system packages with apt-get: chromium (the browser tests and the "
                  "grader's sandbox need them)\n" + _APT)


def test_setuptools_notices_are_warnings() -> None:
    broken, _ = problems(_EDITABLE_NOTICE + _LICENSE_TABLE)
    assert len(broken) == 3 and all(b.startswith("a warning: ") for b in broken)
    assert "Editable installation" in broken[0] and "deprecated" in broken[1]


def test_a_missing_package_in_the_machines_own_index_is_the_machines_note() -> None:
    assert problems(_MACHINE_INDEX, frozenset({"file:///opt/pypi-more/simple"})) == ([], [_MACHINE_INDEX])
    assert problems(_MACHINE_INDEX, frozenset({"file:///opt/pypi/simple"}))[0] == [f"a warning: {_MACHINE_INDEX}"]


def test_apt_get_output_needs_an_announcement_first() -> None:
    broken, _ = problems(_APT)
    assert len(broken) == 3 and all(b.startswith("apt-get output before") for b in broken)
    assert problems(_ANNOUNCED_APT) == ([], [])
    assert problems("apt-get install -y chromium\n" + _APT)[0], "a bare command line says neither what nor why"


def test_pip_output_needs_its_command_line_first() -> None:
    assert problems("Collecting jinja2\nSuccessfully installed jinja2-3.1.6\n")[0]
    assert problems(".venv/bin/pip install -e .\nCollecting jinja2\nSuccessfully installed jinja2-3.1.6\n") == ([], [])
