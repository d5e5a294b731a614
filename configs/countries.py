"""Countries search task: an SFT warm-start on 1-hop questions, then RL on 1- and 2-hop ones.

  gigrl-train --config configs/countries.py --workdir /tmp/gigrl_countries

The task (``gigrl.data.countries``, GeoNames facts): a 1,008-passage corpus (four passages per
country) and 1-/2-hop questions split by country, so held-out questions are about countries no
training question mentions and only searching with the entity the prompt names (and, for 2-hop,
the entity the first observation names) and copying from the retrieved passage answers them.
The warm-start teaches the Search-R1 format on the 1-hop training questions whose answer is in
the retrieved passage (search with the question, answer with the gold answer); RL then samples
1-hop and 2-hop training questions. Held-out EM is evaluated at the start of RL and every
``train.eval_every`` RL steps (greedy, the first ``train.eval_questions`` held-out questions,
1- and 2-hop mixed). Deterministic per seed on CPU.

Status (issue "RL that measurably learns"): with these settings the tiny policies tried so far
(2 and 4 layers, up to 900 SFT steps) learn the format but do not yet copy an unseen entity
from the prompt or the answer from the passage: held-out EM is 0.0 at the start of RL, so RL
has no signal to amplify. See the closing note of the issue for the runs.
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
  cfg.model.preset = "tiny-4l"
  cfg.search.topk = 1                   # BM25(question) top-1 holds the answer for 89% of 1-hop
  cfg.rollout.max_turns = 2             # 2-hop: search, search, answer
  cfg.rollout.max_new_tokens = 48
  cfg.rollout.max_obs_tokens = 64       # one passage (>= the 52-token invalid-action message)
  cfg.rollout.max_prompt_tokens = 160
  cfg.train.sft_steps = 600
  cfg.train.sft_batch_size = 16
  cfg.train.sft_learning_rate = 3e-3
  cfg.train.sft_questions = countries.count_train_questions(hops=1)   # 1-hop ids sort first
  cfg.train.sft_only_answer_in_obs = True
  cfg.train.num_steps = 30
  cfg.train.learning_rate = 1e-4
  cfg.train.kl_coef = 0.001
  cfg.train.sample_every = 5
  cfg.train.eval_every = 10
  cfg.train.eval_questions = 200
  cfg.checkpoint.every_steps = 50
  cfg.checkpoint.keep = 2
  return cfg
