"""Synthetic copying sequences: a cheap stand-in for the pretraining a real policy starts from.

A search agent copies: the entity of the question into its query, the answer from the retrieved
passage into ``<answer>``. A pretrained LM (Qwen, Llama) arrives with induction and copying
heads (Olsson et al. 2022, "In-context learning and induction heads"); a tiny policy trained
from scratch on a few hundred task demonstrations does not, and memorises the training
entities instead (held-out EM 0). ``train.copy_steps`` spends the first SFT steps on these
sequences so the tiny CPU policies start RL with a copying mechanism, as a pretrained one would.

A sequence is ``r1 x r2 x`` with random tokens: ``x`` (length ``U[min_len, max_len]``) repeated
after a random gap; the loss covers the second ``x`` but its first token (which nothing
predicts). The tokens are uniform over the tokenizer's ordinary pieces, so no fact of any data
set is in them. Deterministic in (seed, step).
"""
from __future__ import annotations

import numpy as np


def ordinary_ids(tokenizer) -> np.ndarray:
  """i32[V'] ids of the tokenizer's ordinary pieces: not control, unknown, byte-fallback or
  user-defined (the Search-R1 tags). Needs a sentencepiece tokenizer (``tokenizer.sp``);
  other tokenizers use every id above the special ones (``tokenizer.eos_id``)."""
  sp = getattr(tokenizer, "sp", None)
  if sp is None:
    return np.arange(int(tokenizer.eos_id) + 1, int(tokenizer.vocab_size), dtype=np.int32)
  keep = [i for i in range(sp.get_piece_size())
          if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))
          and not (sp.id_to_piece(i).startswith("<") and sp.id_to_piece(i).endswith(">"))]
  return np.asarray(keep, np.int32)


def copy_batch(ids: np.ndarray, batch_size: int, width: int, seed: int, step: int, *,
               min_len: int = 3, max_len: int = 12, max_gap: int = 8
               ) -> tuple[np.ndarray, np.ndarray]:
  """One batch of copying sequences, left-aligned and padded with 0.

  Args:
    ids: i32[V'] the token ids to draw from (:func:`ordinary_ids`).
    batch_size: B rows; width: W tokens per row (>= 2·max_len + 2·max_gap).
    seed, step: the batch is a pure function of them.
  Returns:
    (tokens i32[B, W], loss_mask f32[B, W]): the mask is 1 on the second copy's tokens after
    its first.
  Raises:
    ValueError: ``width`` cannot hold the longest sequence.
  """
  if width < 2 * (max_len + max_gap):
    raise ValueError(f"copy_batch: width {width} < 2·(max_len + max_gap) = "
                     f"{2 * (max_len + max_gap)}")
  rng = np.random.default_rng([int(seed), int(step), 0xC0B1])
  tokens = np.zeros((batch_size, width), np.int32)
  mask = np.zeros((batch_size, width), np.float32)
  for b in range(batch_size):
    k = int(rng.integers(min_len, max_len + 1))
    a, g = (int(x) for x in rng.integers(0, max_gap + 1, size=2))
    x = rng.choice(ids, size=k)
    seq = np.concatenate([rng.choice(ids, size=a), x, rng.choice(ids, size=g), x])
    tokens[b, :len(seq)] = seq
    mask[b, len(seq) - k + 1:len(seq)] = 1.0
  return tokens, mask
