"""Collects the estimator study's runs (run.sh) into results.json, results.md, curves.png,
forest.png and outputs/ (per-question rows of every evaluation).

  python docs/results/countries_smollm2_estimators/collect.py --runs runs/estimators \
      --out docs/results/countries_smollm2_estimators --command "..."

Works on a partial grid: a run that has not finished is left out (and listed as missing);
every statistic says how many warm-starts it rests on.

With ``--pass-at-k-only`` it rebuilds only the pass@k figures, from the per-question outputs in
outputs/ (and any pass@k evaluation finished under --runs), leaving every other figure of
results.json as it is: how a pass@k evaluation re-run after the runs directory was lost joins
the others. With ``--from-outputs`` it rebuilds every figure that rests on the test rows alone
(test EM, paired differences and their intervals, gains over the start, pass@k) from outputs/,
and leaves the validation curves and mechanisms (which need the runs directory) as they are: how
the t-intervals of issue #51 joined the grid after its runs directory was lost.

``versions`` in results.json: the python, jax, jaxlib, flax, optax, orbax-checkpoint and numpy
versions run.sh records at each (re)start (``--print-versions`` >> RUNS/versions.jsonl), those of
the collecting process, and the hand-written versions_known.json (runs that recorded none).

Statistics (README.md of this folder, "Statistics"):
* test EM of a setting: the mean over its warm-starts of the final test EM (all 469 test
  questions, greedy); 95% interval from a two-way bootstrap that resamples warm-starts and
  questions (the same question draw for every warm-start of a replicate), percentile method;
* the paired difference from ``grpo_recycle``: per warm-start and question, this setting's EM
  minus grpo_recycle's on the same question from the same warm-start, averaged, with the same
  two-way bootstrap; only the warm-starts both have finished enter it;
* beside every paired difference's bootstrap interval (from ``grpo_recycle``, over the start,
  pass@k; issue #51) a t-interval over the warm-starts: each warm-start's mean over the
  questions, then mean ± t_{0.975, n-1} · sd / √n (``per_warm_start``, ``t_interval``; n = 3:
  2 degrees of freedom). Three warm-starts give the bootstrap only 10 distinct draws of them,
  so it understates their variance. A verdict is read from the wider of the two
  (``verdict_interval``);
* pass@k on the 2-hop test questions (8 samples at temperature 1) at the start and the end of
  ``grpo_recycle``: per question the unbiased pass@k (Chen et al. 2021, eq. 1; gigrl-eval's
  ``pass_at_k``), then end minus start on the same questions from the same warm-start, with the
  same two-way bootstrap (``pass_at_k_2hop`` in results.json);
* recycling at matched rollouts (``recycling_at_matched_rollouts``): ``grpo`` minus
  ``grpo_recycle`` on the validation questions at the largest rollout count both were evaluated
  at (640: RL step 20 against 10), paired, with both intervals;
* a family-wise interval for each paired difference from ``grpo_recycle`` (``ci_family_em``,
  ``ci_family_em_2hop``): Bonferroni over the FAMILY = 14 intervals the study reads a verdict
  from (7 comparisons x {EM, 2-hop EM}), i.e. the 1 - 0.05/14 percentile interval of the same
  two-way bootstrap, from BOOT_FAMILY replicates so that each tail holds ~70 of them. Added
  after the grid's first results, as a check that a verdict survives multiplicity.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import zlib

import numpy as np

REFERENCE = "grpo_recycle"
CONTROLS = ("sft_continued", "rft")
ORDER = ("grpo_recycle", "grpo", "stratified", "gigpo", "hadw", "all_four", "rft",
         "sft_continued")
HOPS = ((None, "em"), (1, "em_1hop"), (2, "em_2hop"))
PASS_K = (1, 4, 8)
BOOT = 4000
FAMILY = 14          # paired intervals read for a verdict: 7 comparisons x {EM, 2-hop EM}
BOOT_FAMILY = 40000  # replicates of a family-wise interval (each tail: 40000 * 0.05/28 ~ 71)
SFT_STEPS = 30       # the warm-start's SFT steps: RL step r is run step 30 + r


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str, rows: list[dict]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def normalise_eval_rows(rows: list[dict]) -> list[dict]:
  """gigrl-eval's ``samples_<set>.jsonl`` rows (lists per sample) -> the trainer's
  ``eval_outputs`` schema (id, hops, prediction, em, f1, searches, queries, retrieved); a
  sampled evaluation keeps every sample's answer and EM (``predictions``, ``em_samples``)."""
  out = []
  for r in rows:
    row = {"id": r["id"], "hops": r["hops"], "prediction": r["answers"][0], "em": r["em"][0],
           "f1": r["f1"][0], "searches": r["search_calls"][0],
           "queries": r.get("queries", [[]])[0], "retrieved": r.get("retrieved", [[]])[0]}
    if len(r["em"]) > 1:
      row.update(predictions=r["answers"], em_samples=r["em"],
                 searches_samples=r["search_calls"])
    out.append(row)
  return out


def by_hop(rows: list[dict]) -> dict[str, float]:
  out = {}
  for hops, key in HOPS:
    sel = [r["em"] for r in rows if hops is None or r["hops"] == hops]
    out[key] = float(np.mean(sel)) if sel else float("nan")
    out["n" + key[2:]] = len(sel)
  return out


def eval_lines(run: str) -> list[dict]:
  path = os.path.join(run, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  return [r for r in read_jsonl(path) if r.get("phase") == "eval"]


def val_metrics(line: dict) -> dict[str, float]:
  return {"em": line["eval/em"], "em_1hop": line.get("eval/em/hops=1", float("nan")),
          "em_2hop": line.get("eval/em/hops=2", float("nan"))}


def run_config(run: str) -> dict:
  metas = sorted(glob.glob(os.path.join(run, "checkpoints", "*", "meta", "metadata")),
                 key=lambda p: int(p.split(os.sep)[-3]))
  if not metas:
    return {}
  with open(metas[-1], encoding="utf-8") as f:
    return json.load(f).get("config", {})


def rollouts_per_step(cfg: dict) -> int:
  """Rollouts generated per RL step: candidate prompts x group size (query recycling rolls
  out ``oversample`` x ``prompts_per_step`` candidates; 0 for SFT: a run with no RL step, such
  as the continued-SFT control)."""
  d = cfg.get("data", {})
  if not d or not int(cfg.get("train", {}).get("num_steps", 1)):
    return 0
  over = d["pool"]["oversample"] if d["pool"]["rule"] != "grpo" else 1
  return int(d["prompts_per_step"] * over * d["group_size"])


def passk_matrix(rows_by_seed: dict[int, dict[str, dict]], seeds: list[int], ids: list[str],
                 k: int) -> np.ndarray:
  """f64[S, Q] (seeds x ids): each question's unbiased pass@k (Chen et al. 2021, eq. 1) from its
  sampled row's ``em_samples`` (a sample is right when its EM > 0). Raises KeyError for a seed
  or id with no row, ValueError (from ``pass_at_k``) when k exceeds the samples."""
  from gigrl.training.evaluate import pass_at_k  # pylint: disable=g-import-not-at-top
  def one(r):
    em = r["em_samples"]
    return pass_at_k(len(em), int(sum(e > 0 for e in em)), k)
  return np.array([[one(rows_by_seed[s][i]) for i in ids] for s in seeds], np.float64)


# ---------------------------------------------------------------------------- bootstrap
def rng_for(*key) -> np.random.Generator:
  """A bootstrap generator of its own for each interval, seeded by what it compares (e.g.
  ``rng_for("paired", "gigpo", "em_2hop")``), so that an interval does not move when another
  run is added to the grid (one shared generator would hand it other draws)."""
  return np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))


