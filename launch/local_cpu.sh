#!/usr/bin/env bash
# Local CPU run with 8 simulated devices (exercises the sharded code paths on a laptop).
#   bash launch/local_cpu.sh [CONFIG [WORKDIR]] [--config.field=value ...]
# Defaults: configs/smoke.py, runs/local. JAX_PLATFORMS=cpu keeps an installed libtpu from
# probing for TPU chips (and printing its start-up warnings) on a machine without any.
set -euo pipefail
CONFIG=configs/smoke.py
WORKDIR=runs/local
if [[ $# -gt 0 && "$1" != --* ]]; then CONFIG="$1"; shift; fi
if [[ $# -gt 0 && "$1" != --* ]]; then WORKDIR="$1"; shift; fi
GIGRL_TRAIN="$(dirname "$0")/../.venv/bin/gigrl-train"
[[ -x "$GIGRL_TRAIN" ]] || GIGRL_TRAIN=gigrl-train
JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" \
XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}" \
  "$GIGRL_TRAIN" --config "$CONFIG" --workdir "$WORKDIR" "$@"
