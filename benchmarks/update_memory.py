"""The RL update's memory and time with and without ``model.remat``, side by side.

  python benchmarks/update_memory.py                                   # the engaged preset
  python benchmarks/update_memory.py --config configs/countries.py:smollm2-135m-short \
      --widths 256 --time_widths 256

For each of the run's update programs (the widths ``warmup.plan_run`` lists for the config,
``--widths`` to pick some), it compiles the program with ``model.remat=none`` and with each of
``--remat`` (default ``full``) and prints XLA's ``memory_analysis()`` for it: temporaries and
arguments (GiB; outputs alias the donated arguments), then the ratio of temporaries. For the
widths in ``--time_widths`` it also runs each program ``--repeats`` times (after one untimed
call) on arrays of the program's shapes (loss mask and advantages all ones, so every
micro-batch computes its backward) and prints the median seconds and their ratio.

The programs are the run's own (the trainer built from the config, its shardings and
micro-batches), so the figures are what ``gigrl-train`` executes on this host. Memory figures
come from the compiler, not from timings, and are the same on every run of one XLA version.
"""
from __future__ import annotations

import argparse
import os
import runpy
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (before jax: sets XLA_FLAGS from --threads)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30


def update_programs(config: str, remat: str, init_from: str):
  """{width: RunProgram} of the config's RL update programs with ``model.remat=remat``."""
  from gigrl.training import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import warmup  # pylint: disable=import-outside-toplevel
  path, _, name = config.partition(":")
  cfg = runpy.run_path(os.path.join(ROOT, path))["get_config"](name or None)
  cfg.model.remat = remat
  cfg.train.compile_cache = ""
  if init_from:
    cfg.train.init_from = init_from
  t = trainer_lib.Trainer(cfg, tempfile.mkdtemp(prefix="update_memory."))
  warmup.set_up_engines(t)
  out = {}
  for p in warmup.plan_run(t, int(cfg.train.sft_steps), None):
    if p.stage == "update":
      out[int(p.label.split(" tokens")[0].rsplit(" ", 1)[-1])] = p
  return out


def _inputs(lowered):
  """Arrays of the program's argument shapes: float [rows, W] arrays (loss mask, advantages,
  log-probs) all ones, everything else zeros."""
  args, kwargs = lowered.args_info
  assert not kwargs, kwargs

  def make(info):
    shape, dtype = info.shape, info.dtype
    ones = len(shape) == 2 and jnp.issubdtype(dtype, jnp.floating) and shape[1] > 8
    return (jnp.ones if ones else jnp.zeros)(shape, dtype)
  return jax.tree.map(make, args)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default="configs/countries.py:smollm2-135m-engaged")
  ap.add_argument("--init_from", default="", help="a warm-start (only its shapes matter)")
  ap.add_argument("--remat", default="full", help="comma-separated, against none")
  ap.add_argument("--widths", default="", help="comma-separated update widths (default all)")
  ap.add_argument("--time_widths", default="256", help="widths to also time ('' = none)")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--threads", type=int, default=1, help="XLA threads (1: pinned to one core)")
  a = ap.parse_args()
  settings = ["none"] + [r for r in a.remat.split(",") if r]
  timed = {int(w) for w in a.time_widths.split(",") if w}
  print(f"{a.config}: RL update programs on {jax.devices()[0].platform} "
        f"({os.cpu_count()} cores), jax {jax.__version__}", flush=True)
  rows = {}       # (width, remat) -> (temps, args, compile s, step s or None, label)
  for r in settings:                     # one trainer at a time: each holds a model and Adam
    progs = update_programs(a.config, r, a.init_from)
    widths = sorted(progs)
    if a.widths:
      widths = [w for w in widths if str(w) in a.widths.split(",")]
    for w in widths:
      t0 = time.perf_counter()
      lowered = progs[w].lower()
      compiled = lowered.compile()
      compile_s = time.perf_counter() - t0
      mem = compiled.memory_analysis()
      step = None
      if w in timed:
        secs = []
        for i in range(a.repeats + 1):
          args = _inputs(lowered)
          jax.block_until_ready(args)
          t0 = time.perf_counter()
          jax.block_until_ready(compiled(*args))
          if i:
            secs.append(time.perf_counter() - t0)
          del args
        step = statistics.median(secs)
      rows[(w, r)] = (mem.temp_size_in_bytes, mem.argument_size_in_bytes, compile_s, step,
                      progs[w].label)
      print(f"  {r}: {progs[w].label}: {mem.temp_size_in_bytes / GiB:.2f} GiB temporaries, "
            f"compiled in {compile_s:.0f} s" + (f", {step:.2f} s a step" if step else ""),
            flush=True)
      del compiled, lowered
    del progs
  print(f"{'width':>5} {'remat':>5} {'temps GiB':>9} {'args GiB':>8} {'temps/none':>10} "
        f"{'compile s':>9} {'step s':>7} {'step/none':>9}  program")
  for w in sorted({w for w, _ in rows}):
    base = rows.get((w, "none"))
    for r in settings:
      if (w, r) not in rows:
        continue
      temps, args, compile_s, step, label = rows[(w, r)]
      ratio = f"{temps / base[0]:10.2f}" if base else f"{'':>10}"
      st = f"{step:7.2f}" if step else f"{'':>7}"
      sr = f"{step / base[3]:9.2f}" if step and base and base[3] else f"{'':>9}"
      print(f"{w:>5} {r:>5} {temps / GiB:9.2f} {args / GiB:8.2f} {ratio} {compile_s:9.1f} "
            f"{st} {sr}  {label}")

if __name__ == "__main__":
  main()
