"""What is left to grade on one GPU's board, and the order that ranks the most models soonest.

A board kernelboard measured ranks a model only once every published run of it (with a kernel) on the
board's problems (those with a result on that GPU) has a result there (sitegen/board.py's regrade rule),
and a problem enters the board with its first result. So the queue takes, first, the AI models' runs of
the problems already on the board that have no result the site shows there (none, or one it holds back
until graded again), model by model, the model with the fewest such runs first (each is ranked as soon as
its last one is graded); then those problems' runs whose shown row `--resume` grades again (an earlier
grader's, or a Mega pass of a looser check: settings.TIGHTENED_PASSES), house runs, runs whose agent left
no kernel and kernels published without results; then the other problems one whole problem at a time,
those on the board first (whose baselines the grader measures again: a batch measures every problem's it
is given before it grades, minutes a problem), then those not started, the one with the fewest runs
first, model by model within it: starting a problem holds back the rank of every model with a run on it
until its runs there are graded, so problems are not started side by side. Runs are counted, not
seconds: a call grades what it can of `Todo.now()`, and the next goes on from there.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from .deck import Problem, load_deck
from .schedule import EvalOptions, _cached_baselines, _graded_solutions, baselines_todo, select_submissions
from .schema import HOUSE_HARNESS, HOUSE_MODEL, IMPORTED_SUFFIX
from .settings import held_back, rebaselines
from .submission import Submission
from .tables import read_table, table_path


@dataclass(frozen=True)
class ProblemProgress:
    """One problem's runs on one GPU: how many are graded there (by a grader whose results the current
    one reproduces, with the same solution), of how many, and whether it is on that GPU's board."""

    problem: str
    graded: int
    total: int
    on_board: bool  # a run of it has a result on that GPU (the site shows the problem on its board)
    measured: bool = True  # its baselines on that GPU are ones the current grader reuses


@dataclass(frozen=True)
class Todo:
    """The runs left to grade on `gpu`, in grading order (`queue`), and each problem's progress."""

    gpu: str
    progress: tuple[ProblemProgress, ...]
    queue: tuple[Submission, ...]
    blocking: int  # the first runs of `queue`: an AI model's on a problem of the board, with no result shown
    ready: int  # the first runs of `queue`: on a problem of the board whose baselines are measured

    def now(self) -> tuple[Submission, ...]:
        """What a GPU call should be given: the runs left on the board's problems whose baselines are
        measured, or, when none are, the runs of the one problem to take next. A batch measures the
        baselines of every problem it is given before it grades (minutes a problem), so a queue that
        reached into problems it will not get to would spend a call on them."""
        if self.ready:
            return self.queue[:self.ready]
        first = self.queue[0].problem if self.queue else None
        return tuple(s for s in self.queue if s.problem == first)

    def ranked_after(self) -> dict[str, int]:
        """model -> how many runs of the queue are graded when its rank is held back no more (by the runs
        of the board's problems; a problem started later holds it back again), in queue order."""
        last: dict[str, int] = {}
        for i, sub in enumerate(self.queue[:self.blocking]):
            last[_model(sub)] = i + 1
        return last


def _model(sub: Submission) -> str:
    return str(sub.meta.get("model") or sub.run_id)


def _is_house(sub: Submission) -> bool:
    """A maintainers' run (the house kernel, a calibration row): shown on a board, never ranked."""
    return sub.meta.get("harness") == HOUSE_HARNESS or sub.meta.get("model") == HOUSE_MODEL


def _by_model(runs: Iterable[Submission]) -> list[Submission]:
    """`runs` grouped by model, the model with the fewest runs first (then by name), each model's runs
    in run_id order: the order in which models complete soonest, one run at a time."""
    groups: dict[str, list[Submission]] = defaultdict(list)
    for sub in runs:
        groups[_model(sub)].append(sub)
    order = sorted(groups, key=lambda m: (len(groups[m]), m))
    return [sub for m in order for sub in sorted(groups[m], key=lambda s: s.run_id)]


