"""One-program multi-turn rollout engine (``rollout.engine = callback``).

The whole Search-R1 rollout of a batch is one ``jax.jit``-compiled program (compiled once per
batch shape): prefill the prompts, then a single ``lax.while_loop`` over decode steps. Every step
each decoding row samples one token and feeds it through ``extend``. A row's turn ends at
``</search>``, ``</answer>``, EOS or after ``max_new_tokens`` tokens. At a turn boundary the
program makes one ``jax.experimental.io_callback`` (``ordered=False``) for all the rows whose turn
has ended. The host function (:meth:`CallbackEngine._host_turn`) then:

  * decodes and parses each turn (:mod:`gigrl.rollout.protocol`);
  * calls the retriever once for all the rows' queries;
  * returns fixed-shape int32 observations (``trajectory.observation_ids``, the invalid-action
    message, or nothing on the final turn / after an answer) and a done flag per row.

The program prefills these observations into the rows' KV cache with one ``extend`` and goes on.
When the boundary is due is the ``boundary`` option:

  * ``'turn'`` (default): once every unfinished row of the shard has ended its turn. Rows that
    end early wait. This is the host loop's schedule, but each shard keeps its own pace.
  * ``'step'``: in every step where some row ended a turn. Rows never wait, but each such step
    pays an observation ``extend`` of width ``max_obs_tokens`` over the whole local batch,
    about 100x a decode step on a CPU. ``benchmarks/rollout.py`` measures both.

The protocol and outputs are those of :class:`gigrl.rollout.host_loop.HostLoopEngine` (Search-R1
``search_r1/llm_agent/generation.py`` @ a14dc3a). Token buffers, loss mask and
step ids are written inside the program at the cache slots (a trajectory's tokens are exactly
what its KV cache holds). Texts, anchors, action validity and search counts are recorded on the
host, keyed by the global row ids that the program passes to the callback.

Sharding: the program runs under ``jax.shard_map`` with the batch split over *every* device of
the mesh (a 1-D mesh over the caller's devices, default all), so each device (on a pod, each host)
searches only for its own rows, the per-device callbacks run concurrently, and the per-shard
loops exit independently. Parameters are **replicated** on every device for this engine (the
jit all-gathers sharded params); use the host loop for models that need tensor parallelism.

Differences from the host loop:
  * With sampling (``greedy=False``) the random stream differs: one key per step, folded with
    the shard index, instead of one key per turn. Greedy rollouts are identical.
  * With ``boundary='step'``, a batch can run many more observation ``extend`` calls than the
    host loop's ``max_turns`` (see above).
  * A retriever (or tokenizer) exception on the host is not raised through the callback.
    The host marks every row done, the program ends within one turn, and ``run`` raises
    :class:`CallbackRolloutError` chained to the original exception. This avoids relying on
    backend behaviour for exceptions in callbacks (see jax-ml/jax #6621 for old TPU hangs).
  * Single process only. On a multi-host pod, each process would record only its own rows'
    texts, and an all-gather of the host records is not implemented.

References: Search-R1 ``generation.py``; JAX ``jax.experimental.io_callback`` and
``jax.shard_map`` docs (per-shard callbacks run concurrently, one per device).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gigrl.models import sampler as sampler_lib
from gigrl.models import transformer as tfm
from gigrl.rollout import host_loop
from gigrl.rollout import protocol
from gigrl.rollout import trajectory as traj_lib

RolloutSettings = host_loop.RolloutSettings
ROW_AXIS = "rollout_rows"   # the engine's own 1-D mesh axis (see row_mesh)


class CallbackRolloutError(RuntimeError):
  """The host side of a callback rollout failed (e.g. the retriever raised).

  ``__cause__`` is the original exception.
  """


# --------------------------------------------------------------------------- host records


@dataclasses.dataclass
class _RowRecord:
  """Host-side part of one trajectory (the token buffers live in the program)."""
  anchors: list[str]
  generated_text: list[str] = dataclasses.field(default_factory=list)
  action_valid: list[bool] = dataclasses.field(default_factory=list)
  search_calls: int = 0
  answer_turn: int = -1


@dataclasses.dataclass
class _RunState:
  """Everything the host callbacks of one ``run`` share (callbacks run concurrently)."""
  rows: list[_RowRecord]
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


def _pad_rows(rows: Sequence[Sequence[int]], n: int, width: int, pad_id: int
              ) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists into (i32[n, width], i32[n]); rows past len(rows) are empty."""
  toks = np.full((n, width), pad_id, np.int32)
  lens = np.zeros((n,), np.int32)
  for i, r in enumerate(rows):
    toks[i, :len(r)], lens[i] = r, len(r)
  return toks, lens


