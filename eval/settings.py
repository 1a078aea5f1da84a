"""The grader's settings, in one torch-free module: the grader imports them, the site prints them.

`timing.py`, `judge.py`, `audit.py` (which import torch), `schedule.py` and `scoring.py` take
these constants from here, so the methodology page (`sitegen/views_meta.py`) shows the values the
grader actually runs with without importing torch. Change a value here and both follow.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kernelboard import __version__

#: Written into every result and baseline row; --resume regrades results of a version before
#: RESULTS_COMPARABLE_SINCE (below).
GRADER_VERSION = __version__
#: Cached baseline rows are reused from any grader version from this one up to GRADER_VERSION:
#: raise it whenever timing or the baseline worker changes what a baseline row means.
#: Eager and compile rows have been measured the same way since 0.2.0; library rows are checked
#: against the reference (a wrong one records no time) since 0.2.2.
#: Since 0.4.0 every GPU line is timed with its dispatch covered (timing.time_cuda); since 0.4.1 a
#: covered sample's floor is the least dispatch, not the median (a line whose dispatch nears its
#: GPU time, as eager lines of many small ops can, would be floored differently); since 0.4.2 a loop
#: the host bound is run up to FLOOR_WINDOWS times, the least floor kept (such lines again); 0.4.3
#: checks the kept loop's outputs and 0.4.4 bounds the probes' normalised error, which change no baseline.
BASELINE_METHOD_SINCE: dict[str, str] = {"eager": "0.4.2", "compile": "0.4.2", "library": "0.4.2"}

#: The reference is timed eager and through torch.compile; the headline is the faster compile mode.
BASELINE_VARIANTS: dict[str, tuple[str, ...]] = {"cuda": ("eager", "compile:default", "compile:max-autotune"),
                                                 "cpu": ("eager", "compile:default")}
#: The baseline variants a headline speedup may be measured against (the fastest that ran wins).
HEADLINE_COMPILE_VARIANTS = ("compile:default", "compile:max-autotune")

#: Input sets for baseline timing are fixed so cached baselines stay comparable across runs.
BASELINE_TIMING_SEEDS = (2026, 2027)
#: Shapes faster than this are launch-bound: their CUDA-graph replay time is reported beside them.
LAUNCH_BOUND_MS = 0.2

#: CUDA kernels that PyTorch, its compiler or a vendor library launch — not the candidate's own:
#: by how their names begin, or (cuBLAS's batched TRSM, `batch_trsm_left_kernel<…>(cublasTrsm…)`,
#: seen on an H200 with torch 2.11) by a vendor library's name anywhere in the signature.
#: Only a fallback: the runner tells the candidate's kernels by where they come from
#: (origins.own_kernels) and the own-kernel rule uses this only where it could not. A name says little:
#: a candidate's `gemv_w4_kernel` or its own CUTLASS instantiation looks like a library's, so the
#: cuBLAS prefixes are the exact families (`gemv2T_`, `gemv2N_`, `gemvNSP_`, `gemmk1_`, `dot_kernel<`),
#: not `gemv`, `gemmk` or `dot_kernel` alone.
LIBRARY_KERNEL = re.compile(
    r"^(void )?(at::|at_cuda_detail|\(anonymous namespace\)|c10::|cub::|cutlass::Kernel|cutlass_\d|cutlass3x_|"
    r"sm\d+_xmma|nvjet|cublas|cudnn|ampere_|volta_|turing_|hopper_|gemv2[NT]_|gemvNSP_|gemmk1_|gemmSN_|magma_|"
    r"internal::gemvx|dot_kernel<|splitKreduce|triton_(poi|red|per|tem)_|Memcpy|Memset|memcpy|memset)"
    r"|cublas|cusolver|cufft|cudnn|cusparse",
    re.IGNORECASE,
)
#: Escaped work (audit.escaped_work): a call after which the device stays busy, past the end of
#: the calling stream, for more than this fraction of the event median + this slack. An honest
#: call leaves only a synchronise's latency (~0.01 ms, more on a loaded host: since 0.5.26 the same
#: synchronises' latency around no call is taken off first); work moved to another stream leaves its
#: whole length. A kernel that synchronises inside its call is never flagged by it (0.2.x judged
#: host-synchronised time against 1.5× the median and flagged such kernels on some gradings).
ESCAPE_FRACTION, ESCAPE_SLACK_MS = 0.05, 0.05

#: A pass is refused `integrity_violation` where a shape's median time implies more than this fraction of the
#: GPU's datasheet peak for the problem's regime (scoring.beyond_hardware, since 0.5.13): every timed call starts
#: from a flushed L2, so the bytes a problem must move come from DRAM, and no kernel moves them faster than the
#: memory allows, nor does more FLOPs than the tensor cores can. Such a time is not the computation's: an output
#: served from a cache that the timing pool's repeated values hit, or a clock that lies only in the timed loop
#: (the two known gaps of the judge's clock, eval/timing.py). The most an honest pass reached, on every GPU graded
#: here and every imported board, is 0.90 of its regime's peak (0.77 graded here: 03 on the H100 SXM; on
#: 2026-12-06, and the methodology page gives the figure of the data it is built from).
PEAK_FRACTION_LIMIT = 1.0

#: A stateful deck's timing and floor-batch sets are drawn states whose every router choice is clear:
#: the first of up to ROUTER_CLEAR_DRAWS draws whose least router margin is at least
#: ROUTER_CLEAR_FACTOR × the deck's `router_margin_ulps`, else the widest of them. Checked steps may
#: sit at a near-tie (their element-wise bound is then lifted); a timed output is judged element-wise
#: always, so a rounding that picks the other expert there must not be possible. On the H200 (Mega,
#: 64 experts, top 8) torch.compile's step and the tuned baseline, both faithful, chose another
#: expert than the eager reference on a timing set of each of two contexts (‖d‖/‖ref‖ 0.12–0.16).
#: How often a draw is clear (the reference on the CPU at the real dimensions, context 2048, 24 seeds):
#: its least margin over the 4 MoEs was ≥ 2 ulps in 18, ≥ 4 in 7, ≥ 8 in 3; so about two sets in three
#: find a clear draw among 8, and the rest take the widest (typically 4–5 ulps).
ROUTER_CLEAR_FACTOR, ROUTER_CLEAR_DRAWS = 4.0, 8

#: The L2 flush buffer zeroed before every timed call is this many times the L2 size …
L2_FLUSH_FACTOR = 2
#: … and never smaller than this many bytes.
MIN_FLUSH_BYTES = 1 << 24
#: What a GPU holds for a grading beyond the tensors the grader counts (`judge._fits_beside_judge`): the
#: judge's and the runner's CUDA contexts (about 0.5 GB each on the H100) and their allocators' slack.
GRADER_CONTEXTS_BYTES = 2 << 30
#: A runner's out-of-memory error is the candidate's (`oom`) only where it had at least this share of the
#: GPU's memory beside the grader's own (`judge._oom_verdict`); else the grading is not_graded. The field's
#: harnesses hold the reference beside the candidate in one process; ours holds more (every check's
#: reference, the timing and floor-batch sets), so a kernel is promised half of the GPU, not all but that.
CANDIDATE_GPU_SHARE_MIN = 0.5
#: Timed calls rotate over at least this many input sets (an output cache cannot serve them).
MIN_INPUT_SETS = 2
#: Timed calls are refilled from this many pool input sets (≥ 3: a live set never sees the same
#: values twice in a row), each with a judge-computed reference.
TIMING_POOL_SETS = 3
#: The judge's floor under a claimed time (timing.floor_ms): this many batches of back-to-back
#: calls, each call on an input set never used before, at most PROOF_MAX_SETS sets per batch and
#: their inputs at most PROOF_MAX_BYTES in all, drawn until the judge's references for them took
#: PROOF_REF_BUDGET_S (at least PROOF_MIN_SETS per batch).
PROOF_ROUNDS, PROOF_MIN_SETS, PROOF_MAX_SETS = 5, 2, 12
PROOF_MAX_BYTES, PROOF_REF_BUDGET_S = 4 << 30, 0.1
#: Judge wall time per batch that is not the calls' (the request's round trip, the runner's
#: dispatch): subtracted before dividing by the calls.
PROOF_ROUNDTRIP_MS = 0.5
#: Judge wall time per call of a floor batch that is not the call's own (the runner's loop between
#: calls). Measured honest on the 2-core CPU: 15 µs a call (108 calls of 03's first CPU shape, 17.4 ms
#: by the judge, 15.8 ms by the runner's honest clock). It is also the check's resolution: for calls
#: shorter than about this, a lying clock is not caught here (the round trip is kept out by making
#: each batch last PROOF_MIN_BATCH_MS).
PROOF_DISPATCH_MS = {"cpu": 0.03, "cuda": 0.02}
#: Each floor batch is repeated (its later passes without probes) until it should last this long by
#: the timed median, so the request's round trip is a small part of the judge's wall time; at most
#: PROOF_MAX_REPEAT passes (a claim of ~0 ms cannot make a batch run for ever).
PROOF_MIN_BATCH_MS, PROOF_MAX_REPEAT = 20.0, 200
#: Past two batches, no more floor batches once they took this much of the judge's clock in all.
PROOF_FLOOR_BUDGET_MS = 150.0
#: Where no floor batch passes the two-clock check, at most PROOF_RETRIES longer batches, each made
#: to outlast the worst round trip seen PROOF_RETRY_STRETCH times by the runner's claim (at most
#: PROOF_MAX_RETRY_REPEAT passes). Seen on the 2-core CPU with two test suites at once (load up to 76):
#: an honest 07 reference's 5 calls claimed 1.2 ms inside a 7.5 ms round trip, refused.
PROOF_RETRIES, PROOF_RETRY_STRETCH, PROOF_MAX_RETRY_REPEAT = 2, 10.0, 2000


def proof_shape(median_ms: float, sets: int) -> tuple[int, int]:
    """(sets used, passes) of a floor batch with `sets` input sets at `median_ms` a call: as few sets
    as last PROOF_MIN_BATCH_MS (one call when a call alone lasts that long, else at least 2), repeated
    until they do (at most PROOF_MAX_REPEAT passes), so slow calls cost no more than they must and
    fast ones are not drowned by the round trip."""
    least = 1 if median_ms >= PROOF_MIN_BATCH_MS else min(2, sets)
    used = max(least, min(sets, math.ceil(PROOF_MIN_BATCH_MS / max(median_ms, 1e-6))))
    return used, max(1, min(PROOF_MAX_REPEAT, math.ceil(PROOF_MIN_BATCH_MS / max(median_ms * used, 1e-6))))
#: In at least one floor batch the runner's own samples must cover this fraction of the judge's
#: wall time for the same calls (less the round trip): room for noise. Measured on an H200 x2 host
#: grading on both GPUs (2026-12-01): honest house 03 batches covered as little as 0.69 (two of six
#: gradings had every batch of one shape below 0.7, and were refused under 0.7), a runner whose
#: event timer halves every interval covered 0.38.
PROOF_CLAIM_FACTOR = 0.6
#: The judge's witness of the CPU's timed loop (eval/witness.py): where the judge's median span is at
#: least WITNESS_MIN_SPAN_MS, a loop whose samples are, call for call (the median), under WITNESS_FACTOR
#: of the judge's spans less WITNESS_HANDSHAKE_MS is logged as doubtful; not refused. Measured on the
#: 2-core CI machine (2026-12-07): a clock halved inside the timed loop read 0.45–0.51; honest loops read
#: 0.73–1.08 in one `make test` (126 loops with spans of 0.25 ms or more) and 0.82–0.94 alone, but in a
#: fresh clone's `.ci/run` the honest reference of 03 read 0.28 and 0.23 at one shape (spans 2.8 ms around
#: 0.5 ms calls: the host's wake-ups, not the call), which grader 0.5.25 refused.
WITNESS_FACTOR = 0.6
WITNESS_HANDSHAKE_MS = {"cpu": 0.05}
WITNESS_MIN_SPAN_MS = 0.25
#: The judge's witness of a GPU shape (eval/gpu_witness.py), after its timed loop: WITNESS_GPU_CALLS calls
#: with a call and as many without (the null loop), their judge side queued up front (~10 stream operations a
#: call, far under the ~1,000 a stream holds before its host waits). The null is capped at the judge's own
#: copies and flush plus WITNESS_GPU_SWITCH_CAP_MS, the two context switches a call pays: 283–318 µs on an
#: H100 (bench/cross_process_timing.py, 2026-12-07), with room. Where the judge's figure for a call is at least
#: WITNESS_GPU_MIN_MS, a timed median under WITNESS_GPU_FACTOR of it is logged as doubtful (not refused until
#: honest gradings give the ratios). Its first measurement (tests/test_eval_gpu.py, an H100 80GB HBM3,
#: 2026-12-07, grader 0.5.29): the house 03 kernel read 0.99 at its 0.123 ms shape (1.23 at its 0.020 ms one,
#: under WITNESS_GPU_MIN_MS), the same kernel with its event timer halved in the timed loop alone 0.56 and 0.63:
#: 0.75 lies between (the bench's grader-shaped handshake had read 0.59–0.81 honest, 0.35–0.40 halved).
#: A shape whose timing sets are over WITNESS_GPU_MAX_BYTES in all is not witnessed (the judge
#: keeps them for it; 06's headline sets are GBs), and a loop that has not ended WITNESS_GPU_STALL_S after it was
#: queued is released on both sides and logged.
WITNESS_GPU_CALLS = 16
WITNESS_GPU_SWITCH_CAP_MS = 0.35
WITNESS_GPU_MIN_MS = 0.05
WITNESS_GPU_FACTOR = 0.75
WITNESS_GPU_MAX_BYTES = 1 << 30
WITNESS_GPU_STALL_S = 20.0
#: The environment variable that turns the GPU witness on ("1"): off by default for `kernelboard eval` until
#: honest gradings have given its ratios; bench/gpu_session.sh, which grades the boards, turns it on to gather them.
WITNESS_GPU_ENV = "KERNELBOARD_GPU_WITNESS"
#: Milliseconds of busy work that lift the GPU from idle clocks before anything is measured.
SPIN_UP_MS = 200.0


@dataclass(frozen=True)
class TimerDefaults:
    """A timer's default loop: warm-up until both limits pass, then rep_ms of calls within [min, max]."""

    warmup_ms: float
    min_warmup: int
    rep_ms: float
    min_iters: int
    max_iters: int


