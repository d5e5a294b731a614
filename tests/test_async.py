"""Asynchronous RL with bounded staleness (``train.max_staleness``, gigrl.training.overlap).

The sampler's schedule is tested on its own (no model: a fake ``sample``), then tiny runs: k = 0
keeps no sampler thread and its metrics are those of the synchronous loop; with k = 1 and 2
every row is exactly min(k, versions so far) stale; a run killed while rollouts are in flight
resumes and trains every accepted query once, none lost. The sampler in a process of its own
(``train.sampler_address``, gigrl.training.sampler_process) reproduces the one-process k = 1 run
metric for metric (with LoRA too, sent the adapters only), serves a trainer on 2 processes as
one on 1 process x 2 devices, and a killed sampler or trainer process loses nothing.
"""
import importlib.util
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import threading
import time

import jax
import pytest

from gigrl import testing
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
  s = overlap.schedule(fake, max_staleness=k, first_rl_step=sft + 1, last_step=last,
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
  s = overlap.schedule(fake, max_staleness=2, first_rl_step=8, last_step=12, sft_steps=3,
                       params="v4", version=4, copy=lambda p: p)
  got = _train(s, 8, 12, 3)
  assert got == [(8, 4), (9, 4), (10, 4), (11, 5), (12, 6)]


def test_a_sampler_error_reaches_the_trainer():
  def boom(step, params, version):
    raise RuntimeError(f"retriever down at step {step}")
  s = overlap.schedule(boom, max_staleness=1, first_rl_step=1, last_step=3, sft_steps=0,
                       params="v0", version=0, copy=lambda p: p)
  with pytest.raises(RuntimeError, match="retriever down at step 1"):
    s.get(1)
  s.close()


def test_paused_holds_the_sampler_between_steps():
  fake = _Fake(delay=0.02)
  s = overlap.schedule(fake, max_staleness=2, first_rl_step=1, last_step=6, sft_steps=0,
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
        "--config.data.pool.rule=grpo",
        # most runs here check that no step compiles after the warm-up (off in other test
        # runs, and in the killed ones here: NO_WARMUP)
        "--config.train.warmup=true"]


# for the runs that count no compiles: the killed ones (each launches twice) and the references
# a run is compared with (every metric but the timings is the same without the warm-up:
# tests/test_warmup.py::test_warm_up_off_runs_the_same_programs)
NO_WARMUP = ("--config.train.warmup=false",)


def _cmd(workdir, *extra):
  return testing.train_command(workdir, *ARGS, *extra)


_env = testing.single_process_env


def _run(workdir, *extra):
  testing.run_train(workdir, *ARGS, *extra)


def _rl(workdir):
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return [r for r in rows if r["phase"] == "rl"]


def _async(k):
  return [f"--config.train.max_staleness={k}", "--config.loss.off_policy_correction=tis"]


@pytest.fixture(scope="module")
def k0_run(tmp_path_factory):
  """A k = 0 run (the default)."""
  work = tmp_path_factory.mktemp("k0") / "run"
  _run(work, *NO_WARMUP)
  return work


PINNED_K0 = os.path.join(ROOT, "tests", "pinned", "async_k0_before_b8caa78.json")


@pytest.mark.slow
def test_k0_is_the_loop_before_async(k0_run):
  """k = 0 is the synchronous loop as it was before asynchronous RL: the tiny run's RL metrics and
  its final params (sum of |x| in float64) equal those of the same run at b8caa78, the commit
  before the step was split into the sampler's and the trainer's halves
  (``tests/pinned/async_k0_before_b8caa78.json``, its command and versions inside). On the machine
  that pinned them they are bitwise equal, every value (2026-11-27, jax 0.10.2, AMD EPYC); the
  tolerance only absorbs another CPU's code generation, as measured on an Intel Xeon
  (2026-11-28, same jax): ``kl`` off by at most 8.7e-9 absolute (1.3e-4 relative on a KL of
  1.4e-5), ``grad_norm`` by 5.1e-6 relative, the params' sum by 9e-9 relative. A rollout by other
  params moves them more: the k = 1 run (rollouts one version stale) fails it on 4 values
  (``kl`` 1.4% off at step 6, ``grad_norm`` 5.4e-5). ``strat/strata_per_group``
  was added after b8caa78 and is not compared."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from gigrl import config as config_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import build  # pylint: disable=import-outside-toplevel
  from gigrl.training import checkpoint  # pylint: disable=import-outside-toplevel
  with open(PINNED_K0) as f:
    pinned = json.load(f)
  got = _rl(k0_run)
  assert len(got) == len(pinned["rl_metrics"])
  for want, row in zip(pinned["rl_metrics"], got):
    for k, v in want.items():
      if isinstance(v, float):
        assert row[k] == pytest.approx(v, rel=1e-5, abs=5e-8), (want["step"], k)
      else:
        assert row[k] == v, (want["step"], k)
  spec = importlib.util.spec_from_file_location("smoke", os.path.join(ROOT, "configs/smoke.py"))
  smoke = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(smoke)
  cfg = smoke.get_config()
  config_lib.apply_overrides(cfg, ARGS)
  vocab = build.load_data(cfg, k0_run).tokenizer.vocab_size
  params, meta = checkpoint.restore_params(k0_run, None, build.build_policy(cfg, vocab, None).params)
  assert meta["step"] == pinned["final_step"]
  total = sum(np.abs(np.asarray(x, np.float64)).sum() for x in jax.tree.leaves(params))
  assert float(total) == pytest.approx(pinned["params_abs_sum"], rel=1e-6)


@pytest.fixture(scope="module")
def k1_run(tmp_path_factory):
  """A one-process k = 1 run (the sampler a thread)."""
  work = tmp_path_factory.mktemp("k1") / "run"
  _run(work, *_async(1), *NO_WARMUP)
  return work


@pytest.mark.slow
def test_tiny_runs_hold_the_staleness_bound(tmp_path, k0_run, k1_run):
  """k = 0 logs no asynchronous metrics; k = 1 and 2 log every row exactly min(k, updates so
  far) versions stale, with the correction's ratio near 1 (the tiny updates move little)."""
  assert not any(k.startswith("async/") for r in _rl(k0_run) for k in r)
  _run(tmp_path / "k2", *_async(2), *NO_WARMUP)
  for k, work in ((1, k1_run), (2, tmp_path / "k2")):
    rl = _rl(work)
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
  extra = ["--config.train.max_staleness=1", "--config.loss.off_policy_correction=tis",
           *NO_WARMUP]
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


# ------------------------------------------------------- the sampler in a process of its own
def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start_pair(work, port, *extra: str, processes: int = 0, devices: int = 1,
                samplers: int = 1, sampler_devices: int = 1):
  """The trainer and its sampler process (``train.sampler_address``), all started: the trainer
  on one process (``processes = 0``) or on ``processes`` joined by ``jax.distributed`` (gloo),
  each with ``devices`` CPU devices; the sampler on ``samplers`` processes (a cluster of its
  own when several), each with ``sampler_devices``. Returns the trainer processes, then the
  sampler's."""
  args = [*_async(1), f"--config.train.sampler_address=localhost:{port}", *extra]

  def envs(n, d):
    flags = {} if d == 1 else {"XLA_FLAGS": f"--xla_force_host_platform_device_count={d}"}
    if n <= 1:
      return [_env(**flags)]
    coordinator = f"127.0.0.1:{_free_port()}"
    return [_env(**flags, GIGRL_COORDINATOR=coordinator, GIGRL_NUM_PROCESSES=str(n),
                 GIGRL_PROCESS_ID=str(i)) for i in range(n)]

  cmds = ([(_cmd(work, *args), e) for e in envs(processes, devices)]
          + [(_cmd(work, *args, "--sampler"), e) for e in envs(samplers, sampler_devices)])
  procs = []
  for i, (cmd, env) in enumerate(cmds):   # stderr to files: a full pipe would stall a process
    log = f"{work}.{i}.log"
    with open(log, "w") as f:
      procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, text=True,
                                    cwd=ROOT, env=env))
    procs[-1].log = log
  return procs


