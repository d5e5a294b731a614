"""Deviceless TPU compile (gigrl-compile) of a tiny config: RL step and decode.

libtpu (the `tpu` extra, `pip install -e .[test,tpu]`) describes a v5e slice on this CPU
host (`jax.experimental.topologies`) and compiles the real programs for it, the Pallas
splash-attention kernel included; nothing runs on a TPU.

Every compile runs in a fresh spawned process (``_in_child``), as ``gigrl-compile`` does: libtpu
is never loaded into the long-lived pytest worker, whose CPU backend has run hundreds of other
tests, and a native abort in libtpu fails one test with its exit code instead of taking the
worker (and under ``--dist loadfile``, pytest-xdist 3.8's scheduling) down with it.
"""
import concurrent.futures
import multiprocessing
import os
import subprocess
import sys

import pytest

from gigrl.training import aot as compile_lib
from gigrl import config as config_lib

pytestmark = pytest.mark.slow   # TPU compiles: ~1-2 min on 2 busy cores


@pytest.fixture(autouse=True)
def _full_optimization(monkeypatch):
  """TPU programs compiled as `gigrl-compile` compiles them: conftest.py's
  jax_disable_most_optimizations (LLVM level 0, for the CPU test programs) is not passed on to
  the compile processes."""
  monkeypatch.delenv("JAX_DISABLE_MOST_OPTIMIZATIONS", raising=False)


def _tiny_config():
  cfg = config_lib.base_config()
  cfg.model.preset = "tiny"
  cfg.model.vocab_size = 512
  cfg.model.mesh.fsdp = -1
  cfg.data.prompts_per_step, cfg.data.group_size = 4, 2
  cfg.train.sft_batch_size = 8
  cfg.rollout.max_turns = 1
  cfg.rollout.max_new_tokens = 16
  cfg.rollout.max_obs_tokens = 16
  cfg.rollout.max_prompt_tokens = 32
  return cfg


def _child(fn, *args, **kwargs):
  lines = []
  if "log" in kwargs:
    kwargs["log"] = lines.append
  return fn(*args, **kwargs), lines


def _num_devices(topology):
  return len(compile_lib.topology_devices(topology))


def _in_child(fn, *args, **kwargs):
  """``fn(*args, **kwargs)`` (a module-level function) in a spawned process; returns (its
  result, the lines it logged when ``log=`` is passed)."""
  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
    try:
      return pool.submit(_child, fn, *args, **kwargs).result(timeout=900)
    except concurrent.futures.process.BrokenProcessPool as e:
      pytest.fail(f"the compile process died (a native crash in libtpu/XLA): {e}")


def _compile(cfg, programs, log=False):
  reports, lines = _in_child(compile_lib.compile_programs, cfg, "v5e-4", programs,
                             log=[] if log else None)
  return (reports, lines) if log else reports


def test_topology_names():
  assert compile_lib.parse_topology("v5e-16") == ("v5e", "4x4")
  assert compile_lib.parse_topology("v5p-8") == ("v5p", "2x2x1")
  assert compile_lib.parse_topology("v6e:2x4") == ("v6e", "2x4")
  with pytest.raises(compile_lib.CompileError, match="v5e-16"):
    compile_lib.parse_topology("v5e-12")
  assert _in_child(_num_devices, "v5e-4")[0] == 4


def test_rl_step_and_decode_compile_for_v5e_with_splash():
  reports = _compile(_tiny_config(), ("rl_step", "decode"))
  by_name = {r.name: r for r in reports}
  rl, dec = by_name["rl_step"], by_name["decode"]
  assert rl.shapes == "8 rows x 80 tokens"
  assert rl.kernels >= 2            # splash forward + backward kernels (Mosaic calls)
  assert dec.kernels == 0           # decode attends over the cache in XLA
  for r in reports:
    assert r.fits and 0 < r.total_bytes < 64 << 20
    assert r.flops > 0 and r.roofline_s > 0
    assert r.hbm == 16 << 30
  # attention="xla" compiles the same step without kernels.
  cfg = _tiny_config()
  cfg.model.attention = "xla"
  (xla,) = _compile(cfg, ("rl_step",))
  assert xla.kernels == 0


