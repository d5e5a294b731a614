"""Tokenizers: a sentencepiece model trained on the bundled corpus, and the common interface.

In the bundled model the Search-R1 tags (:data:`gigrl.data.tags.TAGS`) are single pieces
(sentencepiece ``user_defined_symbols``). Nothing depends on that: the rollout stops on a tag's
token sequences, whatever their length (``gigrl.rollout.turns.stop_sequences``), so HF
tokenizers, in which ``</search>`` is several tokens, are used as they ship.

The model file ships in the package (``gigrl/data/files/spm_searchr1.model``); rebuild it with
``python -m gigrl.data.tokenizer --out gigrl/data/files/spm_searchr1.model``.
HF tokenizers (Qwen's ``tokenizer.json``) implement the same interface in
``gigrl.data.hf_tokenizer``.
"""
from __future__ import annotations

import argparse
import io
import os
from typing import Iterator, Protocol, Sequence

import sentencepiece as spm

from gigrl.data import tags
from gigrl.data import qa

TAGS = tags.TAGS
BUNDLED_MODEL = "spm_searchr1.model"
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer(Protocol):
  """What the rollout and trainer need from a tokenizer.

  ``decode`` drops special tokens (pad, EOS, chat markers). A tokenizer may also have
  ``eos_ids`` (every id that ends a generation; default ``[eos_id]``).
  """
  vocab_size: int
  pad_id: int
  eos_id: int

  def encode(self, text: str) -> list[int]: ...
  def decode(self, ids: Sequence[int]) -> str: ...
  def apply_chat_template(self, user_message: str) -> str: ...


class SentencePieceTokenizer:
  """sentencepiece tokenizer with the Search-R1 tags as single pieces.

  Normalisation is the identity and ``add_dummy_prefix`` is off, so ``decode(encode(s)) == s``
  for any string (byte fallback covers unseen characters). The rollout encodes each segment
  (prompt, generated turn, observation) on its own and the SFT demonstrations are built the same
  way, so both see the same token boundaries.
  """

  def __init__(self, model_path: str | None = None):
    path = model_path or os.path.join(qa.bundled_dir(), BUNDLED_MODEL)
    if not os.path.exists(path):
      raise FileNotFoundError(
          f"sentencepiece model {path} not found; build it with "
          "`python -m gigrl.data.tokenizer --out PATH`")
    self.path = path
    self.sp = spm.SentencePieceProcessor(model_file=path)
    self.vocab_size = int(self.sp.get_piece_size())
    self.pad_id, self.eos_id, self.bos_id = PAD_ID, EOS_ID, BOS_ID
    for tag in TAGS:
      if len(self.encode(tag)) != 1:
        raise ValueError(f"{path}: tag {tag!r} is not a single piece")

  def encode(self, text: str) -> list[int]:
    """text -> token ids (no BOS/EOS)."""
    return list(self.sp.encode(text))

  def decode(self, ids: Sequence[int]) -> str:
    """token ids -> text; pad/BOS/EOS ids are dropped."""
    return self.sp.decode([int(i) for i in ids if int(i) > EOS_ID])

  def token_id(self, piece: str) -> int:
    """Id of a single piece such as ``'</search>'``; KeyError if it is not one piece."""
    ids = self.encode(piece)
    if len(ids) != 1:
      raise KeyError(f"{piece!r} is not a single piece: {ids}")
    return ids[0]

  def apply_chat_template(self, user_message: str) -> str:
    """No chat template: Search-R1 uses the raw prompt when the tokenizer has none."""
    return user_message


def _training_sentences() -> Iterator[str]:
  for doc in qa.load_bundled_corpus():
    yield doc.contents.replace("\n", " ")
  for q in qa.load_bundled_questions():
    yield q.question
    yield " ".join(q.golden_answers)


def train(out_path: str, vocab_size: int = 8192) -> str:
  """Trains the BPE model on the bundled corpus and questions; returns ``out_path``.

  Byte fallback makes every string encodable (lossless round trips).
  """
  # Prompt template text is added so its words are single pieces.
  sentences = list(_training_sentences()) + [tags.INSTRUCTION, tags.INVALID_ACTION_MSG] * 20
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
      model_type="bpe", character_coverage=0.9995, byte_fallback=True,
      pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
      user_defined_symbols=list(TAGS), add_dummy_prefix=False,
      split_digits=True, num_threads=1, minloglevel=2, max_sentence_length=16384,
      normalization_rule_name="identity", remove_extra_whitespaces=False,
      allow_whitespace_only_pieces=True)
  with open(out_path, "wb") as f:
    f.write(model.getvalue())
  return out_path


def load(name_or_path: str) -> Tokenizer:
  """``'bundled'`` -> the shipped sentencepiece model; a ``.model`` file -> sentencepiece;
  a directory or ``tokenizer.json`` -> HF tokenizers (Qwen/Llama).

  Raises:
    FileNotFoundError: the path does not exist.
  """
  if name_or_path in ("", "bundled"):
    return SentencePieceTokenizer()
  if name_or_path.endswith(".model"):
    return SentencePieceTokenizer(name_or_path)
  from gigrl.data import hf_tokenizer  # pylint: disable=g-import-not-at-top
  return hf_tokenizer.HFTokenizer(name_or_path)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(qa.bundled_dir(), BUNDLED_MODEL))
  parser.add_argument("--vocab_size", type=int, default=8192)
  args = parser.parse_args(argv)
  print(train(args.out, args.vocab_size))


if __name__ == "__main__":
  main()