# a line of jax's C++ runtime log (glog form): "E1129 19:19:25.085778   31482 file.cc:159] ..."
RUNTIME_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] ")


def _stderr(proc) -> str:
  with open(proc.log) as f:
    return f.read()


def _finish(*procs):
  for p in procs:
    p.wait(timeout=600)
  for p in procs:
    assert p.returncode == 0, _stderr(p)[-4000:]


@pytest.mark.slow
def test_a_sampler_process_runs_the_thread_schedule(tmp_path, k1_run):
  """1 trainer + 1 sampler process, joined by one TCP connection (the weights sent to the
  sampler after each update, its rollouts back): every metric of every step equals the
  one-process k = 1 run's (timings aside), so each row is exactly min(1, updates) versions
  stale and the run learns as that one does; neither process compiles inside a step."""
  work = tmp_path / "pair"
  _finish(*_start_pair(work, _free_port()))
  got = _rl(work)
  _same_metrics(_rl(k1_run), got)
  assert [r["async/staleness_max"] for r in got] == [0, 1, 1, 1, 1, 1]


def _same_metrics(ref, got):
  """Every metric of every RL step equal (timings aside), and no compile inside a step."""
  assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(4, 10))
  for a, b in zip(ref, got):
    keys = {k for k in a.keys() | b.keys() if not k.startswith("time/")
            and not k.endswith(("_s", "tokens_per_s"))}
    assert {k: b.get(k) for k in keys} == {k: a.get(k) for k in keys}, a["step"]
    assert b["time/rollout_compile_s"] == 0 and b["time/update_compile_s"] == 0


