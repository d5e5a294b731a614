"""Countries search task: an SFT warm-start on 1-hop questions, then RL on 1- and 2-hop ones.

  gigrl-train --config configs/countries.py --workdir /tmp/gigrl_countries

The task (``gigrl.data.countries``, GeoNames facts): a 1,008-passage corpus (four passages per
country) and 1-/2-hop questions split by country, so held-out questions are about countries no
training question mentions and only searching with the entity the prompt names (and, for 2-hop,
the entity the first observation names) and copying from the retrieved passage answers them.
The warm-start teaches the Search-R1 format on 1-hop demonstrations (search with the question,
answer with the gold answer); RL then samples 1-hop and 2-hop training questions.
Deterministic per seed on CPU.
"""
import os

from gigrl import config as config_lib
from gigrl.data import countries


def get_config(arg: str | None = None):
  del arg
  cfg = config_lib.base_config()
  cfg.seed = 0
  root = countries.default_dir()
  cfg.data.questions_file = os.path.join(root, countries.QUESTIONS_FILE)
  cfg.search.corpus = os.path.join(root, countries.CORPUS_FILE)
  # The task's 768-piece tokenizer (countries.train_tokenizer): a 10x cheaper LM head than the
  # bundled 8k model's, and held-out entities split into pieces training targets also contain.
  cfg.data.tokenizer = os.path.join(root, countries.TOKENIZER_FILE)
  cfg.data.prompts_per_step = 8
  cfg.data.group_size = 8
  cfg.data.pool.rule = "grpo"
  cfg.data.pool.oversample = 1
  cfg.model.preset = "tiny"
  cfg.rollout.max_turns = 2
  cfg.rollout.max_new_tokens = 48
  cfg.rollout.max_obs_tokens = 128
  cfg.rollout.max_prompt_tokens = 192
  cfg.train.sft_steps = 300
  cfg.train.sft_batch_size = 16
  cfg.train.sft_learning_rate = 3e-3
  cfg.train.sft_questions = 1024        # the first 1,024 training ids are 1-hop questions
  cfg.train.num_steps = 40
  cfg.train.learning_rate = 1e-4
  cfg.train.kl_coef = 0.001
  cfg.train.sample_every = 5
  cfg.train.eval_questions = 200
  cfg.checkpoint.every_steps = 50
  cfg.checkpoint.keep = 2
  return cfg