# --------------------------------------------------------------------------- device program


class _Carry(NamedTuple):
  i: jax.Array            # i32[] decode step
  cache: tfm.KVCache
  logits: jax.Array       # f32[b, V] next-token logits
  key: jax.Array
  tokens: jax.Array       # i32[b, S] trajectory tokens (= cache contents)
  mask: jax.Array         # f32[b, S] loss mask
  step_ids: jax.Array     # i32[b, S]
  turn: jax.Array         # i32[b] current turn of each row
  turn_start: jax.Array   # i32[b] slot of the current turn's first token
  turn_len: jax.Array     # i32[b] tokens generated in the current turn
  window: jax.Array       # i32[b, L] last generated tokens, for stop matching
  waiting: jax.Array      # bool[b] turn ended, observation not yet inserted
  done: jax.Array         # bool[b]


class CallbackEngine:
  """Runs batches of Search-R1 rollouts as one jitted program with host search callbacks.

  Same constructor and ``run`` as :class:`gigrl.rollout.host_loop.HostLoopEngine` (including
  its optional ``mesh``). The batch is split over all devices of the mesh; params are
  replicated. One ``run`` at a time per engine is the intended use, but
  concurrent runs are kept apart by a run id passed into the program.
  """

  def __init__(self, model_cfg, graphdef, tokenizer, retriever, settings: RolloutSettings,
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
      ValueError: a stop tag is not one token, the invalid-action message is longer than
        ``settings.max_obs_tokens``, or an unknown ``boundary``.
      NotImplementedError: more than one JAX process.
    """
    if boundary not in ("turn", "step"):
      raise ValueError(f"boundary={boundary!r}; expected 'turn' or 'step'")
    if obs_chunk < 0:
      raise ValueError(f"obs_chunk={obs_chunk} must be >= 0")
    if jax.process_count() > 1:
      raise NotImplementedError("CallbackEngine is single-process (host records are not "
                                "gathered across processes); use rollout.engine=host_loop")
    self.boundary, self.obs_chunk = boundary, int(obs_chunk)
    self.model_cfg, self.graphdef = model_cfg, graphdef
    self.tok, self.retriever, self.s = tokenizer, retriever, settings
    self.stops = host_loop.stop_sequences(tokenizer)
    self.invalid_ids = traj_lib.invalid_observation_ids(tokenizer)
    if len(self.invalid_ids) > settings.obs_width:
      raise ValueError(f"rollout.max_obs_tokens={settings.max_obs_tokens} is smaller than the "
                       f"invalid-action message ({len(self.invalid_ids)} tokens)")
    self.mesh = row_mesh(mesh)
    self._batch_spec = P(ROW_AXIS)
    self._runs: dict[int, _RunState] = {}
    self._run_ids = itertools.count()
    self._registry_lock = threading.Lock()
    b = self._batch_spec
    self._program = jax.jit(jax.shard_map(
        self._shard_program, mesh=self.mesh,
        in_specs=(P(), b, b, b, b, P(), P()), out_specs=(b, b, b, b, b),
        check_vma=False))

  @property
  def num_shards(self) -> int:
    return int(self.mesh.devices.size)

  # ------------------------------------------------------------------ public

  def run(self, state, questions: Sequence[str], rng: jax.Array
          ) -> tuple[traj_lib.TrajectoryBatch, dict[str, float]]:
    """Rolls out one trajectory per question (repeat questions for groups).

    The batch is padded with empty, already-finished rows up to a multiple of the number of
    shards; the padding is dropped from the result.

    Args:
      state: the policy's ``nnx.State`` (parameters; replicated for the program).
      questions: B question strings.
      rng: PRNG key; the rollout is deterministic given it and the mesh size.
    Returns:
      (batch, metrics): a :class:`TrajectoryBatch` of width ``settings.seq_len``, and
      ``time/decode_s`` (program wall time outside host callbacks), ``time/search_s``
      (wall time with at least one search in progress: retriever + observation tokenisation),
      ``time/callback_s``, ``time/total_s``, ``rollout/generated_tokens``,
      ``rollout/callbacks``, ``rollout/retriever_calls``, ``rollout/decode_steps``.
    Raises:
      ValueError: a prompt is longer than ``max_prompt_tokens``.
      CallbackRolloutError: the host callback failed (retriever or tokenizer error).
    """
    s, b = self.s, len(questions)
    prompts = host_loop.encode_prompts(self.tok, questions, s.max_prompt_tokens)
    n = self.num_shards
    b_pad = max(n, -(-b // n) * n)
    toks, lens = _pad_rows(prompts, b_pad, s.max_prompt_tokens, self.tok.pad_id)
    live = np.arange(b_pad) < b
    run_id, run = self._register([_RowRecord(anchors=[q]) for q in questions])
    try:
      t0 = time.perf_counter()
      args = self._place(state, toks, lens, np.arange(b_pad, dtype=np.int32), live, rng,
                         np.int32(run_id))
      with jax.set_mesh(self.mesh):   # shard_map wants its mesh to be the ambient one
        out = self._program(*args)
      tokens, mask, step_ids, lengths, steps = jax.device_get(out)
      total = time.perf_counter() - t0
    finally:
      with self._registry_lock:
        self._runs.pop(run_id, None)
    if run.error is not None:
      raise CallbackRolloutError(
          f"callback rollout failed on the host ({run.error_where}): "
          f"{type(run.error).__name__}: {run.error}") from run.error
    batch = self._collate(run.rows, tokens[:b], mask[:b], step_ids[:b], lengths[:b])
    callback_s = union_seconds(run.callback_spans)
    metrics = {"time/decode_s": total - callback_s,
               "time/search_s": union_seconds(run.search_spans),
               "time/callback_s": callback_s, "time/total_s": total,
               "rollout/generated_tokens": float(batch.num_generated_tokens),
               "rollout/callbacks": float(run.callbacks),
               "rollout/retriever_calls": float(run.search_calls),
               "rollout/decode_steps": float(np.max(steps))}
    return batch, metrics

  def _place(self, state, *args):
    """Puts params (replicated) and the per-row inputs (split over the rows) on the engine's
    mesh, whatever mesh the caller's arrays live on (e.g. the trainer's FSDP layout)."""
    repl = NamedSharding(self.mesh, P())
    rows = NamedSharding(self.mesh, self._batch_spec)
    specs = (rows, rows, rows, rows, repl, repl)
    state = jax.device_put(state, repl)
    return (state,) + tuple(jax.device_put(a, sh) for a, sh in zip(args, specs))

  # ------------------------------------------------------------------ host side

  def _register(self, rows: list[_RowRecord]) -> tuple[int, _RunState]:
    run = _RunState(rows=rows)
    with self._registry_lock:
      run_id = next(self._run_ids) % (2**31 - 1)
      self._runs[run_id] = run
    return run_id, run

  def _collate(self, rows, tokens, mask, step_ids, lengths) -> traj_lib.TrajectoryBatch:
    return traj_lib.TrajectoryBatch(
        tokens=np.asarray(tokens, np.int32), loss_mask=np.asarray(mask, np.float32),
        step_ids=np.asarray(step_ids, np.int32), lengths=np.asarray(lengths, np.int32),
        search_calls=np.array([r.search_calls for r in rows], np.int32),
        num_steps=np.array([len(r.generated_text) for r in rows], np.int32),
        generated_text=[list(r.generated_text) for r in rows],
        anchors=[list(r.anchors) for r in rows],
        action_valid=[list(r.action_valid) for r in rows])

  def _host_turn(self, run_id, row_ids, ended, turn, gen, gen_len):
    """Host side of one turn boundary on one shard (called from the program).

    Args (jax Arrays, converted with ``np.asarray``):
      run_id: i32[] key of the run's records.
      row_ids: i32[b] global row index of each local row.
      ended: i32[b] 1 for rows whose turn ended in this step.
      turn: i32[b] index of the turn that ended.
      gen: i32[b, N] the turn's generated tokens (stop token included), pad after gen_len.
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
    try:
      self._turn_boundary(run, np.asarray(row_ids), np.asarray(ended), np.asarray(turn),
                          np.asarray(gen), np.asarray(gen_len), obs, obs_len, done)
    except Exception as e:  # pylint: disable=broad-except
      with run.lock:
        if run.error is None:
          run.error, run.error_where = e, f"rows {np.asarray(row_ids).tolist()}"
      obs_len[:], done[:] = 0, 1
    with run.lock:
      run.callbacks += 1
      run.callback_spans.append((t0, time.perf_counter()))
    return obs, obs_len, done

  def _turn_boundary(self, run, row_ids, ended, turn, gen, gen_len, obs, obs_len, done):
    """Records the ended turns, runs the searches, fills ``obs``/``obs_len``/``done``."""
    s = self.s
    queries, query_rows = [], []
    for j in np.flatnonzero(ended):
      rec, t = run.rows[int(row_ids[j])], int(turn[j])
      text = self.tok.decode(gen[j, :gen_len[j]].tolist())
      kind, payload = protocol.parse_action(text)
      rec.generated_text.append(text)
      rec.action_valid.append(kind != "invalid")
      if kind == "answer":
        rec.answer_turn, done[j] = t, 1
      elif t >= s.max_turns:       # final turn: no more observations
        done[j] = 1
      elif kind == "search":
        rec.search_calls += 1
        queries.append(payload)
        query_rows.append(j)
      else:
        self._put(obs, obs_len, j, self.invalid_ids)
        rec.anchors.append(protocol.INVALID_ACTION_MSG.strip())
    if not queries:
      return
    t0 = time.perf_counter()
    found = traj_lib.search_observations(self.retriever, self.tok, queries, s.topk_docs,
                                         s.max_obs_tokens)
    for j, (ids, anchor) in zip(query_rows, found):
      self._put(obs, obs_len, j, ids)
      run.rows[int(row_ids[j])].anchors.append(anchor)
    with run.lock:
      run.search_calls += 1
      run.search_spans.append((t0, time.perf_counter()))

  @staticmethod
  def _put(obs: np.ndarray, obs_len: np.ndarray, j: int, ids: Sequence[int]) -> None:
    ids = list(ids)[:obs.shape[1]]
    obs[j, :len(ids)], obs_len[j] = ids, len(ids)

  # ------------------------------------------------------------------ device side

  def _next_tokens(self, logits: jax.Array, key: jax.Array, row_ids: jax.Array,
                   turn: jax.Array, turn_len: jax.Array) -> jax.Array:
    """The policy's choice: f32[b, V] logits -> i32[b] (tests override this to script)."""
    del row_ids, turn, turn_len
    s = self.s
    return sampler_lib.sample_tokens(logits, key, jnp.float32(s.temperature), top_k=s.top_k,
                                     top_p=s.top_p, greedy=s.greedy)

  def _shard_program(self, state, prompts, prompt_lens, row_ids, live, rng, run_id):
    """Per-shard rollout: prefill, then the decode/turn loop.

    Args (local shard):
      state: replicated params.
      prompts: i32[b, P] right-padded prompt tokens; prompt_lens: i32[b].
      row_ids: i32[b] global row ids; live: bool[b] False for batch padding.
      rng: PRNG key (folded with the shard index); run_id: i32[].
    Returns:
      tokens i32[b, S], loss_mask f32[b, S], step_ids i32[b, S], lengths i32[b],
      decode steps i32[1].
    """
    s, cfg = self.s, self.model_cfg
    model = nnx.merge(self.graphdef, state)
    b, p = prompts.shape
    seq = s.seq_len
    shard = jax.lax.axis_index(ROW_AXIS)
    cache = tfm.init_cache(cfg, b, seq + 1)
    logits = jnp.zeros((b, cfg.vocab_size), jnp.float32)
    # Reuses the sampler's extend so the numerics equal the host loop's.
    logits, cache = sampler_lib._extend_last(  # pylint: disable=protected-access
        model, cache, prompts, prompt_lens, logits)
    valid = jnp.arange(p)[None] < prompt_lens[:, None]
    tokens = jnp.full((b, seq), self.tok.pad_id, jnp.int32)
    tokens = tokens.at[:, :p].set(jnp.where(valid, prompts, self.tok.pad_id)[:, :seq])
    c0 = _Carry(
        i=jnp.int32(0), cache=cache, logits=logits, key=jax.random.fold_in(rng, shard),
        tokens=tokens, mask=jnp.zeros((b, seq), jnp.float32),
        step_ids=jnp.full((b, seq), -1, jnp.int32), turn=jnp.zeros((b,), jnp.int32),
        turn_start=cache.pos, turn_len=jnp.zeros((b,), jnp.int32),
        window=jnp.full((b, self.stops.shape[1]), -2, jnp.int32),
        waiting=jnp.zeros((b,), bool), done=~live)
    max_steps = (s.max_turns + 1) * s.max_new_tokens
    c = jax.lax.while_loop(
        lambda c: (c.i < max_steps) & jnp.any(~c.done),
        lambda c: self._step(model, c, row_ids, run_id), c0)
    return c.tokens, c.mask, c.step_ids, c.cache.pos, c.i[None]

  def _step(self, model, c: _Carry, row_ids, run_id) -> _Carry:
    """One decode step for every decoding row, then the turn boundary if it is due."""
    s = self.s
    b, seq = c.tokens.shape
    key, sub = jax.random.split(c.key)
    act = ~c.done & ~c.waiting
    tok = self._next_tokens(c.logits, sub, row_ids, c.turn, c.turn_len)
    tok = jnp.where(act, tok, sampler_lib.PAD_TOKEN).astype(jnp.int32)
    rows = jnp.arange(b)
    slot = jnp.where(act, c.cache.pos, seq)                    # out of range: dropped
    window = jnp.where(act[:, None],
                       jnp.concatenate([c.window[:, 1:], tok[:, None]], axis=1), c.window)
    stop_hit = sampler_lib._stop_hit  # pylint: disable=protected-access
    hit = act & stop_hit(window, jnp.asarray(self.stops))
    logits, cache = sampler_lib._extend_last(  # pylint: disable=protected-access
        model, c.cache, tok[:, None], act.astype(jnp.int32), c.logits)
    turn_len = c.turn_len + act.astype(jnp.int32)
    ended = act & (hit | (turn_len >= s.max_new_tokens) | (cache.pos >= cache.max_len))
    c = c._replace(
        i=c.i + 1, cache=cache, logits=logits, key=key,
        tokens=c.tokens.at[rows, slot].set(tok, mode="drop"),
        mask=c.mask.at[rows, slot].set(1.0, mode="drop"),
        step_ids=c.step_ids.at[rows, slot].set(c.turn, mode="drop"),
        turn_len=turn_len, window=window, waiting=c.waiting | ended)
    if self.boundary == "step":
      due = jnp.any(ended)
    else:
      due = jnp.any(c.waiting) & ~jnp.any(~c.done & ~c.waiting)
    return jax.lax.cond(due, lambda c: self._boundary(model, c, c.waiting, row_ids, run_id),
                        lambda c: c, c)

  def _boundary(self, model, c: _Carry, ended, row_ids, run_id) -> _Carry:
    """Host callback for the rows in ``ended`` (bool[b]), then their observations go into the
    cache and they start their next turn."""
    s = self.s
    b, seq = c.tokens.shape
    n, w = s.max_new_tokens, s.obs_width
    offs = jnp.arange(n)
    idx = jnp.clip(c.turn_start[:, None] + offs[None], 0, seq - 1)
    gen = jnp.where(offs[None] < c.turn_len[:, None],
                    jnp.take_along_axis(c.tokens, idx, axis=1), self.tok.pad_id)
    i32 = jnp.int32
    obs, obs_len, host_done = io_callback(
        self._host_turn,
        (jax.ShapeDtypeStruct((b, w), i32), jax.ShapeDtypeStruct((b,), i32),
         jax.ShapeDtypeStruct((b,), i32)),
        run_id, row_ids, ended.astype(i32), c.turn, gen, c.turn_len, ordered=False)
    obs_len = jnp.where(ended, jnp.clip(obs_len, 0, w), 0)
    cols = c.cache.pos[:, None] + jnp.arange(w)[None]
    cols = jnp.where(jnp.arange(w)[None] < obs_len[:, None], cols, seq)
    tokens = c.tokens.at[jnp.arange(b)[:, None], cols].set(obs, mode="drop")
    logits, cache = self._insert(model, c.cache, c.logits, obs, obs_len)
    return c._replace(
        cache=cache, logits=logits, tokens=tokens,
        turn=c.turn + ended.astype(i32),
        turn_start=jnp.where(ended, cache.pos, c.turn_start),
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
      return sampler_lib._extend_last(  # pylint: disable=protected-access
          model, cache, obs, obs_len, logits)
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
      lg, sub = sampler_lib._extend_last(  # pylint: disable=protected-access
          model, sub, obs[get], jnp.where(ok, obs_len[get], 0), logits[get])
      cache = tfm.KVCache(cache.k.at[:, put].set(sub.k, mode="drop"),
                          cache.v.at[:, put].set(sub.v, mode="drop"),
                          cache.pos.at[put].set(sub.pos, mode="drop"))
      return j + m, cache, logits.at[put].set(lg, mode="drop")

    _, cache, logits = jax.lax.while_loop(lambda c: c[0] < count, body,
                                          (jnp.int32(0), cache, logits))
    return logits, cache


def make_engine(*args, **kwargs):
  """Deprecated alias of :func:`gigrl.rollout.engine.make_engine`."""
  from gigrl.rollout import engine  # pylint: disable=import-outside-toplevel
  return engine.make_engine(*args, **kwargs)
