r"""``gigrl-compile``: prove the TPU programs of a config fit, without a TPU.

Usage::

  gigrl-compile --config configs/smoke.py --topology v5e-16 [--config.<section>.<field>=value ...]

By default (``--programs run``) it compiles every program the run executes, the set a run's
warm-up compiles before step 1 (:func:`gigrl.training.aot.run_set`: the rollout's grid for the
RL step and the evaluation, the update and SFT widths, the helpers), and prints for each its
per-device bytes against the chip's HBM and the host's compile seconds, then the totals
(``--stages`` picks stages, ``--results FILE`` keeps each report as it is compiled and resumes a
long set). ``--programs rl_step,decode,...`` instead compiles one program of each named kind at
full shape, with FLOPs and a roofline estimate (:func:`gigrl.training.aot.compile_programs`).
It exits 1 naming every program that does not fit (0 when all fit). Topology names: ``v5e-16``
(Cloud accelerator type) or ``v5e:4x4`` (chip grid).
"""
from __future__ import annotations

import os
import sys

def fail(message: str, status: int = 2) -> None:
  """Prints ``gigrl-compile: error: <message>`` (one line) on stderr and exits."""
  print(f"gigrl-compile: error: {' | '.join(str(message).splitlines())}", file=sys.stderr,
        flush=True)
  sys.exit(status)


def main(argv: list[str]) -> None:
  from gigrl.cli import train as train_cli
  from gigrl.training import aot
  from gigrl.config_utils import UserError
  if len(argv) > 1:
    fail(f"unexpected arguments: {' '.join(argv[1:])}")
  flags = train_cli.FLAGS
  if not flags.topology:
    fail("--topology is required, e.g. --topology v5e-16 (see --help)")
  try:
    aot.parse_topology(flags.topology)
  except aot.CompileError as e:
    fail(str(e))
  progs = [p.strip() for p in flags.programs.split(",") if p.strip()]
  print(aot.summary([], flags.topology).split("\n")[0], flush=True)
  log = lambda s: print(s, flush=True)  # noqa: E731
  try:
    if progs == ["run"]:
      stages = [s.strip() for s in flags.stages.split(",") if s.strip()]
      reports = aot.compile_run(flags.config, flags.topology, stages, log=log,
                                results=flags.results)
    else:
      print(aot.HEADER, flush=True)
      reports = aot.compile_programs(flags.config, flags.topology, progs, log=log)
  except (UserError, aot.CompileError) as e:
    fail(str(e))
  over = [getattr(r, "name", None) or f"{r.stage} {r.label}" for r in reports if not r.fits]
  if over:
    fail(f"{', '.join(over)} {'does' if len(over) == 1 else 'do'} not fit in "
         f"{reports[0].hbm / aot.GiB:.1f} GiB per device on {flags.topology}", status=1)
  print(f"gigrl-compile: all {len(reports)} programs fit on {flags.topology}")


def run() -> None:
  """Console entry point (``gigrl-compile``)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")   # before jax is imported: no TPU here
  from gigrl.training import aot
  aot.libtpu_env()
  from absl import app
  from absl import flags as absl_flags

  from gigrl.cli import train as train_cli   # defines --config (and --workdir, unused here)
  absl_flags.DEFINE_string("topology", None, "TPU slice, e.g. v5e-16, v5p-8, v6e-8, v5e:4x4")
  absl_flags.DEFINE_string("programs", "run",
                           "run (every program the run executes), or a comma-separated subset "
                           f"of {', '.join(aot.PROGRAMS)} (one full-shape program each)")
  absl_flags.DEFINE_string("stages", ",".join(aot.RUN_STAGES),
                           f"--programs run: a comma-separated subset of "
                           f"{', '.join(aot.RUN_STAGES)}")
  absl_flags.DEFINE_string("results", "", "--programs run: a JSON-lines file each program's "
                           "report is appended to; programs already in it are not compiled again")

  def parse(argv):
    if any(a in ("-h", "--help", "-help") for a in argv[1:]):
      print((__doc__ or "").strip().replace("``", ""))
      print((aot.__doc__ or "").strip().split("\n\n", 1)[1].replace("``", ""))
      print("\nFlags: --config FILE, --topology NAME, --programs run|LIST, --stages LIST, "
            "--results FILE, --config.<field>=value")
      sys.exit(0)
    return train_cli.parse_flags(argv)

  app.run(main, flags_parser=parse)


if __name__ == "__main__":
  run()
