"""Collects the engaged estimator study's grid (run.sh in this folder; protocol: README.md, fixed
before the grid ran) into results.json (key ``engaged``), outputs/ (per-question rows of every
evaluation), curves.png and forest.png.

  python docs/results/countries_smollm2_engaged/collect.py --runs runs/engaged \
      [--out docs/results/countries_smollm2_engaged] [--command "..."]

Works on a partial grid: every cell of the pre-registered grid (5 warm-starts; 5 settings from
each; 2 controls from warm-starts 0-2) is reported as finished or, with how far it got, as
missing (``grid``, ``missing``); a statistic rests on the warm-starts whose runs have finished and
says how many (``n_warm_starts``) of the planned ones. Validation curves and mechanisms of runs
still in progress are reported beside the finished ones (``in_progress``), never mixed into a
setting's means. Other keys of an existing OUT/results.json are kept.

It reuses the first study's collector (docs/results/countries_smollm2_estimators/collect.py,
imported from its path) for the row schema, the two-way bootstrap, the t-interval over
warm-starts, the paired difference and the versions block. Errors a user can cause (no --runs
directory, a line of a jsonl file that is not JSON, test rows that miss questions) exit 2 with
one line naming the file (and line).

What each figure is computed from (greedy decoding everywhere; EM = exact match of the last
``<answer>``):

* test EM of a run: its ``test_final/samples_test.jsonl`` (gigrl-eval, all 469 test questions);
  ``grpo`` also at RL step N = 36 (``test_step36/``: matched updates), its final being step 2N =
  72 (matched rollouts). The start of RL: ``warm_start/seed_s/test_start/``. A run counts as
  finished once its evaluation's ``results.json`` exists (gigrl-eval writes it last).
* paired differences (``comparisons``): per warm-start and test question, setting a's EM minus
  setting b's on the same question from the same warm-start (rows matched by question id), over
  the warm-starts both have finished; by hop (``em``, ``em_1hop``, ``em_2hop``). Intervals: the
  two-way bootstrap (warm-starts and questions resampled independently, 4,000 replicates,
  percentile) and the t-interval over the warm-starts' paired means (df = n - 1), at 95%
  (``ci95_em``, ``ci95_em_1hop``, ``ci95`` for 2-hop, ``t_interval``; the first study's names) and,
  for the 4 primary comparisons, at the Bonferroni level 1 - 0.05/4 = 98.75% (``ci_family_*``,
  ``t_interval_family``). The verdict is read from the wider of the two (``verdict_interval``,
  ``verdict_interval_family``): for a primary comparison's overall EM at 98.75%, for everything
  else (2-hop, matched updates, controls) at 95%, uncorrected, as the protocol says.
* verdicts (``verdict``): oriented so that a positive difference favours the claim, with the
  rules of notebooks/paper_claims.ipynb section 0: the interval's lower end above 0 -> "holds
  here"; its upper end below the paper's effect (below 0 for a claim with no number) -> "does not
  hold here"; otherwise "cannot tell at this power" (not "no effect"). The papers' effects are
  the first study's (its README and the notebook: Stratified GRPO +0.113, +0.145 on multi-hop;
  HA-DW +0.022). ``interim`` while fewer warm-starts than planned have finished.
* MDE (``mde``): mde.json of this folder (written by mde.py before the grid), unchanged.
* gain over the start (``gain_vs_start``): a run's final test EM minus its warm-start's
  start-of-RL test EM, paired per question, 95%.
* validation curves: the ``phase: "eval"`` lines of each run's metrics.jsonl (all 214 validation
  questions), RL step = run step - 30 (the warm-start's SFT steps; ``sft_matched``'s SFT updates
  count the same way), with the warm-start's own validation at RL step 0.
* mechanisms, from each RL run's metrics.jsonl (``phase: "rl"`` lines), per run, and for a
  setting the mean over its finished runs:
  - ``recycled_share_accepted`` (and ``_last_third``: RL steps after 2/3 of the run's planned
    steps, 25-36; ``grpo`` 49-72): recycled queries among accepted groups, accepted-weighted,
    i.e. sum(pool/recycled_frac x pool/accepted) / sum(pool/accepted), so that a step that
    accepts nothing (it logs recycled_frac 0) weighs 0 (README, the pilot's table);
    ``accepted_per_step``, ``active_pool_end`` (pool/size at the last logged step);
  - ``zero_variance_frac``: mean over steps of the candidate groups with no reward variance;
  - ``strata_per_group``: mean of ``strat/strata_per_group`` (distinct search counts among a
    trained group's rollouts) over the steps that trained a group; ``cross_stratum_bias`` (and
    ``_last_third``): mean of ``strat/cross_stratum_bias``;
  - ``hadw_phi_hard`` / ``hadw_phi_easy``: means of ``hadw/phi_hard`` / ``hadw/phi_easy`` over RL
    steps >= 10, where HA-DW's 10-step window is full (the trainer pushes one value a step; the
    fill itself is not logged, so ``hadw_window_fill`` appears only if a run logs
    ``hadw/window_fill``);
  - ``pool_flips``: the sum over steps of ``pool/flips`` (signal-bearing candidates that were
    zero-variance at an earlier step); the logs do not say whether a flipped query was all-wrong
    or all-right before, so ``pool_flips_sampled`` splits the flips it can see in the rollout
    samples (samples/step_*.txt: the first candidate group, every 5 RL steps) into ``too_hard``
    (the question's earlier sampled group all wrong) and ``too_easy`` (all right), with how many
    groups and questions it saw: a small subsample, not the split of ``pool_flips``;
  - ``test_flips``: test questions whose greedy EM changed between the start of RL (the
    warm-start) and the end of the run: ``wrong_to_right`` (wrong at the start: the greedy
    counterpart of "too hard") and ``right_to_wrong`` (right at the start: "too easy"), overall
    and by hop; greedy rows are one answer per question, not a group;
  - ``test_searches_1hop`` / ``_2hop``: mean searches on the test questions at the end.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIRST_COLLECT = os.path.join(HERE, "..", "countries_smollm2_estimators", "collect.py")


def _load_first():
  spec = importlib.util.spec_from_file_location("countries_smollm2_estimators_collect",
                                                FIRST_COLLECT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


first = _load_first()   # the first study's collector: schema, bootstrap, t-interval, versions

SETTINGS = ("grpo_filter", "grpo_recycle", "grpo", "stratified", "hadw")
CONTROLS = ("rft_filter", "sft_matched")
SEEDS = (0, 1, 2, 3, 4)          # the protocol's warm-starts
CONTROL_SEEDS = (0, 1, 2)
N_STEPS = 36                     # RL steps N of the k = 2 settings; grpo runs 2N
SFT_STEPS = first.SFT_STEPS      # the warm-start's SFT steps: RL step r is run step 30 + r
PLANNED_STEPS = {"grpo": 2 * N_STEPS}
# rollouts per RL step (16 candidate prompts x 4; grpo 8 x 4; continued SFT none), used where a
# run's checkpoints (which hold its config) were deleted after its test evaluation
ROLLOUTS_PER_STEP = {"grpo": 32, "sft_matched": 0}
DEFAULT_ROLLOUTS = 64
GROUP_SIZE = 4
HOPS = first.HOPS
ALPHA = 0.05
FAMILY = 4                       # primary comparisons: Bonferroni over these
ALPHA_FAMILY = ALPHA / FAMILY
HADW_WINDOW = 10
VALIDATION_QUESTIONS = 214
PROTOCOL = "docs/results/countries_smollm2_engaged/README.md"
COMPARED = ("greedy test EM of {a} minus greedy test EM of {b} on the same test question from "
            "the same warm-start, averaged over the questions and the warm-starts both finished")

# The papers' effects (EM units), as the first study used them (its README, "Each technique";
# notebooks/paper_claims.ipynb, CLAIMS). None: the claim has no number for this comparison, so
# its effect is any gain and "does not hold here" needs the whole interval below 0.
COMPARISONS = (
    dict(label="grpo_recycle - grpo_filter", a="grpo_recycle", b="grpo_filter", primary=True,
         what="reuse against the filter alone: the recycling question",
         paper=None, paper_2hop=None, sign=+1,
         paper_source="query recycling (arXiv 2606.10709) reports +1.1 Pass@1 points over "
                      "standard GRPO, not over the variance filter; no number for this "
                      "comparison"),
    dict(label="grpo_filter - grpo", a="grpo_filter", b="grpo", b_test="test_final",
         primary=True, what="the variance filter (DAPO's dynamic sampling) at matched rollouts "
                            "(grpo's RL step 2N = 72)",
         paper=None, paper_2hop=None, sign=+1,
         paper_source="no number for the filter alone in the sources the first study read"),
    dict(label="stratified - grpo_recycle", a="stratified", b="grpo_recycle", primary=True,
         what="Stratified GRPO (with recycling)", paper=0.113, paper_2hop=0.145, sign=+1,
         paper_source="Stratified GRPO (arXiv 2510.06214): up to +11.3 EM points over GRPO, "
                      "+14.5 on multi-hop"),
    dict(label="hadw - grpo_recycle", a="hadw", b="grpo_recycle", primary=True,
         what="HA-DW (with recycling)", paper=0.022, paper_2hop=None, sign=+1,
         paper_source="HA-DW (arXiv 2601.08521): +2.2 points over GRPO on math"),
    dict(label="grpo_filter - grpo (matched updates)", a="grpo_filter", b="grpo",
         b_test=f"test_step{N_STEPS}", primary=False, mde_label="grpo_filter - grpo",
         what=f"the variance filter at matched updates (grpo's RL step N = {N_STEPS}); for the "
              "other primary comparisons matched updates are matched rollouts",
         paper=None, paper_2hop=None, sign=+1,
         paper_source="no number for the filter alone in the sources the first study read"),
    dict(label="rft_filter - grpo_filter", a="rft_filter", b="grpo_filter", primary=False,
         what="control: rejection-sampling fine-tuning with grpo_filter's candidates and filter",
         paper=None, paper_2hop=None, sign=-1,
         paper_source="the claim that RL beats RFT has no number: oriented as grpo_filter "
                      "minus rft_filter"),
    dict(label="sft_matched - grpo_filter", a="sft_matched", b="grpo_filter", primary=False,
         what="control: N further SFT updates on the same RL pool's demonstrations",
         paper=None, paper_2hop=None, sign=-1,
         paper_source="the claim that RL beats further SFT has no number: oriented as "
                      "grpo_filter minus sft_matched"),
)


class CollectError(Exception):
  """A problem with the inputs that the user can fix; main prints it as one line, exit 2."""


# ------------------------------------------------------------------------------ reading
def read_jsonl(path: str, torn_tail_ok: bool = False) -> list[dict]:
  """The JSON objects of ``path``, one a line (blank lines skipped). Raises CollectError naming
  the file and line for a line that is not a JSON object; with ``torn_tail_ok`` a last line
  without its newline that does not parse is dropped (a trainer killed mid-write, as gigrl's
  ``read_metrics`` does)."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.readlines()
  except (OSError, UnicodeDecodeError) as e:
    raise CollectError(f"{path}: cannot read ({e})") from None
  rows = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      if torn_tail_ok and n == len(lines) and not line.endswith("\n"):
        break
      raise CollectError(f"{path}: line {n}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
      raise CollectError(f"{path}: line {n}: not a JSON object")
    rows.append(row)
  return rows


def read_metrics(run: str) -> list[dict]:
  """The lines of ``run/metrics.jsonl`` ([] when there is none; a torn last line dropped)."""
  path = os.path.join(run, "metrics.jsonl")
  return read_jsonl(path, torn_tail_ok=True) if os.path.exists(path) else []


def read_eval_rows(path: str) -> list[dict]:
  """gigrl-eval's ``samples_<set>.jsonl`` as the first study's per-question rows
  (``normalise_eval_rows``); CollectError naming the line of a row that lacks a field."""
  out = []
  for n, row in enumerate(read_jsonl(path), 1):
    try:
      out += first.normalise_eval_rows([row])
    except (KeyError, IndexError, TypeError) as e:
      raise CollectError(f"{path}: row {n}: not an evaluation row (missing {e})") from None
  return out


def finished_eval(run: str, what: str) -> str | None:
  """``run/what/samples_test.jsonl`` once its evaluation has finished (gigrl-eval writes
  ``results.json`` after the samples), else None."""
  samples = os.path.join(run, what, "samples_test.jsonl")
  if os.path.exists(samples) and os.path.exists(os.path.join(run, what, "results.json")):
    return samples
  return None


def validation_curve(lines: list[dict], rollouts_per_step: int) -> list[dict]:
  """The first study's ``validation_curve`` points from metrics lines: one per ``phase: "eval"``
  line after the warm-start (RL step = step - 30)."""
  out = []
  for line in lines:
    if line.get("phase") == "eval" and line.get("step", 0) > SFT_STEPS and "eval/em" in line:
      r = line["step"] - SFT_STEPS
      out.append({"rl_step": r, "rollouts": r * rollouts_per_step, **first.val_metrics(line)})
  return out


# --------------------------------------------------------------------------- mechanisms
def _num(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)


def accepted_weighted_share(rl: list[dict]) -> float | None:
  """sum(pool/recycled_frac x pool/accepted) / sum(pool/accepted) over the RL lines ``rl``:
  the recycled share of the accepted groups (None when none was accepted or nothing logged)."""
  pairs = [(r["pool/recycled_frac"], r["pool/accepted"]) for r in rl
           if _num(r.get("pool/recycled_frac")) and _num(r.get("pool/accepted"))]
  acc = sum(a for _, a in pairs)
  return float(sum(f * a for f, a in pairs) / acc) if acc > 0 else None


def _mean(rows: list[dict], key: str) -> float | None:
  vals = [r[key] for r in rows if _num(r.get(key))]
  return float(np.mean(vals)) if vals else None


def parse_samples(path: str) -> list[tuple[str, list[float]]]:
  """The groups of a trainer's rollout samples file (samples/step_*.txt): [(question, rewards
  of its rollouts)], consecutive trajectories of one question forming a group."""
  groups: list[tuple[str, list[float]]] = []
  reward = None
  with open(path, encoding="utf-8") as f:
    for line in f:
      m = re.match(r"===== trajectory \d+ \| reward ([-\d.]+) \|", line)
      if m:
        reward = float(m.group(1))
      elif line.startswith("question: ") and reward is not None:
        q = line[len("question: "):].rstrip("\n")
        if groups and groups[-1][0] == q:
          groups[-1][1].append(reward)
        else:
          groups.append((q, [reward]))
        reward = None
  return groups


def sampled_flips(run: str, group_size: int = GROUP_SIZE) -> dict:
  """Flips from zero variance to signal seen in the rollout samples of ``run``: a question whose
  earlier sampled group (``group_size`` rollouts, success = reward >= 1) was all wrong
  (``too_hard``) or all right (``too_easy``) and a later one mixed. With the groups sampled
  (``groups``) and the questions sampled more than once (``questions_sampled_twice``)."""
  files = sorted(glob.glob(os.path.join(run, "samples", "step_*.txt")),
                 key=lambda p: int(re.search(r"step_(\d+)", p).group(1)))
  history: dict[str, list[int]] = {}
  groups = 0
  for path in files:
    for q, rewards in parse_samples(path):
      if len(rewards) != group_size:
        continue
      groups += 1
      history.setdefault(q, []).append(sum(r >= 1.0 for r in rewards))
  out = {"groups": groups, "questions_sampled_twice": sum(len(h) > 1 for h in history.values()),
         "too_hard": 0, "too_easy": 0}
  for h in history.values():
    for i, c in enumerate(h):
      if 0 < c < group_size:
        before = h[:i]
        if 0 in before:
          out["too_hard"] += 1
        elif group_size in before:
          out["too_easy"] += 1
        break   # a query with signal is consumed: its first signal group is the flip
  return out


def test_flips(start: dict[str, dict], final: dict[str, dict]) -> dict:
  """Test questions whose greedy EM changed from ``start`` to ``final`` (rows by id):
  ``wrong_to_right`` and ``right_to_wrong``, overall and by hop (``_1hop``, ``_2hop``)."""
  out = {}
  for hops, key in HOPS:
    ids = [i for i in final if i in start and (hops is None or final[i]["hops"] == hops)]
    suffix = key[2:]
    out["wrong_to_right" + suffix] = sum(start[i]["em"] <= 0 < final[i]["em"] for i in ids)
    out["right_to_wrong" + suffix] = sum(final[i]["em"] <= 0 < start[i]["em"] for i in ids)
  return out


def run_mechanisms(lines: list[dict], planned_steps: int) -> dict:
  """The mechanisms of one run from its metrics lines (see the module docstring)."""
  rl = [r for r in lines if r.get("phase") == "rl"]
  if not rl:
    return {}
  last = [r for r in rl if r["step"] - SFT_STEPS > planned_steps - planned_steps // 3]
  trained = [r for r in rl if _num(r.get("trained_groups")) and r["trained_groups"] > 0]
  full = [r for r in rl if r["step"] - SFT_STEPS >= HADW_WINDOW]
  out = {"rl_steps": len(rl),
         "recycled_share_accepted": accepted_weighted_share(rl),
         "recycled_share_accepted_last_third": accepted_weighted_share(last) if last else None,
         "accepted_per_step": _mean(rl, "pool/accepted"),
         "active_pool_end": rl[-1].get("pool/size"),
         "zero_variance_frac": _mean(rl, "zero_variance_frac"),
         "pool_flips": float(sum(r["pool/flips"] for r in rl if _num(r.get("pool/flips")))),
         "strata_per_group": _mean(trained, "strat/strata_per_group"),
         "cross_stratum_bias": _mean(rl, "strat/cross_stratum_bias"),
         "cross_stratum_bias_last_third": _mean(last, "strat/cross_stratum_bias"),
         "search_calls_mean": _mean(rl, "search_calls_mean"),
         "train_reward": _mean(rl, "reward_mean")}
  if any("hadw/phi_hard" in r for r in rl):
    out.update(hadw_phi_hard=_mean(full, "hadw/phi_hard"),
               hadw_phi_easy=_mean(full, "hadw/phi_easy"))
  if any("hadw/window_fill" in r for r in rl):
    out["hadw_window_fill"] = rl[-1].get("hadw/window_fill")
  return out


def mean_mechanisms(per_run: list[dict]) -> dict:
  """Each numeric mechanism's mean over the runs that have it (dicts of numbers; nested
  dicts, such as the flips, averaged key by key), with ``n_runs``."""
  out = {"n_runs": len(per_run)}
  keys = sorted({k for m in per_run for k in m})
  for k in keys:
    vals = [m[k] for m in per_run if k in m]
    if all(isinstance(v, dict) for v in vals):
      out[k] = mean_mechanisms(vals)
      del out[k]["n_runs"]
    else:
      nums = [v for v in vals if _num(v)]
      if nums:
        out[k] = float(np.mean(nums))
  return out


# -------------------------------------------------------------------------------- grid
def committed_rows(outputs: str, stem: str) -> tuple[list[dict] | None, str]:
  """(rows of the committed ``outputs/<stem>.jsonl``, or None when there is none; its path)."""
  path = os.path.join(outputs, stem + ".jsonl")
  return (read_jsonl(path) if os.path.exists(path) else None), path


def collect_warm_start(wdir: str, s: int, outputs: str, prev: dict | None = None
                       ) -> tuple[dict | None, str]:
  """Warm-start ``s``: (its record, or None before its SFT and validation are done; status).

  The record is the first study's ``warm_starts`` entry (``seed``, ``validation_start``,
  ``test_start``) with ``test_rows`` (id -> row) once its start-of-RL test evaluation has
  finished; copies its validation and test rows to ``outputs``. The machine the grid runs on can
  be replaced between sessions, and ``runs/`` with it; what is committed survives. So a
  warm-start whose directory is gone is rebuilt from ``prev`` (its entry in the committed
  results.json) and its committed test rows (``from_committed``), and so is one whose directory
  holds a remake not yet validated (run.sh remakes a warm-start just before its runs); run.sh,
  which skips a test evaluation whose rows are committed, is matched here by reading those
  rows."""
  committed, cpath = committed_rows(outputs, f"warm_start_seed{s}_test_start")
  kept = None if not (prev and committed is not None) else {
      "seed": s, "validation_start": prev["validation_start"],
      "test_start": first.by_hop(committed), "test_rows": {r["id"]: r for r in committed},
      "test_path": cpath, "from_committed": True}
  if not os.path.isdir(wdir):
    return (kept, "finished") if kept else (None, "not started")
  lines = read_metrics(wdir)
  val = [x for x in lines if x.get("phase") == "eval" and x.get("step") == SFT_STEPS
         and "eval/em" in x]
  if not val:
    done = max([x["step"] for x in lines if x.get("phase") == "sft"], default=0)
    if kept:   # being remade (run.sh remakes a warm-start before its runs): the committed one
      return kept, "finished"
    if done >= SFT_STEPS:
      return None, "SFT done; its validation running or pending"
    return None, f"SFT running or stopped: step {done} of {SFT_STEPS} logged"
  w = {"seed": s, "validation_start": first.val_metrics(val[-1])}
  vrows = os.path.join(wdir, "eval_outputs", f"step_{SFT_STEPS:06d}.jsonl")
  if os.path.exists(vrows):
    read_jsonl(vrows)
    shutil.copy(vrows, os.path.join(outputs, f"warm_start_seed{s}_validation.jsonl"))
  samples = finished_eval(wdir, "test_start")
  if samples is None:
    if committed is None:
      return w, "SFT done; start-of-RL test evaluation pending"
    rows, samples = committed, cpath
  else:
    rows = read_eval_rows(samples)
    first.write_jsonl(cpath, rows)
  w["test_start"] = first.by_hop(rows)
  w["test_rows"] = {r["id"]: r for r in rows}
  w["test_path"] = samples
  return w, "finished"


TEST_DERIVED = ("test_flips", "test_searches_1hop", "test_searches_2hop")


def collect_rl_run(rdir: str, name: str, s: int, warm: dict | None, outputs: str,
                   prev: dict | None = None) -> tuple[dict | None, str]:
  """RL run (or control) ``name`` from warm-start ``s``: (its record, or None when it has
  not started; status). The record holds ``curve`` (validation, the warm-start's at RL step 0),
  ``mechanisms``, and, once evaluated, ``test`` (rows of test_final) and for
  grpo ``test_step36``; copies its validation and test rows and its metrics.jsonl
  (``<name>_seed<s>_metrics.jsonl``) to ``outputs``. A finished run whose directory is gone
  (a replaced machine) is rebuilt from ``prev`` (its seed or in-progress entry in the committed
  results.json: curve and mechanisms) and its committed test rows (``from_committed``; an
  unfinished one stays in progress with the test rows it had, e.g. grpo's step 36); a test evaluation
  run.sh skipped because its rows are committed is read from them."""
  rps = ROLLOUTS_PER_STEP.get(name, DEFAULT_ROLLOUTS)
  planned = PLANNED_STEPS.get(name, N_STEPS)
  committed = {what: committed_rows(outputs, f"{name}_seed{s}_{what}")
               for what in ("test_final", f"test_step{N_STEPS}")}
  if not os.path.isdir(rdir):
    if prev is None or not any(r is not None for r, _ in committed.values()):
      return None, "not started"
    run = {"curve": prev["validation_curve"], "rollouts_per_step": prev["rollouts_per_step"],
           "planned_steps": planned, "from_committed": True,
           "mechanisms": {k: v for k, v in prev["mechanisms"].items() if k not in TEST_DERIVED}}
    for what, key in (("test_final", "test"), (f"test_step{N_STEPS}", f"test_step{N_STEPS}")):
      rows, path = committed[what]
      if rows is not None and (what == "test_final" or name == "grpo"):
        run[key], run[key + "_path"] = rows, path
    if "test" in run:
      return run, "finished"
    gone = "its directory is gone (a replaced machine); before: "
    return run, gone + prev["status"].removeprefix(gone)
  lines = read_metrics(rdir)
  if lines:
    shutil.copy(os.path.join(rdir, "metrics.jsonl"),
                os.path.join(outputs, f"{name}_seed{s}_metrics.jsonl"))
  curve = validation_curve(lines, rps)
  if warm and not any(c["rl_step"] == 0 for c in curve):
    curve.insert(0, {"rl_step": 0, "rollouts": 0, **warm["validation_start"]})
  run = {"curve": curve, "rollouts_per_step": rps, "planned_steps": planned,
         "mechanisms": run_mechanisms(lines, planned)}
  if run["mechanisms"]:
    run["mechanisms"]["flips"] = sampled_flips(rdir)
  for f in sorted(glob.glob(os.path.join(rdir, "eval_outputs", "step_*.jsonl"))):
    step = int(re.search(r"step_(\d+)", os.path.basename(f)).group(1)) - SFT_STEPS
    if step > 0:
      read_jsonl(f)
      shutil.copy(f, os.path.join(outputs, f"{name}_seed{s}_validation_rl{step:02d}.jsonl"))
  for what, key in (("test_final", "test"), (f"test_step{N_STEPS}", f"test_step{N_STEPS}")):
    if what != "test_final" and name != "grpo":
      continue
    samples = finished_eval(rdir, what)
    if samples:
      run[key] = read_eval_rows(samples)
      run[key + "_path"] = samples
      first.write_jsonl(committed[what][1], run[key])
    elif committed[what][0] is not None:
      run[key], run[key + "_path"] = committed[what]
  if "test" in run:
    return run, "finished"
  phase = "sft" if name == "sft_matched" else "rl"
  done = max([x["step"] - SFT_STEPS for x in lines if x.get("phase") == phase], default=0)
  unit = "SFT update" if phase == "sft" else "RL step"
  return run, f"running or stopped: {unit} {done} of {planned} logged, no test evaluation yet"


def check_ids(run_rows: list[dict], ids: list[str], path: str) -> None:
  """CollectError naming ``path`` when its rows miss some of the test questions ``ids``."""
  have = {r["id"] for r in run_rows}
  miss = [i for i in ids if i not in have]
  if miss:
    raise CollectError(f"{path}: {len(miss)} of the {len(ids)} test questions missing "
                       f"(first: {miss[0]})")


# ------------------------------------------------------------------------- statistics
def paired_difference(a: dict[int, dict[str, dict]], b: dict[int, dict[str, dict]],
                      cols: dict[str, list[str]], label: str, family: bool) -> dict:
  """``a`` minus ``b`` (test rows by warm-start and id), paired per question within a warm-start,
  over the warm-starts both have: the first study's ``paired`` (95%: mean, ``ci95_em``,
  ``ci95_em_1hop``, ``ci95`` for 2-hop, ``warm_starts``, ``per_warm_start``, ``t_interval``,
  ``verdict_interval``), and with ``family`` the same two intervals at 1 - 0.05/4 (the same
  number of bootstrap replicates: ``ci_family_<key>``, ``t_interval_family``,
  ``verdict_interval_family``). {} when no warm-start has both."""
  out = first.paired(a, b, cols, label)
  if not out or not family:
    return out
  seeds = out["warm_starts"]
  t_fam, v_fam = {}, {}
  for _, key in HOPS:
    d = first.em_matrix(a, seeds, cols[key]) - first.em_matrix(b, seeds, cols[key])
    out[f"ci_family_{key}"] = first.two_way_bootstrap(
        d, first.rng_for("family", label, key), first.BOOT, ALPHA_FAMILY)[1]
    t_fam[key] = first.t_interval(out["per_warm_start"][key], ALPHA_FAMILY)
    v_fam[key] = first.wider(out[f"ci_family_{key}"], t_fam[key])
  out.update(t_interval_family=t_fam, verdict_interval_family=v_fam)
  return out


def verdict(d: float, interval: list[float], effect: float | None, sign: int = 1) -> str:
  """The verdict on a difference ``d`` with ``interval`` (the one a verdict is read from),
  oriented by ``sign`` so that positive favours the claim; ``effect`` the paper's (EM units;
  None: any gain). Rules of notebooks/paper_claims.ipynb section 0: lower end > 0 -> "holds
  here"; upper end < the paper's effect (< 0 with no number) -> "does not hold here: the
  interval excludes ..."; otherwise "cannot tell at this power"."""
  lo, hi = sorted(sign * x for x in interval)
  if lo > 0:
    out = "holds here"
    if effect is not None and hi < effect:
      out += f"; smaller than the paper's +{effect:.3f}"
    return out
  if effect is not None and hi < effect:
    out = f"does not hold here: the interval excludes the paper's +{effect:.3f}"
    return out + (" and 0 (it goes against the claim)" if hi < 0 else "")
  if hi < 0:
    return "does not hold here: the interval lies below 0 (it goes against the claim)"
  return "cannot tell at this power"


NO_VERDICT = ("no verdict: one warm-start gives no t-interval over warm-starts, and the verdict "
              "reads the wider of the two (the bootstrap alone leaves out warm-start variance)")


def _iv(x: list[float] | None) -> str:
  return f"[{x[0]:+.3f}, {x[1]:+.3f}]" if x else "(none: n = 1)"


def comparison_block(c: dict, finals: dict[str, dict[int, dict[str, dict]]],
                     cols: dict[str, list[str]], mde: dict, n_questions: int) -> dict:
  """One pre-registered comparison ``c`` (of COMPARISONS) from the finished runs' test rows
  ``finals[name][seed]`` (grpo's matched-updates rows under ``grpo@test_step36``): the paired
  difference (:func:`paired_difference`), its MDE row from mde.json, the paper's effect and the
  verdict sentences, which say what is compared and from which interval."""
  b_key = c["b"] + ("@" + c["b_test"] if c.get("b_test", "test_final") != "test_final" else "")
  planned = len(CONTROL_SEEDS) if c["a"] in CONTROLS or c["b"] in CONTROLS else len(SEEDS)
  out = {"a": c["a"], "b": c["b"], "b_evaluation": c.get("b_test", "test_final"),
         "primary": c["primary"], "what": c["what"],
         "compared": COMPARED.format(a=c["a"], b=c["b"]),
         "planned_warm_starts": planned,
         "paper": {"effect": c["paper"], "effect_2hop": c["paper_2hop"],
                   "orientation": ("a - b" if c["sign"] > 0 else "b - a")
                                  + " > 0 favours the claim",
                   "source": c["paper_source"]},
         "mde": next((v for k, v in mde.items()
                      if k.split(" (")[0] == c.get("mde_label", c["label"])), None)}
  pr = paired_difference(finals.get(c["a"], {}), finals.get(b_key, {}), cols, c["label"],
                         family=c["primary"])
  out["n_warm_starts"] = pr.get("n_warm_starts", 0)
  if not pr:
    return out
  out.update(pr)
  interim = (f"interim, {pr['n_warm_starts']} of {planned} warm-starts"
             if pr["n_warm_starts"] < planned else "")
  out["verdict"] = {}
  for key, effect, fam in (("em", c["paper"], c["primary"]),
                           ("em_2hop", c["paper_2hop"], False)):
    boot = pr[f"ci_family_{key}"] if fam else pr["ci95" if key == "em_2hop" else f"ci95_{key}"]
    t_iv = pr["t_interval_family"][key] if fam else pr["t_interval"][key]
    iv = pr["verdict_interval_family"][key] if fam else pr["verdict_interval"][key]
    level = f"{100 * (1 - ALPHA_FAMILY):.2f}% (Bonferroni over {FAMILY})" if fam else "95%"
    what = ("greedy test EM" if key == "em" else "greedy test EM on the 2-hop questions")
    q = n_questions if key == "em" else len(cols[key])
    text = (f"{c['label']}: {what} minus {what} on the same {q} questions from the same "
            f"warm-start, n = {pr['n_warm_starts']}: {pr[key]:+.3f}; {level} bootstrap "
            f"{_iv(boot)}, t over warm-starts {_iv(t_iv)}; " + (
                f"the wider {_iv(iv)} -> {verdict(pr[key], iv, effect, c['sign'])}" if t_iv
                else NO_VERDICT))
    out["verdict"][key] = (f"({interim}) " if interim else "") + text
  return out


# ---------------------------------------------------------------------------- collect
def overrides_from_run_sh(path: str) -> dict[str, str]:
  """{setting: its overrides} as run.sh passes them (``--config.`` dropped, comma-joined)."""
  text = open(path, encoding="utf-8").read().replace("\\\n", " ")
  out = {}
  for name, args in re.findall(r'^\s*rl (\w+) "\$s" ([^\n#]*)', text, re.M):
    parts = ["".join(a.split()).replace("$((", "").replace("))", "")
             for a in args.split("--config.")]
    out[name] = ",".join(a for a in parts if a)
  out["grpo"] = "data.pool.rule=grpo,data.pool.oversample=1,train.num_steps=2N"
  return out


def collect(runs: str, out_dir: str, command: str) -> dict:
  """Reads the grid under ``runs``, copies every evaluation's per-question rows to
  ``out_dir/outputs``, and returns results.json's ``engaged`` block (see the module
  docstring). Raises CollectError for inputs the user can fix."""
  if not os.path.isdir(runs):
    raise CollectError(f"--runs {runs}: no such directory")
  outputs = os.path.join(out_dir, "outputs")
  os.makedirs(outputs, exist_ok=True)
  previous = load_engaged(out_dir) or {}
  prev_warm = {w["seed"]: w for w in previous.get("warm_starts", [])}
  prev_runs = {(name, r["seed"]): r for part in ("settings", "controls")
               for name, e in previous.get(part, {}).items()
               for r in e.get("in_progress", []) + e.get("seeds", [])}
  grid: dict[str, dict[str, str]] = {"warm_start": {}}
  warm = {}
  rebuilt = []
  for s in SEEDS:
    w, status = collect_warm_start(os.path.join(runs, "warm_start", f"seed_{s}"), s, outputs,
                                   prev_warm.get(s))
    if w and w.pop("from_committed", False):
      rebuilt.append(f"warm_start/seed_{s}")
    grid["warm_start"][str(s)] = status
    if w:
      warm[s] = w
  found: dict[str, dict[int, dict]] = {}
  for name in SETTINGS + CONTROLS:
    grid[name] = {}
    for s in (CONTROL_SEEDS if name in CONTROLS else SEEDS):
      run, status = collect_rl_run(os.path.join(runs, "rl", name, f"seed_{s}"), name, s,
                                   warm.get(s), outputs, prev_runs.get((name, s)))
      if run and run.pop("from_committed", False):
        rebuilt.append(f"{name}/seed_{s}")
      grid[name][str(s)] = status
      if run:
        found.setdefault(name, {})[s] = run

  tested = {s: w for s, w in warm.items() if "test_rows" in w}
  cols = first.question_columns({s: w["test_rows"] for s, w in tested.items()}) if tested else {}
  ids = cols.get("em", [])
  for w in tested.values():
    check_ids(list(w["test_rows"].values()), ids, w["test_path"])
  finals: dict[str, dict[int, dict[str, dict]]] = {}
  for name, runs_ in found.items():
    for s, run in runs_.items():
      for key, fkey in (("test", name), (f"test_step{N_STEPS}", f"{name}@test_step{N_STEPS}")):
        if key in run and s in tested:
          check_ids(run[key], ids, run[key + "_path"])
          finals.setdefault(fkey, {})[s] = {r["id"]: r for r in run[key]}

  results = {"validation_questions": VALIDATION_QUESTIONS, "test_questions": len(ids),
             "protocol": PROTOCOL,
             "warm_starts": [{k: v for k, v in w.items() if k not in ("test_rows", "test_path")}
                             for _, w in sorted(warm.items())],
             "settings": {}, "controls": {}, "grid": grid,
             "missing": [f"{name}/seed_{s} ({status})" for name, cells in grid.items()
                         for s, status in cells.items() if status != "finished"],
             "from_committed": rebuilt,
             "command": command}
  commits = os.path.join(runs, "commits.txt")
  kept = set(previous.get("commits", []))   # earlier machines' runs/ may be gone
  if os.path.exists(commits):
    kept |= set(open(commits, encoding="utf-8").read().split())
  if kept:
    results["commits"] = sorted(kept)
  if tested:
    results["warm_starts_test"] = first.test_block(
        {s: w["test_rows"] for s, w in tested.items()}, cols, "warm_starts")
  overrides = overrides_from_run_sh(os.path.join(HERE, "run.sh"))
  start_rows = {s: w["test_rows"] for s, w in tested.items()}
  for name in SETTINGS + CONTROLS:
    runs_ = found.get(name, {})
    if not runs_:
      continue
    done = {s: r for s, r in runs_.items() if name in finals and s in finals[name]}
    seeds = []
    for s, run in sorted(done.items()):
      rec = {"seed": s,
             "start": {k: v for k, v in tested[s]["test_start"].items() if k.startswith("em")},
             "final": {k: v for k, v in first.by_hop(run["test"]).items() if k.startswith("em")},
             "validation_curve": run["curve"], "rollouts_per_step": run["rollouts_per_step"]}
      if f"test_step{N_STEPS}" in run:
        rec[f"final_step{N_STEPS}"] = {k: v for k, v in first.by_hop(
            run[f"test_step{N_STEPS}"]).items() if k.startswith("em")}
      mech = dict(run["mechanisms"])
      final_rows = finals[name][s]
      mech["test_flips"] = test_flips(tested[s]["test_rows"], final_rows)
      for hops in (1, 2):
        calls = [r["searches"] for r in final_rows.values() if r["hops"] == hops]
        mech[f"test_searches_{hops}hop"] = float(np.mean(calls)) if calls else None
      rec["mechanisms"] = mech
      seeds.append(rec)
    entry = {"overrides": overrides.get(name, ""), "planned_steps": PLANNED_STEPS.get(
        name, N_STEPS), "seeds": seeds,
             "in_progress": [{"seed": s, "status": grid[name][str(s)],
                              "validation_curve": run["curve"],
                              "rollouts_per_step": run["rollouts_per_step"],
                              "mechanisms": run["mechanisms"]}
                             for s, run in sorted(runs_.items()) if s not in done],
             "test": {}, "gain_vs_start": {}, "mechanisms": {}}
    if done:
      entry["test"] = first.test_block(finals[name], cols, name)
      if f"{name}@test_step{N_STEPS}" in finals:
        entry[f"test_step{N_STEPS}"] = first.test_block(finals[f"{name}@test_step{N_STEPS}"],
                                                        cols, f"{name}@step{N_STEPS}")
      entry["gain_vs_start"] = first.paired(finals[name], start_rows, cols, name + "/gain")
      entry["mechanisms"] = mean_mechanisms([r["mechanisms"] for r in seeds])
    results["controls" if name in CONTROLS else "settings"][name] = entry

  mde_path = os.path.join(HERE, "mde.json")
  try:
    mde = json.load(open(mde_path, encoding="utf-8")) if os.path.exists(mde_path) else {}
  except json.JSONDecodeError as e:
    raise CollectError(f"{mde_path}: line {e.lineno}: not valid JSON ({e.msg})") from None
  results["mde"] = mde
  results["family"] = {"comparisons": [c["label"] for c in COMPARISONS if c["primary"]],
                       "alpha_each": ALPHA_FAMILY, "method": "Bonferroni",
                       "bootstrap_replicates": first.BOOT}
  results["comparisons"] = {c["label"]: comparison_block(c, finals, cols, mde, len(ids))
                            for c in COMPARISONS} if ids else {}
  versions = os.path.join(runs, "versions.jsonl")
  if os.path.exists(versions):
    read_jsonl(versions)        # a malformed line: exit 2 naming it, before versions_block
  results["versions"] = first.versions_block(runs, out_dir, previous.get("versions"))
  return results


def load_engaged(out_dir: str, key: str = "engaged") -> dict | None:
  """The ``key`` block of ``out_dir/results.json`` (None when there is none; the async
  comparison's collector reads its ``learning`` block with it); CollectError naming the file
  when it is not a JSON object."""
  path = os.path.join(out_dir, "results.json")
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f).get(key)
  except (json.JSONDecodeError, AttributeError):
    raise CollectError(f"{path}: not a JSON object; move it away to rebuild it") from None


def write_results(results: dict, out_dir: str) -> str:
  """Writes ``results`` as the ``engaged`` key of ``out_dir/results.json`` (atomically; other
  keys kept); returns the path."""
  path = os.path.join(out_dir, "results.json")
  whole = {}
  if os.path.exists(path):
    load_engaged(out_dir)             # raises on a file that is not ours to overwrite
    with open(path, encoding="utf-8") as f:
      whole = json.load(f)
  whole["engaged"] = results
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(whole, f, indent=1)
  os.replace(tmp, path)
  return path


# ----------------------------------------------------------------------------- figures
def _entries(results: dict):
  for part in ("settings", "controls"):
    yield from results[part].items()


def plot_curves(results: dict, path: str) -> bool:
  """curves.png: validation EM (all 214 questions) against RL step, one panel per setting and
  control (each warm-start a thin line, the mean over warm-starts at each step bold; unfinished
  runs dashed), and a last panel with every mean. Written only when some run has a validation
  point after its start; returns whether it was written."""
  entries = [(n, e, e["seeds"] + e["in_progress"]) for n, e in _entries(results)]
  entries = [(n, e, runs) for n, e, runs in entries
             if any(p["rl_step"] > 0 for r in runs for p in r["validation_curve"])]
  if not entries:
    return False
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  cols = 4
  rows = (len(entries) + 1 + cols - 1) // cols
  fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.3 * rows), squeeze=False,
                           sharey=True)
  axes = axes.ravel()
  for i, (name, e, runs) in enumerate(entries):
    ax, color = axes[i], f"C{i}"
    by_step: dict[int, list[float]] = {}
    for r in runs:
      xs = [p["rl_step"] for p in r["validation_curve"]]
      ys = [p["em"] for p in r["validation_curve"]]
      ax.plot(xs, ys, color=color, lw=0.8, alpha=0.6, ls="-" if r in e["seeds"] else "--")
      for x, y in zip(xs, ys):
        by_step.setdefault(x, []).append(y)
    steps = sorted(by_step)
    mean = [float(np.mean(by_step[x])) for x in steps]
    ax.plot(steps, mean, color=color, lw=2.2, marker="o", ms=3)
    axes[-1].plot(steps, mean, color=color, lw=1.8, marker="o", ms=3,
                  label=f"{name} ({len(e['seeds'])} done, {len(e['in_progress'])} running)",
                  ls="--" if name in CONTROLS else "-")
    ax.set_title(f"{name}: {len(runs)} warm-start(s)", fontsize=10)
  for ax in axes[:len(entries)]:
    ax.axvline(N_STEPS, color="0.6", lw=0.8, ls=":")
  for ax in axes[len(entries):-1]:
    ax.set_visible(False)
  axes[-1].set_title("means over warm-starts", fontsize=10)
  axes[-1].legend(fontsize=7)
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.set_xlabel("RL step (continued SFT: updates)")
  for k in range(0, len(axes), cols):
    axes[k].set_ylabel("validation EM (214, greedy)")
  fig.suptitle("Validation EM by RL step: thin = one warm-start (dashed: still running), "
               f"bold = mean at each step; dotted line: N = {N_STEPS}", fontsize=10)
  fig.tight_layout(rect=(0, 0, 1, 0.96))
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def plot_forest(results: dict, path: str) -> bool:
  """forest.png: every comparison with data, overall and 2-hop test EM: the paired difference,
  its 95% two-way bootstrap interval (thick), its 95% t-interval over warm-starts (dashed), for
  primary ones the 98.75% family-wise wider interval (thin), and the paper's effect (x) in the
  comparison's orientation. Written only when some comparison has data; returns whether."""
  rows = [(k, c) for k, c in results.get("comparisons", {}).items() if c.get("n_warm_starts")]
  if not rows:
    return False
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(13, 1.8 + 0.7 * len(rows)), sharey=True)
  for ax, key, boot_key in ((axes[0], "em", "ci95_em"), (axes[1], "em_2hop", "ci95")):
    shown = False
    for i, (label, c) in enumerate(rows):
      color = "C0" if c["primary"] else ("C3" if c["a"] in CONTROLS else "C2")
      ax.plot(c[boot_key], [i, i], color=color, lw=2.5,
              label="95% bootstrap" if i == 0 else None)
      ax.plot([c[key]], [i], "o", color=color)
      if c["t_interval"].get(key):
        ax.plot(c["t_interval"][key], [i + 0.2, i + 0.2], color=color, lw=1.2, ls="--",
                label="95% t over warm-starts" if i == 0 else None)
      if c["primary"] and key == "em":
        ax.plot(c["verdict_interval_family"][key], [i - 0.2, i - 0.2], color=color, lw=0.8,
                label="98.75% (Bonferroni, 4), the wider" if i == 0 else None)
      effect = c["paper"]["effect" if key == "em" else "effect_2hop"]
      if effect is not None:
        sign = 1 if c["paper"]["orientation"].startswith("a - b") else -1
        ax.plot([sign * effect], [i], "x", color="k", ms=7,
                label=None if shown else "paper's effect")
        shown = True
    ax.axvline(0, color="k", lw=0.8)
    lo, hi = ax.get_xlim()
    ax.set_xlim(max(lo, -1.0), min(hi, 1.0))   # an EM difference lies in [-1, 1]
    ax.set_title("greedy test EM" + (", 2-hop" if key == "em_2hop" else "")
                 + ": a minus b, paired per question")
    ax.grid(alpha=0.3, axis="x")
  axes[0].set_yticks(range(len(rows)))
  axes[0].set_yticklabels([f"{k} (n={c['n_warm_starts']}/{c['planned_warm_starts']})"
                           for k, c in rows], fontsize=8)
  axes[0].invert_yaxis()
  handles, labels = [], []
  for ax in axes:
    for h, l in zip(*ax.get_legend_handles_labels()):
      if l not in labels:
        handles.append(h)
        labels.append(l)
  fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


