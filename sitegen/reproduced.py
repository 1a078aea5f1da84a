"""The same kernel graded on two of kernelboard's own GPUs of one architecture: do the verdicts match?

Why: a verdict a reader can trust does not depend on which machine graded it. The H100 SXM and the H200
are both sm_90, run the same grader on the same published files, and were graded on different hosts,
on different days, beside different builds. A kernel that passes on one and fails on the other is
either a bug of the kernel's that only one grading met (a race, an out-of-bounds read the allocator
hid), a grader whose verdict moved with its host, or a rule changed between two grader versions; each
such pair is listed with both messages, never averaged away. Only results a board shows count (not the
superseded ones `load.split_superseded` holds back), and only kernelboard's own measurements, never an
imported grader's. Speedups are not compared: each GPU divides by its own torch.compile baselines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

from kernelboard.eval.hardware import GPUS
from kernelboard.eval.settings import result_current

from .load import Result, Run, SiteData


@dataclass(frozen=True)
class Regraded:
    """One kernel with a kernelboard verdict on two GPUs of one architecture."""

    run: Run
    first: Result  # the two ordered by GPU key
    second: Result

    @property
    def same(self) -> bool:
        """The same status on both (`wrong` and `runtime_error` differ: a reader sees the label)."""
        return self.first.status == self.second.status

    @property
    def same_pass(self) -> bool:
        """Pass on both or on neither: what a board's ranking depends on."""
        return self.first.is_pass == self.second.is_pass

    @property
    def current(self) -> bool:
        """Both verdicts are ones today's grader would give (`settings.result_current`); a pair with an older
        one is to be graded again (`--resume`), and may differ by a rule changed since."""
        return all(result_current(r.grader_version, r.message, self.run.problem, r.status, r.run_id)
                   for r in (self.first, self.second))

    @property
    def versions(self) -> str:
        """'0.5.31' or '0.5.5 / 0.5.13': the graders of the two verdicts."""
        a, b = self.first.grader_version, self.second.grader_version
        return a if a == b else f"{a} / {b}"


@dataclass(frozen=True)
class Reproduced:
    pairs: tuple[Regraded, ...]  # sorted by (GPU pair, run_id)
    gpus: tuple[str, ...]  # the GPUs that graded at least one of them

    def _where(self, keep: Callable[[Regraded], bool]) -> tuple[Regraded, ...]:
        return tuple(p for p in self.pairs if keep(p))

    @property
    def same(self) -> tuple[Regraded, ...]:
        return self._where(lambda p: p.same)

    @property
    def differ(self) -> tuple[Regraded, ...]:
        return self._where(lambda p: not p.same)

    @property
    def current(self) -> tuple[Regraded, ...]:
        """Pairs whose two verdicts today's grader would both give."""
        return self._where(lambda p: p.current)

    @property
    def differ_pass(self) -> tuple[Regraded, ...]:
        """Pairs where one GPU passes the kernel and the other does not."""
        return self._where(lambda p: not p.same_pass)


def reproduced(data: SiteData) -> Reproduced:
    """Every (kernel, pair of GPUs of one SM) that kernelboard graded on both, with the board's results."""
    ours: dict[str, list[Result]] = {}
    for r in data.results:
        if not r.is_imported and r.gpu in GPUS and r.run_id in data.runs:  # GPUS: no CPU key, no unknown GPU
            ours.setdefault(r.run_id, []).append(r)
    pairs = []
    for run_id, results in ours.items():
        for a, b in combinations(sorted(results, key=lambda r: r.gpu), 2):
            if GPUS[a.gpu].sm == GPUS[b.gpu].sm:
                pairs.append(Regraded(data.runs[run_id], a, b))
    pairs.sort(key=lambda p: (p.first.gpu, p.second.gpu, p.run.run_id))
    return Reproduced(tuple(pairs), tuple(sorted({r.gpu for p in pairs for r in (p.first, p.second)})))
