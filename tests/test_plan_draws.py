"""Where the judge draws a grading's inputs: the checked seeds as the original draws them (on the
CPU), the fresh sets (timing pool, floor batches) on the device where the reference allows it."""

from __future__ import annotations

import types

import torch

from kernelboard.eval.plan import draw_fresh, draw_inputs


def _reference(cpu_only: bool) -> types.ModuleType:
    module = types.ModuleType("reference")
    seen: list[str] = []

    def get_inputs() -> list[torch.Tensor]:
        where = torch.empty(0).device.type  # the factory default get_inputs() runs under
        seen.append(where)
        if cpu_only and where != "cpu":
            raise RuntimeError("this reference draws with a CPU-only step")
        return [torch.randn(4, 3)]

    module.get_inputs = get_inputs  # type: ignore[attr-defined]
    module.seen = seen  # type: ignore[attr-defined]
    return module


def test_fresh_sets_are_drawn_on_the_device_itself() -> None:
    reference = _reference(cpu_only=False)
    (x,) = draw_fresh(reference, 7, "meta")
    assert x.device.type == "meta" and reference.seen == ["meta"]


def test_a_reference_that_cannot_draw_on_the_device_draws_on_the_cpu_and_moves() -> None:
    reference = _reference(cpu_only=True)
    (x,) = draw_fresh(reference, 7, "meta")
    assert x.device.type == "meta" and reference.seen == ["meta", "cpu"]


def test_on_the_cpu_a_fresh_set_is_the_seeds_own_draw() -> None:
    reference = _reference(cpu_only=False)
    assert torch.equal(draw_fresh(reference, 7, "cpu")[0], draw_inputs(reference, 7, "cpu")[0])
