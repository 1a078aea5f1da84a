"""Where kernelboard's verdict differs from the original grader's, on the kernels both graded (no torch).

kernelboard regrades the published kernels (the runs whose results were imported from another grader,
KernelBench-Hard) on its own GPU, under the same run_id. For every run that has a kernelboard-measured
result on a GPU (any result that is neither imported nor a CPU timing) and an imported result on its
source board, the two verdicts are compared as pass / not pass (`eval.schema.STATUSES`):

- **agree**: both pass, or both fail (whatever each one's failing status);
- **excluded**: not a verdict on the GPU — ours is `needs_other_arch`, `not_reproducible`, `not_graded`
  or `dnf` (the kernel says nothing about the model on this GPU), or theirs is `not_graded` or `dnf` (the
  source published no verdict), or theirs is a failure whose run's GPU-lock log shows its check ran no
  kernel (the importer's `RAN_NO_KERNEL`: every GPU command of the run, the check's included, held the
  GPU about a second in all, less than importing torch takes; the environment failed, not the kernel), or
  theirs is a check that timed out (the importer's `CHECK_TIMED_OUT`: KernelBench-Hard's own classifier
  marks a check timeout a retryable infrastructure failure; its check never reached a verdict);
- **differ**, with a cause class read from our status and message by the explicit rules of `classify`.
  A class that starts "stronger check:" names a check kernelboard runs and the original grader does not
  (a stress case, structural case or seed of ours only, the run-time audits, the integrity checks; for a
  stateful step, a state tensor theirs never compares (`THEIRS_COMPARED_OUTPUTS`), or our element-wise
  bound on one it does, where the error ‖d‖/‖ref‖ = r our message gives bounds the cosine (≥ √(1 − r²))
  above the deck's `cos_sim`, so their rule passed it); those rows are counted and listed apart — a
  numeric stress case included when theirs graded the kernel before it ran any
  (`THEIRS_NUMERIC_STRESS_SINCE`), and a structural case where theirs graded it before its own structural
  cases (`THEIRS_STRUCTURAL_SINCE`). A `wrong` on a check both graders run, where theirs graded the kernel
  on another GPU, is the class "other GPU" and counts against the figure (the kernel behaves differently
  there; why is for its run page's log), and so is a `runtime_error` in which Triton refuses a launch for
  more shared memory than our GPU gives a block (a kernel tiled for the other GPU). A difference no rule
  explains gets an honest "(to explain)" class and `explained=False`, which the methodology page flags: it
  is never hidden in a catch-all. A
  difference whose cause the two verdicts cannot show but the published files do carries that evidence
  (`EVIDENCE`, by run) beside its class, and counts where its class does. A difference that is our
  grader's limit (`OUR_LIMITS`, by run: a check of ours that refuses what it should not) is classed
  "our limit: …" whatever check fired, and counts against the figure.

The agreement figure is agree / (agree + differ not caused by a stronger check of ours), over the pairs
not excluded. Everything is computed from `SiteData` at build time, so the table grows as the regrade does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from kernelboard.eval.deck import Problem

from .ingest.kbh import CHECK_TIMED_OUT, RAN_NO_KERNEL
from .load import CPU_KEY, Result, Run, SiteData

#: Our statuses that are no verdict on the grading GPU: such a pair is excluded, not compared.
EXCLUDED_OURS = ("needs_other_arch", "not_reproducible", "not_graded", "dnf")
#: Their statuses that carry no published verdict to agree or differ with.
EXCLUDED_THEIRS = ("not_graded", "dnf")

#: Numeric stress cases our decks add to the original grader's deck, by (bench, problem). Kept by hand
#: because the decks are otherwise interface-compatible copies: each entry must be a numeric stress case
#: of that deck whose problem.yaml says it is ours (07's header: "plus one stress case of ours,
#: `small_scales`"); tests/test_site_agreement.py checks every entry against the deck. Structural cases
#: need no entry: the original grader has none (eval/format_kbh.py refuses `structural_stress`).
OURS_ONLY_CASES: dict[tuple[str, str], frozenset[str]] = {
    ("hard", "07_w4a16_gemm"): frozenset({"small_scales"}),
}

#: The outputs of a stateful step that the original grader's check.py compares, by (bench, problem), as our
#: messages name them (`StepLayout.names`). KernelBench-Mega's 02 check.py (kernelbench.com c7d9221) takes the
#: cosine of the hidden output, of `st[kda_layer]["S"]` and of `st[mla_layer]["c_kv"]`, where kda_layer and
#: mla_layer are the first "K" and the first "M" of the pattern [K, K, K, M]: layers 0 and 3. Its PROMPT.txt
#: promises "the next-token hidden vector and the updated decode state" are checked; the other layers' S, the
#: conv windows cq/ck/cv and the MLA k_rope are never compared, so a `wrong` on one of them is a check of
#: ours only. tests/test_deck_mega.py checks every name against the deck's state layout.
THEIRS_COMPARED_OUTPUTS: dict[tuple[str, str], frozenset[str]] = {
    ("mega", "02_kimi_linear_decode"): frozenset({"hidden", "state[0].S", "state[3].c_kv"}),
}

#: When the original grader first ran numeric stress cases: KernelBench-Hard's `src/eval/numeric_stress.py`
#: arrived in kernelbench.com commit 90b1afc (2026-06-12 09:24 -06:00). The sweep published the day before
#: (commit daf0506, "hard: publish v2 containerized sweep leaderboard", runs of 2026-06-10/11) was graded by
#: check.py files with no stress case, so a published pass graded before this time never met one.
THEIRS_NUMERIC_STRESS_SINCE = datetime(2026, 6, 12, 15, 24, 22, tzinfo=UTC)

#: When the original grader first ran structural cases of the kinds ours runs (KDA's long-memory chains, Sonic
#: MoE's ragged expert offsets with their 129-row transfer, top-k's clustered maxima, paged attention's
#: nonuniform short lengths): KernelBench-Hard's property-generated suite, kernelbench.com commit f41cf40
#: ("Harden grading with generated property checks", 2026-08-07 12:56 UTC; its DEVLOG entry of that day). A
#: verdict of theirs graded from then on met such a case, so ours failing one is no stronger check there.
THEIRS_STRUCTURAL_SINCE = datetime(2026, 8, 7, 12, 56, 42, tzinfo=UTC)

#: Disagreements that no rule can read from the two verdicts, each explained from the published files, by
#: run_id. The cause is shown in the table beside the class; the pair still counts where its class does.
EVIDENCE: dict[str, str] = {
    "20260709_090112_hy3_hy3_01_fp8_gemm": (
        "a bug of its own: its kernel loads x with no mask on M (solution.py:71), and its autotuner tries every "
        "config on a shape's first call. At shape 2 (skinny M, M = 32) each config with BLOCK_M over 32, 7 of its "
        "9 distinct, reads past the 262,144 B of x: bench/triton_bounds.py --shape 2 (2026-12-07) counted 8.4 to "
        "117 million of each such launch's addresses outside x (25–58% of them; the two BLOCK_M = 32 configs "
        "none), while its output is right, as the stores are masked. Whether such a read faults depends on what "
        "the allocator left mapped after x: on the H100 SXM it faulted in a floor batch, whose inputs sit in "
        "allocations of their own, with an illegal memory access; theirs graded it on a B200 and it did not"),
    "20260614_163128_deepseek-claude_deepseek-v4-pro_01_fp8_gemm": (
        "a bug of its own, the same as hy3's 090112: its kernel loads x with no mask on M (solution.py:45 and "
        ":56; it pads K only) and takes BLOCK_M = 64 for any M up to 64 (:103–104). At shape 2 (skinny M, M = 32) "
        "each of its 64 programs reads the 32 rows past x's end: bench/triton_bounds.py --shape 2 (2026-12-07) "
        "counted 16,777,216 of the launch's 100,933,632 addresses (17%) outside x's 262,144 B, from byte 262,144 "
        "on, while its output is right, as the stores are masked. Whether such a read faults depends on what the "
        "allocator left mapped after x: on the H100 SXM it faulted in a floor batch, whose inputs sit in "
        "allocations of their own, with an illegal memory access; theirs graded it on an RTX PRO 6000 and it "
        "did not"),
    "20260709_043047_grok_grok-4.5_01_fp8_gemm": (
        "a bug of its own: it keeps one copy of x padded to a multiple of BLOCK_K, keyed by x's address and "
        "version counter (solution.py:19–21, :69–92), and hands it back to any later x with that key. Only shape "
        "1 pads (K = 4127). Our runner places each check's x in a new tensor (eval/runner.py _place: one copy, "
        "version 1) and frees it after the call, so the caching allocator gives the next check's x the same "
        "block. Seed 42's small_weight case scales the weights only, so the x it left cached was a placed copy "
        "like seed 123's, with its block and version, and seed 123's output is another x's product, as its "
        "error shows: ‖d‖/‖ref‖ = 1.41 = √2, the distance between two outputs of independent inputs of one "
        "distribution. Their check.py draws a seed's inputs while the seed before's are still held "
        "(base_inputs = [t.to(device) …]), so seed 123's x cannot land where seed 42's was. Any caller that "
        "allocates its inputs anew each step meets it"),
    "20260709_090226_hy3_hy3_05_topk_bitonic": (
        "their check failed after 6 s; solution.py redirects Python's include path to "
        "/workspace/problems/05_topk_bitonic/_pyinc/python3.11, a folder of the agent's workspace that the "
        "published files lack, whenever the include path names python3.11 (their environment's Python); "
        "under our Python 3.12 the redirect does not apply, and the kernel builds and passes every "
        "check"),
    "20260702_142614_claude_claude-fable-5_05_topk_bitonic": (
        "their check failed after 3 s on a B200, which runs the kernel's sm_100 code (solution.py:827; an "
        "H200 JIT-compiles its compute_90 PTX, :828); their check log is not published, and their label "
        "\"build\" is scripts/build_catalog.py's COMPILE_RE, which matches any line with \"error:\" (a "
        "RuntimeError's or a CUDA error's too), so it need not be a build failure. On the H200 and the H100 "
        "SXM it is exact on all 80 checks, the structural tie and spike cases included, and on every timed call"),
    "20260709_011644_grok_grok-4.5_05_topk_bitonic": (
        "their check failed after 22 s on an H100; the kernel builds its extension on its first call "
        "(solution.py:541–551, into the default torch_extensions folder under the name topk_h100_final4); "
        "their check log is not published, and their label \"build\" is scripts/build_catalog.py's "
        "COMPILE_RE, tried before any value rule: their logs held \"error:\", \"load_inline\" or \"nvcc\" "
        "somewhere, which an exception or a failed build prints and a value mismatch does not. On the "
        "H200 and the H100 SXM it builds from the published file and is exact on all 80 checks, the structural tie and "
        "spike cases included, and on every timed call"),
    "20260709_040836_grok_grok-4.5_07_w4a16_gemm": (
        "their check failed after 5 s on an H100 PCIe, 5 s of it holding the GPU: too short to build its "
        "extension, which torch's load() compiles from the sidecar w4a16_kernels.cu into .cuda_build_v7 beside "
        "solution.py (solution.py:37–53; our prebuild took 78 s for it on 16 cores), so theirs loaded what the "
        "agent's session had left in that folder, or stopped before building; neither the folder nor their "
        "check log is published. On the H100 SXM it builds from the published files and is right on all 80 "
        "checks and every timed call"),
    "20260719_030522_grok_grok-4.5_05_topk_bitonic": (
        "their check failed after 93 s on a B200, 45 s of it holding the GPU; the kernel has no "
        "architecture-specific code (load_inline with torch's default target, solution.py:476–488) and their "
        "check log is not published. On the H100 SXM it builds from the published file and is exact on all "
        "80 checks, the structural tie and spike cases included, and on every timed call"),
    "20260719_024723_codex_gpt-5.6-sol_01_fp8_gemm": (
        "their check failed after 22 s on a B200 (its run detail: correct false, check_s 22); the reason they "
        "publish is how the agent's session ended, not why the check failed, as their classifier "
        "(src/harness/classification.py) names a run incomplete_session before it reads the check's exit, and "
        "their check log is not published. The kernel is plain Triton (tensor descriptors, a warp-specialised "
        "loop; no architecture-specific code) and its output buffer is reused from call to call, which a "
        "check that compares each output before the next call, theirs and ours alike, allows. On the H100 SXM "
        "it is right on all 64 checks and on every timed call"),
    "20260720_225753_or-fable_anthropic_claude-fable-5_03_paged_attention": (
        "a race of its own: on a call whose inputs sit at addresses it has not captured yet, its paged_capture "
        "(solution.py:102, in its CUDA source) launches the kernel on a stream from torch's pool, which does not "
        "wait for the caller's stream, and returns that launch's output. A numeric stress case hands it inputs "
        "scaled on the GPU just before the call, new tensors (eval/plan.py scaled_positions), so the kernel can "
        "read them before the scaling has written them: on the H100 SXM, seed 123's small_q_kv call of shape 0 "
        "returned an output 43.3 times the reference's norm away (0.00684 where the reference has 3.39e-5), as "
        "one computed from inputs partly left unscaled would be (the case scales the values by 0.01). "
        "KernelBench-Hard's check.py scales on the GPU too, but runs the reference on the scaled inputs "
        "before the solution, so the scaling has long finished when the side stream reads them. Any caller "
        "whose inputs come from the kernel just before meets the race"),
    "20260709_192708_codex_gpt-5.6-sol_02_kda_cutlass": (
        "a bug of its own, read from its code: its forward keys a CUDA graph on its inputs' pointers "
        "(solution.py:255), and on the second call with a pointer set it has seen it captures the graph "
        "(:259–265), which records the two launches without running them, and returns the output buffer as "
        "the call before left it. Each numeric stress case hands it new scaled q, k and v (eval/plan.py "
        "scaled_positions), and torch's caching allocator gives large_qkv's the blocks small_qkv's had just "
        "freed: the same pointers, so large_qkv got back the output of the call before, small_qkv's (q, k and v "
        "× 0.01): 1.43e-9 where 0.151 is expected, ‖d‖/‖ref‖ = 1. Computed on the CPU at seed 42 (shape 0), "
        "small_qkv's reference outputs have a median |x| of 1.2e-9 and a largest of 1.5e-8, nominal's 1.2e-3 "
        "and 1.4e-2, large_qkv's 1.1e-2 and 0.15. Theirs runs the reference on each case's scaled inputs "
        "first, in the same process: its allocations come between two cases', so their pointers need not "
        "repeat. KernelBench-Hard's check added a probe for this on 2026-08-07 (f41cf40: a warmed input "
        "rewritten in place, its pointer kept, \"so output caches cannot masquerade as CUDA-graph replay\"), "
        "after it graded this kernel. Any caller that allocates its inputs anew each step meets it"),
    "20260707_044245_longcat-claude_LongCat-2.0_07_w4a16_gemm": (
        "other GPU: theirs graded it on an RTX PRO 6000 (sm_120); on an H100 and an H200 (both sm_90, Triton "
        "3.6.0) its autotuner's first call faults with an illegal memory access. bench/autotune_configs.py "
        "--shape 0 ran each of its 9 configs alone in a fresh process (2026-12-05, H100 80GB HBM3): 8 give the "
        "reference's output, and config 8 (BM 64, BN 32, BK 128, 4 warps, 4 stages) faults alone (run under "
        "compute-sanitizer's memcheck, it faults again and memcheck names no out-of-bounds access). "
        "bench/triton_bounds.py --shape 0 launched each config in Triton's interpreter with every address "
        "checked (2026-12-06): config 8's 27.5 million addresses, like each other config's, are all inside its "
        "tensors, and the output is right. Read from its code, the same holds at every 07 shape (x and the "
        "packed weights masked on M and K, N a multiple of every BN): the fault is in Triton's sm_90 code for "
        "that tile, which the autotuner benchmarks whichever config would win"),
    "20260802_045225_or-fable_deepseek_deepseek-v4-flash-0731_02_kda_cutlass": (
        "other GPU: theirs graded it on an RTX PRO 6000 (sm_120); on an H100 (sm_90, Triton 3.6.0) its first "
        "call faults with an illegal memory access. bench/triton_bounds.py ran its three kernels (fixed "
        "configurations, no autotuner; solution.py:165–186) at each of 02's four shapes in Triton's interpreter "
        "with every address checked (2026-12-06): each of the 5–126 million addresses a launch's loads and "
        "stores touch is inside its tensors, and its output at seed 42 is right at every shape. Its addresses "
        "do not depend on the values (no index is loaded). So the fault is in the GPU code made for sm_90 of a "
        "kernel whose addresses are sound; which of its three launches faults is for a GPU to say "
        "(compute-sanitizer)"),
    "20260618_151017_gemini_gemini-3.5-flash_02_kimi_linear_decode": (
        "on the H200 its step gave one output on each of 6 timing states of context 8192 (10 back-to-back "
        "calls each, bench/step_determinism.py --queued), every one within the bound; on the failing "
        "floor-batch state its probed output is neither the reference's nor one of the 2 runner-up choices "
        "that keep the deck's cosine rule (the other 2 routers' runner-ups had cosine 0.83–0.97 with the "
        "reference's on those 6 states): an input theirs never drew"),
    "20260721_125907_zai-claude_glm-5.2_02_kimi_linear_decode": (
        "a race, read from its code: every block of its grid (one per SM slot, about 528 on an H200) applies "
        "RoPE in place to the one global copy of the new token's rope key (solution.py:327–331) and writes "
        "it to the cache (:342), so the stored row is rotated as many times as blocks got there first; old "
        "rows are copied exactly. A CPU emulation of 2–500 rotations gives 52–60 of its 64 elements out "
        "and ‖d‖/‖ref‖ 0.24–0.31 (ours measured 56 and 0.311). The next step attends to that key"),
    "20260721_103731_or-fable_anthropic_claude-fable-5_02_kimi_linear_decode": (
        "a race, read from its code: two blocks (dvh 0 and 1) step each KDA head's conv windows, and both "
        "read the window and write it shifted with no order between them (solution.py:636–652, tasks "
        "257–320 at :1127–1131), so a late reader shifts twice and leaves [p2, new, new]: the got value "
        "2.4375 is a raw q projection in the row where the previous input (expected −0.0108) belongs. A CPU "
        "emulation of 5–6 raced warps gives about 238 elements out and ‖d‖/‖ref‖ about 0.20 (ours measured "
        "238 and 0.232); the next step's conv reads that window"),
    "20260725_084342_or-opus_anthropic_claude-opus-5_02_kimi_linear_decode": (
        "its kernels are W4A8 (docstring: \"W4A8 with dp4a\"): every GEMV's input is rounded to int8 in "
        "groups of 128 (solution.py:316–352), where the problem says the activations are bf16; a CPU "
        "emulation of that rounding gives ‖d‖/‖ref‖ 0.034 and 2–3 elements out at seeds 0 and 2, and "
        "0.010–0.012 with none out when the activations are kept (ours measured 0.0323, 1 element out)"),
}

#: Disagreements that are our grader's limit, not the kernel's fault and not a stronger check, by run_id:
#: each shown as "our limit: …" and counted against the agreement figure until the grader is fixed. Empty
#: today: its one entry (claude-opus-4-8's Mega kernel 075926, a timed call's router flip refused by the
#: element-wise bound) was fixed in grader 0.5.1, and 0.5.2 graded it again: it passes.
OUR_LIMITS: dict[str, str] = {}
OUR_LIMIT = "our limit: "
STRONGER = "stronger check: "
TO_EXPLAIN = "(to explain)"

_CASE = re.compile(r"\bcase ([A-Za-z_][A-Za-z0-9_]*)")
#: "… step 0: output 14 (state[3].k_rope): 56 of …" -> "state[3].k_rope" (eval/link.py `part_label`).
_STEP_OUTPUT = re.compile(r": output \d+ \(([^)]+)\):")
_REL_ERR = re.compile(r"‖d‖/‖ref‖=([0-9.eE+-]+)")
_SEED = re.compile(r"\bseed (\d+)\b")
#: Triton's refusal of a launch whose tiles need more shared memory than the GPU gives a block: the same
#: kernel and launch fit where the compiler lays the tiles out differently (sm_100's accumulators live in
#: tensor memory, not shared memory), so on another GPU it is a difference of the GPU, read from the message.
_SHARED_MEMORY = re.compile(r"OutOfResources: out of resource: shared memory, Required: (\d+), Hardware limit: (\d+)")
#: "KernelBench-Hard (run detail): check.py: the output is incorrect" -> the part after the source name.
_SOURCE_PREFIX = re.compile(r"^[^:]*\((?:run detail|imported)\):\s*")


@dataclass(frozen=True)
class Verdict:
    """How two verdicts on one kernel compare: kind is 'agree', 'excluded' or 'differ'."""

    kind: str
    cause: str | None = None  # why excluded, or the cause class of a difference
    explained: bool = True  # False: a difference no rule explains yet (its cause says "(to explain)")

    @property
    def stronger(self) -> bool:
        """A difference caused by a check of ours the original grader does not run."""
        return self.kind == "differ" and (self.cause or "").startswith(STRONGER)


def their_reason(status: str, message: str) -> str:
    """Their verdict in a few words: 'wrong (check.py: the output is incorrect)'."""
    reason = _SOURCE_PREFIX.sub("", message or "").strip()
    return f"{status} ({reason})" if reason and status != "pass" else status


def _wrong_cause(message: str, problem: Problem | None, their_graded: datetime | None = None) -> str | None:
    """The stronger check a `wrong` message names, or None; `their_graded` is when theirs graded the kernel."""
    cases = _CASE.findall(message)
    if problem is not None:
        ours_only = OURS_ONLY_CASES.get((problem.bench, problem.name), frozenset())
        numeric = {case.name for case in problem.numeric_stress}
        for name in cases:
            if name in ours_only:
                return f"{STRONGER}stress case {name} (ours only)"
            if name in numeric and their_graded is not None and their_graded < THEIRS_NUMERIC_STRESS_SINCE:
                return (f"{STRONGER}stress case {name} (theirs graded this kernel on {their_graded:%Y-%m-%d}, "
                        f"before its stress cases of {THEIRS_NUMERIC_STRESS_SINCE:%Y-%m-%d})")
        ss = problem.structural_stress
        if (ss is not None and f"case {ss.function}(" in message
                and (their_graded is None or their_graded < THEIRS_STRUCTURAL_SINCE)):
            return f"{STRONGER}structural case {ss.function} (not run by theirs)"
        compared = THEIRS_COMPARED_OUTPUTS.get((problem.bench, problem.name))
        output = _STEP_OUTPUT.search(message)
        if compared is not None and output is not None and output.group(1) not in compared:
            return (f"{STRONGER}{output.group(1)} checked (theirs compares only "
                    f"{', '.join(sorted(compared))})")
        cos_sim = problem.stateful.cos_sim if problem.stateful is not None else None
        rel = _REL_ERR.search(message)
        if cos_sim is not None and rel is not None and "out of tolerance" in message:
            # ‖d‖ ≤ r‖ref‖ bounds the angle: cosine ≥ √(1 − r²), so the deck's (their) cosine rule passed.
            r = float(rel.group(1))
            least_cosine = math.sqrt(1 - r * r) if r < 1 else 0.0
            if least_cosine >= cos_sim:
                return (f"{STRONGER}element-wise bound (‖d‖/‖ref‖ {r:g} keeps the cosine ≥ "
                        f"{least_cosine:.4f}, over their {cos_sim:g})")
    if "output dtype" in message:
        return f"{STRONGER}output dtype"
    if "names the same index twice" in message:
        return f"{STRONGER}top-k indices distinct within a row"
    if "past the sequence length" in message:
        return f"{STRONGER}reads past the sequence length"
    seeds = [int(s) for s in _SEED.findall(message)]
    if problem is not None and seeds and seeds[0] not in problem.seeds:
        return f"{STRONGER}fresh seed {seeds[0]} (ours only; the deck's are {', '.join(map(str, problem.seeds))})"
    if "written where the call before's were" in message:  # judge._recycled_call (0.5.29)
        return f"{STRONGER}new inputs in the last call's memory (a result kept under an input's address)"
    if "timed call" in message or "floor batch" in message:
        return f"{STRONGER}outputs of the timed calls verified"
    return None


def _forbidden_cause(message: str) -> str | None:
    if "no kernel of its own ran" in message:
        return f"{STRONGER}no kernel of its own"
    if "forbidden aten ops ran" in message:
        return f"{STRONGER}forbidden aten op at run time"
    if "forbidden kernel" in message:
        return f"{STRONGER}forbidden library kernel at run time"
    if message.startswith("forbidden op used:"):
        hits = message.removeprefix("forbidden op used:").split(";")
        if hits and all(not h.strip().endswith(" in solution.py") for h in hits):
            return f"{STRONGER}forbidden text in a file beside solution.py"
    return None


def _integrity_cause(message: str) -> str | None:
    for needle, what in (("work escaped the timed stream", "work escaped the timed stream"),
                         ("wrote into input", "wrote into its inputs"),
                         ("the runner's clock says", "its clock disagrees with the judge's")):
        if needle in message:
            return f"{STRONGER}integrity: {what}"
    return None


def classify(ours_status: str, ours_message: str, their_status: str, their_message: str = "",
             problem: Problem | None = None, gpus: tuple[str, str] | None = None,
             their_graded: datetime | None = None, evidence: str | None = None, limit: str | None = None) -> Verdict:
    """Compare our verdict on a kernel with the original grader's (see the module docstring);
    `gpus` is (ours, theirs) where known, `their_graded` when theirs graded it, `evidence` the
    kernel's entry in EVIDENCE, `limit` its entry in OUR_LIMITS (which replaces the class)."""
    verdict = _classify(ours_status, ours_message, their_status, their_message, problem, gpus, their_graded)
    if limit is not None and verdict.kind == "differ":
        return Verdict("differ", f"{OUR_LIMIT}{limit}")
    if evidence is None or verdict.kind != "differ":
        return verdict
    return Verdict("differ", f"{verdict.cause.replace(TO_EXPLAIN, '').rstrip()} — {evidence}" if verdict.cause
                   else evidence, explained=True)


