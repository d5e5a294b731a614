"""Warm-up: every program a run executes, listed from its config and compiled before step 1.

A jitted call compiles once per static shape; a program first met inside a step stalls that
step (on a TPU slice, a 3B program compiles for minutes). The rollout's shapes come from a
bounded grid (:mod:`gigrl.rollout.shapes`) and the train steps' widths from
:func:`gigrl.update.batch.width_grid`, so :func:`run_programs` lists the whole set from the
config and the run's setup alone:

* ``rollout``: the RL engine's prefill, observation extend, decode and KV-copy programs
  (:meth:`gigrl.rollout.host_loop.HostLoopEngine.plan`, for a step's rows per process);
* ``eval``: the greedy evaluation engine's, for its batch;
* ``update``: the RL update of each width (one on-policy step, micro-batched, or PPO
  mini-batches after the old log-probs, as ``train.*`` selects; :func:`gigrl.update.step.ppo_update`);
* ``logprobs``: the old log-probs of each width (PPO with several updates a step only);
* ``sft``: the SFT step of each width its seeded batches have (:func:`gigrl.update.batch.sft_widths`).

:func:`compile_all` traces and lowers each program in the main thread (Python) and compiles
them on a pool of threads (XLA compiles outside the GIL), with a progress bar ``compiling k/N``;
jax's persistent compilation cache (``train.compile_cache``) turns a second run's compiles into
loads. Afterwards a step compiles nothing (``time/rollout_compile_s`` and
``time/update_compile_s`` are 0; ``tests/test_warmup.py`` counts jax's compile events).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tqdm import tqdm

from gigrl import distributed
from gigrl.rollout import shapes
from gigrl.rollout import turns
from gigrl.update import batch as batch_lib
from gigrl.update import step as update_lib


@dataclasses.dataclass(frozen=True)
class RunProgram:
  """One program of a run.

  Attributes:
    stage: ``rollout``, ``eval``, ``update``, ``logprobs`` or ``sft``.
    label: kind and static shape, e.g. ``decode[64 rows x 48 steps, 224 slots]``.
    lower: traces and lowers it (``-> jax.stages.Lowered``); ``.compile()`` compiles it.
  """
  stage: str
  label: str
  lower: Callable[[], Any]


def prompt_stats(tokenizer, questions: Sequence[Any]) -> shapes.PromptStats:
  """The prompts' :class:`gigrl.rollout.shapes.PromptStats` (``questions``: rows with a
  ``question`` field, or strings)."""
  texts = [getattr(q, "question", q) for q in questions]
  return shapes.prompt_stats([turns.prompt_ids(tokenizer, t) for t in texts])


def local_rows(total: int, rows_multiple: int) -> int:
  """Rows per process of a batch of ``total`` rows (:class:`gigrl.rollout.hosts.ProcessShare`
  pads it to a multiple of the processes and the mesh's batch axes)."""
  multiple = int(np.lcm(jax.process_count(), int(rows_multiple)))
  return (total + (-total % multiple)) // jax.process_count()


def engine_programs(engine, params, rows: int, stage: str) -> list[RunProgram]:
  """Every program of ``engine`` (a :class:`~gigrl.rollout.host_loop.HostLoopEngine`) for
  ``rows`` rows per process."""
  # greedy is traced in decode: an evaluation's decode turns are the RL rollout's programs
  # when the two batches have the same rows (one label: compiled and counted once)
  return [RunProgram(stage, f"B={rows} " + prog.label(),
                     functools.partial(engine.lower, params, rows, prog))
          for prog in engine.plan(rows)]


def update_programs(cfg, steps, mesh, params, opt_state, ref_params, put: Callable,
                    seq_len: int, max_lm_positions: int) -> list[RunProgram]:
  """The RL update's programs, one per width of :func:`batch_lib.width_grid` (and its old
  log-probs when a step makes several updates), for the path :func:`update_lib.ppo_update`
  takes under ``cfg.train``; the arguments are shaped as :func:`update_lib.rl_update` passes
  them (``ref_params``: the reference's stand-in, None with LoRA)."""
  from gigrl.training import build  # pylint: disable=import-outside-toplevel
  b = int(cfg.data.prompts_per_step) * int(cfg.data.group_size)
  mini, micro = build.ppo_rows(cfg)
  epochs = int(cfg.train.ppo_epochs)
  trim = bool(cfg.train.trim_update_padding)
  out = []
  for w in batch_lib.width_grid(seq_len):
    k = batch_lib.lm_positions(np.zeros((1, w), np.float32), max_lm_positions) if trim else None
    kw = {} if k is None else {"lm_positions": k}
    label = f"[{b} rows x {w} tokens, K {k or max_lm_positions}]"

    def rows(n, w=w):
      return (put(np.zeros((n, w), np.int32)), put(np.zeros((n, w), np.float32)),
              put(np.zeros((n, w), np.float32)))

    def behav(n, w=w):    # the sampler's log-probs, when the off-policy correction reads them
      return (put(np.zeros((n, w), np.float32)),) if steps.behaviour else ()

    if mini >= b and epochs == 1 and micro >= b:
      def lower(w=w, kw=kw):
        with jax.set_mesh(mesh):
          return steps.rl_step.jit_for(kw.get("lm_positions")).lower(
              params, opt_state, ref_params, *rows(b, w), *behav(b, w))
      out.append(RunProgram("update", "rl_step" + label, lower))
    elif mini >= b and epochs == 1:
      def lower(w=w, kw=kw):
        with jax.set_mesh(mesh):
          return steps.ppo_step(b // micro, on_policy=True).jit_for(kw.get("lm_positions")).lower(
              params, opt_state, ref_params, *rows(b, w), None, *behav(b, w))
      out.append(RunProgram("update", f"ppo_step[{b // micro} micro-batches]" + label, lower))
    else:
      chunk = min(micro, mini)
      n_micro = mini // chunk
      label = f"[{mini} rows x {w} tokens, K {k or max_lm_positions}]"   # one mini-batch

      def lower_lp(w=w):
        with jax.set_mesh(mesh):
          return steps.logprob_step.__wrapped__.lower(params, *rows(chunk, w)[:2])
      out.append(RunProgram("logprobs", f"logprobs[{chunk} rows x {w} tokens]", lower_lp))
      k_old = k if k is not None else min(max_lm_positions, w - 1)

      def lower(w=w, kw=kw, k_old=k_old):
        with jax.set_mesh(mesh):
          return steps.ppo_step(n_micro).jit_for(kw.get("lm_positions")).lower(
              params, opt_state, ref_params, *rows(mini, w),
              put(np.zeros((mini, k_old), np.float32)), *behav(mini, w))
      out.append(RunProgram("update", f"ppo_step[{n_micro} micro-batches]" + label, lower))
  return out + packed_programs(cfg, steps, mesh, params, opt_state, ref_params, put, seq_len)


def packed_programs(cfg, steps, mesh, params, opt_state, ref_params, put: Callable,
                    seq_len: int) -> list[RunProgram]:
  """With ``train.pack_update_rows`` (:func:`gigrl.training.build.pack_width`): the packed
  update of each W' :func:`gigrl.update.step.packed_widths` allows, K = W' - 1, as
  :func:`gigrl.update.step.rl_update` runs it (one update a step only; else none; without
  micro-batches, a micro-batch per row of the mesh's batch axes)."""
  from gigrl.training import build  # pylint: disable=import-outside-toplevel
  cap = build.pack_width(cfg, seq_len)
  b = int(cfg.data.prompts_per_step) * int(cfg.data.group_size)
  micro = update_lib.packed_micro_rows(b, *build.ppo_rows(cfg), int(cfg.train.ppo_epochs),
                                       build.batch_axis_size(mesh))
  if not cap or micro is None:
    return []
  out = []
  for w in update_lib.packed_widths(cap):
    k = update_lib.packed_lm_positions(w)

    def lower(w=w, k=k):
      z = lambda dt: put(np.zeros((b, w), dt))
      behav = (z(np.float32),) if steps.behaviour else ()
      with jax.set_mesh(mesh):
        return steps.ppo_step(b // micro, on_policy=True, packed=True).jit_for(k).lower(
            params, opt_state, ref_params, z(np.int32), z(np.float32), z(np.float32), None,
            *behav, z(np.int32), z(np.int32), z(np.int32))
    out.append(RunProgram("update", f"ppo_step[{b // micro} micro-batches, packed]"
                          f"[{b} rows x {w} tokens, K {k}]", lower))
  return out


def sft_programs(cfg, steps, mesh, params, opt_state, put: Callable,
                 widths: Sequence[int]) -> list[RunProgram]:
  """The SFT step of each width in ``widths`` (:func:`batch_lib.sft_widths`; the copying
  steps' one width first when ``train.copy_steps``)."""
  t = cfg.train
  shapes_ = [(int(t.copy_batch_size), int(t.copy_width))] if int(t.copy_steps) else []
  shapes_ += [(int(t.sft_batch_size), int(w)) for w in widths]
  out = []
  for n, w in shapes_:
    def lower(n=n, w=w):
      with jax.set_mesh(mesh):
        return steps.sft_step.jit_for(None).lower(
            params, opt_state, put(np.zeros((n, w), np.int32)), put(np.zeros((n, w), np.float32)))
    out.append(RunProgram("sft", f"sft_step[{n} rows x {w} tokens]", lower))
  return out


def published_copy(cfg, params, lora: bool, *, reference_listed: bool) -> RunProgram | None:
  """The device copy an asynchronous sampler is published after each update
  (``train.max_staleness`` >= 1): the whole params for the in-process sampler thread, the
  trained leaves for a sampler process (``train.sampler_address``; the adapters alone with
  LoRA). None at k = 0, or when it is the reference copy's program (the whole params without
  LoRA), already listed when ``reference_listed``."""
  from gigrl.models import lora as lora_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import state as state_lib  # pylint: disable=import-outside-toplevel
  if not int(cfg.train.max_staleness):
    return None
  leaves = (lora_lib.trained_leaf_indices(params, lora) if cfg.train.get("sampler_address")
            else None)
  if leaves is None and reference_listed and not lora:
    return None
  return RunProgram("other", "copy[published adapters]" if leaves else "copy[published params]",
                    lambda: state_lib.copy_leaves_program(params, leaves))


def helper_programs(t, start: int) -> list[RunProgram]:
  """The small programs around the steps: the RL optimizer's init and the reference copy at the
  start of RL, the advantage estimator, and the checkpoint's device copy of the state."""
  from gigrl.advantages import compose  # pylint: disable=import-outside-toplevel
  from gigrl.training import state as state_lib  # pylint: disable=import-outside-toplevel
  cfg, pol = t.cfg, t.policy
  sft_steps, rl_steps = int(cfg.train.sft_steps), int(cfg.train.num_steps)
  params = t.state.params
  out = []
  if rl_steps and start <= sft_steps:
    out.append(RunProgram("other", "init_opt[rl]",
                          lambda: t.steps.init_opt(t.steps.rl_tx, params, lower=True)))
    if not pol.lora.enabled:
      out.append(RunProgram("other", "copy[reference params]",
                            lambda: state_lib.copy_program(params)))
  published = published_copy(cfg, params, pol.lora.enabled,
                             reference_listed=bool(rl_steps and start <= sft_steps))
  if rl_steps and published:
    out.append(published)
  if rl_steps:
    p, g = int(cfg.data.prompts_per_step), int(cfg.data.group_size)
    c, tt = t.pool.num_candidates, t.settings.max_turns + 1
    z = lambda shape, dt: np.zeros(shape, dt)
    inputs = compose.AdvantageInputs(
        rewards=z((p, g), np.float32), valid=z((p, g), bool), strata=z((p, g), np.int32),
        step_rewards=z((p, g, tt), np.float32), step_valid=z((p, g, tt), bool),
        anchor_ids=z((p, g, tt), np.int32), action_valid=z((p, g, tt), bool),
        batch_rewards=z((c, g), np.float32), batch_valid=z((c, g), bool))
    out.append(RunProgram("other", f"advantages[{p} x {g} x {tt}]",
                          lambda: t.adv_fn.lower(inputs, t.state.adv_state)))
  # checkpoints: the saved state's device copy, in the SFT and the RL form (one program when
  # both trees are alike: without LoRA the SFT form saves the params in the reference slot)
  forms = []
  if sft_steps > start:
    forms.append(("sft", t.checkpoints._saved(t.state)))
  if rl_steps:
    forms.append(("rl", t.checkpoints._saved(
        t.state.replace(ref_params=None if pol.lora.enabled else params))))
  seen = {}
  for name, tree in forms:
    sig = str(jax.tree.structure(tree)) + str([(getattr(x, "shape", None), str(
        getattr(x, "dtype", ""))) for x in jax.tree.leaves(tree)])
    seen.setdefault(sig, (name, tree))
  for name, tree in seen.values():
    out.append(RunProgram("other", f"copy[checkpoint{', ' + name if len(seen) > 1 else ''}]",
                          functools.partial(state_lib.copy_program, tree)))
  return out


def summary(programs: Sequence[RunProgram]) -> str:
  """``21 programs: rollout 12, eval 6, update 3`` (counts by stage, in order of first)."""
  counts: dict[str, int] = {}
  for p in programs:
    counts[p.stage] = counts.get(p.stage, 0) + 1
  return f"{len(programs)} programs: " + ", ".join(f"{k} {v}" for k, v in counts.items())


def compile_all(programs: Sequence[RunProgram], *, threads: int = 0,
                show: bool = True, by_stage: dict[str, float] | None = None) -> float:
  """Compiles every program before step 1; returns the wall seconds it took.

  Each is traced and lowered in this thread, then compiled on a pool of ``threads`` threads
  (0: one per core, at most 4), so XLA compiles one program while Python lowers the next; on
  the CPU backend (``threads`` 0) there is no pool: each is compiled in this thread right after
  its lowering. The bar reads ``compiling k/N`` with the program just compiled.
  ``by_stage``, when given, gets each stage's seconds added: its programs' lowering plus
  compile seconds, each program's timed in its own thread (with several threads they overlap,
  so the stages sum to more than the wall; their shares say where the warm-up goes).

  Raises:
    Whatever a program's lowering or compile raises (the label is added to the message).
  """
  t0 = time.perf_counter()
  # No compile thread on CPU: XLA:CPU's compile already uses every core (the smoke warm-up, 36
  # programs on 2 cores: 27.1 s with 2 threads, 27.2-30.3 s with 1), and jaxlib 0.10's XLA:CPU
  # crashed natively in the compile thread, four times in the tests' in-process warm-ups (CI and
  # whole-suite runs, 2026-11-28/29: aborts and segfaults in the persistent-cache write and in
  # backend_compile_and_load) while the main thread lowered the next program. It costs the
  # overlap: the smoke warm-up (23 programs, 2 cores, beside another job) 26.4 / 26.2 s against
  # 24.1 / 24.2 s with the compile thread.
  if not threads:
    threads = 0 if jax.default_backend() == "cpu" else max(1, min(4, os.cpu_count() or 1))
  bar = tqdm(total=len(programs), desc="compiling", unit="program", dynamic_ncols=True,
             file=sys.stderr, disable=not show,
             bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed} {postfix}")
  lock = threading.Lock()

  def add(stage: str, secs: float) -> None:
    if by_stage is not None:
      with lock:
        by_stage[stage] = by_stage.get(stage, 0.0) + secs

  def compile_one(prog: RunProgram, lowered) -> None:
    t = time.perf_counter()
    try:
      lowered.compile()
    except Exception as e:       # name the program, keep the cause
      raise RuntimeError(f"warm-up: compiling {prog.stage} {prog.label} failed: {e}") from e
    add(prog.stage, time.perf_counter() - t)
    with lock:
      bar.set_postfix_str(f"{prog.stage}: {prog.label}", refresh=False)
      bar.update(1)

  def lower(prog: RunProgram):
    try:
      t = time.perf_counter()
      lowered = prog.lower()
      add(prog.stage, time.perf_counter() - t)
      return lowered
    except Exception as e:       # name the program, keep the cause
      raise RuntimeError(f"warm-up: lowering {prog.stage} {prog.label} failed: {e}") from e

  try:
    if threads <= 0:        # in this thread, one program at a time
      for prog in programs:
        compile_one(prog, lower(prog))
    else:
      with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(compile_one, prog, lower(prog)) for prog in programs]
        for fut in futures:
          fut.result()            # re-raises a compile's error, its program named
  finally:
    bar.close()
  return time.perf_counter() - t0


