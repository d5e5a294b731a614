"""Collects the SmolLM2 countries runs of run.sh into results.json and curves.png.

  python docs/results/countries_smollm2/collect.py --runs runs/countries_smollm2

Reads, under --runs:
  sft/eval.json                  the warm-start's held-out evaluation (the start of RL)
  passk/results.json             gigrl-eval --mode sample on the held-out 2-hop questions
  rl/<setting>/seed_<s>/metrics.jsonl   each RL seed's `phase: eval` lines (gigrl-sweep layout)
  control/metrics.jsonl          further SFT from the same start, its `phase: eval` lines
Writes results.json (issue #28's schema, plus the curves, the pass@k ceiling and the gain's 95%
t-interval) and curves.png (held-out EM by hop against RL step, one line per seed, the
control beside them; and each seed's training reward and zero-variance share per RL step). Runs that have not finished yet are reported with what they have
("finished": false), so partial results can be committed.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os

from gigrl.training import sweep

HOPS = (1, 2)


def _jsonl(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def em_by_hop(m: dict) -> dict:
  """{"em", "em_1hop", "em_2hop", "searches_1hop", "searches_2hop", "format_valid", "n"}."""
  out = {"em": m.get("eval/em"), "n": int(m.get("eval/n", 0))}
  for h in HOPS:
    out[f"em_{h}hop"] = m.get(f"eval/em/hops={h}")
    out[f"searches_{h}hop"] = m.get(f"eval/search_calls_mean/hops={h}")
    out[f"n_{h}hop"] = round(m.get("eval/n", 0) * m.get(f"eval/share/hops={h}", 0))
  if "eval/invalid_frac" in m:
    out["format_valid"] = 1.0 - m["eval/invalid_frac"]
    out["answered"] = m.get("eval/answered_frac")
  return out


def curve(rows: list[dict], start_step: int) -> list[dict]:
  """[{"step": RL step (updates after the start), **em_by_hop}] of the eval lines."""
  evals = {r["step"]: r for r in rows if r.get("phase") == "eval" and r["step"] >= start_step}
  return [{"step": s - start_step, **em_by_hop(evals[s])} for s in sorted(evals)]


def interval(values):
  mean, half = sweep.mean_ci(values)
  return {"mean": mean, "ci95": [mean - half, mean + half], "n": len(values),
          "values": list(values)}


def collect(runs: str, sft_steps: int, num_steps: int) -> dict:
  start = json.load(open(os.path.join(runs, "sft", "eval.json")))
  start_m = em_by_hop(start)
  out = {"warm_start": start_m, "runs": [], "control": None}
  pk = os.path.join(runs, "passk", "results.json")
  if os.path.exists(pk):
    ds = json.load(open(pk))["datasets"]
    out["warm_start"]["sampled_2hop"] = {
        name: {k.split("/", 1)[1]: v for k, v in m.items()
               if k.startswith("eval/pass@") or k in ("eval/n", "eval/samples", "eval/em",
                                                      "eval/time_s")
               or k.startswith("eval/share/calls=") or k.startswith("eval/em/calls=")}
        for name, m in ds.items() if name != "origin"}
  for d in sorted(glob.glob(os.path.join(runs, "rl", "*", "seed_*"))):
    rows = _jsonl(os.path.join(d, "metrics.jsonl"))
    c = curve(rows, sft_steps)
    if not c:
      continue
    rl = [r for r in rows if r.get("phase") == "rl"]
    out["runs"].append({
        "setting": os.path.basename(os.path.dirname(d)),
        "estimator": os.path.basename(os.path.dirname(d)), "final_em": c[-1]["em"],
        "seed": int(d.rsplit("_", 1)[1]), "questions": c[0]["n"],
        "start": c[0], "final": c[-1], "curve": c,
        "rl_steps_done": max((r["step"] - sft_steps for r in rl), default=0),
        "finished": os.path.exists(os.path.join(d, sweep.DONE)),
        "train": {k: [r.get(k) for r in rl] for k in
                  ("reward_mean", "zero_variance_frac", "entropy", "search_calls_mean",
                   "step_time_s", "trained_groups")}})
  crow = _jsonl(os.path.join(runs, "control", "metrics.jsonl"))
  cc = [{"step": 0, **start_m}] + [c for c in curve(crow, sft_steps) if c["step"] > 0]
  if len(cc) > 1:
    out["control"] = {"what": "further SFT from the same start (same number of updates)",
                      "start": cc[0], "final": cc[-1], "curve": cc,
                      "finished": cc[-1]["step"] >= num_steps}
  done = [r for r in out["runs"] if r["finished"]]
  gains = [r["final"]["em_2hop"] - r["start"]["em_2hop"] for r in done]
  drops = [r["start"]["em_1hop"] - r["final"]["em_1hop"] for r in done]
  out["summary"] = {
      "finished_seeds": len(done),
      "gain_2hop": interval(gains) if gains else None,
      "drop_1hop_max": max(drops) if drops else None,
      "control_gain_2hop": (out["control"]["final"]["em_2hop"] - start_m["em_2hop"]
                            if out["control"] else None),
  }
  s = out["summary"]
  s["target_met"] = bool(
      len(done) >= 3 and s["gain_2hop"]["mean"] >= 0.15 and s["gain_2hop"]["ci95"][0] > 0
      and s["drop_1hop_max"] <= 0.03 and s["control_gain_2hop"] is not None
      and s["gain_2hop"]["mean"] > s["control_gain_2hop"])
  return out


def plot(res: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 3, figsize=(16, 4))
  axes[1].sharey(axes[0])
  for ax, h in zip(axes, HOPS):
    for r in res["runs"]:
      c = r["curve"]
      ax.plot([p["step"] for p in c], [p[f"em_{h}hop"] for p in c], marker="o",
              label=f"RL seed {r['seed']}" + ("" if r["finished"] else " (running)"))
    if res["control"]:
      c = res["control"]["curve"]
      ax.plot([p["step"] for p in c], [p[f"em_{h}hop"] for p in c], "k--", marker="s",
              label="control: further SFT")
    ax.set_title(f"held-out {h}-hop EM (greedy, n={res['warm_start'][f'n_{h}hop']})")
    ax.set_xlabel("update steps after the warm-start")
    ax.set_xlim(-1, res["num_steps"] + 1)
    ax.grid(alpha=0.3)
  ws = res["warm_start"].get("sampled_2hop") or {}
  for m in ws.values():
    if "pass@8" in m:
      axes[1].axhline(m["pass@8"], color="grey", lw=0.8, ls=":",
                      label=f"warm-start pass@8 {m['pass@8']:.2f}")
  axes[0].set_ylabel("exact match")
  axes[1].legend(fontsize=8)
  ax = axes[2]                      # the RL steps themselves: reward and groups without signal
  for r in res["runs"]:
    t = r["train"]
    steps = range(1, len(t["reward_mean"]) + 1)
    line, = ax.plot(steps, t["reward_mean"], label=f"seed {r['seed']}: rollout reward")
    ax.plot(steps, t["zero_variance_frac"], ls="--", color=line.get_color(),
            label=f"seed {r['seed']}: zero-variance share of candidate groups")
  ax.set_title("training rollouts (16 candidate groups x 4)")
  ax.set_xlabel("RL step")
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.suptitle("SmolLM2-135M-Instruct on the countries task: SFT warm-start, then RL")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--runs", default="runs/countries_smollm2")
  p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  p.add_argument("--sft_steps", type=int, default=30)
  p.add_argument("--num_steps", type=int, default=40)
  p.add_argument("--command", default="bash docs/results/countries_smollm2/run.sh")
  a = p.parse_args()
  os.makedirs(a.out, exist_ok=True)
  res = collect(a.runs, a.sft_steps, a.num_steps)
  res["command"], res["num_steps"] = a.command, a.num_steps
  with open(os.path.join(a.out, "results.json"), "w") as f:
    json.dump(res, f, indent=1, default=lambda x: None if isinstance(x, float) and
              math.isnan(x) else x)
  plot(res, os.path.join(a.out, "curves.png"))
  s = res["summary"]
  print(json.dumps(s, indent=1))


if __name__ == "__main__":
  main()