def two_way_bootstrap(m: np.ndarray, rng: np.random.Generator, b: int = BOOT,
                      alpha: float = 0.05) -> tuple[float, list[float]]:
  """Mean of ``m`` f64[S, Q] (warm-starts x questions) and the 1 - ``alpha`` percentile
  interval of a bootstrap resampling warm-starts and questions independently (multinomial
  weights), from ``b`` replicates."""
  s, q = m.shape
  ws = rng.multinomial(s, np.full(s, 1 / s), size=b).astype(np.float64)
  wq = rng.multinomial(q, np.full(q, 1 / q), size=b).astype(np.float64)
  reps = np.einsum("bs,sq,bq->b", ws, m, wq) / (s * q)
  lo, hi = np.percentile(reps, [50 * alpha, 100 - 50 * alpha])
  return float(m.mean()), [float(lo), float(hi)]


def em_matrix(finals: dict[int, dict[str, dict]], seeds: list[int], ids: list[str]
              ) -> np.ndarray:
  return np.array([[finals[s][i]["em"] for i in ids] for s in seeds], np.float64)


def t_interval(per_warm_start, alpha: float = 0.05) -> list[float] | None:
  """The 1 - ``alpha`` Student-t interval for the mean of ``per_warm_start`` (one value per
  warm-start, e.g. its paired difference averaged over the questions), with n - 1 degrees of
  freedom: mean ± t_{1 - alpha/2, n - 1} · sd / √n (sd with ddof = 1). With n = 3 warm-starts:
  2 degrees of freedom, t = 4.303. None when n < 2 (no spread to estimate).

  Beside the two-way bootstrap because 3 warm-starts give the bootstrap only 10 distinct
  warm-start draws, so it understates their variance (issue #51)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top  (jax requires scipy)
  x = np.asarray(per_warm_start, np.float64)
  if x.size < 2:
    return None
  half = float(stats.t.ppf(1 - alpha / 2, x.size - 1)) * x.std(ddof=1) / np.sqrt(x.size)
  return [float(x.mean() - half), float(x.mean() + half)]


def wider(boot: list[float], t: list[float] | None) -> list[float]:
  """The interval a verdict is read from: the wider of the bootstrap one and the t-interval
  (the bootstrap's on a tie, or when there is no t-interval: n = 1)."""
  if t is None or t[1] - t[0] <= boot[1] - boot[0]:
    return list(boot)
  return list(t)


def question_columns(test_rows: dict[int, dict[str, dict]]) -> dict[str, list[str]]:
  """{"em": every test id, "em_1hop": the 1-hop ids, "em_2hop": the 2-hop ids} (sorted), from
  the test rows (id -> row) of the lowest warm-start."""
  rows = test_rows[min(test_rows)]
  ids = sorted(rows)
  return {key: [i for i in ids if h is None or rows[i]["hops"] == h] for h, key in HOPS}


def test_block(finals: dict[int, dict[str, dict]], cols: dict[str, list[str]],
               label: str) -> dict:
  """A setting's test EM by hop (mean over warm-starts) with its two-way bootstrap interval."""
  seeds = sorted(finals)
  out = {"n_warm_starts": len(seeds), "ci95": {}}
  for _, key in HOPS:
    m = em_matrix(finals, seeds, cols[key])
    out[key], out["ci95"][key] = two_way_bootstrap(m, rng_for("test", label, key))
  return out


def paired(finals: dict[int, dict[str, dict]], ref: dict[int, dict[str, dict]],
           cols: dict[str, list[str]], label: str, family: bool = False) -> dict:
  """``finals`` minus ``ref`` (test rows by warm-start and id) question by question from the
  same warm-start, over the warm-starts both have: per hop key the mean, its two-way bootstrap
  interval (``ci95_em``, ``ci95_em_1hop``, and ``ci95`` for 2-hop), with ``family`` the
  family-wise one (``ci_family_*``); then ``per_warm_start`` (each warm-start's mean over the
  questions), ``t_interval`` (:func:`t_interval` over those) and ``verdict_interval`` (the
  wider of the bootstrap and the t-interval: :func:`wider`), each by hop key. {} when no
  warm-start has both."""
  seeds = sorted(set(finals) & set(ref))
  if not seeds:
    return {}
  out = {"n_warm_starts": len(seeds)}
  per, t_iv, verdict = {}, {}, {}
  for _, key in HOPS:
    d = em_matrix(finals, seeds, cols[key]) - em_matrix(ref, seeds, cols[key])
    mean, ci = two_way_bootstrap(d, rng_for("paired", label, key))
    out[key], out["ci95" if key == "em_2hop" else f"ci95_{key}"] = mean, ci
    if family and key != "em_1hop":
      out[f"ci_family_{key}"] = two_way_bootstrap(
          d, rng_for("family", label, key), BOOT_FAMILY, 0.05 / FAMILY)[1]
    per[key] = [float(x) for x in d.mean(1)]
    t_iv[key] = t_interval(per[key])
    verdict[key] = wider(ci, t_iv[key])
  out.update(warm_starts=seeds, per_warm_start=per, t_interval=t_iv, verdict_interval=verdict)
  return out


def first_warm_starts(finals: dict[int, dict[str, dict]], ref: dict[int, dict[str, dict]],
                      cols: dict[str, list[str]], label: str) -> list[dict]:
  """How the paired reading moved as warm-starts were added: paired EM and 2-hop EM (95%)
  over the first k warm-starts both runs finished, k = 1, 2, ..."""
  both = sorted(set(finals) & set(ref))
  keep = ("em", "ci95_em", "em_2hop", "ci95")
  out = []
  for k in range(1, len(both) + 1):
    pr = paired({s: finals[s] for s in both[:k]}, ref, cols, label)
    out.append({"n_warm_starts": k, **{key: pr[key] for key in keep}})
  return out


def test_figures(name: str, finals: dict[int, dict[str, dict]],
                 ref: dict[int, dict[str, dict]], start: dict[int, dict[str, dict]],
                 cols: dict[str, list[str]]) -> dict:
  """Every figure of setting ``name`` that rests on test rows alone (by warm-start and id:
  its finals, grpo_recycle's ``ref``, the warm-starts' ``start``): ``test``,
  ``paired_vs_grpo_recycle``, ``paired_first_warm_starts`` and ``gain_vs_start`` (final minus
  start on the same questions from the same warm-start), in results.json's order."""
  return {"test": test_block(finals, cols, name),
          "paired_vs_grpo_recycle": (paired(finals, ref, cols, name, family=True)
                                     if name != REFERENCE else {}),
          "paired_first_warm_starts": (first_warm_starts(finals, ref, cols, name)
                                       if name != REFERENCE else []),
          "gain_vs_start": paired(finals, start, cols, name + "/gain")}


# ---------------------------------------------------------------------------- one setting
def collect_run(run: str) -> dict | None:
  """A finished run's validation curve, final test rows and mechanisms (None if unfinished)."""
  test = os.path.join(run, "test_final", "samples_test.jsonl")
  if not os.path.exists(test):
    return None
  cfg = run_config(run)
  per_step = rollouts_per_step(cfg)
  curve = [{"rl_step": line["step"] - SFT_STEPS,
            "rollouts": (line["step"] - SFT_STEPS) * per_step, **val_metrics(line)}
           for line in eval_lines(run)]
  metrics = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))
             if r.get("phase") in ("rl", "sft")]
  return {"curve": curve, "test": normalise_eval_rows(read_jsonl(test)), "metrics": metrics,
          "rollouts_per_step": per_step}