def stage_shares(by_stage: dict[str, float]) -> dict[str, float]:
  """Each stage's fraction of :func:`compile_all`'s ``by_stage`` seconds (they sum to 1)."""
  total = sum(by_stage.values()) or 1.0
  return {k: v / total for k, v in by_stage.items()}


compile_seconds = update_lib.compile_seconds   # (for callers that time the warm-up's compiles)


# ------------------------------------------------------------------------------ a run's set
def plan_run(t, start: int, demos) -> list[RunProgram]:
  """Every program the run ``t`` (a :class:`gigrl.training.trainer.Trainer`, set up) executes
  from step ``start + 1`` on, in order: SFT, rollout, update, evaluation. ``demos``: its SFT
  demonstrations (None when no SFT step is left)."""
  from gigrl.training import build  # pylint: disable=import-outside-toplevel
  cfg, pol = t.cfg, t.policy
  sft_steps = int(cfg.train.sft_steps)
  total = sft_steps + int(cfg.train.num_steps)
  params = pol.params if t.state.params is None else t.state.params
  rparams = pol.rollout_params(params)
  rm = build.batch_axis_size(pol.sampler_mesh)
  seq_len = t.settings.seq_len
  out: list[RunProgram] = []
  if start < sft_steps and demos is not None:
    widths = batch_lib.sft_widths(demos.lengths, demos.tokens.shape[1], cfg.train, cfg.seed,
                                  start + 1, sft_steps)
    out += sft_programs(cfg, t.steps, pol.mesh, params, t.state.opt_state, t._put, widths)
  if int(cfg.train.num_steps) and start < total:
    g = int(cfg.data.group_size)
    rows = local_rows(t.pool.num_candidates * g, rm)
    if not cfg.train.get("sampler_address"):     # else a sampler process's (warm_up_sampler)
      out += engine_programs(t.engine.engine, rparams, rows, "rollout")
    ref = None if pol.lora.enabled else params
    out += update_programs(cfg, t.steps, pol.mesh, params, t.state.opt_state, ref, t._put,
                           seq_len, build.max_generated_tokens(cfg))
  if t.evaluator.questions and (int(cfg.train.eval_questions) or any(
      t.evaluator.due(s) for s in range(start, total + 1))):
    n = len(t.evaluator.questions)
    bs = int(cfg.train.eval_batch_size)
    rows = local_rows(min(bs, n) if bs else n, rm)
    out += engine_programs(t.evaluator.engine().engine, rparams, rows, "eval")
  out += helper_programs(t, start)
  seen, unique = set(), []
  for p in out:                   # a program two stages share is compiled (and counted) once
    if p.label not in seen:
      seen.add(p.label)
      unique.append(p)
  return unique