@pytest.mark.slow
def test_a_lora_sampler_process_is_sent_the_adapters_only(tmp_path):
  """With ``model.lora`` the sampler process is sent the whole params once (the start version)
  and after each update only the adapters (the base is frozen, kept on its devices): every
  metric equals the one-process k = 1 LoRA run's, and its log shows each later version carrying
  the adapter leaves only."""
  lora = ["--config.model.lora.rank=4"]
  _run(tmp_path / "thread", *_async(1), *lora, *NO_WARMUP)
  *procs, sampler = _start_pair(tmp_path / "pair", _free_port(), *lora)
  _finish(*procs, sampler)
  _same_metrics(_rl(tmp_path / "thread"), _rl(tmp_path / "pair"))
  received = re.findall(r"version (\d+) received \((\d+) of (\d+) leaves", _stderr(sampler))
  assert [int(v) for v, _, _ in received] == list(range(5)), received
  (_, n0, total), *later = received
  assert n0 == total and later and all(0 < int(n) < int(total) for _, n, _ in later), received


@pytest.mark.slow
def test_a_trainer_on_two_processes_with_a_sampler_process(tmp_path):
  """The trainer on 2 processes x 1 CPU device (gloo), each connected to the one sampler
  process, each sending its own shards of the params after every update: every metric of every
  step equals, to 1e-6, the run whose trainer is 1 process x 2 devices (the same global layout),
  with each row min(1, updates) versions stale and no compile inside a step."""
  ref, two = tmp_path / "one", tmp_path / "two"
  _finish(*_start_pair(ref, _free_port(), *NO_WARMUP, devices=2))
  _finish(*_start_pair(two, _free_port(), processes=2))
  a, b = _rl(ref), _rl(two)
  assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(4, 10))
  for x, y in zip(a, b):
    keys = {k for k in x.keys() | y.keys() if not k.startswith("time/")
            and not k.endswith(("_s", "tokens_per_s"))}
    for k in sorted(keys):
      if isinstance(x.get(k), float):
        assert y.get(k) == pytest.approx(x[k], abs=1e-6, rel=1e-6), (x["step"], k)
      else:
        assert y.get(k) == x.get(k), (x["step"], k)
    assert y["time/rollout_compile_s"] == 0 and y["time/update_compile_s"] == 0
  assert [r["async/staleness_max"] for r in b] == [0, 1, 1, 1, 1, 1]


def _close_metrics(a, b, skip=()):
  """Every metric of every RL step within 1e-6 (timings and keys ending in ``skip`` aside), no
  compile inside a step."""
  assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(4, 10))
  for x, y in zip(a, b):
    keys = {k for k in x.keys() | y.keys() if not k.startswith("time/")
            and not k.endswith(("_s", "tokens_per_s", *skip))}
    for k in sorted(keys):
      if isinstance(x.get(k), float):
        assert y.get(k) == pytest.approx(x[k], abs=1e-6, rel=1e-6), (x["step"], k)
      else:
        assert y.get(k) == x.get(k), (x["step"], k)
  for y in b:
    assert y["time/rollout_compile_s"] == 0 and y["time/update_compile_s"] == 0


