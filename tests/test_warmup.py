"""Every program a run executes is listed from its config and compiled before step 1 (#50).

A tiny run (4 SFT steps, 3 RL steps, a held-out evaluation of an odd number of questions, so
its last batch is padded) is counted with jax's own compile events
(``/jax/core/compile/backend_compile_duration``, no timings): after the warm-up, nothing
compiles, in any step or evaluation. Its rollouts' lengths and live rows vary from step to step,
and so do the trained rows (GRPO without a filter trains every group). Every program the
engine met is one the plan listed.

One exception, counted apart and printed: orbax's checkpoint writer slices each replicated
array once at the first save on a multi-device mesh (``jit(slice)``, milliseconds each, outside
every step's timers; none on one device).

Try it: put a shape outside the set (``Grid.rows`` returning ``n`` itself, or a width off the
grid), and this test fails with the programs compiled after the warm-up named.
"""
import collections
import os
import sys

import jax
import pytest
from jax import monitoring

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_after = {"on": False, "saving": False, "names": collections.Counter(),
          "checkpoint": collections.Counter()}


def _on_duration(event, secs, **kw):
  del secs
  if event == "/jax/core/compile/backend_compile_duration" and _after["on"]:
    where = "checkpoint" if _after["saving"] else "names"
    _after[where][kw.get("fun_name", "?")] += 1


def _run_cfg():
  """The smoke config of the ``run`` fixture."""
  sys.path.insert(0, ROOT)
  from configs import smoke  # pylint: disable=import-outside-toplevel
  cfg = smoke.get_config()
  cfg.data.max_train_questions = 24
  cfg.data.prompts_per_step = 8          # 16 rows over the tests' 8 CPU devices: 8 or 16 live
  cfg.data.group_size = 2
  cfg.data.pool.rule = "grpo"            # every group trained: the update runs each step
  cfg.rollout.max_new_tokens = 24
  cfg.rollout.max_obs_tokens = 64
  cfg.train.sft_steps = 4
  cfg.train.sft_batch_size = 8
  cfg.train.num_steps = 3
  cfg.train.eval_every = 2
  cfg.train.eval_questions = 10          # eval_batch_size 8: a last batch of 2 (padded)
  cfg.train.eval_batch_size = 8
  cfg.train.compile_cache = ""           # no persistent cache: every compile is a real one
  cfg.train.sample_every = 100
  cfg.checkpoint.every_steps = 2
  # the off-policy correction's update programs (one more array) are warmed up too, and the
  # sampler's log-probs it reads are checked against the trainer's (#52)
  cfg.loss.off_policy_correction = "tis"
  return cfg


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  from gigrl.training import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import warmup  # pylint: disable=import-outside-toplevel
  cfg = _run_cfg()
  workdir = str(tmp_path_factory.mktemp("warmup"))
  t = trainer_lib.Trainer(cfg, workdir)
  monitoring.register_event_duration_secs_listener(_on_duration)
  real = warmup.warm_up
  planned = {}

  def warm_up(tr, start, demos, log):
    out = real(tr, start, demos, log)
    planned["labels"] = [p.label for p in warmup.plan_run(tr, start, demos)]
    _after["on"] = True
    return out

  save = t.checkpoints.save

  def saving(*a, **k):               # orbax's own first-save slicing, counted apart
    _after["saving"] = True
    try:
      return save(*a, **k)
    finally:
      _after["saving"] = False

  warmup.warm_up = warm_up
  t.checkpoints.save = saving
  try:
    t.run()
  finally:
    warmup.warm_up = real
    _after["on"] = False
  return t, planned["labels"], workdir


def test_no_compile_after_warm_up(run):
  t, labels, _ = run
  assert labels and any("update" in l or "rl_step" in l for l in labels)
  print(f"\nplanned {len(labels)} programs; after the warm-up: steps and evaluations "
        f"{dict(_after['names'])}, orbax's checkpoint writes {dict(_after['checkpoint'])}")
  assert not _after["names"], (
      f"compiled after the warm-up: {dict(_after['names'])}; planned {len(labels)} programs")


def test_every_program_met_was_planned(run):
  t, labels, _ = run
  eng = t.engine.engine
  plan = set(eng.plan(eng.batch_rows))          # the rows of its last (an RL step's) rollout
  assert eng.programs and eng.programs <= plan, sorted(p.label() for p in eng.programs - plan)
  # the run varied what a fixed-shape rollout would not: live rows and widths
  assert len({p.rows for p in eng.programs if p.kind == "decode"} |
             {p.width for p in eng.programs if p.kind == "extend"}) > 1


