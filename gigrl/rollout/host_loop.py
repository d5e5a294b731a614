"""Host-driven multi-turn rollout engine (``rollout.engine = host_loop``).

Each turn is one jitted ``decode`` (a ``lax.while_loop`` over the KV cache) that stops every row
at ``</search>``, ``</answer>``, EOS or its token budget; the host then parses actions, calls the
retriever once for all the turn's queries, and feeds the observations back with one jitted
``extend``. Protocol: Search-R1 ``search_r1/llm_agent/generation.py`` @ a14dc3a:
``max_turns`` turns with search, then one final turn in which a search gets no observation.
"""
from __future__ import annotations

import time
from typing import Sequence

import jax
import numpy as np

from gigrl.models import sampler as sampler_lib
from gigrl.models import sharding as sharding_lib
from gigrl.models import transformer as tfm
from gigrl.rollout import protocol
from gigrl.rollout import trajectory as traj_lib
from gigrl.rollout import turns


RolloutSettings = turns.RolloutSettings
settings_from_config = turns.settings_from_config
stop_sequences = turns.stop_sequences
encode_prompts = turns.encode_prompts


def _pad(rows: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  toks = np.full((len(rows), width), pad_id, np.int32)
  lens = np.zeros((len(rows),), np.int32)
  for i, r in enumerate(rows):
    toks[i, :len(r)], lens[i] = r, len(r)
  return toks, lens


class HostLoopEngine:
  """Runs batches of Search-R1 rollouts with a host loop over turns."""

  def __init__(self, model_cfg, graphdef, tokenizer, retriever, settings: RolloutSettings,
               mesh=None):
    """``mesh``: if given, the KV cache is sharded over it (rows over ('data', 'fsdp'),
    KV heads over 'tp'), matching params laid out on the same mesh."""
    self.model_cfg, self.graphdef, self.mesh = model_cfg, graphdef, mesh
    self.tok, self.retriever, self.s = tokenizer, retriever, settings
    self.stops = stop_sequences(tokenizer)
    self.invalid_ids = traj_lib.invalid_observation_ids(tokenizer)
    if len(self.invalid_ids) > settings.obs_width:
      raise ValueError(f"rollout.max_obs_tokens={settings.max_obs_tokens} is smaller than the "
                       f"invalid-action message ({len(self.invalid_ids)} tokens)")

  def run(self, state, questions: Sequence[str], rng: jax.Array
          ) -> tuple[traj_lib.TrajectoryBatch, dict[str, float]]:
    """Rolls out one trajectory per question (repeat questions for groups).

    Args:
      state: the policy's ``nnx.State`` (parameters).
      questions: B question strings.
      rng: PRNG key; the rollout is deterministic given it.
    Returns:
      (batch, metrics) with ``metrics`` = decode/search seconds and token counts.
    """
    s, b = self.s, len(questions)
    builders = [traj_lib.TrajectoryBuilder() for _ in range(b)]
    prompts = encode_prompts(self.tok, questions, s.max_prompt_tokens)
    for tb, ids, q in zip(builders, prompts, questions):
      tb.add_prompt(ids, anchor=q)
    cache = self._init_cache(b, s.seq_len + 1)
    toks, lens = _pad(prompts, s.max_prompt_tokens, self.tok.pad_id)
    logits = np.zeros((b, self.model_cfg.vocab_size), np.float32)
    logits, cache = sampler_lib.extend_last(self.graphdef, state, cache, toks, lens, logits)
    active = np.ones((b,), bool)
    t_decode = t_search = 0.0
    for turn in range(s.max_turns + 1):
      rng, key = jax.random.split(rng)
      t0 = time.perf_counter()
      out = sampler_lib.decode(
          self.graphdef, state, cache, logits, key, active,
          np.full((b,), s.max_new_tokens, np.int32), max_new_tokens=s.max_new_tokens,
          stop_sequences=self.stops, temperature=s.temperature, top_p=s.top_p,
          top_k=s.top_k, greedy=s.greedy)
      cache, logits = out.cache, out.next_logits
      gen_tokens, gen_lens = np.asarray(out.tokens), np.asarray(out.lengths)
      t_decode += time.perf_counter() - t0
      obs, t_s = self._step(builders, active, gen_tokens, gen_lens, turn)
      t_search += t_s
      if not active.any():
        break
      obs_toks, obs_lens = _pad(obs, s.obs_width, self.tok.pad_id)
      logits, cache = sampler_lib.extend_last(self.graphdef, state, cache, obs_toks, obs_lens,
                                              logits)
    batch = traj_lib.collate(builders, s.seq_len, self.tok.pad_id)
    metrics = {"time/decode_s": t_decode, "time/search_s": t_search,
               "rollout/generated_tokens": float(batch.num_generated_tokens)}
    return batch, metrics

  def _init_cache(self, batch: int, max_len: int):
    if self.mesh is None:
      return tfm.init_cache(self.model_cfg, batch, max_len)
    return tfm.init_cache(self.model_cfg, batch, max_len, sharding=sharding_lib.cache_shardings(
        self.model_cfg, self.mesh, batch, max_len))

  def _step(self, builders, active, gen_tokens, gen_lens, turn):
    """Records one turn, decides each row's next observation; updates ``active`` in place."""
    s = self.s
    obs: list[list[int]] = [[] for _ in builders]
    queries, query_rows = [], []
    for i, tb in enumerate(builders):
      if not active[i]:
        continue
      ids = gen_tokens[i, :gen_lens[i]].tolist()
      text = self.tok.decode(ids)
      tb.add_generation(ids, text)
      kind, payload = protocol.parse_action(text)
      if kind == "answer":
        tb.answer_turn, active[i] = turn, False
      elif turn == s.max_turns:       # final turn: no more observations
        active[i] = False
      elif kind == "search":
        tb.search_calls += 1
        queries.append(payload)
        query_rows.append(i)
      else:
        obs[i] = self.invalid_ids
        tb.add_observation(obs[i], anchor=protocol.INVALID_ACTION_MSG.strip())
    t0 = time.perf_counter()
    if queries:
      found = traj_lib.search_observations(self.retriever, self.tok, queries, s.topk_docs,
                                           s.max_obs_tokens)
      for i, (ids, anchor) in zip(query_rows, found):
        obs[i] = ids
        builders[i].add_observation(ids, anchor=anchor)
    return obs, time.perf_counter() - t0
