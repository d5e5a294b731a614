"""Collects issue #52's learning comparison (run.sh in this folder) into results.json (key
``learning``; the other keys are kept), outputs/ (the per-question validation rows it reads) and
learning.png.

  python docs/results/async/collect.py --runs runs/engaged [--out docs/results/async]

What is compared: GRPO with query recycling on the engaged study's regime
(``configs/countries.py:smollm2-135m-engaged``) at ``train.max_staleness`` k = 0, 1 and 2, from the
engaged study's warm-starts 0, 1 and 2, 36 RL steps each (one update a step: matched updates and
matched rollouts). k = 0 is the engaged study's own ``grpo_recycle`` run of that warm-start (the
same config); k >= 1 runs with the off-policy correction ``tis`` (cap 2).

* **Scored on validation only** (all 214 questions, greedy, the run's own periodic evaluation at
  its last step: ``eval_outputs/step_000066.jsonl``); the test questions are not read. A run
  counts once its ``eval.json`` exists (written at its end).
* **Paired differences** (``comparisons``): per warm-start and validation question, the EM at k
  minus the EM at k = 0 on the same question from the same warm-start, over the warm-starts both
  finished; overall and by hop. Intervals as the engaged study's (its collect.py, reused): the
  two-way bootstrap (warm-starts and questions resampled, 4,000 replicates, 95% percentile) and
  the t-interval over the warm-starts' paired means (df = n - 1); the verdict reads the wider.
* **Verdict** on "k costs EM": the interval's upper end below 0 -> "costs EM here"; its lower end
  above 0 -> "gains EM here"; otherwise "cannot tell at this power" with the interval, whose lower
  end is the largest cost it does not rule out.
* **A replaced machine** (``runs/`` gone): a finished run whose metrics are gone is rebuilt
  from its committed entry in results.json and its rows in outputs/ (``from_committed``).
* **Curves**: each run's ``phase: "eval"`` lines (RL step = step - 30), the warm-start's own
  validation at RL step 0.
* **Mechanisms** per run and their mean per k, from its ``phase: "rl"`` lines: staleness (mean and
  max of ``async/staleness_*``), the importance ratio (mean of ``is_ratio_mean``, max of
  ``is_ratio_max``, mean ``is_capped_frac``), mean ``behaviour_abs_dlogp`` (|log pi_prox - log
  pi_behav| per token), the sampler's and trainer's idle seconds per step, step seconds, and the
  recycled share of accepted groups.

Errors a user can cause (no --runs directory, a line that is not JSON) exit 2 with one line
naming the file and line.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ENGAGED_DIR = os.path.join(HERE, "..", "countries_smollm2_engaged")
ENGAGED_COLLECT = os.path.join(ENGAGED_DIR, "collect.py")


def _load_engaged():
  spec = importlib.util.spec_from_file_location("countries_smollm2_engaged_collect",
                                                ENGAGED_COLLECT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


engaged = _load_engaged()     # reading, the row schema and the statistics of the engaged study
first = engaged.first
CollectError = engaged.CollectError

STALENESS = (0, 1, 2)
SEEDS = (0, 1, 2)             # the engaged study's warm-starts the comparison runs from
SFT_STEPS = engaged.SFT_STEPS
N_STEPS = engaged.N_STEPS     # RL steps of every run
FINAL_STEP = SFT_STEPS + N_STEPS
COMMAND = "bash docs/results/async/run.sh (after docs/results/countries_smollm2_engaged/run.sh)"
COMPARED = ("greedy validation EM at staleness k minus greedy validation EM at k = 0 on the same "
            "validation question from the same warm-start, after 36 RL steps (36 updates) each, "
            "averaged over the questions and the warm-starts both finished")
MECHANISMS = (  # (name, metrics key, how it is reduced over a run's RL steps)
    ("staleness_mean", "async/staleness_mean", "mean"),
    ("staleness_max", "async/staleness_max", "max"),
    ("is_ratio_mean", "is_ratio_mean", "mean"),
    ("is_ratio_max", "is_ratio_max", "max"),
    ("is_capped_frac", "is_capped_frac", "mean"),
    ("behaviour_abs_dlogp", "behaviour_abs_dlogp", "mean"),
    ("sampler_idle_s", "time/sampler_idle_s", "mean"),
    ("trainer_idle_s", "time/trainer_idle_s", "mean"),
    ("step_time_s", "step_time_s", "mean"),
)


def run_dir(runs: str, k: int, seed: int) -> str:
  """Where run.sh writes the run at staleness ``k`` from warm-start ``seed``."""
  if k == 0:
    return os.path.join(runs, "rl", "grpo_recycle", f"seed_{seed}")
  return os.path.join(runs, "async", f"k{k}", f"seed_{seed}")


def final_rows(run: str) -> dict[str, dict] | None:
  """The run's validation rows at its last RL step (id -> row) once it has finished, else None."""
  path = os.path.join(run, "eval_outputs", f"step_{FINAL_STEP:06d}.jsonl")
  if not (os.path.exists(os.path.join(run, "eval.json")) and os.path.exists(path)):
    return None
  return {r["id"]: r for r in engaged.read_jsonl(path)}