def test_metrics_log_the_warm_up_and_zero_compiles(run):
  import json  # pylint: disable=import-outside-toplevel
  _, _, workdir = run
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  assert rows[0]["time/warmup_compile_s"] > 0
  stages = {k[len("time/warmup_compile_"):-2]: v for k, v in rows[0].items()
            if k.startswith("time/warmup_compile_") and k != "time/warmup_compile_s"}
  assert {"rollout", "update"} <= set(stages) and all(v > 0 for v in stages.values()), stages
  assert sum(stages.values()) <= rows[0]["time/warmup_compile_s"] + 1e-6   # shares of the wall
  # seconds end in _s (resume tests compare the lines without them)
  assert all(k.endswith("_s") for r in rows for k in r if k.startswith("time/")), rows[0]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert len(rl) == 3 and any(r["update/rows"] > 0 for r in rl)
  assert all(r["time/rollout_compile_s"] == 0 and r["time/update_compile_s"] == 0 for r in rl)
  ev = [r for r in rows if r["phase"] == "eval"]
  assert ev and all(r.get("eval/time/rollout_compile_s", 0) == 0 for r in ev)


def test_warm_up_off_runs_the_same_programs(run, tmp_path):
  """``train.warmup=False`` only defers each compile to the program's first call: the engines
  get the same shape grid (the prompts' lengths over the RL and held-out questions), so every
  metric of every line, the rollout's work counts included, equals the warmed-up run's.
  Try it: call ``set_up_engines`` only when ``train.warmup`` is on, and ``rollout/slot_reads``
  differs."""
  import json  # pylint: disable=import-outside-toplevel
  from gigrl.training import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  _, _, workdir = run
  cfg = _run_cfg()
  cfg.train.warmup = False
  trainer_lib.Trainer(cfg, str(tmp_path)).run()

  def lines(d):
    return [{k: v for k, v in json.loads(l).items() if not k.endswith("_s")}
            for l in open(os.path.join(d, "metrics.jsonl"))]

  on, off = lines(workdir), lines(str(tmp_path))
  assert [r["step"] for r in off] == [r["step"] for r in on]
  for a, b in zip(on, off):
    assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def test_the_samplers_logprobs_are_the_trainers(run):
  """At staleness 0 with an f32 sampler the behaviour log-probs recorded at generation equal
  the trainer's log-probs of the same tokens (π_prox, the params at the start of the update) to
  float rounding: the importance ratio is 1 and nothing is truncated (#52)."""
  import json  # pylint: disable=import-outside-toplevel
  _, _, workdir = run
  rl = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  rl = [r for r in rl if r["phase"] == "rl" and r["update/rows"] > 0]
  assert rl
  for r in rl:
    assert r["behaviour_abs_dlogp"] < 1e-3, r["behaviour_abs_dlogp"]
    assert abs(r["is_ratio_mean"] - 1) < 1e-3 and r["is_capped_frac"] == 0
    assert r["is_ess_frac"] > 0.999


@pytest.mark.slow
def test_the_smollm2_recipe_needs_at_most_32_programs(tmp_path):
  """Issue #50's bound: the README's main job (``configs/countries.py:smollm2-135m-short``) lists
  at most 32 programs in all, from its config and setup alone (nothing is compiled here)."""
  import runpy  # pylint: disable=import-outside-toplevel
  from gigrl.models import fetch  # pylint: disable=import-outside-toplevel
  from gigrl.training import build  # pylint: disable=import-outside-toplevel
  from gigrl.training import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import warmup  # pylint: disable=import-outside-toplevel
  here = fetch.default_dir("smollm2-135m-instruct")
  if not os.path.exists(os.path.join(here, "config.json")):
    try:
      fetch.fetch("smollm2-135m-instruct", here)
    except fetch.UserError as e:
      pytest.skip(f"cannot fetch SmolLM2-135M-Instruct: {e}")
  cfg = runpy.run_path(os.path.join(ROOT, "configs", "countries.py"))["get_config"](
      "smollm2-135m-short")
  cfg.train.compile_cache = ""
  cfg.train.micro_batch_size = 8     # the tests' 8 CPU devices (the recipe's 4 rows do not split)
  t = trainer_lib.Trainer(cfg, str(tmp_path))
  warmup.set_up_engines(t)
  demos = build.sft_demonstrations(cfg, t.data.train, t.tokenizer, t.retriever, t.settings,
                                   lambda _: None)
  programs = warmup.plan_run(t, 0, demos)
  print("\n" + warmup.summary(programs))
  assert len(programs) <= 32, warmup.summary(programs)
  stages = {p.stage for p in programs}
  assert {"sft", "rollout", "update", "eval"} <= stages
  # the rollout: prefix, its copy, the prompt tails, their copy, 3 decode turns at 4 row
  # counts (quarters), observation extends at 2 row counts x 3 widths
  assert sum(p.stage == "rollout" for p in programs) == 22
  # the evaluation (greedy, the same 64 rows) shares every program but its prompt tails
  # (64 distinct prompts against the RL batch's 16): decode's greedy is traced
  assert sum(p.stage == "eval" for p in programs) == 1


