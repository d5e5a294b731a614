#!/bin/bash
# Runs a gigrl command on one GPU machine (the device tool's image: Python 3.12, jax 0.11.2 with
# CUDA). Prepare here once with `bash launch/gpu_wheels.sh` (the missing wheels into .whl/), then
# on the machine, from the repository root, with `.whl` carried:
#
#   bash launch/gpu.sh gigrl-train --config configs/countries.py:smollm2-135m-short --workdir $OUT/run
#   bash launch/gpu.sh bench benchmarks/vs_trl.py --json $OUT/vs_trl.json
#   bash launch/gpu.sh pytest -m "not slow" tests/test_model.py
#
# It installs .whl/ into /tmp/site (no network), puts the checkout on PYTHONPATH (no pip install
# of gigrl: the image's jax, flax and torch are kept), checks that JAX sees the GPU, and runs the
# (GIGRL_ALLOW_CPU=1 skips that check, for trying the launcher on a CPU machine), and runs the
# tool (gigrl-train, -eval, -fetch, -sweep, -compile, -export), a script (bench FILE ...) or pytest.
# The model checkpoint must travel too (gigrl-fetch needs the network): fetch it here into a
# carried folder and point GIGRL_CACHE_DIR at it.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${GIGRL_SITE:-/tmp/site}
if compgen -G ".whl/*" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation \
    --upgrade --target "$SITE" .whl/*
  export PYTHONPATH="$SITE:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
python3 -c "import jax, os; d = jax.devices(); assert d[0].platform == 'gpu' or os.environ.get('GIGRL_ALLOW_CPU'), d; print('[gpu.sh]', jax.__version__, d)"
tool="$1"; shift
case "$tool" in
  gigrl-train)   mod=gigrl.cli.train ;;
  gigrl-eval)    mod=gigrl.cli.eval ;;
  gigrl-fetch)   mod=gigrl.cli.fetch ;;
  gigrl-sweep)   mod=gigrl.cli.sweep ;;
  gigrl-compile) mod=gigrl.cli.compile ;;
  gigrl-export)  mod=gigrl.cli.export ;;
  bench)         exec python3 "$@" ;;
  pytest)        exec python3 -m pytest -p no:cacheprovider -n 0 "$@" ;;
  *) echo "gpu.sh: unknown tool $tool (gigrl-train, gigrl-eval, gigrl-fetch, gigrl-sweep, gigrl-compile, gigrl-export, bench, pytest)" >&2; exit 2 ;;
esac
exec python3 -c "import sys; from $mod import run; sys.argv[0] = '$tool'; run()" "$@"