def mechanisms(rl: list[dict]) -> dict[str, float]:
  """A run's mechanisms (module docstring) from its RL metrics lines."""
  out = {}
  for name, key, how in MECHANISMS:
    vals = [r[key] for r in rl if engaged._num(r.get(key))]  # pylint: disable=protected-access
    if vals:
      out[name] = float(np.max(vals) if how == "max" else np.mean(vals))
  share = engaged.accepted_weighted_share(rl)
  if share is not None:
    out["recycled_share_accepted"] = share
  return out


NO_VERDICT = engaged.NO_VERDICT      # n = 1: no t-interval, so no "wider of the two"


def verdict(interval: list[float]) -> str:
  """The reading of a paired interval (k minus k = 0) on "k costs EM"."""
  lo, hi = interval
  if hi < 0:
    return "costs EM here"
  if lo > 0:
    return "gains EM here"
  return f"cannot tell at this power (a cost of up to {-lo:.3f} EM is not ruled out)"


def start_point(runs: str, s: int, prev: dict | None) -> list[dict]:
  """The curve's RL step 0: warm-start ``s``'s validation EM, from its run directory; where that
  is gone or being remade (a replaced machine), from the run's previous entry in results.json,
  else from the engaged study's committed results.json. [] when none has it."""
  start = [r for r in engaged.read_metrics(os.path.join(runs, "warm_start", f"seed_{s}"))
           if r.get("phase") == "eval" and r.get("step") == SFT_STEPS]
  if start:
    return [{"rl_step": 0, **first.val_metrics(start[-1])}]
  kept = [p for p in (prev or {}).get("validation_curve", []) if p.get("rl_step") == 0]
  if kept:
    return kept
  warm = {w["seed"]: w for w in (engaged.load_engaged(ENGAGED_DIR) or {}).get("warm_starts", [])}
  return [{"rl_step": 0, **warm[s]["validation_start"]}] if s in warm else []


def collect(runs: str, out_dir: str) -> dict:
  """The ``learning`` block from the runs under ``runs`` (module docstring); writes the rows it
  reads to ``out_dir/outputs/k{k}_seed{s}.jsonl``."""
  if not os.path.isdir(runs):
    raise CollectError(f"--runs {runs}: no such directory (run docs/results/async/run.sh)")
  rows, runs_out, curves = {}, {}, {}
  os.makedirs(os.path.join(out_dir, "outputs"), exist_ok=True)
  previous = engaged.load_engaged(out_dir, "learning") or {}
  for k in STALENESS:
    rows[k], runs_out[f"k{k}"] = {}, {}
    for s in SEEDS:
      d = run_dir(runs, k, s)
      lines = engaged.read_metrics(d)
      committed = os.path.join(out_dir, "outputs", f"k{k}_seed{s}.jsonl")
      prev = previous.get("runs", {}).get(f"k{k}", {}).get(str(s))
      if not lines and prev and prev.get("finished") and os.path.exists(committed):
        # A replaced machine took runs/ with it: the run is rebuilt from what is committed,
        # its entry in results.json and its per-question rows (run.sh skips it too).
        rows[k][s] = {r["id"]: r for r in engaged.read_jsonl(committed)}
        runs_out[f"k{k}"][str(s)] = {**prev, "from_committed": True}
        continue
      rl = [r for r in lines if r.get("phase") == "rl"]
      curve = start_point(runs, s, prev) + [
          {k_: v for k_, v in p.items() if k_ != "rollouts"}
          for p in engaged.validation_curve(lines, 0)]
      final = final_rows(d)
      entry = {"workdir": d, "finished": final is not None,
               "rl_steps_logged": len(rl), "validation_curve": curve, **mechanisms(rl)}
      if final is not None:
        rows[k][s] = final
        entry.update(first.by_hop(list(final.values())))
        first.write_jsonl(os.path.join(out_dir, "outputs", f"k{k}_seed{s}.jsonl"),
                          [final[i] for i in sorted(final)])
      if lines:
        runs_out[f"k{k}"][str(s)] = entry
    done = [runs_out[f"k{k}"][str(s)] for s in SEEDS
            if runs_out[f"k{k}"].get(str(s), {}).get("finished")]
    curves[f"k{k}"] = _mean_curve(done)
  comparisons = []
  cols = first.question_columns(rows[0]) if rows[0] else None
  for k in STALENESS[1:]:
    both = sorted(set(rows[k]) & set(rows[0]))
    entry = {"label": f"k{k} - k0", "compared": COMPARED.replace("staleness k", f"k = {k}"),
             "warm_starts_planned": list(SEEDS), "n_warm_starts": len(both)}
    if both and cols:
      pr = first.paired({s: rows[k][s] for s in both}, rows[0], cols, f"async/k{k}")
      entry.update(pr)
      entry["verdict"] = {key: verdict(pr["verdict_interval"][key]) if pr["t_interval"][key]
                          else NO_VERDICT for _, key in first.HOPS}
      if len(both) < len(SEEDS):
        entry["interim"] = True
    comparisons.append(entry)
  means = {f"k{k}": _mean_mechanisms([e for e in runs_out[f"k{k}"].values() if e["finished"]])
           for k in STALENESS}
  finished = sum(e["finished"] for v in runs_out.values() for e in v.values())
  return {
      "status": (f"{finished} of {len(STALENESS) * len(SEEDS)} runs finished"
                 + ("" if finished == len(STALENESS) * len(SEEDS) else
                    " (interim: run.sh resumes the rest)")),
      "command": COMMAND,
      "collect": "python docs/results/async/collect.py --runs runs/engaged",
      "config": "configs/countries.py:smollm2-135m-engaged --config.data.pool.rule=recycle "
                "--config.train.max_staleness=k --config.loss.off_policy_correction=tis (k >= 1)",
      "scored_on": "validation (214 questions, greedy); the test questions are not read",
      "runs": runs_out, "curves": curves, "mechanisms": means, "comparisons": comparisons,
  }


