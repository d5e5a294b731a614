"""A killed run loses nothing: SIGKILL at random points, SIGTERM, corrupt checkpoints.

Every check compares `metrics.jsonl` of the interrupted-and-resumed run with an uninterrupted
run of the same command: all metrics must be equal bitwise, except wall-clock timings
(`*_s`, `*tokens_per_s`), which differ between any two runs.
`GIGRL_RESUME_REPEATS=10 pytest tests/test_resume.py -k kill` repeats the kill test.
The corrupt / partial / changed-config cases start from copies of one short run (``prefix``).
"""
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import time

import pytest

from gigrl import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config.train.sft_steps=3", "--config.train.num_steps=4",
        "--config.data.max_train_questions=8", "--config.data.prompts_per_step=2",
        "--config.data.group_size=2", "--config.model.preset=tiny",
        "--config.rollout.max_new_tokens=16", "--config.rollout.max_obs_tokens=64",
        "--config.train.sft_batch_size=4", "--config.train.eval_questions=0",
        "--config.checkpoint.every_steps=2", "--config.checkpoint.keep=2",
        "--config.advantage.reweight=hadw",
        # every sampled group is trained on, so RL steps update the params (and a resumed
        # run must reproduce the optimizer state and params exactly to match)
        "--config.data.pool.rule=grpo"]
TIMING = ("_s", "tokens_per_s")
REPEATS = int(os.environ.get("GIGRL_RESUME_REPEATS", "1"))

pytestmark = pytest.mark.slow     # subprocess runs of gigrl-train


def _cmd(workdir, *extra):
  return testing.train_command(workdir, *ARGS, *extra)


_env = testing.single_process_env


def _run(workdir, *extra, ok=True):
  return testing.run_train(workdir, *ARGS, *extra, ok=ok)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if not k.endswith(TIMING)} for r in rows]


def _lines(workdir):
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return sum(1 for _ in f)
  except FileNotFoundError:
    return 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("reference")
  _run(workdir)
  rows = _metrics(workdir)
  assert [r["step"] for r in rows] == list(range(1, 8))
  return rows


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
  """A run stopped at step 4 (3 SFT + 1 RL steps; checkpoints 2 and 4), once: copied by each
  test that needs it."""
  workdir = tmp_path_factory.mktemp("prefix") / "run"
  _run(workdir, "--config.train.num_steps=1")
  assert _lines(workdir) == 4
  return workdir


