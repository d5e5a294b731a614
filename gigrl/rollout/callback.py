"""One-program multi-turn rollout engine (``rollout.engine = callback``).

The whole Search-R1 rollout of a batch is one ``jax.jit``-compiled program (compiled once per
batch shape): prefill the prompts, then a single ``lax.while_loop`` over decode steps. Every step
each decoding row samples one token and feeds it through ``extend``
(:func:`gigrl.models.sampler.decode_step`, the host loop's decode step). A row's turn ends at
``</search>``, ``</answer>`` (any of their token sequences,
:func:`gigrl.rollout.turns.stop_sequences`), EOS or after ``max_new_tokens`` tokens. At a turn
boundary the program makes one ``jax.experimental.io_callback`` (``ordered=False``) for all the
rows whose turn has ended. The host function (:meth:`CallbackEngine._host_turn`) runs the turn
dispatch that the host loop runs (:func:`gigrl.rollout.turns.dispatch_turn`): it decodes and
parses each turn, calls the retriever once for all the rows' queries, records the turn and the
observation, and returns fixed-shape int32 observations (nothing on the final turn / after an
answer) and a done flag per row.

The program prefills these observations into the rows' KV cache with one ``extend`` and goes on.
When the boundary is due is the ``boundary`` option:

  * ``'turn'`` (default): once every unfinished row of the shard has ended its turn. Rows that
    end early wait. This is the host loop's schedule, but each shard keeps its own pace.
  * ``'step'``: in every step where some row ended a turn. Rows never wait, but each such step
    pays an observation ``extend`` of width ``max_obs_tokens`` over the whole local batch,
    about 100x a decode step on a CPU. ``benchmarks/rollout.py`` measures both.

The protocol and outputs are those of :class:`gigrl.rollout.host_loop.HostLoopEngine` (Search-R1
``search_r1/llm_agent/generation.py`` @ a14dc3a). The trajectories are recorded on the host
(prompt, each turn's generated tokens as the program passes them to the callback, each
observation), exactly as the host loop records them; the program returns each row's cache
length, which is checked against the record.

Sharding: the program runs under ``jax.shard_map`` with the batch split over *every* device of
the mesh (a 1-D mesh over the caller's devices, default all), so each device searches only for
its own rows, the per-device callbacks run concurrently, and the per-shard loops exit
independently. Parameters are **replicated** on every device for this engine (the jit
all-gathers sharded params); use the host loop for models that need tensor parallelism.

Several processes (one per host of a pod): every process calls :meth:`CallbackEngine.run` with
its own questions (the same count on each); they are split over that process's devices, and
``io_callback`` under ``shard_map`` calls each process's host function for its own devices'
rows only, so each process records and searches only its rows and returns them.

Differences from the host loop:
  * With sampling (``greedy=False``) the random stream differs: one key per step, folded with
    the shard index, instead of one key per turn. Greedy rollouts are identical.
  * With ``boundary='step'``, a batch can run many more observation ``extend`` calls than the
    host loop's ``max_turns`` (see above).
  * A retriever (or tokenizer) exception on the host is not raised through the callback.
    The host marks every row done, the program ends within one turn, and ``run`` raises
    :class:`CallbackRolloutError` chained to the original exception. This avoids relying on
    backend behaviour for exceptions in callbacks (see jax-ml/jax #6621 for old TPU hangs).
    On several processes, the other processes' rows finish normally.

References: Search-R1 ``generation.py``; JAX ``jax.experimental.io_callback`` and
``jax.shard_map`` docs (per-shard callbacks run concurrently, one per device).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gigrl.models import sampler as sampler_lib
from gigrl.models import transformer as tfm
from gigrl.rollout import trajectory as traj_lib
from gigrl.rollout import turns

ROW_AXIS = "rollout_rows"   # the engine's own 1-D mesh axis (see row_mesh)


class CallbackRolloutError(RuntimeError):
  """The host side of a callback rollout failed (e.g. the retriever raised).

  ``__cause__`` is the original exception.
  """


@dataclasses.dataclass
class _RunState:
  """Everything the host callbacks of one ``run`` share (callbacks run concurrently)."""
  records: list[traj_lib.TrajectoryBuilder]   # this process's rows, local order
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
  error: BaseException | None = None
  error_where: str = ""
  callbacks: int = 0
  search_calls: int = 0
  search_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)
  callback_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)


def union_seconds(spans: Sequence[tuple[float, float]]) -> float:
  """Length of the union of [start, end) intervals (concurrent callbacks overlap)."""
  total, end = 0.0, -math.inf
  for a, b in sorted(spans):
    if b <= end:
      continue
    total += b - max(a, end)
    end = b
  return total


def row_mesh(mesh: Mesh | None = None) -> Mesh:
  """1-D ``ROW_AXIS`` mesh over the devices of ``mesh`` (default: all devices).

  The batch is split over every device, whatever the caller's axes. The axis is deliberately
  not called ``'data'``/``'fsdp'``: inside ``shard_map`` those axes are Manual, and model code
  that constrains activations to them under the ambient mesh
  (``gigrl.models.transformer.constrain_batch``) would raise.
  """
  devices = np.asarray(jax.devices() if mesh is None else mesh.devices).reshape(-1)
  return Mesh(devices, (ROW_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


# --------------------------------------------------------------------------- device program


class _Carry(NamedTuple):
  i: jax.Array            # i32[] decode step
  cache: tfm.KVCache
  logits: jax.Array       # f32[b, V] next-token logits
  key: jax.Array
  gen: jax.Array          # i32[b, N] the current turn's generated tokens
  turn: jax.Array         # i32[b] current turn of each row
  turn_len: jax.Array     # i32[b] tokens generated in the current turn
  window: jax.Array       # i32[b, L] last generated tokens, for stop matching
  waiting: jax.Array      # bool[b] turn ended, observation not yet inserted
  done: jax.Array         # bool[b]


class CallbackEngine:
  """Runs batches of Search-R1 rollouts as one jitted program with host search callbacks.

  A :class:`gigrl.rollout.engine.RolloutEngine`, with the host loop's constructor (including
  its optional ``mesh``). The batch is split over all devices of the mesh; params are
  replicated. One ``run`` at a time per engine is the intended use, but concurrent runs are
  kept apart by a run id passed into the program.
  """

  def __init__(self, model_cfg, graphdef, tokenizer, retriever, settings: turns.RolloutSettings,
               *, mesh: Mesh | None = None, boundary: str = "turn", obs_chunk: int = 0):
    """Args beyond the host loop's:
      mesh: devices to split the batch over (all of them, flattened; see :func:`row_mesh`);
        default all devices.
      boundary: when a shard runs the callback + observation ``extend``:
        ``'turn'`` (default) once all its unfinished rows have ended their turn (rows that end
        early wait; the host loop's schedule, but per shard), or ``'step'`` in every step in
        which some row ended a turn (rows never wait, but every such step pays an
        observation ``extend`` of width ``max_obs_tokens``).
      obs_chunk: rows per observation ``extend`` (see :meth:`_insert`); 0 = auto: the whole
        local batch for ``'turn'``, ceil(b/8) rows for ``'step'``.
    Raises:
      ValueError: an unknown ``boundary``.
      ConfigError: a token budget of ``settings`` that this tokenizer's texts do not fit
        (:func:`gigrl.rollout.turns.check_settings`).
    """
    if boundary not in ("turn", "step"):
      raise ValueError(f"boundary={boundary!r}; expected 'turn' or 'step'")
    if obs_chunk < 0:
      raise ValueError(f"obs_chunk={obs_chunk} must be >= 0")
    self.boundary, self.obs_chunk = boundary, int(obs_chunk)
    self.model_cfg, self.graphdef = model_cfg, graphdef
    self.tok, self.retriever, self.s = tokenizer, retriever, settings
    self.stops = turns.stop_sequences(tokenizer)
    turns.check_settings(tokenizer, settings)
    self.invalid_ids = traj_lib.invalid_observation_ids(tokenizer)
    self.mesh = row_mesh(mesh)
    self._batch_spec = P(ROW_AXIS)
    self._runs: dict[int, _RunState] = {}
    self._run_ids = itertools.count()
    self._registry_lock = threading.Lock()
    self._programs: dict = {}       # PRNG key implementation -> jitted program

  def _program(self, key_impl):
    """The jitted per-shard program for keys of ``key_impl`` (None: raw uint32 keys). The key
    enters as its raw data, which can be put on several processes' devices."""
    if key_impl not in self._programs:
      b = self._batch_spec

      def program(params, prompts, prompt_lens, row_ids, live, key_data, run_id):
        key = key_data if key_impl is None else jax.random.wrap_key_data(key_data,
                                                                          impl=key_impl)
        return self._shard_program(params, prompts, prompt_lens, row_ids, live, key, run_id)

      self._programs[key_impl] = jax.jit(jax.shard_map(
          program, mesh=self.mesh, in_specs=(P(), b, b, b, b, P(), P()), out_specs=(b, b),
          check_vma=False))
    return self._programs[key_impl]

  @property
  def num_local_shards(self) -> int:
    """Devices of the mesh on this process."""
    me = jax.process_index()
    return sum(d.process_index == me for d in self.mesh.devices.flat)

  # ------------------------------------------------------------------ public

  def run(self, params, questions: Sequence[str], key: jax.Array
          ) -> tuple[traj_lib.TrajectoryBatch, dict[str, float]]:
    """Rolls out one trajectory per question (see :meth:`RolloutEngine.run`).

    The batch is padded with empty, already-finished rows up to a multiple of this process's
    shard count; the padding is dropped from the result.

    Args:
      params: the policy's ``nnx.State`` (replicated for the program).
      questions: this process's B question strings (one process: the whole batch; the same
        count on every process).
      key: PRNG key, the same on every process; the rollout is deterministic given it and the
        mesh size.
    Returns:
      (batch, metrics): a :class:`TrajectoryBatch` of this process's B rows, width
      ``settings.seq_len``, and this process's ``time/decode_s`` (program wall time outside
      host callbacks), ``time/search_s`` (wall time with at least one search in progress:
      retriever + observation tokenisation), ``time/callback_s``, ``time/total_s``,
      ``rollout/generated_tokens``, ``rollout/callbacks``, ``rollout/retriever_calls``,
      ``rollout/decode_steps``.
    Raises:
      ValueError: a prompt is longer than ``max_prompt_tokens``.
      CallbackRolloutError: the host callback failed (retriever or tokenizer error).
    """
    s, b = self.s, len(questions)
    prompts = turns.encode_prompts(self.tok, questions, s.max_prompt_tokens)
    n = self.num_local_shards
    b_pad = max(n, -(-b // n) * n)
    # the prompts' width: the longest rounded up to rollout.width_bucket (one program per width)
    width = turns.agree_max(s.width(max(len(p) for p in prompts), s.max_prompt_tokens))
    toks, lens = turns.pad_rows(prompts, b_pad, width, self.tok.pad_id)
    live = np.arange(b_pad) < b
    records = [traj_lib.TrajectoryBuilder() for _ in range(b_pad)]
    for rec, ids, q in zip(records, prompts, questions):
      rec.add_prompt(ids, anchor=q)
    run_id, run = self._register(records)
    try:
      t0 = time.perf_counter()
      typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
      key_impl = jax.random.key_impl(key) if typed else None
      key_data = np.asarray(jax.random.key_data(key) if typed else key)
      args = self._place(params, toks, lens, np.arange(b_pad, dtype=np.int32), live, key_data,
                         np.int32(run_id))
      with jax.set_mesh(self.mesh):   # shard_map wants its mesh to be the ambient one
        lengths, steps = self._program(key_impl)(*args)
      lengths, steps = turns.local_rows(lengths), turns.local_rows(steps)
      total = time.perf_counter() - t0
    finally:
      with self._registry_lock:
        self._runs.pop(run_id, None)
    if run.error is not None:
      raise CallbackRolloutError(
          f"callback rollout failed on the host ({run.error_where}): "
          f"{type(run.error).__name__}: {run.error}") from run.error
    held = np.array([len(r.tokens) for r in records[:b]], np.int32)
    if not np.array_equal(held, lengths[:b]):
      raise RuntimeError(f"callback rollout: host records hold {held.tolist()} tokens but the "
                         f"KV caches {lengths[:b].tolist()} (engine bug)")
    batch = traj_lib.collate(records[:b], s.seq_len, self.tok.pad_id)
    callback_s = union_seconds(run.callback_spans)
    metrics = {"time/decode_s": total - callback_s,
               "time/search_s": union_seconds(run.search_spans),
               "time/callback_s": callback_s, "time/total_s": total,
               "rollout/generated_tokens": float(batch.num_generated_tokens),
               "rollout/callbacks": float(run.callbacks),
               "rollout/retriever_calls": float(run.search_calls),
               "rollout/decode_steps": float(np.max(steps))}
    return batch, metrics

  def _place(self, params, *args):
    """Puts params (replicated) and the per-row inputs (split over the rows) on the engine's
    mesh, whatever mesh the caller's arrays live on (e.g. the trainer's FSDP layout). On
    several processes the per-row inputs are this process's rows of global arrays."""
    repl = NamedSharding(self.mesh, P())
    rows = NamedSharding(self.mesh, self._batch_spec)
    params = jax.device_put(params, repl)
    per_row, same = args[:4], args[4:]
    if jax.process_count() > 1:
      per_row = tuple(turns.global_rows(a, rows) for a in per_row)
      # host values equal on every process -> replicated global arrays
      same = tuple(jax.make_array_from_process_local_data(repl, np.asarray(a)) for a in same)
    else:
      per_row = tuple(jax.device_put(a, rows) for a in per_row)
      same = tuple(jax.device_put(a, repl) for a in same)
    return (params,) + per_row + same

  # ------------------------------------------------------------------ host side

  def _register(self, records: list[traj_lib.TrajectoryBuilder]) -> tuple[int, _RunState]:
    run = _RunState(records=records)
    with self._registry_lock:
      run_id = next(self._run_ids) % (2**31 - 1)
      self._runs[run_id] = run
    return run_id, run

  def _host_turn(self, run_id, row_ids, ended, gen, gen_len):
    """Host side of one turn boundary on one shard (called from the program).

    Args (jax Arrays, converted with ``np.asarray``):
      run_id: i32[] key of the run's records.
      row_ids: i32[b] this process's row index of each row of the shard.
      ended: i32[b] 1 for rows whose turn ended in this step.
      gen: i32[b, N] the turn's generated tokens (stop tokens included), garbage after gen_len.
      gen_len: i32[b].
    Returns:
      (obs i32[b, W], obs_len i32[b], done i32[b]). ``done`` is 1 for rows that answered or
      finished their final turn; on a host error it is 1 for every row (the error is kept
      for ``run`` to raise).
    """
    t0 = time.perf_counter()
    b, w = np.shape(row_ids)[0], self.s.obs_width
    obs = np.full((b, w), self.tok.pad_id, np.int32)
    obs_len = np.zeros((b,), np.int32)
    done = np.zeros((b,), np.int32)
    run = self._runs.get(int(np.asarray(run_id)))
    if run is None or run.error is not None:
      done[:] = 1
      return obs, obs_len, done
    row_ids, gen, gen_len = np.asarray(row_ids), np.asarray(gen), np.asarray(gen_len)
    rows = np.flatnonzero(np.asarray(ended))
    try:
      outcome = turns.dispatch_turn(
          [run.records[int(row_ids[j])] for j in rows], [gen[j, :gen_len[j]] for j in rows],
          tokenizer=self.tok, retriever=self.retriever, settings=self.s,
          invalid_ids=self.invalid_ids)
      obs[rows], obs_len[rows] = turns.pad_rows(outcome.observations, len(rows), w,
                                                self.tok.pad_id)
      done[rows] = outcome.done
    except Exception as e:  # pylint: disable=broad-except
      with run.lock:
        if run.error is None:
          run.error, run.error_where = e, f"rows {row_ids.tolist()}"
      obs_len[:], done[:] = 0, 1
      outcome = None
    t1 = time.perf_counter()
    with run.lock:
      run.callbacks += 1
      run.callback_spans.append((t0, t1))
      if outcome is not None and outcome.queries:
        run.search_calls += 1
        run.search_spans.append((t1 - outcome.search_s, t1))
    return obs, obs_len, done

  # ------------------------------------------------------------------ device side

  def _next_tokens(self, logits: jax.Array, key: jax.Array, row_ids: jax.Array,
                   turn: jax.Array, turn_len: jax.Array) -> jax.Array:
    """The policy's choice: f32[b, V] logits -> i32[b] (tests override this to script)."""
    del row_ids, turn, turn_len
    s = self.s
    return sampler_lib.sample_tokens(logits, key, jnp.float32(s.temperature), top_k=s.top_k,
                                     top_p=s.top_p, greedy=s.greedy)

  def _shard_program(self, params, prompts, prompt_lens, row_ids, live, key, run_id):
    """Per-shard rollout: prefill, then the decode/turn loop.

    Args (local shard):
      params: replicated params.
      prompts: i32[b, P] right-padded prompt tokens; prompt_lens: i32[b].
      row_ids: i32[b] the process's row ids; live: bool[b] False for batch padding.
      key: PRNG key (folded with the shard index); run_id: i32[].
    Returns:
      lengths i32[b] (tokens in each row's cache), decode steps i32[1].
    """
    s, cfg = self.s, self.model_cfg
    model = nnx.merge(self.graphdef, params)
    b = prompts.shape[0]
    shard = jax.lax.axis_index(ROW_AXIS)
    cache = tfm.init_cache(cfg, b, s.seq_len + 1)
    logits = jnp.zeros((b, cfg.vocab_size), jnp.float32)
    logits, cache = sampler_lib.model_extend_last(model, cache, prompts, prompt_lens, logits)
    c0 = _Carry(
        i=jnp.int32(0), cache=cache, logits=logits, key=jax.random.fold_in(key, shard),
        gen=jnp.full((b, s.max_new_tokens), self.tok.pad_id, jnp.int32),
        turn=jnp.zeros((b,), jnp.int32), turn_len=jnp.zeros((b,), jnp.int32),
        window=jnp.full((b, self.stops.shape[1]), -2, jnp.int32),
        waiting=jnp.zeros((b,), bool), done=~live)
    max_steps = (s.max_turns + 1) * s.max_new_tokens
    c = jax.lax.while_loop(
        lambda c: (c.i < max_steps) & jnp.any(~c.done),
        lambda c: self._step(model, c, row_ids, run_id), c0)
    return c.cache.pos, c.i[None]

  def _step(self, model, c: _Carry, row_ids, run_id) -> _Carry:
    """One decode step for every decoding row, then the turn boundary if it is due."""
    s = self.s
    b, n = c.gen.shape
    key, sub = jax.random.split(c.key)
    act = ~c.done & ~c.waiting

    def feed(cache, tok, act, logits):
      return sampler_lib.model_extend_last(model, cache, tok[:, None], act.astype(jnp.int32),
                                           logits)

    def choose(logits, key):
      return self._next_tokens(logits, key, row_ids, c.turn, c.turn_len)

    out = sampler_lib.decode_step(feed, c.cache, c.logits, c.window, act, sub,
                                  jnp.asarray(self.stops), jnp.float32(s.temperature),
                                  top_k=s.top_k, top_p=s.top_p, greedy=s.greedy, choose=choose)
    cache = out.kv
    turn_len = c.turn_len + act.astype(jnp.int32)
    ended = act & (out.hit | (turn_len >= s.max_new_tokens) | (cache.pos >= cache.max_len))
    col = jnp.where(act, c.turn_len, n)                       # out of range: dropped
    c = c._replace(
        i=c.i + 1, cache=cache, logits=out.logits, key=key,
        gen=c.gen.at[jnp.arange(b), col].set(out.tokens, mode="drop"),
        turn_len=turn_len, window=out.window, waiting=c.waiting | ended)
    if self.boundary == "step":
      due = jnp.any(ended)
    else:
      due = jnp.any(c.waiting) & ~jnp.any(~c.done & ~c.waiting)
    return jax.lax.cond(due, lambda c: self._boundary(model, c, c.waiting, row_ids, run_id),
                        lambda c: c, c)

  def _boundary(self, model, c: _Carry, ended, row_ids, run_id) -> _Carry:
    """Host callback for the rows in ``ended`` (bool[b]), then their observations go into the
    cache and they start their next turn."""
    b = c.gen.shape[0]
    w = self.s.obs_width
    i32 = jnp.int32
    obs, obs_len, host_done = io_callback(
        self._host_turn,
        (jax.ShapeDtypeStruct((b, w), i32), jax.ShapeDtypeStruct((b,), i32),
         jax.ShapeDtypeStruct((b,), i32)),
        run_id, row_ids, ended.astype(i32), c.gen, c.turn_len, ordered=False)
    obs_len = jnp.where(ended, jnp.clip(obs_len, 0, w), 0)
    logits, cache = self._insert(model, c.cache, c.logits, obs, obs_len)
    return c._replace(
        cache=cache, logits=logits,
        turn=c.turn + ended.astype(i32),
        turn_len=jnp.where(ended, 0, c.turn_len),
        window=jnp.where(ended[:, None], -2, c.window),
        waiting=jnp.zeros_like(c.waiting), done=c.done | (host_done > 0))

  def _insert(self, model, cache: tfm.KVCache, logits, obs, obs_len):
    """Extends rows by their observations (obs i32[b, W], obs_len i32[b]; 0 = no change).

    With ``obs_chunk`` m < b, only the rows with an observation are extended, m at a time: their
    cache rows are gathered, extended and scattered back (a ``while_loop`` over chunks), so a
    boundary with one observation costs one m-row extend, not a b-row one.
    Returns (logits f32[b, V], cache).
    """
    b = obs.shape[0]
    m = min(b, self.obs_chunk or (b if self.boundary == "turn" else max(1, -(-b // 8))))
    if m >= b:
      return sampler_lib.model_extend_last(model, cache, obs, obs_len, logits)
    need = obs_len > 0
    count = jnp.sum(need.astype(jnp.int32))
    order = jnp.concatenate([jnp.argsort(~need, stable=True).astype(jnp.int32),
                             jnp.full((m,), b, jnp.int32)])

    def body(carry):
      j, cache, logits = carry
      sel = jax.lax.dynamic_slice(order, (j,), (m,))
      ok = (j + jnp.arange(m)) < count
      get = jnp.minimum(sel, b - 1)
      put = jnp.where(ok, sel, b)                                   # b: dropped
      sub = tfm.KVCache(cache.k[:, get], cache.v[:, get], cache.pos[get])
      lg, sub = sampler_lib.model_extend_last(
          model, sub, obs[get], jnp.where(ok, obs_len[get], 0), logits[get])
      cache = tfm.KVCache(cache.k.at[:, put].set(sub.k, mode="drop"),
                          cache.v.at[:, put].set(sub.v, mode="drop"),
                          cache.pos.at[put].set(sub.pos, mode="drop"))
      return j + m, cache, logits.at[put].set(lg, mode="drop")

    _, cache, logits = jax.lax.while_loop(lambda c: c[0] < count, body,
                                          (jnp.int32(0), cache, logits))
    return logits, cache

