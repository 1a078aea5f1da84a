#!/usr/bin/env bash
# One call on a GPU machine without a package registry (how the H200 rows in data/results were graded):
# set up .venv-eval as `make eval` makes it, bubblewrap and CUTLASS from CARRY (default .carry, made here by
# bench/carry.sh: Debian's bubblewrap_*.deb, whl/nvidia_cutlass-*.whl, queue_NN.txt), then optionally
#   CASES=a,b   the GPU mechanism cases (CASES=, for all of them)
#   IDS=file    grade these run ids or run_id globs (one a line, in that order; '{gpu}' in the name is this
#               GPU's board key: IDS=.carry/queue-hard-{gpu}.txt, from bench/carry.sh) into a results folder
#               seeded from SEED (SEED: a .tgz of a results folder, or a folder; default data/results;
#               .carry/seed.tgz from bench/carry.sh adds the gradings data/held keeps off the boards);
#               IDS=all grades every run of the deck not graded yet (--resume decides);
#               IDS=todo grades the queue `kernelboard eval todo` writes from the seeded folder, asked again
#               after each round while more than TODO_MIN_LEFT (60) seconds are left
#               (the gradings run with the judge's GPU witness: KERNELBOARD_GPU_WITNESS=0 runs them without)
#   DECK=mega   the Mega deck (default hard)
#   EXCLUDE=g,h run_id globs left out (eval --exclude): a kernel that outlasts a call, say
#   IDLE_LATENCY=0 skips bench/idle_latency.py's lines at setup (about 5 s of the call).
#   EVAL_ARGS='…' more `kernelboard eval` options (say --check-timeout 1500 --timeout 2400 for a kernel
#               whose first call compiles for minutes)
#   BENCH=1     bench/gpu_grading.py on GPU 0 (LOAD busy processes)
#   XPT=1       bench/cross_process_timing.py, sandboxed and not (a judge-side span of a runner's call, and one shaped
#               as the grader's timed loop would use it; ~30 s a mode; XPT=sandboxed: that mode only)
#   TRITON_AHEAD='glob'  archives of `kernelboard eval compile-ahead` (Triton kernels compiled on a CPU host
#               for sm_90), unpacked into the grader's cache root first where `kernelboard eval check-ahead`
#               finds their cache keys can match (same Python ABI and Triton build): each grading's log then
#               says how many of them it found built, and 0 built while grading. With IDS, the call ends by
#               writing $OUT/triton-kept.tgz (`kernelboard eval keep-ahead`; more parts, triton-kept.2.tgz, …,
#               where it would pass 14 MiB, as a call returns files of 16 MiB at most): what this host compiled for
#               the runs it was cut off in, for the next call's TRITON_AHEAD='.carry/triton-kept*.tgz', so a long
#               compile goes on from there
# Results are packed into $OUT (default ./gpu-session-out) every 30 s, so a call cut short still
# returns what finished: res.tgz is a results folder, SEED for the next call and `eval merge`'s source.
# DEADLINE: seconds after the start at which gradings are interrupted (SIGINT: finished rows stay, the run cut
# off is recorded; with --gpus the children stop and merge within seconds, at most 60).
# CALL_LIMIT (590): seconds after the start by which the script ends, keep-ahead's archive cut short if need be
# (a device call killed at its limit returns none of its output).
# WORK: the scratch folder (default /tmp/work); give each of two sessions in one call its own.
set -u
T0=$(date +%s)
CARRY=${CARRY:-.carry}
OUT=${OUT:-gpu-session-out}
DEADLINE=${DEADLINE:-560}
left() { echo $(( DEADLINE - ( $(date +%s) - T0 ) )); }
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
echo "== $(date -u +%FT%TZ) $(hostname)"  # the grader version is on the setup line: the copy's .git may not be the checkout's
nvidia-smi --query-gpu=name,driver_version,memory.used,temperature.gpu,clocks.sm --format=csv,noheader

