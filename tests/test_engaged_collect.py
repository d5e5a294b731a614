"""docs/results/countries_smollm2_engaged/collect.py on a tiny synthetic grid: the paired
differences and their intervals against a hand computation, missing cells, the mechanisms, the
figures, and the one-line exit-2 errors (CPU, no jax)."""
import importlib.util
import json
import os

import numpy as np
import pytest
from scipy import stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "docs/results/countries_smollm2_engaged/collect.py")
HOPS = [1, 2, 1, 2, 1, 2, 1, 2]
# test EM per question (q0..q7) by setting and warm-start
EM = {
    "start": {0: [1, 0, 1, 0, 0, 0, 1, 0], 1: [1, 0, 0, 1, 0, 0, 1, 0]},
    "grpo_filter": {0: [1, 0, 1, 0, 0, 0, 1, 1], 1: [1, 0, 0, 1, 0, 1, 1, 0]},
    "grpo_recycle": {0: [1, 1, 1, 0, 1, 0, 1, 1], 1: [1, 0, 1, 1, 0, 1, 1, 0]},
}
EM["hadw"] = EM["grpo_recycle"]       # identical per question: every paired difference is 0


def _collect():
  spec = importlib.util.spec_from_file_location("engaged_collect", PATH)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _write(path, rows, tail="\n"):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + tail)


def _evaluation(d, what, em, reverse=False):
  """A finished gigrl-eval test evaluation ``d/what``: samples_test.jsonl (rows reversed with
  ``reverse``, so that only the question ids pair them) and results.json."""
  rows = [{"id": f"q{i}", "hops": h, "answers": ["x"], "em": [float(e)], "f1": [float(e)],
           "search_calls": [h], "queries": [["q"] * h], "retrieved": [[["p"]] * h]}
          for i, (e, h) in enumerate(zip(em, HOPS))]
  _write(os.path.join(d, what, "samples_test.jsonl"), rows[::-1] if reverse else rows)
  _write(os.path.join(d, what, "results.json"), [{"datasets": {}}])


def _eval_line(step, em):
  return {"step": step, "phase": "eval", "eval/em": em, "eval/em/hops=1": em,
          "eval/em/hops=2": em}


def _rl_lines(steps, accepted=(2, 0, 2), recycled=(0.5, 0.0, 1.0)):
  return [{"step": 30 + i, "phase": "rl", "pool/accepted": accepted[(i - 1) % 3],
           "pool/recycled_frac": recycled[(i - 1) % 3], "pool/flips": 1.0, "pool/size": 200 - i,
           "zero_variance_frac": 0.5, "trained_groups": 0 if i % 3 == 2 else 2,
           "strat/strata_per_group": 0.0 if i % 3 == 2 else 2.0,
           "strat/cross_stratum_bias": 0.1, "reward_mean": 0.6}
          for i in range(1, steps + 1)]


def _grid(root, seeds=(0, 1)):
  """Warm-starts 0 and 1 finished; grpo_filter, grpo_recycle and hadw finished from both;
  stratified running from warm-start 0 (10 RL steps, no test); nothing else."""
  for s in seeds:
    w = os.path.join(root, "warm_start", f"seed_{s}")
    _write(os.path.join(w, "metrics.jsonl"),
           [{"step": k, "phase": "sft"} for k in range(1, 31)] + [_eval_line(30, 0.5 + s / 10)])
    _write(os.path.join(w, "eval_outputs", "step_000030.jsonl"), [{"id": "v0", "em": 1.0}])
    _evaluation(w, "test_start", EM["start"][s])
    for name in ("grpo_filter", "grpo_recycle", "hadw"):
      run = os.path.join(root, "rl", name, f"seed_{s}")
      _write(os.path.join(run, "metrics.jsonl"),
             _rl_lines(36) + [_eval_line(42, 0.6), _eval_line(54, 0.65), _eval_line(66, 0.7)])
      _write(os.path.join(run, "eval_outputs", "step_000042.jsonl"), [{"id": "v0", "em": 1.0}])
      _evaluation(run, "test_final", EM[name][s], reverse=(name == "hadw"))
  run = os.path.join(root, "rl", "stratified", "seed_0")
  _write(os.path.join(run, "metrics.jsonl"), _rl_lines(10)
         + ['{"step": 41, "phase": "rl", "pool/acc'], tail="")   # torn last line: tolerated
  _write(os.path.join(root, "commits.txt"), ["abc123", "abc123"])
  _write(os.path.join(root, "versions.jsonl"), [{"time": "t0", "python": "3.11"}])


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
  mod = _collect()
  root = tmp_path_factory.mktemp("engaged")
  _grid(str(root / "runs"))
  out = root / "out"
  os.makedirs(out)
  _write(str(out / "results.json"), [{"first_study": {"kept": True}}])
  assert mod.main(["--runs", str(root / "runs"), "--out", str(out), "--command", "x"]) == 0
  return mod, json.load(open(out / "results.json")), out


