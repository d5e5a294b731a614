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

import dataclasses
import time
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gigrl import distributed
from gigrl.rollout import progress
from gigrl.rollout import shapes
from gigrl.models import sampler as sampler_lib
from gigrl.models import sharding as sharding_lib
from gigrl.models import transformer as tfm
from gigrl.rollout import trajectory as traj_lib
from gigrl.rollout import turns


class HostLoopEngine:
  """Runs batches of Search-R1 rollouts with a host loop over turns (a :class:`RolloutEngine`).

  Its jitted calls take their static shapes from a bounded grid (:class:`shapes.Grid`), so
  :meth:`plan` lists every program a batch size can execute and :meth:`warmup` compiles them
  all before the first rollout."""

  def __init__(self, model_cfg, graphdef, tokenizer, retriever, settings: turns.RolloutSettings,
               mesh=None, prompt_stats: shapes.PromptStats | None = None,
               distinct_rows: int | None = None):
    """``mesh``: if given, the KV cache is sharded over it (rows over ('data', 'fsdp'),
    KV heads over 'tp'), matching params laid out on the same mesh. On several processes it
    defaults to all devices on 'fsdp'. ``prompt_stats``: the lengths and shared prefix of every
    prompt the engine will roll out (:func:`turns.prompt_stats_of`; the widths and spans of the
    grid); None: taken from the first batch, and widened (with new programs) for a batch
    outside them. ``distinct_rows``: the most distinct prompts a batch holds (an RL step's
    candidate prompts per process; :class:`shapes.Grid`).

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
    self.prompt_stats, self.distinct_rows = prompt_stats, distinct_rows
    self.programs: set[shapes.Program] = set()   # static shapes met so far: one program each
    self.widened = 0                             # batches that fell outside prompt_stats

  # ---- the program set ------------------------------------------------------------------

  def grid(self, b: int) -> shapes.Grid:
    """The shape grid of ``b`` rows per process (needs ``prompt_stats``)."""
    if self.prompt_stats is None:
      raise ValueError("HostLoopEngine.grid: no prompt_stats yet (pass them, or run a batch)")
    return shapes.Grid(self.s, b, self._devices(b), self.prompt_stats, self.distinct_rows)

  def _devices(self, b: int) -> int:
    """The row shards of this process's ``b`` rows: its devices on the mesh's ('data', 'fsdp')
    axes, over which the KV cache's rows are split (1 without a mesh, or when the rows do not
    divide). Row compaction and copies stay within a shard (:func:`sampler_lib.gather_rows`),
    and row counts are multiples of it."""
    if self.mesh is None:
      return 1
    axis = int(np.prod([self.mesh.shape[a] for a in sharding_lib.BATCH]))
    p = jax.process_count()
    if axis % p or (b * p) % axis:
      return 1
    return axis // p

  def plan(self, b: int) -> list[shapes.Program]:
    """Every program a call of :meth:`run` with ``b`` rows per process can execute
    (:meth:`shapes.Grid.programs`)."""
    return self.grid(b).programs()

  def lower(self, params, b: int, prog: shapes.Program):
    """Traces and lowers ``prog`` (of :meth:`plan` of ``b``) for ``params``, without running
    it: ``.compile()`` of the result (``jax.stages.Lowered``) compiles it, after which a
    :meth:`run` that meets it compiles nothing (jax's own caches hold it)."""
    s = self.s
    if getattr(self, "_dummies", (None,))[0] != b:
      self.batch_rows = b
      self._dummies = (b,) + self._dummy_inputs(b)
    self.batch_rows = b
    _, cache, logits, key, row_ids = self._dummies
    r = prog.rows or b
    span = prog.span or None
    d = self._devices(b)
    none = np.zeros(0, np.int64)
    if prog.kind in ("prefill", "extend"):
      toks = self._rows(np.zeros((r, prog.width), np.int32))
      lens = self._rows(np.zeros((r,), np.int32))
      idx = self._shard_index(none, b, d, r) if prog.rows else None
      return sampler_lib.extend_last.lower(self.graphdef, params, cache, toks, lens, logits, idx,
                                           span=span, shards=self._shards(d))
    if prog.kind == "copy_rows":
      return sampler_lib.copy_rows.lower(cache, logits, self._shard_index(none, b, d, r, fill=0),
                                         self._shard_index(none, b, d, r), slots=span,
                                         shards=self._shards(d))
    if prog.kind == "decode":
      idx = self._shard_index(none, b, d, r) if prog.rows else None
      window = (self._rows(np.full((b, self.stops.shape[1]), -2, np.int32))
                if prog.resume else None)
      return sampler_lib.decode(
          self.graphdef, params, cache, logits, key, self._rows(np.zeros((b,), bool)),
          self._rows(np.zeros((b,), np.int32)), max_new_tokens=prog.width,
          stop_sequences=self.stops, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
          greedy=s.greedy, rows=idx, row_ids=row_ids, span=span, window=window,
          step0=1 if prog.resume else 0, shards=self._shards(d), lower_only=True)
    raise ValueError(f"unknown program kind {prog.kind!r}")

  def _dummy_inputs(self, b: int) -> tuple:
    """(cache, logits, key, row ids) a rollout of ``b`` rows starts from, which :meth:`lower`
    traces with (their eager zeros compile here too, and the loop's eager key split)."""
    _, sub = jax.random.split(jax.random.key(0))
    return (self._init_cache(b * jax.process_count(), self.s.seq_len + 1), self._logits0(b),
            sub, self._rows(np.arange(b, dtype=np.int32)))

  def warmup(self, params, b: int) -> None:
    """Compiles every program of :meth:`plan` of ``b`` (one after another)."""
    for prog in self.plan(b):
      self.lower(params, b, prog).compile()
    self.release()

  def release(self) -> None:
    """Frees the dummy KV cache and logits :meth:`lower` traced with (a whole cache: 1.9 GB for
    SmolLM2's 64 rows); the next :meth:`lower` allocates them again."""
    self._dummies = (None,)

  # ---- a rollout ------------------------------------------------------------------------

  def run(self, params, questions: Sequence[str | None], key: jax.Array
          ) -> tuple[traj_lib.TrajectoryBatch, dict[str, float]]:
    """Rolls out one trajectory per question (see :meth:`RolloutEngine.run`).

    What is computed follows the settings' switches (each saving can be turned off; the
    trajectories are the same either way, up to float rounding): a group's prompt is prefilled
    once and its KV rows copied (``prefill_once_per_group``), the prompts' common prefix
    once, on one row (``shared_prefix``), observation extends and decode turns run only the
    rows that need them (``compact_rows``), prompt tails as wide as the longest one
    (``width_bucket``), and attention and copies touch only the slots a call can have written
    (``slot_bucket``). Every static shape comes from :meth:`grid`. Each row samples from its
    own key stream (``fold_in(turn key, global row id)``), so compaction never changes a sample.

    Args:
      params: the policy's ``nnx.State``.
      questions: this process's B question strings (one process: the whole batch); ``None``
        marks a padding row (an evaluation's last batch): it gets no prompt, is never
        computed and comes back empty.
      key: PRNG key, the same on every process; the rollout is deterministic given it.
    Returns:
      (batch of this process's B rows, metrics): wall seconds ``time/prefill_s``,
      ``time/extend_s`` (observations), ``time/decode_s``, ``time/search_s``, each phase ended
      with the device synchronised; ``rollout/decode_steps`` and per turn
      ``rollout/decode_steps/turn=t`` (decode loop iterations); ``rollout/token_rows`` (token
      rows computed: prefill, extend and decode, padding included), ``rollout/real_tokens``
      (the real tokens among them), ``rollout/padding_frac`` (1 - real / computed),
      ``rollout/slot_reads`` (token rows × the cache slots their attention reads: what
      ``slot_bucket`` saves), and per phase (``prefill``, ``extend``, ``decode``) the work a
      floor counts, ``rollout/<phase>/{token_rows, real_tokens, weight_reads, kv_slots,
      attn_pairs}`` (:func:`_phase`),
      ``time/rollout_compile_s`` (seconds jax compiled in this rollout: 0 after
      :meth:`warmup`; the shapes met so far are ``engine.programs``),
      ``rollout/trajectory_tokens`` (prompt, observation and generated tokens of the
      trajectories: what every saving off computes without padding; with a group's prompt
      prefilled once, ``token_rows`` can be below it); ``rollout/generated_tokens`` and
      ``rollout/retriever_calls`` of this process.
    """
    s, b = self.s, len(questions)
    self.batch_rows = b
    real = np.array([q is not None for q in questions], bool)
    records = [traj_lib.TrajectoryBuilder() for _ in range(b)]
    given = turns.encode_prompts(self.tok, [q for q in questions if q is not None],
                                 s.max_prompt_tokens)
    prompts: list[list[int]] = [[] for _ in range(b)]
    for i, ids in zip(np.flatnonzero(real), given):
      prompts[i] = ids
      records[i].add_prompt(ids, anchor=questions[i])
    self._fit_stats(given)
    grid = self.grid(b)
    work = {"time/prefill_s": 0.0, "time/extend_s": 0.0, "time/decode_s": 0.0,
            "time/search_s": 0.0, "rollout/token_rows": 0.0, "rollout/real_tokens": 0.0,
            "rollout/trajectory_tokens": 0.0, "rollout/slot_reads": 0.0}
    s_max = s.seq_len + 1
    t0, c0 = time.perf_counter(), progress.compile_seconds()
    progress.report(f"rollout: prefill {int(real.sum())} rows")
    logits = self._logits0(b)
    cache = self._init_cache(b * jax.process_count(), s_max)   # global rows
    pos = np.zeros((b,), np.int64)          # host copy of each row's cache length
    logits, cache = self._prefill(params, cache, logits, prompts, real, pos, work, grid)
    work["time/prefill_s"] = _synced(logits, t0)
    active = real.copy()
    row_ids = self._rows(np.arange(b, dtype=np.int32) + np.int32(jax.process_index() * b))
    calls = 0
    for turn in range(s.max_turns + 1):
      key, sub = jax.random.split(key)
      t0 = time.perf_counter()
      live = np.flatnonzero(active)
      progress.report(f"rollout turn {turn + 1}/{s.max_turns + 1}: decode {len(live)} rows")
      cache, logits, gen, gen_lp = self._decode_turn(params, cache, logits, sub, active, pos,
                                                     row_ids, turn, work, grid)
      work["time/decode_s"] += time.perf_counter() - t0
      outcome = turns.dispatch_turn(
          [records[i] for i in live], [gen[i] for i in live],
          tokenizer=self.tok, retriever=self.retriever, settings=s,
          invalid_ids=self.invalid_ids, logprobs=[gen_lp[i] for i in live])
      work["time/search_s"] += outcome.search_s
      calls += outcome.queries > 0
      obs: list[list[int]] = [[] for _ in range(b)]
      for i, ids, done in zip(live, outcome.observations, outcome.done):
        obs[i], active[i] = ids, not done
      if turn == s.max_turns or not distributed.any_process(active.any()):
        break
      t0 = time.perf_counter()
      progress.report(f"rollout turn {turn + 1}/{s.max_turns + 1}: "
                      f"{outcome.queries} searches, extend observations")
      logits, cache, grid = self._extend_observations(params, cache, logits, obs, pos, work,
                                                      grid)
      work["time/extend_s"] += _synced(logits, t0)
    batch = traj_lib.collate(records, s.seq_len, self.tok.pad_id)
    work["rollout/decode_steps"] = float(sum(v for k, v in work.items()
                                             if k.startswith("rollout/decode_steps/")))
    work["rollout/padding_frac"] = padding_frac(work)
    work["time/rollout_compile_s"] = progress.compile_seconds() - c0
    metrics = {**work, "rollout/generated_tokens": float(batch.num_generated_tokens),
               "rollout/retriever_calls": float(calls)}
    return batch, metrics

  def _fit_stats(self, prompts: list[list[int]]) -> None:
    """Takes ``prompt_stats`` from the first batch, or widens them for a batch outside them
    (its shapes were not planned: they compile in this call; ``self.widened`` counts them).
    Collective on several processes: every process takes the same stats."""
    mine = shapes.prompt_stats(prompts) if prompts else None
    if self.prompt_stats is not None:
      if not distributed.any_process(not self.prompt_stats.covers(prompts)):
        return
      self.widened += 1
      mine = self.prompt_stats if mine is None else self.prompt_stats.merge(mine)
    elif mine is None:
      mine = shapes.PromptStats(1, 0)
    # the same stats on every process: the longest prompt, the shortest prefix
    self.prompt_stats = shapes.PromptStats(self._agree(mine.max_len), -self._agree(-mine.prefix))

  # ---- what is computed ------------------------------------------------------------------

  def _decode_turn(self, params, cache, logits, key, active, pos, row_ids, turn, work, grid):
    """Decodes one turn of the ``active`` rows; returns (cache, logits, per-row token lists).

    In calls of :meth:`shapes.Grid.turn_calls` (``rollout.decode_chunk`` steps, or the whole
    turn): after each chunk the rows whose turn ended (a stop sequence, the budget, a full
    cache) leave the batch (with ``compact_rows``), so a row that answered in 10 tokens does
    not run the turn's other 38 steps. The stop check's window and the per-row key streams
    continue across chunks, so the tokens are those of one whole-turn call. ``pos`` is
    advanced in place. Also returns each row's tokens' sampler log-probs (the behaviour
    policy's)."""
    s, b = self.s, len(active)
    s_max = s.seq_len + 1
    n_max = s.max_new_tokens
    going = active.copy()
    left = np.where(active, n_max, 0).astype(np.int32)
    gen: list[list[int]] = [[] for _ in range(b)]
    gen_lp: list[list[float]] = [[] for _ in range(b)]
    window, steps = None, 0
    for step, n in grid.turn_calls():
      live = np.flatnonzero(going)
      rows, computed = self._compact(live, grid, decode=True) if s.compact_rows else (None, b)
      span = grid.decode_span(turn, step, n)
      self._program(shapes.Program("decode", 0 if rows is None else computed, n, span,
                                   step > 0))
      out = sampler_lib.decode(
          self.graphdef, params, cache, logits, key, self._rows(going), self._rows(left),
          max_new_tokens=n, stop_sequences=self.stops, temperature=s.temperature,
          top_p=s.top_p, top_k=s.top_k, greedy=s.greedy, rows=rows, row_ids=row_ids,
          span=span or None, window=window, step0=step, shards=self._shards(grid.d))
      cache, logits, window = out.cache, out.next_logits, out.window
      toks, lens = self._local(out.tokens), self._local(out.lengths)
      stopped, lps = self._local(out.stopped), self._local(out.logprobs)
      for i in live:
        gen[i] += toks[i, :lens[i]].tolist()
        gen_lp[i] += lps[i, :lens[i]].tolist()
      took = int(distributed.agree_max(int(lens.max(initial=0))))
      steps += took
      work["rollout/token_rows"] += took * computed
      work["rollout/slot_reads"] += took * computed * (span or s_max)
      work["rollout/real_tokens"] += float(lens.sum())
      work["rollout/trajectory_tokens"] += float(lens.sum())
      _phase(work, "decode", rows=took * computed,
             real=float(lens.sum()), weight_reads=took,
             kv=_attended(pos[live], lens[live])[1])   # each step reads every slot again
      pos += lens
      left -= lens.astype(np.int32)
      going &= ~stopped.astype(bool) & (left > 0) & (pos < s_max)
      if not distributed.any_process(going.any()):
        break
    work[f"rollout/decode_steps/turn={turn}"] = float(steps)
    return cache, logits, gen, gen_lp

  def _prefill(self, params, cache, logits, prompts, real, pos, work, grid):
    """Writes every real row's prompt into the cache; returns (logits f32[B, V], cache).

    With ``shared_prefix`` the prompts' common prefix (``grid.prefix()`` tokens, the same
    for every batch) is extended once per row shard, on its first row, and its slots copied
    to the shard's other rows; with ``prefill_once_per_group`` each distinct prompt's tail is
    extended once per shard it has rows in, and the other rows get a copy of their first
    occurrence's KV rows and logits (copies never cross a shard: :meth:`_devices`)."""
    s, b = self.s, len(prompts)
    work["rollout/trajectory_tokens"] += float(sum(len(p) for p in prompts))
    pos[:] = [len(p) for p in prompts]
    shard = np.arange(b) // (b // grid.d)
    first: dict[tuple, int] = {}
    rep = np.array([first.setdefault((shard[i], tuple(p)), i) if s.prefill_once_per_group
                    else i for i, p in enumerate(prompts)], np.int64)
    reps = np.flatnonzero((rep == np.arange(b)) & real)
    cut = grid.prefix()
    heads = np.array([reps[shard[reps] == j][0] for j in range(grid.d)
                      if np.any(shard[reps] == j)], np.int64)   # a shard's first real row
    tails_kv = _attended(np.full(len(reps), cut), [len(prompts[i]) - cut for i in reps])
    head_kv = _attended(np.zeros(len(heads)), np.full(len(heads), cut))
    _phase(work, "prefill", kv=(tails_kv[0] + head_kv[0], tails_kv[1] + head_kv[1]))
    if cut:
      logits, cache = self._extend(params, cache, logits, [list(prompts[i][:cut]) for i in heads],
                                   heads, cut, grid.span(cut), compact=True, work=work,
                                   grid=grid, n_rows=grid.d)
      others = np.setdiff1d(np.flatnonzero(real), heads)
      head_of = dict(zip(shard[heads].tolist(), heads.tolist()))
      cache, logits = self._copy(cache, logits,
                                 np.array([head_of[shard[i]] for i in others], np.int64),
                                 others, grid.span(cut), grid)
    tails = [list(prompts[i][cut:]) for i in reps]
    compact = s.compact_rows or s.prefill_once_per_group or s.shared_prefix
    logits, cache = self._extend(params, cache, logits, tails, reps, grid.tail_width(),
                                 grid.prompt_span(), compact=compact, work=work, grid=grid)
    dups = np.flatnonzero((rep != np.arange(b)) & real)
    if s.prefill_once_per_group:
      cache, logits = self._copy(cache, logits, rep[dups], dups, grid.prompt_span(), grid)
    return logits, cache

  def _extend_observations(self, params, cache, logits, obs, pos, work, grid):
    """Extends each row's observation (rows without one: only with ``compact_rows`` off);
    returns (logits, cache, grid). An observation longer than the grid assumed (a retriever
    whose corpus was not measured) widens it to the ``max_obs_tokens`` budget for this and
    every later call (``self.widened`` counts it), so the spans stay bounds."""
    s, b = self.s, len(obs)
    has = np.flatnonzero([len(o) > 0 for o in obs])
    work["rollout/trajectory_tokens"] += float(sum(len(o) for o in obs))
    longest = self._agree(max((len(o) for o in obs), default=0))
    if longest > grid.obs_cap():
      self.prompt_stats = dataclasses.replace(self.prompt_stats, obs_len=None)
      self.widened += 1
      grid = self.grid(grid.b)
    span = grid.obs_span()
    width = grid.obs_width(longest)
    if s.compact_rows:
      out = self._extend(params, cache, logits, [obs[i] for i in has], has, width, span,
                         compact=True, work=work, grid=grid, kind="extend")
    else:
      out = self._extend(params, cache, logits, obs, np.arange(b), width, span,
                         compact=False, work=work, grid=grid, kind="extend")
    _phase(work, "extend", kv=_attended(pos[has], np.array([len(obs[i]) for i in has])))
    pos += [len(o) for o in obs]
    return out + (grid,)

  def _extend(self, params, cache, logits, rows_tokens, rows, width, span, *, compact, work,
              grid, kind="prefill", n_rows=None):
    """One ``extend_last`` of ``rows_tokens`` (token lists) into local ``rows`` at ``width``
    tokens over ``span`` slots (0: all).

    ``compact``: only those rows are computed (their count rounded up, :meth:`_compact`, or
    ``n_rows``); else every row of the batch, ``rows`` being all of them (padding rows get no
    tokens)."""
    b = logits.shape[0] // jax.process_count()
    local = np.asarray(rows, np.int64)
    idx, n = self._compact(local, grid, tails=kind == "prefill", total=n_rows) if compact else (
        None, b)
    if idx is not None:
      toks, lens = turns.pad_rows(self._shard_order(rows_tokens, local, grid, n), n, width,
                                  self.tok.pad_id)
      work["rollout/token_rows"] += float(n * width)
      work["rollout/slot_reads"] += float(n * width * (span or self.s.seq_len + 1))
      work["rollout/real_tokens"] += float(lens.sum())
      _phase(work, kind, rows=float(n * width), real=float(lens.sum()), weight_reads=1)
      self._program(shapes.Program(kind, n, width, span))
      return sampler_lib.extend_last(self.graphdef, params, cache, self._rows(toks),
                                     self._rows(lens), logits, idx, span=span or None,
                                     shards=self._shards(grid.d))
    full = [[] for _ in range(b)]        # every row computed (a compacted call of all B: too)
    for i, t in zip(rows, rows_tokens):
      full[i] = t
    toks, lens = turns.pad_rows(full, b, width, self.tok.pad_id)
    work["rollout/token_rows"] += float(b * width)
    work["rollout/slot_reads"] += float(b * width * (span or self.s.seq_len + 1))
    work["rollout/real_tokens"] += float(lens.sum())
    _phase(work, kind, rows=float(b * width), real=float(lens.sum()), weight_reads=1)
    self._program(shapes.Program(kind, 0, width, span))
    return sampler_lib.extend_last(self.graphdef, params, cache, self._rows(toks),
                                   self._rows(lens), logits, None, span=span or None,
                                   shards=self._shards(grid.d))   # as lower() calls it

  def _copy(self, cache, logits, src, dst, span, grid):
    """Copies local rows ``src`` to local rows ``dst`` (KV slots [0, span) and logits; each
    pair within one row shard), in a call of all B rows (``dst`` padded); a no-op when no
    process has any."""
    if self._agree(len(dst)) == 0:
      return cache, logits
    n = grid.b
    self._program(shapes.Program("copy_rows", n, 0, span))
    # each (src, dst) pair lies in one shard, so both index blocks keep the pairs in step
    return sampler_lib.copy_rows(cache, logits, self._shard_index(src, n, grid.d, n, fill=0),
                                 self._shard_index(dst, n, grid.d, n), slots=span or None,
                                 shards=self._shards(grid.d))

  def _program(self, prog: shapes.Program) -> None:
    """Records a call's static shape in ``self.programs`` (one compiled program each)."""
    self.programs.add(prog)

  def _compact(self, local: np.ndarray, grid: shapes.Grid, tails: bool = False,
               total: int | None = None, decode: bool = False):
    """The compacted call of this process's ``local`` rows: (index, rows computed per
    process). The index (:meth:`_shard_index`) holds each row shard's rows, every shard padded
    to the most any shard of any process needs, bucketed (:meth:`shapes.Grid.rows`; ``tails``:
    :meth:`shapes.Grid.tail_rows`), or ``total`` rows per process. None when that is all B
    rows: the call then computes every row in place (no gathered sub-cache, which would hold
    a second copy of the cache: :meth:`shapes.Grid.call_rows`)."""
    local = np.asarray(local, np.int64)
    if total is None:
      m = grid.b // grid.d
      per = np.bincount(local // m, minlength=grid.d).max(initial=0) if len(local) else 0
      n = self._agree(int(per) * grid.d)
      total = grid.tail_rows(n) if tails else grid.rows(n, decode)
    if grid.call_rows(total) == 0:
      return None, grid.b
    return self._shard_index(local, grid.b, grid.d, int(total)), int(total)

  def _shard_index(self, local: np.ndarray, b: int, d: int, n: int, fill: int | None = None):
    """i32[n] per process: for each of the ``d`` row shards of ``b`` rows, ``n / d`` slots
    holding ``local``'s rows in that shard (as indices local to it, in order), then ``fill``
    (default: past the shard's end, an empty row); a global array on several processes,
    every process giving its own shards' blocks (:func:`sampler_lib.gather_rows`)."""
    m, k = b // d, n // d
    local = np.asarray(local, np.int64)
    out = np.full((d, k), m if fill is None else fill, np.int32)
    for j in range(d):
      mine = local[local // m == j] - j * m
      if len(mine) > k:
        raise ValueError(f"row shard {j}: {len(mine)} rows in a call of {k} a shard")
      out[j, :len(mine)] = mine
    return self._index(out.reshape(-1))

  def _index(self, idx: np.ndarray):
    """A row index as the jitted programs take it: numpy on one process (replicated), else a
    global array split as the rows (each process's blocks on its devices)."""
    return idx if jax.process_count() == 1 else self._rows(idx)

  @staticmethod
  def _shards(d: int) -> int:
    """The row shards of every process together (the ``shards`` of the sampler's calls)."""
    return d * jax.process_count()

  @staticmethod
  def _shard_order(rows_tokens, local: np.ndarray, grid: shapes.Grid, n: int):
    """``rows_tokens`` (one list per row of ``local``) laid out as :meth:`_shard_index` lays
    out their rows: shard by shard, ``n / d`` slots each (empty lists pad)."""
    m, k = grid.b // grid.d, n // grid.d
    out = [[] for _ in range(n)]
    fill = np.zeros(grid.d, np.int64)
    for t, i in zip(rows_tokens, np.asarray(local, np.int64)):
      j = int(i // m)
      out[j * k + fill[j]] = t
      fill[j] += 1
    return out

  def _local(self, x) -> np.ndarray:
    """This process's B rows of a per-row output."""
    return turns.local_rows(x)

  @staticmethod
  def _agree(x: int) -> int:
    """The largest ``x`` over processes (static shapes must be equal on every process)."""
    return distributed.agree_max(x)

  def _rows(self, local: np.ndarray):
    """Per-row host data for the jitted programs: numpy on one process, else a global array
    whose rows on this process are ``local``."""
    if jax.process_count() == 1:
      return local
    global_shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
    return turns.global_rows(local, sharding_lib.batch_sharding(self.mesh, global_shape))

  def _logits0(self, b: int):
    """Zero next-token logits f32[B, V] to start a rollout, laid out as every later call's
    (so the first call compiles the same program as :meth:`warmup`)."""
    if jax.process_count() > 1:
      return self._rows(np.zeros((b, self.model_cfg.vocab_size), np.float32))
    x = jnp.zeros((b, self.model_cfg.vocab_size), jnp.float32)
    if self.mesh is None:
      return x
    return jax.device_put(x, sharding_lib.batch_sharding(self.mesh, x.shape))

  def _init_cache(self, batch: int, max_len: int):
    if self.mesh is None:
      return tfm.init_cache(self.model_cfg, batch, max_len)
    return tfm.init_cache(self.model_cfg, batch, max_len, sharding=sharding_lib.cache_shardings(
        self.model_cfg, self.mesh, batch, max_len))


def _phase(work: dict, phase: str, *, rows: float = 0.0, real: float = 0.0,
           weight_reads: float = 0.0, kv: tuple[float, float] | float = 0.0) -> None:
  """Adds to ``phase``'s work counters (``prefill``, ``extend``, ``decode``):
  ``rollout/<phase>/token_rows`` (computed, padding included), ``.../real_tokens``,
  ``.../weight_reads`` (passes over the weights: calls, or decode steps) and, from
  :func:`_attended`, ``.../kv_slots`` (cache slots the real rows must read, once a pass) and
  ``.../attn_pairs`` (query-token x key-slot pairs the real tokens attend over)."""
  slots, pairs = kv if isinstance(kv, tuple) else (kv, kv)
  for key, v in (("token_rows", rows), ("real_tokens", real), ("weight_reads", weight_reads),
                 ("kv_slots", slots), ("attn_pairs", pairs)):
    k = f"rollout/{phase}/{key}"
    work[k] = work.get(k, 0.0) + float(v)


def _attended(pos: np.ndarray, new: np.ndarray) -> tuple[float, float]:
  """(slots read, attention pairs) of rows that hold ``pos`` slots and append ``new`` tokens in
  one pass: each row reads its ``pos + new`` slots once; its j-th new token attends over
  ``pos + j + 1`` of them."""
  pos, new = np.asarray(pos, np.float64), np.asarray(new, np.float64)
  live = new > 0
  pos, new = pos[live], new[live]
  return float((pos + new).sum()), float((new * pos + new * (new + 1) / 2).sum())


def _synced(x, t0: float) -> float:
  """Seconds since ``t0`` once ``x`` is computed (the device synchronised)."""
  jax.block_until_ready(x)
  return time.perf_counter() - t0


def padding_frac(m: Mapping[str, float]) -> float:
  """1 - real tokens / token rows computed (``rollout/padding_frac``) of engine metrics ``m``
  (``rollout/real_tokens``, ``rollout/token_rows``, counts); 0.0 when nothing was computed."""
  rows = m.get("rollout/token_rows", 0.0)
  return 1.0 - m.get("rollout/real_tokens", 0.0) / rows if rows else 0.0