def mechanisms(runs: dict[int, dict]) -> dict[str, float]:
  """Means over the RL steps of every finished warm-start (``late``: the last 5 steps)."""
  keys = {"zero_variance_frac": "zero_variance_frac",
          "recycled_frac": "pool/recycled_frac",
          "gigpo_anchor_group_frac": "gigpo/anchor_group_frac",
          "cross_stratum_bias": "strat/cross_stratum_bias",
          "stratified_var_reduction": "strat/var_reduction",
          "hadw_phi_hard": "hadw/phi_hard", "hadw_phi_easy": "hadw/phi_easy",
          "train_reward": "reward_mean"}
  out = {}
  for name, key in keys.items():
    vals = [r[key] for run in runs.values() for r in run["metrics"]
            if r.get("phase") == "rl" and isinstance(r.get(key), (int, float))]
    late = [r[key] for run in runs.values() for r in run["metrics"][-5:]
            if r.get("phase") == "rl" and isinstance(r.get(key), (int, float))]
    if vals:
      out[name] = float(np.mean(vals))
      out[name + "_late"] = float(np.mean(late)) if late else float("nan")
  for hops in (1, 2):
    calls = [r["searches"] for run in runs.values() for r in run["test"] if r["hops"] == hops]
    if calls:
      out[f"test_searches_{hops}hop"] = float(np.mean(calls))
  return out


def pass_at_k_block(warm: dict[int, dict], ref_runs: dict[int, dict],
                    ref: dict[int, dict[str, dict]]) -> dict:
  """pass@k on the 2-hop test questions, end of grpo_recycle minus its start, paired.

  ``warm[s]["passk_rows"]`` and ``ref_runs[s]["passk_rows"]`` map question id -> sampled row
  (``em_samples``: the EM of each of the n samples); only warm-starts with both enter. For each k
  of PASS_K: the mean per-question pass@k (Chen et al. 2021, eq. 1) at the start and the end, and
  the mean of end − start with its two-way bootstrap interval (EM units), each warm-start's mean
  of it, its t-interval over those and the wider of the two (``verdict_interval``). ``ref``
  (greedy final
  test rows of grpo_recycle by seed and id) gives greedy EM on the same questions. {} when no
  warm-start has both.
  """
  pk_seeds = sorted(s for s, run in ref_runs.items()
                    if "passk_rows" in run and "passk_rows" in warm.get(s, {}))
  if not pk_seeds:
    return {}
  start = {s: warm[s]["passk_rows"] for s in pk_seeds}
  final = {s: ref_runs[s]["passk_rows"] for s in pk_seeds}
  pk_ids = sorted(set.intersection(*(set(start[s]) & set(final[s]) for s in pk_seeds)))
  block = {"setting": REFERENCE, "n_warm_starts": len(pk_seeds), "questions": len(pk_ids),
           "samples": len(next(iter(start[pk_seeds[0]].values()))["em_samples"]),
           "start": {}, "final": {}, "diff": {}, "ci95": {}, "per_warm_start": {},
           "t_interval": {}, "verdict_interval": {}}
  for k in PASS_K:
    a = passk_matrix(start, pk_seeds, pk_ids, k)
    b = passk_matrix(final, pk_seeds, pk_ids, k)
    block["start"][str(k)], block["final"][str(k)] = float(a.mean()), float(b.mean())
    block["diff"][str(k)], block["ci95"][str(k)] = two_way_bootstrap(
        b - a, rng_for("pass_at_k", k))
    block["per_warm_start"][str(k)] = [float(x) for x in (b - a).mean(1)]
    block["t_interval"][str(k)] = t_interval(block["per_warm_start"][str(k)])
    block["verdict_interval"][str(k)] = wider(block["ci95"][str(k)], block["t_interval"][str(k)])
  # the earlier study's comparison, kept beside it: greedy EM after RL on the same questions
  greedy = [ref[s][i]["em"] for s in pk_seeds for i in pk_ids if i in ref.get(s, {})]
  if greedy:
    block["greedy_final_em_2hop"] = float(np.mean(greedy))
  return block


def pass_at_k_means(rows: dict[str, dict]) -> dict[str, float]:
  """{"1": ..., "4": ..., "8": ...}: the mean over the questions of ``rows`` (id -> sampled row)
  of each question's unbiased pass@k, for every k of PASS_K (gigrl-eval's own figures)."""
  ids = sorted(rows)
  return {str(k): float(passk_matrix({0: rows}, [0], ids, k).mean()) for k in PASS_K}


def rows_by_seed(outputs: str, pattern: str) -> dict[int, dict[str, dict]]:
  """{seed: {id: row}} from the files of ``outputs`` matching ``pattern`` (e.g.
  ``gigpo_seed*_test_final.jsonl``), seed read from each name's ``_seed<s>_``."""
  out = {}
  for path in sorted(glob.glob(os.path.join(outputs, pattern))):
    s = int(re.search(r"_seed(\d+)_", os.path.basename(path)).group(1))
    out[s] = {r["id"]: r for r in read_jsonl(path)}
  return dict(sorted(out.items()))


