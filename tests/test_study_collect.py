"""docs/results/countries_smollm2_estimators/collect.py on a synthetic grid: the statistics
(two-way bootstrap, paired differences) and the results.json schema issue #39 names."""
import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "docs/results/countries_smollm2_estimators/collect.py")


def _collect():
  spec = importlib.util.spec_from_file_location("study_collect", PATH)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _write(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def _read(path):
  with open(path) as f:
    return [json.loads(l) for l in f]


def _eval_rows(em, hops):
  return [{"id": f"q{i}", "hops": int(h), "answers": ["x"], "em": [float(e)], "f1": [float(e)],
           "search_calls": [int(h)], "queries": [["q"] * int(h)], "retrieved": [[["p"]] * int(h)]}
          for i, (e, h) in enumerate(zip(em, hops))]


def _meta(run, step, rule, over, prompts=8):
  _write(os.path.join(run, "checkpoints", str(step), "meta", "metadata"), [])
  with open(os.path.join(run, "checkpoints", str(step), "meta", "metadata"), "w") as f:
    json.dump({"config": {"data": {"prompts_per_step": prompts, "group_size": 4,
                                   "pool": {"rule": rule, "oversample": over}}}}, f)


def _grid(root, q=60, seeds=(0, 1), gain=None):
  rng = np.random.default_rng(0)
  hops = np.array([1, 2] * (q // 2))
  gain = gain or {"grpo_recycle": 0.3, "grpo": 0.3, "gigpo": 0.1}
  line = lambda step, em: {"step": step, "phase": "eval", "eval/em": em, "eval/em/hops=1": em,
                           "eval/em/hops=2": em}
  for s in seeds:
    w = os.path.join(root, "warm_start", f"seed_{s}")
    _write(os.path.join(w, "metrics.jsonl"), [line(30, 0.4)])
    start = rng.random(q) < 0.4
    _write(os.path.join(w, "test_start", "samples_test.jsonl"), _eval_rows(start, hops))
    _write(os.path.join(w, "closed_book", "samples_test.jsonl"), _eval_rows(0 * start, hops))
    for name, g in gain.items():
      run = os.path.join(root, "rl", name, f"seed_{s}")
      final = start | (np.random.default_rng(s).random(q) < g)   # same draw: paired
      _write(os.path.join(run, "test_final", "samples_test.jsonl"), _eval_rows(final, hops))
      _write(os.path.join(run, "metrics.jsonl"),
             [line(30, 0.4)] + [{"step": 30 + i, "phase": "rl", "zero_variance_frac": 0.5,
                                 "pool/recycled_frac": 0.75} for i in range(1, 21)]
             + [line(50, 0.5)])
      _meta(run, 50, "grpo" if name == "grpo" else "recycle", 2)
  return hops


def _collected(mod, root, **grid):
  """Builds a synthetic grid under ``root``, runs collect.py on it: (results.json, out dir)."""
  _grid(root / "runs", **grid)
  out = root / "out"
  os.makedirs(out)
  assert mod.main(["--runs", str(root / "runs"), "--out", str(out), "--command", "x"]) == 0
  return json.load(open(out / "results.json")), out


def test_collect_schema_and_paired_statistics(tmp_path):
  mod = _collect()
  res, out = _collected(mod, tmp_path)
  assert res["test_questions"] == 60 and len(res["warm_starts"]) == 2
  assert res["closed_book_test"]["em"] == 0.0
  for name in ("grpo", "gigpo"):
    e = res["settings"][name]
    t = e["test"]
    assert t["n_warm_starts"] == 2
    for key in ("em", "em_1hop", "em_2hop"):
      lo, hi = t["ci95"][key]
      assert lo <= t[key] <= hi
    assert {"em_2hop", "ci95"} <= set(e["paired_vs_grpo_recycle"])
    assert e["seeds"][0]["final"].keys() >= {"em", "em_1hop", "em_2hop"}
  # grpo's finals equal grpo_recycle's question by question: the paired difference is exactly 0
  pr = res["settings"]["grpo"]["paired_vs_grpo_recycle"]
  assert pr["em_2hop"] == 0.0 and pr["ci95"] == [0.0, 0.0]
  # gigpo gains less on the same questions: a negative paired difference
  assert res["settings"]["gigpo"]["paired_vs_grpo_recycle"]["em"] < 0
  # rollouts per step: recycling rolls out 2 x 8 prompts x 4, plain GRPO 8 x 4
  assert res["settings"]["grpo_recycle"]["seeds"][0]["rollouts_per_step"] == 64
  assert res["settings"]["grpo"]["seeds"][0]["rollouts_per_step"] == 32
  assert res["settings"]["grpo"]["mechanisms"]["recycled_frac"] == pytest.approx(0.75)
  assert "rft/seed_0" in res["missing"]
  # gain over the start on the same questions: finals are start | extra, so never below it
  gain = res["settings"]["gigpo"]["gain_vs_start"]
  assert gain["em"] > 0 and gain["ci95_em"][0] >= 0
  for f in ("results.md", "curves.png", "forest.png", "outputs/grpo_seed1_test_final.jsonl"):
    assert os.path.exists(out / f), f


def test_results_md_tables_per_warm_start_and_mechanisms(tmp_path):
  """results.md: each run's final test EM (2-hop) by warm-start, and the mechanisms table with
  validation EM at RL steps 15 and 20 ("–" where a run has no evaluation at that step)."""
  mod = _collect()
  res, out = _collected(mod, tmp_path)
  md = open(out / "results.md").read().splitlines()
  f = {r["seed"]: r["final"] for r in res["settings"]["gigpo"]["seeds"]}
  want = (f"| gigpo | {f[0]['em']:.3f} ({f[0]['em_2hop']:.3f}) | "
          f"{f[1]['em']:.3f} ({f[1]['em_2hop']:.3f}) |")
  assert want in md
  w = res["warm_starts"][0]["test_start"]
  assert any(l.startswith(f"| start | {w['em']:.3f} ({w['em_2hop']:.3f}) |") for l in md)
  # the paired reading over the first n warm-starts: n = 2 is the full paired difference
  first = res["settings"]["gigpo"]["paired_first_warm_starts"]
  pr = res["settings"]["gigpo"]["paired_vs_grpo_recycle"]
  assert [x["n_warm_starts"] for x in first] == [1, 2]
  assert first[1]["em"] == pytest.approx(pr["em"]) and first[1]["ci95_em"] == pr["ci95_em"]
  d0 = np.mean([a["em"][0] - b["em"][0] for a, b in zip(
      *(_read(tmp_path / "runs" / "rl" / n / "seed_0" / "test_final" / "samples_test.jsonl")
        for n in ("gigpo", "grpo_recycle")))])
  assert first[0]["em"] == pytest.approx(d0)
  assert any(l.startswith(f"| gigpo | {first[0]['em']:+.3f} ") for l in md)
  row = next(l for l in md if l.startswith("| grpo | 0.50 | 0.75 (0.75) |"))
  assert row.endswith("| – → 0.500 |")


def test_an_interval_does_not_move_when_another_run_lands(tmp_path):
  """Each interval draws from its own generator: adding a setting to the grid leaves gigpo's."""
  mod = _collect()

  def gigpo(gain):
    return _collected(mod, tmp_path / str(len(gain)), gain=gain)[0]["settings"]["gigpo"]

  a = gigpo({"grpo_recycle": 0.3, "gigpo": 0.1})
  b = gigpo({"grpo_recycle": 0.3, "grpo": 0.2, "gigpo": 0.1, "stratified": 0.2})
  assert a["test"] == b["test"] and a["paired_vs_grpo_recycle"] == b["paired_vs_grpo_recycle"]
  assert a["paired_vs_grpo_recycle"]["ci95"][0] < a["paired_vs_grpo_recycle"]["ci95"][1]


def test_two_way_bootstrap_widens_with_warm_start_spread():
  mod = _collect()
  rng = np.random.default_rng(0)
  q = rng.random((1, 200)) < 0.5
  same = np.repeat(q, 3, axis=0).astype(float)
  spread = same.copy()
  spread[0] = 0.0                              # one warm-start far from the others
  _, ci_same = mod.two_way_bootstrap(same, np.random.default_rng(1))
  _, ci_spread = mod.two_way_bootstrap(spread, np.random.default_rng(1))
  assert ci_spread[1] - ci_spread[0] > ci_same[1] - ci_same[0]


def test_family_wise_interval_is_the_bonferroni_percentile_interval(tmp_path):
  """ci_family_*: the 1 - 0.05/FAMILY percentile interval of the same two-way bootstrap. It
  holds the 95% interval and, on a known matrix, matches the percentiles of that level."""
  mod = _collect()
  rng = np.random.default_rng(0)
  d = (rng.random((3, 300)) < 0.5).astype(float) - (rng.random((3, 300)) < 0.45)
  _, ci95 = mod.two_way_bootstrap(d, np.random.default_rng(1), 40000)
  _, fam = mod.two_way_bootstrap(d, np.random.default_rng(1), 40000, 0.05 / mod.FAMILY)
  assert fam[0] < ci95[0] < ci95[1] < fam[1]
  s, q = d.shape
  r = np.random.default_rng(1)
  ws = r.multinomial(s, np.full(s, 1 / s), size=40000)
  wq = r.multinomial(q, np.full(q, 1 / q), size=40000)
  reps = (ws @ d * wq).sum(1) / (s * q)
  a = 0.05 / mod.FAMILY
  assert np.allclose(fam, np.quantile(reps, [a / 2, 1 - a / 2]))
  res, out = _collected(mod, tmp_path, gain={"grpo_recycle": 0.3, "gigpo": 0.1})
  pr = res["settings"]["gigpo"]["paired_vs_grpo_recycle"]
  for key, ci in (("em", "ci95_em"), ("em_2hop", "ci95")):
    assert pr[f"ci_family_{key}"][0] <= pr[ci][0] and pr[ci][1] <= pr[f"ci_family_{key}"][1]
  assert "Bonferroni" in open(out / "results.md").read()


def test_continued_sft_generates_no_rollouts():
  """The continued-SFT control (no RL step) is left off the curves' rollouts axis: its config
  still holds the recipe's data section (recycling, 64 rollouts a step), but it generates none."""
  mod = _collect()
  data = {"prompts_per_step": 8, "group_size": 4, "pool": {"rule": "recycle", "oversample": 2}}
  assert mod.rollouts_per_step({"data": data, "train": {"num_steps": 20}}) == 64
  assert mod.rollouts_per_step({"data": data, "train": {"num_steps": 0}}) == 0


def _sampled(correct):
  """gigrl-eval sampled rows of 2-hop questions q1, q3, ...: `correct[i]` of 8 samples right."""
  return [{"id": f"q{2 * i + 1}", "hops": 2, "answers": ["x"] * 8, "f1": [0.0] * 8,
           "em": [1.0] * c + [0.0] * (8 - c), "search_calls": [2] * 8}
          for i, c in enumerate(correct)]


def _passk(root, seed, start, final):
  """pass@k evaluations of warm-start `seed` and of grpo_recycle from it (`start`, `final`:
  samples right per question), as run.sh leaves them."""
  for d, correct in ((root / "warm_start" / f"seed_{seed}" / "passk_start", start),
                     (root / "rl" / "grpo_recycle" / f"seed_{seed}" / "passk_final", final)):
    _write(str(d / "samples_test_2hop.jsonl"), _sampled(correct))
    with open(d / "results.json", "w") as f:
      json.dump({"datasets": {"test_2hop": {"eval/pass@1": 0.0}}}, f)


def test_pass_at_k_start_and_end_are_paired_per_question(tmp_path):
  """pass_at_k_2hop: each question's unbiased pass@k from its 8 samples (Chen et al. eq. 1), at
  the warm-start and at the end of grpo_recycle, and their paired difference."""
  mod = _collect()
  root = tmp_path / "runs"
  _grid(root, q=8, seeds=(0,), gain={"grpo_recycle": 0.3})
  _passk(root, 0, [0, 1, 4, 8], [1, 1, 8, 8])
  out = tmp_path / "out"
  os.makedirs(out)
  assert mod.main(["--runs", str(root), "--out", str(out), "--command", "x"]) == 0
  pk = json.load(open(out / "results.json"))["pass_at_k_2hop"]
  assert pk["questions"] == 4 and pk["samples"] == 8
  # pass@1 = c / 8 per question; pass@8 = 1 when any sample is right
  assert pk["start"]["1"] == pytest.approx((0 + 1 + 4 + 8) / 32)
  assert pk["final"]["1"] == pytest.approx((1 + 1 + 8 + 8) / 32)
  assert pk["start"]["8"] == pytest.approx(0.75) and pk["final"]["8"] == pytest.approx(1.0)
  # pass@4 of 1 right in 8: 1 - C(7,4)/C(8,4) = 0.5
  assert pk["start"]["4"] == pytest.approx((0 + 0.5 + 1 - 1 / 70 + 1) / 4)
  assert pk["diff"]["8"] == pytest.approx(0.25)
  lo, hi = pk["ci95"]["8"]
  assert lo <= 0.25 <= hi
  assert "pass@k on the 4 2-hop test questions" in open(out / "results.md").read()
  assert 0.0 <= pk["greedy_final_em_2hop"] <= 1.0


def test_pass_at_k_rebuilt_from_outputs_after_the_runs_are_lost(tmp_path):
  """--pass-at-k-only: with the runs directory gone but outputs/ kept, a pass@k evaluation run
  again for one warm-start joins the others; the block equals a full collect of the whole grid,
  each seed's pass@k is its rows' mean, and no other figure moves."""
  mod = _collect()
  # the grid, collected before seed 1's pass@k: seed 0's alone
  root = tmp_path / "lost"
  _grid(root / "runs", q=8, gain={"grpo_recycle": 0.3})
  _passk(root / "runs", 0, [0, 1, 4, 8], [1, 1, 8, 8])
  out = root / "out"
  os.makedirs(out)
  assert mod.main(["--runs", str(root / "runs"), "--out", str(out), "--command", "x"]) == 0
  before = json.load(open(out / "results.json"))
  assert before["pass_at_k_2hop"]["n_warm_starts"] == 1
  # the runs are lost; seed 1's pass@k is run again into a fresh runs directory
  shutil.rmtree(root / "runs")
  _passk(root / "again", 1, [2, 0, 8, 3], [8, 1, 8, 5])
  assert mod.main(["--pass-at-k-only", "--runs", str(root / "again"), "--out", str(out)]) == 0
  after = json.load(open(out / "results.json"))
  # the same grid with both pass@k evaluations in place from the start
  _grid(tmp_path / "full", q=8, gain={"grpo_recycle": 0.3})
  _passk(tmp_path / "full", 0, [0, 1, 4, 8], [1, 1, 8, 8])
  _passk(tmp_path / "full", 1, [2, 0, 8, 3], [8, 1, 8, 5])
  os.makedirs(tmp_path / "full_out")
  assert mod.main(["--runs", str(tmp_path / "full"), "--out", str(tmp_path / "full_out"),
                   "--command", "x"]) == 0
  full = json.load(open(tmp_path / "full_out" / "results.json"))
  assert after["pass_at_k_2hop"] == full["pass_at_k_2hop"]
  assert after["pass_at_k_2hop"]["n_warm_starts"] == 2
  assert after["warm_starts"][1]["pass_at_k_2hop_start"]["8"] == pytest.approx(0.75)
  assert after["settings"]["grpo_recycle"]["seeds"][1]["pass_at_k_2hop_final"]["1"] == (
      pytest.approx((8 + 1 + 8 + 5) / 32))
  assert os.path.exists(out / "outputs" / "warm_start_seed1_passk_start.jsonl")
  for key in ("settings", "controls", "warm_starts_test", "closed_book_test", "missing"):
    if key == "settings":
      for e in (before, after):
        for seed in e[key]["grpo_recycle"]["seeds"]:
          seed.pop("pass_at_k_2hop_final", None)
    assert after[key] == before[key], key
  assert "n = 2 warm-start(s)" in open(out / "results.md").read()
  assert mod.main(["--pass-at-k-only", "--runs", str(root), "--out", str(tmp_path)]) == 2


# Student t quantile with 2 degrees of freedom in closed form: t_p = (2p - 1) / sqrt(2p(1 - p))
T975_DF2 = 0.95 / np.sqrt(2 * 0.975 * 0.025)          # 4.3027


def test_t_interval_over_warm_starts_is_the_hand_computed_one(tmp_path):
  """Issue #51: the t-interval over the warm-starts' means, beside the bootstrap: per warm-start
  the mean over questions of setting minus grpo_recycle, then mean ± t_{0.975, n-1} · sd / √n
  (sd with n - 1), checked against a hand computation; the verdict interval is the wider."""
  mod = _collect()
  # the helper on three numbers: mean 0.3, sd = sqrt(0.07)
  lo, hi = mod.t_interval([0.1, 0.2, 0.6])
  half = T975_DF2 * np.sqrt(0.07) / np.sqrt(3)
  assert (lo, hi) == (pytest.approx(0.3 - half), pytest.approx(0.3 + half))
  assert mod.t_interval([0.4]) is None
  assert mod.wider([-1.0, 1.0], [-0.5, 0.5]) == [-1.0, 1.0]
  assert mod.wider([-0.5, 0.5], [-0.4, 0.9]) == [-0.4, 0.9]
  # on a grid of 3 warm-starts, from the rows the runs wrote
  res, out = _collected(mod, tmp_path, seeds=(0, 1, 2),
                        gain={"grpo_recycle": 0.3, "gigpo": 0.1})
  pr = res["settings"]["gigpo"]["paired_vs_grpo_recycle"]
  runs = tmp_path / "runs" / "rl"
  hops = np.array([1, 2] * 30)
  for key, sel in (("em", hops > 0), ("em_1hop", hops == 1), ("em_2hop", hops == 2)):
    d = []
    for s in (0, 1, 2):
      a, b = (np.array([r["em"][0] for r in _read(runs / n / f"seed_{s}" / "test_final" /
                                                   "samples_test.jsonl")])
              for n in ("gigpo", "grpo_recycle"))
      d.append((a - b)[sel].mean())
    assert pr["per_warm_start"][key] == pytest.approx(d)
    m, sd = np.mean(d), np.sqrt(sum((x - np.mean(d)) ** 2 for x in d) / 2)
    assert sd > 0
    assert pr["t_interval"][key] == pytest.approx([m - T975_DF2 * sd / np.sqrt(3),
                                                   m + T975_DF2 * sd / np.sqrt(3)])
    boot = pr["ci95" if key == "em_2hop" else f"ci95_{key}"]
    t = pr["t_interval"][key]
    assert pr["verdict_interval"][key] == (t if t[1] - t[0] > boot[1] - boot[0] else boot)
  # the gain over the start and pass@k carry one too; results.md shows both intervals
  assert len(res["settings"]["gigpo"]["gain_vs_start"]["t_interval"]["em"]) == 2
  md = open(out / "results.md").read()
  lo, hi = pr["t_interval"]["em"]
  assert f"{pr['em']:+.3f} " in md and f"[{lo:+.3f}, {hi:+.3f}]" in md
  assert "Student t with n − 1 degrees of freedom" in md


def test_from_outputs_rebuilds_the_test_figures_of_a_full_collect(tmp_path):
  """--from-outputs: with the runs directory gone, every figure resting on the test rows (test
  EM, paired differences with both intervals, gains, pass@k) is rebuilt from outputs/ into the
  results.json a collect made before the t-interval existed, and equals a full collect's."""
  mod = _collect()
  root = tmp_path / "g"
  _grid(root / "runs", q=8, seeds=(0, 1, 2), gain={"grpo_recycle": 0.3, "gigpo": 0.1})
  _passk(root / "runs", 0, [0, 1, 4, 8], [1, 1, 8, 8])
  _passk(root / "runs", 1, [2, 0, 8, 3], [8, 1, 8, 5])
  out = root / "out"
  os.makedirs(out)
  assert mod.main(["--runs", str(root / "runs"), "--out", str(out), "--command", "x"]) == 0
  full = json.load(open(out / "results.json"))
  # the results.json of before: no t-intervals anywhere
  old = json.loads(json.dumps(full))
  for e in old["settings"].values():
    for block in (e["paired_vs_grpo_recycle"], e["gain_vs_start"]):
      for k in ("warm_starts", "per_warm_start", "t_interval", "verdict_interval"):
        block.pop(k, None)
  for k in ("per_warm_start", "t_interval", "verdict_interval"):
    old["pass_at_k_2hop"].pop(k)
  with open(out / "results.json", "w") as f:
    json.dump(old, f)
  shutil.rmtree(root / "runs")
  assert mod.main(["--from-outputs", "--runs", str(root / "runs"), "--out", str(out)]) == 0
  new = json.load(open(out / "results.json"))
  # each seed's own pass@k: a full collect copies gigrl-eval's figure (this fake writes 0.0),
  # a rebuild computes it from the rows (as --pass-at-k-only does)
  for r in (full, new):
    for e in r["warm_starts"] + r["settings"]["grpo_recycle"]["seeds"]:
      e.pop("pass_at_k_2hop_start", None), e.pop("pass_at_k_2hop_final", None)
  assert new == full
  assert mod.main(["--from-outputs", "--runs", str(root), "--out", str(tmp_path)]) == 2


def test_versions_are_recorded(tmp_path, capsys):
  """results.json's versions: the ones run.sh recorded at each start (collect.py
  --print-versions >> RUNS/versions.jsonl), grouped, and the collecting environment's."""
  mod = _collect()
  assert mod.main(["--print-versions"]) == 0
  line = json.loads(capsys.readouterr().out)
  assert {"time", "commit", "python", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
          "numpy"} <= set(line)
  import jax
  assert line["jax"] == jax.__version__
  _grid(tmp_path / "runs", q=8)
  other = dict(line, time="2000-01-01T00:00:00Z", jax="0.0.1")
  _write(str(tmp_path / "runs" / "versions.jsonl"),
         [line, other, dict(line, time="2100-01-01T00:00:00Z")])
  os.makedirs(tmp_path / "out")
  assert mod.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"),
                   "--command", "x"]) == 0
  v = json.load(open(tmp_path / "out" / "results.json"))["versions"]
  assert [g["versions"]["jax"] for g in v["runs"]] == ["0.0.1", jax.__version__]
  assert v["runs"][1]["starts"] == [line["time"], "2100-01-01T00:00:00Z"]
  assert v["collect"]["numpy"] == np.__version__


def test_recycling_at_matched_rollouts_pairs_the_validation_rows(tmp_path):
  """recycling_at_matched_rollouts: grpo at the RL step where it has generated as many rollouts
  as grpo_recycle (32 a step against 64: step 20 against step 10), minus grpo_recycle, per
  question and warm-start on validation, with the t-interval over warm-starts."""
  mod = _collect()
  curve = lambda per_step: [{"rl_step": r, "rollouts": r * per_step} for r in (0, 5, 10, 15, 20)]
  results = {"settings": {n: {"seeds": [{"seed": s, "validation_curve": curve(k)}
                                         for s in (0, 1, 2)]}
                          for n, k in (("grpo_recycle", 64), ("grpo", 32))}, "controls": {}}
  rng = np.random.default_rng(0)
  want = []
  for s in (0, 1, 2):
    a, b = rng.random(40) < 0.7, rng.random(40) < 0.6
    want.append(a.mean() - b.mean())
    for name, step, em in (("grpo", 20, a), ("grpo_recycle", 10, b), ("grpo_recycle", 20, ~b)):
      _write(str(tmp_path / f"{name}_seed{s}_validation_rl{step:02d}.jsonl"),
             [{"id": f"v{i}", "hops": 1 + i % 2, "em": float(e)} for i, e in enumerate(em)])
  mr = mod.matched_rollouts_block(results, str(tmp_path))
  assert (mr["rollouts"], mr["rl_step"], mr["rl_step_grpo_recycle"]) == (640, 20, 10)
  assert mr["per_warm_start"]["em"] == pytest.approx(want)
  m, sd = np.mean(want), np.std(want, ddof=1)
  assert mr["t_interval"]["em"] == pytest.approx([m - T975_DF2 * sd / np.sqrt(3),
                                                  m + T975_DF2 * sd / np.sqrt(3)])
  assert mr["em"] == pytest.approx(m)
