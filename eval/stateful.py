"""A stateful step as the flat call the grader knows (the Mega deck: `Model.step(hidden, state) ->
(hidden, state)`, state a list of per-layer dicts of tensors).

Everything downstream — the shared input arena, the runner's placement and copy-back, the timing
feed and its probes, the judge's comparison — works on a flat list of input tensors and a tuple of
output tensors. So the step is flattened at both ends, by the same `StepLayout` on both sides: the
inputs are `[hidden, state[0][k0], state[0][k1], …]` (each layer's keys in sorted order), and
`StepAdapter`, a module around the Model (the reference's in the judge, the solution's in the
runner), rebuilds the nested (hidden, state) for the call and flattens what the step returns the
same way. A step returns its state however it likes (the same dicts updated in place, new dicts,
grown tensors); what is judged is the flat tuple of its hidden output and every state tensor. A
returned state that is not a list of dicts holding the layout's keys is refused with a message naming
what differs.

A layer's dict may hold keys of the solution's own beside the problem's (KernelBench-Mega's published
kernels keep a decompressed MLA cache, `k_nope` and `v`, or preallocated buffers there): the caller
threads the state through, so the step's contract is the problem's keys. The extra ones are never
compared and never fed back — every checked step starts from the reference's state and every timed
call from a drawn one — so they cannot carry anything from one graded call to the next, and a step
that needs them rebuilds them inside the call it is timed on. `StepAdapter.extra_keys` names them.

Every call of one adapter gets the same list and the same per-layer dicts, refilled with that call's
tensors, as a serving engine recycles a sequence's state slot: a step must be a function of the state's
contents. One keyed on the identity of its containers (`id(state)`, a dict it kept) and stepping on from
a private copy fails on the next call, every time; before grader 0.5.3 it failed only where CPython
happened to give a new list a freed one's id (a published kernel, `key = id(state)`, did so at its 8th
check). Tensors are never recycled this way: each call's are the grader's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class StepOutputError(ValueError):
    """What a step returned does not have the state's layout (a layer or a key missing or extra)."""


@dataclass(frozen=True)
class StepLayout:
    """Which state tensors a step takes and returns, in the flat call's order: per layer, its keys."""

    layers: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, state: Sequence[dict[str, torch.Tensor]]) -> StepLayout:
        """The layout of a state as the reference draws it."""
        if not isinstance(state, list | tuple) or not all(isinstance(layer, dict) for layer in state):
            raise TypeError(f"a step's state must be a list of dicts of tensors, got {type(state).__name__}")
        return cls(tuple(tuple(sorted(layer)) for layer in state))

    @property
    def names(self) -> list[str]:
        """The flat call's parts, for messages: 'hidden', 'state[0].S', …"""
        return ["hidden"] + [f"state[{i}].{key}" for i, keys in enumerate(self.layers) for key in keys]

    def flatten(self, hidden: torch.Tensor, state: Sequence[dict[str, Any]]) -> list[Any]:
        """[hidden, then every state tensor in layout order]; raises StepOutputError on another layout."""
        if not isinstance(state, list | tuple):
            raise StepOutputError(f"the state returned is a {type(state).__name__}, expected a list of "
                                  f"{len(self.layers)} dicts")
        if len(state) != len(self.layers):
            raise StepOutputError(f"the state returned has {len(state)} layers, expected {len(self.layers)}")
        flat = [hidden]
        for i, (layer, keys) in enumerate(zip(state, self.layers, strict=True)):
            if not isinstance(layer, dict):
                raise StepOutputError(f"state[{i}] returned is a {type(layer).__name__}, expected a dict with "
                                      f"keys {list(keys)}")
            missing = [key for key in keys if key not in layer]
            if missing:
                raise StepOutputError(f"state[{i}] returned has keys {sorted(map(str, layer))}, expected "
                                      f"{list(keys)} ({', '.join(missing)} missing)")
            flat += [layer[key] for key in keys]
        return flat

    def extra_keys(self, state: Sequence[dict[str, Any]]) -> list[str]:
        """'state[i].key' for each key of a returned state that is not the problem's (see the module
        docstring); call it on a state `flatten` accepted."""
        return [f"state[{i}].{key}" for i, (layer, keys) in enumerate(zip(state, self.layers, strict=True))
                for key in sorted(map(str, layer)) if key not in keys]

    def unflatten(self, flat: Sequence[Any]) -> tuple[Any, list[dict[str, Any]]]:
        """(hidden, state) from the flat call's arguments: new dicts holding the same tensors."""
        expected = 1 + sum(len(keys) for keys in self.layers)
        if len(flat) != expected:
            raise ValueError(f"{len(flat)} arguments for a step whose layout has {expected}")
        rest = iter(flat[1:])
        return flat[0], [{key: next(rest) for key in keys} for keys in self.layers]


