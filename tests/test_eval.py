"""gigrl.training.evaluate's metrics: SQuAD F1, the breakdowns (subsets, hops, search-call strata) add up
to the totals, pass@k, the spread selection of held-out questions."""
import json
import random

import pytest

from gigrl.training import evaluate
from gigrl.data.qa import Question
from gigrl.rollout import trajectory as traj_lib


def _result(em, calls, source="a", hops=None, answered=True, invalid=0, f1=None):
  return evaluate.EvalResult(
      question="q", golden_answers=("x",), data_source=source,
      answer="x" if answered else None, em=float(em), search_calls=calls,
      invalid_actions=invalid, text="", f1=float(em if f1 is None else f1), hops=hops)


def test_f1_squad():
  assert evaluate.f1_score(None, ["Paris"]) == 0.0
  assert evaluate.f1_score("The Paris", ["paris"]) == 1.0
  # pred: {new, york, city}, gold {new, york}: p = 2/3, r = 1 -> 0.8
  assert evaluate.f1_score("New York City", ["Boston", "new york"]) == pytest.approx(0.8)
  assert evaluate.f1_score("Lima", ["Cusco"]) == 0.0
  assert evaluate.f1_score("a", ["the"]) == 0.0            # both normalise to no tokens


@pytest.mark.parametrize("seed", range(5))
def test_breakdowns_add_up_to_the_totals(seed):
  rng = random.Random(seed)
  results = [_result(rng.random() < 0.4, rng.choice([0, 1, 1, 2, 3]),
                     source=rng.choice(["countries", "hotpotqa", "nq"]),
                     hops=rng.choice([1, 2, None]), f1=rng.random())
             for _ in range(rng.randint(1, 60))]
  m = evaluate.aggregate(results)
  assert m["eval/n"] == len(results)
  for key, prefix in (("em", "eval/em/"), ("f1", "eval/f1/"),
                      ("search_calls_mean", "eval/search_calls_mean/")):
    for kind in ("calls=", "hops=", "source"):
      if key != "em" and kind == "calls=":
        continue
      names = [k[len(prefix):] for k in m if k.startswith(prefix)]
      if kind == "source":
        names = [s for s in names if "=" not in s]
      else:
        names = [s for s in names if s.startswith(kind)]
      total_share = sum(m[f"eval/share/{s}"] for s in names)
      weighted = sum(m[f"eval/share/{s}"] * m[prefix + s] for s in names)
      if kind == "hops=":   # questions without hops are in no hops subset
        with_hops = [r for r in results if r.hops is not None]
        assert total_share == pytest.approx(len(with_hops) / len(results))
        if with_hops:
          want = sum(getattr(r, "em" if key == "em" else key if key == "f1" else "search_calls")
                     for r in with_hops) / len(results)
          assert weighted == pytest.approx(want)
      else:
        assert total_share == pytest.approx(1.0), (kind, names)
        assert weighted == pytest.approx(m[f"eval/{key}"]), (key, kind)


def test_aggregate_values():
  rs = [_result(1, 1, "geo", hops=1), _result(0, 2, "geo", hops=2, invalid=1),
        _result(0, 0, "lit", answered=False), _result(1, 1, "lit", hops=1)]
  m = evaluate.aggregate(rs)
  assert m["eval/em"] == 0.5 and m["eval/answered_frac"] == 0.75
  assert m["eval/invalid_frac"] == 0.25 and m["eval/search_calls_mean"] == 1.0
  assert m["eval/em/calls=1"] == 1.0 and m["eval/share/calls=1"] == 0.5
  assert m["eval/em/calls=0"] == 0.0 and m["eval/share/calls=2"] == 0.25
  assert m["eval/em/hops=1"] == 1.0 and m["eval/search_calls_mean/hops=2"] == 2.0
  assert m["eval/share/hops=1"] == 0.5 and "eval/em/hops=None" not in m
  assert m["eval/em/geo"] == 0.5 and m["eval/share/lit"] == 0.5
  assert evaluate.aggregate([]) == {}


class _Engine:
  """Answers each question with the text after 'say ' in it, searching `calls` times."""

  def run(self, params, questions, key):
    builders = []
    for q in questions:
      tb = traj_lib.TrajectoryBuilder()
      tb.add_prompt([1], anchor=q)
      calls = q.count("?")
      for _ in range(calls):
        tb.add_generation([2], "<search> x </search>")
      tb.add_generation([3], f"<answer> {q.split('say ')[-1].rstrip('?')} </answer>")
      tb.search_calls = calls
      builders.append(tb)
    return traj_lib.collate(builders, 16, 0), {}


