"""Errors as a new user meets them: one line naming the field, file or row, exit status 2.

The command-line cases run ``gigrl-train`` in subprocesses, all started at once by one fixture
(each stops at start-up, before any model is built); two of them (a flag error and a config
check) are in the quick set, the rest are ``slow``. The rest call the checks in-process.
"""
import os
import re
import subprocess
import sys

import pytest

from gigrl import config as config_lib
from gigrl.cli import train
from gigrl.config_utils import ConfigError, UserError
from gigrl.data import qa
from gigrl.data import tfds_qa
from gigrl.search.base import SearchError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(REPO, "configs", "smoke.py")
QUESTION = '{"question": "Who?", "golden_answers": ["me"]}\n'


def _cli_cases(tmp):
  """name -> (argv after the program, regex the one stderr line must match)."""
  empty = tmp / "empty.jsonl"
  empty.write_text("\n")
  (tmp / "raises.py").write_text("def get_config():\n  return {}['nope']\n")
  base = ["--config", SMOKE, "--workdir", str(tmp / "w")]
  return {
      "unknown_field": (base + ["--config.train.nosuch=1"],
                        r"--config\.train\.nosuch: the config has no field 'train\.nosuch'; "
                        r"the fields of train are .*num_steps"),
      "unknown_section": (base + ["--config.trian.num_steps=1"],
                          r"no field 'trian\.num_steps' \(Did you mean \"train\".*\); "
                          r"the fields of the config are advantage, .*train"),
      "missing_config": (["--config", str(tmp / "nope.py"), "--workdir", str(tmp / "w")],
                         r"--config .*nope\.py: no such file"),
      "config_raises": (["--config", str(tmp / "raises.py"), "--workdir", str(tmp / "w")],
                        r"--config .*raises\.py:2: the config file failed to load: KeyError"),
      "bad_value": (base + ["--config.train.num_steps=many"],
                    r"--config\.train\.num_steps=many: invalid literal"),
      "no_workdir": (["--config", SMOKE], r"--workdir is required"),
      "workdir_unwritable": (["--config", SMOKE, "--workdir", "/proc/gigrl/w"],
                             r"--workdir /proc/gigrl/w: cannot write there"),
      "questions_empty": (base + [f"--config.data.questions_file={empty}"],
                          r"'data\.questions_file' .*empty\.jsonl.*the file is empty"),
      "unknown_source": (base + ["--config.data.train_sources=hotpotqa,nosuchset"],
                         r"'data\.train_sources' .*among 2wikimultihopqa, .*hotpotqa.* "
                         r"\(unknown: nosuchset\)"),
      "hf_path_missing": (base + [f"--config.model.hf_path={tmp}"],
                          r"'model\.hf_path' .*config\.json"),
      "obs_budget": (base + ["--config.rollout.max_obs_tokens=8"],
                     r"'rollout\.max_obs_tokens' has bad value 8; allowed: at least \d+: the "
                     r"invalid-action message is \d+ tokens with this tokenizer"),
      "prompt_budget": (base + ["--config.rollout.max_prompt_tokens=24"],
                        r"'rollout\.max_prompt_tokens' has bad value 24; allowed: more than "
                        r"\d+: the chat template and instruction alone"),
      "hub_id_offline": (base + ["--config.model.hf_path=nosuch-org/nosuch-model"],
                         r"'model\.hf_path' has bad value 'nosuch-org/nosuch-model'; allowed: a "
                         r"local checkpoint directory or a hub id that can be downloaded"),
      "lora_rank": (base + ["--config.model.lora.rank=-4"],
                    r"'model\.lora\.rank' has bad value -4; allowed: an integer and >= 0"),
      "lora_alpha": (base + ["--config.model.lora.rank=4", "--config.model.lora.alpha=0.0"],
                     r"'model\.lora\.alpha' has bad value 0\.0; allowed: a number and > 0"),
      "lora_target": (base + ["--config.model.lora.rank=4", "--config.model.lora.targets=q,v"],
                      r"'model\.lora\.targets' has bad value 'q,v'; allowed: .*q_proj,k_proj,"
                      r"v_proj,o_proj,gate_proj,up_proj,down_proj"),
      "server_down": (base + ["--config.search.backend=http", "--config.search.max_retries=0",
                              "--config.search.on_failure=empty",
                              "--config.search.url=http://127.0.0.1:9/retrieve"],
                      r"127\.0\.0\.1:9/retrieve failed its health check .*connection failed"),
  }


