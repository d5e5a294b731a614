#!/usr/bin/env bash
# Local CPU run with 8 simulated devices (exercises the sharded code paths on a laptop).
#   bash launch/local_cpu.sh configs/smoke.py runs/local [--config.field=value ...]
set -euo pipefail
CONFIG="${1:-configs/smoke.py}"; WORKDIR="${2:-runs/local}"; shift 2 || true
XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}" \
  gigrl-train --config "$CONFIG" --workdir "$WORKDIR" "$@"
