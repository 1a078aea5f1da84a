#!/usr/bin/env bash
# Make AHEAD_VENV (default /tmp/py312): a Python 3.12 virtualenv with the GPU image's torch and Triton, in which
# `kernelboard eval compile-ahead` keys Triton's kernels as the GPU host does. Triton's cache key hashes its
# compiled libtriton, and the cp311 and cp312 builds of Triton 3.6.0 differ: an archive made under this
# machine's Python 3.11 was found by none of an H100 host's gradings (2026-12-05). On 2026-12-07 the
# fingerprint of a venv made by this script (pyenv's CPython 3.12.1, PyPI's triton 3.6.0) was byte for byte
# that of the H200 image's Triton (`triton-ahead.json` of a keep-ahead archive written there).
# Downloads from PyPI (torch 2.11.0 with its CUDA wheels, about 3 GB; installs nothing outside AHEAD_VENV) and
# says so; needs a CPython 3.12 (PYTHON312=, else pyenv's newest 3.12). Then, e.g.:
#   $AHEAD_VENV/bin/kernelboard eval compile-ahead --only 'RUN_ID' --limit 3600 --out .carry/triton-ahead.tgz
# and the GPU call's TRITON_AHEAD='.carry/triton-ahead*.tgz' (bench/gpu_session.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${AHEAD_VENV:-/tmp/py312}
PY=${PYTHON312:-$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python 2>/dev/null | sort -V | tail -1)}
[ -n "$PY" ] && [ -x "$PY" ] || { echo "ahead_env.sh: no CPython 3.12 (name one with PYTHON312=)"; exit 1; }
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
  || { echo "ahead_env.sh: $PY is not CPython 3.12 (the GPU image's Python ABI)"; exit 1; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "ahead_env.sh: installing torch 2.11.0 and triton 3.6.0 (the GPU image's) from PyPI into $VENV (about 3 GB)"
"$VENV/bin/pip" install -q torch==2.11.0 triton==3.6.0 "numpy<2.4" jinja2 pandas plotly markdown-it-py pyarrow \
  click pyyaml rich 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "from kernelboard.eval.ahead import fingerprint; import json; print(json.dumps(fingerprint('9.0')))"
echo "ahead_env.sh: $VENV/bin/kernelboard eval compile-ahead … (the fingerprint above is what its archives carry)"