def _rollout_stats(t, questions) -> shapes.PromptStats:
  """The prompts' stats of ``questions`` and the longest observation the corpus can give."""
  from gigrl.rollout import trajectory as traj_lib  # pylint: disable=import-outside-toplevel
  return dataclasses.replace(prompt_stats(t.tokenizer, questions), obs_len=traj_lib.observation_cap(
      t.tokenizer, t.retriever, t.settings.topk_docs, t.settings.max_obs_tokens))


def _set_up_rl_engine(t, stats: shapes.PromptStats) -> int:
  """Gives ``t``'s RL engine ``stats`` and the batch's distinct prompts; returns its rows per
  process."""
  from gigrl.training import build  # pylint: disable=import-outside-toplevel
  g = int(t.cfg.data.group_size)
  per = local_rows(t.pool.num_candidates * g, build.batch_axis_size(t.policy.sampler_mesh))
  t.engine.engine.prompt_stats = stats
  t.engine.engine.distinct_rows = -(-per // g) + (1 if per % g else 0)
  return per


def set_up_engines(t) -> None:
  """Gives the run's engines the prompts' lengths (RL and held-out questions together, so
  both engines share their prefill programs), the longest observation the corpus can give, and
  the RL batch's distinct prompts."""
  from gigrl.training import build  # pylint: disable=import-outside-toplevel
  stats = _rollout_stats(t, list(t.rl_questions) + list(t.evaluator.questions))
  _set_up_rl_engine(t, stats)
  ev = t.evaluator.engine().engine
  ev.prompt_stats = stats
  ev.distinct_rows = local_rows(min(int(t.cfg.train.eval_batch_size) or len(
      t.evaluator.questions), max(1, len(t.evaluator.questions))), build.batch_axis_size(
          t.policy.sampler_mesh))       # every row its own question: the tails on all B rows


def warm_up_sampler(s, eval_questions: Sequence[Any], log: Callable[[str], None]) -> None:
  """A sampler process's warm-up (:mod:`gigrl.training.sampler_process`): its RL engine's
  programs only (the trainer compiles the updates and evaluations). ``s`` has a trainer's
  ``cfg, tokenizer, retriever, settings, policy, engine, pool, rl_questions``; the prompt stats
  count ``eval_questions`` too, so the programs are the trainer's own in one process."""
  rows = _set_up_rl_engine(s, _rollout_stats(s, list(s.rl_questions) + list(eval_questions)))
  if not bool(s.cfg.train.get("warmup", True)):
    return
  _compile_logged(engine_programs(s.engine.engine, s.policy.rollout_params(s.policy.params),
                                  rows, "rollout"), [s.engine.engine], log)
  _warm_up_gathers(s.pool.num_candidates * int(s.cfg.data.group_size), s.settings.seq_len, log)


def _warm_up_gathers(rows: int, seq_len: int, log: Callable[[str], None]) -> float:
  """On several processes, the host gathers' programs (:func:`distributed.warm_up_gathers`),
  up to the largest a rollout makes: ``rows`` rows of ``seq_len`` 8-byte values. Seconds."""
  t0 = time.perf_counter()
  n = distributed.warm_up_gathers(rows * seq_len * 8)
  if n:
    log(f"warm-up: host gathers of {n} sizes ({distributed.GATHER_MIN_BYTES} bytes to "
        f"{distributed.gather_bucket(rows * seq_len * 8)})")
  return time.perf_counter() - t0


def _compile_logged(programs: Sequence[RunProgram], engines: Sequence[Any],
                    log: Callable[[str], None],
                    by_stage: dict[str, float] | None = None) -> float:
  """:func:`compile_all` with the count, the seconds and each stage's share logged; then frees
  the dummy caches the ``engines``' programs were traced with. Returns the wall seconds;
  ``by_stage`` gets each stage's (overlapping) seconds."""
  log(f"warm-up: {summary(programs)}")
  stages: dict[str, float] = {} if by_stage is None else by_stage
  try:
    secs = compile_all(programs, by_stage=stages)
  finally:
    for engine in engines:
      engine.release()
  shares = ", ".join(f"{k} {v:.0%}" for k, v in stage_shares(stages).items())
  log(f"warm-up: compiled {len(programs)} programs in {secs:.1f} s ({shares} of the "
      f"lowering and compile seconds)")
  return secs


def warm_up(t, start: int, demos, log: Callable[[str], None]) -> dict[str, float]:
  """Lists and compiles the run's programs (:func:`plan_run`, :func:`compile_all`); returns
  ``{"time/warmup_compile_s": seconds}`` for the launch's first metrics line (the count is
  logged), and ``time/warmup_compile_<stage>_s``: each stage's share of those wall seconds
  (its programs' lowering and compile seconds over all programs', so the stages sum to the
  programs' part of the wall; ``sft`` is the part an RL phase does not need).
  ``train.warmup=False``: nothing (the same programs then compile when first met). The
  engines' shape grid must be set first (:func:`set_up_engines`), warm-up or not."""
  if not bool(t.cfg.train.get("warmup", True)):
    return {}
  stages: dict[str, float] = {}
  secs = _compile_logged(plan_run(t, start, demos),
                         [t.engine.engine, t.evaluator.engine().engine], log, stages)
  out = {f"time/warmup_compile_{k}_s": secs * v for k, v in stage_shares(stages).items()}
  rows = max(t.pool.num_candidates * int(t.cfg.data.group_size),
             int(t.cfg.train.eval_batch_size) or int(t.cfg.train.eval_questions))
  secs += _warm_up_gathers(rows, t.settings.seq_len, log)
  return {"time/warmup_compile_s": secs, **out}
