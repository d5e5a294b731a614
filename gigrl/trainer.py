"""The training loop: SFT warm-start, then RL steps; metrics, samples, checkpoints, resume.

Determinism: every random draw is a pure function of (seed, step): rollout keys are
``fold_in(key, step)``, SFT batches come from a seeded permutation, and the query pool's numpy
generator state is checkpointed. A resumed run therefore repeats an uninterrupted one bitwise on
CPU (see docs/architecture.md, "Resume").
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from gigrl import advantages as adv_lib
from gigrl.advantages import anchors as anchors_lib
from gigrl import checkpoint as ckpt_lib
from gigrl import metrics as metrics_lib
from gigrl import models
from gigrl import reward as reward_lib
from gigrl import search as search_lib
from gigrl import update as update_lib
from gigrl.data import pool as pool_lib
from gigrl.models import sharding as sharding_lib
from gigrl.data import qa
from gigrl.data import tfds_qa
from gigrl.data import tokenizer as tok_lib
from gigrl.rollout import callback as callback_lib
from gigrl.rollout import demos as demos_lib
from gigrl.rollout import host_loop
from gigrl.rollout import trajectory as traj_lib


def _log(msg: str) -> None:
  tqdm.write(f"[gigrl] {msg}", file=sys.stderr)


class Trainer:
  """Owns the state of one run (see module docstring)."""

  def __init__(self, cfg: ml_collections.ConfigDict, workdir: str):
    self.cfg, self.workdir = cfg, os.path.abspath(workdir)
    os.makedirs(os.path.join(self.workdir, "samples"), exist_ok=True)
    self._stop_requested = False
    self._setup_data()
    self._setup_model()
    self._setup_rollout()
    self.metrics = metrics_lib.MetricsWriter(self.workdir)
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                      keep=cfg.checkpoint.keep,
                                      async_save=cfg.checkpoint.async_save)

  # ------------------------------------------------------------------ setup
  def _setup_data(self) -> None:
    cfg = self.cfg
    self.tokenizer = tok_lib.load(cfg.data.tokenizer)
    tfds_dir = cfg.data.tfds_dir or os.path.join(self.workdir, "tfds")
    files = [cfg.data.questions_file] if cfg.data.questions_file else None
    builder = tfds_qa.build(tfds_dir, files, cfg.data.eval_percent)
    train = tfds_qa.read_split(builder, "train")
    if not cfg.data.questions_file:
      sources = {s.strip() for s in cfg.data.train_sources.split(",") if s.strip()}
      train = [q for q in train if q.data_source in sources]
    # TFDS shuffles rows by key hash at build time; sort for a readable, stable order.
    train.sort(key=lambda q: (q.data_source, q.id))
    if cfg.data.max_train_questions:
      train = train[:cfg.data.max_train_questions]
    if not train:
      raise ValueError("no training questions left after data.train_sources / "
                       "data.max_train_questions")
    self.train_questions = train
    self.eval_questions = tfds_qa.read_split(builder, "eval")
    self.eval_questions.sort(key=lambda q: (q.data_source, q.id))
    overlap = ({qa.normalize_answer(q.question) for q in train}
               & {qa.normalize_answer(q.question) for q in self.eval_questions})
    assert not overlap, f"eval questions leaked into training: {sorted(overlap)[:3]}"
    _log(f"data: {len(train)} train / {len(self.eval_questions)} eval questions")

  def _setup_model(self) -> None:
    cfg = self.cfg
    self.model_cfg = models.model_config_from(cfg.model, self.tokenizer.vocab_size)
    # Training layout: the `model.train_sharding` preset (FSDP by default) on the mesh.
    self.mesh = sharding_lib.mesh_from_config(cfg.model)
    if cfg.model.hf_path:   # each tensor goes straight to its shard (no full host copy)
      model, self.model_cfg = models.from_hf(
          cfg.model.hf_path, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
          mesh=self.mesh, preset=cfg.model.train_sharding, remat=cfg.model.remat)
    else:
      model = models.Transformer(self.model_cfg, rngs=nnx.Rngs(cfg.seed))
    self.graphdef, params = nnx.split(model)
    self.param_sh = sharding_lib.param_shardings(params, self.mesh, cfg.model.train_sharding)
    self.params = sharding_lib.shard_state(params, self.mesh, cfg.model.train_sharding)
    n = sum(x.size for x in jax.tree.leaves(self.params))
    _log(f"model: {n / 1e6:.2f}M params on mesh {dict(self.mesh.shape)} "
         f"({cfg.model.train_sharding}), {self.model_cfg}")
    t = cfg.train
    opt_kw = dict(weight_decay=t.weight_decay, b1=t.b1, b2=t.b2, grad_clip=t.grad_clip)
    self.sft_tx = update_lib.make_optimizer(t.sft_learning_rate, warmup_steps=0, **opt_kw)
    self.rl_tx = update_lib.make_optimizer(t.learning_rate, warmup_steps=t.warmup_steps,
                                           **opt_kw)
    self.opt_sh = sharding_lib.opt_state_shardings(
        jax.eval_shape(self.sft_tx.init, self.params), self.params, self.mesh,
        cfg.model.train_sharding)
    chunk = int(cfg.model.logprob_chunk_size)
    graphdef = self.graphdef
    max_gen = (cfg.rollout.max_turns + 1) * cfg.rollout.max_new_tokens
    repl = NamedSharding(self.mesh, P())
    out_sh = (self.param_sh, self.opt_sh, repl)
    self.sft_step = update_lib.make_step(
        lambda p, tok, m: update_lib.sft_loss(p, graphdef, tok, m, max_tokens=max_gen,
                                              chunk_size=chunk), self.sft_tx,
        in_shardings=(self.param_sh, self.opt_sh, None, None), out_shardings=out_sh)
    settings = update_lib.rl_settings_from_config(cfg)
    self.rl_step = update_lib.make_step(
        lambda p, ref, tok, m, a: update_lib.rl_loss(p, graphdef, ref, tok, m, a, settings,
                                                     max_tokens=max_gen),
        self.rl_tx, in_shardings=(self.param_sh, self.opt_sh, self.param_sh, None, None, None),
        out_shardings=out_sh)
    self.adv_cfg = adv_lib.AdvantageConfig.from_config(cfg.advantage)
    self.adv_state = adv_lib.init_state(self.adv_cfg)
    self._adv_fn = jax.jit(functools.partial(adv_lib.compute_advantages, self.adv_cfg))

  def _setup_rollout(self) -> None:
    cfg = self.cfg
    self.retriever = search_lib.make_retriever(cfg.search)
    self.settings = host_loop.settings_from_config(cfg.rollout, cfg.search.topk)
    self.engine = callback_lib.make_engine(cfg.rollout.engine, self.model_cfg, self.graphdef,
                                           self.tokenizer, self.retriever, self.settings,
                                           mesh=self.mesh)
    p = cfg.data.pool
    self.pool = pool_lib.QueryPool(
        len(self.train_questions), rule=p.rule, batch_size=cfg.data.prompts_per_step,
        oversample=p.oversample, success_threshold=p.success_threshold, seed=cfg.seed)

  # ------------------------------------------------------------------ state
  def _state_tree(self) -> dict[str, Any]:
    # Before RL starts there is no reference policy yet; its slot holds the params so the
    # tree (and the abstract restore target) has one structure in both phases.
    ref = self.params if self.ref_params is None else self.ref_params
    return {"params": self.params, "opt_state": self.opt_state, "ref_params": ref,
            "adv_state": self.adv_state}

  def _meta(self, step: int, phase: str) -> dict[str, Any]:
    return {"step": step, "phase": phase, "pool": self.pool.state_dict(),
            "sft_steps_done": min(step, self.cfg.train.sft_steps),
            "ref_policy": "params at the end of the SFT warm-start",
            "config": json.loads(self.cfg.to_json_best_effort())}

  def _save(self, step: int, phase: str, force: bool = False) -> None:
    # The async writer reads the arrays after save() returns, while the next train step
    # donates (frees) params and optimizer state: hand it device copies instead.
    state = jax.tree.map(jnp.copy, self._state_tree())
    self.ckpt.save(step, state, self._meta(step, phase), force=force)

  def _restore(self) -> int:
    """Restores the latest good checkpoint; returns the step to continue after (0 = none)."""
    out = self.ckpt.restore_latest(ckpt_lib.abstract_like(self._state_tree()))
    if out is None:
      return 0
    step, state, meta = out
    self.params, self.opt_state = state["params"], state["opt_state"]
    self.adv_state = state["adv_state"]
    rl_started = step >= self.cfg.train.sft_steps
    self.ref_params = state["ref_params"] if rl_started else None
    self.pool.load_state_dict(meta["pool"])
    _log(f"resumed from checkpoint step {step} ({meta['phase']})")
    return step

  # ------------------------------------------------------------------ run
  def run(self) -> None:
    cfg = self.cfg
    sft_steps, total = cfg.train.sft_steps, cfg.train.sft_steps + cfg.train.num_steps
    self.opt_state = self._init_opt(self.sft_tx)
    self.ref_params = None
    start = self._restore()
    self.metrics.truncate_after(start)
    prev = signal.signal(signal.SIGTERM, self._on_sigterm)
    bar = tqdm(total=total, initial=start, desc="gigrl", unit="step", dynamic_ncols=True)
    try:
      demos = self._demonstrations() if start < sft_steps else None
      for step in range(start + 1, total + 1):
        if step <= sft_steps:
          record = self._sft_step(step, demos)
          if step == sft_steps:
            self._begin_rl()
        else:
          if step == 1 and sft_steps == 0:
            self._begin_rl()
          record = self._rl_step(step)
        self.metrics.write(record)
        bar.update(1)
        bar.set_postfix({k: f"{record[k]:.3g}" for k in ("loss", "reward_mean", "em")
                         if isinstance(record.get(k), float)})
        if step % cfg.checkpoint.every_steps == 0 or step == total:
          self._save(step, record["phase"])
        if self._stop_requested:
          if step % cfg.checkpoint.every_steps and step != total:
            self._save(step, record["phase"], force=True)
          _log(f"SIGTERM: checkpoint at step {step} written; exiting")
          break
      self.ckpt.wait()
      if not self._stop_requested and cfg.train.eval_questions:
        self._final_eval(total)
      metrics_lib.plot_metrics(self.workdir)
    finally:
      bar.close()
      self.ckpt.close()
      signal.signal(signal.SIGTERM, prev)

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    self._stop_requested = True

  def _begin_rl(self) -> None:
    """Freezes the reference policy and switches to the RL optimizer."""
    self.ref_params = jax.tree.map(jnp.copy, self.params)
    self.opt_state = self._init_opt(self.rl_tx)

  def _rollout_params(self):
    """The params in the rollout layout (`model.rollout_sharding`, TP by default)."""
    return sharding_lib.shard_state(self.params, self.mesh, self.cfg.model.rollout_sharding)

  def _init_opt(self, tx):
    return jax.jit(tx.init, out_shardings=self.opt_sh)(self.params)

  def _put(self, x: np.ndarray) -> jax.Array:
    """Host batch -> device, rows over the mesh's ('data', 'fsdp') axes."""
    return jax.device_put(x, sharding_lib.batch_sharding(self.mesh, x.shape))

  # ------------------------------------------------------------------ SFT
  def _demonstrations(self) -> traj_lib.TrajectoryBatch:
    t = self.cfg.train
    qs = self.train_questions[:t.sft_questions] if t.sft_questions else self.train_questions
    builders = demos_lib.build_demonstrations(
        qs, self.tokenizer, self.retriever, self.settings,
        only_answer_in_obs=t.sft_only_answer_in_obs)
    if not builders:
      raise ValueError("no SFT demonstrations (train.sft_only_answer_in_obs filtered all)")
    _log(f"SFT: {len(builders)} demonstrations")
    return traj_lib.collate(builders, self.settings.seq_len, self.tokenizer.pad_id)

  def _sft_step(self, step: int, demos: traj_lib.TrajectoryBatch) -> dict[str, Any]:
    bs = self.cfg.train.sft_batch_size
    n = demos.tokens.shape[0]
    per_epoch = max(1, n // bs)
    epoch, i = divmod(step - 1, per_epoch)
    perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(n)
    idx = perm[i * bs:(i + 1) * bs]
    if len(idx) < bs:
      idx = np.resize(perm, bs)
    width = int(demos.lengths[idx].max())
    tokens = self._put(demos.tokens[idx, :self._bucket(width)])
    mask = self._put(demos.loss_mask[idx, :self._bucket(width)])
    t0 = time.perf_counter()
    self.params, self.opt_state, m = self.sft_step(self.params, self.opt_state, tokens, mask)
    m = jax.device_get(m)
    dt = time.perf_counter() - t0
    ntok = float(demos.lengths[idx].sum())
    # The RL-only fields are null on SFT steps, so every line has the same keys.
    return {"step": step, "phase": "sft", "reward_mean": None, "em": None,
            "search_calls_mean": None, "zero_variance_frac": None,
            "loss": float(m["loss"]), "kl": 0.0,
            "tokens_per_s": ntok / dt, "step_time_s": dt,
            **{k: float(v) for k, v in m.items() if k != "loss"}}

  def _bucket(self, width: int) -> int:
    """Pads the sequence width to a multiple of 64 (fewer recompiles)."""
    return min(self.settings.seq_len, -(-width // 64) * 64)

  # ------------------------------------------------------------------ RL
  def _rl_step(self, step: int) -> dict[str, Any]:
    cfg, g = self.cfg, self.cfg.data.group_size
    t_start = time.perf_counter()
    if int((self.pool.weights > 0).sum()) < self.pool.num_candidates:
      # Too few active queries to fill a step: start a new pass over the data.
      _log(f"step {step}: query pool has fewer than {self.pool.num_candidates} active "
           f"queries; re-activating all {self.pool.num_queries}")
      self.pool.weights[:] = 1.0
    cands = self.pool.sample()
    questions = [self.train_questions[int(i)] for i in cands]
    # Fixed rollout width (k·P groups) so the jitted rollout never recompiles; filler groups
    # repeat the last question and are dropped before the pool update.
    n_full = self.pool.num_candidates
    padded = questions + [questions[-1]] * (n_full - len(questions))
    key = jax.random.fold_in(jax.random.key(cfg.seed), step)
    self.retriever_new_step()
    batch, rmetrics = self.engine.run(self._rollout_params(), [q.question for q in padded for _ in range(g)],
                                      key)
    t_roll = time.perf_counter() - t_start
    n_rows = len(cands) * g
    rewards = np.array([reward_lib.em_reward(batch.generated_text[r],
                                             questions[r // g].golden_answers)
                        for r in range(n_rows)], np.float32).reshape(len(cands), g)
    accepted, pmetrics = self.pool.update(cands, rewards)
    rows, valid_groups = self._train_rows(cands, accepted)
    inputs = self._advantage_inputs(batch, rewards, cands, rows, valid_groups)
    adv, self.adv_state, ametrics = self._adv_fn(inputs, self.adv_state)
    sel = rows.reshape(-1)
    step_ids = batch.step_ids[sel]
    tok_adv = np.take_along_axis(np.asarray(adv).reshape(len(sel), -1),
                                 np.maximum(step_ids, 0), axis=1) * (step_ids >= 0)
    row_valid = np.repeat(valid_groups, g).astype(np.float32)
    width = self._bucket(int(batch.lengths[sel].max()))
    t1 = time.perf_counter()
    if valid_groups.any():
      self.params, self.opt_state, lm = self.rl_step(
          self.params, self.opt_state, self.ref_params,
          self._put(batch.tokens[sel, :width]),
          self._put(batch.loss_mask[sel, :width] * row_valid[:, None]),
          self._put(tok_adv[:, :width].astype(np.float32)))
      lm = {k: float(v) for k, v in jax.device_get(lm).items()}
    else:
      lm = {"loss": 0.0, "kl": 0.0, "pg_loss": 0.0}
    t_train = time.perf_counter() - t1
    gen_tokens = rmetrics["rollout/generated_tokens"]
    record = {
        "step": step, "phase": "rl",
        "reward_mean": float(rewards.mean()), "em": float(rewards.mean()),
        "search_calls_mean": float(batch.search_calls[:n_rows].mean()),

        "loss": lm.get("loss", 0.0), "kl": lm.get("kl", 0.0),
        "tokens_per_s": gen_tokens / max(t_roll, 1e-9),
        "train_tokens_per_s": (float(batch.lengths[sel].sum()) / t_train
                               if valid_groups.any() else 0.0),
        "response_tokens_mean": gen_tokens / len(batch.lengths),
        "turns_mean": float(batch.num_steps[:n_rows].mean()),
        "answered_frac": float(np.mean([reward_lib.extract_answer(t) is not None
                                        for t in batch.generated_text[:n_rows]])),
        "trained_groups": int(valid_groups.sum()),
        "step_time_s": time.perf_counter() - t_start,
        **{k: v for k, v in lm.items() if k not in ("loss", "kl")},
        **{("adv/" + k if k == "zero_variance_frac" else k): float(v)
           for k, v in jax.device_get(ametrics).items()},
        # over every rolled-out group (the advantage metric covers the trained ones only)
        "zero_variance_frac": float(np.mean([r.min() == r.max() for r in rewards])),
        **{k: float(v) for k, v in pmetrics.items()},
        **{k: float(v) for k, v in rmetrics.items()},
        **{f"search/{k}": float(v) for k, v in self._search_metrics().items()},
    }
    if step % cfg.train.sample_every == 0:
      self._write_samples(step, batch, questions, rewards)
    return record

  def retriever_new_step(self) -> None:
    """Per-step query cache and per-step search counters (so resumed runs log the same)."""
    if hasattr(self.retriever, "new_step"):
      self.retriever.new_step()
    if hasattr(self.retriever, "reset_metrics"):
      self.retriever.reset_metrics()

  def _search_metrics(self) -> dict[str, float]:
    return dict(self.retriever.metrics()) if hasattr(self.retriever, "metrics") else {}

  def _train_rows(self, cands: np.ndarray, accepted) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the P trained groups: accepted candidates first, padded with unused ones.

    Returns:
      (rows i32[P, G] into the rollout batch, valid bool[P]).
    """
    p, g = self.cfg.data.prompts_per_step, self.cfg.data.group_size
    pos = {int(c): i for i, c in enumerate(cands)}
    acc = [pos[int(a)] for a in accepted][:p]
    rest = [i for i in range(len(cands)) if i not in set(acc)]
    order = (acc + rest + [0] * p)[:p]
    valid = np.array([i < len(acc) for i in range(p)])
    rows = np.array([[o * g + j for j in range(g)] for o in order], np.int32)
    return rows, valid

  def _advantage_inputs(self, batch, rewards, cands, rows, valid_groups):
    p, g = rows.shape
    t = self.settings.max_turns + 1
    cand_idx = rows[:, 0] // g
    r = rewards[cand_idx]                                     # [P, G]
    valid = np.repeat(valid_groups[:, None], g, axis=1)
    flat = rows.reshape(-1)
    nsteps = batch.num_steps[flat].reshape(p, g)
    step_valid = (np.arange(t)[None, None, :] < nsteps[..., None]) & valid[..., None]
    last = np.clip(nsteps - 1, 0, t - 1)
    step_rewards = np.zeros((p, g, t), np.float32)
    np.put_along_axis(step_rewards, last[..., None], r[..., None], axis=2)
    step_rewards *= step_valid
    anchor_ids = np.zeros((p, g, t), np.int32)
    if self.adv_cfg.step == "gigpo":
      anchors = [[batch.anchors[i][:batch.num_steps[i]] for i in row] for row in rows]
      if self.adv_cfg.gigpo_grouping == "similarity":
        ids = anchors_lib.similarity_anchor_ids(anchors, self.adv_cfg.gigpo_similarity_thresh)
      else:
        ids = anchors_lib.exact_anchor_ids(anchors)
      anchor_ids[:, :, :ids.shape[2]] = ids
    action_valid = np.ones((p, g, t), bool)
    for pi, row in enumerate(rows):
      for gi, i in enumerate(row):
        av = batch.action_valid[i][:t]
        action_valid[pi, gi, :len(av)] = av
    return adv_lib.AdvantageInputs(
        rewards=jnp.asarray(r), valid=jnp.asarray(valid),
        strata=jnp.asarray(batch.search_calls[flat].reshape(p, g)),
        step_rewards=jnp.asarray(step_rewards), step_valid=jnp.asarray(step_valid),
        anchor_ids=jnp.asarray(anchor_ids), action_valid=jnp.asarray(action_valid))

  def _write_samples(self, step, batch, questions, rewards, n: int = 4,
                     name: str | None = None, g: int | None = None) -> None:
    g = g or self.cfg.data.group_size
    rows = list(range(min(n, len(batch.lengths))))
    texts = [self.tokenizer.decode(batch.tokens[i, :batch.lengths[i]][
        np.argmax(batch.loss_mask[i] > 0):]) for i in rows]
    path = os.path.join(self.workdir, "samples", name or f"step_{step:06d}.txt")
    metrics_lib.write_samples(path, step, [questions[i // g].question for i in rows],
                              [questions[i // g].golden_answers for i in rows],
                              [float(rewards.reshape(-1)[i]) for i in rows], texts,
                              [int(batch.search_calls[i]) for i in rows])

  def _final_eval(self, step: int) -> None:
    """Greedy rollouts on held-out questions; writes eval.json and a sample file."""
    qs = self.eval_questions[:self.cfg.train.eval_questions]
    if not qs:
      return
    engine = callback_lib.make_engine(
        self.cfg.rollout.engine, self.model_cfg, self.graphdef, self.tokenizer, self.retriever,
        host_loop.RolloutSettings(**{**self.settings.__dict__, "greedy": True}), mesh=self.mesh)
    batch, _ = engine.run(self._rollout_params(), [q.question for q in qs], jax.random.key(0))
    em = np.array([reward_lib.em_reward(batch.generated_text[i], q.golden_answers)
                   for i, q in enumerate(qs)], np.float32)
    out = {"step": step, "eval/em": float(em.mean()), "eval/n": len(qs),
           "eval/search_calls_mean": float(batch.search_calls.mean())}
    with open(os.path.join(self.workdir, "eval.json"), "w") as f:
      json.dump(out, f, indent=1)
    self._write_samples(step, batch, qs, em, n=8, name="eval_samples.txt", g=1)
    _log(f"eval on {len(qs)} held-out questions: EM {em.mean():.3f}")