def _classify(ours_status: str, ours_message: str, their_status: str, their_message: str,
              problem: Problem | None, gpus: tuple[str, str] | None, their_graded: datetime | None) -> Verdict:
    if ours_status in EXCLUDED_OURS:
        return Verdict("excluded", f"ours: {ours_status} (not a verdict on this GPU)")
    if their_status in EXCLUDED_THEIRS:
        return Verdict("excluded", f"theirs: {their_status} (no published verdict)")
    if RAN_NO_KERNEL in their_message:
        return Verdict("excluded", f"theirs: {RAN_NO_KERNEL} (its run's GPU-lock log; no verdict on the kernel)")
    if their_status == "timeout" and CHECK_TIMED_OUT in their_message:
        return Verdict("excluded", f"theirs: {CHECK_TIMED_OUT} (KernelBench-Hard's classifier calls a check timeout a "
                                   "retryable infrastructure failure; no verdict on the kernel)")
    ours_pass, theirs_pass = ours_status == "pass", their_status == "pass"
    if ours_pass == theirs_pass:
        return Verdict("agree")
    if ours_pass:
        return Verdict("differ", f"ours passes where theirs failed: {their_reason(their_status, their_message)}")
    cause = None
    if ours_status == "wrong":
        cause = _wrong_cause(ours_message, problem, their_graded)
    elif ours_status == "forbidden":
        cause = _forbidden_cause(ours_message)
    elif ours_status == "integrity_violation":
        cause = _integrity_cause(ours_message)
    if cause is not None:
        return Verdict("differ", cause)
    if ours_status == "wrong" and gpus is not None and gpus[0] != gpus[1] and _CASE.search(ours_message):
        return Verdict("differ", f"other GPU: fails a check both run on {gpus[0]}, passed on {gpus[1]}")
    shared = _SHARED_MEMORY.search(ours_message) if ours_status == "runtime_error" else None
    if shared and gpus is not None and gpus[0] != gpus[1]:
        return Verdict("differ", f"other GPU: a launch of its asks {int(shared[1]):,} B of shared memory, over the "
                                 f"{int(shared[2]):,} B a block may have on {gpus[0]} (Triton refuses it before it "
                                 f"runs); passed on {gpus[1]}")
    if ours_status in ("runtime_error", "build_error", "timeout", "oom"):
        return Verdict("differ", f"ours fails where theirs passed: {ours_status} {TO_EXPLAIN}", explained=False)
    return Verdict("differ", f"ours: {ours_status} {TO_EXPLAIN}", explained=False)