def plan_todo(gpu: str, subs: Iterable[Submission], graded: dict[str, str | None], shown: Iterable[str],
              measured: Iterable[str] | None = None, published: Iterable[str] | None = None) -> Todo:
    """The `Todo` of `subs` on `gpu`, where `graded` maps each run graded there to its solution's hash
    (`schedule._graded_solutions`): a run counts as graded only with the same solution, as `--resume` skips.
    `shown` are the runs whose result on `gpu` the site shows (`settings.held_back` holds the rest back): a
    problem is on the board with one, even where an earlier grader's row is to be graded again. `measured`
    names the problems whose baselines on `gpu` the current grader reuses (None: all): a problem on the
    board without them is taken like one not started, whole and in turn, since a batch measures them first
    (minutes a problem). `published` names the runs another grader's results were imported for (None: all):
    the site waits on those alone (a Mega kernel published without a results row holds no rank back)."""
    subs = list(subs)
    done = {s.run_id for s in subs if s.run_id in graded and graded[s.run_id] == s.solution_sha256()}
    shown = set(shown) | done
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for sub in subs:
        totals[sub.problem][1] += 1
        totals[sub.problem][0] += sub.run_id in done
    on_board = {s.problem for s in subs if s.run_id in shown}
    measured = set(totals) if measured is None else set(measured)
    progress = tuple(ProblemProgress(p, g, t, p in on_board, p in measured) for p, (g, t) in sorted(totals.items()))
    started = on_board & measured
    left = [s for s in subs if s.run_id not in done]
    published = None if published is None else set(published)
    holds_back = [s for s in left if s.problem in started and s.run_id not in shown and not _is_house(s)
                  and s.has_solution  # a run whose agent left no kernel has nothing to regrade
                  and (published is None or s.run_id in published)]
    queue = _by_model(holds_back)  # each holds an AI model's rank back
    queue += _by_model(s for s in left if s.problem in started and s not in holds_back)  # regrades, house, no kernel
    ready = len(queue)
    fresh: dict[str, list[Submission]] = defaultdict(list)
    for sub in left:
        if sub.problem not in started:
            fresh[sub.problem].append(sub)
    for problem in sorted(fresh, key=lambda p: (p not in on_board, len(fresh[p]), p)):
        queue += _by_model(fresh[problem])
    return Todo(gpu, progress, tuple(queue), len(holds_back), ready)


def todo(opts: EvalOptions, gpu: str) -> Todo:
    """What `--resume` would still grade on `gpu` of the runs `opts` selects, in the order that ranks the
    most models soonest, read from `opts.out` with no GPU."""
    deck = load_deck(opts.deck)
    return plan_todo(gpu, select_submissions(opts, set(deck)), _graded_solutions(opts, gpu),
                     _shown_on_board(opts.out, gpu), _measured_problems(opts, gpu, deck), _published(opts.out))


def _published(out: Path) -> set[str]:
    """The runs another grader's results were imported for, on any GPU folder under `out`: the published runs
    a board waits on (sitegen/board.py `regrades`)."""
    runs: set[str] = set()
    for folder in sorted(p for p in out.iterdir() if p.is_dir()) if out.is_dir() else []:
        path = folder / "results.parquet"
        if path.is_file():
            table = read_table(path, "results").select(["run_id", "measured_by"]).to_pylist()
            runs |= {r["run_id"] for r in table if r["measured_by"].endswith(IMPORTED_SUFFIX)}
    return runs


def _shown_on_board(out: Path, gpu: str) -> set[str]:
    """The runs whose result on `gpu` the site shows: every row but those it holds back until they are graded
    again (`settings.held_back`, as sitegen/load.py `split_superseded` applies it)."""
    results, runs, baselines = (table_path(out, gpu, name) for name in ("results", "runs", "baselines"))
    if not (results.exists() and runs.exists()):
        return set()
    run_rows = {r["run_id"]: r for r in read_table(runs, "runs").to_pylist()}
    rebaselined = {(b["bench"], b["problem"]) for b in (read_table(baselines, "baselines").to_pylist()
                                                         if baselines.exists() else [])
                   if rebaselines(b["variant"], b["grader_version"])}
    shown = set()
    for row in read_table(results, "results").to_pylist():
        run = run_rows.get(row["run_id"], {})
        if row["measured_by"].endswith(IMPORTED_SUFFIX) or not held_back(
                row["grader_version"], row["status"], row["message"], run.get("problem"),
                (run.get("bench"), run.get("problem")) in rebaselined):
            shown.add(row["run_id"])
    return shown


def _measured_problems(opts: EvalOptions, gpu: str, deck: dict[str, Problem]) -> set[str]:
    """The deck's problems whose every baseline on `gpu` (each shape's variants) is one the current grader
    reuses, read from the tables with no GPU: the grading host's device and software taken to be those
    that measured them, as on the fleet so far (the host checks them: `schedule._cached_baselines`)."""
    cuda = replace(opts, device="cuda")
    return {name for name, problem in deck.items()
            if not any(baselines_todo(cuda, problem, _cached_baselines(opts.out, gpu, problem, None)).values())}
