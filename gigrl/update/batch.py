"""The RL update's token batch: which rollout rows are trained, and their tokens, loss mask and
per-token advantages; the SFT step's demonstration rows.

Pure functions of numpy arrays (no devices, no globals), tested on small hand-written cases
(tests/test_rl_batch.py). In one RL step::

  rows, valid = train_rows(candidates, accepted, P, G)           i32[P, G], bool[P]
  (advantages: gigrl.advantages.inputs.advantage_inputs -> the estimator -> f32[P, G, T])
  tokens, mask, tok_adv = train_batch(batch, rows, valid, adv)   [P·G, W] each
  k = lm_positions(mask, cap)                                     LM-head positions per row
  packed = pack_rows(tokens, mask, tok_adv, lengths, groups)      [P·G, W'], fewer rows used

C = candidate groups rolled out (k·P with query recycling), P = trained groups
(``data.prompts_per_step``), G = rollouts per group, T = max steps (``rollout.max_turns + 1``),
W = tokens per trained row (the narrowest width of :func:`width_grid` holding the valid groups'
rows: the filler rows of invalid groups are cut to it), K = LM-head positions per row (the
generation budget, at most W - 1). Rollout row ``c * G + j`` is rollout j of candidate c.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from gigrl.data import copy_task
from gigrl.rollout import trajectory as traj_lib


def train_rows(candidates: Sequence[int], accepted: Sequence[int], num_prompts: int,
               group_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Rollout rows of the P trained groups: accepted candidates first, then unused ones.

  The trained batch always has P groups (a fixed shape for the jitted update); slots beyond the
  accepted groups are filled with other candidates' rows (or candidate 0's when there are fewer
  than P candidates) and marked invalid, so their loss mask is zeroed.

  Args:
    candidates: pool ids of the C rolled-out candidate groups, in rollout order.
    accepted: pool ids the query pool accepted for training (a subset of ``candidates``); at
      most the first P are used.
    num_prompts: P.
    group_size: G.
  Returns:
    (rows i32[P, G] indices into the rollout batch, valid bool[P]).
  Raises:
    ValueError: an accepted id is not among the candidates.
  """
  p, g = num_prompts, group_size
  pos = {int(c): i for i, c in enumerate(candidates)}
  try:
    acc = [pos[int(a)] for a in accepted][:p]
  except KeyError as e:
    raise ValueError(f"accepted query {e.args[0]} is not a candidate of this step") from None
  taken = set(acc)
  rest = [i for i in range(len(candidates)) if i not in taken]
  order = (acc + rest + [0] * p)[:p]
  valid = np.arange(p) < len(acc)
  rows = np.asarray(order, np.int32)[:, None] * g + np.arange(g, dtype=np.int32)[None, :]
  return rows, valid


def token_advantages(advantages: np.ndarray, step_ids: np.ndarray) -> np.ndarray:
  """Per-token advantages: token s of row b gets ``advantages[b, step_ids[b, s]]``.

  Args:
    advantages: f32[B, T] per-step advantages of each row (``[P, G, T]`` reshaped, B = P·G).
    step_ids: i32[B, S] turn index of each generated token, -1 on prompt, observations and
      padding.
  Returns:
    f32[B, S]; 0 where ``step_ids`` is -1.
  """
  adv = np.asarray(advantages, np.float32)
  step_ids = np.asarray(step_ids)
  out = np.take_along_axis(adv, np.maximum(step_ids, 0), axis=1)
  return np.where(step_ids >= 0, out, 0.0).astype(np.float32)