def _hand(name, ref, seeds=(0, 1), ids=range(8)):
  """f64[S, Q]: name's EM minus ref's, question by question (by index = by id)."""
  return np.array([[EM[name][s][i] - EM[ref][s][i] for i in ids] for s in seeds], float)


def test_paired_difference_and_intervals_match_a_hand_computation(collected):
  mod, whole, _ = collected
  res = whole["engaged"]
  assert whole["first_study"] == {"kept": True}          # other keys of results.json kept
  c = res["comparisons"]["grpo_recycle - grpo_filter"]
  d = _hand("grpo_recycle", "grpo_filter")
  per = d.mean(1)                                        # 2/8 and 1/8
  assert per.tolist() == [0.25, 0.125]
  assert c["n_warm_starts"] == 2 and c["warm_starts"] == [0, 1]
  assert c["per_warm_start"]["em"] == pytest.approx(per.tolist())
  assert c["em"] == pytest.approx(0.1875)
  # t-interval over the warm-starts' means, df = 1, at 95% and at 1 - 0.05/4
  half = lambda a: stats.t.ppf(1 - a / 2, 1) * per.std(ddof=1) / np.sqrt(2)
  assert c["t_interval"]["em"] == pytest.approx([0.1875 - half(0.05), 0.1875 + half(0.05)])
  assert c["t_interval_family"]["em"] == pytest.approx(
      [0.1875 - half(0.0125), 0.1875 + half(0.0125)])
  # the two-way bootstrap of the hand-built difference matrix, with the collector's generator
  first = mod.first
  boot = first.two_way_bootstrap(d, first.rng_for("paired", c["a"] + " - " + c["b"], "em"))
  assert c["ci95_em"] == pytest.approx(boot[1])
  fam = first.two_way_bootstrap(d, first.rng_for("family", c["a"] + " - " + c["b"], "em"),
                                first.BOOT, 0.0125)
  assert c["ci_family_em"] == pytest.approx(fam[1])
  # the verdict interval is the wider one: the t-interval with 2 warm-starts
  assert c["verdict_interval_family"]["em"] == c["t_interval_family"]["em"]
  assert c["verdict_interval"]["em"] == c["t_interval"]["em"]
  # 2-hop: questions 1, 3, 5, 7
  d2 = _hand("grpo_recycle", "grpo_filter", ids=(1, 3, 5, 7))
  assert c["per_warm_start"]["em_2hop"] == pytest.approx(d2.mean(1).tolist())
  assert c["em_2hop"] == pytest.approx(d2.mean())
  assert c["mde"]["mde_alpha_0.05"] == pytest.approx(0.0397, abs=1e-3)


def test_pairing_is_by_question_id_within_a_warm_start(collected):
  """hadw's rows equal grpo_recycle's question by question but are written in reverse order:
  paired by id, every difference is 0 and so is every interval; paired by row position (or
  with warm-starts crossed) they would not be."""
  _, whole, _ = collected
  c = whole["engaged"]["comparisons"]["hadw - grpo_recycle"]
  assert c["per_warm_start"]["em"] == [0.0, 0.0]
  assert c["ci95_em"] == [0.0, 0.0] and c["ci_family_em"] == [0.0, 0.0]
  assert c["t_interval"]["em"] == [0.0, 0.0]
  # [0, 0] excludes HA-DW's +0.022 (an interim verdict: 2 of 5 warm-starts)
  assert c["verdict"]["em"].endswith(
      "-> does not hold here: the interval excludes the paper's +0.022")


def test_missing_cells_are_reported_as_missing(collected):
  _, whole, _ = collected
  res = whole["engaged"]
  grid = res["grid"]
  assert grid["warm_start"]["0"] == "finished" and grid["warm_start"]["2"] == "not started"
  assert grid["grpo_recycle"]["1"] == "finished"
  assert grid["stratified"]["0"].startswith("running or stopped: RL step 10 of 36")
  assert grid["grpo"]["0"] == "not started" and grid["sft_matched"]["2"] == "not started"
  assert "stratified/seed_0 (running or stopped: RL step 10 of 36 logged, no test evaluation " \
         "yet)" in res["missing"]
  assert "grpo/seed_4 (not started)" in res["missing"]
  assert not any(m.startswith("grpo_recycle/seed_0") for m in res["missing"])
  # a comparison with no finished pair: no statistic, no verdict
  c = res["comparisons"]["grpo_filter - grpo"]
  assert c["n_warm_starts"] == 0 and "verdict" not in c and "em" not in c
  # the running run: its curve and mechanisms beside the finished ones, not in them
  strat = res["settings"]["stratified"]
  assert strat["seeds"] == [] and strat["test"] == {}
  assert strat["in_progress"][0]["seed"] == 0
  assert strat["in_progress"][0]["mechanisms"]["rl_steps"] == 10
  assert "grpo" not in res["settings"]
  # interim verdicts say how many warm-starts they rest on
  v = res["comparisons"]["grpo_recycle - grpo_filter"]["verdict"]["em"]
  assert v.startswith("(interim, 2 of 5 warm-starts)") and "greedy test EM minus greedy" in v


