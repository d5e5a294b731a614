"""gigrl-sweep: settings parsing, the statistics of its table (95% CI, AUC, steps to a
threshold), and (slow) a 2 settings x 2 seeds grid of tiny smoke runs that resumes."""
import json
import math
import os
import shutil

import pytest

from gigrl.cli import sweep as sweep_cli
from gigrl.training import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_setting_and_errors():
  assert sweep.parse_setting("drgrpo:advantage.outcome=drgrpo, data.pool.rule=grpo") == (
      "drgrpo", ["--config.advantage.outcome=drgrpo", "--config.data.pool.rule=grpo"])
  assert sweep.parse_setting("base:") == ("base", [])
  for bad in ("noname", ":a=1", "a b:x=1", "n:x"):
    with pytest.raises(sweep.SweepError):
      sweep.parse_setting(bad)


def test_mean_ci():
  m, h = sweep.mean_ci([0.2, 0.4, 0.6])
  assert m == pytest.approx(0.4)
  assert h == pytest.approx(4.303 * 0.2 / math.sqrt(3))    # t_{0.975,2} * sd / sqrt(n)
  assert math.isnan(sweep.mean_ci([0.5])[1])
  assert sweep.t_quantile(100) == 1.96


def _fake_run(d, sft, evals, zv, wall):
  os.makedirs(d)
  rows = [{"step": s, "phase": "sft"} for s in range(1, sft + 1)]
  rows += [{"step": sft + i, "phase": "rl", "zero_variance_frac": z}
           for i, z in enumerate(zv, 1)]
  rows += [{"step": sft + s, "phase": "eval", "eval/em": em} for s, em in evals]
  rows.sort(key=lambda r: r["step"])
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  json.dump({"wall_s": wall}, open(os.path.join(d, sweep.WALL), "w"))
  json.dump({}, open(os.path.join(d, sweep.DONE), "w"))


def test_summary_table_and_plot(tmp_path):
  _fake_run(tmp_path / "a" / "seed_0", 3, [(0, 0.1), (2, 0.3), (4, 0.5)], [0.5, 0.25], 60)
  _fake_run(tmp_path / "a" / "seed_1", 3, [(0, 0.1), (2, 0.1), (4, 0.3)], [0.0, 0.25], 120)
  _fake_run(tmp_path / "b" / "seed_0", 3, [(0, 0.0), (4, 0.0)], [1.0], 30)
  os.makedirs(tmp_path / "b" / "seed_1")                       # unfinished: not counted
  s = sweep.summarize(str(tmp_path), ["a", "b"], [0, 1], threshold=0.3)
  a = s["a"]
  assert a["seeds"] == [0, 1] and a["final_em_mean"] == pytest.approx(0.4)
  assert a["final_em_ci95"] == pytest.approx(12.706 * math.sqrt(0.02) / math.sqrt(2))
  # trapezoid: seed 0 (0.4 + 0.8) / 4 = 0.3, seed 1 (0.2 + 0.4) / 4 = 0.15
  assert a["auc_mean"] == pytest.approx(0.225)
  assert a["steps_to_threshold_mean"] == 3.0 and a["reached"] == 2     # steps 2 and 4
  assert a["zero_variance_frac_mean"] == pytest.approx(0.25)
  assert a["wall_s_mean"] == 90 and a["start_em_mean"] == pytest.approx(0.1)
  assert s["b"]["seeds"] == [0] and s["b"]["reached"] == 0
  table = sweep.markdown(s, 0.3, 2)
  assert a["delta_em_mean"] == pytest.approx(0.3)           # seeds: +0.4, +0.2
  assert ("| a | 2/2 | 0.400 ± 1.271 | 0.100 | +0.300 ± 1.271 | 0.225 | 3.0 (2/2) | 0.250 | 1.5 |"
          in table)
  assert "| b | 1/2 | 0.000 ± - |" in table
  assert sweep.plot(s, str(tmp_path / "p.png")) and os.path.getsize(tmp_path / "p.png") > 0


def test_bad_command_line_exits_2(tmp_path, capsys):
  cfg = os.path.join(ROOT, "configs/smoke.py")
  assert sweep_cli.main(["--config", "nope.py", "--workdir", str(tmp_path), "--setting",
                     "a:x=1"]) == 2
  assert "--config nope.py: no such file" in capsys.readouterr().err
  assert sweep_cli.main(["--config", cfg, "--workdir", str(tmp_path), "--setting", "a"]) == 2
  assert "--setting 'a'" in capsys.readouterr().err
  assert sweep_cli.main(["--config", cfg, "--workdir", str(tmp_path), "--setting", "a:x=1",
                     "--seeds", "1,x"]) == 2


TINY = ["train.sft_steps=2", "train.num_steps=2", "data.max_train_questions=8",
        "data.prompts_per_step=2", "data.group_size=2", "model.preset=tiny",
        "rollout.max_new_tokens=16", "rollout.max_obs_tokens=64", "train.sft_batch_size=4",
        "train.eval_questions=2", "checkpoint.every_steps=2", "data.pool.rule=grpo",
        "train.warmup=false"]        # as gigrl.testing.TEST_DEFAULTS: tiny runs compile on demand


