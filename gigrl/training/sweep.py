r"""A grid of config overrides × seeds of training runs, and their comparison: the library
behind ``gigrl-sweep`` (:func:`run_sweep`; each run is :func:`gigrl.training.api.train` in a
process of its own).

Each setting is a name and its overrides (``section.field=value``, values as on the
``gigrl-train`` command line; ``gigrl-sweep --setting`` writes them ``name:a.b=1,c.d=x``), and
``common`` overrides apply to every run. Run ``<setting>/seed_<s>`` of the grid is the
``gigrl-train`` run with ``seed=<s>``, the common and the setting's overrides (its
``train.log`` starts with that command); its output goes to that ``train.log``. Runs go one
after another, or ``parallel`` at a time (separate processes).

``--warm_start``: the SFT warm-start is run once per seed (``<workdir>/warm_start/seed_<s>``,
``train.num_steps=0`` and the ``--set`` overrides), and every setting's run of that seed starts RL
from its params (``train.init_from``): the settings then differ in RL only, and the sweep costs
one SFT per seed instead of one per run. Settings must then change RL fields only (estimator,
pool rule, loss, learning rate); a run whose ``train.sft_steps`` differs is refused.

Resumable: a run that finished is marked ``sweep_done.json`` and never rerun; rerunning the
same command continues a killed run from its own workdir (``gigrl-train`` resumes from the
latest checkpoint). ``--report_only`` rewrites the report from the finished runs.

Report (``<workdir>/sweep.md``, ``sweep.json``, ``sweep.png``), one row per setting, from each
run's ``phase: "eval"`` lines in ``metrics.jsonl`` (``train.eval_every``, set with
``--eval_every`` if the config has none):

* final held-out EM: mean ± half-width of the 95% confidence interval over seeds (Student t,
  n − 1 degrees of freedom), the start-of-RL EM, and the change final − start (per seed, then
  mean ± 95% CI: the paired comparison, since warm-starts differ between seeds);
* AUC: the area under the EM-vs-RL-step curve divided by the RL steps (trapezoid rule; the
  curve's mean height, in EM units);
* steps to ``--threshold``: the first RL step whose eval EM reaches it, mean over the seeds that
  reach it (and how many did);
* mean ``zero_variance_frac`` over RL steps and seeds; wall time per run (all attempts).

The plot draws each setting's mean eval EM against RL steps with its 95% band, and beside it
the mean change from each run's start of RL (the paired view). When the eval lines carry EM by
hop count (``eval/em/hops=N``, e.g. the countries task), the report adds a table of start, final
and paired change per setting and hop, and the plot one panel per hop.
A run that fails is reported (with its log) and makes the exit status 1.
"""
from __future__ import annotations

import concurrent.futures
import json
import math
import multiprocessing
import os
import shlex
import sys
import time
import traceback
from typing import Any, Callable, Sequence

from gigrl.training import metrics as metrics_lib

PROG = "gigrl-sweep"
DONE = "sweep_done.json"
WALL = "sweep_wall.json"
# Two-sided 95% Student-t quantiles t_{0.975, df} for df = 1..30 (normal beyond).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


class SweepError(Exception):
  """A bad command line (exit status 2)."""


def parse_setting(text: str) -> tuple[str, list[str]]:
  """``'name:a.b=1,c.d=x'`` -> ``('name', ['--config.a.b=1', '--config.c.d=x'])``.

  Raises:
    SweepError: no name, a name that is not a folder name, or an item without ``=``.
  """
  name, sep, rest = text.partition(":")
  name = name.strip()
  if not sep or not name or not all(c.isalnum() or c in "-_.+" for c in name):
    raise SweepError(f"--setting {text!r}: expected name:section.field=value,... with a name "
                     "of letters, digits, '-', '_', '.', '+'")
  return name, overrides([x for x in rest.split(",") if x.strip()], f"--setting {text!r}")


def overrides(items: Sequence[str], what: str) -> list[str]:
  out = []
  for item in items:
    field, eq, value = item.strip().partition("=")
    field = field.strip().removeprefix("--config.")
    if not eq or not field:
      raise SweepError(f"{what}: {item!r} is not section.field=value")
    out.append(f"--config.{field}={value.strip()}")
  return out


