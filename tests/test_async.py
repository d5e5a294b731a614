"""Asynchronous RL with bounded staleness (``train.max_staleness``, gigrl.training.overlap).

The sampler's schedule is tested on its own (no model: a fake ``sample``), then tiny runs: k = 0
keeps no sampler thread and its metrics are those of the synchronous loop; with k = 1 and 2
every row is exactly min(k, versions so far) stale; a run killed while rollouts are in flight
resumes and trains every accepted query once, none lost.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gigrl.training import overlap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Fake:
  """A sampler's ``sample`` that records (step, version, params) and the thread it ran on."""

  def __init__(self, delay: float = 0.0):
    self.calls, self.delay = [], delay

  def __call__(self, step, params, version):
    time.sleep(self.delay)
    self.calls.append((step, version, params, threading.current_thread().name))
    return overlap.Rollout(step=step, version=version, cands=None, questions=[], batch=None,
                           row_arrays=None, rewards=None, rows=None, valid=None, rollout_m={},
                           pool_m={}, search_m={}, owned=None, pool_state={}, t_start=0.0,
                           t_roll=0.0)


def _train(sampler, first, last, sft):
  """The trainer's side: get each step, 'update', publish version step - sft."""
  got = []
  for step in range(first, last + 1):
    r, _ = sampler.get(step)
    got.append((step, r.version))
    sampler.publish(f"v{step - sft}", step - sft)
  sampler.close()
  return got


@pytest.mark.parametrize("k", [0, 1, 2])
def test_each_step_is_sampled_by_the_version_k_behind(k):
  sft, last = 3, 12
  fake = _Fake(delay=0.01)
  s = overlap.Sampler(fake, max_staleness=k, first_rl_step=sft + 1, last_step=last,
                      sft_steps=sft, params="v0", version=0, copy=lambda p: p)
  got = _train(s, sft + 1, last, sft)
  assert [v for _, v in got] == [max(0, step - 1 - sft - k) for step, _ in got]
  # the params handed to sample are that version's, and the step is sampled once
  assert [c[2] for c in fake.calls] == [f"v{c[1]}" for c in fake.calls]
  assert [c[0] for c in fake.calls] == list(range(sft + 1, last + 1))
  # k = 0 samples inside the trainer's step, on its thread (the loop as it always was)
  threads = {c[3] for c in fake.calls}
  assert (threads == {threading.current_thread().name}) == (k == 0)
  for step, v in got:                        # the bound: trained by version step - 1 - sft
    assert 0 <= (step - 1 - sft) - v <= k


def test_a_resumed_sampler_starts_from_the_restored_version():
  """After a resume at version 4 with k = 2, the versions 2 and 3 are gone: the next steps
  are sampled by version 4 (less stale), then k behind again."""
  fake = _Fake()
  s = overlap.Sampler(fake, max_staleness=2, first_rl_step=8, last_step=12, sft_steps=3,
                      params="v4", version=4, copy=lambda p: p)
  got = _train(s, 8, 12, 3)
  assert got == [(8, 4), (9, 4), (10, 4), (11, 5), (12, 6)]


def test_a_sampler_error_reaches_the_trainer():
  def boom(step, params, version):
    raise RuntimeError(f"retriever down at step {step}")
  s = overlap.Sampler(boom, max_staleness=1, first_rl_step=1, last_step=3, sft_steps=0,
                      params="v0", version=0, copy=lambda p: p)
  with pytest.raises(RuntimeError, match="retriever down at step 1"):
    s.get(1)
  s.close()


def test_paused_holds_the_sampler_between_steps():
  fake = _Fake(delay=0.02)
  s = overlap.Sampler(fake, max_staleness=2, first_rl_step=1, last_step=6, sft_steps=0,
                      params="v0", version=0, copy=lambda p: p)
  with s.paused():
    n = len(fake.calls)
    time.sleep(0.2)
    assert len(fake.calls) == n
  _train(s, 1, 6, 0)


# ------------------------------------------------------------------------ tiny runs
ARGS = ["--config.train.sft_steps=3", "--config.train.num_steps=6",
        "--config.data.max_train_questions=40", "--config.data.prompts_per_step=2",
        "--config.data.group_size=2", "--config.model.preset=tiny",
        "--config.rollout.max_new_tokens=16", "--config.rollout.max_obs_tokens=64",
        "--config.train.sft_batch_size=4", "--config.train.eval_questions=0",
        "--config.checkpoint.every_steps=2", "--config.checkpoint.keep=2",
        "--config.loss.entropy_coeff=0.01",     # the tiny model earns no reward: a gradient anyway
        # every candidate trained and consumed: the pool's consumed queries are the trained ones
        "--config.data.pool.rule=grpo"]


