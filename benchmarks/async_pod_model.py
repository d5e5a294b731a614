"""A step-time model of asynchronous RL on a TPU slice (issue #52): Search-R1's batch (512 x 5 rows,
Qwen2.5-3B) on v5e-64, synchronous against a sampler/trainer split, from floors.

  python benchmarks/async_pod_model.py [--json docs/results/async/pod_model.json]

Every time here is a floor (a lower bound), not a forecast:
- update: 8·N FLOPs per token (forward, backward, the `remat=full` recompute) over every row's
  padded tokens, two PPO updates a step, plus the old log-probs (2·N per token), at the chips'
  peak bf16 FLOP/s (Search-R1's update, docs/tpu.md: >= 12 s per update on 64 chips);
- rollout: prefill and observation extends at peak FLOP/s (a group's prompt once); decode at
  HBM bandwidth, each step reading the weights' shard and the KV slots of the chip's rows (the
  cache half full on average: it fills from the prompt to 4,757 slots);
- a split of C chips into S sampler and T trainer chips scales each side's floor by C/S and C/T
  (both sides are bound by per-chip work that shrinks linearly with chips);
- with `train.max_staleness` k >= 1 the steady-state step is the slower side, plus the weight
  transfer (bf16 weights to the sampler over ICI); k = 1 and 2 have the same steady state (k
  absorbs variation between steps, which a floor model has none of);
- HBM: a side fits when its largest program, measured by `gigrl-compile` on all 64 chips
  (docs/results/tpu_compile/qwen2.5-3b_v5e-64.jsonl), scaled by 64/S (rollout: KV cache and
  activations per chip grow with rows per chip) or by the micro-batch rows per chip (update:
  measured at 16 chips too, docs/tpu.md), fits the chip's 16 GiB. An estimate, not a compile.

The rollout's measured phase shares (docs/results/rollout_efficiency: decode ~60% of a CPU
rollout) say where a real rollout departs from its floor: decode's long tail (a few long
trajectories keep every chip decoding) is what overlap hides, and a floor has no tail. So the
floors show the cost of a split and the break-even, not the gain.
"""
from __future__ import annotations

import argparse
import json
import os

GiB = 2 ** 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "docs", "results", "tpu_compile", "qwen2.5-3b_v5e-64.jsonl")

# Qwen2.5-3B; Search-R1 train_grpo.sh (docs/tpu.md "Search-R1 GRPO at its batch and lengths")
N = 3.09e9                     # parameters
LAYERS, KV_HEADS, HEAD_DIM = 36, 2, 128
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2      # k and v, bf16
PROMPTS, GROUP = 512, 5
ROWS = PROMPTS * GROUP
PROMPT, TURN, OBS, TURNS = 256, 500, 500, 5
SLOTS = PROMPT + TURNS * TURN + (TURNS - 1) * OBS             # 4,756 tokens
UPDATES = 2                    # PPO mini-batches of 256 prompts
# v5e (cloud.google.com/tpu/docs/v5e)
PEAK, HBM_BW, HBM, ICI = 197e12, 819e9, 16 * GiB, 200e9       # FLOP/s, B/s, B, B/s per chip
CHIPS = 64
UPDATE_16_CHIPS_GIB = 14.88    # rl_step on v5e-16 (docs/tpu.md): 4 rows per chip per micro-batch


def rollout_floor(chips: int) -> dict:
  """Seconds of one step's rollout on ``chips`` chips: prefill/extend FLOPs, decode bytes."""
  fill_tokens = PROMPTS * PROMPT + ROWS * (TURNS - 1) * OBS      # a group's prompt once
  prefill = 2 * N * fill_tokens / (chips * PEAK)
  steps = TURNS * TURN
  kv_read = (ROWS / chips) * (SLOTS / 2) * KV_BYTES_PER_TOKEN    # per chip per decode step
  weights = 2 * N / chips
  decode_mem = steps * (kv_read + weights) / HBM_BW
  decode_flops = 2 * N * ROWS * steps / (chips * PEAK)
  return {"prefill_extend_s": prefill, "decode_s": max(decode_mem, decode_flops),
          "total_s": prefill + max(decode_mem, decode_flops)}


