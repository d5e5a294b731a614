"""The synthetic copying sequences of ``train.copy_steps`` (gigrl/data/copy_task.py)."""
import numpy as np
import pytest

from gigrl.data import copy_task
from gigrl.data import tokenizer as tok_lib


def test_copy_batch_masks_exactly_the_predictable_second_copy():
  ids = np.arange(10, 60, dtype=np.int32)
  tokens, mask = copy_task.copy_batch(ids, 32, 48, seed=3, step=7)
  assert tokens.shape == mask.shape == (32, 48)
  for row, m in zip(tokens, mask):
    n = int((row > 0).sum())
    k = int(m.sum()) + 1                       # the first token of the copy is not a target
    assert 3 <= k <= 12
    second = row[n - k:n]
    seq = row[:n]
    # the copied span occurs earlier in the row, and the mask covers its tail only
    hits = [i for i in range(n - 2 * k + 1) if np.array_equal(seq[i:i + k], second)]
    assert hits, "the second copy has no earlier occurrence"
    assert np.all(m[n - k + 1:n] == 1) and m[:n - k + 1].sum() == 0 and m[n:].sum() == 0
    assert np.isin(seq, ids).all()


def test_copy_batch_is_a_pure_function_of_seed_and_step():
  ids = np.arange(10, 60, dtype=np.int32)
  a = copy_task.copy_batch(ids, 8, 48, seed=0, step=1)
  b = copy_task.copy_batch(ids, 8, 48, seed=0, step=1)
  c = copy_task.copy_batch(ids, 8, 48, seed=0, step=2)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not np.array_equal(a[0], c[0])


def test_copy_batch_refuses_a_width_that_cannot_hold_it():
  with pytest.raises(ValueError, match="width 30"):
    copy_task.copy_batch(np.arange(10, 20), 2, 30, seed=0, step=0)


def test_ordinary_ids_exclude_tags_bytes_and_controls():
  tok = tok_lib.load("")                       # the bundled sentencepiece model
  ids = copy_task.ordinary_ids(tok)
  pieces = {tok.sp.id_to_piece(int(i)) for i in ids}
  assert "<search>" not in pieces and "</answer>" not in pieces
  assert not any(p.startswith("<0x") for p in pieces)
  assert int(tok.eos_id) not in set(ids.tolist()) and len(ids) > 1000
