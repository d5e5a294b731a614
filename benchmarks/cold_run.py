"""The README's main job from an empty compilation cache, before and after (issue #50).

  python benchmarks/cold_run.py --before ../before --out docs/results/rollout_efficiency/cold_run.json

Runs ``gigrl-train --config configs/countries.py:smollm2-135m-short`` (30 SFT steps, an
evaluation, 12 RL steps, an evaluation) twice on this machine, one after the other: with the
checkout at ``--before`` (a ``git worktree`` of the earlier commit) and with this checkout, each
with its own empty compilation cache (``train.compile_cache``), the same seed and data. From each
run's ``metrics.jsonl`` it prints side by side, with the ratio after / before:

* the RL phase: the 12 RL steps' wall seconds (``step_time_s``), compiles included, and the
  seconds of them spent compiling (``time/rollout_compile_s`` + ``time/update_compile_s``);
* the steps that compiled anything;
* the warm rollout: the median ``time/rollout_s`` over the RL steps that compiled nothing;
* the warm-up (after only: ``time/warmup_compile_s``, before step 1) and the whole run's wall
  time, warm-up and evaluations included; ``rl_phase_with_warmup_s``: the RL phase with the
  whole warm-up added (it also compiles the SFT and evaluation programs, so this overstates
  what the RL phase owes it: the conservative figure); ``rl_phase_with_rl_warmup_s``: the RL
  phase with the warm-up's share that its programs took (``time/warmup_compile_<stage>_s``
  without ``sft`` and ``eval``: the before run compiled those outside its RL phase too);
* the held-out EM at the end.

Needs the fetched checkpoint (``gigrl-fetch smollm2-135m-instruct``). Each run takes ~18 minutes
on 2 CPU cores.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402  (the CPU model only: no jax here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/countries.py:smollm2-135m-short"


def run_job(checkout: str, workdir: str, cache: str, log: str) -> float:
  """Runs the main job in ``checkout``; returns its wall seconds."""
  env = dict(os.environ, PYTHONPATH=checkout, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  cmd = [sys.executable, "-m", "gigrl.cli.train", "--config", CONFIG, "--workdir", workdir,
         f"--config.train.compile_cache={cache}"]
  t0 = time.perf_counter()
  with open(log, "w") as f:
    subprocess.run(cmd, cwd=checkout, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
  return time.perf_counter() - t0


def figures(workdir: str, wall: float) -> dict:
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  rl = [r for r in rows if r["phase"] == "rl"]
  ev = [r for r in rows if r["phase"] == "eval"]
  comp = [r.get("time/rollout_compile_s", 0) + r.get("time/update_compile_s", 0) for r in rl]
  warm = [r["time/rollout_s"] for r, c in zip(rl, comp) if r.get("time/rollout_compile_s", 0) < 0.5]
  rl_phase = sum(r["step_time_s"] for r in rl)
  first = next((r for r in rows if "time/warmup_compile_s" in r), {})
  warmup = first.get("time/warmup_compile_s", 0.0)
  return {
      "rl_steps": len(rl),
      "rl_phase_s": rl_phase,
      "rl_compile_s": sum(comp),
      "rl_steps_compiling": sum(c > 0.5 for c in comp),
      "warm_rollout_s": statistics.median(warm) if warm else None,
      "warm_rollout_steps": len(warm),
      "rollout_s": [round(r["time/rollout_s"], 2) for r in rl],
      "warmup_compile_s": warmup,
      "eval_s": [round(r.get("eval/time_s", 0.0), 1) for r in ev],
      "eval_compile_s": [round(r.get("eval/time/rollout_compile_s", 0.0), 1) for r in ev],
      "final_em": ev[-1].get("eval/em") if ev else None,
      "wall_s": wall,
      "rl_phase_with_warmup_s": rl_phase + warmup,
      # the RL phase owes the warm-up less its SFT and evaluation programs' shares (a run
      # logged before the shares existed owes all of it)
      "rl_phase_with_rl_warmup_s": rl_phase + warmup - sum(
          first.get(f"time/warmup_compile_{s}_s", 0.0) for s in ("sft", "eval")),
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--before", required=True, help="a checkout (git worktree) of the earlier commit")
  p.add_argument("--after", default=ROOT)
  p.add_argument("--workdir", default="", help="where the runs go (default: a temporary dir)")
  p.add_argument("--out", default="", help="write the figures here (json)")
  a = p.parse_args(argv)
  base = os.path.abspath(a.workdir or tempfile.mkdtemp(prefix="gigrl_cold_"))
  os.makedirs(base, exist_ok=True)
  res = {}
  for name, checkout in (("before", os.path.abspath(a.before)), ("after", os.path.abspath(a.after))):
    wd, cache = os.path.join(base, name), os.path.join(base, name + "_cache")
    for d in (wd, cache):
      if os.path.exists(d):
        raise SystemExit(f"cold_run.py: {d} exists; a cold run needs it absent")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout,
                         capture_output=True, text=True).stdout.strip()
    print(f"[cold_run] {name}: {checkout} ({rev}) ...", flush=True)
    wall = run_job(checkout, wd, cache, os.path.join(base, name + ".log"))
    res[name] = {"commit": rev, **figures(wd, wall)}
    print(f"[cold_run] {name}: {json.dumps(res[name])}", flush=True)
  b, f = res["before"], res["after"]
  print(f"\n{'':28s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
  for k in ("rl_phase_s", "rl_phase_with_rl_warmup_s", "rl_phase_with_warmup_s", "rl_compile_s",
            "rl_steps_compiling", "warm_rollout_s", "warmup_compile_s", "wall_s"):
    ratio = f"{f[k] / b[k]:.3f}" if b[k] else "-"
    print(f"{k:28s} {b[k]:10.1f} {f[k]:10.1f} {ratio:>13s}")
  print(f"{'final held-out EM':28s} {b['final_em']:10.3f} {f['final_em']:10.3f}")
  _machine.write_record(
      a.out, "cold_run.py", list(argv or sys.argv[1:]), config=CONFIG, before=b, after=f,
      ratio={k: (f[k] / b[k] if b[k] else None) for k in ("rl_phase_s", "warm_rollout_s", "wall_s")}
      | {k: f[k] / b["rl_phase_s"] for k in ("rl_phase_with_warmup_s", "rl_phase_with_rl_warmup_s")})
  return 0


if __name__ == "__main__":
  sys.exit(main())
