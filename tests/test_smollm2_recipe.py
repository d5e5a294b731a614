"""The real-model countries recipe (configs/countries.py:smollm2-135m): its fields, the rollout's
token-budget checks against the tokenizer, the chat template as transformers >= 5 saves it, and
held-out EM by hop in the log lines."""
import json
import re
import os
import runpy

import pytest

from gigrl.training import evaluate
from gigrl import testing
from gigrl.config_utils import ConfigError
from gigrl.data import countries
from gigrl.data import hf_tokenizer
from gigrl.models import fetch
from gigrl.rollout import turns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTRIES = os.path.join(REPO, "configs", "countries.py")


def _config(preset):
  return runpy.run_path(COUNTRIES)["get_config"](preset)


def test_recipe_uses_the_fetched_checkpoint_and_seeds_the_second_search():
  c = _config("smollm2-135m")
  want = fetch.default_dir("smollm2-135m-instruct")
  assert c.model.hf_path == want and c.data.tokenizer == want
  assert c.train.copy_steps == 0 and c.train.sft_steps == 30
  n1 = countries.count_train_questions(hops=1)
  assert c.train.sft_questions == n1 + 300      # every 1-hop question + 300 2-hop ones
  assert (c.data.pool.rule, c.data.pool.oversample) == ("recycle", 2)
  assert c.train.eval_questions == 300
  short = _config("smollm2-135m-short")
  assert short.train.num_steps < c.train.num_steps
  assert short.train.eval_every == short.train.num_steps   # EM at the start of RL and the end
  tiny = _config(None)
  assert tiny.model.hf_path == "" and tiny.model.preset == "tiny-4l"


def test_recipe_evaluates_at_least_100_two_hop_questions():
  rows = [json.loads(l) for l in open(os.path.join(countries.default_dir(),
                                                    countries.QUESTIONS_FILE))]
  ev = sorted((r for r in rows if r["split"] != "train"), key=lambda r: r["id"])
  picked = evaluate.select(ev, _config("smollm2-135m").train.eval_questions)
  assert len(picked) == 300 and sum(r["hops"] == 2 for r in picked) >= 100


def test_unknown_preset_names_the_known_ones():
  with pytest.raises(ValueError, match="smollm2-135m-short"):
    _config("smollm3")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  return hf_tokenizer.HFTokenizer(testing.write_bpe_tokenizer(
      str(tmp_path_factory.mktemp("bpe")), vocab_size=512))


@pytest.mark.parametrize("field,kw", [
    ("rollout.max_obs_tokens", dict(max_obs_tokens=8)),
    ("rollout.max_new_tokens", dict(max_new_tokens=2)),
    ("rollout.max_prompt_tokens", dict(max_prompt_tokens=24)),
])
def test_budgets_too_small_for_the_tokenizer_name_the_field(bpe, field, kw):
  ok = turns.RolloutSettings(max_turns=2, max_new_tokens=48, max_obs_tokens=128,
                             max_prompt_tokens=512)
  turns.check_settings(bpe, ok)
  with pytest.raises(ConfigError) as e:
    turns.check_settings(bpe, turns.RolloutSettings(**{**ok.__dict__, **kw}))
  assert e.value.field == field


def test_chat_template_jinja_beside_the_config_is_used(tmp_path):
  """transformers >= 5 saves the template to chat_template.jinja, not tokenizer_config.json."""
  d = testing.write_bpe_tokenizer(str(tmp_path), vocab_size=300)
  cfg_path = os.path.join(d, "tokenizer_config.json")
  cfg = json.load(open(cfg_path))
  del cfg["chat_template"]
  json.dump(cfg, open(cfg_path, "w"))
  assert hf_tokenizer.HFTokenizer(d).chat_template is None
  with open(os.path.join(d, "chat_template.jinja"), "w") as f:
    f.write("{{ '<|im_start|>system\\nFROM JINJA<|im_end|>\\n' }}{% for m in messages %}"
            "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% endif %}")
  text = hf_tokenizer.HFTokenizer(d).apply_chat_template("Which?")
  assert text == ("<|im_start|>system\nFROM JINJA<|im_end|>\n<|im_start|>user\nWhich?"
                  "<|im_end|>\n<|im_start|>assistant\n")


def test_em_by_hop_in_log_lines():
  m = {"eval/n": 64.0, "eval/em": 0.5, "eval/em/hops=1": 0.857, "eval/share/hops=1": 42 / 64,
       "eval/em/hops=2": 0.091, "eval/share/hops=2": 22 / 64}
  assert evaluate.by_hop(m) == " (1-hop 0.857 of 42, 2-hop 0.091 of 22)"
  assert evaluate.by_hop({"eval/n": 3.0, "eval/em": 1.0}) == ""


@pytest.mark.slow
def test_recipe_end_to_end_on_a_tiny_gguf(tmp_path):
  """configs/countries.py:smollm2-135m-short as it runs, with model.hf_path swapped for a tiny
  GGUF converted by gigrl-fetch's code path: chat-templated prompts, SFT with 2-hop
  demonstrations, recycling RL, held-out EM by hop at the start of RL and at the end."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from gigrl.models import gguf  # pylint: disable=import-outside-toplevel
  testing.write_tiny_gguf(str(tmp_path / "tiny.gguf"))
  ckpt = gguf.gguf_to_hf(str(tmp_path / "tiny.gguf"), str(tmp_path / "ckpt"))["dir"]
  workdir = tmp_path / "run"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)     # one device
  proc = subprocess.run(
      [sys.executable, "-m", "gigrl.cli.train", "--config", COUNTRIES + ":smollm2-135m-short",
       "--workdir", str(workdir), *testing.TEST_DEFAULTS, f"--config.model.hf_path={ckpt}",
       f"--config.data.tokenizer={ckpt}", "--config.train.sft_steps=2",
       "--config.train.sft_batch_size=2", "--config.train.num_steps=1",
       "--config.train.eval_every=1", "--config.train.eval_questions=4",
       "--config.data.prompts_per_step=2", "--config.data.group_size=2",
       "--config.rollout.max_new_tokens=24", "--config.rollout.max_prompt_tokens=640",
       "--config.rollout.max_obs_tokens=400", "--config.checkpoint.every_steps=3"],
      capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  assert [(r["step"], r["phase"]) for r in rows] == [
      (1, "sft"), (2, "sft"), (2, "eval"), (3, "rl"), (3, "eval")]
  rl = rows[3]
  assert rl["time/rollout_s"] > 0 and rl["time/update_s"] >= 0
  assert re.search(r"held-out EM: [\d.]+ \(1-hop [\d.]+ of \d+, 2-hop [\d.]+ of \d+\) at the "
                   r"start of RL \(step 2\) -> [\d.]+ \(1-hop", proc.stderr), proc.stderr[-2000:]
