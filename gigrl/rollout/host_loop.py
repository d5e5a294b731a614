"""Host-driven multi-turn rollout engine (``rollout.engine = host_loop``).

Each turn is one jitted ``decode`` (a ``lax.while_loop`` over the KV cache) that stops every row
at ``</search>``, ``</answer>`` (any of their token sequences, see
:func:`gigrl.rollout.turns.stop_sequences`), EOS or its token budget; the host then parses the
actions in the decoded text, calls the retriever once for all the turn's queries
(:func:`gigrl.rollout.turns.dispatch_turn`), and feeds the observations back with one jitted
``extend``. Protocol: Search-R1 ``search_r1/llm_agent/generation.py`` @ a14dc3a:
``max_turns`` turns with search, then one final turn in which a search gets no observation.

Several processes (one per host of a pod): every process calls :meth:`HostLoopEngine.run` with
its own questions (the same count on each). The per-row inputs become global arrays built from
process-local data; each process reads back only the rows on its own devices, decodes and parses
only those, and sends only their queries to its retriever.
"""
from __future__ import annotations

import time
from typing import Sequence

import jax
import numpy as np

from gigrl.models import sampler as sampler_lib
from gigrl.models import sharding as sharding_lib
from gigrl.models import transformer as tfm
from gigrl.rollout import trajectory as traj_lib
from gigrl.rollout import turns


class HostLoopEngine:
  """Runs batches of Search-R1 rollouts with a host loop over turns (a :class:`RolloutEngine`)."""

  def __init__(self, model_cfg, graphdef, tokenizer, retriever, settings: turns.RolloutSettings,
               mesh=None):
    """``mesh``: if given, the KV cache is sharded over it (rows over ('data', 'fsdp'),
    KV heads over 'tp'), matching params laid out on the same mesh. On several processes it
    defaults to all devices on 'fsdp'.

    Raises:
      ConfigError: a token budget of ``settings`` that this tokenizer's texts do not fit
        (:func:`gigrl.rollout.turns.check_settings`).
    """
    if mesh is None and jax.process_count() > 1:
      mesh = sharding_lib.make_mesh()
    self.model_cfg, self.graphdef, self.mesh = model_cfg, graphdef, mesh
    self.tok, self.retriever, self.s = tokenizer, retriever, settings
    self.stops = turns.stop_sequences(tokenizer)
    turns.check_settings(tokenizer, settings)
    self.invalid_ids = traj_lib.invalid_observation_ids(tokenizer)

  def run(self, params, questions: Sequence[str], key: jax.Array
          ) -> tuple[traj_lib.TrajectoryBatch, dict[str, float]]:
    """Rolls out one trajectory per question (see :meth:`RolloutEngine.run`).

    Args:
      params: the policy's ``nnx.State``.
      questions: this process's B question strings (one process: the whole batch).
      key: PRNG key, the same on every process; the rollout is deterministic given it.
    Returns:
      (batch of this process's B rows, metrics): ``time/decode_s``, ``time/search_s``,
      ``rollout/generated_tokens`` and ``rollout/retriever_calls`` of this process.
    """
    s, b = self.s, len(questions)
    records = [traj_lib.TrajectoryBuilder() for _ in range(b)]
    prompts = turns.encode_prompts(self.tok, questions, s.max_prompt_tokens)
    for rec, ids, q in zip(records, prompts, questions):
      rec.add_prompt(ids, anchor=q)
    toks, lens = turns.pad_rows(prompts, b, s.max_prompt_tokens, self.tok.pad_id)
    logits = self._rows(np.zeros((b, self.model_cfg.vocab_size), np.float32))
    cache = self._init_cache(logits.shape[0], s.seq_len + 1)
    logits, cache = sampler_lib.extend_last(self.graphdef, params, cache, self._rows(toks),
                                            self._rows(lens), logits)
    active = np.ones((b,), bool)
    budget = self._rows(np.full((b,), s.max_new_tokens, np.int32))
    t_decode = t_search = 0.0
    calls = 0
    for turn in range(s.max_turns + 1):
      key, sub = jax.random.split(key)
      t0 = time.perf_counter()
      out = sampler_lib.decode(
          self.graphdef, params, cache, logits, sub, self._rows(active), budget,
          max_new_tokens=s.max_new_tokens, stop_sequences=self.stops,
          temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, greedy=s.greedy)
      cache, logits = out.cache, out.next_logits
      gen_tokens, gen_lens = turns.local_rows(out.tokens), turns.local_rows(out.lengths)
      t_decode += time.perf_counter() - t0
      rows = np.flatnonzero(active)
      outcome = turns.dispatch_turn(
          [records[i] for i in rows], [gen_tokens[i, :gen_lens[i]] for i in rows],
          tokenizer=self.tok, retriever=self.retriever, settings=s,
          invalid_ids=self.invalid_ids)
      t_search += outcome.search_s
      calls += outcome.queries > 0
      obs: list[list[int]] = [[] for _ in range(b)]
      for i, ids, done in zip(rows, outcome.observations, outcome.done):
        obs[i], active[i] = ids, not done
      if turn == s.max_turns or not turns.any_process(active.any()):
        break
      obs_toks, obs_lens = turns.pad_rows(obs, b, s.obs_width, self.tok.pad_id)
      logits, cache = sampler_lib.extend_last(self.graphdef, params, cache,
                                              self._rows(obs_toks), self._rows(obs_lens),
                                              logits)
    batch = traj_lib.collate(records, s.seq_len, self.tok.pad_id)
    metrics = {"time/decode_s": t_decode, "time/search_s": t_search,
               "rollout/generated_tokens": float(batch.num_generated_tokens),
               "rollout/retriever_calls": float(calls)}
    return batch, metrics

  def _rows(self, local: np.ndarray):
    """Per-row host data for the jitted programs: numpy on one process, else a global array
    whose rows on this process are ``local``."""
    if jax.process_count() == 1:
      return local
    global_shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
    return turns.global_rows(local, sharding_lib.batch_sharding(self.mesh, global_shape))

  def _init_cache(self, batch: int, max_len: int):
    if self.mesh is None:
      return tfm.init_cache(self.model_cfg, batch, max_len)
    return tfm.init_cache(self.model_cfg, batch, max_len, sharding=sharding_lib.cache_shardings(
        self.model_cfg, self.mesh, batch, max_len))