@pytest.fixture(scope="module")
def cli_results(request, tmp_path_factory):
  """Starts the selected cases' processes at once (those of the tests this session runs)."""
  wanted = {item.callspec.params["name"] for item in request.session.items
            if getattr(item, "originalname", "") == "test_cli_error_is_one_line_with_exit_2"}
  tmp = tmp_path_factory.mktemp("cli")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1",
         "HF_HUB_CACHE": str(tmp / "hf_hub")}      # hub ids resolve offline, from an empty cache
  cases = _cli_cases(tmp)
  assert set(cases) == set(CLI_CASES)
  procs = {name: (subprocess.Popen([sys.executable, "-m", "gigrl.cli.train", *argv], cwd=tmp,
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True), pattern)
           for name, (argv, pattern) in cases.items() if name in wanted}
  out = {}
  for name, (p, pattern) in procs.items():
    stdout, stderr = p.communicate(timeout=300)
    out[name] = (p.returncode, stdout, stderr, pattern)
  return out


CLI_CASES = ("unknown_field", "unknown_section", "missing_config", "config_raises", "bad_value",
             "no_workdir", "workdir_unwritable", "questions_empty", "unknown_source",
             "hf_path_missing", "obs_budget", "prompt_budget", "hub_id_offline", "server_down",
             "lora_rank", "lora_alpha", "lora_target")
QUICK_CLI_CASES = ("unknown_field", "questions_empty", "obs_budget", "lora_target")


@pytest.mark.parametrize("name", [
    n if n in QUICK_CLI_CASES else pytest.param(n, marks=pytest.mark.slow) for n in CLI_CASES])
def test_cli_error_is_one_line_with_exit_2(cli_results, name):
  rc, stdout, stderr, pattern = cli_results[name]
  lines = [l for l in stderr.splitlines() if l.strip()]
  assert rc == 2, (rc, stderr[-2000:])
  assert "Traceback" not in stderr and not stdout.strip(), stderr[-2000:]
  assert lines and lines[-1].startswith("gigrl-train: error: "), stderr[-2000:]
  assert len(lines) == 1, lines         # nothing else printed at start-up
  assert re.search(pattern, lines[-1]), lines[-1]


def test_usage_lists_the_flags():
  text = train.usage()           # what --help prints
  for flag in ("--config:", "--workdir:", "--config.<section>.<field>=value", "advantage"):
    assert flag in text


@pytest.mark.slow
def test_help_lists_the_flags():
  p = subprocess.run([sys.executable, "-m", "gigrl.cli.train", "--help"], capture_output=True,
                     text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert p.returncode == 0, p.stderr
  for text in ("--config:", "--workdir:", "--config.<section>.<field>=value", "advantage"):
    assert text in p.stdout


# ------------------------------------------------------------------------ in-process


def test_config_checks_data_paths_at_start_up(tmp_path):
  cfg = config_lib.base_config()
  config_lib.validate(cfg)
  cfg.data.questions_file = str(tmp_path / "q.jsonl")
  with pytest.raises(ConfigError, match="does not exist") as e:
    config_lib.validate(cfg)
  assert e.value.field == "data.questions_file"
  (tmp_path / "q.jsonl").write_text(" \n\n")
  with pytest.raises(ConfigError, match="the file is empty"):
    config_lib.validate(cfg)
  (tmp_path / "q.jsonl").write_text(QUESTION)
  config_lib.validate(cfg)
  cfg.data.tokenizer = str(tmp_path / "nope.model")
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg)
  assert e.value.field == "data.tokenizer"


@pytest.mark.parametrize("sources,problem", [
    ("hotpotqa,nosuchset", r"\(unknown: nosuchset\)"),
    ("bamboogle", "held out for evaluation only"),
    (" , ", "a comma-separated list"),
])
def test_train_sources_must_be_known_training_sets(sources, problem):
  cfg = config_lib.base_config()
  cfg.data.train_sources = sources
  with pytest.raises(ConfigError, match=problem) as e:
    config_lib.validate(cfg)
  assert e.value.field == "data.train_sources"
  assert isinstance(e.value, UserError)


def test_bundled_set_table_matches_the_files():
  for s in qa.BUNDLED_SETS:
    questions = qa.load_questions(os.path.join(qa.bundled_dir(), s.questions))
    assert {q.data_source for q in questions} == set(s.sources), s.questions
    assert os.path.isfile(os.path.join(qa.bundled_dir(), s.corpus))
  assert qa.check_train_sources("hotpotqa, musique,hotpotqa") == ["hotpotqa", "musique"]
  assert "bamboogle" in qa.EVAL_ONLY_SOURCES and "bamboogle" not in qa.TRAIN_SOURCES


