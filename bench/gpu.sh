#!/usr/bin/env bash
# One command that proves and measures every script on a GPU; bench/gpu.py says what it runs and measures.
#   bash bench/gpu.sh --out runs/gpu      # on a GPU machine, under 9 minutes: OUT/results.json, OUT/summary.md
#   bash bench/gpu.sh --dry-run           # the same steps at toy size on CPU
# The GPU machines have no network: the packages they lack come from .whl/, which bash bench/gpu_wheels.sh fills on a
# machine that has one (carry .whl with the working tree). PYTHON=... picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dry=0; for a in "$@"; do [ "$a" = --dry-run ] && dry=1; done
if [ "$dry" = 0 ] && [ -d .whl ] && ! "$PY" -c "import datasets, tyro, trl" 2>/dev/null; then
    # into the interpreter's own environment, taking from .whl/ only what it lacks or has in a version too old
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --find-links .whl datasets tyro trl \
        || { echo "pip could not install from .whl/ into $PY's environment; using --target /tmp/gpu_site"
             "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target /tmp/gpu_site \
                 .whl/datasets-*.whl .whl/tyro-*.whl .whl/trl-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl \
                 .whl/docstring_parser-*.whl .whl/typeguard-*.whl
             export PYTHONPATH=/tmp/gpu_site${PYTHONPATH:+:$PYTHONPATH}; }
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" bench/gpu.py "$@"
