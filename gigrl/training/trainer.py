"""The training loop: SFT warm-start, then RL steps; the cadence of logs, samples, evaluation
and checkpoints; SIGTERM / Ctrl-C; resume.

An RL step (:meth:`Trainer.rl_step`) reads top to bottom as the data flow, one stage per
package: sample prompts (:mod:`gigrl.data.pool`), roll out with search, each host reducing its
rows to rewards (:mod:`gigrl.rollout.hosts`, :mod:`gigrl.rollout.reward`), advantages
(:mod:`gigrl.advantages.inputs`), update (:mod:`gigrl.update.step`), log
(:mod:`gigrl.training.metrics`). The run's setup is in :mod:`gigrl.training.build`, its
checkpoints in :mod:`gigrl.training.resume`, its held-out evaluation in
:mod:`gigrl.training.evaluator`.

Determinism: every random draw is a pure function of (seed, step): rollout keys are
``fold_in(key, step)``, SFT batches come from a seeded permutation, and the query pool's numpy
generator state is checkpointed. A resumed run therefore repeats an uninterrupted one bitwise on
CPU (see docs/architecture.md, "Resume").
"""
from __future__ import annotations

import functools
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from tqdm import tqdm

from gigrl import distributed
from gigrl import search as search_lib
from gigrl.advantages import inputs as adv_inputs
from gigrl.data import copy_task
from gigrl.rollout import progress
from gigrl.rollout import trajectory as traj_lib
from gigrl.training import build
from gigrl.training import evaluator as evaluator_lib
from gigrl.training import metrics as metrics_lib
from gigrl.training import overlap
from gigrl.training import resume
from gigrl.training import sampler_process
from gigrl.training import state as state_lib
from gigrl.training import stop as stop_lib
from gigrl.training import warmup
from gigrl.update import batch as batch_lib
from gigrl.update import step as update_lib

NonFiniteError = stop_lib.NonFiniteError      # raised by run(); gigrl-train reports it


def _log(msg: str) -> None:
  tqdm.write(f"[gigrl] {msg}", file=sys.stderr)