def bucket(width: int, seq_len: int, multiple: int = 64) -> int:
  """Pads a sequence width up to a multiple of ``multiple``, at most ``seq_len``
  (fewer distinct shapes, so fewer recompiles of the train step)."""
  return min(int(seq_len), -(-int(width) // multiple) * multiple)


# The update's and SFT step's widths: a bounded grid (issue #50), so every train-step program is
# known before step 1 and compiled then (gigrl.training.warmup).
WIDTH_BUCKETS = 4


def width_grid(seq_len: int, buckets: int = WIDTH_BUCKETS, multiple: int = 64) -> list[int]:
  """The widths a train step can have: ``seq_len · k / buckets`` for k = 1..buckets, each
  rounded up to ``multiple`` and at most ``seq_len`` (e.g. 192, 384, 512, 656 for 656)."""
  return sorted({bucket(-(-int(seq_len) * k // buckets), seq_len, multiple)
                 for k in range(1, buckets + 1)})


def grid_width(width: int, seq_len: int, buckets: int = WIDTH_BUCKETS) -> int:
  """The narrowest width of :func:`width_grid` that holds ``width`` tokens."""
  return next(w for w in width_grid(seq_len, buckets) if w >= min(int(width), int(seq_len)))


def train_batch(batch: traj_lib.TrajectoryBatch, rows: np.ndarray, valid_groups: np.ndarray,
                advantages: np.ndarray, *, trained_width: bool = True
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The RL update's token batch for the trained rows, cut to a bucketed width.

  Args:
    batch: the rollout batch.
    rows, valid_groups: from :func:`train_rows` (i32[P, G], bool[P]).
    advantages: f32[P, G, T] from the advantage estimator.
    trained_width: W from the rows of valid groups only (``train.trim_update_padding``): the
      filler rows of invalid groups (loss mask 0) are cut to it; with no valid group W is one
      bucket. False: W covers every selected row, filler rows included.
  Returns:
    (tokens i32[B, W], loss_mask f32[B, W] (zero on invalid groups), token advantages
    f32[B, W]) with B = P·G and W = :func:`grid_width` of the longest trained row.
  """
  sel = rows.reshape(-1)
  g = rows.shape[1]
  row_valid = np.repeat(np.asarray(valid_groups, np.float32), g)
  measured = sel[row_valid > 0] if trained_width else sel
  width = grid_width(int(batch.lengths[measured].max(initial=1)), batch.tokens.shape[1])
  adv = np.asarray(advantages, np.float32).reshape(len(sel), -1)
  tok_adv = token_advantages(adv, batch.step_ids[sel, :width])
  mask = batch.loss_mask[sel, :width] * row_valid[:, None]
  return batch.tokens[sel, :width], mask.astype(np.float32), tok_adv


@dataclasses.dataclass(frozen=True)
class PackedRows:
  """Trained rows packed several to a row (:func:`pack_rows`).

  Attributes:
    tokens: i32[B, W']; loss_mask, token_advantages: f32[B, W']: the packed rows first, then
      empty rows (mask 0) up to the batch's B rows, so a program keeps its row count.
    positions: i32[B, W']: each token's position in its own trajectory (RoPE).
    segment_ids: i32[B, W']: one id per trajectory and per shared prompt in its packed row
      (1, 2, ...), 0 on padding.
    prefix_ids: i32[B, W']: on a trajectory's tokens, the segment id of the group prompt it
      continues (-1: none). A token attends to earlier tokens of its own segment and of its
      prefix segment (:func:`gigrl.models.attention.packed_mask`).
    rows: packed rows holding tokens (the rest are empty).
    trajectories: trajectories packed (the rows with loss tokens).
    behaviour: f32[B, W'], the sampler's log-probs packed like the advantages, when
      :func:`pack_rows` was given them; else None.
  """
  tokens: np.ndarray
  loss_mask: np.ndarray
  token_advantages: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  prefix_ids: np.ndarray
  rows: int
  trajectories: int
  behaviour: np.ndarray | None = None

  @property
  def width(self) -> int:
    return self.tokens.shape[1]


def _shared_prompt(tokens: np.ndarray, loss_mask: np.ndarray, rows: Sequence[int]) -> int:
  """Tokens the ``rows`` share before any of them has a loss token, less one: the last prompt
  token stays in each trajectory, whose first generated token it predicts."""
  first = min(int(np.argmax(loss_mask[i] > 0)) for i in rows)
  ref = tokens[rows[0], :first]
  n = first
  for i in rows[1:]:
    diff = np.flatnonzero(tokens[i, :first] != ref)
    n = min(n, int(diff[0]) if len(diff) else first)
  return max(0, n - 1)


def pack_rows(tokens: np.ndarray, loss_mask: np.ndarray, token_advantages: np.ndarray,
              lengths: np.ndarray, groups: np.ndarray | None = None, *,
              max_width: int | None = None, multiple: int = 64,
              behaviour: np.ndarray | None = None) -> PackedRows:
  """Packs the rows that carry loss tokens into as few rows as fit, a group's prompt once.

  Units: the rows of one group (same ``groups`` id) share their prompt, which is written once,
  followed by each row's continuation (its last prompt token, then its generations and
  observations); a row alone is a unit by itself. Units are packed first-fit decreasing into
  rows of width W' = the longest unit, rounded up to ``multiple`` (a unit is never split). A
  group whose unit would be wider than ``max_width`` is packed row by row instead. With
  ``segment_ids``, ``prefix_ids`` and ``positions``, the training forward
  (:func:`gigrl.update.step.masked_logprobs`) computes for each trajectory what it computes
  for that trajectory alone in its own row: attention to its own earlier tokens and its
  prompt's, RoPE positions from 0. Losses summed over tokens (``token-mean``,
  ``seq-mean-token-sum-norm``) are then unchanged (:func:`gigrl.update.step.rl_update` packs
  only for those). Packing with segment ids is what MaxText and Tunix do for SFT; the shared
  prompt is the training-side counterpart of prefix caching (vLLM, SGLang's RadixAttention).

  Args:
    tokens: i32[B, W]; loss_mask, token_advantages: f32[B, W] (:func:`train_batch`).
    lengths: i32[B]: each row's tokens (prompt, generations, observations).
    groups: i32[B]: the group of each row (rows of a group have the same prompt); None = no
      prompt is shared.
    max_width: the widest packed row allowed (default W).
    behaviour: optional f32[B, W], the sampler's log-probs aligned with ``tokens``, packed in the
      same layout as ``token_advantages`` (the off-policy correction's input).
  Returns:
    :class:`PackedRows`, [B, W'] each.
  """
  b, w = tokens.shape
  lengths = np.minimum(np.asarray(lengths, np.int64), w)
  max_width = w if max_width is None else int(max_width)
  trained = [i for i in range(b) if loss_mask[i, 1:].sum() > 0]
  units: list[tuple[int, list[int]]] = []        # (shared prompt tokens, rows)
  by_group: dict[int, list[int]] = {}
  for i in trained:
    by_group.setdefault(int(groups[i]) if groups is not None else -1 - i, []).append(i)
  for rows in by_group.values():
    shared = _shared_prompt(tokens, loss_mask, rows) if len(rows) > 1 else 0
    size = shared + sum(int(lengths[i]) - shared for i in rows)
    if shared and size <= max_width:
      units.append((shared, rows))
    else:
      units += [(0, [i]) for i in rows]
  size = lambda u: u[0] + sum(int(lengths[i]) - u[0] for i in u[1])
  width = max(1, bucket(max((size(u) for u in units), default=1), max(max_width, w), multiple))
  bins: list[list[tuple[int, list[int]]]] = []
  room: list[int] = []
  for u in sorted(units, key=lambda u: (-size(u), u[1][0])):
    j = next((k for k, left in enumerate(room) if left >= size(u)), None)
    if j is None:
      bins.append([u])
      room.append(width - size(u))
    else:
      bins[j].append(u)
      room[j] -= size(u)
  shape = (b, width)
  out_tok, out_mask = np.zeros(shape, tokens.dtype), np.zeros(shape, loss_mask.dtype)
  out_adv = np.zeros(shape, token_advantages.dtype)
  out_behav = None if behaviour is None else np.zeros(shape, behaviour.dtype)
  pos, seg, pre = np.zeros(shape, np.int32), np.zeros(shape, np.int32), np.full(shape, -1,
                                                                                 np.int32)
  for r, units_r in enumerate(bins):
    at, sid = 0, 0
    for shared, rows in units_r:
      prefix = -1
      if shared:
        sid += 1
        prefix = sid
        out_tok[r, at:at + shared] = tokens[rows[0], :shared]
        pos[r, at:at + shared] = np.arange(shared)
        seg[r, at:at + shared] = sid
        at += shared
      for i in rows:
        n = int(lengths[i]) - shared
        sid += 1
        out_tok[r, at:at + n] = tokens[i, shared:shared + n]
        out_mask[r, at:at + n] = loss_mask[i, shared:shared + n]
        out_adv[r, at:at + n] = token_advantages[i, shared:shared + n]
        if out_behav is not None:
          out_behav[r, at:at + n] = behaviour[i, shared:shared + n]
        pos[r, at:at + n] = np.arange(shared, shared + n)
        seg[r, at:at + n] = sid
        pre[r, at:at + n] = prefix
        at += n
  return PackedRows(out_tok, out_mask, out_adv, pos, seg, pre, len(bins), len(trained),
                    out_behav)


def lm_positions(loss_mask: np.ndarray, cap: int) -> int:
  """K, the LM-head positions per row of an update: ``cap`` (the generation budget), at most
  the row's W - 1 targets, so K is a function of W alone and the update has one program per
  width of :func:`width_grid` (issue #50). Packed rows take W' - 1
  (:func:`gigrl.update.step.packed_lm_positions`).

  Args:
    loss_mask: f32[B, W] of the update's rows (aligned with the tokens; targets are [:, 1:]).
    cap: the static bound (``build.max_generated_tokens``).
  Returns:
    K >= 1.
  """
  return max(1, min(int(cap), loss_mask.shape[1] - 1))


def sft_indices(num_demos: int, batch_size: int, seed: int, step: int) -> np.ndarray:
  """Demonstration rows of SFT step ``step`` (1-based): a seeded permutation per epoch.

  Args:
    num_demos: N demonstrations; batch_size: rows per step.
  Returns:
    i64[batch_size] indices; epoch e uses ``default_rng([seed, e]).permutation(N)``, cut into
    ``max(1, N // batch_size)`` batches (a last partial batch wraps around the permutation).
  """
  per_epoch = max(1, num_demos // batch_size)
  epoch, i = divmod(step - 1, per_epoch)
  perm = np.random.default_rng([seed, epoch]).permutation(num_demos)
  idx = perm[i * batch_size:(i + 1) * batch_size]
  if len(idx) < batch_size:
    idx = np.resize(perm, batch_size)
  return idx




def sft_batch(demos: traj_lib.TrajectoryBatch, train: Any, seed: int, step: int,
              copy_ids: Callable[[], np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """SFT step ``step``'s rows: synthetic copying sequences for the first ``train.copy_steps``
  steps (:mod:`gigrl.data.copy_task`), then demonstration rows (:func:`sft_indices`) cut to a
  bucketed width.

  Args:
    demos: the collated demonstrations; train: the config's ``train`` section;
    copy_ids: returns the tokenizer's ordinary ids (called only on copying steps).
  Returns:
    (tokens i32[B, W], loss_mask f32[B, W], lengths i32[B]).
  """
  if step <= train.copy_steps:
    tok, msk = copy_task.copy_batch(copy_ids(), train.copy_batch_size, train.copy_width, seed,
                                    step)
    return tok, msk, (tok > 0).sum(axis=1)
  idx = sft_indices(demos.tokens.shape[0], train.sft_batch_size, seed, step)
  width = grid_width(int(demos.lengths[idx].max()), demos.tokens.shape[1])
  return demos.tokens[idx, :width], demos.loss_mask[idx, :width], demos.lengths[idx]


def sft_widths(demos_lengths: np.ndarray, seq_len: int, train: Any, seed: int, first: int,
               last: int) -> list[int]:
  """The widths of SFT steps ``first``..``last`` (:func:`sft_batch`), computed from the seeded
  batch order alone: the SFT step's programs, known before step 1."""
  out = set()
  for step in range(max(first, int(train.copy_steps) + 1), last + 1):
    idx = sft_indices(len(demos_lengths), train.sft_batch_size, seed, step)
    out.add(grid_width(int(demos_lengths[idx].max()), seq_len))
  return sorted(out)