#: `timing.time_cuda` (CUDA events) and `timing.time_cpu` (perf_counter) defaults.
#: The covered GPU timer (timing.time_cuda): before each timed call the GPU sleeps COVER_FACTOR
#: times the host's slowest measured dispatch of one call (clamped to [COVER_MIN_MS, COVER_MAX_MS]),
#: so the call's launches are queued when it starts; a call whose dispatch took COVER_MARGIN of the
#: sleep or more was not covered (or waited on the GPU) and its sample is its GPU span.
COVER_FACTOR = 3.0
COVER_MIN_MS = 0.05
COVER_MAX_MS = 5.0
COVER_MARGIN = 0.8
#: More uncovered calls than this share of a loop: it is timed again behind a sleep COVER_RETRY_FACTOR
#: times longer (a loaded host's dispatch outgrew the cover), and where that loop has as many, without
#: the cover (the calls wait on the GPU inside themselves, which waits out any sleep).
COVER_UNCOVERED_SHARE = 0.1
COVER_RETRY_FACTOR = 4.0
#: A covered loop is given up at its call COVER_PILOT_CALLS where more than COVER_PILOT_SHARE of the
#: calls before it outlasted their sleep (since 0.4.5): the decision the whole loop would reach, minus
#: its thousands of waited-out sleeps (a call that waits on the GPU inside itself outlasts every one; on
#: the H200 such an 03 kernel spent about 8 s a shape in two doomed covered loops before being timed
#: synchronised). A loop given up this way counts as one that outgrew its cover.
COVER_PILOT_CALLS = 32
COVER_PILOT_SHARE = 0.5
#: A covered loop the host bound (its floor, the least dispatch less one launch's, above the median
#: GPU span) is run again up to FLOOR_WINDOWS loops in all, each after a pause of
#: FLOOR_WINDOW_PAUSE_MS, and the loop with the least floor is kept (timing._covered): a KVM host
#: can be slow for a whole loop (one grading's least dispatch for the same call 0.0198 ms, the
#: others' 0.0146 ms).
FLOOR_WINDOWS = 3
FLOOR_WINDOW_PAUSE_MS = 20.0
#: The judge's check that the cover hid no work (audit.cover_hid_work): a call from an idle GPU to a
#: device-wide synchronise, less the same synchronises timed around no call, may take at most the
#: covered loop's GPU span plus its dispatch plus this slack (COVER_SLACK_MS + COVER_SLACK_FRACTION
#: of the two); beyond it the shape is timed again with the GPU idle before each call (the whole
#: latency, as before 0.4.0).
COVER_SLACK_MS = 0.02
COVER_SLACK_FRACTION = 0.25
CUDA_TIMER = TimerDefaults(warmup_ms=100.0, min_warmup=10, rep_ms=400.0, min_iters=20, max_iters=2000)
CPU_TIMER = TimerDefaults(warmup_ms=50.0, min_warmup=3, rep_ms=200.0, min_iters=10, max_iters=200)
#: Bytes written before each CPU timed call (a cache-sized buffer).
CPU_FLUSH_BYTES = 64 << 20

