"""Warm RL steps of the README's main job from one warm-start, two checkouts side by side.

  python benchmarks/rollout_ab.py --before ../after --init_from runs/cold/after@30 \
      --out docs/results/rollout_efficiency/rollout_ab.json

Runs ``gigrl-train --config configs/countries.py:smollm2-135m-short`` from the warm-start
``--init_from`` (``train.init_from``: its params, a fresh RL optimizer) for ``--steps`` RL steps
with no evaluation, once with the checkout at ``--before`` (a ``git worktree``) and once with
this one (``--after``), one after the other on this machine, with the same seed, data and keys.
Each run compiles its whole program set before step 1 (its own empty compilation cache), so
every step is warm. The two runs roll out the same questions; per step it prints the rollout
seconds (``time/rollout_s``) and the update seconds side by side, then the medians and their
ratio after / before, and the share of the rollout in each phase (prefill, observation
extends, decode). A quicker check than ``cold_run.py`` (which also times the compiles and the
evaluations) for a change that is meant to keep the warm rollout's speed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402  (the CPU model only: no jax here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/countries.py:smollm2-135m-short"
PHASES = ("time/prefill_s", "time/extend_s", "time/decode_s", "time/search_s")


def run(checkout: str, workdir: str, init_from: str, steps: int, log: str) -> list[dict]:
  """The RL rows of ``metrics.jsonl`` of one run of ``checkout``."""
  env = dict(os.environ, PYTHONPATH=checkout, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  cmd = [sys.executable, "-m", "gigrl.cli.train", "--config", CONFIG, "--workdir", workdir,
         f"--config.train.init_from={init_from}", f"--config.train.num_steps={steps}",
         "--config.train.eval_questions=0", "--config.checkpoint.every_steps=1000",
         f"--config.train.compile_cache={workdir}_cache"]
  with open(log, "w") as f:
    subprocess.run(cmd, cwd=checkout, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return [r for r in rows if r.get("phase") == "rl"]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--before", required=True, help="a checkout (git worktree) of the earlier commit")
  p.add_argument("--after", default=ROOT)
  p.add_argument("--init_from", required=True, help="a run at the end of its SFT ([@step])")
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--workdir", default="", help="where the runs go (default: a temporary dir)")
  p.add_argument("--out", default="", help="write the figures here (json)")
  a = p.parse_args(argv)
  base = os.path.abspath(a.workdir or tempfile.mkdtemp(prefix="gigrl_ab_"))
  os.makedirs(base, exist_ok=True)
  init_from = os.path.abspath(a.init_from.split("@")[0]) + (
      "@" + a.init_from.split("@")[1] if "@" in a.init_from else "")
  res = {}
  for name, checkout in (("before", os.path.abspath(a.before)), ("after", os.path.abspath(a.after))):
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout,
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=checkout, capture_output=True, text=True).stdout.strip()
    print(f"[rollout_ab] {name}: {checkout} ({rev}{'+dirty' if dirty else ''}) ...", flush=True)
    wd = os.path.join(base, name)
    rows = run(checkout, wd, init_from, a.steps, os.path.join(base, name + ".log"))
    res[name] = {"commit": rev + ("+dirty" if dirty else ""),
                 "rollout_s": [round(r["time/rollout_s"], 2) for r in rows],
                 "update_s": [round(r.get("time/update_s", 0.0), 2) for r in rows],
                 "compile_s": [round(r.get("time/rollout_compile_s", 0.0)
                                     + r.get("time/update_compile_s", 0.0), 2) for r in rows],
                 "phases_s": {k: round(sum(r.get(k, 0.0) for r in rows), 2) for k in PHASES},
                 "generated_tokens": [r.get("rollout/generated_tokens") for r in rows]}
  b, f = res["before"], res["after"]
  print(f"\n{'step':>4s} {'rollout before':>15s} {'after':>8s} {'update before':>14s} {'after':>8s}")
  for i, (rb, ra, ub, ua) in enumerate(zip(b["rollout_s"], f["rollout_s"], b["update_s"],
                                           f["update_s"])):
    print(f"{i + 1:4d} {rb:15.2f} {ra:8.2f} {ub:14.2f} {ua:8.2f}")
  med = {k: (statistics.median(b[k]), statistics.median(f[k])) for k in ("rollout_s", "update_s")}
  for k, (x, y) in med.items():
    print(f"median {k:10s} before {x:7.2f}  after {y:7.2f}  after/before {y / x:.3f}")
  for k in PHASES:
    x, y = b["phases_s"][k], f["phases_s"][k]
    print(f"total {k:16s} before {x:7.2f}  after {y:7.2f}" + (f"  {y / x:.3f}" if x else ""))
  same = b["generated_tokens"] == f["generated_tokens"]
  print(f"same generated tokens per step: {same}")
  _machine.write_record(a.out, "rollout_ab.py", list(argv or sys.argv[1:]), config=CONFIG,
                        before=b, after=f, same_generated_tokens=same,
                        ratio={k: y / x for k, (x, y) in med.items()})
  return 0


if __name__ == "__main__":
  sys.exit(main())