@dataclass(frozen=True)
class Pair:
    """One published kernel graded by both: the run, our result, theirs, and how they compare."""

    run: Run
    ours: Result
    theirs: Result
    verdict: Verdict

    @property
    def short_message(self) -> str:
        """Our message, cut for a table cell."""
        m = self.ours.message
        return m if len(m) <= 160 else m[:157] + "…"


@dataclass(frozen=True)
class Agreement:
    pairs: tuple[Pair, ...]  # sorted by (our GPU, run_id)
    published: int  # published kernels: AI-model runs with an imported result
    regraded: int  # of those, how many have a kernelboard-measured result on a GPU
    gpus: tuple[str, ...]  # the GPUs we regraded them on

    def _of(self, kind: str) -> tuple[Pair, ...]:
        return tuple(p for p in self.pairs if p.verdict.kind == kind)

    @property
    def agree(self) -> tuple[Pair, ...]:
        return self._of("agree")

    @property
    def excluded(self) -> tuple[Pair, ...]:
        return self._of("excluded")

    @property
    def stronger(self) -> tuple[Pair, ...]:
        """Differences caused by a stronger check of ours, listed and counted apart."""
        return tuple(p for p in self._of("differ") if p.verdict.stronger)

    @property
    def other(self) -> tuple[Pair, ...]:
        """Every other difference (these count against the agreement figure)."""
        return tuple(p for p in self._of("differ") if not p.verdict.stronger)

    @property
    def unexplained(self) -> tuple[Pair, ...]:
        return tuple(p for p in self.pairs if p.verdict.kind == "differ" and not p.verdict.explained)

    @property
    def compared(self) -> int:
        """Pairs with a verdict on both sides (not excluded)."""
        return len(self.pairs) - len(self.excluded)

    @property
    def rate(self) -> float | None:
        """agree / (agree + differences not caused by a stronger check), or None with nothing to divide."""
        denominator = len(self.agree) + len(self.other)
        return len(self.agree) / denominator if denominator else None

    @property
    def per_kernel(self) -> tuple[int, int]:
        """(kernels that agree, kernels that agree or differ for a cause held against the figure), each kernel
        counted once however many GPUs graded it: it agrees only where none of its gradings differs that way."""
        other = {p.run.run_id for p in self.other}
        agree = {p.run.run_id for p in self.agree} - other
        return len(agree), len(agree) + len(other)