#: What a sandboxed process (the runner, the prebuild) prints reaches its published log through
#: eval/sandbox_output.py: the first LOG_HEAD_BYTES of its lines as they come (the largest committed grading or
#: prebuild log is 16 KB, so no honest grading loses a line), then, once it has ended, a count of the rest and its
#: last LOG_TAIL_BYTES (room for a long traceback). A flood costs the disk about a MiB, not the sandbox's 8 GiB.
LOG_HEAD_BYTES = 1 << 20
LOG_TAIL_BYTES = 64 << 10


def _version(text: str) -> tuple[int, ...]:
    """'0.2.1' -> (0, 2, 1); a suffix such as '.dev3' or '+local' is ignored."""
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0].split(".dev")[0])[:3])


#: The first grader to label a failure built against its own CUTLASS, in place of an unpublished vendored one,
#: `not_reproducible` (eval/reproducible.py `cutlass_stood_in`): an earlier failure that rule relabels is not
#: current, and `--resume` grades it again (schedule._graded_solutions).
CUTLASS_STAND_IN_SINCE = "0.5.10"


def version_order(text: str) -> tuple[tuple[int, ...], str]:
    """A sort key that puts grader versions, bare ('0.5.9') or named ('kernelboard 0.5.9'), in release order
    ('0.5.9' before '0.5.11', which a string sort reverses); text without a version sorts first, by itself."""
    return _version(text), text