def test_cli_exits_1_naming_the_program_that_does_not_fit():
  """Qwen2.5-7B's f32 weights replicated for decode (model.rollout_sharding=replicated)
  need 30 GB per chip: more than a v5e's 16 GiB."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "gigrl.cli.compile", "--config",
         os.path.join(os.path.dirname(__file__), "..", "configs", "smoke.py"),
         "--topology", "v5e-4", "--programs", "decode",
         "--config.model.preset=qwen2.5-7b", "--config.model.rollout_sharding=replicated"]
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 1, out.stderr[-2000:]
  assert "gigrl-compile: error: decode does not fit" in out.stderr
  assert "OVER" in out.stdout


def test_ppo_mini_and_micro_batches_compile_the_accumulating_step():
  """train.ppo_mini_batch_size / micro_batch_size: the RL program is one mini-batch's
  update with gradient accumulation (update.make_ppo_step), plus the old log-probs, one
  micro-batch of rows per call (update.old_logprobs)."""
  cfg = _tiny_config()
  cfg.train.ppo_mini_batch_size = 2      # prompts: 4 rows per update
  cfg.train.micro_batch_size = 4         # rows: no accumulation split below the mesh
  cfg.data.prompts_per_step = 4
  reports = _compile(cfg, ("rl_step", "old_logprobs"))
  rl, old = reports
  assert (rl.name, rl.shapes) == ("rl_step", "4 rows (1 x 4) x 80 tokens")
  assert (old.name, old.shapes) == ("old_logprobs", "8 rows (2 x 4) x 80 tokens")
  assert rl.fits and old.fits and rl.kernels >= 2


def test_lora_train_step_compiles_with_adapter_only_optimizer_state():
  """model.lora: the RL update compiles on a v5e slice (adapters sharded after their base
  matrices), and the optimizer state the log line reports is the adapters' alone."""
  cfg = _tiny_config()
  cfg.model.lora.rank = 8
  (rl,), lines = _compile(cfg, ("rl_step",), log=True)
  _, full_lines = _compile(_tiny_config(), ("rl_step",), log=True)
  assert rl.fits and rl.kernels >= 2
  state, full = lines[0], full_lines[0]
  assert "LoRA rank 8" in state and "reference 0 GiB" in state, state
  assert "full fine-tuning" in full and "reference 0 GiB" not in full, full
  opt = lambda line: float(line.split("optimizer ")[1].split(" GiB")[0])
  trained = lambda line: float(line.split("(")[1].split(" GiB")[0])
  assert opt(state) == pytest.approx(2 * trained(state), rel=0.01)   # Adam mu, nu: adapters
  assert opt(full) == pytest.approx(2 * trained(full), rel=0.01)
  assert opt(state) < opt(full) / 2, (state, full)


def _run_set(cfg, stages, results):
  reports = compile_lib.compile_run(cfg, "v5e-4", stages, log=None, results=results)
  return [(r.stage, r.label, r.bytes, r.fits, r.compile_s) for r in reports]


def test_the_run_set_compiles_for_v5e_and_a_second_call_resumes_it(tmp_path):
  """gigrl-compile's default (--programs run): every program the run's warm-up compiles, the
  rollout's grid (prefix prefill, tails, KV copies, per-turn decode, observation widths), the
  update's widths and the helpers, lowered on the slice's mesh; each fits. Its reports are
  kept in --results as they come, and a second call compiles nothing."""
  cfg = _tiny_config()
  cfg.train.sft_steps, cfg.train.num_steps, cfg.train.eval_questions = 2, 2, 0
  cfg.rollout.max_obs_tokens, cfg.rollout.max_prompt_tokens = 64, 160   # the engine's budgets
  stages = ("sft", "rollout", "update", "other")
  res = str(tmp_path / "set.jsonl")
  first = _in_child(_run_set, cfg, stages, res)[0]
  by_stage = {}
  for stage, label, size, fits, _ in first:
    by_stage.setdefault(stage, []).append(label)
    assert fits and 0 < size < 64 << 20, (stage, label, size)
  assert set(by_stage) == set(stages), by_stage
  kinds = {lab.split("[")[0].split()[-1] for lab in by_stage["rollout"]}
  assert {"prefill", "copy_rows", "decode", "extend"} <= kinds, by_stage["rollout"]
  assert len(by_stage["update"]) == 4                  # update.batch.width_grid: four widths
  assert any(lab.startswith("advantages") for lab in by_stage["other"])
  second = _in_child(_run_set, cfg, stages, res)[0]
  assert second == first                               # read back, not compiled again
  assert len(open(res).read().splitlines()) == len(first)


def test_the_run_set_has_the_copy_an_asynchronous_sampler_is_published(tmp_path):
  """With ``train.max_staleness = 1`` each update publishes a device copy for the sampler:
  gigrl-compile's set has it. For the sampler thread it is the whole params, the reference
  copy's program (listed once); for a sampler process with LoRA, the adapters alone (#52)."""
  cfg = _tiny_config()
  cfg.train.sft_steps, cfg.train.num_steps, cfg.train.eval_questions = 2, 2, 0
  cfg.rollout.max_obs_tokens, cfg.rollout.max_prompt_tokens = 64, 160
  cfg.train.max_staleness = 1
  full = _in_child(_run_set, cfg, ("other",), str(tmp_path / "full.jsonl"))[0]
  cfg.model.lora.rank, cfg.train.sampler_address = 4, "localhost:1"
  lora = _in_child(_run_set, cfg, ("other",), str(tmp_path / "lora.jsonl"))[0]
  size = {label: b for _, label, b, fits, _ in full + lora if fits}
  assert "copy[reference params]" in size and "copy[published params]" not in size, size
  assert size["copy[published adapters]"] < size["copy[reference params]"] / 4, size