def _copy(prefix, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(prefix, workdir)
  return workdir


def _start(workdir):
  return subprocess.Popen(_cmd(workdir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT, env=_env())


def _wait_for(proc, pred, timeout=300):
  t0 = time.time()
  while time.time() - t0 < timeout:
    if pred() or proc.poll() is not None:
      return
    time.sleep(0.05)
  raise TimeoutError("training did not reach the kill point")


@pytest.mark.parametrize("repeat", range(REPEATS))
def test_sigkill_at_random_points_then_resume(tmp_path, reference, repeat):
  rng = random.Random(1000 + repeat)
  workdir = tmp_path / "run"
  # Two kills: one right when a checkpoint write starts (its temporary directory appears),
  # one at a random metrics line plus a random delay.
  ckpt_dir = workdir / "checkpoints"

  def writing_checkpoint():
    return ckpt_dir.exists() and any("tmp" in p.name for p in ckpt_dir.iterdir())

  kill_points = [writing_checkpoint,
                 (lambda n=rng.randint(3, 6): _lines(workdir) >= n)]
  for pred in kill_points:
    proc = _start(workdir)
    _wait_for(proc, pred)
    time.sleep(rng.uniform(0.0, 0.3))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  out = _run(workdir)
  assert _metrics(workdir) == reference, out[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_checkpoint_and_exit_cleanly(tmp_path, reference, sig):
  workdir = tmp_path / "run"
  proc = _start(workdir)
  _wait_for(proc, lambda: _lines(workdir) >= 4)      # in RL, between checkpoints
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  assert f"{sig.name}: checkpoint at step" in err and "Traceback" not in err
  steps = sorted(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
  n = _lines(workdir)
  assert steps[-1] == n        # the step it stopped at was checkpointed
  _run(workdir)
  assert _metrics(workdir) == reference


def test_corrupt_latest_checkpoint_falls_back(tmp_path, reference, prefix):
  workdir = _copy(prefix, tmp_path)                        # stopped at step 4; keeps 2 and 4
  steps = sorted(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
  assert steps == [2, 4]
  state = workdir / "checkpoints" / "4" / "state"
  for root, _, files in os.walk(state):
    for f in files:
      with open(os.path.join(root, f), "wb") as fh:
        fh.write(b"garbage")
  out = _run(workdir)
  assert "checkpoint 4 is corrupt or partial" in out
  assert "resumed from checkpoint step 2" in out
  assert _metrics(workdir) == reference


def test_partial_checkpoint_dir_is_ignored(tmp_path, reference, prefix):
  workdir = _copy(prefix, tmp_path)                        # steps 1..4, checkpoints 2, 4
  tmp = workdir / "checkpoints" / "6.orbax-checkpoint-tmp-123"
  shutil.copytree(workdir / "checkpoints" / "4", tmp)     # a write that never finished
  out = _run(workdir)
  # the changed field is reported at start-up
  assert "config changed since the checkpoint was written: train.num_steps: 1 -> 4" in out
  assert _metrics(workdir) == reference


def test_structure_change_is_refused_and_loses_nothing(tmp_path, reference, prefix):
  workdir = _copy(prefix, tmp_path)                        # steps 1..4, checkpoints 2, 4
  before = (workdir / "metrics.jsonl").read_text()
  proc = _run(workdir, "--config.advantage.hadw.window=12", ok=False)
  assert proc.returncode != 0
  assert "does not fit this config" in proc.stderr
  assert "advantage.hadw.window: 10 -> 12" in proc.stderr
  assert "new --workdir" in proc.stderr
  assert (workdir / "metrics.jsonl").read_text() == before    # not truncated
  assert sorted(p for p in os.listdir(workdir / "checkpoints") if p.isdigit()) == ["2", "4"]
  _run(workdir)                                               # the old config continues
  assert _metrics(workdir) == reference


def test_init_from_an_sft_run_continues_it_exactly(tmp_path, reference):
  """``train.init_from``: RL from another run's end-of-SFT checkpoint equals the RL of one run
  that did both (params restored exactly; optimizer, reference policy, pool and advantage
  state start as they do after SFT). A checkpoint before the end of SFT continues SFT from
  its params with a fresh optimizer (its step-3 update differs from the one run's, whose Adam
  moments carry over); an RL checkpoint is refused (exit 2, naming the field)."""
  sft = tmp_path / "sft"
  _run(sft, "--config.train.num_steps=0")                  # steps 1..3, checkpoints 2, 3
  assert [r["step"] for r in _metrics(sft)] == [1, 2, 3]
  cont = tmp_path / "continued"
  out = _run(cont, f"--config.train.init_from={sft}@2", "--config.train.num_steps=0")
  assert "SFT continues to step 3 with a fresh optimizer" in out
  rows = _metrics(cont)
  assert [(r["step"], r["phase"]) for r in rows] == [(3, "sft")]
  assert rows[0]["loss"] == reference[2]["loss"]           # the same params and batch at step 3
  assert rows[0]["grad_norm"] == reference[2]["grad_norm"]
  rl = tmp_path / "rl"
  _run(rl, f"--config.train.init_from={sft}")
  proc = _run(tmp_path / "rl2", f"--config.train.init_from={rl}", ok=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "train.init_from" in proc.stderr and "(rl)" in proc.stderr
  assert _metrics(rl) == reference[3:]
  # notebooks/export_warm_start.py (the notebook's committed warm-start): params only, the same RL.
  spec = importlib.util.spec_from_file_location(
      "export_warm_start", os.path.join(ROOT, "notebooks", "export_warm_start.py"))
  export = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(export)
  exported = tmp_path / "exported"
  assert export.export(str(sft), str(exported)) == 3
  assert _metrics(exported) == [export.slim(r) for r in _metrics(sft)]
  rl2 = tmp_path / "rl_from_export"
  _run(rl2, f"--config.train.init_from={exported}")
  assert _metrics(rl2) == reference[3:]