def graded_before(grader_version: str, since: str) -> bool:
    """Whether a grader of `grader_version` predates version `since`."""
    return _version(grader_version) < _version(since)


def timed_before_method(grader_version: str, variant: str = "compile") -> bool:
    """Whether a grader of `grader_version` timed by a method older than the one `variant`'s baselines
    are measured by now (BASELINE_METHOD_SINCE): its rows and today's baselines do not compare."""
    return graded_before(grader_version, BASELINE_METHOD_SINCE[variant.split(":", 1)[0]])


#: The oldest grader whose results this one reproduces: the same checks (so the same verdicts) and the
#: same timing method. `--resume` skips a run graded by any version from this one to this grader's (a
#: device call grades about ten runs, so a change that cannot move a verdict and moves a figure only as
#: noise does must not send every graded run back to the GPU). 0.4.5 gives up a covered loop at its
#: pilot calls where 0.4.4 ran it out to the same decision (COVER_PILOT_CALLS). 0.4.6 changes only
#: stateful (Mega) grading, which no earlier grader ran on a GPU: its state moved to the device, its
#: weights drawn there, its timed sets drawn clear of router ties. 0.4.7 sends the timed calls' probes
#: as one binary frame (a Mega step's JSON probes outgrew the reply header's bound): same checks.
#: 0.4.8 records the covered loop's GPU span (shapes.gpu_span_ms), null in earlier rows: same figures.
#: 0.4.9 labels a solution that reads a helper of the original grader's reference.py `not_reproducible`
#: (a build_error before): same checks and figures for every kernel that builds.
#: 0.5.0 accepts a stateful step's state keys of its own (SUPERSEDED_VERDICTS names the verdicts it changes).
#: 0.5.1 takes a router problem's timed call that returns another expert choice's output as that choice.
#: 0.5.2 runs the op audit on a shape's second call (warm), not its first, and draws a stateful deck's
#: timing and floor-batch states on the device: no verdict changes (a first-call-only op buys no time).
#: 0.5.3 logs each shape's first call and op-audit call apart (a kernel's own compile runs there), and gives
#: every call of a stateful step one recycled state list and dicts (eval/stateful.py): a step keyed on its
#: containers' identity now fails at its second check, where 0.5.2 failed it only when CPython reused an id.
#: No earlier pass is touched: none of the 24 published Mega passes keys on them (read in their code; one
#: compares the state with the list it last returned itself, which the grader never passes back).
#: 0.5.4 has the prebuild call each solution's Model once on meta tensors (eval/prebuild.py `warm_call`), so
#: an extension built on the first call is built on the CPU ahead of the GPU too: no check or figure changes.
#: 0.5.5's warm call covers every shape and compiles the solution's Triton kernels for the grading GPU with
#: no GPU (eval/triton_compile_only.py: launches compile, none runs), and each grading's log counts the
#: kernels built while it ran, apart from those found built: no check or figure changes.
#: 0.5.6 records a run a batch was cut off in (<out>/<gpu>/interrupted.json, eval/interrupted.py) and grades
#: such runs after every other in the next batch (with --gpus too: an interrupted parent stops its children
#: and merges what they finished): scheduling only, no check or figure changes. Its prebuild
#: can refuse torch's extension builds (`kernelboard eval compile-ahead`, eval/ahead.py: Triton kernels
#: compiled on another CPU host, carried into the grader's caches).
#: 0.5.7 measures every problem's baselines before any build starts, builds the first run ahead too, and has
#: the GPU take the first run whose build has ended (schedule.next_to_grade), with runs held back built
#: first (schedule.build_window); its warm call may run 480 s: scheduling only, no check or figure changes.
#: 0.5.8: a build that has ended keeps no place among the `depth` running ahead (a held run built early no
#: longer stops the builds behind it while it waits to go last), and for a GPU grading the warm call runs
#: every shape again on fake CUDA tensors (prebuild._fake_cuda_call: builds behind `if x.is_cuda`), and
#: the prebuild answers `torch.cuda.get_device_properties` with the probe's identity of the grading GPU, at
#: import too: scheduling and building only, no check or figure changes.
#: 0.5.9: a launch-bound shape's CUDA-graph replay whose output misses the reference's leaves `graph_ms` empty
#: with a note instead of failing the kernel `wrong` (judge._graph_times): the replay is a figure beside the
#: latency, and a call that launches on the legacy default stream captures an empty graph (claude-opus-4-8
#: 07 034935 on the H100, right on every check and timed call). SUPERSEDED_VERDICTS names the verdict.
#: Its scheduling: a run cut off within HOLD_BACK_AFTER_S of build and grading keeps its place in the next
#: batch (only longer ones go last), one held run at most builds early, and `--build-ahead N` sets how many
#: build at once. Its prebuild calls every shape on fake CUDA tensors, also where no Model could be built on
#: meta or the CPU (one that allocates on "cuda:0" itself), with torch.cuda's streams, events and graphs
#: standing in for the GPU's (prebuild._host_streams_and_graphs): building only.
#: 0.5.10 labels a failure `not_reproducible` where its build added a vendored CUTLASS folder beside the
#: solution that the published files lack (the grader's own CUTLASS stood in) and the evidence ties the
#: failure to CUTLASS: an error line naming it, or, for a `wrong` output, the kernel's files calling their
#: CUTLASS changed (eval/reproducible.py `cutlass_stood_in`; gpt-5.6-sol 07 150450, "customized"). Judge
#: side only: no check or figure changes; one committed verdict moves (that run's 0.5.9 `wrong`, which
#: `--resume` grades again: CUTLASS_STAND_IN_SINCE).
#: Its grading runs in the scratch copy its prebuild built in, keeping only builds there (schedule.graded_copy):
#: a build beside solution.py (`build_directory=` a folder of its own) is no longer done again on the GPU's time
#: (deepseek-v4-flash-0731 07 021705: 343 s, cut off; grok-4.5 07 040836: a 73 s first call), and the log's
#: "built while grading" counts shared objects there too: building only, no check or figure changes.
#: 0.5.11 holds a checked step at a router near-tie element-wise (judge._near_tie_verdict): to the reference's
#: output or, with one router tied, to that router's runner-up choice; with several tied, the states of the
#: layers up to the first tied router's. 0.5.10 and earlier kept the cosine rule alone at such steps (about
#: half of Mega's checked steps): its Mega passes are graded again by `--resume` (TIGHTENED_PASSES) but stay
#: shown, measured under their grader's rule; its failures stand (the new rule is stricter).
#: 0.5.12 notes a change of torch's global numeric switches in the runner (the log, and the verdict's message)
#: instead of failing the kernel `integrity_violation` (judge.Switches): since 0.2.0 the reference, its outputs
#: and the baselines are computed in processes the solution never enters, so a switch it flips reaches only its
#: own computations, which every check holds to the reference. Two committed verdicts fall to it
#: (SUPERSEDED_VERDICTS): claude-fable-5 07 224447 (H200) and qwen3.8-max 07 025959 (H100 SXM), which turn
#: `allow_bf16_reduced_precision_reduction` off at import for fp32 reductions in their own cuBLAS calls.
#: 0.5.13 refuses a pass timed beyond the GPU's datasheet peak for its problem's regime (PEAK_FRACTION_LIMIT,
#: scoring.beyond_hardware), in the parent after scoring: no committed pass comes near it (0.77 at most), so
#: no committed verdict moves and none is graded again.
#: 0.5.14 widens bf16 `tl.dot` operands to fp32 in Triton's interpreter (a CPU grading's runner; eval/interpreter.py),
#: whose dot multiplied their bit patterns: a correct bf16 kernel was `wrong` on the CPU; and masks off, and says in
#: the log, a lane outside the tensors a launch was given, which the interpreter read from host memory. GPU
#: gradings are unchanged and no committed row is a CPU grading.
#: 0.5.15 fits 06's headline shape on an 80 GB H100: the judge keeps the checks' inputs on the host and lets go
#: of its timing and floor-batch sets before the runner places its own (15 GB each side); the runner drops a
#: checked shape's floor batches; a grading's runner tree is killed and waited for whole (eval/proctree.py);
#: and a shape whose grader-side demand cannot fit the GPU is not_graded, never the candidate's `oom`. Before,
#: every 06 grading on the H100, the house reference's too, was `oom` (none was committed). What a kernel is
#: checked and timed against is unchanged.
#: 0.5.16: on the H100, 0.5.15's judge still held 42.4 GB at 06's headline (its references lay in blocks its freed
#: inputs had left, which `empty_cache` cannot return), and the house kernel was `oom` again. The judge's allocator
#: now maps its segments page by page (expandable segments), drops each shape's floor-batch references once it is
#: timed, and a runner's OOM is the candidate's only where it had half of the GPU beside the grader's own share
#: (CANDIDATE_GPU_SHARE_MIN); `correctness.compare` works in fp64 chunks (COMPARE_CHUNK), and an earlier shape keeps
#: one timing reference (a CUDA-graph replay's). What a kernel is checked and timed against is unchanged.
#: 0.5.17: a reply's output tensors come through shared memory (protocol.OutputArea, a sealed memfd per shape),
#: not the socket, which carried 06's 0.8 GB outputs at about 1 GB/s; the input arena is sealed at its size too.
#: On the H100 (2026-12-06) 06 took 54–116 s a grading, 168–170 s under 0.5.16. What is checked and timed is
#: unchanged. 0.5.18: once a shape is checked and timed the runner lets its checks' inputs and floor batches go
#: and empties its allocator's cache (runner._op_release), before the judge draws the next shape: 06's wide
#: shape ran the judge out of the H100's memory beside a runner of 38.5 GB (LongCat-2.0 082519, not_graded).
#: 0.5.19: the judge's own out-of-memory error is weighed as a runner's is (judge._judge_oom_verdict): the
#: candidate's `oom` where the runner held more than CANDIDATE_GPU_SHARE_MIN of the GPU beyond the grader's
#: placed sets, not_graded within it (until then always not_graded, a verdict a hoarding kernel could dodge);
#: --resume grades again a not_graded row that is the grader's failure (schedule.gives_verdict).
#: 0.5.20: a root grader's sandbox drops root before candidate code runs (jail.sandbox_uid: a uid of its own per
#: solution, no capabilities), so RLIMIT_NPROC, which the kernel does not apply to root, stops a fork bomb where
#: no cgroup can be made (the GPU hosts); the row's `sandbox` says which uid it ran as. Verdicts unchanged.
#: 0.5.21: the drop of 0.5.20 engages on a host whose /dev/nvidia* names a folder (/dev/nvidia-caps, read as a
#: device node closed to other users: 0.5.20's ten H100 rows kept root, as their `sandbox` says); the runner's
#: log says whether each shape's shared inputs are page-locked (a driver may refuse an unprivileged uid).
#: 0.5.22: what the runner and the prebuild print reaches their logs through a pipe the trusted side reads
#: (eval/sandbox_output.py): a line of theirs that starts like a tagged line other than with their own tag (as
#: the grader's `[grader]` and the judge's `[worker]` do, look-alikes included) is marked `[runner printed]` /
#: `[prebuild printed]`, and past LOG_HEAD_BYTES only their last LOG_TAIL_BYTES are kept, after a count of the
#: rest. Logs only: verdicts unchanged.
#: 0.5.23: the log says the moment a process's output passes LOG_HEAD_BYTES (a worker killed at a phase's
#: timeout writes no count or tail); a batch cut off while measuring baselines keeps the rows it finished (the
#: baseline worker checkpoints after each row), and the next measures the rest. Verdicts unchanged.
#: 0.5.24: with --stop-at, a run that could not finish is taken out of the queue at once, its build ended (the
#: batch waited for such builds until its deadline), and a pass the batch grades updates its problem's quickest
#: pass (another GPU's stood in all batch long). Scheduling only: verdicts unchanged.
#: 0.5.25: on the CPU the judge's own clock witnesses every timed call (eval/witness.py), and a loop whose
#: samples are call for call under WITNESS_FACTOR of its spans is timed again, then refused as an
#: integrity_violation (a clock lie told only inside the timed loop). GPU gradings unchanged.
#: 0.5.26: a launched kernel the profiler names by its mangled symbol is the candidate's own where its binary
#: holds that symbol, whether or not c++filt demangles it there (origins._add_symbols): 0.5.25 refused two 01
#: kernels of their own CUTLASS 3 GEMMs on the H100 SXM as `forbidden`. And escaped work is the residue beyond
#: the synchronises' own latency around no call, call by call (audit.escaped_work): 0.5.25 refused a
#: single-stream 01 kernel on a host slowed by five builds. The three rows were taken out of data/held before
#: publication, to be graded again. Verdicts change only for such kernels.
#: 0.5.27: the witness's ratio is logged, no longer refused (a loaded CI host read an honest reference at
#: 0.23–0.28, under the 0.6 that 0.5.25 refused); a report of more or fewer calls than it saw, or a broken
#: handshake, is still an integrity_violation. CPU only.
#: 0.5.28: on a GPU, after each shape's timed loop, the judge's own stream times WITNESS_GPU_CALLS calls the
#: runner makes through device memory both map (eval/gpu_witness.py), and the log gives its figure for a
#: call beside the timed median: logged, not refused, and only with KERNELBOARD_GPU_WITNESS=1 until a GPU has
#: measured it. The timed loop itself is unchanged; verdicts unchanged.
#: 0.5.29: each shape of a stateless problem calls its first nominal check once more after its last, the inputs
#: written where the last call's were, as new tensors with the same sizes, strides and version counters
#: (judge._recycled_call): a kernel that keeps what it derived from an input under the input's address serves a
#: stale result there. Verdicts change only for such kernels (TIGHTENED_PASSES names the two passes it may change).
#: And the GPU witness's note of doubt moves from under 0.5 to under 0.75 of its figure, as its first measurement
#: set it (logged only).
#: 0.5.30: a host-synchronised reading past audit.cover_hid_work's allowance is taken once more, and the shape
#: is timed again with the GPU idle only where both readings exceed it (judge._host_synced): a host busy with
#: builds stretched one reading of an honest 01 kernel's shapes and cost it its covered figures (1.75× against
#: 2.38× on a quieter host). Timing method changes only for shapes whose first reading tripped the rule.
#: 0.5.31: the builds of the runs behind a grading pause while it is in its timing phase (schedule.BuildQueue.quiet,
#: sandbox.Prebuild.pause): a shape the host bounds is timed at the host's least dispatch, which moved up to 2×
#: between busy and quieter hosts (three 0.5.7–0.5.9 passes on the H100 SXM graded again beside short prebuilds only:
#: 0.87×→1.39×, 1.04×→1.78×, 2.57×→3.48×). The rules are unchanged; the host is quieter while they measure.
RESULTS_COMPARABLE_SINCE = "0.4.4"