def test_one_warm_start_gives_no_verdict(tmp_path):
  """With n = 1 there is no t-interval over warm-starts, so the protocol's "wider of the two"
  does not exist: the sentence gives the figures and no verdict (the bootstrap alone, over
  questions, would read "does not hold" for hadw's 0 difference)."""
  mod = _collect()
  _grid(str(tmp_path / "runs"), seeds=(0,))
  os.makedirs(tmp_path / "out")
  assert mod.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"),
                   "--command", "x"]) == 0
  c = json.load(open(tmp_path / "out" / "results.json"))["engaged"]["comparisons"][
      "hadw - grpo_recycle"]
  assert c["n_warm_starts"] == 1 and c["verdict"]
  assert all("no verdict: one warm-start" in v and "does not hold" not in v and "->" not in v
             for v in c["verdict"].values()), c["verdict"]


def test_setting_blocks_mechanisms_and_outputs(collected):
  _, whole, out = collected
  res = whole["engaged"]
  e = res["settings"]["grpo_recycle"]
  assert [s["seed"] for s in e["seeds"]] == [0, 1]
  assert e["test"]["em"] == pytest.approx(np.mean(EM["grpo_recycle"][0] + EM["grpo_recycle"][1]))
  assert e["gain_vs_start"]["em"] == pytest.approx(_hand("grpo_recycle", "start").mean())
  curve = e["seeds"][0]["validation_curve"]
  assert [p["rl_step"] for p in curve] == [0, 12, 24, 36]
  assert curve[0]["em"] == 0.5 and curve[1]["rollouts"] == 12 * 64
  m = e["seeds"][0]["mechanisms"]
  # accepted-weighted: (2 x 0.5 + 0 x 0 + 2 x 1.0) / 4 = 0.75 (the plain mean would be 0.5)
  assert m["recycled_share_accepted"] == pytest.approx(0.75)
  assert m["recycled_share_accepted_last_third"] == pytest.approx(0.75)
  assert m["strata_per_group"] == pytest.approx(2.0)     # only the steps that trained a group
  assert m["pool_flips"] == 36.0 and m["active_pool_end"] == 164
  # greedy flips start -> end on warm-start 0: q1, q4, q7 wrong -> right, none right -> wrong
  assert m["test_flips"]["wrong_to_right"] == 3 and m["test_flips"]["right_to_wrong"] == 0
  assert m["test_flips"]["wrong_to_right_2hop"] == 2
  assert e["mechanisms"]["n_runs"] == 2
  assert res["commits"] == ["abc123"]
  assert res["versions"]["runs"][0]["starts"] == ["t0"]
  names = sorted(os.listdir(out / "outputs"))
  assert "warm_start_seed0_test_start.jsonl" in names
  assert "warm_start_seed1_validation.jsonl" in names
  assert "grpo_recycle_seed1_test_final.jsonl" in names
  assert "grpo_filter_seed0_validation_rl12.jsonl" in names
  row = json.loads(open(out / "outputs" / "hadw_seed0_test_final.jsonl").readline())
  assert set(row) == {"id", "hops", "prediction", "em", "f1", "searches", "queries",
                      "retrieved"}                       # the first study's schema
  assert (out / "curves.png").exists() and (out / "forest.png").exists()