def t_quantile(df: int) -> float:
  """t_{0.975, df} (1.96 beyond 30; NaN for df < 1)."""
  if df < 1:
    return float("nan")
  return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
  """(mean, half-width of the 95% CI) with the sample std (ddof 1); half-width NaN for n < 2."""
  n = len(values)
  if not n:
    return float("nan"), float("nan")
  m = sum(values) / n
  if n < 2:
    return m, float("nan")
  sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
  return m, t_quantile(n - 1) * sd / math.sqrt(n)


# ------------------------------------------------------------------------------ one run
def run_summary(run_dir: str) -> dict[str, Any]:
  """A run's eval curve and statistics from its ``metrics.jsonl``.

  Returns:
    ``curve`` [(RL step, eval EM)], ``curve_by_hop`` {hops: [(RL step, eval EM of the
    questions with that many hops)]} (empty when the questions carry no hop count),
    ``start_em``, ``final_em``, ``auc`` (mean height of the
    curve over its RL steps; the single value if there is one point), ``zero_variance_frac``
    (mean over RL steps), ``wall_s`` (all attempts), ``sft_steps``.
  """
  path = os.path.join(run_dir, "metrics.jsonl")
  rows = metrics_lib.read_metrics(path) if os.path.exists(path) else []
  rl = [r["step"] for r in rows if r.get("phase") == "rl"]
  # RL starts after the SFT steps (absent from the file of a train.init_from run)
  sft = min(rl) - 1 if rl else max((r["step"] for r in rows if r.get("phase") == "sft"),
                                   default=0)
  curve = sorted({r["step"] - sft: r["eval/em"] for r in rows
                  if r.get("phase") == "eval" and isinstance(r.get("eval/em"), (int, float))
                  and r["step"] >= sft}.items())     # not train.sft_eval_every's SFT lines
  hops = {}     # held-out EM by hop count, when the questions carry it (evaluate.by_hop)
  for key in sorted({k for r in rows if r.get("phase") == "eval" for k in r
                     if k.startswith("eval/em/hops=")}):
    hops[key.rpartition("=")[2]] = sorted({
        r["step"] - sft: r[key] for r in rows if r.get("phase") == "eval"
        and isinstance(r.get(key), (int, float)) and r["step"] >= sft}.items())
  zv = [r["zero_variance_frac"] for r in rows if r.get("phase") == "rl"
        and isinstance(r.get("zero_variance_frac"), (int, float))]
  if len(curve) > 1:
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(curve, curve[1:]))
    auc = area / (curve[-1][0] - curve[0][0])
  else:
    auc = curve[0][1] if curve else float("nan")
  wall = json.load(open(os.path.join(run_dir, WALL))) if os.path.exists(
      os.path.join(run_dir, WALL)) else {"wall_s": float("nan")}
  return {"curve": curve, "curve_by_hop": hops, "sft_steps": sft,
          "start_em": curve[0][1] if curve else float("nan"),
          "final_em": curve[-1][1] if curve else float("nan"), "auc": auc,
          "zero_variance_frac": sum(zv) / len(zv) if zv else float("nan"),
          "wall_s": float(wall["wall_s"])}


def steps_to(curve: Sequence[tuple[int, float]], threshold: float) -> int | None:
  """The first RL step whose eval EM is >= ``threshold`` (None if never)."""
  return next((s for s, em in curve if em >= threshold), None)


# ------------------------------------------------------------------------------ report
def _by_hop(runs) -> dict[str, Any]:
  """{hops: start / final EM and the paired change, mean ± 95% CI over the runs}."""
  out = {}
  for hop in sorted({h for r in runs for h in r.get("curve_by_hop", {})}):
    curves = [r["curve_by_hop"][hop] for r in runs if r.get("curve_by_hop", {}).get(hop)]
    finals, starts = [c[-1][1] for c in curves], [c[0][1] for c in curves]
    m, ci = mean_ci(finals)
    dm, dci = mean_ci([f - s0 for f, s0 in zip(finals, starts)])
    out[hop] = {"n": len(curves), "start_em_mean": mean_ci(starts)[0], "final_em_mean": m,
                "final_em_ci95": ci, "delta_em_mean": dm, "delta_em_ci95": dci}
  return out