def rebuild_pass_at_k(runs_dir: str, out_dir: str) -> dict:
  """Rebuilds the pass@k figures of ``out_dir/results.json`` from the per-question outputs in
  ``out_dir/outputs`` and leaves every other figure as it is; returns the new results.

  First copies (normalised) each finished pass@k evaluation found under ``runs_dir``
  (``warm_start/seed_*/passk_start``, ``rl/grpo_recycle/seed_*/passk_final``) into outputs/;
  then reads every ``warm_start_seed<s>_passk_start.jsonl`` and
  ``grpo_recycle_seed<s>_passk_final.jsonl`` there, with ``grpo_recycle_seed<s>_test_final.jsonl``
  for greedy EM, into ``pass_at_k_2hop`` (:func:`pass_at_k_block`) and each warm-start's and
  grpo_recycle seed's pass@k. For a grid whose runs directory is gone but whose outputs/ were
  committed, so that a pass@k evaluation re-run later joins the others. Raises FileNotFoundError
  when ``out_dir`` holds no results.json.
  """
  outputs = os.path.join(out_dir, "outputs")
  with open(os.path.join(out_dir, "results.json"), encoding="utf-8") as f:
    results = json.load(f)
  for what, pattern in (("passk_start", os.path.join("warm_start", "seed_*")),
                        ("passk_final", os.path.join("rl", REFERENCE, "seed_*"))):
    for d in sorted(glob.glob(os.path.join(runs_dir, pattern))):
      files = glob.glob(os.path.join(d, what, "samples_*.jsonl"))
      if files and os.path.exists(os.path.join(d, what, "results.json")):
        s = int(d.rsplit("_", 1)[1])
        name = "warm_start" if what == "passk_start" else REFERENCE
        write_jsonl(os.path.join(outputs, f"{name}_seed{s}_{what}.jsonl"),
                    normalise_eval_rows(read_jsonl(files[0])))

  start = rows_by_seed(outputs, "warm_start_seed*_passk_start.jsonl")
  final = rows_by_seed(outputs, f"{REFERENCE}_seed*_passk_final.jsonl")
  greedy = rows_by_seed(outputs, f"{REFERENCE}_seed*_test_final.jsonl")
  for w in results["warm_starts"]:
    if w["seed"] in start:
      w["pass_at_k_2hop_start"] = pass_at_k_means(start[w["seed"]])
  for e in results["settings"].get(REFERENCE, {}).get("seeds", []):
    if e["seed"] in final:
      e["pass_at_k_2hop_final"] = pass_at_k_means(final[e["seed"]])
  block = pass_at_k_block({s: {"passk_rows": r} for s, r in start.items()},
                          {s: {"passk_rows": r} for s, r in final.items()}, greedy)
  if block:
    results["pass_at_k_2hop"] = block
  commits = os.path.join(runs_dir, "commits.txt")
  if os.path.exists(commits):
    results["commits"] = sorted(set(results.get("commits", []))
                                | set(open(commits).read().split()))
  results["versions"] = versions_block(runs_dir, out_dir, results.get("versions"))
  return results


def rebuild_from_outputs(runs_dir: str, out_dir: str) -> dict:
  """Rebuilds every figure of ``out_dir/results.json`` that rests on the per-question test rows
  alone, from ``out_dir/outputs``, and leaves the others (validation curves, mechanisms,
  overrides) as they are; returns the new results.

  The pass@k figures as :func:`rebuild_pass_at_k` (with any pass@k evaluation finished under
  ``runs_dir``); then from ``warm_start_seed<s>_{test_start,closed_book}.jsonl`` and
  ``<setting>_seed<s>_test_final.jsonl``: ``warm_starts_test``, ``closed_book_test`` and, for
  every setting and control already in results.json, ``test``, ``paired_vs_grpo_recycle``,
  ``paired_first_warm_starts`` and ``gain_vs_start`` (:func:`test_figures`), the t-intervals
  included. On a grid whose runs directory is gone this is how a new statistic joins the
  committed figures; on a full grid it equals what a full collect writes. Raises
  FileNotFoundError when ``out_dir`` holds no results.json or outputs/ no test rows.
  """
  results = rebuild_pass_at_k(runs_dir, out_dir)
  outputs = os.path.join(out_dir, "outputs")
  start = rows_by_seed(outputs, "warm_start_seed*_test_start.jsonl")
  if not start:
    raise FileNotFoundError(f"no warm_start_seed*_test_start.jsonl in {outputs}")
  cols = question_columns(start)
  results["warm_starts_test"] = test_block(start, cols, "warm_starts")
  closed = [by_hop(list(rows.values())) for rows in
            rows_by_seed(outputs, "warm_start_seed*_closed_book.jsonl").values()]
  if closed:
    results["closed_book_test"] = {k: float(np.mean([c[k] for c in closed])) for _, k in HOPS}
  ref = rows_by_seed(outputs, f"{REFERENCE}_seed*_test_final.jsonl")
  for name, e in _entries(results):
    finals = rows_by_seed(outputs, f"{name}_seed*_test_final.jsonl")
    if finals:
      e.update(test_figures(name, finals, ref, start, cols))
  block = matched_rollouts_block(results, outputs)
  if block:
    results["recycling_at_matched_rollouts"] = block
  return results


def matched_rollouts_block(results: dict, outputs: str, name: str = "grpo") -> dict:
  """``name`` (plain GRPO, fewer rollouts a step) minus grpo_recycle on validation, at the largest
  number of rollouts both reached at an evaluation (grpo's RL step 20 against grpo_recycle's step
  10: 640 rollouts each), paired per question and warm-start from the per-question validation
  rows in ``outputs``: by hop key the mean, the two-way bootstrap interval (``ci95``), the
  t-interval over warm-starts and the wider (``verdict_interval``). {} when either run or its
  validation rows are missing."""
  entries = dict(_entries(results))
  if name not in entries or REFERENCE not in entries:
    return {}

  def steps(e):   # rollouts -> RL step, the same for every warm-start
    per = [{c["rollouts"]: c["rl_step"] for c in r["validation_curve"] if c["rollouts"]}
           for r in e["seeds"]]
    return {k: v for k, v in per[0].items() if all(p.get(k) == v for p in per)} if per else {}
  a, b = steps(entries[name]), steps(entries[REFERENCE])
  common = sorted(set(a) & set(b))
  if not common:
    return {}
  n = common[-1]
  ra = rows_by_seed(outputs, f"{name}_seed*_validation_rl{a[n]:02d}.jsonl")
  rb = rows_by_seed(outputs, f"{REFERENCE}_seed*_validation_rl{b[n]:02d}.jsonl")
  seeds = sorted(set(ra) & set(rb))
  if not seeds:
    return {}
  rows = ra[seeds[0]]
  out = {"setting": name, "rollouts": n, "rl_step": a[n], "rl_step_" + REFERENCE: b[n],
         "n_warm_starts": len(seeds), "questions": len(rows), "ci95": {}, "per_warm_start": {},
         "t_interval": {}, "verdict_interval": {}}
  for hops, key in HOPS:
    ids = sorted(i for i in rows if hops is None or rows[i]["hops"] == hops)
    d = em_matrix(ra, seeds, ids) - em_matrix(rb, seeds, ids)
    out[key], out["ci95"][key] = two_way_bootstrap(d, rng_for("matched_rollouts", name, key))
    out["per_warm_start"][key] = [float(x) for x in d.mean(1)]
    out["t_interval"][key] = t_interval(out["per_warm_start"][key])
    out["verdict_interval"][key] = wider(out["ci95"][key], out["t_interval"][key])
  return out


