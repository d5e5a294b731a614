"""End-to-end: `gigrl-train` on the bundled data (tiny sizes), outputs, resume, composition."""
import json
import os
import subprocess
import sys

import pytest

from gigrl import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ("step", "reward_mean", "em", "search_calls_mean", "zero_variance_frac", "loss",
            "kl", "train/tokens_per_s", "rollout/tokens_per_s", "phase")
TINY = ["--config.train.sft_steps=2", "--config.train.num_steps=2",
        "--config.data.max_train_questions=8", "--config.data.prompts_per_step=2",
        "--config.data.group_size=2", "--config.model.preset=tiny",
        "--config.rollout.max_new_tokens=16", "--config.rollout.max_obs_tokens=64",
        "--config.train.sft_batch_size=4", "--config.train.sample_every=1",
        "--config.train.eval_questions=2", "--config.checkpoint.every_steps=2"]

pytestmark = pytest.mark.slow     # subprocess runs of gigrl-train


def _train(workdir, *extra):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)     # one device is enough here and compiles faster
  proc = subprocess.run(
      [sys.executable, "-m", "gigrl.cli.train", "--config", os.path.join(ROOT, "configs/smoke.py"),
       "--workdir", str(workdir), *testing.TEST_DEFAULTS, *TINY, *extra],
      capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("run")
  _train(workdir)
  return workdir


def test_outputs(run_dir):
  rows = _metrics(run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert [r["phase"] for r in rows] == ["sft", "sft", "rl", "rl"]
  for r in rows:
    assert all(k in r for k in REQUIRED), sorted(r)
    assert "tokens_per_s" not in r       # one meaning per key: train/ or rollout/
  for r in rows[2:]:
    assert 0.0 <= r["reward_mean"] <= 1.0 and r["rollout/tokens_per_s"] > 0
    assert "pool/size" in r and "adv/mean" in r
  assert os.path.exists(os.path.join(run_dir, "samples", "step_000003.txt"))
  sample = open(os.path.join(run_dir, "samples", "step_000003.txt")).read()
  assert "question:" in sample and "gold:" in sample
  assert os.path.exists(os.path.join(run_dir, "metrics.png"))
  ev = json.load(open(os.path.join(run_dir, "eval.json")))
  assert ev["eval/n"] == 2 and 0.0 <= ev["eval/em"] <= 1.0
  assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "4"]


def test_rerun_resumes_and_adds_nothing(run_dir):
  before = _metrics(run_dir)
  proc = _train(run_dir)
  assert "resumed from checkpoint step 4" in proc.stderr + proc.stdout
  assert _metrics(run_dir) == before


def test_all_estimators_compose_in_training(tmp_path):
  _train(tmp_path, "--config.advantage.outcome=stratified", "--config.advantage.step=gigpo",
         "--config.advantage.reweight=hadw", "--config.data.pool.rule=bounded_dapo",
         "--config.data.pool.oversample=2")
  rows = _metrics(tmp_path)
  rl = [r for r in rows if r["phase"] == "rl"]
  assert len(rl) == 2
  assert all("strat/cross_stratum_bias" in r and "hadw/anchor" in r for r in rl)


def test_the_retired_callback_engine_is_a_start_up_error(tmp_path):
  """``rollout.engine=callback`` (retired in #50): one line naming the replacement, exit 2."""
  proc = subprocess.run(
      [sys.executable, "-m", "gigrl.cli.train", "--config", os.path.join(ROOT, "configs/smoke.py"),
       "--workdir", str(tmp_path), "--config.rollout.engine=callback"],
      capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  err = [l for l in proc.stderr.splitlines() if l.strip()]
  assert "Traceback" not in proc.stderr
  assert "rollout.engine" in err[-1] and "host_loop" in err[-1], err[-1]


def test_nonfinite_updates_are_skipped_counted_and_stop_the_run(tmp_path):
  # lr 1e30: the first update sends the params to ~1e30, the next losses are not finite.
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "gigrl.cli.train", "--config", os.path.join(ROOT, "configs/smoke.py"),
       "--workdir", str(tmp_path), *testing.TEST_DEFAULTS, *TINY, "--config.train.sft_steps=6",
       "--config.train.num_steps=0", "--config.train.sft_learning_rate=1e30",
       "--config.train.max_consecutive_nonfinite=2", "--config.train.eval_questions=0"],
      capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "consecutive updates had a non-finite loss or gradient norm" in proc.stderr
  rows = _metrics(tmp_path)
  skipped = [r["train/nonfinite_updates"] for r in rows]
  assert skipped[0] == 0 and skipped[-1] == 2 and len(rows) < 6, skipped
  assert "Traceback" not in proc.stderr