ls "$CARRY"/bubblewrap_*.deb "$CARRY"/whl/*.whl >/dev/null \
  || { echo "nothing to unpack in $CARRY: run bench/carry.sh where a registry answers, and carry $CARRY"; exit 1; }
dpkg -x "$CARRY"/bubblewrap_*.deb /tmp/bw && export PATH=/tmp/bw/usr/bin:$PATH
bwrap --version || exit 1
make -s .venv-eval/bin/python PYTHON=python3 >/dev/null || exit 1
.venv-eval/bin/pip install -q --no-deps --no-build-isolation -e . || exit 1
.venv-eval/bin/pip install -q --no-index --no-deps "$CARRY"/whl/*.whl || exit 1
.venv-eval/bin/python -c "import torch, kernelboard; print('torch', torch.__version__, torch.cuda.get_device_name(), 'kernelboard', kernelboard.__version__)"
if [ -n "${TRITON_AHEAD:-}" ]; then
  CACHE_ROOT=${KERNELBOARD_CACHE:-$HOME/.cache/kernelboard}
  mkdir -p "$CACHE_ROOT"
  for a in $TRITON_AHEAD; do  # unpacked only where this host's Triton keys its variants alike (as check-ahead
    # says), each variant's group file pointed at its new folder (Triton finds a variant by those paths alone)
    KERNELBOARD_CACHE=$CACHE_ROOT .venv-eval/bin/kernelboard eval unpack-ahead "$a"
  done
fi
# Whether candidate code will run as root here (grader 0.5.21 drops it where the grader is root; a line
# "[grader] the sandbox keeps root's uid: …" says why not), before any grading depends on it.
.venv-eval/bin/python -c "from kernelboard.eval.jail import make_jail
j = make_jail(sandboxed=True, device='cuda', hide=[])
import os; print('sandbox: grader uid', os.getuid(), '- candidate code', 'drops root to a uid per solution' if j.setpriv else 'keeps it')"
# Where a call from an idle GPU spends its time on this host (bench/idle_latency.py, about 5 s): the fact behind
# the hidden-work check's allowance, which an H200 host's calls from idle exceeded on two shapes (2026-12-07).
[ "${IDLE_LATENCY:-1}" = 0 ] || timeout -s INT 60 .venv-eval/bin/python bench/idle_latency.py 2>&1 | tail -6
echo "== setup done at $(( $(date +%s) - T0 )) s"

WORK=${WORK:-/tmp/work}
mkdir -p $WORK
pack() {  # the results folder (logs included) and the GPU suite's folder, as they are now
  [ -d $WORK/res ] && tar -C $WORK -czf "$OUT/res.tgz.part" res && mv "$OUT/res.tgz.part" "$OUT/res.tgz"
  [ -d $WORK/gpusuite ] && tar -C $WORK -czf "$OUT/gpusuite.tgz.part" gpusuite && mv "$OUT/gpusuite.tgz.part" "$OUT/gpusuite.tgz"
  true
}
( while sleep 30; do pack; done ) &
PACKER=$!

if [ -n "${CASES+x}" ]; then
  echo "== GPU cases '${CASES}' ($(left) s left)"
  mkdir -p $WORK/gpusuite
  KERNELBOARD_GPU_CASES="$CASES" timeout -s INT "$(left)" .venv-eval/bin/python -m pytest --noconftest -o addopts="" \
    -m gpu -q -rA --basetemp $WORK/gpusuite/tmp tests/test_eval_gpu.py 2>&1 | tail -60
  grep -rh "zygote" $WORK/gpusuite/tmp --include=*.log 2>/dev/null | sort | uniq -c | head
fi

if [ -n "${BENCH:-}" ]; then
  echo "== bench ($(left) s left)"
  timeout -s INT "$(left)" .venv-eval/bin/python bench/gpu_grading.py --gpus 0 --cpu-load "${LOAD:-4}" \
    --work $WORK/bench --json "$OUT/bench.json" 2>&1 | tail -80
fi

if [ -n "${XPT:-}" ]; then
  echo "== cross-process timing ($(left) s left)"
  modes=(--unsandboxed "")
  [ "$XPT" = sandboxed ] && modes=("")
  for mode in "${modes[@]}"; do
    timeout -k 5 -s INT 60 .venv-eval/bin/python bench/cross_process_timing.py $mode --work $WORK/xpt \
      --json "$OUT/xpt${mode:---sandboxed}.json" 2>&1 | tail -18
  done
fi

if [ -n "${IDS:-}" ]; then
  # The judge's GPU witness on every grading (logged beside the timed median, never a verdict), so the boards'
  # gradings give the honest ratios its rule waits for; KERNELBOARD_GPU_WITNESS=0 grades without it.
  export KERNELBOARD_GPU_WITNESS=${KERNELBOARD_GPU_WITNESS:-1}
  SEED=${SEED:-data/results}
  mkdir -p $WORK/res
  if [ -f "$SEED" ]; then tar -C $WORK -xzf "$SEED"; else cp -r "$SEED"/. $WORK/res/; fi
  sleep 1; touch $WORK/.started  # logs newer than this are this call's (the seed's copies are older)
  GPU_KEY=$(.venv-eval/bin/python -c "import sys; from kernelboard.eval.hardware import gpu_key; print(gpu_key(sys.argv[1]))" \
    "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)")
  DECK=${DECK:-hard}
  excluded=(); IFS=, read -r -a globs <<< "${EXCLUDE:-}"
  for g in "${globs[@]}"; do [ -n "$g" ] && excluded+=(--exclude "$g"); done
  grade() {  # $1: a file of run ids or globs (in grading order), or "all"
    local only=(); [ "$1" = all ] || while read -r id; do [ -n "$id" ] && only+=(--only "$id"); done < "$1"
    echo "== grading ${1/#all/every ungraded run of $DECK} ($(( ${#only[@]} / 2 )) run ids, $(( ${#excluded[@]} / 2 )) exclusions) into a" \
      "folder seeded from $SEED ($(left) s left)"
    timeout -s INT "$(left)" .venv-eval/bin/kernelboard eval --deck eval/decks/$DECK --submissions data/submissions/$DECK \
      --out $WORK/res --resume --stop-at $(( T0 + DEADLINE )) "${only[@]}" "${excluded[@]}" ${EVAL_ARGS:-} 2>&1 \
      | grep -v "^\s*$" | tail -80
    echo "== eval exited ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
  }
  G0=$(date +%s)
  if [ "$IDS" = todo ]; then
    # The queue `kernelboard eval todo` writes from this call's own results folder (the seed and what this call
    # graded), asked again whenever a round ends with time left: the runs the board waits on first, then, once
    # its problems are done, the next problem's, so a call neither grades from a stale queue nor idles.
    last=""
    while [ "$(left)" -gt "${TODO_MIN_LEFT:-60}" ]; do
      .venv-eval/bin/kernelboard eval todo --deck eval/decks/$DECK --submissions data/submissions/$DECK \
        --out $WORK/res --gpu "$GPU_KEY" --queue $WORK/queue.txt "${excluded[@]}" 2>&1 | tail -12
      [ -s $WORK/queue.txt ] || { echo "== nothing left to grade on $GPU_KEY"; break; }
      queued=$(cat $WORK/queue.txt)
      [ "$queued" = "$last" ] && { echo "== the queue is what the last round was given: stopping"; break; }
      last=$queued
      grade $WORK/queue.txt
    done
  else
    IDS=${IDS//\{gpu\}/$GPU_KEY}  # the queue of this GPU's board
    [ "$IDS" = all ] || [ -f "$IDS" ] || { echo "no $IDS: bench/carry.sh writes each board's queue"; exit 1; }
    grade "$IDS"
  fi
  new_logs() { find $WORK/res/*/logs -name "$1" -newer $WORK/.started 2>/dev/null | sort; }  # this call's, any GPU
  # the GPU's share of the batch: each grading's worker log ends at its last "(+N s)" stamp (the worker's span)
  new_logs '*.log' | grep -v '\.prebuild\.log$' | while read -r f; do grep -o "(+[0-9.]* s)" "$f" | tail -1; done \
    | tr -d '(+s)' | awk -v wall=$(( $(date +%s) - G0 )) '{n++; t+=$1} END {if (n) printf \
      "== GPU busy: %d gradings'"'"' worker spans sum to %.0f s of the batch'"'"'s %d s (%.0f%%)\n", n, t, wall, 100*t/wall}'
  new_logs '*.log' | xargs -r grep -h "zygote" | sort | uniq -c | head -5
  # what each grading still built on the GPU's time (the prebuild's aim: nothing), then the prebuilds' Triton lines
  new_logs '*.log' | xargs -r grep -H "built while grading" | sed 's|.*/||'
  # builds kept from the prebuild's copy (a build beside solution.py), and failures relabelled after the fact
  new_logs '*.log' | grep -v '\.prebuild\.log$' | xargs -r grep -H "graded in the copy its prebuild\|relabelled" \
    | sed 's|.*/||' | cut -c1-300
  new_logs '*.prebuild.log' | xargs -r grep -H "Triton kernel variants compiled" | sed 's|.*/||'
  # the GPU witness's ratios in this call's gradings (bench/witness_ratios.py), for the rule that waits on them
  new_logs '*.log' | grep -v '\.prebuild\.log$' | xargs -r .venv-eval/bin/python bench/witness_ratios.py --lowest 5 || true
  # runs a batch was cut off in (graded last by the next: eval/interrupted.py)
  for f in $WORK/res/*/interrupted.json; do [ -f "$f" ] && echo "== interrupted runs ($f):" && cat "$f"; done
fi

kill $PACKER 2>/dev/null
pack
if [ -n "${IDS:-}" ]; then  # after the results are packed: the Triton variants this host compiled for the runs
  # it was cut off in, so that the next call's compile goes on from them; never past CALL_LIMIT, where the device
  # call itself would be killed and return no output (a 1,081-variant archive took a call past its 600 s)
  room=$(( ${CALL_LIMIT:-590} - ( $(date +%s) - T0 ) ))
  if [ "$room" -gt 5 ]; then
    timeout -k 2 "$room" .venv-eval/bin/kernelboard eval keep-ahead --results $WORK/res \
      --submissions data/submissions/$DECK --out "$OUT/triton-kept.tgz" \
      --arch "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)" \
      || echo "== keep-ahead did not end within the call's last $room s (CALL_LIMIT ${CALL_LIMIT:-590}): no Triton archive"
  else
    echo "== no time left for keep-ahead before CALL_LIMIT ${CALL_LIMIT:-590}: no Triton archive"
  fi
fi
nvidia-smi --query-gpu=temperature.gpu,clocks.sm --format=csv,noheader
echo "== done at $(( $(date +%s) - T0 )) s"
