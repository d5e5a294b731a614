"""HF `tokenizer.json` tokenizers (Qwen2.5, Llama 3) behind gigrl's Tokenizer interface.

Uses the `tokenizers` library only (no transformers), with the vocabulary as shipped: no
tokens are added for the Search-R1 tags, which a byte-level BPE splits into several tokens
(`</search>` -> `</`, `search`, `>`); the rollout stops on those sequences
(`gigrl.rollout.turns.stop_sequences`) and parses the tags in the decoded text. The chat
template is applied
the way Search-R1 does it (`tokenizer.apply_chat_template([{"role": "user",
"content": prompt}], add_generation_prompt=True, tokenize=False)`):

* if `tokenizer_config.json` carries a Jinja `chat_template` (or, as transformers >= 5 saves
  it, a `chat_template.jinja` file lies beside it), that template is rendered with jinja2 with
  those arguments (exact HF behaviour);
* otherwise the Qwen2.5 format is used, with its default system message:
  `<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful
  assistant.<|im_end|>\\n<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n`.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Sequence

import numpy as np
from tokenizers import Tokenizer as _HFTok

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def qwen_chat(prompt: str, system: str = QWEN_SYSTEM) -> str:
  """Qwen2.5 chat format for one user turn plus the assistant generation prompt."""
  return (f"<|im_start|>system\n{system}<|im_end|>\n"
          f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")


def _token_str(tok: Any) -> str | None:
  if isinstance(tok, dict):
    return tok.get("content")
  return tok


def _read_text(path: str) -> str | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return f.read()


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
  """The Jinja ``chat_template``, compiled once per process: compiling it took ~3.4 ms, once per
  prompt (SmolLM2's start tokenized its ~4,800 prompts twice: 33 s of a 45 s start on 2 cores),
  rendering the compiled one takes ~0.1 ms."""
  import jinja2  # pylint: disable=g-import-not-at-top  (a core dependency)
  env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                           extensions=["jinja2.ext.loopcontrols"])
  env.globals["raise_exception"] = _raise
  return env.from_string(template)


class HFTokenizer:
  """Tokenizer from a HF checkpoint dir (or a tokenizer.json path).

  Attributes:
    vocab_size: ids the tokenizer can produce (added tokens included). The model's
      embedding may be larger (Qwen2.5: 151,936 rows for 151,665 ids).
    pad_id, eos_id: from tokenizer_config.json (Qwen fallback: <|endoftext|>,
      <|im_end|>).
    eos_ids: every id that ends a generation (eos + generation_config eos ids).
  """

  def __init__(self, name_or_path: str):
    path = name_or_path
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path} not found (expected a tokenizer.json or a "
                              "directory containing one)")
    root = os.path.dirname(path)
    self.path = path
    self.tok = _HFTok.from_file(path)
    self.config = _read_json(os.path.join(root, "tokenizer_config.json"))
    gen = _read_json(os.path.join(root, "generation_config.json"))
    self.vocab_size = int(self.tok.get_vocab_size(with_added_tokens=True))
    eos = _token_str(self.config.get("eos_token")) or self._first_present(
        ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>"])
    pad = _token_str(self.config.get("pad_token")) or self._first_present(
        ["<|endoftext|>", "<|finetune_right_pad_id|>", "<pad>"]) or eos
    self.eos_id = self._require_id(eos, "eos_token")
    self.pad_id = self._require_id(pad, "pad_token")
    bos = _token_str(self.config.get("bos_token"))
    self.bos_token = bos or ""
    extra = gen.get("eos_token_id", [])
    extra = extra if isinstance(extra, list) else [extra]
    self.eos_ids = sorted({self.eos_id, *[int(i) for i in extra if i is not None]})
    self.chat_template = self.config.get("chat_template") or _read_text(
        os.path.join(root, "chat_template.jinja"))   # where transformers >= 5 saves it

  def _first_present(self, tokens: Sequence[str]) -> str | None:
    for t in tokens:
      if self.tok.token_to_id(t) is not None:
        return t
    return None

  def _require_id(self, token: str | None, field: str) -> int:
    i = None if token is None else self.tok.token_to_id(token)
    if i is None:
      raise ValueError(f"{self.path}: {field} {token!r} is not a token of the vocab")
    return int(i)

  # ---- Tokenizer interface ------------------------------------------------

  def encode(self, text: str) -> list[int]:
    """text -> ids, no BOS/EOS added (special-token strings map to their ids)."""
    return list(self.tok.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Sequence[int]) -> str:
    """ids -> text, special tokens (pad, eos, chat markers) dropped."""
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def token_id(self, piece: str) -> int:
    """Id of a single token such as '<|im_end|>'; KeyError if it is not one token."""
    i = self.tok.token_to_id(piece)
    if i is None:
      ids = self.encode(piece)
      if len(ids) != 1:
        raise KeyError(f"{piece!r} is not a single token: {ids}")
      i = ids[0]
    return int(i)

  def apply_chat_template(self, user_message: str) -> str:
    """One user message + generation prompt, as Search-R1 builds its prompts."""
    if self.chat_template:
      return _compiled_template(self.chat_template).render(
          messages=[{"role": "user", "content": user_message}],
          add_generation_prompt=True, bos_token=self.bos_token,
          eos_token=self.tok.id_to_token(self.eos_id))
    return qwen_chat(user_message)

  def pad(self, seqs: Sequence[Sequence[int]], length: int | None = None, *,
          left: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Pads id lists -> (i32[B, L] padded with pad_id, i32[B] lengths).

    Sequences longer than `length` raise ValueError (no silent truncation).
    """
    lens = np.asarray([len(s) for s in seqs], np.int32)
    width = int(length if length is not None else (lens.max() if len(lens) else 0))
    if len(lens) and lens.max() > width:
      raise ValueError(f"sequence of {lens.max()} tokens exceeds pad length {width}")
    out = np.full((len(seqs), width), self.pad_id, np.int32)
    for i, s in enumerate(seqs):
      if len(s):
        if left:
          out[i, width - len(s):] = s
        else:
          out[i, :len(s)] = s
    return out, lens


def _raise(msg):
  raise ValueError(msg)
