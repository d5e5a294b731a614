"""The pilot's figures, read from its run (validation only; issue #51): per RL step the pool's
accepted groups, recycled share, active queries, zero-variance share, searches and step time,
and the validation EM by hop at each evaluation. Copies metrics.jsonl and the validation rows to
pilot/ and writes pilot/summary.json.

  python docs/results/countries_smollm2_engaged/pilot_summary.py runs/engaged/pilot/grpo_recycle_pool200
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SFT = 30


def main(run: str) -> None:
  rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
  rl = [r for r in rows if r.get("phase") == "rl"]
  ev = [r for r in rows if r.get("phase") == "eval"]
  out_dir = os.path.join(HERE, "pilot")
  os.makedirs(out_dir, exist_ok=True)
  shutil.copy(os.path.join(run, "metrics.jsonl"), os.path.join(out_dir, "metrics.jsonl"))
  for f in glob.glob(os.path.join(run, "eval_outputs", "*.jsonl")):
    shutil.copy(f, os.path.join(out_dir, "validation_" + os.path.basename(f)))
  print(f"{'step':>4s} {'acc':>4s} {'recyc':>6s} {'active':>6s} {'zero_var':>8s} {'search':>6s} "
        f"{'strata':>6s} {'reward':>6s} {'step_s':>7s}")
  for r in rl:
    print(f"{r['step'] - SFT:4d} {r['pool/accepted']:4.0f} {r['pool/recycled_frac']:6.2f} "
          f"{r['pool/size']:6.0f} {r['zero_variance_frac']:8.2f} {r['search_calls_mean']:6.2f} "
          f"{r.get('strat/strata_per_group', float('nan')):6.2f} {r['reward_mean']:6.2f} "
          f"{r['step_time_s']:7.1f}")
  n = len(rl)
  last = rl[n - n // 3:] if n >= 3 else rl
  val = [{"rl_step": r["step"] - SFT, "em": r["eval/em"], "em_1hop": r.get("eval/em/hops=1"),
          "em_2hop": r.get("eval/em/hops=2"),
          "searches": r.get("eval/search_calls_mean")} for r in ev]
  for v in val:
    print(f"validation at RL step {v['rl_step']}: EM {v['em']:.3f} (1-hop {v['em_1hop']:.3f}, "
          f"2-hop {v['em_2hop']:.3f}), {v['searches']:.2f} searches")
  summary = {
      "steps": n,
      "recycled_frac_last_third": float(np.mean([r["pool/recycled_frac"] for r in last])) if last else None,
      "accepted_mean_last_third": float(np.mean([r["pool/accepted"] for r in last])) if last else None,
      "active_at_end": rl[-1]["pool/size"] if rl else None,
      "step_time_s_median": float(np.median([r["step_time_s"] for r in rl])) if rl else None,
      "search_calls_mean": float(np.mean([r["search_calls_mean"] for r in rl])) if rl else None,
      "validation": val,
  }
  print(json.dumps({k: v for k, v in summary.items() if k != "validation"}))
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