# --------------------------------------------------------------------------- versions
VERSION_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
KNOWN_VERSIONS = "versions_known.json"   # in OUT: what is known of runs that recorded nothing


def installed_versions() -> dict:
  """{"python": "3.11.7", "jax": "0.10.2", ...}: this interpreter's version and the installed
  version (as ``pip freeze`` gives it) of each of VERSION_PACKAGES; None for one not installed."""
  import platform  # pylint: disable=g-import-not-at-top
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  out = {"python": platform.python_version()}
  for name in VERSION_PACKAGES:
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  return out


def version_record() -> dict:
  """One line of RUNS/versions.jsonl, which run.sh appends at each (re)start of the grid
  (``collect.py --print-versions``): the UTC time, the checkout's commit and
  :func:`installed_versions`."""
  import datetime  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    commit = None
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
  return {"time": now, "commit": commit, **installed_versions()}


def versions_block(runs_dir: str, out_dir: str, old: dict | None = None) -> dict:
  """results.json's ``versions``: the package versions the figures were made with.

  ``runs``: the distinct version sets run.sh recorded in ``runs_dir/versions.jsonl`` at the
  grid's (re)starts, each with the times of the starts that ran it (``starts``), merged with
  those already in ``old`` (the previous results.json's, so that a lost runs directory keeps
  them); ``collect``: this process's (the bootstrap's numpy); ``known_before_recording``: the
  hand-written ``out_dir/versions_known.json``, where present (what notes say about runs that
  recorded nothing)."""
  groups = {}
  path = os.path.join(runs_dir, "versions.jsonl")
  for g in (old or {}).get("runs", []) + [
      {"versions": {k: r.get(k) for k in ("python", *VERSION_PACKAGES)}, "starts": [r["time"]]}
      for r in (read_jsonl(path) if os.path.exists(path) else [])]:
    key = json.dumps(g["versions"], sort_keys=True)
    groups.setdefault(key, {"versions": g["versions"], "starts": set()})["starts"].update(
        g["starts"])
  runs = [{"versions": g["versions"], "starts": sorted(g["starts"])} for g in groups.values()]
  out = {"runs": sorted(runs, key=lambda g: g["starts"][0]),
         "collect": installed_versions()}
  known = os.path.join(out_dir, KNOWN_VERSIONS)
  if os.path.exists(known):
    with open(known, encoding="utf-8") as f:
      out["known_before_recording"] = json.load(f)
  out["note"] = ("runs: the versions run.sh recorded at each (re)start of the grid "
                 "(RUNS/versions.jsonl; none where the grid ran before run.sh recorded them); "
                 "collect: the environment of the collect.py that wrote this file"
                 + ("; known_before_recording: what is known of earlier runs, by hand"
                    if os.path.exists(known) else ""))
  return out


def load_results(out_dir: str) -> dict | None:
  """``out_dir/results.json``, or None where there is none (or it does not parse)."""
  try:
    with open(os.path.join(out_dir, "results.json"), encoding="utf-8") as f:
      return json.load(f)
  except (FileNotFoundError, json.JSONDecodeError):
    return None


