#!/bin/bash
# Downloads, here (where pip reaches a registry), the cp312 wheels the GPU image lacks into .whl/,
# which the device tool carries (`carry: [".whl"]`) and launch/gpu.sh installs there.
# The GPU image (Python 3.12, jax 0.11.2 + CUDA 13, flax, optax, orbax, chex, transformers, peft,
# tokenizers, sentencepiece, safetensors, jinja2, matplotlib, ...) lacks these gigrl needs:
#   ml_collections, tensorflow-datasets (+ array_record, dm-tree, immutabledict, promise,
#   simple_parsing, docstring-parser, tensorflow-metadata, googleapis-common-protos, termcolor,
#   toml), bm25s, rapidfuzz, gguf, importlib_resources; with --bench also trl and datasets.
# Versions are the ones this repo's CPU CI installs. Usage: bash launch/gpu_wheels.sh [--bench]
set -euo pipefail
cd "$(dirname "$0")/.."
info="$(git rev-parse --git-dir)/info"; mkdir -p "$info"
grep -qx '/.whl/' "$info/exclude" 2>/dev/null || echo /.whl/ >> "$info/exclude"
mkdir -p .whl
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
WHEELS="ml_collections==1.1.0 tensorflow-datasets==4.9.10 array_record==0.8.6 dm-tree==0.1.10
  immutabledict==4.3.1 simple_parsing==0.1.9 docstring-parser termcolor==3.3.0 toml==0.10.2
  tensorflow-metadata==1.21.0 googleapis-common-protos bm25s==0.3.16 rapidfuzz==3.14.6
  gguf==0.19.0 importlib_resources"
if [ "${1:-}" = "--bench" ]; then WHEELS="$WHEELS trl==1.16.0 datasets==5.2.0 dill multiprocess"; fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLAT -d .whl $WHEELS
# promise (a tfds import) ships as an sdist only: pure Python, built there without the network
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl promise==2.3
du -sh .whl
