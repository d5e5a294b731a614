"""Minimum detectable effects of the engaged study, fixed before any of its runs (issue #51).

For each pre-registered comparison: the smallest true paired difference in test EM that a
two-sided t-test over the warm-starts' paired means detects with 80% power, at alpha = 0.05 and
at the family-wise alpha (0.05 / 4, Bonferroni over the 4 primary comparisons). The spread of
the warm-starts' paired differences is not known before the runs; it is taken from the most
similar comparison of the first study (docs/results/countries_smollm2_estimators/results.json,
3 warm-starts, max_turns 2), which makes these figures rough (a standard deviation from 3
values).

  python docs/results/countries_smollm2_engaged/mde.py [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
from scipy import optimize, stats

HERE = os.path.dirname(os.path.abspath(__file__))
FIRST = os.path.join(HERE, "..", "countries_smollm2_estimators", "results.json")
PRIMARY = 4            # comparisons in the family-wise family (the protocol's primary ones)
# comparison -> (warm-starts, the first study's proxy: setting, reference)
COMPARISONS = {
    "grpo_recycle - grpo_filter (reuse against the filter alone)": (5, "grpo", "grpo_recycle"),
    "grpo_filter - grpo (the filter, matched rollouts)": (5, "grpo", "grpo_recycle"),
    "stratified - grpo_recycle": (5, "stratified", "grpo_recycle"),
    "hadw - grpo_recycle": (5, "hadw", "grpo_recycle"),
    "rft_filter - grpo_filter (control)": (3, "rft", "grpo_recycle"),
    "sft_matched - grpo_filter (control)": (3, "sft_continued", "grpo_recycle"),
}


def per_warm_start(results: dict, name: str, ref: str) -> np.ndarray:
  """The first study's paired differences in final test EM, one per warm-start."""
  rows = {**results["settings"], **results.get("controls", {})}
  get = lambda n: {s["seed"]: s["final"]["em"] for s in rows[n]["seeds"]}
  a, b = get(name), get(ref)
  return np.array([a[s] - b[s] for s in sorted(set(a) & set(b))])


def mde(sd: float, n: int, alpha: float, power: float = 0.8) -> float:
  """Smallest |delta| with P(reject) = power: two-sided one-sample t-test of n paired means
  (noncentral t, df = n - 1, noncentrality delta * sqrt(n) / sd)."""
  crit = stats.t.ppf(1 - alpha / 2, n - 1)

  def gap(delta):
    nc = delta * np.sqrt(n) / sd
    upper = np.nan_to_num(stats.nct.sf(crit, n - 1, nc), nan=1.0)
    lower = np.nan_to_num(stats.nct.cdf(-crit, n - 1, nc), nan=0.0)
    return upper + lower - power
  return float(optimize.brentq(gap, 1e-6, (crit + 10) * sd / np.sqrt(n)))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", default="")
  a = p.parse_args(argv)
  with open(FIRST) as f:
    first = json.load(f)
  out = {}
  print(f"{'comparison':60s} {'n':>2s} {'sd (first study)':>17s} {'MDE a=.05':>10s} "
        f"{'MDE family':>10s}")
  for label, (n, name, ref) in COMPARISONS.items():
    d = per_warm_start(first, name, ref)
    sd = float(d.std(ddof=1))
    row = {"warm_starts": n, "proxy": f"{name} - {ref} (first study)",
           "proxy_differences": d.round(4).tolist(), "sd": sd,
           "mde_alpha_0.05": mde(sd, n, 0.05), f"mde_alpha_0.05/{PRIMARY}": mde(sd, n, 0.05 / PRIMARY)}
    out[label] = row
    print(f"{label:60s} {n:2d} {sd:17.4f} {row['mde_alpha_0.05']:10.3f} "
          f"{row[f'mde_alpha_0.05/{PRIMARY}']:10.3f}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