# -------------------------------------------------------------------------------- main
def summary_lines(results: dict) -> list[str]:
  """A few lines for the terminal: the grid's cells by status, each comparison's verdict."""
  lines = []
  for name, cells in results["grid"].items():
    lines.append(f"{name:13s} " + "; ".join(f"{s}: {st}" for s, st in cells.items()))
  for label, c in results.get("comparisons", {}).items():
    lines.append(c["verdict"]["em"] if c.get("verdict") else f"{label}: no paired warm-start yet")
  return lines


def main(argv=None) -> int:
  """Command line (see the module docstring); 0, or 2 with one line on stderr for an input
  error."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--runs", default="runs/engaged")
  p.add_argument("--out", default=HERE)
  p.add_argument("--command", default="bash docs/results/countries_smollm2_engaged/run.sh")
  args = p.parse_args(argv)
  try:
    results = collect(args.runs, args.out, args.command)
    path = write_results(results, args.out)
  except CollectError as e:
    print(f"collect.py: {e}", file=sys.stderr)
    return 2
  figures = [f for f, ok in (("curves.png", plot_curves(results, os.path.join(args.out,
                                                                              "curves.png"))),
                             ("forest.png", plot_forest(results, os.path.join(args.out,
                                                                              "forest.png"))))
             if ok]
  print("\n".join(summary_lines(results)))
  print(f"collected {len(results['warm_starts'])} warm-start(s), "
        f"{sum(len(e['seeds']) for _, e in _entries(results))} finished run(s), "
        f"{len(results['missing'])} missing cell(s) -> {path}"
        + (f", {', '.join(figures)}" if figures else " (no figure: no data yet)"),
        file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