def test_evaluate_hops_from_file(tmp_path):
  qs = [Question("1", "say Lima?", ("Lima",), "countries"),
        Question("2", "say Quito??", ("Lima",), "countries")]
  path = tmp_path / "q.jsonl"
  path.write_text(json.dumps({"question": "Say lima?", "golden_answers": ["Lima"], "hops": 1})
                  + "\n" + json.dumps({"question": "say Quito??", "golden_answers": ["x"],
                                       "hops": 2}) + "\nnot json\n")
  hops = evaluate.question_hops([str(path)])
  results, m, _ = evaluate.evaluate(_Engine(), None, qs, hops=hops)
  assert [r.hops for r in results] == [1, 2]
  assert [r.em for r in results] == [1.0, 0.0]
  assert m["eval/em/hops=1"] == 1.0 and m["eval/em/hops=2"] == 0.0
  assert m["eval/search_calls_mean/hops=2"] == 2.0 and m["eval/f1"] == 0.5


def test_pass_at_k():
  assert evaluate.pass_at_k(4, 0, 2) == 0.0
  assert evaluate.pass_at_k(4, 4, 1) == 1.0
  assert evaluate.pass_at_k(4, 1, 1) == pytest.approx(0.25)
  assert evaluate.pass_at_k(4, 1, 2) == pytest.approx(0.5)    # 1 - C(3,2)/C(4,2)
  assert evaluate.pass_at_k(4, 3, 2) == 1.0
  with pytest.raises(ValueError):
    evaluate.pass_at_k(2, 1, 3)


def test_select_spreads_over_the_list():
  qs = list(range(10))
  assert evaluate.select(qs, 0) == qs and evaluate.select(qs, 20) == qs
  assert evaluate.select(qs, 2) == [0, 9]
  sel = evaluate.select(["a"] * 50 + ["b"] * 50, 10)
  assert len(sel) == 10 and sel.count("b") == 5


# ------------------------------------------------------------------ per-question rows (#39)
def test_question_rows_name_each_search_and_its_passages():
  """One row per question: id, hops, prediction, EM, searches, and the passage ids of each
  search aligned with its query ([] for a search the turn limit left unexecuted)."""
  from gigrl.search import base  # pylint: disable=g-import-not-at-top

  class Fixed:
    def search(self, queries, topk):
      return [[base.Passage(f"{q}-{i}", "", 0.0) for i in range(topk)] for q in queries]

  log = evaluate.RetrievalLog(Fixed())
  log.search(["capital of Peru", "currency of Peru"], 2)
  turns = ["<search>capital of Peru</search>", "<search>currency of Peru</search>",
           "<search>never run</search>"]
  qs = [Question("q-1", "Q?", ("Sol",), "countries")]
  res = [evaluate.EvalResult("Q?", ("Sol",), "countries", "Sol", 1.0, 2, 0, "", f1=1.0,
                             hops=2, turns=tuple(turns))]
  (row,) = evaluate.question_rows(qs, res, log)
  assert row["id"] == "q-1" and row["hops"] == 2 and row["prediction"] == "Sol"
  assert row["em"] == 1.0 and row["searches"] == 2
  assert row["queries"] == ["capital of Peru", "currency of Peru", "never run"]
  assert row["retrieved"] == [["capital of Peru-0", "capital of Peru-1"],
                              ["currency of Peru-0", "currency of Peru-1"], []]


