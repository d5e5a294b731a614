"""Rollouts ahead of the update: asynchronous RL with bounded staleness (``train.max_staleness``).

An RL step has two halves. :func:`sample_step` is the sampler's: sample prompts from the query
pool, roll out with search, reward, and apply the pool's rule (accept, consume, recycle). The
trainer's half (:meth:`gigrl.training.trainer.Trainer.rl_step`) computes the advantages and the
update. :func:`schedule` decides when the sampler's half of step ``s`` runs and with which
params:

* ``max_staleness = 0`` (:class:`Synchronous`): synchronously, inside step ``s``, with the
  params the trainer has at that moment (version ``s - 1``). This is the loop as it always was,
  call for call.
* ``max_staleness = k >= 1`` (:class:`Sampler`): in a background thread, ahead of the trainer,
  with the params of version ``max(0, s - 1 - k)``, exactly (verl's ``one_step_off_policy`` for
  k = 1): the batch of step ``s`` is trained on by version ``s - 1``, so every row is exactly
  ``min(k, s - 1)`` versions stale, and a run is as deterministic as a synchronous one. While the
  trainer updates, the sampler generates the next k steps' rollouts.

Versions count RL updates: version 0 is the params RL starts from, version v the params after
v updates. The trainer publishes each version (:meth:`Sampler.publish`); with k >= 1 that is a
device copy, since the next update donates the trainer's buffers. The sampler keeps the versions
it still needs and drops the rest.

The query pool is touched only by the sampler, in step order, so a query is consumed once and
a recycled query is never in flight twice. Each :class:`Rollout` carries the pool's state just
after its own update; the trainer checkpoints that snapshot with the step it trains, so a
resumed run puts the queries of rollouts that were in flight (sampled, not yet trained) back in
the pool and samples them again: none is trained twice, none is lost. After a resume the first
k steps are sampled by the restored version (staleness below k; the older versions are not in
the checkpoint).

Evaluations share the retriever with the sampler; :meth:`Sampler.paused` holds the sampler
between two steps while the trainer evaluates.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from gigrl import distributed
from gigrl.advantages import inputs as adv_inputs
from gigrl.config_utils import ConfigError
from gigrl.data import pool as pool_lib
from gigrl.training import state as state_lib
from gigrl.update import batch as batch_lib


@dataclasses.dataclass
class Rollout:
  """The sampler's half of one RL step.

  Attributes:
    step: the run's step it is for; version: the params version that sampled it.
    cands: i64[C] candidate pool ids; questions: their questions; batch: the
      :class:`~gigrl.rollout.trajectory.TrajectoryBatch` (behaviour log-probs included);
      row_arrays: :func:`gigrl.advantages.inputs.row_arrays`; rewards: f32[C, G].
    rows: i32[P, G] trained rows; valid: bool[P] trained groups (the pool's acceptance).
    rollout_m, pool_m, search_m: the engine's, the pool's and the retriever's metrics.
    owned: :meth:`gigrl.rollout.hosts.ProcessShare.owned` of this rollout's rows.
    pool_state: :meth:`QueryPool.state_dict` just after this step's pool update.
    t_start: ``perf_counter`` when sampling began; t_roll: seconds of the rollout;
    idle_s: seconds the sampler waited for the params of ``version`` before it.
  """
  step: int
  version: int
  cands: np.ndarray
  questions: list
  batch: Any
  row_arrays: Any
  rewards: np.ndarray
  rows: np.ndarray
  valid: np.ndarray
  rollout_m: dict
  pool_m: dict
  search_m: dict
  owned: Callable
  pool_state: dict
  t_start: float
  t_roll: float
  idle_s: float = 0.0


def sample_step(t, step: int, params, version: int, log: Callable[[str], None]) -> Rollout:
  """The sampler's half of RL step ``step`` with ``params`` (training layout) of ``version``.

  Args:
    t: the :class:`~gigrl.training.trainer.Trainer` (its pool, engine, retriever, questions).
  Returns:
    the :class:`Rollout`.
  """
  cfg, g, t_steps = t.cfg, t.cfg.data.group_size, t.settings.max_turns + 1
  t_start = time.perf_counter()
  # 1. sample prompts (the query pool; filler groups keep the rollout's width fixed)
  cands, questions, padded = pool_lib.sample_prompts(
      t.pool, t.rl_questions, lambda msg: log(f"step {step}: {msg}"))
  # 2. roll out with search. Each process rolls out its own share of the rows and reduces
  #    their strings (rewards, anchors, action flags) to compact arrays; the token arrays and
  #    those arrays are then global on every process, so everything below is the same
  #    computation on every host (no decision to broadcast).
  key = jax.random.fold_in(jax.random.key(cfg.seed), step)
  t.retriever.new_step()
  search_before = t.retriever.metrics()
  golden = [q.golden_answers for q in questions]
  batch, row_arrays, rollout_m = t.engine.run_rl(
      t.policy.rollout_params(params), [q.question for q in padded for _ in range(g)], key,
      lambda b, first: adv_inputs.row_arrays(b, golden, g, t_steps, first_row=first), g)
  owned = t.engine.owned_now()
  t_roll = time.perf_counter() - t_start
  # 3. reward: exact match per rollout (row_arrays), f32[C, G]; the pool keeps or recycles
  rewards = row_arrays.rewards[:len(questions) * g].reshape(len(questions), g)
  accepted, pool_m = t.pool.update(cands, rewards)
  rows, valid = batch_lib.train_rows(cands, accepted, cfg.data.prompts_per_step, g)
  search_m = distributed.reduce_metrics({   # this step's (the counters are cumulative)
      k: float(v - search_before.get(k, 0)) for k, v in t.retriever.metrics().items()})
  return Rollout(step=step, version=version, cands=cands, questions=questions, batch=batch,
                 row_arrays=row_arrays, rewards=rewards, rows=rows, valid=valid,
                 rollout_m=rollout_m, pool_m=pool_m, search_m=search_m, owned=owned,
                 pool_state=t.pool.state_dict(), t_start=t_start, t_roll=t_roll)


def for_trainer(t, step: int, log: Callable[[str], None]) -> "Synchronous | Sampler":
  """The :func:`schedule` of trainer ``t``'s RL steps from ``step`` on (its params now are the
  version ``step - 1 - train.sft_steps``).

  Raises:
    ConfigError: naming ``train.max_staleness`` when k >= 1 on several processes (each would
      issue the sampler's and the trainer's programs in its own order: a sampler process,
      ``train.sampler_address``, serves that case).
  """
  cfg = t.cfg
  k = int(cfg.train.max_staleness)
  if k and jax.process_count() > 1:
    raise ConfigError("train.max_staleness", k, "0 on several processes without "
                      "train.sampler_address (the sampler thread serves a one-process trainer; a "
                      "sampler process serves a trainer on any number of processes)")
  sft = int(cfg.train.sft_steps)
  return schedule(lambda s, params, v: sample_step(t, s, params, v, log), max_staleness=k,
                 first_rl_step=step, last_step=sft + int(cfg.train.num_steps), sft_steps=sft,
                 params=t.state.params, version=step - 1 - sft, copy=state_lib.copy)


def paused(sampler: "Synchronous | Sampler | None"):
  """:meth:`Sampler.paused`, or nothing when there is no sampler yet."""
  return contextlib.nullcontext() if sampler is None else sampler.paused()


def close(sampler: "Synchronous | Sampler | None", error: BaseException | None = None) -> None:
  """:meth:`Sampler.close` when there is one. ``error``: the exception the trainer is exiting
  with, if any (a sampler process is then told that the trainer failed, not that it is done)."""
  if sampler is not None:
    sampler.close(error)


class Stopped(Exception):
  """:meth:`Sampler.get` after :meth:`Sampler.close`."""


def schedule(sample: Callable[[int, Any, int], Rollout], *, max_staleness: int,
             first_rl_step: int, last_step: int, sft_steps: int, params, version: int,
             copy: Callable[[Any], Any]) -> "Synchronous | Sampler":
  """The schedule of :func:`sample_step` for ``max_staleness = k``: :class:`Synchronous` for
  k = 0, else a :class:`Sampler` thread k steps ahead (module docstring).

  Args:
    sample: ``sample(step, params, version) -> Rollout``.
    max_staleness: k >= 0.
    first_rl_step: the run's first RL step of this process's run (version 0 samples it when RL
      starts here; after a resume, the restored params' version).
    last_step: the run's last step (the sampler stops after it).
    sft_steps: RL step ``s`` has version ``s - 1 - sft_steps`` before its update.
    params, version: the params the trainer starts RL with, and their version.
    copy: ``copy(params) -> params``, a device copy (the trainer's next update donates its own).
  """
  if not int(max_staleness):
    return Synchronous(sample, params=params, version=version)
  return Sampler(sample, max_staleness=max_staleness, first_rl_step=first_rl_step,
                 last_step=last_step, sft_steps=sft_steps, params=params, version=version,
                 copy=copy)


class Synchronous:
  """k = 0: each step is sampled inside the trainer's step, on its thread, by the params it has
  then (version ``step - 1 - sft_steps``): the loop as it always was, call for call. The
  interface of :class:`Sampler`."""
  k = 0

  def __init__(self, sample: Callable[[int, Any, int], Rollout], *, params, version: int):
    self.sample, self.current = sample, (params, int(version))

  def get(self, step: int) -> tuple[Rollout, float]:
    """Samples RL step ``step`` now; the trainer waited 0 s for it."""
    params, version = self.current
    return self.sample(step, params, version), 0.0

  def publish(self, params, version: int) -> None:
    """The trainer's params after its update ``version`` (kept, not copied)."""
    self.current = (params, int(version))

  def paused(self):
    """Nothing runs between two steps: a no-op context."""
    return contextlib.nullcontext()

  def close(self, error: BaseException | None = None) -> None:  # pylint: disable=unused-argument
    """Nothing to close."""


class Sampler:
  """Runs :func:`sample_step` for the trainer in a thread, up to ``max_staleness = k >= 1``
  steps ahead (module docstring); the arguments are :func:`schedule`'s.

  Raises:
    ValueError: when k < 1 (k = 0 is :class:`Synchronous`).
  """

  def __init__(self, sample: Callable[[int, Any, int], Rollout], *, max_staleness: int,
               first_rl_step: int, last_step: int, sft_steps: int, params, version: int,
               copy: Callable[[Any], Any], agree: Callable[[bool], bool] | None = None):
    if int(max_staleness) < 1:
      raise ValueError(f"max_staleness={max_staleness}: a Sampler samples ahead (k >= 1)")
    self.sample, self.k, self.sft_steps = sample, int(max_staleness), int(sft_steps)
    # a sampler on several processes: before each step, whether every process goes on
    # (``agree(go) -> all go``, a collective), so all sample it or none does
    self.agree = agree
    self.last_step, self.copy = int(last_step), copy
    self.next_step = int(first_rl_step)
    self.versions: dict[int, Any] = {int(version): copy(params)}   # copies still needed
    self.ready: dict[int, Rollout] = {}
    self.error: BaseException | None = None
    self.cond = threading.Condition()
    self.hold = threading.Lock()             # held by the sampler while it samples a step
    self.stopped = False
    self.thread = threading.Thread(target=self._loop, name="gigrl-sampler", daemon=True)
    self.thread.start()

  def version_for(self, step: int) -> int:
    """The params version that samples RL step ``step``: ``max(0, step - 1 - sft_steps - k)``."""
    return max(0, step - 1 - self.sft_steps - self.k)

  def _loop(self) -> None:
    try:
      while True:
        t0 = time.perf_counter()
        with self.cond:
          s = self.next_step
          if s > self.last_step or self.stopped:
            return
          oldest = min(self.versions)
          want = max(self.version_for(s), oldest)   # after a resume: the restored version
          self.cond.wait_for(lambda: self.stopped or want in self.versions)
          params = None if self.stopped else self.versions[want]
        if self.agree is not None and not self.agree(params is not None):
          return
        if params is None:
          return
        idle = time.perf_counter() - t0
        with self.hold:
          r = self.sample(s, params, want)
        r.idle_s = idle
        with self.cond:
          self.ready[s] = r
          self.next_step = s + 1
          # versions no later step needs (each later step needs version_for(step) or newer)
          for v in [v for v in self.versions if v < want]:
            del self.versions[v]
          self.cond.notify_all()
    except BaseException as e:  # pylint: disable=broad-except
      with self.cond:
        self.error = e
        self.cond.notify_all()

  def get(self, step: int) -> tuple[Rollout, float]:
    """RL step ``step``'s rollout, and the seconds the trainer waited for it.

    Raises:
      whatever the sampler thread raised; :class:`Stopped` when :meth:`close` ran first.
    """
    t0 = time.perf_counter()
    with self.cond:
      self.cond.wait_for(lambda: step in self.ready or self.error is not None or self.stopped)
      if self.error is not None:
        raise self.error
      if step not in self.ready:
        raise Stopped(f"the sampler was closed before step {step}")
      return self.ready.pop(step), time.perf_counter() - t0

  def publish(self, params, version: int) -> None:
    """The trainer's params after its update ``version`` (copied for the sampler)."""
    copy = self.copy(params)
    with self.cond:
      self.versions[int(version)] = copy
      self.cond.notify_all()

  @contextlib.contextmanager
  def paused(self):
    """Holds the sampler between two steps (for an evaluation, which shares the retriever)."""
    with self.hold:
      yield

  def stop(self) -> None:
    """Asks the sampler thread to stop after the step it is sampling (returns at once); a
    :meth:`get` waiting for a later step raises :class:`Stopped`."""
    with self.cond:
      self.stopped = True
      self.cond.notify_all()

  def close(self, error: BaseException | None = None) -> None:  # pylint: disable=unused-argument
    """Stops the sampler thread (a step it is sampling finishes first)."""
    self.stop()
    self.thread.join()