#: Passes an earlier grader gave under a looser check than the current one, as (the first grader with the
#: stricter check, the problems or the run ids it applies to, what it checks more strictly, as a run page says
#: it): `--resume` grades them again, and until then the site shows
#: them as their grader measured them (unlike SUPERSEDED_VERDICTS, which it holds back: a verdict that rule
#: changed). 0.5.11: Mega's checked steps at a router near-tie, held element-wise. 0.5.29: the inputs written
#: where the last call's were; of the 302 published Hard kernels, read for results kept under an input's address
#: (data/README.md), two have a pass on a board that such a call may not give: deepseek-v4-flash-0731's 01 of
#: 2026-08-01 replays its CUDA graph on its cached K-padded x whenever x's address and version counter repeat, and
#: its 06 of 2026-08-01 keeps its tile schedule under `id(offsets)` and the offsets' version counter.
TIGHTENED_PASSES: tuple[tuple[str, frozenset[str], str], ...] = (
    ("0.5.11", frozenset({"02_kimi_linear_decode"}),
     "its checked steps at a router near-tie were held to the cosine rule alone, where the current grader holds "
     "them element-wise"),
    ("0.5.29", frozenset({"20260801_205612_or-fable_deepseek_deepseek-v4-flash-0731_01_fp8_gemm",
                          "20260801_233528_or-fable_deepseek_deepseek-v4-flash-0731_06_sonic_moe_swiglu"}),
     "its code serves a result kept under an input's address (or id) and version counter, and it was never called "
     "with new inputs written where the last call's were, as the current grader calls it"),
)


