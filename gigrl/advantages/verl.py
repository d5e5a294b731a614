"""GiGPO on verl-agent's flat step rows, through gigrl's kernels.

A drop-in for verl-agent@2716b30b ``gigpo/core_gigpo.py::
compute_gigpo_outcome_advantage``: a verl / verl-agent trainer swaps it in
with one import and keeps its call::

  from gigrl.advantages.verl import compute_gigpo_outcome_advantage

verl-agent's layout is one row per active step (an LLM turn): ``index`` is the
prompt-group uid of the row, ``traj_index`` its trajectory uid, rows of a
trajectory appear in time order. The rows are mapped onto gigrl's padded
``[P, G, T]`` layout with vectorised numpy (run-length + hash factorisation of
the uids, stable ranks for the positions; no per-row Python loop), the
jitted kernels of :mod:`gigrl.advantages.gigpo` compute the advantages, and
the per-row scores are gathered back and spread over the response tokens.
The grid's P, G and T are rounded up to :func:`bucket` sizes, so steps whose
row counts vary reuse a few compiled kernels (a compile takes ~2 s on CPU;
padded shapes can move a score by an ulp of its reductions, ~5e-7).

Semantics (verl-agent ``episode_norm_reward``, ``build_step_group``,
``step_norm_reward``; GiGPO Eqs. 3, 6-8):

* episode score of a row = ``token_level_rewards.sum(-1)``; mean/std over all
  rows of the prompt (cross-step statistics); a prompt with one row keeps its
  raw score (mean 0, std 1);
* step groups: rows of a prompt with equal anchor observation (exact), or
  greedy similarity clusters over the prompt's rows in batch order; a
  singleton group gives 0;
* ``mode``: ``mean_norm`` subtracts the mean, ``mean_std_norm`` also divides
  by ``std + epsilon`` (unbiased std), at both levels;
* joint: ``A = A_E + step_advantage_w * A_S``, times ``response_mask``.

``step_rewards`` are the rows' discounted step returns (verl-agent computes
them with ``compute_step_discounted_returns`` and subtracts the invalid-action
penalty). Pass ``step_rewards=None`` with ``gamma`` and ``env_rewards`` (and
optionally ``is_action_valid`` and ``invalid_action_penalty_coef``) to have
them computed here (Eq. 5).
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gigrl.advantages import anchors as anchors_lib
from gigrl.advantages import gigpo as gigpo_lib

MODES = gigpo_lib.MODES


class RowLayout(NamedTuple):
  """Where each flat row sits in the padded layout.

  Attributes:
    prompt: int64[N] prompt number (order of first appearance).
    traj: int64[N] trajectory number within the prompt (0 when trajectories
      are not needed: then each prompt's rows form one sequence).
    step: int64[N] position within the trajectory (batch order).
    shape: (P, G, T).
    flat: int64[N] ``(prompt * G + traj) * T + step``.
    dense: True iff ``flat == arange(N)`` (rows already are the padded grid,
      so scatter and gather are reshapes).
  """
  prompt: np.ndarray
  traj: np.ndarray
  step: np.ndarray
  shape: tuple[int, int, int]
  flat: np.ndarray
  dense: bool


class FlatAdvantages(NamedTuple):
  """Result of :func:`gigpo_row_advantages`.

  Attributes:
    token_advantages: f32[N, L] ``row_scores[:, None] * response_mask``
      (a torch tensor when the rewards came as one).
    row_scores: f32[N] joint advantage ``A_E + w * A_S`` of each row.
    episode_advantages: f32[N] ``A_E`` of each row.
    step_advantages: f32[N] ``A_S`` of each row.
    step_group_ids: int32[N] anchor group of each row, dense per prompt.
  """
  token_advantages: Any
  row_scores: np.ndarray
  episode_advantages: np.ndarray
  step_advantages: np.ndarray
  step_group_ids: np.ndarray


# ------------------------------------------------------------ row mapping
def factorize(values: Any) -> tuple[np.ndarray, int, np.ndarray]:
  """Dense codes of a length-N key array, in order of first appearance.

  Equal neighbours are collapsed first (verl-agent rows of one uid are
  usually adjacent), then the run values are hashed with a dict (uuid
  strings: about 10x faster than ``np.unique``'s sort).

  Args:
    values: length-N sequence of hashable keys (np.ndarray of str/object/
      int, list, ...).

  Returns:
    (codes int64[N], number of distinct keys, run starts int64[R]) where runs
    are maximal blocks of equal neighbours.
  """
  arr = values if isinstance(values, np.ndarray) else np.asarray(
      values, dtype=object)
  n = len(arr)
  if n == 0:
    return np.zeros(0, np.int64), 0, np.zeros(0, np.int64)
  change = np.flatnonzero(arr[1:] != arr[:-1]) + 1
  starts = np.concatenate([[0], change]).astype(np.int64)
  keys = arr[starts].tolist()
  table = dict(zip(dict.fromkeys(keys), range(n)))
  run_codes = np.fromiter(map(table.__getitem__, keys), np.int64, len(keys))
  lengths = np.diff(np.append(starts, n))
  return np.repeat(run_codes, lengths), len(table), starts


def first_rows(codes: np.ndarray, n_codes: int, *,
               first_appearance: bool = False) -> np.ndarray:
  """int64[n_codes] index of the first element with each code.

  Args:
    codes: int64[N] codes in ``[0, n_codes)``, each present at least once.
    n_codes: number of codes.
    first_appearance: the codes are numbered in order of first appearance
      (as :func:`factorize` returns them): then no scatter-min is needed.
  """
  n = len(codes)
  if not first_appearance:
    first = np.full(n_codes, n, np.int64)
    np.minimum.at(first, codes, np.arange(n, dtype=np.int64))
    return first
  new = np.ones(n, bool)
  new[1:] = codes[1:] > np.maximum.accumulate(codes)[:-1]
  first = np.empty(n_codes, np.int64)
  first[codes[new]] = np.flatnonzero(new)
  return first


def _ranks(codes: np.ndarray, n_codes: int, starts: np.ndarray | None = None
           ) -> np.ndarray:
  """Position of each element among the elements with the same code."""
  n = len(codes)
  if starts is not None and len(starts) == n_codes:   # each code is one run
    lengths = np.diff(np.append(starts, n))
    return np.arange(n, dtype=np.int64) - np.repeat(starts, lengths)
  order = np.argsort(codes, kind="stable")
  first = np.searchsorted(codes[order], np.arange(n_codes))
  ranks = np.empty(n, np.int64)
  ranks[order] = np.arange(n, dtype=np.int64) - first[codes[order]]
  return ranks


def bucket(x: int) -> int:
  """``x`` rounded up to a ladder of 4 sizes per octave (at most 25% padding: 8, 10, 12, 14,
  16, 20, 24, 28, 32, 40, ...), so batches with varying row counts reuse a few jit shapes."""
  x = int(x)
  q = 1 << max(0, x.bit_length() - 3)
  return -(-x // q) * q


def row_layout(index: Any, traj_index: Any | None = None, *,
               bucketed: bool = False) -> RowLayout:
  """Maps verl-agent's flat step rows onto the padded ``[P, G, T]`` layout.

  Prompts and trajectories are numbered in order of first appearance; a
  trajectory's steps are its rows in batch order. Vectorised: run-length and
  dict factorisation of the uids, stable ranks for the positions.

  Args:
    index: length-N prompt-group uid of each row (strings, ints, ...).
    traj_index: length-N trajectory uid of each row, or None: then G = 1 and
      each prompt's rows, in batch order, form one sequence (enough for
      GiGPO when the step returns are given: its statistics are per prompt).
    bucketed: pad P, G and T up to :func:`bucket` sizes (empty cells are not rows), so the
      jitted kernel compiles once per bucket, not once per batch shape (~2 s each on CPU).

  Returns:
    RowLayout.

  Raises:
    ValueError: lengths differ, or a trajectory's rows carry two prompt uids.
  """
  prompt, n_prompts, p_starts = factorize(index)
  n = len(prompt)
  if traj_index is None:
    step = _ranks(prompt, n_prompts, p_starts)
    traj = np.zeros(n, np.int64)
  else:
    if len(traj_index) != n:
      raise ValueError(f"traj_index has {len(traj_index)} rows, index {n}")
    tcode, n_traj, t_starts = factorize(traj_index)
    owner = prompt[first_rows(tcode, n_traj, first_appearance=True)]
    if not np.array_equal(owner[tcode], prompt):
      bad = int(np.flatnonzero(owner[tcode] != prompt)[0])
      raise ValueError(f"row {bad}: trajectory {traj_index[bad]!r} appears "
                       "under two prompt uids")
    step = _ranks(tcode, n_traj, t_starts)
    traj = _ranks(owner, n_prompts)[tcode]       # owner is first-appearance
  shape = (n_prompts, int(traj.max(initial=-1)) + 1,
           int(step.max(initial=-1)) + 1)
  if bucketed:
    shape = tuple(bucket(x) for x in shape)
  flat = (prompt * shape[1] + traj) * shape[2] + step
  dense = n == shape[0] * shape[1] * shape[2] and bool(
      (np.diff(flat) == 1).all())
  return RowLayout(prompt, traj, step, shape, flat, dense)


def _to_grid(layout: RowLayout, values: np.ndarray, fill=0) -> np.ndarray:
  """[..., N] row values -> [..., P, G, T] (``fill`` where no row is)."""
  lead = values.shape[:-1]
  if layout.dense:
    return values.reshape(lead + layout.shape)
  grid = np.full(lead + (int(np.prod(layout.shape)),), fill, values.dtype)
  grid[..., layout.flat] = values
  return grid.reshape(lead + layout.shape)


def _from_grid(layout: RowLayout, grid: np.ndarray) -> np.ndarray:
  flat = np.asarray(grid).reshape(-1)
  return flat if layout.dense else flat[layout.flat]


# ------------------------------------------------------------ anchors
def _first_rows(anchor_obs: Any) -> np.ndarray:
  """int64[N]: the first row with an equal observation (verl-agent keys).

  One hashing pass in C: ``dict.setdefault(key, row)`` returns the row that
  first inserted the key (two passes, a dict build then lookups, cost ~40%
  more on fresh strings, whose hashes are not cached yet).
  """
  keys = anchor_obs.tolist() if isinstance(anchor_obs, np.ndarray) else list(
      anchor_obs)
  n = len(keys)
  try:
    return np.fromiter(map({}.setdefault, keys, range(n)), np.int64, n)
  except TypeError:                # arrays / lists: verl-agent to_hashable
    keys = [anchors_lib.to_hashable(k) for k in keys]
    return np.fromiter(map({}.setdefault, keys, range(n)), np.int64, n)


def _int_ids(anchor_obs: Any) -> np.ndarray | None:
  """int64[N] when the observations are integer ids, else None."""
  if hasattr(anchor_obs, "detach") or isinstance(anchor_obs, np.ndarray):
    arr = _numpy(anchor_obs)
    return arr.astype(np.int64) if arr.ndim == 1 and arr.dtype.kind in "iu" \
        else None
  if len(anchor_obs) and all(isinstance(x, (int, np.integer)) and
                             not isinstance(x, bool) for x in anchor_obs):
    return np.asarray(anchor_obs, np.int64)
  return None


def step_group_ids(anchor_obs: Any, layout: RowLayout, *,
                   enable_similarity: bool = False,
                   similarity_thresh: float = 0.95) -> np.ndarray:
  """Anchor group of each row, dense within its prompt (verl-agent
  ``build_step_group``).

  Args:
    anchor_obs: length-N anchor observations: strings (or any hashable /
      array observation, grouped by equality like verl-agent
      ``to_hashable``), or an integer array of precomputed observation ids.
    layout: from :func:`row_layout`.
    enable_similarity: greedy similarity clusters (strings only) over each
      prompt's rows in batch order instead of exact equality.
    similarity_thresh: ``SequenceMatcher.ratio()`` threshold, in (0, 1).

  Returns:
    int32[N] ids in ``[0, G * T)``, equal within a prompt iff same group
    (dense cluster numbers with similarity; otherwise the padded in-prompt
    position of one row of the group).

  Raises:
    ValueError: wrong length, or threshold not in (0, 1).
    TypeError: similarity grouping of a non-string observation.
  """
  n = len(layout.prompt)
  if len(anchor_obs) != n:
    raise ValueError(f"anchor_obs has {len(anchor_obs)} rows, index {n}")
  p_n = layout.shape[0]
  if enable_similarity:
    obs = anchor_obs.tolist() if isinstance(anchor_obs, np.ndarray) else list(
        anchor_obs)
    order = np.argsort(layout.prompt, kind="stable")
    bounds = np.searchsorted(layout.prompt[order], np.arange(p_n + 1))
    ids = np.empty(n, np.int32)
    for p in range(p_n):
      rows = order[bounds[p]:bounds[p + 1]]
      ids[rows] = anchors_lib.similarity_clusters([obs[i] for i in rows],
                                                  similarity_thresh)
    return ids
  arr = _int_ids(anchor_obs)
  # A row's id is the in-prompt position of a representative row with the
  # same observation in the same prompt: its first row overall, unless that
  # lies in another prompt (an observation recurring across prompts); only
  # those rows are then sorted, to their prompt's first row.
  if arr is None:
    rep = _first_rows(anchor_obs)
  else:
    uniq, codes = np.unique(arr, return_inverse=True)
    codes = codes.reshape(-1)
    rep = first_rows(codes, len(uniq))[codes]
  shared = np.flatnonzero(layout.prompt[rep] != layout.prompt)
  if shared.size:
    key = rep[shared] * p_n + layout.prompt[shared]
    _, where, inv = np.unique(key, return_index=True, return_inverse=True)
    rep[shared] = shared[where[inv.reshape(-1)]]
  local = layout.flat - layout.prompt * (layout.shape[1] * layout.shape[2])
  return local[rep].astype(np.int32)


# ------------------------------------------------------------ kernel
@functools.partial(jax.jit, static_argnames=("eps", "omega", "norm",
                                             "gamma"))
def _grid_kernel(values, valid, ids, penalty, *, eps, omega, norm, gamma):
  """f32[3, P, G, T]: joint, episode and step advantages (see gigpo.py).

  ``values`` f32[2, P, G, T] stacks the episode scores and the step values
  (one transfer instead of two); ``valid`` None = every grid cell is a row;
  ``penalty`` None unless ``gamma`` is set.
  """
  scores, step_values = values[0], values[1]
  if valid is None:
    valid = jnp.ones(scores.shape, bool)
  returns = step_values
  if gamma is not None:        # step_values are env rewards: Eq. 5
    returns = gigpo_lib.discounted_returns(step_values, valid, gamma) - penalty
  a_e = gigpo_lib.episode_advantages(scores, valid, eps=eps, norm_by_std=norm,
                                     episode_stats="cross_steps")
  a_s = gigpo_lib.step_advantages(returns, valid, ids, eps=eps,
                                  norm_by_std=norm)
  return jnp.stack([jnp.where(valid, a_e + omega * a_s, 0.0), a_e, a_s])


def _numpy(x: Any, dtype=None) -> np.ndarray:
  if hasattr(x, "detach"):                             # torch.Tensor
    x = x.detach().cpu()
    if x.is_floating_point() and x.element_size() < 4:   # bf16 / f16
      x = x.float()
    x = x.numpy()
  return np.asarray(x, dtype)


def gigpo_row_advantages(token_level_rewards: Any, step_rewards: Any,
                         response_mask: Any, anchor_obs: Any, index: Any,
                         traj_index: Any, epsilon: float = 1e-6,
                         step_advantage_w: float = 1.0,
                         mode: str = "mean_norm",
                         enable_similarity: bool = False,
                         similarity_thresh: float = 0.95, *,
                         gamma: float | None = None,
                         env_rewards: Any = None,
                         is_action_valid: Any = None,
                         invalid_action_penalty_coef: float = 0.0
                         ) -> FlatAdvantages:
  """GiGPO advantages of verl-agent's flat step rows.

  Reference: verl-agent ``compute_gigpo_outcome_advantage`` (same arguments
  and defaults); golden ``tests/golden/gigpo_*``. From ``PIPELINE_MIN_ROWS``
  rows whose prompts occupy contiguous rows (verl-agent's order), the host
  passes run in blocks of prompts on two worker threads (same results).

  Args:
    token_level_rewards: f32[N, L] (numpy or torch); the row's episode score
      is its sum (verl-agent puts the episode reward minus the invalid-action
      penalty at the last valid token).
    step_rewards: f32[N] discounted step return of each row (penalty
      included), or None to compute it from ``env_rewards`` and ``gamma``.
    response_mask: [N, L] 0/1 mask of the response tokens.
    anchor_obs: length-N anchor observations (strings, hashable objects or
      integer ids; see :func:`step_group_ids`).
    index: length-N prompt-group uid of each row (verl ``uid``).
    traj_index: length-N trajectory uid (verl-agent ``traj_uid``); rows of a
      trajectory in time order. Only used when ``step_rewards`` is None.
    epsilon: added to both stds.
    step_advantage_w: weight of the step advantage.
    mode: ``"mean_norm"`` or ``"mean_std_norm"`` (both levels).
    enable_similarity: similarity instead of exact anchor grouping.
    similarity_thresh: similarity threshold in (0, 1).
    gamma: discount of the step returns (only with ``step_rewards=None``).
    env_rewards: f32[N] environment reward of each row (``step_rewards=
      None``).
    is_action_valid: [N] 0/1 or bool; an invalid action subtracts
      ``invalid_action_penalty_coef`` from the step return
      (``step_rewards=None``; the episode score already contains it).
    invalid_action_penalty_coef: see ``is_action_valid``.

  Returns:
    FlatAdvantages (token advantages f32[N, L] as a torch tensor on the
    rewards' device when ``token_level_rewards`` is one, numpy otherwise).

  Raises:
    ValueError: unknown mode, inconsistent lengths, missing ``gamma`` /
      ``env_rewards``, a trajectory under two prompt uids.
  """
  if mode not in MODES:
    raise ValueError(f"Unknown mode: {mode!r} (expected one of {MODES})")
  tlr = _numpy(token_level_rewards)
  mask = _numpy(response_mask)
  if tlr.ndim != 2 or mask.shape != tlr.shape:
    raise ValueError(f"token_level_rewards {tlr.shape} and response_mask "
                     f"{mask.shape} must both be [N, L]")
  n = tlr.shape[0]
  if len(index) != n:
    raise ValueError(f"index has {len(index)} rows, token_level_rewards {n}")
  if step_rewards is None:
    if gamma is None or env_rewards is None:
      raise ValueError("step_rewards=None needs gamma and env_rewards")
    layout = row_layout(index, traj_index, bucketed=True)
    values = _numpy(env_rewards, np.float32).reshape(-1)
    penalty = np.zeros(n, np.float32)
    if is_action_valid is not None:
      penalty = invalid_action_penalty_coef * (
          1.0 - _numpy(is_action_valid, np.float32).reshape(-1))
  else:
    layout = row_layout(index, bucketed=True)
    values = _numpy(step_rewards, np.float32).reshape(-1)
    penalty = None
    gamma = None
  if len(values) != n:
    raise ValueError(f"step rewards have {len(values)} rows, expected {n}")
  kernel = functools.partial(
      _grid_kernel, eps=float(epsilon), omega=float(step_advantage_w),
      norm=mode == "mean_std_norm", gamma=None if gamma is None else float(gamma))
  chunks = None if enable_similarity else _prompt_chunks(layout)
  if chunks is not None:
    tokens, row, a_e, a_s, ids = _pipelined(tlr, mask, values, penalty, anchor_obs, layout,
                                            chunks, kernel)
  else:
    tokens, row, a_e, a_s, ids = _serial(tlr, mask, values, penalty, anchor_obs, layout,
                                         kernel, enable_similarity, similarity_thresh)
  if hasattr(token_level_rewards, "detach"):
    import torch                                  # pylint: disable=g-import-not-at-top
    tokens = torch.from_numpy(tokens).to(token_level_rewards.device)
  return FlatAdvantages(tokens, row, a_e, a_s, ids)


def _grid_advantages(layout: RowLayout, scores: np.ndarray, values: np.ndarray,
                     penalty: np.ndarray | None, ids: np.ndarray, kernel
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """f32[N] joint, episode and step advantages of the rows, through one kernel call."""
  valid = None if layout.dense else _to_grid(layout, np.ones(len(ids), bool), fill=False)
  grid = lambda x: _to_grid(layout, x)
  out = np.asarray(kernel(grid(np.stack([scores, values])), valid, grid(ids),
                          None if penalty is None else grid(penalty)))
  return tuple(_from_grid(layout, x) for x in out)


def _write_tokens(mask: np.ndarray, row: np.ndarray, out: np.ndarray) -> None:
  """``out[i, l] = row[i] * mask[i, l]`` (f32)."""
  if mask.dtype == np.float32:   # einsum's loop: ~25% faster, same products
    np.einsum("ij,i->ij", mask, row, out=out)
  else:
    np.multiply(row[:, None], mask, out=out, dtype=np.float32)


def _serial(tlr, mask, values, penalty, anchor_obs, layout, kernel, enable_similarity,
            similarity_thresh):
  """One pass: anchors, token sums, one kernel call, the token write."""
  ids = step_group_ids(anchor_obs, layout,
                       enable_similarity=enable_similarity,
                       similarity_thresh=similarity_thresh)
  scores = np.einsum("ij->i", tlr.astype(np.float32, copy=False))
  row, a_e, a_s = _grid_advantages(layout, scores, values, penalty, ids, kernel)
  tokens = np.empty(mask.shape, np.float32)
  _write_tokens(mask, row, tokens)
  return tokens, row, a_e, a_s, ids


# Below this many rows the serial pass is faster than handing work to threads.
PIPELINE_MIN_ROWS = 1 << 17
PIPELINE_CHUNKS = 4


def _prompt_chunks(layout: RowLayout) -> list[tuple[int, int, int, int]] | None:
  """``PIPELINE_CHUNKS`` (row start, row end, prompt start, prompt end) blocks of whole prompts,
  or None when the serial pass is used: few rows, one core, or a prompt's rows not contiguous
  (then a block of rows is not a block of prompts)."""
  n = len(layout.prompt)
  if n < PIPELINE_MIN_ROWS or (os.cpu_count() or 1) < 2:
    return None
  starts = np.flatnonzero(np.diff(layout.prompt)) + 1
  if len(starts) != int(layout.prompt[-1]) or layout.prompt[0] != 0:
    return None                      # some prompt's rows come in more than one run
  starts = np.concatenate([[0], starts, [n]])
  n_prompts = int(layout.prompt[-1]) + 1
  cuts = [round(i * n_prompts / PIPELINE_CHUNKS) for i in range(PIPELINE_CHUNKS + 1)]
  return [(int(starts[a]), int(starts[b]), a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _chunk_layout(layout: RowLayout, r0: int, r1: int, q0: int, q1: int) -> RowLayout:
  """Rows ``[r0, r1)`` (prompts ``[q0, q1)``) as a layout of their own, P bucketed."""
  _, g, t = layout.shape
  shape = (bucket(q1 - q0), g, t)
  prompt = layout.prompt[r0:r1] - q0
  flat = layout.flat[r0:r1] - q0 * g * t
  dense = r1 - r0 == shape[0] * g * t and bool((np.diff(flat) == 1).all())
  return RowLayout(prompt, layout.traj[r0:r1], layout.step[r0:r1], shape, flat, dense)


def _pipelined(tlr, mask, values, penalty, anchor_obs, layout, chunks, kernel):
  """The serial pass's results, with the host work overlapped on two cores.

  GiGPO's statistics are per prompt, so blocks of whole prompts are independent. The main thread
  hashes one block's anchor observations (Python, holds the GIL) and runs its kernel while two
  worker threads sum the token rewards and write the previous blocks' token advantages (numpy,
  releases the GIL; the write of the [N, L] output, page faults included, is the largest pass).
  Each block's kernel sees the same per-prompt rows as the whole batch's (only P is padded
  differently), and the token write is elementwise.
  """
  n = len(layout.prompt)
  tokens = np.empty(mask.shape, np.float32)
  row, a_e, a_s = (np.empty(n, np.float32) for _ in range(3))
  ids = np.empty(n, np.int32)
  scores = np.empty(n, np.float32)
  tlr32 = tlr.astype(np.float32, copy=False)

  def token_sum(r0, r1):
    np.einsum("ij->i", tlr32[r0:r1], out=scores[r0:r1])

  def write(r0, r1):
    _write_tokens(mask[r0:r1], row[r0:r1], tokens[r0:r1])

  obs = anchor_obs if isinstance(anchor_obs, np.ndarray) or hasattr(anchor_obs, "detach") \
      else list(anchor_obs)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    sums = [pool.submit(token_sum, r0, r1) for r0, r1, _, _ in chunks]
    writes = []
    for (r0, r1, q0, q1), summed in zip(chunks, sums):
      sub = _chunk_layout(layout, r0, r1, q0, q1)
      ids[r0:r1] = step_group_ids(obs[r0:r1], sub)
      summed.result()
      row[r0:r1], a_e[r0:r1], a_s[r0:r1] = _grid_advantages(
          sub, scores[r0:r1], values[r0:r1], None if penalty is None else penalty[r0:r1],
          ids[r0:r1], kernel)
      mid = (r0 + r1) // 2                    # two halves: both workers write the last block
      writes += [pool.submit(write, r0, mid), pool.submit(write, mid, r1)]
    for w in writes:
      w.result()
  return tokens, row, a_e, a_s, ids


def compute_gigpo_outcome_advantage(token_level_rewards: Any,
                                    step_rewards: Any, response_mask: Any,
                                    anchor_obs: Any, index: Any,
                                    traj_index: Any, epsilon: float = 1e-6,
                                    step_advantage_w: float = 1.0,
                                    mode: str = "mean_norm",
                                    enable_similarity: bool = False,
                                    similarity_thresh: float = 0.95,
                                    **kwargs) -> tuple[Any, Any]:
  """verl-agent's ``compute_gigpo_outcome_advantage``, computed by gigrl.

  Same arguments, defaults and return as verl-agent (``(advantages,
  returns)``, both the same f32[N, L] tensor); extra keyword arguments as in
  :func:`gigpo_row_advantages`, which also returns the [N] row scores.

  Raises:
    ValueError: see :func:`gigpo_row_advantages`.
  """
  out = gigpo_row_advantages(
      token_level_rewards, step_rewards, response_mask, anchor_obs, index,
      traj_index, epsilon, step_advantage_w, mode, enable_similarity,
      similarity_thresh, **kwargs)
  return out.token_advantages, out.token_advantages
