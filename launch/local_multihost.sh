#!/usr/bin/env bash
# A pod run on one machine: N gigrl-train processes (one per simulated "host"), each with
# DEVICES CPU devices, joined through a local coordinator (gloo collectives on CPU).
#   bash launch/local_multihost.sh N [CONFIG [WORKDIR]] [--config.field=value ...]
# Defaults: N=2, configs/smoke.py, runs/multihost, DEVICES=2 per process. Process 0 writes the
# run files; each process logs to WORKDIR/process_<i>.log (process 0 also to the terminal).
# Rerunning the same command resumes; Ctrl-C stops every process after a checkpoint.
set -euo pipefail
N=2
if [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; then N="$1"; shift; fi
CONFIG=configs/smoke.py
WORKDIR=runs/multihost
if [[ $# -gt 0 && "$1" != --* ]]; then CONFIG="$1"; shift; fi
if [[ $# -gt 0 && "$1" != --* ]]; then WORKDIR="$1"; shift; fi
DEVICES="${DEVICES:-2}"
GIGRL_TRAIN="$(dirname "$0")/../.venv/bin/gigrl-train"
[[ -x "$GIGRL_TRAIN" ]] || GIGRL_TRAIN=gigrl-train
PORT="${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
mkdir -p "$WORKDIR"
PIDS=()
stop() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
trap stop INT TERM
for ((i = 0; i < N; i++)); do
  JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" \
  XLA_FLAGS="--xla_force_host_platform_device_count=$DEVICES ${XLA_FLAGS:-}" \
    "$GIGRL_TRAIN" --config "$CONFIG" --workdir "$WORKDIR" \
      --coordinator_address "127.0.0.1:$PORT" --num_processes "$N" --process_id "$i" "$@" \
      > "$WORKDIR/process_$i.log" 2>&1 &
  PIDS+=($!)
done
tail -n +1 -f "$WORKDIR/process_0.log" --pid "${PIDS[0]}" &
STATUS=0
for p in "${PIDS[@]}"; do wait "$p" || STATUS=$?; done
exit "$STATUS"