# ------------------------------------------------------------------ when evaluations run
def test_eval_due_steps():
  """train.eval_every counts RL steps from the end of SFT; train.sft_eval_every adds step 0,
  every N SFT steps and the end of SFT; eval_questions = 0 turns both off."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from gigrl.training import evaluator  # pylint: disable=g-import-not-at-top

  def due(**kw):
    t = ml_collections.ConfigDict(dict(sft_steps=5, num_steps=7, eval_every=3, sft_eval_every=0,
                                       eval_questions=4))
    t.update(kw)
    return [s for s in range(t.sft_steps + t.num_steps + 1) if evaluator.eval_due(t, s)]

  assert due() == [5, 8, 11, 12]
  assert due(sft_eval_every=2) == [0, 2, 4, 5, 8, 11, 12]
  assert due(sft_eval_every=2, eval_every=0) == [0, 2, 4, 5]
  assert due(sft_steps=0, sft_eval_every=2) == [0, 3, 6, 7]
  assert due(eval_questions=0, sft_eval_every=1) == []


# ------------------------------------------------------------------ train.eval_every (slow)
import os       # noqa: E402
import shutil   # noqa: E402
import subprocess  # noqa: E402
import sys      # noqa: E402

from gigrl import testing  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config.train.sft_steps=2", "--config.train.num_steps=3",
        "--config.data.max_train_questions=8", "--config.data.prompts_per_step=2",
        "--config.data.group_size=2", "--config.model.preset=tiny",
        "--config.rollout.max_new_tokens=16", "--config.rollout.max_obs_tokens=64",
        "--config.train.sft_batch_size=4", "--config.train.eval_questions=4",
        "--config.train.eval_every=2", "--config.train.sft_eval_every=1",
        "--config.checkpoint.every_steps=2",
        "--config.checkpoint.keep=3", "--config.data.pool.rule=grpo"]


def _train(workdir, *extra):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(testing.train_command(workdir, *TINY, *extra), capture_output=True,
                        text=True, timeout=900, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc.stderr


def _lines(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if not k.endswith(("_s", "tokens_per_s"))} for r in rows]


@pytest.mark.slow
def test_eval_every_lines_and_exact_resume(tmp_path):
  """Eval lines after every SFT step from step 0 (sft_eval_every=1), at the start of RL
  (step 2), every 2 RL steps (4) and at the end (5); a run resumed from the step-2 checkpoint
  rewrites the same metrics.jsonl (eval lines included)."""
  workdir = tmp_path / "run"
  err = _train(workdir)
  rows = _lines(workdir)
  assert [(r["step"], r["phase"]) for r in rows] == [
      (0, "eval"), (1, "sft"), (1, "eval"), (2, "sft"), (2, "eval"), (3, "rl"), (4, "rl"), (4, "eval"), (5, "rl"),
      (5, "eval")]
  for r in rows:
    if r["phase"] == "eval":
      assert r["eval/n"] == 4 and {"eval/em", "eval/f1", "eval/search_calls_mean",
                                   "eval/answered_frac", "eval/invalid_frac"} <= set(r)
  assert "held-out EM:" in err and "at the start of RL (step 2)" in err
  ev = json.load(open(workdir / "eval.json"))
  assert ev["eval/em"] == rows[-1]["eval/em"] and ev["step"] == 5
  assert (workdir / "samples" / "eval_samples.txt").read_text() == (
      workdir / "samples" / "eval_000005.txt").read_text()
  # every evaluation's per-question rows, whose EM averages to the line's
  for r in rows:
    if r["phase"] == "eval":
      out = workdir / "eval_outputs" / f"step_{r['step']:06d}.jsonl"
      qrows = [json.loads(line) for line in open(out)]
      assert len(qrows) == 4 and all(q["id"] and "prediction" in q and "retrieved" in q
                                     and len(q["retrieved"]) == len(q["queries"])
                                     for q in qrows)
      assert sum(q["em"] for q in qrows) / 4 == pytest.approx(r["eval/em"])
  # a run resumed at its last step (killed after the final checkpoint, before eval.json): the
  # final evaluation reuses step 5's periodic eval line instead of rolling out again
  os.remove(workdir / "eval.json")
  again = _train(workdir)
  assert "step 5: evaluating" not in again, again[-3000:]
  assert json.load(open(workdir / "eval.json")) == ev
  assert os.path.exists(workdir / "samples" / "eval_000004.txt")
  for step in ("4", "5"):                      # as if killed right after step 2's checkpoint
    shutil.rmtree(workdir / "checkpoints" / step)
  _train(workdir)
  assert _lines(workdir) == rows
  # gigrl-eval on the run's latest checkpoint and own held-out questions = the final eval
  from gigrl.cli import eval as eval_cli  # pylint: disable=g-import-not-at-top
  out = tmp_path / "eval"
  assert eval_cli.main(["--workdir", str(workdir), "--datasets", "run,bamboogle",
                        "--max_questions", "4", "--batch_size", "4", "--output", str(out)]) == 0
  got = json.load(open(out / "results.json"))
  assert got["step"] == 5 and set(got["datasets"]) == {"run", "bamboogle"}
  # (the rollout's work counts, eval/rollout/*, depend on the batch size, 4 here)
  mine = {k: v for k, v in got["datasets"]["run"].items() if k.startswith("eval/")
          and not k.endswith("_s") and k != "eval/samples" and not k.startswith("eval/rollout/")}
  assert mine == {k: v for k, v in ev.items() if k.startswith("eval/") and not k.endswith("_s")
                  and not k.startswith("eval/rollout/")}
  table = open(out / "results.md").read()
  assert "| run | 4 |" in table and "| bamboogle | 4 |" in table and "average" in table
  qrows = [json.loads(line) for line in open(out / "samples_bamboogle.jsonl")]
  assert len(qrows) == 4 and all(q["id"] and len(q["retrieved"][0]) == len(q["queries"][0])
                                 for q in qrows)


# ------------------------------------------------------------------ gigrl-eval: bad input
def _eval_cli(*args):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "gigrl.cli.eval", *args], capture_output=True,
                        text=True, timeout=300, cwd=ROOT, env=env)


def test_resolve_datasets(tmp_path):
  from gigrl.cli import eval as eval_cli  # pylint: disable=g-import-not-at-top
  from gigrl.config_utils import ConfigError  # pylint: disable=g-import-not-at-top
  (tmp_path / "nq").mkdir()
  (tmp_path / "nq" / "test.jsonl").write_text(
      json.dumps({"id": "1", "question": "who?", "golden_answers": ["me"]}) + "\n")
  (tmp_path / "hotpotqa").mkdir()
  (tmp_path / "hotpotqa" / "dev.jsonl").write_text(
      json.dumps({"question": "what?", "golden_answers": ["it"]}) + "\n")
  sets = eval_cli.resolve_datasets("nq,hotpotqa,countries,mine=" + str(
      tmp_path / "nq" / "test.jsonl"), data_dir=str(tmp_path))
  assert [s.name for s in sets] == ["nq", "hotpotqa", "countries", "mine"]
  assert sets[0].questions[0].data_source == "nq" and sets[1].origin.endswith("dev.jsonl")
  assert all(q.split == "eval" for q in sets[2].questions) and len(sets[2].questions) > 100
  assert sets[3].questions[0].data_source == "mine"
  with pytest.raises(ConfigError) as e:
    eval_cli.resolve_datasets("nq,bogus", data_dir=str(tmp_path))
  assert e.value.field == "--datasets" and "bogus" in str(e.value)
  with pytest.raises(ConfigError) as e:
    eval_cli.resolve_datasets("searchr1", data_dir=str(tmp_path))     # no triviaqa file
  assert e.value.field == "--data_dir" and "triviaqa" in str(e.value)
  with pytest.raises(ConfigError) as e:
    eval_cli.resolve_datasets("triviaqa")
  assert "need --data_dir" in str(e.value)
  assert eval_cli.SEARCH_R1_SETS == ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa",
                                     "musique", "bamboogle")


def test_markdown_table_per_dataset():
  a = evaluate.aggregate([_result(1, 1), _result(0, 2), _result(0, 0, answered=False)])
  b = evaluate.aggregate([_result(1, 1)])
  a["eval/pass@2"], b["eval/pass@2"] = 0.5, 1.0
  t = evaluate.markdown_table({"nq": a, "popqa": b}, ks=[2])
  lines = t.splitlines()
  assert lines[0] == ("| dataset | n | EM | F1 | search calls | answered | invalid | pass@2 | "
                      "EM calls=0 (share) | EM calls=1 (share) | EM calls=2 (share) |")
  assert lines[2] == ("| nq | 3 | 0.333 | 0.333 | 1.000 | 0.667 | 0.000 | 0.500 | "
                      "0.000 (0.33) | 1.000 (0.33) | 0.000 (0.33) |")
  assert lines[3].startswith("| popqa | 1 | 1.000 |") and lines[3].endswith("| - | 1.000 (1.00) | - |")
  assert lines[4].startswith("| average |  | 0.667 |")


def _bad_input(tmp_path, case):
  """(argv, text the one error line must contain) of a bad gigrl-eval command line."""
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"question": "q", "golden_answers": ["a"]}) + "\n{not json\n")
  (tmp_path / "run").mkdir()
  args, want = {
      "no_checkpoint": (["--workdir", str(tmp_path / "run"), "--datasets", "bamboogle"],
                        "no checkpoints/ folder"),
      "unknown_dataset": (["--workdir", str(tmp_path / "run"), "--datasets", "nq_open"],
                          "--datasets"),
      "malformed_file": (["--workdir", str(tmp_path / "run"), "--datasets", str(bad)],
                         f"{bad}:2: field '<json>'"),
      "missing_hf": (["--hf_path", str(tmp_path / "nope"), "--datasets", "bamboogle"],
                     "--hf_path"),
      "bad_k": (["--workdir", str(tmp_path / "run"), "--datasets", "bamboogle", "--k", "4"],
                "--k 4"),
  }[case]
  return args, want


@pytest.mark.parametrize("case", ["no_checkpoint", "unknown_dataset", "malformed_file",
                                  "missing_hf", "bad_k"])
def test_gigrl_eval_bad_input_exits_2(tmp_path, case, monkeypatch, capsys):
  """In-process: ``main`` exits 2 with one ``gigrl-eval: error:`` line (the console script's
  wiring is checked by the subprocess test below)."""
  from gigrl.cli import eval as eval_cli  # pylint: disable=g-import-not-at-top
  args, want = _bad_input(tmp_path, case)
  monkeypatch.setattr(sys, "argv", ["gigrl-eval"])
  with pytest.raises(SystemExit) as e:
    eval_cli.main(args)
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2, err[-3:]
  assert err[-1].startswith("gigrl-eval: error: ") and want in err[-1], err[-3:]
  if case == "unknown_dataset":
    assert "nq_open" in err[-1]


@pytest.mark.slow
def test_gigrl_eval_bad_input_exits_2_as_a_subprocess(tmp_path):
  args, want = _bad_input(tmp_path, "unknown_dataset")
  proc = _eval_cli(*args)
  assert proc.returncode == 2, proc.stderr[-2000:]
  err = proc.stderr.strip().splitlines()
  assert err[-1].startswith("gigrl-eval: error: ") and want in err[-1], err[-3:]
  assert "Traceback" not in proc.stderr and "nq_open" in err[-1]


@pytest.mark.slow
def test_rl_from_init_from_reuses_its_start_evaluation(tmp_path):
  """An RL run started with train.init_from writes the source run's evaluation of the same
  params as its start-of-RL eval line (no second rollout pass), and evaluates itself when a
  field the evaluation depends on differs."""
  sft, rl, other = tmp_path / "sft", tmp_path / "rl", tmp_path / "other"
  _train(sft, "--config.train.num_steps=0")
  start = [r for r in _lines(sft) if r["phase"] == "eval" and r["step"] == 2]
  err = _train(rl, f"--config.train.init_from={sft}", "--config.seed=1",
               "--config.data.pool.rule=recycle")
  rows = _lines(rl)
  assert rows[0] == start[0] and rows[0]["phase"] == "eval"
  assert "step 2: evaluating" not in err and "the evaluation of train.init_from" in err
  err = _train(other, f"--config.train.init_from={sft}", "--config.rollout.max_turns=1")
  assert "step 2: evaluating" in err


def test_same_eval_fields_reads_a_missing_field_as_its_default():
  """A config saved before a field existed agrees with one that has the field at its default
  (so an evaluation made by the older run is reused), and differs when the value does not."""
  import copy  # pylint: disable=import-outside-toplevel
  from gigrl import config as config_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import evaluator  # pylint: disable=import-outside-toplevel
  mine = json.loads(config_lib.base_config().to_json_best_effort())
  older = copy.deepcopy(mine)
  del older["rollout"]["max_turns"]
  assert evaluator.same_eval_fields(older, mine)
  assert evaluator.same_eval_fields(mine, older)
  changed = copy.deepcopy(mine)
  changed["rollout"]["max_turns"] += 1
  assert not evaluator.same_eval_fields(older, changed)
  changed = copy.deepcopy(mine)
  changed["data"]["group_size"] += 1                    # EVAL_IGNORED: RL sampling only
  assert evaluator.same_eval_fields(changed, mine)


def test_same_eval_fields_compares_data_files_by_their_bytes(tmp_path):
  """Two runs from two checkouts name the same packaged questions under different directories:
  the files' bytes decide, so the source run's evaluation is reused; other bytes are not."""
  import copy  # pylint: disable=import-outside-toplevel
  from gigrl import config as config_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import evaluator  # pylint: disable=import-outside-toplevel
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  for d in ("a", "b"):
    (tmp_path / d / "questions.jsonl").write_text('{"question": "q", "answers": ["x"]}\n')
  mine = json.loads(config_lib.base_config().to_json_best_effort())
  mine["data"]["questions_file"] = str(tmp_path / "a" / "questions.jsonl")
  theirs = copy.deepcopy(mine)
  theirs["data"]["questions_file"] = str(tmp_path / "b" / "questions.jsonl")
  assert evaluator.same_eval_fields(theirs, mine)
  (tmp_path / "b" / "questions.jsonl").write_text('{"question": "q", "answers": ["y"]}\n')
  assert not evaluator.same_eval_fields(theirs, mine)