class StepAdapter(nn.Module):
    """`model.<entry>(hidden, state)` called with the flat arguments; returns the flat tuple. With
    `margins` (the reference only: its step takes a list that each MoE appends its router margin to),
    the last call's margins are kept in `last_margins`."""

    def __init__(self, model: nn.Module, layout: StepLayout, entry: str = "step", margins: bool = False) -> None:
        super().__init__()
        self.model = model
        self.layout = layout
        self.entry = entry
        self.margins = margins
        self.last_margins: list[float] = []
        self.extra_keys: list[str] = []  # the last call's state keys of the solution's own (module docstring)
        self._slot: tuple[list[dict[str, Any]], tuple[dict[str, Any], ...]] | None = None  # (the list, its dicts)

    def forward(self, *flat: Any) -> tuple[Any, ...]:
        return self._call(flat, None)

    def with_runner_up(self, router: int, *flat: Any) -> tuple[Any, ...]:
        """The reference's step with router `router` choosing its runner-up expert in place of its last
        chosen one (problem.py `Stateful`: a deck with `router_margin_ulps` promises `flip=`): the
        output another expert choice at that router gives."""
        if not self.margins:
            raise ValueError("only the reference's step (margins=True) takes a router's runner-up")
        return self._call(flat, router)

    def _recycled(self, fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The adapter's one state list, its own dicts put back (a step may have replaced or added entries)
        and refilled with `fresh`'s tensors (module docstring)."""
        if self._slot is None:
            self._slot = (fresh, tuple(fresh))
            return fresh
        state, dicts = self._slot
        state[:] = dicts
        for mine, new in zip(dicts, fresh, strict=True):
            mine.clear()
            mine.update(new)
        return state

    def _call(self, flat: tuple[Any, ...], flip: int | None) -> tuple[Any, ...]:
        hidden, fresh = self.layout.unflatten(flat)
        state = self._recycled(fresh)
        step = getattr(self.model, self.entry)
        if self.margins:
            self.last_margins = []
            out = (step(hidden, state, self.last_margins) if flip is None
                   else step(hidden, state, self.last_margins, flip=flip))
        else:
            out = step(hidden, state)
        if not isinstance(out, tuple | list) or len(out) != 2:
            raise StepOutputError(f"{self.entry} returned a {type(out).__name__}, expected (hidden, state)")
        flat = tuple(self.layout.flatten(out[0], out[1]))
        # named only where a layer holds more keys than the problem's (a timed call's host work stays as small)
        grew = any(len(layer) != len(keys) for layer, keys in zip(out[1], self.layout.layers, strict=True))
        self.extra_keys = self.layout.extra_keys(out[1]) if grew else []
        return flat


class FunctionStep(nn.Module):
    """A deck's library line for a stateful step, `fn(model, hidden, state) -> (hidden, state)`, as a
    module with `step` (so `StepAdapter` calls it like a Model); `model` is the reference's."""

    def __init__(self, fn: Any, model: nn.Module) -> None:
        super().__init__()
        self.fn = fn
        self.inner = model

    def step(self, hidden: Any, state: Any) -> Any:
        return self.fn(self.inner, hidden, state)


def clone_flat(flat: Sequence[Any]) -> list[Any]:
    """Private copies of a flat call's tensors (a step may update its state in place)."""
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in flat]
