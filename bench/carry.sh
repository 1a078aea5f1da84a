#!/usr/bin/env bash
# Make CARRY (default .carry): what bench/gpu_session.sh unpacks on a GPU machine that has no package
# registry. Debian bookworm's bubblewrap .deb (the sandbox; `dpkg -x`, never installed), and in whl/ the
# nvidia-cutlass wheel (CUTLASS headers for kernels that include them) and fla-core (FLA's chunk_kda, 02's
# library line). Each file is pinned by name and SHA-256, so every call grades with what the committed rows
# name. Also each deck's queue for the H200 and H100 SXM boards, queue-<deck>-<gpu>.txt (`kernelboard eval
# todo`: the runs left, in the order that ranks AI models soonest); gpu_session.sh's IDS=.carry/queue-hard-{gpu}.txt
# takes the one of the GPU it finds, and `--resume` skips what an earlier call graded (IDS=todo writes the
# queue on the GPU machine instead, from the call's own seeded results: what a session's later calls want).
# seed.tgz is the first call's SEED: data/results plus the real gradings data/held keeps off the boards until
# their problem is whole there (the queues count them graded).
# Run where PyPI and deb.debian.org answer (a developer machine): it downloads, installs nothing and says
# what it fetches. Name CARRY in the device call's carry list (.gitignore keeps it out of git); 7.6 MB.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARRY=$(mkdir -p "${CARRY:-$ROOT/.carry}/whl" && cd "${CARRY:-$ROOT/.carry}" && pwd)
PYTHON=${PYTHON:-python3}
DEB=bubblewrap_0.8.0-2+deb12u1_amd64.deb
declare -A FETCH=(  # pinned file -> where it comes from (a URL, or a pip requirement)
  [$DEB]=https://deb.debian.org/debian/pool/main/b/bubblewrap/$DEB
  [whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl]=nvidia-cutlass==4.2.0
  [whl/fla_core-0.6.0-py3-none-any.whl]=fla-core==0.6.0
)
PINS="3cc9134a3286ad01a323dcd924ba123eb634cefaeec82d774257e06308aeaadb  $DEB
f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6  whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl
b0708b70e0b119cd58a0a5146ea56cb175cef6ed969d8ac60267e3e077ce3ebd  whl/fla_core-0.6.0-py3-none-any.whl"

cd "$CARRY"
while read -r sum file; do
  echo "$sum  $file" | sha256sum --quiet -c &>/dev/null && continue
  source=${FETCH[$file]}
  echo "carry.sh: fetching $file from $source"
  rm -f "$file"
  if [[ $source == https://* ]]; then
    curl -sSfL --retry 3 -o "$file.part" "$source" && mv "$file.part" "$file"
  else  # no dependencies: the grader reads these packages' files only (CUTLASS's headers, FLA's kernels)
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d whl "$source"
  fi
  echo "$sum  $file" | sha256sum --quiet -c || { echo "carry.sh: $CARRY/$file is not the pinned file" >&2; exit 1; }
done <<< "$PINS"
rm -f queue_*.txt  # (run_id globs per problem, as this script wrote them before queues)
KERNELBOARD=${KERNELBOARD:-$ROOT/.venv/bin/kernelboard}
if [ -x "$KERNELBOARD" ]; then
  # seed.tgz: data/results with the gradings data/held keeps off the boards merged in, the SEED of a call
  SEEDING=$(mktemp -d) && trap 'rm -rf "$SEEDING"' EXIT
  cp -r "$ROOT/data/results" "$SEEDING/res"
  if [ -d "$ROOT/data/held" ]; then
    (cd "$ROOT" && "$KERNELBOARD" eval merge data/held --into "$SEEDING/res" | grep -v "^=== ")
  fi
  tar -C "$SEEDING" -czf "$CARRY/seed.tgz" res
  for deck in hard mega; do  # what each board has left, in the order that ranks AI models soonest
    (cd "$ROOT" && "$KERNELBOARD" eval todo --deck "eval/decks/$deck" --submissions "data/submissions/$deck" \
      --out "$SEEDING/res" --gpu h200 --gpu h100-sxm --queue "$CARRY/queue-$deck-{gpu}.txt" | grep -v "^  ")
  done
else
  echo "carry.sh: no $KERNELBOARD (make .venv/.dev, or name one with KERNELBOARD=): no queue files written"
fi
echo "carry.sh: $CARRY holds $DEB, whl/ ($(ls whl | tr '\n' ' ')) and $(ls queue-*.txt 2>/dev/null | wc -l)" \
  "queue files ($(du -sh . | cut -f1)): SEED=.carry/seed.tgz IDS=todo (or IDS=.carry/queue-hard-{gpu}.txt)" \
  "bench/gpu_session.sh"