def _mean_curve(entries: list[dict]) -> list[dict]:
  by_step: dict[int, list[dict]] = {}
  for e in entries:
    for p in e["validation_curve"]:
      by_step.setdefault(p["rl_step"], []).append(p)
  return [{"rl_step": r, "n": len(ps), **{key: float(np.mean([p[key] for p in ps]))
                                           for _, key in first.HOPS}}
          for r, ps in sorted(by_step.items())]


def _mean_mechanisms(entries: list[dict]) -> dict[str, float]:
  names = [n for n, _, _ in MECHANISMS] + ["recycled_share_accepted"]
  return {n: float(np.mean([e[n] for e in entries if n in e]))
          for n in names if any(n in e for e in entries)} | {"n_runs": len(entries)}


def plot(learning: dict, path: str) -> bool:
  """learning.png: mean validation EM against RL step per k, each warm-start's faint."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  if not any(learning["curves"].values()):
    return False
  fig, ax = plt.subplots(figsize=(6, 3.6))
  for i, k in enumerate(STALENESS):
    color = f"C{i}"
    for e in learning["runs"][f"k{k}"].values():
      c = e["validation_curve"]
      ax.plot([p["rl_step"] for p in c], [p["em"] for p in c], color=color, alpha=0.25, lw=1)
    c = learning["curves"][f"k{k}"]
    if c:
      ax.plot([p["rl_step"] for p in c], [p["em"] for p in c], "o-", color=color,
              label=f"k = {k} (mean of {c[-1]['n']} finished)")
  ax.set_xlabel("RL step (one update each)")
  ax.set_ylabel("validation EM (214 questions, greedy)")
  ax.set_title("max_staleness k: validation EM (faint: each warm-start)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def main(argv=None) -> int:
  """Command line (module docstring); 0, or 2 with one line on stderr for an input error."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--runs", default="runs/engaged")
  p.add_argument("--out", default=HERE)
  args = p.parse_args(argv)
  try:
    learning = collect(args.runs, args.out)
  except CollectError as e:
    print(f"collect.py: {e}", file=sys.stderr)
    return 2
  path = os.path.join(args.out, "results.json")
  results = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      results = json.load(f)
  results["learning"] = learning
  with open(path, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
    f.write("\n")
  drew = plot(learning, os.path.join(args.out, "learning.png"))
  for c in learning["comparisons"]:
    if "em" in c:
      iv = c["verdict_interval"]["em"]
      print(f"{c['label']}: {c['em']:+.3f} [{iv[0]:+.3f}, {iv[1]:+.3f}] over "
            f"{c['n_warm_starts']} warm-start(s): {c['verdict']['em']}")
    else:
      print(f"{c['label']}: no warm-start finished at both k")
  print(f"{learning['status']} -> {path}" + (", learning.png" if drew else ""), file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
