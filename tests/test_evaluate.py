"""gigrl.training.evaluate on a stand-in engine, and the start-up checks of gigrl.training.build (eval leak,
rows that the mesh does not divide)."""
import jax
import numpy as np
import pytest

from gigrl.training import build
from gigrl import config as config_lib
from gigrl.training import evaluate
from gigrl.config_utils import ConfigError
from gigrl.data.qa import Question
from gigrl.models import sharding as shd
from gigrl.rollout import trajectory as traj_lib

QS = [Question("1", "capital of France?", ("Paris",), "geo"),
      Question("2", "capital of Peru?", ("Lima",), "geo"),
      Question("3", "who wrote Hamlet?", ("Shakespeare",), "lit")]
TURNS = [["<search> France </search>", "<answer> paris </answer>"],     # EM 1, 1 search
         ["<answer> Cusco </answer>"],                                  # EM 0
         ["hmm", "<search> Hamlet </search>", "no tags"]]               # never answers


class FakeEngine:
  def __init__(self):
    self.calls = []

  def run(self, params, questions, key):
    self.calls.append((params, list(questions)))
    builders = []
    for turns in TURNS[:len(questions)]:
      tb = traj_lib.TrajectoryBuilder()
      tb.add_prompt([1], anchor="q")
      for t in turns:
        tb.add_generation([2], t)
      tb.search_calls = sum("<search>" in t for t in turns)
      builders.append(tb)
    return traj_lib.collate(builders, 8, 0), {}


def test_evaluate_per_question_and_aggregate():
  engine = FakeEngine()
  results, m, batch = evaluate.evaluate(engine, "PARAMS", QS)
  assert engine.calls == [("PARAMS", [q.question for q in QS])]
  assert [r.em for r in results] == [1.0, 0.0, 0.0]
  assert [r.answer for r in results] == ["paris", "Cusco", None]
  assert [r.search_calls for r in results] == [1, 0, 1]
  assert [r.invalid_actions for r in results] == [0, 0, 2]
  want = {"eval/n": 3.0, "eval/em": pytest.approx(1 / 3),
          "eval/search_calls_mean": pytest.approx(2 / 3),
          "eval/answered_frac": pytest.approx(2 / 3),
          "eval/invalid_frac": pytest.approx(1 / 3),
          "eval/em/geo": 0.5, "eval/em/lit": 0.0, "eval/f1": pytest.approx(1 / 3)}
  assert {k: m[k] for k in want} == want     # breakdowns: tests/test_eval.py
  assert batch.tokens.shape[0] == 3
  assert evaluate.evaluate(engine, "PARAMS", []) == ([], {}, None)


class ByQuestionEngine(FakeEngine):
  """Each row's turns follow its question (not its position), as a real engine's do."""

  def run(self, params, questions, key):
    self.calls.append((params, list(questions)))
    texts = [q.question for q in QS]
    builders = []
    for q in questions:
      tb = traj_lib.TrajectoryBuilder()
      builders.append(tb)
      if q is None:             # a padding row: never computed, comes back empty
        continue
      tb.add_prompt([1], anchor="q")
      for t in TURNS[texts.index(q)]:
        tb.add_generation([2], t)
      tb.search_calls = sum("<search>" in t for t in TURNS[texts.index(q)])
    return traj_lib.collate(builders, 8, 0), {}


def test_evaluate_in_chunks_equals_one_call():
  """train.eval_batch_size: fixed-width chunks (the last padded), the same results."""
  whole = evaluate.evaluate(ByQuestionEngine(), "P", QS)
  engine, lines = ByQuestionEngine(), []
  results, m, batch = evaluate.evaluate(engine, "P", QS, batch_size=2, log=lines.append)
  assert [len(c[1]) for c in engine.calls] == [2, 2]            # one shape: no recompiles
  assert engine.calls[1][1] == [QS[2].question, None]    # padded with an empty row (#50)
  assert results == whole[0] and m == whole[1]
  assert batch.tokens.shape[0] == 2 and len(lines) == 2 and lines[-1].startswith("3/3")


def test_eval_leak_is_an_error_naming_the_field():
  with pytest.raises(ConfigError) as e:
    build.check_no_leak(QS[:2], [Question("9", "Capital of  France?", ("x",), "geo")],
                        "data.questions_file", "my.jsonl")
  assert e.value.field == "data.questions_file" and "capital of france" in str(e.value)
  build.check_no_leak(QS[:2], QS[2:], "data.train_sources", "geo")     # no overlap: fine


def test_rows_must_divide_the_mesh():
  if jax.device_count() < 8:
    pytest.skip("needs 8 (simulated) devices; tests/conftest.py sets them")
  mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tp": 2})           # batch axes: 4 devices
  cfg = config_lib.base_config()
  cfg.data.prompts_per_step, cfg.data.group_size = 3, 2           # 6 rows
  with pytest.raises(ConfigError) as e:
    build.check_rows_fit_mesh(cfg, mesh)
  msg = str(e.value)
  assert e.value.field == "data.prompts_per_step"
  assert "data.group_size" in msg and "'fsdp': 2" in msg and "= 4" in msg
  cfg.data.group_size = 4                                          # 12 rows
  cfg.train.sft_steps, cfg.train.sft_batch_size = 5, 6
  with pytest.raises(ConfigError) as e:
    build.check_rows_fit_mesh(cfg, mesh)
  assert e.value.field == "train.sft_batch_size"
  cfg.train.sft_batch_size = 8
  build.check_rows_fit_mesh(cfg, mesh)
  x = build.put_rows(mesh, np.zeros((12, 3), np.float32))
  assert x.sharding.spec[0] == ("data", "fsdp")
  assert x.addressable_shards[0].data.shape == (3, 3)             # rows really split