def tightened_since(graded_by: str, problem: str | None, status: str | None,
                    run_id: str | None = None) -> tuple[str, str] | None:
    """(the grader, what it checks more strictly) where a pass graded by `graded_by` on `problem` (of the run
    `run_id`) predates a stricter check of the current grader (TIGHTENED_PASSES), else None."""
    if status != "pass":
        return None
    return next(((since, what) for since, scope, what in TIGHTENED_PASSES
                 if graded_before(graded_by, since) and (problem in scope or run_id in scope)), None)


#: Verdicts an earlier grader gave under a rule a later one changed, as (the first grader without the rule,
#: a pattern of the result's message): such a result is not current (`--resume` grades it again) and the
#: site holds it back as a regrade in progress (sitegen/load.py `split_superseded`), where RESULTS_COMPARABLE_SINCE
#: would send every graded run back to the GPU. 0.5.0 accepts a stateful step's state keys of its own beside
#: the problem's (eval/stateful.py); 0.4.x refused them as `wrong`: three published Mega kernels that keep a
#: decompressed MLA cache or preallocated buffers in the state.
#: 0.5.1 holds a router problem's timed call that misses its reference to the output of another expert
#: choice too (eval/judge.py `_RunnerUps`): a timed-call miss on the Mega step before 0.5.1 may be one.
#: 0.5.12 notes a solution's change of torch's global switches where earlier graders failed it
#: `integrity_violation` ("torch global state changed …").
#: Each entry: (since, message pattern, the problems it applies to, or None for every problem).
SUPERSEDED_VERDICTS: tuple[tuple[str, re.Pattern[str], frozenset[str] | None], ...] = (
    ("0.5.0", re.compile(r"StepOutputError: state\[\d+\] returned has keys"), None),
    ("0.5.1", re.compile(r"(timed call \d+ \(input set|floor batch \d+[^,]*, call \d+ \(input set"
                         r"|(a timed call|the CUDA-graph replay) on input set) \d+.*returned a wrong output"),
     frozenset({"02_kimi_linear_decode"})),
    ("0.5.9", re.compile(r"the CUDA-graph replay on input set \d+ returned a wrong output"), None),
    ("0.5.12", re.compile(r"^torch global state changed"), None),
)


