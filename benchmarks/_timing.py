"""The one timing loop the benchmark scripts share."""
from __future__ import annotations

import time


def timed_runs(fn, repeats: int, warmup: int = 1):
  """Calls `fn` `warmup` times untimed (compilation), then `repeats` times timed.

  Returns:
    (wall seconds per run: list[float], process-CPU seconds per run: list[float],
    the last run's output). CPU time is the robust number on a shared machine when
    every side runs single-threaded: it does not count time spent descheduled.
  """
  for _ in range(warmup):
    fn()
  wall, cpu, out = [], [], None
  for _ in range(repeats):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  return wall, cpu, out