def summarize(workdir: str, settings: Sequence[str], seeds: Sequence[int],
              threshold: float) -> dict[str, Any]:
  """Per setting: the per-seed summaries (finished runs only) and the statistics."""
  out = {}
  for name in settings:
    runs = {}
    for s in seeds:
      d = os.path.join(workdir, name, f"seed_{s}")
      if os.path.exists(os.path.join(d, DONE)):
        runs[s] = run_summary(d)
    finals = [r["final_em"] for r in runs.values() if not math.isnan(r["final_em"])]
    starts = [r["start_em"] for r in runs.values() if not math.isnan(r["start_em"])]
    reached = [t for t in (steps_to(r["curve"], threshold) for r in runs.values())
               if t is not None]
    deltas = [r["final_em"] - r["start_em"] for r in runs.values()
              if not math.isnan(r["final_em"]) and not math.isnan(r["start_em"])]
    m, ci = mean_ci(finals)
    dm, dci = mean_ci(deltas)
    out[name] = {
        "seeds": sorted(runs), "final_em_mean": m, "final_em_ci95": ci,
        "start_em_mean": mean_ci(starts)[0], "delta_em_mean": dm, "delta_em_ci95": dci,
        "auc_mean": mean_ci([r["auc"] for r in
                                                                  runs.values()])[0],
        "steps_to_threshold_mean": mean_ci(reached)[0], "reached": len(reached),
        "zero_variance_frac_mean": mean_ci([r["zero_variance_frac"] for r in runs.values()
                                            if not math.isnan(r["zero_variance_frac"])])[0],
        "wall_s_mean": mean_ci([r["wall_s"] for r in runs.values()])[0],
        "by_hop": _by_hop(runs.values()),
        "runs": {str(s): r for s, r in runs.items()}}
  return out


def _f(x: float, fmt: str = ".3f") -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(summary: dict[str, Any], threshold: float, n_seeds: int) -> str:
  head = ["setting", "seeds", "final EM (mean ± 95% CI)", "start EM",
          "final − start EM (mean ± 95% CI)", "AUC",
          f"steps to EM ≥ {threshold:g}", "zero_variance_frac", "wall time (min)"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, s in summary.items():
    final = (f"{_f(s['final_em_mean'])} ± {_f(s['final_em_ci95'])}"
             if s["seeds"] else "-")
    steps = (f"{_f(s['steps_to_threshold_mean'], '.1f')} ({s['reached']}/{len(s['seeds'])})"
             if s["seeds"] else "-")
    lines.append("| " + " | ".join([
        name, f"{len(s['seeds'])}/{n_seeds}", final, _f(s["start_em_mean"]),
        f"{_f(s['delta_em_mean'], '+.3f')} ± {_f(s['delta_em_ci95'])}" if s["seeds"] else "-",
        _f(s["auc_mean"]), steps, _f(s["zero_variance_frac_mean"]),
        _f(s["wall_s_mean"] / 60, ".1f")]) + " |")
  hop_rows = [(name, hop, h) for name, s in summary.items()
              for hop, h in s.get("by_hop", {}).items()]
  if hop_rows:
    lines += ["", "| setting | hops | seeds | final EM (mean ± 95% CI) | start EM | "
              "final − start EM (mean ± 95% CI) |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {hop} | {h['n']} | {_f(h['final_em_mean'])} ± "
              f"{_f(h['final_em_ci95'])} | {_f(h['start_em_mean'])} | "
              f"{_f(h['delta_em_mean'], '+.3f')} ± {_f(h['delta_em_ci95'])} |"
              for name, hop, h in hop_rows]
  return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: str) -> str | None:
  """Two panels per setting, on the seeds' common eval steps, with 95% bands: the mean eval EM
  against RL steps, and the mean change from each run's own start of RL (the paired view,
  which seed-to-seed differences in the warm-start do not widen)."""
  # A bare Figure (no pyplot): never switches the caller's matplotlib backend.
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  hops = sorted({h for s in summary.values() for r in s["runs"].values()
                 for h in r.get("curve_by_hop", {})})
  fig = Figure(figsize=(11, 8 if hops else 4))
  axes = fig.subplots(2 if hops else 1, 2).reshape(-1)
  ax_em, ax_delta = axes[0], axes[1]
  panels = [(ax_em, "curve", None, False), (ax_delta, "curve", None, True)]
  panels += [(ax, "curve_by_hop", hop, False) for ax, hop in zip(axes[2:], hops)]
  drawn = False
  for name, s in summary.items():
    for ax, key, hop, shift in panels:
      curves = [dict(r[key] if hop is None else r[key].get(hop, []))
                for r in s["runs"].values()]
      curves = [c for c in curves if c]
      if not curves:
        continue
      xs = sorted(set.intersection(*(set(c) for c in curves)))
      stats = [mean_ci([c[x] - (c[xs[0]] if shift else 0.0) for c in curves]) for x in xs]
      mean = [m for m, _ in stats]
      half = [0.0 if math.isnan(h) else h for _, h in stats]
      line, = ax.plot(xs, mean, marker="o", ms=3, label=f"{name} (n={len(curves)})")
      ax.fill_between(xs, [m - h for m, h in zip(mean, half)],
                      [m + h for m, h in zip(mean, half)], color=line.get_color(), alpha=0.15,
                      lw=0)
      drawn = True
  if not drawn:
    return None
  for ax in axes[2 + len(hops):]:
    ax.set_visible(False)
  for ax, hop in zip(axes[2:], hops):
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"held-out EM, {hop}-hop questions")
    ax.set_title(f"{hop}-hop questions: mean over seeds, 95% CI band", fontsize=10)
    ax.grid(alpha=0.3)
  for ax, label, title in (
      (ax_em, "held-out EM (greedy)", "held-out EM: mean over seeds, 95% CI band"),
      (ax_delta, "held-out EM − its start-of-RL value",
       "change from the start of RL: mean over seeds, 95% CI band")):
    ax.set_xlabel("RL step")
    ax.set_ylabel(label)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
  ax_delta.axhline(0.0, color="k", lw=0.8)
  ax_em.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path