def write_all(results: dict, out_dir: str) -> None:
  """results.json (atomically: readers never see half), results.md, curves.png, forest.png."""
  tmp = os.path.join(out_dir, "results.json.tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  os.replace(tmp, os.path.join(out_dir, "results.json"))
  write_markdown(results, os.path.join(out_dir, "results.md"))
  plot_curves(results, os.path.join(out_dir, "curves.png"))
  plot_forest(results, os.path.join(out_dir, "forest.png"))


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--runs", default="runs/estimators")
  p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  p.add_argument("--command", default="bash docs/results/countries_smollm2_estimators/run.sh")
  p.add_argument("--pass-at-k-only", action="store_true",
                 help="rebuild only the pass@k figures of OUT/results.json, from OUT/outputs/ "
                      "and any pass@k evaluation finished under RUNS; every other figure stays")
  p.add_argument("--from-outputs", action="store_true",
                 help="rebuild every figure that rests on the test rows (test EM, paired "
                      "differences with their bootstrap and t-intervals, gains, pass@k) from "
                      "OUT/outputs/; validation curves and mechanisms stay as they are")
  p.add_argument("--print-versions", action="store_true",
                 help="print one JSON line: time, commit, python and the installed jax, jaxlib, "
                      "flax, optax, orbax-checkpoint, numpy (run.sh appends it to "
                      "RUNS/versions.jsonl at each start)")
  args = p.parse_args(argv)
  outputs = os.path.join(args.out, "outputs")
  if args.print_versions:
    print(json.dumps(version_record()))
    return 0
  if args.pass_at_k_only or args.from_outputs:
    flag = "--pass-at-k-only" if args.pass_at_k_only else "--from-outputs"
    if not os.path.exists(os.path.join(args.out, "results.json")):
      print(f"collect.py: {flag}: no results.json in {args.out}", file=sys.stderr)
      return 2
    if args.pass_at_k_only:
      results = rebuild_pass_at_k(args.runs, args.out)
    else:
      try:
        results = rebuild_from_outputs(args.runs, args.out)
      except FileNotFoundError as e:
        print(f"collect.py: --from-outputs: {e}", file=sys.stderr)
        return 2
    write_all(results, args.out)
    n = (results.get("pass_at_k_2hop", {}).get("n_warm_starts", 0) if args.pass_at_k_only
         else len(results.get("warm_starts", [])))
    print(f"rebuilt {'pass@k' if args.pass_at_k_only else 'the test figures'} from {n} "
          f"warm-start(s) -> {args.out}", file=sys.stderr)
    return 0
  os.makedirs(outputs, exist_ok=True)
  settings_sh = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.sh")).read()
  overrides = dict(re.findall(r'^\s+"([a-z_]+):([^"]+)"', settings_sh, re.M))
  overrides["sft_continued"] = ("train.sft_steps=50,train.num_steps=0,"
                                "train.sft_learning_rate=1e-5,train.sft_questions=<all train>")

  def save(name: str, rows: list[dict]) -> None:
    write_jsonl(os.path.join(outputs, name + ".jsonl"), rows)

  # warm-starts
  warm = {}
  for wdir in sorted(glob.glob(os.path.join(args.runs, "warm_start", "seed_*"))):
    s = int(wdir.rsplit("_", 1)[1])
    lines = [x for x in eval_lines(wdir) if x["step"] == SFT_STEPS]
    if not lines:
      continue
    w = {"seed": s, "validation_start": val_metrics(lines[-1])}
    vrows = os.path.join(wdir, "eval_outputs", f"step_{SFT_STEPS:06d}.jsonl")
    if os.path.exists(vrows):
      shutil.copy(vrows, os.path.join(outputs, f"warm_start_seed{s}_validation.jsonl"))
    for what, key in (("test_start", "test_start"), ("closed_book", "closed_book"),
                      ("passk_start", "pass_at_k_2hop_start")):
      files = glob.glob(os.path.join(wdir, what, "samples_*.jsonl"))
      if not files:
        continue
      rows = normalise_eval_rows(read_jsonl(files[0]))
      save(f"warm_start_seed{s}_{what}", rows)
      if what == "passk_start":
        w["passk_rows"] = {r["id"]: r for r in rows}
        res = json.load(open(os.path.join(wdir, what, "results.json")))["datasets"]
        w[key] = {k.split("@")[1]: v for k, v in next(iter(res.values())).items()
                  if k.startswith("eval/pass@")}
      else:
        w[key] = by_hop(rows)
        if what == "test_start":
          w["test_rows"] = {r["id"]: r for r in rows}
    warm[s] = w

  # RL settings and controls
  found: dict[str, dict[int, dict]] = {}
  for name in ORDER:
    for rdir in sorted(glob.glob(os.path.join(args.runs, "rl", name, "seed_*"))):
      s = int(rdir.rsplit("_", 1)[1])
      run = collect_run(rdir)
      if run is None:
        continue
      if s in warm and not any(c["rl_step"] == 0 for c in run["curve"]):
        # a control resumed from the warm-start's checkpoint has no eval line of its own at
        # its start: the warm-start's (same params, same questions)
        run["curve"].insert(0, {"rl_step": 0, "rollouts": 0, **warm[s]["validation_start"]})
      found.setdefault(name, {})[s] = run
      save(f"{name}_seed{s}_test_final", run["test"])
      for f in sorted(glob.glob(os.path.join(rdir, "eval_outputs", "step_*.jsonl"))):
        step = int(re.search(r"step_(\d+)", f).group(1)) - SFT_STEPS
        shutil.copy(f, os.path.join(outputs, f"{name}_seed{s}_validation_rl{step:02d}.jsonl"))
      pk = glob.glob(os.path.join(rdir, "passk_final", "samples_*.jsonl"))
      if pk:
        run["passk_rows"] = {r["id"]: r for r in normalise_eval_rows(read_jsonl(pk[0]))}
        save(f"{name}_seed{s}_passk_final", list(run["passk_rows"].values()))
        res = json.load(open(os.path.join(rdir, "passk_final", "results.json")))["datasets"]
        run["passk"] = {k.split("@")[1]: v for k, v in next(iter(res.values())).items()
                        if k.startswith("eval/pass@")}

  ids = sorted(next(iter(warm.values()))["test_rows"]) if warm and all(
      "test_rows" in w for w in warm.values()) else []
  cols = question_columns({s: w["test_rows"] for s, w in warm.items()}) if ids else {}

  results = {"validation_questions": 214, "test_questions": len(ids),
             "protocol": "docs/results/countries_smollm2_estimators/README.md",
             "warm_starts": [{k: v for k, v in w.items() if k not in ("test_rows", "passk_rows")}
                             for _, w in sorted(warm.items())],
             "settings": {}, "controls": {}, "missing": [], "command": args.command}
  commits = os.path.join(args.runs, "commits.txt")
  if os.path.exists(commits):          # the code each (re)start of run.sh ran
    results["commits"] = sorted(set(open(commits).read().split()))
  if ids:
    results["warm_starts_test"] = test_block({s: w["test_rows"] for s, w in warm.items()},
                                             cols, "warm_starts")
    closed = [w["closed_book"] for w in warm.values() if "closed_book" in w]
    results["closed_book_test"] = {k: float(np.mean([c[k] for c in closed]))
                                   for _, k in HOPS if closed}
  ref = {s: {r["id"]: r for r in run["test"]} for s, run in found.get(REFERENCE, {}).items()}
  for name in ORDER:
    runs = found.get(name, {})
    for s in warm:
      if s not in runs:
        results["missing"].append(f"{name}/seed_{s}")
    if not runs or not ids:
      continue
    finals = {s: {r["id"]: r for r in run["test"]} for s, run in runs.items()}
    entry = {"overrides": overrides.get(name, ""),
             "seeds": [{"seed": s,
                        "start": {k: v for k, v in warm[s].get("test_start", {}).items()
                                  if k.startswith("em")},
                        "final": {k: v for k, v in by_hop(run["test"]).items()
                                  if k.startswith("em")},
                        "validation_curve": run["curve"],
                        "rollouts_per_step": run["rollouts_per_step"],
                        **({"pass_at_k_2hop_final": run["passk"]} if "passk" in run else {})}
                       for s, run in sorted(runs.items())],
             **test_figures(name, finals, ref, {s: w["test_rows"] for s, w in warm.items()
                                                 if "test_rows" in w}, cols),
             "mechanisms": mechanisms(runs)}
    results["controls" if name in CONTROLS else "settings"][name] = entry
  block = pass_at_k_block(warm, found.get(REFERENCE, {}), ref)
  if block:
    results["pass_at_k_2hop"] = block
  block = matched_rollouts_block(results, outputs)
  if block:
    results["recycling_at_matched_rollouts"] = block
  previous = load_results(args.out)     # versions recorded before (a lost runs dir keeps them)
  results["versions"] = versions_block(args.runs, args.out,
                                       (previous or {}).get("versions"))
  write_all(results, args.out)
  done = sum(len(e["seeds"]) for part in ("settings", "controls")
             for e in results[part].values())
  print(f"collected {len(warm)} warm-starts and {done} runs ({len(results['missing'])} "
        f"missing) -> {args.out}", file=sys.stderr)
  return 0


def _ci(x: list[float]) -> str:
  return f"[{x[0]:+.3f}, {x[1]:+.3f}]"


def write_markdown(results: dict, path: str) -> None:
  lines = [f"# Estimator study: test EM ({results['test_questions']} questions, greedy), "
           "mean over warm-starts", ""]
  if results.get("warm_starts_test"):
    w = results["warm_starts_test"]
    cb = results.get("closed_book_test", {})
    lines += [f"Start of RL (the warm-starts, n = {w['n_warm_starts']}): EM {w['em']:.3f} "
              f"{_ci(w['ci95']['em'])}, 1-hop {w['em_1hop']:.3f}, 2-hop {w['em_2hop']:.3f}; "
              f"closed book (retriever returns nothing): EM {cb.get('em', float('nan')):.3f}, "
              f"1-hop {cb.get('em_1hop', float('nan')):.3f}, "
              f"2-hop {cb.get('em_2hop', float('nan')):.3f}.", ""]
  lines += ["| setting | warm-starts | EM [95% CI] | 1-hop | 2-hop [95% CI] | gain over the "
            "start, EM [95% CI] | paired 2-hop vs grpo_recycle [95% CI] | paired EM vs "
            "grpo_recycle | family-wise interval: paired EM, paired 2-hop (Bonferroni, "
            f"{FAMILY} intervals) |",
            "|---|---|---|---|---|---|---|---|---|"]
  for part in ("settings", "controls"):
    for name, e in results[part].items():
      t, pr = e["test"], e["paired_vs_grpo_recycle"]
      pair2 = f"{pr['em_2hop']:+.3f} {_ci(pr['ci95'])}" if pr else "(reference)"
      pair = f"{pr['em']:+.3f} {_ci(pr['ci95_em'])}" if pr else ""
      fam = (f"{_ci(pr['ci_family_em'])}, {_ci(pr['ci_family_em_2hop'])}"
             if pr and "ci_family_em" in pr else "")
      gain = e.get("gain_vs_start") or {}
      gain = f"{gain['em']:+.3f} {_ci(gain['ci95_em'])}" if gain else ""
      lines.append(f"| {name}{' (control)' if part == 'controls' else ''} | "
                   f"{t['n_warm_starts']} | {t['em']:.3f} {_ci(t['ci95']['em'])} | "
                   f"{t['em_1hop']:.3f} | {t['em_2hop']:.3f} {_ci(t['ci95']['em_2hop'])} | "
                   f"{gain} | {pair2} | {pair} | {fam} |")
  lines += t_interval_lines(results)
  mr = results.get("recycling_at_matched_rollouts")
  if mr:
    lines += ["", f"At matched rollouts ({mr['rollouts']} each), validation EM "
              f"({mr['questions']} questions, n = {mr['n_warm_starts']} warm-starts): "
              f"{mr['setting']} at RL step {mr['rl_step']} minus {REFERENCE} at RL step "
              f"{mr['rl_step_' + REFERENCE]}: " + "; ".join(
                  f"{label} {mr[key]:+.3f} {_ci(mr['ci95'][key])} (t over warm-starts "
                  f"{_ci_or_dash(mr['t_interval'][key])})"
                  for label, key in (("EM", "em"), ("1-hop", "em_1hop"), ("2-hop", "em_2hop")))
              + "."]
  pk = results.get("pass_at_k_2hop")
  if pk:
    has_t = "t_interval" in pk
    lines += ["", f"pass@k on the {pk['questions']} 2-hop test questions ({pk['samples']} samples "
              f"at temperature 1), start and end of {pk['setting']}, paired, "
              f"n = {pk['n_warm_starts']} warm-start(s):", "",
              "| k | start | end | end − start [95% CI] |"
              + (" t-interval over warm-starts [95%] |" if has_t else ""),
              "|---|---|---|---|" + ("---|" if has_t else "")]
    for k in pk["diff"]:
      lines.append(f"| {k} | {pk['start'][k]:.3f} | {pk['final'][k]:.3f} | "
                   f"{pk['diff'][k]:+.3f} {_ci(pk['ci95'][k])} |"
                   + (f" {_ci_or_dash(pk['t_interval'][k])} |" if has_t else ""))
    if "greedy_final_em_2hop" in pk:
      lines += ["", "Greedy EM at the end on the same questions: "
                f"{pk['greedy_final_em_2hop']:.3f}."]
  lines += (per_warm_start_lines(results) + first_warm_starts_lines(results)
            + mechanism_lines(results))
  if results["missing"]:
    lines += ["", "Not finished yet: " + ", ".join(results["missing"]) + "."]
  lines += ["", f"Command: `{results['command']}`", ""]
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines))


