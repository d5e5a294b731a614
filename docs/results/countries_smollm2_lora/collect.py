"""LoRA against full fine-tuning on the SmolLM2 countries recipe: one table (issue #29).

  python docs/results/countries_smollm2_lora/collect.py --runs runs/countries_smollm2

Reads, under --runs (docs/results/countries_smollm2/run.sh's layout plus this directory's run.sh):
  sft/eval.json                         the warm-start both start from (held-out EM by hop)
  rl/grpo_recycle/seed_<s>/             full fine-tuning RL: eval.json, metrics.jsonl
  lora/lora_r16/seed_<s>/               LoRA RL, same steps from the same warm-start
and, in --out, bench_full.json / bench_lora.json: the last line of
`benchmarks/smollm2_steps.py --sft_steps 0 ...` for each (the RL step time and the peak RSS of
the training process, measured alone). Writes results.json and results.md in --out, and
copies each run's eval.json and metrics.jsonl to --out/outputs/.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics

from gigrl.training import sweep


def _json(path):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _jsonl(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def run_summary(workdir: str, sft_steps: int) -> dict:
  """Held-out EM by hop of the run's final eval, and its median RL step times (s)."""
  ev = _json(os.path.join(workdir, "eval.json")) or {}
  rl = [r for r in _jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("phase") == "rl"]
  med = lambda key: statistics.median(r[key] for r in rl[1:]) if len(rl) > 1 else None
  return {"workdir": workdir, "finished": bool(ev), "rl_steps": len(rl),
          "step": ev.get("step", sft_steps) - sft_steps if ev else None,
          "em": ev.get("eval/em"), "em_1hop": ev.get("eval/em/hops=1"),
          "em_2hop": ev.get("eval/em/hops=2"),
          "searches_2hop": ev.get("eval/search_calls_mean/hops=2"),
          # the first RL step compiles; the rest, as run (other jobs may have shared the cores)
          "step_s": med("step_time_s"), "update_s": med("time/update_s"),
          "rollout_s": med("time/rollout_s")}


def _mean_ci(values):
  values = [v for v in values if v is not None]
  if not values:
    return None
  mean, half = sweep.mean_ci(values)
  return {"mean": mean, "ci95": [mean - half, mean + half], "n": len(values)}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--runs", default="runs/countries_smollm2")
  p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  p.add_argument("--sft_steps", type=int, default=30)
  p.add_argument("--command", default="")
  a = p.parse_args()
  start = _json(os.path.join(a.runs, "sft", "eval.json")) or {}
  settings = {"full": sorted(glob.glob(os.path.join(a.runs, "rl", "grpo_recycle", "seed_*"))),
              "lora_r16": sorted(glob.glob(os.path.join(a.runs, "lora", "lora_r16", "seed_*")))}
  out = {"command": a.command,
         "start": {"em": start.get("eval/em"), "em_1hop": start.get("eval/em/hops=1"),
                   "em_2hop": start.get("eval/em/hops=2")}}
  os.makedirs(os.path.join(a.out, "outputs"), exist_ok=True)
  for name, dirs in settings.items():
    runs = [run_summary(d, a.sft_steps) for d in dirs]
    done = [r for r in runs if r["finished"]]
    out[name] = {"runs": runs, **{f"{k}_mean": _mean_ci([r[k] for r in done])
                                  for k in ("em", "em_1hop", "em_2hop")},
                 "gain_2hop": _mean_ci([r["em_2hop"] - out["start"]["em_2hop"] for r in done])}
    bench = _json(os.path.join(a.out, f"bench_{name.split('_')[0]}.json"))
    if bench and bench.get("rl"):
      out[name]["bench"] = {k: bench["rl"].get(k) for k in
                            ("step_s", "rollout_s", "update_s", "peak_rss_gib", "steps")}
      out[name]["bench"]["overrides"] = bench.get("overrides", [])
    for d in dirs:
      seed = os.path.basename(d)
      for f in ("eval.json", "metrics.jsonl"):
        if os.path.exists(os.path.join(d, f)):
          shutil.copy(os.path.join(d, f), os.path.join(a.out, "outputs", f"{name}_{seed}_{f}"))
  with open(os.path.join(a.out, "results.json"), "w") as f:
    json.dump(out, f, indent=1)
  lines = ["| setting | seeds | held-out EM | 1-hop | 2-hop | 2-hop gain | RL step s (bench) | "
           "update s (bench) | peak RSS GiB (bench) | RL step s (in the runs) |",
           "|---|---|---|---|---|---|---|---|---|---|",
           f"| warm-start (start of RL) | - | {out['start']['em']:.3f} | "
           f"{out['start']['em_1hop']:.3f} | {out['start']['em_2hop']:.3f} | | | | | |"]
  fmt = lambda s: "n/a" if s is None else (f"{s['mean']:.3f}" if s["n"] == 1 else
                                           f"{s['mean']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]")
  for name in settings:
    s, b = out[name], out[name].get("bench", {})
    done = [r for r in s["runs"] if r["finished"]]
    steps_in_runs = ", ".join(f"{r['step_s']:.0f}" for r in s["runs"] if r["step_s"])
    num = lambda v, spec=".1f": "n/a" if v is None else format(v, spec)
    lines.append(f"| {name} | {len(done)} | {fmt(s['em_mean'])} | {fmt(s['em_1hop_mean'])} | "
                 f"{fmt(s['em_2hop_mean'])} | {fmt(s['gain_2hop'])} | {num(b.get('step_s'))} | "
                 f"{num(b.get('update_s'))} | {num(b.get('peak_rss_gib'))} | {steps_in_runs} |")
  table = "\n".join(lines)
  with open(os.path.join(a.out, "results.md"), "w") as f:
    f.write(table + "\n")
  print(table)


if __name__ == "__main__":
  main()
