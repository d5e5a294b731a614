"""Rollouts over several processes (hosts): each rolls out its own share of the rows, and every
process gets the global batch back. One process: the engine itself.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from gigrl import distributed
from gigrl.rollout import host_loop


class ProcessShare:
  """A rollout engine over the global rows: each process rolls out (decodes, and searches for)
  only its contiguous share of ``questions``, then every process gets the whole batch back
  (:func:`gigrl.distributed.gather_batch`) with global metrics (counts summed; wall times and
  decode steps the slowest process's). One process: the engine itself.

  Questions are padded (repeating the last) to a multiple of the mesh's batch devices, so each
  process's rows split over its devices; the padding rows are dropped from the result.

  :meth:`run_rl` (the RL step) keeps each process's string work on its own rows: the rows'
  texts, anchors and action flags stay on their host, which reduces them to compact
  :class:`gigrl.update.batch.RowArrays` (all-gathered), and :meth:`owned` gathers per-group values
  (the anchor ids) each from the host that holds the group.
  """

  # per-row lists that run_rl reduces on each host instead of gathering
  LOCAL_FIELDS = ("generated_text", "anchors", "action_valid")

  def __init__(self, engine, rows_multiple: int):
    """``engine``: a :class:`gigrl.rollout.engine.RolloutEngine`; ``rows_multiple``: devices
    the batch dimension is split over (rows per process must divide by it)."""
    self.engine, self.rows_multiple = engine, int(rows_multiple)
    # (this process's rollout rows, global index of the first, rows per process) of the last
    # run_rl; rows per process None = the batch is global (one process, or groups split)
    self._local: tuple[Any, int, int | None] | None = None

  def _padded(self, questions, fill: Any = None) -> list:
    """``questions`` padded to a multiple of the processes and batch axes with ``fill`` (None:
    an empty row the engine never computes)."""
    multiple = int(np.lcm(jax.process_count(), self.rows_multiple))
    return list(questions) + [fill] * (-len(questions) % multiple)

  @staticmethod
  def _cut(batch, n: int):
    return dataclasses.replace(batch, **{
        f.name: getattr(batch, f.name)[:n] for f in dataclasses.fields(batch)
        if getattr(batch, f.name) is not None})

  @staticmethod
  def _reduce(metrics):
    # counts (tokens, callbacks, retriever requests) add up over processes; wall times and the
    # decode loop's step count (one loop over the global batch) are the slowest process's
    out = distributed.reduce_metrics(
        metrics, maximum=[k for k in metrics if k.startswith(("time/", "rollout/decode_steps"))])
    if "rollout/padding_frac" in out:       # a ratio: recomputed from the summed counts
      out["rollout/padding_frac"] = host_loop.padding_frac(out)
    return out

  def run(self, params, questions, key):
    if jax.process_count() == 1:
      return self.engine.run(params, questions, key)
    n = len(questions)
    padded = self._padded(questions)
    local, metrics = self.engine.run(params, padded[distributed.process_rows(len(padded))], key)
    batch = distributed.gather_batch(local)
    if len(padded) > n:
      batch = self._cut(batch, n)
    return batch, self._reduce(metrics)

  def run_rl(self, params, questions, key, row_fn, group_size: int):
    """Rolls out ``questions`` (G consecutive rows per group); ``row_fn(rows, first_row)``
    reduces a process's rows (global rows ``first_row + i``) to a NamedTuple of per-row arrays.

    Returns:
      (batch, row arrays, metrics): the global batch without the per-row string lists
      (:attr:`LOCAL_FIELDS` are None) when there are several processes, the global row arrays
      (first ``len(questions)`` rows). When a process's share is not whole groups, the whole
      batch is gathered and every process reduces every row (the one-process computation).
    """
    n = len(questions)
    if jax.process_count() == 1:
      batch, metrics = self.engine.run(params, questions, key)
      self._local = (batch, 0, None)
      return batch, row_fn(batch, 0), metrics
    padded = self._padded(questions, fill=questions[-1])   # (row_fn reads every row)
    share = distributed.process_rows(len(padded))
    local, metrics = self.engine.run(params, padded[share], key)
    per = share.stop - share.start
    if per % int(group_size):              # groups split between processes: the global path
      batch = self._cut(distributed.gather_batch(local), n)
      self._local = (batch, 0, None)
      return batch, row_fn(batch, 0), self._reduce(metrics)
    arrays = row_fn(local, share.start)
    arrays = type(arrays)(*(distributed.gather_rows(a)[:n] for a in arrays))
    batch = self._cut(distributed.gather_batch(local, skip=self.LOCAL_FIELDS), n)
    self._local = (local, share.start, per)
    return batch, arrays, self._reduce(metrics)

  def owned(self, group_fn, rows: np.ndarray) -> np.ndarray:
    """``group_fn(rows_of_this_process, first_row)`` -> [P, ...] values of the groups of
    ``rows`` (i32[P, G] global rollout rows) this process holds, gathered so each group's value
    comes from its host (after :meth:`run_rl`)."""
    return self._owned(self._local, group_fn, rows)

  def owned_now(self) -> Callable[[Any, np.ndarray], np.ndarray]:
    """:meth:`owned` of the last :meth:`run_rl`'s rows, kept for later (a rollout trained on
    after the next one has run: ``train.max_staleness``); picklable, so a sampler process can
    send it with its rollout (one process's share: the whole batch)."""
    return functools.partial(ProcessShare._owned, self._local)

  @staticmethod
  def _owned(local_share, group_fn, rows: np.ndarray) -> np.ndarray:
    local, first, per = local_share
    x = group_fn(local, first)
    if per is None:
      return x
    return distributed.gather_owned(x, np.asarray(rows)[:, 0] // per)