def verdict_superseded(graded_by: str, message: str | None, problem: str | None = None) -> bool:
    """Whether a verdict of grader `graded_by` with this message, on `problem`, fell to a later rule
    (SUPERSEDED_VERDICTS)."""
    return any(graded_before(graded_by, since) and pattern.search(message or "")
               and (problems is None or problem in problems)
               for since, pattern, problems in SUPERSEDED_VERDICTS)


def rebaselines(variant: str, measured_by: str) -> bool:
    """Whether a baseline row of `variant` measured by grader `measured_by` re-baselines its problem on its GPU:
    a torch.compile line timed by today's method (`held_back`'s `rebaselined`)."""
    return variant.startswith("compile") and not timed_before_method(measured_by)


def held_back(graded_by: str, status: str, message: str | None, problem: str | None, rebaselined: bool) -> bool:
    """Whether the site holds a result kernelboard measured back from every board and page until it is graded
    again (sitegen/load.py `split_superseded` says why): a pass timed by an older method than its problem's
    compile baselines on its GPU (`rebaselined`: measured by today's method), or a verdict a later rule
    changed (SUPERSEDED_VERDICTS). Imported results are never held back."""
    return ((status == "pass" and rebaselined and timed_before_method(graded_by))
            or verdict_superseded(graded_by, message, problem))


