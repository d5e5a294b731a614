"""SFT and RL step time of the SmolLM2-135M countries recipe, beside its GEMM floor.

  python benchmarks/smollm2_steps.py --init_from runs/countries_smollm2/sft   # a warm-start
  python benchmarks/smollm2_steps.py --quick                                  # 2 SFT steps only
  python benchmarks/smollm2_steps.py --init_from runs/countries_smollm2/sft --sft_steps 0 \
      --set model.lora.rank=16 --set model.lora.alpha=32.0     # RL only, a LoRA setting

Runs `gigrl-train --config configs/countries.py:smollm2-135m` in a subprocess for a few SFT
steps, then (with --init_from, a run at the end of its SFT) a few RL steps from that
warm-start, and reads the per-step timings from its metrics.jsonl (the first step of each phase,
which compiles, is left out). For each phase it prints:

* step time (median), trained tokens per step and per second; for RL also the rollout's
  generated tokens per second and its share of the step;
* model FLOPs utilisation: 6·N·tokens per second (N = 134.5M parameters) over the machine's
  peak, where the peak is measured here as the best f32 matrix product rate (a 2048³ GEMM in
  XLA, all cores): MFU is then "the share of what this CPU's XLA GEMM does";
* the floor: the same step's weight GEMMs alone (`_gemm_floor.train_gemm_seconds`: forward,
  dX and dW of every kernel and the LM head, timed at 2,048 token rows and scaled linearly to
  the step's trained tokens) and the step's (RL: the update's) time over it;
* peak RSS of that phase's training process (ru_maxrss of that child alone, os.wait4).

``--set FIELD=VALUE`` (repeatable) passes config overrides to both phases (e.g. LoRA);
``--sft_steps 0`` skips the SFT phase.

Needs the fetched checkpoint (`gigrl-fetch smollm2-135m-instruct`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_floor import train_gemm_seconds  # noqa: E402
from _timing import timed_runs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOOR_ROWS = 2048
CONFIG = os.path.join(ROOT, "configs", "countries.py") + ":smollm2-135m"


def gemm_peak_flops(n: int = 2048, repeats: int = 5) -> float:
  """Best f32 FLOP/s of an n³ matrix product in XLA on this machine (all cores)."""
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  wall, _, _ = timed_runs(lambda: jax.block_until_ready(f(a)), repeats)
  return 2 * n ** 3 / min(wall)


def train_run(workdir: str, overrides: list[str]) -> tuple[list[dict], float, float]:
  """(metrics rows, wall s, peak RSS GiB) of one gigrl-train subprocess."""
  cmd = [sys.executable, "-m", "gigrl.cli.train", "--config", CONFIG, "--workdir", workdir,
         *overrides]
  t0 = time.perf_counter()
  with tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
    _, status, usage = os.wait4(proc.pid, 0)       # this child's own rusage
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode:
      err.seek(0)
      sys.exit(f"smollm2_steps: gigrl-train failed (exit {proc.returncode}):\n"
               + err.read()[-2000:])
  rss = usage.ru_maxrss / 2 ** 20                  # KiB -> GiB
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return rows, wall, rss


def phase_stats(rows: list[dict], phase: str, n_params: int, peak: float) -> dict:
  steps = [r for r in rows if r.get("phase") == phase][1:]     # the first one compiles
  if not steps:
    return {}
  t = statistics.median(r["step_time_s"] for r in steps)
  tps = statistics.median(r["train/tokens_per_s"] for r in steps)
  out = {"steps": len(steps), "step_s": t, "train_tokens_per_s": tps}
  if phase == "rl":
    out["rollout_tokens_per_s"] = statistics.median(r["rollout/tokens_per_s"] for r in steps)
    out["rollout_s"] = statistics.median(r["time/rollout_s"] for r in steps)
    out["update_s"] = statistics.median(r["time/update_s"] for r in steps)
  out["train_tokens_per_step"] = tps * (out.get("update_s") or t)
  out["mfu"] = 6 * n_params * tps / peak
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sft_steps", type=int, default=4)
  p.add_argument("--rl_steps", type=int, default=3)
  p.add_argument("--init_from", default="", help="a run at the end of its SFT (for RL)")
  p.add_argument("--quick", action="store_true", help="2 SFT steps, no RL")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="a config override for both phases (repeatable), e.g. model.lora.rank=16")
  a = p.parse_args()
  extra = [f"--config.{kv}" for kv in a.set]
  if a.quick:
    a.sft_steps, a.init_from = 2, ""
  from gigrl.models import fetch  # pylint: disable=g-import-not-at-top
  from gigrl.models.config import config_from_hf  # pylint: disable=g-import-not-at-top
  ckpt = fetch.default_dir("smollm2-135m-instruct")
  fetch.check_hf_path(ckpt)
  cfg = config_from_hf(ckpt)
  n = cfg.num_params
  peak = gemm_peak_flops()
  print(f"machine: {os.cpu_count()} cores, jax {jax.__version__} on {jax.devices()[0].platform}"
        f"; measured f32 GEMM peak {peak / 1e9:.1f} GFLOP/s; model N = {n / 1e6:.1f}M")
  results = {}
  if a.set:
    print("overrides: " + " ".join(a.set))
  with tempfile.TemporaryDirectory() as tmp:
    if a.sft_steps:
      rows, wall, rss = train_run(os.path.join(tmp, "sft"), [
          f"--config.train.sft_steps={a.sft_steps}", "--config.train.num_steps=0",
          "--config.train.eval_questions=0", "--config.checkpoint.every_steps=1000", *extra])
      results["sft"] = {**phase_stats(rows, "sft", n, peak), "peak_rss_gib": rss,
                        "wall_s": wall}
    if a.init_from:
      rows, wall, rss = train_run(os.path.join(tmp, "rl"), [
          f"--config.train.init_from={a.init_from}", f"--config.train.num_steps={a.rl_steps}",
          "--config.train.eval_questions=0", "--config.checkpoint.every_steps=1000", *extra])
      results["rl"] = {**phase_stats(rows, "rl", n, peak), "peak_rss_gib": rss, "wall_s": wall}
  # GEMM time is linear in the rows: time FLOOR_ROWS of them once and scale (an RL step's rows
  # at once need ~24 GB of random operands; a second timing beside the first's buffers too)
  floor_per_token = train_gemm_seconds(cfg, FLOOR_ROWS, repeats=2)[0] / FLOOR_ROWS
  print("| phase | steps timed | step s | trained tokens/step | trained tokens/s | MFU "
        "(6N·tok/s / peak) | GEMM floor s | step / floor | rollout gen tokens/s | peak RSS GiB |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for phase, r in results.items():
    if not r.get("steps"):
      print(f"| {phase} | 0 (run more steps) | | | | | | | | {r['peak_rss_gib']:.1f} |")
      continue
    tokens = int(round(r["train_tokens_per_step"]))
    floor = floor_per_token * tokens
    upd = r.get("update_s") or r["step_s"]
    r.update(gemm_floor_s=floor, ratio=upd / floor)
    print(f"| {phase} | {r['steps']} | {r['step_s']:.1f} | {tokens} | "
          f"{r['train_tokens_per_s']:.0f} | {r['mfu']:.1%} | {floor:.1f} | {upd / floor:.2f}x"
          f"{' (update)' if phase == 'rl' else ''} | "
          f"{r.get('rollout_tokens_per_s') or 0:.0f} | {r['peak_rss_gib']:.1f} |")
  print(json.dumps({"peak_flops": peak, "num_params": n, "overrides": a.set, **results}))


if __name__ == "__main__":
  main()