def _ci_or_dash(x: list[float] | None) -> str:
  return _ci(x) if x else "–"


def t_interval_lines(results: dict) -> list[str]:
  """Markdown: every paired difference from grpo_recycle, and every gain over the start, with
  both intervals: the two-way bootstrap and the t-interval over the warm-starts' means (n - 1
  degrees of freedom). The wider, the one a verdict is read from, is in bold."""
  rows = [(n, e) for n, e in _entries(results)
          if "t_interval" in (e.get("paired_vs_grpo_recycle") or e.get("gain_vs_start") or {})]
  if not rows:
    return []

  def both(pr, key, boot_key):
    if not pr:
      return "", ""
    boot, t = pr[boot_key], pr["t_interval"][key]
    b, tt = _ci(boot), _ci_or_dash(t)
    if pr["verdict_interval"][key] == list(boot):
      b = f"**{b}**"
    else:
      tt = f"**{tt}**"
    return f"{pr[key]:+.3f} {b}", tt

  def per(pr, key):
    return " / ".join(f"{x:+.3f}" for x in pr["per_warm_start"][key]) if pr else ""
  lines = ["", "Every paired difference with both intervals: the two-way bootstrap (95%) and the "
           "t-interval over the warm-starts' means (95%, Student t with n − 1 degrees of freedom: "
           "2 for n = 3). The wider, in bold, is the one a verdict is read from "
           "(`verdict_interval` in results.json).", "",
           "| setting | n | paired EM vs grpo_recycle [bootstrap] | t-interval | by warm-start | "
           "paired 1-hop [bootstrap] | t-interval | paired 2-hop [bootstrap] | t-interval | "
           "by warm-start | gain over the start, EM [bootstrap] | t-interval |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, e in rows:
    pr, gain = e.get("paired_vs_grpo_recycle") or {}, e.get("gain_vs_start") or {}
    n = (pr or gain)["n_warm_starts"]
    cells = [*both(pr, "em", "ci95_em"), per(pr, "em"), *both(pr, "em_1hop", "ci95_em_1hop"),
             *both(pr, "em_2hop", "ci95"), per(pr, "em_2hop"), *both(gain, "em", "ci95_em")]
    if not pr:
      cells[0] = "(reference)"
    lines.append(f"| {name}{' (control)' if name in CONTROLS else ''} | {n} | "
                 + " | ".join(cells) + " |")
  return lines


def per_warm_start_lines(results: dict) -> list[str]:
  """Markdown: each setting's final test EM (2-hop) from each warm-start, beside the start."""
  seeds = [w["seed"] for w in results["warm_starts"]]
  if not seeds or not (results["settings"] or results["controls"]):
    return []

  def cell(x):
    return f"{x['em']:.3f} ({x['em_2hop']:.3f})" if x else "–"
  lines = ["", "Test EM (2-hop EM) of each run, by warm-start:", "",
           "| setting | " + " | ".join(f"warm-start {s}" for s in seeds) + " |",
           "|---|" + "---|" * len(seeds),
           "| start | " + " | ".join(cell(w.get("test_start")) for w in results["warm_starts"])
           + " |"]
  for name, e in _entries(results):
    final = {r["seed"]: r["final"] for r in e["seeds"]}
    lines.append(f"| {name} | " + " | ".join(cell(final.get(s)) for s in seeds) + " |")
  return lines


def first_warm_starts_lines(results: dict) -> list[str]:
  """Markdown: each paired EM difference from grpo_recycle over the first 1, 2, ... warm-starts
  (with 1, its interval covers question sampling only)."""
  rows = [(n, e["paired_first_warm_starts"]) for n, e in _entries(results)
          if e.get("paired_first_warm_starts")]
  if not rows:
    return []
  most = max(len(r) for _, r in rows)
  lines = ["", "Paired EM vs grpo_recycle [95% CI] over the first n warm-starts (n = 1: the "
           "interval covers question sampling only):", "",
           "| setting | " + " | ".join(f"n = {k}" for k in range(1, most + 1)) + " |",
           "|---|" + "---|" * most]
  for name, r in rows:
    cells = [f"{x['em']:+.3f} {_ci(x['ci95_em'])}" for x in r] + ["–"] * (most - len(r))
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return lines


def mechanism_lines(results: dict) -> list[str]:
  """Markdown: the logged mechanisms (means over RL steps and warm-starts; late = the last 5
  steps), test searches per question, and validation EM at RL steps 15 and 20 (mean over
  warm-starts), which says whether 20 steps sit on a plateau."""
  if not (results["settings"] or results["controls"]):
    return []

  def f(m, key, d=2):
    v = m.get(key)
    return f"{v:.{d}f}" if isinstance(v, (int, float)) and np.isfinite(v) else "–"

  def val(e, step):
    v = [p["em"] for r in e["seeds"] for p in r["validation_curve"] if p["rl_step"] == step]
    return f"{np.mean(v):.3f}" if len(v) == len(e["seeds"]) else "–"
  lines = ["", "Mechanisms (mean over RL steps and warm-starts; late: the last 5 steps), test "
           "searches per question, and validation EM at RL step 15 and 20:", "",
           "| setting | zero-variance groups | recycled share (late) | anchor groups per valid "
           "step | cross-stratum term (late) | HA-DW φ hard / easy | train reward (late) | "
           "searches 1-hop / 2-hop | validation EM, step 15 → 20 |",
           "|---|---|---|---|---|---|---|---|---|"]
  for name, e in _entries(results):
    m = e["mechanisms"]
    lines.append(
        f"| {name} | {f(m, 'zero_variance_frac')} | {f(m, 'recycled_frac')} "
        f"({f(m, 'recycled_frac_late')}) | {f(m, 'gigpo_anchor_group_frac')} | "
        f"{f(m, 'cross_stratum_bias')} ({f(m, 'cross_stratum_bias_late')}) | "
        f"{f(m, 'hadw_phi_hard')} / {f(m, 'hadw_phi_easy')} | {f(m, 'train_reward')} "
        f"({f(m, 'train_reward_late')}) | {f(m, 'test_searches_1hop')} / "
        f"{f(m, 'test_searches_2hop')} | {val(e, 15)} → {val(e, 20)} |")
  return lines


def _entries(results: dict):
  for part in ("settings", "controls"):
    yield from results[part].items()


def plot_curves(results: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), sharey="col")
  for name, e in _entries(results):
    for row, xkey in enumerate(("rl_step", "rollouts")):
      if xkey == "rollouts" and not e["seeds"][0]["rollouts_per_step"]:
        continue                        # continued SFT generates no rollouts
      for col, (_, key) in enumerate(HOPS):
        curves = [{c[xkey]: c[key] for c in s["validation_curve"]} for s in e["seeds"]]
        xs = sorted(set.intersection(*(set(c) for c in curves)))
        if not xs:
          continue
        ys = np.array([[c[x] for x in xs] for c in curves])
        mean = ys.mean(0)
        ax = axes[row, col]
        line, = ax.plot(xs, mean, marker="o", ms=3, label=f"{name} (n={len(curves)})",
                        ls="--" if name in CONTROLS else "-")
        if len(curves) > 1:
          half = ys.std(0, ddof=1) / np.sqrt(len(curves))
          ax.fill_between(xs, mean - half, mean + half, color=line.get_color(), alpha=0.15)
  titles = {"em": "all 214", "em_1hop": "the 132 1-hop", "em_2hop": "the 82 2-hop"}
  for col, (_, key) in enumerate(HOPS):
    axes[0, col].set_title(f"validation EM, {titles[key]} questions")
    axes[0, col].set_xlabel("updates after the warm-start (RL steps / SFT steps)")
    axes[1, col].set_xlabel("rollouts generated")
  for ax in axes.flat:
    ax.grid(alpha=0.3)
  axes[0, 0].set_ylabel("EM (mean over warm-starts, band ±1 s.e.)")
  axes[1, 0].set_ylabel("EM")
  handles, labels = axes[0, 0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=4)
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_forest(results: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top
  rows = [(n, e) for n, e in _entries(results) if e["paired_vs_grpo_recycle"]]
  fig, axes = plt.subplots(1, 3, figsize=(14, 1.6 + 0.6 * max(len(rows), 1)), sharey=True)
  for col, (_, key) in enumerate(HOPS):
    ax = axes[col]
    for i, (name, e) in enumerate(rows):
      pr = e["paired_vs_grpo_recycle"]
      ci = pr["ci95" if key == "em_2hop" else f"ci95_{key}"]
      color = "C0" if name not in CONTROLS else "C3"
      if f"ci_family_{key}" in pr:      # the family-wise interval: thin, behind the 95% one
        ax.plot(pr[f"ci_family_{key}"], [i, i], color=color, lw=0.8, alpha=0.5,
                label="family-wise (Bonferroni, 14)" if i == 0 else None)
      ax.plot(ci, [i, i], color=color, lw=2, label="95%, bootstrap" if i == 0 else None)
      ax.plot([pr[key]], [i], "o", color=color)
      t = (pr.get("t_interval") or {}).get(key)
      if t:                             # the t-interval over warm-starts, just below
        ax.plot(t, [i + 0.25, i + 0.25], color=color, lw=1.2, ls="--",
                label="95%, t over warm-starts" if i == 0 else None)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_title({"em": "test EM", "em_1hop": "test EM, 1-hop",
                  "em_2hop": "test EM, 2-hop"}[key] + " minus grpo_recycle's")
    ax.grid(alpha=0.3, axis="x")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(6))   # no overlapping labels
  axes[0].set_yticks(range(len(rows)))
  axes[0].set_yticklabels([f"{n} (n={e['paired_vs_grpo_recycle']['n_warm_starts']})"
                           for n, e in rows])
  axes[0].invert_yaxis()
  if rows:                              # below the panels: inside, it hid a row's interval
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
  fig.tight_layout(rect=(0, 0.06 if rows else 0, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
