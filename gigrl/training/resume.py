"""Where a run's state comes from and goes to: its checkpoints (saved every
``checkpoint.every_steps`` and on SIGTERM, restored on resume), ``train.init_from`` (another
run's params at the end of its SFT), and with LoRA the frozen base the adapters belong to.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

from gigrl.config_utils import ConfigError
from gigrl.models import lora as lora_lib
from gigrl.training import build
from gigrl.training import checkpoint as ckpt_lib
from gigrl.training import evaluator as evaluator_lib
from gigrl.training import state as state_lib


class RunCheckpoints:
  """Saves and restores one run's :class:`~gigrl.training.state.TrainState` (the query pool's
  state with it)."""

  def __init__(self, cfg, policy, pool, workdir, log: Callable[[str], None]):
    self.cfg, self.policy, self.pool, self.log = cfg, policy, pool, log
    self.ckpt = ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(workdir), keep=cfg.checkpoint.keep,
                                      async_save=cfg.checkpoint.async_save)
    self.initialized_from: str | None = None     # train.init_from, when it was used
    self.lora_base: str | None = None            # LoRA on a full run's params (init_from)

  def config_json(self) -> dict[str, Any]:
    return json.loads(self.cfg.to_json_best_effort())

  def _saved(self, state: state_lib.TrainState) -> state_lib.TrainState:
    if self.policy.lora.enabled:
      # LoRA: the adapters (and their optimizer state) only; the frozen base is rebuilt from
      # model.hf_path / the preset, and the reference policy is that base (no slot).
      params, ref = self.policy.trained(state.params), None
    else:
      params = state.params
      ref = state.params if state.ref_params is None else state.ref_params
    # The advantage state is host / single-device data (the same on every process); orbax
    # saves only global arrays on several processes, so it is checkpointed replicated.
    # the pool as the state's last step left it (with train.max_staleness the sampler's live
    # pool is ahead, holding in-flight queries; a resume samples those again)
    pool = state.pool if state.pool else self.pool.state_dict()
    return state.replace(params=params, ref_params=ref, pool=pool,
                         adv_state=build.replicated(self.policy.mesh, state.adv_state))

  def _with_base(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """A restored state's params: with LoRA, its adapters beside this run's frozen base."""
    if not self.policy.lora.enabled:
      return state
    _, frozen = lora_lib.split_trainable(self.policy.params, True)
    return state.replace(params=lora_lib.merge(state.params, frozen), ref_params=None)

  def base_name(self) -> str:
    """What the LoRA adapters belong to: a full run's checkpoint (``train.init_from``), the
    checkpoint directory, or the preset and seed."""
    m = self.cfg.model
    return self.lora_base or (
        os.path.abspath(m.hf_path) if m.hf_path and os.path.isdir(m.hf_path) else
        m.hf_path or f"preset {m.preset}, seed {self.cfg.seed}")

  def init_source(self) -> tuple[str, int | None] | None:
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

  def _load_lora_base(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """LoRA with ``train.init_from`` naming a full fine-tuning run (e.g. its SFT warm-start):
    that run's params become this run's frozen base, under fresh (B = 0) adapters."""
    source = self.init_source()
    if not (self.policy.lora.enabled and source):
      return state
    meta = ckpt_lib.restore_meta(*source)
    if "lora_base" in meta:          # a LoRA run: its adapters continue on its own base
      return state
    trained, frozen = lora_lib.split_trainable(self.policy.params, True)
    base, _ = ckpt_lib.restore_params(source[0], int(meta["step"]), frozen)
    self.policy.params = lora_lib.merge(trained, base)
    self.lora_base = f"train.init_from {os.path.abspath(source[0])}@{meta['step']}"
    self.log(f"LoRA base: the params of {source[0]} step {meta['step']}")
    return state.replace(params=self.policy.params)

  def _check_base(self, meta: dict[str, Any]) -> None:
    """ConfigError naming ``model.hf_path`` when a LoRA checkpoint's adapters were trained
    on another base than this run's."""
    saved = meta.get("lora_base")
    if self.policy.lora.enabled and saved is not None and saved != self.base_name():
      raise ConfigError("model.hf_path", self.cfg.model.hf_path,
                        f"the base the checkpoint's LoRA adapters belong to ({saved})")

  def save(self, state: state_lib.TrainState, phase: str, force: bool = False) -> None:
    saved = self._saved(state)
    meta = {"phase": phase, "sft_steps_done": min(saved.step, self.cfg.train.sft_steps),
            "ref_policy": ("the base with the LoRA adapters off" if self.policy.lora.enabled
                           else "params at the end of the SFT warm-start"),
            "config": self.config_json()}
    if self.policy.lora.enabled:
      meta["lora_base"] = self.base_name()
    # The async writer reads the arrays after save() returns, while the next train step
    # donates (frees) params and optimizer state: hand it device copies instead.
    self.ckpt.save(state_lib.copy(saved), meta, force=force)

  def keep_rl_progress(self, state: state_lib.TrainState) -> None:
    """Writes ``state`` (after an RL step) unless its step is saved already, and waits for the
    write: a run stopped by an error (a lost sampler process) keeps the steps it trained."""
    if state.step > int(self.cfg.train.sft_steps) and state.step not in self.ckpt.steps():
      self.save(state, "rl", force=True)
      self.log(f"checkpoint at step {state.step} written")
    self.ckpt.wait()

  def restore(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The latest checkpoint's state (see :meth:`Checkpointer.restore_latest`), else
    ``train.init_from``'s params, else ``state``."""
    config = self.config_json()
    state = self._load_lora_base(state)
    out = self.ckpt.restore_latest(self._saved(state), config)
    if out is None:
      return self._init_from(state) if self.cfg.train.init_from else state
    restored, meta = out
    self._check_base(meta)
    restored = self._with_base(restored)
    changes = ckpt_lib.config_differences(meta.get("config") or {}, config)
    if changes:
      self.log("config changed since the checkpoint was written: " + "; ".join(changes))
    self.pool.load_state_dict(restored.pool)
    if restored.step <= self.cfg.train.sft_steps or self.policy.lora.enabled:
      restored = restored.replace(ref_params=None)
    restored = restored.replace(adv_state=build.local_copy(restored.adv_state))
    self.log(f"resumed from checkpoint step {restored.step} ({meta.get('phase')})")
    return restored

  def _init_from(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """``train.init_from``: a new run starts at step ``train.sft_steps`` with the params of
    another run's checkpoint written at the end of its SFT (e.g. one warm-start shared by the
    RL runs of several estimators, ``gigrl-sweep --warm_start``). The RL optimizer, reference
    policy, pool and advantage state start fresh, as after this run's own SFT. A checkpoint of
    an earlier SFT step s starts this run at step s, whose SFT continues to
    ``train.sft_steps`` with a fresh optimizer (a continued-SFT control from a warm-start).

    Raises:
      ConfigError: naming ``train.init_from`` when ``@step`` is not an integer or the
        checkpoint is an RL one or past step ``train.sft_steps``.
      CheckpointError / StateMismatchError: no such checkpoint, or other model params.
    """
    value = self.cfg.train.init_from
    path, at = self.init_source()
    if self.lora_base:    # LoRA on a full run's params: loaded as the base, adapters fresh
      params, meta = state.params, ckpt_lib.restore_meta(path, at)
    else:
      target = self._saved(state).params      # the adapters alone with LoRA
      params, meta = ckpt_lib.restore_params(path, at, target)
      self._check_base(meta)
      params = self._with_base(state.replace(params=params)).params
    sft, at_step = int(self.cfg.train.sft_steps), int(meta["step"])
    if at_step > sft or meta.get("phase") == "rl":
      raise ConfigError("train.init_from", value,
                        f"an SFT checkpoint at step train.sft_steps = {sft} or before; "
                        f"that one is at step {meta['step']} ({meta.get('phase')})")
    self.initialized_from = value
    what = ("RL starts here" if at_step == sft else
            f"SFT continues to step {sft} with a fresh optimizer")
    self.log(f"initialised from {path} step {at_step} (params only; {what})")
    return state.replace(params=params, step=at_step)

  def source_eval(self, step: int) -> dict[str, Any] | None:
    """``train.init_from``'s own held-out evaluation of the params this run starts from, when
    every config field the evaluation reads is the same (greedy rollouts of the same params on
    the same questions give the same metrics); None otherwise."""
    source = self.init_source()
    if not source or not self.initialized_from or self.lora_base:
      return None
    meta = ckpt_lib.restore_meta(*source)
    if not evaluator_lib.same_eval_fields(meta.get("config") or {}, self.config_json()):
      return None
    return evaluator_lib.recorded_eval(source[0], step)