@pytest.mark.slow
def test_tiny_grid_with_warm_start_runs_reports_and_resumes(tmp_path, monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)         # one device: faster compiles
  wd = str(tmp_path / "sweep")
  argv = ["--config", os.path.join(ROOT, "configs/smoke.py"), "--workdir", wd,
          "--seeds", "0,1", "--parallel", "2", "--eval_every", "1", "--threshold", "0.5",
          "--warm_start",
          "--setting", "grpo:advantage.outcome=grpo",
          "--setting", "drgrpo:advantage.outcome=drgrpo"]
  for o in TINY:
    argv += ["--set", o]
  assert sweep_cli.main(argv) == 0
  out = json.load(open(os.path.join(wd, "sweep.json")))
  for name in ("grpo", "drgrpo"):
    s = out["settings"][name]
    assert s["seeds"] == [0, 1]
    for r in s["runs"].values():
      assert [x for x, _ in r["curve"]] == [0, 1, 2]         # start of RL, every step
    assert 0.0 <= s["final_em_mean"] <= 1.0 and s["wall_s_mean"] > 0
    for r in (0, 1):                 # RL from the seed's shared warm start
      log = open(os.path.join(wd, name, f"seed_{r}", "train.log")).read()
      assert f"initialised from {os.path.join(wd, 'warm_start', f'seed_{r}')} step 2" in log
      assert log.splitlines()[0].count("--config.train.init_from=") == 1
  md = open(os.path.join(wd, "sweep.md")).read()
  assert md.startswith("Command: `gigrl-sweep --config") and "| grpo | 2/2 |" in md
  assert "SFT warm-start shared by every setting" in md
  assert os.path.getsize(os.path.join(wd, "sweep.png")) > 0
  # a killed run: its marker and last checkpoint gone; the rerun resumes only that run
  run = os.path.join(wd, "drgrpo", "seed_1")
  os.remove(os.path.join(run, sweep.DONE))
  shutil.rmtree(os.path.join(run, "checkpoints", "4"))
  before = open(os.path.join(wd, "grpo", "seed_0", "train.log")).read()
  metrics_before = open(os.path.join(run, "metrics.jsonl")).read()
  assert sweep_cli.main(argv) == 0
  assert open(os.path.join(wd, "grpo", "seed_0", "train.log")).read() == before  # not rerun
  log = open(os.path.join(run, "train.log")).read()
  assert log.count("$ ") == 2 and log.count("initialised from") == 2   # no checkpoint left
  strip = lambda t: [{k: v for k, v in json.loads(l).items() if not k.endswith("_s")}
                     for l in t.splitlines()]
  assert strip(open(os.path.join(run, "metrics.jsonl")).read()) == strip(metrics_before)


def test_held_out_em_by_hop_is_summarized_and_plotted(tmp_path):
  """Eval lines with ``eval/em/hops=N`` (questions that carry a hop count): per setting and hop
  the start, final and paired change over seeds, a table below the main one, and one panel
  per hop."""
  def run(d, em1, em2):
    _fake_run(d, 3, [(0, 0.5), (4, 0.6)], [0.5], 10)
    rows = [json.loads(l) for l in open(d / "metrics.jsonl")]
    for r in rows:
      if r["phase"] == "eval":
        i = 0 if r["step"] == 3 else 1
        r["eval/em/hops=1"], r["eval/em/hops=2"] = em1[i], em2[i]
    with open(d / "metrics.jsonl", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  run(tmp_path / "a" / "seed_0", (0.7, 0.8), (0.3, 0.7))
  run(tmp_path / "a" / "seed_1", (0.7, 0.7), (0.3, 0.5))
  s = sweep.summarize(str(tmp_path), ["a"], [0, 1], threshold=0.3)
  two = s["a"]["by_hop"]["2"]
  assert two["n"] == 2 and two["start_em_mean"] == pytest.approx(0.3)
  assert two["final_em_mean"] == pytest.approx(0.6) and two["delta_em_mean"] == pytest.approx(0.3)
  assert s["a"]["by_hop"]["1"]["delta_em_mean"] == pytest.approx(0.05)
  table = sweep.markdown(s, 0.3, 2)
  assert "| a | 2 | 2 | 0.600 ± 1.271 | 0.300 | +0.300 ± 1.271 |" in table
  assert sweep.plot(s, str(tmp_path / "p.png"))


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_is_not_marked_done(tmp_path, monkeypatch):
  """``launch``: SIGTERM during the run checkpoints and exits 3; no ``sweep_done.json`` is
  written, so the next sweep reruns (resumes) it instead of counting it finished."""
  # pylint: disable=g-import-not-at-top
  import multiprocessing
  import signal
  import threading
  import time
  # pylint: enable=g-import-not-at-top
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  run = str(tmp_path / "run")
  long = [o for o in TINY
          if not o.startswith(("train.sft_steps", "train.num_steps", "checkpoint.every_steps"))]
  long += ["train.sft_steps=100000", "train.num_steps=0", "checkpoint.every_steps=100000"]
  out = {}
  lines = []
  t = threading.Thread(target=lambda: out.update(rc=sweep.launch(
      os.path.join(ROOT, "configs/smoke.py"), long, run, lines.append)))
  t.start()
  log = os.path.join(run, "train.log")
  deadline = time.time() + 300
  while time.time() < deadline:     # the step loop has started (its signal handlers are in)
    if os.path.exists(log) and "/100000 [" in open(log).read():
      break
    time.sleep(0.5)
  children = multiprocessing.active_children()
  assert len(children) == 1, "the run's process"
  time.sleep(1.0)
  os.kill(children[0].pid, signal.SIGTERM)
  t.join(timeout=300)
  assert out["rc"] == 3, open(log).read()[-2000:]
  assert not os.path.exists(os.path.join(run, sweep.DONE))
  assert "stopped at step" in open(log).read()
  assert "stopped before its last step; rerun to resume" in lines[-1]
  assert os.listdir(os.path.join(run, "checkpoints"))     # the SIGTERM checkpoint
