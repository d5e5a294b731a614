"""Stratified GRPO (Zhu et al., arXiv 2510.06214): the Search-R1 GRPO setting with the
stratified advantage (SAN blended with the global GRPO advantage, α = 0.6, App. D.1).

  gigrl-train --config configs/stratified_grpo.py:qwen2.5-3b --workdir DIR \
      --config.model.hf_path=/ckpt/Qwen2.5-3B --config.data.tokenizer=/ckpt/Qwen2.5-3B

Presets: ``qwen2.5-3b`` (base; α = 0.6 is the paper's value for it), ``qwen2.5-3b-instruct``,
``tiny``. The paper trains in the Search-R1 setting; its code is not public, so every value
other than the estimator and α is Search-R1's ``train_grpo.sh`` (docs/recipes.md marks them).
Strata are the search-call counts; a search in the final turn counts, as Search-R1 counts it.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _recipe  # noqa: E402

PRESETS = {"qwen2.5-3b": None, "qwen2.5-3b-instruct": None, "tiny": None}


def get_config(arg: str | None = None):
  preset, _ = _recipe.split_arg(arg, PRESETS)
  cfg = _recipe.load("search_r1_grpo").get_config(preset)
  cfg.advantage.outcome = "stratified"          # §4: SAN + blend
  cfg.advantage.stratified.alpha = 0.6          # App. D.1 (Qwen2.5-3B-Base)
  cfg.advantage.stratified.count_final_search = True   # Search-R1's search count
  return cfg