@pytest.mark.slow
def test_a_sampler_on_two_processes(tmp_path):
  """The sampler on 2 processes x 1 CPU device (gloo, a JAX cluster of its own): process 0
  assembles each version and forwards it to process 1, both roll out their share of each step's
  rows, agree before each step, and group GiGPO's anchor ids of the rows whose strings they hold
  (the trainer could not: that is a collective of the sampler's processes). Every metric of
  every step equals, to 1e-6, the run whose sampler is 1 process x 2 devices, but the rollout's
  ``weight_reads`` (a count per process, summed over processes), and no step compiles (the host
  gathers move bytes padded to a few sizes; unpadded, step 4 compiled ten of jax's gather
  programs, ~0.4 s; at this size every gather fits the smallest padded size, so the warm-up of
  the bigger ones is tested in tests/test_host_gathers.py). Try it: leave the anchor ids
  to the trainer (``_sample`` without its grouping) and ``gigpo/anchor_group_frac`` differs
  at step 4 (0.25 against 0.33: the trainer would group sampler process 0's rows only)."""
  gigpo = ["--config.advantage.step=gigpo", "--config.advantage.gigpo.grouping=similarity"]
  ref, two = tmp_path / "one", tmp_path / "two"
  _finish(*_start_pair(ref, _free_port(), *gigpo, *NO_WARMUP, sampler_devices=2))
  procs = _start_pair(two, _free_port(), *gigpo, samplers=2)
  _finish(*procs)
  a, b = _rl(ref), _rl(two)
  _close_metrics(a, b, skip=("weight_reads",))
  assert all("gigpo/anchor_group_frac" in r for r in b if r["update/rows"] > 0)
  assert [r["async/staleness_max"] for r in b] == [0, 1, 1, 1, 1, 1]
  assert "on 2 processes" in _stderr(procs[1])


@pytest.mark.slow
@pytest.mark.parametrize("killed,processes,samplers", [
    ("sampler", 0, 1), ("sampler", 2, 1), ("trainer", 0, 1), ("trainer process 1 of 2", 2, 1),
    ("sampler process 1 of 2", 0, 2), ("sampler process 0 of 2", 0, 2)])
