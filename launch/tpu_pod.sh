#!/usr/bin/env bash
# Launch a gigrl run on every worker of a Cloud TPU VM pod slice.
#
#   TPU_NAME=my-v5e-32 ZONE=us-west4-a WORKDIR=gs://my-bucket/runs/qwen15b \
#     bash launch/tpu_pod.sh configs/base.py:qwen2.5-1.5b --config.model.hf_path=/data/Qwen2.5-1.5B-Instruct
#
# Every worker runs the same command (SPMD); jax.distributed picks up the TPU topology.
# WORKDIR must be shared (GCS) so orbax checkpoints are visible to all hosts; rerunning
# this script with the same WORKDIR resumes after a preemption.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${WORKDIR:?set WORKDIR}"
CONFIG="${1:?config file, e.g. configs/base.py:qwen2.5-1.5b}"; shift
REPO="${REPO:-https://github.com/your-org/gigrl.git}"
EXTRA_ARGS="$*"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e
  [ -d gigrl ] || git clone $REPO gigrl
  cd gigrl && git pull --ff-only
  python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]'
  .venv/bin/python -c 'import jax; jax.distributed.initialize(); print(jax.device_count())'
  GIGRL_DISTRIBUTED=1 .venv/bin/gigrl-train --config $CONFIG --workdir $WORKDIR $EXTRA_ARGS
"
