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
from typing import Mapping, Sequence

import jax
import numpy as np

from gigrl import progress
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
    self.programs: set[tuple] = set()   # static shapes met so far: one compiled program each

  def run(self, params, questions: Sequence[str], key: jax.Array
          ) -> tuple[traj_lib.TrajectoryBatch, dict[str, float]]:
    """Rolls out one trajectory per question (see :meth:`RolloutEngine.run`).

    What is computed follows the settings' switches (each saving can be turned off; the
    trajectories are the same either way, up to float rounding): a group's prompt is prefilled
    once and its KV rows copied (``prefill_once_per_group``), the batch's common prompt prefix
    once (``shared_prefix``), observation extends and decode turns run only the rows that need
    them (``compact_rows``), at widths rounded to ``width_bucket`` tokens, and attention reads
    only the written slots, rounded to ``slot_bucket``. Each row samples from its own key
    stream (``fold_in(turn key, global row id)``), so compaction never changes a sample.

    Args:
      params: the policy's ``nnx.State``.
      questions: this process's B question strings (one process: the whole batch).
      key: PRNG key, the same on every process; the rollout is deterministic given it.
    Returns:
      (batch of this process's B rows, metrics): wall seconds ``time/prefill_s``,
      ``time/extend_s`` (observations), ``time/decode_s``, ``time/search_s``, each phase ended
      with the device synchronised; ``rollout/decode_steps`` and per turn
      ``rollout/decode_steps/turn=t`` (decode loop iterations); ``rollout/token_rows`` (token
      rows computed: prefill, extend and decode, padding included), ``rollout/real_tokens``
      (the real tokens among them), ``rollout/padding_frac`` (1 - real / computed),
      ``time/rollout_compile_s`` (seconds jax compiled in this rollout: > 0 when it met a new
      static shape; the shapes met so far are ``engine.programs``),
      ``rollout/trajectory_tokens`` (prompt, observation and generated tokens of the
      trajectories: what every saving off computes without padding; with a group's prompt
      prefilled once, ``token_rows`` can be below it); ``rollout/generated_tokens`` and
      ``rollout/retriever_calls`` of this process.
    """
    s, b = self.s, len(questions)
    self.batch_rows = b
    records = [traj_lib.TrajectoryBuilder() for _ in range(b)]
    prompts = turns.encode_prompts(self.tok, questions, s.max_prompt_tokens)
    for rec, ids, q in zip(records, prompts, questions):
      rec.add_prompt(ids, anchor=q)
    work = {"time/prefill_s": 0.0, "time/extend_s": 0.0, "time/decode_s": 0.0,
            "time/search_s": 0.0, "rollout/token_rows": 0.0, "rollout/real_tokens": 0.0,
            "rollout/trajectory_tokens": 0.0}
    s_max = s.seq_len + 1
    t0, c0 = time.perf_counter(), progress.compile_seconds()
    progress.report(f"rollout: prefill {b} rows")
    logits = self._rows(np.zeros((b, self.model_cfg.vocab_size), np.float32))
    cache = self._init_cache(logits.shape[0], s_max)
    pos = np.zeros((b,), np.int64)          # host copy of each row's cache length
    logits, cache = self._prefill(params, cache, logits, prompts, pos, work)
    work["time/prefill_s"] = _synced(logits, t0)
    active = np.ones((b,), bool)
    row_ids = self._rows(np.arange(b, dtype=np.int32) + np.int32(jax.process_index() * b))
    calls = 0
    for turn in range(s.max_turns + 1):
      key, sub = jax.random.split(key)
      t0 = time.perf_counter()
      live = np.flatnonzero(active)
      progress.report(f"rollout turn {turn + 1}/{s.max_turns + 1}: decode {len(live)} rows")
      cache, logits, gen = self._decode_turn(params, cache, logits, sub, active, pos, row_ids,
                                             turn, work)
      work["time/decode_s"] += time.perf_counter() - t0
      outcome = turns.dispatch_turn(
          [records[i] for i in live], [gen[i] for i in live],
          tokenizer=self.tok, retriever=self.retriever, settings=s,
          invalid_ids=self.invalid_ids)
      work["time/search_s"] += outcome.search_s
      calls += outcome.queries > 0
      obs: list[list[int]] = [[] for _ in range(b)]
      for i, ids, done in zip(live, outcome.observations, outcome.done):
        obs[i], active[i] = ids, not done
      if turn == s.max_turns or not turns.any_process(active.any()):
        break
      t0 = time.perf_counter()
      progress.report(f"rollout turn {turn + 1}/{s.max_turns + 1}: "
                      f"{outcome.queries} searches, extend observations")
      logits, cache = self._extend_observations(params, cache, logits, obs, pos, work)
      work["time/extend_s"] += _synced(logits, t0)
    batch = traj_lib.collate(records, s.seq_len, self.tok.pad_id)
    work["rollout/decode_steps"] = float(sum(v for k, v in work.items()
                                             if k.startswith("rollout/decode_steps/")))
    work["rollout/padding_frac"] = padding_frac(work)
    work["time/rollout_compile_s"] = progress.compile_seconds() - c0
    metrics = {**work, "rollout/generated_tokens": float(batch.num_generated_tokens),
               "rollout/retriever_calls": float(calls)}
    return batch, metrics

  # ---- what is computed ------------------------------------------------------------------

  def _decode_turn(self, params, cache, logits, key, active, pos, row_ids, turn, work):
    """Decodes one turn of the ``active`` rows; returns (cache, logits, per-row token lists).

    In chunks of ``rollout.decode_chunk`` steps (0: the whole turn in one call): after each
    chunk the rows whose turn ended (a stop sequence, the budget, a full cache) leave the batch
    (with ``compact_rows``), so a row that answered in 10 tokens does not run the turn's other
    38 steps. The stop check's window and the per-row key streams continue across chunks, so
    the tokens are those of one whole-turn call. ``pos`` is advanced in place."""
    s, b = self.s, len(active)
    s_max = s.seq_len + 1
    n_max = s.max_new_tokens
    chunk = s.decode_chunk if (s.decode_chunk and s.compact_rows) else n_max
    going = active.copy()
    left = np.where(active, n_max, 0).astype(np.int32)
    gen: list[list[int]] = [[] for _ in range(b)]
    window, step, steps = None, 0, 0
    while True:
      n = min(chunk, n_max - step)
      live = np.flatnonzero(going)
      rows = self._compact(live) if s.compact_rows else None
      span = self._span(int(pos[live].max(initial=0)) + n, s_max)
      self._program("decode", b if rows is None else len(rows), n, span)
      out = sampler_lib.decode(
          self.graphdef, params, cache, logits, key, self._rows(going), self._rows(left),
          max_new_tokens=n, stop_sequences=self.stops, temperature=s.temperature,
          top_p=s.top_p, top_k=s.top_k, greedy=s.greedy, rows=rows, row_ids=row_ids,
          span=span, window=window, step0=step)
      cache, logits, window = out.cache, out.next_logits, out.window
      toks, lens = self._local(out.tokens), self._local(out.lengths)
      stopped = self._local(out.stopped)
      for i in live:
        gen[i] += toks[i, :lens[i]].tolist()
      took = int(turns.agree_max(int(lens.max(initial=0))))
      steps += took
      work["rollout/token_rows"] += took * (b if rows is None else self._local_count(rows))
      work["rollout/real_tokens"] += float(lens.sum())
      work["rollout/trajectory_tokens"] += float(lens.sum())
      pos += lens
      left -= lens.astype(np.int32)
      going &= ~stopped.astype(bool) & (left > 0) & (pos < s_max)
      step += n
      if step >= n_max or not turns.any_process(going.any()):
        break
    work[f"rollout/decode_steps/turn={turn}"] = float(steps)
    return cache, logits, gen


  def _prefill(self, params, cache, logits, prompts, pos, work):
    """Writes every row's prompt into the cache; returns (logits f32[B, V], cache).

    Distinct prompts are extended once each (``prefill_once_per_group``; other rows get a
    copy of their first occurrence's KV rows and logits), after the common prefix of the
    batch's distinct prompts was extended once on one row and copied
    (``shared_prefix``; at least one token of every prompt is left to the second extend, which
    gives each row its own next-token logits)."""
    s, b = self.s, len(prompts)
    work["rollout/trajectory_tokens"] += float(sum(len(p) for p in prompts))
    pos[:] = [len(p) for p in prompts]
    first: dict[tuple, int] = {}
    rep = np.array([first.setdefault(tuple(p), i) if s.prefill_once_per_group else i
                    for i, p in enumerate(prompts)], np.int64)
    reps = np.flatnonzero(rep == np.arange(b))
    cut = 0
    if s.shared_prefix and len(reps) > 1:
      cut = min(_common_prefix([prompts[i] for i in reps]), min(len(prompts[i]) for i in reps) - 1)
    if self._agree(cut) > 0:
      head = [list(prompts[reps[0]][:cut])] if cut else []
      width = self._agree(s.width(cut, s.max_prompt_tokens))
      logits, cache = self._extend(params, cache, logits, head, reps[:len(head)], width,
                                   compact=True, work=work)
      cache, logits = self._copy(cache, logits, np.full(len(reps) - 1, reps[0]) if cut
                                 else np.zeros(0, np.int64), reps[1:] if cut else reps[:0], work)
    tails = [list(prompts[i][cut:]) for i in reps]
    width = self._agree(s.width(max(len(t) for t in tails), s.max_prompt_tokens))
    compact = s.compact_rows or s.prefill_once_per_group or s.shared_prefix
    logits, cache = self._extend(params, cache, logits, tails, reps, width, compact=compact,
                                 work=work, end=int(pos.max(initial=0)))
    dups = np.flatnonzero(rep != np.arange(b))
    cache, logits = self._copy(cache, logits, rep[dups], dups, work)
    return logits, cache

  def _extend_observations(self, params, cache, logits, obs, pos, work):
    """Extends each row's observation (rows without one: only with ``compact_rows`` off)."""
    s, b = self.s, len(obs)
    has = np.flatnonzero([len(o) > 0 for o in obs])
    width = self._agree(s.width(max((len(o) for o in obs), default=0), s.obs_width))
    work["rollout/trajectory_tokens"] += float(sum(len(o) for o in obs))
    end = int((pos + [len(o) for o in obs]).max(initial=0))
    if s.compact_rows:
      out = self._extend(params, cache, logits, [obs[i] for i in has], has, width,
                         compact=True, work=work, end=end)
    else:
      out = self._extend(params, cache, logits, obs, np.arange(b), width, compact=False,
                         work=work, end=end)
    pos += [len(o) for o in obs]
    return out

  def _extend(self, params, cache, logits, rows_tokens, rows, width, *, compact, work,
              end=None):
    """One ``extend_last`` of ``rows_tokens`` (token lists) into local ``rows`` at ``width``.

    ``compact``: only those rows are computed (their count rounded up, :meth:`_compact`);
    else every row of the batch, ``rows`` being all of them."""
    b = logits.shape[0] // jax.process_count()
    end = width if end is None else end
    span = self._span(end, self.s.seq_len + 1)
    if compact:
      idx = self._compact(np.asarray(rows, np.int64))
      n = self._local_count(idx)
      toks, lens = turns.pad_rows(rows_tokens, n, width, self.tok.pad_id)
      work["rollout/token_rows"] += float(n * width)
      work["rollout/real_tokens"] += float(lens.sum())
      self._program("extend", len(idx), width, span)
      return sampler_lib.extend_last(self.graphdef, params, cache, self._rows(toks),
                                     self._rows(lens), logits, idx, span=span)
    toks, lens = turns.pad_rows(rows_tokens, b, width, self.tok.pad_id)
    work["rollout/token_rows"] += float(b * width)
    work["rollout/real_tokens"] += float(lens.sum())
    self._program("extend", None, width, span)
    return sampler_lib.extend_last(self.graphdef, params, cache, self._rows(toks),
                                   self._rows(lens), logits, span=span)

  def _copy(self, cache, logits, src, dst, work):
    """Copies local rows ``src`` to local rows ``dst`` (KV rows and logits); a no-op when no
    process has any."""
    n = self._agree(len(dst))
    if n == 0:
      return cache, logits
    n = self._row_bucket(n)
    self._program("copy_rows", n)
    return sampler_lib.copy_rows(cache, logits, self._global_index(src, n, fill=0),
                                 self._global_index(dst, n))

  def _program(self, *shape) -> None:
    """Records a call's static shape in ``self.programs`` (one compiled program each)."""
    self.programs.add(shape)

  def _compact(self, local: np.ndarray) -> np.ndarray:
    """Global row indices (identical on every process) of each process's ``local`` rows, each
    process's list padded with an out-of-range row to the same bucketed count."""
    return self._global_index(local, self._row_bucket(self._agree(len(local))))

  def _row_bucket(self, n: int) -> int:
    """Rows computed for ``n`` needed (per process): rounded up to a multiple of an eighth of
    the process's B rows (and of its local devices), so a kind of call compiles at most 8
    programs, whatever the rows left."""
    b = self.batch_rows
    d = jax.local_device_count() if self.mesh is not None else 1
    q = d * max(1, -(-b // (8 * d)))
    return min(b, max(q, -(-int(n) // q) * q))

  def _global_index(self, local: np.ndarray, n: int, fill: int | None = None) -> np.ndarray:
    b, p = self.batch_rows, jax.process_count()
    pad = b * p if fill is None else fill
    own = np.full((n,), pad, np.int32)
    own[:len(local)] = np.asarray(local, np.int64) + jax.process_index() * b
    if p == 1:
      return own
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return np.asarray(multihost_utils.process_allgather(own)).reshape(-1)

  def _local(self, x) -> np.ndarray:
    """This process's B rows of a per-row output (compacted outputs may come back replicated
    over the processes: then its block is cut out)."""
    r = turns.local_rows(x)
    b = self.batch_rows
    return r if r.shape[0] == b else r[jax.process_index() * b:(jax.process_index() + 1) * b]

  def _local_count(self, idx: np.ndarray) -> int:
    return len(idx) // jax.process_count()

  def _span(self, needed: int, max_len: int) -> int | None:
    return sampler_lib.span_slots(self._agree(needed), max_len, self.s.slot_bucket)

  @staticmethod
  def _agree(x: int) -> int:
    """The largest ``x`` over processes (static shapes must be equal on every process)."""
    return turns.agree_max(x)

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


def _synced(x, t0: float) -> float:
  """Seconds since ``t0`` once ``x`` is computed (the device synchronised)."""
  jax.block_until_ready(x)
  return time.perf_counter() - t0


def _common_prefix(rows: Sequence[Sequence[int]]) -> int:
  """Length of the longest token prefix all ``rows`` share."""
  first = rows[0]
  n = min(len(r) for r in rows)
  for r in rows[1:]:
    k = 0
    while k < n and r[k] == first[k]:
      k += 1
    n = k
  return n


def padding_frac(m: Mapping[str, float]) -> float:
  """1 - real tokens / token rows computed (``rollout/padding_frac``) of engine metrics ``m``
  (``rollout/real_tokens``, ``rollout/token_rows``, counts); 0.0 when nothing was computed."""
  rows = m.get("rollout/token_rows", 0.0)
  return 1.0 - m.get("rollout/real_tokens", 0.0) / rows if rows else 0.0