def _count_compiles_after_warm_up(cfg, workdir: str) -> dict:
  """Runs ``cfg`` in ``workdir`` and returns the programs compiled after its warm-up (orbax's
  first-save slicing excluded, as above)."""
  from gigrl.training import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import warmup  # pylint: disable=import-outside-toplevel
  _after["names"].clear()
  t = trainer_lib.Trainer(cfg, workdir)
  real, save = warmup.warm_up, t.checkpoints.save

  def warm_up(*a, **k):
    out = real(*a, **k)
    _after["on"] = True
    return out

  def saving(*a, **k):
    _after["saving"] = True
    try:
      return save(*a, **k)
    finally:
      _after["saving"] = False

  warmup.warm_up, t.checkpoints.save = warm_up, saving
  try:
    t.run()
  finally:
    warmup.warm_up = real
    _after["on"] = False
  return dict(_after["names"])


def _smoke_rl(max_train_questions: int):
  """The smoke config for a compile count: 8 prompts x 2, every group trained (GRPO), 2 RL steps,
  no evaluation, samples or persistent cache; the compile listener registered."""
  sys.path.insert(0, ROOT)
  from configs import smoke  # pylint: disable=import-outside-toplevel
  monitoring.register_event_duration_secs_listener(_on_duration)
  cfg = smoke.get_config()
  cfg.data.max_train_questions, cfg.data.prompts_per_step, cfg.data.group_size = (
      max_train_questions, 8, 2)
  cfg.data.pool.rule = "grpo"
  cfg.train.num_steps = 2
  cfg.train.eval_questions, cfg.train.compile_cache, cfg.train.sample_every = 0, "", 100
  return cfg


@pytest.mark.slow
def test_no_compile_after_warm_up_at_staleness_1_with_lora_and_on_resume(tmp_path):
  """At ``train.max_staleness = 1`` each update's params are device-copied for the sampler
  thread: that copy is planned too, with LoRA (where no reference copy shares its program) and
  on a resume in the middle of RL (where none is made). Try it: drop ``published_copy`` from
  ``helper_programs``, and ``jit(_copy_arrays)`` compiles after the warm-up."""
  cfg = _smoke_rl(max_train_questions=24)
  cfg.rollout.max_new_tokens, cfg.rollout.max_obs_tokens = 24, 64
  cfg.train.sft_steps, cfg.train.sft_batch_size = 2, 8
  cfg.train.max_staleness = 1
  cfg.checkpoint.every_steps = 2
  lora = cfg.copy_and_resolve_references()
  lora.model.lora.rank = 4
  assert _count_compiles_after_warm_up(lora, str(tmp_path / "lora")) == {}
  assert _count_compiles_after_warm_up(cfg, str(tmp_path / "full")) == {}
  cfg.train.num_steps = 4                      # resumed at RL step 2 of 4
  assert _count_compiles_after_warm_up(cfg, str(tmp_path / "full")) == {}