# -------------------------------------------------------------------------------- runs
def _train_process(config: str, overrides: list[str], run_dir: str) -> None:
  """A spawned process's whole life: its output into ``train.log``, the config file with the
  run's overrides, :func:`gigrl.training.api.train`; ``sweep_done.json`` only when the run
  reached its last step. Exit status 0 when it did."""
  fd = os.open(os.path.join(run_dir, "train.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  # pylint: disable=g-import-not-at-top
  from gigrl import config as config_lib
  from gigrl.config_utils import UserError
  from gigrl.training import api
  # pylint: enable=g-import-not-at-top
  try:
    cfg = config_lib.load_file(config)
    config_lib.apply_overrides(cfg, overrides)
    result = api.train(cfg, run_dir)
  except UserError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    sys.stderr.flush()
    sys.exit(1)
  if not result.complete:
    print(f"[{PROG}] stopped at step {result.step} of {result.total}", file=sys.stderr,
          flush=True)
    sys.exit(3)
  with open(os.path.join(run_dir, DONE), "w", encoding="utf-8") as f:
    json.dump({"command": command_line(config, run_dir, overrides), "step": result.step,
               "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "eval": result.eval}, f)
  sys.stdout.flush()
  sys.exit(0)


def command_line(config: str, run_dir: str, overrides: Sequence[str]) -> str:
  """The ``gigrl-train`` command that runs the same run by hand."""
  return " ".join(shlex.quote(a) for a in [
      "gigrl-train", "--config", config, "--workdir", os.path.abspath(run_dir),
      *[f"--config.{o.removeprefix('--config.')}" for o in overrides]])


def launch(config: str, overrides: list[str], run_dir: str, log: Callable[[str], None]) -> int:
  """Runs one run in a spawned process (its own JAX, memory and signals) and waits; adds its
  wall time to ``sweep_wall.json``.

  Returns:
    its exit status: 0 finished (``sweep_done.json`` written), 2 a bad config, 3 stopped
    before its last step (SIGTERM), other values failed (see its ``train.log``).
  """
  os.makedirs(run_dir, exist_ok=True)
  wall_path = os.path.join(run_dir, WALL)
  before = json.load(open(wall_path))["wall_s"] if os.path.exists(wall_path) else 0.0
  with open(os.path.join(run_dir, "train.log"), "a", encoding="utf-8") as f:
    f.write(f"$ {command_line(config, run_dir, overrides)}\n")
  t0 = time.time()
  proc = multiprocessing.get_context("spawn").Process(
      target=_train_process, args=(config, list(overrides), run_dir))
  try:
    proc.start()
    proc.join()
  finally:
    with open(wall_path + ".tmp", "w", encoding="utf-8") as w:
      json.dump({"wall_s": before + time.time() - t0}, w)
    os.replace(wall_path + ".tmp", wall_path)
  rc = proc.exitcode
  done = rc == 0 and os.path.exists(os.path.join(run_dir, DONE))
  log(f"{os.path.relpath(run_dir)}: " + (
      "done" if done else "stopped before its last step; rerun to resume" if rc == 3
      else f"FAILED (exit {rc}), see train.log"))
  return 0 if done else (rc or 1)


def run_sweep(config: str, workdir: str, settings: dict[str, list[str]], seeds: Sequence[int],
              *, common: Sequence[str] = (), parallel: int = 1, warm_start: bool = False,
              threshold: float = 0.3, report_only: bool = False, command: str | None = None,
              log: Callable[[str], None] | None = None) -> tuple[dict[str, Any], int]:
  """Runs the grid (the runs not finished yet), then writes its report.

  Args:
    config: a config file, ``FILE[:PRESET]``.
    workdir: the sweep's folder; run ``<setting>/seed_<s>`` lives in its subfolder.
    settings: name -> overrides (``section.field=value``) of each grid point.
    seeds: the seeds of every setting (``seed=<s>`` is set on each run).
    common: overrides of every run (applied before the setting's).
    parallel: runs at a time (processes).
    warm_start: one SFT warm-start per seed (``warm_start/seed_<s>``, ``train.num_steps=0``),
      and every setting's run of that seed starts RL from it (``train.init_from``).
    threshold: the EM of "steps to threshold".
    report_only: only rewrite the report from the finished runs.
    command: the command line written into the report.
  Returns:
    (the per-setting summary (:func:`summarize`), the number of runs that failed).
  """
  log = log or (lambda msg: print(f"[{PROG}] {msg}", file=sys.stderr, flush=True))
  os.makedirs(workdir, exist_ok=True)

  def run_overrides(s, extra):
    return [f"seed={s}", *[o.removeprefix("--config.") for o in common],
            *[o.removeprefix("--config.") for o in extra]]

  warm = {s: os.path.join(workdir, "warm_start", f"seed_{s}") for s in seeds}
  jobs = []
  for name, extra in settings.items():
    for s in seeds:
      d = os.path.join(workdir, name, f"seed_{s}")
      if os.path.exists(os.path.join(d, DONE)):
        continue
      init = [f"train.init_from={os.path.abspath(warm[s])}"] if warm_start else []
      jobs.append((run_overrides(s, [*extra, *init]), d, s))
  failed = 0
  if not report_only and jobs:
    log(f"{len(jobs)} runs to do ({len(settings) * len(seeds) - len(jobs)} already finished), "
        f"{parallel} at a time")
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
      # Warm starts are submitted first, so they take the workers first; a run waits only for
      # its own seed's warm start (and is skipped, counted as failed, if that failed).
      warm_rc = {s: pool.submit(launch, config, run_overrides(s, ["train.num_steps=0"]), d, log)
                 for s, d in warm.items()
                 if warm_start and not os.path.exists(os.path.join(d, DONE))}

      def after_warm_start(overrides, d, s):
        if s in warm_rc and warm_rc[s].result() != 0:
          log(f"{os.path.relpath(d)}: skipped (its warm start failed)")
          return 1
        return launch(config, overrides, d, log)
      runs = [pool.submit(after_warm_start, o, d, s) for o, d, s in jobs]
      failed = sum(f.result() != 0 for f in [*warm_rc.values(), *runs])
  summary = summarize(workdir, list(settings), seeds, threshold)
  table = markdown(summary, threshold, len(seeds))
  if warm_start:
    walls = [run_summary(d)["wall_s"] for d in warm.values()
             if os.path.exists(os.path.join(d, DONE))]
    table += (f"\nWall time excludes the SFT warm-start shared by every setting of a seed "
              f"(`warm_start/seed_<s>`: {_f(mean_ci(walls)[0] / 60, '.1f')} min per seed).\n")
  command = command or f"run_sweep({config!r}, {workdir!r}, ...)"
  with open(os.path.join(workdir, "sweep.md"), "w", encoding="utf-8") as f:
    f.write(f"Command: `{command}`\n\n{table}")
  with open(os.path.join(workdir, "sweep.json"), "w", encoding="utf-8") as f:
    json.dump({"command": command, "threshold": threshold, "seeds": list(seeds),
               "settings": {k: {"overrides": [f"--config.{o.removeprefix('--config.')}"
                                              for o in v], **summary[k]}
                            for k, v in settings.items()}}, f, indent=1)
  png = plot(summary, os.path.join(workdir, "sweep.png"))
  print(table)
  log(f"wrote {os.path.join(workdir, 'sweep.md')}, sweep.json"
      + (", sweep.png" if png else " (no eval lines to plot: set --eval_every)"))
  return summary, failed