def test_a_killed_process_loses_nothing(tmp_path, killed, processes, samplers):
  """SIGKILL the sampler process (or the trainer, or one process of a sampler on 2 processes)
  once the trainer has checkpointed step 6: every other process stops with one line naming
  ``train.sampler_address`` (exit 2, no traceback; a surviving sampler process does not wait at
  jax's shutdown barrier for the killed one, which aborted it after 100 s with a fatal dump;
  the one exception: when sampler process 0, which hosts jax's coordination service, is killed,
  jax itself may abort sampler process 1 first, with its own fatal message), the trainer (one process, or 2 that agree on it) having checkpointed the last step it trained;
  rerunning them all finishes every step once, and the queries the pool consumed are exactly
  those the steps accepted (none trained twice, none lost in flight). The trainer processes'
  per-step agreement also covers a rollout that reached one of them and not the other; this kill
  does not force that race. A lone trainer is killed only after the sampler has sent its last
  step: with nothing left to sample, the sampler must still exit 2 (it used to exit 0)."""
  work = tmp_path / "killed"
  procs = _start_pair(work, _free_port(), *NO_WARMUP, processes=processes, samplers=samplers)
  trainers = procs[:max(processes, 1)]
  deadline, ckpt = time.time() + 600, work / "checkpoints" / "6"
  while not ckpt.exists() and trainers[0].poll() is None and time.time() < deadline:
    time.sleep(0.05)
  if killed == "trainer":     # once the sampler has sent its last step, so it has nothing left
    while ("step 9 sampled" not in _stderr(procs[-1]) and trainers[0].poll() is None
           and time.time() < deadline):
      time.sleep(0.02)
  victim = {"sampler": procs[-1], "trainer": trainers[0], "trainer process 1 of 2": procs[1],
            "sampler process 1 of 2": procs[-1], "sampler process 0 of 2": procs[-2]}[killed]
  others = [p for p in procs if p is not victim]
  victim.send_signal(signal.SIGKILL)
  victim.wait()
  for proc in others:
    proc.wait(timeout=600)
    err = _stderr(proc)
    assert ckpt.exists(), err[-4000:]
    if killed == "sampler process 0 of 2" and proc is procs[-1] and proc.returncode == -6:
      # the killed process hosted jax's coordination service: jax aborts the other process of
      # that cluster itself, which gigrl cannot intercept (distributed.initialize)
      assert "coordination service" in err, err[-4000:]
      continue
    assert proc.returncode == 2, err[-4000:]
    lines = err.strip().splitlines()
    if killed == "sampler process 0 of 2":
      # the coordination service went with process 0: jax's own threads may log its loss (a
      # failed preemption-notice poll, "Failed to cancel preemption barrier") at any time,
      # also after gigrl's error line and before the exit
      lines = [line for line in lines if not RUNTIME_LOG.match(line)]
    last = lines[-1]
    assert last.startswith("gigrl-train: error:"), err[-4000:]
    assert "train.sampler_address" in last or "rerun every process" in last, last
    assert "Traceback" not in err, err[-4000:]
  # the steps trained before the loss are kept: the last one is checkpointed
  trained = max(r["step"] for r in _rl(work))
  last_ckpt = max(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
  assert last_ckpt == trained if "trainer" not in killed else last_ckpt <= trained
  _finish(*_start_pair(work, _free_port(), *NO_WARMUP, processes=processes, samplers=samplers))
  rl = _rl(work)
  assert [r["step"] for r in rl] == list(range(4, 10))
  accepted = sum(int(r["pool/accepted"]) for r in rl)
  from gigrl.training import checkpoint  # pylint: disable=import-outside-toplevel
  pool = checkpoint.restore_meta(str(work), None)["pool"]
  assert accepted == sum(w == 0 for w in pool["weights"]) > 0


def test_sampler_process_errors_name_the_field(tmp_path):
  """No sampler process listens: the trainer's wait ends with an error naming the address; a
  sampler address needs k >= 1 and the host:port form."""
  from gigrl import config as config_lib  # pylint: disable=import-outside-toplevel
  from gigrl.config_utils import ConfigError  # pylint: disable=import-outside-toplevel
  from gigrl.training import sampler_process  # pylint: disable=import-outside-toplevel
  start = sampler_process.Start(first_rl_step=1, last_step=2, sft_steps=0, max_staleness=1,
                                version=0, pool_state={})
  address = f"localhost:{_free_port()}"
  with pytest.raises(sampler_process.SamplerError, match=f"sampler_address={address}"):
    sampler_process.RemoteSampler(address, start, [], lambda _: None, timeout=0.5)
  cfg = config_lib.base_config()
  cfg.train.sampler_address = address
  with pytest.raises(ConfigError, match="train.sampler_address"):
    config_lib.validate(cfg)
  cfg.train.max_staleness, cfg.train.sampler_address = 1, "localhost"
  with pytest.raises(ConfigError, match="host:port"):
    config_lib.validate(cfg)


def test_a_stop_from_one_trainer_process_waits_for_the_others_loss():
  """CI's race (trainer process 1 of 2 killed, the sampler exited 0): process 0's receiver
  ends with a clean stop at once while process 1's, still busy putting a version on the
  devices, records its lost connection 0.3 s later; the sampler's check after a stop hears
  every receiver out and raises that loss (exit 2), and with no loss it returns."""
  from gigrl.training import sampler_process  # pylint: disable=import-outside-toplevel
  errors: list[BaseException] = []
  lost = sampler_process.SamplerError("trainer process 1 closed its connection")

  def busy_then_lost():
    time.sleep(0.3)
    errors.append(lost)

  receivers = [threading.Thread(target=lambda: None), threading.Thread(target=busy_then_lost)]
  for th in receivers:
    th.start()
  with pytest.raises(sampler_process.SamplerError, match="trainer process 1"):
    sampler_process._raise_if_any_lost(receivers, errors)  # pylint: disable=protected-access
  clean = [threading.Thread(target=lambda: time.sleep(0.1)) for _ in range(2)]
  for th in clean:
    th.start()
  sampler_process._raise_if_any_lost(clean, [])  # pylint: disable=protected-access



def test_a_trainer_that_fails_tells_the_sampler():
  """A trainer process that exits with an error sends Failed (its error) in place of the clean
  stop, and the sampler's reader of that process returns a one-line SamplerError naming it (so
  the sampler exits 2, not 0 as after a stop); a clean stop returns None, a closed connection
  the lost-connection error."""
  import multiprocessing.connection as mpc  # pylint: disable=import-outside-toplevel
  from gigrl.training import sampler_process  # pylint: disable=import-outside-toplevel
  start = sampler_process.Start(first_rl_step=1, last_step=2, sft_steps=0, max_staleness=1,
                                version=0, pool_state={})
  port = _free_port()
  listener = mpc.Listener(("localhost", port), authkey=sampler_process._authkey())  # pylint: disable=protected-access
  got: dict = {}

  def serve():
    conn = listener.accept()
    added = []
    got["error"] = sampler_process._read_trainer(  # pylint: disable=protected-access
        conn, 0, added.append, f"localhost:{port}")
    got["added"] = added
    conn.close()

  th = threading.Thread(target=serve)
  th.start()
  remote = sampler_process.RemoteSampler(f"localhost:{port}", start, [], lambda _: None)
  remote.close(RuntimeError("step 5: the update's loss is NaN\nmore"))
  th.join(30)
  listener.close()
  assert [type(m).__name__ for m in got["added"]] == ["Hello", "Start", "Params"]
  err = got["error"]
  assert isinstance(err, sampler_process.SamplerError), err
  assert str(err).startswith(f"trainer process 0 of train.sampler_address=localhost:{port} "
                             "failed (RuntimeError: step 5: the update's loss is NaN): rerun"), (
                                 str(err))
  a, b = multiprocessing.Pipe()
  a.send(None)
  assert sampler_process._read_trainer(b, 1, lambda m: None, "x") is None  # pylint: disable=protected-access
  a.close()
  assert "closed its connection to train.sampler_address=x" in str(
      sampler_process._read_trainer(b, 1, lambda m: None, "x"))  # pylint: disable=protected-access


def test_a_lost_peer_is_recognised_whatever_jax_raises(monkeypatch):
  """What CI met once (1eb2846): gloo's reset came as a ValueError from process_allgather, not
  a JaxRuntimeError. On 2 processes (jax.process_count faked) a lost peer's message anywhere in
  the error's cause chain, whatever its type, is recognised and marks the cluster; the sampler's
  get then raises a one-line SamplerError naming the address. Any other error, overlap.Stopped,
  and a lost peer's message on one process pass through unchanged."""
  from gigrl import distributed  # pylint: disable=import-outside-toplevel
  from gigrl.training import sampler_process  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(distributed._peer_lost, "lost", False)  # pylint: disable=protected-access
  gone = ValueError("Gloo AllGather failed: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                    "Read error [127.0.0.1]:4242: Connection reset by peer")

  class Get:
    def __init__(self, err):
      self.err = err

    def get(self, step):
      raise self.err

  def wrapped(err):
    try:
      raise err
    except ValueError as e:
      try:
        raise RuntimeError("process_allgather failed") from e
      except RuntimeError as outer:
        return outer

  assert not distributed.lost_process(gone)              # one process: not a lost peer
  assert not distributed.peer_was_lost()
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert not distributed.lost_process(ValueError("shapes (2,) and (3,) do not match"))
  assert not distributed.peer_was_lost()
  assert distributed.lost_process(wrapped(gone))         # in the cause chain
  assert distributed.peer_was_lost()
  monkeypatch.setitem(distributed._peer_lost, "lost", False)  # pylint: disable=protected-access
  with pytest.raises(sampler_process.SamplerError,
                     match=r"^sampler process 0: a collective of the 2 processes failed "
                           r"\(ValueError: .*Connection reset by peer\).*localhost:1234") as e:
    sampler_process._get(Get(gone), 3, "localhost:1234")  # pylint: disable=protected-access
  assert "\n" not in str(e.value) and distributed.peer_was_lost()
  with pytest.raises(ValueError, match="do not match"):
    sampler_process._get(Get(ValueError("do not match")), 3, "x")  # pylint: disable=protected-access
  with pytest.raises(overlap.Stopped):
    sampler_process._get(Get(overlap.Stopped()), 3, "x")  # pylint: disable=protected-access

def test_params_pieces_assemble_to_the_trainer_params():
  """Each process's shards of a leaf (replica id 0 only) assemble to the whole leaf: here the
  8 simulated devices' shards of an FSDP-sharded leaf and of a replicated one (sent once), as a
  2-process trainer's two halves would arrive; a missing piece is an error, not zeros."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from gigrl.training import sampler_process  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  a = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
  b = np.arange(5, dtype=np.int32)
  params = {"a": jax.device_put(a, NamedSharding(mesh, P("fsdp"))),
            "b": jax.device_put(b, NamedSharding(mesh, P()))}
  from gigrl.training import state as state_lib  # pylint: disable=import-outside-toplevel
  pieces = sampler_process._pieces(  # pylint: disable=protected-access
      dict(enumerate(jax.tree.leaves(params))))
  assert len(pieces) == len(jax.devices()) + 1            # a's 8 shards, b once
  half = len(pieces) // 2                                 # "process 0" and "process 1"
  got = sampler_process.assemble(pieces[half:] + pieces[:half], jax.tree.leaves(params))
  np.testing.assert_array_equal(got[0], a)
  np.testing.assert_array_equal(got[1], b)
  with pytest.raises(RuntimeError, match="cover leaves"):
    sampler_process.assemble(pieces[1:], jax.tree.leaves(params))
  # an update's version with LoRA: the trained leaves only, device-copied as publish does
  only_b = sampler_process._pieces(  # pylint: disable=protected-access
      state_lib.copy_leaves(params, [1]))
  got = sampler_process.assemble(only_b, jax.tree.leaves(params), [1])
  assert list(got) == [1]
  np.testing.assert_array_equal(got[1], b)


def test_a_sampler_process_is_forwarded_the_shards_it_holds():
  """A sampler process other than 0 names the shards its devices hold (``own_shards``), and
  process 0 forwards it those slices of each version (``shards_for``): here an FSDP leaf over
  the 8 simulated devices (8 shards of 8 rows) and a replicated one (whole), each slice equal to
  the leaf at that shard's index."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from gigrl.training import sampler_process  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  a = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
  b = np.arange(5, dtype=np.int32)
  params = {"a": jax.device_put(a, NamedSharding(mesh, P("fsdp"))),
            "b": jax.device_put(b, NamedSharding(mesh, P()))}
  wanted = sampler_process.own_shards(params)
  assert len(wanted[0]) == len(jax.devices()) and wanted[1] == [((0, 5),)]
  got = sampler_process.shards_for({0: a, 1: b}, wanted)
  assert sum(x.nbytes for x in got[0].values()) == a.nbytes
  for x, host in zip(jax.tree.leaves(params), (a, b)):
    i = 0 if host is a else 1
    for index in x.sharding.addressable_devices_indices_map(x.shape).values():
      key = sampler_process._shard_key(index, x.shape)  # pylint: disable=protected-access
      np.testing.assert_array_equal(got[i][key], host[index])


def test_with_lora_only_the_adapters_are_trained_leaves():
  """``lora.trained_leaf_indices``: with LoRA, the adapter leaves (A and B of each target), which an update
  changes and the sampler is sent after the start; without LoRA, None (every leaf)."""
  import jax  # pylint: disable=import-outside-toplevel
  from gigrl import config as config_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import build  # pylint: disable=import-outside-toplevel
  from gigrl.models import lora as lora_lib  # pylint: disable=import-outside-toplevel
  cfg = config_lib.base_config()
  cfg.model.preset, cfg.model.lora.rank = "tiny", 4
  params = build.build_policy(cfg, 512, None).params
  names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  got = lora_lib.trained_leaf_indices(params, True)
  assert got and all("_lora_" in names[i] for i in got)
  assert not any("_lora_" in n for i, n in enumerate(names) if i not in got)
  assert lora_lib.trained_leaf_indices(params, False) is None
