"""The runner's call on new inputs in the last call's memory (grader 0.5.29, `runner._recycle`), on the CPU: the
new tensors lie where the kept ones did, with their sizes, strides and version counters, and usually their ids;
an input that does not fit its slot is placed as any check's input is."""

from __future__ import annotations

import torch

from kernelboard.eval.runner import _kept, _recycle, _Shared


def _shared(t: torch.Tensor) -> _Shared:
    return _Shared(t.clone(), None)


def test_new_inputs_take_the_last_calls_memory_and_version_counters() -> None:
    last = [torch.randn(4, 6)[:, ::2], torch.arange(5), torch.zeros(3)]  # a strided view among them
    last[2].add_(1)  # version 1
    addresses, versions = [t.data_ptr() for t in last], [t._version for t in last]
    kept = _kept(last)
    last = None  # the runner holds the arguments through `kept` alone, as after the call
    values = [_Shared(torch.randn(4, 3), (6, 2)), _shared(torch.arange(5) * 7), _shared(torch.full((3,), 2.0))]
    placed, same, _ = _recycle(values, kept, "cpu")
    assert same == [True, True, True] and kept == []
    for (arg, view), value, address, version in zip(placed, values, addresses, versions, strict=True):
        assert arg.data_ptr() == address and arg._version == version and view is value.view
        assert torch.equal(arg, value.view)
    assert placed[0][0].stride() == (6, 2)


def test_the_new_tensors_usually_take_the_freed_ones_ids() -> None:
    """Made right after the old ones are let go: CPython's allocator hands the freed objects' memory back."""
    hits = 0
    for _ in range(20):
        last = [torch.randn(8), torch.arange(4)]
        ids = [id(t) for t in last]
        kept = _kept(last)
        del last
        placed, _, ident = _recycle([_shared(torch.randn(8)), _shared(torch.arange(4))], kept, "cpu")
        assert ident == [id(arg) == i for (arg, _), i in zip(placed, ids, strict=True)]  # reported as it is
        hits += ident == [True, True]
    assert hits >= 15, hits


def test_an_input_that_does_not_fit_its_slot_is_placed_anew() -> None:
    kept = _kept([torch.randn(4), torch.randn(2, 2), 3])
    values = [_shared(torch.randn(5)), _shared(torch.randn(2, 2).to(torch.float16)), _shared(torch.randn(1))]
    placed, same, ident = _recycle(values, kept, "cpu")
    assert same == [False, False, False] and ident == [False, False, False]
    assert [arg is value.view for (arg, _), value in zip(placed, values, strict=True)] == [True] * 3  # the CPU's view


def test_a_kept_argument_that_is_not_a_tensor_leaves_its_position_alone() -> None:
    kept = _kept([torch.randn(3)])
    placed, same, _ = _recycle([_shared(torch.randn(3)), 1.5], kept, "cpu")
    assert same == [True, False] and placed[1] == (1.5, None)