class Trainer:
  """One run: builds everything from the config, then :meth:`run` loops over the steps."""

  def __init__(self, cfg: ml_collections.ConfigDict, workdir: str | epath.PathLike):
    self.cfg, self.workdir = cfg, epath.Path(workdir)
    # multi-host: every process runs this same program on its own rows (SPMD); process 0
    # alone writes the run's files.
    self.out = metrics_lib.RunOutputs(self.workdir, enabled=distributed.is_main())
    self.data = build.load_data(cfg, self.workdir)
    _log(f"data: {len(self.data.train)} train / {len(self.data.eval)} eval questions")
    self.tokenizer = self.data.tokenizer
    self.policy = build.build_policy(cfg, self.tokenizer.vocab_size, self.tokenizer)
    build.check_rows_fit_mesh(cfg, self.policy.mesh)
    _log(f"model: {self.policy.describe()}")
    self.steps = build.build_steps(cfg, self.policy)
    self.adv_cfg, self.adv_fn, adv_state = build.build_advantages(cfg)
    self.retriever = search_lib.make_retriever(cfg.search)
    self.settings = build.rollout_settings(cfg)
    self.engine = build.rl_engine(cfg, self.policy, self.tokenizer, self.retriever)
    self.rl_questions = build.rl_questions(cfg.train, self.data.train, cfg.seed)
    self.pool = build.query_pool(cfg, len(self.rl_questions))
    self.sampler = None    # created at the first RL step (training.overlap / sampler_process)
    self.checkpoints = resume.RunCheckpoints(cfg, self.policy, self.pool, self.workdir, _log)
    self.evaluator = evaluator_lib.Evaluator(cfg, self.policy, self.tokenizer, self.retriever,
                                             self.data.eval, self.out, _log)
    params = self.policy.params
    # ref_params is None until RL starts (the checkpoint stores the params in its slot).
    self.state = state_lib.TrainState(
        params=params, opt_state=self.steps.init_opt(self.steps.sft_tx, params),
        ref_params=None, adv_state=adv_state, step=0, pool=self.pool.state_dict())

  # ------------------------------------------------------------------ loop
  def run(self) -> None:
    """Trains to ``train.sft_steps + train.num_steps`` steps (resuming if possible), then
    evaluates on held-out questions and plots the metrics."""
    cfg, ckpts = self.cfg, self.checkpoints
    sft_steps, total = cfg.train.sft_steps, cfg.train.sft_steps + cfg.train.num_steps
    self.state = ckpts.restore(self.state)
    start, fresh_init = self.state.step, bool(ckpts.initialized_from)
    # a fresh start (no checkpoint of its own, train.init_from or not) drops every old line,
    # a start-of-run eval line included
    self.out.truncate_metrics_after(start if start and not fresh_init else -1)
    bar = tqdm(total=total, initial=start, desc="gigrl", unit="step", dynamic_ncols=True)
    try:
      self.stopped = False
      # the rollout's turns (and the update's micro-batches) show on the bar within a step
      with stop_lib.StopSignals(_log) as stop, progress.reporting(
          lambda msg: bar.set_postfix_str(msg, refresh=True)):
        demos = build.sft_demonstrations(cfg, self.data.train, self.tokenizer, self.retriever,
                                         self.settings, _log) if start < sft_steps else None
        warmup.set_up_engines(self)    # the shape grid, which the warm-up compiles (or not)
        first = warmup.warm_up(self, start, demos, _log)   # every program, before step 1
        if (start == 0 or fresh_init) and self.evaluator.due(start):
          # the initial policy: no SFT, or train.init_from's (whose own evaluation of the same
          # params is reused when it fits)
          reused = ckpts.source_eval(start) if start == sft_steps else None
          self.evaluator.periodic(start, self.state.params, reused)
        for step in range(start + 1, total + 1):
          if step <= sft_steps:
            record = self.sft_step(step, demos)
          else:
            if step == sft_steps + 1:
              self._begin_rl()
            try:
              record = self.rl_step(step)
            except sampler_process.SamplerError:
              ckpts.keep_rl_progress(self.state)
              raise
          self.state = self.state.replace(step=step)
          nonfinite_in_a_row = record.pop("_nonfinite_consecutive", 0)
          record, first = {**record, **first}, {}
          self.out.write_metrics(record)
          stop_lib.check_finite(step, nonfinite_in_a_row, cfg.train.max_consecutive_nonfinite,
                                record, ckpts.ckpt.steps)
          if self.evaluator.due(step):   # before the checkpoint, so a resume never misses it
            with overlap.paused(self.sampler):
              self.evaluator.periodic(step, self.state.params)
          bar.update(1)
          bar.set_postfix({k: f"{record[k]:.3g}" for k in ("loss", "reward_mean")
                           if isinstance(record.get(k), float)})
          saved = step % cfg.checkpoint.every_steps == 0 or step == total
          if saved:
            ckpts.save(self.state, record["phase"])
          # Every process stops after the same step when any got SIGTERM / Ctrl-C (an
          # all-reduce of one bit; a preemption notice reaches hosts at different times).
          if distributed.any_process(stop.name is not None):
            if not saved:
              ckpts.save(self.state, record["phase"], force=True)
            ckpts.ckpt.wait()
            why = stop.name or "stop requested on another process"
            _log(f"{why}: checkpoint at step {step} written; exiting")
            self.stopped = True
            break
        ckpts.ckpt.wait()
        overlap.close(self.sampler)
        if not self.stopped and cfg.train.eval_questions:
          self.evaluator.final(total, self.state.params, self.workdir)
      self.out.plot()
    finally:
      error = sys.exc_info()[1]
      overlap.close(self.sampler, error)   # a sampler process hears of a failure
      bar.close()
      distributed.lost_process(error)   # another process gone: close() cannot wait
      ckpts.ckpt.close()

  def _begin_rl(self) -> None:
    """Freezes the reference policy and switches to the RL optimizer."""
    params = self.state.params
    # LoRA: no copy; the reference is the base with the adapters off (update.step.rl_loss)
    ref = None if self.policy.lora.enabled else state_lib.copy(params)
    self.state = self.state.replace(
        ref_params=ref, opt_state=self.steps.init_opt(self.steps.rl_tx, params))

  def _put(self, x: np.ndarray) -> jax.Array:
    """Global rows (the same on every process) -> a batch-sharded global array."""
    return build.put_global_rows(self.policy.mesh, x)

  # ------------------------------------------------------------------ SFT
  @functools.cached_property
  def _copy_ids(self) -> np.ndarray:
    """The tokenizer's ordinary pieces (:func:`copy_task.ordinary_ids`), on first use."""
    return copy_task.ordinary_ids(self.tokenizer)

  def sft_step(self, step: int, demos: traj_lib.TrajectoryBatch) -> dict[str, Any]:
    """One supervised step on demonstration (or copying) rows; its metrics line."""
    tok, msk, lengths = batch_lib.sft_batch(demos, self.cfg.train, self.cfg.seed, step,
                                            lambda: self._copy_ids)
    tokens, mask = self._put(tok), self._put(msk)
    t0 = time.perf_counter()
    params, opt_state, m = self.steps.sft_step(self.state.params, self.state.opt_state,
                                               tokens, mask)
    m = update_lib.host_metrics(m)
    dt = time.perf_counter() - t0
    self.state = self.state.replace(params=params, opt_state=opt_state)
    # The RL-only fields are null on SFT steps, so every line has the same keys.
    return {"step": step, "phase": "sft", "reward_mean": None, "em": None,
            "search_calls_mean": None, "zero_variance_frac": None, "kl": 0.0,
            "train/tokens_per_s": float(lengths.sum()) / dt,
            "rollout/tokens_per_s": None, "step_time_s": dt, **m}

  # ------------------------------------------------------------------ RL
  def _sampler(self, step: int):
    """The sampler of this run's RL steps, from ``step``: :mod:`gigrl.training.overlap` (this
    process), or :mod:`gigrl.training.sampler_process` (``train.sampler_address``)."""
    self.sampler = self.sampler or sampler_process.for_trainer(self, step, _log)
    return self.sampler

  def rl_step(self, step: int) -> dict[str, Any]:
    """One RL step, stage by stage; its metrics line. Stages 1-3 (prompts, rollout, reward and
    the pool) are the sampler's (:func:`gigrl.training.overlap.sample_step`), this step's or,
    with ``train.max_staleness`` k >= 1, done ahead with params k versions old."""
    cfg, g, t_steps = self.cfg, self.cfg.data.group_size, self.settings.max_turns + 1
    t_step = time.perf_counter()
    r, wait_s = self._sampler(step).get(step)
    batch, rows, valid = r.batch, r.rows, r.valid
    # 4. advantages of the trained groups
    adv, adv_state, adv_m = adv_inputs.step_advantages(
        self.adv_fn, self.adv_cfg, self.state.adv_state, batch, r.rewards, rows, valid, t_steps,
        num_candidates=self.pool.num_candidates, row_arrays=r.row_arrays, owned=r.owned)
    # the pool as this step left it (ahead of it, the sampler's may hold in-flight queries)
    self.state = self.state.replace(adv_state=adv_state, pool=r.pool_state)
    # 5. update (PPO-clip + KL, epochs × mini-batches)
    mini_rows, micro_rows = build.ppo_rows(cfg)
    params, opt_state, update_m, t_train = update_lib.rl_update(
        self.steps, self.state.params, self.state.opt_state, self.state.ref_params, batch,
        rows, valid, adv, put=self._put, mini_batch_rows=mini_rows,
        micro_batch_rows=micro_rows, epochs=int(cfg.train.ppo_epochs), seed=int(cfg.seed),
        step=step, shuffle=bool(cfg.train.shuffle),
        trim_padding=bool(cfg.train.trim_update_padding),
        max_lm_positions=build.max_generated_tokens(cfg),
        pack=build.pack_width(cfg, self.settings.seq_len),
        pack_micro_rows=build.batch_axis_size(self.policy.mesh),
        behaviour=self.steps.behaviour)
    self.state = self.state.replace(params=params, opt_state=opt_state)
    self.sampler.publish(params, step - int(cfg.train.sft_steps))
    # 6. log
    record = metrics_lib.rl_record(
        step, batch, r.rewards, r.row_arrays.answered, update_metrics=update_m,
        advantage_metrics=adv_m, pool_metrics=r.pool_m, rollout_engine_metrics=r.rollout_m,
        search_metrics=r.search_m, trained_rows=rows.reshape(-1)[np.repeat(valid, g)],
        trained_groups=int(valid.sum()), times={
            "start": t_step if self.sampler.k else r.t_start, "rollout_s": r.t_roll,
            "update_s": t_train})
    if self.sampler.k:
      record.update(metrics_lib.staleness_metrics(step - 1 - int(cfg.train.sft_steps), r,
                                                  wait_s))
    if step % cfg.train.sample_every == 0:
      metrics_lib.write_samples(self.out, self.tokenizer, f"step_{step:06d}.txt", step, batch,
                                r.questions, r.rewards.reshape(-1), n=4, g=g)
    return record
