"""The judge's record of torch's global switches a solution flips (grader 0.5.12: named, never failed)."""

from __future__ import annotations

from typing import Any

import pytest

from kernelboard.eval.judge import Switches


class _Reply:
    """What `Switches.note` reads of a runner's reply: its report of the switches."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state(self, like: dict[str, Any]) -> dict[str, Any]:
        assert set(like) == set(self._state)
        return self._state


def test_switches_name_each_change_once_and_keep_a_switch_set_back(capsys: pytest.CaptureFixture[str]) -> None:
    switches = Switches({"matmul.allow_tf32": False, "float32_matmul_precision": "highest"})
    switches.note(_Reply({"matmul.allow_tf32": False, "float32_matmul_precision": "highest"}), "at import")
    assert switches.clause() == ""
    switches.note(_Reply({"matmul.allow_tf32": True, "float32_matmul_precision": "high"}), "during shape 0")
    switches.note(_Reply({"matmul.allow_tf32": True, "float32_matmul_precision": "high"}), "during shape 1")
    switches.note(_Reply({"matmul.allow_tf32": False, "float32_matmul_precision": "high"}), "while timing")
    logged = [line for line in capsys.readouterr().out.splitlines() if "global switches" in line]
    assert len(logged) == 1 and "during shape 0" in logged[0]  # once; setting it back is no new change
    assert switches.clause() == ("; it changed torch's global switches (float32_matmul_precision: 'highest' -> "
                                 "'high', matmul.allow_tf32: False -> True)")