def test_a_sampler_process_is_published_the_adapters_by_a_planned_program():
  """With ``train.sampler_address`` and LoRA, each update publishes a device copy of the
  adapters alone (not of the whole params), and the warm-up's ``copy[published adapters]``
  is that program: once it is compiled, publishing compiles nothing."""
  from gigrl import config as config_lib  # pylint: disable=import-outside-toplevel
  from gigrl.models import lora as lora_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import build  # pylint: disable=import-outside-toplevel
  from gigrl.training import state as state_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import warmup  # pylint: disable=import-outside-toplevel
  monitoring.register_event_duration_secs_listener(_on_duration)
  cfg = config_lib.base_config()
  cfg.model.preset, cfg.model.lora.rank = "tiny", 4
  cfg.train.max_staleness, cfg.train.sampler_address = 1, "localhost:1"
  params = build.build_policy(cfg, 512, None).params
  prog = warmup.published_copy(cfg, params, True, reference_listed=True)
  assert prog.label == "copy[published adapters]"
  prog.lower().compile()
  trained = lora_lib.trained_leaf_indices(params, True)
  _after["names"].clear()
  _after["on"] = True
  try:
    copies = state_lib.copy_leaves(params, trained)
  finally:
    _after["on"] = False
  assert sorted(copies) == trained and len(trained) < len(jax.tree.leaves(params))
  assert not _after["names"], dict(_after["names"])
  cfg.train.max_staleness = 0
  assert warmup.published_copy(cfg, params, True, reference_listed=True) is None


def test_compile_seconds_are_the_calling_threads():
  """``progress.compile_seconds`` counts the calling thread's compiles only: with k >= 1 the
  sampler thread's rollout runs beside the update, and a compile on one must not show in the
  other's ``time/*_compile_s``. Try it: count every thread's compiles in one total, and this
  thread sees the other's compile."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  from gigrl.rollout import progress  # pylint: disable=import-outside-toplevel
  mine = progress.compile_seconds()
  theirs = {}

  def other():
    before = progress.compile_seconds()
    jax.jit(lambda x: x * 3.0 + 1.0)(np.arange(11.0)).block_until_ready()   # a new program
    theirs["s"] = progress.compile_seconds() - before

  th = threading.Thread(target=other)
  th.start()
  th.join()
  assert theirs["s"] > 0
  assert progress.compile_seconds() == mine


def test_cpu_warm_up_compiles_in_the_calling_thread(monkeypatch):
  """On the CPU backend ``compile_all`` compiles each program in the calling thread, right after
  its lowering, with no pool (jaxlib 0.10's XLA:CPU crashed natively four times in the tests'
  warm-ups, in the compile thread, while the main thread lowered the next program); an
  explicit ``threads`` still gets a pool. Try it: drop the CPU case, and the pool gets a thread
  per core and compiles off the main thread."""
  import concurrent.futures  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from gigrl.training import warmup  # pylint: disable=import-outside-toplevel
  pools, compiled_on = [], []
  real = concurrent.futures.ThreadPoolExecutor

  def recording(n, *args, **kwargs):
    pools.append(n)
    return real(n, *args, **kwargs)

  class Lowered:                  # records the thread that compiles it
    def __init__(self, lowered):
      self.lowered = lowered

    def compile(self):
      compiled_on.append(threading.current_thread() is threading.main_thread())
      return self.lowered.compile()

  monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", recording)
  monkeypatch.setattr(os, "cpu_count", lambda: 8)
  fn = jax.jit(lambda x: x * 5.0 - 2.0)
  progs = [warmup.RunProgram("other", f"p{i}", lambda i=i: Lowered(fn.lower(np.arange(3.0 + i))))
           for i in range(2)]
  warmup.compile_all(progs, show=False)
  assert jax.default_backend() == "cpu" and pools == [] and compiled_on == [True, True]
  warmup.compile_all(progs, threads=3, show=False)
  assert pools == [3] and compiled_on[2:] == [False, False]


def test_packed_updates_are_planned_and_compile_before_step_1(tmp_path):
  """``train.pack_update_rows`` without micro-batches (one ``rl_step`` unpacked): the packed
  update of every W' under ``train.pack_max_width`` is listed and compiled in the warm-up, and
  the steps that pack compile nothing. Try it: drop ``packed_programs`` from
  ``update_programs``, and ``jit(step)`` compiles after the warm-up."""
  import json  # pylint: disable=import-outside-toplevel
  cfg = _smoke_rl(max_train_questions=16)
  cfg.rollout.max_turns, cfg.rollout.max_new_tokens = 0, 16
  cfg.train.sft_steps, cfg.train.micro_batch_size = 0, 0
  cfg.train.pack_update_rows, cfg.train.pack_max_width = True, 256
  cfg.checkpoint.every_steps = 100
  workdir = str(tmp_path)
  assert _count_compiles_after_warm_up(cfg, workdir) == {}
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert rl and all(r["update/rows_computed"] < r["update/rows"] for r in rl), [
      (r["update/rows_computed"], r["update/rows"], r["update/width"]) for r in rl]
