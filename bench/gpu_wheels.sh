#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what bench/gpu.sh needs on a GPU machine that has no network: Python 3.12 wheels for
# x86-64 Linux of datasets, tyro and TRL at the versions installed here (so the GPU runs the code the CPU tests ran),
# what they need that those machines lack (dill, multiprocess, docstring-parser, typeguard), and, in case theirs are
# too old for datasets, pyarrow, fsspec and xxhash (pip there installs these only if needed). About 57 MB; the device
# tool carries at most 64 MiB with the working tree.
#   bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl
mkdir -p .whl
python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "trl==${TRL_VERSION:-1.16.0}" "datasets==$(version datasets)" \
    "tyro==$(version tyro)" "dill==$(version dill)" "multiprocess==$(version multiprocess)" \
    "docstring_parser==$(version docstring_parser)" "typeguard==$(version typeguard)" "pyarrow==$(version pyarrow)" \
    "fsspec==$(version fsspec)" "xxhash==$(version xxhash)"
ls -1 .whl
du -sh .whl
