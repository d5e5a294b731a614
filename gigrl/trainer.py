"""The training loop: SFT warm-start, then RL steps; the cadence of logs, samples, eval and
checkpoints; SIGTERM / Ctrl-C; resume.

The pieces live elsewhere: setup in :mod:`gigrl.build`, the state in :mod:`gigrl.train_state`,
the jitted steps in :mod:`gigrl.update` (losses in :mod:`gigrl.loss`), the RL step's host glue
in :mod:`gigrl.rl_batch`, evaluation in :mod:`gigrl.evaluate`, files in :mod:`gigrl.metrics`.

Determinism: every random draw is a pure function of (seed, step): rollout keys are
``fold_in(key, step)``, SFT batches come from a seeded permutation, and the query pool's numpy
generator state is checkpointed. A resumed run therefore repeats an uninterrupted one bitwise on
CPU (see docs/architecture.md, "Resume").
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from tqdm import tqdm

from gigrl import build
from gigrl import checkpoint as ckpt_lib
from gigrl import distributed
from gigrl import evaluate as evaluate_lib
from gigrl import metrics as metrics_lib
from gigrl import rl_batch
from gigrl import search as search_lib
from gigrl import train_state as state_lib
from gigrl import update as update_lib
from gigrl.config_utils import ConfigError
from gigrl.data import copy_task
from gigrl.data import pool as pool_lib
from gigrl.data import qa as qa_lib
from gigrl.models import lora as lora_lib
from gigrl.rollout import demos as demos_lib
from gigrl.rollout import trajectory as traj_lib


def _log(msg: str) -> None:
  tqdm.write(f"[gigrl] {msg}", file=sys.stderr)


def _rl_questions(t, train: list) -> list:
  """The questions RL samples: all training questions, or (``train.rl_skip_sft_questions``)
  those after the first ``train.sft_questions``, which the warm-start never demonstrated.

  Raises:
    ConfigError: naming ``train.rl_skip_sft_questions`` when that leaves no question.
  """
  if not t.rl_skip_sft_questions:
    return train
  rest = train[int(t.sft_questions):]
  if not rest:
    raise ConfigError(
        "train.rl_skip_sft_questions", True,
        f"False, or train.sft_questions ({t.sft_questions}) below the {len(train)} training "
        "questions: no question is left for RL")
  return rest


class NonFiniteError(RuntimeError):
  """Too many consecutive updates had a NaN/Inf loss or gradient."""


class _StopSignals:
  """SIGTERM (preemption) and SIGINT (Ctrl-C) request a checkpoint and a clean exit.

  A second Ctrl-C interrupts at once (KeyboardInterrupt). Handlers are installed only on the
  main thread (Python allows no other).
  """

  def __init__(self):
    self.name: str | None = None
    self._prev: dict[int, Any] = {}

  def __enter__(self) -> "_StopSignals":
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._prev[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame) -> None:
    del frame
    if self.name is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.name = signal.Signals(signum).name
    _log(f"{self.name}: finishing the current step, then checkpointing "
         "(Ctrl-C again to stop at once)")

  def __exit__(self, *exc) -> None:
    for sig, prev in self._prev.items():
      signal.signal(sig, prev)


class _ProcessShare:
  """A rollout engine over the global rows: each process rolls out (decodes, and searches for)
  only its contiguous share of ``questions``, then every process gets the whole batch back
  (:func:`gigrl.distributed.gather_batch`) with global metrics (counts summed; wall times and
  decode steps the slowest process's). One process: the engine itself.

  Questions are padded (repeating the last) to a multiple of the mesh's batch devices, so each
  process's rows split over its devices; the padding rows are dropped from the result.

  :meth:`run_rl` (the RL step) keeps each process's string work on its own rows: the rows'
  texts, anchors and action flags stay on their host, which reduces them to compact
  :class:`gigrl.rl_batch.RowArrays` (all-gathered), and :meth:`owned` gathers per-group values
  (the anchor ids) each from the host that holds the group.
  """

  # per-row lists that run_rl reduces on each host instead of gathering
  LOCAL_FIELDS = ("generated_text", "anchors", "action_valid")

  def __init__(self, engine, mesh: jax.sharding.Mesh):
    self.engine, self.mesh = engine, mesh
    # (this process's rollout rows, global index of the first, rows per process) of the last
    # run_rl; rows per process None = the batch is global (one process, or groups split)
    self._local: tuple[Any, int, int | None] | None = None

  def _padded(self, questions) -> list:
    multiple = int(np.lcm(jax.process_count(), build.batch_axis_size(self.mesh)))
    return list(questions) + [questions[-1]] * (-len(questions) % multiple)

  @staticmethod
  def _cut(batch, n: int):
    return dataclasses.replace(batch, **{
        f.name: getattr(batch, f.name)[:n] for f in dataclasses.fields(batch)
        if getattr(batch, f.name) is not None})

  @staticmethod
  def _reduce(metrics):
    # counts (tokens, callbacks, retriever requests) add up over processes; wall times and the
    # decode loop's step count (one loop over the global batch) are the slowest process's
    return distributed.reduce_metrics(
        metrics, maximum=[k for k in metrics if k.startswith("time/")
                          or k == "rollout/decode_steps"])

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
    padded = self._padded(questions)
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
    local, first, per = self._local
    x = group_fn(local, first)
    if per is None:
      return x
    return distributed.gather_owned(x, np.asarray(rows)[:, 0] // per)


def eval_due(train: Any, step: int) -> bool:
  """Whether the params after ``step`` updates are evaluated on held-out questions.

  ``train.eval_every``: at the start of RL (the last SFT step, or step 0), every
  ``eval_every`` RL steps after it, and at the last step. ``train.sft_eval_every``: also during
  the warm-start, at step 0 (the initial policy), every ``sft_eval_every`` SFT steps and at the
  end of SFT. Never when ``train.eval_questions`` is 0.

  Args:
    train: the config's ``train`` section.
    step: updates done (SFT steps count from 1, RL steps follow ``train.sft_steps``).
  """
  if not train.eval_questions:
    return False
  sft_due = bool(train.sft_eval_every) and step <= train.sft_steps and (
      step % train.sft_eval_every == 0 or step == train.sft_steps)
  rl = step - train.sft_steps
  rl_due = bool(train.eval_every) and rl >= 0 and (
      rl % train.eval_every == 0 or rl == train.num_steps)
  return sft_due or rl_due


# Config fields a held-out evaluation depends on (whole sections minus the keys in
# EVAL_IGNORED, which only RL sampling, the SFT data or LoRA's zero-initialised adapters read).
EVAL_FIELDS = ("data", "rollout", "search", "model", "train.eval_questions",
               "train.eval_batch_size")
EVAL_IGNORED = ("pool", "prompts_per_step", "group_size", "lora", "max_train_questions")


def _dotted(tree: dict[str, Any], field: str) -> Any:
  for part in field.split("."):
    tree = tree.get(part) if isinstance(tree, dict) else None
  return tree


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
    self.engine = _ProcessShare(
        build.build_engine(cfg, self.policy, self.tokenizer, self.retriever), self.policy.mesh)
    self.rl_questions = _rl_questions(cfg.train, self.data.train)
    p = cfg.data.pool
    self.pool = pool_lib.QueryPool(
        len(self.rl_questions), rule=p.rule, batch_size=cfg.data.prompts_per_step,
        oversample=p.oversample, success_threshold=p.success_threshold, seed=cfg.seed)
    self.ckpt = ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(self.workdir),
                                      keep=cfg.checkpoint.keep,
                                      async_save=cfg.checkpoint.async_save)
    params = self.policy.params
    # ref_params is None until RL starts (the checkpoint stores the params in its slot).
    self.state = state_lib.TrainState(
        params=params, opt_state=self.steps.init_opt(self.steps.sft_tx, params),
        ref_params=None, adv_state=adv_state, step=0, pool=self.pool.state_dict())
    self._initialized_from: str | None = None     # train.init_from, when it was used
    self._lora_base: str | None = None            # LoRA on a full run's params (init_from)

  # ------------------------------------------------------------------ checkpoints
  def _config_json(self) -> dict[str, Any]:
    return json.loads(self.cfg.to_json_best_effort())

  def _checkpointed(self, state: state_lib.TrainState) -> state_lib.TrainState:
    if self.policy.lora.enabled:
      # LoRA: the adapters (and their optimizer state) only; the frozen base is rebuilt from
      # model.hf_path / the preset, and the reference policy is that base (no slot).
      params, ref = self.policy.trained(state.params), None
    else:
      params = state.params
      ref = state.params if state.ref_params is None else state.ref_params
    # The advantage state is host / single-device data (the same on every process); orbax
    # saves only global arrays on several processes, so it is checkpointed replicated.
    return state.replace(params=params, ref_params=ref, pool=self.pool.state_dict(),
                         adv_state=build.replicated(self.policy.mesh, state.adv_state))

  def _with_base(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """A restored state's params: with LoRA, its adapters beside this run's frozen base."""
    if not self.policy.lora.enabled:
      return state
    _, frozen = lora_lib.split_trainable(self.policy.params, True)
    return state.replace(params=lora_lib.merge(state.params, frozen), ref_params=None)

  def _base_name(self) -> str:
    """What the LoRA adapters belong to: a full run's checkpoint (``train.init_from``), the
    checkpoint directory, or the preset and seed."""
    m = self.cfg.model
    return self._lora_base or (
        os.path.abspath(m.hf_path) if m.hf_path and os.path.isdir(m.hf_path) else
        m.hf_path or f"preset {m.preset}, seed {self.cfg.seed}")

  def _init_source(self) -> tuple[str, int | None] | None:
    """(workdir, step or None) of ``train.init_from``; None when it is not set.

    Raises:
      ConfigError: naming ``train.init_from`` when ``@step`` is not an integer.
    """
    value = self.cfg.train.init_from
    if not value:
      return None
    path, _, at = value.rpartition("@") if "@" in value else (value, "", "")
    if at and not at.isdigit():
      raise ConfigError("train.init_from", value, "'<workdir>' or '<workdir>@<step>'")
    return path, int(at) if at else None

  def _load_lora_base(self) -> None:
    """LoRA with ``train.init_from`` naming a full fine-tuning run (e.g. its SFT warm-start):
    that run's params become this run's frozen base, under fresh (B = 0) adapters."""
    source = self._init_source()
    if not (self.policy.lora.enabled and source):
      return
    meta = ckpt_lib.restore_meta(*source)
    if "lora_base" in meta:          # a LoRA run: its adapters continue on its own base
      return
    trained, frozen = lora_lib.split_trainable(self.policy.params, True)
    base, _ = ckpt_lib.restore_params(source[0], int(meta["step"]), frozen)
    self.policy.params = lora_lib.merge(trained, base)
    self.state = self.state.replace(params=self.policy.params)
    self._lora_base = f"train.init_from {os.path.abspath(source[0])}@{meta['step']}"
    _log(f"LoRA base: the params of {source[0]} step {meta['step']}")

  def _check_base(self, meta: dict[str, Any]) -> None:
    """ConfigError naming ``model.hf_path`` when a LoRA checkpoint's adapters were trained
    on another base than this run's."""
    saved = meta.get("lora_base")
    if self.policy.lora.enabled and saved is not None and saved != self._base_name():
      raise ConfigError("model.hf_path", self.cfg.model.hf_path,
                        f"the base the checkpoint's LoRA adapters belong to ({saved})")

  def _save(self, phase: str, force: bool = False) -> None:
    state = self._checkpointed(self.state)
    meta = {"phase": phase, "sft_steps_done": min(state.step, self.cfg.train.sft_steps),
            "ref_policy": ("the base with the LoRA adapters off" if self.policy.lora.enabled
                           else "params at the end of the SFT warm-start"),
            "config": self._config_json()}
    if self.policy.lora.enabled:
      meta["lora_base"] = self._base_name()
    # The async writer reads the arrays after save() returns, while the next train step
    # donates (frees) params and optimizer state: hand it device copies instead.
    self.ckpt.save(state_lib.copy(state), meta, force=force)

  def _restore(self) -> None:
    """Continues from the latest checkpoint, if any (see :meth:`Checkpointer.restore_latest`)."""
    config = self._config_json()
    self._load_lora_base()
    out = self.ckpt.restore_latest(self._checkpointed(self.state), config)
    if out is None:
      if self.cfg.train.init_from:
        self._init_from(self.cfg.train.init_from)
      return
    state, meta = out
    self._check_base(meta)
    state = self._with_base(state)
    changes = ckpt_lib.config_differences(meta.get("config") or {}, config)
    if changes:
      _log("config changed since the checkpoint was written: " + "; ".join(changes))
    self.pool.load_state_dict(state.pool)
    if state.step <= self.cfg.train.sft_steps or self.policy.lora.enabled:
      state = state.replace(ref_params=None)
    state = state.replace(adv_state=build.local_copy(state.adv_state))
    self.state = state
    _log(f"resumed from checkpoint step {state.step} ({meta.get('phase')})")

  def _init_from(self, value: str) -> None:
    """``train.init_from``: a new run starts at step ``train.sft_steps`` with the params of
    another run's checkpoint written at the end of its SFT (e.g. one warm-start shared by the
    RL runs of several estimators, ``gigrl-sweep --warm_start``). The RL optimizer, reference
    policy, pool and advantage state start fresh, as after this run's own SFT.

    Raises:
      ConfigError: naming ``train.init_from`` when ``@step`` is not an integer or the
        checkpoint is not at step ``train.sft_steps``.
      CheckpointError / StateMismatchError: no such checkpoint, or other model params.
    """
    path, at = self._init_source()
    if self._lora_base:    # LoRA on a full run's params: loaded as the base, adapters fresh
      params, meta = self.state.params, ckpt_lib.restore_meta(path, at)
    else:
      target = self._checkpointed(self.state).params      # the adapters alone with LoRA
      params, meta = ckpt_lib.restore_params(path, at, target)
      self._check_base(meta)
      params = self._with_base(self.state.replace(params=params)).params
    sft = int(self.cfg.train.sft_steps)
    if int(meta["step"]) != sft:
      raise ConfigError("train.init_from", value,
                        f"a checkpoint at the end of SFT (step train.sft_steps = {sft}); "
                        f"that one is at step {meta['step']} ({meta.get('phase')})")
    self.state = self.state.replace(params=params, step=sft)
    self._initialized_from = value
    _log(f"initialised from {path} step {sft} (params only; RL starts here)")

  # ------------------------------------------------------------------ loop
  def run(self) -> None:
    """Trains to ``train.sft_steps + train.num_steps`` steps (resuming if possible), then
    evaluates on held-out questions and plots the metrics."""
    cfg = self.cfg
    sft_steps, total = cfg.train.sft_steps, cfg.train.sft_steps + cfg.train.num_steps
    self._restore()
    start = self.state.step
    # a fresh start (no checkpoint of its own, train.init_from or not) drops every old line,
    # a start-of-run eval line included
    self.out.truncate_metrics_after(start if start and not self._initialized_from else -1)
    bar = tqdm(total=total, initial=start, desc="gigrl", unit="step", dynamic_ncols=True)
    try:
      stopped = False
      with _StopSignals() as stop:
        demos = self._demonstrations() if start < sft_steps else None
        if (start == 0 or self._initialized_from) and self._eval_due(start):
          self._periodic_eval(start)      # the initial policy: no SFT, or train.init_from's
          # (train.init_from's own evaluation of the same params is reused when it fits)
        for step in range(start + 1, total + 1):
          if step <= sft_steps:
            record = self._sft_step(step, demos)
          else:
            if step == sft_steps + 1:
              self._begin_rl()
            record = self._rl_step(step)
          self.state = self.state.replace(step=step)
          nonfinite_in_a_row = record.pop("_nonfinite_consecutive", 0)
          self.out.write_metrics(record)
          self._check_finite(step, nonfinite_in_a_row, record)
          if self._eval_due(step):      # before the checkpoint, so a resume never misses it
            self._periodic_eval(step)
          bar.update(1)
          bar.set_postfix({k: f"{record[k]:.3g}" for k in ("loss", "reward_mean")
                           if isinstance(record.get(k), float)})
          saved = step % cfg.checkpoint.every_steps == 0 or step == total
          if saved:
            self._save(record["phase"])
          # Every process stops after the same step when any got SIGTERM / Ctrl-C (an
          # all-reduce of one bit; a preemption notice reaches hosts at different times).
          if distributed.any_process(stop.name is not None):
            if not saved:
              self._save(record["phase"], force=True)
            self.ckpt.wait()
            why = stop.name or "stop requested on another process"
            _log(f"{why}: checkpoint at step {step} written; exiting")
            stopped = True
            break
        self.ckpt.wait()
        if not stopped and cfg.train.eval_questions:
          self._final_eval(total)
      self.out.plot()
    finally:
      bar.close()
      self.ckpt.close()

  def _begin_rl(self) -> None:
    """Freezes the reference policy and switches to the RL optimizer."""
    params = self.state.params
    # LoRA: no copy; the reference is the base with the adapters off (update.rl_loss)
    ref = None if self.policy.lora.enabled else state_lib.copy(params)
    self.state = self.state.replace(
        ref_params=ref, opt_state=self.steps.init_opt(self.steps.rl_tx, params))

  def _check_finite(self, step: int, n: int, record: dict[str, Any]) -> None:
    """Stops when ``train.max_consecutive_nonfinite`` (= n) updates in a row were skipped; the
    checkpoints written so far hold only finite updates."""
    if n >= self.cfg.train.max_consecutive_nonfinite:
      raise NonFiniteError(
          f"step {step}: {n} consecutive updates had a non-finite loss or gradient norm "
          f"(loss {record.get('loss')}, grad_norm {record.get('grad_norm')}); stopping. The "
          f"last checkpoint ({self.ckpt.steps()[-1:] or 'none'}) holds finite params; lower "
          "the learning rate (train.learning_rate / train.sft_learning_rate) and rerun")

  def _put(self, x: np.ndarray) -> jax.Array:
    """Global rows (the same on every process) -> a batch-sharded global array."""
    return build.put_global_rows(self.policy.mesh, x)

  @staticmethod
  def _update_metrics(m: dict[str, Any]) -> dict[str, Any]:
    """Train-step metrics as floats; the skip counters under their record names."""
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    out = {k: v for k, v in m.items() if not k.startswith("nonfinite_")}
    out["train/nonfinite_updates"] = m.get("nonfinite_updates", 0.0)
    out["_nonfinite_consecutive"] = int(m.get("nonfinite_consecutive", 0))
    return out

  # ------------------------------------------------------------------ SFT
  def _demonstrations(self) -> traj_lib.TrajectoryBatch:
    t = self.cfg.train
    qs = self.data.train[:t.sft_questions] if t.sft_questions else self.data.train
    builders = demos_lib.build_demonstrations(
        qs, self.tokenizer, self.retriever, self.settings,
        only_answer_in_obs=t.sft_only_answer_in_obs, counterfactuals=t.sft_counterfactuals,
        seed=self.cfg.seed)
    if not builders:
      raise ValueError("no SFT demonstrations (train.sft_only_answer_in_obs filtered all)")
    _log(f"SFT: {len(builders)} demonstrations")
    return traj_lib.collate(builders, self.settings.seq_len, self.tokenizer.pad_id)

  @functools.cached_property
  def _copy_ids(self) -> np.ndarray:
    """The tokenizer's ordinary pieces (:func:`copy_task.ordinary_ids`), on first use."""
    return copy_task.ordinary_ids(self.tokenizer)

  def _sft_step(self, step: int, demos: traj_lib.TrajectoryBatch) -> dict[str, Any]:
    t = self.cfg.train
    if step <= t.copy_steps:                  # synthetic copying sequences (data/copy_task)
      tok, msk = copy_task.copy_batch(self._copy_ids, t.copy_batch_size, t.copy_width,
                                      self.cfg.seed, step)
      lengths = (tok > 0).sum(axis=1)
    else:
      idx = rl_batch.sft_indices(demos.tokens.shape[0], t.sft_batch_size, self.cfg.seed, step)
      width = rl_batch.bucket(int(demos.lengths[idx].max()), self.settings.seq_len)
      tok, msk = demos.tokens[idx, :width], demos.loss_mask[idx, :width]
      lengths = demos.lengths[idx]
    tokens, mask = self._put(tok), self._put(msk)
    t0 = time.perf_counter()
    params, opt_state, m = self.steps.sft_step(self.state.params, self.state.opt_state,
                                               tokens, mask)
    m = self._update_metrics(m)
    dt = time.perf_counter() - t0
    self.state = self.state.replace(params=params, opt_state=opt_state)
    # The RL-only fields are null on SFT steps, so every line has the same keys.
    return {"step": step, "phase": "sft", "reward_mean": None, "em": None,
            "search_calls_mean": None, "zero_variance_frac": None, "kl": 0.0,
            "train/tokens_per_s": float(lengths.sum()) / dt,
            "rollout/tokens_per_s": None, "step_time_s": dt, **m}

  # ------------------------------------------------------------------ RL
  def _rl_step(self, step: int) -> dict[str, Any]:
    cfg, g, p = self.cfg, self.cfg.data.group_size, self.cfg.data.prompts_per_step
    t_start = time.perf_counter()
    if int((self.pool.weights > 0).sum()) < self.pool.num_candidates:
      # Too few active queries to fill a step: start a new pass over the data.
      _log(f"step {step}: query pool has fewer than {self.pool.num_candidates} active "
           f"queries; re-activating all {self.pool.num_queries}")
      self.pool.weights[:] = 1.0
    cands = self.pool.sample()
    questions = [self.rl_questions[int(i)] for i in cands]
    # Fixed rollout width (k·P groups) so the jitted rollout never recompiles; filler groups
    # repeat the last question and are dropped before the pool update.
    padded = questions + [questions[-1]] * (self.pool.num_candidates - len(questions))
    key = jax.random.fold_in(jax.random.key(cfg.seed), step)
    self.retriever.new_step()
    search_before = self.retriever.metrics()
    # Each process rolls out its own share of the rows (_ProcessShare) and reduces their
    # strings (answers, anchors, action flags) to compact arrays; the token arrays and those
    # arrays are then global on every process, so the pool decision, advantages and metrics
    # below are the same computation on every host (no decision to broadcast).
    t_steps = self.settings.max_turns + 1
    golden = [q.golden_answers for q in questions]
    batch, row_arrays, rmetrics = self.engine.run_rl(
        self.policy.rollout_params(self.state.params),
        [q.question for q in padded for _ in range(g)], key,
        lambda b, first: rl_batch.row_arrays(b, golden, g, t_steps, first_row=first), g)
    t_roll = time.perf_counter() - t_start
    rewards = row_arrays.rewards[:len(questions) * g].reshape(len(questions), g)
    accepted, pmetrics = self.pool.update(cands, rewards)
    rows, valid = rl_batch.train_rows(cands, accepted, p, g)
    grouping = build.anchor_grouping(self.adv_cfg)
    anchor_ids = None
    if grouping is not None:    # each host groups the anchors of the trained groups it holds
      anchor_ids = self.engine.owned(
          lambda b, first: rl_batch.group_anchor_ids(
              b, rows, t_steps, anchor_grouping=grouping,
              similarity_thresh=self.adv_cfg.gigpo_similarity_thresh, first_row=first), rows)
    inputs = rl_batch.advantage_inputs(
        batch, rewards, rows, valid, t_steps, anchor_grouping=grouping,
        similarity_thresh=self.adv_cfg.gigpo_similarity_thresh,
        num_candidates=self.pool.num_candidates,
        count_final_search=self.adv_cfg.stratified_count_final_search,
        row_arrays=row_arrays, anchor_ids=anchor_ids)
    adv, adv_state, ametrics = self.adv_fn(inputs, self.state.adv_state)
    self.state = self.state.replace(adv_state=adv_state)
    tokens, mask, tok_adv = rl_batch.train_batch(batch, rows, valid, np.asarray(adv))
    t1 = time.perf_counter()
    if valid.any():
      mini_rows, micro_rows = build.ppo_rows(cfg)
      params, opt_state, lm = update_lib.ppo_update(
          self.steps, self.state.params, self.state.opt_state, self.state.ref_params,
          tokens, mask, tok_adv, put=self._put, mini_batch_rows=mini_rows,
          epochs=int(cfg.train.ppo_epochs), micro_batch_rows=micro_rows, seed=int(cfg.seed),
          step=step, shuffle=bool(cfg.train.shuffle))
      lm = self._update_metrics(lm)
      self.state = self.state.replace(params=params, opt_state=opt_state)
    else:
      lm = {"loss": 0.0, "kl": 0.0, "pg_loss": 0.0}
    t_train = time.perf_counter() - t1
    gen_tokens = rmetrics["rollout/generated_tokens"]
    sel = rows.reshape(-1)[np.repeat(valid, g)]      # the trained groups' rows
    record = {
        "step": step, "phase": "rl",
        **rl_batch.rollout_metrics(batch, rewards, row_arrays.answered),
        "loss": lm.get("loss", 0.0), "kl": lm.get("kl", 0.0),
        "train/tokens_per_s": (float(batch.lengths[sel].sum()) / t_train
                               if valid.any() else 0.0),
        "rollout/tokens_per_s": gen_tokens / max(t_roll, 1e-9),
        "response_tokens_mean": gen_tokens / len(batch.lengths),
        "trained_groups": int(valid.sum()),
        "step_time_s": time.perf_counter() - t_start,
        "time/rollout_s": t_roll, "time/update_s": t_train,
        **{k: v for k, v in lm.items() if k not in ("loss", "kl")},
        # the advantage's own zero-variance share covers the trained groups only
        **{("adv/" + k if k == "zero_variance_frac" else k): float(v)
           for k, v in jax.device_get(ametrics).items()},
        **{k: float(v) for k, v in pmetrics.items()},
        **{k: float(v) for k, v in rmetrics.items()},
        **({} if anchor_ids is None else
           {"gigpo/anchor_group_frac": rl_batch.anchor_group_frac(inputs)}),
        # this step's search counters (the retriever's counters are cumulative)
        **{f"search/{k}": v for k, v in distributed.reduce_metrics(
            {k: float(v - search_before.get(k, 0))
             for k, v in self.retriever.metrics().items()}).items()},
    }
    if step % cfg.train.sample_every == 0:
      self._write_samples(f"step_{step:06d}.txt", step, batch, questions,
                          rewards.reshape(-1), n=4, g=g)
    return record

  # ------------------------------------------------------------------ outputs
  def _write_samples(self, name: str, step: int, batch: traj_lib.TrajectoryBatch,
                     questions, rewards, *, n: int, g: int) -> None:
    rows = list(range(min(n, len(batch.lengths), len(questions) * g)))
    texts = [self.tokenizer.decode(batch.tokens[i, :batch.lengths[i]][
        np.argmax(batch.loss_mask[i] > 0):]) for i in rows]
    self.out.write_samples(name, step, [questions[i // g].question for i in rows],
                           [questions[i // g].golden_answers for i in rows],
                           [float(rewards[i]) for i in rows], texts,
                           [int(batch.search_calls[i]) for i in rows])

  # ------------------------------------------------------------------ evaluation
  def _eval_questions(self) -> list[Any]:
    """The held-out questions every evaluation of the run uses (spread over the sorted eval
    split, so each data source and hops count keeps its share)."""
    return evaluate_lib.select(self.data.eval, self.cfg.train.eval_questions)

  def _eval_due(self, step: int) -> bool:
    return eval_due(self.cfg.train, step) and bool(self.data.eval)

  def _evaluate(self, step: int):
    """Greedy rollouts of the current params on :meth:`_eval_questions` (cached per step)."""
    if getattr(self, "_last_eval", (None,))[0] == step:
      return self._last_eval
    if getattr(self, "_eval_engine", None) is None:
      self._eval_engine = _ProcessShare(build.build_engine(
          self.cfg, self.policy, self.tokenizer, self.retriever, greedy=True), self.policy.mesh)
      d = self.cfg.data
      files = ([d.questions_file] if d.questions_file else
               [os.path.join(qa_lib.bundled_dir(), f) for f in qa_lib.BUNDLED_QUESTION_FILES])
      self._hops = evaluate_lib.question_hops(files)
    qs = self._eval_questions()
    _log(f"step {step}: evaluating {len(qs)} held-out questions (greedy rollouts) ...")
    t0 = time.perf_counter()
    results, metrics, batch = evaluate_lib.evaluate(
        self._eval_engine, self.policy.rollout_params(self.state.params), qs,
        jax.random.key(0), hops=self._hops, batch_size=int(self.cfg.train.eval_batch_size),
        log=lambda msg: _log(f"step {step}: eval {msg}"))
    self._last_eval = (step, qs, results, {**metrics, "eval/time_s":
                                           time.perf_counter() - t0}, batch)
    return self._last_eval

  def _source_eval(self, step: int) -> dict[str, Any] | None:
    """``train.init_from``'s own held-out evaluation of the params this run starts from, when
    every config field the evaluation depends on (``EVAL_FIELDS``) is the same: greedy
    rollouts of the same params on the same questions give the same metrics (the eval key is
    fixed, the run's seed plays no part). Read from that run's ``metrics.jsonl`` eval line or
    ``eval.json`` at ``step``; None when there is none or a field differs."""
    source = self._init_source()
    if not source or not self._initialized_from or self._lora_base:
      return None
    meta = ckpt_lib.restore_meta(*source)
    theirs, mine = meta.get("config") or {}, self._config_json()
    for field in EVAL_FIELDS:
      a, b = _dotted(theirs, field), _dotted(mine, field)
      if isinstance(a, dict) and isinstance(b, dict):
        a, b = ({k: v for k, v in d.items() if k not in EVAL_IGNORED} for d in (a, b))
      if a != b:
        return None
    workdir = epath.Path(source[0])
    rows = (metrics_lib.read_metrics(workdir / "metrics.jsonl")
            if (workdir / "metrics.jsonl").exists() else [])
    found = [r for r in rows if r.get("phase") == "eval" and r["step"] == step]
    if not found and (workdir / "eval.json").exists():
      found = [json.loads((workdir / "eval.json").read_text())]
    found = [r for r in found if r.get("step") == step]
    return {k: v for k, v in found[-1].items() if k.startswith("eval/")} if found else None

  def _periodic_eval(self, step: int) -> None:
    """One ``phase: "eval"`` line in metrics.jsonl (``step`` = updates done)."""
    reused = self._source_eval(step) if step == self.cfg.train.sft_steps else None
    if reused is not None:
      self.out.write_metrics({"step": step, "phase": "eval", **reused})
      _log(f"step {step}: held-out EM {reused['eval/em']:.3f}{evaluate_lib.by_hop(reused)} "
           f"(the evaluation of train.init_from {self.cfg.train.init_from}: same params, "
           "questions and rollout settings)")
      return
    _, qs, results, metrics, batch = self._evaluate(step)
    self.out.write_metrics({"step": step, "phase": "eval", **metrics})
    self._write_samples(f"eval_{step:06d}.txt", step, batch, qs, [r.em for r in results],
                        n=8, g=1)
    _log(f"step {step}: held-out EM {metrics['eval/em']:.3f}{evaluate_lib.by_hop(metrics)} "
         f"(F1 {metrics['eval/f1']:.3f}, {metrics['eval/search_calls_mean']:.2f} searches)")

  def _final_eval(self, step: int) -> None:
    """Greedy rollouts on held-out questions (or, when ``train.eval_every`` evaluated this step
    already, that evaluation); writes eval.json and a sample file, and prints held-out EM at
    the start of RL and now when periodic evaluation ran."""
    if not self._eval_questions():
      return
    rows = (metrics_lib.read_metrics(self.out.metrics_path)
            if self.out.enabled and self.out.metrics_path.exists() else [])
    if self._eval_due(step):
      # The periodic evaluation of this step ran before its checkpoint (same params, greedy):
      # reuse it rather than roll out every held-out question again. Every process decides
      # alike (from the config), so none waits in a rollout the others skip.
      same = [r for r in rows if r.get("phase") == "eval" and r["step"] == step]
      metrics = {k: v for k, v in same[-1].items() if k.startswith("eval/")} if same else {}
      periodic = self.workdir / "samples" / f"eval_{step:06d}.txt"
      if self.out.enabled and periodic.exists():
        (self.workdir / "samples" / "eval_samples.txt").write_text(periodic.read_text())
    else:
      _, qs, results, metrics, batch = self._evaluate(step)
      self._write_samples("eval_samples.txt", step, batch, qs, [r.em for r in results], n=8,
                          g=1)
    if not metrics:                  # not the main process (it alone reads metrics.jsonl)
      return
    self.out.write_json("eval.json", {"step": step, **metrics})
    _log(f"eval on {int(metrics['eval/n'])} held-out questions: EM {metrics['eval/em']:.3f}"
         f"{evaluate_lib.by_hop(metrics)}")
    start = [r for r in rows
             if r.get("phase") == "eval" and r["step"] == self.cfg.train.sft_steps]
    if start and step > self.cfg.train.sft_steps:
      _log(f"held-out EM: {start[-1]['eval/em']:.3f}{evaluate_lib.by_hop(start[-1])} at the "
           f"start of RL (step {start[-1]['step']}) -> {metrics['eval/em']:.3f}"
           f"{evaluate_lib.by_hop(metrics)} at step {step}")
