"""docs/results/async/collect.py (issue #52's learning comparison) on a tiny synthetic set of runs:
the paired differences against a hand computation, the verdicts, the mechanisms, a missing k, and
the one-line exit-2 error (CPU, no jax)."""
import importlib.util
import json
import os

import numpy as np
from scipy import stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "docs/results/async/collect.py")
HOPS = [1, 2, 1, 2, 1, 2]
EM = {0: {0: [1, 0, 1, 0, 1, 1], 1: [1, 1, 0, 0, 1, 0], 2: [0, 0, 1, 1, 1, 0]},
      1: {0: [1, 0, 0, 0, 1, 1], 1: [0, 1, 0, 0, 1, 0], 2: [0, 0, 1, 0, 1, 0]}}


def _collect():
  spec = importlib.util.spec_from_file_location("async_collect", PATH)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _write(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _run(d, em, k):
  rows = [{"id": f"v{i}", "hops": h, "prediction": "x", "em": float(e), "f1": float(e),
           "searches": h} for i, (e, h) in enumerate(zip(em, HOPS))]
  _write(os.path.join(d, "eval_outputs", "step_000066.jsonl"), rows[::-1])
  _write(os.path.join(d, "eval.json"), [{"step": 66}])
  rl = [{"step": 30 + i, "phase": "rl", "async/staleness_mean": float(min(k, i - 1)),
         "async/staleness_max": float(min(k, i - 1)), "is_ratio_max": 1.0 + 0.1 * i,
         "is_ratio_mean": 1.0, "pool/accepted": 2.0, "pool/recycled_frac": 0.5}
        for i in range(1, 37)]
  ev = [{"step": s, "phase": "eval", "eval/em": float(np.mean(em)), "eval/em/hops=1": 0.5,
         "eval/em/hops=2": 0.5} for s in (42, 54, 66)]
  _write(os.path.join(d, "metrics.jsonl"), rl + ev)


def test_the_learning_comparison_pairs_k_with_k0_per_question(tmp_path):
  mod = _collect()
  runs = tmp_path / "runs"
  for s in range(3):
    _write(str(runs / "warm_start" / f"seed_{s}" / "metrics.jsonl"),
           [{"step": 30, "phase": "eval", "eval/em": 0.5, "eval/em/hops=1": 0.5,
             "eval/em/hops=2": 0.5}])
    for k in (0, 1):
      _run(mod.run_dir(str(runs), k, s), EM[k][s], k)
  out = tmp_path / "out"
  assert mod.main(["--runs", str(runs), "--out", str(out)]) == 0
  got = json.loads((out / "results.json").read_text())["learning"]
  k1, k2 = got["comparisons"]
  d = np.array([np.subtract(EM[1][s], EM[0][s]) for s in range(3)], float)
  assert k1["n_warm_starts"] == 3 and abs(k1["em"] - d.mean()) < 1e-12
  per = d.mean(1)
  half = stats.t.ppf(0.975, 2) * per.std(ddof=1) / np.sqrt(3)
  np.testing.assert_allclose(k1["t_interval"]["em"], [per.mean() - half, per.mean() + half])
  two = [i for i, h in enumerate(HOPS) if h == 2]
  assert abs(k1["em_2hop"] - d[:, two].mean()) < 1e-12
  iv = k1["verdict_interval"]["em"]
  assert k1["verdict"]["em"] == mod.verdict(iv)
  assert k2["n_warm_starts"] == 0 and "em" not in k2            # no k = 2 run yet
  m = got["mechanisms"]["k1"]
  assert m["staleness_max"] == 1 and m["n_runs"] == 3 and abs(m["is_ratio_max"] - 4.6) < 1e-9
  assert got["mechanisms"]["k0"]["staleness_max"] == 0
  assert [p["rl_step"] for p in got["curves"]["k1"]] == [0, 12, 24, 36]
  assert (out / "outputs" / "k1_seed2.jsonl").exists() and (out / "learning.png").exists()
  assert got["status"].startswith("6 of 9 runs finished")
  # A replaced machine: the k = 0 runs' directories are gone, and the warm-starts' (being
  # remade); collected again into the same out/, the k = 0 runs are rebuilt from the committed
  # results.json and rows, the curves keep their step 0, and every figure stays.
  import shutil
  for s in range(3):
    shutil.rmtree(mod.run_dir(str(runs), 0, s))
    shutil.rmtree(runs / "warm_start" / f"seed_{s}")
  assert mod.main(["--runs", str(runs), "--out", str(out)]) == 0
  again = json.loads((out / "results.json").read_text())["learning"]
  assert again["comparisons"] == got["comparisons"] and again["curves"] == got["curves"]
  assert again["mechanisms"] == got["mechanisms"] and again["status"] == got["status"]
  assert all(again["runs"]["k0"][str(s)].pop("from_committed") for s in range(3))
  assert again["runs"] == got["runs"]


def test_one_warm_start_gives_no_verdict(tmp_path):
  """k = 1 and k = 0 from warm-start 0 only: no t-interval over warm-starts, so no verdict (the
  question bootstrap alone would leave out warm-start variance)."""
  mod = _collect()
  runs = tmp_path / "runs"
  for k in (0, 1):
    _run(mod.run_dir(str(runs), k, 0), EM[k][0], k)
  assert mod.main(["--runs", str(runs), "--out", str(tmp_path / "out")]) == 0
  k1 = json.loads((tmp_path / "out" / "results.json").read_text())["learning"]["comparisons"][0]
  assert k1["n_warm_starts"] == 1 and k1["t_interval"]["em"] is None
  assert set(k1["verdict"].values()) == {mod.NO_VERDICT}


def test_verdicts_read_the_interval():
  mod = _collect()
  assert mod.verdict([-0.2, -0.01]) == "costs EM here"
  assert mod.verdict([0.01, 0.2]) == "gains EM here"
  assert mod.verdict([-0.05, 0.02]).startswith("cannot tell at this power (a cost of up to 0.050")


def test_a_line_that_is_not_json_exits_2_naming_the_file_and_line(tmp_path, capsys):
  mod = _collect()
  runs = tmp_path / "runs"
  d = mod.run_dir(str(runs), 1, 0)
  _write(os.path.join(d, "metrics.jsonl"), ['{"step": 31, "phase": "rl"}', "{oops", "{}"])
  assert mod.main(["--runs", str(runs), "--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "metrics.jsonl: line 2" in err[0]
  assert mod.main(["--runs", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