def _source_result(run: Run, imported: list[Result]) -> Result | None:
    """Its imported result on its source board (the run's own GPU), else on any board."""
    for r in imported:
        if r.gpu == run.gpu:
            return r
    return imported[0] if imported else None


def agreement(data: SiteData) -> Agreement:
    imported: dict[str, list[Result]] = {}
    ours: list[Result] = []
    for r in data.results:
        if r.is_imported:
            imported.setdefault(r.run_id, []).append(r)
        elif r.gpu != CPU_KEY:
            ours.append(r)
    published = {run_id for run_id in imported if run_id in data.runs and not data.runs[run_id].is_house}
    pairs = []
    for r in sorted(ours, key=lambda r: (r.gpu, r.run_id)):
        run = data.runs.get(r.run_id)
        if run is None or r.run_id not in published:
            continue
        theirs = _source_result(run, imported[r.run_id])
        if theirs is None:
            continue
        problem = data.problems.get((run.bench, run.problem))
        verdict = classify(r.status, r.message, theirs.status, theirs.message, problem, (r.gpu, theirs.gpu),
                           theirs.graded_at, EVIDENCE.get(r.run_id), OUR_LIMITS.get(r.run_id))
        pairs.append(Pair(run, r, theirs, verdict))
    return Agreement(tuple(pairs), len(published), len({p.run.run_id for p in pairs}),
                     tuple(sorted({p.ours.gpu for p in pairs})))