def test_empty_questions_file_names_the_file_not_tfds(tmp_path):
  path = tmp_path / "empty.jsonl"
  path.write_text("\n")
  with pytest.raises(qa.DataError, match=r"empty\.jsonl: no questions") as e:
    tfds_qa.build(str(tmp_path / "tfds"), [str(path)])
  assert isinstance(e.value, UserError) and e.value.line == 0


def test_a_split_without_questions_is_empty_not_a_tfds_error(tmp_path):
  path = tmp_path / "q.jsonl"
  path.write_text(QUESTION + QUESTION.replace("Who?", "Where?"))
  builder = tfds_qa.build(str(tmp_path / "tfds"), [str(path)], eval_percent=0)
  assert len(tfds_qa.read_split(builder, "train")) == 2
  assert tfds_qa.read_split(builder, "eval") == []


def test_tfds_and_bm25_are_quiet(tmp_path, capfd):
  from gigrl.search import bm25  # pylint: disable=import-outside-toplevel
  path = tmp_path / "q.jsonl"
  path.write_text(QUESTION)
  capfd.readouterr()
  tfds_qa.build(str(tmp_path / "tfds"), [str(path)], eval_percent=0)
  bm25.BM25Retriever([qa.Document("1", '"T"\ntext')])
  out, err = capfd.readouterr()
  for noise in ("Downloading and preparing", "downloaded and prepared",
                "Using custom data configuration", "Building index"):
    assert noise not in out + err


def test_unwritable_workdir(tmp_path):
  train.check_writable_dir(str(tmp_path / "new" / "dir"), "--workdir")
  assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())
  with pytest.raises(train.UserError, match="--workdir /proc/x/y: cannot write there"):
    train.check_writable_dir("/proc/x/y", "--workdir")
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(train.UserError, match="a_file: exists and is not a directory"):
    train.check_writable_dir(str(tmp_path / "a_file"), "--workdir")


def test_user_error_found_as_a_cause():
  try:
    try:
      raise SearchError("http://x", "down")
    except SearchError as e:
      raise RuntimeError("callback rollout failed") from e
  except RuntimeError as e:
    assert isinstance(train._cause_of_type(e, (UserError, SearchError)), SearchError)
  assert train._cause_of_type(RuntimeError("bug"), (UserError, SearchError)) is None


class _DeadInner:
  """An inner retriever whose every call fails like a server that is down."""

  def search(self, queries, topk):
    raise SearchError("http://127.0.0.1:9/retrieve", "connection failed", retryable=True)


def test_sft_demonstrations_are_not_built_on_failed_searches():
  # on_failure=empty with the server down: the demonstrations' one batched search fails
  # (100% of the queries), which passes search.max_failure_frac and stops the run.
  from gigrl.data import tokenizer as tok_lib  # pylint: disable=import-outside-toplevel
  from gigrl.rollout import demos  # pylint: disable=import-outside-toplevel
  from gigrl.rollout import engine as engine_lib  # pylint: disable=import-outside-toplevel
  from gigrl.search import resilient  # pylint: disable=import-outside-toplevel
  questions = qa.load_bundled_questions()[:4]
  settings = engine_lib.RolloutSettings(max_turns=2, max_new_tokens=48, max_obs_tokens=80,
                                       max_prompt_tokens=256, topk_docs=2)
  retriever = resilient.ResilientRetriever(_DeadInner(), max_retries=0, on_failure="empty",
                                           max_failure_frac=0.5)
  with pytest.raises(resilient.TooManySearchFailures, match="4 of 4 search queries"):
    demos.build_demonstrations(questions, tok_lib.SentencePieceTokenizer(), retriever,
                               settings)


def test_malformed_hop_queries_name_the_field_file_and_line(tmp_path):
  path = tmp_path / "q.jsonl"
  path.write_text('{"question": "a?", "golden_answers": ["b"]}\n'
                  '{"question": "c?", "golden_answers": ["d"], "hop_queries": ["x", 3]}\n')
  with pytest.raises(qa.DataError, match=r"q\.jsonl.*2.*hop_queries") as e:
    qa.load_questions(str(path))
  assert "list of non-empty strings" in str(e.value)
  path.write_text('{"question": "c?", "golden_answers": ["d"], "hop_queries": [" x ", "y"]}\n')
  assert qa.load_questions(str(path))[0].hop_queries == ("x", "y")
