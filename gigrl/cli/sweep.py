r"""``gigrl-sweep``: a grid of config overrides × seeds of training runs, and their comparison.

Usage::

  gigrl-sweep --config configs/countries.py --workdir runs/estimators --seeds 0,1,2 \
      --parallel 2 --threshold 0.3 \
      --setting 'grpo:data.pool.rule=grpo' \
      --setting 'drgrpo:advantage.outcome=drgrpo,data.pool.rule=grpo' \
      --setting 'recycle:data.pool.rule=recycle'

Each setting is ``name:section.field=value,...`` (values as on the ``gigrl-train`` command
line); ``--set section.field=value`` applies to every run. The grid, its resumption and its
report are :func:`gigrl.training.sweep.run_sweep` (see that module for the statistics); this
tool parses the command line. A bad one ends with one line ``gigrl-sweep: error: ...`` and
exit status 2; a run that fails makes the exit status 1.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from gigrl.training import sweep as sweep_lib
from gigrl.training.sweep import PROG, SweepError, parse_setting


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
    common = sweep_lib.overrides(args.set, "--set")
    if args.eval_every is not None:
      common.append(f"--config.train.eval_every={args.eval_every}")
  except SweepError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  command = " ".join([PROG] + [a if " " not in a else repr(a) for a in argv])
  _, failed = sweep_lib.run_sweep(
      config, args.workdir, settings, seeds, common=common, parallel=args.parallel,
      warm_start=args.warm_start, threshold=args.threshold, report_only=args.report_only,
      command=command)
  return 1 if failed else 0


def run() -> None:
  """Console entry point (``gigrl-sweep``)."""
  sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
  run()
