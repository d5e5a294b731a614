"""The real-model countries recipe (configs/countries.py:smollm2-135m): its fields, the rollout's
token-budget checks against the tokenizer, the chat template as transformers >= 5 saves it, and
held-out EM by hop in the log lines."""
import json
import os
import runpy

import pytest

from gigrl import evaluate
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
