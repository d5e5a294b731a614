"""End-to-end with a Hugging Face checkpoint and tokenizer as they ship.

A tiny random Qwen2 checkpoint saved with ``transformers`` (``model.hf_path``) and a Qwen2-style
byte-level BPE ``tokenizer.json`` built in the test (``data.tokenizer``; no special tokens
added for the Search-R1 tags, which are several tokens each): ``gigrl-train`` runs 1 SFT step
and 2 RL steps with the host-loop engine.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_checkpoint(directory: str, vocab_size: int, eos_id: int, pad_id: int) -> str:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(
      vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
      tie_word_embeddings=True, rope_theta=10000.0, eos_token_id=eos_id, pad_token_id=pad_id)
  transformers.Qwen2ForCausalLM(cfg).save_pretrained(directory, safe_serialization=True)
  return directory


@pytest.mark.slow
def test_gigrl_train_with_hf_qwen2_checkpoint_and_bpe_tokenizer(tmp_path):
  from gigrl import testing  # pylint: disable=import-outside-toplevel
  from gigrl.data import tags  # pylint: disable=import-outside-toplevel
  from gigrl.data import tokenizer as tok_lib  # pylint: disable=import-outside-toplevel
  tok_dir = testing.write_bpe_tokenizer(str(tmp_path / "tokenizer"))
  tok = tok_lib.load(tok_dir)
  assert all(len(tok.encode(t)) > 1 for t in tags.TAGS)      # no tag is a single token
  ckpt = _write_checkpoint(str(tmp_path / "qwen2"), tok.vocab_size, tok.eos_id, tok.pad_id)
  workdir = tmp_path / "run"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)     # one device
  proc = subprocess.run(
      [sys.executable, "-m", "gigrl.cli.train", "--config", os.path.join(ROOT, "configs/smoke.py"),
       "--workdir", str(workdir), *testing.TEST_DEFAULTS, f"--config.model.hf_path={ckpt}",
       f"--config.data.tokenizer={tok_dir}", "--config.train.sft_steps=1",
       "--config.train.num_steps=2", "--config.data.max_train_questions=8",
       "--config.data.prompts_per_step=2", "--config.data.group_size=2",
       "--config.data.pool.rule=grpo", "--config.rollout.max_new_tokens=16",
       "--config.rollout.max_obs_tokens=80", "--config.rollout.max_prompt_tokens=256",
       "--config.train.sft_batch_size=4", "--config.train.sample_every=1",
       "--config.train.eval_questions=2", "--config.checkpoint.every_steps=3"],
      capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(workdir / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  for r in rows:
    print(json.dumps(r))
  assert [(r["step"], r["phase"]) for r in rows] == [(1, "sft"), (2, "rl"), (3, "rl")]
  assert rows[0]["loss"] > 0 and rows[0]["train/tokens_per_s"] > 0
  for r in rows[1:]:
    assert r["response_tokens_mean"] > 0 and r["rollout/tokens_per_s"] > 0
    assert r["trained_groups"] == 2 and 0.0 <= r["reward_mean"] <= 1.0
  sample = (workdir / "samples" / "step_000002.txt").read_text()
  assert "question:" in sample and "gold:" in sample
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3"]