def result_current(graded_by: str, message: str | None = None, problem: str | None = None,
                   status: str | None = None, run_id: str | None = None) -> bool:
    """Whether a result graded by `graded_by` (on `problem`, with `status`, of the run `run_id`) is one this
    grader would give (see RESULTS_COMPARABLE_SINCE, SUPERSEDED_VERDICTS and TIGHTENED_PASSES)."""
    return (_version(RESULTS_COMPARABLE_SINCE) <= _version(graded_by) <= _version(GRADER_VERSION)
            and not verdict_superseded(graded_by, message, problem)
            and tightened_since(graded_by, problem, status, run_id) is None)


def baseline_reusable(variant: str, measured_by: str) -> bool:
    """Whether a cached baseline row of `variant` measured by grader `measured_by` means what this
    grader would measure now (see BASELINE_METHOD_SINCE)."""
    since = BASELINE_METHOD_SINCE[variant.split(":", 1)[0]]
    return _version(since) <= _version(measured_by) <= _version(GRADER_VERSION)


#: Submissions whose extensions compile on the CPU at once, ahead of the one the GPU grades
#: (schedule.run_eval): at most PREBUILD_AHEAD, and one per PREBUILD_CPUS_EACH cores of the host
#: (the H200's host has 16: three builds; this 2-core machine: one). Each torch extension build
#: runs ninja with two compilers (the binding's C++ and the .cu) for 50–60 s. `eval --build-ahead N` sets
#: the depth instead: on the H100 host of 2026-12-05 (16 cores, three at once, one place held by a 400 s
#: Triton compile) the GPU was busy about 40% of the calls' grading time and waited on 60–100 s builds for the rest.
#: Whether five at once keep the timing's spread is for bench/gpu_grading.py --cpu-load 10 to say first
#: (four busy processes kept it ≤ 0.7% on the H200's host).
PREBUILD_AHEAD, PREBUILD_CPUS_EACH = 3, 4

#: A run a batch was cut off in is graded last by the next batches (eval/interrupted.py) only when it had run
#: this long, its build and its grading together: one cut sooner was where the call's deadline fell, not a run
#: that outlasts calls, and goes in its place. After three H100 calls on 2026-12-05 six runs were held back,
#: five of them cut 8–58 s into their grading (two in their timing), and every call built the held runs first.
HOLD_BACK_AFTER_S = 120.0

#: How long a prebuild's warm call may run (prebuild.warm_call), all shapes together: the solution's Model
#: built and called on meta tensors of each shape, so that an extension it builds in its constructor or its
#: first call is built on the CPU too, and its Triton kernels are compiled (for the grading GPU's arch). On
#: the H200, 10 of 28 published 05 kernels built that way, each in about 50 s of the GPU's time; of the 301
#: Hard and 62 Mega submissions, the warm call reaches the builds of 45 and 8 that no import does, and
#: compiles the Triton kernels of 124 of the 179 Triton-only Hard ones (1,315 variants, 1,290 s of compile;
#: bench/warm_call_reach.py). A build cut off here is built again by the worker, as it was before. Since
#: 0.5.7 the GPU grades the runs whose builds have ended meanwhile (schedule.next_to_grade), so a long warm
#: call holds up only its own run. 480 s stays inside the build's timeout (600 s, `--build-timeout`) and
#: covers most of the slowest Triton compile seen: MiniMax-M3 07 215424 unrolls 32 `tl.dot` groups, and its
#: five variants took 524 s on a 2-core CPU host (159 s and 368 s for two of them on the H200's host).
PREBUILD_WARM_CALL_S = 480
