#!/usr/bin/env bash
# Launch a gigrl run on every worker of a Cloud TPU VM pod slice, after proving it fits.
#
#   TPU_NAME=my-v5e-64 ZONE=us-west4-a ACCELERATOR_TYPE=v5litepod-64 \
#     bash launch/tpu_pod.sh gs://my-bucket/runs/qwen3b /data/Qwen2.5-3B-Instruct \
#       configs/base.py [--config.<section>.<field>=value ...]
#
# Arguments:
#   1. WORKDIR: a gs:// directory (orbax checkpoints and metrics must be visible to every
#      host; rerunning with the same WORKDIR resumes after a preemption).
#   2. HF_CKPT: the HF checkpoint directory on every worker (config.json, *.safetensors,
#      tokenizer.json). The run uses the checkpoint's own tokenizer (data.tokenizer=HF_CKPT).
#   3. CONFIG: a config file (with an optional :arg), then any --config.* overrides.
#
# Steps:
#   1. gigrl-compile on this machine (CPU, libtpu from the `tpu` extra): every program the
#      run executes (the set its warm-up compiles) is compiled for ACCELERATOR_TYPE at the
#      config's real batch and lengths (COMPILE_PROGRAMS=rl_step,decode,... compiles one
#      full-shape program per kind instead: minutes, not hours, for a 3B model); reports are
#      kept in COMPILE_RESULTS (default compile_<TOPOLOGY>.jsonl), so a rerun resumes. If one
#      does not fit, the script stops here (exit 1), before a slice is allocated. It reads config.json from LOCAL_CKPT (default HF_CKPT; copy
#      config.json there if the checkpoint lives only on the workers).
#   2. CREATE=1: create the TPU VM slice (gcloud compute tpus tpu-vm create).
#   3. Every worker installs gigrl and runs the same gigrl-train command (SPMD; on a TPU VM
#      jax.distributed finds the coordinator, process count and id by itself).
#
# Environment: TPU_NAME, ZONE, ACCELERATOR_TYPE (e.g. v5litepod-64, v5p-64, v6e-8);
# optional CREATE=1, RUNTIME_VERSION (for CREATE), REPO (git URL the workers clone),
# LOCAL_CKPT, SKIP_COMPILE=1.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${ACCELERATOR_TYPE:?set ACCELERATOR_TYPE}"
WORKDIR="${1:?WORKDIR: a gs:// directory}"
HF_CKPT="${2:?HF_CKPT: the HF checkpoint directory on the workers}"
CONFIG="${3:?CONFIG: a config file, e.g. configs/base.py}"
shift 3
EXTRA_ARGS=("$@")
REPO="${REPO:-https://github.com/your-org/gigrl.git}"
LOCAL_CKPT="${LOCAL_CKPT:-$HF_CKPT}"

if [[ "$WORKDIR" != gs://* ]]; then
  echo "tpu_pod.sh: WORKDIR=$WORKDIR must be a gs:// path (every host reads and writes it)" >&2
  exit 2
fi
# v5litepod-64 -> v5e-64 (gigrl-compile --topology names).
TOPOLOGY="${ACCELERATOR_TYPE/v5litepod/v5e}"
MODEL_ARGS=("--config.model.hf_path=$HF_CKPT" "--config.data.tokenizer=$HF_CKPT")

# 1. Prove every program fits before allocating anything.
if [[ "${SKIP_COMPILE:-0}" != 1 ]]; then
  here="$(cd "$(dirname "$0")/.." && pwd)"
  gigrl_compile="${GIGRL_COMPILE:-$here/.venv/bin/gigrl-compile}"
  [[ -x "$gigrl_compile" ]] || gigrl_compile=gigrl-compile
  echo "tpu_pod.sh: gigrl-compile --topology $TOPOLOGY"
  JAX_PLATFORMS=cpu "$gigrl_compile" --config "$CONFIG" --topology "$TOPOLOGY" \
    --programs "${COMPILE_PROGRAMS:-run}" --results "${COMPILE_RESULTS:-compile_$TOPOLOGY.jsonl}" \
    "--config.model.hf_path=$LOCAL_CKPT" "--config.data.tokenizer=$LOCAL_CKPT" \
    "${EXTRA_ARGS[@]}"
fi

# 2. Allocate the slice.
if [[ "${CREATE:-0}" == 1 ]]; then
  gcloud compute tpus tpu-vm create "$TPU_NAME" --zone "$ZONE" \
    --accelerator-type "$ACCELERATOR_TYPE" \
    --version "${RUNTIME_VERSION:-v2-alpha-tpuv5-lite}"
fi

# 3. The run, on every worker.
quoted="$(printf ' %q' "${MODEL_ARGS[@]}" "${EXTRA_ARGS[@]}")"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e
  [ -d gigrl ] || git clone $REPO gigrl
  cd gigrl && git pull --ff-only
  python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]'
  GIGRL_DISTRIBUTED=1 .venv/bin/gigrl-train --config $CONFIG --workdir $WORKDIR $quoted
"
