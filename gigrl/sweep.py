r"""``gigrl-sweep``: a grid of config overrides × seeds of ``gigrl-train``, and their comparison.

Usage::

  gigrl-sweep --config configs/countries.py --workdir runs/estimators --seeds 0,1,2 \
      --parallel 2 --threshold 0.3 \
      --setting 'grpo:data.pool.rule=grpo' \
      --setting 'drgrpo:advantage.outcome=drgrpo,data.pool.rule=grpo' \
      --setting 'recycle:data.pool.rule=recycle'

Each setting is ``name:section.field=value,...`` (values as on the ``gigrl-train`` command
line); ``--set section.field=value`` applies to every run. Run ``<setting>/seed_<s>`` of the
grid is ``gigrl-train --config <config> --workdir <workdir>/<setting>/seed_<s>
--config.seed=<s> <--set ...> <the setting's overrides>``; its output goes to ``train.log`` in
its folder. Runs go one after another, or ``--parallel N`` at a time (separate processes).

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

import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Sequence

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
def _read_jsonl(path: str) -> list[dict[str, Any]]:
  rows = []
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError:
          break
  return rows


def run_summary(run_dir: str) -> dict[str, Any]:
  """A run's eval curve and statistics from its ``metrics.jsonl``.

  Returns:
    ``curve`` [(RL step, eval EM)], ``curve_by_hop`` {hops: [(RL step, eval EM of the
    questions with that many hops)]} (empty when the questions carry no hop count),
    ``start_em``, ``final_em``, ``auc`` (mean height of the
    curve over its RL steps; the single value if there is one point), ``zero_variance_frac``
    (mean over RL steps), ``wall_s`` (all attempts), ``sft_steps``.
  """
  rows = _read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
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


def _launch(cmd: list[str], run_dir: str, log) -> int:
  """Runs one gigrl-train attempt; adds its wall time to ``sweep_wall.json``."""
  os.makedirs(run_dir, exist_ok=True)
  wall_path = os.path.join(run_dir, WALL)
  before = json.load(open(wall_path))["wall_s"] if os.path.exists(wall_path) else 0.0
  t0 = time.time()
  with open(os.path.join(run_dir, "train.log"), "a", encoding="utf-8") as f:
    f.write(f"$ {' '.join(cmd)}\n")
    f.flush()
    try:
      rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    finally:
      with open(wall_path + ".tmp", "w", encoding="utf-8") as w:
        json.dump({"wall_s": before + time.time() - t0}, w)
      os.replace(wall_path + ".tmp", wall_path)
  if rc == 0:
    with open(os.path.join(run_dir, DONE), "w", encoding="utf-8") as f:
      json.dump({"command": cmd, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}, f)
  log(f"{os.path.relpath(run_dir)}: {'done' if rc == 0 else f'FAILED (exit {rc}), see train.log'}")
  return rc


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


# -------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="gigrl-train config file (FILE[:PRESET])")
  p.add_argument("--workdir", required=True, help="the sweep's folder (one subfolder per run)")
  p.add_argument("--setting", action="append", default=[], required=True,
                 help="name:section.field=value,... (repeatable; one per grid point)")
  p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
  p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                 help="an override for every run (repeatable)")
  p.add_argument("--eval_every", type=int, default=None,
                 help="train.eval_every for every run (default: the config's)")
  p.add_argument("--parallel", type=int, default=1, help="runs at a time (processes)")
  p.add_argument("--threshold", type=float, default=0.3, help="EM for 'steps to threshold'")
  p.add_argument("--warm_start", action="store_true",
                 help="one SFT warm-start per seed, shared by every setting (train.init_from)")
  p.add_argument("--report_only", action="store_true", help="only rewrite the report")
  return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
  args = parse_args(argv)
  try:
    path, sep, preset = args.config.partition(":")     # FILE[:PRESET], as gigrl-train's
    if not os.path.isfile(path):
      raise SweepError(f"--config {path}: no such file")
    config = os.path.abspath(path) + sep + preset
    settings = dict(parse_setting(s) for s in args.setting)
    if len(settings) != len(args.setting):
      raise SweepError("--setting: two settings have the same name")
    try:
      seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
      raise SweepError(f"--seeds {args.seeds!r}: expected comma-separated integers") from None
    if not seeds:
      raise SweepError("--seeds: no seed given")
    if args.parallel < 1:
      raise SweepError(f"--parallel {args.parallel}: expected >= 1")
    common = overrides(args.set, "--set")
    if args.eval_every is not None:
      common.append(f"--config.train.eval_every={args.eval_every}")
  except SweepError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  os.makedirs(args.workdir, exist_ok=True)

  def log(msg):
    print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)

  def train_cmd(d, s, extra):
    return [sys.executable, "-m", "gigrl.train", "--config", config,
            "--workdir", os.path.abspath(d), f"--config.seed={s}", *common, *extra]

  warm = {s: os.path.join(args.workdir, "warm_start", f"seed_{s}") for s in seeds}
  jobs = []
  for name, extra in settings.items():
    for s in seeds:
      d = os.path.join(args.workdir, name, f"seed_{s}")
      if os.path.exists(os.path.join(d, DONE)):
        continue
      init = ([f"--config.train.init_from={os.path.abspath(warm[s])}"] if args.warm_start
              else [])
      jobs.append((train_cmd(d, s, [*extra, *init]), d, s))
  failed = 0
  if not args.report_only and jobs:
    log(f"{len(jobs)} runs to do ({len(settings) * len(seeds) - len(jobs)} already finished), "
        f"{args.parallel} at a time")
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
      # Warm starts are submitted first, so they take the workers first; a run waits only for
      # its own seed's warm start (and is skipped, counted as failed, if that failed).
      warm_rc = {s: pool.submit(_launch, train_cmd(d, s, ["--config.train.num_steps=0"]), d, log)
                 for s, d in warm.items()
                 if args.warm_start and not os.path.exists(os.path.join(d, DONE))}

      def after_warm_start(cmd, d, s):
        if s in warm_rc and warm_rc[s].result() != 0:
          log(f"{os.path.relpath(d)}: skipped (its warm start failed)")
          return 1
        return _launch(cmd, d, log)
      runs = [pool.submit(after_warm_start, cmd, d, s) for cmd, d, s in jobs]
      failed = sum(f.result() != 0 for f in [*warm_rc.values(), *runs])
  summary = summarize(args.workdir, list(settings), seeds, args.threshold)
  table = markdown(summary, args.threshold, len(seeds))
  cmd_line = " ".join([PROG] + [a if " " not in a else repr(a) for a in argv])
  if args.warm_start:
    walls = [run_summary(d)["wall_s"] for d in warm.values()
             if os.path.exists(os.path.join(d, DONE))]
    table += (f"\nWall time excludes the SFT warm-start shared by every setting of a seed "
              f"(`warm_start/seed_<s>`: {_f(mean_ci(walls)[0] / 60, '.1f')} min per seed).\n")
  with open(os.path.join(args.workdir, "sweep.md"), "w", encoding="utf-8") as f:
    f.write(f"Command: `{cmd_line}`\n\n{table}")
  with open(os.path.join(args.workdir, "sweep.json"), "w", encoding="utf-8") as f:
    json.dump({"command": cmd_line, "threshold": args.threshold, "seeds": seeds,
               "settings": {k: {"overrides": v, **summary[k]} for k, v in settings.items()}},
              f, indent=1)
  png = plot(summary, os.path.join(args.workdir, "sweep.png"))
  print(table)
  log(f"wrote {os.path.join(args.workdir, 'sweep.md')}, sweep.json"
      + (", sweep.png" if png else " (no eval lines to plot: set --eval_every)"))
  return 1 if failed else 0


def run() -> None:
  """Console entry point (``gigrl-sweep``)."""
  sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
  run()