def test_a_replaced_machine_loses_nothing_committed(collected, tmp_path):
  """runs/ gone (a new machine): warm-start 1 regenerated without its test evaluation (run.sh
  skips it, its rows being committed), every RL run of it gone, grpo_filter from warm-start 0
  gone too, warm-start 0 being remade (3 SFT steps logged); collected again into the committed
  out/, every figure is the same."""
  import shutil
  mod, whole, out = collected
  root = tmp_path / "runs"
  _grid(str(root))
  shutil.rmtree(root / "warm_start" / "seed_1" / "test_start")
  for name in ("grpo_filter", "grpo_recycle", "hadw"):
    shutil.rmtree(root / "rl" / name / "seed_1")
  shutil.rmtree(root / "rl" / "grpo_filter" / "seed_0")
  # warm-start 0 being remade (run.sh remakes it before its runs): 3 SFT steps logged so far
  shutil.rmtree(root / "warm_start" / "seed_0")
  os.makedirs(root / "warm_start" / "seed_0")
  (root / "warm_start" / "seed_0" / "metrics.jsonl").write_text(
      "".join(json.dumps({"phase": "sft", "step": i, "loss": 1.0}) + "\n" for i in (1, 2, 3)))
  os.remove(root / "commits.txt")
  again = tmp_path / "out"
  shutil.copytree(out, again)
  assert mod.main(["--runs", str(root), "--out", str(again), "--command", "x"]) == 0
  res, new = whole["engaged"], json.load(open(again / "results.json"))["engaged"]
  assert new["comparisons"] == res["comparisons"]
  assert new["settings"] == res["settings"] and new["warm_starts"] == res["warm_starts"]
  assert new["missing"] == res["missing"] and new["commits"] == ["abc123"]
  assert new["from_committed"] == ["warm_start/seed_0", "grpo_filter/seed_0",
                                   "grpo_filter/seed_1", "grpo_recycle/seed_1", "hadw/seed_1"]
  assert (again / "outputs" / "hadw_seed0_metrics.jsonl").exists()


def test_verdict_rules():
  mod = _collect()
  assert mod.verdict(-0.02, [-0.06, 0.02], 0.113).startswith(
      "does not hold here: the interval excludes the paper's +0.113")
  assert mod.verdict(0.0, [-0.03, 0.035], 0.022) == "cannot tell at this power"
  assert mod.verdict(0.0, [-0.03, 0.035], None) == "cannot tell at this power"
  assert mod.verdict(-0.05, [-0.09, -0.01], None).startswith("does not hold here")
  assert mod.verdict(0.05, [0.01, 0.09], 0.113) == "holds here; smaller than the paper's +0.113"
  # sign -1: the claim is b better than a (RL beats the control)
  assert mod.verdict(0.05, [0.01, 0.09], None, sign=-1).startswith("does not hold here")


def test_no_data_no_figures(tmp_path):
  mod = _collect()
  os.makedirs(tmp_path / "runs")
  os.makedirs(tmp_path / "out")
  assert mod.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
  res = json.load(open(tmp_path / "out" / "results.json"))["engaged"]
  assert res["warm_starts"] == [] and res["comparisons"] == {}
  assert len(res["missing"]) == 5 + 5 * 5 + 2 * 3
  assert not (tmp_path / "out" / "curves.png").exists()
  assert not (tmp_path / "out" / "forest.png").exists()


def test_user_errors_exit_2_with_one_line(tmp_path, capsys):
  mod = _collect()
  os.makedirs(tmp_path / "out")
  assert mod.main(["--runs", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "nope" in err and "Traceback" not in err
  runs = tmp_path / "runs"
  _grid(str(runs))
  bad = runs / "rl" / "grpo_filter" / "seed_1" / "metrics.jsonl"
  lines = open(bad).read().splitlines()
  lines[2] = '{"step": 33, "phase": "rl", '                # a malformed line, not the last
  _write(str(bad), lines)
  assert mod.main(["--runs", str(runs), "--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err
  assert f"{bad}: line 3: not valid JSON" in err


def test_sampled_flips_split_too_hard_and_too_easy(tmp_path):
  """The rollout samples (first candidate group every 5 steps): a question all wrong, then
  mixed, is a too-hard flip; all right, then mixed, too easy; mixed first is no flip."""
  mod = _collect()

  def sample(step, groups):
    text = f"# step {step}\n"
    for q, rewards in groups:
      for i, r in enumerate(rewards):
        text += (f"\n===== trajectory {i} | reward {r:.2f} | search calls 1\nquestion: {q}\n"
                 "gold: ['x']\n--- generated (observations inline) ---\n<answer> x </answer>\n")
    _write(str(tmp_path / "samples" / f"step_{step:06d}.txt"), [text], tail="")
  sample(35, [("A?", [0, 0, 0, 0])])
  sample(40, [("B?", [1, 1, 1, 1])])
  sample(45, [("A?", [1, 0, 0, 0])])
  sample(50, [("B?", [1, 0, 1, 1])])
  sample(55, [("C?", [1, 0, 1, 1])])
  sample(60, [("C?", [0, 0, 0, 0])])
  assert mod.sampled_flips(str(tmp_path)) == {"groups": 6, "questions_sampled_twice": 3,
                                              "too_hard": 1, "too_easy": 1}
