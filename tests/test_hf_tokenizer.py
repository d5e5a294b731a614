"""HFTokenizer on a tiny byte-level BPE tokenizer.json built on the fly."""
import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gigrl.data.hf_tokenizer import HFTokenizer, qwen_chat

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("tok")
  t = Tokenizer(models.BPE())
  t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  t.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  t.train_from_iterator(["who wrote the iliad? <search> homer </search>"] * 20, trainer)
  t.save(str(d / "tokenizer.json"))
  return d


def test_encode_decode_and_special_ids(tok_dir):
  tok = HFTokenizer(str(tok_dir))
  text = "who wrote hamlet?\n<answer> shakespeare </answer>"
  assert tok.decode(tok.encode(text)) == text
  assert tok.eos_id == tok.token_id("<|im_end|>")       # Qwen fallback defaults
  assert tok.pad_id == tok.token_id("<|endoftext|>")
  assert tok.vocab_size >= 259
  ids = tok.encode(qwen_chat("q?"))
  assert ids.count(tok.token_id("<|im_start|>")) == 3
  # Special tokens are dropped when decoding generated ids.
  assert tok.decode(tok.encode("yes") + [tok.eos_id, tok.pad_id]) == "yes"


def test_chat_template_default_is_qwen25(tok_dir):
  tok = HFTokenizer(str(tok_dir / "tokenizer.json"))
  assert tok.apply_chat_template("Q") == (
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
      "assistant.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n")


def test_jinja_template_and_config_tokens(tok_dir, tmp_path):
  import shutil
  d = tmp_path / "cfg"
  shutil.copytree(tok_dir, d)
  template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
              "<|im_start|>assistant\n{% endif %}")
  (d / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": template, "eos_token": "<|endoftext|>",
       "pad_token": {"content": "<|endoftext|>"}}))
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  tok = HFTokenizer(str(d))
  assert tok.apply_chat_template("Q") == (
      "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n")
  assert tok.eos_id == tok.pad_id == tok.token_id("<|endoftext|>")
  assert tok.eos_ids == [0, 2]


def test_a_jinja_template_is_compiled_once(tok_dir, tmp_path, monkeypatch):
  """Every prompt renders the template compiled once per process (compiling it per prompt took
  ~3.4 ms each: 33 s of SmolLM2's 45 s start on 2 cores, which tokenized its ~4,800 prompts
  twice; 6 s with it compiled once), and a second tokenizer of the same template reuses it."""
  import shutil
  import jinja2
  d = tmp_path / "cfg"
  shutil.copytree(tok_dir, d)
  template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}<!-- once -->"
  (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  compiled = []
  real = jinja2.Environment.from_string
  monkeypatch.setattr(jinja2.Environment, "from_string",
                      lambda self, *a, **k: compiled.append(1) or real(self, *a, **k))
  first, second = HFTokenizer(str(d)), HFTokenizer(str(d))
  assert [first.apply_chat_template(q) for q in ("A", "B")] == ["[A]<!-- once -->",
                                                                 "[B]<!-- once -->"]
  assert second.apply_chat_template("C") == "[C]<!-- once -->"
  assert len(compiled) == 1


def test_pad(tok_dir):
  tok = HFTokenizer(str(tok_dir))
  ids, lens = tok.pad([[5, 6, 7], [8]], 4)
  np.testing.assert_array_equal(ids, [[5, 6, 7, tok.pad_id], [8] + [tok.pad_id] * 3])
  np.testing.assert_array_equal(lens, [3, 1])
  ids, _ = tok.pad([[5, 6, 7], [8]], left=True)
  np.testing.assert_array_equal(ids, [[5, 6, 7], [tok.pad_id, tok.pad_id, 8]])
  with pytest.raises(ValueError, match="exceeds"):
    tok.pad([[1, 2, 3]], 2)
  with pytest.raises(FileNotFoundError):
    HFTokenizer(str(tok_dir / "nope"))


def test_testing_qwen2_style_bpe(tmp_path):
  """gigrl.testing.write_bpe_tokenizer: Qwen2 split + ByteLevel, ChatML template, tags of
  several tokens, lossless round trips of the protocol texts."""
  from gigrl import testing
  from gigrl.data import tags
  from gigrl.rollout import protocol
  tok = HFTokenizer(testing.write_bpe_tokenizer(str(tmp_path / "bpe"), vocab_size=512))
  assert tok.vocab_size == 512
  assert [tok.tok.id_to_token(i) for i in tok.encode("</search>")] == ["</", "search", ">"]
  assert all(len(tok.encode(t)) > 1 for t in tags.TAGS)
  assert tok.apply_chat_template("Q") == (
      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nQ"
      "<|im_end|>\n<|im_start|>assistant\n")
  assert tok.eos_id == tok.token_id("<|im_end|>") and tok.pad_id == tok.token_id("<|endoftext|>")
  assert tok.eos_ids == sorted([tok.eos_id, tok.pad_id])
  for text in (protocol.make_prompt("Who wrote Hamlet"), tags.INVALID_ACTION_MSG,
               protocol.format_observation('Doc 1(Title: "Zürich") Ünïcödé — 東京\n')):
    assert tok.decode(tok.encode(text)) == text