def update_floor(chips: int) -> dict:
  """Seconds of one step's update (two PPO updates) and old log-probs on ``chips`` chips."""
  tokens = ROWS * SLOTS
  upd = 8 * N * tokens / (chips * PEAK)
  old = 2 * N * tokens / (chips * PEAK)
  return {"update_s": upd, "old_logprobs_s": old, "total_s": upd + old}


def measured_peaks() -> tuple[float, float]:
  """(largest rollout program, largest update program) GiB per chip on 64 chips."""
  roll = upd = 0.0
  with open(MEASURED) as f:
    for line in f:
      r = json.loads(line)
      if r["stage"] == "rollout":
        roll = max(roll, r["bytes"] / GiB)
      elif r["stage"] == "update":
        upd = max(upd, r["bytes"] / GiB)
  return roll, upd


def fits(sampler: int, trainer: int, roll64: float, upd64: float) -> tuple[float, float]:
  """Estimated GiB per chip of the largest sampler and trainer program."""
  roll = roll64 * CHIPS / sampler
  # micro-batch rows per chip 64/T: 1 at 64 chips (upd64), 4 at 16 chips (measured); linear
  per_chip = CHIPS / trainer
  upd = upd64 + (UPDATE_16_CHIPS_GIB - upd64) * (per_chip - 1) / 3
  return roll, upd


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", default="")
  a = p.parse_args(argv)
  roll64, upd64 = measured_peaks()
  r64, u64 = rollout_floor(CHIPS), update_floor(CHIPS)
  transfer = 2 * N / ICI          # bf16 weights into the sampler chips, one chip's link (a bound)
  rows = [{"layout": "synchronous, 64 chips take turns", "sampler_chips": CHIPS,
           "trainer_chips": CHIPS, "k": 0, "rollout_s": r64["total_s"],
           "update_s": u64["total_s"], "step_s": r64["total_s"] + u64["total_s"],
           "sampler_gib": roll64, "trainer_gib": upd64}]
  for s, t in ((32, 32), (48, 16)):
    r, u = rollout_floor(s), update_floor(t)
    g_r, g_u = fits(s, t, roll64, upd64)
    for k in (1, 2):
      step = max(r["total_s"], u["total_s"]) + transfer
      rows.append({"layout": f"split {s}/{t}", "sampler_chips": s, "trainer_chips": t, "k": k,
                   "rollout_s": r["total_s"], "update_s": u["total_s"], "step_s": step,
                   "sampler_idle_s": max(0.0, u["total_s"] - r["total_s"]),
                   "trainer_idle_s": max(0.0, r["total_s"] - u["total_s"]),
                   "sampler_gib": g_r, "trainer_gib": g_u})
  sync = rows[0]["step_s"]
  best = CHIPS * r64["total_s"] / (r64["total_s"] + u64["total_s"])
  print(f"floors on v5e-64 (Qwen2.5-3B, {ROWS} rows x {SLOTS} tokens): rollout "
        f"{r64['total_s']:.1f} s (prefill/extend {r64['prefill_extend_s']:.1f}, decode "
        f"{r64['decode_s']:.1f}), update {u64['total_s']:.1f} s (2 updates {u64['update_s']:.1f}, "
        f"old log-probs {u64['old_logprobs_s']:.1f}); weight transfer >= {transfer:.3f} s")
  print(f"| layout | k | sampler s | trainer s | step s (floor) | vs synchronous | sampler GiB/chip "
        f"| trainer GiB/chip |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    fit = lambda g: f"{g:.1f}" + ("" if g <= 16 else " OVER")
    print(f"| {r['layout']} | {r['k']} | {r['rollout_s']:.1f} | {r['update_s']:.1f} | "
          f"{r['step_s']:.1f} | {r['step_s'] / sync:.2f}x | {fit(r['sampler_gib'])} | "
          f"{fit(r['trainer_gib'])} |")
  print(f"break-even split: {best:.1f} sampler chips (step = synchronous); any other split is "
        f"slower on floors, and a faster async step needs what floors omit (decode's long tail)")
  if a.json:
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
      json.dump({"rows": rows, "break_even_sampler_chips": best, "floors_64": {
          "rollout": r64, "update": u64}, "weight_transfer_s": transfer,
                 "command": "python benchmarks/async_pod_model.py --json " + a.json,
                 "device": "model (no device): v5e figures, measured HBM of docs/results/tpu_compile"},
                f, indent=1)


if __name__ == "__main__":
  main()