def _cmd(workdir, *extra):
  return [sys.executable, "-m", "gigrl.cli.train", "--config",
          os.path.join(ROOT, "configs/smoke.py"), "--workdir", str(workdir), *ARGS, *extra]


def _env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  return env


def _run(workdir, *extra):
  proc = subprocess.run(_cmd(workdir, *extra), capture_output=True, text=True, timeout=600,
                        cwd=ROOT, env=_env())
  assert proc.returncode == 0, proc.stderr[-4000:]


def _rl(workdir):
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return [r for r in rows if r["phase"] == "rl"]


@pytest.mark.slow
def test_tiny_runs_hold_the_staleness_bound(tmp_path):
  """k = 0 logs no asynchronous metrics; k = 1 and 2 log every row exactly min(k, updates so
  far) versions stale, with the correction's ratio near 1 (the tiny updates move little)."""
  _run(tmp_path / "k0")
  assert not any(k.startswith("async/") for r in _rl(tmp_path / "k0") for k in r)
  for k in (1, 2):
    _run(tmp_path / f"k{k}", f"--config.train.max_staleness={k}",
         "--config.loss.off_policy_correction=tis")
    rl = _rl(tmp_path / f"k{k}")
    assert [r["step"] for r in rl] == list(range(4, 10))
    for i, r in enumerate(rl):
      assert r["async/staleness_max"] == min(k, i) <= k
      assert r["async/version"] == max(0, i - k)
      assert abs(r["is_ratio_mean"] - 1) < 0.05 and r["is_capped_frac"] == 0


@pytest.mark.slow
def test_a_killed_async_run_trains_each_accepted_query_once(tmp_path):
  """SIGKILL a k = 1 run after its first RL checkpoint (the sampler is a step ahead: a rollout
  is in flight); the resumed run finishes every step once, and the queries its pool consumed
  are exactly the ones its steps accepted: none trained twice (the pool would consume it once
  but count two acceptances), none lost (consumed in flight but never trained)."""
  work = tmp_path / "killed"
  extra = ["--config.train.max_staleness=1", "--config.loss.off_policy_correction=tis"]
  proc = subprocess.Popen(_cmd(work, *extra), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, cwd=ROOT, env=_env())
  deadline = time.time() + 600
  ckpt = work / "checkpoints" / "6"
  while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  time.sleep(0.3)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert ckpt.exists(), "the run ended before its step-6 checkpoint"
  _run(work, *extra)
  rl = _rl(work)
  assert [r["step"] for r in rl] == list(range(4, 10))
  accepted = sum(int(r["pool/accepted"]) for r in rl)
  from gigrl.training import checkpoint  # pylint: disable=import-outside-toplevel
  pool = checkpoint.restore_meta(str(work), None)["pool"]
  consumed = sum(w == 0 for w in pool["weights"])
  assert accepted == consumed > 0


@pytest.mark.slow
def test_sampler_on_its_own_device(tmp_path):
  """``rollout.devices = 1`` of 2 CPU devices: rollouts and evaluations on device 0, training on
  device 1 (two meshes of one process, weights moved by ``jax.device_put`` after each update),
  with k = 1: the run finishes with the bound held and nothing compiled after the warm-up. A
  split that leaves no device to train on is refused, naming the field (exit 2)."""
  env = dict(_env(), XLA_FLAGS="--xla_force_host_platform_device_count=2")
  extra = ["--config.train.max_staleness=1", "--config.loss.off_policy_correction=tis",
           "--config.rollout.devices=1", "--config.train.eval_questions=4",
           "--config.train.eval_every=3"]
  proc = subprocess.run(_cmd(tmp_path / "split", *extra), capture_output=True, text=True,
                        timeout=600, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rl = _rl(tmp_path / "split")
  assert [r["async/staleness_max"] for r in rl] == [0, 1, 1, 1, 1, 1]
  assert all(r["time/rollout_compile_s"] == 0 and r["time/update_compile_s"] == 0 for r in rl)
  proc = subprocess.run(_cmd(tmp_path / "bad", "--config.rollout.devices=2"), capture_output=True,
                        text=True, timeout=600, cwd=ROOT, env=env)
  assert proc.returncode == 2 and "rollout.devices" in proc.stderr, proc.stderr[-2000:]
